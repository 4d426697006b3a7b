"""Two revisions of specjax timed side by side, interleaved in one run: did a change make a method slower?

    python benchmarks/compare_revisions.py --old 8e1b26c [--new HEAD] [--repeats 7] [--batches 1,8]
        [--methods none,draft,ngram,eagle] [--model stdlib-coder] [--dtype float32] [--prompt-tokens N] [--out DIR]

Each revision's package (``specjax/`` with ``models/`` and ``train/`` placed as the install places them) is
copied out of git into a temporary folder. Then, for every repeat, a fresh worker process per revision (the
order alternating) loads the bundled pair (or ``--model``: any name or path ``specjax.load`` takes, such as
``smollm2-135m-instruct`` once its GGUF file is installed; in ``--dtype``), compiles, and times ``generate`` for the target
alone, the draft model, the n-gram lookup and the shipped EAGLE-3 head at k = 4 (``--methods`` also takes
``eagle-cutoff``, the head with a confidence cutoff of 0.3, ``suffix``, suffix decoding over each row's own
context: both verify windows of several lengths, and ``eagle-tree``, the head's dynamic tree of 8 nodes), at each
batch size (64 new tokens, greedy, fixed code prompts), each the median of 3 calls after a warm-up. The report
gives each revision's median tokens/s over the repeats and the ratio new / old per (method, batch), and checks that both revisions
produce the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

PROMPTS = ("import os\nimport sys\n\n\ndef main(argv):\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "from collections import defaultdict\n\n\ndef group_by(items, key):\n",
           "import unittest\n\n\nclass TestParser(unittest.TestCase):\n\n    def test_empty(self):\n",
           "def read_config(path):\n    with open(path) as f:\n",
           "class Node:\n    def __init__(self, value, next=None):\n",
           "try:\n    import json\nexcept ImportError:\n")

METHODS = ("none", "draft", "ngram", "eagle", "eagle-cutoff", "suffix", "eagle-tree")  # eagle-cutoff and suffix
# verify in windows of several lengths (engine.verify_bucketed) and need a revision that has them (cb2e16e or
# later); eagle-tree, the head's dynamic tree of 8 nodes, one with specjax.tree.parse_tree

WORKER = r'''
import json, statistics, sys, time
import jax, specjax
PROMPTS = json.loads(sys.argv[1])
BATCHES, METHODS = json.loads(sys.argv[2]), json.loads(sys.argv[3])
pair = specjax.load(sys.argv[4], **({} if sys.argv[6] == 'float32' else {'dtype': sys.argv[6]}))
target, tok, draft = pair.model, pair.tokenizer, pair.draft
old_api = hasattr(specjax.SpecConfig(), "method")
def kwargs(method):
  if old_api:
    return {"none": dict(spec=specjax.SpecConfig("none", 0)), "draft": dict(draft=draft, spec=specjax.SpecConfig("draft", 4)),
            "ngram": dict(spec=specjax.SpecConfig("ngram", 4))}[method]
  from specjax.proposers import DraftModel, NGram, for_heads
  if method == "eagle":
    return dict(proposer=for_heads(pair.heads["eagle"]), spec=specjax.SpecConfig(k=4))
  if method == "eagle-cutoff":
    return dict(proposer=for_heads(pair.heads["eagle"], cutoff=0.3), spec=specjax.SpecConfig(k=4))
  if method == "eagle-tree":
    from specjax.tree import parse_tree
    return dict(proposer=for_heads(pair.heads["eagle"]), spec=specjax.SpecConfig(tree=parse_tree("dynamic:2,4,8")))
  if method == "suffix":
    from specjax.proposers import Suffix
    return dict(proposer=Suffix(), spec=specjax.SpecConfig(k=4))
  return {"none": dict(spec=specjax.SpecConfig(k=0)), "draft": dict(proposer=DraftModel(draft), spec=specjax.SpecConfig(k=4)),
          "ngram": dict(proposer=NGram(), spec=specjax.SpecConfig(k=4))}[method]
out = {}
LONG = int(sys.argv[5])
for batch in BATCHES:
  rows = [tok.encode(p) for p in (PROMPTS * batch)[:batch]]
  if LONG:  # each row: the prompts from its own onwards, joined, cut at LONG tokens
    joined = [tok.encode("\n".join((PROMPTS * (LONG // 8 + 2))[i:])) for i in range(batch)]
    rows = [ids[:LONG] for ids in joined]
  for method in METHODS:
    call = lambda: specjax.generate(target, rows, max_new_tokens=64, **kwargs(method))
    first = call()
    times = []
    for _ in range(3):
      start = time.perf_counter()
      res = call()
      times.append(time.perf_counter() - start)
    if LONG:  # decoding only: the same call for one token (the prefill and the first token) subtracted
      prefill = lambda: specjax.generate(target, rows, max_new_tokens=1, **kwargs(method))
      prefill()
      ones = []
      for _ in range(3):
        start = time.perf_counter()
        prefill()
        ones.append(time.perf_counter() - start)
      rate = batch * 63 / (statistics.median(times) - statistics.median(ones))
    else:
      rate = batch * 64 / statistics.median(times)
    out[f"{method} b={batch}"] = {"tokens_per_s": rate, "tokens": first.tokens.tolist()}
print("RESULT " + json.dumps(out))
'''


def export(rev: str, root: str) -> str:
  """The package of ``rev`` as the install lays it out, in ``root/<rev>/specjax``; returns ``root/<rev>``."""
  dest = os.path.join(root, rev.replace("/", "_"))
  tmp = os.path.join(root, "tree_" + rev.replace("/", "_"))
  os.makedirs(tmp)
  archive = subprocess.run(["git", "archive", rev, "specjax", "models", "train"], capture_output=True, check=True)
  subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
  shutil.copytree(os.path.join(tmp, "specjax"), os.path.join(dest, "specjax"))
  shutil.copytree(os.path.join(tmp, "models"), os.path.join(dest, "specjax", "models"))
  shutil.copytree(os.path.join(tmp, "train"), os.path.join(dest, "specjax", "train"))
  return dest


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--old", required=True)
  parser.add_argument("--new", default="HEAD")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default: 1,8)")
  parser.add_argument("--methods", default="none,draft,ngram,eagle",
                      help=f"comma-separated subset of {','.join(METHODS)} (default: none,draft,ngram,eagle)")
  parser.add_argument("--model", default="stdlib-coder",
                      help="what each worker loads (a name or path specjax.load takes; default: the bundled pair)")
  parser.add_argument("--dtype", default="float32",
                      help="the dtype each worker loads the model in (specjax.load's: float32, mixed, ...; both "
                           "revisions must know it)")
  parser.add_argument("--prompt-tokens", type=int, default=0,
                      help="make every prompt this many tokens long (the prompts joined, from the row's own on), "
                           "to time long contexts; the rate is then of decoding only: the median call for one "
                           "new token (the prefill) subtracted (default 0: the prompts as they are, whole calls)")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
  args = parser.parse_args(argv)
  unknown = sorted(set(args.methods.split(",")) - set(METHODS))
  if unknown:
    parser.error(f"--methods: {unknown} are not among {', '.join(METHODS)}")
  revs = {}
  for label, rev in (("old", args.old), ("new", args.new)):
    revs[label] = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True,
                                 check=True).stdout.strip()
  results = {label: [] for label in revs}
  with tempfile.TemporaryDirectory() as root:
    paths = {label: export(rev, root) for label, rev in revs.items()}
    for r in range(args.repeats):
      order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
      for label in order:
        env = dict(os.environ, PYTHONPATH=paths[label])
        batches = [int(b) for b in args.batches.split(",")]
        proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(PROMPTS), json.dumps(batches),
                               json.dumps(args.methods.split(",")), args.model, str(args.prompt_tokens), args.dtype],
                              env=env, capture_output=True, text=True, cwd=root)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
          print(proc.stderr[-3000:], file=sys.stderr)
          return 1
        results[label].append(json.loads(line[7:]))
        print(f"repeat {r + 1}/{args.repeats} {label}: " + ", ".join(
            f"{k} {v['tokens_per_s']:.0f}" for k, v in results[label][-1].items()), file=sys.stderr, flush=True)
  cases = list(results["old"][0])
  table = {}
  for case in cases:
    old = statistics.median(run[case]["tokens_per_s"] for run in results["old"])
    new = statistics.median(run[case]["tokens_per_s"] for run in results["new"])
    same = results["old"][0][case]["tokens"] == results["new"][0][case]["tokens"]
    table[case] = {"old_tokens_per_s": old, "new_tokens_per_s": new, "new_over_old": new / old, "same_tokens": same}
  report = {"old": revs["old"], "new": revs["new"], "model": args.model, "dtype": args.dtype, "repeats": args.repeats,
            "prompt_tokens": args.prompt_tokens,
            "load_average": list(os.getloadavg()), "cases": table}
  os.makedirs(args.out, exist_ok=True)
  tag = "" if args.model == "stdlib-coder" else "_" + os.path.basename(args.model).split(".")[0]
  tag += f"_p{args.prompt_tokens}" if args.prompt_tokens else ""
  tag += "" if args.dtype == "float32" else "_" + args.dtype
  stem = os.path.join(args.out, f"compare_{revs['old']}_{revs['new']}{tag}")
  with open(stem + ".json", "w") as f:
    json.dump(report, f, indent=1)
  lines = [f"{args.model}{'' if args.dtype == 'float32' else ' (' + args.dtype + ')'}: old {revs['old']}, new {revs['new']}"
           + (f", prompts of {args.prompt_tokens} tokens" if args.prompt_tokens else "")
           + f": medians of {args.repeats} interleaved worker runs "
           f"(each the median of 3 calls), load average at the end {report['load_average']}", "",
           "| case | old tok/s | new tok/s | new / old | same tokens |", "|---|---|---|---|---|"]
  lines += [f"| {c} | {v['old_tokens_per_s']:.0f} | {v['new_tokens_per_s']:.0f} | {v['new_over_old']:.3f} | "
            f"{v['same_tokens']} |" for c, v in table.items()]
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
