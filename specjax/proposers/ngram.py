"""The n-gram proposer (prompt lookup decoding): proposals copied from the row's own context.

A row's context (prompt + emitted tokens) often repeats itself: code re-uses identifiers, edits copy their
input, a stuck model loops. The proposer finds the most recent earlier occurrence of the row's last n tokens
and proposes the tokens that followed it. It needs no model and no cache, and it is deterministic, so its
proposal distribution is ``q_i = one-hot(d_i)`` and the ordinary acceptance rule keeps the output exact.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from specjax.cache import write_rows
from specjax.config import check_int
from specjax.sharding import TOKENS
from specjax.proposers.base import Context, Features, Proposal, Proposer, Verified

MAX_NGRAM = 8


def ngram_propose(history: jax.Array, length: jax.Array, k: int, n_max: int, n_min: int = 1
                  ) -> tuple[jax.Array, jax.Array]:
  """Proposes k tokens per row by n-gram lookup in the row's own context. Pure, jittable, static-shaped.

  For n from ``n_max`` down to ``n_min``, the first n that matches wins:

  1. the suffix is the row's last n tokens, ``history[b, length-n : length]``;
  2. an occurrence is an earlier position ``j`` with ``history[b, j-n+1 : j+1]`` equal to the suffix and
     ``n-1 <= j < length-1`` (it may overlap the suffix, but not be the suffix itself); take the largest j;
  3. propose ``history[b, j+1+i]`` for ``i < k``. Where that would pass the newest token, the continuation
     repeats with period ``length-1-j`` (index ``j+1 + i mod (length-1-j)``): a row in a loop proposes the
     loop, and every index stays inside the context.

  A row with no match for any n proposes its newest token k times (cheap, and right for runs of a token)
  and reports ``matched = 0``.

  Args:
    history: ``[B, L] int32``; ``history[b, :length[b]]`` is row b's context, the newest token last.
      Entries at ``length[b]`` and beyond are ignored.
    length: ``[B] int32`` in ``[1, L]``.
    k: static number of proposals per row, >= 1.
    n_max: static longest n-gram length to try.
    n_min: static shortest n-gram length to try, ``1 <= n_min <= n_max``.

  Returns:
    drafts ``[B, k] int32``, and matched ``[B] int32``: the n whose occurrence was used, 0 for none.
  """
  batch, size = history.shape
  newest = length - 1  # [B] position of the newest token
  ends = jnp.arange(size)[None, :]  # [1, L] candidate occurrence ends j
  # suffix[b, i] = history[b, newest - i]: the suffix read backwards (clamped where the row is shorter
  # than n; no occurrence can match then, because it would need n-1 <= j < newest < n-1).
  back = jnp.maximum(newest[:, None] - jnp.arange(n_max)[None, :], 0)  # [B, n_max]
  suffix = jnp.take_along_axis(history, back, axis=1)  # [B, n_max]

  # An occurrence of the last n tokens ending at j is one of the last n-1 tokens ending at j whose token
  # n-1 places back also matches: grow the match mask one token per n.
  match = ends < newest[:, None]  # [B, L]
  best_end = newest  # [B] where there is no match: repeat the newest token
  matched = jnp.zeros((batch,), jnp.int32)
  for i in range(n_max):
    shifted = jnp.pad(history, ((0, 0), (i, 0)))[:, :size]  # [B, L] shifted[b, j] = history[b, j - i]
    match = match & (ends >= i) & (shifted == suffix[:, i:i + 1])
    n = i + 1
    if n >= n_min:  # longer n-grams overwrite shorter ones
      found = jnp.any(match, axis=1)  # [B]
      last_end = jnp.max(jnp.where(match, ends, -1), axis=1)  # [B] the most recent occurrence
      best_end = jnp.where(found, last_end, best_end)
      matched = jnp.where(found, n, matched)

  period = jnp.maximum(newest - best_end, 1)  # [B] >= 1 wherever matched
  steps = jnp.arange(k)[None, :]  # [1, k]
  index = jnp.where(matched[:, None] > 0, best_end[:, None] + 1 + steps % period[:, None], newest[:, None])
  drafts = jnp.take_along_axis(history, index, axis=1)  # [B, k]
  return drafts.astype(jnp.int32), matched


@dataclasses.dataclass(frozen=True, eq=False)
class NGram(Proposer):
  """Prompt lookup: n-grams of the row's own context, longest first (see :func:`ngram_propose`).

  Attributes:
    n_max: the longest n-gram looked up, in ``[1, MAX_NGRAM]``.
    n_min: the shortest, in ``[1, n_max]``.

  Its state is the row's context, ``history[b, :lengths[b] + 1]`` with ``last`` at ``lengths[b]``.
  """

  n_max: int = 3
  n_min: int = 1

  name: ClassVar[str] = "ngram"
  may_skip_propose: ClassVar[bool] = True  # commit reads only the previous commit's state (base.Proposer)
  plain_rounds_keep_caches: ClassVar[bool] = True  # it holds no KV cache

  def __post_init__(self):
    for name in ("n_max", "n_min"):
      check_int(f"NGram.{name}", getattr(self, name), 1, MAX_NGRAM)
    if self.n_min > self.n_max:
      raise ValueError(f"NGram.n_min ({self.n_min}) must be <= n_max ({self.n_max})")

  def init(self, target, prompts, prompt_lens, features: Features, max_len: int) -> jax.Array:
    # Room for the last window a row writes: it starts below max_len and holds up to k + 1 tokens.
    batch, padded = prompts.shape
    return jnp.zeros((batch, max_len + 1), jnp.int32).at[:, :padded].set(prompts)

  def propose(self, state, target, ctx: Context, keys, k, sampler, steps) -> Proposal:
    drafts, _ = ngram_propose(state, ctx.lengths + 1, k, self.n_max, self.n_min)  # [B, k]
    q = jax.nn.one_hot(drafts, target.cfg.vocab_size, dtype=jnp.float32)  # a deterministic proposal
    return Proposal(drafts, q, state, jnp.zeros((), jnp.int32))

  def commit(self, state, target, verified: Verified) -> jax.Array:
    # The context grows at its end, lengths + 1; what lies past a row's new length is overwritten later.
    return write_rows(state, verified.emitted, verified.lengths + 1, TOKENS)
