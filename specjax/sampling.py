"""Warping and sampling: the one place where the sampling settings are applied to logits.

Target and proposer distributions both go through :meth:`Sampler.warp`, so the speculative output follows the
target's *warped* distribution exactly (the acceptance rule compares like with like).

Every setting is per row (:class:`RowSettings`, arrays ``[B]``): ``generate`` broadcasts its one
:class:`~specjax.config.SamplingConfig` to the rows, a server writes each request's own. A static :class:`Mode`
chooses the code paths a program compiles, so a greedy batch pays nothing for filters or penalties it does not
use. Logit bias and the penalties read per-row token counts (:class:`Counts`, kept in the decode state); under
speculation the warp of window position i counts the proposals before it (:meth:`Sampler.warp_window`,
:meth:`Sampler.push`), for the target and the proposer alike (``ALGORITHMS.md``, "Penalties, min-p and logit
bias under speculation").

Keys are per row (``[B]``, a request's own seed): :func:`split_keys`, :func:`uniform` and :func:`sample` draw
each row from its own key, so a row's draws never depend on the other rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import MAX_STOP_TOKENS, SamplingConfig


@dataclasses.dataclass(frozen=True)
class Mode:
  """Which parts of the warp a program compiles (static). Built by :meth:`of` from the rows' settings.

  Attributes:
    greedy: every row is greedy: the argmax of the (adjusted) logits, no random numbers drawn.
    mixed: some rows may be greedy beside sampled rows (their one-hot distribution goes through sampling).
    filters: some row may filter (top-k, top-p, min-p).
    top_k: a static bound on every row's top-k (``lax.top_k`` instead of a sort), or 0 (a row may have none).
    adjusts: some row may have logit bias or a penalty: the decode state then keeps :class:`Counts`.
  """

  greedy: bool = False
  mixed: bool = False
  filters: bool = False
  top_k: int = 0
  adjusts: bool = False

  @classmethod
  def of(cls, configs: Sequence[SamplingConfig]) -> Mode:
    """The cheapest mode that applies every config of ``configs`` exactly."""
    sampled = [c for c in configs if not c.greedy]
    top_ks = [c.top_k for c in sampled if c.filters]
    bound = max(top_ks) if top_ks and all(top_ks) and len(top_ks) == len(sampled) else 0
    return cls(greedy=not sampled, mixed=bool(sampled) and len(sampled) < len(configs),
               filters=any(c.filters for c in sampled), top_k=bound, adjusts=any(c.adjusts for c in configs))


# What a server compiles: any request's settings, each part skipped at run time when no live row uses it.
FULL = Mode(greedy=False, mixed=True, filters=True, top_k=0, adjusts=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSettings:
  """The settings of each row, arrays over the ``B`` rows (see :class:`~specjax.config.SamplingConfig`).

  ``logit_bias`` is dense ``[B, V]`` and present only in a mode that ``adjusts`` (None otherwise).
  """

  temperature: jax.Array  # [B] float32, 0: greedy
  top_k: jax.Array  # [B] int32, 0: off
  top_p: jax.Array  # [B] float32, 1: off
  min_p: jax.Array  # [B] float32, 0: off
  presence: jax.Array  # [B] float32
  frequency: jax.Array  # [B] float32
  repetition: jax.Array  # [B] float32, 1: off
  logit_bias: jax.Array | None  # [B, V] float32
  max_new: jax.Array  # [B] int32 tokens to generate
  stop_ids: jax.Array  # [B, MAX_STOP_TOKENS] int32, padded with -1

  @classmethod
  def of(cls, configs: Sequence[SamplingConfig], max_new: Sequence[int], stop_ids: Sequence[Sequence[int]],
         vocab_size: int, mode: Mode) -> RowSettings:
    """Host arrays (numpy) for rows with these configs, max new tokens and stop ids (validated by the caller)."""
    f32 = lambda name: np.asarray([getattr(c, name) for c in configs], np.float32)
    bias = None
    if mode.adjusts:
      bias = np.zeros((len(configs), vocab_size), np.float32)
      for row, c in zip(bias, configs):
        for token, value in c.logit_bias:
          row[token] = value
    stops = np.full((len(configs), MAX_STOP_TOKENS), -1, np.int32)
    for row, ids in zip(stops, stop_ids):
      row[:len(ids)] = ids
    return cls(temperature=f32("temperature"), top_k=np.asarray([c.top_k for c in configs], np.int32),
               top_p=f32("top_p"), min_p=f32("min_p"), presence=f32("presence_penalty"),
               frequency=f32("frequency_penalty"), repetition=f32("repetition_penalty"), logit_bias=bias,
               max_new=np.asarray(max_new, np.int32), stop_ids=stops)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Counts:
  """What the logit adjustments read, per row: the generated tokens' counts and the prompt's tokens."""

  generated: jax.Array  # [B, V] int32 occurrences of each token in the row's output so far
  prompt: jax.Array  # [B, V] bool tokens present in the row's prompt

  @classmethod
  def of(cls, prompts: jax.Array, prompt_lens: jax.Array, vocab_size: int) -> Counts:
    """Counts at the start of generation: nothing generated; the prompt's tokens (``prompts [B, P]``
    right-padded to ``prompt_lens``) marked."""
    batch, padded = prompts.shape
    valid = jnp.arange(padded)[None, :] < prompt_lens[:, None]  # [B, P]
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], prompts.shape)
    prompt = jnp.zeros((batch, vocab_size), bool).at[rows, prompts].max(valid)
    return cls(generated=jnp.zeros((batch, vocab_size), jnp.int32), prompt=prompt)

  def add(self, tokens: jax.Array, keep: jax.Array) -> Counts:
    """The counts after rows append ``tokens [B, T]`` where ``keep [B, T]``."""
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
    generated = self.generated.at[rows, jnp.maximum(tokens, 0)].add(keep.astype(jnp.int32))
    return dataclasses.replace(self, generated=generated)


def _argmax_block(size: int) -> int:
  """The block :func:`first_argmax` splits an axis of ``size`` into: the divisor of ``size`` in ``[64, 1024]``
  nearest ``sqrt(size)`` (both stages then stay short), else 256 (and a tail of ``size % 256``)."""
  divisors = [b for b in range(64, min(size, 1024) + 1) if size % b == 0]
  return min(divisors, key=lambda b: abs(b * b - size)) if divisors else 256


def first_argmax(x: jax.Array) -> jax.Array:
  """``jnp.argmax(x, axis=-1)`` as ``int32`` (the first index on ties) for rows without NaN, in two short
  passes: each block's maximum (a plain max, which XLA vectorizes), then the first index of the row's maximum
  inside the first block that holds it. XLA:CPU computes ``argmax`` as one variadic reduction that it does not
  vectorize: over SmolLM2's 49,152 logits 160 us a row, this 24 us; greedy decoding takes several per round (the
  target's window, each proposal, the correction). A row with NaN gets some index in range (XLA's vectorized
  max does not reliably propagate NaN, and handling it would double the cost of every row). Axes under 128, or
  without a whole block, go to ``jnp.argmax`` directly."""
  size = x.shape[-1]
  block = _argmax_block(size)
  main = size - size % block
  if size < 128 or main == 0:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  blocks = x[..., :main].reshape(x.shape[:-1] + (main // block, block))
  top = jnp.max(blocks, axis=-1)  # [..., nb]
  b = jnp.argmax(top, axis=-1)  # the first block holding the maximum
  inside = jnp.take_along_axis(blocks, b[..., None, None], axis=-2)[..., 0, :]  # [..., block]
  index = b * block + jnp.argmax(inside, axis=-1)
  if main < size:  # the tail past the last whole block wins when it holds a larger value
    tail = x[..., main:]
    wins = jnp.max(tail, axis=-1) > jnp.max(top, axis=-1)
    index = jnp.where(wins, main + jnp.argmax(tail, axis=-1), index)
  return index.astype(jnp.int32)


def _rows(x: jax.Array, like: jax.Array) -> jax.Array:
  """A per-row ``[B]`` array shaped to broadcast against ``like [B, ..., V]``."""
  return x.reshape(x.shape + (1,) * (like.ndim - 1))


def _adjust(logits: jax.Array, s: RowSettings, counts: Counts, drafts: jax.Array | None,
            extra: jax.Array | None = None) -> jax.Array:
  """Logit bias, repetition penalty, then frequency and presence penalties of ``logits [B, ..., V]``.

  Every position sees the row's ``counts``; with ``drafts [B, T-1]`` (a window ``[B, T, V]``) position i also
  counts ``drafts[:, :i]``, the proposals before it; with ``extra [B, T, V]`` (tree nodes) position i also
  counts ``extra[:, i]``."""
  expand = lambda x: x.reshape(x.shape[:1] + (1,) * (logits.ndim - 2) + x.shape[1:])  # [B, V] -> [B, ..., V]
  generated = expand(counts.generated)
  if drafts is not None:
    before = jnp.cumsum(jax.nn.one_hot(drafts, logits.shape[-1], dtype=jnp.int32), axis=1)  # [B, T-1, V]
    generated = generated + jnp.concatenate([jnp.zeros_like(generated), before], axis=1)  # [B, T, V]
  if extra is not None:
    generated = generated + extra
  logits = logits + expand(s.logit_bias)
  seen = expand(counts.prompt) | (generated > 0)
  r = _rows(s.repetition, logits)
  logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
  return logits - _rows(s.frequency, logits) * generated - _rows(s.presence, logits) * (generated > 0)


def _filter(scaled: jax.Array, s: RowSettings, bound: int) -> jax.Array:
  """min-p, top-k, then top-p of ``scaled [B, ..., V]`` logits, each row by its own settings: the kept
  tokens are those at or above one logit threshold per position (ties at the edge kept). Returns the
  probabilities of the kept tokens, renormalised."""
  if bound:  # every row has 1 <= top_k <= bound: the kept set lies in the top `bound`
    top = jax.lax.top_k(scaled, bound)[0]  # [B, ..., bound] descending
  else:
    top = -jnp.sort(-scaled, axis=-1)  # [B, ..., V]
  width = top.shape[-1]
  k = _rows(s.top_k, scaled)
  k = jnp.where(k > 0, jnp.minimum(k, width), width)
  kth = jnp.take_along_axis(top, jnp.broadcast_to(k - 1, top.shape[:-1] + (1,)), axis=-1)  # [B, ..., 1]
  min_p = _rows(s.min_p, scaled)
  floor = jnp.where(min_p > 0, top[..., :1] + jnp.log(jnp.maximum(min_p, 1e-38)), -jnp.inf)  # p >= min_p * p_max
  threshold = jnp.maximum(kth, floor)
  # top-p on what min-p and top-k kept: the smallest prefix whose mass reaches top_p.
  kept = jnp.where(top >= threshold, top, -jnp.inf)
  sorted_p = jax.nn.softmax(kept, axis=-1)
  mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
  top_p = _rows(s.top_p, scaled)
  inside = (mass_before < top_p) & (top >= threshold)
  last = jnp.maximum(jnp.sum(inside, axis=-1, keepdims=True), 1) - 1  # index of the last kept entry
  threshold = jnp.where(top_p < 1.0, jnp.take_along_axis(top, last, axis=-1), threshold)
  return jax.nn.softmax(jnp.where(scaled >= threshold, scaled, -jnp.inf), axis=-1)


def warp_logits(logits: jax.Array, s: RowSettings, mode: Mode, counts: Counts | None = None,
                drafts: jax.Array | None = None, extra: jax.Array | None = None) -> jax.Array:
  """The one warp: logit adjustments, temperature, min-p, top-k, top-p, per row.

  Args:
    logits: ``[B, ..., V]`` float.
    s: the rows' settings. mode: static code paths (see :class:`Mode`).
    counts: what the adjustments read (modes that adjust); drafts: ``[B, T-1]`` for a window ``[B, T, V]``
      whose position i counts ``drafts[:, :i]`` besides ``counts`` (see :func:`_adjust`); extra: ``[B, T, V]``
      counts that position i adds (tree nodes: the tokens on the node's path).

  Returns:
    Probabilities ``[B, ..., V] float32`` that sum to 1; a greedy row (temperature 0) gets the one-hot of the
    argmax of its adjusted logits (first on ties).
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  if mode.adjusts:
    uses = jnp.any(s.repetition != 1.0) | jnp.any(s.presence != 0.0) | jnp.any(s.frequency != 0.0) | \
        jnp.any(s.logit_bias != 0.0)
    logits = jax.lax.cond(uses, lambda x: _adjust(x, s, counts, drafts, extra), lambda x: x, logits)
  onehot = lambda: jax.nn.one_hot(first_argmax(logits), vocab, dtype=jnp.float32)
  if mode.greedy:
    return onehot()
  t = _rows(s.temperature, logits)
  scaled = logits / jnp.where(t > 0, t, 1.0) if mode.mixed else logits / t
  if mode.filters:
    needs = jnp.any(s.top_k > 0) | jnp.any(s.top_p < 1.0) | jnp.any(s.min_p > 0.0)
    probs = jax.lax.cond(needs, lambda x: _filter(x, s, mode.top_k), lambda x: jax.nn.softmax(x, axis=-1), scaled)
  else:
    probs = jax.nn.softmax(scaled, axis=-1)
  return jnp.where(t > 0, probs, onehot()) if mode.mixed else probs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampler:
  """The warp and the draws of one round, as proposers and verification use them.

  A proposer drawing d_1, d_2, .. in turn calls :meth:`warp` and :meth:`draw` for each position and
  :meth:`push` after each draw, so that the counts of position i include d_<i (a no-op without adjustments);
  verification warps the whole window at once with :meth:`warp_window`.
  """

  settings: RowSettings
  counts: Counts | None
  mode: Mode = dataclasses.field(metadata=dict(static=True))
  allowed: jax.Array | None = None  # [B, V] bool: what a grammar allows at the next position (None: all)
  grammar: Any = None  # specjax.grammar.GrammarSteps: the grammar's masks along the proposals (None: first only)

  def warp(self, logits: jax.Array) -> jax.Array:
    """Warped probabilities of ``logits [B, V]`` (or ``[B, T, V]`` sharing the current counts). With
    ``allowed``, the next position (``[B, T, V]``: position 0) is restricted to the allowed tokens first
    (unless the logits give none of them any mass)."""
    if self.allowed is not None:
      allowed = self.allowed
      if logits.ndim == 3:
        rest = jnp.ones((allowed.shape[0], logits.shape[1] - 1, allowed.shape[1]), bool)
        allowed = jnp.concatenate([allowed[:, None], rest], axis=1)
      logits = logits.astype(jnp.float32)
      # A proposer with no mass on any allowed token (a reduced draft vocabulary) keeps its own law there
      # (masking would leave nothing): its proposal is one the grammar forbids, always rejected, and q is still
      # the law it was drawn from.
      some = jnp.any(allowed & (logits > -jnp.inf), axis=-1, keepdims=True)
      logits = jnp.where(allowed | ~some, logits, -jnp.inf)
    return warp_logits(logits, self.settings, self.mode, self.counts)

  def warp_window(self, logits: jax.Array, drafts: jax.Array) -> jax.Array:
    """Warped ``[B, k+1, V]`` for the window ``[last, d_1..d_k]``: position i counts ``d_1..d_i``."""
    return warp_logits(logits, self.settings, self.mode, self.counts, drafts)

  def warp_nodes(self, logits: jax.Array, path_counts: jax.Array | None) -> jax.Array:
    """Warped ``[B, T, V]`` for tree nodes: node t counts ``path_counts[:, t]`` (the tokens on its path below
    the root, :func:`specjax.tree.node_counts`) besides the row's own; ``path_counts`` may be None when the
    sampler keeps no counts."""
    extra = path_counts if self.counts is not None else None
    return warp_logits(logits, self.settings, self.mode, self.counts, extra=extra)

  @property
  def counts_tokens(self) -> bool:
    """Whether warps read counts (penalties, logit bias): tree nodes then need their path counts."""
    return self.counts is not None

  def push(self, tokens: jax.Array) -> Sampler:
    """The sampler for the next position, after each row drew ``tokens [B]``. With ``grammar``, ``allowed``
    becomes the grammar's mask after the proposals so far (asked of the host); without, a grammar's
    ``allowed`` holds for the first position only."""
    sampler = self
    if self.grammar is not None:
      grammar, allowed = self.grammar.advance(tokens)
      sampler = dataclasses.replace(sampler, grammar=grammar, allowed=allowed)
    elif self.allowed is not None:
      sampler = dataclasses.replace(sampler, allowed=jnp.ones_like(self.allowed))
    if self.counts is None:
      return sampler
    return dataclasses.replace(sampler, counts=self.counts.add(tokens[:, None], jnp.ones(tokens.shape + (1,), bool)))

  def draw(self, probs: jax.Array, keys: jax.Array) -> jax.Array:
    """Draws from warped ``probs [B, ..., V]`` with row keys ``[B]``: the argmax when every row is greedy
    (no random numbers), else :func:`sample` (a greedy row's one-hot distribution gives its argmax)."""
    if self.mode.greedy:
      return first_argmax(probs)
    return sample(probs, keys)

  def draw_chain(self, logits: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array, Sampler]:
    """Draws ``d_1..d_k`` in turn from ``logits [B, k, V]`` that do not depend on the draws (Medusa's heads):
    ``(drafts [B, k], q [B, k, V], sampler after them)``; one vectorised warp when nothing counts and no
    grammar masks the positions after the first."""
    k = logits.shape[1]
    if self.counts is None and self.grammar is None:
      q = self.warp(logits)
      return self.draw(q, keys), q, self

    def step(sampler, xs):
      z, step_keys = xs
      q = sampler.warp(z)
      d = sampler.draw(q, step_keys)
      return sampler.push(d), (d, q)

    sampler, (drafts, q) = jax.lax.scan(step, self, (jnp.swapaxes(logits, 0, 1), split_keys(keys, k)))
    return drafts.T, jnp.swapaxes(q, 0, 1), sampler


def warp(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """One :class:`SamplingConfig` applied to every row of ``logits [B, ..., V]`` (or ``[V]``): the one warp
  (:func:`warp_logits`) with the config broadcast to rows. Settings that read counts (logit bias and
  penalties) apply as at the start of generation of a prompt with no tokens: use :class:`Sampler` for more.

  Returns:
    Probabilities of ``logits``' shape, ``float32``, that sum to 1 along the last axis.
  """
  flat = logits if logits.ndim > 1 else logits[None]
  batch, vocab = flat.shape[0], flat.shape[-1]
  mode = Mode.of([cfg])
  settings = jax.tree.map(jnp.asarray, RowSettings.of([cfg] * batch, [1] * batch, [()] * batch, vocab, mode))
  counts = None
  if mode.adjusts:
    counts = Counts(generated=jnp.zeros((batch, vocab), jnp.int32), prompt=jnp.zeros((batch, vocab), bool))
  probs = warp_logits(flat, settings, mode, counts)
  return probs if logits.ndim > 1 else probs[0]


def row_keys(seed_or_key, batch: int) -> jax.Array:
  """``[B]`` row keys from one seed or PRNG key (``generate``'s rows); a server gives each request its own."""
  key = jax.random.key(seed_or_key) if isinstance(seed_or_key, (int, np.integer)) else seed_or_key
  return jax.random.split(key, batch)


def split_keys(keys: jax.Array, n: int) -> jax.Array:
  """``n`` keys per row from row keys ``[B]``: ``[n, B]`` (item i: one key per row)."""
  return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, n))(keys), 0, 1)


def uniform(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform draws in [0, 1) of ``shape [B, ...]``, row b from ``keys[b]``."""
  return jax.vmap(lambda k: jax.random.uniform(k, shape[1:], jnp.float32))(keys)


def sample(weights: jax.Array, keys: jax.Array) -> jax.Array:
  """Draws an index with probability proportional to ``weights`` (need not be normalised).

  Uses the exponential race: ``argmax_v weights_v / e_v`` with ``e_v ~ Exp(1)`` picks ``v`` with
  probability ``weights_v / sum(weights)``; zero weights are never picked when any weight is positive.

  Args:
    weights: ``[B, ..., V]`` non-negative.
    keys: row keys ``[B]``: row b's draws depend on ``keys[b]`` alone.

  Returns:
    ``[B, ...] int32`` indices.
  """
  e = jax.vmap(lambda k: jax.random.exponential(k, weights.shape[1:], jnp.float32))(keys)
  # e = 0 has probability 2^-24 per entry; clamp it so that 0 / e never makes a NaN.
  e = jnp.maximum(e, jnp.finfo(jnp.float32).tiny)
  return first_argmax(weights / e)
