"""Multi-token prediction (DeepSeek-V3) as a chain proposer.

D sequential modules share the target's embedding and unembedding (``specjax.models.heads.MTPHeads``);
proposal j comes from module ``min(j, D)``: past its depth the last module is reused on its own outputs,
as vLLM does. Each module keeps its own cache of true pairs (see :mod:`specjax.proposers.chain`); for
depths d >= 3 the positions between the accepted context and the frontier (``d - 2`` of them) need tokens
that are only guesses when proposing, and stay out of the cache.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.models.heads import kinds_of
from specjax.proposers.chain import ChainHeads


@dataclasses.dataclass(frozen=True, eq=False)
class MTP(ChainHeads):
  """MTP proposer. Attributes: ``heads``, an :class:`specjax.models.heads.MTPHeads` built for this target."""

  name: ClassVar[str] = "mtp"
  kinds: ClassVar[tuple[str, ...]] = kinds_of(name)
