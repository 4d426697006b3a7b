"""The device check: what speculation is worth on one accelerator, measured in one run of under 8 minutes.

    python benchmarks/device_check.py [OUT] [--tiny] [--budget-s 420]

Writes ``device_check.json`` and ``device_check.md`` to OUT (default ``$OUT``, else
``benchmarks/results/device-check``), rewritten after every stage so that a run cut short keeps what it
measured, and ``pair/`` (``specjax bench``'s report for the bundled pair). Needs nothing but this working tree
and the project's install. Stages, smallest first:

1. ``pair``: ``specjax.load("stdlib-coder")`` in bfloat16, its draft, the n-gram proposer and every head set
   it ships (``loaded.heads``) against the target alone at k = 4, batch 1, greedy, through ``specjax.bench.run``:
   the calibrated cost model's prediction next to each measured speedup.
2. Random Llama targets of about 0.5 B, 1.5 B and 7 B parameters in bfloat16, each run only if its weights fit
   in device memory and the time left allows it (estimated from the previous size): the forward cost
   ``v(T) = cost(T) / cost(1)`` for T = 1..9 (a cached target pass over T tokens at batch 1, timed inside one
   jitted loop by ``specjax.costmodel``), then the baseline against speculation with draft = target at each k
   in ``KS``: every proposal is accepted (greedy), so tau = k + 1 and the speedup is the upper bound any draft
   of this target's cost could reach; next to it the cost model's prediction of that whole call and the
   prediction from v(T) alone, ``(k + 1) / (k + v(k + 1))``. Then token trees (``Settings.trees``), still with
   draft = target: every tree's path of first choices is accepted, so tau = depth + 1 whatever the width, and
   the speedup by tree size is what the verify pass over N + 1 nodes (``v(N + 1)``, measured too) and the
   draft's level-by-level rollout over the frontier cost against the chain of the same depth.
3. ``pair_trees``: the bundled pair's draft and heads, the chain at k = 4 against each tree of
   ``Settings.trees`` (trees deeper than a proposer can go are skipped) and ``k="auto", tree="auto"`` (what the
   cost model chooses on this device), greedy, batch 1, the target alone in the same stage: tau and speedup by
   tree size on real code prompts.
   Compile times are reported separately.

``--tiny`` runs every stage with a tiny random target and short generations (CPU; the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time
import traceback
from typing import Any

import jax
from flax import nnx

import specjax
from specjax import bench, costmodel
from specjax.models import Llama, LlamaConfig
from specjax.proposers import DraftModel, NGram, for_heads
from specjax.tokenizer import ByteTokenizer
from specjax.tree import DynamicTree

BF16 = dict(dtype="bfloat16", param_dtype="bfloat16", max_seq_len=2048)
SIZES = {
    "0.5B": LlamaConfig(vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, n_kv_heads=8, d_ff=5632, **BF16),
    "1.5B": LlamaConfig(vocab_size=32000, d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8, d_ff=5632,
                        tie_embeddings=False, **BF16),
    "7B": LlamaConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008, tie_embeddings=False,
                      **BF16),
}
TINY_SIZES = {"tiny": LlamaConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                                  **BF16)}


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one device check measures.

  Attributes:
    sizes: the random targets, smallest first. t_max: v(T) for T = 1..t_max. ks: speculation lengths of the
    draft = target runs. max_new_tokens, repeats: per timed generate call. calibration_repeats, min_seconds:
    the cost model's timings. pair_k, pair_new_tokens, pair_repeats: the bundled pair's bench case;
    pair_methods: its proposers (None: draft, ngram and every shipped head set). trees: the token trees of
    the random targets' and the pair's tree runs (empty: none). tree_methods: the pair's proposers for trees
    (None: draft and every shipped head set). tree_auto: also run the pair with ``k="auto", tree="auto"``.
  """

  sizes: dict
  t_max: int = 9
  ks: tuple[int, ...] = (2, 4)
  max_new_tokens: int = 64
  repeats: int = 3
  calibration_repeats: int = 3
  min_seconds: float = 0.01
  pair_k: int = 4
  pair_new_tokens: int = 64
  pair_repeats: int = 3
  pair_methods: tuple[str, ...] | None = None
  trees: tuple = (DynamicTree(2, 4, 8), DynamicTree(4, 4, 16), DynamicTree(4, 6, 32))
  tree_methods: tuple[str, ...] | None = None
  tree_auto: bool = True


