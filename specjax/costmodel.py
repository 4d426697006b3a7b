"""The economics of speculation: a calibrated cost model, its speedup prediction, and ``k = "auto"``.

With per-position acceptance ``a_i = P(d_i accepted | d_<i accepted)`` a round of speculation length k
emits on average ``E[tau] = 1 + sum_{i=1..k} prod_{j<=i} a_j`` tokens and costs, in this engine,

    round(k) = body(k) + P(all k accepted) * c,     body(k) ~ propose(k) + v(k + 1) + r(k)

seconds: the proposer's ``propose`` of k tokens, one target pass over the ``k + 1`` window, a per-round cost
``r`` (warping, acceptance, emission, the proposer's ``commit``, statistics), and, for a proposer with
``catch_up`` (the draft model), one more proposer step of cost c after a fully accepted round.
Calibration goes through the proposer protocol only (:mod:`specjax.proposers`): it times v(T), the
proposer's own ``propose`` at k = 1 and k_max, each prefill (the target's pass and the proposer's
``init``), and ``body(k)`` whole, by running the engine's own round (:func:`specjax.engine.round_step`)
in a jitted loop, since on CPU the parts do not add up exactly (fusion, cache writes, the loop's
bookkeeping). The baseline is the same loop with ``k = 0``: one token per
``body(0)``. In the steady state of one row

    speedup(k) = (E[tau](k) / round(k)) / (1 / round(0)),

and for a whole call of N tokens per row over a batch (``predict_speedup(..., n_tokens=N)``) the model
adds each model's prefill and counts the loop's rounds, which run until the slowest row is done
(:func:`expected_rounds`). ``choose_k`` is the argmax over ``k in {0..k_max}``; ``k = 0`` means
speculation does not pay.
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import engine
from specjax.cache import KVCache
from specjax.config import SamplingConfig, check_int
from specjax.numerics import per_position, row_invariant
from specjax.proposers import Proposer
from specjax.proposers.base import Context
from specjax.runtime import RUNTIME, SplitModels, Structure
from specjax.sampling import Mode, RowSettings, Sampler, row_keys
from specjax.tree import TreeShape, tree_window


@dataclasses.dataclass(frozen=True)
class CostTable:
  """Seconds measured on one machine, for one (target, proposer, batch size).

  Attributes:
    batch: batch size the table was measured at.
    verify: ``{T: seconds}`` of one target pass over T tokens per row; ``verify[1]`` is the target step.
    proposer_step: seconds of the proposer's ``propose`` with k = 1 (c: the cost of a catch-up step).
    propose: ``{k: seconds}`` of ``propose`` with k proposals (calibration measures k = 1 and k_max; the
      sum of parts interpolates linearly between them). Missing: ``k * proposer_step``.
    catch_up: the proposer needs one more step after a fully accepted round (the draft model).
    overhead: ``{k: seconds}`` per round besides the model passes (warping, acceptance); missing k: 0.
      Used only where ``rounds`` has no entry for k.
    rounds: ``{k: seconds}`` of one round of the engine's own loop body with k proposals (k = 0: the
      baseline step), measured whole inside one jitted loop, without the draft's catch-up step (which
      depends on acceptance and is added by :func:`round_seconds`). Where present it replaces the sum of
      parts ``k * proposer_step + verify[k + 1] + overhead[k]``.
    prefill: ``{"target": s, "proposer": s}``: one prefill pass over ``prompt_len`` tokens per row.
    prompt_len, n_tokens: the prompt bucket and new tokens per row the table was measured for (they fix
      the cache length).
    spread: relative spread of the round timings (half the inter-quartile range over the median, the
      largest over k): the calibration's own noise, which bounds how precise a prediction can be.
  """

  batch: int
  verify: Mapping[int, float]
  proposer_step: float
  propose: Mapping[int, float] = dataclasses.field(default_factory=dict)
  catch_up: bool = False
  overhead: Mapping[int, float] = dataclasses.field(default_factory=dict)
  rounds: Mapping[int, float] = dataclasses.field(default_factory=dict)
  prefill: Mapping[str, float] = dataclasses.field(default_factory=dict)
  prompt_len: int | None = None
  n_tokens: int | None = None
  spread: float = 0.0
  tree_rounds: Mapping[object, float] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if 1 not in self.verify:
      raise ValueError("CostTable.verify must hold T=1 (the target step)")
    for name in ("verify", "rounds", "propose", "tree_rounds"):
      bad = {t: s for t, s in getattr(self, name).items() if not s > 0}
      if bad:
        raise ValueError(f"CostTable.{name} times must be > 0, got {bad}")
    unknown = set(self.prefill) - {"target", "proposer"}
    if unknown:
      raise ValueError(f"CostTable.prefill keys must be 'target' and 'proposer', got {sorted(unknown)}")
    if (self.proposer_step < 0 or any(s < 0 for s in self.overhead.values())
        or any(s < 0 for s in self.prefill.values())):
      raise ValueError("CostTable.proposer_step, overhead and prefill times must be >= 0")

  @property
  def k_max(self) -> int:
    return max(self.verify) - 1

  def to_dict(self) -> dict:
    return {"batch": self.batch, "verify": {int(t): s for t, s in self.verify.items()},
            "proposer_step": self.proposer_step, "propose": {int(k): s for k, s in self.propose.items()},
            "catch_up": self.catch_up, "overhead": {int(k): s for k, s in self.overhead.items()},
            "rounds": {int(k): s for k, s in self.rounds.items()}, "prefill": dict(self.prefill),
            "prompt_len": self.prompt_len, "n_tokens": self.n_tokens, "spread": self.spread,
            "tree_rounds": {tree.describe(): s for tree, s in self.tree_rounds.items()},
            "round_over_parts": {int(k): s / parts_seconds(self, k) for k, s in self.rounds.items()
                                 if k + 1 in self.verify}}


def _acceptance(acceptance_by_position: Sequence[float | None], i: int) -> float:
  """a_i for 1-based i; positions past the measured ones reuse the last measured value."""
  known = [a for a in acceptance_by_position if a is not None]
  if not known:
    return 0.0
  values = list(acceptance_by_position)
  if i <= len(values) and values[i - 1] is not None:
    return float(values[i - 1])
  return float(known[-1])


def survival(acceptance_by_position: Sequence[float | None], k: int) -> list[float]:
  """``[P(d_1..d_i all accepted) for i = 1..k]``."""
  out, run = [], 1.0
  for i in range(1, k + 1):
    run *= _acceptance(acceptance_by_position, i)
    out.append(run)
  return out


def expected_tau(acceptance_by_position: Sequence[float | None], k: int) -> float:
  """Mean tokens emitted per round, ``1 + sum_i prod_{j<=i} a_j``, in ``[1, k + 1]``."""
  return 1.0 + sum(survival(acceptance_by_position, k))


def propose_seconds(table: CostTable, k: int) -> float:
  """The proposer's ``propose`` of k tokens: measured, else interpolated linearly between the measured k
  (or extrapolated from the largest), else ``k * proposer_step``."""
  if k == 0:
    return 0.0
  if k in table.propose:
    return table.propose[k]
  known = sorted(table.propose)
  if len(known) >= 2:
    lo = max([x for x in known if x < k], default=known[0])
    hi = min([x for x in known if x > k], default=known[-1])
    if lo == hi:
      lo, hi = known[-2], known[-1]
    slope = (table.propose[hi] - table.propose[lo]) / (hi - lo)
    return max(0.0, table.propose[lo] + slope * (k - lo))
  return k * table.proposer_step


def parts_seconds(table: CostTable, k: int) -> float:
  """One round as the sum of its measured parts: ``propose(k)``, ``v(k + 1)`` and ``overhead[k]``."""
  if k + 1 not in table.verify:
    raise ValueError(f"the cost table has no verification time for a window of {k + 1} (k={k})")
  return propose_seconds(table, k) + table.verify[k + 1] + table.overhead.get(k, 0.0)


def _catch_up_seconds(table: CostTable) -> float:
  return table.proposer_step if table.catch_up else 0.0


def _body_seconds(table: CostTable, k: int) -> float:
  """One round without the catch-up step: measured whole where the table has it, else its parts."""
  return table.rounds[k] if k in table.rounds else parts_seconds(table, k)


def round_seconds(table: CostTable, acceptance_by_position: Sequence[float | None], k: int) -> float:
  """Predicted seconds of one round of speculation length k (k = 0: one baseline step), including the
  catch-up proposer step that follows a fully accepted round (``table.catch_up``), weighted by its
  probability."""
  if k == 0:
    return _body_seconds(table, 0)
  body = _body_seconds(table, k)
  return body + survival(acceptance_by_position, k)[-1] * _catch_up_seconds(table)


def expected_rounds(acceptance_by_position: Sequence[float | None], k: int, batch: int,
                    n_tokens: int) -> tuple[float, float]:
  """Expected loop iterations and catch-up steps for ``batch`` rows of ``n_tokens`` each, computed exactly.

  A row emits ``X = 1 + (accepted proposals)`` tokens per round, i.i.d. with
  ``P(X > j) = prod_{i<=j} a_i``; it needs ``R`` rounds, the first ``r`` with ``S_r = X_1 + .. + X_r >=
  n_tokens``. The loop runs until the slowest row is done, ``E[max_b R_b] = sum_r (1 - P(R <= r)^B)``:
  with ``batch > 1`` more than ``n_tokens / tau``. A round begins with the draft's catch-up step when some
  row still generating had every proposal of the previous round accepted: ``sum_r 1 - (1 - g_r)^B`` with
  ``g_r = P(S_{r-1} + k + 1 < n_tokens, X_r = k + 1)``. Rows are taken as independent; the distribution of
  ``S_r`` comes from repeated convolution (no sampling, so the answer is deterministic).
  """
  if k == 0:
    return float(n_tokens), 0.0
  return _rounds_of(survival(acceptance_by_position, k), batch, n_tokens)


def _rounds_of(survival_curve: Sequence[float], batch: int, n_tokens: int) -> tuple[float, float]:
  """:func:`expected_rounds` for any round whose accepted count n has ``P(n >= j) = survival_curve[j - 1]``
  (a chain's or a tree's, ``k`` its length or depth)."""
  k = len(survival_curve)
  surv = np.array([1.0] + list(survival_curve))  # P(X > j) for j = 0..k
  px = np.concatenate([[0.0], surv - np.append(surv[1:], 0.0)])  # P(X = x), x = 0..k+1
  dist = np.zeros(n_tokens)  # P(S_r = s) for s < n_tokens (mass at >= n_tokens is dropped: the row is done)
  dist[0] = 1.0
  rounds = catch_ups = 0.0
  for _ in range(n_tokens):
    alive = dist.sum()  # P(R > r - 1): the row generates in round r
    if alive < 1e-12:
      break
    rounds += 1.0 - (1.0 - alive) ** batch
    g = px[k + 1] * dist[: max(0, n_tokens - k - 1)].sum()  # full accept in round r and still generating after
    catch_ups += 1.0 - (1.0 - g) ** batch
    dist = np.convolve(dist, px)[:n_tokens]
  return float(rounds), float(catch_ups)


def run_seconds(table: CostTable, k: int, rounds: float, catch_ups: float) -> float:
  """Predicted seconds of one ``generate`` call: the target's prefill and the proposer's ``init``, then
  ``rounds`` loop iterations with ``k`` proposals and ``catch_ups`` catch-up proposer steps."""
  prefill = table.prefill.get("target", 0.0) + (table.prefill.get("proposer", 0.0) if k else 0.0)
  return prefill + rounds * _body_seconds(table, k) + catch_ups * _catch_up_seconds(table)


def predict_speedup(table: CostTable, acceptance_by_position: Sequence[float | None], k: int,
                    n_tokens: int | None = None) -> float:
  """Predicted speedup of speculation length k over the baseline (1.0 for k = 0).

  Without ``n_tokens``: the steady-state token rate of one row, ``E[tau] / round(k)`` over
  ``1 / round(0)``. With ``n_tokens``: the time of a whole call generating ``n_tokens`` per row for
  ``table.batch`` rows, prefill and the slowest row (see :func:`expected_rounds`) included.
  """
  if k == 0:
    return 1.0
  if n_tokens is None:
    rate = expected_tau(acceptance_by_position, k) / round_seconds(table, acceptance_by_position, k)
    return rate * round_seconds(table, acceptance_by_position, 0)
  rounds, catch_ups = expected_rounds(acceptance_by_position, k, table.batch, n_tokens)
  return run_seconds(table, 0, n_tokens, 0.0) / run_seconds(table, k, rounds, catch_ups)


def choose_k(table: CostTable, acceptance_by_position: Sequence[float | None], k_max: int | None = None,
             margin: float = 0.0, n_tokens: int | None = None) -> int:
  """The k in ``{0..k_max}`` with the highest predicted speedup; 0 unless some k beats 1 + margin."""
  k_max = table.k_max if k_max is None else min(k_max, table.k_max)
  best_k, best = 0, 1.0 + margin
  for k in range(1, k_max + 1):
    s = predict_speedup(table, acceptance_by_position, k, n_tokens)
    if s > best:
      best_k, best = k, s
  return best_k


# ------------------------------------------------------------------------------------------ trees
#
# A top-choice tree's child of sibling rank r at depth d is accepted, once the walk reached its parent, with
# probability c[d][r] = P(the target's draw there is the proposer's (r+1)-th choice), whatever its siblings
# (``ALGORITHMS.md``, "Token trees"). Taking the c[d][r] as independent along a path (the model, as Medusa's
# and Sequoia's tree searches take them), a node's path is accepted with probability prod_j c[j][r_j],
# E[tau] = 1 + sum over nodes of that product, and the best static tree of N nodes is the N nodes of highest
# path probability, which form a tree (a child's never exceeds its parent's). The c[d][r] are measured by a
# pilot run (``SpecStats.rank_acceptance``); the tree's round is timed whole, like a chain's.


def _rank_probability(rank_acceptance: Sequence[Sequence[float | None]], depth: int, rank: int) -> float:
  """c[depth][rank] (0-based depth); not measured: 0, so a child is never worth verifying until a pilot
  offered it. Unlike a chain's acceptance by position, a depth the pilot's walk never reached is not
  extrapolated from the depths above it: the pilot offers alternatives along its spine of first choices only,
  so a depth goes unmeasured exactly when the walk keeps leaving that spine, and the rank acceptance seen
  there says nothing about the depths below (extrapolating it once predicted τ 4.7 for a tree that ran at
  1.7-2.9 on the bundled draft model)."""
  row = rank_acceptance[depth] if depth < len(rank_acceptance) else ()
  value = row[rank] if rank < len(row) else None
  return 0.0 if value is None else float(value)


def path_probability(rank_acceptance: Sequence[Sequence[float | None]], path: Sequence[int]) -> float:
  """P(every node of the rank path ``path`` accepted), the product of its c[d][r]."""
  out = 1.0
  for depth, rank in enumerate(path):
    out *= _rank_probability(rank_acceptance, depth, rank)
  return out


def tree_survival(rank_acceptance: Sequence[Sequence[float | None]], tree) -> list[float]:
  """``[P(n >= j) for j = 1..D]`` of a :class:`specjax.tree.TreeShape`: the path probabilities of its
  depth-j nodes summed (one child at most is accepted under each node)."""
  out = [0.0] * tree.depth
  for path in tree.paths():
    out[len(path) - 1] += path_probability(rank_acceptance, path)
  return [min(1.0, x) for x in out]


def tree_tau(rank_acceptance: Sequence[Sequence[float | None]], tree) -> float:
  """E[tau] of a static top-choice tree: 1 + the sum of its nodes' path probabilities."""
  return 1.0 + sum(tree_survival(rank_acceptance, tree))


