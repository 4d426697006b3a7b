"""Decoding configuration: what to speculate with and how to sample. Validated at construction."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SCHEDULES = ("static", "dynamic")
MAX_K = 32
MAX_STOP_TOKENS = 4  # stop tokens per row, padded with -1 to this static size (one program for any set)
MAX_LOGPROBS = 20  # top alternatives per emitted token (OpenAI's top_logprobs limit)
MIN_PROMPT_BUCKET = 16  # the shortest padded prompt length
NEW_TOKENS_BUCKET = 32  # generate compiles for max_new_tokens rounded up to a multiple of this


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
  """``value`` as an int, or ValueError naming ``name`` and the allowed range (bools are not integers)."""
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
  if not ok or (low is not None and value < low) or (high is not None and value > high):
    allowed = ("an integer" if low is None and high is None else f"an integer >= {low}" if high is None
               else f"an integer <= {high}" if low is None else f"an integer in [{low}, {high}]")
    raise ValueError(f"{name} must be {allowed}, got {value!r}")
  return int(value)


def check_number(name: str, value, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False) -> float:
  """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``), or ValueError naming it."""
  ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
  ok = ok and math.isfinite(value)
  if ok and low is not None:
    ok = value > low if low_open else value >= low
  if ok and high is not None:
    ok = value <= high
  if not ok:
    left = "(" if low_open else "["
    allowed = ("a finite number" if low is None and high is None else
               f"a finite number {'>' if low_open else '>='} {low}" if high is None else
               f"a number in {left}{low}, {high}]")
    raise ValueError(f"{name} must be {allowed}, got {value!r}")
  return float(value)


MAX_LOGIT_BIAS = 300  # entries of one logit_bias map (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # |bias| at most this (OpenAI's range)
PENALTY_RANGE = 2.0  # presence and frequency penalties in [-2, 2] (OpenAI's range)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How a token is drawn from a next-token distribution; applied identically to target and proposer.

  The warp (:func:`specjax.sampling.warp`), in order, on the logits of each position:

  1. ``logit_bias``: ``{token: bias}`` added to the logits (OpenAI's ``logit_bias``, each in [-100, 100]);
  2. ``repetition_penalty`` (> 0, 1 = off): tokens present in the prompt or the output so far have a positive
     logit divided by it and a negative one multiplied by it (transformers, vLLM);
  3. ``frequency_penalty`` and ``presence_penalty`` (in [-2, 2], 0 = off): subtract ``frequency * count +
     presence * (count > 0)``, counting the *generated* tokens so far (OpenAI's definition, vLLM's counting);
  4. ``temperature`` (>= 0, 0 = greedy: the argmax of the adjusted logits);
  5. ``min_p`` (in [0, 1], 0 = off): drops tokens whose probability is below ``min_p`` times the largest;
  6. ``top_k`` (>= 0, 0 = off), then ``top_p`` (in (0, 1], 1 = off).

  Under speculation the counts of window position i include the proposals before it, for the target and
  the proposer alike, so the output follows exactly the law of plain decoding with these settings.
  Static under ``jax.jit`` in :func:`specjax.generate`: the settings choose the compiled code paths
  (:class:`specjax.sampling.Mode`), their values are arrays.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: tuple[tuple[int, float], ...] = ()  # sorted (token, bias) pairs; a dict is accepted

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    t, p = self.temperature, self.top_p
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
      raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
    set_("temperature", float(t))
    set_("top_k", check_int("top_k", self.top_k, 0))
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 < p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {p!r}")
    set_("top_p", float(p))
    set_("min_p", check_number("min_p", self.min_p, 0.0, 1.0))
    set_("presence_penalty", check_number("presence_penalty", self.presence_penalty, -PENALTY_RANGE, PENALTY_RANGE))
    set_("frequency_penalty", check_number("frequency_penalty", self.frequency_penalty, -PENALTY_RANGE,
                                           PENALTY_RANGE))
    set_("repetition_penalty", check_number("repetition_penalty", self.repetition_penalty, 0.0, low_open=True))
    bias = self.logit_bias
    if isinstance(bias, dict):
      bias = tuple(bias.items())
    if not isinstance(bias, (tuple, list)) or not all(isinstance(e, (tuple, list)) and len(e) == 2 for e in bias):
      raise ValueError(f"logit_bias must be a {{token id: bias}} mapping, got {self.logit_bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
      raise ValueError(f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS} are supported")
    pairs = {}
    for token, value in bias:
      token = check_int("logit_bias token id", int(token) if isinstance(token, str) and token.isdigit() else token, 0)
      pairs[token] = check_number(f"logit_bias[{token}]", value, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
    set_("logit_bias", tuple(sorted(pairs.items())))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def filters(self) -> bool:
    """Whether it filters the distribution (top-k, top-p or min-p); greedy decoding never needs to."""
    return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

  @property
  def adjusts(self) -> bool:
    """Whether it changes the logits before temperature (logit bias or a penalty)."""
    return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or \
        self.repetition_penalty != 1.0

  def check_vocab(self, vocab_size: int) -> None:
    """Raises ValueError unless every ``logit_bias`` token is in ``[0, vocab_size)``."""
    for token, _ in self.logit_bias:
      if token >= vocab_size:
        raise ValueError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})")


GREEDY = SamplingConfig(temperature=0.0)

MAX_PILOT_PROMPTS = 64  # SpecConfig.pilot_prompts: one pilot batch


def _pilot_prompts(prompts, k) -> tuple[tuple[int, ...], ...]:
  """``SpecConfig.pilot_prompts`` as a tuple of tuples of ints (hashable: it keys the decision), or ValueError."""
  if k != "auto":
    raise ValueError(f"pilot_prompts are what k='auto' measures acceptance on: they need k='auto', got k={k!r}")
  form = "a non-empty sequence of token-id prompts (each a non-empty sequence of integers >= 0)"
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (tuple, list, np.ndarray)) or len(prompts) == 0:
    raise ValueError(f"pilot_prompts must be {form}, got {prompts!r:.80}")
  if len(prompts) > MAX_PILOT_PROMPTS:
    raise ValueError(f"pilot_prompts holds {len(prompts)} prompts; at most {MAX_PILOT_PROMPTS} (one pilot batch)")
  rows = []
  for i, row in enumerate(prompts):
    if isinstance(row, (str, bytes)) or not isinstance(row, (tuple, list, np.ndarray)) or len(row) == 0:
      raise ValueError(f"pilot_prompts[{i}] must be a non-empty sequence of token ids (encode text first), "
                       f"got {row!r:.80}")
    rows.append(tuple(check_int(f"pilot_prompts[{i}][{j}]", t, 0) for j, t in enumerate(row)))
  return tuple(rows)


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
    invariant: verify windows computed position by position with a one-token step's shapes
      (:mod:`specjax.numerics`), so that every logit the verify pass computes is bit for bit the target
      alone's there and greedy speculation equals the target alone token for token in any dtype. Costs one
      matrix product per window position instead of one per window (measured in ``docs/benchmarks.md``).
    tree: None (a chain of k proposals per round), or a token tree per round: a
      :class:`specjax.tree.TreeShape` (fixed, e.g. ``TreeShape((4, 2, 2, 1), max_nodes=16)``), a
      :class:`specjax.tree.DynamicTree` (EAGLE-2's, grown by the proposer's confidence), or the strings
      ``"dynamic"`` / ``"4-2-2-1/16"`` that :func:`specjax.tree.parse_tree` reads. The proposer must propose
      trees (DraftModel, Eagle, MTP and Medusa do). ``k`` is then the tree's depth and is not given.
      ``"auto"`` (with ``k="auto"``): the cost model chooses between the chains ``1..k_max``, static trees
      of ``tree_sizes`` nodes built from the proposer's measured acceptance by depth and sibling rank
      (:func:`specjax.costmodel.best_tree`), and no speculation, per batch size.
    tree_sizes: the node counts ``tree="auto"`` considers, each in ``[1, MAX_K]``.
    pilot_prompts: for ``k="auto"`` only: token-id prompts (a sequence of non-empty sequences of ids, at most
      ``MAX_PILOT_PROMPTS``) that its pilot runs measure acceptance on, in one batch, instead of the call's own
      prompts. Give a few prompts like the ones you will serve: a pilot on the call's prompts sees one prompt at
      batch 1. The cost of a round is still timed at the call's own batch size and prompt bucket.
  """

  k: int | str = 4
  k_max: int = 8
  schedule: str = "static"
  invariant: bool = False
  tree: Any = None
  tree_sizes: tuple[int, ...] = (4, 8, 16, 32)
  pilot_prompts: Any = None

  def __post_init__(self):
    if self.pilot_prompts is not None:
      object.__setattr__(self, "pilot_prompts", _pilot_prompts(self.pilot_prompts, self.k))
    sizes = tuple(self.tree_sizes) if isinstance(self.tree_sizes, (tuple, list)) else None
    if not sizes:
      raise ValueError(f"tree_sizes must be a non-empty sequence of integers in [1, {MAX_K}], got {self.tree_sizes!r}")
    for i, n in enumerate(sizes):
      check_int(f"tree_sizes[{i}]", n, 1, MAX_K)
    object.__setattr__(self, "tree_sizes", tuple(sorted(set(sizes))))
    if self.tree == "auto":
      if self.k != "auto":
        raise ValueError(f"tree='auto' chooses between chains and trees: it needs k='auto', got k={self.k!r}")
    elif self.tree is not None:
      from specjax.tree import DynamicTree, TreeShape, parse_tree

      tree = parse_tree(self.tree) if isinstance(self.tree, str) else self.tree
      if not isinstance(tree, (TreeShape, DynamicTree)):
        raise ValueError(f"tree must be None, a specjax.tree.TreeShape, a specjax.tree.DynamicTree, a string "
                         f"such as 'dynamic' or '4-2-2-1/16', or 'auto' (with k='auto'), got {self.tree!r}")
      if self.k == "auto" or self.schedule != "static":
        raise ValueError("tree: a token tree takes neither k='auto' nor schedule='dynamic' (the tree fixes the "
                         "proposals of every round)")
      object.__setattr__(self, "tree", tree)
      object.__setattr__(self, "k", tree.depth)
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    check_int("k_max", self.k_max, 1, MAX_K)
    if not isinstance(self.invariant, bool):
      raise ValueError(f"invariant must be True or False, got {self.invariant!r}")
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
  def auto_tree(self) -> bool:
    """Whether ``k="auto"`` also considers trees (``tree="auto"``)."""
    return self.tree == "auto"

  @property
  def num_proposals(self) -> int:
    """Proposals per round (0 for the baseline); ``"auto"`` has none until ``generate`` resolves it."""
    if self.auto:
      raise ValueError("k='auto' has no fixed number of proposals: generate resolves it per batch size")
    return self.k
