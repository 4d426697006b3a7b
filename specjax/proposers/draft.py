"""A separate, smaller draft model as the proposer (Leviathan et al. 2023; Chen et al. 2023)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax.cache import KVCache
from specjax.config import SamplingConfig
from specjax.proposers.base import Context, Features, Proposal, Proposer, Verified
from specjax.sampling import draw, split_keys, warp


def draft_rollout(draft_fn, cache: KVCache, last: jax.Array, key: jax.Array, k: int,
                  sampling: SamplingConfig, steps: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, KVCache]:
  """Proposes k tokens per row with k single-token draft steps.

  Args:
    draft_fn: ``(tokens[B, 1], cache) -> (logits, hidden, cache)``.
    cache: draft cache holding the context before ``last``.
    last: ``[B]`` the newest accepted token.
    key: PRNG key.
    k: static speculation length.
    sampling: static warp shared with the target.
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
  (cache, _), (drafts, q) = jax.lax.scan(step, (cache, last), (jnp.arange(k), split_keys(key, k)))
  return drafts.T, jnp.swapaxes(q, 0, 1), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
  """Invariant at the start of a round: the cache holds the row's context before ``last`` except where
  ``stale``: after a fully accepted round the draft never saw its own last proposal ``prev`` (the token at
  cache position ``lengths - 1``)."""

  cache: KVCache
  prev: jax.Array  # [B]
  stale: jax.Array  # [B] bool


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel(Proposer):
  """A draft model with the target's vocabulary, run autoregressively for k steps per round.

  Attributes:
    model: any specjax model (the forward contract of :mod:`specjax.models.llama`) whose vocabulary
      equals the target's.
  """

  model: Any = None

  name: ClassVar[str] = "draft"
  module_fields: ClassVar[tuple[str, ...]] = ("model",)
  catch_up: ClassVar[bool] = True

  def check(self, target_cfg, needed_len: int) -> None:
    cfg = getattr(self.model, "cfg", None)
    if cfg is None or not hasattr(cfg, "vocab_size"):
      raise ValueError(f"draft must be a specjax model (with a .cfg config), got {type(self.model).__name__}")
    if cfg.vocab_size != target_cfg.vocab_size:
      raise ValueError(f"draft vocab_size ({cfg.vocab_size}) must equal the target's ({target_cfg.vocab_size})")
    if needed_len > cfg.max_seq_len:
      raise ValueError(f"prompt length + max_new_tokens = {needed_len} exceeds the draft's cache length "
                       f"max_seq_len={cfg.max_seq_len}")

  def init(self, target, prompts, prompt_lens, features: Features, max_len: int) -> DraftState:
    batch = prompts.shape[0]
    # Writes the whole padded prompt; positions past prompt_lens - 1 are rolled back at once.
    _, _, cache = self.model(prompts, self.model.init_cache(batch, max_len))
    prev = prompts[jnp.arange(batch), jnp.maximum(prompt_lens - 2, 0)]
    return DraftState(cache=cache.with_lengths(prompt_lens - 1), prev=prev, stale=jnp.zeros((batch,), bool))

  def propose(self, state: DraftState, target, ctx: Context, key, k, sampling, steps) -> Proposal:
    # The draft must see every accepted token before proposing: after a fully accepted round it has not
    # seen d_k (= prev). Re-feeding prev where the draft already has it rewrites identical entries.
    def catch_up(cache):
      _, _, cache = self.model(state.prev[:, None], cache.with_lengths(cache.lengths - 1))
      return cache

    needs = jnp.any(state.stale & ctx.active)
    cache = jax.lax.cond(needs, catch_up, lambda c: c, state.cache)
    drafts, q, cache = draft_rollout(self.model, cache, ctx.last, key, k, sampling, steps)
    return Proposal(drafts, q, dataclasses.replace(state, cache=cache), needs.astype(jnp.int32))

  def commit(self, state: DraftState, target, verified: Verified) -> DraftState:
    before_token = jnp.take_along_axis(verified.window, verified.n[:, None], axis=1)[:, 0]  # [B]
    active = verified.active
    return DraftState(
        cache=state.cache.with_lengths(verified.new_lengths),
        prev=jnp.where(active, before_token, state.prev),
        stale=jnp.where(active, verified.n == verified.num_drafts, state.stale))
