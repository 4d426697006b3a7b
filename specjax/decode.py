"""``generate``: the host API around the pure engine (:mod:`specjax.engine`).

It validates inputs (errors name the field and the allowed values), pads prompts to power-of-two
buckets, resolves ``k="auto"`` with the calibrated cost model, and keeps one compiled program per
(target structure, proposer structure, k, max_new_tokens, sampling, schedule, placement) in the bounded
:data:`specjax.runtime.RUNTIME` caches, so a call with new prompts or new weights of the same shapes does not
recompile. The whole generation of a call runs inside that one jitted program.

With ``mesh=`` the program is built for a :class:`specjax.sharding.Placement`: the models' weights are moved
onto the mesh once (in place), the prompts are split by rows over ``data``, the program traces its models
under the placement's rules, and its outputs come back replicated, so every process of a multi-host run reads
the whole result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from specjax import costmodel, engine, sharding
from specjax.config import GREEDY, SamplingConfig, SpecConfig
from specjax.engine import RoundStats
from specjax.proposers import DraftModel, Proposer
from specjax.runtime import RUNTIME

# Times each jitted entry point was traced (a diagnostic for recompilation tests and benchmarks).
TRACE_COUNTS = RUNTIME.trace_counts

MIN_PROMPT_BUCKET = 16
# k="auto" speculates only where the predicted speedup exceeds 1 + AUTO_MARGIN + the calibration's own
# spread: a wrong "yes" costs more than a wrong "no".
AUTO_MARGIN = 0.02


def bucket_length(n: int) -> int:
  """The padded prompt length for a prompt of ``n`` tokens: a power of two, at least 16."""
  return max(MIN_PROMPT_BUCKET, 1 << max(0, n - 1).bit_length())


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
  """``nnx.split(model)``, kept while the model's weights stay the same arrays (see
  :meth:`specjax.runtime.Runtime.split_model`)."""
  return RUNTIME.split_model(model)


def forget_model(model: nnx.Module) -> None:
  """Drops the split kept for ``model`` (after replacing one of its submodules)."""
  RUNTIME.forget_model(model)


def _generate_tokens(target_def, target_state, proposer, proposer_defs, proposer_states, prompts, prompt_lens,
                     key, eos_ids, *, k, max_new, sampling, dynamic=False):
  TRACE_COUNTS["generate_tokens"] += 1
  return engine.generate_tokens(target_def, target_state, proposer, proposer_defs, proposer_states, prompts,
                                prompt_lens, key, eos_ids, k=k, max_new=max_new, sampling=sampling, dynamic=dynamic)


generate_tokens = jax.jit(_generate_tokens, static_argnames=(
    "target_def", "proposer", "proposer_defs", "k", "max_new", "sampling", "dynamic"))
generate_tokens.__doc__ = engine.generate_tokens.__doc__


def _program(target_def, template: Proposer | None, proposer_defs: tuple, k: int, max_new: int,
             sampling: SamplingConfig, dynamic: bool, placement: sharding.Placement | None = None):
  """The jitted run with its static arguments bound, kept per graphdef object: a jitted call would
  otherwise hash and compare the graphdefs (a walk over every node) on every call. A ``placement`` (a mesh
  and its rules) is part of the key: the program traces its models under it and returns replicated outputs."""
  options = None if template is None else (type(template), template.options())
  key = (id(target_def), options, tuple(map(id, proposer_defs)), k, max_new, sampling, dynamic, placement)

  def make():
    def run(target_state, proposer_states, prompts, prompt_lens, rng, eos_ids):
      with sharding.activate(placement):
        return _generate_tokens(target_def, target_state, template, proposer_defs, proposer_states, prompts,
                                prompt_lens, rng, eos_ids, k=k, max_new=max_new, sampling=sampling, dynamic=dynamic)
    out = None if placement is None else placement.replicated  # small outputs, readable on every process
    return jax.jit(run, out_shardings=out), target_def, proposer_defs  # graphdefs live while their ids are keys

  return RUNTIME.programs.get_or_make(key, make)[0]


@dataclasses.dataclass(frozen=True)
class SpecStats:
  """What a run did. ``acceptance_rate = accepted_tokens / drafted_tokens`` (None without drafting);
  ``mean_accepted_length`` is τ, tokens emitted per row-round counting the corrected or bonus token
  (in [1, k+1]); ``acceptance_by_position[i]`` is P(d_{i+1} accepted | d_1..d_i accepted)."""

  rounds: int
  row_rounds: int
  catch_ups: int
  drafted_tokens: int
  accepted_tokens: int
  acceptance_rate: float | None
  mean_accepted_length: float
  acceptance_by_position: list[float | None]
  new_tokens: int
  k: int

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  """Result of :func:`generate`.

  Attributes:
    tokens: ``[B, max_new_tokens] int32`` generated ids; positions past ``lengths[b]`` hold -1. An EOS
      that ended a row is included.
    lengths: ``[B] int32`` generated tokens per row.
    text: decoded rows when a tokenizer was given, else None.
    stats: :class:`SpecStats`.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  text: list[str] | None
  stats: SpecStats

  def rows(self) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


