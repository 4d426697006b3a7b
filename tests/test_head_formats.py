"""Published heads in and out (``specjax.head_formats``): EAGLE-3 and EAGLE-1 heads in the layout vLLM and SGLang
load, Medusa heads in the Medusa repository's layout.

Files are written here with the safetensors numpy API and json, from random weights, in the layouts those
projects read (see the module docstring of ``specjax.head_formats`` for the public files the layouts come
from). The imported heads are checked against numpy references written from the published equations
(independent of the specjax modules: own RMSNorm, rope, grouped-query attention and SiLU MLP), speculation with
them is checked to be exact, and every way a file can fail to fit its target is refused by field. A tiny GGUF
file written here checks that a shipped model's file brings its heads when loaded by path.
"""

from __future__ import annotations

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import specjax
import specjax.pretrained
from helpers import SMALL, make_model
from specjax import SpecConfig
from specjax.head_formats import MEDUSA_FILE, detect, load_published, save_published
from specjax.hf import CheckpointFileError
from specjax.models.heads import HeadConfig, MedusaHeads, build_heads, save_heads
from specjax.models.llama import RopeScaling
from specjax.proposers import for_heads

# float32 logits of a one-layer head, ours (XLA) vs numpy, same weights: only summation order differs.
RTOL, ATOL = 1e-4, 1e-4
CFG = SMALL.replace(n_layers=4)  # V 64, D 32, 4 heads (2 KV): EAGLE-3 fuses three of its layers
IDS = [0, 2, 3]  # vLLM's default (2, L//2, L-3) is not increasing for 4 layers, so the file names its ids


@pytest.fixture(scope="module")
def target():
  return make_model(CFG, seed=5)


def _params(heads) -> dict:
  return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(heads))}


def _assert_same(a, b):
  pa, pb = _params(a), _params(b)
  assert pa.keys() == pb.keys()
  for path in pa:
    assert pa[path].dtype == pb[path].dtype, path
    np.testing.assert_array_equal(pa[path], pb[path], err_msg=str(path))


# ------------------------------------------------------------------------------------- files by hand


def _eagle3_files(path, cfg=CFG, *, d=32, n_heads=4, n_kv=2, head_dim=None, ff=48, draft=24, seed=0,
                  embed=False, config=None, drop=(), change=None):
  """An EAGLE-3 head folder as SpecForge saves it and vLLM/SGLang load it, random weights."""
  rng = np.random.default_rng(seed)
  hd = head_dim or d // n_heads
  e = d if embed else cfg.d_model
  w = lambda *shape: (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)
  ids = np.sort(rng.choice(cfg.vocab_size, draft, replace=False))
  t2d = np.zeros(cfg.vocab_size, bool)
  t2d[ids] = True
  tensors = {
      "fc.weight": w(d, 3 * cfg.d_model),
      "midlayer.input_layernorm.weight": 1 + 0.1 * w(e),
      "midlayer.hidden_norm.weight": 1 + 0.1 * w(d),
      "midlayer.self_attn.q_proj.weight": w(n_heads * hd, e + d),
      "midlayer.self_attn.k_proj.weight": w(n_kv * hd, e + d),
      "midlayer.self_attn.v_proj.weight": w(n_kv * hd, e + d),
      "midlayer.self_attn.o_proj.weight": w(d, n_heads * hd),
      "midlayer.post_attention_layernorm.weight": 1 + 0.1 * w(d),
      "midlayer.mlp.gate_proj.weight": w(ff, d),
      "midlayer.mlp.up_proj.weight": w(ff, d),
      "midlayer.mlp.down_proj.weight": w(d, ff),
      "norm.weight": 1 + 0.1 * w(d),
      "lm_head.weight": w(draft, d),
      "d2t": (ids - np.arange(draft)).astype(np.int64),  # target id = draft id + d2t[draft id]
      "t2d": t2d,
  }
  if embed:
    tensors["embed_tokens.weight"] = w(cfg.vocab_size, d)
  tensors.update(change or {})
  for key in drop:
    del tensors[key]
  hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
        "intermediate_size": ff, "num_attention_heads": n_heads, "num_key_value_heads": n_kv,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 5000.0,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": draft, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": IDS, "use_aux_hidden_state": True}}
  if head_dim:
    hf["head_dim"] = head_dim
  if d != cfg.d_model:
    hf["target_hidden_size"] = cfg.d_model
  hf.update(config or {})
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(hf))
  save_file(tensors, str(path / "model.safetensors"))
  return path


