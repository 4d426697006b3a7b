"""Decoding configuration: what to speculate with and how to sample. Validated at construction."""

from __future__ import annotations

import dataclasses
import math

METHODS = ("none", "draft")
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
  """What proposes tokens and how many per round.

  Attributes:
    method: ``"none"`` (target only, the baseline) or ``"draft"`` (a separate draft model).
    k: speculation length, the number of proposed tokens per round, in ``[1, MAX_K]`` for ``"draft"``;
      ignored (treated as 0) for ``"none"``.
  """

  method: str = "draft"
  k: int = 4

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
    if not isinstance(self.k, int) or isinstance(self.k, bool):
      raise ValueError(f"k must be an integer in [1, {MAX_K}], got {self.k!r}")
    if self.method != "none" and not 1 <= self.k <= MAX_K:
      raise ValueError(f"k must be in [1, {MAX_K}] for method {self.method!r}, got {self.k}")
    if self.method == "none" and not 0 <= self.k <= MAX_K:
      raise ValueError(f"k must be in [0, {MAX_K}], got {self.k}")

  @property
  def window(self) -> int:
    """Proposed tokens per round actually used by the engine (0 for the baseline)."""
    return 0 if self.method == "none" else self.k
