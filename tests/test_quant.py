"""Weight-only quantization (int8, int4): the quantized product against a numpy reference, exact greedy
speculation and the target's distribution with a quantized target and proposers, refusals by field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import SMALL, make_model, perturbed_copy
from test_distribution import TINY, chi_square_pvalue, exact_joint, sample_joint
from specjax import SamplingConfig, SpecConfig
from specjax.models.heads import build_heads
from specjax.proposers import Eagle
from specjax.quant import QuantizedArray, quantize, quantize_array, take_rows, weight_bytes


def numpy_dequantize(qa: QuantizedArray) -> np.ndarray:
  """The reference: codes unpacked with numpy, ``q * scale (+ low)`` in float64."""
  q = np.asarray(qa.q)
  if qa.bits == 4:
    q = np.stack([q & 0xF, q >> 4], axis=qa.axis + 1).reshape(qa.shape)
  g = qa.shape[qa.axis] // qa.group
  split = qa.shape[:qa.axis] + (g, qa.group) + qa.shape[qa.axis + 1:]
  w = q.astype(np.float64).reshape(split) * np.expand_dims(np.asarray(qa.scale, np.float64), qa.axis + 1)
  if qa.low is not None:
    w = w + np.expand_dims(np.asarray(qa.low, np.float64), qa.axis + 1)
  return w.reshape(qa.shape)


@pytest.mark.parametrize("bits,group,axis", [(8, None, 0), (8, 32, 0), (4, 32, 0), (4, 16, 1)])
def test_quantized_matmul_matches_numpy_reference(bits, group, axis):
  """The jitted product with a quantized weight equals numpy's product with the reference dequantization to
  1e-5 relative (float32 accumulation over 64 terms), and the quantization error of every weight is at most
  half a step (its group's scale)."""
  rng = np.random.default_rng(bits + axis)
  w = rng.normal(size=(64, 48) if axis == 0 else (48, 64)).astype(np.float32)
  x = rng.normal(size=(2, 3, 64)).astype(np.float32)
  qa = quantize_array(w, bits, axis=axis, group=group)
  ref_w = numpy_dequantize(qa)
  step = np.repeat(np.asarray(qa.scale, np.float64), qa.group, axis=axis)
  assert np.all(np.abs(ref_w - w) <= 0.5 * step * (1 + 1e-3) + 1e-6)
  spec = "btd,df->btf" if axis == 0 else "btd,fd->btf"
  got = jax.jit(lambda x, qa: jnp.einsum(spec, x, qa[...].astype(jnp.float32)))(x, qa)
  want = np.einsum(spec, x.astype(np.float64), ref_w)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  if axis == 1:  # a table quantized along its rows' axis: a lookup dequantizes the rows it reads
    rows = jnp.array([[3, 0], [47, 3]])
    np.testing.assert_allclose(np.asarray(take_rows(qa, rows)), ref_w[np.asarray(rows)], rtol=1e-6, atol=1e-6)


def test_q4_1_blocks_map_onto_int4_exactly():
  """GGUF Q4_1 blocks (``w = m + q d``, ``m`` the block minimum, ``d = (max - min) / 15``, float16 pairs) are
  requantized to the int4 layout without loss: the codes and pairs come back."""
  rng = np.random.default_rng(0)
  d = rng.uniform(0.01, 0.1, size=(4, 24)).astype(np.float16).astype(np.float32)
  m = -rng.uniform(0.1, 1.0, size=(4, 24)).astype(np.float16).astype(np.float32)
  q = rng.integers(0, 16, size=(4, 32, 24))
  q[:, 0], q[:, 1] = 0, 15  # the block's minimum and maximum, as Q4_1's quantizer makes them
  w = (m[:, None] + q * d[:, None]).reshape(128, 24).astype(np.float32)
  qa = quantize_array(w, 4, axis=0, group=32)
  np.testing.assert_array_equal(np.asarray(qa.scale, np.float32), d)
  np.testing.assert_array_equal(np.asarray(qa.low, np.float32), m)
  np.testing.assert_allclose(np.asarray(qa.dequantize()), w, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def quantized_models():
  target = make_model(SMALL, seed=0)
  draft = perturbed_copy(target, 0.3, seed=1)
  return {dtype: (quantize(target, dtype, group=16 if dtype == "int4" else None), quantize(draft, dtype))
          for dtype in ("int8", "int4")}


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_speculation_equals_quantized_greedy(quantized_models, dtype):
  """A quantized target with a quantized draft model (and, for int4, a quantized EAGLE head): speculative greedy
  equals the quantized target's own greedy token for token; the weights take under 30% (int8) / 28% (int4: 6 bits
  a weight with groups of 16) of float32's bytes."""
  target, draft = quantized_models[dtype]
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, SMALL.vocab_size, n).tolist() for n in (3, 9)]
  base = specjax.generate(target, prompts, max_new_tokens=24)
  spec = specjax.generate(target, prompts, draft=draft, spec=SpecConfig(k=3), max_new_tokens=24)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  assert 0 < spec.stats.accepted_tokens < spec.stats.drafted_tokens
  if dtype == "int4":  # a quantized head too (one dtype: each proposer costs a compile)
    head = quantize(build_heads("eagle1", target.cfg, seed=2), dtype)
    eagle = specjax.generate(target, prompts, proposer=Eagle(head), spec=SpecConfig(k=2), max_new_tokens=24)
    np.testing.assert_array_equal(eagle.tokens, base.tokens)
  float_bytes = weight_bytes(make_model(SMALL, seed=0))
  assert weight_bytes(target) < float_bytes * (0.3 if dtype == "int8" else 0.28)


