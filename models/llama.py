"""A Llama-family decoder in Flax NNX: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Optional config fields (all off by default, which is plain Llama) cover the close relatives that share
this skeleton: Mistral (sliding-window attention), Qwen2 (q/k/v biases), Qwen3 (per-head query/key
RMSNorm), Gemma (``1 + w`` norm weights, GELU-tanh, ``sqrt(d_model)`` embedding scale), Gemma 2 (post-norms,
attention and final logit soft-capping, ``query_pre_attn_scalar``, sliding window on alternating layers),
Gemma 3 (query/key norms, a separate rotary base on its local layers), Phi-3 (rotary on part of each head)
and Llama 3's rope scaling.

Every specjax model keeps one forward contract::

    model(tokens[B, T], cache) -> (logits[B, T, V] float32, hidden[B, T, D], cache)

Positions come from the cache: row ``b`` places its ``T`` tokens at positions
``cache.lengths[b] .. cache.lengths[b] + T - 1``; the returned cache holds their keys and values and its
lengths are advanced by ``T``. Callers roll back by lowering the lengths (see :mod:`specjax.cache`).

Weights are stored ``[in, out]`` and applied with named einsums. ``hidden`` is the final-norm output, the
input of the LM head (what draft heads such as Medusa and EAGLE read). Heads on the target use three more
methods that every target model offers: ``embed_tokens(tokens)`` (the scaled token embedding),
``unembed(hidden)`` (the LM head, logits in float32) and ``forward_features(tokens, cache, aux_layers)``,
the forward that also returns the residual streams entering the chosen layers (EAGLE-3 reads three).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import sharding
from specjax.cache import KVCache, PendingKV, write_rows
from specjax.config import check_int
from specjax.numerics import (FLOAT_DTYPES, MATMUL_DTYPES, einsum_f32, per_position_on, positionwise,
                               positionwise_unless, row_invariant, weight_product)
from specjax.quant import take_rows
from specjax.sharding import KEYS, MLP_HIDDEN, QUERIES, RESIDUAL
from specjax.tree import TreeMask, path_slots, pending_visibility, visibility

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
ROPE_SCALINGS = ("linear", "llama3", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Rotary frequency scaling for long contexts. Frozen and hashable (part of a static config).

  ``kind="linear"`` divides every frequency by ``factor`` (position interpolation). ``kind="llama3"``
  divides the low frequencies (wavelength above ``original_max_seq_len / low_freq_factor``) by
  ``factor``, keeps the high ones (wavelength below ``original_max_seq_len / high_freq_factor``) and
  interpolates smoothly in between, as Llama 3.1 does. ``kind="longrope"`` (Phi-3) divides frequency ``i``
  by ``freq_factors[i]`` (the checkpoint's ``short_factor``) and multiplies the rotated entries by
  ``attention_factor``; that is LongRoPE only for sequences of at most ``original_max_seq_len`` positions
  (beyond it the reference switches every position to ``long_factors``), so a config using it must keep
  ``max_seq_len <= original_max_seq_len``. ``long_factors`` is carried only so an export can write it back;
  ``factor`` is unused (1.0).
  """

  kind: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_seq_len: int = 8192
  freq_factors: tuple[float, ...] | None = None
  long_factors: tuple[float, ...] | None = None
  attention_factor: float = 1.0

  def __post_init__(self):
    if self.kind not in ROPE_SCALINGS:
      raise ValueError(f"RopeScaling.kind must be one of {ROPE_SCALINGS}, got {self.kind!r}")
    if not self.factor >= 1.0:
      raise ValueError(f"RopeScaling.factor must be >= 1, got {self.factor!r}")
    if self.kind == "longrope":
      for name in ("freq_factors", "long_factors"):
        value = getattr(self, name)
        if value is not None:
          object.__setattr__(self, name, tuple(float(v) for v in value))
        if name == "freq_factors" and (not value or not all(v > 0 for v in getattr(self, name))):
          raise ValueError(f"RopeScaling.freq_factors must be a non-empty sequence of numbers > 0, got {value!r}")
      if not 0.0 < self.attention_factor < float("inf"):
        raise ValueError(f"RopeScaling.attention_factor must be a finite number > 0, got {self.attention_factor!r}")
    if self.kind in ("llama3", "longrope"):
      if not isinstance(self.original_max_seq_len, int) or self.original_max_seq_len < 1:
        raise ValueError(
            f"RopeScaling.original_max_seq_len must be an integer >= 1, got {self.original_max_seq_len!r}")
    if self.kind == "llama3":
      if not 0.0 < self.low_freq_factor < self.high_freq_factor:
        raise ValueError(
            "RopeScaling needs 0 < low_freq_factor < high_freq_factor, got "
            f"{self.low_freq_factor!r} and {self.high_freq_factor!r}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture of a Llama-family decoder. Frozen and hashable: it is static under ``jax.jit``.

  ``n_kv_heads`` defaults to ``n_heads`` (no grouping) and ``head_dim`` to ``d_model // n_heads``.
  ``dtype`` is the activation dtype, ``param_dtype`` the storage dtype of the weights.

  Family options (defaults are plain Llama):
    rope_scaling: a :class:`RopeScaling`, or None.
    qkv_bias: q, k and v projections carry biases (Qwen2).
    activation: the MLP gate activation, one of ``ACTIVATIONS`` (Gemma: ``"gelu_tanh"``).
    norm_offset: RMSNorm multiplies by ``norm_offset + scale`` (Gemma stores ``w`` and uses ``1 + w``).
    embed_scale: token embeddings are multiplied by this (Gemma: ``sqrt(d_model)``), in ``dtype``.
    attn_scale: query-key scale; None means ``head_dim ** -0.5`` (Gemma 2: ``query_pre_attn_scalar**-0.5``).
    attn_softcap: attention scores become ``c * tanh(s / c)`` before masking (Gemma 2), or None.
    final_softcap: logits become ``c * tanh(l / c)`` (Gemma 2), or None.
    post_norms: an extra RMSNorm on the attention output and on the MLP output before each residual add
      (Gemma 2).
    sliding_window: a query at position p sees only positions ``> p - sliding_window``, or None.
    sliding_layers: per layer, whether ``sliding_window`` applies; None means every layer.
    qk_norm: an RMSNorm over each query and key head (``head_dim`` weights, ``norm_offset`` as the other
      norms) before the rotary embedding (Qwen3, Gemma 3).
    local_rope_base: the rotary base of the sliding-window layers, which then rotate with no
      ``rope_scaling`` (Gemma 3's local layers); None: every layer uses ``rope_base`` and ``rope_scaling``.
    rotary_dim: the rotary embedding turns only the first ``rotary_dim`` entries of each head, the rest
      pass unchanged (``partial_rotary_factor``); None (or ``head_dim``): the whole head.

  Precision:
    matmul_dtype: None (products in ``dtype``), or ``"bfloat16"``: mixed precision, with float32 activations
      and (usually) bfloat16 weights, each weight product takes bfloat16 operands and accumulates in float32
      (:func:`specjax.numerics.weight_product`); norms, attention, softmax and logits stay float32. On XLA:CPU
      a verify window then costs about what a one-token step does, and each product rounds a row alike in both,
      so a verify pass with only attention and the norms taken position by position is bit for bit the
      one-token steps (the engine verifies such a target so by itself: ``engine.always_invariant``).
      ``specjax.load(..., dtype="mixed")`` makes such a model.
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
  rope_scaling: RopeScaling | None = None
  qkv_bias: bool = False
  activation: str = "silu"
  norm_offset: float = 0.0
  embed_scale: float = 1.0
  attn_scale: float | None = None
  attn_softcap: float | None = None
  final_softcap: float | None = None
  post_norms: bool = False
  sliding_window: int | None = None
  sliding_layers: tuple[bool, ...] | None = None
  qk_norm: bool = False
  local_rope_base: float | None = None
  rotary_dim: int | None = None
  matmul_dtype: str | None = None

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
      check_int(f"LlamaConfig.{name}", getattr(self, name), 1)
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
    if self.local_rope_base is not None and not self.local_rope_base > 1.0:
      raise ValueError(f"LlamaConfig.local_rope_base must be > 1 or None, got {self.local_rope_base!r}")
    if self.rotary_dim == self.head_dim:
      object.__setattr__(self, "rotary_dim", None)
    rd = self.rotary_dim
    if rd is not None and (not isinstance(rd, int) or isinstance(rd, bool) or rd < 2 or rd % 2
                           or rd > self.head_dim):
      raise ValueError(
          f"LlamaConfig.rotary_dim must be an even integer in [2, head_dim={self.head_dim}] or None, got {rd!r}")
    if not self.norm_eps > 0.0:
      raise ValueError(f"LlamaConfig.norm_eps must be > 0, got {self.norm_eps!r}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in FLOAT_DTYPES:
        raise ValueError(f"LlamaConfig.{name} must be one of {FLOAT_DTYPES}, got {getattr(self, name)!r}")
    if self.matmul_dtype not in MATMUL_DTYPES:
      raise ValueError(f"LlamaConfig.matmul_dtype must be one of {MATMUL_DTYPES}, got {self.matmul_dtype!r}")
    if self.matmul_dtype is not None and self.dtype != "float32":
      raise ValueError(f"LlamaConfig.matmul_dtype={self.matmul_dtype!r} needs float32 activations (dtype), got "
                       f"dtype={self.dtype!r}")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"LlamaConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
    if self.rope_scaling is not None and self.rope_scaling.kind == "longrope":
      scaling, pairs = self.rope_scaling, (self.rotary_dim or self.head_dim) // 2
      if len(scaling.freq_factors) != pairs:
        raise ValueError(f"LlamaConfig.rope_scaling.freq_factors must hold one factor per rotary pair ({pairs}), "
                         f"got {len(scaling.freq_factors)}")
      if self.max_seq_len > scaling.original_max_seq_len:
        raise ValueError(
            f"LlamaConfig.max_seq_len ({self.max_seq_len}) must be <= rope_scaling.original_max_seq_len "
            f"({scaling.original_max_seq_len}): longrope's short factors hold only that far")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"LlamaConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
    for name in ("embed_scale", "attn_scale", "attn_softcap", "final_softcap"):
      value = getattr(self, name)
      if value is None and name != "embed_scale":
        continue
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < float("inf"):
        raise ValueError(f"LlamaConfig.{name} must be a finite number > 0, got {value!r}")
    window = self.sliding_window
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
      raise ValueError(f"LlamaConfig.sliding_window must be an integer >= 1 or None, got {window!r}")
    if self.sliding_layers is not None:
      object.__setattr__(self, "sliding_layers", tuple(bool(b) for b in self.sliding_layers))
      if len(self.sliding_layers) != self.n_layers:
        raise ValueError(
            f"LlamaConfig.sliding_layers must have one entry per layer (n_layers={self.n_layers}), "
            f"got {len(self.sliding_layers)}")

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of ``layer``, or None when it attends to the whole context."""
    if self.sliding_layers is not None and not self.sliding_layers[layer]:
      return None
    return self.sliding_window

  def replace(self, **changes: Any) -> LlamaConfig:
    return dataclasses.replace(self, **changes)

  @property
  def num_params(self) -> int:
    """Parameter count (embeddings counted once when tied)."""
    d, f, v = self.d_model, self.d_ff, self.vocab_size
    attn = d * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
    if self.qkv_bias:
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
    if self.qk_norm:
      attn += 2 * self.head_dim
    per_layer = attn + 3 * d * f + (4 if self.post_norms else 2) * d
    return v * d * (1 if self.tie_embeddings else 2) + self.n_layers * per_layer + d


def init_param(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype: str, axes: tuple[str | None, ...]
               ) -> nnx.Param:
  """A normal(0, 1 / fan_in) weight whose axes have the logical names ``axes`` (:mod:`specjax.sharding`)."""
  value = jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * fan_in**-0.5
  return sharding.param(value, axes)


class RMSNorm(nnx.Module):
  """``x / rms(x) * (offset + scale)``, computed in float32. ``offset`` is 0 (Llama) or 1 (Gemma)."""

  def __init__(self, dim: int, eps: float, param_dtype: str, offset: float = 0.0, axis: str = "embed"):
    self.scale = sharding.param(jnp.full((dim,), 1.0 - offset, param_dtype), (axis,))
    self.eps = eps
    self.offset = offset

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    if self.offset:
      scale = self.offset + scale
    return (y * scale).astype(x.dtype)


def rope_frequencies(head_dim: int, base: float, scaling: RopeScaling | None = None) -> jax.Array:
  """The rotary inverse frequencies ``[head_dim // 2] float32``, scaled as ``scaling`` says."""
  half = head_dim // 2
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [Dh/2]
  if scaling is None:
    return inv_freq
  if scaling.kind == "linear":
    return inv_freq / scaling.factor
  if scaling.kind == "longrope":
    return inv_freq / jnp.asarray(scaling.freq_factors, jnp.float32)
  # llama3: low frequencies divided by factor, high ones kept, a smooth ramp between.
  wavelen = 2 * jnp.pi / inv_freq
  old = scaling.original_max_seq_len
  low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
  smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  return jnp.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), smoothed, scaled)


def rope(x: jax.Array, positions: jax.Array, base: float, scaling: RopeScaling | None = None,
         rotary_dim: int | None = None) -> jax.Array:
  """Rotary embedding, half-split convention (as in Llama's reference and Hugging Face).

  Args:
    x: ``[B, T, H, Dh]``.
    positions: ``[B, T] int32``.
    base: the rotary base (``rope_theta``). scaling: optional frequency scaling.
    rotary_dim: rotate only ``x[..., :rotary_dim]`` (frequencies as for a head of that size) and pass the
      rest through (partial rotary, as Phi-3 and GPT-NeoX); None: all of ``Dh``.

  ``scaling.attention_factor`` (LongRoPE) multiplies the rotated entries, not the passed-through ones.
  """
  dim = x.shape[-1] if rotary_dim is None else rotary_dim
  half = dim // 2
  inv_freq = rope_frequencies(dim, base, scaling)  # [R/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  if scaling is not None and scaling.attention_factor != 1.0:  # longrope scales the rotated entries
    cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:dim].astype(jnp.float32)
  turned = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
  if dim < x.shape[-1]:
    turned.append(x[..., dim:].astype(jnp.float32))
  return jnp.concatenate(turned, axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query causal attention over a :class:`KVCache` layer.

  ``in_dim`` (default ``d_model``) is the width of the input (EAGLE-3's head projects q, k and v from
  ``2 * d_model``); the output is always ``d_model`` wide. ``first``: cache positions below it are never
  visible (a head whose cache starts with placeholder positions). ``local_rope``: rotate with
  ``cfg.local_rope_base`` and no scaling (a Gemma 3 local layer) instead of ``cfg.rope_base``.
  """

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, window: int | None = None, in_dim: int | None = None,
               first: int = 0, local_rope: bool = False):
    d, h, kv, dh, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
    d_in = d if in_dim is None else in_dim
    self.wq = init_param(rngs, (d_in, h, dh), d_in, pd, ("embed", "heads", "head_dim"))
    self.wk = init_param(rngs, (d_in, kv, dh), d_in, pd, ("embed", "kv_heads", "head_dim"))
    self.wv = init_param(rngs, (d_in, kv, dh), d_in, pd, ("embed", "kv_heads", "head_dim"))
    self.wo = init_param(rngs, (h, dh, d), h * dh, pd, ("heads", "head_dim", "embed"))
    if cfg.qkv_bias:
      self.bq = sharding.param(jnp.zeros((h, dh), pd), ("heads", "head_dim"))
      self.bk = sharding.param(jnp.zeros((kv, dh), pd), ("kv_heads", "head_dim"))
      self.bv = sharding.param(jnp.zeros((kv, dh), pd), ("kv_heads", "head_dim"))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(dh, cfg.norm_eps, pd, cfg.norm_offset, axis="head_dim")
      self.k_norm = RMSNorm(dh, cfg.norm_eps, pd, cfg.norm_offset, axis="head_dim")
    self.cfg = cfg
    self.local_rope = local_rope
    self.window = window
    self.first = first

  def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values of ``x [B, T, D_in]`` at ``positions [B, T]``, rotary applied:
    ``q [B, T, H, Dh]``, ``k`` and ``v [B, T, Hkv, Dh]``."""
    cfg, dt, md = self.cfg, x.dtype, self.cfg.matmul_dtype
    q = weight_product("btd,dnh->btnh", x, self.wq[...], md)
    k = weight_product("btd,dkh->btkh", x, self.wk[...], md)
    v = weight_product("btd,dkh->btkh", x, self.wv[...], md)
    if cfg.qkv_bias:
      q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
    if cfg.qk_norm:  # per head, before the rotation (position by position: see Block._mlp_part)
      q, k = positionwise(self.q_norm, q), positionwise(self.k_norm, k)
    base, scaling = (cfg.local_rope_base, None) if self.local_rope else (cfg.rope_base, cfg.rope_scaling)
    q = sharding.constrain(rope(q, positions, base, scaling, cfg.rotary_dim), QUERIES)
    k = sharding.constrain(rope(k, positions, base, scaling, cfg.rotary_dim), KEYS)
    return q, k, sharding.constrain(v, KEYS)

  def attend(self, q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array) -> jax.Array:
    """Attention of ``q [B, T, H, Dh]`` over ``keys``/``values [B, S, Hkv, Dh]`` where ``visible [B, T, S]``,
    then the output projection: ``[B, T, D]``."""
    return self.attend_blocks(q, ((keys, values, visible),))

  def attend_blocks(self, q: jax.Array, blocks: tuple[tuple[jax.Array, jax.Array, jax.Array], ...]) -> jax.Array:
    """:meth:`attend` over several blocks ``(keys [B, S_i, Hkv, Dh], values, visible [B, T, S_i])`` under one
    softmax, as if they were concatenated on the key axis (without copying them into one buffer)."""
    return self.output(self.attention(q, blocks))

  def attention(self, q: jax.Array, blocks: tuple[tuple[jax.Array, jax.Array, jax.Array], ...],
                paths: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """:meth:`attend_blocks` before the output projection: ``[B, T, H, Dh]`` (``paths``: see
    :func:`grouped_attention`)."""
    cfg = self.cfg
    b, t = q.shape[:2]
    scale = cfg.head_dim**-0.5 if cfg.attn_scale is None else cfg.attn_scale
    q = q.reshape(b, t, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)  # [B, T, Hkv, G, Dh]
    out = grouped_attention(q, blocks, scale, cfg.attn_softcap, paths)
    out = out.reshape(b, t, cfg.n_heads, cfg.head_dim)
    return sharding.constrain(out, QUERIES)

  def output(self, out: jax.Array) -> jax.Array:
    """The output projection of attention's ``[B, T, H, Dh]``: ``[B, T, D]``."""
    return sharding.constrain(weight_product("btnh,nhd->btd", out, self.wo[...], self.cfg.matmul_dtype), RESIDUAL)

  def __call__(self, x, positions, k_buf, v_buf, offsets, gap=None, tree=None, write=True):
    """x ``[B, T, D_in]``, positions ``[B, T]``, buffers ``[B, S, Hkv, Dh]``, offsets ``[B]``.

    ``gap``: optional ``(start [B], stop [B])``: cache positions in ``[start, stop)`` are not visible (a chain
    head's entries that hold guesses rather than context; see :mod:`specjax.proposers.chain`). ``tree``: a
    :class:`specjax.tree.TreeMask` when the tokens are tree nodes (each sees its ancestors, not the window).
    ``write`` (static): False reads the buffers only and returns the pass's own keys and values ``[B, T, Hkv,
    Dh]`` in their place (a chain pass at ``offsets``; see :class:`specjax.cache.PendingKV`).
    """
    invariant = row_invariant(self.cfg)  # products round alike in any window: only attention (and norms) go per position
    q, k, v = positionwise_unless(invariant, self.project, x, positions)
    in_order = (per_position_on() and tree is not None and write and gap is None
                and 1 < x.shape[1] == tree.visible.shape[-1])  # a verify pass's tree: see attend_along_paths
    if write:
      k_buf, v_buf = write_rows(k_buf, k, offsets, KEYS), write_rows(v_buf, v, offsets, KEYS)
      # A query at position p sees the cache positions 0..p of its own row (p - window + 1..p if windowed).
      # In order, a node sees the cache as the one-token steps along its path do.
      visible = visibility(positions, k_buf.shape[1], None if in_order else tree, self.window, self.first)
    else:
      if tree is not None or gap is not None:
        raise ValueError("only a chain pass without a gap may leave the cache unwritten (write=False)")
      visible, own = pending_visibility(positions, offsets, k_buf.shape[1], self.window, self.first)
    if gap is not None:
      cache_pos = jnp.arange(k_buf.shape[1])[None, None, :]  # [1, 1, S]
      visible &= ~((cache_pos >= gap[0][:, None, None]) & (cache_pos < gap[1][:, None, None]))
    if in_order:
      attend = lambda q, visible, paths, values: self.attention(q, ((k_buf, values, visible),), paths)
      out = attend_along_paths(attend, q, v, v_buf, offsets, visible, tree)
      return (self.output(out) if invariant else positionwise(self.output, out)), k_buf, v_buf
    if write:
      core, masks = (lambda q, visible: self.attention(q, ((k_buf, v_buf, visible),))), (visible,)
    else:
      core, masks = (lambda q, visible, own: self.attention(q, ((k_buf, v_buf, visible), (k, v, own)))), (visible, own)
    if invariant:
      out = self.output(positionwise(core, q, *masks))
    else:
      out = positionwise(lambda q, *masks: self.output(core(q, *masks)), q, *masks)
    return (out, k_buf, v_buf) if write else (out, k, v)


PADDED_MAX_QUERIES = 32  # passes of at most this many tokens over caches of at least PADDED_MIN_POSITIONS
PADDED_MIN_POSITIONS = 512  # attend with head-padded queries (grouped_attention)


def attend_along_paths(attend, q: jax.Array, v: jax.Array, v_buf: jax.Array, offsets: jax.Array, visible: jax.Array,
                       tree: TreeMask) -> jax.Array:
  """A tree verify pass's attention under :func:`specjax.numerics.per_position`, ``[B, T, ...]``: each node's
  computed as the one-token steps that decode its path compute it.

  The pass writes its nodes at ``offsets + slot``, so a node's ancestors sit among its masked siblings, where
  the one-token steps have the path at ``offsets .. offsets + depth``. The masked entries add exact zeros, but
  attention's sums group their terms by index, so the two round apart and a near tie of the logits can go the
  other way (a greedy tree departing from the target alone in mixed precision). Here each node's scores of the
  region are taken in its path's order (:func:`specjax.tree.path_slots`; a score does not depend on where its
  key lies) and its values lie so too, under the one-token step's mask (``visible``: without the tree): the same
  vectors, bit for bit. The values are laid out once per pass (:func:`values_layout`, the transposition a pass
  makes anyway) and a scan over the nodes rewrites their region with each node's path before its attention (``T``
  entries in place: no node copies the buffer).

  Args:
    attend: ``attend(q [B, 1, ...], visible [B, 1, S], paths, values) -> [B, 1, ...]``, one node's attention
      (``paths``: as :func:`grouped_attention` takes it).
    q: the nodes' queries ``[B, T, ...]``; v: their values ``[B, T, Hkv, Dh]``; v_buf: the cache's values;
    offsets: ``[B]`` where the pass writes (the tree's ``start``).
  """
  padded = head_padded(1, v_buf.shape[1])
  slots = path_slots(tree)  # [B, T, T]
  per_node = lambda x: jnp.moveaxis(x, 1, 0)[:, :, None]  # [B, T, ...] -> [T, B, 1, ...]

  def node(laid, xs):
    q, visible, slots = xs
    laid = write_values(laid, jnp.take_along_axis(v, slots[:, 0, :, None, None], axis=1), offsets, padded)
    return laid, attend(q, visible, (offsets, slots), laid)

  _, outs = jax.lax.scan(node, values_layout(v_buf, padded, q.dtype), tuple(map(per_node, (q, visible, slots))))
  return jnp.moveaxis(outs[:, :, 0], 0, 1)


def head_padded(queries: int, positions: int) -> bool:
  """Whether :func:`grouped_attention` takes ``queries`` over ``positions`` with head-padded queries."""
  return queries <= PADDED_MAX_QUERIES and positions >= PADDED_MIN_POSITIONS and not sharding.placed()


def values_layout(values: jax.Array, padded: bool, dtype) -> jax.Array:
  """Values ``[B, S, Hkv, Dh]`` as :func:`grouped_attention`'s sum over them reads them: ``[B, S, Hkv * Dh]``
  with head-padded queries, else ``[B, Hkv, Dh, S]`` (the layout XLA:CPU gives that product's operand)."""
  b, s, kv, dh = values.shape
  return (values.reshape(b, s, kv * dh) if padded else jnp.moveaxis(values, 1, 3)).astype(dtype)


def write_values(laid: jax.Array, values: jax.Array, offsets: jax.Array, padded: bool) -> jax.Array:
  """:func:`values_layout`'s buffer ``laid`` with ``values [B, T, Hkv, Dh]``, laid out alike, written at each row's
  ``offsets`` (along the positions)."""
  new = values_layout(values, padded, laid.dtype)
  axis = 1 if padded else 3
  write = lambda buf, x, o: jax.lax.dynamic_update_slice_in_dim(buf, x, o, axis=axis - 1)
  return jax.vmap(write)(laid, new, offsets)


def grouped_attention(q: jax.Array, blocks: tuple[tuple[jax.Array, jax.Array, jax.Array], ...], scale: float,
                      softcap: float | None = None, paths: tuple[jax.Array, jax.Array] | None = None
                      ) -> jax.Array:
  """Softmax attention of grouped queries ``q [B, T, Hkv, G, Dh]`` over key/value blocks ``(keys [B, S_i, Hkv,
  Dh], values, visible [B, T, S_i])`` under one softmax (scores in float32, scaled, soft-capped, masked):
  ``[B, T, Hkv, G, Dh]`` in ``q``'s dtype. Shared by every model family.

  Two ways to the same products, chosen statically. By default each KV head is contracted apart (batch
  dimensions ``B, Hkv``), which makes XLA:CPU copy each cache buffer into ``[B, Hkv, S, Dh]`` at every pass. A
  short pass (at most :data:`PADDED_MAX_QUERIES` tokens: a decode step, a verify window) over a long cache (at
  least :data:`PADDED_MIN_POSITIONS` positions in the largest block), off a mesh, instead pads each query row to
  all KV heads, zeros outside its own (``[B, T·Hkv·G, Hkv·Dh]``), and contracts against the cache in its own
  layout (``[B, S, Hkv·Dh]``, batch dimension ``B`` only): Hkv times the multiply-adds, which a memory-bound pass
  does not notice, and no copy. On this CPU, SmolLM2-135M decoded 1.05x (alone) and 1.11x (with its head and a
  cutoff) faster so after 512-token prompts at 2 rows, but 2-10 % slower after short prompts (caches of ~150
  positions), hence the bound on positions, placed between those two measurements (the crossover was not
  located; ``docs/benchmarks.md``, "Attention without the cache's transposition"). The two agree to float
  rounding (another summation order).

  ``paths``: ``(start [B], slots [B, T, W])`` (:func:`attend_along_paths`): query t's scores of the keys at
  ``start .. start + W - 1`` are taken in the order ``slots[:, t]`` (``visible`` then says which of the
  reordered keys it sees); the one block's values are given as :func:`values_layout` lays them out, in that order.
  """
  laid_out = paths is not None
  b, t, kv, g, dh = q.shape
  dt = q.dtype
  positions = max(keys.shape[1] for keys, _, _ in blocks)
  padded = head_padded(t, positions)
  if padded:
    eye = jnp.eye(kv, dtype=dt)[None, None, :, None, :, None]  # query head x cache head
    rows = (q[:, :, :, :, None, :] * eye).reshape(b, t * kv * g, kv * dh)
    flat = lambda x: x.reshape(b, x.shape[1], kv * dh).astype(dt)  # [B, S, Hkv*Dh]: the buffer's own layout
    product = lambda keys: jnp.einsum("bmd,bsd->bms", rows, flat(keys)).reshape(b, t, kv, g, keys.shape[1])
    spread = lambda x: x[:, :, None, None, :]  # [B, T, S] -> the scores' [B, T, Hkv, G, S]

    def weighted(w, values):
      values = values.astype(dt) if laid_out else flat(values)
      out = jnp.einsum("bms,bsd->bmd", w.reshape(b, t * kv * g, -1), values).reshape(b, t, kv, g, kv, dh)
      return jnp.moveaxis(jnp.diagonal(out, axis1=2, axis2=4), -1, 2)  # each query row's own head
  else:
    product = lambda keys: jnp.einsum("btkgh,bskh->bkgts", q, keys.astype(dt))
    spread = lambda x: x[:, None, None]  # [B, T, S] -> the scores' [B, Hkv, G, T, S]
    weighted = lambda w, values: jnp.einsum("bkgts," + ("bkhs" if laid_out else "bskh") + "->btkgh", w,
                                            values.astype(dt))
  if paths is not None and len(blocks) != 1:
    raise ValueError(f"attention along paths takes one block of keys, got {len(blocks)}")

  def along_paths(s):  # the scores of each query's region in its path's order
    start, slots = paths
    width = slots.shape[-1]
    region = jax.vmap(lambda row, at: jax.lax.dynamic_slice_in_dim(row, at, width, axis=-1))(s, start)
    region = jnp.take_along_axis(region, jnp.broadcast_to(spread(slots), region.shape), axis=-1)
    return jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice_in_dim(row, new, at, axis=-1))(s, region, start)

  def scores(keys, visible):
    s = product(keys).astype(jnp.float32) * scale
    if softcap is not None:
      s = softcap * jnp.tanh(s / softcap)
    if paths is not None:
      s = along_paths(s)
    return jnp.where(spread(visible), s, jnp.finfo(jnp.float32).min)

  parts = [scores(keys, visible) for keys, _, visible in blocks]
  weights = jax.nn.softmax(jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0], axis=-1).astype(dt)
  bounds = np.cumsum([part.shape[-1] for part in parts])[:-1]
  outs = [weighted(w, values) for w, (_, values, _) in zip(jnp.split(weights, bounds, axis=-1), blocks)]
  return functools.reduce(operator.add, outs)


class MLP(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
    self.w_gate = init_param(rngs, (d, f), d, pd, ("embed", "mlp"))
    self.w_up = init_param(rngs, (d, f), d, pd, ("embed", "mlp"))
    self.w_down = init_param(rngs, (f, d), f, pd, ("mlp", "embed"))
    self.activation = cfg.activation
    self.matmul_dtype = cfg.matmul_dtype

  def __call__(self, x):
    """``x [B, T, D] -> [B, T, D]``: SwiGLU (or the configured gate activation)."""
    md = self.matmul_dtype
    gate = sharding.constrain(weight_product("btd,df->btf", x, self.w_gate[...], md), MLP_HIDDEN)
    up = sharding.constrain(weight_product("btd,df->btf", x, self.w_up[...], md), MLP_HIDDEN)
    out = weight_product("btf,fd->btd", activate(gate, self.activation) * up, self.w_down[...], md)
    return sharding.constrain(out, RESIDUAL)


def activate(x: jax.Array, name: str) -> jax.Array:
  """The named activation (one of ``ACTIVATIONS``; ``gelu_tanh`` is GELU's tanh approximation)."""
  if name == "silu":
    return jax.nn.silu(x)
  return jax.nn.gelu(x, approximate=name == "gelu_tanh")


class Block(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, layer: int = 0, first: int = 0):
    norm = lambda: RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, cfg.norm_offset)
    self.attn_norm = norm()
    local_rope = cfg.local_rope_base is not None and cfg.layer_window(layer) is not None
    self.attn = Attention(cfg, rngs, window=cfg.layer_window(layer), first=first, local_rope=local_rope)
    self.mlp_norm = norm()
    self.mlp = MLP(cfg, rngs)
    if cfg.post_norms:
      self.post_attn_norm = norm()
      self.post_mlp_norm = norm()
    self.post_norms = cfg.post_norms
    self.row_invariant = row_invariant(cfg)

  def __call__(self, x, positions, k_buf, v_buf, offsets, gap=None, tree=None, write=True):
    a, k_buf, v_buf = self.attn(positionwise(self.attn_norm, x), positions, k_buf, v_buf, offsets, gap, tree, write)
    return sharding.constrain(positionwise_unless(self.row_invariant, self._mlp_part, x, a), RESIDUAL), k_buf, v_buf

  def _mlp_part(self, x, a):
    # The norms go position by position under per_position even where the rest runs on the whole window (a
    # row-invariant model): XLA:CPU's row reductions round some rows differently from 9 rows up.
    m_in = x + (positionwise(self.post_attn_norm, a) if self.post_norms else a)
    m = self.mlp(positionwise(self.mlp_norm, m_in))
    return m_in + (positionwise(self.post_mlp_norm, m) if self.post_norms else m)


class DecoderLM(nnx.Module):
  """The forward contract every specjax model family keeps, written once over its ``forward_features``
  (see the module docstring): ``model(tokens, cache) -> (logits, hidden, cache)`` and ``init_cache``."""

  cfg: Any

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    return KVCache.init(self.cfg, batch, max_len)

  def __call__(self, tokens: jax.Array, cache: KVCache, tree: TreeMask | None = None
               ) -> tuple[jax.Array, jax.Array, KVCache]:
    """Args: tokens ``[B, T] int32``; cache with ``lengths + T <= max_len``; ``tree``: the tokens are tree
    nodes at ``tree.positions``, each attending to its ancestors (:class:`specjax.tree.TreeMask`).

    Returns: logits ``[B, T, V] float32``, hidden ``[B, T, D]``, cache advanced by ``T``.
    """
    logits, hidden, _, cache = self.forward_features(tokens, cache, tree=tree)
    return logits, hidden, cache

  def forward_pending(self, tokens: jax.Array, cache: KVCache, aux_layers: tuple[int, ...] = ()
                      ) -> tuple[jax.Array, jax.Array, jax.Array | None, PendingKV]:
    """``forward_features`` over a chain of ``tokens [B, T]`` that reads the cache and does not write it:
    logits, hidden and aux as there, and the pass's keys and values as a :class:`specjax.cache.PendingKV`
    (``cache.append(pending)`` is then the cache ``forward_features`` returns). Equal to ``forward_features``
    up to float rounding (one softmax over the cache and the pass's own keys, summed in another order)."""
    return self.forward_features(tokens, cache, aux_layers, write=False)


class Llama(DecoderLM):
  """Llama-family decoder. See the module docstring for the forward contract."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = init_param(rngs, (cfg.vocab_size, cfg.d_model), cfg.d_model, cfg.param_dtype, ("vocab", "embed"))
    self.blocks = nnx.List([Block(cfg, rngs, layer) for layer in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, cfg.norm_offset)
    if not cfg.tie_embeddings:
      self.lm_head = init_param(rngs, (cfg.d_model, cfg.vocab_size), cfg.d_model, cfg.param_dtype, ("embed", "vocab"))

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """The input embedding of ``tokens [B, T]``: ``[B, T, D]`` in the activation dtype (scaled for Gemma)."""
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    x = take_rows(self.embed[...], tokens).astype(dt)
    if cfg.embed_scale != 1.0:
      x = x * jnp.asarray(cfg.embed_scale, dt)
    return sharding.constrain_rows(x, "embed")

  def unembed(self, hidden: jax.Array) -> jax.Array:
    """The LM head on final-norm features ``[..., D]``: logits ``[..., V] float32`` (soft-capped for Gemma 2)."""
    cfg = self.cfg
    if cfg.matmul_dtype is not None:
      logits = (weight_product("...d,vd->...v", hidden, self.embed[...], cfg.matmul_dtype) if cfg.tie_embeddings
                else weight_product("...d,dv->...v", hidden, self.lm_head[...], cfg.matmul_dtype))
    else:
      logits = einsum_f32("...d,dv->...v", hidden, self.embed[...].T if cfg.tie_embeddings else self.lm_head[...])
    if cfg.final_softcap is not None:
      logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return sharding.constrain_rows(logits, "vocab")

  def forward_features(self, tokens: jax.Array, cache: KVCache, aux_layers: tuple[int, ...] = (),
                       tree: TreeMask | None = None, write: bool = True
                       ) -> tuple[jax.Array, jax.Array, jax.Array | None, KVCache | PendingKV]:
    """The forward pass that also returns the residual streams entering ``aux_layers`` (static); ``tree``
    as in ``__call__``; ``write=False``: see :meth:`forward_pending`.

    Returns: logits ``[B, T, V] float32``, hidden ``[B, T, D]``, aux ``[B, T, len(aux_layers) * D]``
    (None when ``aux_layers`` is empty), and the cache advanced by ``T``.
    """
    positions = pass_positions(tokens, cache, tree)
    invariant = row_invariant(self.cfg)
    x, cache, aux = run_blocks(self.blocks, positionwise_unless(invariant, self.embed_tokens, tokens), positions, cache,
                               aux_layers, tree, write)
    hidden = positionwise(self.final_norm, x)
    return positionwise_unless(invariant, self.unembed, hidden), hidden, aux, cache



def check_aux_layers(aux_layers: tuple[int, ...], n_layers: int, where: str = "aux_layers") -> tuple[int, ...]:
  """Validates layer ids whose incoming residual streams a head reads: distinct, increasing, in
  ``[0, n_layers)``. Raises ValueError naming ``where``, the value and the target's depth."""
  layers = tuple(aux_layers)
  bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers]
  if bad:
    raise ValueError(f"{where} must be layer ids in [0, {n_layers}) (the target has n_layers={n_layers}), "
                     f"got {bad[0]!r} in {layers}")
  if list(layers) != sorted(set(layers)):
    raise ValueError(f"{where} must be distinct and increasing, got {layers}")
  return layers