def _medusa_files(path, cfg=CFG, *, heads=3, layers=1, seed=0, config=None, drop=(), change=None):
  """A Medusa head folder as Medusa's training script saves it: ``{i}.{j}.linear.*`` (one ResBlock repeated
  ``layers`` times) and ``{i}.{layers}.weight``, the head's own LM head."""
  rng = np.random.default_rng(seed)
  d, v = cfg.d_model, cfg.vocab_size
  tensors = {}
  for i in range(heads):
    block_w, block_b = (0.2 * rng.standard_normal((d, d))).astype(np.float32), (
        0.1 * rng.standard_normal(d)).astype(np.float32)
    for j in range(layers):
      tensors[f"{i}.{j}.linear.weight"], tensors[f"{i}.{j}.linear.bias"] = block_w, block_b
    tensors[f"{i}.{layers}.weight"] = (rng.standard_normal((v, d)) * d**-0.5).astype(np.float32)
  tensors.update(change or {})
  for key in drop:
    del tensors[key]
  path.mkdir(parents=True, exist_ok=True)
  hf = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
  hf.update(config or {})
  (path / "config.json").write_text(json.dumps(hf))
  save_file(tensors, str(path / MEDUSA_FILE))
  return path


# ------------------------------------------------------------------------------------ numpy references


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, positions, base):  # x [T, H, Dh]: the two-halves rotation of Llama / vLLM's neox style
  half = x.shape[-1] // 2
  inv = base ** (-np.arange(half, dtype=np.float64) / half)
  ang = positions[:, None, None] * inv
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def _attention(x, t, base, n_heads, n_kv, head_dim):
  """Causal grouped-query attention of one sequence ``x [T, in]`` with HF-layout weights ``t`` (q/k/v/o)."""
  T = x.shape[0]
  q = (x @ t["q"].T).reshape(T, n_heads, head_dim)
  k = (x @ t["k"].T).reshape(T, n_kv, head_dim)
  v = (x @ t["v"].T).reshape(T, n_kv, head_dim)
  pos = np.arange(T, dtype=np.float64)
  q, k = _rope(q, pos, base), _rope(k, pos, base)
  group = n_heads // n_kv
  out = np.zeros((T, n_heads, head_dim))
  for h in range(n_heads):  # query head h reads kv head h // group (HF repeat_kv)
    s = q[:, h] @ k[:, h // group].T / np.sqrt(head_dim)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // group]
  return out.reshape(T, -1) @ t["o"].T


def _silu(x):
  return x / (1 + np.exp(-x))


def eagle3_reference(t, hf, aux, tokens, embed):
  """One EAGLE-3 pass over pairs ``(aux[i], tokens[i])`` at positions 0..T-1 as vLLM/SGLang compute it:
  ``f = fc(aux)``; q, k, v from ``[input_layernorm(embed), hidden_norm(f)]``; residual ``f`` (``hidden_norm(f)``
  with ``norm_before_residual``); post-attention norm and SiLU MLP; ``lm_head(norm(out))`` over the draft
  vocabulary, placed at target ids ``i + d2t[i]``, -inf elsewhere. Returns ``(out [T, d], logits [T, V])``."""
  f64 = {k: np.asarray(v, np.float64) for k, v in t.items()}
  eps, base = hf["rms_norm_eps"], hf["rope_theta"]
  heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
  hd = hf.get("head_dim") or hf["hidden_size"] // heads
  feat = aux @ f64["fc.weight"].T
  normed = _rms(feat, f64["midlayer.hidden_norm.weight"], eps)
  x = np.concatenate([_rms(embed[tokens], f64["midlayer.input_layernorm.weight"], eps), normed], -1)
  proj = {n: f64[f"midlayer.self_attn.{n}_proj.weight"] for n in "qkvo"}
  h = (normed if hf.get("norm_before_residual") else feat) + _attention(x, proj, base, heads, kv, hd)
  m = _rms(h, f64["midlayer.post_attention_layernorm.weight"], eps)
  mlp = lambda n: f64[f"midlayer.mlp.{n}_proj.weight"]
  out = h + (_silu(m @ mlp("gate").T) * (m @ mlp("up").T)) @ mlp("down").T
  small = _rms(out, f64["norm.weight"], eps) @ f64["lm_head.weight"].T
  full = np.full((len(tokens), hf["vocab_size"]), -np.inf)
  full[:, np.arange(small.shape[1]) + t["d2t"]] = small
  return out, full


def medusa_reference(t, layers, heads, hidden):
  """Medusa's heads on ``hidden [..., D]``: head i repeats ``x + SiLU(W x + b)`` ``layers`` times, then its own LM
  head. Returns ``[..., heads, V]``."""
  out = []
  for i in range(heads):
    x = np.asarray(hidden, np.float64)
    w, b = np.asarray(t[f"{i}.0.linear.weight"], np.float64), np.asarray(t[f"{i}.0.linear.bias"], np.float64)
    for _ in range(layers):
      x = x + _silu(x @ w.T + b)
    out.append(x @ np.asarray(t[f"{i}.{layers}.weight"], np.float64).T)
  return np.stack(out, -2)


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("kind,options", [
    ("eagle3", dict(aux_layers=tuple(IDS), draft_vocab_size=24, d2t=np.arange(24) * 2 + 3)),
    ("eagle3", dict(aux_layers=(1, 2, 3), d_model=16, n_heads=2, own_embedding=True, norm_before_residual=True,
                    head_dim=12, rope_scaling=RopeScaling("linear", 2.0))),
    ("eagle1", {}),
    ("medusa", dict(num_heads=3, own_lm_heads=True)),
])
def test_specjax_to_file_to_specjax_is_bit_for_bit(kind, options, tmp_path, target):
  if kind == "medusa":  # non-zero blocks (Medusa starts them at zero)
    heads = MedusaHeads(HeadConfig.for_target(kind, CFG, **options), rngs=nnx.Rngs(7), zero_init=False)
  else:
    heads = build_heads(kind, CFG, seed=7, **options)
  assert save_published(tmp_path, heads, target) == kind and detect(tmp_path) == kind
  back = load_published(tmp_path, CFG)
  assert back.cfg == heads.cfg
  _assert_same(heads, back)
  # File -> specjax -> file: the same tensors, bit for bit.
  save_published(tmp_path / "again", back, target)
  name = MEDUSA_FILE if kind == "medusa" else "model.safetensors"
  first, second = load_file(str(tmp_path / name)), load_file(str(tmp_path / "again" / name))
  assert first.keys() == second.keys()
  for key in first:
    np.testing.assert_array_equal(first[key], second[key], err_msg=key)
  assert json.loads((tmp_path / "config.json").read_text()) == json.loads((tmp_path / "again/config.json").read_text())


def test_medusa_heads_on_the_target_unembedding_export_with_copies_of_it(tmp_path, target):
  """A specjax Medusa set shares the target's LM head; the published layout gives every head its own, so export
  copies the target's in, bit for bit, and the imported set (own heads) computes the same logits. Those agree
  to float32 rounding, not bit for bit on every CPU: the copy is contracted as ``z @ W [D, V]`` per head, the
  target's head as its own layout, and XLA:CPU may sum the two products in different orders (it does on an
  AMD EPYC without AVX-512: 4.8e-7 at most)."""
  heads = build_heads("medusa", CFG, num_heads=2)
  save_published(tmp_path, heads, target)
  back = load_published(tmp_path, CFG)
  assert back.cfg.own_lm_heads
  unembedding = np.asarray(target.unembed(jnp.eye(CFG.d_model, dtype=jnp.float32)))  # [D, V]: 1 * w + zeros
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(back.lm_heads[...][i]), unembedding, err_msg=f"head {i}")
  h = np.random.default_rng(0).standard_normal((3, CFG.d_model)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(back.logits(target, back(h))), np.asarray(heads.logits(target, heads(h))),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(CheckpointFileError, match="without target="):
    save_published(tmp_path / "x", heads)


def test_heads_the_layout_cannot_express_are_refused(tmp_path):
  with pytest.raises(CheckpointFileError, match=r"d_model=16 differs from target_d_model=32.*own_embedding=True"):
    save_published(tmp_path, build_heads("eagle3", CFG, aux_layers=(0, 1, 2), d_model=16, n_heads=2))
  with pytest.raises(CheckpointFileError, match=r"aux_layers=\[0, 3\].*exactly three"):
    save_published(tmp_path, build_heads("eagle3", CFG, aux_layers=(0, 3)))
  medusa = MedusaHeads(HeadConfig.for_target("medusa", CFG, num_heads=2, medusa_layers=2, own_lm_heads=True),
                       rngs=nnx.Rngs(0), zero_init=False)
  with pytest.raises(CheckpointFileError, match="repeats one ResBlock.*medusa_layers=2"):
    save_published(tmp_path, medusa)
  with pytest.raises(CheckpointFileError, match="kind 'mtp'"):
    save_published(tmp_path, build_heads("mtp", CFG))


# ------------------------------------------------------------------------------------ against references


@pytest.mark.parametrize("variant", ["shared_embedding", "own_embedding_narrow_head"])
def test_imported_eagle3_step_matches_the_numpy_reference(variant, tmp_path, target):
  kw = {} if variant == "shared_embedding" else dict(d=24, n_heads=3, n_kv=1, head_dim=10, embed=True,
                                                      config={"norm_before_residual": True})
  path = _eagle3_files(tmp_path, seed=2, **kw)
  heads = load_published(path, CFG)
  assert heads.cfg.aux_layers == tuple(IDS) and heads.cfg.rope_base == 5000.0
  t, hf = load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())
  rng = np.random.default_rng(3)
  T = 7
  aux = rng.standard_normal((1, T, 3 * CFG.d_model)).astype(np.float32)
  tokens = rng.integers(0, CFG.vocab_size, (1, T))
  cache = heads.init_caches(1, 16)[0]
  out, _ = heads.step(0, target, heads.input_features(None, aux), tokens, cache)
  logits = np.asarray(heads.logits(0, target, out))[0]
  embed = t["embed_tokens.weight"] if kw else np.asarray(target.embed[...])
  ref_out, ref_logits = eagle3_reference(t, hf, aux[0].astype(np.float64), tokens[0], np.asarray(embed, np.float64))
  np.testing.assert_allclose(np.asarray(out)[0], ref_out, rtol=RTOL, atol=ATOL)
  assert np.array_equal(np.isinf(logits), np.isinf(ref_logits))  # only the drafted ids are proposable
  finite = np.isfinite(ref_logits)
  np.testing.assert_allclose(logits[finite], ref_logits[finite], rtol=RTOL, atol=ATOL)


