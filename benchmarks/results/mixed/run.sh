#!/usr/bin/env bash
# Mixed precision (specjax.load(..., dtype="mixed")) on SmolLM2-135M-Instruct with its shipped EAGLE-3 head, the
# 8 held-out chat prompts, batch 1, 64 tokens, medians of 3 interleaved repeats; the mixed target alone and the
# float32 target alone in each run. Then v(T)/v(1) of a pass over T tokens, float32 and mixed, with the
# bit-for-bit check against T one-token steps.
set -uo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
R=benchmarks/results/mixed
$PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/chat.jsonl --n 8 \
  --methods eagle,suffix+eagle,ngram --ks 1,2,4 --trees "dynamic:2,4,8;dynamic:4,4,16" --max-new-tokens 64 \
  --repeats 3 --dtype mixed --reference-dtype float32 --out $R/chat > $R/chat.log 2>&1 || echo FAILED chat
$PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/chat.jsonl --n 8 \
  --methods eagle,suffix+eagle --ks 1,2,4 --trees "dynamic:2,4,8" --temperature 0.7 --max-new-tokens 64 \
  --repeats 3 --dtype mixed --reference-dtype float32 --out $R/chat-t0.7 > $R/chat-t0.7.log 2>&1 || echo FAILED t0.7
for dtype in float32 mixed; do
  $PY benchmarks/window_pass_cost.py --dtype $dtype --windows 2,3,5,9,17 > $R/window_pass_cost_$dtype.txt 2>&1 \
    || echo FAILED window $dtype
done
echo done
