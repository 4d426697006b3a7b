"""Medusa (Cai et al. 2024): k heads on the target's last hidden state propose k tokens in one pass."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax.proposers.base import Context, Features, Proposal, Proposer, TreeProposal, Verified
from specjax.tree import grow


@dataclasses.dataclass(frozen=True, eq=False)
class Medusa(Proposer):
  """Proposal j of a round comes from head j on the target's hidden state at position ``L - 1`` (the
  state whose own logits produced ``last``): ``d_j ~ q_j = warp(unembed(head_j(h)))``. The heads do not
  see each other's proposals; the acceptance rule keeps the output exact all the same.

  Attributes:
    heads: a :class:`specjax.models.heads.MedusaHeads` built for this target; k <= its head count.

  Its state is ``h [B, D]``, the target's hidden state at position ``L - 1``.
  """

  heads: Any = None

  name: ClassVar[str] = "medusa"
  may_skip_propose: ClassVar[bool] = True  # commit reads only the previous commit's state (base.Proposer)
  plain_rounds_keep_caches: ClassVar[bool] = True  # it holds no KV cache
  module_fields: ClassVar[tuple[str, ...]] = ("heads",)

  @property
  def max_k(self) -> int | None:
    return self.heads.cfg.num_heads

  def check(self, target_cfg, needed_len: int) -> None:
    from specjax.models.heads import check_heads, kinds_of

    cfg = getattr(self.heads, "cfg", None)
    if cfg is None or getattr(cfg, "kind", None) not in kinds_of(self.name):
      raise ValueError(f"method 'medusa' needs Medusa heads (specjax.models.heads.MedusaHeads), "
                       f"got {type(self.heads).__name__}")
    check_heads(cfg, target_cfg)

  def describe(self) -> dict[str, Any]:
    return {"method": self.name, "heads": self.heads.cfg.num_heads}

  def init(self, target, prompts, prompt_lens, features: Features, max_len: int) -> jax.Array:
    rows = jnp.arange(prompts.shape[0])
    return features.hidden[rows, jnp.maximum(prompt_lens - 2, 0)]  # [B, D]

  def propose(self, state, target, ctx: Context, keys, k, sampler, steps) -> Proposal:
    z = self.heads(state)[:, :k]  # [B, k, D]
    drafts, q, _ = sampler.draw_chain(self.heads.logits(target, z), keys)  # [B, k], [B, k, V]
    return Proposal(drafts, q, state, jnp.zeros((), jnp.int32))

  def propose_tree(self, state, target, ctx: Context, keys, spec, sampler) -> TreeProposal:
    """Level d's children come from head d on the same hidden state, whatever their parents (Medusa's
    cartesian tree; a dynamic tree ranks the paths by the sum of the heads' log-probabilities)."""
    logits = self.heads.logits(target, self.heads(state)[:, :spec.depth])  # [B, D, V]

    def expand(level, frontier, carry):
      return jnp.broadcast_to(logits[:, level - 1][:, None], frontier.tokens.shape + logits.shape[-1:]), carry

    tree, q, _ = grow(spec, ctx.last, expand, None, sampler, keys)
    return TreeProposal(tree, q, state, jnp.zeros((), jnp.int32))

  def commit(self, state, target, verified: Verified) -> jax.Array:
    h = verified.features.hidden[jnp.arange(state.shape[0]), verified.n]  # position L + n = new L - 1
    return jnp.where(verified.active[:, None], h, state)
