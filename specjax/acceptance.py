"""The acceptance rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

One function serves greedy decoding, sampling and every proposer: greedy is the case where both
distributions are one-hot (the warp of temperature 0), a deterministic proposer the case where ``q`` is
the one-hot of its token. The emitted tokens follow the target's warped distribution exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import first_argmax, sample, split_keys, uniform


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
  """The (unnormalised) correction distribution ``max(0, p - q)``, ``[..., V]``.

  Falls back to ``p`` where the residual has no mass (``p == q`` up to rounding), a case the rule never
  reaches in exact arithmetic because a rejection requires ``p(d) < q(d)``.
  """
  r = jnp.maximum(p - q, 0.0)
  return jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0.0, r, p)


def accept(p: jax.Array, q: jax.Array, drafts: jax.Array, key: jax.Array,
           num_drafts: jax.Array | None = None, greedy: bool = False) -> tuple[jax.Array, jax.Array]:
  """Verifies one window of proposals per row.

  Args:
    p: ``[B, k+1, V]`` target's warped distributions; ``p[:, i]`` follows ``x_<=t, d_<=i``.
    q: ``[B, k, V]`` proposer's warped distributions that ``drafts`` were drawn from.
    drafts: ``[B, k] int32`` proposed tokens d_1..d_k.
    key: PRNG key for the acceptance draws and the correction/bonus draw, or per-row keys ``[B]``.
    num_drafts: optional ``[B] int32``: only ``d_1..d_{num_drafts}`` are proposals (a dynamic schedule);
      ``q`` must be zero past them, so that accepting all of them draws the bonus from ``p_{num+1}``.
    greedy: static; promises that ``p`` and ``q`` are one-hot (temperature 0). The rule is then
      deterministic (accept iff ``p_i(d_i) = 1``; the residual is one-hot) and no random numbers are drawn.

  Returns:
    ``n`` ``[B] int32``, the number of accepted proposals (0..k), and ``token`` ``[B] int32``, the token
    emitted after them: drawn from ``normalize(max(0, p_{n+1} - q_{n+1}))`` if ``n < k``, from
    ``p_{k+1}`` (the bonus token) if ``n == k``. Rows emit ``d_1..d_n, token``.
  """
  b, k = drafts.shape
  u_key, s_key = split_keys(key, 2)
  if k == 0:  # target-only: the bonus token from p_1 (what the rule below gives, without gathering from zeros)
    token = first_argmax(p[:, 0]) if greedy else sample(p[:, 0], s_key)
    return jnp.zeros((b,), jnp.int32), token
  # 1. Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), as long as all earlier ones were.
  p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, k]
  q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]  # [B, k]
  if greedy:
    ok = p_d > 0.5  # one-hot p: d_i is the target's argmax
  else:
    u = uniform(u_key, (b, k))  # in [0, 1): ratio 1 always passes, 0 never
    ok = u * q_d < p_d  # u < p/q without dividing; q_d > 0 because d_i was drawn from q_i
  if num_drafts is not None:
    ok &= jnp.arange(k)[None, :] < num_drafts[:, None]
  n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)  # [B]
  # 2. The next token: residual at the first rejection, or the bonus from p_{k+1} when all passed.
  p_next = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
  if greedy:  # one-hot p: the residual at a rejection (d != argmax p) and the bonus are both p's argmax
    return n.astype(jnp.int32), first_argmax(p_next)
  q_pad = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)  # [B, k+1, V]; q_{k+1} = 0
  q_next = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]  # [B, V]
  return n.astype(jnp.int32), sample(residual(p_next, q_next), s_key)
