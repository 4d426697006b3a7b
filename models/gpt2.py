"""GPT-2 in Flax NNX: learned positions, pre-LayerNorm blocks, fused q/k/v, GELU MLP, biases everywhere.

It keeps the specjax forward contract::

    model(tokens[B, T], cache) -> (logits[B, T, V] float32, hidden[B, T, D], cache)

with positions taken from the :class:`~specjax.cache.KVCache` lengths, exactly as :mod:`models.llama`
does, so it serves as a target or a draft in :func:`specjax.generate` unchanged. The LM head is the
token embedding (GPT-2 always ties them). Weights are stored ``[in, out]``, as in GPT-2's own Conv1D.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import sharding
from specjax.cache import PendingKV, write_rows
from specjax.config import check_int
from specjax.models.llama import (ACTIVATIONS, DecoderLM, activate, attend_along_paths, grouped_attention, pass_positions,
                                  run_blocks)
from specjax.numerics import FLOAT_DTYPES, einsum_f32, per_position_on, positionwise
from specjax.quant import take_rows
from specjax.sharding import KEYS, MLP_HIDDEN, QUERIES, RESIDUAL
from specjax.tree import TreeMask, pending_visibility, visibility


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """Architecture of a GPT-2 decoder. Frozen and hashable: static under ``jax.jit``.

  ``max_seq_len`` is the number of learned positions (``n_positions``); ``d_ff`` defaults to
  ``4 * d_model``. ``attn_scale`` None means ``head_dim ** -0.5``.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  max_seq_len: int = 1024
  d_ff: int | None = None
  norm_eps: float = 1e-5
  activation: str = "gelu_tanh"
  attn_scale: float | None = None
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
      check_int(f"GPT2Config.{name}", getattr(self, name), 1)
    if self.d_model % self.n_heads:
      raise ValueError(f"GPT2Config.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
    if self.d_ff is None:
      object.__setattr__(self, "d_ff", 4 * self.d_model)
    check_int("GPT2Config.d_ff", self.d_ff, 1)
    if not self.norm_eps > 0.0:
      raise ValueError(f"GPT2Config.norm_eps must be > 0, got {self.norm_eps!r}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"GPT2Config.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
    if self.attn_scale is not None and not self.attn_scale > 0.0:
      raise ValueError(f"GPT2Config.attn_scale must be > 0 or None, got {self.attn_scale!r}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in FLOAT_DTYPES:
        raise ValueError(f"GPT2Config.{name} must be one of {FLOAT_DTYPES}, got {getattr(self, name)!r}")

  # What KVCache.init and generate read from every model config.
  @property
  def n_kv_heads(self) -> int:
    return self.n_heads

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def tie_embeddings(self) -> bool:
    return True

  def replace(self, **changes: Any) -> GPT2Config:
    return dataclasses.replace(self, **changes)

  @property
  def num_params(self) -> int:
    d, f = self.d_model, self.d_ff
    per_layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
    return (self.vocab_size + self.max_seq_len) * d + self.n_layers * per_layer + 2 * d


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: str, axes: tuple[str | None, ...]) -> nnx.Param:
  """A normal(0, 0.02) weight whose axes have the logical names ``axes`` (:mod:`specjax.sharding`)."""
  return sharding.param((0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype), axes)


class LayerNorm(nnx.Module):
  """``(x - mean) / sqrt(var + eps) * scale + bias``, computed in float32."""

  def __init__(self, dim: int, eps: float, param_dtype: str):
    self.scale = sharding.param(jnp.ones((dim,), param_dtype), ("embed",))
    self.bias = sharding.param(jnp.zeros((dim,), param_dtype), ("embed",))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
  """Multi-head causal attention with a fused ``[D, 3, H, Dh]`` q/k/v projection (q, k, v in that order)."""

  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    d, h, dh, pd = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.param_dtype
    self.w_qkv = _init(rngs, (d, 3, h, dh), pd, ("embed", None, "heads", "head_dim"))
    self.b_qkv = sharding.param(jnp.zeros((3, h, dh), pd), (None, "heads", "head_dim"))
    self.wo = _init(rngs, (h, dh, d), pd, ("heads", "head_dim", "embed"))
    self.bo = sharding.param(jnp.zeros((d,), pd), ("embed",))
    self.cfg = cfg

  def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``q``, ``k`` and ``v [B, T, H, Dh]`` of ``x [B, T, D]``."""
    dt = x.dtype
    qkv = jnp.einsum("btd,dcnh->cbtnh", x, self.w_qkv[...].astype(dt))
    qkv = qkv + self.b_qkv[...].astype(dt)[:, None, None]  # [3, B, T, H, Dh]
    return sharding.constrain(qkv[0], QUERIES), sharding.constrain(qkv[1], KEYS), sharding.constrain(qkv[2], KEYS)

  def attend(self, q: jax.Array, k_buf: jax.Array, v_buf: jax.Array, visible: jax.Array) -> jax.Array:
    """Attention of ``q [B, T, H, Dh]`` over the buffers where ``visible [B, T, S]``, projected: ``[B, T, D]``."""
    return self.attend_blocks(q, ((k_buf, v_buf, visible),))

  def attend_blocks(self, q: jax.Array, blocks: tuple[tuple[jax.Array, jax.Array, jax.Array], ...],
                    paths: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """:meth:`attend` over several ``(keys, values, visible)`` blocks under one softmax (see
    :func:`specjax.models.llama.grouped_attention`, also for ``paths``)."""
    cfg, dt = self.cfg, q.dtype
    b, t, h, dh = q.shape
    scale = cfg.head_dim**-0.5 if cfg.attn_scale is None else cfg.attn_scale
    out = grouped_attention(q.reshape(b, t, h, 1, dh), blocks, scale, paths=paths)
    out = out.reshape(b, t, h, dh)
    out = sharding.constrain(out, QUERIES)
    out = jnp.einsum("btnh,nhd->btd", out, self.wo[...].astype(dt)) + self.bo[...].astype(dt)
    return sharding.constrain(out, RESIDUAL)

  def __call__(self, x, positions, k_buf, v_buf, offsets, tree=None, write=True):
    """x ``[B, T, D]``, positions ``[B, T]``, buffers ``[B, S, H, Dh]``, offsets ``[B]``; ``tree``: an optional
    :class:`specjax.tree.TreeMask`; ``write``: as for :class:`specjax.models.llama.Attention`."""
    q, k, v = positionwise(self.project, x)
    if not write:
      if tree is not None:
        raise ValueError("only a chain pass may leave the cache unwritten (write=False)")
      visible, own = pending_visibility(positions, offsets, k_buf.shape[1])
      attend = lambda q, visible, own: self.attend_blocks(q, ((k_buf, v_buf, visible), (k, v, own)))
      return positionwise(attend, q, visible, own), k, v
    k_buf, v_buf = write_rows(k_buf, k, offsets, KEYS), write_rows(v_buf, v, offsets, KEYS)
    if per_position_on() and tree is not None and 1 < x.shape[1] == tree.visible.shape[-1]:  # a verify pass's tree
      attend = lambda q, visible, paths, values: self.attend_blocks(q, ((k_buf, values, visible),), paths)
      out = attend_along_paths(attend, q, v, v_buf, offsets, visibility(positions, k_buf.shape[1]), tree)
      return out, k_buf, v_buf
    visible = visibility(positions, k_buf.shape[1], tree)  # [B, T, S]
    return positionwise(lambda q, visible: self.attend(q, k_buf, v_buf, visible), q, visible), k_buf, v_buf


class MLP(nnx.Module):

  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
    self.w_in = _init(rngs, (d, f), pd, ("embed", "mlp"))
    self.b_in = sharding.param(jnp.zeros((f,), pd), ("mlp",))
    self.w_out = _init(rngs, (f, d), pd, ("mlp", "embed"))
    self.b_out = sharding.param(jnp.zeros((d,), pd), ("embed",))
    self.activation = cfg.activation

  def __call__(self, x):
    """``x [B, T, D] -> [B, T, D]``."""
    dt = x.dtype
    h = jnp.einsum("btd,df->btf", x, self.w_in[...].astype(dt)) + self.b_in[...].astype(dt)
    h = sharding.constrain(activate(h, self.activation), MLP_HIDDEN)
    out = jnp.einsum("btf,fd->btd", h, self.w_out[...].astype(dt)) + self.b_out[...].astype(dt)
    return sharding.constrain(out, RESIDUAL)


class Block(nnx.Module):

  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    self.attn_norm = LayerNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = LayerNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, k_buf, v_buf, offsets, tree=None, write=True):
    a, k_buf, v_buf = self.attn(positionwise(self.attn_norm, x), positions, k_buf, v_buf, offsets, tree, write)
    return sharding.constrain(positionwise(self._mlp_part, x, a), RESIDUAL), k_buf, v_buf

  def _mlp_part(self, x, a):
    x = x + a
    return x + self.mlp(self.mlp_norm(x))


class GPT2(DecoderLM):
  """GPT-2 decoder. See the module docstring for the forward contract."""

  def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _init(rngs, (cfg.vocab_size, cfg.d_model), cfg.param_dtype, ("vocab", "embed"))
    self.pos_embed = _init(rngs, (cfg.max_seq_len, cfg.d_model), cfg.param_dtype, (None, "embed"))
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = LayerNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """The token embedding of ``tokens [B, T]`` (without the learned positions): ``[B, T, D]``."""
    return sharding.constrain_rows(take_rows(self.embed[...], tokens).astype(jnp.dtype(self.cfg.dtype)), "embed")

  def unembed(self, hidden: jax.Array) -> jax.Array:
    """The LM head (the tied embedding) on final-norm features ``[..., D]``: logits ``[..., V] float32``."""
    logits = einsum_f32("...d,vd->...v", hidden, self.embed[...])
    return sharding.constrain_rows(logits, "vocab")

  def forward_features(self, tokens: jax.Array, cache: KVCache, aux_layers: tuple[int, ...] = (),
                       tree: TreeMask | None = None, write: bool = True
                       ) -> tuple[jax.Array, jax.Array, jax.Array | None, KVCache | PendingKV]:
    """The forward pass that also returns the residual streams entering ``aux_layers`` (see
    :meth:`specjax.models.llama.Llama.forward_features`).

    Positions at or past ``max_seq_len`` (only ever scratch positions that generate rolls back) reuse
    the last learned position rather than reading out of bounds.
    """
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    positions = pass_positions(tokens, cache, tree)  # [B, T]
    embed = lambda tokens, positions: self.embed_tokens(tokens) + jnp.take(
        self.pos_embed[...], jnp.minimum(positions, cfg.max_seq_len - 1), axis=0).astype(dt)
    x = positionwise(embed, tokens, positions)
    x, cache, aux = run_blocks(self.blocks, x, positions, cache, aux_layers, tree, write)
    hidden = positionwise(self.final_norm, x)
    return positionwise(self.unembed, hidden), hidden, aux, cache