def test_quantized_target_distribution():
  """Sampling with an int4 target and an int4 draft follows the quantized target's warped law (int4, the
  coarser of the two: int8 shares every code path but the unpacking)."""
  target = quantize(make_model(TINY, seed=0), "int4", group=8)
  draft = quantize(make_model(TINY, seed=5), "int4", group=8)
  sampling = SamplingConfig(temperature=0.8, top_k=8)
  counts, st = sample_joint(target, draft, sampling, 2, 2, n=20_000, seed=1)
  assert 0.05 < st.acceptance_rate < 0.95
  assert chi_square_pvalue(counts, exact_joint(target, sampling, 2)) > 1e-3


def test_bad_quantization_options_name_the_field():
  model = make_model(SMALL, seed=0)
  with pytest.raises(ValueError, match=r"dtype must be one of \('int8', 'int4'\), got 'int3'"):
    quantize(model, "int3")
  with pytest.raises(ValueError, match=r"group must be an even integer >= 1 for int4, None \(per channel\) or "
                                       r"'default', got 5"):
    quantize(model, "int4", group=5)
  with pytest.raises(ValueError, match=r"group must be an integer >= 1 for int8, .* got 0"):
    quantize(model, "int8", group=0)
  with pytest.raises(ValueError, match=r"group must be an integer >= 1 for int8, .* got 'per-row'"):
    quantize(model, "int8", group="per-row")
  with pytest.raises(ValueError, match=r"group must be an integer >= 1 dividing the quantized axis \(48\)"):
    quantize_array(np.ones((48, 4), np.float32), 8, group=5)
  with pytest.raises(ValueError, match=r"activation_dtype must be one of \('float32', 'bfloat16', 'float16'\), "
                                       r"got 'int8'"):
    quantize(model, "int8", activation_dtype="int8")
  with pytest.raises(ValueError, match=r"bits must be one of \(4, 8\), got 3"):
    quantize_array(np.ones((4, 4), np.float32), 3)
  with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16', 'float16', 'int8', 'int4', "
                                       r"'mixed'\), got 'q4_1'"):
    specjax.load("stdlib-coder", dtype="q4_1")


@pytest.mark.parametrize("kind", ["bfloat16", "int4"])
def test_token_lookups_in_a_loop_never_convert_the_whole_table(kind):
  """``take_rows`` inside a decode-style loop reads its rows without a float32 copy of the whole table: XLA:CPU
  gathers bfloat16 in float32 and, without the barrier, converts the whole table and hoists that out of the loop
  (21 ms per call for SmolLM2's embedding; this test fails then). The rows equal the dequantized table's."""
  rng = np.random.default_rng(0)
  table = rng.normal(size=(4096, 64)).astype(np.float32)
  stored = (jnp.asarray(table, jnp.bfloat16) if kind == "bfloat16"
            else quantize_array(table, int(kind[3:]), axis=1, group=32))
  dense = np.asarray(stored.astype(jnp.float32) if kind == "bfloat16" else stored.dequantize(), np.float32)

  @jax.jit
  def lookups(stored, tokens):
    def body(carry):
      i, out = carry
      rows = take_rows(stored, tokens[i][None]).astype(jnp.float32)
      return i + 1, out.at[i].set(rows[0])
    return jax.lax.while_loop(lambda c: c[0] < tokens.shape[0], body, (0, jnp.zeros((tokens.shape[0], 64))))[1]

  tokens = jnp.asarray([5, 4095, 0, 1234], jnp.int32)
  temp = lookups.lower(stored, tokens).compile().memory_analysis().temp_size_in_bytes
  assert temp < table.nbytes // 4, f"{temp} bytes of temporaries: the whole table is converted to float32"
  np.testing.assert_array_equal(np.asarray(lookups(stored, tokens)), dense[np.asarray(tokens)])
