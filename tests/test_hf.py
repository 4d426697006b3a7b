"""Hugging Face import/export checked against transformers itself (tiny random models, no downloads).

Every family is built as a random transformers model with every parameter perturbed (so norm weights,
biases and offsets are not their trivial initial values), saved with ``save_pretrained`` and loaded with
:func:`specjax.hf.load_hf`; the properties are then exact agreement with transformers (float32 logits
within ``ATOL``, greedy tokens identical) and exact parameter round trips.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

import specjax
from specjax import hf
from specjax.models.llama import Llama, LlamaConfig
from specjax.tokenizer import HFTokenizer, TokenizerError, check_same_vocab, load_hf_tokenizer

ATOL = 1e-4  # float32 logits, ours vs transformers (eager attention)
VOCAB = 96
FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gemma2", "gpt2")

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _hf_config(family: str, **overrides):
  if family == "llama":  # llama3 rope scaling with a short original context, so every regime occurs
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    kw = dict(_COMMON, rope_parameters=rope, tie_word_embeddings=False)
    cls = transformers.LlamaConfig
  elif family == "mistral":
    kw, cls = dict(_COMMON, sliding_window=5, tie_word_embeddings=False), transformers.MistralConfig
  elif family == "qwen2":
    kw = dict(_COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1,
              tie_word_embeddings=True)
    cls = transformers.Qwen2Config
  elif family == "gemma":
    kw, cls = dict(_COMMON), transformers.GemmaConfig
  elif family == "gemma2":
    kw = dict(_COMMON, sliding_window=6, query_pre_attn_scalar=12, attn_logit_softcapping=1.5,
              final_logit_softcapping=2.0)
    cls = transformers.Gemma2Config
  else:
    kw = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=None,
              eos_token_id=None)
    cls = transformers.GPT2Config
  kw.update(overrides)
  return cls(**kw)


def _tokenizer(words: int = VOCAB, shift: int = 0) -> Tokenizer:
  """A word-level tokenizer of exactly ``words`` tokens; ``shift`` permutes the ids (a mismatched pair)."""
  names = ["<unk>", "<eos>"] + [f"w{i}" for i in range(words - 2)]
  vocab = {name: (i + shift) % words for i, name in enumerate(names)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  return tok


def _make_checkpoint(path, family: str, seed: int = 0, **overrides):
  """Saves a random transformers model of ``family`` plus a tokenizer to ``path``; returns the model."""
  torch.manual_seed(seed)
  config = _hf_config(family, **overrides)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():
    for p in model.parameters():  # move every weight off its initial value, norms and biases included
      p.add_(0.2 * torch.randn_like(p))
  model.eval()
  model.save_pretrained(str(path))
  _tokenizer().save(os.path.join(path, "tokenizer.json"))
  return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """family -> (directory, transformers model), built once for the module."""
  out = {}
  for family in FAMILIES:
    path = tmp_path_factory.mktemp(family)
    out[family] = (str(path), _make_checkpoint(path, family))
  return out


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


@jax.jit
def _step(graphdef, state, tokens, cache):
  logits, _, cache = nnx.merge(graphdef, state)(tokens, cache)
  return logits, cache


def _our_logits(model, tokens: np.ndarray, chunks: list[int]) -> np.ndarray:
  """Logits for ``tokens [B, T]`` fed through the cache in consecutive chunks of the given sizes."""
  graphdef, state = nnx.split(model)
  cache = model.init_cache(tokens.shape[0], tokens.shape[1])
  out, start = [], 0
  for size in chunks:
    logits, cache = _step(graphdef, state, jnp.asarray(tokens[:, start:start + size]), cache)
    out.append(np.asarray(logits))
    start += size
  assert start == tokens.shape[1] and int(cache.lengths[0]) == tokens.shape[1]
  return np.concatenate(out, axis=1)


# ------------------------------------------------------------------------------ logits and tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_full_and_cached(checkpoints, family):
  path, hf_model = checkpoints[family]
  model, tok = hf.load_hf(path, dtype="float32")
  tokens = np.random.default_rng(1).integers(0, VOCAB, size=(2, 14))
  want = _hf_logits(hf_model, tokens)  # [B, T, V]
  full = _our_logits(model, tokens, [14])
  np.testing.assert_allclose(full, want, atol=ATOL, rtol=0)
  # Prefill 5, then token by token: positions, cache writes and (sliding) masks all exercised.
  cached = _our_logits(model, tokens, [5] + [1] * 9)
  np.testing.assert_allclose(cached, want, atol=ATOL, rtol=0)
  assert np.abs(want).max() > 0.1  # the comparison is not between two near-zero tensors


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_transformers(checkpoints, family, tmp_path):
  path, hf_model = checkpoints[family]
  model, _ = hf.load_hf(path)
  prompt = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, size=7)]
  with torch.no_grad():
    hf_out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):]
  hf_out = hf_out.tolist()
  assert len(hf_out) == 32
  ours = specjax.generate(model, [prompt], max_new_tokens=32)
  assert ours.rows()[0] == hf_out
  # Speculative decoding with a different random draft of the same family keeps the target's output.
  _make_checkpoint(tmp_path, family, seed=7, **{"n_layer" if family == "gpt2" else "num_hidden_layers": 1})
  target, draft, _ = hf.load_hf_pair(path, str(tmp_path))
  spec = specjax.generate(target, [prompt], draft=draft, spec=specjax.SpecConfig(k=3),
                          max_new_tokens=32)
  assert spec.rows()[0] == hf_out


def test_gpt2_hub_layout_loads(checkpoints, tmp_path):
  """The hub's gpt2 files name tensors without "transformer." and carry causal-mask buffers."""
  from safetensors.numpy import load_file, save_file

  path = _copy_checkpoint(checkpoints["gpt2"][0], tmp_path)
  file = os.path.join(path, "model.safetensors")
  tensors = {k.removeprefix("transformer."): v for k, v in load_file(file).items()}
  tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 128, 128), np.float32))
  save_file(tensors, file, metadata={"format": "pt"})
  _assert_same_params(hf.load_hf(path)[0], hf.load_hf(checkpoints["gpt2"][0])[0])


