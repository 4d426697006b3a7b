"""The economics of speculation: a calibrated cost model, its speedup prediction, and ``k = "auto"``.

With per-position acceptance ``a_i = P(d_i accepted | d_<i accepted)`` a round of speculation length k
emits on average ``E[tau] = 1 + sum_{i=1..k} prod_{j<=i} a_j`` tokens and costs, in this engine,

    round(k) = k * c + v(k + 1) + P(all k accepted) * c + r

seconds: k proposer steps, one target pass over the ``k + 1`` window, the catch-up step the draft needs after
a fully accepted round (see ``decode``), and a fixed per-round cost ``r`` (warping, acceptance, bookkeeping).
The baseline is the same loop with ``k = 0``: ``round(0) = v(1) + r0`` for one token. So

    speedup(k) = (E[tau](k) / round(k)) / (1 / round(0))

``choose_k`` is the argmax over ``k in {0..k_max}``; ``k = 0`` means speculation does not pay.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import SamplingConfig


@dataclasses.dataclass(frozen=True)
class CostTable:
  """Seconds measured on one machine, for one (target, proposer, batch size).

  Attributes:
    batch: batch size the table was measured at.
    verify: ``{T: seconds}`` of one target pass over T tokens per row; ``verify[1]`` is the target step.
    proposer_step: seconds of one proposer step (0 for a free proposer).
    overhead: ``{k: seconds}`` per round besides the model passes (warping, acceptance); missing k: 0.
  """

  batch: int
  verify: Mapping[int, float]
  proposer_step: float
  overhead: Mapping[int, float] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if 1 not in self.verify:
      raise ValueError("CostTable.verify must hold T=1 (the target step)")
    bad = {t: s for t, s in self.verify.items() if not s > 0}
    if bad:
      raise ValueError(f"CostTable.verify times must be > 0, got {bad}")
    if self.proposer_step < 0 or any(s < 0 for s in self.overhead.values()):
      raise ValueError("CostTable.proposer_step and overhead times must be >= 0")

  @property
  def k_max(self) -> int:
    return max(self.verify) - 1

  def to_dict(self) -> dict:
    return {"batch": self.batch, "verify": {int(t): s for t, s in self.verify.items()},
            "proposer_step": self.proposer_step, "overhead": {int(k): s for k, s in self.overhead.items()}}


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


def round_seconds(table: CostTable, acceptance_by_position: Sequence[float | None], k: int) -> float:
  """Predicted seconds of one round of speculation length k (k = 0: one baseline step)."""
  extra = table.overhead.get(k, 0.0)
  if k == 0:
    return table.verify[1] + extra
  if k + 1 not in table.verify:
    raise ValueError(f"the cost table has no verification time for a window of {k + 1} (k={k})")
  all_accepted = survival(acceptance_by_position, k)[-1]
  return k * table.proposer_step + table.verify[k + 1] + all_accepted * table.proposer_step + extra


def predict_speedup(table: CostTable, acceptance_by_position: Sequence[float | None], k: int) -> float:
  """Predicted tokens/s of speculation length k over the baseline's (1.0 for k = 0)."""
  base_rate = 1.0 / round_seconds(table, acceptance_by_position, 0)
  rate = expected_tau(acceptance_by_position, k) / round_seconds(table, acceptance_by_position, k)
  return rate / base_rate


def choose_k(table: CostTable, acceptance_by_position: Sequence[float | None], k_max: int | None = None,
             margin: float = 0.0) -> int:
  """The k in ``{0..k_max}`` with the highest predicted speedup; 0 unless some k beats 1 + margin."""
  k_max = table.k_max if k_max is None else min(k_max, table.k_max)
  best_k, best = 0, 1.0 + margin
  for k in range(1, k_max + 1):
    s = predict_speedup(table, acceptance_by_position, k)
    if s > best:
      best_k, best = k, s
  return best_k


# ------------------------------------------------------------------------------------ calibration


