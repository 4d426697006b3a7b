"""Decoding configuration: what to speculate with and how to sample. Validated at construction."""

from __future__ import annotations

import dataclasses
import math

SCHEDULES = ("static", "dynamic")
MAX_K = 32


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How a token is drawn from a next-token distribution; applied identically to target and proposer.

  ``temperature == 0`` is greedy decoding. ``top_k == 0`` and ``top_p == 1`` disable those filters.
  Static under ``jax.jit``: a new configuration compiles a new program.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    t = self.temperature
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
      raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
    if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
      raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
    p = self.top_p
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 < p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {p!r}")
    object.__setattr__(self, "temperature", float(t))
    object.__setattr__(self, "top_p", float(p))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


GREEDY = SamplingConfig(temperature=0.0)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """How many proposals per round; what proposes them is the proposer (:mod:`specjax.proposers`).

  Attributes:
    k: proposals per round, in ``[0, MAX_K]`` (0: no speculation, the target-only baseline), or
      ``"auto"``: chosen per batch size from a cost model calibrated on the current hardware (see
      :mod:`specjax.costmodel`), possibly 0.
    k_max: the largest k that ``"auto"`` considers, in ``[1, MAX_K]``.
    schedule: ``"static"`` proposes k tokens every round; ``"dynamic"`` adapts the number of proposals
      during generation from the running acceptance, within ``[1, k]`` (Hugging Face's heuristic: +2 after
      a round in which every row accepted all proposals, -1 otherwise; starts at k). The verification
      window stays ``k + 1``: only proposal work is saved.
  """

  k: int | str = 4
  k_max: int = 8
  schedule: str = "static"

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    if not isinstance(self.k_max, int) or isinstance(self.k_max, bool) or not 1 <= self.k_max <= MAX_K:
      raise ValueError(f"k_max must be an integer in [1, {MAX_K}], got {self.k_max!r}")
    if self.k == "auto":
      if self.schedule == "dynamic":
        raise ValueError("schedule 'dynamic' needs an integer k (its upper bound), not 'auto'")
      return
    if not isinstance(self.k, int) or isinstance(self.k, bool) or not 0 <= self.k <= MAX_K:
      raise ValueError(f"k must be an integer in [0, {MAX_K}] or 'auto', got {self.k!r}")
    if self.schedule == "dynamic" and self.k < 1:
      raise ValueError(f"schedule 'dynamic' needs k >= 1 (its upper bound), got {self.k}")

  @property
  def auto(self) -> bool:
    return self.k == "auto"

  @property
  def num_proposals(self) -> int:
    """Proposals per round (0 for the baseline); ``"auto"`` has none until ``generate`` resolves it."""
    if self.auto:
      raise ValueError("k='auto' has no fixed number of proposals: generate resolves it per batch size")
    return self.k
