"""A separate, smaller draft model as the proposer (Leviathan et al. 2023; Chen et al. 2023)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache import KVCache, write_rows
from specjax.config import MAX_K
from specjax.sharding import TOKENS
from specjax.proposers.base import Context, Features, Proposal, Proposer, TreeProposal, Verified
from specjax.sampling import Sampler, split_keys
from specjax.tree import TreeMask, compact, frontier_sizes, grow


def draft_rollout(draft_fn, cache: KVCache, last: jax.Array, keys: jax.Array, k: int,
                  sampler: Sampler, steps: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, KVCache]:
  """Proposes k tokens per row with k single-token draft steps.

  Args:
    draft_fn: ``(tokens[B, 1], cache) -> (logits, hidden, cache)``.
    cache: draft cache holding the context before ``last``.
    last: ``[B]`` the newest accepted token.
    keys: ``[B]`` row keys.
    k: static speculation length.
    sampler: the round's warp, shared with the target (each step counts the proposals before it).
    steps: optional ``[] int32`` in ``[1, k]`` (a dynamic schedule): steps past it are skipped at run
      time and yield token 0 with ``q = 0``.

  Returns:
    drafts ``[B, k] int32``, their warped distributions ``q [B, k, V]``, and the draft cache, which now
    also holds ``last, d_1 .. d_{k-1}`` (those drafted).
  """

  def propose(cache, token, sampler, step_keys):
    logits, _, cache = draft_fn(token[:, None], cache)
    q = sampler.warp(logits[:, 0])  # [B, V]
    d = sampler.draw(q, step_keys)
    return cache, d, q, sampler.push(d)

  def step(carry, xs):
    cache, token, sampler = carry
    i, step_keys = xs
    if steps is None:
      cache, d, q, sampler = propose(cache, token, sampler, step_keys)
    else:
      skip = lambda c, t, s, _: (c, jnp.zeros_like(t), jnp.zeros((t.shape[0], vocab), jnp.float32), s)
      cache, d, q, sampler = jax.lax.cond(i < steps, propose, skip, cache, token, sampler, step_keys)
    return (cache, d, sampler), (d, q)

  vocab = jax.eval_shape(lambda c, t: draft_fn(t[:, None], c)[0], cache, last).shape[-1]
  (cache, _, _), (drafts, q) = jax.lax.scan(step, (cache, last, sampler), (jnp.arange(k), split_keys(keys, k)))
  return drafts.T, jnp.swapaxes(q, 0, 1), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeRegion:
  """The draft's entries of one tree round, from :meth:`DraftModel.propose_tree` to :meth:`DraftModel.commit`.

  Entry ``w`` (cache index ``L + w``, ``L`` the root's index) holds the keys and values of a frontier node:
  its token, its depth (0: the root) and its parent's entry (-1 for the root). An entry's keys and values
  depend only on the tokens of its path from the root, so any entry whose path spells the accepted tokens
  holds the accepted node's (duplicate siblings of a sampled tree included).

  Attributes:
    tokens, parents, depths: ``[B, W] int32``, ``W`` the frontier sizes' sum.
  """

  tokens: jax.Array
  parents: jax.Array
  depths: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
  """Invariant: ``history[b, :L + 1]`` is row b's context (prompt, then accepted tokens; ``last`` at the
  target cache's length ``L``), and the draft cache holds the keys and values of ``history[b, :seen]``,
  ``seen = cache.lengths[b] <= L``, at their own positions. ``seen = L`` after a chain round with a
  rejection; ``L - 1`` after a fully accepted chain round (the draft never fed its own last proposal). After
  a tree round ``seen = L`` when the last accepted node was expanded (its entry is moved into place with
  the rest of the path), ``L - 1`` when it was not (a leaf). Smaller still after rounds in which the draft
  proposed nothing (a server's k = 0 rounds). ``propose`` first catches the draft up to ``L``.

  ``region`` is None between rounds; a tree round's :meth:`DraftModel.propose_tree` sets it (what
  :meth:`DraftModel.commit` needs to compact the accepted path) and ``commit`` drops it again.
  """

  cache: KVCache
  history: jax.Array  # [B, max_len + 1] int32
  fed: jax.Array  # [B, MAX_K] int32: d_1 .. d_{k-1} the last chain rollout fed after last (-1 past them)
  region: TreeRegion | None = None


def _no_fed(batch: int) -> jax.Array:
  return jnp.full((batch, MAX_K), -1, jnp.int32)


# Tokens fed per catch-up pass once a row is more than one token behind (after rounds without proposals).
CATCH_UP_WIDTH = 8


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel(Proposer):
  """A draft model with the target's vocabulary, run autoregressively for k steps per round, or one pass per
  level over a token tree's frontier (:meth:`propose_tree`), whose accepted path's entries :meth:`commit`
  then moves to consecutive cache positions (no pass feeds the path again).

  Attributes:
    model: any specjax model (the forward contract of :mod:`specjax.models.llama`) whose vocabulary
      equals the target's.
  """

  model: Any = None

  name: ClassVar[str] = "draft"
  may_skip_propose: ClassVar[bool] = True  # commit never counts past the cache; the next propose catches up
  module_fields: ClassVar[tuple[str, ...]] = ("model",)
  catch_up: ClassVar[bool] = True
  plain_rounds_keep_caches: ClassVar[bool] = True  # commit moves the cache's lengths only

  def check(self, target_cfg, needed_len: int) -> None:
    cfg = getattr(self.model, "cfg", None)
    if cfg is None or not hasattr(cfg, "vocab_size"):
      raise ValueError(f"draft must be a specjax model (with a .cfg config), got {type(self.model).__name__}")
    if cfg.vocab_size != target_cfg.vocab_size:
      raise ValueError(f"draft vocab_size ({cfg.vocab_size}) must equal the target's ({target_cfg.vocab_size})")
    if needed_len > cfg.max_seq_len:
      raise ValueError(f"prompt length + max_new_tokens = {needed_len} exceeds the draft's cache length "
                       f"max_seq_len={cfg.max_seq_len}")

  def init(self, target, prompts, prompt_lens, features: Features, max_len: int) -> DraftState:
    batch, padded = prompts.shape
    # Writes the whole padded prompt; positions past prompt_lens - 1 are rolled back at once.
    _, _, cache = self.model(prompts, self.model.init_cache(batch, max_len))
    history = jnp.zeros((batch, max_len + 1), jnp.int32).at[:, :padded].set(prompts)
    return DraftState(cache=cache.with_lengths(prompt_lens - 1), history=history, fed=_no_fed(batch))

  def _catch_up(self, state: DraftState, ctx: Context) -> tuple[KVCache, jax.Array]:
    """Feeds every active row's unseen context ``history[seen:L]`` to the draft: one single-token pass
    after a fully accepted round, passes of ``CATCH_UP_WIDTH`` tokens while some row is further behind.
    Returns the cache (``seen = L`` for active rows) and the number of passes."""
    behind = lambda cache: jnp.where(ctx.active, ctx.lengths - cache.lengths, 0)  # [B]

    def feed(width: int):
      def run(cache: KVCache) -> KVCache:
        # A window that would run past the cache starts earlier: re-feeding seen tokens rewrites the same
        # entries. Rows not behind write past their length only (rolled back).
        start = jnp.clip(cache.lengths, 0, cache.max_len - width)  # [B]
        tokens = jnp.take_along_axis(state.history, start[:, None] + jnp.arange(width)[None, :], axis=1)
        _, _, fed = self.model(tokens, cache.with_lengths(start))
        seen = jnp.where(behind(cache) > 0, jnp.minimum(start + width, ctx.lengths), cache.lengths)
        return fed.with_lengths(seen)
      return run

    def body(carry):
      cache, passes = carry
      cache = jax.lax.cond(jnp.max(behind(cache)) > 1, feed(CATCH_UP_WIDTH), feed(1), cache)
      return cache, passes + 1

    return jax.lax.while_loop(lambda c: jnp.any(behind(c[0]) > 0), body, (state.cache, jnp.zeros((), jnp.int32)))

  def propose(self, state: DraftState, target, ctx: Context, keys, k, sampler, steps) -> Proposal:
    # The draft must see every accepted token before proposing (see DraftState).
    cache, passes = self._catch_up(state, ctx)
    drafts, q, cache = draft_rollout(self.model, cache, ctx.last, keys, k, sampler, steps)
    fed = jnp.pad(drafts[:, :k - 1], ((0, 0), (0, MAX_K - (k - 1))), constant_values=-1)
    return Proposal(drafts, q, dataclasses.replace(state, cache=cache, fed=fed), passes)

  def propose_tree(self, state: DraftState, target, ctx: Context, keys, spec, sampler) -> TreeProposal:
    """The draft over a tree: after the catch-up, level j's frontier (the root at level 1) is one draft pass
    at position ``L + j - 1``, written after the previous levels' entries, each node attending to the context
    and to its ancestors' entries (a :class:`specjax.tree.TreeMask` over the region from ``L`` on). The
    state keeps the region's layout (:class:`TreeRegion`); :meth:`commit` moves the accepted path's entries
    to consecutive positions, so the next round needs a catch-up step only when the last accepted node was
    a leaf the draft never fed (the catch-up of this round counts in ``extra_steps``)."""
    cache, passes = self._catch_up(state, ctx)
    before = cache.lengths
    sizes = frontier_sizes(spec)
    start = ctx.lengths  # the root's index: the region of frontier entries starts there
    width = sum(sizes)
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    rel = jnp.asarray(np.repeat(np.arange(len(sizes)), sizes), jnp.int32)  # each entry's depth
    batch = ctx.last.shape[0]

    def expand(level, frontier, carry):
      cache, mask, tokens, parents = carry
      f = frontier.tokens.shape[1]
      own = jax.nn.one_hot(offsets[level - 1] + jnp.arange(f), width, dtype=bool)[None]
      vis = own if mask is None else own | jnp.take_along_axis(mask, frontier.parent[..., None], axis=1)
      vis = jnp.broadcast_to(vis, frontier.tokens.shape + (width,))
      tree = TreeMask(positions=jnp.broadcast_to((start + level - 1)[:, None], frontier.tokens.shape), start=start,
                      visible=vis, entry_positions=start[:, None] + rel[None, :])
      logits, _, cache = self.model(frontier.tokens, cache.with_lengths(start + offsets[level - 1]), tree=tree)
      # Where each frontier node's entry sits, for commit: its token and its parent's entry.
      up = jnp.full_like(frontier.parent, -1) if level == 1 else offsets[level - 2] + frontier.parent
      tokens = tokens.at[:, offsets[level - 1]:offsets[level - 1] + f].set(frontier.tokens)
      parents = parents.at[:, offsets[level - 1]:offsets[level - 1] + f].set(up)
      return logits, (cache, vis, tokens, parents)

    empty = jnp.zeros((batch, width), jnp.int32)
    tree, q, (cache, _, tokens, parents) = grow(spec, ctx.last, expand, (cache, None, empty, empty), sampler, keys)
    region = TreeRegion(tokens=tokens, parents=parents, depths=jnp.broadcast_to(rel[None, :], (batch, width)))
    seen = jnp.where(ctx.active, start + 1, before)  # the root's entry; commit adds the accepted path's
    return TreeProposal(tree, q, DraftState(cache=cache.with_lengths(seen), history=state.history, fed=_no_fed(batch),
                                           region=region),
                        passes)

  def _compact(self, state: DraftState, verified: Verified) -> KVCache:
    """The cache after a tree round: for each accepted depth ``i`` whose node has an entry (every accepted
    node but possibly the last: a node with an accepted child was expanded), an entry whose path spells
    ``d_1..d_i`` moves to ``L + i``; ``seen = L + 1 +`` their number for active rows."""
    region, cache = state.region, state.cache
    depth = verified.window.shape[1] - 1  # D: the window is the root and the path's D tokens
    deps = region.depths
    # window[:, i] is the accepted node's token at depth i (for i <= n).
    spelled = (region.tokens == jnp.take_along_axis(verified.window, jnp.minimum(deps, depth), axis=1)) & (
        deps <= verified.n[:, None])
    match = deps == 0  # the root's entry (at L already)
    for _ in range(depth - 1):  # entries reach depth D - 1; a node matches when its parent does, one level a step
      up = jnp.take_along_axis(match, jnp.maximum(region.parents, 0), axis=1)
      match = (deps == 0) | (spelled & up & (region.parents >= 0))
    levels = jnp.arange(1, depth)  # [D - 1] the depths that can have entries besides the root
    cand = match[:, None, :] & (deps[:, None, :] == levels[None, :, None])  # [B, D - 1, W]
    has = jnp.any(cand, axis=-1) & verified.active[:, None]
    src = jnp.where(has, jnp.argmax(cand, axis=-1), levels[None, :]).astype(jnp.int32)  # else: stays
    idx = jnp.concatenate([jnp.zeros((src.shape[0], 1), jnp.int32), src], axis=1)  # [B, D]
    width = region.tokens.shape[1]
    # Inactive rows move nothing (identity indices), at a start that keeps the slice inside the cache.
    start = jnp.where(verified.active, verified.lengths, jnp.minimum(verified.lengths, cache.max_len - width))
    moved = compact(cache, start, idx, width)
    # At most L + 1 + n = the new length (only depths <= n match); inactive rows keep what they had.
    return moved.with_lengths(jnp.where(verified.active, verified.lengths + 1 + jnp.sum(has, axis=1), cache.lengths))

  def commit(self, state: DraftState, target, verified: Verified) -> DraftState:
    history = write_rows(state.history, verified.emitted, verified.lengths + 1, TOKENS)
    if state.region is not None:  # a tree round: the accepted path's entries move into place
      return DraftState(cache=self._compact(state, verified), history=history, fed=state.fed)
    # The rollout fed last, d_1 .. d_{steps-1}: the draft has seen what of them the row's context continues
    # with, its leading run of fed tokens equal to the emitted ones (all accepted proposals, when the round
    # verified this draft's own proposals; fewer when a combined proposer chose another member's). After a
    # round without proposals (the draft fed nothing) seen stays where it was.
    emitted = jnp.pad(verified.emitted, ((0, 0), (0, max(0, MAX_K - verified.emitted.shape[1]))),
                      constant_values=-2)[:, :MAX_K]
    agree = jnp.sum(jnp.cumprod(state.fed == emitted, axis=1), axis=1)  # [B]
    seen = jnp.minimum(jnp.minimum(verified.new_lengths, state.cache.lengths), verified.lengths + 1 + agree)
    return DraftState(cache=state.cache.with_lengths(seen), history=history, fed=state.fed)
