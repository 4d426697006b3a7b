"""Qwen3, Gemma 3 (text) and Phi-3 checkpoints checked against transformers (tiny random models).

Each family is a random transformers model (every parameter perturbed, so the query/key norms, the
``1 + w`` norms and the fused projections are not their initial values) saved with ``save_pretrained``
and loaded with :func:`specjax.hf.load_hf`. Each config turns on what makes the family differ from Llama:
Qwen3 a ``head_dim`` unlike ``hidden_size / heads`` and a sliding-window layer; Gemma 3 one local and one
global layer with a window shorter than the test sequence, different local and global rotary bases,
linear rope scaling on the global layer and final soft-capping; Phi-3 partial rotary, LongRoPE (within
its original context) and a window on every layer. Properties: float32 logits within ``ATOL`` of
transformers (full and cached), greedy tokens equal, speculation with a draft equal to plain greedy, exact
export round trips, the chat template of ``tokenizer_config.json`` rendered as transformers renders it,
and refusals naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

import specjax
from specjax import hf
from specjax.models.llama import Llama
from test_hf import (VOCAB, _assert_same_params, _copy_checkpoint, _edit_config, _hf_logits, _our_logits,
                     _tokenizer)

ATOL = 1e-4  # float32 logits, ours vs transformers (eager attention); the measured gaps are in the docs
FAMILIES = ("qwen3", "gemma3_text", "phi3")
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)

# Special tokens of each family's chat format: the first words of the test vocabulary.
_SPECIALS = {
    "qwen3": ["<|im_start|>", "<|im_end|>"],
    "gemma3_text": ["<start_of_turn>", "<end_of_turn>"],
    "phi3": ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
}
# Short templates in each family's turn format (the shipped ones add tools and reasoning on top).
_TEMPLATES = {
    "qwen3": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "gemma3_text": ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
                    "else m['role'] %}<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n"
                    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "phi3": ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"),
}
_END_OF_TURN = {"qwen3": "<|im_end|>", "gemma3_text": "<end_of_turn>", "phi3": "<|end|>"}


def _hf_config(family: str, **overrides):
  if family == "qwen3":  # head_dim 16 != 32 / 4; layer 1 slides over 5 positions
    kw = dict(_COMMON, head_dim=16, use_sliding_window=True, sliding_window=5, max_window_layers=1,
              tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cls = transformers.Qwen3Config
  elif family == "gemma3_text":  # local layer 0 (window 4, base 1e4), global layer 1 (base 1e6, linear x2)
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    kw = dict(_COMMON, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
              rope_parameters=rope, query_pre_attn_scalar=12, final_logit_softcapping=3.0)
    cls = transformers.Gemma3TextConfig
  else:  # phi3: rotary on half of each head, longrope (short factors, attention factor), a window everywhere
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 2.5], "long_factor": [3.0, 5.0], "original_max_position_embeddings": 64}
    kw = dict(_COMMON, sliding_window=6, tie_word_embeddings=False, rope_parameters=rope,
              original_max_position_embeddings=64)
    cls = transformers.Phi3Config
  kw.update(overrides)
  return cls(**kw)


def _family_tokenizer(family: str):
  tok = _tokenizer()
  vocab = tok.get_vocab()
  specials = _SPECIALS[family]
  # Rename the first words to the family's special tokens (ids unchanged), registered as special.
  renamed = {(specials[i - 2] if 2 <= i < 2 + len(specials) else name): i for name, i in vocab.items()}
  tok = Tokenizer(models.WordLevel(renamed, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens([AddedToken(s, special=True) for s in specials + ["<unk>", "<eos>"]])
  return tok


def _make_checkpoint(path, family: str, seed: int = 0, **overrides):
  """A random transformers model of ``family`` plus tokenizer files in ``path``; returns the model."""
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(_hf_config(family, **overrides),
                                                        attn_implementation="eager")
  with torch.no_grad():
    for p in model.parameters():  # every weight off its initial value, norms included
      p.add_(0.2 * torch.randn_like(p))
  model.eval()
  model.save_pretrained(str(path))
  _family_tokenizer(family).save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": _TEMPLATES[family], "eos_token": "<eos>", "bos_token": "<unk>",
               "tokenizer_class": "PreTrainedTokenizerFast"}, f)
  return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """family -> (directory, transformers model), built once for the module."""
  return {f: (str(p), _make_checkpoint(p, f)) for f in FAMILIES for p in [tmp_path_factory.mktemp(f)]}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_full_and_cached(checkpoints, family):
  path, hf_model = checkpoints[family]
  model, _ = hf.load_hf(path)
  tokens = np.random.default_rng(1).integers(0, VOCAB, size=(2, 14))
  want = _hf_logits(hf_model, tokens)  # [B, T, V]
  full = _our_logits(model, tokens, [14])
  cached = _our_logits(model, tokens, [5] + [1] * 9)  # prefill, then token by token past the windows
  print(f"{family}: max |logit diff| full {np.abs(full - want).max():.2e}, "
        f"cached {np.abs(cached - want).max():.2e}, max |logit| {np.abs(want).max():.2f}")
  np.testing.assert_allclose(full, want, atol=ATOL, rtol=0)
  np.testing.assert_allclose(cached, want, atol=ATOL, rtol=0)
  assert np.abs(want).max() > 0.1


def _variant(model, **change):
  """``model``'s weights in a Llama built with ``change`` applied to its config (weights it lacks dropped)."""
  fresh = Llama(model.cfg.replace(**change), rngs=nnx.Rngs(0))
  have = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  keep = lambda a, b: {k: keep(a[k], v) if isinstance(v, dict) else a[k] for k, v in b.items()}
  state = nnx.state(fresh, nnx.Param)
  nnx.replace_by_pure_dict(state, keep(have, nnx.to_pure_dict(state)))
  nnx.update(fresh, state)
  return fresh