def _summarise(stats: RoundStats, lengths: np.ndarray, k: int) -> SpecStats:
  row_rounds = int(np.sum(stats.row_rounds))
  accepted = int(np.sum(stats.accepted))
  drafted = int(np.sum(stats.drafted))
  reached, acc_at = np.asarray(stats.reached), np.asarray(stats.accepted_at)
  return SpecStats(
      rounds=int(stats.rounds),
      row_rounds=row_rounds,
      catch_ups=int(stats.catch_ups),
      drafted_tokens=drafted,
      accepted_tokens=accepted,
      acceptance_rate=accepted / drafted if drafted else None,
      mean_accepted_length=(accepted + row_rounds) / row_rounds if row_rounds else 0.0,
      acceptance_by_position=[float(a / r) if r else None for a, r in zip(acc_at, reached)],
      new_tokens=int(np.sum(lengths)),
      k=k,
  )


def _model_config(model: nnx.Module, role: str):
  cfg = getattr(model, "cfg", None)
  if cfg is None or not hasattr(cfg, "vocab_size"):
    raise ValueError(f"{role} must be a specjax model (with a .cfg config), got {type(model).__name__}")
  return cfg


def _as_token_rows(prompts, tokenizer) -> list[list[int]]:
  if isinstance(prompts, str):
    prompts = [prompts]
  if isinstance(prompts, np.ndarray) or isinstance(prompts, jax.Array):
    arr = np.asarray(prompts)
    if arr.ndim == 1:
      arr = arr[None]
    if arr.ndim != 2:
      raise ValueError(f"prompts array must be [B, P] token ids, got shape {arr.shape}")
    return [list(map(int, row)) for row in arr]
  if not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
  if all(isinstance(p, (int, np.integer)) for p in prompts):
    prompts = [prompts]
  rows = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if tokenizer is None:
        raise ValueError(f"prompts[{i}] is text: pass tokenizer= to encode it")
      rows.append(list(tokenizer.encode(p)))
    else:
      rows.append([int(t) for t in p])
  return rows