def best_tree(rank_acceptance: Sequence[Sequence[float | None]], nodes: int, depth: int, ranks: int = 8):
  """The :class:`specjax.tree.TreeShape` of at most ``nodes`` nodes, ``depth`` levels and ``ranks`` children
  per node with the highest predicted E[tau]: the nodes of highest path probability, taken best first from
  the children of those already taken (a heap), so the result is closed under parents. Nodes of probability
  0 are not taken, so the tree may be smaller; None when even the root's first child has probability 0."""
  check_int("best_tree: nodes", nodes, 1)
  check_int("best_tree: depth", depth, 1)
  heap, kept, order = [], [], 0

  def push(path):
    nonlocal order
    prob = path_probability(rank_acceptance, path)
    if prob > 0.0:
      heapq.heappush(heap, (-prob, order, path))  # order: ties go to the node created first (a parent)
      order += 1

  for r in range(ranks):
    push((r,))
  while heap and len(kept) < nodes:
    _, _, path = heapq.heappop(heap)
    kept.append(path)
    if len(path) < depth:
      for r in range(ranks):
        push(path + (r,))
  return TreeShape.from_paths(kept) if kept else None


def tree_round_seconds(table: CostTable, rank_acceptance: Sequence[Sequence[float | None]], tree) -> float:
  """One round with ``tree`` (timed whole, ``table.tree_rounds``), plus the catch-up step of a proposer with
  ``catch_up`` (the draft model) after a round that accepted the tree's full depth, weighted by its
  probability (its deepest level is never expanded by the draft)."""
  if tree not in table.tree_rounds:
    raise ValueError(f"the cost table has no round time for tree {tree.describe()!r}: calibrate with trees=")
  return table.tree_rounds[tree] + tree_survival(rank_acceptance, tree)[-1] * _catch_up_seconds(table)


