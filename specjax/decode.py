"""``generate``: the host API around the pure engine (:mod:`specjax.engine`).

It validates inputs (errors name the field and the allowed values), pads prompts to power-of-two
buckets, resolves ``k="auto"`` with the calibrated cost model, and keeps one compiled program per
(target structure, proposer structure, k, bucket of max_new_tokens, sampling, schedule, placement) in the
bounded :data:`specjax.runtime.RUNTIME` caches, so a call with new prompts, new weights of the same shapes or
another ``max_new_tokens`` in the same bucket does not recompile. The whole generation of a call runs inside
that one jitted program.

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
from specjax.config import GREEDY, MIN_PROMPT_BUCKET, NEW_TOKENS_BUCKET, SamplingConfig, SpecConfig
from specjax.engine import RoundStats
from specjax.proposers import DraftModel, Proposer
from specjax.request import Request, stop_ids, token_rows
from specjax.runtime import RUNTIME, SplitModels, Structure
from specjax.sampling import Mode, RowSettings, row_keys
from specjax.tree import TreeShape

# Times each jitted entry point was traced (a diagnostic for recompilation tests and benchmarks).
TRACE_COUNTS = RUNTIME.trace_counts

# k="auto" speculates only where the predicted speedup exceeds 1 + AUTO_MARGIN + the calibration's own
# spread: a wrong "yes" costs more than a wrong "no".
AUTO_MARGIN = 0.02


def bucket_length(n: int) -> int:
  """The padded prompt length for a prompt of ``n`` tokens: a power of two, at least 16."""
  return max(MIN_PROMPT_BUCKET, 1 << max(0, n - 1).bit_length())


def new_tokens_bound(max_new_tokens: int) -> int:
  """The static bound ``generate`` compiles for: ``max_new_tokens`` rounded up to a multiple of
  :data:`~specjax.config.NEW_TOKENS_BUCKET` (32). Each row stops at the exact ``max_new_tokens`` (a per-row
  setting the program reads at run time), so calls of 20 and 30 new tokens share one program; the bucket costs
  at most 31 cache positions more."""
  return -(-max_new_tokens // NEW_TOKENS_BUCKET) * NEW_TOKENS_BUCKET


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
  """``nnx.split(model)``, kept while the model's weights stay the same arrays (see
  :meth:`specjax.runtime.Runtime.split_model`)."""
  return RUNTIME.split_model(model)


def _generate_tokens(target_def, target_state, proposer, proposer_defs, proposer_states, prompts, prompt_lens,
                     keys, settings, *, k, max_new, mode, dynamic=False, logprobs=None, invariant=False, tree=None):
  TRACE_COUNTS["generate_tokens"] += 1
  return engine.generate_tokens(target_def, target_state, proposer, proposer_defs, proposer_states, prompts,
                                prompt_lens, keys, settings, k=k, max_new=max_new, mode=mode, dynamic=dynamic,
                                logprobs=logprobs, invariant=invariant, tree=tree)


generate_tokens = jax.jit(_generate_tokens, static_argnames=(
    "target_def", "proposer", "proposer_defs", "k", "max_new", "mode", "dynamic", "logprobs", "invariant", "tree"))
generate_tokens.__doc__ = engine.generate_tokens.__doc__


def _build_program(structure: Structure, k: int, max_new: int, mode: Mode, dynamic: bool, logprobs: int | None,
                   invariant: bool, tree, placement: sharding.Placement | None):
  """The jitted run with its static arguments bound (kept by :meth:`SplitModels.cached`; ``tree``: the
  rounds' tree spec or None). A ``placement`` (a mesh and its rules), last, is part of the key: the program
  traces its models under it and returns replicated outputs."""
  def run(target_state, proposer_states, prompts, prompt_lens, keys, settings):
    with sharding.activate(placement):
      return _generate_tokens(structure.tdef, target_state, structure.template, structure.pdefs, proposer_states,
                              prompts, prompt_lens, keys, settings, k=k, max_new=max_new, mode=mode,
                              dynamic=dynamic, logprobs=logprobs, invariant=invariant, tree=tree)
  out = None if placement is None else placement.replicated  # small outputs, readable on every process
  return jax.jit(run, out_shardings=out)


@dataclasses.dataclass(frozen=True)
class SpecStats:
  """What a run did. ``acceptance_rate = accepted_tokens / drafted_tokens`` (None without drafting);
  ``mean_accepted_length`` is τ, tokens emitted per row-round counting the corrected or bonus token
  (in [1, k+1]); ``acceptance_by_position[i]`` is P(d_{i+1} accepted | d_1..d_i accepted). With a token tree
  (``tree``, its description), ``k`` is the tree's depth, a position is a depth, ``drafted_tokens`` counts
  the tree's nodes, and ``accepted_by_rank[r]`` counts the accepted nodes that were their proposer's
  (r+1)-th choice among their siblings (the last entry: that rank or worse). ``rank_acceptance[i][r]`` is
  P(the proposer's (r+1)-th choice is accepted at depth i+1 | the walk reached depth i) under the top-choice
  rule, measured where such a child was offered (None where none was): the input of the cost model's trees
  (:func:`specjax.costmodel.best_tree`). A chain offers rank 0 only (its entries equal
  ``acceptance_by_position`` in greedy decoding)."""

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
  accepted_by_rank: list[int] = dataclasses.field(default_factory=list)
  tree: str | None = None
  rank_acceptance: list[list[float | None]] = dataclasses.field(default_factory=list)

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
    proposed: ``[B, max_new_tokens] bool``: the token was a proposal the target accepted (False for the
      target's own corrected or bonus token, and past the row's length).
    logprobs: ``[B, max_new_tokens] float32`` (with ``logprobs=``): each token's log-probability under the
      target's own distribution, the log-softmax of its logits before any warp; else None.
    top_ids, top_logprobs: ``[B, max_new_tokens, N]`` (with ``logprobs=N``, N >= 1): the N most likely tokens
      at each position and their log-probabilities; else None.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  text: list[str] | None
  stats: SpecStats
  proposed: np.ndarray | None = None
  logprobs: np.ndarray | None = None
  top_ids: np.ndarray | None = None
  top_logprobs: np.ndarray | None = None

  def rows(self) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


def _summarise(stats: RoundStats, lengths: np.ndarray, k: int, tree=None) -> SpecStats:
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
      accepted_by_rank=[int(x) for x in np.asarray(stats.ranks).sum(axis=0)] if tree is not None else [],
      tree=None if tree is None else tree.describe(),
      rank_acceptance=[[float(a / o) if o else None for a, o in zip(acc, off)]
                       for acc, off in zip(np.asarray(stats.ranks), np.asarray(stats.offered))],
  )


def model_config(model: nnx.Module, role: str):
  """``model.cfg``, or ValueError naming ``role`` when ``model`` is no specjax model."""
  cfg = getattr(model, "cfg", None)
  if cfg is None or not hasattr(cfg, "vocab_size"):
    raise ValueError(f"{role} must be a specjax model (with a .cfg config), got {type(model).__name__}")
  return cfg


def prepare_prompts(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token rows (checked by :meth:`Request.check`) to their bucket length:
  ``([B, bucket] int32, [B] int32)``."""
  lens = np.array([len(r) for r in rows], np.int32)
  padded = np.zeros((len(rows), bucket_length(int(lens.max()))), np.int32)
  for i, row in enumerate(rows):
    padded[i, : len(row)] = row
  return padded, lens


# The pilot tree of tree="auto": along the spine of the proposer's first choices, depth d offers this many
# ranks (the children that measure P(rank r accepted at depth d); 22 nodes at depth 8).
PILOT_FANS = (4, 4, 3, 3, 2, 2, 2, 2)


def pilot_tree(depth: int) -> TreeShape:
  """The tree a ``tree="auto"`` pilot run proposes: the first choices to ``depth`` (at most
  ``len(PILOT_FANS)``) and, under each, the alternatives that :data:`PILOT_FANS` offers at that depth."""
  return TreeShape.from_paths([(0,) * d + (r,) for d in range(depth) for r in range(PILOT_FANS[d])])


def resolve_auto_k(target, proposer: Proposer, spec: SpecConfig, sampling: SamplingConfig, rows: list[list[int]],
                   seed: int, max_new_tokens: int = 64) -> int | TreeShape:
  """What ``k="auto"`` runs for this batch, decided once per (models, sampling, batch size, prompt bucket,
  power-of-two bucket of ``max_new_tokens``, backend, tree candidates): a chain's k (0: target only) or,
  with ``tree="auto"``, a :class:`~specjax.tree.TreeShape`.

  It measures a :class:`~specjax.costmodel.CostTable` for this batch size and prompt bucket (the calibration
  times the proposer's own ``propose`` and the engine's whole round), the proposer's per-position acceptance
  from a pilot run at ``k_max`` on these prompts (or on ``spec.pilot_prompts``, in one batch), and picks the k
  with the highest predicted speedup for a whole call (prefill and the slowest row included), 0 (target only)
  when none beats the baseline by more than ``AUTO_MARGIN`` plus the calibration's spread. With ``tree="auto"`` a second pilot proposes
  :func:`pilot_tree` and measures acceptance by depth and sibling rank; for each of ``spec.tree_sizes`` the
  best static tree under that measurement (:func:`specjax.costmodel.best_tree`) is calibrated too (its whole
  round), and the best of chains, trees and the target alone is chosen the same way.
  """
  prompt_len = bucket_length(max(map(len, rows)))
  n_tokens = bucket_length(max_new_tokens)
  pilot_rows = [list(p) for p in spec.pilot_prompts] if spec.pilot_prompts else rows
  for i, row in enumerate(spec.pilot_prompts or ()):  # a pilot needs a proposal and its bonus token of room
    Request(row, 2, sampling, (), seed, None).check(
        target.cfg.vocab_size, target.cfg.max_seq_len, prompt_name=f"spec.pilot_prompts[{i}]",
        room_name=f"the target's cache length max_seq_len={target.cfg.max_seq_len} (a pilot runs 2 tokens or more)")
  room = target.cfg.max_seq_len - max(map(len, rows + pilot_rows))
  k_max = max(1, min(spec.k_max, room - 1, proposer.max_k or spec.k_max))
  key = (id(target), target.cfg, proposer.identity(), sampling, len(rows), k_max, prompt_len, n_tokens,
         jax.default_backend(), spec.pilot_prompts) + ((spec.tree_sizes,) if spec.auto_tree else ())

  def decide() -> int | TreeShape:
    # The pilot's length is fixed (not this call's max_new_tokens): acceptance needs a few rounds to show.
    pilot_new = max(1, min(8 * (k_max + 1), room))
    pilot = generate(target, pilot_rows, proposer=proposer, spec=SpecConfig(k=k_max), sampling=sampling,
                     max_new_tokens=pilot_new, seed=seed)
    ranks, trees = [], ()
    if spec.auto_tree:
      depth = min(k_max, len(PILOT_FANS))
      tree_pilot = generate(target, pilot_rows, proposer=proposer, spec=SpecConfig(tree=pilot_tree(depth)),
                            sampling=sampling, max_new_tokens=pilot_new, seed=seed)
      ranks = tree_pilot.stats.rank_acceptance
      trees = tuple(dict.fromkeys(t for n in spec.tree_sizes if (t := costmodel.best_tree(ranks, n, depth))))
    table = costmodel.cost_table(target, proposer, len(rows), k_max, sampling, prompt_len, n_tokens, trees)
    return costmodel.choose_speculation(table, pilot.stats.acceptance_by_position, ranks, k_max,
                                        margin=AUTO_MARGIN + table.spread, n_tokens=n_tokens)

  return RUNTIME.auto_k.get_or_make(key, decide)


def resolve_proposer(proposer, draft) -> Proposer | None:
  """``proposer``, or ``DraftModel(draft)``; ValueError for both or for something that is no proposer."""
  if draft is not None and proposer is not None:
    raise ValueError("pass either draft= (a draft model) or proposer=, not both")
  if draft is not None:
    return DraftModel(draft)
  if proposer is not None and not isinstance(proposer, Proposer):
    raise ValueError(f"proposer must be a specjax.proposers.Proposer (DraftModel, NGram, Medusa, Eagle, MTP), "
                     f"got {type(proposer).__name__}")
  return proposer


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
             seed: int = 0, tokenizer=None, eos_id: int | Sequence[int] | None = None, logprobs: int | None = None,
             mesh: jax.sharding.Mesh | None = None, rules: sharding.ShardingRules | None = None,
             response_format: dict | None = None) -> GenerateOutput:
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
    sampling: the :class:`SamplingConfig` of every row (temperature, top-k, top-p, min-p, penalties, logit
      bias), shared by target and proposer. Default greedy.
    max_new_tokens: tokens to generate per row (exact unless the row emits a stop token).
    seed: PRNG seed; the same seed and inputs give the same output.
    tokenizer: encodes text prompts and decodes the output; provides the default ``eos_id``.
    eos_id: the token, or up to ``MAX_STOP_TOKENS`` tokens, that end a row (included in its output), for
      example EOS and a chat template's end-of-turn token. None: the tokenizer's ``eos_id`` if it has one,
      else rows never end early.
    logprobs: None, or N in ``[0, MAX_LOGPROBS]``: also return each emitted token's log-probability under the
      target's own distribution (before any warp) and its N most likely alternatives.
    mesh: a ``jax.sharding.Mesh`` with axes ``data`` and ``model`` (:func:`specjax.sharding.make_mesh`), or
      None (one device). The target and the proposer's modules are moved onto it in place (once; later calls
      find them there), tensor-parallel over ``model`` and the rows over ``data``; the output is the same as
      on one device up to floating-point reduction order (greedy: the same tokens).
    rules: the :class:`specjax.sharding.ShardingRules` mapping logical axes to mesh axes (default
      ``TENSOR_PARALLEL``); only with ``mesh``.
    response_format: structured output (needs ``tokenizer`` and llguidance, ``pip install 'specjax[grammar]'``):
      OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, or
      specjax's ``{"type": "regex", "pattern": ...}`` or ``{"type": "grammar", "grammar": <Lark>}``
      (:class:`specjax.grammar.Grammar`). Every row's output then follows the target's law restricted to the
      grammar, exactly, with or without speculation (``docs/guide.md``, "Structured output"); the rounds are
      stepped by the host (:mod:`specjax.grammar`), so a chain's ``k`` only (no ``"auto"``, trees or mesh).

  Returns:
    :class:`GenerateOutput`.

  Raises:
    ValueError: naming the offending field and its allowed values.
  """
  proposer = resolve_proposer(proposer, draft)
  if spec is None:
    spec = SpecConfig(k=4) if proposer is not None else SpecConfig(k=0)
  if not isinstance(spec, SpecConfig):
    raise ValueError(f"spec must be a SpecConfig, got {type(spec).__name__}")
  if response_format is not None:
    from specjax import grammar as grammars  # noqa: PLC0415 (an optional dependency's module)
    structured = grammars.Grammar.from_response_format(response_format)
    if structured is not None:
      return _generate_structured(target, prompts, structured, proposer=proposer, spec=spec, sampling=sampling,
                                  max_new_tokens=max_new_tokens, seed=seed, tokenizer=tokenizer, eos_id=eos_id,
                                  logprobs=logprobs, mesh=mesh)
  if spec.tree is not None and proposer is None:
    raise ValueError("spec.tree needs a proposer that proposes trees (DraftModel, Eagle, MTP or Medusa)")
  if proposer is None and (spec.auto or spec.k > 0):
    raise ValueError(f"spec.k={spec.k!r} needs a proposer: pass proposer= (for example specjax.proposers.NGram()) "
                     "or draft=, or use SpecConfig(k=0) for target-only decoding")
  tcfg = model_config(target, "target")
  rows = token_rows(prompts, tokenizer)
  stops = stop_ids(eos_id, tokenizer)
  for i, row in enumerate(rows):
    Request(tuple(row), max_new_tokens, sampling, stops, seed, logprobs).check(
        tcfg.vocab_size, tcfg.max_seq_len, prompt_name=f"prompts[{i}]", stop_name="eos_id",
        room_name=f"the target's cache length max_seq_len={tcfg.max_seq_len}")
  padded, lens = prepare_prompts(rows)
  needed = int(lens.max()) + max_new_tokens
  if proposer is not None:
    proposer.check(tcfg, needed)
    if spec.tree is not None:  # tree="auto": any depth-1 tree asks whether the proposer proposes trees at all
      proposer.check_tree(TreeShape((1,)) if spec.auto_tree else spec.tree)
    elif not spec.auto and proposer.max_k is not None and spec.k > proposer.max_k:
      raise ValueError(f"spec.k={spec.k} exceeds the {proposer.max_k} proposals per round that this {proposer.name} "
                       f"proposer can make")

  placement = sharding.Placement.create(mesh, rules)
  if placement is not None:
    if spec.auto:
      raise ValueError("spec.k='auto' calibrates on one device: pass an integer k with mesh=")
    padded, lens = _place(placement, target, proposer if spec.k > 0 else None, padded, lens)
  k, tree = (resolve_auto_k(target, proposer, spec, sampling, rows, seed, max_new_tokens), None) if spec.auto \
      else (spec.k, spec.tree)
  if isinstance(k, TreeShape):
    k, tree = k.depth, k
  mode = Mode.of([sampling])
  settings = RowSettings.of([sampling] * len(rows), [max_new_tokens] * len(rows), [stops] * len(rows),
                            tcfg.vocab_size, mode)
  models = SplitModels(target, proposer if k > 0 else None)
  program, args = models.cached("generate", _build_program, k, new_tokens_bound(max_new_tokens), mode,
                                spec.schedule == "dynamic" and k > 0, logprobs, spec.invariant and k > 0, tree,
                                placement)
  out, lengths, stats = program(*args, padded, lens, row_keys(seed, len(rows)), settings)
  out, lengths = jax.device_get(out), np.asarray(lengths)
  # The program's outputs cover the bucket; no row went past max_new_tokens (ids -1 there): cut to it.
  out = jax.tree.map(lambda x: np.asarray(x)[:, :max_new_tokens], out)
  tokens = out.ids
  text = None
  if tokenizer is not None:
    text = [tokenizer.decode(row[:n].tolist()) for row, n in zip(tokens, lengths)]
  stats = _summarise(jax.device_get(stats), lengths, k, tree)
  return GenerateOutput(tokens=tokens, lengths=lengths, text=text, stats=stats,
                        proposed=np.asarray(out.proposed), logprobs=out.logprobs, top_ids=out.top_ids,
                        top_logprobs=out.top_logprobs)


def _generate_structured(target, prompts, structured, *, proposer, spec: SpecConfig, sampling: SamplingConfig,
                         max_new_tokens: int, seed: int, tokenizer, eos_id, logprobs, mesh) -> GenerateOutput:
  """:func:`generate` under a grammar: the rows run in a :class:`specjax.serving.slots.SlotEngine` of as many
  slots, each round stepped by the host (:mod:`specjax.grammar`); row i draws from seed ``seed + i``."""
  from specjax import grammar as grammars  # noqa: PLC0415
  from specjax.serving.slots import SlotEngine  # noqa: PLC0415 (serving imports this module)
  if tokenizer is None:
    raise ValueError("response_format needs tokenizer= (the grammar is compiled against its vocabulary)")
  for name, bad in (("spec.k", spec.auto), ("spec.tree", spec.tree is not None),
                    ("spec.schedule", spec.schedule != "static"), ("mesh", mesh is not None),
                    ("logprobs", logprobs is not None)):
    if bad:
      raise ValueError(f"{name} is not supported with response_format (structured rounds are host-stepped chains "
                       f"of a fixed k on one device)")
  if proposer is None and spec.k > 0:
    raise ValueError(f"spec.k={spec.k} needs a proposer: pass proposer= or draft=, or SpecConfig(k=0)")
  tcfg = model_config(target, "target")
  rows = token_rows(prompts, tokenizer)
  stops = stop_ids(eos_id, tokenizer)
  try:
    compiled = grammars.compile_grammar(structured, tokenizer, stops)
  except grammars.RequestError as e:
    raise grammars.RequestError(e.field if e.field != "stop_ids" else "eos_id", str(e)) from None
  requests = [Request(tuple(row), max_new_tokens, sampling, stops, (seed + i) % (1 << 32), grammar=compiled)
              for i, row in enumerate(rows)]
  for i, request in enumerate(requests):
    request.check(tcfg.vocab_size, tcfg.max_seq_len - spec.k, prompt_name=f"prompts[{i}]", stop_name="eos_id",
                  room_name=f"the target's cache length max_seq_len={tcfg.max_seq_len} less k ({spec.k})")
  needed = max(map(len, rows)) + max_new_tokens + spec.k
  engine_ = SlotEngine(target, proposer if spec.k > 0 else None, slots=len(rows), widths=(len(rows),),
                       max_len=min(bucket_length(needed), tcfg.max_seq_len), ks=(spec.k,))
  slots = engine_.insert(requests)
  out = {s: [] for s in slots}
  proposed = {s: [] for s in slots}
  rounds = row_rounds = drafted = accepted = catch_ups = 0
  reached = np.zeros((spec.k,), np.int64)
  accepted_at = np.zeros((spec.k,), np.int64)
  while engine_.live_slots:
    result = engine_.step(spec.k)
    rounds += 1
    catch_ups += result.catch_ups
    row_rounds += sum(result.row_rounds.values())
    drafted += sum(result.drafted.values())
    accepted += sum(result.accepted.values())
    reached += result.reached[:spec.k]
    accepted_at += result.accepted_at[:spec.k]
    for slot, new in result.tokens.items():
      n_acc = result.accepted.get(slot, 0)
      out[slot] += new
      proposed[slot] += [i < n_acc for i in range(len(new))]
  lengths = np.asarray([len(out[s]) for s in slots], np.int32)
  tokens = np.full((len(rows), max_new_tokens), -1, np.int32)
  marks = np.zeros((len(rows), max_new_tokens), bool)
  for i, s in enumerate(slots):
    tokens[i, :lengths[i]] = out[s]
    marks[i, :lengths[i]] = proposed[s]
  text = [tokenizer.decode(out[s]) for s in slots]
  stats = SpecStats(rounds=rounds, row_rounds=row_rounds, catch_ups=catch_ups, drafted_tokens=drafted,
                    accepted_tokens=accepted, acceptance_rate=accepted / drafted if drafted else None,
                    mean_accepted_length=(accepted + row_rounds) / row_rounds if row_rounds else 0.0,
                    acceptance_by_position=[float(a / r) if r else None for a, r in zip(accepted_at, reached)],
                    new_tokens=int(lengths.sum()), k=spec.k)
  return GenerateOutput(tokens=tokens, lengths=lengths, text=text, stats=stats, proposed=marks)
