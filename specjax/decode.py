"""Speculative decoding as pure jitted functions, and ``generate``, which runs whole inside one jit.

One round, for every row of the batch at once (shapes never depend on acceptance):

1. draft rollout: ``lax.scan`` over k draft steps proposes ``d[B, k]`` with distributions ``q[B, k, V]``
   (method ``ngram``: a lookup in the row's own context proposes ``d``, and ``q = one-hot(d)``);
2. verification: one target pass over the window ``[last, d_1..d_k]`` gives ``p[B, k+1, V]``;
3. acceptance: :func:`specjax.acceptance.accept` keeps ``n[B]`` proposals and draws one more token;
4. emission: rows append ``d_1..d_n, token`` (cut at EOS and at ``max_new_tokens``);
5. both caches advance by ``n + 1`` per row: rejected positions are simply not counted.

The baseline (method ``none``) is the same loop with ``k = 0``: the window is ``[last]`` and step 3 draws
the "bonus" token from ``p_1``, so baseline and speculation share every line of sampling code.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.acceptance import accept
from specjax.cache import KVCache
from specjax.config import GREEDY, SamplingConfig, SpecConfig
from specjax.ngram import ngram_propose
from specjax.sampling import draw, warp

# Times each jitted entry point was traced (a diagnostic for recompilation tests and benchmarks).
TRACE_COUNTS: collections.Counter[str] = collections.Counter()

MIN_PROMPT_BUCKET = 16


def bucket_length(n: int) -> int:
  """The padded prompt length for a prompt of ``n`` tokens: a power of two, at least 16."""
  return max(MIN_PROMPT_BUCKET, 1 << max(0, n - 1).bit_length())


def forward(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, cache: KVCache):
  """The pure forward contract ``(tokens[B, T], cache) -> (logits[B, T, V], hidden[B, T, D], cache)``."""
  return nnx.merge(graphdef, state)(tokens, cache)


# ----------------------------------------------------------------------------------------- state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundStats:
  """Counters accumulated over the rounds of a run (device arrays inside the loop)."""

  rounds: jax.Array  # [] loop iterations
  row_rounds: jax.Array  # [B] rounds in which the row was still generating
  drafted: jax.Array  # [B] proposals verified
  accepted: jax.Array  # [B] accepted proposals
  reached: jax.Array  # [k] active row-rounds in which proposal i was verified with d_<i accepted
  accepted_at: jax.Array  # [k] active row-rounds in which proposal i was accepted
  catch_ups: jax.Array  # [] rounds that began with the draft's catch-up step

  @classmethod
  def zeros(cls, batch: int, k: int) -> RoundStats:
    return cls(rounds=jnp.zeros((), jnp.int32), row_rounds=jnp.zeros((batch,), jnp.int32),
               drafted=jnp.zeros((batch,), jnp.int32), accepted=jnp.zeros((batch,), jnp.int32),
               reached=jnp.zeros((k,), jnp.int32), accepted_at=jnp.zeros((k,), jnp.int32),
               catch_ups=jnp.zeros((), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything the generation loop carries from one round to the next.

  Invariant at the start of a round: both caches hold the row's context up to but excluding ``last``
  (``lengths = context - 1``); ``prev`` is the token at cache position ``lengths - 1``, which the draft
  cache lacks where ``draft_stale`` (after a fully accepted round the draft never saw ``d_k``). With the
  n-gram proposer, ``history[b, :lengths[b] + 1]`` is the row's context, ``last`` at ``lengths[b]``.
  """

  target_cache: KVCache
  draft_cache: KVCache | None
  last: jax.Array  # [B] newest token, in no cache yet
  prev: jax.Array  # [B] token before it
  draft_stale: jax.Array  # [B] bool
  out: jax.Array  # [B, max_new + k + 1] emitted tokens (valid up to n_out)
  history: jax.Array | None  # [B, P + max_new + k + 1] prompt + emitted tokens (n-gram proposer only)
  n_out: jax.Array  # [B]
  done: jax.Array  # [B] bool
  k_now: jax.Array  # [] proposals per round under a dynamic schedule (static schedule: k)
  key: jax.Array
  stats: RoundStats


# ---------------------------------------------------------------------------------- the round


