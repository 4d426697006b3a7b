"""Ad hoc (the record of docs/benchmarks.md, "A confidence cutoff"): does XLA:CPU copy a buffer that a
``lax.switch`` updates in place in every branch? A 12 MB float32 buffer carried through a 100-iteration loop,
updated in every branch of a switch, without the switch, and passed to the branches read-only; prints the
milliseconds per iteration (median of 7) and how many copies of the buffer the compiled program holds."""

import statistics
import time

import jax
import jax.numpy as jnp

N = 3_000_000  # 12 MB of float32
ITERATIONS = 100


def at(i):
  return (i * 4 % (N - 8),)


def body_switch(i, carry):
  cache, x = carry

  def branch(width):
    def run(cache):
      return jax.lax.dynamic_update_slice(cache, jnp.full((width,), x, jnp.float32), at(i)), x + width
    return run

  return jax.lax.switch(i % 3, [branch(1), branch(2), branch(3)], cache)


def body_plain(i, carry):
  cache, x = carry
  return jax.lax.dynamic_update_slice(cache, jnp.full((2,), x, jnp.float32), at(i)), x + 2


def body_read_only(i, carry):
  cache, x = carry

  def branch(width):
    def run(cache):
      return jnp.sum(jax.lax.dynamic_slice(cache, at(i), (width,))) + x + width, jnp.full((3,), x + width)
    return run

  y, update = jax.lax.switch(i % 3, [branch(1), branch(2), branch(3)], cache)
  return jax.lax.dynamic_update_slice(cache, update, at(i)), y


def main():
  for name, body in (("switch", body_switch), ("plain", body_plain), ("readonly switch", body_read_only)):
    loop = jax.jit(lambda cache, body=body: jax.lax.fori_loop(0, ITERATIONS, body, (cache, jnp.float32(0))),
                   donate_argnums=0)
    cache = jax.block_until_ready(loop(jnp.zeros((N,), jnp.float32))[0])
    times = []
    for _ in range(7):
      start = time.perf_counter()
      cache = jax.block_until_ready(loop(cache)[0])
      times.append(time.perf_counter() - start)
    print(name, f"{1000 * statistics.median(times) / ITERATIONS:.3f} ms per iteration")
    text = loop.lower(jnp.zeros((N,), jnp.float32)).compile().as_text()
    print("  copies:", sum(1 for line in text.splitlines() if " copy(" in line and str(N) in line))


if __name__ == "__main__":
  main()