def test_imported_medusa_heads_match_the_numpy_reference(tmp_path, target):
  path = _medusa_files(tmp_path, heads=3, layers=2, seed=4)
  heads = load_published(path, CFG)
  assert heads.cfg.num_heads == 3 and heads.cfg.medusa_layers == 2 and heads.cfg.own_lm_heads
  h = np.random.default_rng(5).standard_normal((2, CFG.d_model)).astype(np.float32)
  got = np.asarray(heads.logits(target, heads(h)))  # [2, 3, V]
  np.testing.assert_allclose(got, medusa_reference(load_file(str(path / MEDUSA_FILE)), 2, 3, h), rtol=RTOL, atol=ATOL)
  # The first k heads alone (a round of k < num_heads proposals) are the first k of the reference.
  np.testing.assert_allclose(np.asarray(heads.logits(target, heads(h)[:, :2])), got[:, :2], rtol=RTOL, atol=ATOL)


# -------------------------------------------------------------------------------------------- exactness


def test_greedy_speculation_with_imported_heads_equals_the_target_alone(tmp_path, target):
  prompts = [[3, 7, 1, 9, 4], [12, 30], [5] * 9]
  base = specjax.generate(target, prompts, max_new_tokens=14)
  eagle1 = build_heads("eagle1", CFG, seed=2)
  save_published(tmp_path / "eagle1", eagle1)
  for folder in (_eagle3_files(tmp_path / "eagle3", seed=6), _medusa_files(tmp_path / "medusa", heads=3, seed=6),
                 tmp_path / "eagle1"):
    heads = load_published(folder, CFG)
    out = specjax.generate(target, prompts, proposer=for_heads(heads), spec=SpecConfig(k=3), max_new_tokens=14)
    np.testing.assert_array_equal(out.tokens, base.tokens, err_msg=folder.name)
    np.testing.assert_array_equal(out.lengths, base.lengths)


