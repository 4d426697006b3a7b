"""GGUF checkpoints in: llama.cpp's one-file format (metadata, tokenizer and often-quantized tensors).

:func:`load_gguf` reads a ``.gguf`` file of the ``llama``, ``qwen2``, ``qwen3``, ``phi3`` or ``gemma3`` architecture
into a specjax
:class:`~specjax.models.llama.Llama` plus a :class:`GGUFTokenizer` rebuilt from the file's metadata.
Reading and dequantization use the ``gguf`` package (llama.cpp's own Python reader); every tensor type in
``TENSOR_TYPES`` dequantizes to float32 and is then cast to the requested dtype, one tensor at a time.

The metadata is mapped to the fields of a Hugging Face ``config.json`` and validated by
:func:`specjax.hf.config_from_hf`, and the tensors are placed through :class:`specjax.hf.ParamTree` with
:mod:`specjax.hf`'s tensor table, so both formats share one set of checks. A GGUF tensor is its Hugging
Face counterpart under another name, with one exception: for ``llama``, llama.cpp's converter reorders
the rows of each query and key head from the two-halves rotary layout to interleaved pairs, which
:func:`unpermute_rotary` undoes (``qwen2``, ``qwen3`` and ``phi3`` files are written unpermuted). Phi-3's
fused ``attn_qkv`` and ``ffn_up`` (gate then up) are Hugging Face's ``qkv_proj`` and ``gate_up_proj``, split
through the same table; its LongRoPE factors are tensors ``rope_factors_short`` / ``rope_factors_long``.
``gemma3`` files store every norm weight as ``1 + w`` (undone here) and leave to llama.cpp's code what the
metadata does not say: every sixth layer global (unless ``attention.sliding_window_pattern`` says
otherwise), a local rotary base of 10000 (unless ``rope.freq_base_swa``) with no scaling, and the
attention scale ``head_dim ** -0.5`` (``(hidden / heads) ** -0.5`` for the 62-layer 27B); this loader makes
the same choices. Other architectures are refused by name.

Tokenizers: ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE with ``tokenizer.ggml.merges``) and
``"llama"`` (SentencePiece-style BPE with byte fallback, merges taken from the file or derived from the
token scores) are rebuilt as ``tokenizers`` objects that encode as ``transformers``'
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` does.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from specjax.hf import LOAD_DTYPES, CheckpointFileError, ParamTree, config_from_hf
from specjax.hf import tensor_specs
from specjax.quant import QUANT_DTYPES, quantize
from specjax.tokenizer import HFTokenizer, byte_stand_ins

SUPPORTED = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TOKENIZER_MODELS = ("gpt2", "llama")
# Block types whose blocks map onto specjax.quant's layouts (their bits); the dtype that keeps each type's blocks.
BLOCK, BLOCK_BYTES = 32, {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
BLOCK_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
KEPT_BLOCKS = {"int8": ("Q8_0",), "int4": ("Q8_0", "Q4_0", "Q4_1")}

# Hugging Face module names (as in specjax.hf's tensor table) -> llama.cpp tensor names.
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# Gemma 2/3 norms around attention and MLP (specjax.hf's post_norms layout) under llama.cpp's names.
_POST_NORM_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                    "post_feedforward_layernorm": "post_ffw_norm"}
# Token types of tokenizer.ggml.token_type (llama.cpp's enum).
_CONTROL, _USER_DEFINED = 3, 4


# ------------------------------------------------------------------------------------------ file


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A block-quantized GGUF tensor as stored: blocks of ``BLOCK`` consecutive weights along its last (input) axis.

  ``codes``: ``[*shape]``, int8 for Q8_0 (``w = q * scale``), uint8 in [0, 15] for Q4_0 / Q4_1
  (``w = q * scale + low``). ``scale`` and ``low``: ``[*shape[:-1], shape[-1] // BLOCK]`` float16, the blocks'
  ``d`` and ``m`` (Q4_0: ``low = -8 d``; Q8_0: ``low`` is None).
  """

  codes: np.ndarray
  scale: np.ndarray
  low: np.ndarray | None

  def map_rows(self, fn) -> Blocks:
    """The same blocks with ``fn`` applied to the rows (the leading axis) of codes, scales and minima."""
    return Blocks(fn(self.codes), fn(self.scale), None if self.low is None else fn(self.low))


class _Corrupt(Exception):
  """Raised inside the reader; the message names the field. Turned into a CheckpointFileError with the file."""


