"""Several proposers as one: per row and per round, the proposal of the member that expects to be accepted most.

``ALGORITHMS.md``, "Choosing among proposers per row (exact)". Every member commits every round (so each keeps
its state current whatever was chosen), and each row takes the proposal of the member with the highest
*expected number of accepted tokens*:

- a member that scores its own proposals (:attr:`~specjax.proposers.base.Proposal.score`; suffix decoding:
  the sum of its path probabilities) is judged by that score;
- any other member (a draft model, a head) by a constant, ``expected[i]``: what it accepts per round on
  the user's text, which ``SpecStats`` reports (``mean_accepted_length - 1``).

So with ``Combined((Suffix(store), Eagle(heads)), expected=(None, 0.8))`` a row takes the suffix match when its
score is at least 0.8 and the head's proposal otherwise. The scoring members propose every round; a member
credited with a constant proposes in a chain round only when some row chose it (the choice is known before
it proposes), so where the suffix match wins for every row the round costs the suffix's proposals only. With
trees every member proposes every round. The choice depends only on the context and the
members' states (a score never reads a round's random draws: only deterministic members score), and the
``q`` handed to acceptance is the chosen member's, so the output law is the target's, as for every proposer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax.config import MAX_K, check_int
from specjax.proposers.base import Context, Features, Proposal, Proposer, TreeProposal, Verified
from specjax.sampling import split_keys

DEFAULT_EXPECTED = 1.0  # accepted proposals per round assumed for a member that does not score its proposals


def _choose(scores: list[jax.Array]) -> jax.Array:
  """``[B] int32``: the member with the highest score per row (the first on ties)."""
  return jnp.argmax(jnp.stack(scores, axis=0), axis=0).astype(jnp.int32)


def _pick(choice: jax.Array, values: list[Any]) -> Any:
  """Row b of ``values[choice[b]]``, leaf by leaf (``values`` share one structure, batch-major)."""
  def per_leaf(*leaves):
    out = leaves[0]
    for i, leaf in enumerate(leaves[1:], start=1):
      mask = (choice == i).reshape((-1,) + (1,) * (leaf.ndim - 1))
      out = jnp.where(mask, leaf, out)
    return out
  return jax.tree.map(per_leaf, *values)


@dataclasses.dataclass(frozen=True, eq=False)
class Combined(Proposer):
  """Members proposing side by side, one chosen per row and round (see the module docstring).

  Attributes:
    members: two or more proposers. At most one may read the target's intermediate layers (``aux_layers``).
    expected: per member, None (its own score: only for members that score their proposals, such as
      :class:`~specjax.proposers.Suffix`) or a number (the accepted proposals per round it is credited with;
      ``-inf`` never chooses it). Default: the scoring members' own scores, ``DEFAULT_EXPECTED`` for others.
    ks: per member, None or the most proposals it makes in a round of k (``min(k, ks[i])``, the rest
      masked). A round verifies the shortest window that holds the chosen proposals
      (:func:`specjax.engine.verify_bucketed`), so ``Combined((Suffix(store), head), ks=(None, 2))`` with
      ``k = 8`` verifies 9 tokens where a long suffix match was chosen and 3 where the head was.
  """

  members: tuple = ()
  expected: tuple | None = None
  ks: tuple | None = None
  module_counts: tuple | None = None  # set by split: how many modules each member's template has

  name: ClassVar[str] = "combined"

  def __post_init__(self):
    members = tuple(self.members) if isinstance(self.members, (tuple, list)) else None
    if not members or len(members) < 2 or not all(isinstance(m, Proposer) for m in members):
      raise ValueError(f"Combined.members must be two or more specjax proposers, got {self.members!r}")
    if any(isinstance(m, Combined) for m in members):
      raise ValueError("Combined.members: list the members of a nested Combined directly")
    object.__setattr__(self, "members", members)
    expected = self.expected
    if expected is None:
      expected = tuple(None if m.scores_proposals else DEFAULT_EXPECTED for m in members)
    if not isinstance(expected, (tuple, list)) or len(expected) != len(members):
      raise ValueError(f"Combined.expected must give one entry per member ({len(members)}), got {self.expected!r}")
    for i, (m, e) in enumerate(zip(members, expected)):
      if e is None and not m.scores_proposals:
        raise ValueError(f"Combined.expected[{i}]: method {m.name!r} does not score its proposals; give the "
                         f"accepted proposals per round to credit it with (a number)")
      if e is not None and (isinstance(e, bool) or not isinstance(e, (int, float)) or math.isnan(e)):
        raise ValueError(f"Combined.expected[{i}] must be None or a number (-inf: never chosen), got {e!r}")
    object.__setattr__(self, "expected", tuple(None if e is None else float(e) for e in expected))
    ks = self.ks if self.ks is not None else (None,) * len(members)
    if not isinstance(ks, (tuple, list)) or len(ks) != len(members):
      raise ValueError(f"Combined.ks must give one entry per member ({len(members)}), got {self.ks!r}")
    for i, cap in enumerate(ks):
      if cap is not None:
        check_int(f"Combined.ks[{i}]", cap, 1, MAX_K)
    object.__setattr__(self, "ks", tuple(ks))
    if self.module_counts is not None:  # a template (split): its members hold no modules to ask
      return
    readers = [m for m in members if m.aux_layers]
    if len(readers) > 1:
      raise ValueError(f"Combined.members: at most one member may read the target's layers; "
                       f"{[m.name for m in readers]} all do")

  # ---------------------------------------------------------------------------------- description

  @property
  def aux_layers(self) -> tuple[int, ...]:
    return next((m.aux_layers for m in self.members if m.aux_layers), ())

  @property
  def max_k(self) -> int | None:
    # A member capped below its own maximum never needs more.
    limits = [m.max_k for m, cap in zip(self.members, self.ks) if m.max_k is not None and (cap is None or cap > m.max_k)]
    return min(limits) if limits else None

  @property
  def varies_limit(self) -> bool:
    return any(m.varies_limit for m in self.members) or any(cap is not None for cap in self.ks)

  @property
  def catch_up(self) -> bool:  # the cost model adds a catch-up step when a member needs one
    return any(m.catch_up for m in self.members)

  @property
  def plain_rounds_keep_caches(self) -> bool:
    return all(m.plain_rounds_keep_caches for m in self.members)

  def options(self) -> tuple:
    return (("members", tuple((type(m).__name__, m.options()) for m in self.members)),
            ("expected", self.expected), ("ks", self.ks), ("module_counts", self.module_counts))

  def modules(self) -> tuple[Any, ...]:
    return tuple(x for m in self.members for x in m.modules())

  def describe(self) -> dict[str, Any]:
    return {"method": self.name, "members": [m.describe() for m in self.members], "expected": list(self.expected),
            "ks": list(self.ks)}

  def check(self, target_cfg, needed_len: int) -> None:
    for m in self.members:
      m.check(target_cfg, needed_len)

  def check_tree(self, spec) -> None:
    for m in self.members:
      m.check_tree(spec)

  @property
  def proposes_trees(self) -> bool:
    return all(m.proposes_trees for m in self.members)

  def split(self, split_model) -> tuple[Proposer, tuple, tuple]:
    parts = [m.split(split_model) for m in self.members]
    template = dataclasses.replace(self, members=tuple(t for t, _, _ in parts),
                                   module_counts=tuple(len(g) for _, g, _ in parts))
    return template, tuple(x for _, g, _ in parts for x in g), tuple(x for _, _, s in parts for x in s)

  def bind(self, graphdefs: tuple, states: tuple) -> Proposer:
    members, at = [], 0
    for m, count in zip(self.members, self.module_counts):
      members.append(m.bind(graphdefs[at:at + count], states[at:at + count]))
      at += count
    return dataclasses.replace(self, members=tuple(members))

  # ------------------------------------------------------------------------------------------ pure

  def init(self, target, prompts, prompt_lens, features: Features, max_len: int) -> tuple:
    return tuple(m.init(target, prompts, prompt_lens, _features_for(m, features), max_len) for m in self.members)

  def _scores(self, proposals) -> list[jax.Array]:
    batch = (proposals[0].drafts if isinstance(proposals[0], Proposal) else proposals[0].tree.tokens).shape[0]
    return [p.score if e is None else jnp.full((batch,), e, jnp.float32) for p, e in zip(proposals, self.expected)]

  def propose(self, state, target, ctx: Context, keys, k, sampler, steps) -> Proposal:
    """The scoring members propose first; their scores and the others' constants decide each row's member;
    then each member credited with a constant proposes only when some active row chose it (a ``lax.cond``:
    at batch 1 a round costs the chosen member's proposals, not every member's), where
    :attr:`~specjax.proposers.base.Proposer.may_skip_propose` allows it."""
    member_keys = split_keys(keys, len(self.members))

    def own(i, s):
      m, cap = self.members[i], self.ks[i]
      own_k = k if cap is None else min(k, cap)
      p = m.propose(s, target, ctx, member_keys[i], own_k, sampler, None if steps is None else jnp.minimum(steps, own_k))
      limit = jnp.full(ctx.last.shape, own_k, jnp.int32) if p.limit is None else p.limit
      if own_k < k:  # padded to k: no proposals there (the engine masks past the limit)
        p = p._replace(drafts=jnp.pad(p.drafts, ((0, 0), (0, k - own_k))),
                       q=jnp.pad(p.q, ((0, 0), (0, k - own_k), (0, 0))))
      return p._replace(limit=limit)

    batch = ctx.last.shape[0]
    proposals = [own(i, s) if e is None else None for i, (s, e) in enumerate(zip(state, self.expected))]
    scores = [p.score if e is None else jnp.full((batch,), e, jnp.float32) for p, e in zip(proposals, self.expected)]
    choice = _choose(scores)
    for i, (m, s) in enumerate(zip(self.members, state)):
      if proposals[i] is not None:
        continue
      if not m.may_skip_propose:
        proposals[i] = own(i, s)
        continue
      shapes = jax.eval_shape(lambda s, i=i: own(i, s), s)
      skipped = lambda s, shapes=shapes: shapes._replace(
          drafts=jnp.zeros(shapes.drafts.shape, shapes.drafts.dtype), q=jnp.zeros(shapes.q.shape, shapes.q.dtype),
          state=s, extra_steps=jnp.zeros((), jnp.int32), limit=jnp.zeros(shapes.limit.shape, jnp.int32),
          score=None if shapes.score is None else jnp.zeros(shapes.score.shape, shapes.score.dtype))
      proposals[i] = jax.lax.cond(jnp.any((choice == i) & ctx.active), lambda s, i=i: own(i, s), skipped, s)
    drafts = _pick(choice, [p.drafts for p in proposals])
    q = _pick(choice, [p.q for p in proposals])
    limit = _pick(choice, [p.limit for p in proposals])
    score = _pick(choice, scores)
    extra = sum(p.extra_steps for p in proposals)
    return Proposal(drafts, q, tuple(p.state for p in proposals), extra, limit=limit, score=score)

  def propose_tree(self, state, target, ctx: Context, keys, spec, sampler) -> TreeProposal:
    if not self.proposes_trees:
      return super().propose_tree(state, target, ctx, keys, spec, sampler)
    member_keys = split_keys(keys, len(self.members))
    proposals = [m.propose_tree(s, target, ctx, kk, spec, sampler)
                 for m, s, kk in zip(self.members, state, member_keys)]
    scores = self._scores(proposals)
    choice = _choose(scores)
    tree = _pick(choice, [p.tree for p in proposals])
    qs = [p.q for p in proposals]
    if any(q is None for q in qs):
      if not all(q is None for q in qs):
        raise ValueError("Combined: members disagree on whether the tree's children are sampled")
      q = None
    else:
      q = _pick(choice, qs)
    return TreeProposal(tree, q, tuple(p.state for p in proposals), sum(p.extra_steps for p in proposals),
                        score=_pick(choice, scores))

  def commit(self, state, target, verified: Verified) -> tuple:
    return tuple(m.commit(s, target, dataclasses.replace(verified, features=_features_for(m, verified.features)))
                 for m, s in zip(self.members, state))


def _features_for(member: Proposer, features: Features) -> Features:
  """The target's features as ``member`` reads them: members that read no intermediate layers get none."""
  return features if member.aux_layers else Features(hidden=features.hidden, aux=None)