def draft_rollout(draft_fn, cache: KVCache, last: jax.Array, key: jax.Array, k: int,
                  sampling: SamplingConfig, steps: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, KVCache]:
  """Proposes k tokens per row with k single-token draft steps.

  Args:
    draft_fn: ``(tokens[B, 1], cache) -> (logits, hidden, cache)``.
    cache: draft cache holding the context before ``last``.
    last: ``[B]`` the newest accepted token.
    key: PRNG key. k: static speculation length. sampling: static warp shared with the target.
    steps: optional ``[] int32`` in ``[1, k]`` (a dynamic schedule): steps past it are skipped at run
      time and yield token 0 with ``q = 0``.

  Returns:
    drafts ``[B, k] int32``, their warped distributions ``q [B, k, V]``, and the draft cache, which now
    also holds ``last, d_1 .. d_{k-1}`` (those drafted).
  """

  def propose(cache, token, step_key):
    logits, _, cache = draft_fn(token[:, None], cache)
    q = warp(logits[:, 0], sampling)  # [B, V]
    return cache, draw(q, step_key, sampling), q

  def step(carry, xs):
    cache, token = carry
    i, step_key = xs
    if steps is None:
      cache, d, q = propose(cache, token, step_key)
    else:
      skip = lambda c, t, _: (c, jnp.zeros_like(t), jnp.zeros((t.shape[0], vocab), jnp.float32))
      cache, d, q = jax.lax.cond(i < steps, propose, skip, cache, token, step_key)
    return (cache, d), (d, q)

  vocab = jax.eval_shape(lambda c, t: draft_fn(t[:, None], c)[0], cache, last).shape[-1]
  (cache, _), (drafts, q) = jax.lax.scan(step, (cache, last), (jnp.arange(k), jax.random.split(key, k)))
  return drafts.T, jnp.swapaxes(q, 0, 1), cache


def verify(target_fn, cache: KVCache, last: jax.Array, drafts: jax.Array,
           sampling: SamplingConfig) -> tuple[jax.Array, KVCache]:
  """Scores ``[last, d_1..d_k]`` in one target pass: returns ``p [B, k+1, V]`` and the cache (+k+1)."""
  window = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, k+1]
  logits, _, cache = target_fn(window, cache)
  return warp(logits, sampling), cache


