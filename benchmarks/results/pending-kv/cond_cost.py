"""Ad hoc (the record of docs/benchmarks.md, "Verify windows without copying the cache"): what a target pass
costs inside a ``lax.cond`` against outside one, SmolLM2-135M-Instruct (float32), a 2-token chain pass over a
cache of S positions at B rows (100 of them live), N passes in a jitted ``fori_loop``:

- ``written``: ``forward_features`` writing the cache, no conditional (a static chain's verify);
- ``cond_written``: the same inside both branches of a ``lax.cond`` (``verify_bucketed`` before 8ba2517);
- ``cond_pending``: ``forward_pending`` inside the branches, ``cache.append`` after (``verify_bucketed`` now).

    python benchmarks/results/pending-kv/cond_cost.py --rows 1 --positions 256 [--repeats 7]

Prints the median milliseconds per pass and each repeat's."""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

import specjax


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=1)
  parser.add_argument("--positions", type=int, default=256)
  parser.add_argument("--passes", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args()
  target = specjax.load("smollm2-135m-instruct").model
  graphdef, params = nnx.split(target)
  rows = args.rows
  cache = target.init_cache(rows, args.positions)
  _, _, cache = target(jnp.ones((rows, 100), jnp.int32), cache)
  cache = cache.with_lengths(jnp.full((rows,), 100))

  def written(model, cache, tokens, i):
    logits, _, _, cache = model.forward_features(tokens, cache)
    return logits, cache

  def cond_written(model, cache, tokens, i):
    def run(cache):
      logits, _, _, cache = model.forward_features(tokens, cache)
      return logits, cache
    return jax.lax.cond(i % 2 == 0, run, run, cache)

  def cond_pending(model, cache, tokens, i):
    def run(cache):
      logits, _, _, pending = model.forward_pending(tokens, cache)
      return logits, pending
    logits, pending = jax.lax.cond(i % 2 == 0, run, run, cache)
    return logits, cache.append(pending)

  def loop(fn):
    @jax.jit
    def run(params, cache):
      model = nnx.merge(graphdef, params)

      def body(i, carry):
        cache, acc = carry
        logits, cache = fn(model, cache, jnp.full((rows, 2), i % 7, jnp.int32), i)
        return cache.with_lengths(jnp.full((rows,), 100)), acc + logits[0, 0, 0]
      return jax.lax.fori_loop(0, args.passes, body, (cache, 0.0))
    return run

  runs = {fn.__name__: loop(fn) for fn in (written, cond_written, cond_pending)}
  for run in runs.values():
    jax.block_until_ready(run(params, cache))
  times = {name: [] for name in runs}
  for _ in range(args.repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run(params, cache))
      times[name].append(1000 * (time.perf_counter() - start) / args.passes)
  for name, ms in times.items():
    print(f"{name}: {statistics.median(ms):.2f} ms a pass ({', '.join(f'{t:.1f}' for t in ms)})")


if __name__ == "__main__":
  main()
