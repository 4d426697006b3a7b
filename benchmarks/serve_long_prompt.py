"""A long prompt joining a busy server: the inter-token latency of the requests already decoding, with and
without chunked prefill (the engine and scheduler in process, no HTTP).

    python benchmarks/serve_long_prompt.py [--prompt 1600] [--chunks 0,256] [--repeats 3] [--out DIR]

The target has the bundled pair's target shape with random weights and ``max_seq_len`` 2048 (the bundled
weights stop at 1024 positions; the timing does not depend on the weights), 8 slots, plain decoding,
``max_len`` 2048. Per repeat: 7 requests decode (32-token prompts, ``--running-tokens`` each); once each has
streamed a few tokens, a request with a ``--prompt``-token prompt arrives; the gaps between the 7's token
events from its arrival to its first token are their inter-token latencies under the join (each gap shared
by the tokens of its event). Reported per ``--prefill-chunk`` value: p50/p90/p99 of those gaps over every
repeat, the long request's time to first token, and the load average around the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--prompt", type=int, default=1600)
  p.add_argument("--running-tokens", type=int, default=300)
  p.add_argument("--chunks", default="0,256", help="--prefill-chunk values (0: at once)")
  p.add_argument("--rounds", type=int, default=8)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)

  import specjax
  from flax import nnx

  from specjax import cli
  from specjax.bench import load_average, machine
  from specjax.models import Llama
  from specjax.request import Request
  from specjax.serving.scheduler import Job, Scheduler
  from specjax.serving.slots import SlotEngine

  cfg = specjax.load(cli.DEFAULT_PAIR).model.cfg.replace(max_seq_len=2048)
  target = Llama(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  report = {"machine": machine(), "settings": vars(args), "results": []}
  for chunk in [int(x) for x in args.chunks.split(",")]:
    engine = SlotEngine(target, None, slots=8, max_len=2048, widths=(8,), rounds=args.rounds,
                        prefill_chunk=chunk or None)
    t = time.perf_counter()
    engine.warm_up()
    compile_s = time.perf_counter() - t
    scheduler = Scheduler(engine).start()
    gaps, ttfts, loads = [], [], [load_average()]
    try:
      for rep in range(args.repeats + 1):  # the first: warm-up, not counted
        events = [[] for _ in range(7)]

        def sink(i):
          def take(event):
            if event.kind == "tokens":
              events[i].append((time.perf_counter(), len(event.tokens)))
          return take

        running = [Job(Request(tuple(rng.integers(0, cfg.vocab_size, 32).tolist()), args.running_tokens), sink(i))
                   for i in range(7)]
        for job in running:
          scheduler.submit(job)
        while min(len(e) for e in events) < 3:
          time.sleep(0.001)
        first = threading.Event()
        long = Job(Request(tuple(rng.integers(0, cfg.vocab_size, args.prompt).tolist()), 4),
                   lambda e: first.set() if e.kind == "tokens" else None)
        arrival = time.perf_counter()
        scheduler.submit(long)
        assert first.wait(600)
        joined = time.perf_counter()
        time.sleep(0.05)
        for job in running:
          scheduler.cancel(job)
        while scheduler.slots_used:
          time.sleep(0.01)
        if rep == 0:
          continue
        ttfts.append(joined - arrival)
        for e in events:
          for (t0, _), (t1, n) in zip(e, e[1:]):
            if t1 > arrival and t0 < joined:
              gaps += [(t1 - t0) / n] * n
    finally:
      scheduler.stop()
    loads.append(load_average())
    pct = {f"p{q}": float(np.percentile(gaps, q)) for q in (50, 90, 99)}
    row = {"prefill_chunk": chunk, "itl_s": pct, "long_ttft_s": float(np.median(ttfts)), "ttft_repeats": ttfts,
           "tokens": len(gaps), "load_average": loads, "compile_s": compile_s}
    report["results"].append(row)
    print(f"prefill_chunk {chunk}: ITL of the 7 while the {args.prompt}-token prompt joins "
          f"p50/p90/p99 {pct['p50'] * 1e3:.1f}/{pct['p90'] * 1e3:.1f}/{pct['p99'] * 1e3:.1f} ms over {len(gaps)} "
          f"tokens; its TTFT {row['long_ttft_s'] * 1e3:.0f} ms; load average {loads}", flush=True)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "long_prompt.json"), "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
