"""Warping and sampling: the one place where temperature, top-k and top-p are applied.

Target and proposer distributions both go through :func:`warp`, so the speculative output follows the
target's *warped* distribution exactly (the acceptance rule compares like with like).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig


def warp(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Turns logits into the sampling distribution: temperature, then top-k, then top-p.

  Args:
    logits: ``[..., V]`` float.
    cfg: static sampling configuration. Temperature 0 gives the one-hot of the argmax (first on ties).

  Returns:
    Probabilities ``[..., V] float32`` that sum to 1 along the last axis.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  if cfg.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
  logits = logits / cfg.temperature
  if 0 < cfg.top_k < vocab:
    kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]  # [..., 1]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if cfg.top_p < 1.0:
    # Keep the smallest set of most likely tokens whose mass reaches top_p (ties at the edge kept).
    sorted_p = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    threshold = jnp.min(jnp.where(mass_before < cfg.top_p, sorted_p, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


def sample(weights: jax.Array, key: jax.Array) -> jax.Array:
  """Draws an index with probability proportional to ``weights`` (need not be normalised).

  Uses the exponential race: ``argmax_v weights_v / e_v`` with ``e_v ~ Exp(1)`` picks ``v`` with
  probability ``weights_v / sum(weights)``; zero weights are never picked when any weight is positive.

  Args:
    weights: ``[..., V]`` non-negative.
    key: PRNG key.

  Returns:
    ``[...] int32`` indices.
  """
  # e = 0 has probability 2^-24 per entry; clamp it so that 0 / e never makes a NaN.
  e = jnp.maximum(jax.random.exponential(key, weights.shape, jnp.float32), jnp.finfo(jnp.float32).tiny)
  return jnp.argmax(weights / e, axis=-1).astype(jnp.int32)


def draw(probs: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Draws from warped ``probs`` ``[..., V]``: the argmax when greedy (no random numbers), else :func:`sample`."""
  if cfg.greedy:
    return jnp.argmax(probs, axis=-1).astype(jnp.int32)
  return sample(probs, key)
