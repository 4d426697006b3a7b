"""The suite's own set-up (tests/conftest.py) does what it says: every worker reads and writes the run's
persistent compilation cache, whatever it compiles."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp


def test_the_workers_use_the_runs_compilation_cache():
  """JAX reads its cache settings when it is imported: set too late, they are silently ignored (the workers
  then compiled every program afresh, and the cache held only the subprocesses' programs)."""
  folder = os.environ["JAX_COMPILATION_CACHE_DIR"]
  assert jax.config.jax_compilation_cache_dir == folder
  # conftest sets both thresholds to 0 unless the caller chose their own; either way JAX must hold them.
  min_secs = float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
  min_bytes = int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"])
  assert jax.config.jax_persistent_cache_min_compile_time_secs == min_secs
  assert jax.config.jax_persistent_cache_min_entry_size_bytes == min_bytes
  if min_secs > 0 or min_bytes > 0:
    return  # the caller's thresholds may keep a tiny program out of the cache: nothing more to check
  before = set(os.listdir(folder)) if os.path.isdir(folder) else set()
  scale = 1 + int.from_bytes(os.urandom(4), "little") / 2**32  # a constant of its own: a program no run compiled
  jax.jit(lambda x: jnp.sin(x) * scale + 0.5)(jnp.arange(7.0)).block_until_ready()
  assert set(os.listdir(folder)) - before, "a fresh program was not written to the cache"
