"""Plain (k = 0) calls at width 8 on an engine of the target alone, on one that also carries the bundled draft
model (ks 0, 1, 2, 4, as ``specjax serve --method draft --k auto``), and on the latter each after a k = 1 call:
does a plain call cost more when the engine has a draft, or right after a speculative call? Ad hoc, for
docs/benchmarks.md ("Speculation at concurrency 4, in process and over HTTP").

    python benchmarks/results/serve/2026-12-05-inprocess-auto/plain_rounds.py [--repeats 9] [--rounds 1,8]
"""
import argparse
import json
import time

import jax
import numpy as np

import specjax
from specjax import cli
from specjax.proposers import DraftModel
from specjax.request import Request
from specjax.serving.slots import SlotEngine

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=9)
p.add_argument("--rounds", default="1,8")
args = p.parse_args()
pair = specjax.load(cli.DEFAULT_PAIR)
target, tok = pair.model, pair.tokenizer
prompts = [tok.encode(f"def function_{i}(values):\n    return") for i in range(8)]
engines = {"target alone": SlotEngine(target, None, slots=8, widths=(8,), max_len=256, ks=(0,), rounds=8),
           "with draft": SlotEngine(target, DraftModel(pair.draft), slots=8, widths=(8,), max_len=256,
                                    ks=(0, 1, 2, 4), rounds=8)}
for e in engines.values():
  e.warm_up()


def run(engine, rounds, between=None):
  """Eight 96-token requests inserted, then plain calls of ``rounds`` until they end (with ``between``, a call of
  that k before each): seconds a round of the plain calls, by bucket."""
  engine.insert([Request(tuple(x), 96, stop_ids=()) for x in prompts])
  out = {}
  while engine.live_slots:
    if between is not None:
      engine.collect(engine.launch(between, rounds))
      if not engine.live_slots:
        break
    jax.block_until_ready(engine.state)
    start = time.perf_counter()
    result = engine.collect(engine.launch(0, rounds))
    if result.rounds == rounds:
      out.setdefault(result.bucket, []).append((time.perf_counter() - start) / rounds)
  return out


ns = [int(x) for x in args.rounds.split(",")]
cases = {**{name: (e, None) for name, e in engines.items()}, "with draft, each after a k = 1 call": (engines["with draft"], 1)}
for e, between in cases.values():
  for n in ns:
    run(e, n, between)
times = {(name, n): {} for name in cases for n in ns}
for _ in range(args.repeats):
  for n in ns:
    for name, (e, between) in cases.items():
      for b, v in run(e, n, between).items():
        times[(name, n)].setdefault(b, []).extend(v)
report = {f"{name}, {n}-round calls": {str(b): round(1e3 * float(np.median(v)), 3) for b, v in sorted(t.items())}
          for (name, n), t in times.items()}
print(json.dumps({"ms_a_round_by_bucket": report}, indent=1))