def test_bfloat16_load_casts_every_weight_and_stays_close(checkpoints):
  path, hf_model = checkpoints["llama"]
  model, _ = hf.load_hf(path, dtype="bfloat16")
  dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
  assert dtypes == {jnp.dtype(jnp.bfloat16)} and model.cfg.dtype == "bfloat16"
  tokens = np.random.default_rng(3).integers(0, VOCAB, size=(1, 10))
  ours = _our_logits(model, tokens, [10])
  assert ours.dtype == np.float32
  np.testing.assert_allclose(ours, _hf_logits(hf_model, tokens), atol=0.15, rtol=0)


def test_sharded_checkpoint_loads_like_single_file(checkpoints, tmp_path):
  path, hf_model = checkpoints["qwen2"]
  hf_model.save_pretrained(str(tmp_path), max_shard_size="20KB")
  assert os.path.isfile(tmp_path / "model.safetensors.index.json")
  _tokenizer().save(str(tmp_path / "tokenizer.json"))
  a, _ = hf.load_hf(path)
  b, _ = hf.load_hf(str(tmp_path))
  _assert_same_params(a, b)


# ------------------------------------------------------------------------------------ round trip


def _assert_same_params(a, b):
  pa, pb = nnx.to_pure_dict(nnx.state(a, nnx.Param)), nnx.to_pure_dict(nnx.state(b, nnx.Param))
  assert jax.tree.structure(pa) == jax.tree.structure(pb)
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("family", FAMILIES)
def test_export_import_round_trip_and_transformers_loads_export(checkpoints, family, tmp_path):
  path, hf_model = checkpoints[family]
  model, tok = hf.load_hf(path)
  hf.save_hf(model, tok, str(tmp_path))
  again, tok2 = hf.load_hf(str(tmp_path))
  _assert_same_params(model, again)
  assert again.cfg == model.cfg
  check_same_vocab(tok, tok2)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
  assert type(reloaded) is type(hf_model)
  tokens = np.random.default_rng(4).integers(0, VOCAB, size=(2, 12))
  np.testing.assert_allclose(_hf_logits(reloaded, tokens), _hf_logits(hf_model, tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie, dtype", [(False, "float32"), (True, "bfloat16")])
def test_native_llama_exports_to_llama_for_causal_lm_with_byte_tokenizer(tmp_path, tie, dtype):
  cfg = LlamaConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                    tie_embeddings=tie, rope_base=500000.0, dtype=dtype, param_dtype=dtype)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  hf.save_hf(model, specjax.ByteTokenizer(), str(tmp_path))
  again, tok = hf.load_hf(str(tmp_path), dtype=dtype)
  _assert_same_params(model, again)
  # transformers runs the exported weights (upcast to float32) like specjax does.
  hf_model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager",
                                                           dtype=torch.float32)
  assert type(hf_model) is transformers.LlamaForCausalLM
  ours32, _ = hf.load_hf(str(tmp_path), dtype="float32")
  tokens = np.random.default_rng(5).integers(0, 257, size=(2, 12))
  np.testing.assert_allclose(_our_logits(ours32, tokens, [12]), _hf_logits(hf_model, tokens), atol=ATOL,
                             rtol=0)
  # The exported tokenizer.json gives ByteTokenizer's ids, through transformers too.
  text = "naïve café, 日本語 🙂"
  fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
  assert fast(text)["input_ids"] == specjax.ByteTokenizer().encode(text)
  assert tok.eos_id == specjax.ByteTokenizer.eos_id and tok.decode(tok.encode(text)) == text


