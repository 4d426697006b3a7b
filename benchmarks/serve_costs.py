"""What the slot engine's device time is made of at one width, against ``generate`` at the same batch.

    python benchmarks/serve_costs.py [--width 8] [--repeats 7] [--tokens 96] [--out FILE.json]

Bundled pair, target alone (k = 0), greedy, ``max_len`` 256, 8 rounds per call, ``--width`` rows of code
openings. Everything compiled and run once before timing; each figure is a median over ``--repeats``, the
clock read after ``jax.block_until_ready`` (or the engine's ``collect``, which waits for the call):

- ``generate``: ``specjax.generate`` of the ``--width`` prompts for ``--tokens`` tokens, and for one token; the
  difference over ``tokens - 1`` is the cost of one loop iteration (one token per row);
- ``round_ms_by_bucket``: one round of an 8-round call at each attention bucket the call used;
- ``one_round_call_ms`` against ``round_ms_in_8_round_calls``: the fixed cost of a call (the host's
  dispatch and results, the bucket window's copy in and out of the cache);
- ``insert_ms``: one request inserted into the running state (its prefill, then the write of its row),
  split into ``prefill_ms`` and ``write_ms``;
- ``insert_then_call_ms``: an insert and a one-round call after it, the call dispatched behind the insert
  (``queued``, as the server runs them) and after the host waited for the insert (``settled``);
- ``host_launch_ms``, ``host_collect_ms``: the host's own time in a one-round call, ``launch`` until it
  returns and ``collect`` once the device is done (fetching the outputs, the bookkeeping);
- ``interruptible``: the same 8-round calls on an engine built with ``interruptible=True`` (a host callback
  per round; see :class:`specjax.serving.slots.SlotEngine`) and without: how long ``launch`` takes to
  return (on CPU, XLA runs a program with a host callback synchronously) and the cost of a round;
- ``bucket_cache``: calls of one round and of 8 on ``--width`` live rows, interleaved, on an engine whose caches
  stay at ``max_len`` (each call copies its bucket's window out and back) and on one built with
  ``bucket_cache=True`` (the caches kept at the bucket): a round, and a call's fixed cost (one-round call less a
  round), each;
- ``round_fit``: calls of 1, 2, 4, ... 64 rounds on ``--width`` live rows at one bucket (128, the caches kept at
  it, as the server runs them), a least-squares line through their medians: a round's own cost (the slope;
  ``round_over_generate_iteration`` against ``generate``'s) and a call's fixed cost (the intercept). A round of
  an 8-round call above carries an eighth of the fixed cost; this does not.

Prints one JSON object (and writes it to ``--out``). Results: ``docs/benchmarks.md``, "Why device calls end".
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _median_ms(values) -> float:
  return round(float(np.median(values)) * 1e3, 3)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--width", type=int, default=8)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--tokens", type=int, default=96)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  if args.width < 1 or args.repeats < 1 or not 2 <= args.tokens <= 200:
    p.error("--width and --repeats must be >= 1, --tokens in [2, 200]")

  import jax

  import specjax
  from specjax import cli
  from specjax.bench import load_average
  from specjax.config import MIN_PROMPT_BUCKET
  from specjax.decode import bucket_length
  from specjax.request import Request
  from specjax.sampling import FULL, RowSettings
  from specjax.serving.slots import SlotEngine, _build_write

  loads = [load_average()]
  pair = specjax.load(cli.DEFAULT_PAIR)
  target, tok = pair.model, pair.tokenizer
  prompts = [tok.encode(f"def function_{i}(values):\n    return") for i in range(args.width)]
  rounds, max_len = 8, 256

  def generate(n: int) -> float:
    start = time.perf_counter()
    specjax.generate(target, prompts, max_new_tokens=n, eos_id=[]).rows()  # rows(): on the host
    return time.perf_counter() - start

  def engine_calls(engine) -> list[tuple[float, float, int, int]]:
    """The prompts inserted, then 8-round calls until they end: (launch s, call s, rounds, bucket) each."""
    engine.insert([Request(tuple(x), args.tokens, stop_ids=()) for x in prompts])
    calls = []
    while engine.live_slots:
      jax.block_until_ready(engine.state)
      start = time.perf_counter()
      call = engine.launch(0, rounds)
      launched = time.perf_counter()
      result = engine.collect(call)
      calls.append((launched - start, time.perf_counter() - start, result.rounds, result.bucket))
    return calls

  report: dict = {"width": args.width, "tokens": args.tokens, "repeats": args.repeats, "max_len": max_len,
                  "rounds_per_call": rounds}
  # generate: one token per row per loop iteration
  for n in (args.tokens, 1):
    generate(n)
  full, one = [], []
  for _ in range(args.repeats):
    full.append(generate(args.tokens))
    one.append(generate(1))
  report["generate"] = {"call_ms": _median_ms(full), "one_token_call_ms": _median_ms(one),
                        "iteration_ms": round((np.median(full) - np.median(one)) / (args.tokens - 1) * 1e3, 3)}

  engines = {flag: SlotEngine(target, None, slots=args.width, widths=(args.width,), max_len=max_len, ks=(0,),
                              rounds=rounds, interruptible=flag) for flag in (False, True)}
  for engine in engines.values():
    engine.warm_up()
    engine_calls(engine)
  runs = {flag: [] for flag in engines}
  for _ in range(args.repeats):  # interleaved: the machine's load drifts over both alike
    for flag, engine in engines.items():
      runs[flag].extend(engine_calls(engine))
  calls = runs[False]
  by_bucket = {}
  for _, seconds, n, bucket in calls:
    if n == rounds:
      by_bucket.setdefault(bucket, []).append(seconds / n)
  report["round_ms_by_bucket"] = {str(b): _median_ms(v) for b, v in sorted(by_bucket.items())}
  report["interruptible"] = {}
  for flag, flagged in runs.items():
    whole = [(launch, seconds / n) for launch, seconds, n, _ in flagged if n == rounds]
    report["interruptible"][str(flag).lower()] = {"launch_returns_ms": _median_ms([x for x, _ in whole]),
                                                 "round_ms": _median_ms([x for _, x in whole])}

  # A call of one round against rounds of 8-round calls, and one insert, into a state whose other rows run.
  engine = engines[False]
  engine.insert([Request(tuple(x), 200, stop_ids=()) for x in prompts[:args.width - 1]])
  engine.step(0, rounds)
  free = Request(tuple(prompts[-1]), 200, stop_ids=())
  bucket = max(MIN_PROMPT_BUCKET, bucket_length(len(free.prompt)))
  padded = np.zeros((1, bucket), np.int32)
  padded[0, :len(free.prompt)] = free.prompt
  settings = RowSettings.of([free.sampling], [200], [()], engine.vocab_size, FULL)
  prefill, prefill_args = engine._prefill_program(bucket, 1)
  write, _ = engine._program("serve-write", _build_write, engine.width, 1, engine.length)
  lens, seeds = np.asarray([len(free.prompt)], np.int32), np.zeros((1,), np.uint32)
  one_round, per_round, inserts, prefills, writes, queued, settled = [], [], [], [], [], [], []
  for i in range(args.repeats + 1):
    jax.block_until_ready(engine.state)
    start = time.perf_counter()
    (slot,) = engine.insert([free])
    jax.block_until_ready(engine.state)
    inserted = time.perf_counter() - start
    one = engine.step(0, 1).seconds
    whole = engine.step(0, rounds)
    engine.cancel(slot)
    engine.step(0, 1)
    start = time.perf_counter()
    new = jax.block_until_ready(prefill(*prefill_args, padded, lens, seeds, settings))
    prefilled = time.perf_counter()
    engine.state = jax.block_until_ready(write(engine.state, np.asarray([args.width - 1], np.int32), new))
    written = time.perf_counter()
    engine.step(0, 1)  # (the row written by hand: back to the engine's own rows)
    # An insert and the call after it, dispatched behind it as the server does, and with the host waiting for
    # the insert first (settle: the order before 2026-12-05), alternating which goes first.
    behind = {}
    for settle in (False, True) if i % 2 else (True, False):
      began = time.perf_counter()
      (slot,) = engine.insert([free])
      if settle:
        jax.block_until_ready(engine.state)  # (what SlotEngine.settle does; also on trees without it)
      engine.step(0, 1)
      behind[settle] = time.perf_counter() - began
      engine.cancel(slot)
      engine.step(0, 1)
    if i:  # the first: warm-up
      inserts.append(inserted)
      one_round.append(one)
      per_round.append(whole.seconds / whole.rounds)
      prefills.append(prefilled - start)
      writes.append(written - prefilled)
      queued.append(behind[False])
      settled.append(behind[True])
  report.update(one_round_call_ms=_median_ms(one_round), round_ms_in_8_round_calls=_median_ms(per_round),
                insert_ms=_median_ms(inserts), prefill_ms=_median_ms(prefills), write_ms=_median_ms(writes),
                insert_then_call_ms={"queued": _median_ms(queued), "settled": _median_ms(settled)},
                prompt_tokens=len(free.prompt), prompt_bucket=bucket)

  # The host's side of a one-round call: launch (dispatch) until it returns, and collect (fetching the outputs,
  # the bookkeeping) once the device is done, so that no device time is in either.
  launches, collects = [], []
  rows = [Request(tuple(x), 200, stop_ids=()) for x in prompts]
  for i in range(10 * args.repeats + 10):
    if i % 100 == 0:  # rows with room for the next 100 calls
      engine.reset()
      engine.insert(rows)
      jax.block_until_ready(engine.state)
    start = time.perf_counter()
    call = engine.launch(0, 1)
    launched = time.perf_counter()
    jax.block_until_ready(call.outputs)
    done = time.perf_counter()
    engine.collect(call)
    if i >= 10:  # the first: warm-up
      launches.append(launched - start)
      collects.append(time.perf_counter() - done)
  report.update(host_launch_ms=_median_ms(launches), host_collect_ms=_median_ms(collects))

  # A call's fixed cost with the caches at max_len (a window copied out and back each call) and kept at the bucket.
  kept = SlotEngine(target, None, slots=args.width, widths=(args.width,), max_len=max_len, ks=(0,), rounds=rounds,
                    bucket_cache=True)
  kept.warm_up()
  windowed = engines[False]
  timed = {"max_len": ([], [], []), "bucket": ([], [], [])}
  for i in range(4 * args.repeats + 4):
    for name, eng in (("max_len", windowed), ("bucket", kept)) if i % 2 else (("bucket", kept), ("max_len", windowed)):
      if i % 4 == 0:  # rows with room for the next calls (4 x 9 rounds from ~10-token prompts)
        eng.reset()
        eng.insert(rows)
        eng.step(0, 1)
        eng.settle()
      one, many = eng.step(0, 1), eng.step(0, rounds)
      if i >= 4:
        timed[name][0].append(one.seconds)
        timed[name][1].append(many.seconds / many.rounds)
        timed[name][2].append(many.bucket)
  report["bucket_cache"] = {name: {"one_round_call_ms": _median_ms(a), "round_ms": _median_ms(b),
                                   "fixed_ms": round(_median_ms(a) - _median_ms(b), 3), "buckets": sorted(set(c))}
                            for name, (a, b, c) in timed.items()}
  # A round's own cost and a call's fixed cost, fitted over calls of 1 to 64 rounds at one bucket (caches kept
  # at it, as the server runs): what a round costs against a `generate` iteration, without the fixed cost that
  # a round of an 8-round call carries an eighth of.
  spans = (1, 2, 4, 8, 16, 32, 64)
  fit_engine = SlotEngine(target, None, slots=args.width, widths=(args.width,), max_len=max_len, ks=(0,),
                          rounds=spans[-1], buckets=(128,), bucket_cache=True)
  fit_engine.warm_up()
  by_rounds = {n: [] for n in spans}
  for i in range(args.repeats + 1):
    for n in spans:
      fit_engine.reset()
      fit_engine.insert(rows)
      fit_engine.step(0, 1)
      fit_engine.settle()
      call = fit_engine.step(0, n)
      if i and call.rounds == n:  # the first: warm-up
        by_rounds[n].append(call.seconds)
  medians = {n: float(np.median(v)) for n, v in by_rounds.items() if v}
  slope, intercept = np.polyfit(list(medians), list(medians.values()), 1)
  report["round_fit"] = {"bucket": 128, "call_ms_by_rounds": {str(n): round(v * 1e3, 3) for n, v in medians.items()},
                         "round_ms": round(float(slope) * 1e3, 3), "fixed_ms": round(float(intercept) * 1e3, 3),
                         "round_over_generate_iteration": round(float(slope) * 1e3 / report["generate"]["iteration_ms"],
                                                                3)}
  loads.append(load_average())
  report["load_average"] = loads
  text = json.dumps(report, indent=1)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
