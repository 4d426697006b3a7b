"""Draft heads that read the target's own features: Medusa, EAGLE (1 and 3) and multi-token prediction.

Each head set is an NNX module with a frozen, hashable :class:`HeadConfig` that records the target it was
built for (hidden size, vocabulary, depth and the layers it reads), so a head set can be refused for
another target by field name (:func:`check_heads`). The heads share the target's frozen parts through the
target passed to each call (``target.embed_tokens`` and ``target.unembed``), never a copy of them.

- :class:`MedusaHeads` (Cai et al. 2024): ``num_heads`` residual SiLU blocks on the target's last hidden
  state; head j on ``h_t`` predicts ``x_{t+2+j}`` through the target's unembedding.
- :class:`Eagle1Head` and :class:`Eagle3Head` (Li et al. 2024/2025): one decoder layer over
  ``(feature, embed(token))`` pairs, rolled out on its own outputs. EAGLE-1 reads the target's final hidden
  state and regresses the next one (logits through the target's unembedding); EAGLE-3 fuses the residual
  streams entering three layers and has its own output head over a reduced draft vocabulary mapped to
  target ids (``d2t``).
- :class:`MTPHeads` (DeepSeek-V3): ``num_heads`` sequential modules; module d combines
  ``RMSNorm(h^{d-1})`` and ``RMSNorm(embed(x_{i+d}))`` through a projection and one block, and predicts
  ``x_{i+d+1}`` through a norm and the target's unembedding.

EAGLE and MTP are *chain heads*: a depth-indexed family of one-layer modules with their own KV caches
(``num_depths`` of them), driven by :mod:`specjax.proposers.chain`. Their per-depth contract:
``input_features(hidden, aux) -> [.., F]``, ``step(depth, target, feats[B,T,F], tokens[B,T], cache)
-> (out[B,T,F], cache)`` and ``logits(depth, target, out) -> [.., V]``.

:data:`HEADS` is the one registry of head kinds: kind -> module class, each class naming its ``kind`` and
the proposer ``method`` that drives it (``specjax.proposers.PROPOSERS[method]``). Everything that maps a
kind or a method name to a class (building, loading, ``for_heads``, the command lines) reads it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import sharding
from specjax.cache import KVCache
from specjax.config import check_int
from specjax.numerics import einsum_f32, weight_product
from specjax.quant import take_rows
from specjax.models.llama import (MLP, Attention, Block, LlamaConfig, RMSNorm, RopeScaling, check_aux_layers,
                                  init_param, pass_positions)

MAX_HEADS = 32
FORMAT = "specjax-heads/1"


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """A head set's architecture and the target it belongs to. Frozen and hashable (static under jit).

  Attributes:
    kind: one of ``KINDS``.
    target_d_model, target_vocab_size, target_n_layers: the target's hidden size, vocabulary and depth.
    num_heads: Medusa heads (the most proposals per round) or MTP depth D; 1 for EAGLE.
    aux_layers: EAGLE-3: the target layers whose incoming residual streams are fused, increasing.
    d_model: width of an EAGLE-3 head's layer (default the target's); EAGLE-1 and MTP use the target's.
    n_heads, n_kv_heads, d_ff: the head layer's attention heads and MLP width.
    draft_vocab_size: EAGLE-3: size of the reduced draft vocabulary (None: the target's whole vocabulary).
    medusa_layers: residual blocks per Medusa head.
    norm_eps, rope_base: as the target's.
    dtype, param_dtype: activation and storage dtypes.
    matmul_dtype: None, or ``"bfloat16"``: the weight products in bfloat16 accumulated in float32, with float32
      activations (mixed precision, as :attr:`specjax.models.llama.LlamaConfig.matmul_dtype`; a head loaded
      with its target by ``specjax.load(..., dtype="mixed")``). Medusa's residual blocks stay float32 products.

  Options that published heads need (their defaults are specjax's own heads; see
  :mod:`specjax.head_formats`):
    head_dim: the head layer's attention head size (None: ``d_model // n_heads``).
    rope_scaling: the head layer's rotary scaling (a :class:`~specjax.models.llama.RopeScaling` or None).
    own_embedding: EAGLE-3: the head embeds tokens with a table of its own ``[target_vocab_size, d_model]``
      (a published head that ships ``embed_tokens``) instead of the target's embedding.
    norm_before_residual: EAGLE-3: the layer's residual is the normed feature rather than the feature
      (the ``norm_before_residual`` option of vLLM's EAGLE-3 layer).
    own_lm_heads: Medusa: each head ends in an output projection of its own ``[d_model, target_vocab_size]``
      (Medusa's layout) instead of the target's unembedding.
    qkv_bias: MTP: the module's attention has q, k and v biases (a Qwen2 decoder layer, as MiMo's MTP layers).
    normed_output: MTP: a module's output is taken after its output norm, so the next module (and a rollout
      past the last one) reads the normed state, as module 1 reads the target's final-norm hidden state, and
      the logits are the unembedding of the output itself (MiMo's MTP layers return ``final_layernorm(x)``).
      Default: the DeepSeek-V3 form, where the norm is part of the output head only.
  """

  kind: str
  target_d_model: int
  target_vocab_size: int
  target_n_layers: int
  num_heads: int = 1
  aux_layers: tuple[int, ...] = ()
  d_model: int | None = None
  n_heads: int = 4
  n_kv_heads: int | None = None
  d_ff: int | None = None
  draft_vocab_size: int | None = None
  medusa_layers: int = 1
  norm_eps: float = 1e-5
  rope_base: float = 10000.0
  dtype: str = "float32"
  param_dtype: str = "float32"
  head_dim: int | None = None
  rope_scaling: RopeScaling | None = None
  own_embedding: bool = False
  norm_before_residual: bool = False
  own_lm_heads: bool = False
  qkv_bias: bool = False
  normed_output: bool = False
  matmul_dtype: str | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"HeadConfig.kind must be one of {KINDS}, got {self.kind!r}")
    for name in ("target_d_model", "target_vocab_size", "target_n_layers", "num_heads", "n_heads", "medusa_layers"):
      check_int(f"HeadConfig.{name}", getattr(self, name), 1)
    if self.num_heads > MAX_HEADS:
      raise ValueError(f"HeadConfig.num_heads must be in [1, {MAX_HEADS}], got {self.num_heads}")
    object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
    if self.kind == "eagle3":
      if not self.aux_layers:
        object.__setattr__(self, "aux_layers", default_aux_layers(self.target_n_layers))
      check_aux_layers(self.aux_layers, self.target_n_layers, "HeadConfig.aux_layers")
    elif self.aux_layers:
      raise ValueError(f"HeadConfig.aux_layers is for kind 'eagle3' only, got {self.aux_layers} for {self.kind!r}")
    if self.kind == "eagle1" or self.kind == "eagle3":
      if self.num_heads != 1:
        raise ValueError(f"HeadConfig.num_heads must be 1 for kind {self.kind!r}, got {self.num_heads}")
    if self.d_model is None:
      object.__setattr__(self, "d_model", self.target_d_model)
    if self.kind != "eagle3" and self.d_model != self.target_d_model:
      raise ValueError(f"HeadConfig.d_model must equal target_d_model ({self.target_d_model}) for kind "
                       f"{self.kind!r} (its outputs feed the target's unembedding), got {self.d_model}")
    if self.n_kv_heads is None:
      object.__setattr__(self, "n_kv_heads", self.n_heads)
    if self.d_ff is None:
      object.__setattr__(self, "d_ff", 3 * self.d_model)
    v = self.draft_vocab_size
    if v is not None:
      if self.kind != "eagle3":
        raise ValueError(f"HeadConfig.draft_vocab_size is for kind 'eagle3' only, got {v} for {self.kind!r}")
      if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= self.target_vocab_size:
        raise ValueError(f"HeadConfig.draft_vocab_size must be an integer in [1, target_vocab_size="
                         f"{self.target_vocab_size}] or None, got {v!r}")
    if isinstance(self.rope_scaling, dict):  # as read back from heads.json
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    for name, kind in (("own_embedding", "eagle3"), ("norm_before_residual", "eagle3"), ("own_lm_heads", "medusa"),
                       ("qkv_bias", "mtp"), ("normed_output", "mtp")):
      value = getattr(self, name)
      if not isinstance(value, bool):
        raise ValueError(f"HeadConfig.{name} must be True or False, got {value!r}")
      if value and self.kind != kind:
        raise ValueError(f"HeadConfig.{name} is for kind {kind!r} only, got it for {self.kind!r}")
    self.layer_config()  # validates heads, widths and dtypes through LlamaConfig

  @property
  def num_depths(self) -> int:
    """Chain heads: how many one-layer modules with their own caches (EAGLE 1, MTP D); Medusa: 0."""
    return {"medusa": 0, "eagle1": 1, "eagle3": 1, "mtp": self.num_heads}[self.kind]

  @property
  def vocab_size(self) -> int:
    """Tokens the head can propose: the draft vocabulary for EAGLE-3, else the target's."""
    return self.draft_vocab_size or self.target_vocab_size

  def layer_config(self) -> LlamaConfig:
    """The head layer's shape as a one-layer :class:`LlamaConfig` (sizes its attention, MLP and cache)."""
    head_dim = self.head_dim
    if head_dim is None:
      head_dim = self.d_model // self.n_heads if self.d_model % self.n_heads == 0 else None
      if head_dim is None or head_dim % 2:
        raise ValueError(f"HeadConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                         "into an even head size (or give head_dim)")
    try:
      return LlamaConfig(vocab_size=self.target_vocab_size, d_model=self.d_model, n_layers=1, n_heads=self.n_heads,
                         n_kv_heads=self.n_kv_heads, d_ff=self.d_ff, head_dim=head_dim, norm_eps=self.norm_eps,
                         rope_base=self.rope_base, rope_scaling=self.rope_scaling, qkv_bias=self.qkv_bias,
                         dtype=self.dtype, param_dtype=self.param_dtype, matmul_dtype=self.matmul_dtype)
    except ValueError as e:
      raise ValueError(str(e).replace("LlamaConfig.", "HeadConfig.")) from None

  def to_json(self) -> dict[str, Any]:
    """The fields as JSON values; the published-format options appear only when set, so a head set that uses
    none of them writes the same ``heads.json`` as before they existed."""
    out = {**dataclasses.asdict(self), "aux_layers": list(self.aux_layers)}
    for name, default in (("head_dim", None), ("rope_scaling", None), ("own_embedding", False),
                          ("norm_before_residual", False), ("own_lm_heads", False), ("qkv_bias", False),
                          ("normed_output", False), ("matmul_dtype", None)):
      if out[name] == default:
        del out[name]
    return out

  @classmethod
  def for_target(cls, kind: str, target_cfg, **options) -> HeadConfig:
    """A config for ``target_cfg`` (a specjax model config): its sizes, eps, rope base and dtypes."""
    fields = dict(target_d_model=target_cfg.d_model, target_vocab_size=target_cfg.vocab_size,
                  target_n_layers=target_cfg.n_layers, norm_eps=getattr(target_cfg, "norm_eps", 1e-5),
                  rope_base=getattr(target_cfg, "rope_base", 10000.0), dtype=target_cfg.dtype,
                  param_dtype=target_cfg.param_dtype)
    if kind in ("eagle1", "eagle3", "mtp") and "n_heads" not in options:
      fields["n_heads"] = target_cfg.n_heads
      fields["n_kv_heads"] = getattr(target_cfg, "n_kv_heads", None)
    return cls(kind=kind, **{**fields, **options})


def default_aux_layers(n_layers: int) -> tuple[int, ...]:
  """EAGLE-3's low, middle and high layers: ``(2, L//2, L-3)`` as published, or ``(1, L//2, L-1)`` where
  that is not increasing (shallow targets); fewer (distinct) layers for targets under 3 layers."""
  for layers in ((2, n_layers // 2, n_layers - 3), (1, n_layers // 2, n_layers - 1)):
    if list(layers) == sorted(set(layers)) and layers[0] >= 0 and layers[-1] < n_layers:
      return layers
  return tuple(sorted({0, n_layers // 2, n_layers - 1}))


def check_heads(cfg: HeadConfig, target_cfg, where: str = "heads") -> None:
  """Refuses a head set built for another target, naming the field that differs."""
  for ours, theirs in (("target_d_model", "d_model"), ("target_vocab_size", "vocab_size"),
                       ("target_n_layers", "n_layers")):
    if getattr(cfg, ours) != getattr(target_cfg, theirs):
      raise ValueError(f"{where} were built for a target with {theirs}={getattr(cfg, ours)}, but this target has "
                       f"{theirs}={getattr(target_cfg, theirs)} (HeadConfig.{ours})")
  if cfg.aux_layers:
    check_aux_layers(cfg.aux_layers, target_cfg.n_layers, f"{where}: HeadConfig.aux_layers")


class Linear(nnx.Module):
  """``x @ w (+ b)`` with ``w [in, out]``; ``axes`` are the logical names of ``w``'s two axes (the bias
  takes the second), by default ``("embed", "embed")``: a projection inside the residual width, which the
  default rules keep whole (see :mod:`specjax.sharding`)."""

  def __init__(self, d_in: int, d_out: int, rngs: nnx.Rngs, dtype: str, bias: bool = False, zero: bool = False,
               axes: tuple[str | None, str | None] = ("embed", "embed"), matmul_dtype: str | None = None):
    self.matmul_dtype = matmul_dtype
    if zero:
      self.w = sharding.param(jnp.zeros((d_in, d_out), dtype), axes)
    else:
      self.w = init_param(rngs, (d_in, d_out), d_in, dtype, axes)
    self.b = sharding.param(jnp.zeros((d_out,), dtype), axes[1:]) if bias else None

  def __call__(self, x: jax.Array, float32: bool = False) -> jax.Array:
    """``x @ w (+ b)`` in ``x``'s dtype; ``float32`` (logits): accumulated and returned in float32
    (:func:`specjax.numerics.einsum_f32`) rather than rounded to ``x.dtype``. With ``matmul_dtype`` (mixed
    precision: float32 activations) the product is :func:`specjax.numerics.weight_product`'s."""
    if self.matmul_dtype is not None:
      y = weight_product("...i,io->...o", x, self.w[...], self.matmul_dtype)
    elif float32:
      y = einsum_f32("...i,io->...o", x, self.w[...])
    else:
      y = jnp.einsum("...i,io->...o", x, self.w[...].astype(x.dtype))
    return y if self.b is None else y + self.b[...].astype(y.dtype)


class HeadModule(nnx.Module):
  """What every head set is: an NNX module over a :class:`HeadConfig` of its own ``kind``.

  Class attributes (read through :data:`HEADS`): ``kind``, the :class:`HeadConfig` kind the class builds;
  ``method``, the proposer method that drives it (``specjax.proposers.PROPOSERS[method]``). Constructed as
  ``cls(cfg, rngs=...)`` (plus class-specific keywords), which is how :func:`load_heads` and
  :func:`specjax.loading.cast` rebuild one.
  """

  kind: ClassVar[str]
  method: ClassVar[str]
  cfg: HeadConfig

  def _set_config(self, cfg: HeadConfig) -> None:
    if cfg.kind != self.kind:
      raise ValueError(f"{type(self).__name__} needs HeadConfig.kind {self.kind!r}, got {cfg.kind!r}")
    self.cfg = cfg

  def check_variables(self) -> None:
    """Validates variables that are data rather than weights, after a load (EAGLE-3: the vocabulary map);
    raises ValueError naming the one that does not fit. Nothing to check by default."""


# ------------------------------------------------------------------------------------------ Medusa


class MedusaHeads(HeadModule):
  """``num_heads`` heads ``z_j = ResBlock^L_j(h)`` with ``ResBlock(x) = x + SiLU(x W + b)``.

  ``zero_init`` (Medusa's choice) makes every block the identity at first: each head then predicts what the
  target's own head does. Head j on the hidden state at position t proposes ``x_{t+2+j}``.
  """

  kind: ClassVar[str] = "medusa"
  method: ClassVar[str] = "medusa"

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs, zero_init: bool = True):
    self._set_config(cfg)
    h, layers, d = cfg.num_heads, cfg.medusa_layers, cfg.d_model
    w = jnp.zeros((h, layers, d, d), cfg.param_dtype) if zero_init else (
        jax.random.normal(rngs.params(), (h, layers, d, d), jnp.float32) * d**-0.5).astype(cfg.param_dtype)
    # Square residual blocks inside the hidden width: replicated under the default rules (they are d x d
    # per head, small next to the vocabulary-sharded unembedding they feed).
    self.w = sharding.param(w, (None, None, "embed", "embed"))
    self.b = sharding.param(jnp.zeros((h, layers, d), cfg.param_dtype), (None, None, "embed"))
    if cfg.own_lm_heads:  # Medusa's layout: one output projection per head (initialised at random here)
      self.lm_heads = init_param(rngs, (h, d, cfg.target_vocab_size), d, cfg.param_dtype, (None, "embed", "vocab"))

  def __call__(self, hidden: jax.Array) -> jax.Array:
    """``hidden [..., D]`` (the target's final-norm state) -> ``[..., num_heads, D]`` head features."""
    x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (self.cfg.num_heads, hidden.shape[-1]))
    w, b = self.w[...].astype(x.dtype), self.b[...].astype(x.dtype)
    for layer in range(self.cfg.medusa_layers):
      x = x + jax.nn.silu(jnp.einsum("...hd,hde->...he", x, w[:, layer]) + b[:, layer])
    return x

  def logits(self, target, z: jax.Array, first: int = 0) -> jax.Array:
    """Logits ``[..., j, V] float32`` of heads ``first .. first + j - 1`` from their features ``z [..., j, D]``:
    through each head's own output projection when the set has them (``HeadConfig.own_lm_heads``), else the
    target's unembedding."""
    if not self.cfg.own_lm_heads:
      return target.unembed(z)
    heads = self.lm_heads[...][first:first + z.shape[-2]]  # [j, D, V]
    return sharding.constrain_rows(einsum_f32("...hd,hdv->...hv", z, heads), "vocab")


# ---------------------------------------------------------------------------------- chain heads


class ChainHeadModule(HeadModule):
  """What EAGLE and MTP heads share: a depth-indexed family of one-layer modules, each computed as
  ``inputs`` (the attention input and the residual from a feature and a token), the depth's
  ``attention``, then ``finish`` (residual add and MLP). ``step`` runs them over a cache (inference);
  training runs the same three pieces with masks of its own (``specjax.train.heads``), and scores the
  outputs through ``logits`` or, over a reduced vocabulary, ``draft_logits`` and ``vocab_map``.

  ``regresses_features``: the outputs live in the target's hidden space (EAGLE-1), so training also
  regresses them onto the target's next hidden state.
  """

  regresses_features: ClassVar[bool] = False

  @property
  def num_depths(self) -> int:
    return self.cfg.num_depths

  def init_caches(self, batch: int, max_len: int) -> tuple[KVCache, ...]:
    return tuple(KVCache.init(self.cfg.layer_config(), batch, max_len) for _ in range(self.num_depths))

  def step(self, depth: int, target, feats: jax.Array, tokens: jax.Array, cache: KVCache, gap=None, tree=None
           ) -> tuple[jax.Array, KVCache]:
    """Pairs ``(feats[B, T, F], tokens[B, T])`` at cache positions ``lengths .. lengths + T - 1``:
    returns the outputs ``[B, T, F]`` and the cache advanced by T. ``gap``: cache positions not to attend
    to; ``tree``: the pairs are tree nodes (see :class:`specjax.models.llama.Attention`)."""
    attn_in, residual = self.inputs(depth, target, feats, tokens)
    positions = pass_positions(tokens, cache, tree)  # [B, T]
    a, k_buf, v_buf = self.attention(depth)(attn_in, positions, cache.k[0], cache.v[0], cache.lengths, gap, tree)
    return self.finish(depth, residual, a), KVCache(k=(k_buf,), v=(v_buf,), lengths=cache.lengths + tokens.shape[1])

  def vocab_map(self) -> jax.Array | None:
    """``[V_draft] int32``: the target ids of the head's own vocabulary where it is a strict subset of the
    target's (then :meth:`draft_logits` scores it); None: the head predicts over the target's vocabulary
    and :meth:`logits` is its own distribution."""
    return None

  def draft_logits(self, depth: int, target, out: jax.Array) -> jax.Array:
    """Logits over the head's own vocabulary (``vocab_map``'s order, else the target's) ``[..., V_head]``
    float32 from head outputs ``[..., F]``."""
    return self.logits(depth, target, out)


class EagleHead(ChainHeadModule):
  """What both EAGLE layers share: one decoder layer (its attention ``attn``) with a post-attention MLP
  (``mlp_norm``, ``mlp``), one depth. The kinds differ in their inputs and output head:
  :class:`Eagle1Head` and :class:`Eagle3Head`."""

  method: ClassVar[str] = "eagle"

  def _init_mlp(self, rngs: nnx.Rngs) -> None:
    """The layer's MLP; built after the kind's own parts (the order fixes how ``rngs`` is consumed)."""
    self.mlp_norm = RMSNorm(self.cfg.d_model, self.cfg.norm_eps, self.cfg.param_dtype)
    self.mlp = MLP(self.cfg.layer_config(), rngs)

  def attention(self, depth: int) -> Attention:
    return self.attn

  def finish(self, depth: int, residual: jax.Array, a: jax.Array) -> jax.Array:
    h = residual + a
    return h + self.mlp(self.mlp_norm(h))


class Eagle1Head(EagleHead):
  """EAGLE-1: ``x = fc([embed(token), feature])`` (2D -> D, with bias), then a decoder layer without its
  first norm. The feature is the target's final hidden state; the output regresses the target's next one
  and goes through the target's unembedding."""

  kind: ClassVar[str] = "eagle1"
  regresses_features: ClassVar[bool] = True

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
    self._set_config(cfg)
    self.fc = Linear(2 * cfg.target_d_model, cfg.d_model, rngs, cfg.param_dtype, bias=True,
                     matmul_dtype=cfg.matmul_dtype)
    self.attn = Attention(cfg.layer_config(), rngs)
    self._init_mlp(rngs)

  def input_features(self, hidden: jax.Array, aux: jax.Array | None) -> jax.Array:
    """The per-position feature the head reads from the target: its final hidden state ``[..., D]``."""
    return hidden

  def inputs(self, depth: int, target, feats: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(attention input, residual)`` of the pairs ``(feats [B, T, D], tokens [B, T])``."""
    emb = target.embed_tokens(tokens).astype(feats.dtype)
    x = self.fc(jnp.concatenate([emb, feats], axis=-1))
    return x, x  # EAGLE's first layer has no input norm

  def logits(self, depth: int, target, out: jax.Array) -> jax.Array:
    """Next-token logits ``[..., V] float32`` through the target's unembedding from outputs ``[..., D]``."""
    return target.unembed(out)


class Eagle3Head(EagleHead):
  """EAGLE-3: the feature is ``fc(aux)`` (the fused layers, 3D -> d); the layer projects q, k and v from
  ``[RMSNorm(embed(token)), RMSNorm(feature)]`` (D + d wide) with the feature as residual; its pre-norm
  output feeds the next step, and ``lm_head(norm(out))`` gives logits over the draft vocabulary, scattered
  to the target ids in ``d2t`` (the rest get -inf, so they are never proposed)."""

  kind: ClassVar[str] = "eagle3"

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs, d2t: np.ndarray | None = None):
    self._set_config(cfg)
    pd, d, dt = cfg.param_dtype, cfg.d_model, cfg.target_d_model
    e = d if cfg.own_embedding else dt  # width of the token embedding the layer reads
    self.fc = Linear(len(cfg.aux_layers) * dt, d, rngs, pd, matmul_dtype=cfg.matmul_dtype)
    self.embed_norm = RMSNorm(e, cfg.norm_eps, pd)
    self.feature_norm = RMSNorm(d, cfg.norm_eps, pd)
    self.attn = Attention(cfg.layer_config(), rngs, in_dim=e + d)
    self.final_norm = RMSNorm(d, cfg.norm_eps, pd)
    self.lm_head = Linear(d, cfg.vocab_size, rngs, pd, axes=("embed", "vocab"), matmul_dtype=cfg.matmul_dtype)
    self.d2t = nnx.Variable(jnp.asarray(check_vocab_map(
        np.arange(cfg.vocab_size) if d2t is None else d2t, cfg), jnp.int32))
    self._init_mlp(rngs)
    if cfg.own_embedding:  # a published head's own table (built last: the rngs of the others stay as they were)
      self.embed = init_param(rngs, (cfg.target_vocab_size, d), d, pd, ("vocab", "embed"))

  def check_variables(self) -> None:
    check_vocab_map(np.asarray(self.d2t[...]), self.cfg)

  def input_features(self, hidden: jax.Array, aux: jax.Array | None) -> jax.Array:
    """The per-position feature the head reads from the target: the fused layer streams ``[..., d]``."""
    return self.fc(aux.astype(jnp.dtype(self.cfg.dtype)))

  def inputs(self, depth: int, target, feats: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(attention input, residual)`` of the pairs ``(feats [B, T, d], tokens [B, T])``."""
    if self.cfg.own_embedding:
      emb = take_rows(self.embed[...], tokens).astype(feats.dtype)
    else:
      emb = target.embed_tokens(tokens).astype(feats.dtype)
    normed = self.feature_norm(feats)
    residual = normed if self.cfg.norm_before_residual else feats
    return jnp.concatenate([self.embed_norm(emb), normed], axis=-1), residual

  def vocab_map(self) -> jax.Array | None:
    if self.cfg.draft_vocab_size in (None, self.cfg.target_vocab_size):
      return None
    return self.d2t[...]

  def draft_logits(self, depth: int, target, out: jax.Array) -> jax.Array:
    return self.lm_head(self.final_norm(out), float32=True)  # [..., V_draft]

  def logits(self, depth: int, target, out: jax.Array) -> jax.Array:
    """Next-token logits ``[..., V] float32`` over the target's vocabulary from head outputs ``[..., d]``:
    the draft vocabulary's placed at their target ids (``d2t``), -inf elsewhere."""
    small = self.draft_logits(depth, target, out)  # [..., V_draft]
    # Gathered rather than scattered: a scatter along the vocabulary made XLA:CPU lay the draft logits out
    # vocabulary-major and take the LM head's product transposed, a form its bfloat16 product lacks.
    d2t, vocab = self.d2t[...], self.cfg.target_vocab_size
    t2d = jnp.full((vocab,), -1, jnp.int32).at[d2t].set(jnp.arange(d2t.shape[0], dtype=jnp.int32))  # [V], -1: none
    spread = jnp.take(small, jnp.maximum(t2d, 0), axis=-1)
    return sharding.constrain_rows(jnp.where(t2d >= 0, spread, -jnp.inf), "vocab")


def check_vocab_map(d2t, cfg: HeadConfig) -> np.ndarray:
  """Validates an EAGLE-3 draft-to-target id map: ``draft_vocab_size`` distinct ids in
  ``[0, target_vocab_size)``. Raises ValueError naming the first bad id."""
  d2t = np.asarray(d2t)
  if d2t.shape != (cfg.vocab_size,) or not np.issubdtype(d2t.dtype, np.integer):
    raise ValueError(f"the draft vocabulary map d2t must be {cfg.vocab_size} integer ids (draft_vocab_size), "
                     f"got an array of shape {d2t.shape} and dtype {d2t.dtype}")
  bad = d2t[(d2t < 0) | (d2t >= cfg.target_vocab_size)]
  if bad.size:
    raise ValueError(f"the draft vocabulary map d2t holds id {int(bad[0])} outside the target's vocabulary "
                     f"[0, {cfg.target_vocab_size})")
  if np.unique(d2t).size != d2t.size:
    raise ValueError("the draft vocabulary map d2t must hold distinct target ids")
  return d2t


class MTPModule(nnx.Module):
  """One DeepSeek-V3 multi-token-prediction module: ``eh_proj([RMSNorm(embed), RMSNorm(h)])`` (2D -> D),
  one decoder block, and the output norm before the shared unembedding (``HeadConfig.normed_output``: the
  norm ends the module instead, MiMo's form)."""

  def __init__(self, cfg: HeadConfig, rngs: nnx.Rngs, first: int):
    lcfg, pd, d = cfg.layer_config(), cfg.param_dtype, cfg.d_model
    self.embed_norm = RMSNorm(d, cfg.norm_eps, pd)
    self.hidden_norm = RMSNorm(d, cfg.norm_eps, pd)
    self.proj = Linear(2 * d, d, rngs, pd, matmul_dtype=cfg.matmul_dtype)
    self.block = Block(lcfg, rngs, first=first)
    self.out_norm = RMSNorm(d, cfg.norm_eps, pd)


class MTPHeads(ChainHeadModule):
  """``num_heads`` (D) sequential MTP modules sharing the target's embedding and unembedding.

  Chain use (see :mod:`specjax.proposers.chain`): proposal j comes from module ``min(j, D)``. Module d's
  cache holds, at index ``i + D - 1``, the pair ``(h^{d-1}_i, x_{i+d})`` (``h^0`` the target's hidden
  state); indices below ``D - 1`` are placeholders that attention never sees. At position i module d
  sees positions ``<= i - d + 1`` and i itself: the ``d - 2`` positions between need tokens past the
  accepted context (a proposal's own guesses), and training masks them the same way.

  ``HeadConfig.normed_output`` (MiMo): ``finish`` applies the output norm, so ``h^d`` is the normed state
  (as ``h^0``, the target's final-norm hidden state, is) and ``logits`` unembeds it as it is.
  ``HeadConfig.qkv_bias``: each block's attention has q, k and v biases.
  """

  kind: ClassVar[str] = "mtp"
  method: ClassVar[str] = "mtp"

  def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
    self._set_config(cfg)
    self.modules = nnx.List([MTPModule(cfg, rngs, first=cfg.num_heads - 1) for _ in range(cfg.num_heads)])

  def input_features(self, hidden: jax.Array, aux: jax.Array | None) -> jax.Array:
    return hidden

  def inputs(self, depth: int, target, feats: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    m = self.modules[depth]
    emb = target.embed_tokens(tokens).astype(feats.dtype)
    x = m.proj(jnp.concatenate([m.embed_norm(emb), m.hidden_norm(feats)], axis=-1))
    return m.block.attn_norm(x), x

  def attention(self, depth: int) -> Attention:
    return self.modules[depth].block.attn

  def finish(self, depth: int, residual: jax.Array, a: jax.Array) -> jax.Array:
    m = self.modules[depth]
    h = residual + a
    h = h + m.block.mlp(m.block.mlp_norm(h))
    return m.out_norm(h) if self.cfg.normed_output else h

  def logits(self, depth: int, target, out: jax.Array) -> jax.Array:
    if self.cfg.normed_output:
      return target.unembed(out)
    return target.unembed(self.modules[depth].out_norm(out))


# ------------------------------------------------------------------------------------------ registry


# Head kind -> module class: the one table of head kinds (the proposer of a kind is
# specjax.proposers.PROPOSERS[HEADS[kind].method]).
HEADS: dict[str, type[HeadModule]] = {cls.kind: cls for cls in (MedusaHeads, Eagle1Head, Eagle3Head, MTPHeads)}
KINDS = tuple(HEADS)
# The proposer methods that drive head sets, in registry order: ("medusa", "eagle", "mtp").
HEAD_METHODS = tuple(dict.fromkeys(cls.method for cls in HEADS.values()))


def kinds_of(method: str) -> tuple[str, ...]:
  """The head kinds proposer ``method`` drives, in registry order (``"eagle"``: ``("eagle1", "eagle3")``;
  a method of no head set: ``()``)."""
  return tuple(kind for kind, cls in HEADS.items() if cls.method == method)


# -------------------------------------------------------------------------------- build, save, load


def build_heads(kind: str, target_cfg, *, seed: int = 0, d2t: np.ndarray | None = None, **options) -> HeadModule:
  """A head set of ``kind`` for a target with config ``target_cfg``, randomly initialised.

  ``kind``: one of ``KINDS``; ``options``: :class:`HeadConfig` fields (``num_heads``, ``d_model``,
  ``draft_vocab_size``, ...); ``d2t``: EAGLE-3's draft-to-target map (default: the first
  ``draft_vocab_size`` ids; ignored by the other kinds). Medusa heads start at zero (the identity), as
  Medusa does.
  """
  cfg = HeadConfig.for_target(kind, target_cfg, **options)
  cls = HEADS[kind]
  extra = {"d2t": d2t} if issubclass(cls, Eagle3Head) else {}
  return cls(cfg, rngs=nnx.Rngs(seed), **extra)


def save_heads(directory: str | pathlib.Path, heads) -> None:
  """Writes ``heads.json`` (format, :class:`HeadConfig`) and ``heads.safetensors`` (every variable,
  in its dtype, keyed by its path) to ``directory``."""
  from safetensors.flax import save_file

  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  _, state = nnx.split(heads)
  flat = {"/".join(str(p) for p in path): jnp.asarray(v) for path, v in nnx.to_flat_state(state)}
  save_file(flat, str(directory / "heads.safetensors"))
  (directory / "heads.json").write_text(json.dumps({"format": FORMAT, "config": heads.cfg.to_json()}, indent=2) + "\n")


def load_heads(directory: str | pathlib.Path, target_cfg=None):
  """Loads a head set written by :func:`save_heads`; with ``target_cfg``, refuses one built for another
  target (:func:`check_heads`).

  Raises:
    FileNotFoundError / ValueError: naming the file and the field that is missing or does not fit.
  """
  from safetensors.flax import load_file

  directory = pathlib.Path(directory)
  meta_path, weights_path = directory / "heads.json", directory / "heads.safetensors"
  for path in (meta_path, weights_path):
    if not path.is_file():
      raise FileNotFoundError(f"head set file {path} does not exist")
  try:
    meta = json.loads(meta_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{meta_path} is not valid JSON: {e}") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise ValueError(f"{meta_path}: format must be {FORMAT!r}, got {meta.get('format') if isinstance(meta, dict) else meta!r}")
  try:
    fields = dict(meta["config"])
    fields["aux_layers"] = tuple(fields.get("aux_layers", ()))
    cfg = HeadConfig(**fields)
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{meta_path} is not a valid head configuration: {e}") from None
  if target_cfg is not None:
    check_heads(cfg, target_cfg, where=f"the heads in {directory}")
  module_cls = HEADS[cfg.kind]
  abstract = nnx.eval_shape(lambda: module_cls(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  try:
    got = load_file(str(weights_path))
  except Exception as e:  # safetensors raises its own error types on malformed files
    raise ValueError(f"{weights_path} is not a valid safetensors file: {e}") from None
  flat = []
  for path, var in nnx.to_flat_state(state):
    name = "/".join(str(p) for p in path)
    if name not in got:
      raise ValueError(f"{weights_path} lacks the tensor {name} that {meta_path} needs")
    if got[name].shape != var.shape:
      raise ValueError(f"{weights_path}: {name} has shape {got[name].shape}, {meta_path} needs {var.shape}")
    flat.append((path, var.replace(jnp.asarray(got[name], var.dtype))))
  extra = set(got) - {"/".join(str(p) for p in path) for path, _ in flat}
  if extra:
    raise ValueError(f"{weights_path} holds tensor {sorted(extra)[0]} that {meta_path} does not describe")
  heads = nnx.merge(graphdef, nnx.from_flat_state(flat))
  heads.check_variables()
  return heads