def predict_tree_speedup(table: CostTable, rank_acceptance: Sequence[Sequence[float | None]], tree,
                         n_tokens: int | None = None) -> float:
  """Predicted speedup of rounds with ``tree`` over the baseline, as :func:`predict_speedup` for chains
  (steady state without ``n_tokens``; a whole call of ``n_tokens`` per row with it)."""
  if n_tokens is None:
    rate = tree_tau(rank_acceptance, tree) / tree_round_seconds(table, rank_acceptance, tree)
    return rate * round_seconds(table, (), 0)
  rounds, catch_ups = _rounds_of(tree_survival(rank_acceptance, tree), table.batch, n_tokens)
  prefill = table.prefill.get("target", 0.0) + table.prefill.get("proposer", 0.0)
  spent = prefill + rounds * table.tree_rounds[tree] + catch_ups * _catch_up_seconds(table)
  return run_seconds(table, 0, n_tokens, 0.0) / spent


def choose_speculation(table: CostTable, acceptance_by_position: Sequence[float | None],
                       rank_acceptance: Sequence[Sequence[float | None]], k_max: int | None = None,
                       margin: float = 0.0, n_tokens: int | None = None):
  """The best of the chains ``k in {1..k_max}`` and the trees of ``table.tree_rounds``: an ``int`` k (0: no
  speculation beats 1 + margin) or the :class:`~specjax.tree.TreeShape` to run."""
  k = choose_k(table, acceptance_by_position, k_max, margin, n_tokens)
  best_choice = k
  best = predict_speedup(table, acceptance_by_position, k, n_tokens) if k else 1.0 + margin
  for tree in table.tree_rounds:
    s = predict_tree_speedup(table, rank_acceptance, tree, n_tokens)
    if s > best:
      best_choice, best = tree, s
  return best_choice