def pass_positions(tokens: jax.Array, cache: KVCache, tree: TreeMask | None) -> jax.Array:
  """``[B, T] int32``: where a pass's tokens sit: ``lengths .. lengths + T - 1``, or the tree's positions."""
  if tree is not None:
    return tree.positions
  return cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]


def run_blocks(blocks, x: jax.Array, positions: jax.Array, cache: KVCache, aux_layers: tuple[int, ...] = (),
               tree: TreeMask | None = None, write: bool = True
               ) -> tuple[jax.Array, KVCache | PendingKV, jax.Array | None]:
  """Runs the decoder blocks over ``x [B, T, D]`` with the cache; shared by every model family.

  Each block is called as ``block(x, positions, k_buf, v_buf, offsets, tree=tree, write=write) -> (x, k, v)``.

  Returns: the residual stream after the last block ``[B, T, D]``, the cache advanced by ``T`` (``write``
  False: the cache untouched and the pass's keys and values as a :class:`PendingKV` instead), and the
  streams entering the blocks in ``aux_layers`` concatenated on the last axis (None when empty).
  """
  offsets = cache.lengths
  ks, vs, captured = [], [], []
  for layer, block in enumerate(blocks):
    if layer in aux_layers:
      captured.append(x)
    x, k, v = block(x, positions, cache.k[layer], cache.v[layer], offsets, tree=tree, write=write)
    ks.append(k)
    vs.append(v)
  aux = jnp.concatenate(captured, axis=-1) if captured else None
  if not write:
    return x, PendingKV(k=tuple(ks), v=tuple(vs)), aux
  return x, KVCache(k=tuple(ks), v=tuple(vs), lengths=offsets + x.shape[1]), aux
