"""Proposers behind one protocol (:mod:`specjax.proposers.base`): a draft model (sequential, or parallel: PARD),
n-gram lookup, suffix decoding over the row's context and a global store, heads on the target (Medusa,
EAGLE-1/3, MTP), and a combination of any of them chosen per row. Pass one to :func:`specjax.generate` as
``proposer=``."""

import dataclasses

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


def for_heads(heads, **options) -> Proposer:
  """The proposer that drives a head set from :mod:`specjax.models.heads`: ``PROPOSERS[method]`` of its
  kind's registry entry (:data:`specjax.models.heads.HEADS`, by ``heads.cfg.kind``), built with ``options``
  (e.g. ``cutoff=`` for EAGLE and MTP: :class:`specjax.proposers.chain.ChainHeads`)."""
  kind = getattr(getattr(heads, "cfg", None), "kind", None)
  if kind not in HEADS:
    raise ValueError(f"heads must be a head set from specjax.models.heads (kind one of {tuple(HEADS)}), "
                     f"got {type(heads).__name__}")
  cls = PROPOSERS[HEADS[kind].method]
  fields = {f.name for f in dataclasses.fields(cls)} - set(cls.module_fields)
  if unknown := sorted(set(options) - fields):
    raise ValueError(f"{cls.name} takes the options {sorted(fields)}, not {unknown}")
  return cls(heads, **options)


__all__ = ["METHODS", "MAX_NGRAM", "MTP", "PROPOSERS", "Combined", "Context", "DraftModel", "Eagle", "Features",
           "Medusa", "NGram", "ParallelDraft", "Proposal", "Proposer", "Suffix", "SuffixStore", "Verified",
           "draft_rollout", "for_heads", "ngram_propose"]
