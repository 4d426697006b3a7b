#!/usr/bin/env bash
# The head fine-tuned with its draft vocabulary made again from the conversations (ft4) against the shipped head.
set -uo pipefail
cd /work/main
PY=/work/main/.venv/bin/python
R=benchmarks/results/prompt_kinds_vocab
mkdir -p $R
$PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/chat.jsonl --n 8 \
  --heads vocab=/work/runs/ft4/heads --methods eagle,vocab,suffix+vocab --ks 1,2,4 --trees "" \
  --max-new-tokens 64 --repeats 3 --out $R/chat > $R/chat.log 2>&1 || echo FAILED chat
for kind in code prose math; do
  $PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/$kind.jsonl --n 8 \
    --heads vocab=/work/runs/ft4/heads --methods eagle,vocab --ks 1,2,4 --trees "" \
    --max-new-tokens 64 --repeats 3 --out $R/$kind > $R/$kind.log 2>&1 || echo FAILED $kind
done
echo done
