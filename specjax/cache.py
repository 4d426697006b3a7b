"""Static, preallocated key/value cache with per-row lengths.

The cache never changes shape during generation. A forward pass over ``T`` tokens writes their keys and
values at each row's own offset (``lengths[b]``) and advances the lengths by ``T``; rolling back rejected
speculative tokens is just setting ``lengths`` to a smaller value: the stale entries beyond a row's length
are masked out by position and overwritten by the next write. No copies, no data-dependent shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sharding
from specjax.sharding import KEYS, ROWS


class CacheSpec(Protocol):
  """What a model config must expose for a cache to be sized for it."""

  n_layers: int
  n_kv_heads: int
  head_dim: int
  dtype: str


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Per-layer keys and values plus the number of valid positions per row.

  Attributes:
    k: one array per layer, ``[B, S, n_kv_heads, head_dim]``.
    v: one array per layer, ``[B, S, n_kv_heads, head_dim]``.
    lengths: ``[B] int32``; positions ``>= lengths[b]`` of row ``b`` are not part of its context.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array

  @classmethod
  def init(cls, spec: CacheSpec, batch: int, max_len: int) -> KVCache:
    """An empty cache for ``batch`` rows of up to ``max_len`` positions each; on a mesh (while a sharded
    program is traced) its buffers are split as :data:`specjax.sharding.KEYS` says: rows over ``data``, KV
    heads over ``model``."""
    if batch < 1:
      raise ValueError(f"batch must be >= 1, got {batch}")
    if max_len < 1:
      raise ValueError(f"max_len must be >= 1, got {max_len}")
    shape = (batch, max_len, spec.n_kv_heads, spec.head_dim)
    dtype = jnp.dtype(spec.dtype)
    zeros = lambda: tuple(sharding.constrain(jnp.zeros(shape, dtype), KEYS) for _ in range(spec.n_layers))
    return cls(k=zeros(), v=zeros(), lengths=sharding.constrain(jnp.zeros((batch,), jnp.int32), ROWS))

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]

  def with_lengths(self, lengths: jax.Array) -> KVCache:
    """The same buffers with new per-row lengths (rollback or advance; no copy)."""
    return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

  def append(self, pending: PendingKV) -> KVCache:
    """The cache with a pass's ``pending`` keys and values written at each row's length and the lengths
    advanced by their ``T`` (what the pass would have returned had it written them itself). Callers guarantee
    ``lengths + T <= max_len``, as for any pass."""
    t = pending.k[0].shape[1]
    write = lambda bufs, news: tuple(write_rows(b, n, self.lengths, KEYS) for b, n in zip(bufs, news))
    return KVCache(k=write(self.k, pending.k), v=write(self.v, pending.v), lengths=self.lengths + t)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingKV:
  """A pass's own keys and values, computed but not yet written into its cache
  (``DecoderLM.forward_pending``); :meth:`KVCache.append` writes them.

  Why: a pass inside one branch of a ``lax.switch`` (a verify window of several possible lengths) that wrote
  the cache would make XLA copy the whole cache through the conditional every round; a pass that only reads it
  returns ``[B, T]`` entries instead, written once after the switch, in place. (SmolLM2-135M on a CPU, 4 rows x
  1,024 positions: a pass cost 24 % more inside a conditional that writes the cache, 14 % more inside one that
  reads it; ``docs/benchmarks.md``, "Verify windows without copying the cache through the switch".)

  Attributes:
    k: one array per layer, ``[B, T, n_kv_heads, head_dim]``.
    v: one array per layer, ``[B, T, n_kv_heads, head_dim]``.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]


def write_rows(buf: jax.Array, new: jax.Array, offsets: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
  """Writes ``new[b]`` into ``buf[b]`` starting at position ``offsets[b]`` (along axis 1).

  Args:
    buf: ``[B, S, ...]``: a cache buffer ``[B, S, H, D]``, or a token history ``[B, S]``.
    names: the buffer's logical axis names (``sharding.KEYS`` for a cache buffer, ``sharding.TOKENS`` for a
      token history), constraining the result's placement on a mesh.
    new: ``[B, T, ...]`` entries for T consecutive positions per row.
    offsets: ``[B] int32`` first position to write, per row. Callers guarantee ``offsets + T <= S``
      (``dynamic_update_slice`` would otherwise clamp the start and shift the write).

  Returns:
    The updated buffer, ``[B, S, ...]``.
  """
  write_one = lambda b, x, o: jax.lax.dynamic_update_slice(b, x.astype(b.dtype), (o,) + (0,) * (b.ndim - 1))
  return sharding.constrain(jax.vmap(write_one)(buf, new, offsets), names)


def cache_bytes(spec: CacheSpec, batch: int, max_len: int) -> int:
  """Bytes a :class:`KVCache` for ``spec`` holds at ``batch`` rows and ``max_len`` positions."""
  per_layer = 2 * batch * max_len * spec.n_kv_heads * spec.head_dim * np.dtype(jnp.dtype(spec.dtype)).itemsize
  return spec.n_layers * per_layer + batch * np.dtype(np.int32).itemsize
