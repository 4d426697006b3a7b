"""Proposers behind one protocol (:mod:`specjax.proposers.base`): a draft model (sequential, or parallel: PARD),
n-gram lookup, suffix decoding over the row's context and a global store, heads on the target (Medusa,
EAGLE-1/3, MTP), and a combination of any of them chosen per row. Pass one to :func:`specjax.generate` as
``proposer=``."""

from specjax.models.heads import HEADS
from specjax.proposers.base import Context, Features, Proposal, Proposer, Verified
from specjax.proposers.combined import Combined
from specjax.proposers.draft import DraftModel, draft_rollout
from specjax.proposers.eagle import Eagle
from specjax.proposers.medusa import Medusa
from specjax.proposers.mtp import MTP
from specjax.proposers.ngram import MAX_NGRAM, NGram, ngram_propose
from specjax.proposers.pard import ParallelDraft
from specjax.proposers.suffix import Suffix, SuffixStore

# Method names (CLI, bench, reports) -> proposer class. "none" is the target-only baseline.
PROPOSERS: dict[str, type[Proposer]] = {
    cls.name: cls for cls in (DraftModel, ParallelDraft, NGram, Suffix, Medusa, Eagle, MTP, Combined)}
METHODS = ("none",) + tuple(PROPOSERS)


def for_heads(heads) -> Proposer:
  """The proposer that drives a head set from :mod:`specjax.models.heads`: ``PROPOSERS[method]`` of its
  kind's registry entry (:data:`specjax.models.heads.HEADS`, by ``heads.cfg.kind``)."""
  kind = getattr(getattr(heads, "cfg", None), "kind", None)
  if kind not in HEADS:
    raise ValueError(f"heads must be a head set from specjax.models.heads (kind one of {tuple(HEADS)}), "
                     f"got {type(heads).__name__}")
  return PROPOSERS[HEADS[kind].method](heads)


__all__ = ["METHODS", "MAX_NGRAM", "MTP", "PROPOSERS", "Combined", "Context", "DraftModel", "Eagle", "Features",
           "Medusa", "NGram", "ParallelDraft", "Proposal", "Proposer", "Suffix", "SuffixStore", "Verified",
           "draft_rollout", "for_heads", "ngram_propose"]