def prepare_prompts(rows: list[list[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token rows to their bucket length: ``([B, bucket] int32, [B] int32)``."""
  for i, row in enumerate(rows):
    if not row:
      raise ValueError(f"prompts[{i}] is empty: every prompt needs at least 1 token")
    bad = [t for t in row if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(f"prompts[{i}] holds token id {bad[0]} outside the vocabulary [0, {vocab_size})")
  lens = np.array([len(r) for r in rows], np.int32)
  padded = np.zeros((len(rows), bucket_length(int(lens.max()))), np.int32)
  for i, row in enumerate(rows):
    padded[i, : len(row)] = row
  return padded, lens


def resolve_auto_k(target, proposer: Proposer, spec: SpecConfig, sampling: SamplingConfig, rows: list[list[int]],
                   seed: int, max_new_tokens: int = 64) -> int:
  """The k that ``k="auto"`` runs for this batch, decided once per (models, sampling, batch size, prompt
  bucket, power-of-two bucket of ``max_new_tokens``, backend).

  It measures a :class:`~specjax.costmodel.CostTable` for this batch size and prompt bucket (the calibration
  times the proposer's own ``propose`` and the engine's whole round), the proposer's per-position acceptance
  from a pilot run at ``k_max`` on these prompts, and picks the k with the highest predicted speedup for a
  whole call (prefill and the slowest row included), 0 (target only) when none beats the baseline by more
  than ``AUTO_MARGIN`` plus the calibration's spread.
  """
  prompt_len = bucket_length(max(map(len, rows)))
  n_tokens = bucket_length(max_new_tokens)
  room = target.cfg.max_seq_len - max(map(len, rows))
  k_max = max(1, min(spec.k_max, room - 1, proposer.max_k or spec.k_max))
  key = (id(target), target.cfg, proposer.identity(), sampling, len(rows), k_max, prompt_len, n_tokens,
         jax.default_backend())

  def decide() -> int:
    # The pilot's length is fixed (not this call's max_new_tokens): acceptance needs a few rounds to show.
    pilot = generate(target, rows, proposer=proposer, spec=SpecConfig(k=k_max), sampling=sampling,
                     max_new_tokens=max(1, min(8 * (k_max + 1), room)), seed=seed)
    table = costmodel.cost_table(target, proposer, len(rows), k_max, sampling, prompt_len, n_tokens)
    return costmodel.choose_k(table, pilot.stats.acceptance_by_position, k_max,
                              margin=AUTO_MARGIN + table.spread, n_tokens=n_tokens)

  return RUNTIME.auto_k.get_or_make(key, decide)


def _resolve_proposer(proposer, draft) -> Proposer | None:
  if draft is not None and proposer is not None:
    raise ValueError("pass either draft= (a draft model) or proposer=, not both")
  if draft is not None:
    return DraftModel(draft)
  if proposer is not None and not isinstance(proposer, Proposer):
    raise ValueError(f"proposer must be a specjax.proposers.Proposer (DraftModel, NGram, Medusa, Eagle, MTP), "
                     f"got {type(proposer).__name__}")
  return proposer


MAX_STOP_TOKENS = 4  # stop tokens per call, padded with -1 to this static size (one program for any set)


def _stop_tokens(eos_id, vocab_size: int) -> np.ndarray:
  """``[MAX_STOP_TOKENS] int32``: the stop tokens, padded with -1 (no token is -1)."""
  ids = [] if eos_id is None else [eos_id] if isinstance(eos_id, (int, np.integer)) else list(eos_id)
  if len(ids) > MAX_STOP_TOKENS:
    raise ValueError(f"eos_id holds {len(ids)} tokens; at most {MAX_STOP_TOKENS} stop tokens are supported")
  for t in ids:
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
      raise ValueError(f"eos_id must be token ids in [0, {vocab_size}), got {t!r}")
  return np.array(ids + [-1] * (MAX_STOP_TOKENS - len(ids)), np.int32)


def _check_int(name: str, value, low: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _place(placement: sharding.Placement, target: nnx.Module, proposer: Proposer | None, padded: np.ndarray,
           lens: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """Moves the target and the proposer's modules onto the mesh (once: a model already placed there costs an
  identity check) and returns the prompts ``[B, P]`` and lengths ``[B]`` split by rows."""
  placement.check_batch(len(lens))
  RUNTIME.place_model(target, placement, "the target")
  for module in () if proposer is None else proposer.modules():
    RUNTIME.place_model(module, placement, f"the {proposer.name} proposer")
  return placement.put(padded, sharding.TOKENS), placement.put(lens, sharding.ROWS)


def generate(target: nnx.Module, prompts, *, proposer: Proposer | None = None, draft: nnx.Module | None = None,
             spec: SpecConfig | None = None, sampling: SamplingConfig = GREEDY, max_new_tokens: int = 64,
             seed: int = 0, tokenizer=None, eos_id: int | Sequence[int] | None = None,
             mesh: jax.sharding.Mesh | None = None, rules: sharding.ShardingRules | None = None) -> GenerateOutput:
  """Generates up to ``max_new_tokens`` per prompt with speculative decoding, in one jitted loop.

  Args:
    target: the model whose distribution the output follows.
    prompts: text (with ``tokenizer``), a list of texts, a list of token-id lists of any lengths, or a
      ``[B, P]`` array. Rows are padded on the right to a bucket length; no left padding.
    proposer: what proposes tokens (:mod:`specjax.proposers`: ``DraftModel``, ``NGram``, ``Medusa``,
      ``Eagle``, ``MTP``); None: target-only decoding. The output law is the same for every proposer.
    draft: shorthand for ``proposer=DraftModel(draft)``.
    spec: proposals per round (``k``, or ``"auto"``) and the schedule; defaults to ``k=4`` with a
      proposer, ``k=0`` (the baseline) without.
    sampling: temperature / top-k / top-p, shared by target and proposer. Default greedy.
    max_new_tokens: tokens to generate per row (exact unless the row emits EOS).
    seed: PRNG seed; the same seed and inputs give the same output.
    tokenizer: encodes text prompts and decodes the output; provides the default ``eos_id``.
    eos_id: the token, or up to ``MAX_STOP_TOKENS`` tokens, that end a row (included in its output), for
      example EOS and a chat template's end-of-turn token. None: the tokenizer's ``eos_id`` if it has one,
      else rows never end early.
    mesh: a ``jax.sharding.Mesh`` with axes ``data`` and ``model`` (:func:`specjax.sharding.make_mesh`), or
      None (one device). The target and the proposer's modules are moved onto it in place (once; later calls
      find them there), tensor-parallel over ``model`` and the rows over ``data``; the output is the same as
      on one device up to floating-point reduction order (greedy: the same tokens).
    rules: the :class:`specjax.sharding.ShardingRules` mapping logical axes to mesh axes (default
      ``TENSOR_PARALLEL``); only with ``mesh``.

  Returns:
    :class:`GenerateOutput`.

  Raises:
    ValueError: naming the offending field and its allowed values.
  """
  proposer = _resolve_proposer(proposer, draft)
  if spec is None:
    spec = SpecConfig(k=4) if proposer is not None else SpecConfig(k=0)
  if not isinstance(spec, SpecConfig):
    raise ValueError(f"spec must be a SpecConfig, got {type(spec).__name__}")
  if not isinstance(sampling, SamplingConfig):
    raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
  if proposer is None and (spec.auto or spec.k > 0):
    raise ValueError(f"spec.k={spec.k!r} needs a proposer: pass proposer= (for example specjax.proposers.NGram()) "
                     "or draft=, or use SpecConfig(k=0) for target-only decoding")
  tcfg = _model_config(target, "target")
  _check_int("max_new_tokens", max_new_tokens, 1)
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise ValueError(f"seed must be an integer, got {seed!r}")
  if eos_id is None and tokenizer is not None:
    eos_id = getattr(tokenizer, "eos_id", None)
  eos_ids = _stop_tokens(eos_id, tcfg.vocab_size)

  rows = _as_token_rows(prompts, tokenizer)
  padded, lens = prepare_prompts(rows, tcfg.vocab_size)
  needed = int(lens.max()) + max_new_tokens
  if needed > tcfg.max_seq_len:
    raise ValueError(f"prompt length ({int(lens.max())}) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the "
                     f"target's cache length max_seq_len={tcfg.max_seq_len}")
  if proposer is not None:
    proposer.check(tcfg, needed)
    if not spec.auto and proposer.max_k is not None and spec.k > proposer.max_k:
      raise ValueError(f"spec.k={spec.k} exceeds the {proposer.max_k} proposals per round that this {proposer.name} "
                       f"proposer can make")

  placement = sharding.Placement.create(mesh, rules)
  if placement is not None:
    if spec.auto:
      raise ValueError("spec.k='auto' calibrates on one device: pass an integer k with mesh=")
    padded, lens = _place(placement, target, proposer if spec.k > 0 else None, padded, lens)
  k = resolve_auto_k(target, proposer, spec, sampling, rows, seed, max_new_tokens) if spec.auto else spec.k
  target_def, target_state = split_model(target)
  template, proposer_defs, proposer_states = (None, (), ()) if k == 0 else proposer.split(split_model)
  program = _program(target_def, template, proposer_defs, k, max_new_tokens, sampling,
                     spec.schedule == "dynamic" and k > 0, placement)
  tokens, lengths, stats = program(target_state, proposer_states, padded, lens, jax.random.key(seed),
                                   eos_ids)
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  text = None
  if tokenizer is not None:
    text = [tokenizer.decode(row[:n].tolist()) for row, n in zip(tokens, lengths)]
  return GenerateOutput(tokens=tokens, lengths=lengths, text=text,
                        stats=_summarise(jax.device_get(stats), lengths, k))