# ------------------------------------------------------------------------------------ calibration


def _pass_program(model: nnx.Module, batch: int, window: int, context: int, cache_len: int):
  """``run(state, iters)``: ``iters`` cached forwards over ``window`` tokens per row inside one jitted loop
  (per-call dispatch does not count, as inside ``generate``). Kept in the runtime's program cache: the
  target-only programs serve every proposer's calibration, and a second calibration compiles nothing new."""
  program, (state, _) = SplitModels(model).cached("calibration-pass", _build_pass, batch, window, context, cache_len)
  return program, (state,)


def _build_pass(structure: Structure, batch: int, window: int, context: int, cache_len: int):
  @jax.jit
  def run(state, iters):
    model = nnx.merge(structure.tdef, state)
    cache = model.init_cache(batch, cache_len).with_lengths(jnp.full((batch,), context, jnp.int32))
    tokens = jnp.ones((batch, window), jnp.int32)

    def body(_, carry):
      cache, acc = carry
      with per_position(row_invariant(model.cfg)):  # as the engine verifies (engine.always_invariant)
        logits, _, new = model(tokens, cache)
      # Feed a data dependency forward so XLA cannot hoist or drop the pass.
      return new.with_lengths(cache.lengths), acc + logits[:, -1, 0]
    return jax.lax.fori_loop(0, iters, body, (cache, jnp.zeros((batch,), jnp.float32)))[1]

  return run


