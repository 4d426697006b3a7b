#!/usr/bin/env bash
# The head at the target's width (576) trained from scratch on the 3,712 conversations (w576) against the shipped
# 256-wide head: chains and a tree on held-out chat, greedy and t = 0.7, the target alone in each run.
set -uo pipefail
cd /work/main
PY=/work/main/.venv/bin/python
R=benchmarks/results/prompt_kinds_w576
mkdir -p $R
$PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/chat.jsonl --n 8 \
  --heads w576=/work/runs/w576/heads --methods eagle,w576 --ks 1,2,4 --trees "dynamic:2,4,8" \
  --max-new-tokens 64 --repeats 3 --out $R/chat > $R/chat.log 2>&1 || echo FAILED chat
$PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/chat.jsonl --n 8 \
  --heads w576=/work/runs/w576/heads --methods eagle,w576 --ks 1,2 --trees "dynamic:2,4,8" \
  --temperature 0.7 --max-new-tokens 64 --repeats 3 --out $R/chat-t0.7 > $R/chat-t0.7.log 2>&1 || echo FAILED t07
echo done
