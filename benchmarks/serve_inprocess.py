"""Continuous batching in process, without HTTP: closed-loop clients against ``generate`` calls of the same size.

    python benchmarks/serve_inprocess.py [--concurrency 8] [--requests 64] [--repeats 5] [--refill 2,0]
        [--first-rounds 1] [--methods none,auto] [--bucket-cache on] [--ahead off] [--client-delay-ms 0]
        [--out FILE.json]

``serve_load.py``'s workload (code openings, output lengths log-normal around 48 tokens in [8, 160],
``ignore_eos``, greedy) on the bundled pair's target alone, 8 slots, ``max_len`` 256, built as ``specjax serve``
builds it (:func:`specjax.serving.server.build_server`, with its start-up timings), and driven by
``--concurrency`` clients in this process: each submits its next request from the end event of its last (after
``--client-delay-ms``, a stand-in for a network round trip). Beside it, the same requests through
``specjax.generate`` in calls of ``--concurrency`` (static batching: each call runs to its longest request). One
server per ``--refill`` setting (0: ``refill_rounds=None``) and ``--first-rounds`` setting (the rounds of a new
request's first call: ``specjax serve --first-rounds``) and ``--bucket-cache`` setting (``on``: the KV caches
kept at the steps' attention bucket, ``specjax serve --bucket-cache``) and ``--ahead`` setting (``on``: calls
launched ahead of the collect, ``specjax serve --launch-ahead``) and ``--methods`` entry (``none``: the
target alone; ``auto``: the bundled draft model with k chosen per call among 0, 1, 2, 4, as ``specjax serve
--method draft``),
and the runs of every server and of ``generate`` interleaved, the order rotating, so that the machine's drift falls
on all alike; ratios pair the runs of one repeat. Each server is measured only after its greedy step programs,
which ``build_server`` compiles in a thread while it serves, are all compiled: that thread takes about 1.5 cores
here and would be measured with every run. Reported per server: tokens/s, the ratio to ``generate``, its calls
and rounds, and the rounds it ran by width and live requests (row utilisation: live row-rounds over width-rounds);
by k, its calls, rounds, device-call seconds (dispatch to results) and tokens, and by k and what ended the call,
its calls, rounds and seconds; the cuts and growths of the caches (``relengths``, with ``--bucket-cache on``); with
``auto``, the policy's final
view (:meth:`specjax.serving.policy.SpeculationPolicy.describe`). ``none`` and ``auto`` in one process need
``vm.max_map_count`` above its usual 65530 (the script says so and stops); else run each alone.

Run it with another source tree first on ``PYTHONPATH`` (``PYTHONPATH=/tmp/base python benchmarks/...``) to
measure that tree the same way (a tree without ``refill_rounds`` or ``bucket_cache`` runs its own default).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--concurrency", type=int, default=8)
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--refill", default="2,0", help="refill_rounds of each server, comma-separated (0: None)")
  p.add_argument("--first-rounds", default="1",
                 help="first_rounds of each server, comma-separated (servers: every refill with every value)")
  p.add_argument("--methods", default="none", help="none and/or auto, comma-separated (a server for each)")
  p.add_argument("--bucket-cache", default="on",
                 help="off and/or on, comma-separated (a server for each; default on, as specjax serve)")
  p.add_argument("--ahead", default="off",
                 help="off and/or on, comma-separated (a server for each; on: specjax serve --launch-ahead)")
  p.add_argument("--client-delay-ms", type=float, default=0.0)
  p.add_argument("--out")
  args = p.parse_args(argv)
  refills = [int(x) for x in args.refill.split(",")]
  firsts = [int(x) for x in args.first_rounds.split(",")]
  methods = args.methods.split(",")
  caches = args.bucket_cache.split(",")
  aheads = args.ahead.split(",")
  if not aheads or any(a not in ("off", "on") for a in aheads):
    p.error(f"--ahead must be off and/or on, comma-separated, got {args.ahead!r}")
  if not caches or any(c not in ("off", "on") for c in caches):
    p.error(f"--bucket-cache must be off and/or on, comma-separated, got {args.bucket_cache!r}")
  if not methods or any(m not in ("none", "auto") for m in methods):
    p.error(f"--methods must be none and/or auto, comma-separated, got {args.methods!r}")
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      map_count = int(f.read())
  except OSError:
    map_count = None
  if "auto" in methods and len(methods) > 1 and map_count is not None and map_count < 200_000:
    p.error(f"--methods {args.methods}: the servers' compiled programs need more memory maps than "
            f"vm.max_map_count = {map_count} allows in one process (LLVM fails with 'Cannot allocate memory'); "
            "raise it (sysctl -w vm.max_map_count=262144) or run each method alone")
  if args.concurrency < 1 or args.requests < args.concurrency or args.repeats < 1 or any(r < 0 for r in refills) \
      or any(f < 1 for f in firsts):
    p.error("--concurrency >= 1, --requests >= --concurrency, --repeats >= 1, --refill values >= 0 and "
            "--first-rounds values >= 1")

  import specjax
  from specjax.bench import load_average
  from specjax.serving.scheduler import Job
  from specjax.serving.server import build_server
  import serve_load

  loads = [load_average()]
  target, tok, reqs, prompts, requests = serve_load.bundled_requests(args.requests)
  total = sum(r.max_tokens for r in reqs)
  has_refill = "refill_rounds" in inspect.signature(build_server).parameters
  if not has_refill:
    refills = refills[:1]  # a tree without the option: one server, with its own default
  has_cache = "bucket_cache" in inspect.signature(build_server).parameters
  if not has_cache:
    caches = caches[:1]  # (likewise)
  if "launch_ahead" not in inspect.signature(build_server).parameters:
    aheads = aheads[:1]  # (likewise)

  draft = None
  if "auto" in methods:
    from specjax import cli
    from specjax.proposers import DraftModel
    draft = DraftModel(specjax.load(cli.DEFAULT_PAIR).draft)
  servers = {}
  for method, refill, first, cache, ahead in [(m, r, f, c, a) for m in methods for r in refills for f in firsts
                                               for c in caches for a in aheads]:
    kwargs = {"refill_rounds": refill or None} if has_refill else {}
    kwargs["first_rounds"] = first
    if has_cache:
      kwargs["bucket_cache"] = cache == "on"
    if len(aheads) > 1 or ahead == "on":
      kwargs["launch_ahead"] = ahead == "on"
    proposer, k = (draft, "auto") if method == "auto" else (None, 0)
    started = time.perf_counter()
    srv = build_server(target, tok, proposer, name="bench", slots=8, max_len=256, k=k, **kwargs)
    name = ((f"{method} " if len(methods) > 1 else "") + (f"refill={refill}" if has_refill else "tree default")
            + (f" first={first}" if len(firsts) > 1 else "") + (f" cache={cache}" if len(caches) > 1 else "") + (f" ahead={ahead}" if len(aheads) > 1 else ""))
    print(f"server {name}: built in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    counts = collections.Counter()

    def on_step(result, scheduler, counts=counts, chained=srv.scheduler.on_step, seen=[0]):
      relengths = getattr(scheduler.engine, "relengths", 0)  # the caches cut or grown (bucket_cache)
      counts["relengths"] += relengths - seen[0]
      seen[0] = relengths
      counts["calls"] += 1
      counts["rounds"] += result.rounds
      counts["call_seconds"] += result.seconds
      counts["row_rounds"] += sum(result.row_rounds.values())
      counts["width_rounds"] += result.width * result.rounds
      counts[f"w{result.width}/live{len(result.row_rounds)}"] += result.rounds
      counts[f"ended/{result.ended}"] += 1
      counts[f"k{result.k}/calls"] += 1
      counts[f"k{result.k}/rounds"] += result.rounds
      counts[f"k{result.k}/seconds"] += result.seconds
      counts[f"k{result.k}/tokens"] += sum(len(t) for t in result.tokens.values())
      counts[f"k{result.k}/catch_ups"] += result.catch_ups
      counts[f"k{result.k}/ahead_calls"] += bool(getattr(result, "ahead", False))
      counts[f"k{result.k}/{result.ended}/calls"] += 1
      counts[f"k{result.k}/{result.ended}/rounds"] += result.rounds
      counts[f"k{result.k}/{result.ended}/seconds"] += result.seconds
      chained(result, scheduler)

    srv.scheduler.on_step = on_step
    servers[name] = (srv, counts)
    # The greedy step programs compile in a thread after the server starts (build_server's defer_greedy): wait,
    # or that compilation shares the cores with every run measured (an idle server then costs ~1.5 cores here).
    while getattr(srv.scheduler.engine, "greedy_steps_pending", 0):  # 0 on a tree without deferred programs
      if time.perf_counter() - started > 1800:
        raise RuntimeError(f"server {name}: the greedy step programs did not finish compiling in 30 minutes "
                           "(see the log of build_server's compile thread)")
      time.sleep(0.5)
    print(f"server {name}: greedy step programs compiled after {time.perf_counter() - started:.1f} s",
          file=sys.stderr, flush=True)

  def closed_loop(srv) -> float:
    order = iter(range(len(requests)))
    lock, done, left, errors = threading.Lock(), threading.Event(), [len(requests)], []

    def submit_next():
      with lock:
        i = next(order, None)
      if i is not None:
        srv.scheduler.submit(Job(requests[i], sink))

    def sink(event):
      if event.kind == "tokens":
        return
      if event.kind == "error":
        errors.append(event.error)
        done.set()
        return
      with lock:
        left[0] -= 1
        if left[0] == 0:
          done.set()
      if args.client_delay_ms:
        threading.Timer(args.client_delay_ms / 1e3, submit_next).start()
      else:
        submit_next()

    start = time.perf_counter()
    for _ in range(args.concurrency):
      submit_next()
    if not done.wait(600) or errors:
      raise RuntimeError(f"the closed loop failed: {errors or 'not finished in 600 s'}")
    return time.perf_counter() - start

  groups = [list(range(i, min(i + args.concurrency, len(reqs)))) for i in range(0, len(reqs), args.concurrency)]

  def static() -> float:
    start = time.perf_counter()
    for g in groups:
      specjax.generate(target, [prompts[i] for i in g], max_new_tokens=max(reqs[i].max_tokens for i in g),
                       eos_id=[]).rows()
    return time.perf_counter() - start

  runners = {name: (lambda srv=srv: closed_loop(srv)) for name, (srv, _) in servers.items()}
  runners["generate"] = static
  for run in runners.values():  # warm-up: every program compiled, the servers' widths touched
    run()
  for _, counts in servers.values():
    counts.clear()
  names = list(runners)
  seconds = {n: [] for n in names}
  for rep in range(args.repeats):
    for name in names[rep % len(names):] + names[:rep % len(names)]:
      seconds[name].append(runners[name]())
  loads.append(load_average())
  for srv, _ in servers.values():
    srv.scheduler.stop()

  report = {"concurrency": args.concurrency, "requests": args.requests, "tokens": total, "repeats": args.repeats,
            "client_delay_ms": args.client_delay_ms, "load_average": loads, "tree_has_refill": has_refill,
            "results": {}}
  for name in names:
    row = {"seconds": seconds[name], "tokens_per_s": float(np.median([total / s for s in seconds[name]]))}
    if name != "generate":
      ratios = [g / s for s, g in zip(seconds[name], seconds["generate"])]
      counts = servers[name][1]
      row.update(ratio_to_generate=float(np.median(ratios)), ratio_repeats=[round(r, 3) for r in ratios],
                 per_repeat={k: v / args.repeats for k, v in sorted(counts.items())},
                 row_utilisation=counts["row_rounds"] / max(counts["width_rounds"], 1))
      policy = servers[name][0].scheduler.policy
      if policy is not None:
        row["policy"] = policy.describe()
    report["results"][name] = row
    print(f"{name:>14}: {row['tokens_per_s']:.0f} tok/s"
          + (f", {row['ratio_to_generate']:.3f}x generate (per repeat {row['ratio_repeats']}), row utilisation "
             f"{row['row_utilisation']:.3f}" if name != "generate" else ""), file=sys.stderr, flush=True)
  text = json.dumps(report, indent=1)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  else:
    print(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
