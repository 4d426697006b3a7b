"""The pure decoding engine: the loop state, one speculative round, the prefill and the jitted loop.

One round, for every row of the batch at once (shapes never depend on acceptance):

1. propose: the proposer (:mod:`specjax.proposers`) guesses ``d[B, k]`` with the distributions
   ``q[B, k, V]`` they were drawn from;
2. verify: one target pass over the window ``[last, d_1..d_k]`` gives ``p[B, k+1, V]`` and the target's
   features of the window;
3. accept: :func:`specjax.acceptance.accept` keeps ``n[B]`` proposals and draws one more token;
4. emit: rows append ``d_1..d_n, token`` (cut at a stop token and at the row's ``max_new``), with the
   target's log-probabilities when asked, and count them for the logit adjustments;
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
from specjax.config import MAX_K
from specjax.cache import KVCache
from specjax.numerics import per_position, row_invariant
from specjax.proposers.base import Context, Features, Proposer, Verified
from specjax.sampling import Counts, Mode, RowSettings, Sampler, split_keys
from specjax import tree as trees
from specjax.tree import MAX_RANKS


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
  ranks: jax.Array  # [k, MAX_RANKS] accepted proposals by depth and rank among their siblings (a chain's: rank 0)
  offered: jax.Array  # [k, MAX_RANKS] active row-rounds whose walk reached depth i with a child of rank r there

  @classmethod
  def zeros(cls, batch: int, k: int) -> RoundStats:
    return cls(rounds=jnp.zeros((), jnp.int32), row_rounds=jnp.zeros((batch,), jnp.int32),
               drafted=jnp.zeros((batch,), jnp.int32), accepted=jnp.zeros((batch,), jnp.int32),
               reached=jnp.zeros((k,), jnp.int32), accepted_at=jnp.zeros((k,), jnp.int32),
               catch_ups=jnp.zeros((), jnp.int32), ranks=jnp.zeros((k, MAX_RANKS), jnp.int32),
               offered=jnp.zeros((k, MAX_RANKS), jnp.int32))

  def update(self, active: jax.Array, n: jax.Array, num_drafts: jax.Array, extra_steps: jax.Array,
             drafted: jax.Array | None = None, accepted_ranks: jax.Array | None = None,
             offered_ranks: jax.Array | None = None) -> RoundStats:
    """The counters after one round: ``active [B]`` rows, ``n [B]`` accepted of ``num_drafts`` each. A
    tree (its depth in ``num_drafts``) also gives ``drafted [B]`` (its nodes), ``accepted_ranks [B, D]`` (the
    accepted nodes' sibling ranks, -1 past ``n``) and ``offered_ranks [B, D, MAX_RANKS]`` (whether the node
    the walk reached at depth i had a child of rank r: what the rank-r acceptance is measured against);
    a chain's proposals are all rank 0."""
    act = active.astype(jnp.int32)
    k = self.reached.shape[0]
    positions = jnp.arange(k)[None, :]  # [1, k]
    num_drafts = jnp.asarray(num_drafts)  # [] or [B] (a proposer's per-row limit)
    per_row = num_drafts[:, None] if num_drafts.ndim else num_drafts
    reached = act[:, None] * (positions <= n[:, None]) * (positions < per_row)  # [B, k]
    if accepted_ranks is None:
      accepted_ranks = jnp.where(positions < n[:, None], 0, -1)
      offered_ranks = (reached[..., None] > 0) & (jnp.arange(MAX_RANKS) == 0)
    pad = k - accepted_ranks.shape[1]  # a tree shallower than the statistics' k
    accepted_ranks = jnp.pad(accepted_ranks, ((0, 0), (0, pad)), constant_values=-1)
    offered_ranks = jnp.pad(offered_ranks, ((0, 0), (0, pad), (0, 0)))
    hist = jax.nn.one_hot(jnp.minimum(accepted_ranks, MAX_RANKS - 1), MAX_RANKS, dtype=jnp.int32)  # -1: zeros
    return RoundStats(
        rounds=self.rounds + 1,
        row_rounds=self.row_rounds + act,
        drafted=self.drafted + act * (num_drafts if drafted is None else drafted),
        accepted=self.accepted + act * n,
        reached=self.reached + jnp.sum(reached, axis=0),
        accepted_at=self.accepted_at + jnp.sum(act[:, None] * (positions < n[:, None]), axis=0),
        catch_ups=self.catch_ups + extra_steps,
        ranks=self.ranks + jnp.sum(act[:, None, None] * hist, axis=0),
        offered=self.offered + jnp.sum(act[:, None, None] * offered_ranks.astype(jnp.int32), axis=0),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tokens:
  """Emitted tokens with what is known of each, ``[B, L]`` (a round's ``L = k + 1``; a run's output buffer).

  Attributes:
    ids: ``int32`` the tokens.
    proposed: ``bool`` the token was a proposal the target accepted (False: the target's own draw).
    logprobs: ``float32`` the target's log-probability of the token under its own distribution before any
      warping (log-softmax of its logits); None when not asked for.
    top_ids, top_logprobs: ``[B, L, N]`` the N most likely tokens there and their log-probabilities; None
      unless asked for N >= 1 alternatives.
  """

  ids: jax.Array
  proposed: jax.Array
  logprobs: jax.Array | None = None
  top_ids: jax.Array | None = None
  top_logprobs: jax.Array | None = None

  @classmethod
  def zeros(cls, batch: int, length: int, logprobs: int | None) -> Tokens:
    with_lp = logprobs is not None
    top = (batch, length, logprobs) if with_lp and logprobs > 0 else None
    return cls(ids=jnp.zeros((batch, length), jnp.int32), proposed=jnp.zeros((batch, length), bool),
               logprobs=jnp.zeros((batch, length), jnp.float32) if with_lp else None,
               top_ids=None if top is None else jnp.zeros(top, jnp.int32),
               top_logprobs=None if top is None else jnp.zeros(top, jnp.float32))

  def write(self, new: Tokens, at: jax.Array) -> Tokens:
    """Row b's ``new`` entries written at ``at[b]`` (every field alike)."""
    put = lambda o, e: jax.vmap(lambda o, e, i: jax.lax.dynamic_update_slice_in_dim(o, e, i, axis=0))(o, e, at)
    return jax.tree.map(put, self, new)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything the generation loop carries from one round to the next; every field but ``k_now`` and
  ``stats``' scalars is batch-major, so rows can be written and taken (:func:`put_rows`, :func:`take_rows`).

  Invariant at the start of a round: the target cache holds each row's context up to but excluding
  ``last`` (``lengths = context - 1``); the proposer's state is whatever its ``commit`` made of the last
  round (None for the baseline); ``counts`` (modes that adjust logits) count each row's emitted tokens.
  """

  target_cache: KVCache
  proposer: Any
  last: jax.Array  # [B] newest token, in no cache yet
  out: Tokens | None  # [B, max_new + k + 1] emitted tokens (valid up to n_out); None: not kept (a server)
  n_out: jax.Array  # [B]
  done: jax.Array  # [B] bool
  k_now: jax.Array  # [] proposals per round under a dynamic schedule (static schedule: k)
  keys: jax.Array  # [B] each row's PRNG key
  settings: RowSettings  # [B] each row's sampling, max new tokens and stop ids
  counts: Counts | None  # [B, V] what logit adjustments read; None in modes without them
  stats: RoundStats


def cache_length(prompt_bucket: int, max_new: int) -> int:
  """The cache length of a run: the last window of a row ends at ``prompt + max_new + k - 2`` for any
  ``k <= MAX_K``. It does not depend on ``k``, so that a baseline and a speculative run attend over caches of
  one length (reductions over the cache round alike)."""
  return prompt_bucket + max_new + MAX_K


def prefill(target, proposer: Proposer | None, prompts: jax.Array, prompt_lens: jax.Array, max_len: int,
            prefilled: tuple[KVCache, Features] | None = None) -> tuple[KVCache, Any]:
  """The target's pass over the padded prompts ``[B, P]`` (rolled back to ``prompt_lens - 1``, so that the
  last prompt token is the first round's ``last``) and the proposer's initial state. ``prefilled``: that
  pass already made (in chunks, by a server): its cache and its features ``[B, P, ..]``."""
  batch = prompts.shape[0]
  aux_layers = proposer.aux_layers if proposer is not None else ()
  with jax.named_scope("prefill"):
    if prefilled is None:
      _, features, cache = target_pass(target, prompts, target.init_cache(batch, max_len), aux_layers)
    else:
      cache, features = prefilled
    cache = cache.with_lengths(prompt_lens - 1)
    pstate = None if proposer is None else proposer.init(target, prompts, prompt_lens, features, max_len)
  return cache, pstate


def init_state(target, proposer: Proposer | None, prompts: jax.Array, prompt_lens: jax.Array, keys: jax.Array,
               settings: RowSettings, *, k: int, mode: Mode, max_len: int, out_len: int | None,
               logprobs: int | None = None, prefilled: tuple[KVCache, Features] | None = None) -> DecodeState:
  """The loop state before the first round: prefill done, nothing emitted. Used by the loop, the server's
  prefill and the cost model's calibration alike.

  Args:
    target: the target model (inside the trace). proposer: bound proposer, or None (k must then be 0).
    prompts: ``[B, P] int32`` right-padded; prompt_lens: ``[B] int32 >= 1``. keys: ``[B]`` row keys.
    settings: the rows' :class:`RowSettings`. k: static proposals per round (sizes the statistics).
    mode: static :class:`Mode` (whether counts are kept). max_len: static cache length.
    out_len: static length of the output buffer (:func:`output_length`), or None to keep none.
    logprobs: static; None: no log-probabilities; N >= 0: each token's and N alternatives.
    prefilled: the target's pass over ``prompts`` already made (see :func:`prefill`), or None.
  """
  batch = prompts.shape[0]
  target_cache, pstate = prefill(target, proposer if k > 0 else None, prompts, prompt_lens, max_len, prefilled)
  return DecodeState(
      target_cache=target_cache, proposer=pstate, last=prompts[jnp.arange(batch), prompt_lens - 1],
      out=None if out_len is None else Tokens.zeros(batch, out_len, logprobs),
      n_out=jnp.zeros((batch,), jnp.int32), done=jnp.zeros((batch,), bool), k_now=jnp.int32(k), keys=keys,
      settings=settings,
      counts=Counts.of(prompts, prompt_lens, target.cfg.vocab_size) if mode.adjusts else None,
      stats=RoundStats.zeros(batch, k))


def output_length(max_new: int, k: int) -> int:
  """The output buffer a run needs: a row's last round may write ``k + 1`` tokens from ``max_new - 1``."""
  return max_new + k + 1


# ------------------------------------------------------------------------------------ row operations


def _batch_fields(state: DecodeState) -> dict[str, Any]:
  """The batch-major parts of a state (everything but ``k_now`` and ``stats``)."""
  return dict(target_cache=state.target_cache, proposer=state.proposer, last=state.last, out=state.out,
              n_out=state.n_out, done=state.done, keys=state.keys, settings=state.settings, counts=state.counts)


def put_rows(state: DecodeState, rows: jax.Array, new: DecodeState) -> DecodeState:
  """``state`` with rows ``rows [G]`` replaced by the ``G`` rows of ``new`` (for example fresh requests from
  :func:`init_state`); ``k_now`` and the statistics stay ``state``'s."""
  put = lambda big, small: big.at[rows].set(small)
  return dataclasses.replace(state, **jax.tree.map(put, _batch_fields(state), _batch_fields(new)))


def copy_rows(state: DecodeState, src: jax.Array, rows: jax.Array, keys: jax.Array, settings: RowSettings
              ) -> DecodeState:
  """``state`` with rows ``rows [G]`` made copies of row ``src []`` (its caches, proposer state, counts, output
  so far) but for their own ``keys [G]`` and ``settings [G]``; entries of ``rows`` past the last row are
  dropped (padding). Copies of a freshly prefilled row equal prefills of the same prompt with those keys and
  settings, so that n samples of one prompt share its prefill."""
  take = lambda x: jnp.broadcast_to(x[src], rows.shape + x.shape[1:])
  put = lambda big, small: big.at[rows].set(small, mode="drop")
  fields = _batch_fields(state)
  fields = jax.tree.map(lambda x: put(x, take(x)), {k: v for k, v in fields.items() if k not in ("keys", "settings")})
  return dataclasses.replace(state, **fields, keys=put(state.keys, keys),
                             settings=jax.tree.map(put, state.settings, settings))


def take_rows(state: DecodeState, src: jax.Array) -> DecodeState:
  """A state of ``len(src)`` rows: row i is ``state``'s row ``src[i]``, or a free (done) row where
  ``src[i] < 0``; statistics start from zero."""
  valid = src >= 0
  take = lambda x: x[jnp.where(valid, src, 0)]
  fields = jax.tree.map(take, _batch_fields(state))
  fields["done"] = fields["done"] | ~valid
  return DecodeState(**fields, k_now=state.k_now, stats=RoundStats.zeros(src.shape[0], state.stats.reached.shape[0]))


# ---------------------------------------------------------------------------------- the round


def always_invariant(target, invariant: bool) -> bool:
  """Whether a verify pass of ``target`` goes position by position: where asked (``invariant``), and always for
  a target whose weight products round each row alike in any window (mixed precision,
  :func:`specjax.numerics.row_invariant`): there only its attention and norms go position by position, which
  costs little (SmolLM2-135M on XLA:CPU: a 5-token window 1.12 one-token steps instead of 1.03), and without it
  a rounding flip at one bfloat16 operand would grow through the layers and flip near-tied greedy tokens."""
  return invariant or row_invariant(getattr(target, "cfg", None))


def verify(target, cache: KVCache, last: jax.Array, drafts: jax.Array, sampler: Sampler,
           aux_layers: tuple[int, ...] = (), invariant: bool = False
           ) -> tuple[jax.Array, jax.Array, Features, KVCache]:
  """Scores ``[last, d_1..d_k]`` in one target pass; ``invariant`` (static): each position computed with a
  one-token step's shapes (:func:`specjax.numerics.per_position`), so its logits are bit for bit those of
  the target alone there.

  Returns ``p [B, k+1, V]`` (warped: position i counts ``d_1..d_i`` as output), the raw ``logits
  [B, k+1, V]``, the target's :class:`Features` at the ``k + 1`` positions, and the cache advanced by ``k + 1``.
  """
  window = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, k+1]
  with per_position(always_invariant(target, invariant)):
    logits, features, cache = target_pass(target, window, cache, aux_layers)
  return sampler.warp_window(logits, drafts), logits, features, cache


