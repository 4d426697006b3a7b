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
import math
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


def per_position_on() -> bool:
  """Whether the pass being traced is under :func:`per_position`."""
  return _PER_POSITION.get()


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


FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # the dtypes a model's weights and activations may take
MATMUL_DTYPES = (None, "bfloat16")  # LlamaConfig.matmul_dtype: None, products in the activation dtype
PRODUCT_TILE = 16  # XLA:CPU's bfloat16 product takes rows in tiles of this many (see weight_product)
MIN_PRODUCT_ROWS = 3  # ... and a tile of 1 or 2 rows with kernels of its own: padded to this many


def weight_product(spec: str, x: jax.Array, w: jax.Array, matmul_dtype: str | None = None) -> jax.Array:
  """``jnp.einsum(spec, x, w)`` of activations ``x`` with a weight ``w``, in ``x``'s dtype.

  ``matmul_dtype`` None: ``w`` is cast to ``x``'s dtype and the product taken there (float32 models: a
  float32 product). ``"bfloat16"`` (mixed precision, :attr:`specjax.models.llama.LlamaConfig.matmul_dtype`):
  both operands in bfloat16, accumulated in float32, as accelerators take matrix products by default. ``x``'s
  leading axes are flattened into the rows of one ``[M, K] x [K, N]`` product (``[N, K]`` when ``w`` holds its
  contracted axes last, as a tied embedding used as the LM head does), padded with zero rows so that no tile of
  :data:`PRODUCT_TILE` rows holds fewer than :data:`MIN_PRODUCT_ROWS` (1 row becomes 3, 17 becomes 19).

  Why bfloat16 and the padding, on XLA:CPU (measured on Sapphire Rapids, ``docs/benchmarks.md``, "Mixed
  precision"): its float32 product takes a matrix-vector path at one row and a much slower one from two rows
  up (SmolLM2-135M: a pass over 5 tokens cost 1.45 passes over one), while with its bfloat16 product with
  float32 accumulation a pass over 2 to 9 tokens cost 1.01-1.09 passes over one. And it rounds each row the
  same way whatever the number of rows, except in a last tile of 1 or 2 rows, which take kernels of their own;
  with the padding a row's product is bit for bit the same in a one-token step and in a verify window
  (``tests/test_numerics.py`` checks that on the running backend, for several shapes and row counts). Pass
  ``spec``'s output as ``x``'s leading axes followed by ``w``'s uncontracted axes, as every call site does.
  """
  if matmul_dtype is None:
    return jnp.einsum(spec, x, w.astype(x.dtype))
  inputs, out = spec.split("->")
  lhs, rhs = inputs.split(",")
  contracted = [c for c in lhs if c.isalpha() and c in rhs]
  n_c = len(contracted)
  if rhs.startswith("".join(contracted)):
    k = math.prod(w.shape[:n_c])
    w2, kept, form = w.reshape(k, -1), w.shape[n_c:], "mk,kn->mn"
  elif rhs.endswith("".join(contracted)):
    k = math.prod(w.shape[w.ndim - n_c:])
    w2, kept, form = w.reshape(-1, k), w.shape[:w.ndim - n_c], "mk,nk->mn"
  else:
    raise ValueError(f"weight_product: {spec!r} must contract w's leading or trailing axes")
  lead = x.shape[:x.ndim - n_c]
  x2 = x.reshape(-1, k).astype(matmul_dtype)
  rows = x2.shape[0]
  last = rows % PRODUCT_TILE
  if 0 < last < MIN_PRODUCT_ROWS:
    x2 = jnp.concatenate([x2, jnp.zeros((MIN_PRODUCT_ROWS - last, k), x2.dtype)], axis=0)
  y = jnp.einsum(form, x2, w2.astype(matmul_dtype), preferred_element_type=jnp.float32)[:rows]
  return y.reshape(*lead, *kept).astype(x.dtype)


def row_invariant(cfg: Any) -> bool:
  """Whether a model of ``cfg`` takes its weight products row-invariant (:func:`weight_product` in
  bfloat16): then under :func:`per_position` only attention and the norms (row reductions, which XLA:CPU rounds
  by row count) go position by position, and the products and elementwise parts run on the whole window (each
  row rounds as in a one-token step)."""
  return getattr(cfg, "matmul_dtype", None) is not None


def positionwise_unless(invariant: bool, fn: Callable[..., Any], *xs: jax.Array) -> Any:
  """``fn(*xs)`` where ``invariant`` (its rows round alike whatever the window), else :func:`positionwise`."""
  return fn(*xs) if invariant else positionwise(fn, *xs)