def test_load_takes_a_published_head_folder_next_to_the_shipped_ones(tmp_path):
  """``specjax.load(target, heads=DIR)``: the bundled pair's target (6 layers, D 256, V 4096) with a published
  EAGLE-3 head in place of its shipped one; greedy output is the target's own."""
  coder = specjax.load("stdlib-coder")
  cfg = coder.model.cfg
  ids = [1, 3, 5]
  folder = _eagle3_files(tmp_path / "eagle3", cfg, d=cfg.d_model, n_heads=4, n_kv=4, ff=64, draft=300, seed=1,
                         config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}})
  loaded = specjax.load("stdlib-coder", heads=str(folder))
  assert set(loaded.heads) == set(coder.heads)  # the shipped medusa and mtp sets stay
  heads = loaded.heads["eagle"]
  assert heads.cfg.aux_layers == tuple(ids) and heads.cfg.draft_vocab_size == 300
  prompt = [coder.tokenizer.encode("def main():\n    ")]
  base = specjax.generate(loaded.model, prompt, max_new_tokens=10)
  out = specjax.generate(loaded.model, prompt, proposer=for_heads(heads), spec=SpecConfig(k=3), max_new_tokens=10)
  np.testing.assert_array_equal(out.tokens, base.tokens)


# -------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("edit,match", [
    (dict(config={"target_hidden_size": 48}), r"target_hidden_size=48 does not fit \(allowed: 32, the target's"),
    (dict(d=40, n_heads=4), r"hidden_size=40 does not fit \(allowed: 32 .*no embed_tokens.weight"),
    (dict(config={"vocab_size": 65}), r"vocab_size=65 does not fit \(allowed: 64, the target's vocabulary"),
    (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}),
     r"eagle_aux_hidden_state_layer_ids=\[0, 2, 4\] does not fit \(allowed: three distinct increasing layer ids in "
     r"\[0, 3\]"),
    (dict(config={"eagle_config": {}}), r"absent: vLLM's default.*=\[2, 2, 1\]"),
    (dict(config={"num_hidden_layers": 2}), r"num_hidden_layers=2 .*allowed: 1"),
    (dict(config={"attention_bias": True}), r"attention_bias=True .*allowed: false"),
    (dict(config={"draft_vocab_size": 70}), r"draft_vocab_size=70 .*allowed: 1..64"),
    (dict(drop=("norm.weight",)), r"lacks tensor 'norm.weight'"),
    (dict(drop=("d2t",)), r"lacks tensor 'd2t', which a head with draft_vocab_size=24 < vocab_size=64"),
    (dict(change={"lm_head.weight": np.zeros((24, 31), np.float32)}),
     r"'lm_head.weight' has shape \[24, 31\], but config.json implies \[24, 32\]"),
    (dict(change={"midlayer.self_attn.q_proj.weight": np.zeros((32, 32), np.float32)}),
     r"'midlayer.self_attn.q_proj.weight' has shape \[32, 32\], but config.json implies \[32, 64\]"),
    (dict(change={"extra.weight": np.zeros(3, np.float32)}), r"unexpected tensor 'extra.weight'"),
    (dict(change={"d2t": np.full(24, 60, np.int64)}), r"d2t maps draft id 4 to target id 64, outside .*\[0, 64\)"),
    (dict(change={"d2t": np.zeros(24, np.int64), "t2d": np.arange(64) < 24}), None),  # consistent: accepted
    (dict(change={"t2d": np.arange(64) < 24}), r"t2d disagrees with d2t"),
    (dict(change={"d2t": np.zeros(24, np.float32)}), r"'d2t' must hold integers"),
])
def test_eagle3_files_that_do_not_fit_are_refused_by_field(edit, match, tmp_path):
  path = _eagle3_files(tmp_path, seed=9, **edit)
  if match is None:
    load_published(path, CFG)
    return
  with pytest.raises(CheckpointFileError, match=match):
    load_published(path, CFG)