def _round(state: DecodeState, *, target_fn, draft_fn, k: int, max_new: int,
           sampling: SamplingConfig, eos_id: jax.Array, dynamic: bool,
           ngram: tuple[int, int] | None) -> DecodeState:
  key, draft_key, accept_key = jax.random.split(state.key, 3)
  active = ~state.done  # [B]
  batch = state.last.shape[0]
  draft_cache = state.draft_cache
  needs = jnp.zeros((), bool)

  with jax.named_scope("draft"):
    if k > 0 and ngram is not None:
      n_min, n_max = ngram
      drafts, _ = ngram_propose(state.history, state.target_cache.lengths + 1, k, n_max, n_min)  # [B, k]
      q = None  # one-hot(drafts), built below once the vocabulary is known
    elif k > 0:
      # The draft must see every accepted token before proposing: after a fully accepted round it has
      # not seen d_k (= prev). Re-feeding prev where the draft already has it rewrites identical entries.
      def catch_up(cache):
        _, _, cache = draft_fn(state.prev[:, None], cache.with_lengths(cache.lengths - 1))
        return cache

      needs = jnp.any(state.draft_stale & active)
      draft_cache = jax.lax.cond(needs, catch_up, lambda c: c, draft_cache)
      drafts, q, draft_cache = draft_rollout(draft_fn, draft_cache, state.last, draft_key, k, sampling,
                                             steps=state.k_now if dynamic else None)
    else:
      drafts = jnp.zeros((batch, 0), jnp.int32)
      q = None

  with jax.named_scope("verify"):
    p, target_cache = verify(target_fn, state.target_cache, state.last, drafts, sampling)

  with jax.named_scope("accept"):
    if k > 0 and ngram is not None:
      # A deterministic proposer: q_i = one-hot(d_i), zero past a dynamic schedule's proposals (as the
      # draft rollout's skipped steps), so accept() draws the bonus from p_{k_now + 1}.
      q = jax.nn.one_hot(drafts, p.shape[-1], dtype=p.dtype)  # [B, k, V]
      if dynamic:
        q = q * (jnp.arange(k) < state.k_now)[None, :, None]
    elif q is None:
      q = jnp.zeros((batch, 0, p.shape[-1]), p.dtype)
    num_drafts = jnp.full((batch,), state.k_now) if dynamic else None
    n, token = accept(p, q, drafts, accept_key, num_drafts, greedy=sampling.greedy)  # [B], [B]

  with jax.named_scope("emit"):
    slots = jnp.arange(k + 1)[None, :]  # [1, k+1]
    emitted = jnp.where(slots == n[:, None], token[:, None],
                        jnp.concatenate([drafts, token[:, None]], axis=1))  # [B, k+1]
    count = jnp.minimum(n + 1, max_new - state.n_out)  # max_new_tokens is exact per row
    is_eos = (emitted == eos_id) & (slots < count[:, None])
    hit_eos = jnp.any(is_eos, axis=1)
    count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, count)  # EOS ends the row there
    count = jnp.where(active, count, 0)
    write = jax.vmap(lambda o, e, i: jax.lax.dynamic_update_slice(o, e, (i,)))
    out = write(state.out, emitted, state.n_out)
    # The context grows at its end, lengths + 1; what lies past a row's new length is overwritten later.
    history = None if state.history is None else write(state.history, emitted, state.target_cache.lengths + 1)
    n_out = state.n_out + count
    done = state.done | hit_eos | (n_out >= max_new)

    # Both caches advance by n + 1 for generating rows; everything past that is rolled back.
    lengths = state.target_cache.lengths + jnp.where(active, n + 1, 0)
    target_cache = target_cache.with_lengths(lengths)
    if draft_cache is not None:
      draft_cache = draft_cache.with_lengths(lengths)
    before_token = jnp.take_along_axis(
        jnp.concatenate([state.last[:, None], drafts], axis=1), n[:, None], axis=1)[:, 0]

    s = state.stats
    act = active.astype(jnp.int32)
    positions = jnp.arange(k)[None, :]  # [1, k]
    stats = RoundStats(
        rounds=s.rounds + 1,
        row_rounds=s.row_rounds + act,
        drafted=s.drafted + act * state.k_now,
        accepted=s.accepted + act * n,
        reached=s.reached + jnp.sum(act[:, None] * (positions <= n[:, None]) * (positions < state.k_now), axis=0),
        accepted_at=s.accepted_at + jnp.sum(act[:, None] * (positions < n[:, None]), axis=0),
        catch_ups=s.catch_ups + needs.astype(jnp.int32),
    )

  return DecodeState(
      target_cache=target_cache,
      draft_cache=draft_cache,
      last=jnp.where(active, token, state.last),
      prev=jnp.where(active, before_token, state.prev),
      draft_stale=jnp.where(active, n == state.k_now, state.draft_stale),
      out=out,
      history=history,
      n_out=n_out,
      done=done,
      k_now=_next_k(state.k_now, n, active, k) if dynamic else state.k_now,
      key=key,
      stats=stats,
  )


def _next_k(k_now: jax.Array, n: jax.Array, active: jax.Array, k: int) -> jax.Array:
  """Hugging Face's schedule: +2 after a round where every generating row accepted all, else -1."""
  all_accepted = jnp.all(jnp.where(active, n == k_now, True))
  return jnp.clip(jnp.where(all_accepted, k_now + 2, k_now - 1), 1, k).astype(jnp.int32)


