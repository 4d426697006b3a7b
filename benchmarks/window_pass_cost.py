"""What the window-invariant verify pass costs, and that it is bit for bit: one target pass over T tokens,
plain and under ``specjax.numerics.per_position``, against T one-token steps.

    python benchmarks/window_pass_cost.py --target smollm2-135m-instruct --dtype bfloat16 --batch 1
    python benchmarks/window_pass_cost.py --dtype mixed --windows 2,3,5,9,17

Prints, for each window T (default 5), whether each window pass's logits equal the T steps' bit for bit (and
their largest difference), and v(T)/v(1) for both: the median time of a T-token pass over that of a 1-token
pass (jitted, after a warm-up, ``block_until_ready`` before each clock read), cache of 160 positions after a
32-token prompt. ``--dtype mixed``: a mixed-precision target (``specjax.load(..., dtype="mixed")``), which the
engine always verifies under ``per_position``.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import numpy as np
from flax import nnx

import specjax
from specjax import numerics


@functools.partial(jax.jit, static_argnames=("graphdef", "invariant"))
def _pass(graphdef, state, tokens, cache, invariant):
  with numerics.per_position(invariant):
    logits, _, cache = nnx.merge(graphdef, state)(tokens, cache)
  return logits, cache


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="smollm2-135m-instruct")
  parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "mixed"))
  parser.add_argument("--windows", default="5", help="comma-separated window lengths T (at most 64)")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  model = specjax.load(args.target, dtype=args.dtype).model
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  vocab, batch = model.cfg.vocab_size, args.batch
  _, cache = _pass(graphdef, state, rng.integers(0, vocab, (batch, 32)).astype(np.int32),
                   model.init_cache(batch, 160), False)
  widths = [int(t) for t in args.windows.split(",")]
  if not widths or min(widths) < 1 or max(widths) > 64:
    raise SystemExit(f"--windows must be integers in [1, 64], got {args.windows!r}")
  window = rng.integers(0, vocab, (batch, max(widths))).astype(np.int32)
  steps, step_cache = [], cache
  for t in range(max(widths)):
    logits, step_cache = _pass(graphdef, state, window[:, t:t + 1], step_cache, False)
    steps.append(np.asarray(logits))
  steps = np.concatenate(steps, axis=1)

  def median_seconds(tokens, invariant):
    jax.block_until_ready(_pass(graphdef, state, tokens, cache, invariant))
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(_pass(graphdef, state, tokens, cache, invariant))
      times.append(time.perf_counter() - start)
    return float(np.median(times))

  one = median_seconds(window[:, :1], False)
  print(f"{args.target} {args.dtype} batch {batch}: v(1) = {one * 1e3:.1f} ms")
  for t in widths:
    for invariant in (False, True):
      logits = np.asarray(_pass(graphdef, state, window[:, :t], cache, invariant)[0])
      print(f"  T={t} per_position={invariant}: bit for bit {bool(np.array_equal(logits, steps[:, :t]))} "
            f"(max |diff| {float(np.abs(logits - steps[:, :t]).max()):.3g}), "
            f"v({t})/v(1) = {median_seconds(window[:, :t], invariant) / one:.2f}")


if __name__ == "__main__":
  main()
