"""Where a single request loses time in ``specjax serve`` against ``specjax.generate`` (concurrency 1).

    python benchmarks/serve_profile.py [--requests 16] [--repeats 3] [--http] [--out FILE.json]

Bundled pair, target alone (method ``none``), greedy, 8 slots, ``max_len`` 256, 8 rounds per call, the
requests of ``benchmarks/serve_load.py``'s workload one at a time, each layer timed on the same requests and
the layers interleaved request by request (the load of a shared machine drifts over all of them alike):

- ``generate``: ``specjax.generate`` of the request alone (one compiled loop, its cache sized to the call);
- ``engine/<variant>``: a :class:`~specjax.serving.slots.SlotEngine` driven by hand (insert, then calls of up
  to 8 rounds until the request ends, the first call ``first_rounds``): the insert, each call's time
  (dispatch to results on the host), the host time between calls, the attention buckets used;
- ``scheduler/<variant>``: the :class:`~specjax.serving.scheduler.Scheduler` thread with a sink that counts
  tokens: submit to the first token and to the last;
- ``http`` (``--http``): a ``specjax serve`` process of this tree (the ``after`` variant), streamed
  completions sent one at a time as ``serve_load.py`` sends them: send to the first token and to the end.

Variants: ``before`` (every step the general sampling program, the first call 8 rounds, attention buckets
128 and 256: the server before ``greedy_steps``, ``first_rounds`` and the 64 bucket), ``after-b128`` (greedy
steps and a first call of one round, buckets 128 and 256), ``after`` (the defaults: buckets 64, 128, 256).
Prints the summary (tokens/s per layer, ratios to ``generate``) and the load average, and writes every
figure to ``--out`` (JSON). Results: ``docs/benchmarks.md``, "Concurrency 1: where a single request loses".
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import types

import numpy as np

VARIANTS = {"before": dict(greedy_steps=False, first_rounds=None, buckets=(128, 256)),
            "after-b128": dict(greedy_steps=True, first_rounds=1, buckets=(128, 256)),
            "after": dict(greedy_steps=True, first_rounds=1)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--requests", type=int, default=16)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated among {','.join(VARIANTS)}")
  p.add_argument("--http", action="store_true", help="also time a specjax serve process over HTTP")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  variants = [v for v in args.variants.split(",") if v]
  if not variants or any(v not in VARIANTS for v in variants):
    p.error(f"--variants: among {','.join(VARIANTS)}, got {args.variants!r}")

  import specjax
  from specjax.bench import load_average
  from specjax.serving.scheduler import Job, Scheduler
  from specjax.serving.slots import SlotEngine
  import serve_load

  loads = [load_average()]
  target, tok, reqs, prompts, requests = serve_load.bundled_requests(args.requests)
  rounds, max_len = 8, 256

  gen = lambda i: specjax.generate(target, [prompts[i]], max_new_tokens=reqs[i].max_tokens, eos_id=[]).rows()
  for i in range(len(reqs)):
    gen(i)  # compile

  def drive(engine, first_rounds, i: int) -> dict:
    t0 = time.perf_counter()
    (slot,) = engine.insert([requests[i]])
    t1 = time.perf_counter()
    calls, tokens, first, host, last_end = [], 0, None, 0.0, t1
    while engine.live_slots:
      start = time.perf_counter()
      host += start - last_end
      result = engine.step(0, first_rounds if not calls else rounds)
      last_end = time.perf_counter()
      calls.append((result.seconds, result.rounds, result.bucket))
      tokens += len(result.tokens.get(slot, []))
      first = first or last_end
    return {"insert_s": t1 - t0, "calls": calls, "tokens": tokens, "first_s": first - t0,
            "total_s": time.perf_counter() - t0, "host_between_calls_s": host}

  def schedule(scheduler, i: int) -> dict:
    done, first, count = threading.Event(), [], [0]

    def sink(event):
      if event.kind == "tokens":
        if not first:
          first.append(time.perf_counter())
        count[0] += len(event.tokens)
      else:
        done.set()
    t0 = time.perf_counter()
    scheduler.submit(Job(requests[i], sink))
    done.wait(120)
    return {"first_s": first[0] - t0, "total_s": time.perf_counter() - t0, "tokens": count[0]}

  layers, schedulers = {"generate": lambda i: {"total_s": _timed(gen, i), "tokens": reqs[i].max_tokens}}, []
  for name in variants:
    opts = dict(VARIANTS[name])
    first_rounds = opts.pop("first_rounds")
    engine = SlotEngine(target, None, slots=8, max_len=max_len, ks=(0,), rounds=rounds, **opts)
    engine.warm_up()
    for i in range(2):
      drive(engine, first_rounds or rounds, i)  # everything compiled and touched
    scheduler = Scheduler(engine, None, max_queue=4, first_rounds=first_rounds).start()
    schedulers.append(scheduler)
    layers[f"engine/{name}"] = lambda i, e=engine, f=first_rounds or rounds: drive(e, f, i)
    layers[f"scheduler/{name}"] = lambda i, s=scheduler: schedule(s, i)
  proc = None
  try:
    if args.http:
      import os
      import tempfile

      import httpx
      ns = types.SimpleNamespace(slots=8, max_len=max_len, random_init=False, target=None, server_args="", ks="0",
                                 out=tempfile.mkdtemp(prefix="serve_profile"))
      proc, url = serve_load.start_server("none", ns)
      serve_load._wait_healthy(proc, url, os.path.join(ns.out, "server-none.log"))
      model = serve_load.model_name(url)

      client = httpx.Client(base_url=url, timeout=120)  # one connection for every request, as serve_load's clients

      def http(i: int) -> dict:
        body = {"model": model, "prompt": reqs[i].prompt, "max_tokens": reqs[i].max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        t0, first, tokens = time.perf_counter(), None, 0
        with client.stream("POST", "/v1/completions", json=body) as r:
          for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
              n = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
              if n:
                first = first or time.perf_counter()
                tokens += n
        return {"first_s": first - t0, "total_s": time.perf_counter() - t0, "tokens": tokens}
      for i in range(2):
        http(i)
      layers["http/after"] = http
    out = {name: [] for name in layers}
    names = list(layers)
    for rep in range(args.repeats):  # request by request, every layer in turn (the order rotating)
      for i in range(len(reqs)):
        turn = (rep * len(reqs) + i) % len(names)
        for name in names[turn:] + names[:turn]:
          out[name].append(layers[name](i))
  finally:
    for scheduler in schedulers:
      scheduler.stop()
    if proc is not None:
      proc.terminate()
      proc.wait(60)
  loads.append(load_average())

  tok_s = lambda rows: sum(r["tokens"] for r in rows) / sum(r["total_s"] for r in rows)
  ms = lambda rows, key: 1e3 * float(np.median([r[key] for r in rows]))
  summary = {}
  for name, rows in out.items():
    row = {"tokens_per_s": tok_s(rows), "vs_generate": tok_s(rows) / tok_s(out["generate"]),
           "latency_ms_p50": ms(rows, "total_s")}
    if "first_s" in rows[0]:
      row["first_token_ms_p50"] = ms(rows, "first_s")
    if "calls" in rows[0]:
      calls = [c for r in rows for c in r["calls"]]
      row.update(insert_ms_p50=ms(rows, "insert_s"), calls_per_request=len(calls) / len(rows),
                 call_ms_per_round_p50=1e3 * float(np.median([s / n for s, n, _ in calls])),
                 buckets={str(b): sum(1 for c in calls if c[2] == b) for b in sorted({c[2] for c in calls})},
                 host_between_calls_ms_per_request=1e3 * float(np.mean([r["host_between_calls_s"] for r in rows])))
    summary[name] = row
  summary["generate"]["ms_per_token"] = 1e3 / summary["generate"]["tokens_per_s"]
  print(json.dumps(summary, indent=1))
  print(f"load average {loads[0]} .. {loads[1]}", file=sys.stderr)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"settings": vars(args), "load_average": loads, "summary": summary, "raw": out}, f, indent=1)
  return 0


def _timed(f, *args) -> float:
  t = time.perf_counter()
  f(*args)
  return time.perf_counter() - t


if __name__ == "__main__":
  sys.exit(main())
