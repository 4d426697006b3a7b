"""Which k (or token tree) a step of the slot engine runs: measured step costs against the acceptance
measured online.

A step computes every row of the engine's current width (the smallest compiled batch size that holds the
live requests, :class:`specjax.serving.slots.SlotEngine`), so its cost ``t(W, k)`` depends on the width W
and on k; every live row then gains ``E[tau](k)`` tokens (:func:`specjax.costmodel.expected_tau`, from the
acceptance by position). The step that delivers the most tokens per second is
``argmax_k E[tau](k) / t(W, k)`` (the number of live rows multiplies every candidate alike). As the number of
live requests moves the width, it moves k: speculation where a step is cheap (few live requests), plain
decoding where the batch is wide enough that verifying k + 1 positions per row costs more than it saves.
The choice depends on:

- the width and the cache length (through ``t(W, k)``: the median of the latest steps of each (W, k) as
  they run, per round, which follows the machine's load; start-up timings of the compiled steps
  (:meth:`~specjax.serving.slots.SlotEngine.time_steps`, on live one-token rows) only until a candidate has
  run at that width, since they time the general program at the smallest attention length, not the served one);
- the acceptance of the requests being served (counts of accepted proposals by position from each step's
  ``RoundStats``, decayed so that the current mix of requests dominates); a position past the first is
  estimated with ``prior_rounds`` pseudo-rounds at the acceptance of the position before it (a Beta prior),
  so that a position reached only in a few probe rounds, or not lately, is read as "like the one before"
  rather than from a handful of rounds: an estimate too low is never corrected (its k does not run, so its
  acceptance is measured only in rare probes), one too high is corrected by the steps it wins (on the
  bundled pair at width 1 five k = 2 steps left P(d_1 accepted | d_0 accepted) at about 0.06 against 0.57
  measured, and k = 1 ran where k = 2 was 8 % faster);
- a margin: k > 0 runs only where its predicted rate beats plain decoding by more than ``margin``.

Costs are compared in pairs. The candidate that runs (the width's current best) is timed at every step, the
others only in probes, minutes apart on a busy server; on a shared machine whose speed drifts by tens of
percent over a minute, a probe timed in a slow spell and compared with the best's latest steps reads the drift
as the candidate's cost (on the bundled pair at concurrency 8, 2-core CPU: plain decoding's round measured
5.5 ms at start-up and 8.9 ms served, while k = 1 delivered 1.13x plain decoding's tokens/s as a fixed k,
auto ran plain decoding in 114 of 267 calls and delivered 0.91x). So each timed probe is also read as a ratio
to the best's last few steps (``pair_steps``), taken at the same moment, and a candidate's cost is its median
ratio (of the latest ``pair_window``) times the best's current cost; the best's own steps follow the machine,
the ratio is what the probe measured. A candidate without a ratio to the current best (none probed since the
best changed) uses the inverse ratio the best has to it, else its own latest steps.

Token trees (the engine's ``trees``) are candidates beside the chains, keyed by their spec: a tree's
``E[tau]`` is measured directly, ``(accepted + row_rounds) / row_rounds`` over its own steps (decayed counts,
as the chains' acceptance), since the acceptance by position of a chain says little about a tree's siblings.
A candidate with nothing measured yet runs first (the chains at their largest k, then each tree in turn).

A choice is only as good as its data: while one k runs, the others' costs and the acceptance at positions
past k go stale. The policy therefore probes: every ``probe_every`` steps at a width it runs one other
candidate in turn (first those with no measured step at that width: the scheduler does not time a program's
first run nor, where calls run several rounds, a one-round call), and doubles that width's interval (up to
``probe_max``) while its choice holds. A probe of a candidate with no measured step at the width does not
double it: a cold or one-round probe brings no timing, and doubling then would leave the candidate at its
start-up timing for hundreds of steps (on the bundled pair at width 1, 216 calls at k = 1 before plain
decoding, whose round costs 0.43x a k = 1 round, was first timed). A probe never runs on a step the caller
says cannot be timed (``choose(width, timed=False)``: the scheduler's one-round calls, a new request's first
call or one while a request waits): it waits for the next timed step. And probing has a budget
(``probe_budget``, 1 % of the throughput): a candidate predicted to deliver a fraction ``d`` less than the
best is probed at most every ``d / probe_budget`` steps, so a candidate far behind (SmolLM2's head at width
8: k = 2 and 4 at about 0.5-0.8x plain decoding) costs little, while one near the best is probed at the
doubling interval (on SmolLM2 at concurrency 8, 7 probes in 177 calls cost auto 6 % against plain decoding
before the budget).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

import numpy as np

from specjax.costmodel import expected_tau
from specjax.tree import DynamicTree, TreeShape

Choice = int | TreeShape | DynamicTree  # a chain of k proposals or a token tree (specjax.serving.slots.Choice)


def _name(choice: Choice) -> int | str:
  """A candidate's key in :meth:`SpeculationPolicy.describe`: k, or the tree's ``describe()``."""
  return choice if isinstance(choice, int) else choice.describe()


def _is_k(choice) -> bool:
  return isinstance(choice, int) and not isinstance(choice, bool) and choice >= 0


def _show(choice) -> object:
  """A candidate, or anything given as one, for error messages."""
  return choice.describe() if isinstance(choice, (TreeShape, DynamicTree)) else choice


def _order(choice: Choice) -> tuple:
  """Chains by k, then trees by description."""
  return (0, choice, "") if isinstance(choice, int) else (1, 0, choice.describe())


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """Settings of :class:`SpeculationPolicy`.

  Attributes:
    margin: k > 0 must beat plain decoding's predicted rate by this fraction.
    window: steps of each k whose median gives its cost.
    decay: acceptance counts are multiplied by this before each speculative step's counts are added
      (0.98: about the last 50 steps weigh).
    probe_every, probe_max: the first and the longest interval, in steps, between probes.
    prior_rounds: the weight, in row-rounds, of the prior of a position's acceptance past the first (the
      estimate of the position before it); 0: the measured ratio alone.
    probe_budget: the share of the throughput that probing may cost: a candidate predicted to deliver a
      fraction ``d`` less than the best (``1 - rate / best rate``) is probed at most once every
      ``d / probe_budget`` steps (a step of it loses about ``d`` of a step), so candidates near the best are
      probed as often as ``probe_every`` allows and hopeless ones rarely.
    paired: a candidate other than the best is costed by its ratio to the best, timed at the same moment
      (see the module docstring); False: by its own latest steps alone, whenever they ran.
    pair_steps: the best's latest steps whose median a probe's time is divided by.
    pair_window: the latest ratios of a candidate to the best whose median gives its ratio.
  """

  margin: float = 0.03
  window: int = 32
  paired: bool = True
  pair_steps: int = 4
  pair_window: int = 8
  decay: float = 0.98
  probe_every: int = 16
  probe_max: int = 512
  prior_rounds: float = 8.0
  probe_budget: float = 0.01

  def __post_init__(self):
    if not 0 <= self.margin < 1:
      raise ValueError(f"margin must be in [0, 1), got {self.margin!r}")
    if not 0 < self.decay <= 1:
      raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
    if not (isinstance(self.prior_rounds, (int, float)) and not isinstance(self.prior_rounds, bool)
            and 0 <= self.prior_rounds < float("inf")):
      raise ValueError(f"prior_rounds must be a finite number >= 0, got {self.prior_rounds!r}")
    if not (isinstance(self.probe_budget, (int, float)) and not isinstance(self.probe_budget, bool)
            and 0 < self.probe_budget <= 1):
      raise ValueError(f"probe_budget must be a number in (0, 1], got {self.probe_budget!r}")
    if not isinstance(self.paired, bool):
      raise ValueError(f"paired must be True or False, got {self.paired!r}")
    for name in ("window", "probe_every", "probe_max", "pair_steps", "pair_window"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class SpeculationPolicy:
  """Picks each step's candidate, a k or a token tree, from the candidates' measured costs at the step's
  width and the online acceptance (see the module docstring). Not thread-safe: one engine thread calls
  :meth:`choose` and :meth:`observe`.

  Args:
    step_seconds: ``{width: {candidate: seconds}}`` start-up timings of one step for each width and candidate,
      a k (int) or a tree spec (:class:`specjax.tree.TreeShape`, :class:`~specjax.tree.DynamicTree`)
      (:meth:`specjax.serving.slots.SlotEngine.time_steps`); every width has the same candidates.
    config: :class:`PolicyConfig`.

  Attributes:
    candidates: the chains' k in increasing order, then the trees. ks, trees: the two kinds apart.
  """

  def __init__(self, step_seconds: Mapping[int, Mapping[Choice, float]], config: PolicyConfig = PolicyConfig()):
    sets = {frozenset(by_k) for by_k in step_seconds.values()}
    if not step_seconds or len(sets) != 1 or not next(iter(sets)) or \
        any(not (_is_k(c) or isinstance(c, (TreeShape, DynamicTree))) for c in next(iter(sets))) or \
        any(not s > 0 for by_k in step_seconds.values() for s in by_k.values()):
      raise ValueError("step_seconds must map each width to {candidate: seconds > 0} for the same candidates "
                       "(k >= 0 or a tree spec), got "
                       f"{ {w: {_show(c): s for c, s in by_k.items()} for w, by_k in step_seconds.items()} }")
    first = next(iter(step_seconds.values()))
    self.ks = tuple(sorted(c for c in first if isinstance(c, int)))
    self.trees = tuple(c for c in first if not isinstance(c, int))
    self.candidates = self.ks + self.trees
    self.widths = tuple(sorted(step_seconds))
    self.config = config
    self._prior = {(w, c): float(s) for w, by_k in step_seconds.items() for c, s in by_k.items()}
    self._times = {key: collections.deque(maxlen=config.window) for key in self._prior}
    # (width, candidate, reference) -> the candidate's latest round times over the reference's at the moment
    self._ratios: dict[tuple[int, Choice, Choice], collections.deque] = {}
    size = max(self.ks + (1,))
    self._reached, self._accepted = np.zeros(size), np.zeros(size)
    self._tree_counts = {t: np.zeros(2) for t in self.trees}  # decayed [accepted proposals, row-rounds]
    self._probe = {w: {"interval": config.probe_every, "since": 0, "turn": 0} for w in self.widths}
    self.best = {w: self.candidates[0] for w in self.widths}
    self.choices: collections.Counter[tuple[int, Choice]] = collections.Counter()  # (width, candidate) -> steps

  def step_seconds(self, width: int, k: Choice) -> float:
    """The current estimate of one round's cost at ``width`` with k proposals (or tree ``k``): for the width's
    current best, or any candidate without a ratio to it (or with ``paired`` off), the median of its latest
    steps there, or its start-up timing while it has not run there; for another, its median ratio to the best
    (or the inverse of the best's to it) times the best's cost."""
    best = self.best.get(width)
    if self.config.paired and k != best and self._times.get((width, best)):
      ratios = self._ratios.get((width, k, best))
      if ratios:
        return float(np.median(ratios)) * self.own_seconds(width, best)
      inverse = self._ratios.get((width, best, k))
      if inverse:
        return self.own_seconds(width, best) / float(np.median(inverse))
    return self.own_seconds(width, k)

  def own_seconds(self, width: int, k: Choice) -> float:
    """The median of the latest timed steps of ``k`` at ``width``, or its start-up timing while none ran there
    (no pairing)."""
    times = self._times[(width, k)]
    return float(np.median(times)) if times else self._prior[(width, k)]

  def acceptance_by_position(self) -> list[float | None]:
    """``P(d_i accepted | d_<i accepted)`` of the chains, from the decayed counts: the first position's
    measured ratio (None while nothing was measured), each later one ``(accepted + m a) / (reached + m)``
    with ``a`` the estimate of the position before it and ``m`` the config's ``prior_rounds``."""
    measured, m = self.measured_acceptance(), self.config.prior_rounds
    out = measured[:1]
    for ratio, a, r in zip(measured[1:], self._accepted[1:], self._reached[1:]):
      before = out[-1]
      if before is None or r + m == 0:  # no estimate to lean on, or nothing at all (m = 0, nothing reached)
        out.append(ratio)
      else:
        out.append(float((a + m * before) / (r + m)))
    return out

  def measured_acceptance(self) -> list[float | None]:
    """The decayed counts' ratios alone, ``accepted / reached`` by position (None where nothing was
    measured): what :meth:`acceptance_by_position` starts from."""
    return [float(a / r) if r > 0 else None for a, r in zip(self._accepted, self._reached)]

  def expected_tau(self, k: Choice) -> float:
    """Tokens per row-round: a chain's from the acceptance by position, a tree's from its own steps (1.0 for a
    tree not measured yet)."""
    if not isinstance(k, int):
      accepted, rounds = self._tree_counts[k]
      return float((accepted + rounds) / rounds) if rounds > 0 else 1.0
    return expected_tau(self.acceptance_by_position(), k) if k else 1.0

  def rate(self, width: int, k: Choice) -> float:
    """Predicted tokens per second per live row at ``width`` with k proposals (or tree ``k``)."""
    return self.expected_tau(k) / self.step_seconds(width, k)

  def unmeasured(self) -> Choice | None:
    """The candidate to measure before any comparison: the largest k while no chain acceptance is measured,
    then each tree without a step of its own; None once everything has been measured."""
    if self.ks[-1:] and self.ks[-1] > 0 and self._reached[0] == 0:
      return self.ks[-1]
    return next((t for t in self.trees if self._tree_counts[t][1] == 0), None)

  def decide(self, width: int) -> Choice:
    """The candidate with the best predicted rate at ``width`` (no probing)."""
    if len(self.candidates) == 1:
      return self.candidates[0]
    first = self.unmeasured()
    if first is not None:  # nothing measured yet for it: measure it
      return first
    rates = {c: self.rate(width, c) for c in self.candidates}
    best = max(rates, key=rates.get)
    if 0 in rates and best != 0 and rates[best] <= rates[0] * (1 + self.config.margin):
      best = 0
    return best

  def choose(self, width: int, timed: bool = True) -> Choice:
    """The candidate for the next step at ``width``: the best predicted, or now and then a probe of another.
    ``timed``: the step can bring a timing (False: a call of one round where calls run several, whose time
    :meth:`observe` does not take); a probe that falls due on an untimed step waits for the next timed one,
    since a probe exists to time its candidate."""
    if width not in self._probe:
      raise ValueError(f"width must be one of the timed widths {self.widths}, got {width!r}")
    best, probe = self.decide(width), self._probe[width]
    if best != self.best[width]:
      self.best[width] = best
      probe.update(interval=self.config.probe_every, since=0)
    probe["since"] += 1
    # The candidates a probe may take: those the budget allows this long after the last probe.
    top = self.rate(width, best)
    others = [c for c in self.candidates if c != best
              and probe["since"] * self.config.probe_budget >= 1 - self.rate(width, c) / top]
    if others and timed and self.unmeasured() is None and probe["since"] >= probe["interval"]:
      probe["since"] = 0
      untimed = [c for c in others if not self._times[(width, c)]]  # only a start-up timing at this width
      if untimed:  # the interval stays until the probe brings a timing (a cold or one-round call does not)
        best = untimed[0]
      else:
        probe["interval"] = min(2 * probe["interval"], self.config.probe_max)
        probe["turn"] += 1
        best = others[probe["turn"] % len(others)]
    self.choices[(width, best)] += 1
    return best

  def observe(self, width: int, k: Choice, seconds: float | None, reached: np.ndarray, accepted_at: np.ndarray,
              accepted: int | None = None, row_rounds: int | None = None) -> None:
    """Takes one step's outcome: its width and wall time per round (None: not a timing, such as the first run
    of a program, whose acceptance still counts), and with k > 0 the live rows' counts of proposals
    reached / accepted by position (``RoundStats.reached`` / ``accepted_at`` of the step). A tree step
    (``k`` a tree spec) needs ``accepted`` and ``row_rounds`` instead: the live rows' accepted proposals and
    row-rounds in the step (the sums of :class:`~specjax.serving.slots.StepResult`'s per slot counts)."""
    if (width, k) not in self._times:
      raise ValueError(f"(width, k) must be among the timed widths {self.widths} and candidates "
                       f"{[_name(c) for c in self.candidates]}, got {(width, _show(k))!r}")
    if seconds is not None:
      best = self.best[width]
      recent = list(self._times[(width, best)])[-self.config.pair_steps:]
      if k != best and recent:  # a probe: its ratio to the best's steps of the same moment
        ratios = self._ratios.setdefault((width, k, best), collections.deque(maxlen=self.config.pair_window))
        ratios.append(float(seconds) / float(np.median(recent)))
      self._times[(width, k)].append(float(seconds))
    if not isinstance(k, int):
      if accepted is None or row_rounds is None:
        raise ValueError(f"observe: a tree step ({k.describe()}) needs accepted= and row_rounds=")
      if row_rounds > 0:
        counts = self._tree_counts[k]
        counts *= self.config.decay
        counts += (float(accepted), float(row_rounds))
    elif k > 0 and np.sum(reached) > 0:
      self._reached *= self.config.decay
      self._accepted *= self.config.decay
      self._reached[:k] += reached[:k]
      self._accepted[:k] += accepted_at[:k]

  def describe(self) -> dict:
    """The policy's current view, for metrics and reports (JSON-friendly: a chain is keyed by its k, a tree
    by its ``describe()``)."""
    return {"best": {w: _name(c) for w, c in self.best.items()},
            "choices": {f"{w}/{_name(c)}": n for (w, c), n in sorted(self.choices.items(),
                                                                      key=lambda x: (x[0][0], _order(x[0][1])))},
            "acceptance_by_position": self.acceptance_by_position(),
            "measured_acceptance": self.measured_acceptance(),
            "reached": [float(r) for r in self._reached],
            "step_seconds": {w: {_name(c): self.step_seconds(w, c) for c in self.candidates} for w in self.widths},
            "ratios_to_best": {f"{w}/{_name(c)}": float(np.median(r)) for (w, c, b), r in self._ratios.items()
                               if r and b == self.best[w]},
            "expected_tau": {_name(c): self.expected_tau(c) for c in self.candidates},
            "unmeasured_trees": [_name(t) for t in self.trees if self._tree_counts[t][1] == 0]}
