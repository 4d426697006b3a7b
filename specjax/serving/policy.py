"""Which k a step of the slot engine runs: measured step costs against the acceptance measured online.

A step computes every row of the engine's current width (the smallest compiled batch size that holds the
live requests, :class:`specjax.serving.slots.SlotEngine`), so its cost ``t(W, k)`` depends on the width W
and on k; every live row then gains ``E[tau](k)`` tokens (:func:`specjax.costmodel.expected_tau`, from the
acceptance by position). The step that delivers the most tokens per second is
``argmax_k E[tau](k) / t(W, k)`` (the number of live rows multiplies every candidate alike). As the number of
live requests moves the width, it moves k: speculation where a step is cheap (few live requests), plain
decoding where the batch is wide enough that verifying k + 1 positions per row costs more than it saves.
The choice depends on:

- the width and the cache length (through ``t(W, k)``: start-up timings of the compiled steps, then the
  median of the latest steps of each (W, k) as they run, which follows the machine's load);
- the acceptance of the requests being served (counts of accepted proposals by position from each step's
  ``RoundStats``, decayed so that the current mix of requests dominates);
- a margin: k > 0 runs only where its predicted rate beats plain decoding by more than ``margin``.

A choice is only as good as its data: while one k runs, the others' costs and the acceptance at positions
past k go stale. The policy therefore probes: every ``probe_every`` steps at a width it runs one other
candidate in turn, and doubles that width's interval (up to ``probe_max``) while its choice holds.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

import numpy as np

from specjax.costmodel import expected_tau


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """Settings of :class:`SpeculationPolicy`.

  Attributes:
    margin: k > 0 must beat plain decoding's predicted rate by this fraction.
    window: steps of each k whose median gives its cost.
    decay: acceptance counts are multiplied by this before each speculative step's counts are added
      (0.98: about the last 50 steps weigh).
    probe_every, probe_max: the first and the longest interval, in steps, between probes.
  """

  margin: float = 0.03
  window: int = 32
  decay: float = 0.98
  probe_every: int = 16
  probe_max: int = 512

  def __post_init__(self):
    if not 0 <= self.margin < 1:
      raise ValueError(f"margin must be in [0, 1), got {self.margin!r}")
    if not 0 < self.decay <= 1:
      raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
    for name in ("window", "probe_every", "probe_max"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class SpeculationPolicy:
  """Picks k for each step from the candidates' measured costs at the step's width and the online
  acceptance (see the module docstring). Not thread-safe: one engine thread calls :meth:`choose` and
  :meth:`observe`.

  Args:
    step_seconds: ``{width: {k: seconds}}`` start-up timings of one step for each width and candidate k
      (:meth:`specjax.serving.slots.SlotEngine.time_steps`); every width has the same candidates.
    config: :class:`PolicyConfig`.
  """

  def __init__(self, step_seconds: Mapping[int, Mapping[int, float]], config: PolicyConfig = PolicyConfig()):
    ks = {tuple(sorted(by_k)) for by_k in step_seconds.values()}
    if not step_seconds or len(ks) != 1 or not next(iter(ks)) or \
        any(not s > 0 for by_k in step_seconds.values() for s in by_k.values()):
      raise ValueError("step_seconds must map each width to {k: seconds > 0} for the same candidates k, got "
                       f"{ {w: dict(by_k) for w, by_k in step_seconds.items()} }")
    self.ks = next(iter(ks))
    self.widths = tuple(sorted(step_seconds))
    self.config = config
    self._times = {(w, k): collections.deque([float(s)], maxlen=config.window)
                   for w, by_k in step_seconds.items() for k, s in by_k.items()}
    size = max(max(self.ks), 1)
    self._reached, self._accepted = np.zeros(size), np.zeros(size)
    self._probe = {w: {"interval": config.probe_every, "since": 0, "turn": 0} for w in self.widths}
    self.best = {w: self.ks[0] for w in self.widths}
    self.choices: collections.Counter[tuple[int, int]] = collections.Counter()  # (width, k) -> steps

  def step_seconds(self, width: int, k: int) -> float:
    """The current estimate of one step's cost at ``width`` with k proposals."""
    return float(np.median(self._times[(width, k)]))

  def acceptance_by_position(self) -> list[float | None]:
    """``P(d_i accepted | d_<i accepted)`` from the decayed counts (None where nothing was measured)."""
    return [float(a / r) if r > 0 else None for a, r in zip(self._accepted, self._reached)]

  def expected_tau(self, k: int) -> float:
    return expected_tau(self.acceptance_by_position(), k) if k else 1.0

  def rate(self, width: int, k: int) -> float:
    """Predicted tokens per second per live row at ``width`` with k proposals."""
    return self.expected_tau(k) / self.step_seconds(width, k)

  def decide(self, width: int) -> int:
    """The k with the best predicted rate at ``width`` (no probing)."""
    if len(self.ks) == 1:
      return self.ks[0]
    if self._reached[0] == 0:  # no acceptance measured yet: measure it at the largest k
      return self.ks[-1]
    rates = {k: self.rate(width, k) for k in self.ks}
    best = max(rates, key=rates.get)
    if 0 in rates and best != 0 and rates[best] <= rates[0] * (1 + self.config.margin):
      best = 0
    return best

  def choose(self, width: int) -> int:
    """The k for the next step at ``width``: the best predicted, or now and then a probe of another k."""
    if width not in self._probe:
      raise ValueError(f"width must be one of the timed widths {self.widths}, got {width!r}")
    best, probe = self.decide(width), self._probe[width]
    if best != self.best[width]:
      self.best[width] = best
      probe.update(interval=self.config.probe_every, since=0)
    probe["since"] += 1
    others = [k for k in self.ks if k != best]
    if others and self._reached[0] > 0 and probe["since"] >= probe["interval"]:
      probe["since"] = 0
      probe["interval"] = min(2 * probe["interval"], self.config.probe_max)
      probe["turn"] += 1
      best = others[probe["turn"] % len(others)]
    self.choices[(width, best)] += 1
    return best

  def observe(self, width: int, k: int, seconds: float, reached: np.ndarray, accepted_at: np.ndarray) -> None:
    """Takes one step's outcome: its width and wall time, and with k > 0 the live rows' counts of proposals
    reached / accepted by position (``RoundStats.reached`` / ``accepted_at`` of the step)."""
    if (width, k) not in self._times:
      raise ValueError(f"(width, k) must be among the timed widths {self.widths} and candidates {self.ks}, "
                       f"got {(width, k)!r}")
    self._times[(width, k)].append(float(seconds))
    if k > 0 and np.sum(reached) > 0:
      self._reached *= self.config.decay
      self._accepted *= self.config.decay
      self._reached[:k] += reached[:k]
      self._accepted[:k] += accepted_at[:k]

  def describe(self) -> dict:
    """The policy's current view, for metrics and reports."""
    return {"best": dict(self.best), "choices": {f"{w}/{k}": n for (w, k), n in sorted(self.choices.items())},
            "acceptance_by_position": self.acceptance_by_position(),
            "step_seconds": {w: {k: self.step_seconds(w, k) for k in self.ks} for w in self.widths},
            "expected_tau": {k: self.expected_tau(k) for k in self.ks}}