def verify_widths(k: int) -> tuple[int, ...]:
  """The proposal counts a round of ``k`` verifies at, when its proposer proposes fewer per row
  (:attr:`~specjax.proposers.base.Proposer.varies_limit`): 0, 1, 3, 7, ... below k, and k (windows of 1, 2,
  4, 8, ... and k + 1 tokens)."""
  widths = [0]
  while 2 * widths[-1] + 1 < k:
    widths.append(2 * widths[-1] + 1)
  return tuple(widths) + (k,)


def verify_bucketed(target, cache: KVCache, last: jax.Array, drafts: jax.Array, num_drafts: jax.Array,
                    active: jax.Array, sampler: Sampler, aux_layers: tuple[int, ...] = (), invariant: bool = False,
                    widths: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array, Features, KVCache]:
  """:func:`verify` over the shortest window of ``widths`` (default :func:`verify_widths`; ascending, the last
  k) that holds every active row's ``num_drafts [B]`` proposals (one branch of a ``lax.switch`` per width): a
  round whose rows propose little costs a short target pass. Positions past the window get ``p = 0`` and zero
  logits and features; no row reads them (its proposals end inside the window, ``q = 0`` after them, so its
  next token comes from within). A target with ``forward_pending`` (every specjax model family) scores the
  window without writing the cache inside the branch, and the window's keys and values (zeros past it, past
  every row's new length) are written after it: the cache is not copied through the switch."""
  k = drafts.shape[1]
  widths = verify_widths(k) if widths is None else tuple(widths)
  if not widths or widths[-1] != k or list(widths) != sorted(set(widths)):
    raise ValueError(f"verify widths must ascend and end at k={k}, got {widths}")
  needed = jnp.max(jnp.where(active, num_drafts, 0))
  index = jnp.sum(jnp.asarray(widths[:-1])[None] < needed)  # the first width >= needed
  # Every array of xs padded on axis 1 from width + 1 (or width) positions to k + 1 (or k); None stays None.
  pads = lambda width, *xs: jax.tree.map(
      lambda x: jnp.pad(x, ((0, 0), (0, k - width)) + ((0, 0),) * (x.ndim - 2)), xs)

  if always_invariant(target, invariant) or not hasattr(target, "forward_pending"):
    def branch(width: int):
      def run(cache):
        p, logits, features, cache = verify(target, cache, last, drafts[:, :width], sampler, aux_layers, invariant)
        return *pads(width, p, logits, features), cache
      return run
    return jax.lax.switch(index, [branch(w) for w in widths], cache)

  # The branches only read the cache and return their window's keys and values, written after the switch: a
  # branch that wrote the cache would make XLA copy all of it through the conditional every round. (An
  # invariant pass keeps the written path: its logits must be bit for bit a one-token step's.)
  def pending_branch(width: int):
    def run(cache):
      window = jnp.concatenate([last[:, None], drafts[:, :width]], axis=1)  # [B, width+1]
      logits, hidden, aux, kv = target.forward_pending(window, cache, aux_layers)
      return pads(width, sampler.warp_window(logits, drafts[:, :width]), logits, Features(hidden, aux), kv)
    return run

  p, logits, features, kv = jax.lax.switch(index, [pending_branch(w) for w in widths], cache)
  return p, logits, features, cache.append(kv)


