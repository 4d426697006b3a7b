"""Warping and sampling: the one place where temperature, top-k and top-p are applied.

Target and proposer distributions both go through :func:`warp`, so the speculative output follows the
target's *warped* distribution exactly (the acceptance rule compares like with like).

The settings are either one static :class:`~specjax.config.SamplingConfig` for the whole batch (compiled
in), or a :class:`RowSampling` of per-row arrays (a server's requests, each with its own settings, in one
program). Keys are one PRNG key for the batch, or one per row (``[B]``, a request's own seed): the helpers
:func:`split_keys`, :func:`uniform` and :func:`sample` take either, so a row's draws then depend on its own
key alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
  """Per-row sampling settings, arrays ``[B]``: ``temperature`` (0: greedy), ``top_k`` (0: off) and
  ``top_p`` (1: off). Applied exactly as :class:`SamplingConfig` applies one setting to every row."""

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array

  greedy = False  # rows decide at run time; a greedy row's one-hot distributions go through the sampling path

  @classmethod
  def of(cls, settings, batch: int | None = None) -> RowSampling:
    """From a list of :class:`SamplingConfig` (one per row), or one config repeated ``batch`` times."""
    if isinstance(settings, SamplingConfig):
      settings = [settings] * batch
    return cls(temperature=jnp.asarray([s.temperature for s in settings], jnp.float32),
               top_k=jnp.asarray([s.top_k for s in settings], jnp.int32),
               top_p=jnp.asarray([s.top_p for s in settings], jnp.float32))


def _rows(x: jax.Array, like: jax.Array) -> jax.Array:
  """A per-row ``[B]`` array shaped to broadcast against ``like [B, ..., V]``."""
  return x.reshape(x.shape + (1,) * (like.ndim - 1))


def _warp_rows(logits: jax.Array, cfg: RowSampling) -> jax.Array:
  vocab = logits.shape[-1]
  t = _rows(cfg.temperature, logits)
  scaled = logits / jnp.where(t > 0, t, 1.0)

  def filtered(scaled):
    # top-k then top-p per row, on one sort (only run when some row filters).
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.clip(_rows(cfg.top_k, scaled), 1, vocab)
    kth = jnp.take_along_axis(sorted_desc, k - 1, axis=-1)
    keep_k = jnp.where(_rows(cfg.top_k, scaled) > 0, scaled >= kth, True)
    scaled = jnp.where(keep_k, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    sorted_p = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    top_p = _rows(cfg.top_p, probs)
    threshold = jnp.min(jnp.where(mass_before < top_p, sorted_p, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where((top_p >= 1.0) | (probs >= threshold), probs, 0.0)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)

  needs = jnp.any(cfg.top_k > 0) | jnp.any(cfg.top_p < 1.0)
  probs = jax.lax.cond(needs, filtered, lambda x: jax.nn.softmax(x, axis=-1), scaled)
  onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
  return jnp.where(t > 0, probs, onehot)


def warp(logits: jax.Array, cfg: SamplingConfig | RowSampling) -> jax.Array:
  """Turns logits into the sampling distribution: temperature, then top-k, then top-p.

  Args:
    logits: ``[..., V]`` float (``[B, ..., V]`` with per-row settings).
    cfg: static sampling configuration, or per-row :class:`RowSampling`. Temperature 0 gives the one-hot
      of the argmax (first on ties).

  Returns:
    Probabilities ``[..., V] float32`` that sum to 1 along the last axis.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  if isinstance(cfg, RowSampling):
    return _warp_rows(logits, cfg)
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


def split_keys(key: jax.Array, n: int) -> jax.Array:
  """``n`` keys from one key ``[n]``, or from per-row keys ``[B]`` as ``[n, B]`` (item i: row keys)."""
  if key.ndim == 0:
    return jax.random.split(key, n)
  return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, n))(key), 0, 1)


def _per_row(fn, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """``fn(key, shape)``, or with per-row keys ``[B]`` each row's ``shape[1:]`` from its own key."""
  if key.ndim == 0:
    return fn(key, shape)
  return jax.vmap(lambda k: fn(k, shape[1:]))(key)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform draws in [0, 1) of ``shape`` (leading axis the rows when ``key`` is per-row)."""
  return _per_row(lambda k, s: jax.random.uniform(k, s, jnp.float32), key, shape)


def sample(weights: jax.Array, key: jax.Array) -> jax.Array:
  """Draws an index with probability proportional to ``weights`` (need not be normalised).

  Uses the exponential race: ``argmax_v weights_v / e_v`` with ``e_v ~ Exp(1)`` picks ``v`` with
  probability ``weights_v / sum(weights)``; zero weights are never picked when any weight is positive.

  Args:
    weights: ``[..., V]`` non-negative.
    key: PRNG key, or per-row keys ``[B]`` (then ``weights`` is ``[B, ..., V]``).

  Returns:
    ``[...] int32`` indices.
  """
  # e = 0 has probability 2^-24 per entry; clamp it so that 0 / e never makes a NaN.
  e = _per_row(lambda k, s: jax.random.exponential(k, s, jnp.float32), key, weights.shape)
  e = jnp.maximum(e, jnp.finfo(jnp.float32).tiny)
  return jnp.argmax(weights / e, axis=-1).astype(jnp.int32)


def draw(probs: jax.Array, key: jax.Array, cfg: SamplingConfig | RowSampling) -> jax.Array:
  """Draws from warped ``probs`` ``[..., V]``: the argmax when greedy (no random numbers), else :func:`sample`
  (per-row settings always sample: a greedy row's one-hot distribution gives its argmax)."""
  if cfg.greedy:
    return jnp.argmax(probs, axis=-1).astype(jnp.int32)
  return sample(probs, key)
