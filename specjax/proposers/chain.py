"""Chain heads on the target (EAGLE, MTP): one-layer modules rolled out on their own outputs.

A chain head has ``D`` depths (EAGLE: 1; MTP: its modules), each with its own KV cache. Depth d's cache
holds, at index ``i + D - 1``, the pair ``(h^{d-1}_i, x_{i+d})``: ``h^0_i`` is the target's feature at
position i (``heads.input_features``), ``h^{d}_i`` the output of depth d there. Indices below ``D - 1``
are placeholders that attention never sees (``first`` of the heads' attention).

Invariant at the start of a round, with the target cache at length ``L`` and ``last = x_L``:

- depth d's cache holds the true pairs for ``i <= L - d`` (length ``L + D - d``): every token and feature
  in them is accepted context, never one of the head's own guesses;
- ``feat`` is depth 1's output for ``i = L - 1``, the pair ``(h^0_{L-1}, last)``: its logits give d_1;
- ``tail_feats``/``tail_tokens``: the target features ``h^0_i`` for ``i in [L-D+1, L-1]`` and the tokens
  ``x_{L-D+2} .. x_L``, which depths 2.. need again once later tokens are known (empty when D = 1).

propose: d_1 from ``feat``; proposal j = 2..k comes from depth ``min(j, D)`` fed the previous output and
``d_{j-1}``, at index ``L + D - 2 + max(0, j - D)`` (speculative entries past each cache's length). With a
``cutoff``, a row's proposals end before the first one the head is not sure enough its chain reaches (see
:class:`ChainHeads`), and the rollout past the depths stops once no active row goes on. Depth
d >= 3 has no true pairs for ``i in [L-d+1, L-2]`` (they need tokens past ``last``); those indices are
hidden from its attention (a gap), as in training.

commit: every depth re-reads the window ``i = L-D+1 .. L+k`` with the true features (the tails, then the
verified window's) and the accepted tokens, overwriting its own guesses; lengths move to ``L' + D - d``
for the new length ``L' = L + n + 1``, so whatever lies past the accepted tokens is rolled back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax.cache import KVCache
from specjax.proposers.base import Context, Features, Proposal, Proposer, TreeProposal, Verified
from specjax.sampling import split_keys
from specjax.tree import TreeMask, frontier_sizes, grow


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChainState:
  caches: tuple[KVCache, ...]  # one per depth, [B, S + D - 1, ...]
  feat: jax.Array  # [B, F] depth 1's output for the pair (h^0_{L-1}, last)
  tail_feats: jax.Array  # [B, D - 1, F]
  tail_tokens: jax.Array  # [B, D - 1]


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
  """``x[b, index[b, j]]`` for ``x [B, T, ...]`` and ``index [B, J]`` (clamped into range)."""
  index = jnp.clip(index, 0, x.shape[1] - 1)
  index = index.reshape(index.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, index, axis=1)


def confident_limit(confidence: jax.Array, top: jax.Array, cutoff: float) -> jax.Array:
  """How many proposals each row keeps under a ``cutoff`` (see :attr:`ChainHeads.cutoff`): ``confidence
  [B, k]`` the head's probability of each proposal it drew, ``top [B, k]`` its largest probability at that
  position (0 where it did not propose) -> ``[B] int32``: proposal j is kept while, for every i <= j,
  ``confidence_1 * .. * confidence_(i-1) * top_i >= cutoff``; the first always. The rule for proposal j reads
  proposal j's distribution but not proposal j itself."""
  before = jnp.cumprod(jnp.pad(confidence[:, :-1], ((0, 0), (1, 0)), constant_values=1.0), axis=1)
  sure = (before * top >= cutoff).at[:, 0].set(True)
  return jnp.sum(jnp.cumprod(sure.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def top_probability(probs: jax.Array, drawn: jax.Array) -> jax.Array:
  """``[B, V], [B] -> [B]``: what a cutoff compares before a proposal is drawn: its distribution's largest
  probability. (Reading the drawn token's own probability instead would keep likely draws more often than
  unlikely ones, so a kept proposal would no longer follow the q that acceptance is handed.)"""
  del drawn
  return jnp.max(probs, axis=-1)


@dataclasses.dataclass(frozen=True, eq=False)
class ChainHeads(Proposer):
  """Base of the EAGLE and MTP proposers (see the module docstring).

  Attributes:
    heads: the head module.
    cutoff: None (every round proposes k tokens), or a number in ``(0, 1]``: a row's proposals end before
      proposal j when the head's confidence that the chain gets that far falls below ``cutoff``: the product
      of its own probabilities (at temperature 1, before any warp) of the proposals before j, times the
      largest probability of its distribution for j (:func:`confident_limit`); the first proposal is always
      made. The target then verifies the shortest window that holds every row's proposals (one compiled
      window per length ``2 .. k + 1``), so a round the head is unsure about costs a short target pass, and
      the head stops rolling out once no row goes on. Whether proposal j is made reads the earlier proposals
      and j's distribution, never j's own draw nor the target, so a kept proposal still follows the q that
      acceptance is handed and the output's law is unchanged (greedy: the target alone's tokens; a rule that
      read the draw would not be: ``tests/test_distribution.py``). It pays where a longer verify pass costs
      more than a shorter one (CPUs, large batches); chains only (a :class:`specjax.tree.DynamicTree`
      already grows by the head's confidence).
  """

  heads: Any = None
  cutoff: float | None = None

  module_fields: ClassVar[tuple[str, ...]] = ("heads",)
  kinds: ClassVar[tuple[str, ...]] = ()
  may_skip_propose: ClassVar[bool] = True  # commit re-reads the whole window from the previous commit's caches

  def __post_init__(self):
    cutoff = self.cutoff
    if cutoff is not None and (isinstance(cutoff, bool) or not isinstance(cutoff, (int, float))
                               or not 0.0 < cutoff <= 1.0):
      raise ValueError(f"cutoff must be None or a number in (0, 1] (the head's confidence in its chain below "
                       f"which a row stops proposing), got {cutoff!r}")

  @property
  def aux_layers(self) -> tuple[int, ...]:
    return self.heads.cfg.aux_layers

  @property
  def varies_limit(self) -> bool:
    return self.cutoff is not None

  def verify_widths(self, k: int) -> tuple[int, ...] | None:
    return tuple(range(1, k + 1)) if self.cutoff is not None else None

  def check(self, target_cfg, needed_len: int) -> None:
    from specjax.models.heads import check_heads

    cfg = getattr(self.heads, "cfg", None)
    if cfg is None or getattr(cfg, "kind", None) not in self.kinds:
      raise ValueError(f"method {self.name!r} needs a head set of kind {' or '.join(self.kinds)} "
                       f"(specjax.models.heads), got {type(self.heads).__name__}")
    check_heads(cfg, target_cfg)

  def describe(self) -> dict[str, Any]:
    described = {"method": self.name, "kind": self.heads.cfg.kind, "depths": self.heads.num_depths}
    return described if self.cutoff is None else {**described, "cutoff": self.cutoff}

  def init(self, target, prompts, prompt_lens, features: Features, max_len: int) -> ChainState:
    heads, depths = self.heads, self.heads.num_depths
    batch, padded = prompts.shape
    feats = heads.input_features(features.hidden, features.aux)  # [B, P, F]
    h0 = feats
    caches, depth1 = [], None
    for d, cache in enumerate(heads.init_caches(batch, max_len + depths - 1)):
      # Depth d + 1 reads x_{i+d+1} at position i: the prompt shifted left (the padding is rolled back).
      tokens = jnp.pad(prompts[:, d + 1:], ((0, 0), (0, d + 1)))  # [B, P]
      cache = cache.with_lengths(jnp.full((batch,), depths - 1))
      feats, cache = heads.step(d, target, feats, tokens, cache)
      caches.append(cache.with_lengths(prompt_lens - 1 + depths - (d + 1)))
      depth1 = feats if d == 0 else depth1
    tail = prompt_lens[:, None] - depths + jnp.arange(depths - 1)[None, :]  # [B, D-1] i = P-D .. P-2
    return ChainState(caches=tuple(caches), feat=_gather(depth1, prompt_lens[:, None] - 2)[:, 0],
                      tail_feats=_gather(h0, tail), tail_tokens=_gather(prompts, tail + 1))

  def propose(self, state: ChainState, target, ctx: Context, keys, k, sampler, steps) -> Proposal:
    heads, depths, cutoff = self.heads, self.heads.num_depths, self.cutoff
    keys = split_keys(keys, k)  # [k, B]
    caches = list(state.caches)

    def sample(depth, out, step_keys, sampler):
      logits = heads.logits(depth, target, out)  # [B, V]
      q = sampler.warp(logits)
      d = sampler.draw(q, step_keys)
      sure = None
      if cutoff is not None:  # the head's own law at temperature 1: its probability of d, and its largest
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        sure = (jnp.take_along_axis(probs, d[:, None], axis=1)[:, 0], top_probability(probs, d))
      return d, q, sure, sampler.push(d)

    d, q, c, sampler = sample(0, state.feat, keys[0], sampler)
    drafts, qs, confidence, out = [d], [q], [c], state.feat
    start = ctx.lengths + depths - 2  # the chain's first index in each depth's cache (position L - 1)
    gap = lambda depth: (ctx.lengths + depths - depth, start)  # [true pairs' end, chain start)
    for j in range(2, min(k, depths) + 1):  # proposal j from depth j, at position L - 1
      out, caches[j - 1] = heads.step(j - 1, target, out[:, None], d[:, None], caches[j - 1].with_lengths(start),
                                      gap(j))
      out = out[:, 0]
      d, q, c, sampler = sample(j - 1, out, keys[j - 1], sampler)
      drafts.append(d)
      qs.append(q)
      confidence.append(c)
    if k > depths:  # proposals past the depth: the last depth rolls out on its own outputs, one position on
      last_depth = depths - 1
      cache = caches[last_depth].with_lengths(ctx.lengths + depths - 1)

      def step(carry, step_keys):
        out, token, cache, sampler = carry
        out, cache = heads.step(last_depth, target, out[:, None], token[:, None], cache, gap(depths))
        token, q, c, sampler = sample(last_depth, out[:, 0], step_keys, sampler)
        return (out[:, 0], token, cache, sampler), (token, q, c)

      if cutoff is None:
        (_, _, caches[last_depth], _), (rest, rest_q, _) = jax.lax.scan(step, (out, d, cache, sampler),
                                                                          keys[depths:])
        drafts.append(rest.T)
        qs.append(jnp.swapaxes(rest_q, 0, 1))
      else:  # the same steps while any active row goes on (the rest stay 0: not proposals)
        left = k - depths
        so_far = [jnp.stack(x, axis=1) for x in zip(*confidence)]  # drawn, top: [B, depths]
        chain = jnp.prod(so_far[0], axis=1)
        going_on = confident_limit(*so_far, cutoff) == depths  # [B] every proposal so far kept
        zeros = lambda x: jnp.zeros((left,) + x.shape, x.dtype)
        rest, rest_q, rest_c, rest_top = zeros(d), zeros(q), zeros(chain), zeros(chain)

        def going(loop):
          return (loop[0] < left) & jnp.any(ctx.active & loop[3])

        def body(loop):
          i, carry, chain, going_on, rest, rest_q, rest_c, rest_top = loop
          carry, (token, q, (c, top)) = step(carry, keys[depths + i])
          return (i + 1, carry, chain * c, going_on & (chain * top >= cutoff), rest.at[i].set(token),
                  rest_q.at[i].set(q), rest_c.at[i].set(c), rest_top.at[i].set(top))

        loop = (jnp.zeros((), jnp.int32), (out, d, cache, sampler), chain, going_on, rest, rest_q, rest_c, rest_top)
        _, (_, _, caches[last_depth], _), _, _, rest, rest_q, rest_c, rest_top = jax.lax.while_loop(going, body, loop)
        drafts.append(rest.T)
        qs.append(jnp.swapaxes(rest_q, 0, 1))
        confidence.append((rest_c.T, rest_top.T))
    drafts = jnp.concatenate([x if x.ndim == 2 else x[:, None] for x in drafts], axis=1)  # [B, k]
    q = jnp.concatenate([x if x.ndim == 3 else x[:, None] for x in qs], axis=1)  # [B, k, V]
    limit = None
    if cutoff is not None:
      drawn, top = ([x if x.ndim == 2 else x[:, None] for x in xs] for xs in zip(*confidence))
      limit = confident_limit(jnp.concatenate(drawn, axis=1), jnp.concatenate(top, axis=1), cutoff)
    return Proposal(drafts, q, dataclasses.replace(state, caches=tuple(caches)), jnp.zeros((), jnp.int32), limit)

  def propose_tree(self, state: ChainState, target, ctx: Context, keys, spec, sampler) -> TreeProposal:
    """The chain's rollout over a tree: level 1's children from ``feat``; level j's frontier nodes enter depth
    ``min(j, D)`` as pairs (parent's output, token) at the chain's position for proposal j, each attending to
    the true pairs and to its own ancestors among the frontier entries (a :class:`specjax.tree.TreeMask` over
    the speculative region that starts where the chain's speculative entries do)."""
    heads, depths = self.heads, self.heads.num_depths
    sizes = frontier_sizes(spec)  # F per level 1..D
    levels = len(sizes)
    module = lambda j: min(j, depths) - 1  # the depth (0-based) that expands level j >= 2
    start = ctx.lengths + depths - 2
    gap = lambda depth: (ctx.lengths + depths - depth, start)
    # Each depth's region: the levels it expands, their entries' offsets and positions (static).
    offsets, region_pos = {}, {}
    for j in range(2, levels + 1):
      m = module(j)
      pos = region_pos.setdefault(m, [])
      offsets[j] = len(pos)
      pos += [max(0, j - depths)] * sizes[j - 1]
    caches = list(state.caches)

    def expand(level, frontier, carry):
      outs, masks = carry
      if level == 1:
        out = state.feat[:, None]  # [B, 1, F]
        return heads.logits(0, target, out), (out, masks)
      m = module(level)
      width = len(region_pos[m])
      rel = jnp.asarray(region_pos[m], jnp.int32)
      region = start + rel[0]  # where this depth's speculative entries begin
      f = frontier.tokens.shape[1]
      own = jax.nn.one_hot(offsets[level] + jnp.arange(f), width, dtype=bool)[None]  # [1, F, W]
      inherited = masks.get(m) if module(level - 1) == m and level > 2 else None
      mask = own if inherited is None else own | jnp.take_along_axis(inherited, frontier.parent[..., None], axis=1)
      mask = jnp.broadcast_to(mask, (frontier.tokens.shape[0], f, width))
      tree = TreeMask(positions=jnp.broadcast_to((start + max(0, level - depths))[:, None], frontier.tokens.shape),
                      start=region, visible=mask, entry_positions=start[:, None] + rel[None, :])
      parent_out = jnp.take_along_axis(outs, frontier.parent[..., None], axis=1)  # [B, F, Fd]
      cache = caches[m].with_lengths(region + offsets[level])
      out, caches[m] = heads.step(m, target, parent_out, frontier.tokens, cache, gap(m + 1), tree)
      return heads.logits(m, target, out), (out, {**masks, m: mask})

    tree, q, _ = grow(spec, ctx.last, expand, (None, {}), sampler, keys)
    return TreeProposal(tree, q, dataclasses.replace(state, caches=tuple(caches)), jnp.zeros((), jnp.int32))

  def commit(self, state: ChainState, target, verified: Verified) -> ChainState:
    heads, depths = self.heads, self.heads.num_depths
    batch, window = verified.emitted.shape
    width = window + depths - 1  # positions i = L-D+1 .. L+k
    h0 = jnp.concatenate([state.tail_feats,
                          heads.input_features(verified.features.hidden, verified.features.aux)], axis=1)
    seq = jnp.concatenate([state.tail_tokens, verified.emitted,
                           jnp.zeros((batch, depths - 1), jnp.int32)], axis=1)  # x_{L-D+2} ..
    feats, caches, depth1 = h0, [], None
    for d in range(depths):
      # Written at index L (position i = L - D + 1): every depth re-reads the whole window.
      cache = state.caches[d].with_lengths(verified.lengths)
      feats, cache = heads.step(d, target, feats, seq[:, d:d + width], cache)
      caches.append(cache.with_lengths(verified.new_lengths + depths - (d + 1)))
      depth1 = feats if d == 0 else depth1
    active, n = verified.active, verified.n
    keep = lambda new, old: jnp.where(active.reshape((batch,) + (1,) * (old.ndim - 1)), new, old)
    tail = n[:, None] + 1 + jnp.arange(depths - 1)[None, :]  # [B, D-1]
    return ChainState(caches=tuple(caches),
                      feat=keep(_gather(depth1, n[:, None] + depths - 1)[:, 0], state.feat),
                      tail_feats=keep(_gather(h0, tail), state.tail_feats),
                      tail_tokens=keep(_gather(seq, tail), state.tail_tokens))
