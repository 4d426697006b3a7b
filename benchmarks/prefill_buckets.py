"""What a server's prefill costs at each padded prompt length, and what the prompt buckets cost a workload.

    python benchmarks/prefill_buckets.py [--target smollm2-135m-instruct] [--dtype float32] [--repeats 9]
        [--buckets 16,32,48,...] [--out FILE.json]

One request's prefill (:class:`specjax.serving.slots.SlotEngine`'s prefill program: the target's pass over the
padded prompt, the proposer-free row it makes) at each length of ``--buckets`` (default: the engine's default
ladder up to 512, which holds every power of two), compiled and run once before timing, then timed
``--repeats`` times with the lengths interleaved, the clock read after ``jax.block_until_ready``; medians.
``per_token_ms`` is a bucket's time over its length, ``over_16`` its time over the shortest length's (16 by
default: v(T)/v(16)).

``workloads``: the prefill time of ``serve_load.py``'s workload (32 requests, ``--distinct-prompts``, with and
without ``--shared-prefix``), its prompts encoded by the target's tokenizer, each padded to a power of two
(``generate``'s buckets, the server's before the ladder) and to the default ladder: the sum of the measured
prefill times of the buckets each way.

Prints one JSON object (and writes it to ``--out``). Results: ``docs/benchmarks.md``, "Prompt buckets between
the powers of two".
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

import serve_load


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="smollm2-135m-instruct")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--repeats", type=int, default=9)
  p.add_argument("--buckets", type=lambda t: tuple(int(x) for x in t.split(",")), default=None)
  p.add_argument("--out")
  args = p.parse_args(argv)

  import specjax
  from specjax.bench import machine
  from specjax.decode import bucket_length
  from specjax.serving.slots import SlotEngine, _prefill_operands, default_prompt_buckets

  pair = specjax.load(args.target, dtype=args.dtype)
  buckets = tuple(sorted(args.buckets or default_prompt_buckets(512)))
  engine = SlotEngine(pair.model, None, slots=1, max_len=max(buckets), prompt_buckets=buckets)
  programs = {}
  for b in buckets:
    program, state_args = engine._prefill_program(b, 1)
    prompts, lens, seeds, settings = _prefill_operands(b, 1, engine.vocab_size)
    lens = np.asarray([b], np.int32)  # every position a prompt token
    ops = (prompts, lens, seeds, settings)
    call = lambda program=program, state_args=state_args, ops=ops: program(*state_args, *ops)
    jax.block_until_ready(call())  # compile, run once
    programs[b] = call
  times: dict[int, list[float]] = {b: [] for b in buckets}
  for _ in range(args.repeats):
    for b in buckets:
      start = time.perf_counter()
      jax.block_until_ready(programs[b]())
      times[b].append(time.perf_counter() - start)
  ms = {b: float(np.median(t)) * 1e3 for b, t in times.items()}
  ladder = default_prompt_buckets(512)
  workloads = {}
  if set(ladder) <= set(ms):  # the workloads' figures need every length of the ladder (and so every power of two)
    for name, prefix in (("distinct", ""), ("distinct, shared prefix", serve_load.PREAMBLE)):
      reqs = serve_load.workload(32, 0, 48, 8, 160, True, prefix, "0.")
      lengths = [len(pair.tokenizer.encode(r.prompt)) for r in reqs]
      pow2 = sum(ms[bucket_length(n)] for n in lengths)
      fine = sum(ms[next(b for b in ladder if b >= n)] for n in lengths)
      workloads[name] = {"prompt_tokens": lengths, "powers_of_two_ms": pow2, "ladder_ms": fine,
                         "ladder_over_powers": fine / pow2}
  report = {"machine": machine(), "target": args.target, "dtype": args.dtype, "repeats": args.repeats,
            "prefill_ms": ms, "per_token_ms": {b: ms[b] / b for b in buckets},
            "over_16": {b: ms[b] / ms[buckets[0]] for b in buckets}, "workloads": workloads}
  text = json.dumps(report, indent=1)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
