#!/usr/bin/env bash
# Mixed precision on the held-out prompts of the other kinds (code, prose, math; chat is run.sh's): SmolLM2-135M-Instruct
# with its shipped EAGLE-3 head, 8 prompts per kind, batch 1, greedy, 64 tokens, medians of 3 interleaved repeats,
# the mixed target alone and the float32 target alone in each run.
set -uo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
R=benchmarks/results/mixed
for kind in code prose math; do
  $PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/$kind.jsonl --n 8 \
    --methods eagle,ngram --ks 2,4 --trees "dynamic:2,4,8" --max-new-tokens 64 --repeats 3 --dtype mixed \
    --reference-dtype float32 --out $R/$kind > $R/$kind.log 2>&1 || echo FAILED $kind
done
echo done