def _emit(state: DecodeState, drafts: jax.Array, n: jax.Array, token: jax.Array, logits: jax.Array,
          logprobs: int | None) -> tuple[Tokens, jax.Array, jax.Array]:
  """Each row's round output ``d_1..d_n, token``, cut at a stop token and at the row's ``max_new``.

  Returns ``emitted`` (:class:`Tokens` ``[B, k+1]``: ``d_1..d_n, token``, then the rejected proposals),
  ``count [B]`` (how many of them the row keeps; 0 for finished rows) and ``hit_stop [B]``.
  """
  k = drafts.shape[1]
  slots = jnp.arange(k + 1)[None, :]  # [1, k+1]
  ids = jnp.where(slots == n[:, None], token[:, None], jnp.concatenate([drafts, token[:, None]], axis=1))
  count = jnp.minimum(n + 1, state.settings.max_new - state.n_out)  # max_new_tokens is exact per row
  stop = state.settings.stop_ids  # [B, E], -1: none
  is_stop = jnp.any(ids[..., None] == stop[:, None, :], axis=-1) & (slots < count[:, None])
  hit_stop = jnp.any(is_stop, axis=1)
  count = jnp.where(hit_stop, jnp.argmax(is_stop, axis=1) + 1, count)  # a stop token ends the row there
  count = jnp.where(state.done, 0, count)
  emitted = Tokens(ids=ids, proposed=slots < n[:, None])
  if logprobs is not None:
    # The target's own distribution at each window position, before any warp (vLLM's default).
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, k+1, V]
    emitted = dataclasses.replace(emitted, logprobs=jnp.take_along_axis(logp, ids[..., None], axis=-1)[..., 0])
    if logprobs > 0:
      top_logprobs, top_ids = jax.lax.top_k(logp, logprobs)
      emitted = dataclasses.replace(emitted, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)
  return emitted, count, hit_stop