def _generate_tokens(target_def, target_state, draft_def, draft_state, prompts: jax.Array,
                    prompt_lens: jax.Array, key: jax.Array, eos_id: jax.Array, *, k: int, max_new: int,
                    sampling: SamplingConfig, dynamic: bool = False,
                    ngram: tuple[int, int] | None = None) -> tuple[jax.Array, jax.Array, RoundStats]:
  """The whole run, prefill and all rounds, as one jitted program.

  Args:
    target_def, target_state: the target model split by ``nnx.split``.
    draft_def, draft_state: the draft model likewise, or ``None`` when ``k == 0`` or with ``ngram``.
    prompts: ``[B, P] int32`` right-padded prompts (P a bucket length); prompt_lens: ``[B] int32 >= 1``.
    key: PRNG key. eos_id: ``[] int32``, -1 for none.
    k: static speculation length (0 = target only). max_new: static tokens to generate per row.
    sampling: static warp applied to target and draft alike.
    dynamic: static; adapt the proposals per round within ``[1, k]`` (see ``SpecConfig.schedule``).
    ngram: static ``(n_min, n_max)``: propose by n-gram lookup in each row's context
      (:func:`specjax.ngram.ngram_propose`) instead of with the draft model; None: the draft proposes.

  Returns:
    tokens ``[B, max_new] int32`` (-1 past each row's length), lengths ``[B] int32``, and the statistics.
  """
  TRACE_COUNTS["generate_tokens"] += 1
  batch, padded = prompts.shape
  max_len = padded + max_new + k  # the last window of a row ends at prompt + max_new + k - 2
  target_fn = functools.partial(forward, target_def, target_state)
  use_draft = k > 0 and ngram is None
  draft_fn = functools.partial(forward, draft_def, draft_state) if use_draft else None

  rows = jnp.arange(batch)
  last = prompts[rows, prompt_lens - 1]
  prev = prompts[rows, jnp.maximum(prompt_lens - 2, 0)]

  def prefill(model_def, model_state):
    # Writes the whole padded prompt; positions past prompt_lens - 1 are rolled back at once.
    model = nnx.merge(model_def, model_state)
    _, _, cache = model(prompts, model.init_cache(batch, max_len))
    return cache.with_lengths(prompt_lens - 1)

  with jax.named_scope("prefill"):
    target_cache = prefill(target_def, target_state)
    draft_cache = prefill(draft_def, draft_state) if use_draft else None

  history = None
  if k > 0 and ngram is not None:
    # Room for the last window written by a row: it starts below P + max_new and holds k + 1 tokens.
    history = jnp.zeros((batch, padded + max_new + k + 1), jnp.int32).at[:, :padded].set(prompts)

  state = DecodeState(
      target_cache=target_cache, draft_cache=draft_cache, last=last, prev=prev,
      draft_stale=jnp.zeros((batch,), bool), out=jnp.zeros((batch, max_new + k + 1), jnp.int32), history=history,
      n_out=jnp.zeros((batch,), jnp.int32), done=jnp.zeros((batch,), bool), k_now=jnp.int32(k), key=key,
      stats=RoundStats.zeros(batch, k))
  body = functools.partial(_round, target_fn=target_fn, draft_fn=draft_fn, k=k, max_new=max_new,
                           sampling=sampling, eos_id=eos_id, dynamic=dynamic, ngram=ngram)
  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  valid = jnp.arange(max_new)[None, :] < state.n_out[:, None]
  return jnp.where(valid, state.out[:, :max_new], -1), state.n_out, state.stats


generate_tokens = jax.jit(
    _generate_tokens, static_argnames=("target_def", "draft_def", "k", "max_new", "sampling", "dynamic", "ngram"))
generate_tokens.__doc__ = _generate_tokens.__doc__

# (id(target_def), id(draft_def), k, max_new, sampling, dynamic, ngram) -> (jitted program, its graphdefs)
_PROGRAMS: dict[tuple, tuple] = {}


def _program(target_def, draft_def, k: int, max_new: int, sampling: SamplingConfig, dynamic: bool,
             ngram: tuple[int, int] | None):
  """:func:`generate_tokens` with its static arguments bound, kept per graphdef object: a jitted call would
  otherwise hash and compare both graphdefs (a walk over every node) on every call."""
  key = (id(target_def), id(draft_def), k, max_new, sampling, dynamic, ngram)
  entry = _PROGRAMS.get(key)
  if entry is None:
    def run(target_state, draft_state, prompts, prompt_lens, rng, eos_id):
      return _generate_tokens(target_def, target_state, draft_def, draft_state, prompts, prompt_lens, rng,
                              eos_id, k=k, max_new=max_new, sampling=sampling, dynamic=dynamic, ngram=ngram)
    entry = _PROGRAMS[key] = (jax.jit(run), target_def, draft_def)
  return entry[0]


# ------------------------------------------------------------------------------------ the API

