"""Training heads on a frozen target: Medusa, EAGLE-1/3 (with training-time test) and MTP.

Every loss distils the target's own next-token distributions, computed on the fly from the same batch (the
target is run inside the jitted step, its outputs under ``stop_gradient``: its parameters never change).
For a batch ``rows [B, T+1]`` the target gives, at every position t, ``p_t`` (the distribution of
``x_{t+1}``), its final hidden state ``h_t`` and, for EAGLE-3, the residual streams entering the chosen
layers. The conventions are the inference ones (:mod:`specjax.proposers`), so a trained head is used
as trained:

- Medusa head j on ``h_t`` predicts ``x_{t+2+j}``: forward KL to ``p_{t+1+j}``, head j weighted
  ``decay^j`` (Medusa's later recipe; Hydra++ found the teacher's distributions better than data labels).
- EAGLE (chain, one depth): the pair ``(F_t, x_{t+1})`` at position t gives ``o_t``, whose logits predict
  ``x_{t+2}``: soft cross entropy against ``p_{t+1}``. EAGLE-1 adds ``SmoothL1(o_t, h_{t+1})`` (feature
  regression, weight ``regression``) with the token term weighted ``token_loss`` (EAGLE-1: 1.0 and 0.1)
  and uniform noise on the input features. EAGLE-3 predicts over its draft vocabulary: the target's
  distribution restricted to it and renormalised, positions whose target argmax lies outside it dropped.
- Training-time test (``ttt_steps = m > 1``, EAGLE-3's recipe): step s feeds the head its own step-(s-1)
  outputs, ``(o^{s-1}_{t-1}, x_{t+1})`` at position t, attending to the step-0 keys at positions
  ``<= t - s`` (the real prefix) and to its own keys of steps 1..s at ``t - s + r``: exactly what a chain
  proposal ``s + 1`` sees at inference. Step s is weighted ``decay^s``.
- MTP (DeepSeek-V3): module d (0-based) reads ``(h^d_t, x_{t+d+1})`` (``h^0`` the target's hidden state,
  ``h^{d}`` module d-1's output) and predicts ``x_{t+d+2}``: forward KL to ``p_{t+d+1}``, weighted
  ``decay^d``. Module d >= 2 at position t does not see positions ``t-d+1 .. t-1`` (their tokens lie past
  the accepted context at inference); a one-module MTP head can take the training-time test as EAGLE does.

Each loss also reports, per proposal position, ``Σ_v min(p, q)`` (the expected acceptance of a token drawn
from q at temperature 1) and the greedy agreement: the offline predictors of acceptance that
``specjax eval`` puts next to the measured ones.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.heads import KINDS, build_heads

_HUBER_DELTA = 1.0


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
  """The ``[heads]`` section of a head recipe.

  Attributes:
    kind: one of ``medusa``, ``eagle1``, ``eagle3``, ``mtp``.
    num_heads: Medusa heads (the most proposals per round) or MTP modules.
    d_model, n_heads, n_kv_heads, d_ff: the head layer's shape (EAGLE-3 may be narrower than the target;
      0 = the target's width / heads, ``3 * d_model`` for d_ff).
    draft_vocab_size: EAGLE-3: the reduced draft vocabulary, the most frequent training tokens (0 = all).
    aux_layers: EAGLE-3: target layers whose incoming residual streams are fused (empty = the default
      low/middle/high layers).
    ttt_steps: chain heads with one depth: steps of the training-time test (1 = none).
    decay: weight ratio between successive heads, TTT steps or MTP modules.
    regression, token_loss: EAGLE-1's weights of the feature regression and of the token loss.
    feature_noise: EAGLE-1: half-width of the uniform noise added to the input features.
    medusa_layers: residual blocks per Medusa head.
  """

  kind: str = "eagle3"
  num_heads: int = 4
  d_model: int = 0
  n_heads: int = 0
  n_kv_heads: int = 0
  d_ff: int = 0
  draft_vocab_size: int = 0
  aux_layers: tuple[int, ...] = ()
  ttt_steps: int = 1
  decay: float = 0.8
  regression: float = 1.0
  token_loss: float = 0.1
  feature_noise: float = 0.0
  medusa_layers: int = 1

  def __post_init__(self):
    from specjax.train.config import ConfigError, _check_float, _check_int

    if self.kind not in KINDS:
      raise ConfigError(f"heads.kind must be one of {KINDS}, got {self.kind!r}")
    for name in ("num_heads", "ttt_steps", "medusa_layers"):
      _check_int("heads", name, getattr(self, name))
    for name in ("d_model", "n_heads", "n_kv_heads", "d_ff", "draft_vocab_size"):
      _check_int("heads", name, getattr(self, name), 0)
    for name in ("regression", "token_loss", "feature_noise"):
      _check_float("heads", name, getattr(self, name), 0.0)
    _check_float("heads", "decay", self.decay, 0.0, 1.0, low_open=True)
    object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
    if self.ttt_steps > 1 and (self.kind == "medusa" or (self.kind == "mtp" and self.num_heads > 1)):
      raise ConfigError(f"heads.ttt_steps > 1 needs a chain head with one depth (eagle1, eagle3, or mtp with "
                        f"num_heads = 1), got kind {self.kind!r} with num_heads {self.num_heads}")
    if self.kind in ("eagle1", "eagle3") and self.num_heads != 1:
      object.__setattr__(self, "num_heads", 1)

  def build(self, target_cfg, *, seed: int, d2t: np.ndarray | None = None):
    """The randomly initialised head set for ``target_cfg`` this section describes."""
    options: dict[str, Any] = {}
    if self.kind in ("medusa", "mtp"):
      options["num_heads"] = self.num_heads
    if self.kind == "medusa":
      options["medusa_layers"] = self.medusa_layers
    for name in ("d_model", "n_heads", "n_kv_heads", "d_ff"):
      if getattr(self, name):
        options[name] = getattr(self, name)
    if self.kind == "eagle3":
      if self.aux_layers:
        options["aux_layers"] = self.aux_layers
      if self.draft_vocab_size:
        options["draft_vocab_size"] = self.draft_vocab_size
    return build_heads(self.kind, target_cfg, seed=seed, d2t=d2t, **options)


def frequent_tokens(rows: np.ndarray, vocab_size: int, n: int) -> np.ndarray:
  """The ``n`` most frequent ids of ``rows`` (ties to the smaller id), sorted: EAGLE-3's draft vocabulary."""
  counts = np.bincount(np.asarray(rows).ravel(), minlength=vocab_size)[:vocab_size]
  order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
  return np.sort(order[:n]).astype(np.int32)


