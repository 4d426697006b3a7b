"""Parallel drafting (PARD, An et al. 2025): a draft model with a mask token proposes k tokens in one pass.

The pass reads the row's newly committed tokens (those its cache does not hold yet, ending with ``last``) and
then ``k - 1`` mask tokens; the outputs at ``last`` and at the masks are q_1..q_k. q_i does not condition on
d_<i; the acceptance rule is exact for any q_i that d_i was really drawn from (``ALGORITHMS.md``, "Parallel
drafting"). The masks' keys and values never become context: the cache length advances over the real tokens
only, so the next pass overwrites them.

The draft's vocabulary is the target's plus the mask token (``mask_id = target vocab_size`` by default, the
draft's last row): q is the warp of the first ``V`` logits. Train one with ``specjax train draft --parallel``
(:mod:`specjax.train.pard`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax.cache import KVCache, write_rows
from specjax.proposers.base import Context, Features, Proposal, Proposer, Verified
from specjax.sampling import Sampler
from specjax.sharding import TOKENS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ParallelState:
  """Invariant: ``history[b, :L + 1]`` is row b's context (``last`` at the target cache's length ``L``), and
  the draft cache holds the keys and values of ``history[b, :seen]``, ``seen = cache.lengths[b] <= L``, at their
  own positions. After a round ``seen`` is the round's ``L + 1`` (the pass fed the real tokens through
  ``last``): the next pass feeds the ``n + 1`` tokens the round emitted. Entries past ``seen`` (the masks, the
  pass's padding) are not context."""

  cache: KVCache
  history: jax.Array  # [B, max_len + 1] int32


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelDraft(Proposer):
  """A parallel draft model: one forward pass per round whatever k (chains only: no ``propose_tree``).

  Attributes:
    model: a specjax model whose vocabulary is the target's plus the mask token (with ``unembed``, the LM head
      on final-norm features, as every specjax decoder has).
    mask_id: the mask token's id, in ``[target vocab_size, model vocab_size)``; None: the draft's last token.
    max_proposals: the most proposals per round (static: the draft's cache keeps room for one pass of
      ``2 * max_proposals`` tokens past the context).
  """

  model: Any = None
  mask_id: int | None = None
  max_proposals: int = 16

  name: ClassVar[str] = "pard"
  may_skip_propose: ClassVar[bool] = True  # the next propose catches up on what a skipped round did not feed
  plain_rounds_keep_caches: ClassVar[bool] = True  # commit writes the history only
  module_fields: ClassVar[tuple[str, ...]] = ("model",)

  @property
  def max_k(self) -> int:
    return self.max_proposals

  @property
  def mask(self) -> int:
    """The mask token's id (``mask_id``, or the draft's last token)."""
    return self.model.cfg.vocab_size - 1 if self.mask_id is None else self.mask_id

  def check(self, target_cfg, needed_len: int) -> None:
    cfg = getattr(self.model, "cfg", None)
    if cfg is None or not hasattr(cfg, "vocab_size"):
      raise ValueError(f"ParallelDraft.model must be a specjax model (with a .cfg config), got "
                       f"{type(self.model).__name__}")
    v = target_cfg.vocab_size
    if cfg.vocab_size <= v:
      raise ValueError(
          f"ParallelDraft.model has no mask token: its vocab_size ({cfg.vocab_size}) must be the target's "
          f"vocab_size + 1 ({v + 1}), the last token being the mask (mask_id = {v}); train a parallel draft with "
          "`specjax train draft --parallel`")
    if cfg.vocab_size != v + 1:
      raise ValueError(f"ParallelDraft.model's vocab_size ({cfg.vocab_size}) must be the target's vocab_size + 1 "
                       f"({v + 1}): the target's tokens and the mask token")
    if self.mask_id is not None and (isinstance(self.mask_id, bool) or not isinstance(self.mask_id, int)
                                     or not v <= self.mask_id < cfg.vocab_size):
      raise ValueError(f"ParallelDraft.mask_id must be in [{v}, {cfg.vocab_size}) (a token the target never "
                       f"emits), got {self.mask_id!r}")
    if isinstance(self.max_proposals, bool) or not isinstance(self.max_proposals, int) or self.max_proposals < 1:
      raise ValueError(f"ParallelDraft.max_proposals must be an integer >= 1, got {self.max_proposals!r}")
    if needed_len > cfg.max_seq_len:
      raise ValueError(f"prompt length + max_new_tokens = {needed_len} exceeds the draft's cache length "
                       f"max_seq_len={cfg.max_seq_len}")

  def init(self, target, prompts, prompt_lens, features: Features, max_len: int) -> ParallelState:
    batch, padded = prompts.shape
    # Room past the target's cache length for one pass's masks and padding (2k tokens, k <= max_proposals).
    _, _, cache = self.model(prompts, self.model.init_cache(batch, max_len + 2 * self.max_proposals))
    history = jnp.zeros((batch, max_len + 1), jnp.int32).at[:, :padded].set(prompts)
    return ParallelState(cache=cache.with_lengths(prompt_lens - 1), history=history)

  def _catch_up(self, state: ParallelState, ctx: Context, width: int) -> tuple[KVCache, jax.Array]:
    """Feeds ``width`` unseen tokens per pass while some active row has more than ``width`` unseen (after
    rounds without proposals); rows with fewer write past their length only. Returns the cache and the
    number of passes (none after an ordinary round)."""
    behind = lambda cache: jnp.where(ctx.active, ctx.lengths + 1 - cache.lengths, 0)  # [B] unseen incl. last

    def body(carry):
      cache, passes = carry
      tokens = jnp.take_along_axis(state.history, cache.lengths[:, None] + jnp.arange(width)[None, :], axis=1,
                                   mode="clip")
      _, _, fed = self.model(tokens, cache)
      seen = jnp.where(behind(cache) > width, cache.lengths + width, cache.lengths)
      return fed.with_lengths(seen), passes + 1

    return jax.lax.while_loop(lambda c: jnp.any(behind(c[0]) > width), body,
                              (state.cache, jnp.zeros((), jnp.int32)))

  def propose(self, state: ParallelState, target, ctx: Context, keys, k, sampler: Sampler, steps) -> Proposal:
    """One pass: each row's ``u`` unseen real tokens (``history[seen:L + 1]``, ``1 <= u <= k + 1`` after an
    ordinary round; ragged rows padded to ``k + 1``) then ``k - 1`` masks at ``L + 1 .. L + k - 1``, then the
    padding (at later positions: no token reads it). The outputs at ``last`` and the masks are q_1..q_k."""
    width = k + 1  # real slots: the n + 1 <= k + 1 tokens a round emits
    cache, passes = self._catch_up(state, ctx, width)
    seen = cache.lengths  # [B]
    unseen = jnp.clip(ctx.lengths + 1 - seen, 1, width)  # [B] real tokens this pass, ending with last
    slot = jnp.arange(width + k - 1)[None, :]  # [1, 2k]
    real = jnp.take_along_axis(state.history, seen[:, None] + slot, axis=1, mode="clip")
    tokens = jnp.where(slot < unseen[:, None], real, self.mask)  # [B, 2k]
    with jax.named_scope("parallel_draft"):
      _, hidden, fed = self.model(tokens, cache)  # hidden [B, 2k, D]
      at = unseen[:, None] - 1 + jnp.arange(k)[None, :]  # [B, k]: last, then the k - 1 masks
      # The LM head at the k outputs only (the pass's other logits are never computed: XLA drops them); q is over
      # the target's vocabulary: the mask token's logit is dropped.
      logits = self.model.unembed(jnp.take_along_axis(hidden, at[..., None], axis=1))[..., :target.cfg.vocab_size]
    drafts, q, _ = sampler.draw_chain(logits, keys)
    # The real tokens through last are context now; the masks' entries are dropped (not counted).
    lengths = jnp.where(ctx.active, seen + unseen, seen)
    return Proposal(drafts, q, ParallelState(cache=fed.with_lengths(lengths), history=state.history), passes)

  def commit(self, state: ParallelState, target, verified: Verified) -> ParallelState:
    history = write_rows(state.history, verified.emitted, verified.lengths + 1, TOKENS)
    # The pass fed the context through the round's last token: the emitted tokens are the next pass's input.
    return ParallelState(cache=state.cache, history=history)
