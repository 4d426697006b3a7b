"""Where a speculative round's time goes on this CPU, under XLA:CPU options, weight dtypes and thread counts.

    python benchmarks/verify_cost.py --target smollm2-135m-instruct [--variants default,...] [--out DIR]

For each variant (an ``XLA_FLAGS`` setting, a weight dtype, a thread count) one subprocess loads the target
(so that XLA reads its flags at start), calibrates the cost model at batch 1 with the n-gram proposer
(in-jit timings: a target pass over T tokens ``v(T)``, the engine's whole round ``body(k)``), and times
``generate`` side by side: target only and n-gram k=4 on the same prompts, medians over repeats after a
warm-up. Writes ``<out>/verify_cost.json`` and ``.md``: v(T)/v(1), body(k)/body(0), the in-loop round over
the standalone pass (round(4) / v(5)), tokens/s and the n-gram speedup, per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = {
    # name: (XLA_FLAGS additions, param dtype, activation dtype, threads or None)
    "default": ("", "float32", "float32", None),
    "no-xnnpack": ("--xla_cpu_use_xnnpack=false", "float32", "float32", None),
    "onednn": ("--xla_cpu_use_onednn=true", "float32", "float32", None),
    "no-thunks": ("--xla_cpu_use_thunk_runtime=false", "float32", "float32", None),
    "fast-math": ("--xla_cpu_enable_fast_math=true", "float32", "float32", None),
    "eigen-1-thread": ("--xla_cpu_multi_thread_eigen=false", "float32", "float32", None),
    "bf16-weights": ("", "bfloat16", "float32", None),
    "bf16": ("", "bfloat16", "bfloat16", None),
    "1-thread": ("", "float32", "float32", 1),
}


def _measure(args) -> dict:
  """One variant, in this process (XLA_FLAGS already set by the parent)."""
  import jax
  import numpy as np

  import specjax
  from specjax import SpecConfig, costmodel
  from specjax.decode import bucket_length
  from specjax.loading import cast
  from specjax.proposers import NGram

  loaded = specjax.load(args.target)
  target = loaded.model
  if (args.param_dtype, args.dtype) != ("float32", "float32"):
    target = cast(target, args.param_dtype)
    target = target if args.dtype == args.param_dtype else _with_activation(target, args.dtype)
  tok = loaded.tokenizer
  prompts = [tok.encode(p) for p in ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                                     "import os\nimport sys\n\n\ndef main(argv):\n",
                                     "class Stack:\n    def __init__(self):\n        self.items = []\n")]
  k, n = 4, args.max_new_tokens
  table = costmodel.calibrate_costs(target, NGram(), 1, k, prompt_len=bucket_length(max(map(len, prompts))),
                                    n_tokens=bucket_length(n), repeats=args.repeats, min_seconds=0.05)
  runs = {"none": (None, SpecConfig(k=0)), "ngram": (NGram(), SpecConfig(k=k))}
  times = {name: [] for name in runs}
  outputs = {}
  for name, (proposer, spec) in runs.items():  # warm-up
    outputs[name] = [specjax.generate(target, [p], proposer=proposer, spec=spec, max_new_tokens=n).tokens
                     for p in prompts]
  for rep in range(args.repeats):
    for name, (proposer, spec) in (list(runs.items())[rep % 2:] + list(runs.items())[:rep % 2]):
      start = time.perf_counter()
      for p in prompts:
        jax.block_until_ready(specjax.generate(target, [p], proposer=proposer, spec=spec, max_new_tokens=n).tokens)
      times[name].append(time.perf_counter() - start)
  same = all(np.array_equal(a, b) for a, b in zip(outputs["none"], outputs["ngram"]))
  v, body = table.verify, table.rounds
  tok_s = {name: n * len(prompts) / statistics.median(ts) for name, ts in times.items()}
  return {"v1_ms": v[1] * 1e3, "v_over_v1": {t: v[t] / v[1] for t in sorted(v)},
          "body0_ms": body[0] * 1e3, "body_over_body0": {kk: body[kk] / body[0] for kk in sorted(body)},
          "round4_over_v5": body[4] / v[5], "body0_over_v1": body[0] / v[1],
          "tokens_per_s": tok_s, "ngram_speedup": tok_s["ngram"] / tok_s["none"], "greedy_equal": bool(same),
          "spread": table.spread, "load_average": list(os.getloadavg())}


def _with_activation(model, dtype: str):
  import dataclasses

  from flax import nnx

  graphdef, state = nnx.split(model)
  cfg = dataclasses.replace(model.cfg, dtype=dtype)
  new_def, _ = nnx.split(nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(new_def, state)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="smollm2-135m-instruct")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--param-dtype", default="float32", help=argparse.SUPPRESS)
  parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    print("RESULT " + json.dumps(_measure(args)), flush=True)
    return 0
  results = {}
  for name in args.variants.split(","):
    if name not in VARIANTS:
      parser.error(f"--variants: unknown {name!r}; known: {', '.join(VARIANTS)}")
    flags, param_dtype, dtype, threads = VARIANTS[name]
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    cmd = [sys.executable, __file__, "--child", name, "--target", args.target, "--param-dtype", param_dtype,
           "--dtype", dtype, "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats)]
    if threads:
      cmd = ["taskset", "-c", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])] + cmd
    print(f"variant {name}: {env['XLA_FLAGS'] or '(no flags)'} params {param_dtype} activations {dtype}"
          f"{f' threads {threads}' if threads else ''}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode or line is None:
      results[name] = {"error": (proc.stderr or proc.stdout)[-2000:]}
      print(f"  failed: {results[name]['error'][-300:]}", file=sys.stderr)
      continue
    results[name] = {"xla_flags": flags, "param_dtype": param_dtype, "dtype": dtype, "threads": threads,
                     **json.loads(line[len("RESULT "):])}
    r = results[name]
    print(f"  v(5)/v(1) {r['v_over_v1']['5']:.2f}  body(4)/body(0) {r['body_over_body0']['4']:.2f}  "
          f"round(4)/v(5) {r['round4_over_v5']:.2f}  base {r['tokens_per_s']['none']:.1f} tok/s  "
          f"ngram x{r['ngram_speedup']:.2f}", file=sys.stderr, flush=True)
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f"verify_cost_{args.target.replace('/', '_')}")
  with open(stem + ".json", "w") as f:
    json.dump(results, f, indent=1)
  lines = ["| variant | v(1) ms | v(2) | v(5) | v(9)? | body(0) ms | body(4)/body(0) | round(4)/v(5) | base tok/s "
           "| ngram k=4 tok/s | speedup | greedy equal |", "|" + "---|" * 12]
  for name, r in results.items():
    if "error" in r:
      lines.append(f"| {name} | failed | | | | | | | | | | |")
      continue
    vv = r["v_over_v1"]
    lines.append(f"| {name} | {r['v1_ms']:.2f} | {vv['2']:.2f} | {vv['5']:.2f} | {vv.get('9', float('nan')):.2f} | "
                 f"{r['body0_ms']:.2f} | {r['body_over_body0']['4']:.2f} | {r['round4_over_v5']:.2f} | "
                 f"{r['tokens_per_s']['none']:.1f} | {r['tokens_per_s']['ngram']:.1f} | {r['ngram_speedup']:.2f} | "
                 f"{r['greedy_equal']} |")
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