def _prefill_program(model: nnx.Module, batch: int, prompt_len: int, cache_len: int):
  """``run(state, iters)``: ``iters`` prefill passes over ``prompt_len`` tokens into an empty cache."""
  program, (state, _) = SplitModels(model).cached("calibration-prefill", _build_prefill, batch, prompt_len, cache_len)
  return program, (state,)


def _build_prefill(structure: Structure, batch: int, prompt_len: int, cache_len: int):
  @jax.jit
  def run(state, iters):
    model = nnx.merge(structure.tdef, state)

    def body(_, acc):
      tokens = jnp.ones((batch, prompt_len), jnp.int32) + (acc > 1e30).astype(jnp.int32)[:, None]
      logits, _, _ = model(tokens, model.init_cache(batch, cache_len))
      return acc + logits[:, -1, 0]
    return jax.lax.fori_loop(0, iters, body, jnp.zeros((batch,), jnp.float32))

  return run


def _synthetic_prompts(batch: int, length: int) -> jax.Array:
  """A repeating pattern (so that an n-gram lookup finds matches), ``[B, length] int32``."""
  return jnp.broadcast_to(1 + jnp.arange(length, dtype=jnp.int32) % 7, (batch, length))


def _rewind(new, old, never: jax.Array):
  """``new`` with every cache rolled back to ``old``'s lengths and every other leaf taken from ``old``: the
  next iteration repeats the same work on the cache buffers it just wrote (no copies).

  ``never`` is a traced boolean that is False at run time but that XLA cannot prove False (it depends on
  the iteration's outputs): the other leaves are ``where(never, changed(new), old)``, so a state that comes
  back unchanged does not make the next iteration's work loop-invariant (XLA would hoist it out of the
  loop, and the timing would miss it). ``changed`` differs from its input, so XLA cannot fold the select
  either."""
  def back(n, o):
    if isinstance(n, KVCache):
      return n.with_lengths(o.lengths)
    if jax.dtypes.issubdtype(n.dtype, jax.dtypes.prng_key):
      return o
    return jnp.where(never, ~n if n.dtype == bool else n + 1, o)
  return jax.tree.map(back, new, old, is_leaf=lambda x: isinstance(x, KVCache))


def _round_program(parts: SplitModels, batch: int, k: int, sampling: SamplingConfig, context: int, cache_len: int):
  return parts.cached("calibration-round", _build_round, batch, k, sampling, context, cache_len)


def _state_at(parts: Structure, tstate, pstates, batch: int, k: int, sampling: SamplingConfig, context: int,
              cache_len: int):
  """Inside a trace: the engine's own initial state (:func:`specjax.engine.init_state`) after a synthetic
  prompt of ``context + 1`` tokens, so the target cache holds ``context`` positions."""
  target, proposer = parts.models(tstate, pstates)
  prompts = _synthetic_prompts(batch, context + 1)
  mode = Mode.of([sampling])
  settings = RowSettings.of([sampling] * batch, [1] * batch, [()] * batch, target.cfg.vocab_size, mode)
  return engine.init_state(target, proposer, prompts, jnp.full((batch,), context + 1, jnp.int32),
                           row_keys(0, batch), jax.tree.map(jnp.asarray, settings), k=k, mode=mode,
                           max_len=cache_len, out_len=None)


def _build_round(parts: Structure, batch: int, k: int, sampling: SamplingConfig, context: int, cache_len: int):
  """``run(target_state, proposer_states, iters)``: ``iters`` rounds of the engine's own round
  (:func:`specjax.engine.round_step`) at a fixed context length, from a state built by
  :func:`specjax.engine.init_state`. After each round the caches are rolled back and every other part of
  the state restored, so every round does the same work: proposals, verification, acceptance, emission,
  the proposer's commit and statistics, without the draft's catch-up step."""
  state_mode = Mode.of([sampling])

  @jax.jit
  def run(tstate, pstates, iters):
    state = _state_at(parts, tstate, pstates, batch, k, sampling, context, cache_len)

    def body(_, state):
      target, proposer = parts.models(tstate, pstates)
      new = engine.round_step(state, target=target, proposer=proposer, k=k, mode=state_mode)[0]
      never = jnp.sum(new.last) < -1  # token ids are >= 0
      return dataclasses.replace(_rewind(new, state, never), last=new.last, stats=new.stats, settings=state.settings)
    state = jax.lax.fori_loop(0, iters, body, state)
    return state.last, state.stats.accepted

  return run