def test_export_refuses_configs_no_family_expresses(tmp_path):
  cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, norm_offset=1.0)
  with pytest.raises(hf.CheckpointFileError, match="embed_scale"):
    hf.save_hf(Llama(cfg, rngs=nnx.Rngs(0)), None, str(tmp_path))


def test_generate_accepts_hf_tokenizer(checkpoints):
  path, _ = checkpoints["gemma"]
  model, tok = hf.load_hf(path)
  out = specjax.generate(model, "w1 w2 w3", tokenizer=tok, max_new_tokens=5)
  assert out.lengths[0] == 5
  assert out.text[0] == tok.decode(out.rows()[0])


# ------------------------------------------------------------------------------------- bad input


def _copy_checkpoint(src: str, dst) -> str:
  for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
      g.write(f.read())
  return str(dst)


def _edit_config(path: str, **changes):
  file = os.path.join(path, "config.json")
  with open(file) as f:
    config = json.load(f)
  config.update(changes)
  for key, value in changes.items():
    if value is ...:
      del config[key]
  with open(file, "w") as f:
    json.dump(config, f)


def test_missing_files_are_named(checkpoints, tmp_path):
  path, _ = checkpoints["llama"]
  with pytest.raises(hf.CheckpointFileError, match="checkpoint directory not found"):
    hf.load_hf(str(tmp_path / "nowhere"))
  for name in ("config.json", "model.safetensors", "tokenizer.json"):
    d = tmp_path / name.replace(".", "_")
    d.mkdir()
    _copy_checkpoint(path, d)
    os.remove(d / name)
    error = TokenizerError if name == "tokenizer.json" else hf.CheckpointFileError
    with pytest.raises(error, match=f"{name}: file not found"):
      hf.load_hf(str(d))


def test_missing_shard_is_named(checkpoints, tmp_path):
  _, hf_model = checkpoints["llama"]
  hf_model.save_pretrained(str(tmp_path), max_shard_size="20KB")
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shard = sorted(set(index["weight_map"].values()))[-1]
  os.remove(tmp_path / shard)
  with pytest.raises(hf.CheckpointFileError, match=f"{shard}: file not found"):
    hf.load_hf_model(str(tmp_path))