@pytest.mark.parametrize("edit,match", [
    (dict(config={"hidden_size": 48}), r"hidden_size=48 does not fit \(allowed: 32"),
    (dict(config={"medusa_num_heads": 4}), r"lacks tensor '3.0.linear.weight'"),
    (dict(change={"1.1.weight": np.zeros((64, 31), np.float32)}), r"'1.1.weight' has shape \[64, 31\].*\[64, 32\]"),
    (dict(layers=2, change={"0.1.linear.bias": np.ones(32, np.float32)}), r"0.1.linear.bias differs from 0.0"),
])
def test_medusa_files_that_do_not_fit_are_refused_by_field(edit, match, tmp_path):
  with pytest.raises(CheckpointFileError, match=match):
    load_published(_medusa_files(tmp_path, **edit), CFG)


def test_eagle1_and_detection(tmp_path):
  heads = build_heads("eagle1", CFG, seed=1)
  save_published(tmp_path / "e1", heads)
  tensors = load_file(str(tmp_path / "e1/model.safetensors"))
  assert "fc.bias" in tensors and not any(k.startswith("midlayer.") for k in tensors)
  # vLLM's layout has no fc.bias (its fc is bias-free): such a file loads with a zero bias.
  del tensors["fc.bias"]
  save_file(tensors, str(tmp_path / "e1/model.safetensors"))
  assert not np.asarray(load_published(tmp_path / "e1", CFG).fc.b[...]).any()
  with pytest.raises(CheckpointFileError, match=r"hidden_size=32 does not fit \(allowed: 48"):
    load_published(tmp_path / "e1", CFG.replace(d_model=48, n_heads=4))
  save_heads(tmp_path / "own", heads)
  assert detect(tmp_path / "own") == "specjax"
  (tmp_path / "empty").mkdir()
  with pytest.raises(CheckpointFileError, match="is not a head folder: expected heads.json"):
    detect(tmp_path / "empty")