def _tree_round_program(parts: SplitModels, batch: int, tree, sampling: SamplingConfig, context: int, cache_len: int):
  return parts.cached("calibration-tree-round", _build_tree_round, batch, tree, sampling, context, cache_len)


def _build_tree_round(parts: Structure, batch: int, tree, sampling: SamplingConfig, context: int, cache_len: int):
  """As :func:`_build_round`, for the engine's tree round (:func:`specjax.engine.tree_round_step`)."""
  state_mode = Mode.of([sampling])

  @jax.jit
  def run(tstate, pstates, iters):
    state = _state_at(parts, tstate, pstates, batch, tree.depth, sampling, context, cache_len)

    def body(_, state):
      target, proposer = parts.models(tstate, pstates)
      new = engine.tree_round_step(state, target=target, proposer=proposer, tree=tree, mode=state_mode)[0]
      never = jnp.sum(new.last) < -1
      return dataclasses.replace(_rewind(new, state, never), last=new.last, stats=new.stats, settings=state.settings)
    state = jax.lax.fori_loop(0, iters, body, state)
    return state.last, state.stats.accepted

  return run


def _propose_program(parts: SplitModels, batch: int, k: int, sampling: SamplingConfig, context: int, cache_len: int):
  return parts.cached("calibration-propose", _build_propose, batch, k, sampling, context, cache_len)


def _build_propose(parts: Structure, batch: int, k: int, sampling: SamplingConfig, context: int, cache_len: int):
  """``run(target_state, proposer_states, iters)``: ``iters`` calls of the proposer's ``propose`` of k
  tokens at a fixed context length (its state rewound after each)."""
  @jax.jit
  def run(tstate, pstates, iters):
    state = _state_at(parts, tstate, pstates, batch, k, sampling, context, cache_len)
    sampler = Sampler(state.settings, state.counts, Mode.of([sampling]))

    def body(_, carry):
      pstate, last = carry
      target, proposer = parts.models(tstate, pstates)
      ctx = Context(last=last, lengths=state.target_cache.lengths, active=jnp.ones((batch,), bool))
      proposal = proposer.propose(pstate, target, ctx, row_keys(1, batch), k, sampler, None)
      drafts, new = proposal.drafts, proposal.state
      return _rewind(new, pstate, jnp.sum(drafts) < -1), drafts[:, -1]
    return jax.lax.fori_loop(0, iters, body, (state.proposer, state.last))[1]

  return run


def _proposer_prefill_program(parts: SplitModels, batch: int, prompt_len: int, cache_len: int):
  return parts.cached("calibration-init", _build_proposer_prefill, batch, prompt_len, cache_len)


def _build_proposer_prefill(parts: Structure, batch: int, prompt_len: int, cache_len: int):
  """``run(target_state, proposer_states, iters)``: ``iters`` calls of the proposer's ``init`` after a
  target prefill over ``prompt_len`` tokens (done once, outside the timed loop)."""
  @jax.jit
  def run(tstate, pstates, iters):
    target, proposer = parts.models(tstate, pstates)
    prompts = _synthetic_prompts(batch, prompt_len)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    _, features, _ = engine.target_pass(target, prompts, target.init_cache(batch, cache_len), proposer.aux_layers)

    def body(_, acc):
      target, proposer = parts.models(tstate, pstates)
      shifted = prompts + (acc > 1e30).astype(jnp.int32)  # a dependency: no hoisting
      pstate = proposer.init(target, shifted, lens, features, cache_len)
      return acc + sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(pstate)[:1])
    return jax.lax.fori_loop(0, iters, body, jnp.zeros((), jnp.float32))

  return run