# -------------------------------------------------------------------------------------- pieces


def _soft_ce(p: jax.Array, logits: jax.Array) -> jax.Array:
  """``-Σ_v p(v) log softmax(logits)(v)`` per position (forward KL up to p's entropy)."""
  logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.where(p > 0, p * logq, 0.0), axis=-1)


def _acceptance(p: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``Σ min(p, softmax(logits))`` and greedy agreement per position."""
  q = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.sum(jnp.minimum(p, q), axis=-1), (jnp.argmax(p, -1) == jnp.argmax(logits, -1)).astype(jnp.float32)


def _mean(x: jax.Array, mask) -> jax.Array:
  """Mean of ``x`` over the entries where ``mask`` (broadcast to ``x``) is set."""
  mask = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), x.shape)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def ttt_visible(t: int, step: int) -> jax.Array:
  """The attention mask of training-time-test step ``step`` over the keys of steps 0..step, ``[T, (step+1) T]``:
  query t sees step-0 keys at positions ``<= t - step`` and the step-r key at ``t - step + r`` (r >= 1)."""
  q = jnp.arange(t)[:, None]
  k = jnp.arange(t)[None, :]
  blocks = [k <= q - step] + [k == q - step + r for r in range(1, step + 1)]
  return jnp.concatenate(blocks, axis=1)


def depth_visible(t: int, depth: int) -> jax.Array:
  """Causal mask ``[T, T]`` of MTP module ``depth`` (0-based): position t sees ``t' <= t - depth + 1``
  (all of ``t' <= t`` for depths 0 and 1) and itself."""
  q = jnp.arange(t)[:, None]
  k = jnp.arange(t)[None, :]
  return (k <= q - max(depth - 1, 0)) | (k == q)


def _target_outputs(target, rows: jax.Array, aux_layers: tuple[int, ...]):
  """The frozen target over ``rows [B, T+1]``: ``p [B, T+1, V]`` (temperature 1), hidden, aux."""
  b, t1 = rows.shape
  logits, hidden, aux, _ = target.forward_features(rows, target.init_cache(b, t1), aux_layers)
  p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  return jax.lax.stop_gradient(p), jax.lax.stop_gradient(hidden), (
      None if aux is None else jax.lax.stop_gradient(aux))


def _medusa_loss(heads, target, hcfg: HeadsConfig, rows, p, hidden, aux, key):
  t = rows.shape[1] - 1
  z = heads(hidden[:, :t])  # [B, T, H, D]
  losses, accept, greedy, weights = [], [], [], []
  for j in range(heads.cfg.num_heads):
    valid = (jnp.arange(t) + 1 + j <= t).astype(jnp.float32)[None, :]  # p_{t+1+j} exists
    target_p = jnp.pad(p[:, 1 + j:], ((0, 0), (0, j), (0, 0)))[:, :t]  # p_{t+1+j}
    logits = target.unembed(z[:, :, j])
    losses.append(_mean(_soft_ce(target_p, logits), valid))
    a, g = _acceptance(target_p, logits)
    accept.append(_mean(a, valid))
    greedy.append(_mean(g, valid))
    weights.append(hcfg.decay ** j)
  return losses, accept, greedy, weights, {}


def _chain_logits_and_target(heads, target, depth: int, out, target_p):
  """``(logits, target distribution, position weights)`` for one chain step: EAGLE-3 over its draft
  vocabulary (target restricted and renormalised; positions whose argmax lies outside dropped)."""
  if heads.cfg.kind != "eagle3" or heads.cfg.draft_vocab_size in (None, heads.cfg.target_vocab_size):
    return heads.logits(depth, target, out), target_p, 1.0
  d2t = heads.d2t[...]
  small = heads.lm_head(heads.final_norm(out)).astype(jnp.float32)  # [B, T, V_draft]
  restricted = target_p[..., d2t]
  inside = jnp.isin(jnp.argmax(target_p, -1), d2t).astype(jnp.float32)
  return small, restricted / jnp.maximum(jnp.sum(restricted, -1, keepdims=True), 1e-9), inside


def _chain_loss(heads, target, hcfg: HeadsConfig, rows, p, hidden, aux, key):
  t = rows.shape[1] - 1
  batch = rows.shape[0]
  positions = jnp.broadcast_to(jnp.arange(t), (batch, t))
  feats = heads.input_features(hidden, aux)[:, :t]  # F_t for the pairs t = 0..T-1
  if hcfg.feature_noise:
    feats = feats + jax.random.uniform(key, feats.shape, feats.dtype, -hcfg.feature_noise, hcfg.feature_noise)
  losses, accept, greedy, weights, extra = [], [], [], [], {}

  def score(step_index: int, depth: int, out):
    shift = depth + 1  # depth d predicts x_{t+d+2}: target p_{t+d+1}
    valid = (jnp.arange(t) + shift <= t) & (jnp.arange(t) >= (step_index if depth == 0 else 0))
    target_p = jnp.pad(p[:, shift:], ((0, 0), (0, shift - 1), (0, 0)))[:, :t]
    logits, target_q, weight = _chain_logits_and_target(heads, target, depth, out, target_p)
    mask = valid.astype(jnp.float32)[None, :] * weight
    loss = _soft_ce(target_q, logits)
    a, g = _acceptance(target_p, heads.logits(depth, target, out))  # over the whole vocabulary
    if heads.cfg.kind == "eagle1":
      reg_target = jnp.pad(hidden[:, 1:], ((0, 0), (0, 0), (0, 0)))[:, :t]  # h_{t+1}
      reg = jnp.sum(optax_huber(out - reg_target.astype(out.dtype)), -1) / out.shape[-1]
      loss = hcfg.token_loss * loss + hcfg.regression * reg
    losses.append(_mean(loss, mask))
    accept.append(_mean(a, valid.astype(jnp.float32)[None, :]))
    greedy.append(_mean(g, valid.astype(jnp.float32)[None, :]))

  for depth in range(heads.num_depths):  # MTP's cascade; EAGLE has one depth
    tokens = jnp.pad(rows[:, depth + 1:], ((0, 0), (0, depth)))[:, :t]  # x_{t+d+1}
    attn_in, residual = heads.inputs(depth, target, feats, tokens)
    att = heads.attention(depth)
    q, k, v = att.project(attn_in, positions)
    visible = jnp.broadcast_to(depth_visible(t, depth), (batch, t, t))
    out = heads.finish(depth, residual, att.attend(q, k, v, visible))
    score(0, depth, out)
    weights.append(hcfg.decay ** depth)
    feats = out
  if hcfg.ttt_steps > 1:  # one depth: its own outputs fed back, seeing the real prefix and its own steps
    tokens = rows[:, 1:]
    keys, values = [k], [v]
    for s in range(1, hcfg.ttt_steps):
      shifted = jnp.pad(out[:, :-1], ((0, 0), (1, 0), (0, 0)))  # o^{s-1}_{t-1} at position t
      attn_in, residual = heads.inputs(0, target, shifted, tokens)
      q, k, v = att.project(attn_in, positions)
      keys.append(k)
      values.append(v)
      visible = jnp.broadcast_to(ttt_visible(t, s), (batch, t, (s + 1) * t))
      out = heads.finish(0, residual, att.attend(q, jnp.concatenate(keys, 1), jnp.concatenate(values, 1), visible))
      score(s, 0, out)
      weights.append(hcfg.decay ** s)
  return losses, accept, greedy, weights, extra


def optax_huber(x: jax.Array) -> jax.Array:
  """Smooth L1 (Huber with delta 1) per element, as EAGLE-1's feature regression."""
  ax = jnp.abs(x)
  return jnp.where(ax < _HUBER_DELTA, 0.5 * x * x / _HUBER_DELTA, ax - 0.5 * _HUBER_DELTA)


def head_loss(heads, target, hcfg: HeadsConfig, rows: jax.Array, key: jax.Array):
  """The training loss of a head set on one batch, and its per-position metrics.

  Args:
    heads: the head set (a module merged inside the trace). target: the frozen target.
    hcfg: the recipe's ``[heads]`` section. rows: ``[B, T+1] int32``. key: noise key (EAGLE-1).

  Returns:
    ``(loss [], metrics)``: metrics ``loss_i``, ``accept_i`` (mean ``Σ min(p, q)``) and ``greedy_i`` for
    each proposal position i (Medusa head i, chain step i, MTP module i), 1-based.
  """
  p, hidden, aux = _target_outputs(target, rows, heads.cfg.aux_layers)
  fn = _medusa_loss if heads.cfg.kind == "medusa" else _chain_loss
  losses, accept, greedy, weights, extra = fn(heads, target, hcfg, rows, p, hidden, aux, key)
  total = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
  metrics = {"loss": total, **extra}
  for i, (l, a, g) in enumerate(zip(losses, accept, greedy), start=1):
    metrics.update({f"loss_{i}": l, f"accept_{i}": a, f"greedy_{i}": g})
  return total, metrics


def expected_tau(accept: list[float]) -> float:
  """τ predicted from per-position acceptances taken as conditional (``1 + Σ_i Π_{j<=i} a_j``)."""
  return 1.0 + sum(math.prod(accept[:i + 1]) for i in range(len(accept)))