def test_cli_refuses_a_published_head_that_does_not_fit(tmp_path, capsys):
  from specjax.cli import main

  path = _eagle3_files(tmp_path, seed=1)  # built for a 32-wide target, not the bundled pair's 256
  rc = main(["generate", "--prompt", "x", "--method", "eagle", "--heads", str(path), "--target", "stdlib-coder"])
  assert rc == 2
  assert "vocab_size=64 does not fit (allowed: 4096, the target's vocabulary)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ GGUF recognition


def test_a_shipped_gguf_file_brings_its_heads_when_loaded_by_path(tmp_path, monkeypatch, caplog):
  """A model shipped as a GGUF file registers its size and fingerprint (``assets/<name>/gguf.json``); loading
  that file by path attaches the heads shipped for it and logs one line saying so. Another file of the same
  size (other weights) and an unregistered one get no heads."""
  import test_gguf
  from specjax.gguf import fingerprint

  model = make_model(test_gguf._cfg(), seed=3)
  path = test_gguf._write_specjax(tmp_path / "tiny.gguf", model)
  other = test_gguf._write_specjax(tmp_path / "other.gguf", make_model(test_gguf._cfg(), seed=4))
  assets = tmp_path / "assets"
  entry = json.loads(specjax.pretrained.register_gguf(assets / "tiny-chat", path).read_text())
  assert entry == {"file": "tiny.gguf", "size": (tmp_path / "tiny.gguf").stat().st_size, "fingerprint": fingerprint(path)}
  shipped = build_heads("eagle3", model.cfg, seed=1, aux_layers=(0, 1), d_model=16, n_heads=2)
  save_heads(assets / "tiny-chat" / "heads" / "eagle", shipped)
  monkeypatch.setattr(specjax.pretrained, "ASSETS", assets)
  assert specjax.pretrained.recognise_gguf(path) == "tiny-chat"
  assert (tmp_path / "other.gguf").stat().st_size == (tmp_path / "tiny.gguf").stat().st_size
  assert fingerprint(other) != fingerprint(path) and specjax.pretrained.recognise_gguf(other) is None
  with caplog.at_level(logging.INFO, logger="specjax.loading"):
    loaded = specjax.load(path)
  assert set(loaded.heads) == {"eagle"}
  _assert_same(loaded.heads["eagle"], shipped)
  lines = [r.getMessage() for r in caplog.records if r.name == "specjax.loading"]
  assert lines == ["tiny.gguf is the GGUF file of 'tiny-chat': attached its shipped heads: eagle (eagle3)"]
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="specjax.loading"):
    assert specjax.load(other).heads == {}
  assert not caplog.records
  # The method runs with the attached head, exactly.
  prompt = [[5, 9, 2, 7]]
  base = specjax.generate(loaded.model, prompt, max_new_tokens=8)
  out = specjax.generate(loaded.model, prompt, proposer=for_heads(loaded.heads["eagle"]), spec=SpecConfig(k=2),
                         max_new_tokens=8)
  np.testing.assert_array_equal(out.tokens, base.tokens)