FULL = Settings(sizes=SIZES)
TINY = Settings(sizes=TINY_SIZES, t_max=2, ks=(1,), max_new_tokens=4, repeats=1, calibration_repeats=1,
                min_seconds=1e-4, pair_k=1, pair_new_tokens=4, pair_repeats=1, pair_methods=("ngram",),
                trees=(DynamicTree(2, 2, 3),), tree_methods=("eagle",), tree_auto=False)


def random_target(cfg: LlamaConfig, seed: int = 0) -> Llama:
  """A randomly initialised target whose weights are drawn on the device, inside one jitted function (no
  host copy of a multi-GB model)."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(seed))))
  state = jax.jit(lambda: nnx.state(Llama(cfg, rngs=nnx.Rngs(seed))))()
  return nnx.merge(graphdef, state)


def device_bytes() -> int | None:
  """The memory of the first device, where the backend reports it (not on CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def _timed(fn) -> tuple[float, Any]:
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def measure_size(name: str, cfg: LlamaConfig, s: Settings, prompt: list[int]) -> dict[str, Any]:
  """v(T) and baseline against draft = target for one random target (see the module docstring)."""
  t0 = time.perf_counter()
  target = random_target(cfg)
  init_s = time.perf_counter() - t0
  proposer = DraftModel(target)  # the target proposes for itself: every greedy proposal is accepted
  n = s.max_new_tokens
  prompt_len = specjax.decode.bucket_length(len(prompt))
  cal_s, cal = _timed(lambda: costmodel.Calibration(
      target, proposer, 1, s.t_max - 1, prompt_len=prompt_len, n_tokens=n, min_seconds=s.min_seconds,
      rounds=s.ks).warm_up())
  for _ in range(s.calibration_repeats):
    cal.time_once()
  table = cal.table()
  v = {t: table.verify[t] / table.verify[1] for t in sorted(table.verify)}

  def call(k: int):
    return specjax.generate(target, [prompt], proposer=proposer if k else None, spec=specjax.SpecConfig(k=k),
                            max_new_tokens=n)

  runs, base = [], None
  for k in (0,) + tuple(s.ks):
    first, out = _timed(lambda: call(k))  # compile, then the run
    times = [_timed(lambda: call(k))[0] for _ in range(s.repeats)]
    steady = statistics.median(times)
    row = {"k": k, "seconds": steady, "seconds_all": times, "first_call_s": first,
           "compile_s": max(0.0, first - steady), "tokens_per_s": n / steady, "rounds": out.stats.rounds,
           "tau": out.stats.mean_accepted_length, "acceptance_by_position": out.stats.acceptance_by_position}
    if k == 0:
      base = row
    else:
      row["speedup"] = base["seconds"] / steady
      row["predicted_speedup"] = costmodel.predict_speedup(table, out.stats.acceptance_by_position, k, n_tokens=n)
      row["predicted_from_v"] = (k + 1) / (k + v[k + 1]) if k + 1 in v else None
      row["measured_over_predicted"] = row["speedup"] / row["predicted_speedup"]
    runs.append(row)
  tree_runs = []
  for tree in s.trees:
    window = tree.nodes + 1
    spec = specjax.SpecConfig(tree=tree)
    call_tree = lambda: specjax.generate(target, [prompt], proposer=proposer, spec=spec, max_new_tokens=n)
    first, out = _timed(call_tree)
    steady = statistics.median([_timed(call_tree)[0] for _ in range(s.repeats)])
    tree_runs.append({"tree": tree.describe(), "nodes": tree.nodes, "depth": tree.depth, "seconds": steady,
                      "compile_s": max(0.0, first - steady), "tokens_per_s": n / steady,
                      "tau": out.stats.mean_accepted_length, "speedup": base["seconds"] / steady,
                      "v_window": pass_seconds(target, window, prompt_len, n, s.min_seconds) / table.verify[1]})
  return {"name": name, "params": cfg.num_params, "config": dataclasses.asdict(cfg), "init_s": init_s,
          "calibration_compile_s": cal_s, "v": v, "verify_s": dict(table.verify), "cost_table": table.to_dict(),
          "runs": runs, "trees": tree_runs, "device_peak_bytes": bench.device_peak_bytes(),
          "seconds": time.perf_counter() - t0}


def pass_seconds(target, window: int, prompt_len: int, n_tokens: int, min_seconds: float) -> float:
  """Seconds of one cached target pass over ``window`` tokens at batch 1, timed as the cost model's
  calibration times v(T) (inside one jitted loop, the difference of n and 2n iterations, best of 3)."""
  cache_len = prompt_len + n_tokens + window
  run, args = costmodel._pass_program(target, 1, window, prompt_len + n_tokens // 2, cache_len)
  jax.block_until_ready(run(*args, 1))
  start = time.perf_counter()
  jax.block_until_ready(run(*args, 2))
  iters = int(min(1024, max(2, round(min_seconds / max((time.perf_counter() - start) / 2, 1e-7)))))
  best = []
  for _ in range(3):
    short, _ = _timed(lambda: jax.block_until_ready(run(*args, iters)))
    long, _ = _timed(lambda: jax.block_until_ready(run(*args, 2 * iters)))
    best.append((short, long))
  short, long = min(b[0] for b in best), min(b[1] for b in best)
  return (long - short) / iters if long > short else long / (2 * iters)


def measure_pair_trees(s: Settings) -> dict[str, Any]:
  """The bundled pair's draft and heads: the chain at k = 4, each tree of ``s.trees`` and the cost model's own
  choice (``k="auto", tree="auto"``), greedy, batch 1, against the target alone (see the module docstring)."""
  loaded = specjax.load("stdlib-coder", dtype="bfloat16")
  proposers = {"draft": DraftModel(loaded.draft)}
  proposers.update({method: for_heads(heads) for method, heads in loaded.heads.items()})
  proposers = {m: p for m, p in proposers.items() if s.tree_methods is None or m in s.tree_methods}
  rows = [loaded.tokenizer.encode(p) for p in bench.DEFAULT_PROMPTS[:4]]
  cases = [("none", None, specjax.SpecConfig(k=0))]
  for method, proposer in proposers.items():
    cases.append((f"{method} chain k={s.pair_k}", proposer, specjax.SpecConfig(k=s.pair_k)))
    for tree in s.trees:
      if proposer.max_k is None or tree.depth <= proposer.max_k:
        cases.append((f"{method} {tree.describe()}", proposer, specjax.SpecConfig(tree=tree)))
    if s.tree_auto:
      cases.append((f"{method} auto", proposer, specjax.SpecConfig(k="auto", tree="auto", k_max=s.pair_k,
                                                                   tree_sizes=tuple(t.nodes for t in s.trees))))

  def call(proposer, spec):
    return [specjax.generate(loaded.model, [row], proposer=proposer, spec=spec, max_new_tokens=s.pair_new_tokens)
            for row in rows]

  first, outs = {}, {}
  for name, proposer, spec in cases:
    first[name], outs[name] = _timed(lambda: call(proposer, spec))
  times = {name: [] for name, _, _ in cases}
  for _ in range(s.pair_repeats):  # interleaved
    for name, proposer, spec in cases:
      times[name].append(_timed(lambda: call(proposer, spec))[0])
  base = statistics.median(times["none"])
  results = []
  for name, _, spec in cases[1:]:
    steady = statistics.median(times[name])
    stats = [o.stats for o in outs[name]]
    rounds = sum(st.row_rounds for st in stats)
    results.append({"case": name, "seconds": steady, "speedup": base / steady,
                    "tau": sum(st.new_tokens for st in stats) / max(rounds, 1),
                    "compile_s": max(0.0, first[name] - steady),
                    "ran": sorted({st.tree or f"k={st.k}" for st in stats})})
  return {"baseline_s": base, "results": results}


def measure_pair(s: Settings, out_dir: pathlib.Path) -> dict[str, Any]:
  """The bundled pair with its draft, the n-gram proposer and its shipped heads, through ``bench.run``."""
  loaded = specjax.load("stdlib-coder", dtype="bfloat16")
  proposers = {"draft": DraftModel(loaded.draft), "ngram": NGram()}
  proposers.update({method: for_heads(heads) for method, heads in loaded.heads.items()})
  proposers = {m: p for m, p in proposers.items() if s.pair_methods is None or m in s.pair_methods}
  settings = bench.BenchSettings(batch_sizes=(1,), ks=(s.pair_k,), samplings=("greedy",), methods=tuple(proposers),
                                 max_new_tokens=s.pair_new_tokens, repeats=s.pair_repeats, auto=False, dynamic=False,
                                 calibration_repeats=s.calibration_repeats, calibration_min_seconds=s.min_seconds)
  rows = [loaded.tokenizer.encode(p) for p in bench.DEFAULT_PROMPTS[:4]]
  report = bench.run(loaded.model, proposers, rows, settings, progress=False)
  bench.write(report, str(out_dir / "pair"))
  keep = ("config", "method", "k", "total_s", "output_tokens_per_s", "tau", "acceptance_rate", "speedup",
          "predicted_speedup", "prior_predicted_speedup", "measured_over_predicted", "compile_s_estimate")
  return {"methods": list(proposers), "results": [{f: r[f] for f in keep} for r in report["results"]],
          "cost_tables": report["cost_tables"]}


def markdown(report: dict[str, Any]) -> str:
  m = report["machine"]
  lines = [f"# Device check: {m['device_kind']} ({m['backend']}, {m['device_count']} device(s)), jax {m['jax']}", ""]
  for stage in report["skipped"]:
    lines.append(f"- skipped {stage['name']}: {stage['why']}")
  if "pair" in report:
    lines += ["", "## Bundled pair (stdlib-coder, bfloat16, batch 1, greedy)", "",
              "| config | tokens/s | tau | speedup | predicted | measured/predicted | compile s |", "|---|---|---|---|---|---|---|"]
    for r in report["pair"]["results"]:
      fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)
      lines.append(f"| {r['config']} | {r['output_tokens_per_s']:.0f} | {fmt(r['tau'])} | {fmt(r['speedup'])} | "
                   f"{fmt(r['predicted_speedup'])} | {fmt(r['measured_over_predicted'])} | {fmt(r['compile_s_estimate'], '{:.1f}')} |")
  for size in report["sizes"]:
    ts = sorted(size["v"])
    lines += ["", f"## Random target {size['name']} ({size['params'] / 1e9:.2f} B parameters, bfloat16, batch 1)", "",
              "| T | " + " | ".join(map(str, ts)) + " |", "|---" * (len(ts) + 1) + "|",
              "| v(T) | " + " | ".join(f"{size['v'][t]:.2f}" for t in ts) + " |",
              f"| step ms | {size['verify_s'][1] * 1e3:.2f} |" + " |" * (len(ts) - 1), "",
              "| k | tokens/s | tau | speedup (draft = target) | cost model | from v(T) | compile s |",
              "|---|---|---|---|---|---|---|"]
    for r in size["runs"]:
      fmt = lambda key: "-" if r.get(key) is None else f"{r[key]:.2f}"
      lines.append(f"| {r['k']} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | {fmt('speedup')} | "
                   f"{fmt('predicted_speedup')} | {fmt('predicted_from_v')} | {r['compile_s']:.1f} |")
    if size.get("trees"):
      lines += ["", "| tree (draft = target) | nodes | tau | tokens/s | speedup | v(N + 1) | compile s |",
                "|---|---|---|---|---|---|---|"]
      lines += [f"| {r['tree']} | {r['nodes']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | "
                f"{r['v_window']:.2f} | {r['compile_s']:.1f} |" for r in size["trees"]]
    lines.append(f"\ninit {size['init_s']:.1f} s, cost-model calibration (compile and warm-up) "
                 f"{size['calibration_compile_s']:.1f} s, stage {size['seconds']:.0f} s")
  if "pair_trees" in report:
    lines += ["", "## Bundled pair: chains against token trees (stdlib-coder, bfloat16, batch 1, greedy)", "",
              "| case | ran | tau | speedup | compile s |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {', '.join(r['ran'])} | {r['tau']:.2f} | {r['speedup']:.2f} | {r['compile_s']:.1f} |"
              for r in report["pair_trees"]["results"]]
  lines.append(f"\ntotal {report['seconds']:.0f} s")
  return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: pathlib.Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  (out / "device_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
  (out / "device_check.md").write_text(markdown(report))


def run(settings: Settings, out: pathlib.Path, budget_s: float) -> dict[str, Any]:
  """Every stage that fits, smallest first; the report is rewritten after each."""
  start = time.perf_counter()
  report: dict[str, Any] = {"machine": bench.machine(), "settings": dataclasses.asdict(settings) | {"sizes": list(settings.sizes)},
                            "budget_s": budget_s, "sizes": [], "skipped": [], "errors": [], "seconds": 0.0}

  def stage(name: str, fn):
    try:
      return fn()
    except Exception as e:  # a stage that fails (out of memory, ...) is recorded; the next still runs
      report["errors"].append({"stage": name, "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc(limit=5)})
      return None
    finally:
      report["seconds"] = time.perf_counter() - start
      write(report, out)
      jax.clear_caches()

  pair = stage("pair", lambda: measure_pair(settings, out))
  if pair is not None:
    report["pair"] = pair
  prompt = ByteTokenizer().encode(bench.DEFAULT_PROMPTS[0])
  previous = None
  memory = device_bytes()
  for name, cfg in settings.sizes.items():
    need = 2 * cfg.num_params * 1.3
    left = budget_s - (time.perf_counter() - start)
    estimate = 0.0 if previous is None else 1.3 * previous["seconds"] * max(
        cfg.n_layers / previous["config"]["n_layers"], (cfg.num_params / previous["params"]) ** 0.5)
    if memory is not None and need > memory:
      report["skipped"].append({"name": name, "why": f"needs ~{need / 2**30:.0f} GiB, the device has {memory / 2**30:.0f}"})
    elif estimate > left:
      report["skipped"].append({"name": name, "why": f"estimated {estimate:.0f} s, {left:.0f} s of the budget left"})
    else:
      result = stage(name, lambda: measure_size(name, cfg, settings, prompt))
      if result is not None:
        report["sizes"].append(result)
        previous = result
      write(report, out)
  if settings.trees:
    left = budget_s - (time.perf_counter() - start)
    if left < 60:
      report["skipped"].append({"name": "pair_trees", "why": f"{left:.0f} s of the budget left"})
    else:
      trees = stage("pair_trees", lambda: measure_pair_trees(settings))
      if trees is not None:
        report["pair_trees"] = trees
    write(report, out)
  return report


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="benchmarks/device_check.py", description=__doc__.split("\n\n")[0])
  parser.add_argument("out", nargs="?", default=os.environ.get("OUT") or "benchmarks/results/device-check",
                      help="output folder (default: $OUT, else benchmarks/results/device-check)")
  parser.add_argument("--tiny", action="store_true", help="tiny settings for CPU (the test suite)")
  parser.add_argument("--budget-s", type=float, default=420.0,
                      help="seconds the whole check may take; larger targets are skipped when they would not fit")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  report = run(TINY if args.tiny else FULL, out, args.budget_s)
  print(markdown(report))
  print(f"wrote {out / 'device_check.json'}, {out / 'device_check.md'}", file=sys.stderr)
  return 1 if report["errors"] else 0


if __name__ == "__main__":
  sys.exit(main())
