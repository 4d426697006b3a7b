"""Losses: next-token cross entropy, and the divergences a draft is distilled with.

Every divergence takes target logits (p) and draft logits (q) of shape ``[..., V]`` and returns one value
per position ``[...]`` in nats (TVD is a probability mass). Both sides are softened by the same
``temperature`` first, as in sampling. ``1 - tvd(p, q) = Σ_v min(p, q)`` is the probability that a token
drawn from q is accepted by the rule of speculative sampling, so TVD is the divergence that aims at
acceptance directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Mean next-token cross entropy.

  Args:
    logits: ``[B, T, V]``. targets: ``[B, T] int32``. mask: ``[B, T]`` weights (1 = counted), or None.

  Returns:
    ``[]`` float32: the masked mean of ``-log softmax(logits)[targets]``.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
  return masked_mean(nll, mask)


def masked_mean(x: jax.Array, mask: jax.Array | None) -> jax.Array:
  """Mean of ``x`` over the entries where ``mask`` is set (all entries when None)."""
  if mask is None:
    return jnp.mean(x)
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _log_probs(logits: jax.Array, temperature: float) -> jax.Array:
  return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def _kl(logp: jax.Array, logq: jax.Array) -> jax.Array:
  # Σ p (log p - log q); p = 0 contributes 0 (exp(-inf) * finite); the where guards -inf - -inf.
  return jnp.sum(jnp.where(logp > -jnp.inf, jnp.exp(logp) * (logp - logq), 0.0), axis=-1)


def forward_kl(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """KL(p‖q) ``[...]``: mode-covering; the draft is pushed to cover all of the target's mass."""
  return _kl(_log_probs(p_logits, temperature), _log_probs(q_logits, temperature))


def reverse_kl(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """KL(q‖p) ``[...]``: mode-seeking; the draft concentrates where the target is confident."""
  return _kl(_log_probs(q_logits, temperature), _log_probs(p_logits, temperature))


def jsd(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Jensen–Shannon divergence ``½ KL(p‖m) + ½ KL(q‖m)``, ``m = (p + q) / 2``, ``[...]``, in [0, log 2]."""
  logp, logq = _log_probs(p_logits, temperature), _log_probs(q_logits, temperature)
  logm = jnp.logaddexp(logp, logq) - jnp.log(2.0)
  return 0.5 * _kl(logp, logm) + 0.5 * _kl(logq, logm)


def tvd(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Total variation ``½ Σ |p - q| = 1 - Σ min(p, q)`` ``[...]``, in [0, 1]."""
  p = jnp.exp(_log_probs(p_logits, temperature))
  q = jnp.exp(_log_probs(q_logits, temperature))
  return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)


def expected_acceptance(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
  """``Σ_v min(p, q)`` ``[...]``: the probability that the draft's sampled token is accepted.

  ``temperature == 0`` gives the greedy case: 1 where both argmaxes agree, else 0.
  """
  if temperature == 0:
    return (jnp.argmax(p_logits, -1) == jnp.argmax(q_logits, -1)).astype(jnp.float32)
  return 1.0 - tvd(p_logits, q_logits, temperature)


DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tvd": tvd}