class Calibration:
  """The timing programs of a :class:`CostTable`, timed in as many interleaved passes as wanted.

  ``Calibration(...)`` builds the programs (see :func:`calibrate_costs` for what they time); ``warm_up()``
  compiles them and sizes each timing to last at least ``min_seconds``; every ``time_once()`` times each
  program once (a run of n and one of 2n iterations), interleaved across programs; ``table()`` turns the
  timings so far into a :class:`CostTable` (:meth:`per_iteration`). A benchmark calls ``time_once()``
  between its own measurements, so that the calibration sees the same stretch of time as the measured runs.

  ``rounds`` (default every k in ``1..k_max``) limits the whole-round programs to the k a caller will
  predict for: each is a compile of the target and the proposer together, which dominates the calibration of
  a deep model on an accelerator. Predictions for other k fall back to the sum of the parts. ``trees``: token
  trees (:class:`specjax.tree.TreeShape` or :class:`~specjax.tree.DynamicTree`) whose whole round is timed too
  (``CostTable.tree_rounds``), for a proposer that proposes trees.

  ``windows`` (default ``1..k_max + 1``), ``propose`` (default ``{1, k_max}``) and ``prefill`` (default True)
  likewise limit the target passes, the proposer's ``propose`` and the two prefills timed, for a caller that
  reads a few figures (``specjax eval``'s cost ratios): the target step (T = 1) and the baseline round (k = 0)
  are always timed. A table without the figures a prediction needs raises ``KeyError`` there.
  """

  def __init__(self, target: nnx.Module, proposer=None, batch: int = 1, k_max: int = 4, *,
               sampling: SamplingConfig = SamplingConfig(temperature=0.0), prompt_len: int = 16,
               n_tokens: int = 64, min_seconds: float = 0.01, rounds: Sequence[int] | None = None,
               trees: Sequence = (), windows: Sequence[int] | None = None, propose: Sequence[int] | None = None,
               prefill: bool = True):
    if proposer is not None and not isinstance(proposer, Proposer):
      raise ValueError(f"calibrate_costs: proposer must be a specjax.proposers.Proposer or None, got "
                       f"{type(proposer).__name__}")
    for name, value in (("batch", batch), ("k_max", k_max), ("prompt_len", prompt_len), ("n_tokens", n_tokens)):
      check_int(f"calibrate_costs: {name}", value, 1)
    if not min_seconds > 0:
      raise ValueError(f"calibrate_costs: min_seconds must be > 0, got {min_seconds!r}")
    rounds = range(1, k_max + 1) if rounds is None else sorted(set(rounds))
    if any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= k_max for k in rounds):
      raise ValueError(f"calibrate_costs: rounds must be integers in [1, k_max={k_max}], got {list(rounds)}")
    windows = range(1, k_max + 2) if windows is None else list(windows)
    if any(isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= k_max + 1 for t in windows):
      raise ValueError(f"calibrate_costs: windows must be integers in [1, k_max + 1 = {k_max + 1}], got "
                       f"{list(windows)}")
    windows = sorted(set(windows) | {1})
    propose = sorted({1, k_max}) if propose is None else list(propose)
    if any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= k_max for k in propose):
      raise ValueError(f"calibrate_costs: propose must be integers in [1, k_max={k_max}], got {list(propose)}")
    propose = sorted(set(propose))
    if not isinstance(prefill, bool):
      raise ValueError(f"calibrate_costs: prefill must be True or False, got {prefill!r}")
    trees = tuple(dict.fromkeys(trees))
    if trees:
      if proposer is None:
        raise ValueError("calibrate_costs: trees need a proposer")
      for tree in trees:
        proposer.check_tree(tree)
    self.batch, self.prompt_len, self.n_tokens, self.min_seconds = batch, prompt_len, n_tokens, min_seconds
    self.catch_up = proposer is not None and proposer.catch_up
    window = max([k_max + 1] + [tree_window(tree) for tree in trees])
    context, cache_len = prompt_len + n_tokens // 2, prompt_len + n_tokens + window
    programs = {("verify", t): _pass_program(target, batch, t, context, cache_len) for t in windows}
    if prefill:
      programs[("prefill", "target")] = _prefill_program(target, batch, prompt_len, cache_len)
    programs[("round", 0)] = _round_program(SplitModels(target, None), batch, 0, sampling, context, cache_len)
    if proposer is not None:
      parts = SplitModels(target, proposer)
      if prefill:
        programs[("prefill", "proposer")] = _proposer_prefill_program(parts, batch, prompt_len, cache_len)
      for k in propose:
        programs[("propose", k)] = _propose_program(parts, batch, k, sampling, context, cache_len)
      for k in rounds:
        programs[("round", k)] = _round_program(parts, batch, k, sampling, context, cache_len)
      for tree in trees:
        programs[("tree", tree)] = _tree_round_program(parts, batch, tree, sampling, context, cache_len)
    self.programs = programs
    self.iters: dict = {}
    self.runs: dict = {name: [] for name in programs}  # (t(n), t(2n)) per time_once()
    self.times: dict = {name: [] for name in programs}  # (t(2n) - t(n)) / n per time_once()

  def warm_up(self) -> Calibration:
    for name, (run, args) in self.programs.items():
      jax.block_until_ready(run(*args, 1))  # compile
      start = time.perf_counter()
      jax.block_until_ready(run(*args, 2))
      per = max((time.perf_counter() - start) / 2, 1e-7)
      self.iters[name] = int(min(1024, max(2, round(self.min_seconds / per))))
    return self

  def time_once(self) -> None:
    """One timing of every program: a run of n iterations and one of 2n, interleaved across programs."""
    if not self.iters:
      self.warm_up()
    for name, (run, args) in self.programs.items():
      n = self.iters[name]
      elapsed = []
      for iters in (n, 2 * n):
        start = time.perf_counter()
        jax.block_until_ready(run(*args, iters))
        elapsed.append(time.perf_counter() - start)
      self.runs[name].append(tuple(elapsed))
      self.times[name].append(max(elapsed[1] - elapsed[0], 1e-9) / n)

  def per_iteration(self, name) -> float:
    """The seconds one iteration of program ``name`` costs: ``(min t(2n) - min t(n)) / n`` over the timings
    so far. The difference leaves out what a call costs besides its iterations (dispatch, setting up the
    initial state); the minima leave out what other processes add (contention only ever adds time), so the
    figure stays meaningful on a busy machine, where single differences can even come out negative. Where
    the minima still invert, ``min t(2n) / 2n`` (the call's overhead included) stands in."""
    n = self.iters[name]
    short, long = (min(ts) for ts in zip(*self.runs[name], strict=True))
    return (long - short) / n if long > short else long / (2 * n)

  def table(self) -> CostTable:
    if not all(self.times.values()):
      raise ValueError("Calibration.table: call time_once() at least once first")
    costs = {name: self.per_iteration(name) for name in self.times}
    # spread: the round timings' own noise, half the inter-quartile range of single differences over their median
    spread = {name: (float(np.percentile(ts, 75) - np.percentile(ts, 25)) / 2 / max(statistics.median(ts), 1e-12))
              for name, ts in self.times.items()}
    pick = lambda kind: {key: s for (kd, key), s in costs.items() if kd == kind}
    propose = pick("propose")
    return CostTable(batch=self.batch, verify=pick("verify"), proposer_step=propose.get(1, 0.0), propose=propose,
                     catch_up=self.catch_up, rounds=pick("round"), prefill=pick("prefill"),
                     prompt_len=self.prompt_len, n_tokens=self.n_tokens,
                     spread=max(s for (kd, _), s in spread.items() if kd in ("round", "tree")),
                     tree_rounds=pick("tree"))



