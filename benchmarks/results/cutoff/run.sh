#!/usr/bin/env bash
# The shipped SmolLM2 EAGLE-3 head with a confidence cutoff (ChainHeads.cutoff) against its static chains on the
# held-out chat prompts, greedy and T = 0.7, the target alone in each run; batch 1, 8 prompts x 64 tokens.
set -uo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
R=benchmarks/results/cutoff
$PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/chat.jsonl --n 8 \
  --methods eagle --ks 1,2,3,4 --cutoffs 0.15,0.3 --trees "" --max-new-tokens 64 --repeats 3 \
  --out $R/chat > $R/chat.log 2>&1 || echo FAILED chat
$PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/chat.jsonl --n 8 \
  --methods eagle,ngram,suffix+eagle --ks 1,2,3 --cutoffs 0.15,0.3 --trees "" --temperature 0.7 --max-new-tokens 64 \
  --repeats 3 --out $R/chat-t0.7 > $R/chat-t0.7.log 2>&1 || echo FAILED t0.7
# Off chat: code and prose prompts (4 each), greedy; the head is surer there.
for kind in code prose; do
  $PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/$kind.jsonl --n 4 \
    --methods eagle --ks 1,2,4 --cutoffs 0.3 --trees "" --max-new-tokens 64 --repeats 3 \
    --out $R/$kind > $R/$kind.log 2>&1 || echo FAILED $kind
done
echo done