# id(model) -> (weak reference, graphdef, state, its variables, their arrays): see split_model.
_SPLITS: dict[int, tuple] = {}


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
  """``nnx.split(model)``, kept per model for as long as every variable still holds the same array.

  Walking the module graph costs about a millisecond of Python per call for a small model, as much as
  decoding a token; ``generate`` therefore splits each model once. Updating weights in place (assigning a
  variable's value, ``nnx.update``, an optimizer step) replaces arrays and is noticed by an identity check of
  each variable's array (microseconds). Replacing a whole submodule is not noticed: call
  :func:`forget_model` after doing that.
  """
  entry = _SPLITS.get(id(model))
  if entry is not None:
    ref, graphdef, state, variables, arrays = entry
    if ref() is model and all(v.get_raw_value() is a for v, a in zip(variables, arrays)):
      return graphdef, state
  graphdef, state = nnx.split(model)
  if entry is not None and entry[0]() is model and entry[1] == graphdef:
    graphdef = entry[1]  # same structure, new weights: keep the object, and with it the compiled programs
  variables = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]
  key = id(model)
  ref = weakref.ref(model, lambda _: _SPLITS.pop(key, None))
  _SPLITS[key] = (ref, graphdef, state, variables, [v.get_raw_value() for v in variables])
  return graphdef, state


def forget_model(model: nnx.Module) -> None:
  """Drops the split that :func:`split_model` keeps for ``model`` (after replacing a submodule)."""
  _SPLITS.pop(id(model), None)



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


# (target, proposer, sampling, batch, k_max, prompt bucket, length bucket, backend) -> chosen k, filled by
# k="auto". Models are keyed by identity and config: calibrate again (clear this and
# ``costmodel.COST_TABLES``) after changing a model's weights in place.
AUTO_K: dict[tuple, int] = {}
# k="auto" speculates only where the predicted speedup exceeds 1 + AUTO_MARGIN + the calibration's own
# spread: a wrong "yes" costs more than a wrong "no".
AUTO_MARGIN = 0.02


def resolve_auto_k(target, draft, spec: SpecConfig, sampling: SamplingConfig, rows: list[list[int]],
                   seed: int, max_new_tokens: int = 64) -> int:
  """The k that ``k="auto"`` runs for this batch, decided once per (models, sampling, batch size, prompt
  bucket, power-of-two bucket of ``max_new_tokens``, backend).

  It measures a :class:`~specjax.costmodel.CostTable` for this batch size and prompt bucket, the draft's
  per-position acceptance from a pilot run at ``k_max`` on these prompts, and picks the k with the highest
  predicted speedup for a whole call (prefill and the slowest row included), 0 (target only) when none
  beats the baseline by more than ``AUTO_MARGIN`` plus the calibration's spread. The n-gram proposer is
  costed as a free proposer (``proposer=None``): its lookup is a few comparisons per context token, next
  to which a model step is large.
  """
  from specjax import costmodel

  if spec.method == "ngram":
    draft = None
    proposer = ("ngram", spec.ngram_min, spec.ngram_max)
  else:
    proposer = (id(draft), draft.cfg)
  prompt_len = bucket_length(max(map(len, rows)))
  n_tokens = bucket_length(max_new_tokens)
  key = (id(target), target.cfg, proposer, sampling, len(rows), spec.k_max, prompt_len, n_tokens,
         jax.default_backend())
  if key not in AUTO_K:
    room = target.cfg.max_seq_len - max(map(len, rows))
    k_max = max(1, min(spec.k_max, room - 1))
    # The pilot's length is fixed (not this call's max_new_tokens): acceptance needs a few rounds to show.
    pilot = generate(target, rows, draft=draft, spec=dataclasses.replace(spec, k=k_max), sampling=sampling,
                     max_new_tokens=max(1, min(8 * (k_max + 1), room)), seed=seed)
    ngram = (spec.ngram_min, spec.ngram_max) if spec.method == "ngram" else None
    table = costmodel.cost_table(target, draft, len(rows), k_max, sampling, prompt_len, n_tokens, ngram=ngram)
    AUTO_K[key] = costmodel.choose_k(table, pilot.stats.acceptance_by_position, k_max,
                                     margin=AUTO_MARGIN + table.spread, n_tokens=n_tokens)
  return AUTO_K[key]