def calibrate_costs(target: nnx.Module, proposer=None, batch: int = 1, k_max: int = 4, *,
                    sampling: SamplingConfig = SamplingConfig(temperature=0.0), prompt_len: int = 16,
                    n_tokens: int = 64, repeats: int = 7, min_seconds: float = 0.01, trees: Sequence = (),
                    rounds: Sequence[int] | None = None, windows: Sequence[int] | None = None,
                    propose: Sequence[int] | None = None, prefill: bool = True) -> CostTable:
  """Measures a :class:`CostTable` on the current backend for one batch size.

  Times, each inside one jitted loop (so per-call dispatch does not count, as inside ``generate``):
  target passes over T = 1..k_max+1 tokens, the proposer's ``propose`` at k = 1 and k_max, the engine's
  whole round for every k in 0..k_max (proposals, verification, warping, acceptance, emission, the
  proposer's commit, statistics), the target's prefill over ``prompt_len`` tokens and the proposer's
  ``init``. Any :class:`specjax.proposers.Proposer` is timed the same way, through its own methods; with
  ``proposer=None`` only the target's figures are measured. Each figure comes from ``repeats`` timings,
  interleaved across all of them, each lasting at least ``min_seconds`` (:meth:`Calibration.per_iteration`:
  the least disturbed of them). The caches have the
  length ``generate`` gives them for a prompt bucket of ``prompt_len`` and ``n_tokens`` new tokens at
  ``k_max`` (attention reads the whole cache, so its length matters), filled to the middle of the run,
  ``prompt_len + n_tokens // 2``. ``trees``: token trees whose whole round is timed as well
  (``CostTable.tree_rounds``, for :func:`predict_tree_speedup`). ``rounds``, ``windows``, ``propose`` and
  ``prefill`` time only some of the rounds, target passes, proposals and prefills (:class:`Calibration`), for a
  caller that reads only those.
  """
  check_int("calibrate_costs: repeats", repeats, 1)
  calibration = Calibration(target, proposer, batch, k_max, sampling=sampling, prompt_len=prompt_len,
                            n_tokens=n_tokens, min_seconds=min_seconds, trees=trees, rounds=rounds,
                            windows=windows, propose=propose, prefill=prefill).warm_up()
  for _ in range(repeats):
    calibration.time_once()
  return calibration.table()


# table_key(...) -> CostTable; shared by k="auto" and the benchmark (bounded, in the runtime's caches).
# Models are keyed by identity and config: clear it after changing a model's weights in place.
COST_TABLES = RUNTIME.cost_tables


def table_key(target: nnx.Module, proposer, batch: int, k_max: int, sampling: SamplingConfig,
              prompt_len: int = 16, n_tokens: int = 64, trees: tuple = ()) -> tuple:
  """The key of :data:`COST_TABLES` (tests and tools may place a table there by hand)."""
  return (id(target), target.cfg, None if proposer is None else proposer.identity(), batch, k_max, sampling, prompt_len, n_tokens,
          jax.default_backend()) + ((tuple(trees),) if trees else ())


def cost_table(target: nnx.Module, proposer, batch: int, k_max: int, sampling: SamplingConfig,
               prompt_len: int = 16, n_tokens: int = 64, trees: tuple = (), **calibration) -> CostTable:
  """:func:`calibrate_costs`, measured once per :func:`table_key` and kept; ``calibration``
  (``repeats``, ``min_seconds``) applies to the first measurement."""
  key = table_key(target, proposer, batch, k_max, sampling, prompt_len, n_tokens, tuple(trees))
  return COST_TABLES.get_or_make(key, lambda: calibrate_costs(
      target, proposer, batch, k_max, sampling=sampling, prompt_len=prompt_len, n_tokens=n_tokens,
      trees=tuple(trees), **calibration))


def speedup_table(table: CostTable, acceptance_by_position: Sequence[float | None], k_max: int) -> dict[int, float]:
  return {k: predict_speedup(table, acceptance_by_position, k) for k in range(0, k_max + 1)}
