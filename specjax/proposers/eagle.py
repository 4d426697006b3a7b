"""EAGLE (Li et al. 2024, 2025): one decoder layer over the target's features, rolled out on its own.

EAGLE-1 reads the target's final hidden state and predicts through the target's unembedding
(``specjax.models.heads.Eagle1Head``); EAGLE-3 fuses the residual streams entering three target layers and
predicts over a reduced draft vocabulary with its own output head (``specjax.models.heads.Eagle3Head``). The
rollout and the cache discipline are those of every chain head (:mod:`specjax.proposers.chain`): the head
re-reads the accepted tokens' target features after each verification, so it never conditions on its own
rejected guesses.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.models.heads import kinds_of
from specjax.proposers.chain import ChainHeads


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle(ChainHeads):
  """EAGLE proposer. Attributes: ``heads``, an :class:`specjax.models.heads.Eagle1Head` or
  :class:`~specjax.models.heads.Eagle3Head` built for this target."""

  name: ClassVar[str] = "eagle"
  kinds: ClassVar[tuple[str, ...]] = kinds_of(name)  # eagle1, eagle3
