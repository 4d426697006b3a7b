"""What each speculation length costs a served request at concurrency 1, and whether the server's policy finds
the best one, in process (no HTTP: the host's own load does not enter).

    python benchmarks/serve_policy.py [--requests 32] [--repeats 3] [--ks 0,1,2,4] [--out FILE.json]

Bundled pair, greedy, 8 slots (widths 1 and 8), ``max_len`` 256, 8 rounds per call, the requests of
``benchmarks/serve_load.py``'s workload one at a time:

- ``engine``: a :class:`~specjax.serving.slots.SlotEngine` without a proposer (``none/k0``) and one with the
  draft model at each fixed k (``draft/k<k>``), driven by hand (insert, a first call of one round, then calls
  of 8), the variants interleaved request by request: tokens/s over the requests, tau, and the median time of a
  round in full calls (what the policy compares, ``E[tau](k) / t(k)``);
- ``start-up``: :meth:`~specjax.serving.slots.SlotEngine.time_steps` of the draft engine (the policy's
  timings before anything has been served);
- ``scheduler``: the :class:`~specjax.serving.scheduler.Scheduler` thread over each engine, ``none`` (plain
  decoding) and ``auto`` (:class:`~specjax.serving.policy.SpeculationPolicy` among ``--ks`` from those
  start-up timings), the requests submitted one at a time, interleaved: tokens/s, the ratio auto / none, and
  the policy's view at the end (steps by k, its step costs and E[tau]).

Prints the summary and the load average; ``--out`` writes every figure (JSON). Results: ``docs/benchmarks.md``,
"Concurrency 1 on the bundled pair: start-up timings on live rows".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--requests", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--ks", default="0,1,2,4", help="the speculation lengths of the draft engine (0 among them)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  try:
    ks = tuple(sorted({int(x) for x in args.ks.split(",") if x.strip()}))
  except ValueError:
    p.error(f"--ks: comma-separated integers, got {args.ks!r}")
  if 0 not in ks or len(ks) < 2:
    p.error(f"--ks must hold 0 and at least one k > 0, got {args.ks!r}")
  if args.requests < 2 or args.repeats < 1:
    p.error("--requests must be >= 2 and --repeats >= 1")

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import serve_load

  import specjax
  from specjax import cli, proposers
  from specjax.bench import load_average
  from specjax.request import Request
  from specjax.serving.policy import SpeculationPolicy
  from specjax.serving.scheduler import Job, Scheduler
  from specjax.serving.slots import SlotEngine

  loads = [load_average()]
  pair = specjax.load(cli.DEFAULT_PAIR)
  reqs = serve_load.workload(args.requests, 0, 48, 8, 160)
  requests = [Request(tuple(pair.tokenizer.encode(r.prompt)), r.max_tokens, stop_ids=()) for r in reqs]
  opts = dict(slots=8, max_len=256, rounds=8, widths=(1, 8))
  plain = SlotEngine(pair.model, None, ks=(0,), **opts)
  draft = SlotEngine(pair.model, proposers.DraftModel(pair.draft), ks=ks, **opts)

  def drive(engine, k: int, i: int) -> dict:
    t0 = time.perf_counter()
    (slot,) = engine.insert([requests[i]])
    calls, tokens = [], 0
    while engine.live_slots:
      result = engine.step(k, 1 if not calls else engine.rounds)
      calls.append((result.seconds, result.rounds))
      tokens += len(result.tokens.get(slot, []))
    return {"total_s": time.perf_counter() - t0, "tokens": tokens, "calls": calls}

  variants = {"none/k0": (plain, 0), **{f"draft/k{k}": (draft, k) for k in ks}}
  for engine, k in variants.values():  # every program compiled and run once (a first run costs several rounds)
    for i in range(len(requests)):
      drive(engine, k, i)
  runs = {name: [] for name in variants}
  for _ in range(args.repeats):
    for i in range(len(requests)):
      for name, (engine, k) in variants.items():
        runs[name].append(drive(engine, k, i))
  engine_table = {}
  for name, rs in runs.items():
    total, tokens = sum(r["total_s"] for r in rs), sum(r["tokens"] for r in rs)
    rounds = sum(n for r in rs for _, n in r["calls"])
    full = [s / n for r in rs for s, n in r["calls"] if n == engine.rounds]
    engine_table[name] = {"tok_s": tokens / total, "tau": tokens / rounds,
                          "round_ms_full_calls": 1e3 * float(np.median(full)) if full else None}

  t0 = time.perf_counter()
  startup = draft.time_steps(5)
  startup_s = time.perf_counter() - t0
  policy = SpeculationPolicy(startup)
  schedulers = {"none": Scheduler(plain, None, max_queue=4).start(),
                "auto": Scheduler(draft, policy, max_queue=4).start()}

  def submit(scheduler, i: int) -> tuple[float, int]:
    done, count = threading.Event(), [0]

    def sink(event):
      if event.kind == "tokens":
        count[0] += len(event.tokens)
      else:
        done.set()
    t0 = time.perf_counter()
    scheduler.submit(Job(requests[i], sink))
    if not done.wait(300):
      raise RuntimeError(f"request {i} did not finish in 300 s")
    return time.perf_counter() - t0, count[0]

  per_repeat = []
  try:
    for _ in range(args.repeats):
      sums = {name: [0.0, 0] for name in schedulers}
      for i in range(len(requests)):
        for name, scheduler in schedulers.items():
          t, n = submit(scheduler, i)
          sums[name][0] += t
          sums[name][1] += n
      per_repeat.append({name: n / t for name, (t, n) in sums.items()})
  finally:
    for scheduler in schedulers.values():
      scheduler.stop()
  loads.append(load_average())
  view = policy.describe()
  report = {
      "engine": engine_table,
      "startup_s": startup_s,
      "startup_round_ms": {w: {k: 1e3 * s for k, s in by_k.items()} for w, by_k in startup.items()},
      "scheduler_tok_s": per_repeat,
      "auto_over_none": [r["auto"] / r["none"] for r in per_repeat],
      "policy": {"choices": view["choices"], "expected_tau": view["expected_tau"],
                 "step_ms": {w: {k: 1e3 * s for k, s in by_k.items()} for w, by_k in view["step_seconds"].items()}},
      "load_average": loads, "requests": args.requests, "repeats": args.repeats, "ks": ks,
  }
  for name, row in engine_table.items():
    ms = row["round_ms_full_calls"]
    print(f"engine {name}: {row['tok_s']:.0f} tok/s, tau {row['tau']:.2f}, a round in full calls "
          f"{'-' if ms is None else f'{ms:.2f} ms'}")
  print(f"start-up timings ({startup_s:.1f} s), round ms:",
        {w: {k: round(v, 2) for k, v in by_k.items()} for w, by_k in report["startup_round_ms"].items()})
  print("scheduler tok/s per repeat:", [{n: round(v) for n, v in r.items()} for r in per_repeat])
  print(f"auto / none: median {np.median(report['auto_over_none']):.3f} (per repeat "
        f"{', '.join(f'{x:.3f}' for x in report['auto_over_none'])})")
  print("policy:", json.dumps(report["policy"]))
  print("load average:", loads)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
