"""Measures target/draft forward cost on this machine: T = 1 vs T = k+1 tokens, batch 1, inside jit.

Usage: python -m specjax.train.bench  (prints one JSON line per model shape)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.llama import Llama, LlamaConfig


def step_cost(cfg: LlamaConfig, t: int, cache_len: int = 256, reps: int = 50) -> float:
  """Median seconds of one jitted forward over ``t`` tokens at cache offset ``cache_len // 2``."""
  model = Llama(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  @jax.jit
  def fwd(state, tokens, cache):
    logits, _, cache = nnx.merge(graphdef, state)(tokens, cache)
    return logits, cache

  cache = model.init_cache(1, cache_len).with_lengths(jnp.array([cache_len // 2], jnp.int32))
  tokens = jnp.ones((1, t), jnp.int32)
  jax.block_until_ready(fwd(state, tokens, cache))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fwd(state, tokens, cache))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv):
  vocab = int(argv[1]) if len(argv) > 1 else 4096
  shapes = [  # (d_model, n_layers, n_heads, d_ff)
      (256, 6, 4, 768), (320, 6, 5, 960), (256, 8, 4, 768), (384, 4, 6, 1024), (192, 12, 3, 576),
      (64, 1, 2, 192), (64, 2, 2, 192), (96, 1, 2, 256), (128, 1, 2, 384),
  ]
  for d, layers, heads, ff in shapes:
    cfg = LlamaConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, d_ff=ff, max_seq_len=1024)
    c1, c5 = step_cost(cfg, 1), step_cost(cfg, 5)
    print(json.dumps(dict(d=d, layers=layers, heads=heads, ff=ff, vocab=vocab, params=cfg.num_params,
                          t1_ms=round(c1 * 1e3, 3), t5_ms=round(c5 * 1e3, 3), ratio=round(c5 / c1, 2))),
          flush=True)


if __name__ == "__main__":
  main(sys.argv)