def _next_k(k_now: jax.Array, n: jax.Array, active: jax.Array, k: int) -> jax.Array:
  """Hugging Face's schedule: +2 after a round where every generating row accepted all, else -1."""
  all_accepted = jnp.all(jnp.where(active, n == k_now, True))
  return jnp.clip(jnp.where(all_accepted, k_now + 2, k_now - 1), 1, k).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposed:
  """The first half of a round (:func:`propose_round`), handed to :func:`finish_round`: a host may read
  ``drafts`` in between (a grammar's masks along the proposals, :mod:`specjax.grammar`).

  Attributes:
    drafts: ``[B, k] int32`` the proposals (0 past ``num_drafts``). q: ``[B, k, V]`` their distributions
      (0 past ``num_drafts``). proposer: the proposer's state after proposing. extra_steps: ``[] int32``.
    num_drafts: ``[B] int32`` proposals per row, or None (all k). keys: ``[B]`` the row keys of the next
      round; accept_keys: ``[B]`` the acceptance draws' keys.
  """

  drafts: jax.Array
  q: jax.Array
  proposer: Any
  extra_steps: jax.Array
  num_drafts: jax.Array | None
  keys: jax.Array
  accept_keys: jax.Array


def propose_round(state: DecodeState, *, target, proposer: Proposer | None, k: int, mode: Mode,
                  dynamic: bool = False, allowed: jax.Array | None = None, grammar: Any = None) -> Proposed:
  """Step 1 of a round (see :func:`round_step`): the proposals and their distributions.

  ``allowed [B, V] bool`` (optional): the tokens a grammar allows at the first proposal's position; the
  proposer then draws d_1 from its distribution restricted to them (renormalised), and hands that q_1 to
  acceptance, which keeps the rule exact and raises acceptance under a grammar. ``grammar`` (optional, with
  ``allowed``): a :class:`specjax.grammar.GrammarSteps`, the grammar's mask at every later position too
  (asked of the host after each draw), so that each q_i is the proposer's law restricted to what the grammar
  allows after ``d_<i`` and no proposal is one the grammar forbids (sampled proposers; a deterministic one's
  proposals are its own)."""
  keys, propose_keys, accept_keys = split_keys(state.keys, 3)
  active = ~state.done  # [B]
  batch = state.last.shape[0]
  sampler = Sampler(state.settings, state.counts, mode, allowed, grammar)
  if k == 0:
    return Proposed(drafts=jnp.zeros((batch, 0), jnp.int32), q=None, proposer=state.proposer,
                    extra_steps=jnp.zeros((), jnp.int32), num_drafts=None, keys=keys, accept_keys=accept_keys)
  ctx = Context(last=state.last, lengths=state.target_cache.lengths, active=active)
  proposal = proposer.propose(state.proposer, target, ctx, propose_keys, k, sampler, state.k_now if dynamic else None)
  drafts, q = proposal.drafts, proposal.q
  # Proposals past k_now (a dynamic schedule) or past the row's limit (a proposer that proposes fewer)
  # are not proposals: q = 0 there, so the row's next token comes from p after its last proposal.
  num_drafts = jnp.full((batch,), state.k_now) if dynamic else None
  if proposal.limit is not None:
    num_drafts = proposal.limit if num_drafts is None else jnp.minimum(num_drafts, proposal.limit)
  if num_drafts is not None:
    used = jnp.arange(k)[None, :] < num_drafts[:, None]
    drafts, q = jnp.where(used, drafts, 0), q * used[..., None]
  return Proposed(drafts=drafts, q=q, proposer=proposal.state, extra_steps=proposal.extra_steps,
                  num_drafts=num_drafts, keys=keys, accept_keys=accept_keys)


