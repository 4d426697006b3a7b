"""Hugging Face checkpoints in and out: ``config.json`` + ``*.safetensors`` + ``tokenizer.json``.

Import (:func:`load_hf`) reads a checkpoint directory of one of the families in ``SUPPORTED`` into a
specjax model (:class:`~specjax.models.llama.Llama` for the Llama, Mistral, Qwen2/3, Gemma 1-3 and Phi-3
families,
:class:`~specjax.models.gpt2.GPT2` for GPT-2) plus an :class:`~specjax.tokenizer.HFTokenizer`. Every
config option that changes the forward pass is either mapped or refused with an :class:`CheckpointFileError`
naming the field; options that only matter for training (dropout, initialisation) are not read. The
tokenizer side (reading ``tokenizer.json``, comparing a target's and a draft's) lives in
:mod:`specjax.tokenizer`.

Weights stream one tensor at a time: each is read from its safetensors file, cast to the requested dtype,
rearranged to specjax's ``[in, out]`` layout and placed, so the host never holds a second full copy.
The model is built abstractly (``nnx.eval_shape``), so no random initialisation is spent either.

Export (:func:`save_hf`) writes the reverse: a directory that ``transformers`` loads with no custom code
(``LlamaForCausalLM`` for a plain Llama config; Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3 or
GPT-2 when the config uses their features).

A MiMo checkpoint (``model_type`` ``mimo``) loads here as its Qwen2 body; its MTP layers
(``model.mtp_layers.*``) are left to :mod:`specjax.mimo`, which ``specjax.load`` uses to build the MTP proposer.

One table, :func:`tensor_specs`, names every tensor of a family and how its layout maps onto ours;
import, export and the shape checks all read it. Fused tensors (Phi-3's ``qkv_proj`` and
``gate_up_proj``) appear in it once per piece, under the same name, in the order they are stacked.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.gpt2 import GPT2, GPT2Config
from specjax.models.llama import Llama, LlamaConfig, RopeScaling
from specjax.numerics import FLOAT_DTYPES
from specjax.tokenizer import ByteTokenizer, byte_level_tokenizer, check_same_vocab, load_hf_tokenizer

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2", "mimo")
LOAD_DTYPES = FLOAT_DTYPES

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "mimo": "MiMoForCausalLM",
}
# Tensors of the multi-token-prediction layers a MiMo checkpoint carries beside its body; the body loader
# leaves them to specjax.mimo, which builds the MTP proposer from them.
MIMO_MTP_PREFIX = "model.mtp_layers."
# Hugging Face activation names -> ours. Gemma 1 configs say "gelu" but mean the tanh form (as
# transformers itself decides), handled in _llama_family_config.
_ACTIVATIONS = {
    "silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}
_GEMMA = ("gemma", "gemma2", "gemma3_text")
# Rope types each family's transformers code accepts that _rope_entry computes. Phi-3 takes only "default"
# and "longrope" (its older spellings "su" and "yarn" mean longrope there).
_ROPE_TYPES = {"phi3": ("default", "longrope", "su", "yarn")}
# Buffers some checkpoints carry that are recomputed, not learned (causal masks, rotary tables).
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


class CheckpointFileError(ValueError):
  """A checkpoint directory that cannot be loaded or written; the message names the file or field."""


# --------------------------------------------------------------------------------------- config


def _read_json(file: str) -> dict[str, Any]:
  try:
    with open(file, encoding="utf-8") as f:
      data = json.load(f)
  except FileNotFoundError as e:
    raise CheckpointFileError(f"{file}: file not found") from e
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointFileError(f"{file}: not valid JSON ({e})") from e
  if not isinstance(data, dict):
    raise CheckpointFileError(f"{file}: expected a JSON object, got {type(data).__name__}")
  return data


def _field(hf: dict, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
  """``hf[name]``, type-checked; ``default`` when absent or null (required when no default)."""
  value = hf.get(name)
  if value is None:
    if default is ...:
      raise CheckpointFileError(f"config.json: required field {name!r} is missing")
    return default
  ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, float, (int, float)))
  if not ok:
    raise CheckpointFileError(f"config.json: field {name!r} has the wrong type: {value!r}")
  return value


def _refuse_if(condition: bool, field: str, value: Any, why: str) -> None:
  if condition:
    raise CheckpointFileError(f"config.json: {field}={value!r} is not supported ({why})")


def _rope_entry(rope: dict, field: str, base: float, family: str, hf: dict) -> tuple[float, RopeScaling | None]:
  """``(base, scaling)`` from one rope parameter object (``field`` names it in errors); ``base`` is the
  default when the object has no ``rope_theta``."""
  base = float(rope.get("rope_theta", base))
  kind = rope.get("rope_type", rope.get("type", "default"))
  allowed = _ROPE_TYPES.get(family, ("default", "linear", "llama3"))
  if kind not in allowed:
    raise CheckpointFileError(f"config.json: {field}.rope_type={kind!r} is not supported "
                              f"(supported: {', '.join(repr(k) for k in allowed)})")
  try:
    if kind == "linear":
      return base, RopeScaling("linear", float(rope["factor"]))
    if kind == "llama3":
      return base, RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                               float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    if kind in ("longrope", "su", "yarn"):  # Phi-3's LongRoPE, as transformers computes it
      original = rope.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
      if original is None:
        raise KeyError("original_max_position_embeddings")
      original = int(original)
      factor = rope.get("factor") or _field(hf, "max_position_embeddings", int, 2048) / original
      scale = rope.get("attention_factor")
      if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
      return base, RopeScaling("longrope", 1.0, original_max_seq_len=original,
                               freq_factors=tuple(rope["short_factor"]), long_factors=tuple(rope["long_factor"]),
                               attention_factor=float(scale))
  except KeyError as e:
    raise CheckpointFileError(f"config.json: {field} of rope_type {kind!r} lacks {e.args[0]!r}") from e
  except (TypeError, ValueError) as e:
    raise CheckpointFileError(f"config.json: {field}: {e}") from e
  return base, None


def rope_parameters(base: float, scaling: RopeScaling | None) -> dict[str, Any]:
  """A rotary setting as transformers writes it (``rope_parameters``; the pre-5.0 ``rope_scaling`` object)."""
  rope: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
  if scaling is not None:
    rope.update(rope_type=scaling.kind, factor=scaling.factor)
    if scaling.kind == "llama3":
      rope.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                  original_max_position_embeddings=scaling.original_max_seq_len)
    if scaling.kind == "longrope":
      rope.update(short_factor=list(scaling.freq_factors),
                  long_factor=list(scaling.long_factors or scaling.freq_factors),
                  original_max_position_embeddings=scaling.original_max_seq_len,
                  attention_factor=scaling.attention_factor)
      del rope["factor"]
  return rope


@dataclasses.dataclass(frozen=True)
class _Rope:
  base: float
  scaling: RopeScaling | None
  partial: float = 1.0  # partial_rotary_factor
  local_base: float | None = None  # Gemma 3's sliding-window layers


def _rope(hf: dict, family: str) -> _Rope:
  """The rotary settings from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``
  (older files); Gemma 3 keeps one object per layer type (or ``rope_local_base_freq``)."""
  params = hf.get("rope_parameters")
  legacy = hf.get("rope_scaling")
  field = "rope_parameters" if params is not None else "rope_scaling"
  rope = params if params is not None else legacy
  rope = {} if rope is None else rope
  if not isinstance(rope, dict):
    raise CheckpointFileError(f"config.json: field {field!r} must be an object, got {rope!r}")
  nested = any(isinstance(v, dict) for v in rope.values())
  if family == "gemma3_text":
    global_base = _field(hf, "rope_theta", (int, float), 1e6)
    local = {"rope_theta": _field(hf, "rope_local_base_freq", (int, float), 1e4)}
    local_field = "rope_local_base_freq"
    if nested:
      unknown = sorted(set(rope) - {"full_attention", "sliding_attention"})
      _refuse_if(bool(unknown), f"{field} layer type", unknown, "Gemma 3 has full_attention and sliding_attention")
      local, local_field = rope.get("sliding_attention") or local, f"{field}.sliding_attention"
      rope, field = rope.get("full_attention") or {}, f"{field}.full_attention"
    base, scaling = _rope_entry(rope, field, global_base, family, hf)
    local_base, local_scaling = _rope_entry(local, local_field, 1e4, family, hf)
    _refuse_if(local_scaling is not None, f"{local_field}.rope_type", local_scaling and local_scaling.kind,
               "scaled rotary on the local layers is not implemented")
    for part in (rope, local):
      _refuse_if(part.get("partial_rotary_factor") not in (None, 1, 1.0), "partial_rotary_factor",
                 part.get("partial_rotary_factor"), "Gemma 3 rotates whole heads")
    return _Rope(base, scaling, local_base=local_base)
  if nested:
    raise CheckpointFileError(f"config.json: {field} per layer type is not supported: {rope!r}")
  base, scaling = _rope_entry(rope, field, _field(hf, "rope_theta", (int, float), 10000.0), family, hf)
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  partial = 1.0 if partial is None else partial
  _refuse_if(family != "phi3" and partial not in (1, 1.0), "partial_rotary_factor", partial,
             f"{family} rotates whole heads in transformers; only phi3 reads it")
  if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0.0 < partial <= 1.0:
    raise CheckpointFileError(f"config.json: partial_rotary_factor must be a number in (0, 1], got {partial!r}")
  return _Rope(base, scaling, partial=float(partial))


def _layer_windows(hf: dict, family: str, n_layers: int) -> tuple[int | None, tuple[bool, ...] | None]:
  """``(sliding_window, sliding_layers)`` as each family's transformers code decides them."""
  window = _field(hf, "sliding_window", int, None)
  layer_types = hf.get("layer_types")
  if family in ("mistral", "phi3"):  # one window on every layer
    _refuse_if(layer_types is not None, "layer_types", layer_types, f"{family} with per-layer attention types")
    return window, None
  if family in ("qwen2", "qwen3"):
    if not hf.get("use_sliding_window", False):
      return None, None
  if family in ("llama", "gemma"):
    _refuse_if(layer_types is not None and any(t != "full_attention" for t in layer_types), "layer_types",
               layer_types, f"{family} has no sliding-window layers")
    return None, None
  if layer_types is None:
    if family in ("qwen2", "qwen3"):
      first = _field(hf, "max_window_layers", int, 28)
      layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    elif family == "gemma3_text":  # every pattern-th layer is global, the others local
      pattern = _field(hf, "sliding_window_pattern", int, 6)
      _refuse_if(pattern < 1, "sliding_window_pattern", pattern, "must be >= 1")
      layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    else:  # gemma2 alternates, starting with a sliding layer
      layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
  if not isinstance(layer_types, list) or len(layer_types) != n_layers:
    raise CheckpointFileError(
        f"config.json: layer_types must list one type per layer (num_hidden_layers={n_layers}), "
        f"got {layer_types!r}")
  for t in layer_types:
    _refuse_if(t not in ("full_attention", "sliding_attention"), "layer_types", t, "unknown attention type")
  sliding = tuple(t == "sliding_attention" for t in layer_types)
  if not any(sliding):
    return None, None
  if window is None:
    raise CheckpointFileError("config.json: layer_types has sliding_attention layers but sliding_window is null")
  return window, sliding