def test_the_family_features_matter(checkpoints):
  """Dropping any mapped feature moves the logits far outside ATOL: the parity test can fail."""
  tokens = np.random.default_rng(1).integers(0, VOCAB, size=(1, 14))
  whole_heads = lambda cfg: dict(rotary_dim=None, rope_scaling=dataclasses.replace(
      cfg.rope_scaling, freq_factors=cfg.rope_scaling.freq_factors * 2))  # same factors, whole heads
  for family, change in (("qwen3", lambda cfg: dict(qk_norm=False)),
                         ("gemma3_text", lambda cfg: dict(local_rope_base=None)),
                         ("phi3", whole_heads), ("phi3", lambda cfg: dict(rope_scaling=None))):
    path, hf_model = checkpoints[family]
    model = hf.load_hf_model(path)
    broken = _variant(model, **change(model.cfg))
    gap = np.abs(_our_logits(broken, tokens, [14]) - _hf_logits(hf_model, tokens)).max()
    assert gap > 100 * ATOL, (family, change, gap)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_speculative_match_transformers(checkpoints, family, tmp_path):
  path, hf_model = checkpoints[family]
  prompt = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, size=7)]
  with torch.no_grad():
    want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
  # A one-layer random draft of the same family; speculation keeps the target's greedy output.
  one = dict(num_hidden_layers=1, **({"layer_types": ["full_attention"]} if family == "gemma3_text" else {}))
  _make_checkpoint(tmp_path, family, seed=7, **one)
  target, draft, _ = hf.load_hf_pair(path, str(tmp_path))
  assert specjax.generate(target, [prompt], max_new_tokens=16).rows()[0] == want.tolist()
  spec = specjax.generate(target, [prompt], draft=draft, spec=specjax.SpecConfig(k=3), max_new_tokens=16)
  assert spec.rows()[0] == want.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_and_transformers_loads_export(checkpoints, family, tmp_path):
  path, hf_model = checkpoints[family]
  model, tok = hf.load_hf(path)
  hf.save_hf(model, tok, str(tmp_path))
  again, _ = hf.load_hf(str(tmp_path))
  _assert_same_params(model, again)
  assert again.cfg == model.cfg
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
  assert type(reloaded) is type(hf_model)
  tokens = np.random.default_rng(4).integers(0, VOCAB, size=(2, 12))
  np.testing.assert_allclose(_hf_logits(reloaded, tokens), _hf_logits(hf_model, tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_from_tokenizer_config(checkpoints, family):
  path, _ = checkpoints[family]
  loaded = specjax.load(path)
  ref = transformers.AutoTokenizer.from_pretrained(path)
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "w3 w4"},
              {"role": "assistant", "content": "w5"}, {"role": "user", "content": "w6"}]
  if family == "gemma3_text":
    messages = messages[1:]  # the short Gemma template has no system turn
  for prompt in (True, False):
    assert loaded.chat.render(messages, add_generation_prompt=prompt) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=prompt)
  assert loaded.chat.encode(loaded.tokenizer, messages) == list(
      ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))
  assert loaded.chat.end_of_turn_ids[0] == loaded.tokenizer.encode(_END_OF_TURN[family])[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_num_params_counts_every_loaded_parameter(checkpoints, family):
  model, _ = hf.load_hf(checkpoints[family][0])
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert model.cfg.num_params == count == sum(p.numel() for p in checkpoints[family][1].parameters())


# ------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("family, changes, match", [
    ("phi3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
     r"rope_parameters.rope_type='linear' is not supported \(supported: 'default', 'longrope', 'su', 'yarn'\)"),
    ("phi3", {"rope_parameters": ..., "rope_scaling": {"type": "su", "short_factor": [1.0] * 2}},
     "rope_scaling of rope_type 'su' lacks 'long_factor'"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                  "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}},
     r"freq_factors must hold one factor per rotary pair \(2\), got 3"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.2}},
     "partial_rotary_factor=0.2 is not supported"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     r"rope_type='yarn' is not supported \(supported: 'default', 'linear', 'llama3'\)"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported"),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5 is not supported"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type='linear' is not supported"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
     r"rope_parameters.full_attention.rope_type='yarn' is not supported \(supported: 'default'"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ("gemma3_text", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     "model_type='gemma3' .*not supported.*gemma3_text"),
])
def test_unsupported_options_are_refused_naming_the_field(checkpoints, tmp_path, family, changes, match):
  path = _copy_checkpoint(checkpoints[family][0], tmp_path)
  _edit_config(path, **changes)
  with pytest.raises(hf.CheckpointFileError, match=match):
    hf.load_hf_model(path)


