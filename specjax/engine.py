"""The pure decoding engine: the loop state, one speculative round, the prefill and the jitted loop.

One round, for every row of the batch at once (shapes never depend on acceptance):

1. propose: the proposer (:mod:`specjax.proposers`) guesses ``d[B, k]`` with the distributions
   ``q[B, k, V]`` they were drawn from;
2. verify: one target pass over the window ``[last, d_1..d_k]`` gives ``p[B, k+1, V]`` and the target's
   features of the window;
3. accept: :func:`specjax.acceptance.accept` keeps ``n[B]`` proposals and draws one more token;
4. emit: rows append ``d_1..d_n, token`` (cut at EOS and at ``max_new_tokens``);
5. commit: the target cache advances by ``n + 1`` per row (rejected positions are simply not counted) and
   the proposer updates its own state from the verified window.

The baseline is the same loop with ``k = 0`` and no proposer: the window is ``[last]`` and step 3 draws the
"bonus" token from ``p_1``, so baseline and speculation share every line of sampling code. Nothing here
touches the host: :mod:`specjax.decode` holds ``generate`` and its program caches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.acceptance import accept
from specjax.cache import KVCache
from specjax.config import SamplingConfig
from specjax.proposers.base import Context, Features, Proposer, Verified
from specjax.sampling import split_keys, warp


def forward(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, cache: KVCache):
  """The pure forward contract ``(tokens[B, T], cache) -> (logits[B, T, V], hidden[B, T, D], cache)``."""
  return nnx.merge(graphdef, state)(tokens, cache)


def target_pass(target, tokens: jax.Array, cache: KVCache, aux_layers: tuple[int, ...] = ()
                ) -> tuple[jax.Array, Features, KVCache]:
  """One target pass over ``tokens [B, T]``: logits ``[B, T, V]``, the :class:`Features` a proposer reads
  (the residual streams entering ``aux_layers`` only when asked: plain targets need no ``forward_features``),
  and the cache advanced by ``T``."""
  if aux_layers:
    logits, hidden, aux, cache = target.forward_features(tokens, cache, aux_layers)
  else:
    logits, hidden, cache = target(tokens, cache)
    aux = None
  return logits, Features(hidden=hidden, aux=aux), cache


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
  catch_ups: jax.Array  # [] proposer passes besides the proposals (the draft model's catch-up steps)

  @classmethod
  def zeros(cls, batch: int, k: int) -> RoundStats:
    return cls(rounds=jnp.zeros((), jnp.int32), row_rounds=jnp.zeros((batch,), jnp.int32),
               drafted=jnp.zeros((batch,), jnp.int32), accepted=jnp.zeros((batch,), jnp.int32),
               reached=jnp.zeros((k,), jnp.int32), accepted_at=jnp.zeros((k,), jnp.int32),
               catch_ups=jnp.zeros((), jnp.int32))

  def update(self, active: jax.Array, n: jax.Array, num_drafts: jax.Array, extra_steps: jax.Array) -> RoundStats:
    """The counters after one round: ``active [B]`` rows, ``n [B]`` accepted of ``num_drafts`` each."""
    act = active.astype(jnp.int32)
    positions = jnp.arange(self.reached.shape[0])[None, :]  # [1, k]
    return RoundStats(
        rounds=self.rounds + 1,
        row_rounds=self.row_rounds + act,
        drafted=self.drafted + act * num_drafts,
        accepted=self.accepted + act * n,
        reached=self.reached + jnp.sum(act[:, None] * (positions <= n[:, None]) * (positions < num_drafts), axis=0),
        accepted_at=self.accepted_at + jnp.sum(act[:, None] * (positions < n[:, None]), axis=0),
        catch_ups=self.catch_ups + extra_steps,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything the generation loop carries from one round to the next.

  Invariant at the start of a round: the target cache holds each row's context up to but excluding
  ``last`` (``lengths = context - 1``); the proposer's state is whatever its ``commit`` made of the last
  round (None for the baseline).
  """

  target_cache: KVCache
  proposer: Any
  last: jax.Array  # [B] newest token, in no cache yet
  out: jax.Array | None  # [B, max_new + k + 1] emitted tokens (valid up to n_out); None: not kept
  n_out: jax.Array  # [B]
  done: jax.Array  # [B] bool
  k_now: jax.Array  # [] proposals per round under a dynamic schedule (static schedule: k)
  key: jax.Array
  stats: RoundStats


def cache_length(prompt_bucket: int, max_new: int, k: int) -> int:
  """The cache length a run needs: the last window of a row ends at ``prompt + max_new + k - 2``."""
  return prompt_bucket + max_new + k


def prefill(target, proposer: Proposer | None, prompts: jax.Array, prompt_lens: jax.Array, max_len: int
            ) -> tuple[KVCache, Any]:
  """The target's pass over the padded prompts ``[B, P]`` (rolled back to ``prompt_lens - 1``, so that the
  last prompt token is the first round's ``last``) and the proposer's initial state."""
  batch = prompts.shape[0]
  aux_layers = proposer.aux_layers if proposer is not None else ()
  with jax.named_scope("prefill"):
    _, features, cache = target_pass(target, prompts, target.init_cache(batch, max_len), aux_layers)
    cache = cache.with_lengths(prompt_lens - 1)
    pstate = None if proposer is None else proposer.init(target, prompts, prompt_lens, features, max_len)
  return cache, pstate


