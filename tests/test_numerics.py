"""Mixed precision's weight products (:func:`specjax.numerics.weight_product`): the product against a float64
reference of the bfloat16-rounded operands, and the property the engine's exactness in mixed precision rests on:
on the running backend each row of a padded bfloat16 product rounds alike whatever the number of rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import numerics
from specjax.models import LlamaConfig


def _bf16(x) -> np.ndarray:
  """``x`` rounded to bfloat16, as float64."""
  return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


# (spec, x shape, w shape): every form the Llama family takes (q/k/v, output projection, MLP, both LM heads).
SPECS = [("btd,dnh->btnh", (2, 3, 48), (48, 4, 8)), ("btnh,nhd->btd", (2, 3, 4, 8), (4, 8, 48)),
         ("btd,df->btf", (1, 1, 48), (48, 96)), ("...d,vd->...v", (1, 5, 48), (200, 48)),
         ("...d,dv->...v", (3, 48), (48, 200))]


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS)
def test_bfloat16_products_equal_the_rounded_operands_product(spec, x_shape, w_shape):
  """bfloat16 operands, float32 accumulation: within float32 rounding of the exact product of the rounded
  operands (float64 here), shaped as ``jnp.einsum`` shapes it; the float32 activations' own product differs by
  far more (the operands' rounding), which the tolerance rules out."""
  rng = np.random.default_rng(0)
  x, w = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)
  got = numerics.weight_product(spec, jnp.asarray(x), jnp.asarray(w).astype(jnp.bfloat16), "bfloat16")
  want = np.einsum(spec, _bf16(x), _bf16(w))
  assert got.dtype == jnp.float32 and got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max())
  assert np.abs(np.einsum(spec, x.astype(np.float64), w.astype(np.float64)) - want).max() > 1e-3
  plain = numerics.weight_product(spec, jnp.asarray(x), jnp.asarray(w))  # matmul_dtype None: einsum as it was
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(jnp.einsum(spec, jnp.asarray(x), jnp.asarray(w))))


@pytest.mark.parametrize("k,n", [(64, 96), (512, 256), (576, 1536), (1536, 576)])
def test_each_row_of_a_bfloat16_product_rounds_alike_for_any_number_of_rows(k, n):
  """Row i of a product over 2..40 rows is bit for bit the product of row i alone, in both weight layouts,
  with weight_product's padding. Without it one row takes a kernel of its own on XLA:CPU and rounds differently
  (the test's power, checked on CPU); on some CPUs (the Xeons of 2026-12) a last tile of one or two rows does
  too, which the row counts 17, 18, 33, 34 cover. On an AMD EPYC with AVX512-BF16 only the one-row kernel
  differs."""
  rng = np.random.default_rng(k)
  x = jnp.asarray(rng.standard_normal((40, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
  for spec, weight in (("md,dn->mn", w), ("md,nd->mn", w.T)):
    product = jax.jit(lambda x, w, spec=spec: numerics.weight_product(spec, x, w, "bfloat16"))
    alone = np.stack([np.asarray(product(x[i:i + 1], weight))[0] for i in range(40)])
    for m in (2, 3, 5, 8, 9, 16, 17, 18, 19, 33, 34, 40):
      np.testing.assert_array_equal(np.asarray(product(x[:m], weight)), alone[:m], err_msg=f"{spec}, {m} rows")
  if jax.default_backend() == "cpu":
    raw = jax.jit(lambda x, w: jnp.einsum("md,dn->mn", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32))
    assert not np.array_equal(np.asarray(raw(x[:1], w))[0], np.asarray(raw(x[:5], w))[0])


def test_a_product_over_middle_axes_is_refused():
  with pytest.raises(ValueError, match="must contract w's leading or trailing axes"):
    numerics.weight_product("bd,ndm->bnm", jnp.ones((2, 4)), jnp.ones((3, 4, 5)), "bfloat16")


def test_matmul_dtype_is_checked_by_name():
  base = dict(vocab_size=16, d_model=16, n_layers=1, n_heads=2, d_ff=32)
  with pytest.raises(ValueError, match=r"LlamaConfig.matmul_dtype must be one of \(None, 'bfloat16'\), got 'float16'"):
    LlamaConfig(**base, matmul_dtype="float16")
  with pytest.raises(ValueError, match="needs float32 activations"):
    LlamaConfig(**base, dtype="bfloat16", param_dtype="bfloat16", matmul_dtype="bfloat16")
  assert LlamaConfig(**base, param_dtype="bfloat16", matmul_dtype="bfloat16").matmul_dtype == "bfloat16"


# Axis sizes: under a block (jnp.argmax itself), whole blocks (SmolLM2's 49,152, GPT-2's 50,257 = 29 x 1733:
# 256-blocks and a tail), a prime (a tail only past whole blocks), a draft vocabulary.
ARGMAX_SIZES = [7, 127, 128, 300, 1031, 8192, 49152, 50257]


@pytest.mark.parametrize("size", ARGMAX_SIZES)
def test_first_argmax_is_jnp_argmax(size):
  """:func:`specjax.sampling.first_argmax` gives ``jnp.argmax``'s index on random rows, on ties (the first),
  with -inf everywhere, with +inf, and with the maximum in the tail past the last block; with NaN an index in
  range."""
  from specjax.sampling import first_argmax

  rng = np.random.default_rng(size)
  rows = [rng.standard_normal(size), np.full(size, -np.inf), np.zeros(size)]
  tied = rng.standard_normal(size)
  for i in rng.choice(size, 3, replace=False):
    tied[i] = 9.0
  rows.append(tied)
  for where in (0, size // 2, size - 1):
    row = rng.standard_normal(size)
    row[where] = 5.0
    rows.append(row)
    inf = rng.standard_normal(size)
    inf[[where, size - 1]] = np.inf
    rows.append(inf)
  x = np.stack(rows).astype(np.float32)  # [R, V]
  for shape in ((x.shape[0], size), (2, x.shape[0] // 2, size)):
    got = jax.jit(first_argmax)(jnp.asarray(x[:np.prod(shape[:-1])].reshape(shape)))
    want = np.argmax(x[:np.prod(shape[:-1])].reshape(shape), axis=-1)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
  nan = x.copy()
  nan[:, ::3] = np.nan
  got = np.asarray(jax.jit(first_argmax)(jnp.asarray(nan)))
  assert ((0 <= got) & (got < size)).all()