def _median_seconds(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _pass_seconds(model: nnx.Module, batch: int, window: int, context: int, iters: int, repeats: int,
                  sampling: SamplingConfig | None = None) -> float:
  """Seconds of one cached forward over ``window`` tokens per row, timed as ``iters`` passes inside one
  jitted loop (so per-call dispatch does not count, as inside ``generate``). With ``sampling``, each pass
  also warps and draws from its last distribution, as a proposer step does."""
  from specjax.sampling import draw, warp

  graphdef, state = nnx.split(model)
  cache = model.init_cache(batch, context + window + 1).with_lengths(jnp.full((batch,), context, jnp.int32))
  tokens = jnp.ones((batch, window), jnp.int32)

  @jax.jit
  def run(state, cache, tokens):
    def body(_, carry):
      cache, acc = carry
      logits, _, new = nnx.merge(graphdef, state)(tokens, cache)
      out = logits[:, -1, 0]
      if sampling is not None:
        out = out + draw(warp(logits[:, -1], sampling), jax.random.key(0), sampling)
      # Feed a data dependency forward so XLA cannot hoist or drop the pass.
      return new.with_lengths(cache.lengths), acc + out
    return jax.lax.fori_loop(0, iters, body, (cache, jnp.zeros((batch,), jnp.float32)))[1]

  return _median_seconds(run, (state, cache, tokens), repeats) / iters


def _accept_seconds(vocab: int, batch: int, k: int, sampling: SamplingConfig, iters: int, repeats: int) -> float:
  from specjax.acceptance import accept
  from specjax.sampling import warp

  @jax.jit
  def run(key):
    def body(i, acc):
      kk = jax.random.fold_in(key, i)
      logits = jax.random.normal(kk, (batch, k + 1, vocab))
      p = warp(logits, sampling)
      q = p[:, :k] if k else jnp.zeros((batch, 0, vocab))
      d = jnp.argmax(q, -1).astype(jnp.int32) if k else jnp.zeros((batch, 0), jnp.int32)
      n, tok = accept(p, q, d, kk, greedy=sampling.greedy)
      return acc + n + tok
    return jax.lax.fori_loop(0, iters, body, jnp.zeros((batch,), jnp.int32))

  return _median_seconds(run, (jax.random.key(0),), repeats) / iters


def calibrate_costs(target: nnx.Module, proposer: nnx.Module | None, batch: int, k_max: int, *,
                    sampling: SamplingConfig = SamplingConfig(temperature=0.0), context: int = 64,
                    iters: int = 8, repeats: int = 5) -> CostTable:
  """Measures a :class:`CostTable` on the current backend for one batch size.

  Times target passes over T = 1..k_max+1 tokens, one proposer step, and the per-round cost of warping
  and acceptance for each k, each as the median of ``repeats`` timed runs of ``iters`` passes inside one
  jit (per-call dispatch does not count, as inside ``generate``). The proposer step includes its warp and
  draw; the per-round overhead counts the warp of the k + 1 target distributions and the acceptance.
  """
  vocab = target.cfg.vocab_size
  verify = {t: _pass_seconds(target, batch, t, context, iters, repeats) for t in range(1, k_max + 2)}
  step = (_pass_seconds(proposer, batch, 1, context, iters, repeats, sampling)
          if proposer is not None else 0.0)
  overhead = {k: _accept_seconds(vocab, batch, k, sampling, iters, repeats) for k in range(0, k_max + 1)}
  return CostTable(batch=batch, verify=verify, proposer_step=step, overhead=overhead)


# (target, proposer, batch, k_max, sampling, backend) -> CostTable; shared by k="auto" and the benchmark.
# Models are keyed by identity and config: clear this after changing a model's weights in place.
COST_TABLES: dict[tuple, CostTable] = {}


def cost_table(target: nnx.Module, proposer: nnx.Module | None, batch: int, k_max: int,
               sampling: SamplingConfig, **calibration) -> CostTable:
  """:func:`calibrate_costs`, measured once per (models, batch, k_max, sampling, backend) and kept;
  ``calibration`` (``context``, ``iters``, ``repeats``) applies to the first measurement."""
  key = (id(target), target.cfg, id(proposer), getattr(proposer, "cfg", None), batch, k_max, sampling,
         jax.default_backend())
  if key not in COST_TABLES:
    COST_TABLES[key] = calibrate_costs(target, proposer, batch, k_max, sampling=sampling, **calibration)
  return COST_TABLES[key]


def speedup_table(table: CostTable, acceptance_by_position: Sequence[float | None], k_max: int) -> dict[int, float]:
  return {k: predict_speedup(table, acceptance_by_position, k) for k in range(0, k_max + 1)}