def init_state(target, proposer: Proposer | None, prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array,
               *, k: int, max_new: int, max_len: int | None = None) -> DecodeState:
  """The loop state before the first round: prefill done, nothing emitted. Used by the loop and by the
  cost model's calibration alike.

  Args:
    target: the target model (inside the trace). proposer: bound proposer, or None (k must then be 0).
    prompts: ``[B, P] int32`` right-padded; prompt_lens: ``[B] int32 >= 1``. key: PRNG key.
    k: static proposals per round. max_new: static tokens to generate per row.
    max_len: static cache length (default :func:`cache_length` of ``P``).
  """
  batch, padded = prompts.shape
  max_len = cache_length(padded, max_new, k) if max_len is None else max_len
  target_cache, pstate = prefill(target, proposer if k > 0 else None, prompts, prompt_lens, max_len)
  last = prompts[jnp.arange(batch), prompt_lens - 1]
  return DecodeState(
      target_cache=target_cache, proposer=pstate, last=last,
      out=jnp.zeros((batch, max_new + k + 1), jnp.int32), n_out=jnp.zeros((batch,), jnp.int32),
      done=jnp.zeros((batch,), bool), k_now=jnp.int32(k), key=key, stats=RoundStats.zeros(batch, k))


# ---------------------------------------------------------------------------------- the round


def verify(target, cache: KVCache, last: jax.Array, drafts: jax.Array, sampling: SamplingConfig,
           aux_layers: tuple[int, ...] = ()) -> tuple[jax.Array, Features, KVCache]:
  """Scores ``[last, d_1..d_k]`` in one target pass.

  Returns ``p [B, k+1, V]`` (warped), the target's :class:`Features` at the ``k + 1`` positions, and the
  cache advanced by ``k + 1``.
  """
  window = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, k+1]
  logits, features, cache = target_pass(target, window, cache, aux_layers)
  return warp(logits, sampling), features, cache


def _emit(state: DecodeState, drafts: jax.Array, n: jax.Array, token: jax.Array, max_new, eos_ids: jax.Array
          ) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array, jax.Array]:
  """Appends ``d_1..d_n, token`` to each active row's output, cut at a stop token and at ``max_new``.

  ``max_new``: an int, or ``[B]`` per row; ``eos_ids``: ``[E]`` for every row, or ``[B, E]`` per row.

  Returns ``emitted [B, k+1]`` (``d_1..d_n, token``, then the rejected proposals), ``count [B]`` (how many
  of them the row keeps), the new ``out`` (None when the state keeps none), ``n_out`` and ``done [B]``.
  """
  k = drafts.shape[1]
  slots = jnp.arange(k + 1)[None, :]  # [1, k+1]
  emitted = jnp.where(slots == n[:, None], token[:, None], jnp.concatenate([drafts, token[:, None]], axis=1))
  count = jnp.minimum(n + 1, max_new - state.n_out)  # max_new_tokens is exact per row
  eos = eos_ids if eos_ids.ndim == 2 else eos_ids[None, :]  # [B or 1, E]
  is_eos = jnp.any(emitted[..., None] == eos[:, None, :], axis=-1) & (slots < count[:, None])  # any stop token
  hit_eos = jnp.any(is_eos, axis=1)
  count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, count)  # EOS ends the row there
  count = jnp.where(state.done, 0, count)
  out = None
  if state.out is not None:
    out = jax.vmap(lambda o, e, i: jax.lax.dynamic_update_slice(o, e, (i,)))(state.out, emitted, state.n_out)
  n_out = state.n_out + count
  return emitted, count, out, n_out, state.done | hit_eos | (n_out >= max_new)


def _next_k(k_now: jax.Array, n: jax.Array, active: jax.Array, k: int) -> jax.Array:
  """Hugging Face's schedule: +2 after a round where every generating row accepted all, else -1."""
  all_accepted = jnp.all(jnp.where(active, n == k_now, True))
  return jnp.clip(jnp.where(all_accepted, k_now + 2, k_now - 1), 1, k).astype(jnp.int32)