def _reader_class():
  import gguf

  class Reader(gguf.GGUFReader):
    """``gguf.GGUFReader`` that remembers the last metadata key it parsed and checks every tensor's type
    and extent before the base class maps it, so a bad file is reported by the field at fault."""

    last_key = None

    def _push_field(self, field, skip_sum=False):
      self.last_key = field.name
      return super()._push_field(field, skip_sum)

    def _build_tensors(self, start_offs, fields):
      size = len(self.data)
      for field in fields:
        _, name, _, dims, raw_type, offset = field.parts
        name = bytes(name).decode("utf-8", "replace")
        try:
          qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
          raise _Corrupt(f"tensor {name!r} has unknown tensor type number {int(raw_type[0])}") from None
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        end = int(start_offs) + int(offset[0]) + math.prod(int(d) for d in dims) * block_bytes // block
        if end > size:
          raise _Corrupt(f"truncated: tensor {name!r} ends at byte {end} but the file has {size} bytes")
      super()._build_tensors(start_offs, fields)

  return Reader


class GGUFFile:
  """An open GGUF file: typed metadata lookups and float32 tensors, with errors that name the file.

  The file is memory-mapped; tensors are read (and dequantized) only when asked for, one at a time.

  Raises:
    CheckpointFileError: a missing file, or one that is not a readable GGUF file (bad magic, truncated,
      corrupt), naming the metadata key or tensor where reading stopped.
  """

  def __init__(self, path: str):
    self.path = str(path)
    if not os.path.isfile(self.path):
      raise CheckpointFileError(f"{self.path}: file not found")
    reader_class = _reader_class()
    reader = reader_class.__new__(reader_class)  # kept when __init__ fails: it knows the last key read
    try:
      reader.__init__(self.path)
    except _Corrupt as e:
      raise CheckpointFileError(f"{self.path}: not a valid GGUF file: {e}") from None
    except Exception as e:  # the reader raises ValueError, IndexError, KeyError... on a bad file
      if str(e) == "GGUF magic invalid":
        raise CheckpointFileError(f"{self.path}: not a GGUF file (the first 4 bytes are not b'GGUF')") from e
      where = "the header" if reader.last_key is None else f"the metadata after key {reader.last_key!r}"
      raise CheckpointFileError(
          f"{self.path}: truncated or corrupt GGUF file: cannot read {where} ({type(e).__name__}: {e})") from e
    self.fields = reader.fields
    self.tensors = {t.name: t for t in reader.tensors}

  def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """The value of metadata ``key``, type-checked (``int``, ``float``, ``str``, ``bool`` or ``list``);
    ``default`` when absent (required when no default is given)."""
    field = self.fields.get(key)
    if field is None:
      if default is ...:
        raise CheckpointFileError(f"{self.path}: metadata key {key!r} is missing")
      return default
    value = field.contents()
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
      value, ok = float(value), True
    if not ok:
      names = " or ".join(k.__name__ for k in kinds)
      shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)
      raise CheckpointFileError(f"{self.path}: metadata key {key!r} must be {names}, got {shown}")
    return value

  def tensor_type(self, name: str) -> str:
    return self.tensors[name].tensor_type.name

  def shape(self, name: str) -> tuple[int, ...]:
    """The tensor's shape in numpy (row-major) order: GGUF lists dimensions fastest-first."""
    return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

  def check_type(self, name: str) -> None:
    """Raises CheckpointFileError naming the tensor, its type and the supported ones when the type is not
    in ``TENSOR_TYPES``."""
    kind = self.tensor_type(name)
    if kind not in TENSOR_TYPES:
      raise CheckpointFileError(
          f"{self.path}: tensor {name!r} has type {kind}, which is not supported (supported: "
          f"{', '.join(TENSOR_TYPES)})")

  def blocks(self, name: str) -> Blocks | None:
    """Tensor ``name`` as its blocks, exactly as stored, when its type is one of ``BLOCK_TYPES`` (else None).

    Q4_0's ``w = (q - 8) d`` is returned as ``w = q d + low`` with ``low = -8 d`` (exact in float16: a power
    of two; None when ``8 d`` would overflow float16, so that the tensor takes the float path)."""
    kind, t = self.tensor_type(name), self.tensors[name]
    if kind not in BLOCK_TYPES:
      return None
    shape = self.shape(name)
    raw = np.asarray(t.data, np.uint8).reshape(-1, BLOCK_BYTES[kind])  # one row a block of 32 weights
    groups = shape[:-1] + (shape[-1] // BLOCK,)
    scale = raw[:, 0:2].copy().view(np.float16).reshape(groups)
    if kind == "Q8_0":
      return Blocks(raw[:, 2:].copy().view(np.int8).reshape(shape), scale, None)
    qs = raw[:, 4:] if kind == "Q4_1" else raw[:, 2:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(shape)  # byte j: weights j (low), j + 16 (high)
    if kind == "Q4_1":
      return Blocks(codes, scale, raw[:, 2:4].copy().view(np.float16).reshape(groups))
    low32 = -8.0 * scale.astype(np.float32)
    low = low32.astype(np.float16)
    return Blocks(codes, scale, low) if np.array_equal(low.astype(np.float32), low32) else None

  def array(self, name: str) -> np.ndarray:
    """Tensor ``name`` dequantized to float32, in numpy order (``[out, in]`` for a matrix)."""
    from gguf.quants import dequantize

    self.check_type(name)
    kind, t = self.tensor_type(name), self.tensors[name]
    try:
      x = dequantize(t.data, t.tensor_type)
    except Exception as e:
      raise CheckpointFileError(f"{self.path}: cannot dequantize tensor {name!r} of type {kind} ({e})") from e
    return x.reshape(self.shape(name))


FINGERPRINT_HEAD, FINGERPRINT_TAIL = 4 << 20, 1 << 20


def fingerprint(path: str) -> str:
  """A cheap identity of a GGUF file: ``"sha256:<hex>"`` over its size, its first 4 MiB (header, metadata and
  usually the tokenizer) and its last 1 MiB (tensor data). Reads at most 5 MiB whatever the file's size; two
  files share it only if they share those bytes and their length (another quantization or a re-export does
  not)."""
  import hashlib

  size = os.path.getsize(path)
  digest = hashlib.sha256(str(size).encode())
  with open(path, "rb") as f:
    digest.update(f.read(FINGERPRINT_HEAD))
    if size > FINGERPRINT_HEAD:
      f.seek(max(FINGERPRINT_HEAD, size - FINGERPRINT_TAIL))
      digest.update(f.read())
  return "sha256:" + digest.hexdigest()


def _open(path_or_file: str | GGUFFile) -> GGUFFile:
  return path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)


# ---------------------------------------------------------------------------------------- config


def unpermute_rotary(x: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's rotary reordering of a query or key projection (``llama`` files only).

  Args:
    x: ``[n_heads * head_dim, d_model]`` weight or ``[n_heads * head_dim]`` bias, Hugging Face layout as
      stored in the file, whose rows within each head run ``x0, y0, x1, y1, ...`` (interleaved pairs).
    n_heads: query heads for ``attn_q``, key/value heads for ``attn_k``.

  Returns:
    The same numbers with each head's rows in the two-halves order ``x0, x1, ..., y0, y1, ...`` that
    Hugging Face checkpoints and specjax's rotary embedding use.
  """
  rows = x.shape[0]
  return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _llama3_rope_from_factors(f: GGUFFile, factors: np.ndarray, head_dim: int, base: float,
                              context: int) -> dict[str, Any]:
  """The Llama 3 ``rope_parameters`` that reproduce ``rope_freqs.weight``, llama.cpp's per-frequency divisors.

  llama.cpp divides rotary frequency i by ``factors[i]``: 1 for short wavelengths, ``factor`` for long
  ones and a smooth ramp between. The ramp depends only on its two end wavelengths, so the fit recovers
  those (from the ramp's points, or from the gap between the plateaus when it has fewer than two) and
  expresses them as ``low_freq_factor`` / ``high_freq_factor`` of ``original_max_position_embeddings``.
  """
  from specjax.models.llama import RopeScaling, rope_frequencies

  key = "rope_freqs.weight"
  inv_freq = base ** (-np.arange(head_dim // 2, dtype=np.float64) / (head_dim // 2))
  wavelen = 2 * np.pi / inv_freq
  factors = factors.astype(np.float64)
  if factors.shape != inv_freq.shape or not np.all(factors >= 1.0 - 1e-6):
    raise CheckpointFileError(
        f"{f.path}: tensor {key!r} must hold {head_dim // 2} factors >= 1 (one per rotary frequency), "
        f"got shape {list(factors.shape)}, min {factors.min():.4g}")
  factor = float(factors.max())
  short = np.isclose(factors, 1.0, rtol=1e-5)
  long = np.isclose(factors, factor, rtol=1e-5)
  ramp = ~short & ~long
  # On the ramp 1/f = (1 - s)/factor + s with s linear in 1/wavelength: s = (1/w - 1/w_low)/(1/w_high - 1/w_low).
  s = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
  below = wavelen[short].max() if short.any() else 0.0
  above = wavelen[long].min() if long.any() else np.inf
  if ramp.sum() >= 2:
    slope, offset = np.polyfit(1.0 / wavelen[ramp], s[ramp], 1)
    w_low = -slope / offset
    w_high = 1.0 / (1.0 / slope + 1.0 / w_low)
  elif ramp.sum() == 1 and np.isfinite(above):
    w_low, (w, s1) = above, (wavelen[ramp][0], s[ramp][0])
    w_high = 1.0 / (1.0 / w_low + (1.0 / w - 1.0 / w_low) / s1)
  elif ramp.sum() == 0 and np.isfinite(above):
    w_high, w_low = below + (above - below) / 3, below + 2 * (above - below) / 3
  else:
    w_high = w_low = np.nan
  try:
    old = int(context)
    scaling = RopeScaling("llama3", factor, old / w_low, old / w_high, old)
    ours = np.asarray(rope_frequencies(head_dim, base, scaling), np.float64)
    fits = np.allclose(ours, inv_freq / factors, rtol=1e-4, atol=0)
  except (ValueError, ZeroDivisionError, OverflowError):
    fits = False
  if not fits:
    raise CheckpointFileError(
        f"{f.path}: tensor {key!r} holds rotary frequency factors that no Llama 3 rope scaling reproduces "
        "(specjax's LlamaConfig has no field for arbitrary per-frequency factors)")
  return {"rope_type": "llama3", "factor": factor, "low_freq_factor": old / w_low,
          "high_freq_factor": old / w_high, "original_max_position_embeddings": old}


def _hf_config(f: GGUFFile) -> tuple[dict[str, Any], dict[str, str]]:
  """The file's metadata as Hugging Face ``config.json`` fields, and which GGUF key each came from."""
  arch = f.get("general.architecture", str)
  if arch not in SUPPORTED:
    raise CheckpointFileError(
        f"{f.path}: general.architecture={arch!r} is not supported (supported: {', '.join(SUPPORTED)})")
  source: dict[str, str] = {}

  def key(hf_name: str, gguf_key: str, kind, default: Any = ...) -> Any:
    source[hf_name] = f"{arch}.{gguf_key}"
    value = f.get(f"{arch}.{gguf_key}", kind, default)
    if isinstance(value, list):
      raise CheckpointFileError(
          f"{f.path}: metadata key '{arch}.{gguf_key}' holds one value per layer ({len(value)} values); "
          "only a single value is supported")
    return value

  experts = f.get(f"{arch}.expert_count", int, 0)
  if experts:
    raise CheckpointFileError(
        f"{f.path}: metadata key '{arch}.expert_count' is {experts}: mixture-of-experts models are not supported")
  d_model = key("hidden_size", "embedding_length", int)
  n_heads = key("num_attention_heads", "attention.head_count", int)
  head_dim = key("head_dim", "attention.key_length", int, None)
  if head_dim is None:
    head_dim = d_model // n_heads if n_heads else 0
  value_dim = f.get(f"{arch}.attention.value_length", int, head_dim)
  if value_dim != head_dim:
    raise CheckpointFileError(
        f"{f.path}: metadata key '{arch}.attention.value_length' ({value_dim}) must equal the key length "
        f"({head_dim})")
  rope_dims = f.get(f"{arch}.rope.dimension_count", int, head_dim)
  if rope_dims != head_dim and arch != "phi3":
    raise CheckpointFileError(
        f"{f.path}: metadata key '{arch}.rope.dimension_count' is {rope_dims} but the head size is "
        f"{head_dim}: rotary embedding on part of each head is not supported")
  if "token_embd.weight" not in f.tensors:
    raise CheckpointFileError(f"{f.path}: tensor 'token_embd.weight' is missing")
  vocab = f.shape("token_embd.weight")[0]
  stated = f.get(f"{arch}.vocab_size", int, vocab)
  if stated != vocab:
    raise CheckpointFileError(
        f"{f.path}: metadata key '{arch}.vocab_size' is {stated} but tensor 'token_embd.weight' has {vocab} rows")
  base = key("rope_theta", "rope.freq_base", float, 10000.0)
  context = key("max_position_embeddings", "context_length", int)
  rope: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
  source["rope_parameters"] = f"{arch}.rope.scaling.type"
  kind = f.get(f"{arch}.rope.scaling.type", str, "none")
  legacy = f.get(f"{arch}.rope.scale_linear", float, None)
  if kind == "linear" or (kind == "none" and legacy not in (None, 1.0)):
    factor = legacy if kind == "none" else f.get(f"{arch}.rope.scaling.factor", float)
    rope.update(rope_type="linear", factor=factor)
  elif kind != "none":
    raise CheckpointFileError(
        f"{f.path}: metadata key '{arch}.rope.scaling.type' is {kind!r}, which is not supported (supported: "
        "'none', 'linear'; Llama 3 scaling comes from tensor 'rope_freqs.weight')")
  if arch == "phi3":
    source["partial_rotary_factor"] = f"{arch}.rope.dimension_count"
    rope["partial_rotary_factor"] = rope_dims / head_dim
  if "rope_factors_short.weight" in f.tensors or "rope_factors_long.weight" in f.tensors:
    if rope["rope_type"] != "default" or arch != "phi3":
      raise CheckpointFileError(f"{f.path}: tensors 'rope_factors_short.weight' / 'rope_factors_long.weight' are "
                                f"supported only in phi3 files without '{arch}.rope.scaling.type'")
    for name in ("rope_factors_short.weight", "rope_factors_long.weight"):
      if name not in f.tensors:
        raise CheckpointFileError(f"{f.path}: tensor {name!r} is missing (its LongRoPE partner is present)")
    source["original_max_position_embeddings"] = f"{arch}.rope.scaling.original_context_length"
    rope.update(rope_type="longrope", short_factor=f.array("rope_factors_short.weight").tolist(),
                long_factor=f.array("rope_factors_long.weight").tolist(),
                original_max_position_embeddings=f.get(f"{arch}.rope.scaling.original_context_length", int),
                attention_factor=f.get(f"{arch}.rope.scaling.attn_factor", float, 1.0))
  if "rope_freqs.weight" in f.tensors:
    if rope["rope_type"] != "default":
      raise CheckpointFileError(
          f"{f.path}: tensor 'rope_freqs.weight' together with '{arch}.rope.scaling.type'={kind!r} is not "
          "supported")
    factors = f.array("rope_freqs.weight")
    if not np.allclose(factors, 1.0):
      rope.update(_llama3_rope_from_factors(f, factors, head_dim, base, context))
  hf = {
      "model_type": arch,
      "vocab_size": vocab,
      "hidden_size": d_model,
      "intermediate_size": key("intermediate_size", "feed_forward_length", int),
      "num_hidden_layers": key("num_hidden_layers", "block_count", int),
      "num_attention_heads": n_heads,
      "num_key_value_heads": key("num_key_value_heads", "attention.head_count_kv", int, n_heads),
      "head_dim": head_dim,
      "rms_norm_eps": key("rms_norm_eps", "attention.layer_norm_rms_epsilon", float),
      "max_position_embeddings": context,
      "rope_parameters": rope,
      "tie_word_embeddings": "output.weight" not in f.tensors,
  }
  source["tie_word_embeddings"] = "tensor 'output.weight'"
  if arch == "llama":
    hf["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    source["attention_bias"] = "tensor 'blk.0.attn_q.bias'"
  elif arch == "phi3":  # llama.cpp writes 0 for "no window"
    hf["sliding_window"] = key("sliding_window", "attention.sliding_window", int, 0) or None
  elif arch == "gemma3":
    hf.update(_gemma3_fields(f, hf, rope, source))
  else:
    hf["use_sliding_window"] = False  # llama.cpp runs qwen2 and qwen3 with full attention on every layer
  return hf, source


def _gemma3_fields(f: GGUFFile, hf: dict[str, Any], rope: dict[str, Any], source: dict[str, str]) -> dict[str, Any]:
  """The ``gemma3_text`` config fields of a ``gemma3`` file, defaulted as llama.cpp's code defaults them."""
  arch, n_layers = "gemma3", hf["num_hidden_layers"]
  window = f.get(f"{arch}.attention.sliding_window", int, None)
  pattern = f.get(f"{arch}.attention.sliding_window_pattern", (int, list), 6)
  source.update(layer_types=f"{arch}.attention.sliding_window_pattern",
                sliding_window=f"{arch}.attention.sliding_window",
                final_logit_softcapping=f"{arch}.final_logit_softcapping")
  if isinstance(pattern, list):  # one flag per layer: true = local
    sliding = [bool(x) for x in pattern]
  else:  # llama.cpp: layer i is local when i % n < n - 1 (n = 0: every layer)
    sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
  if window is None:  # the converter writes no window when every layer is global
    sliding = [False] * n_layers
  local = f.get(f"{arch}.rope.freq_base_swa", float, 10000.0)
  d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]
  return {
      "model_type": "gemma3_text",
      "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
      "sliding_window": window,
      "rope_parameters": {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}},
      "query_pre_attn_scalar": d_model // n_heads if n_layers == 62 else hf["head_dim"],
      "final_logit_softcapping": f.get(f"{arch}.final_logit_softcapping", float, None),
      "hidden_activation": "gelu_pytorch_tanh",
  }


def config_from_gguf(path_or_file: str | GGUFFile, dtype: str = "float32"):
  """Maps a GGUF file's metadata to ``(architecture, LlamaConfig)``; refuses what specjax cannot run exactly.

  Raises:
    CheckpointFileError: naming the file and the metadata key (or tensor) at fault.
  """
  f = _open(path_or_file)
  hf, source = _hf_config(f)
  try:
    return config_from_hf(hf, dtype)
  except CheckpointFileError as e:
    # config_from_hf names Hugging Face fields; add the GGUF keys they were read from.
    message = str(e).removeprefix("config.json: ")
    keys = [f"{name} = {source[name]}" for name in source if name in message]
    legend = f" [GGUF: {'; '.join(keys)}]" if keys else ""
    raise CheckpointFileError(f"{f.path}: {message}{legend}") from e


def _gguf_name(hf_key: str, post_norms: bool = False) -> str:
  """llama.cpp's name for a Hugging Face tensor name of a Llama-family model (``post_norms``: Gemma 2/3's
  four norms per layer)."""
  module, _, kind = hf_key.rpartition(".")
  if module in _GLOBAL_NAMES:
    return f"{_GLOBAL_NAMES[module]}.{kind}"
  _, _, layer, rest = module.split(".", 3)  # model.layers.{i}.{rest}
  name = _POST_NORM_NAMES[rest] if post_norms and rest in _POST_NORM_NAMES else _LAYER_NAMES[rest]
  return f"blk.{layer}.{name}.{kind}"


def load_gguf_model(path: str, dtype: str = "float32", group: int | None | str = "default"):
  """Loads the model of a GGUF file (no tokenizer). See :func:`load_gguf`."""
  quant = dtype if dtype in QUANT_DTYPES else None
  dtype = "float32" if quant else dtype
  f = _open(path)
  family, cfg = config_from_gguf(f, dtype)
  for name in f.tensors:  # refuse before dequantizing anything
    f.check_type(name)
  params = ParamTree(cfg)
  specs: dict[str, list] = {}  # GGUF name -> its pieces (several for a fused tensor)
  for spec in tensor_specs(family, cfg):
    specs.setdefault(_gguf_name(spec.key, cfg.post_norms), []).append(spec)
  rope_tensors = {"rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight"}
  unexpected = sorted(set(f.tensors) - set(specs) - rope_tensors)
  if unexpected:
    raise CheckpointFileError(
        f"{f.path}: unexpected tensor {unexpected[0]!r} (not part of a {family} model as the metadata "
        f"describes it){f' and {len(unexpected) - 1} more' if len(unexpected) > 1 else ''}")
  for name, pieces in specs.items():
    if name not in f.tensors:
      raise CheckpointFileError(f"{f.path}: tensor {name!r} is missing (the metadata describes a {family} model "
                            f"with {cfg.n_layers} blocks)")
    params.check_shape(pieces, f.shape(name), f"{f.path}: tensor {name!r}", "the metadata")
    rows = lambda x: x
    if family == "llama" and ".attn_q." in name:
      rows = lambda x: unpermute_rotary(x, cfg.n_heads)
    elif family == "llama" and ".attn_k." in name:
      rows = lambda x: unpermute_rotary(x, cfg.n_kv_heads)
    blocks = f.blocks(name) if quant and f.tensor_type(name) in KEPT_BLOCKS[quant] else None
    if blocks is not None and params.put_blocks(pieces, blocks.map_rows(rows), dtype):
      continue  # kept as the file's blocks: codes and scales as stored
    x = rows(f.array(name))
    if family == "gemma3_text" and name.endswith("norm.weight"):
      x = x - 1.0  # llama.cpp's converter stores Gemma's 1 + w
    params.put(pieces, x, dtype)  # one tensor at a time: dequantized, cast, rearranged, handed to JAX
    del x
  model = params.model()
  return model if quant is None else quantize(model, quant, group)


# ------------------------------------------------------------------------------------- tokenizer

# Pre-tokenizer splits by tokenizer.ggml.pre, as llama.cpp names them. Names not listed here that use
# GPT-2's own split ("default", "gpt-2", "smollm") get the ByteLevel pre-tokenizer's built-in regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None, "gpt-2": None, "smollm": None,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class GGUFTokenizer(HFTokenizer):
  """:class:`~specjax.hf.HFTokenizer` rebuilt from a GGUF file's metadata.

  ``encode`` adds BOS (and EOS) when the file's ``tokenizer.ggml.add_bos_token`` (``add_eos_token``) says
  so; ``bos_id`` / ``eos_id`` come from ``tokenizer.ggml.bos_token_id`` / ``eos_token_id`` (None when
  absent). ``chat`` is the file's chat template as a :class:`specjax.chat.ChatFormat`, or None.
  """

  def __init__(self, tokenizer, eos_id: int | None = None, bos_id: int | None = None, chat=None):
    super().__init__(tokenizer, eos_id=eos_id)
    self.bos_id = bos_id
    self.chat = chat


def _byte_level_bpe(f: GGUFFile, tokens: list[str]):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  pre = f.get("tokenizer.ggml.pre", str, "default")
  if pre not in PRE_TOKENIZERS:
    raise CheckpointFileError(
        f"{f.path}: metadata key 'tokenizer.ggml.pre' is {pre!r}, which is not supported (supported: "
        f"{', '.join(PRE_TOKENIZERS)})")
  # Tokens are spelled in GPT-2's byte alphabet, except some added ones written as plain text: respell those.
  stand_in = byte_stand_ins()
  alphabet = set(stand_in.values())
  vocab = {t if set(t) <= alphabet else "".join(stand_in[b] for b in t.encode("utf-8")): i
           for i, t in enumerate(tokens)}
  merges = [tuple(m.split(" ")) for m in f.get("tokenizer.ggml.merges", list)]
  try:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  except Exception as e:
    raise CheckpointFileError(f"{f.path}: metadata key 'tokenizer.ggml.merges' does not fit the tokens ({e})") from e
  split = PRE_TOKENIZERS[pre]
  if split is None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    from tokenizers import Regex

    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  return tok, alphabet


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
  """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens, the
  higher the merged token's score the earlier (ties: longer left part, then longer right part, then
  token order), which is the order SentencePiece's BPE applies them in."""
  ids = {t: i for i, t in enumerate(tokens)}
  merges = []
  for i, token in enumerate(tokens):
    pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
    pairs.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
    merges += [(scores[i], len(a), len(b), a, b) for a, b in pairs]
  merges.sort(key=lambda m: (-m[0], -m[1], -m[2]))  # stable: ties keep token order
  return [(a, b) for _, _, _, a, b in merges]


def _sentencepiece_bpe(f: GGUFFile, tokens: list[str]):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  if "tokenizer.ggml.merges" in f.fields:
    merges = [tuple(m.split(" ")) for m in f.get("tokenizer.ggml.merges", list)]
  else:
    scores = f.get("tokenizer.ggml.scores", list)
    if len(scores) != len(tokens):
      raise CheckpointFileError(f"{f.path}: metadata key 'tokenizer.ggml.scores' has {len(scores)} entries but "
                            f"'tokenizer.ggml.tokens' has {len(tokens)}")
    merges = _sentencepiece_merges(tokens, scores)
  vocab = {t: i for i, t in enumerate(tokens)}
  try:
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
  except Exception as e:
    raise CheckpointFileError(f"{f.path}: the merges do not fit 'tokenizer.ggml.tokens' ({e})") from e
  prefix = f.get("tokenizer.ggml.add_space_prefix", bool, True)
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                               split=False)
  steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
  return tok, None


def load_gguf_tokenizer(path: str | GGUFFile) -> GGUFTokenizer:
  """Rebuilds the tokenizer a GGUF file describes (see :func:`load_gguf`).

  Raises:
    CheckpointFileError: a missing or malformed ``tokenizer.*`` key, or an unsupported tokenizer model or
      pre-tokenizer, naming the file and the key.
  """
  from tokenizers import AddedToken, processors

  from specjax.chat import ChatFormat, ChatTemplateError

  f = _open(path)
  kind = f.get("tokenizer.ggml.model", str)
  if kind not in TOKENIZER_MODELS:
    raise CheckpointFileError(f"{f.path}: metadata key 'tokenizer.ggml.model' is {kind!r}, which is not supported "
                          f"(supported: {', '.join(TOKENIZER_MODELS)})")
  tokens = f.get("tokenizer.ggml.tokens", list)
  types = f.get("tokenizer.ggml.token_type", list, None) or [1] * len(tokens)
  if len(types) != len(tokens):
    raise CheckpointFileError(f"{f.path}: metadata key 'tokenizer.ggml.token_type' has {len(types)} entries but "
                          f"'tokenizer.ggml.tokens' has {len(tokens)}")
  tok, alphabet = (_byte_level_bpe if kind == "gpt2" else _sentencepiece_bpe)(f, tokens)

  def token_id(name: str) -> int | None:
    i = f.get(f"tokenizer.ggml.{name}", int, None)
    if i is not None and not 0 <= i < len(tokens):
      raise CheckpointFileError(f"{f.path}: metadata key 'tokenizer.ggml.{name}' is {i}, outside the "
                            f"{len(tokens)} tokens")
    return i

  bos, eos, unk, pad = (token_id(n) for n in ("bos_token_id", "eos_token_id", "unknown_token_id",
                                               "padding_token_id"))
  # Control tokens (and the named special ones) match whole and are dropped when decoding; user-defined
  # tokens match whole but are text. A control token spelled outside a byte-level alphabet is a
  # mislabelled entry that no text can produce, so it stays out (as in transformers).
  special = {i for i, t in enumerate(types) if t == _CONTROL and (alphabet is None or set(tokens[i]) <= alphabet)}
  special |= {i for i in (bos, eos, unk, pad) if i is not None}
  tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special)])
  user = [i for i, t in enumerate(types) if t == _USER_DEFINED and i not in special]
  if user:
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in user])

  # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
  add_bos = f.get("tokenizer.ggml.add_bos_token", bool, kind == "llama") and bos is not None
  add_eos = f.get("tokenizer.ggml.add_eos_token", bool, False) and eos is not None
  if add_bos or add_eos:
    ends = ([(tokens[bos], bos)] if add_bos else []) + ([(tokens[eos], eos)] if add_eos and eos != bos else [])
    first, last = ([f"{tokens[bos]}:0"] if add_bos else []), ([f"{tokens[eos]}:0"] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(
        single=first + ["$A:0"] + last, pair=first + ["$A:0"] + last + first + ["$B:1"] + last,
        special_tokens=ends)
  template = f.get("tokenizer.chat_template", str, None)
  out = GGUFTokenizer(tok, eos_id=eos, bos_id=bos)
  if template is not None:
    try:
      out.chat = ChatFormat.create(template, out)
    except ChatTemplateError as e:
      raise CheckpointFileError(f"{f.path}: metadata key 'tokenizer.chat_template': {e}") from e
  return out


def load_gguf(path: str, dtype: str = "float32", group: int | None | str = "default"):
  """Loads a GGUF file: ``(model, tokenizer)``.

  Args:
    path: a ``.gguf`` file of architecture ``llama``, ``qwen2``, ``qwen3``, ``phi3`` or ``gemma3`` whose
      tensors are of the types in ``TENSOR_TYPES`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K).
    dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: the weights' storage and activation dtype
      (quantized tensors are dequantized to float32 first, then cast). ``"int8"`` or ``"int4"``: weight-only
      quantization with float32 activations, keeping the file's own blocks where they map onto
      :mod:`specjax.quant`'s layouts (``KEPT_BLOCKS``): Q8_0 tensors become int8 in groups of 32 under both,
      Q4_0 / Q4_1 tensors int4 in groups of 32 under ``"int4"``, codes and float16 scales (and minima) as
      stored, so the weights read exactly as the file's dequantization. Every other weight (another type, a
      Q4 tensor under ``"int8"``, a block that does not run along our layout's contracting axis) is read to
      float32 and quantized by :func:`specjax.quant.quantize` with ``group``.
    group: the quantization group of those other weights (see :func:`specjax.quant.quantize`).

  Returns:
    A :class:`~specjax.models.llama.Llama` with the forward contract of every specjax model, and a
    :class:`GGUFTokenizer` (an :class:`~specjax.hf.HFTokenizer`) usable as ``tokenizer=`` in
    :func:`specjax.generate`, with ``bos_id``, ``eos_id`` and ``chat`` (the chat template, or None).

  Raises:
    CheckpointFileError (a ValueError): a missing, truncated or corrupt file, an unsupported architecture,
      tensor type or tokenizer, or a missing or malformed key or tensor; the message names the file and
      the key or tensor.
  """
  if dtype not in LOAD_DTYPES + QUANT_DTYPES:
    raise CheckpointFileError(f"dtype must be one of {LOAD_DTYPES + QUANT_DTYPES}, got {dtype!r}")
  f = _open(path)
  tokenizer = load_gguf_tokenizer(f)
  model = load_gguf_model(f, dtype, group)
  if tokenizer.vocab_size > model.cfg.vocab_size:
    raise CheckpointFileError(
        f"{f.path}: metadata key 'tokenizer.ggml.tokens' lists {tokenizer.vocab_size} tokens but tensor "
        f"'token_embd.weight' has only {model.cfg.vocab_size} rows")
  return model, tokenizer
