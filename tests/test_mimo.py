"""MiMo checkpoints: a Qwen2 body plus MTP layers in one directory, loaded as a target and its MTP proposer.

transformers has no MiMo class, so the test writes the files itself: the body is a random transformers Qwen2
model (every weight perturbed) saved with ``save_pretrained``; two MTP layers of random numpy tensors are added
under ``model.mtp_layers.{i}.`` with the names of Xiaomi's ``modeling_mimo.py`` and the MiMo MTP loaders of
vLLM and SGLang, and ``config.json`` becomes ``MiMoForCausalLM`` / ``mimo``. Properties: body logits equal
transformers' Qwen2 within ``ATOL``; each imported MTP layer equals a float64 numpy reference written from
MiMo's equations within ``ATOL``; greedy speculation with the proposer equals the target alone (library and
CLI); export to MiMo's layout reproduces the original tensors bit for bit; MTP layers that do not fit the
body or the config are refused naming the field.
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
from safetensors.numpy import load_file, save_file

import specjax
from specjax.cli import main
from specjax.config import SpecConfig
from specjax.hf import CheckpointFileError
from specjax.mimo import save_mimo
from specjax.models.heads import build_heads
from specjax.proposers import for_heads
from test_hf import VOCAB, _assert_same_params, _copy_checkpoint, _edit_config, _tokenizer

ATOL = 1e-4  # float32 logits vs transformers and vs the float64 reference
D_MODEL, HEADS, KV_HEADS, HEAD_DIM, FF, EPS, THETA = 32, 4, 2, 8, 64, 1e-5, 640000.0
MTP_LAYERS = 2
PREFIX = "model.mtp_layers."


def _mtp_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Random MTP layers in MiMo's names and shapes (norm weights near 1, projections ~ 1 / sqrt(fan in))."""
  out = {}
  shapes = {"token_layernorm.weight": (D_MODEL,), "hidden_layernorm.weight": (D_MODEL,),
            "input_proj.weight": (D_MODEL, 2 * D_MODEL), "input_layernorm.weight": (D_MODEL,),
            "self_attn.q_proj.weight": (HEADS * HEAD_DIM, D_MODEL), "self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
            "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, D_MODEL), "self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
            "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, D_MODEL), "self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,),
            "self_attn.o_proj.weight": (D_MODEL, HEADS * HEAD_DIM), "post_attention_layernorm.weight": (D_MODEL,),
            "mlp.gate_proj.weight": (FF, D_MODEL), "mlp.up_proj.weight": (FF, D_MODEL),
            "mlp.down_proj.weight": (D_MODEL, FF), "final_layernorm.weight": (D_MODEL,)}
  for i in range(MTP_LAYERS):
    for name, shape in shapes.items():
      if name.endswith("layernorm.weight"):
        x = 1.0 + 0.3 * rng.standard_normal(shape)
      elif name.endswith("bias"):
        x = 0.3 * rng.standard_normal(shape)
      else:
        x = rng.standard_normal(shape) * 1.5 / np.sqrt(shape[1])
      out[f"{PREFIX}{i}.{name}"] = x.astype(np.float32)
  return out


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
  """(directory, the transformers Qwen2 model of the body, every tensor of the checkpoint)."""
  path = str(tmp_path_factory.mktemp("mimo"))
  torch.manual_seed(0)
  config = transformers.Qwen2Config(
      vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=FF, num_hidden_layers=2, num_attention_heads=HEADS,
      num_key_value_heads=KV_HEADS, max_position_embeddings=128, rms_norm_eps=EPS, tie_word_embeddings=False,
      rope_parameters={"rope_type": "default", "rope_theta": THETA}, bos_token_id=None, eos_token_id=None,
      pad_token_id=None)
  model = transformers.Qwen2ForCausalLM(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  model.save_pretrained(path)
  weights = os.path.join(path, "model.safetensors")
  tensors = {**load_file(weights), **_mtp_tensors(np.random.default_rng(0))}
  save_file(tensors, weights, metadata={"format": "pt"})
  # MiMo's published config fields (XiaomiMiMo/MiMo config.json): the body's, plus these.
  _edit_config(path, architectures=["MiMoForCausalLM"], model_type="mimo", attention_bias=True, use_mrope=False,
               num_nextn_predict_layers=MTP_LAYERS)
  _tokenizer().save(os.path.join(path, "tokenizer.json"))
  return path, model, tensors


@pytest.fixture(scope="module")
def loaded(mimo):
  return specjax.load(mimo[0])


# ------------------------------------------------------------------------------------ numpy reference


def _rms(x, w):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _rope(x, positions):
  """Rotary embedding in the rotate-half form of Qwen2: ``x [T, H, Dh]`` at ``positions [T]``."""
  half = HEAD_DIM // 2
  angles = positions[:, None] * THETA ** (-np.arange(half) * 2.0 / HEAD_DIM)[None, :]  # [T, Dh/2]
  cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _mtp_layer_reference(t: dict, layer: int, hidden: np.ndarray, tokens: np.ndarray):
  """One MiMo MTP layer from its equations, in float64: ``hidden [T, D]`` (the state it reads at each
  position) and ``tokens [T]`` (the token it is told comes next there) -> (output ``[T, D]``, logits ``[T, V]``).

  e = token_layernorm(embed(token)), h = hidden_layernorm(hidden), x = input_proj([h, e]) (hidden first);
  x += attn(input_layernorm(x)) (Qwen2: q/k/v biases, GQA, rope, causal); x += mlp(post_attention_layernorm(x));
  out = final_layernorm(x); logits = lm_head(out) with the body's embedding and lm_head.
  """
  w = lambda name: t[f"{PREFIX}{layer}.{name}"].astype(np.float64)
  embed, lm_head = t["model.embed_tokens.weight"].astype(np.float64), t["lm_head.weight"].astype(np.float64)
  e = _rms(embed[tokens], w("token_layernorm.weight"))
  h = _rms(hidden.astype(np.float64), w("hidden_layernorm.weight"))
  x = np.concatenate([h, e], axis=-1) @ w("input_proj.weight").T  # [T, D]
  n = _rms(x, w("input_layernorm.weight"))
  steps = x.shape[0]
  proj = lambda name, heads: (n @ w(f"self_attn.{name}_proj.weight").T + w(f"self_attn.{name}_proj.bias")).reshape(
      steps, heads, HEAD_DIM)
  positions = np.arange(steps, dtype=np.float64)
  q, k, v = _rope(proj("q", HEADS), positions), _rope(proj("k", KV_HEADS), positions), proj("v", KV_HEADS)
  k, v = np.repeat(k, HEADS // KV_HEADS, axis=1), np.repeat(v, HEADS // KV_HEADS, axis=1)  # [T, H, Dh]
  scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(HEAD_DIM)
  scores = np.where(np.tril(np.ones((steps, steps), bool))[None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  attn = np.einsum("hts,shd->thd", probs, v).reshape(steps, HEADS * HEAD_DIM)
  x = x + attn @ w("self_attn.o_proj.weight").T
  m = _rms(x, w("post_attention_layernorm.weight"))
  gate = m @ w("mlp.gate_proj.weight").T
  x = x + (gate / (1.0 + np.exp(-gate)) * (m @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
  out = _rms(x, w("final_layernorm.weight"))
  return out, out @ lm_head.T


# ------------------------------------------------------------------------------------------- properties


@jax.jit
def _forward(graphdefs, states, tokens):
  """The body's logits and final-norm hidden state of ``tokens [B, T]``, and each MTP layer's outputs and logits
  on the pairs (state at i, x_{i+layer+1}) for every i that has that token: layer 0 reads the body's hidden state,
  layer 1 layer 0's output (its chained use in specjax). One compiled call (eager JAX is slow here)."""
  target, heads = nnx.merge(graphdefs[0], states[0]), nnx.merge(graphdefs[1], states[1])
  batch, steps = tokens.shape
  logits, hidden, _ = target(tokens, target.init_cache(batch, steps))
  feats, layers = hidden, []
  for layer in range(MTP_LAYERS):
    n = steps - layer - 1
    # The head's cache starts past its placeholder positions, as the chain proposer's does.
    cache = heads.init_caches(batch, steps + MTP_LAYERS)[layer].with_lengths(
        jnp.full((batch,), MTP_LAYERS - 1, jnp.int32))
    feats, _ = heads.step(layer, target, feats[:, :n], tokens[:, layer + 1:], cache)
    layers.append((feats, heads.logits(layer, target, feats)))
  return logits, hidden, layers


@pytest.fixture(scope="module")
def forward(loaded):
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 12))
  split = [nnx.split(m) for m in (loaded.model, loaded.heads["mtp"])]
  out = _forward(tuple(g for g, _ in split), tuple(s for _, s in split), jnp.asarray(tokens))
  return tokens, jax.tree.map(np.asarray, out)


def test_body_logits_match_transformers_qwen2(mimo, forward):
  _, hf_model, _ = mimo
  tokens, (logits, hidden, _) = forward
  with torch.no_grad():
    out = hf_model(torch.as_tensor(tokens), output_hidden_states=True)
  np.testing.assert_allclose(logits, out.logits.numpy(), atol=ATOL, rtol=0)
  np.testing.assert_allclose(hidden, out.hidden_states[-1].numpy(), atol=ATOL, rtol=0)  # after the final norm


def test_each_mtp_layer_matches_a_numpy_reference(mimo, loaded, forward):
  """Layer 0 on the body's final-norm hidden state h_i with token x_{i+1}, layer 1 on layer 0's output with
  x_{i+2}: both match the float64 reference of MiMo's equations, fed transformers' own hidden state."""
  _, hf_model, tensors = mimo
  heads = loaded.heads["mtp"]
  assert heads.cfg.num_heads == MTP_LAYERS and heads.cfg.normed_output and heads.cfg.qkv_bias
  tokens, (_, _, layers) = forward
  with torch.no_grad():
    ref_hidden = hf_model.model(torch.as_tensor(tokens)).last_hidden_state.numpy()
  for row in range(tokens.shape[0]):
    ref_feats = ref_hidden[row]
    for layer, (out, logits) in enumerate(layers):
      n = tokens.shape[1] - layer - 1
      ref_feats, ref_logits = _mtp_layer_reference(tensors, layer, ref_feats[:n], tokens[row, layer + 1:])
      np.testing.assert_allclose(logits[row], ref_logits, atol=ATOL, rtol=0, err_msg=f"row {row}, layer {layer}")
      np.testing.assert_allclose(out[row], ref_feats, atol=ATOL, rtol=0, err_msg=f"row {row}, layer {layer}")
      assert np.abs(ref_logits).max() > 1.0  # not a vacuous comparison


def test_greedy_speculation_with_the_checkpoint_mtp_equals_the_target_alone(mimo, loaded, capsys):
  text = " ".join(f"w{i}" for i in (3, 7, 1, 9, 4, 12, 30))
  prompt = [loaded.tokenizer.encode(text)]
  base = specjax.generate(loaded.model, prompt, max_new_tokens=12)
  # k = 3 > 2 layers: proposals 1, 2 from layers 0, 1, proposal 3 from layer 1 rolled out on its own output.
  out = specjax.generate(loaded.model, prompt, proposer=for_heads(loaded.heads["mtp"]), spec=SpecConfig(k=3),
                         max_new_tokens=12)
  np.testing.assert_array_equal(out.tokens, base.tokens)
  np.testing.assert_array_equal(out.lengths, base.lengths)
  # The command line finds the proposer in the directory itself.
  capsys.readouterr()
  assert main(["generate", "--target", mimo[0], "--prompt", text, "--method", "mtp", "--k", "3",
               "--max-new-tokens", "12"]) == 0
  assert loaded.tokenizer.decode(base.tokens[0].tolist()) in capsys.readouterr().out


def test_export_to_mimo_layout_reproduces_the_checkpoint_bit_for_bit(mimo, loaded, tmp_path):
  path, _, tensors = mimo
  save_mimo(loaded.model, loaded.heads["mtp"], loaded.tokenizer, str(tmp_path))
  written = load_file(str(tmp_path / "model.safetensors"))
  assert set(written) == set(tensors)
  for key, x in tensors.items():
    np.testing.assert_array_equal(written[key], x, err_msg=key)
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  assert config["architectures"] == ["MiMoForCausalLM"] and config["num_nextn_predict_layers"] == MTP_LAYERS
  again = specjax.load(str(tmp_path))
  _assert_same_params(again.model, loaded.model)
  _assert_same_params(again.heads["mtp"], loaded.heads["mtp"])
  # DeepSeek-form MTP heads (norm in the output head, no biases) have no MiMo layout.
  with pytest.raises(CheckpointFileError, match=r"\['qkv_bias', 'normed_output'\]"):
    save_mimo(loaded.model, build_heads("mtp", loaded.model.cfg, num_heads=1, d_ff=FF), None, str(tmp_path / "x"))


# -------------------------------------------------------------------------------------------- refusals


def _tensor_edit(key: str, value):
  def edit(tensors):
    if value is None:
      del tensors[key]
    else:
      tensors[key] = value
  return edit


@pytest.mark.parametrize("config, edit, match", [
    ({}, _tensor_edit(f"{PREFIX}0.hidden_layernorm.weight", np.ones(48, np.float32)),
     r"'model.mtp_layers.0.hidden_layernorm.weight' has shape \[48\].*hidden_size=32.*implies \[32\]"),
    ({}, _tensor_edit(f"{PREFIX}0.input_proj.weight", np.ones((32, 48), np.float32)),
     r"input_proj.weight' has shape \[32, 48\].*hidden_size=32.*implies \[32, 64\]"),
    ({}, _tensor_edit(f"{PREFIX}1.final_layernorm.weight", None),
     r"lacks tensor 'model.mtp_layers.1.final_layernorm.weight'.*num_nextn_predict_layers=2"),
    ({}, _tensor_edit(f"{PREFIX}0.self_attn.o_proj.bias", np.ones(32, np.float32)),
     r"unexpected tensor 'model.mtp_layers.0.self_attn.o_proj.bias'"),
    ({"num_nextn_predict_layers": 1}, None, r"MTP layer 1, but config.json has num_nextn_predict_layers=1"),
    ({"num_nextn_predict_layers": 0}, None, r"is an MTP layer, but config.json has num_nextn_predict_layers=0"),
    ({"num_nextn_predict_layers": 3}, None, r"lacks tensor 'model.mtp_layers.2\..*num_nextn_predict_layers=3"),
    ({"num_nextn_predict_layers": "2"}, None, r"num_nextn_predict_layers must be an integer >= 0"),
    ({"architectures": ["Qwen2ForCausalLM"]}, None, r"architectures=.*MiMoForCausalLM"),
    ({"use_mrope": True}, None, r"use_mrope=True is not supported"),
])
def test_mtp_layers_that_do_not_fit_are_refused_naming_the_field(mimo, tmp_path, config, edit, match):
  path = _copy_checkpoint(mimo[0], tmp_path)
  if config:
    _edit_config(path, **config)
  if edit is not None:
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})
  with pytest.raises(CheckpointFileError, match=match):
    specjax.load(path)


def test_a_mimo_checkpoint_without_mtp_layers_loads_its_body_alone(mimo, tmp_path):
  path = _copy_checkpoint(mimo[0], tmp_path)
  weights = os.path.join(path, "model.safetensors")
  save_file({k: v for k, v in load_file(weights).items() if not k.startswith(PREFIX)}, weights)
  _edit_config(path, num_nextn_predict_layers=0)
  assert specjax.load(path).heads == {}


def test_a_bfloat16_checkpoint_loads_its_mtp_layers(mimo, loaded, tmp_path):
  """MiMo ships bfloat16 weights: the MTP layers load from them (read as ml_dtypes' bfloat16, not refused as
  non-float) and equal the float32 layers rounded to bfloat16. A rotary buffer in an MTP layer is skipped, as the
  body's are."""
  from safetensors.torch import load_file as load_torch, save_file as save_torch

  path = _copy_checkpoint(mimo[0], tmp_path)
  weights = os.path.join(path, "model.safetensors")
  tensors = {k: v.to(torch.bfloat16) for k, v in load_torch(weights).items()}
  tensors[f"{PREFIX}0.self_attn.rotary_emb.inv_freq"] = torch.ones(HEAD_DIM // 2)
  save_torch(tensors, weights, metadata={"format": "pt"})
  heads = specjax.load(path).heads["mtp"]
  ours = nnx.to_pure_dict(nnx.state(heads, nnx.Param))
  want = nnx.to_pure_dict(nnx.state(loaded.heads["mtp"], nnx.Param))
  for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y.astype(jnp.bfloat16).astype(jnp.float32)))
