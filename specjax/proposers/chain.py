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
``d_{j-1}``, at index ``L + D - 2 + max(0, j - D)`` (speculative entries past each cache's length). Depth
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


@dataclasses.dataclass(frozen=True, eq=False)
class ChainHeads(Proposer):
  """Base of the EAGLE and MTP proposers (see the module docstring); ``heads`` is the head module."""

  heads: Any = None

  module_fields: ClassVar[tuple[str, ...]] = ("heads",)
  kinds: ClassVar[tuple[str, ...]] = ()
  may_skip_propose: ClassVar[bool] = True  # commit re-reads the whole window from the previous commit's caches

  @property
  def aux_layers(self) -> tuple[int, ...]:
    return self.heads.cfg.aux_layers

  def check(self, target_cfg, needed_len: int) -> None:
    from specjax.models.heads import check_heads

    cfg = getattr(self.heads, "cfg", None)
    if cfg is None or getattr(cfg, "kind", None) not in self.kinds:
      raise ValueError(f"method {self.name!r} needs a head set of kind {' or '.join(self.kinds)} "
                       f"(specjax.models.heads), got {type(self.heads).__name__}")
    check_heads(cfg, target_cfg)

  def describe(self) -> dict[str, Any]:
    return {"method": self.name, "kind": self.heads.cfg.kind, "depths": self.heads.num_depths}

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
    heads, depths = self.heads, self.heads.num_depths
    keys = split_keys(keys, k)  # [k, B]
    caches = list(state.caches)

    def sample(depth, out, step_keys, sampler):
      q = sampler.warp(heads.logits(depth, target, out))  # [B, V]
      d = sampler.draw(q, step_keys)
      return d, q, sampler.push(d)

    d, q, sampler = sample(0, state.feat, keys[0], sampler)
    drafts, qs, out = [d], [q], state.feat
    start = ctx.lengths + depths - 2  # the chain's first index in each depth's cache (position L - 1)
    gap = lambda depth: (ctx.lengths + depths - depth, start)  # [true pairs' end, chain start)
    for j in range(2, min(k, depths) + 1):  # proposal j from depth j, at position L - 1
      out, caches[j - 1] = heads.step(j - 1, target, out[:, None], d[:, None], caches[j - 1].with_lengths(start),
                                      gap(j))
      out = out[:, 0]
      d, q, sampler = sample(j - 1, out, keys[j - 1], sampler)
      drafts.append(d)
      qs.append(q)
    if k > depths:  # proposals past the depth: the last depth rolls out on its own outputs, one position on
      last_depth = depths - 1

      def step(carry, step_keys):
        out, token, cache, sampler = carry
        out, cache = heads.step(last_depth, target, out[:, None], token[:, None], cache, gap(depths))
        token, q, sampler = sample(last_depth, out[:, 0], step_keys, sampler)
        return (out[:, 0], token, cache, sampler), (token, q)

      cache = caches[last_depth].with_lengths(ctx.lengths + depths - 1)
      (_, _, caches[last_depth], _), (rest, rest_q) = jax.lax.scan(step, (out, d, cache, sampler), keys[depths:])
      drafts.append(rest.T)
      qs.append(jnp.swapaxes(rest_q, 0, 1))
    drafts = jnp.concatenate([x if x.ndim == 2 else x[:, None] for x in drafts], axis=1)  # [B, k]
    q = jnp.concatenate([x if x.ndim == 3 else x[:, None] for x in qs], axis=1)  # [B, k, V]
    return Proposal(drafts, q, dataclasses.replace(state, caches=tuple(caches)), jnp.zeros((), jnp.int32))

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
