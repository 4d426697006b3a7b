"""specjax.load: the bundled pair by name (the CLI's default) and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax


@pytest.fixture(scope="module")
def pair():
  return specjax.load("stdlib-coder")


def test_bundled_pair_is_exact_and_its_draft_agrees(pair):
  target, tok, draft = pair
  assert target.cfg.vocab_size == draft.cfg.vocab_size == tok.vocab_size
  prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n"]
  base = specjax.generate(target, prompts, max_new_tokens=24, tokenizer=tok)
  spec = specjax.generate(target, prompts, draft=draft, spec=specjax.SpecConfig(k=4), max_new_tokens=24,
                          tokenizer=tok)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  assert spec.text == base.text
  # A trained, distilled draft: far above the chance agreement of a random one (about 1 / vocab).
  assert spec.stats.acceptance_rate > 0.2


def test_load_in_bfloat16(pair):
  target16, tok, draft16 = specjax.load("stdlib-coder", dtype="bfloat16")
  for model in (target16, draft16):
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    assert model.cfg.dtype == "bfloat16"
  out = specjax.generate(target16, ["x = 1\n"], draft=draft16, max_new_tokens=8, tokenizer=tok)
  assert out.lengths[0] == 8


@pytest.mark.parametrize("args,match", [
    (("no-such-model",), r"'no-such-model' is neither a known model name \(smollm2-135m-instruct, stdlib-coder\) "
                         r"nor a .gguf file or checkpoint directory"),
    (("stdlib-coder", "int3"), r"dtype must be one of \('float32', 'bfloat16', 'float16', 'int8', 'int4', "
                               r"'mixed'\), got 'int3'"),
])
def test_load_errors(args, match):
  with pytest.raises(ValueError, match=match):
    specjax.load(*args)


def test_load_in_mixed_precision(pair):
  """dtype='mixed': the target's and its heads' weights in bfloat16 with bfloat16 products and float32
  activations, its draft float32; the target's logits and a head's features within bfloat16 rounding of the
  float32 ones (and not equal to them); speculation with the draft and with the head equals the mixed target
  alone."""
  mixed = specjax.load("stdlib-coder", dtype="mixed")
  target, tok, draft = mixed
  assert target.cfg.matmul_dtype == "bfloat16" and target.cfg.dtype == "float32"
  assert {x.dtype for x in jax.tree.leaves(nnx.state(target, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(nnx.state(draft, nnx.Param))} == {jnp.dtype(jnp.float32)}
  assert set(mixed.heads) == set(pair.heads)
  for method, heads in mixed.heads.items():
    assert heads.cfg.matmul_dtype == "bfloat16" and heads.cfg.dtype == "float32", method
    assert {x.dtype for x in jax.tree.leaves(nnx.state(heads, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}, method
  eagle, eagle32 = mixed.heads["eagle"], pair.heads["eagle"]
  aux = jax.random.normal(jax.random.key(0), (1, 3, len(eagle.cfg.aux_layers) * target.cfg.d_model))
  got, want = np.asarray(eagle.input_features(None, aux)), np.asarray(eagle32.input_features(None, aux))
  assert got.dtype == np.float32 and 0 < np.abs(got - want).max() < 0.05 * np.abs(want).max()
  tokens = jnp.asarray([tok.encode("def fibonacci(n):\n")])
  got = np.asarray(target(tokens, target.init_cache(1, 64))[0])
  want = np.asarray(pair.model(tokens, pair.model.init_cache(1, 64))[0])
  assert 0 < np.abs(got - want).max() < 0.05 * np.abs(want).max()
  prompts = ["def fibonacci(n):\n", "import os\n"]
  alone = specjax.generate(target, prompts, max_new_tokens=16, tokenizer=tok)
  spec = specjax.generate(target, prompts, draft=draft, spec=specjax.SpecConfig(k=4), max_new_tokens=16, tokenizer=tok)
  np.testing.assert_array_equal(spec.tokens, alone.tokens)
  # Eight rows: the batch at which the head's bfloat16 LM head was once laid out transposed (a product XLA:CPU
  # lacks), when its logits were scattered into the target's vocabulary.
  prompts = prompts * 4
  alone = specjax.generate(target, prompts, max_new_tokens=16, tokenizer=tok)
  head = specjax.generate(target, prompts, proposer=specjax.proposers.for_heads(eagle), spec=specjax.SpecConfig(k=3),
                          max_new_tokens=16, tokenizer=tok)
  np.testing.assert_array_equal(head.tokens, alone.tokens)
  assert head.stats.acceptance_rate > 0.2  # a trained head, in bfloat16: still far above chance


def test_mixed_precision_refusals():
  from specjax.loading import mixed_precision
  from specjax.models import GPT2, GPT2Config
  from specjax.quant import quantize

  gpt2 = GPT2(GPT2Config(vocab_size=32, d_model=32, n_layers=1, n_heads=2, max_seq_len=32), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dtype 'mixed' applies to Llama-family models and their heads, got a GPT2"):
    mixed_precision(gpt2)
  with pytest.raises(ValueError, match="quant_group applies to dtype 'int8' or 'int4' only"):
    specjax.load("stdlib-coder", dtype="mixed", quant_group=8)
  target = specjax.load("stdlib-coder").model
  with pytest.raises(ValueError, match="quantized"):
    mixed_precision(quantize(target, "int8"))
  from specjax.models.heads import HeadConfig

  with pytest.raises(ValueError, match=r"HeadConfig.matmul_dtype must be one of \(None, 'bfloat16'\), got 'float16'"):
    HeadConfig.for_target("eagle3", target.cfg, matmul_dtype="float16")


def test_bundled_pair_exports_to_hugging_face_format(pair, tmp_path):
  """The trained pair (BPE tokenizer included) round-trips through the Hugging Face export."""
  target, tok, _ = pair
  specjax.save_hf(target, tok, str(tmp_path))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
  again, tok2 = specjax.load(str(tmp_path))
  text = "def main():\n    return 0\n"
  assert tok2.encode(text) == tok.encode(text)
  for a, b in zip(jax.tree.leaves(nnx.state(target, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