def round_step(state: DecodeState, *, target, proposer: Proposer | None, k: int, max_new,
               sampling, eos_ids: jax.Array, dynamic: bool = False, outputs: bool = False):
  """One speculative round (the loop body of :func:`generate_tokens`; see the module docstring).

  Args:
    state: the loop state (``out`` may be None: the caller takes each round's tokens from the outputs).
    target: the target model. proposer: the bound proposer, or None (then k must be 0). With k == 0 and
      a proposer (a server's plain-decoding rounds) the proposer proposes nothing but its ``commit`` still
      follows the round, so that its state keeps up with the context.
    k: static proposals per round (0: the baseline).
    max_new: tokens per row: a static int, or ``[B] int32`` per row (a server's requests).
    sampling: a static :class:`SamplingConfig` for every row, or per-row
      :class:`specjax.sampling.RowSampling`; the state's key is one key or one per row.
    eos_ids: ``[E] int32`` stop tokens for every row, or ``[B, E]`` per row (-1: none).
    dynamic: static; ``state.k_now`` proposals of the k are used (the rest are masked).
    outputs: static; also return the round's ``emitted [B, k+1]`` tokens and ``count [B]`` (how many of
      them each row kept).

  Returns the state after the round (and, with ``outputs``, ``(state, emitted, count)``). Invariant: every
  row's emitted tokens follow the target's warped distribution exactly (greedy: they equal target-only
  greedy decoding), whatever the other rows do.
  """
  key, propose_key, accept_key = split_keys(state.key, 3)
  active = ~state.done  # [B]
  batch = state.last.shape[0]
  aux_layers = proposer.aux_layers if proposer is not None else ()

  with jax.named_scope("propose"):
    if k > 0:
      ctx = Context(last=state.last, lengths=state.target_cache.lengths, active=active)
      drafts, q, pstate, extra = proposer.propose(state.proposer, target, ctx, propose_key, k, sampling,
                                                  state.k_now if dynamic else None)
      if dynamic:  # proposals past k_now are not proposals: q = 0 there, so the bonus comes from p_{k_now+1}
        used = (jnp.arange(k) < state.k_now)[None, :]
        drafts, q = jnp.where(used, drafts, 0), q * used[..., None]
    else:
      drafts, pstate, extra = jnp.zeros((batch, 0), jnp.int32), state.proposer, jnp.zeros((), jnp.int32)

  with jax.named_scope("verify"):
    p, features, target_cache = verify(target, state.target_cache, state.last, drafts, sampling, aux_layers)

  with jax.named_scope("accept"):
    if k == 0:
      q = jnp.zeros((batch, 0, p.shape[-1]), p.dtype)
    num_drafts = jnp.full((batch,), state.k_now) if dynamic else None
    n, token = accept(p, q, drafts, accept_key, num_drafts, greedy=sampling.greedy)  # [B], [B]

  with jax.named_scope("emit"):
    emitted, count, out, n_out, done = _emit(state, drafts, n, token, max_new, eos_ids)
    lengths = state.target_cache.lengths
    new_lengths = lengths + jnp.where(active, n + 1, 0)  # everything past that is rolled back

  with jax.named_scope("commit"):
    if proposer is not None:
      verified = Verified(window=jnp.concatenate([state.last[:, None], drafts], axis=1), emitted=emitted, n=n,
                          num_drafts=state.k_now, active=active, lengths=lengths, new_lengths=new_lengths,
                          features=features)
      pstate = proposer.commit(pstate, target, verified)

  new_state = DecodeState(
      target_cache=target_cache.with_lengths(new_lengths),
      proposer=pstate,
      last=jnp.where(active, token, state.last),
      out=out,
      n_out=n_out,
      done=done,
      k_now=_next_k(state.k_now, n, active, k) if dynamic else state.k_now,
      key=key,
      stats=state.stats.update(active, n, state.k_now, extra),
  )
  return (new_state, emitted, count) if outputs else new_state


def generate_tokens(target_def, target_state, proposer: Proposer | None, proposer_defs: tuple,
                    proposer_states: tuple, prompts: jax.Array, prompt_lens: jax.Array, key: jax.Array,
                    eos_ids: jax.Array, *, k: int, max_new: int, sampling: SamplingConfig,
                    dynamic: bool = False) -> tuple[jax.Array, jax.Array, RoundStats]:
  """The whole run, prefill and all rounds, as one program (jit it with the static arguments bound).

  Args:
    target_def, target_state: the target model split by ``nnx.split``.
    proposer: the proposer's template (:meth:`Proposer.split`), None for the baseline;
      proposer_defs, proposer_states: its modules' graphdefs (static) and states.
    prompts: ``[B, P] int32`` right-padded prompts (P a bucket length); prompt_lens: ``[B] int32 >= 1``.
    key: PRNG key. eos_ids: ``[E] int32`` tokens that end a row (padded with -1).
    k: static speculation length (0 = target only). max_new: static tokens to generate per row.
    sampling: static warp applied to target and proposer alike.
    dynamic: static; adapt the proposals per round within ``[1, k]`` (see ``SpecConfig.schedule``).

  Returns:
    tokens ``[B, max_new] int32`` (-1 past each row's length), lengths ``[B] int32``, and the statistics.
  """
  use = proposer is not None and k > 0

  def models():
    # Merged inside each traced function (not closed over across the loop boundary).
    bound = proposer.bind(proposer_defs, proposer_states) if use else None
    return nnx.merge(target_def, target_state), bound

  target, bound = models()
  state = init_state(target, bound, prompts, prompt_lens, key, k=k, max_new=max_new)

  def body(state):
    target, bound = models()
    return round_step(state, target=target, proposer=bound, k=k, max_new=max_new, sampling=sampling,
                      eos_ids=eos_ids, dynamic=dynamic)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  valid = jnp.arange(max_new)[None, :] < state.n_out[:, None]
  return jnp.where(valid, state.out[:, :max_new], -1), state.n_out, state.stats