def test_the_registered_smollm2_file_is_the_one_pretrained_finds():
  """The registry entry shipped for SmolLM2 names the file ``specjax.load("smollm2-135m-instruct")`` loads;
  where the file is on this machine, its size and fingerprint match the entry."""
  from specjax.loading import GGUF_NAMES, find_gguf

  entry = specjax.pretrained.gguf_registry()["smollm2-135m-instruct"]
  assert entry["file"] == GGUF_NAMES["smollm2-135m-instruct"].file
  assert isinstance(entry["size"], int) and entry["size"] > 0
  try:
    path = find_gguf("smollm2-135m-instruct")
  except FileNotFoundError:  # CI has no downloaded model: the entry's own fields are what is checked there
    return
  assert specjax.pretrained.recognise_gguf(path) == "smollm2-135m-instruct"


def test_cli_export_heads(tmp_path, capsys):
  from specjax.cli import main

  shipped = specjax.pretrained.ASSETS / "stdlib-coder" / "heads"
  assert main(["export-heads", "--heads", str(shipped / "medusa"), "--out", str(tmp_path / "m")]) == 0
  assert "in the published medusa layout" in capsys.readouterr().out
  assert detect(tmp_path / "m") == "medusa"
  # The shipped EAGLE-3 head is narrower than its target and reads the target's embedding: no published form.
  assert main(["export-heads", "--heads", str(shipped / "eagle"), "--out", str(tmp_path / "e")]) == 2
  assert "HeadConfig.d_model=128 differs from target_d_model=256" in capsys.readouterr().err