def test_truncated_safetensors_is_named(checkpoints, tmp_path):
  path = _copy_checkpoint(checkpoints["mistral"][0], tmp_path)
  file = os.path.join(path, "model.safetensors")
  data = open(file, "rb").read()
  with open(file, "wb") as f:
    f.write(data[: len(data) // 2])
  with pytest.raises(hf.CheckpointFileError, match="model.safetensors: not a valid safetensors file"):
    hf.load_hf(path)


def test_shape_disagreeing_with_config_is_named(checkpoints, tmp_path):
  path = _copy_checkpoint(checkpoints["llama"][0], tmp_path)
  _edit_config(path, intermediate_size=48)
  want = (r"model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight' has shape \[32, 64\] but "
          r"config.json implies \[32, 48\]")
  with pytest.raises(hf.CheckpointFileError, match=want):
    hf.load_hf(path)


def test_missing_and_unexpected_tensors_are_named(checkpoints, tmp_path):
  path = _copy_checkpoint(checkpoints["gemma"][0], tmp_path)
  _edit_config(path, num_hidden_layers=3)
  with pytest.raises(hf.CheckpointFileError,
                     match=r"lacks 9 tensor\(s\) config.json requires, e.g. \['model.layers.2"):
    hf.load_hf(path)
  _edit_config(path, num_hidden_layers=1)
  with pytest.raises(hf.CheckpointFileError, match="unexpected tensor 'model.layers.1"):
    hf.load_hf(path)


@pytest.mark.parametrize("changes, match", [
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "model_type='bert' is not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures="),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type='yarn' is not supported"),
    ({"rope_parameters": ..., "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type='dynamic' is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"hidden_act": "relu2"}, "hidden_act='relu2' is not supported"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config="),
    ({"num_key_value_heads": 3},
     r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ({"hidden_size": ...}, "required field 'hidden_size' is missing"),
])
def test_unsupported_config_is_refused_naming_the_field(checkpoints, tmp_path, changes, match):
  path = _copy_checkpoint(checkpoints["llama"][0], tmp_path)
  _edit_config(path, **changes)
  with pytest.raises(hf.CheckpointFileError, match=match):
    hf.load_hf(path)


def test_legacy_rope_fields_load(checkpoints, tmp_path):
  """Older config.json files spell the rope as rope_theta + rope_scaling (with "type" or "rope_type")."""
  path = _copy_checkpoint(checkpoints["llama"][0], tmp_path)
  new, _ = hf.load_hf(path)
  rope = json.loads(open(os.path.join(path, "config.json")).read())["rope_parameters"]
  theta = rope.pop("rope_theta")
  rope["type"] = rope.pop("rope_type")
  _edit_config(path, rope_parameters=..., rope_theta=theta, rope_scaling=rope)
  old, _ = hf.load_hf(path)
  assert old.cfg == new.cfg and old.cfg.rope_scaling.kind == "llama3"


def test_pair_loader_refuses_a_mismatched_draft_tokenizer(checkpoints, tmp_path):
  """check_same_vocab itself is tested in test_tokenizer.py; here load_hf_pair runs it."""
  target = load_hf_tokenizer(checkpoints["llama"][0])
  check_same_vocab(target, HFTokenizer(_tokenizer()))  # an identical vocabulary passes
  # The draft directory's tokenizer.json is the odd one out.
  draft = _copy_checkpoint(checkpoints["llama"][0], tmp_path)
  HFTokenizer(_tokenizer(VOCAB, shift=3)).save(os.path.join(draft, "tokenizer.json"))
  with pytest.raises(TokenizerError, match="draft tokenizer maps token id 0 to"):
    hf.load_hf_pair(checkpoints["llama"][0], draft)


def test_eos_id_comes_from_config(checkpoints, tmp_path):
  path = _copy_checkpoint(checkpoints["llama"][0], tmp_path)
  assert load_hf_tokenizer(path).eos_id is None
  _edit_config(path, eos_token_id=[1, 2])
  assert load_hf_tokenizer(path).eos_id == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_num_params_counts_every_loaded_parameter(checkpoints, family):
  model, _ = hf.load_hf(checkpoints[family][0])
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert model.cfg.num_params == count
  assert count == sum(p.numel() for p in checkpoints[family][1].parameters())