def test_phi3_longrope_holds_within_the_original_context(checkpoints, tmp_path):
  """LongRoPE is exact while the sequence fits original_max_position_embeddings (transformers uses the
  short factors there), so the loaded model stops at that length; the older "su" spelling is the same."""
  path = _copy_checkpoint(checkpoints["phi3"][0], tmp_path)
  cfg = hf.load_hf_model(path).cfg
  assert cfg.max_seq_len == 64 and cfg.rope_scaling.freq_factors == (1.0, 2.5)
  assert cfg.rope_scaling.attention_factor == pytest.approx((1 + np.log(2) / np.log(64)) ** 0.5)
  rope = json.loads(open(os.path.join(path, "config.json")).read())["rope_parameters"]
  _edit_config(path, rope_parameters=..., rope_theta=rope["rope_theta"], partial_rotary_factor=0.5,
               rope_scaling={"type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]})
  assert hf.load_hf_model(path).cfg == cfg


def test_gemma3_legacy_rope_fields_and_pattern_load(checkpoints, tmp_path):
  """Older Gemma 3 config.json files: rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern."""
  path = _copy_checkpoint(checkpoints["gemma3_text"][0], tmp_path)
  new = hf.load_hf_model(path).cfg
  _edit_config(path, rope_parameters=..., layer_types=..., rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 2.0}, sliding_window_pattern=2)
  assert hf.load_hf_model(path).cfg == new
  assert new.local_rope_base == 1e4 and new.rope_base == 1e6 and new.sliding_layers == (True, False)
