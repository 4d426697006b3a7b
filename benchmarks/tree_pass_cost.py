"""What a target's tree verify pass costs against a one-token step, at several batches and cache lengths.

    python benchmarks/tree_pass_cost.py --target smollm2-135m-instruct --dtype mixed --cases 1x256,8x256,1x1024

For each case ``BxS`` (rows x cache positions; each row's context about half the cache, rows at different
lengths), one pass over a tree of 9 slots (the root and 8 nodes, depths up to 4, paths that skip sibling slots)
under ``specjax.numerics.per_position`` (as the engine verifies a mixed-precision target) and one one-token step,
each jitted, timed after a warm-up with ``block_until_ready`` before each clock read; prints the medians and
v(tree)/v(1). To compare two revisions, run it with each revision's package first on ``PYTHONPATH`` (as
``benchmarks/compare_revisions.py`` exports them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax import numerics
from specjax import tree as trees

PARENTS = (-1, 0, 0, 1, 2, 1, 3, 5, 6)  # slot 6's path (0, 1, 3, 6) and others skip sibling slots


def _median_seconds(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--target", default="smollm2-135m-instruct")
  parser.add_argument("--dtype", default="mixed", choices=("float32", "bfloat16", "mixed"))
  parser.add_argument("--cases", default="1x256,8x256,1x1024", help="comma-separated BATCHxCACHE_POSITIONS")
  parser.add_argument("--repeats", type=int, default=11)
  args = parser.parse_args(argv)
  cases = []
  for case in args.cases.split(","):
    try:
      batch, positions = (int(x) for x in case.split("x"))
    except ValueError:
      parser.error(f"--cases: {case!r} is not BATCHxCACHE_POSITIONS (for example 8x256)")
    if batch < 1 or positions < 64:
      parser.error(f"--cases: {case!r} needs at least 1 row and 64 positions")
    cases.append((batch, positions))

  model = specjax.load(args.target, dtype=args.dtype).model
  graphdef, state = nnx.split(model)

  @jax.jit
  def tree_pass(state, tokens, cache, mask):
    with numerics.per_position(True):
      return nnx.merge(graphdef, state)(tokens, cache, tree=mask)[0]

  @jax.jit
  def step(state, tokens, cache):
    return nnx.merge(graphdef, state)(tokens, cache)[0]

  depths = [0]
  for parent in PARENTS[1:]:
    depths.append(depths[parent] + 1)
  print(f"{args.target} ({args.dtype}), jax {jax.__version__}, {jax.devices()[0].device_kind}; tree of "
        f"{len(PARENTS)} slots, medians of {args.repeats}")
  print("| rows | cache positions | one-token step ms | tree pass ms | v(tree)/v(1) |")
  print("|---|---|---|---|---|")
  for batch, positions in cases:
    lengths = jnp.asarray(positions // 2 - 20 + 3 * np.arange(batch), jnp.int32)
    cache = model.init_cache(batch, positions).with_lengths(lengths)
    parents = jnp.broadcast_to(jnp.asarray(PARENTS, jnp.int32), (batch, len(PARENTS)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, parents.shape), jnp.int32)
    nodes = trees.Tree(tokens=tokens, parents=parents,
                       depths=jnp.broadcast_to(jnp.asarray(depths, jnp.int32), parents.shape),
                       ranks=jnp.zeros_like(parents), valid=jnp.ones(parents.shape, bool))
    mask = trees.verify_mask(nodes, lengths, max(depths))
    one = _median_seconds(step, (state, tokens[:, :1], cache), args.repeats)
    tree = _median_seconds(tree_pass, (state, tokens, cache, mask), args.repeats)
    print(f"| {batch} | {positions} | {one * 1e3:.1f} | {tree * 1e3:.1f} | {tree / one:.2f} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