def generate(target: nnx.Module, prompts, *, draft: nnx.Module | None = None,
             spec: SpecConfig | None = None, sampling: SamplingConfig = GREEDY,
             max_new_tokens: int = 64, seed: int = 0, tokenizer=None,
             eos_id: int | None = None) -> GenerateOutput:
  """Generates up to ``max_new_tokens`` per prompt with speculative decoding, in one jitted loop.

  Args:
    target: the model whose distribution the output follows.
    prompts: text (with ``tokenizer``), a list of texts, a list of token-id lists of any lengths, or a
      ``[B, P]`` array. Rows are padded on the right to a bucket length; no left padding.
    draft: the draft model (same vocabulary) for method ``"draft"``; methods ``"none"`` and ``"ngram"``
      use no draft and ignore it.
    spec: method and speculation length; defaults to ``draft, k=4`` with a draft, ``none`` without.
      Method ``"ngram"`` proposes by lookup in each row's own prompt and output (``spec.ngram_max`` down
      to ``spec.ngram_min`` tokens) and needs no draft; the output law is the same for every method.
    sampling: temperature / top-k / top-p, shared by target and draft. Default greedy.
    max_new_tokens: tokens to generate per row (exact unless the row emits EOS).
    seed: PRNG seed; the same seed and inputs give the same output.
    tokenizer: encodes text prompts and decodes the output; provides the default ``eos_id``.
    eos_id: the token that ends a row (included in its output). None: rows never end early.

  Returns:
    :class:`GenerateOutput`.

  Raises:
    ValueError: naming the offending field and its allowed values.
  """
  if spec is None:
    spec = SpecConfig("draft", 4) if draft is not None else SpecConfig("none", 0)
  if not isinstance(spec, SpecConfig):
    raise ValueError(f"spec must be a SpecConfig, got {type(spec).__name__}")
  if not isinstance(sampling, SamplingConfig):
    raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
  tcfg = _model_config(target, "target")
  if spec.method == "draft":
    if draft is None:
      raise ValueError("method 'draft' needs a draft model: pass draft=")
    dcfg = _model_config(draft, "draft")
    if dcfg.vocab_size != tcfg.vocab_size:
      raise ValueError(f"draft vocab_size ({dcfg.vocab_size}) must equal the target's ({tcfg.vocab_size})")
  if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise ValueError(f"seed must be an integer, got {seed!r}")
  if eos_id is None and tokenizer is not None:
    eos_id = getattr(tokenizer, "eos_id", None)
  if eos_id is not None and not 0 <= eos_id < tcfg.vocab_size:
    raise ValueError(f"eos_id must be in [0, {tcfg.vocab_size}), got {eos_id}")

  rows = _as_token_rows(prompts, tokenizer)
  padded, lens = prepare_prompts(rows, tcfg.vocab_size)
  longest = int(lens.max())
  limits = [("target", tcfg)] + ([("draft", dcfg)] if spec.method == "draft" else [])
  for role, cfg in limits:
    if longest + max_new_tokens > cfg.max_seq_len:
      raise ValueError(
          f"prompt length ({longest}) + max_new_tokens ({max_new_tokens}) = {longest + max_new_tokens} "
          f"exceeds the {role}'s cache length max_seq_len={cfg.max_seq_len}")

  k = resolve_auto_k(target, draft, spec, sampling, rows, seed, max_new_tokens) if spec.auto else spec.window
  target_def, target_state = split_model(target)
  draft_def, draft_state = split_model(draft) if k > 0 and spec.method == "draft" else (None, None)
  ngram = (spec.ngram_min, spec.ngram_max) if spec.method == "ngram" and k > 0 else None
  program = _program(target_def, draft_def, k, max_new_tokens, sampling, spec.schedule == "dynamic" and k > 0,
                     ngram)
  tokens, lengths, stats = program(target_state, draft_state, padded, lens, jax.random.key(seed),
                                   np.int32(-1 if eos_id is None else eos_id))
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  text = None
  if tokenizer is not None:
    text = [tokenizer.decode(row[:n].tolist()) for row, n in zip(tokens, lengths)]
  return GenerateOutput(tokens=tokens, lengths=lengths, text=text,
                        stats=_summarise(jax.device_get(stats), lengths, k))
