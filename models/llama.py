"""A Llama-family decoder in Flax NNX: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Every specjax model keeps one forward contract::

    model(tokens[B, T], cache) -> (logits[B, T, V] float32, hidden[B, T, D], cache)

Positions come from the cache: row ``b`` places its ``T`` tokens at positions
``cache.lengths[b] .. cache.lengths[b] + T - 1``; the returned cache holds their keys and values and its
lengths are advanced by ``T``. Callers roll back by lowering the lengths (see :mod:`specjax.cache`).

Weights are stored ``[in, out]`` and applied with named einsums. ``hidden`` is the final-norm output, the
input of the LM head (what draft heads such as Medusa and EAGLE read).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.cache import KVCache, write_rows

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture of a Llama-family decoder. Frozen and hashable: it is static under ``jax.jit``.

  ``n_kv_heads`` defaults to ``n_heads`` (no grouping) and ``head_dim`` to ``d_model // n_heads``.
  ``dtype`` is the activation dtype, ``param_dtype`` the storage dtype of the weights.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  d_ff: int
  n_kv_heads: int | None = None
  head_dim: int | None = None
  rope_base: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  max_seq_len: int = 2048
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"LlamaConfig.{name} must be an integer >= 1, got {value!r}")
    if self.n_kv_heads is None:
      object.__setattr__(self, "n_kv_heads", self.n_heads)
    if self.head_dim is None:
      if self.d_model % self.n_heads:
        raise ValueError(
            f"LlamaConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
            "when head_dim is not given")
      object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
    if not isinstance(self.n_kv_heads, int) or not 1 <= self.n_kv_heads <= self.n_heads:
      raise ValueError(
          f"LlamaConfig.n_kv_heads must be in [1, n_heads={self.n_heads}], got {self.n_kv_heads!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
    if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
      raise ValueError(f"LlamaConfig.head_dim must be an even integer >= 2, got {self.head_dim!r}")
    if not self.rope_base > 1.0:
      raise ValueError(f"LlamaConfig.rope_base must be > 1, got {self.rope_base!r}")
    if not self.norm_eps > 0.0:
      raise ValueError(f"LlamaConfig.norm_eps must be > 0, got {self.norm_eps!r}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"LlamaConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")

  def replace(self, **changes: Any) -> LlamaConfig:
    return dataclasses.replace(self, **changes)

  @property
  def num_params(self) -> int:
    """Parameter count (embeddings counted once when tied)."""
    d, f, v = self.d_model, self.d_ff, self.vocab_size
    attn = d * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
    per_layer = attn + 3 * d * f + 2 * d
    return v * d * (1 if self.tie_embeddings else 2) + self.n_layers * per_layer + d


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype: str) -> nnx.Param:
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * fan_in**-0.5)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, param_dtype: str):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotary embedding, half-split convention (as in Llama's reference and Hugging Face).

  Args:
    x: ``[B, T, H, Dh]``.
    positions: ``[B, T] int32``.
  """
  half = x.shape[-1] // 2
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [Dh/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, h, kv, dh, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
    self.wq = _init(rngs, (d, h, dh), d, pd)
    self.wk = _init(rngs, (d, kv, dh), d, pd)
    self.wv = _init(rngs, (d, kv, dh), d, pd)
    self.wo = _init(rngs, (h, dh, d), h * dh, pd)
    self.cfg = cfg

  def __call__(self, x, positions, k_buf, v_buf, offsets):
    """x ``[B, T, D]``, positions ``[B, T]``, buffers ``[B, S, Hkv, Dh]``, offsets ``[B]``."""
    cfg, dt = self.cfg, x.dtype
    q = rope(jnp.einsum("btd,dnh->btnh", x, self.wq[...].astype(dt)), positions, cfg.rope_base)
    k = rope(jnp.einsum("btd,dkh->btkh", x, self.wk[...].astype(dt)), positions, cfg.rope_base)
    v = jnp.einsum("btd,dkh->btkh", x, self.wv[...].astype(dt))
    k_buf, v_buf = write_rows(k_buf, k, offsets), write_rows(v_buf, v, offsets)

    b, t = x.shape[:2]
    groups = cfg.n_heads // cfg.n_kv_heads
    q = q.reshape(b, t, cfg.n_kv_heads, groups, cfg.head_dim)  # [B, T, Hkv, G, Dh]
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k_buf.astype(dt)).astype(jnp.float32)
    scores *= cfg.head_dim**-0.5
    # A query at position p sees the cache positions 0..p of its own row.
    visible = jnp.arange(k_buf.shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bkgts,bskh->btkgh", weights, v_buf.astype(dt)).reshape(b, t, cfg.n_heads, cfg.head_dim)
    return jnp.einsum("btnh,nhd->btd", out, self.wo[...].astype(dt)), k_buf, v_buf


class MLP(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
    self.w_gate = _init(rngs, (d, f), d, pd)
    self.w_up = _init(rngs, (d, f), d, pd)
    self.w_down = _init(rngs, (f, d), f, pd)

  def __call__(self, x):
    dt = x.dtype
    gate = jnp.einsum("btd,df->btf", x, self.w_gate[...].astype(dt))
    up = jnp.einsum("btd,df->btf", x, self.w_up[...].astype(dt))
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.w_down[...].astype(dt))


class Block(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, k_buf, v_buf, offsets):
    a, k_buf, v_buf = self.attn(self.attn_norm(x), positions, k_buf, v_buf, offsets)
    x = x + a
    return x + self.mlp(self.mlp_norm(x)), k_buf, v_buf


class Llama(nnx.Module):
  """Llama-family decoder. See the module docstring for the forward contract."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _init(rngs, (cfg.vocab_size, cfg.d_model), cfg.d_model, cfg.param_dtype)
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _init(rngs, (cfg.d_model, cfg.vocab_size), cfg.d_model, cfg.param_dtype)

  @property
  def config(self) -> LlamaConfig:
    return self.cfg

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    return KVCache.init(self.cfg, batch, max_len)

  def __call__(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, jax.Array, KVCache]:
    """Args: tokens ``[B, T] int32``; cache with ``lengths + T <= max_len``.

    Returns: logits ``[B, T, V] float32``, hidden ``[B, T, D]``, cache advanced by ``T``.
    """
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    offsets = cache.lengths
    positions = offsets[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]  # [B, T]
    x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)  # [B, T, D]
    ks, vs = [], []
    for layer, block in enumerate(self.blocks):
      x, k_buf, v_buf = block(x, positions, cache.k[layer], cache.v[layer], offsets)
      ks.append(k_buf)
      vs.append(v_buf)
    hidden = self.final_norm(x)
    head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
    logits = jnp.einsum("btd,dv->btv", hidden, head.astype(dt)).astype(jnp.float32)
    new_cache = KVCache(k=tuple(ks), v=tuple(vs), lengths=offsets + tokens.shape[1])
    return logits, hidden, new_cache