def _llama_family_config(hf: dict, family: str, dtype: str) -> LlamaConfig:
  gemma = family in _GEMMA
  d_model = _field(hf, "hidden_size", int)
  n_heads = _field(hf, "num_attention_heads", int)
  n_layers = _field(hf, "num_hidden_layers", int)
  n_kv_heads = _field(hf, "num_key_value_heads", int, n_heads)
  if n_kv_heads < 1 or n_heads % n_kv_heads:
    raise CheckpointFileError(
        f"config.json: num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads "
        f"({n_kv_heads})")
  for name in ("mlp_bias", "use_bidirectional_attention"):
    _refuse_if(bool(hf.get(name)), name, hf.get(name), "not implemented")
  bias = hf.get("attention_bias", False)
  _refuse_if(bool(bias), "attention_bias", bias, "biases on the q/k/v/o projections are not implemented")
  act_field = ("hidden_activation" if family in ("gemma2", "gemma3_text") or hf.get("hidden_activation")
               else "hidden_act")
  act = hf.get(act_field) or ("gelu_pytorch_tanh" if gemma else "silu")
  if family == "gemma" and act == "gelu":
    act = "gelu_pytorch_tanh"  # legacy Gemma value; transformers runs the tanh form too
  _refuse_if(act not in _ACTIVATIONS, act_field, act, f"supported: {sorted(_ACTIVATIONS)}")
  rope = _rope(hf, family)
  window, sliding = _layer_windows(hf, family, n_layers)
  # transformers' Qwen3 and Gemma 3 configs default head_dim to a constant, not hidden_size / heads.
  head_dim = _field(hf, "head_dim", int, {"qwen3": 128, "gemma3_text": 256}.get(family)) or d_model // n_heads
  extra: dict[str, Any] = {}
  if gemma:
    extra.update(norm_offset=1.0, embed_scale=d_model**0.5)
  if family in ("gemma2", "gemma3_text"):
    scalar = _field(hf, "query_pre_attn_scalar", (int, float), 256)
    extra.update(post_norms=True, attn_scale=float(scalar) ** -0.5,
                 attn_softcap=_field(hf, "attn_logit_softcapping", (int, float), None),
                 final_softcap=_field(hf, "final_logit_softcapping", (int, float), None))
  elif family == "gemma":
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
      _refuse_if(hf.get(name) is not None, name, hf.get(name), "not part of Gemma 1")
  if family == "gemma3_text":
    # transformers' Gemma3Attention never applies attn_logit_softcapping (Gemma 3 replaced it with the
    # query/key norms); rather than guess, a config that sets it is refused.
    _refuse_if(extra.pop("attn_softcap") is not None, "attn_logit_softcapping", hf.get("attn_logit_softcapping"),
               "transformers' Gemma 3 ignores it; specjax will not guess")
    local = rope.local_base
    if sliding is None or (local == rope.base and rope.scaling is None):
      local = None  # no local layers, or they rotate as the global ones
    extra.update(qk_norm=True, local_rope_base=local)
  if family == "qwen3":
    extra.update(qk_norm=True)
  max_seq_len = _field(hf, "max_position_embeddings", int, 2048)
  if rope.scaling is not None and rope.scaling.kind == "longrope":
    # Exact only while the sequence fits the original context (then transformers too uses short_factor).
    max_seq_len = min(max_seq_len, rope.scaling.original_max_seq_len)
  if rope.partial != 1.0:
    rotary = int(head_dim * rope.partial)
    _refuse_if(rotary < 2 or rotary % 2, "partial_rotary_factor", rope.partial,
               f"head_dim {head_dim} * factor must give an even rotary size >= 2, got {rotary}")
    extra.update(rotary_dim=rotary)
  try:
    return LlamaConfig(
        vocab_size=_field(hf, "vocab_size", int),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=_field(hf, "intermediate_size", int),
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_base=rope.base,
        rope_scaling=rope.scaling,
        norm_eps=float(_field(hf, "rms_norm_eps", (int, float), 1e-5 if family == "phi3" else 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        max_seq_len=max_seq_len,
        dtype=dtype,
        param_dtype=dtype,
        qkv_bias=family == "qwen2",
        activation=_ACTIVATIONS[act],
        sliding_window=window,
        sliding_layers=sliding,
        **extra,
    )
  except CheckpointFileError:
    raise
  except ValueError as e:
    raise CheckpointFileError(f"config.json: {e}") from e


def _gpt2_config(hf: dict, dtype: str) -> GPT2Config:
  for name in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
    _refuse_if(bool(hf.get(name)), name, hf.get(name), "not implemented")
  act = hf.get("activation_function", "gelu_new")
  _refuse_if(act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"), "activation_function", act,
             "supported: gelu_new, gelu_pytorch_tanh, gelu")
  tie = hf.get("tie_word_embeddings", True)
  _refuse_if(not tie, "tie_word_embeddings", tie, "GPT-2's LM head is always its token embedding here")
  d_model, n_heads = _field(hf, "n_embd", int), _field(hf, "n_head", int)
  try:
    return GPT2Config(
        vocab_size=_field(hf, "vocab_size", int),
        d_model=d_model,
        n_layers=_field(hf, "n_layer", int),
        n_heads=n_heads,
        max_seq_len=_field(hf, "n_positions", int, 1024),
        d_ff=_field(hf, "n_inner", int, None),
        norm_eps=float(_field(hf, "layer_norm_epsilon", (int, float), 1e-5)),
        activation=_ACTIVATIONS[act],
        attn_scale=None if hf.get("scale_attn_weights", True) else 1.0,
        dtype=dtype,
        param_dtype=dtype,
    )
  except ValueError as e:
    raise CheckpointFileError(f"config.json: {e}") from e


def config_from_hf(hf: dict, dtype: str = "float32") -> tuple[str, LlamaConfig | GPT2Config]:
  """Maps a parsed ``config.json`` to ``(family, specjax config)``; refuses what it cannot run exactly.

  Raises:
    CheckpointFileError: naming the unsupported or malformed field.
  """
  if dtype not in LOAD_DTYPES:
    raise CheckpointFileError(f"dtype must be one of {LOAD_DTYPES}, got {dtype!r}")
  family = hf.get("model_type")
  if family == "gemma3":
    raise CheckpointFileError(
        "config.json: model_type='gemma3' (the multimodal Gemma3ForConditionalGeneration) is not supported; "
        "text-only Gemma 3 checkpoints (model_type 'gemma3_text', Gemma3ForCausalLM) are")
  if family not in SUPPORTED:
    raise CheckpointFileError(
        f"config.json: model_type={family!r} is not supported (supported: {', '.join(SUPPORTED)})")
  archs = hf.get("architectures")
  if archs is not None:
    _refuse_if(archs != [_ARCHITECTURES[family]], "architectures", archs,
               f"expected [{_ARCHITECTURES[family]!r}] for model_type {family!r}")
  quant = hf.get("quantization_config")
  _refuse_if(quant is not None, "quantization_config", quant, "quantized checkpoints are not supported")
  if family == "gpt2":
    return family, _gpt2_config(hf, dtype)
  if family == "mimo":  # a Qwen2 body (plus MTP layers, read by specjax.mimo)
    use_mrope = hf.get("use_mrope")
    _refuse_if(bool(use_mrope), "use_mrope", use_mrope, "MiMo's text body rotates with plain rope")
    # MiMo's config says attention_bias: true; its Qwen2 layers always have q/k/v biases and no o bias,
    # whatever the field says (transformers' Qwen2Attention does not read it).
    body = {k: v for k, v in hf.items() if k != "attention_bias"}
    return family, _llama_family_config(body, "qwen2", dtype)
  return family, _llama_family_config(hf, family, dtype)


# -------------------------------------------------------------------------------------- tensors


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One checkpoint tensor: its Hugging Face name, our parameter path, and the layout map.

  Ours has ``n_in`` leading input axes and the rest output axes; Hugging Face stores the same numbers
  as one 2-D ``[out, in]`` matrix when ``transpose`` (``nn.Linear``) or ``[in, out]`` when not
  (embeddings, GPT-2's Conv1D); ``n_in == 0`` is a flat vector (norms, biases).
  """

  key: str
  path: tuple[str | int, ...]
  n_in: int = 0
  transpose: bool = False

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    if self.n_in == 0:
      return (math.prod(ours),)
    shape = (math.prod(ours[:self.n_in]), math.prod(ours[self.n_in:]))
    return shape[::-1] if self.transpose else shape

  def to_ours(self, x: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
    return (x.T if self.transpose else x).reshape(ours)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    flat = x.reshape(self.hf_shape(x.shape)[::-1] if self.transpose else self.hf_shape(x.shape))
    return np.ascontiguousarray(flat.T if self.transpose else flat)


def tensor_specs(family: str, cfg, prefix: str = "") -> list[_Tensor]:
  """Every tensor of ``family`` under ``cfg``: the one table import, export and shape checks share."""
  T = _Tensor
  if family == "gpt2":
    specs = [T(f"{prefix}wte.weight", ("embed",), 1), T(f"{prefix}wpe.weight", ("pos_embed",), 1),
             T(f"{prefix}ln_f.weight", ("final_norm", "scale")),
             T(f"{prefix}ln_f.bias", ("final_norm", "bias"))]
    for i in range(cfg.n_layers):
      h, b = f"{prefix}h.{i}.", ("blocks", i)
      specs += [
          T(h + "ln_1.weight", b + ("attn_norm", "scale")), T(h + "ln_1.bias", b + ("attn_norm", "bias")),
          T(h + "attn.c_attn.weight", b + ("attn", "w_qkv"), 1),
          T(h + "attn.c_attn.bias", b + ("attn", "b_qkv")),
          T(h + "attn.c_proj.weight", b + ("attn", "wo"), 2), T(h + "attn.c_proj.bias", b + ("attn", "bo")),
          T(h + "ln_2.weight", b + ("mlp_norm", "scale")), T(h + "ln_2.bias", b + ("mlp_norm", "bias")),
          T(h + "mlp.c_fc.weight", b + ("mlp", "w_in"), 1), T(h + "mlp.c_fc.bias", b + ("mlp", "b_in")),
          T(h + "mlp.c_proj.weight", b + ("mlp", "w_out"), 1), T(h + "mlp.c_proj.bias", b + ("mlp", "b_out")),
      ]
    return specs
  specs = [T("model.embed_tokens.weight", ("embed",), 1), T("model.norm.weight", ("final_norm", "scale"))]
  if not cfg.tie_embeddings:
    specs.append(T("lm_head.weight", ("lm_head",), 1, True))
  fused = family == "phi3"  # q, k, v stacked in one qkv_proj; gate and up in one gate_up_proj
  for i in range(cfg.n_layers):
    h, b = f"model.layers.{i}.", ("blocks", i)
    specs += [
        T(h + "input_layernorm.weight", b + ("attn_norm", "scale")),
        *(T(h + (f"self_attn.{x}_proj.weight" if not fused else "self_attn.qkv_proj.weight"),
            b + ("attn", f"w{x}"), 1, True) for x in "qkv"),
        T(h + "self_attn.o_proj.weight", b + ("attn", "wo"), 2, True),
        *(T(h + (f"mlp.{x}_proj.weight" if not fused else "mlp.gate_up_proj.weight"), b + ("mlp", f"w_{x}"), 1,
            True) for x in ("gate", "up")),
        T(h + "mlp.down_proj.weight", b + ("mlp", "w_down"), 1, True),
    ]
    if cfg.qk_norm:
      specs += [T(h + f"self_attn.{x}_norm.weight", b + ("attn", f"{x}_norm", "scale")) for x in "qk"]
    if cfg.qkv_bias:
      specs += [T(h + f"self_attn.{x}_proj.bias", b + ("attn", f"b{x}")) for x in "qkv"]
    if cfg.post_norms:  # Gemma 2 names: its "post_attention" norm really follows the attention
      specs += [T(h + "post_attention_layernorm.weight", b + ("post_attn_norm", "scale")),
                T(h + "pre_feedforward_layernorm.weight", b + ("mlp_norm", "scale")),
                T(h + "post_feedforward_layernorm.weight", b + ("post_mlp_norm", "scale"))]
    else:
      specs.append(T(h + "post_attention_layernorm.weight", b + ("mlp_norm", "scale")))
  return specs


def _model_class(cfg):
  return GPT2 if isinstance(cfg, GPT2Config) else Llama


def _get(tree: dict, path: tuple) -> Any:
  for p in path:
    tree = tree[p]
  return tree


def _set(tree: dict, path: tuple, value: Any) -> None:
  for p in path[:-1]:
    tree = tree[p]
  tree[path[-1]] = value


class ParamTree:
  """The parameters of a model being loaded, placed one checkpoint tensor at a time.

  The model is built abstractly (``nnx.eval_shape``: shapes and dtypes only, no memory, no random
  initialisation); each tensor arrives in the Hugging Face layout of its :class:`_Tensor` spec, is
  shape-checked, cast, rearranged to specjax's layout and handed to JAX, so the host never holds a second
  full copy. Both checkpoint formats (``load_hf_model`` and :mod:`specjax.gguf`) load through it.
  """

  def __init__(self, cfg):
    model_class = _model_class(cfg)
    self.graphdef, self.abstract = nnx.split(nnx.eval_shape(lambda: model_class(cfg, rngs=nnx.Rngs(0))))
    self.shapes = nnx.to_pure_dict(self.abstract)
    self.values = jax.tree.map(lambda _: None, self.shapes)

  def _pieces(self, spec: _Tensor | Sequence[_Tensor]) -> list[tuple[_Tensor, tuple[int, ...], tuple[int, ...]]]:
    """``(spec, our shape, its Hugging Face-layout shape)`` for one spec or the pieces of a fused tensor."""
    specs = [spec] if isinstance(spec, _Tensor) else list(spec)
    return [(s, ours, s.hf_shape(ours)) for s in specs for ours in [tuple(_get(self.shapes, s.path).shape)]]

  def check_shape(self, spec: _Tensor | Sequence[_Tensor], shape: Sequence[int], where: str, source: str) -> None:
    """Raises CheckpointFileError (``where: tensor ... has shape ... but {source} implies ...``) when ``shape``
    is not the Hugging Face-layout shape of ``spec`` (a list: the pieces stacked along the first axis)."""
    pieces = self._pieces(spec)
    want = (sum(hf_shape[0] for _, _, hf_shape in pieces),) + pieces[0][2][1:]
    if tuple(shape) != want:
      raise CheckpointFileError(f"{where} has shape {list(shape)} but {source} implies {list(want)}")

  def put(self, spec: _Tensor | Sequence[_Tensor], x: np.ndarray, dtype: str) -> None:
    """Places ``x`` (Hugging Face layout, already shape-checked) as ``spec``'s parameter in ``dtype``; a
    list of pieces takes consecutive slices of ``x``'s first axis."""
    start = 0
    for s, ours, hf_shape in self._pieces(spec):
      piece = x[start:start + hf_shape[0]]
      start += hf_shape[0]
      _set(self.values, s.path, jnp.asarray(s.to_ours(piece.astype(jnp.dtype(dtype), copy=False), ours)))

  def put_blocks(self, spec: _Tensor | Sequence[_Tensor], blocks, dtype: str) -> bool:
    """Places a block-quantized tensor (:class:`specjax.gguf.Blocks`, Hugging Face layout, blocks along its
    input axis) as :class:`specjax.quant.QuantizedArray` values read as ``dtype``, codes and scales unchanged.

    A piece is placed this way only if it is a weight (:func:`specjax.quant.is_weight`) and every group of
    our layout's contracting axis (:func:`specjax.quant.weight_axis`) holds the weights of one block, so that
    the group's scale is that block's. Returns False, placing nothing, when some piece does not map (a
    norm, or an attention output whose head size is not a multiple of the block); then place the float
    values with :meth:`put`.
    """
    from specjax.quant import from_codes, is_weight, weight_axis

    group = blocks.codes.shape[-1] // blocks.scale.shape[-1]
    block_ids = np.arange(blocks.scale.size, dtype=np.int32).reshape(blocks.scale.shape)
    placed, start = [], 0
    for s, ours, hf_shape in self._pieces(spec):
      rows = slice(start, start + hf_shape[0])
      start += hf_shape[0]
      name = str(s.path[-1])
      if s.n_in == 0 or not is_weight(name, len(ours)):
        return False
      axis = weight_axis(name, len(ours))
      if ours[axis] % group:
        return False
      # The block of every weight, in our layout; each group of `axis` must hold one block only.
      ids = s.to_ours(np.repeat(block_ids[rows], group, axis=-1), ours)
      ids = ids.reshape(ours[:axis] + (ours[axis] // group, group) + ours[axis + 1:])
      first = np.take(ids, 0, axis=axis + 1)
      if not (ids == np.expand_dims(first, axis + 1)).all():
        return False
      low = None if blocks.low is None else blocks.low.reshape(-1)[first]
      placed.append((s, s.to_ours(blocks.codes[rows], ours), blocks.scale.reshape(-1)[first], low, axis))
    for s, codes, scale, low, axis in placed:
      _set(self.values, s.path, from_codes(codes, scale, low, axis, group, dtype))
    return True

  def missing(self, specs: Sequence[_Tensor]) -> list[_Tensor]:
    return [s for s in specs if _get(self.values, s.path) is None]

  def model(self):
    """The model; call once every parameter is placed."""
    nnx.replace_by_pure_dict(self.abstract, self.values)
    return nnx.merge(self.graphdef, self.abstract)


def _weight_files(path: str) -> dict[str, str]:
  """Safetensors files to read, each mapped to the tensors the index assigns it (None: all of them)."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise CheckpointFileError(f"{index}: missing or empty 'weight_map'")
    files: dict[str, list[str]] = {}
    for key, name in weight_map.items():
      files.setdefault(name, []).append(key)
    for name in files:
      if not os.path.isfile(os.path.join(path, name)):
        raise CheckpointFileError(f"{os.path.join(path, name)}: file not found (listed in {index})")
    return {os.path.join(path, n): keys for n, keys in files.items()}
  single = os.path.join(path, "model.safetensors")
  if os.path.isfile(single):
    return {single: None}
  found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if len(found) == 1:
    return {os.path.join(path, found[0]): None}
  if found:
    raise CheckpointFileError(
        f"{path}: several .safetensors files ({', '.join(found)}) but no model.safetensors.index.json")
  others = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".msgpack", ".h5"))]
  hint = f" ({', '.join(others)} found: convert to safetensors first)" if others else ""
  raise CheckpointFileError(f"{os.path.join(path, 'model.safetensors')}: file not found{hint}")


def _open_files(path: str) -> Iterator[tuple[str, Any, list[str]]]:
  from safetensors import safe_open

  for file, keys in _weight_files(path).items():
    try:
      with safe_open(file, framework="numpy") as f:
        yield file, f, list(f.keys()) if keys is None else keys
    except CheckpointFileError:
      raise
    except Exception as e:  # SafetensorError and OSError: truncated, corrupt or unreadable file
      raise CheckpointFileError(f"{file}: not a valid safetensors file ({e})") from e


def load_hf_model(path: str, dtype: str = "float32"):
  """Loads the model of a checkpoint directory (no tokenizer). See :func:`load_hf`."""
  if not os.path.isdir(path):
    raise CheckpointFileError(f"{path}: checkpoint directory not found")
  family, cfg = config_from_hf(_read_json(os.path.join(path, "config.json")), dtype)
  params = ParamTree(cfg)
  prefix = ""
  if family == "gpt2":
    keys = [k for file, _, ks in _open_files(path) for k in ks]
    prefix = "transformer." if any(k.startswith("transformer.") for k in keys) else ""
  specs: dict[str, list[_Tensor]] = {}
  for s in tensor_specs(family, cfg, prefix):
    specs.setdefault(s.key, []).append(s)
  # Checkpoints of tied models may still carry a copy of the head; transformers ignores it too.
  ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
  seen: dict[str, str] = {}
  for file, f, keys in _open_files(path):
    for key in keys:
      if key in seen:
        raise CheckpointFileError(f"{file}: tensor {key!r} also appears in {seen[key]}")
      seen[key] = file
      spec = specs.get(key)
      if spec is None:
        if key in ignorable or key.endswith(_BUFFER_SUFFIXES) or (family == "mimo" and key.startswith(MIMO_MTP_PREFIX)):
          continue
        raise CheckpointFileError(f"{file}: unexpected tensor {key!r} (not part of a {family} model as "
                              "config.json describes it)")
      try:
        piece = f.get_slice(key)
        shape, source_dtype = tuple(piece.get_shape()), piece.get_dtype()
      except Exception as e:
        raise CheckpointFileError(f"{file}: cannot read tensor {key!r} ({e})") from e
      params.check_shape(spec, shape, f"{file}: tensor {key!r}", "config.json")
      if source_dtype not in ("F32", "F16", "BF16", "F64"):
        raise CheckpointFileError(f"{file}: tensor {key!r} has dtype {source_dtype}; only float tensors load")
      try:
        x = f.get_tensor(key)
      except Exception as e:
        raise CheckpointFileError(f"{file}: cannot read tensor {key!r} ({e})") from e
      params.put(spec, x, dtype)  # one tensor at a time: cast, rearrange, hand to JAX, drop the host copy
      del x
  missing = list(dict.fromkeys(s.key for s in params.missing([s for ss in specs.values() for s in ss])))
  if missing:
    raise CheckpointFileError(
        f"{path}: checkpoint lacks {len(missing)} tensor(s) config.json requires, e.g. {missing[:3]}")
  return params.model()


def load_hf(path: str, dtype: str = "float32"):
  """Loads a Hugging Face checkpoint directory: ``(model, tokenizer)``.

  Args:
    path: a directory with ``config.json``, ``model.safetensors`` (or shards with
      ``model.safetensors.index.json``) and ``tokenizer.json``.
    dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: the weights' storage and activation dtype.

  Returns:
    A specjax model with the forward contract of every specjax model (``Llama`` or ``GPT2``), and an
    :class:`~specjax.tokenizer.HFTokenizer` usable as ``tokenizer=`` in :func:`specjax.generate`.

  Raises:
    CheckpointFileError (a ValueError): a missing or malformed file, an unsupported architecture or option,
      or a tensor that disagrees with ``config.json``; the message names the file or field.
    TokenizerError (a ValueError): a missing or malformed ``tokenizer.json``, naming it.
  """
  model = load_hf_model(path, dtype)
  return model, load_hf_tokenizer(path)


def load_hf_pair(target_path: str, draft_path: str, dtype: str = "float32"):
  """Loads a target and a draft that share a vocabulary: ``(target, draft, tokenizer)``.

  Raises:
    CheckpointFileError: as :func:`load_hf`, or when the two models' vocabulary sizes disagree.
    TokenizerError: as :func:`load_hf`, or when the two tokenizers disagree
      (:func:`~specjax.tokenizer.check_same_vocab`).
  """
  target_tok, draft_tok = load_hf_tokenizer(target_path), load_hf_tokenizer(draft_path)
  check_same_vocab(target_tok, draft_tok)
  target, draft = load_hf_model(target_path, dtype), load_hf_model(draft_path, dtype)
  if target.cfg.vocab_size != draft.cfg.vocab_size:
    raise CheckpointFileError(
        f"{draft_path}: draft vocab_size ({draft.cfg.vocab_size}) differs from the target's "
        f"({target.cfg.vocab_size}) in config.json")
  return target, draft, target_tok


# --------------------------------------------------------------------------------------- export


def _export_family(cfg) -> str:
  if isinstance(cfg, GPT2Config):
    return "gpt2"
  if cfg.qk_norm:
    return "gemma3_text" if cfg.norm_offset == 1.0 else "qwen3"
  if cfg.rotary_dim is not None or (cfg.rope_scaling is not None and cfg.rope_scaling.kind == "longrope"):
    return "phi3"
  if cfg.post_norms or cfg.attn_softcap is not None or cfg.final_softcap is not None:
    return "gemma2"
  if cfg.norm_offset == 1.0:
    return "gemma"
  if cfg.qkv_bias:
    return "qwen2"
  if cfg.sliding_window is not None and cfg.sliding_layers is None:
    return "mistral"
  return "llama"


def config_to_hf(cfg, eos_id: int | None = None) -> dict[str, Any]:
  """The ``config.json`` of ``cfg`` in the Hugging Face family that expresses it exactly.

  Raises:
    CheckpointFileError: naming the config fields no supported family expresses (checked by mapping the
      result back with :func:`config_from_hf`).
  """
  family = _export_family(cfg)
  hf: dict[str, Any] = {"architectures": [_ARCHITECTURES[family]], "model_type": family,
                        "vocab_size": cfg.vocab_size, "eos_token_id": eos_id, "bos_token_id": None,
                        "pad_token_id": None, "dtype": cfg.param_dtype,
                        "tie_word_embeddings": cfg.tie_embeddings}
  if family == "gpt2":
    inverse = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
    if cfg.activation not in inverse:
      raise CheckpointFileError(
          f"cannot export: GPT2Config.activation={cfg.activation!r} has no GPT-2 equivalent")
    if cfg.attn_scale not in (None, 1.0):
      raise CheckpointFileError(
          f"cannot export: GPT2Config.attn_scale={cfg.attn_scale!r} has no GPT-2 equivalent")
    hf.update(n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_positions=cfg.max_seq_len,
              n_inner=cfg.d_ff, layer_norm_epsilon=cfg.norm_eps, activation_function=inverse[cfg.activation],
              scale_attn_weights=cfg.attn_scale is None)
  else:
    inverse = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
    rope = rope_parameters(cfg.rope_base, cfg.rope_scaling)
    hf.update(hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
              num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
              rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_seq_len, rope_parameters=rope,
              # The pre-5.0 spelling too, so older transformers read the same rope.
              rope_theta=cfg.rope_base, rope_scaling=None if cfg.rope_scaling is None else rope)
    hf["hidden_activation" if family in ("gemma2", "gemma3_text") else "hidden_act"] = inverse[cfg.activation]
    if family in ("mistral", "phi3"):
      hf["sliding_window"] = cfg.sliding_window
    if family == "phi3":
      rope["partial_rotary_factor"] = (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim
      hf.update(rope_scaling=None)
      if cfg.rope_scaling is not None:
        hf["original_max_position_embeddings"] = cfg.rope_scaling.original_max_seq_len
    if family in ("qwen2", "qwen3", "gemma2", "gemma3_text") and cfg.sliding_window is not None:
      windows = cfg.sliding_layers or (True,) * cfg.n_layers
      hf.update(sliding_window=cfg.sliding_window, use_sliding_window=True,
                layer_types=["sliding_attention" if w else "full_attention" for w in windows])
    if family in ("qwen2", "qwen3") and cfg.sliding_window is None:
      hf.update(use_sliding_window=False, sliding_window=None)
    if family == "qwen3":
      hf.update(attention_bias=False)
    if family in ("gemma2", "gemma3_text"):
      if cfg.sliding_window is None:
        hf.update(sliding_window=cfg.max_seq_len, layer_types=["full_attention"] * cfg.n_layers)
      scalar = (cfg.attn_scale or cfg.head_dim**-0.5) ** -2
      hf.update(query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
                attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap)
    if family == "gemma3_text":  # one rope object per layer type; the local layers rotate unscaled
      local = cfg.rope_base if cfg.local_rope_base is None else cfg.local_rope_base
      hf.update(rope_parameters={"full_attention": rope,
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local}},
                rope_local_base_freq=local, attn_logit_softcapping=None)
  _, back = config_from_hf(hf, cfg.dtype)
  back = back.replace(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
  if back != cfg:
    diff = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(back, f.name)]
    raise CheckpointFileError(
        f"cannot export: {type(cfg).__name__} fields {diff} have no exact equivalent in Hugging Face "
        f"{family!r} (the closest family for this config)")
  return hf


def save_hf(model, tokenizer, path: str) -> None:
  """Writes ``model`` (and ``tokenizer``) as a Hugging Face checkpoint directory.

  Writes ``config.json``, ``model.safetensors`` (the weights in their storage dtype) and, when a
  tokenizer is given, ``tokenizer.json``: an :class:`~specjax.tokenizer.HFTokenizer` (a ``BPETokenizer``
  included) is saved as is, a :class:`~specjax.tokenizer.ByteTokenizer` as the equivalent
  :func:`~specjax.tokenizer.byte_level_tokenizer`. ``load_hf`` of the
  directory gives back identical parameters; ``transformers.AutoModelForCausalLM.from_pretrained`` loads it
  with no custom code (``LlamaForCausalLM`` for a plain Llama config).

  Raises:
    CheckpointFileError: a config no supported family expresses exactly, or an unsupported tokenizer.
  """
  from safetensors.numpy import save_file

  cfg = getattr(model, "cfg", None)
  if not isinstance(cfg, (LlamaConfig, GPT2Config)):
    raise CheckpointFileError(f"save_hf exports Llama-family and GPT-2 models, got {type(model).__name__}")
  if isinstance(tokenizer, ByteTokenizer):
    tokenizer = byte_level_tokenizer()
  if tokenizer is not None and not (callable(getattr(tokenizer, "save", None)) and hasattr(tokenizer, "eos_id")):
    raise CheckpointFileError(
        "save_hf writes ByteTokenizer and tokenizers-library tokenizers (HFTokenizer, BPETokenizer: "
        f"anything with save(path) writing tokenizer.json and eos_id), got {type(tokenizer).__name__}")
  eos_id = None if tokenizer is None else tokenizer.eos_id
  hf = config_to_hf(cfg, eos_id)
  family = hf["model_type"]
  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  pieces: dict[str, list[np.ndarray]] = {}
  for spec in tensor_specs(family, cfg, "transformer." if family == "gpt2" else ""):
    pieces.setdefault(spec.key, []).append(spec.to_hf(np.asarray(jax.device_get(_get(state, spec.path)))))
  tensors = {key: p[0] if len(p) == 1 else np.concatenate(p, axis=0) for key, p in pieces.items()}
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(hf, f, indent=2)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  if tokenizer is not None:
    tokenizer.save(os.path.join(path, "tokenizer.json"))