def unpack_mask(bits: jax.Array, vocab: int) -> jax.Array:
  """``[..., ceil(V/32)] int32`` bitmasks (bit ``v % 32`` of word ``v // 32``: token v allowed; the layout of
  xgrammar and llguidance) as ``[..., V] bool``."""
  v = jnp.arange(vocab)
  return ((bits[..., v // 32] >> (v % 32)) & 1).astype(bool)


def round_step(state: DecodeState, *, target, proposer: Proposer | None, k: int, mode: Mode,
               dynamic: bool = False, logprobs: int | None = None, invariant: bool = False
               ) -> tuple[DecodeState, Tokens, jax.Array]:
  """One speculative round (the loop body of :func:`generate_tokens`; see the module docstring):
  :func:`propose_round`, then :func:`finish_round`.

  Args:
    state: the loop state (``out`` may be None: the caller takes each round's tokens from the outputs).
    target: the target model. proposer: the bound proposer, or None (then k must be 0). With k == 0 and
      a proposer (a server's plain-decoding rounds) the proposer proposes nothing but its ``commit`` still
      follows the round, so that its state keeps up with the context.
    k: static proposals per round (0: the baseline).
    mode: static :class:`Mode` covering every row's settings (``state.settings``).
    dynamic: static; ``state.k_now`` proposals of the k are used (the rest are masked).
    logprobs: static; None, or the number of alternatives to return with each token's log-probability.
    invariant: static; the verify pass computes each position as a one-token step does (bit for bit the
      target alone's logits, at the cost of one product per position; see :mod:`specjax.numerics`).

  Returns:
    The state after the round, the round's ``emitted`` :class:`Tokens` ``[B, k+1]`` and ``count [B]`` (how
    many of them each row kept). Invariant: every row's emitted tokens follow the target's warped
    distribution exactly (greedy: they equal target-only greedy decoding), whatever the other rows do.
  """
  with jax.named_scope("propose"):
    proposed = propose_round(state, target=target, proposer=proposer, k=k, mode=mode, dynamic=dynamic)
  return finish_round(state, proposed, target=target, proposer=proposer, k=k, mode=mode, dynamic=dynamic,
                      logprobs=logprobs, invariant=invariant)


def finish_round(state: DecodeState, proposed: Proposed, *, target, proposer: Proposer | None, k: int, mode: Mode,
                 dynamic: bool = False, logprobs: int | None = None, invariant: bool = False, allowed: jax.Array | None = None
                 ) -> tuple[DecodeState, Tokens, jax.Array]:
  """Steps 2-5 of a round (verify, accept, emit, commit) after :func:`propose_round`; arguments and returns
  as :func:`round_step`.

  ``allowed [B, k+1, V] bool`` (optional): the tokens a grammar allows at each window position, given the
  proposals before it. The target's logits are masked to them before the warp, so p (and the residual and
  the bonus token drawn from it) is the target's law restricted to the grammar, and a forbidden proposal
  (p = 0) is always rejected: the output follows the law of constrained decoding without speculation.
  Positions past a forbidden proposal are never read, whatever they allow.
  """
  active = ~state.done  # [B]
  batch = state.last.shape[0]
  aux_layers = proposer.aux_layers if proposer is not None else ()
  sampler = Sampler(state.settings, state.counts, mode)
  drafts, num_drafts = proposed.drafts, proposed.num_drafts

  with jax.named_scope("verify"):
    if allowed is not None:  # the mask enters before the warp, so greedy rows take the allowed argmax
      window = jnp.concatenate([state.last[:, None], drafts], axis=1)  # [B, k+1]
      with per_position(always_invariant(target, invariant)):
        logits, features, target_cache = target_pass(target, window, state.target_cache, aux_layers)
      p = sampler.warp_window(jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf), drafts)
    elif k > 1 and proposer.varies_limit and num_drafts is not None:
      p, logits, features, target_cache = verify_bucketed(target, state.target_cache, state.last, drafts, num_drafts,
                                                          active, sampler, aux_layers, invariant,
                                                          proposer.verify_widths(k))
    else:
      p, logits, features, target_cache = verify(target, state.target_cache, state.last, drafts, sampler,
                                                 aux_layers, invariant)

  with jax.named_scope("accept"):
    q = proposed.q if k > 0 else jnp.zeros((batch, 0, p.shape[-1]), p.dtype)
    n, token = accept(p, q, drafts, proposed.accept_keys, num_drafts, greedy=mode.greedy)  # [B], [B]

  with jax.named_scope("emit"):
    emitted, count, hit_stop = _emit(state, drafts, n, token, logits, logprobs)
    n_out = state.n_out + count
    lengths = state.target_cache.lengths
    new_lengths = lengths + jnp.where(active, n + 1, 0)  # everything past that is rolled back
    counts = state.counts
    if counts is not None:
      counts = counts.add(emitted.ids, jnp.arange(k + 1)[None, :] < count[:, None])

  pstate = proposed.proposer
  with jax.named_scope("commit"):
    if proposer is not None:
      verified = Verified(window=jnp.concatenate([state.last[:, None], drafts], axis=1), emitted=emitted.ids, n=n,
                          num_drafts=state.k_now, active=active, lengths=lengths, new_lengths=new_lengths,
                          features=features)
      pstate = proposer.commit(pstate, target, verified)

  new_state = DecodeState(
      target_cache=target_cache.with_lengths(new_lengths),
      proposer=pstate,
      last=jnp.where(active, token, state.last),
      out=None if state.out is None else state.out.write(emitted, state.n_out),
      n_out=n_out,
      done=state.done | hit_stop | (n_out >= state.settings.max_new),
      k_now=_next_k(state.k_now, n, active, k) if dynamic else state.k_now,
      keys=proposed.keys,
      settings=state.settings,
      counts=counts,
      stats=state.stats.update(active, n, state.k_now if num_drafts is None else num_drafts,
                               proposed.extra_steps),
  )
  return new_state, emitted, count


def tree_round_step(state: DecodeState, *, target, proposer: Proposer, tree: trees.TreeSpec, mode: Mode,
                    logprobs: int | None = None, invariant: bool = False) -> tuple[DecodeState, Tokens, jax.Array]:
  """One round with a token tree (``ALGORITHMS.md``, "Token trees"): the proposer grows a tree of ``N``
  nodes per row (:meth:`Proposer.propose_tree`), one target pass scores the root and every node at position
  ``length + depth`` attending to its ancestors, :func:`specjax.tree.accept_tree` walks it, and the accepted
  path's keys and values move to consecutive cache positions. From there on the round is a chain's: the path
  is emitted, counted and committed (``Verified`` sees the root and the path as the window, the features
  gathered along it). Same arguments and returns as :func:`round_step` (``[B, D + 1]`` tokens, ``D`` the
  tree's depth); ``invariant`` computes each node with a one-token step's shapes."""
  keys, propose_keys, accept_keys = split_keys(state.keys, 3)
  active = ~state.done
  batch = state.last.shape[0]
  depth = tree.depth
  sampler = Sampler(state.settings, state.counts, mode)
  lengths = state.target_cache.lengths

  with jax.named_scope("propose"):
    ctx = Context(last=state.last, lengths=lengths, active=active)
    proposal = proposer.propose_tree(state.proposer, target, ctx, propose_keys, tree, sampler)
    tree_nodes, q, pstate, extra = proposal.tree, proposal.q, proposal.state, proposal.extra_steps

  with jax.named_scope("verify"):
    mask = trees.verify_mask(tree_nodes, lengths, depth)
    with per_position(always_invariant(target, invariant)):
      if proposer.aux_layers:
        logits, hidden, aux, target_cache = target.forward_features(tree_nodes.tokens, state.target_cache,
                                                                    proposer.aux_layers, tree=mask)
      else:
        (logits, hidden, target_cache), aux = target(tree_nodes.tokens, state.target_cache, tree=mask), None
    counts = trees.node_counts(tree_nodes, logits.shape[-1], depth) if state.counts is not None else None
    p = sampler.warp_nodes(logits, counts)  # [B, N + 1, V]

  with jax.named_scope("accept"):
    outcome = trees.accept_tree(p, tree_nodes, accept_keys, depth=depth, select=tree.select, greedy=mode.greedy, q=q)
    n, token, path = outcome.n, outcome.token, outcome.path

  with jax.named_scope("emit"):
    along = lambda x: jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)
    drafts = along(tree_nodes.tokens)[:, 1:]  # [B, D] the path's tokens (past n: repeats)
    emitted, count, hit_stop = _emit(state, drafts, n, token, along(logits), logprobs)
    n_out = state.n_out + count
    new_lengths = lengths + jnp.where(active, n + 1, 0)
    counts = state.counts
    if counts is not None:
      counts = counts.add(emitted.ids, jnp.arange(depth + 1)[None, :] < count[:, None])
    target_cache = trees.compact(target_cache, lengths, path, tree_nodes.slots)

  with jax.named_scope("commit"):
    features = Features(hidden=along(hidden), aux=None if aux is None else along(aux))
    verified = Verified(window=jnp.concatenate([state.last[:, None], drafts], axis=1), emitted=emitted.ids, n=n,
                        num_drafts=jnp.int32(depth), active=active, lengths=lengths, new_lengths=new_lengths,
                        features=features)
    pstate = proposer.commit(pstate, target, verified)

  accepted_ranks = jnp.where(jnp.arange(depth)[None, :] < n[:, None], along(tree_nodes.ranks)[:, 1:], -1)
  offered_ranks = trees.offered_ranks(tree_nodes, path, n, depth, MAX_RANKS)
  new_state = DecodeState(
      target_cache=target_cache.with_lengths(new_lengths),
      proposer=pstate,
      last=jnp.where(active, token, state.last),
      out=None if state.out is None else state.out.write(emitted, state.n_out),
      n_out=n_out,
      done=state.done | hit_stop | (n_out >= state.settings.max_new),
      k_now=state.k_now,
      keys=keys,
      settings=state.settings,
      counts=counts,
      stats=state.stats.update(active, n, jnp.int32(depth), extra, drafted=jnp.sum(tree_nodes.valid[:, 1:], axis=1),
                               accepted_ranks=accepted_ranks, offered_ranks=offered_ranks),
  )
  return new_state, emitted, count


def generate_tokens(target_def, target_state, proposer: Proposer | None, proposer_defs: tuple,
                    proposer_states: tuple, prompts: jax.Array, prompt_lens: jax.Array, keys: jax.Array,
                    settings: RowSettings, *, k: int, max_new: int, mode: Mode, dynamic: bool = False,
                    logprobs: int | None = None, invariant: bool = False, tree: trees.TreeSpec | None = None
                    ) -> tuple[Tokens, jax.Array, RoundStats]:
  """The whole run, prefill and all rounds, as one program (jit it with the static arguments bound).

  Args:
    target_def, target_state: the target model split by ``nnx.split``.
    proposer: the proposer's template (:meth:`Proposer.split`), None for the baseline;
      proposer_defs, proposer_states: its modules' graphdefs (static) and states.
    prompts: ``[B, P] int32`` right-padded prompts (P a bucket length); prompt_lens: ``[B] int32 >= 1``.
    keys: ``[B]`` row keys. settings: the rows' :class:`RowSettings` (``max_new`` at most the static bound).
    k: static speculation length (0 = target only). max_new: static bound on tokens per row.
    mode: static warp paths covering ``settings``. dynamic: static; adapt the proposals per round within
      ``[1, k]`` (see ``SpecConfig.schedule``). logprobs: static; None, or the alternatives per token.
    invariant: static; window-invariant verify passes (see :func:`round_step`).
    tree: static; a :class:`specjax.tree.TreeShape` or :class:`~specjax.tree.DynamicTree`: every round
      proposes a tree (:func:`tree_round_step`) and ``k`` must be its depth; None: chains of ``k``.

  Returns:
    :class:`Tokens` ``[B, max_new]`` (ids -1 past each row's length), lengths ``[B] int32``, the statistics.
  """
  use = proposer is not None and k > 0

  def models():
    # Merged inside each traced function (not closed over across the loop boundary).
    bound = proposer.bind(proposer_defs, proposer_states) if use else None
    return nnx.merge(target_def, target_state), bound

  target, bound = models()
  state = init_state(target, bound, prompts, prompt_lens, keys, settings, k=k, mode=mode,
                     max_len=cache_length(prompts.shape[1], max_new), out_len=output_length(max_new, k),
                     logprobs=logprobs)

  def body(state):
    target, bound = models()
    if tree is not None:
      return tree_round_step(state, target=target, proposer=bound, tree=tree, mode=mode, logprobs=logprobs,
                             invariant=invariant)[0]
    return round_step(state, target=target, proposer=bound, k=k, mode=mode, dynamic=dynamic, logprobs=logprobs,
                      invariant=invariant)[0]

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  out = jax.tree.map(lambda x: x[:, :max_new], state.out)
  valid = jnp.arange(max_new)[None, :] < state.n_out[:, None]
  out = dataclasses.replace(out, ids=jnp.where(valid, out.ids, -1), proposed=out.proposed & valid)
  return out, state.n_out, state.stats
