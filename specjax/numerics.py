"""Window-invariant model passes: position i of a ``T``-token pass rounds exactly as a one-token pass there.

A library matrix product picks its kernel, its blocking and its reduction order from the shapes, so
``x[i] @ W`` inside a ``[T, D] @ [D, N]`` product is not bit for bit the ``[1, D] @ [D, N]`` product of a
decode step (on this CPU they differ in most elements by an ulp; on GPUs split-K kernels do the same). At a
near-tie of the target's logits that ulp decides the argmax, so a speculative verify pass over ``k + 1``
tokens can emit a different greedy token than the target alone.

Under :func:`per_position` (entered while tracing; the engine enters it for the verify pass when
``SpecConfig.invariant`` is set), every specjax model computes the per-position parts of a pass (norms, the
q/k/v, output and MLP projections, attention of each query over the cache, the LM head) on each position's
``[B, 1, ...]`` slice: the very shapes of a one-token decode step, so the same kernels and the same
rounding. Only the cache write sees the whole window. The price is that each weight matrix is multiplied
``T`` times by one row instead of once by ``T`` rows (see ``docs/benchmarks.md`` for what that costs).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

_PER_POSITION: contextvars.ContextVar[bool] = contextvars.ContextVar("specjax_per_position", default=False)


@contextlib.contextmanager
def per_position(on: bool = True) -> Iterator[None]:
  """While tracing under it, every specjax model pass over ``T > 1`` tokens computes each position with the
  one-token step's shapes (:func:`positionwise`). Enter it inside a traced function whose jit key includes
  ``on`` (a trace made under one setting must not be reused under the other)."""
  token = _PER_POSITION.set(on)
  try:
    yield
  finally:
    _PER_POSITION.reset(token)


def positionwise(fn: Callable[..., Any], *xs: jax.Array) -> Any:
  """``fn(*xs)`` for inputs ``[B, T, ...]``. Under :func:`per_position` with ``T > 1``, ``fn`` is called on
  each position's ``[B, 1, ...]`` slices and its outputs (a pytree of ``[B, 1, ...]`` arrays) are
  concatenated on axis 1, so that each call has exactly a one-token decode step's shapes."""
  t = xs[0].shape[1]
  if t == 1 or not _PER_POSITION.get():
    return fn(*xs)
  outs = [fn(*(x[:, i:i + 1] for x in xs)) for i in range(t)]
  return jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=1), *outs)


def einsum_f32(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """``jnp.einsum(spec, x, w)`` accumulated and returned in float32, whatever the operands' dtype: the
  product that makes logits (an LM head, a draft head's output layer).

  The operands are cast up rather than passed with ``preferred_element_type``: a product of two bfloat16
  (or float16) numbers is exact in float32, so this is the mixed-precision product exactly, and it also
  compiles on XLA:CPU, whose dot thunk lacks the bfloat16 x bfloat16 -> float32 form for some operand
  layouts. Accelerator compilers fuse the casts into the product."""
  return jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32))
