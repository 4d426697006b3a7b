"""Published draft heads in and out: EAGLE-3 and EAGLE-1 heads in the layout vLLM and SGLang load, Medusa
heads in the Medusa repository's layout.

A published head is a folder:

- **EAGLE-3** (vLLM ``llama_eagle3.py``, SGLang ``llama_eagle3.py``, SpecForge ``llama3_eagle.py``): a
  ``config.json`` of the draft architecture (``LlamaForCausalLMEagle3``: ``hidden_size``, attention heads,
  ``intermediate_size``, ``rms_norm_eps``, rope, ``vocab_size`` (the target's), ``draft_vocab_size``,
  optionally ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids``) and one safetensors file with
  ``fc.weight`` (the three target streams, concatenated, to the head width, no bias), ``midlayer.*`` (one
  Llama layer whose q/k/v read ``[input_layernorm(embed), hidden_norm(feature)]``, 2H wide), ``norm.weight``,
  ``lm_head.weight`` over the draft vocabulary, ``d2t`` (``target id = draft id + d2t[draft id]``) and ``t2d``
  (a mask over the target vocabulary, True at the drafted ids); ``embed_tokens.weight`` only when the head has
  an embedding of its own (vLLM then uses it, SGLang still the target's: the same table for heads trained on a
  frozen copy; without it both share the target's).
- **EAGLE-1** (SafeAILab ``cnets1.py``, vLLM ``llama_eagle.py``): a Llama ``config.json`` of one layer and
  ``fc.weight`` (+ ``fc.bias``) over ``[embed, feature]``, then ``layers.0.*`` without an input norm; logits
  through the target's LM head. ``embed_tokens.weight`` is ignored (both share the target's). ``fc.bias`` is
  applied as EAGLE's own code does (vLLM's ``fc`` has no bias and drops it); absent, it is zero.
- **Medusa** (FasterDecoding ``medusa_model.py``): ``config.json`` with ``medusa_num_heads`` and
  ``medusa_num_layers`` and ``medusa_lm_head.safetensors`` holding, per head i, ``{i}.{j}.linear.weight``/
  ``.bias`` (a residual SiLU block; Medusa repeats one block ``medusa_num_layers`` times) and ``{i}.{L}.weight``,
  the head's own LM head.

Everything is checked against the target on import (hidden size, vocabulary, layer ids, vocabulary maps,
every tensor's presence and shape), and errors name the field and the values allowed. One table per format
(:func:`tensor_table`) names every tensor and where it lives in the specjax module: import, export and the
shape checks all read it, as :mod:`specjax.hf` does for models.

Aux layer ids follow vLLM: id i is the residual stream entering target layer i (specjax's ``aux_layers``);
absent, both runtimes use ``(2, L // 2, L - 3)``. Export writes the ids only when they differ from that
default (SGLang reads explicit ids whose first is 1 as "output of layer i", i.e. one later).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.hf import CheckpointFileError, _field, _read_json, _rope, _Tensor, _weight_files, rope_parameters
from specjax.models.heads import HEADS, Eagle1Head, Eagle3Head, HeadConfig, MedusaHeads, check_heads

# Published format name -> the specjax head class that computes it.
FORMATS = {cls.kind: cls for cls in (Eagle3Head, Eagle1Head, MedusaHeads)}
MEDUSA_FILE = "medusa_lm_head.safetensors"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class HeadTensor(_Tensor):
  """One tensor of a published head: :class:`specjax.hf._Tensor`'s layout map, plus ``index`` (the slice of
  the specjax parameter it fills: Medusa's per-head blocks live in stacked arrays), ``optional`` (may be
  absent: zeros), and ``role``: ``"weight"``, ``"d2t"`` (draft-to-target offsets) or ``"t2d"`` (the target
  mask, derived from ``d2t``)."""

  index: tuple[int, ...] = ()
  optional: bool = False
  role: str = "weight"


def tensor_table(fmt: str, cfg: HeadConfig) -> list[HeadTensor]:
  """Every tensor of a head of published format ``fmt`` (a key of ``FORMATS``) with configuration ``cfg``:
  the one table import, export and shape checks share."""
  T = HeadTensor
  if fmt == MedusaHeads.kind:
    specs = []
    for i in range(cfg.num_heads):
      for j in range(cfg.medusa_layers):
        specs += [T(f"{i}.{j}.linear.weight", ("w",), 1, True, index=(i, j)),
                  T(f"{i}.{j}.linear.bias", ("b",), index=(i, j))]
      specs.append(T(f"{i}.{cfg.medusa_layers}.weight", ("lm_heads",), 1, True, index=(i,)))
    return specs
  layer = "midlayer." if fmt == Eagle3Head.kind else "layers.0."
  specs = [
      T(layer + "self_attn.q_proj.weight", ("attn", "wq"), 1, True),
      T(layer + "self_attn.k_proj.weight", ("attn", "wk"), 1, True),
      T(layer + "self_attn.v_proj.weight", ("attn", "wv"), 1, True),
      T(layer + "self_attn.o_proj.weight", ("attn", "wo"), 2, True),
      T(layer + "post_attention_layernorm.weight", ("mlp_norm", "scale")),
      T(layer + "mlp.gate_proj.weight", ("mlp", "w_gate"), 1, True),
      T(layer + "mlp.up_proj.weight", ("mlp", "w_up"), 1, True),
      T(layer + "mlp.down_proj.weight", ("mlp", "w_down"), 1, True),
      T("fc.weight", ("fc", "w"), 1, True),
  ]
  if fmt == Eagle1Head.kind:
    return specs + [T("fc.bias", ("fc", "b"), optional=True)]
  specs += [T(layer + "input_layernorm.weight", ("embed_norm", "scale")),
            T(layer + "hidden_norm.weight", ("feature_norm", "scale")),
            T("norm.weight", ("final_norm", "scale")),
            T("lm_head.weight", ("lm_head", "w"), 1, True),
            # Both maps may be absent when the draft vocabulary is the target's, in order (vLLM and SGLang
            # then map draft id i to target id i).
            T("d2t", ("d2t",), optional=True, role="d2t"), T("t2d", ("d2t",), optional=True, role="t2d")]
  if cfg.own_embedding:
    specs.append(T("embed_tokens.weight", ("embed",), 1))
  return specs


# Tensors a runtime ignores, so import does too (named so that anything else unexpected is refused).
_IGNORED = {Eagle1Head.kind: ("embed_tokens.weight", "layers.0.input_layernorm.weight"),
            Eagle3Head.kind: (), MedusaHeads.kind: ()}


# --------------------------------------------------------------------------------------- detect


def detect(directory: str | os.PathLike) -> str:
  """The format of a head folder: ``"specjax"`` (``heads.json``, :func:`specjax.models.heads.save_heads`) or
  a key of ``FORMATS``, from its files and ``config.json``.

  Raises:
    CheckpointFileError: the folder is none of these, naming what each format needs.
  """
  d = pathlib.Path(directory)
  if not d.is_dir():
    raise CheckpointFileError(f"head folder {d} does not exist")
  if (d / "heads.json").is_file():
    return "specjax"
  hf = _read_json(str(d / "config.json")) if (d / "config.json").is_file() else None
  if (d / MEDUSA_FILE).is_file() or (d / "medusa_lm_head.pt").is_file() or (hf and "medusa_num_heads" in hf):
    return MedusaHeads.kind
  if hf is not None:
    archs = hf.get("architectures") or []
    keys = _tensor_names(str(d))
    if any("Eagle3" in a for a in archs) or "draft_vocab_size" in hf or any(k.startswith("midlayer.") for k in keys):
      return Eagle3Head.kind
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
      return Eagle1Head.kind
  raise CheckpointFileError(
      f"{d} is not a head folder: expected heads.json (specjax), {MEDUSA_FILE} + config.json (Medusa), or "
      "config.json + safetensors with midlayer.* (EAGLE-3) or fc.weight and layers.0.* (EAGLE-1)")


def _tensor_names(path: str) -> list[str]:
  from safetensors import safe_open

  names = []
  for file in _weight_files(path):
    try:
      with safe_open(file, framework="numpy") as f:
        names += list(f.keys())
    except Exception as e:  # SafetensorError, OSError
      raise CheckpointFileError(f"{file}: not a valid safetensors file ({e})") from e
  return names


def _read_tensors(fmt: str, path: str) -> dict[str, np.ndarray]:
  from safetensors import safe_open

  if fmt == MedusaHeads.kind:
    file = os.path.join(path, MEDUSA_FILE)
    if not os.path.isfile(file):
      hint = " (medusa_lm_head.pt found: convert it to safetensors first)" if os.path.isfile(
          os.path.join(path, "medusa_lm_head.pt")) else ""
      raise CheckpointFileError(f"{file}: file not found{hint}")
    files = [file]
  else:
    files = list(_weight_files(path))
  out: dict[str, np.ndarray] = {}
  for file in files:
    try:
      with safe_open(file, framework="numpy") as f:
        for key in f.keys():
          if key in out:
            raise CheckpointFileError(f"{file}: tensor {key!r} appears twice")
          out[key] = f.get_tensor(key)
    except CheckpointFileError:
      raise
    except Exception as e:
      raise CheckpointFileError(f"{file}: not a valid safetensors file ({e})") from e
  return out


# --------------------------------------------------------------------------------------- config


def _require(condition: bool, field: str, value: Any, allowed: str) -> None:
  if not condition:
    raise CheckpointFileError(f"config.json: {field}={value!r} does not fit (allowed: {allowed})")


def _layer_fields(hf: dict, target_cfg) -> dict[str, Any]:
  """The head layer's :class:`HeadConfig` fields from a Llama-style draft ``config.json``, refusing options the
  layer does not compute."""
  d = _field(hf, "hidden_size", int)
  n_heads = _field(hf, "num_attention_heads", int)
  n_kv = _field(hf, "num_key_value_heads", int, n_heads)
  head_dim = _field(hf, "head_dim", int, None)
  layers = _field(hf, "num_hidden_layers", int, 1)
  _require(layers == 1, "num_hidden_layers", layers, "1: specjax heads have one decoder layer")
  act = hf.get("hidden_act", "silu")
  _require(act in ("silu", "swish"), "hidden_act", act, "'silu'")
  for name in ("attention_bias", "mlp_bias", "bias"):
    _require(not hf.get(name), name, hf.get(name), "false: the head layer has no biases")
  scale = hf.get("logit_scale", 1.0)
  _require(scale in (None, 1, 1.0), "logit_scale", scale, "1.0")
  vocab = _field(hf, "vocab_size", int)
  _require(vocab == target_cfg.vocab_size, "vocab_size", vocab,
           f"{target_cfg.vocab_size}, the target's vocabulary")
  rope = _rope(hf, "llama")  # the heads' layer is a Llama layer (whole-head rotary, one base)
  rope_base, rope_scaling = rope.base, rope.scaling
  return dict(d_model=d, n_heads=n_heads, n_kv_heads=n_kv, d_ff=_field(hf, "intermediate_size", int),
              head_dim=None if head_dim in (None, d // n_heads) else head_dim,
              norm_eps=float(_field(hf, "rms_norm_eps", (int, float), 1e-6)), rope_base=rope_base,
              rope_scaling=rope_scaling)


def vllm_default_aux_layers(n_layers: int) -> tuple[int, ...]:
  """The layers vLLM and SGLang read when a head names none: ``(2, L // 2, L - 3)``."""
  return (2, n_layers // 2, n_layers - 3)


def _eagle3_config(hf: dict, target_cfg, names: set[str]) -> HeadConfig:
  archs = hf.get("architectures") or list(EAGLE3_ARCHITECTURES[:1])
  _require(any(a in EAGLE3_ARCHITECTURES for a in archs), "architectures", archs,
           f"one of {list(EAGLE3_ARCHITECTURES)} (a Llama EAGLE-3 layer; the speculators format is not read)")
  eagle = hf.get("eagle_config") if isinstance(hf.get("eagle_config"), dict) else {}
  _require(eagle.get("use_aux_hidden_state", True), "eagle_config.use_aux_hidden_state",
           eagle.get("use_aux_hidden_state"), "true: the head reads three target layers through fc")
  _require(not hf.get("norm_before_fc"), "norm_before_fc", hf.get("norm_before_fc"), "false")
  fields = _layer_fields(hf, target_cfg)
  n = target_cfg.n_layers
  target_width = _field(hf, "target_hidden_size", int, fields["d_model"])
  _require(target_width == target_cfg.d_model, "target_hidden_size" if "target_hidden_size" in hf else "hidden_size",
           target_width, f"{target_cfg.d_model}, the target's hidden size")
  own_embedding = "embed_tokens.weight" in names
  if not own_embedding:
    _require(fields["d_model"] == target_cfg.d_model, "hidden_size", fields["d_model"],
             f"{target_cfg.d_model} (the target's hidden size) when the file has no embed_tokens.weight: the layer "
             "then reads the target's embedding")
  ids = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
  field = "eagle_aux_hidden_state_layer_ids"
  if ids is None:
    ids, field = vllm_default_aux_layers(n), "eagle_aux_hidden_state_layer_ids (absent: vLLM's default (2, L//2, L-3))"
  ids = tuple(ids)
  ok = all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in ids) and list(ids) == sorted(set(ids))
  _require(ok and len(ids) == 3, field, list(ids), f"three distinct increasing layer ids in [0, {n - 1}] (the "
           f"target has {n} layers; id i is the residual stream entering layer i)")
  draft = _field(hf, "draft_vocab_size", int, target_cfg.vocab_size)
  _require(1 <= draft <= target_cfg.vocab_size, "draft_vocab_size", draft, f"1..{target_cfg.vocab_size}")
  return HeadConfig(kind=Eagle3Head.kind, target_d_model=target_cfg.d_model, target_vocab_size=target_cfg.vocab_size,
                    target_n_layers=n, aux_layers=ids, draft_vocab_size=draft, own_embedding=own_embedding,
                    norm_before_residual=bool(hf.get("norm_before_residual", False)), **fields)


def _eagle1_config(hf: dict, target_cfg) -> HeadConfig:
  _require(not hf.get("add_para_norm"), "add_para_norm", hf.get("add_para_norm"), "false (HASS norms are not read)")
  fields = _layer_fields(hf, target_cfg)
  _require(fields["d_model"] == target_cfg.d_model, "hidden_size", fields["d_model"],
           f"{target_cfg.d_model}, the target's hidden size (EAGLE-1 predicts the target's features)")
  return HeadConfig(kind=Eagle1Head.kind, target_d_model=target_cfg.d_model, target_vocab_size=target_cfg.vocab_size,
                    target_n_layers=target_cfg.n_layers, **fields)


def _medusa_config(hf: dict, target_cfg, tensors: dict[str, np.ndarray]) -> HeadConfig:
  heads = _field(hf, "medusa_num_heads", int, 4)  # Medusa's MedusaConfig defaults
  layers = _field(hf, "medusa_num_layers", int, 1)
  for name, value in (("medusa_num_heads", heads), ("medusa_num_layers", layers)):
    _require(value >= 1, name, value, "an integer >= 1")
  width = _field(hf, "hidden_size", int, target_cfg.d_model)
  _require(width == target_cfg.d_model, "hidden_size", width, f"{target_cfg.d_model}, the target's hidden size")
  vocab = _field(hf, "vocab_size", int, target_cfg.vocab_size)
  _require(vocab == target_cfg.vocab_size, "vocab_size", vocab, f"{target_cfg.vocab_size}, the target's vocabulary")
  for i in range(heads):  # Medusa repeats one ResBlock: its copies must agree, or Medusa's own load differs
    for suffix in ("weight", "bias"):
      first = tensors.get(f"{i}.0.linear.{suffix}")
      for j in range(1, layers):
        other = tensors.get(f"{i}.{j}.linear.{suffix}")
        if first is not None and other is not None and not np.array_equal(first, other):
          raise CheckpointFileError(
              f"{MEDUSA_FILE}: {i}.{j}.linear.{suffix} differs from {i}.0.linear.{suffix}, but Medusa repeats one "
              f"ResBlock medusa_num_layers={layers} times (allowed: equal blocks)")
  return HeadConfig(kind=MedusaHeads.kind, target_d_model=target_cfg.d_model, target_vocab_size=target_cfg.vocab_size,
                    target_n_layers=target_cfg.n_layers, num_heads=heads, medusa_layers=layers, own_lm_heads=True)


# --------------------------------------------------------------------------------------- import


def _state(cfg: HeadConfig) -> tuple[Any, dict[tuple, Any]]:
  module_cls = HEADS[cfg.kind]
  graphdef, state = nnx.split(nnx.eval_shape(lambda: module_cls(cfg, rngs=nnx.Rngs(0))))
  return graphdef, {tuple(path): var for path, var in nnx.to_flat_state(state)}


def load_published(directory: str | os.PathLike, target_cfg, fmt: str | None = None, dtype: str = "float32"):
  """Imports a published head folder (``fmt``, a key of ``FORMATS``; default :func:`detect`) for a target with
  config ``target_cfg``: a specjax head module (:class:`~specjax.models.heads.Eagle3Head`,
  :class:`~specjax.models.heads.Eagle1Head` or :class:`~specjax.models.heads.MedusaHeads`) that computes what
  vLLM/SGLang (EAGLE) or Medusa compute with those weights.

  Raises:
    CheckpointFileError (a ValueError): a missing or malformed file, a config field or tensor that does not fit
      the target or the format (naming it and the values allowed), or inconsistent vocabulary maps.
  """
  path = str(directory)
  fmt = detect(path) if fmt is None else fmt
  if fmt not in FORMATS:
    raise CheckpointFileError(f"{path}: format {fmt!r} is not a published head format (allowed: {sorted(FORMATS)})")
  hf_path = os.path.join(path, "config.json")
  hf = _read_json(hf_path) if fmt != MedusaHeads.kind or os.path.isfile(hf_path) else {}
  tensors = _read_tensors(fmt, path)
  try:
    if fmt == Eagle3Head.kind:
      cfg = _eagle3_config(hf, target_cfg, set(tensors))
    elif fmt == Eagle1Head.kind:
      cfg = _eagle1_config(hf, target_cfg)
    else:
      cfg = _medusa_config(hf, target_cfg, tensors)
  except CheckpointFileError as e:
    raise CheckpointFileError(f"{path}: {e}") from None
  except ValueError as e:  # a HeadConfig field the file's values break
    raise CheckpointFileError(f"{path}: config.json does not make a valid head: {e}") from None
  check_heads(cfg, target_cfg, where=f"the heads in {path}")
  offsets = tensors.get("d2t")
  if cfg.kind == Eagle3Head.kind and cfg.vocab_size == cfg.target_vocab_size and (
      offsets is None or (offsets.shape == (cfg.vocab_size,) and not offsets.any())):
    cfg = dataclasses.replace(cfg, draft_vocab_size=None)  # the whole vocabulary in order: specjax's None
  graphdef, state = _state(cfg)
  values = {p: np.zeros(v.shape, np.float32) if jnp.issubdtype(v.dtype, jnp.floating) else None
            for p, v in state.items()}
  file = MEDUSA_FILE if fmt == MedusaHeads.kind else "the safetensors file"
  table = tensor_table(fmt, cfg)
  d2t = None
  for spec in table:
    if spec.role == "t2d":
      continue
    x = tensors.get(spec.key)
    if x is None:
      if spec.optional:
        continue
      raise CheckpointFileError(f"{path}: {file} lacks tensor {spec.key!r}, which a {fmt} head with this "
                                "config.json needs")
    ours = tuple(state[spec.path].shape)[len(spec.index):]
    want = (cfg.vocab_size,) if spec.role == "d2t" else spec.hf_shape(ours)
    if tuple(x.shape) != want:
      raise CheckpointFileError(f"{path}: tensor {spec.key!r} has shape {list(x.shape)}, but config.json implies "
                                f"{list(want)}")
    if spec.role == "d2t":
      if not np.issubdtype(x.dtype, np.integer):
        raise CheckpointFileError(f"{path}: tensor 'd2t' must hold integers (draft id + d2t = target id), got "
                                  f"{x.dtype}")
      d2t = np.arange(cfg.vocab_size, dtype=np.int64) + x.astype(np.int64)
      continue
    values[spec.path][spec.index] = spec.to_ours(np.asarray(x, np.float32), ours)
  if cfg.kind == Eagle3Head.kind:
    if d2t is None:
      if cfg.vocab_size != cfg.target_vocab_size:
        raise CheckpointFileError(f"{path}: {file} lacks tensor 'd2t', which a head with draft_vocab_size="
                                  f"{cfg.vocab_size} < vocab_size={cfg.target_vocab_size} needs")
      d2t = np.arange(cfg.vocab_size, dtype=np.int64)
    _check_vocab_maps(path, cfg, d2t, tensors.get("t2d"))
    values[("d2t",)] = d2t.astype(np.int32)
  known = {s.key for s in table} | set(_IGNORED[fmt])
  extra = sorted(set(tensors) - known)
  if extra:
    raise CheckpointFileError(f"{path}: unexpected tensor {extra[0]!r} (not part of a {fmt} head as config.json "
                              "describes it)")
  heads = nnx.merge(graphdef, nnx.from_flat_state({p: var.replace(jnp.asarray(values[p], var.dtype))
                                                    for p, var in state.items()}))
  heads.check_variables()
  if dtype != "float32":
    from specjax.loading import cast

    heads = cast(heads, dtype)
  return heads


def _check_vocab_maps(path: str, cfg: HeadConfig, d2t: np.ndarray, t2d: np.ndarray | None) -> None:
  v = cfg.target_vocab_size
  bad = d2t[(d2t < 0) | (d2t >= v)]
  if bad.size:
    i = int(np.flatnonzero((d2t < 0) | (d2t >= v))[0])
    raise CheckpointFileError(f"{path}: d2t maps draft id {i} to target id {int(bad[0])}, outside the target's "
                              f"vocabulary (allowed: target ids in [0, {v}))")
  if np.unique(d2t).size != d2t.size:
    raise CheckpointFileError(f"{path}: d2t maps two draft ids to one target id (allowed: distinct target ids)")
  if t2d is None:
    return  # vLLM and SGLang do not read it
  if t2d.shape != (v,):
    raise CheckpointFileError(f"{path}: tensor 't2d' has shape {list(t2d.shape)}, but config.json implies [{v}] "
                              "(vocab_size)")
  mask = np.zeros(v, bool)
  mask[d2t] = True
  if not np.array_equal(t2d.astype(bool), mask):
    raise CheckpointFileError(f"{path}: t2d disagrees with d2t: it marks {int(t2d.astype(bool).sum())} target ids, "
                              f"d2t maps to {int(mask.sum())} (allowed: t2d True exactly at draft id + d2t)")


# --------------------------------------------------------------------------------------- export


def _config_to_hf(fmt: str, cfg: HeadConfig, base_model: str | None) -> dict[str, Any]:
  if fmt == MedusaHeads.kind:
    return {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.medusa_layers,
            "base_model_name_or_path": base_model, "hidden_size": cfg.d_model, "vocab_size": cfg.target_vocab_size}
  lcfg = cfg.layer_config()
  rope = rope_parameters(cfg.rope_base, cfg.rope_scaling)
  hf: dict[str, Any] = {
      "architectures": [EAGLE3_ARCHITECTURES[0] if fmt == Eagle3Head.kind else "LlamaForCausalLM"],
      "model_type": "llama", "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": 1,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": lcfg.head_dim,
      "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
      "rope_scaling": None if cfg.rope_scaling is None else rope, "vocab_size": cfg.target_vocab_size,
      "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": cfg.param_dtype,
  }
  if fmt == Eagle3Head.kind:
    hf["draft_vocab_size"] = cfg.vocab_size
    if cfg.d_model != cfg.target_d_model:
      hf["target_hidden_size"] = cfg.target_d_model
    if cfg.norm_before_residual:
      hf["norm_before_residual"] = True
    if cfg.aux_layers != vllm_default_aux_layers(cfg.target_n_layers):
      ids = list(cfg.aux_layers)
      hf["eagle_aux_hidden_state_layer_ids"] = ids
      hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
  return hf


def save_published(directory: str | os.PathLike, heads, target=None, base_model: str | None = None) -> str:
  """Writes a specjax head set in its published layout (EAGLE-3 and EAGLE-1 as vLLM and SGLang load them,
  Medusa as the Medusa repository does); :func:`load_published` of the folder gives the same parameters back.

  Args:
    heads: an :class:`~specjax.models.heads.Eagle3Head`, :class:`~specjax.models.heads.Eagle1Head` or
      :class:`~specjax.models.heads.MedusaHeads`.
    target: the target model; needed for Medusa heads that use the target's unembedding (each published head
      carries its own LM head, so the target's is copied in).
    base_model: Medusa's ``base_model_name_or_path``.

  Returns: the format written (a key of ``FORMATS``).

  Raises:
    CheckpointFileError: a head the layout cannot express, naming the field and the values it allows.
  """
  from safetensors.numpy import save_file

  cfg = heads.cfg
  fmt = cfg.kind
  if fmt not in FORMATS:
    raise CheckpointFileError(f"cannot export a head set of kind {fmt!r} (allowed: {sorted(FORMATS)})")
  if fmt == Eagle3Head.kind and not cfg.own_embedding and cfg.d_model != cfg.target_d_model:
    raise CheckpointFileError(
        f"cannot export: HeadConfig.d_model={cfg.d_model} differs from target_d_model={cfg.target_d_model}; the "
        "published EAGLE-3 layer reads a token embedding as wide as itself (allowed: d_model equal to the target's, "
        "or own_embedding=True)")
  if fmt == Eagle3Head.kind and len(cfg.aux_layers) != 3:
    raise CheckpointFileError(f"cannot export: HeadConfig.aux_layers={list(cfg.aux_layers)}, but vLLM and SGLang fuse "
                              "exactly three target layers (allowed: three layer ids)")
  flat = {tuple(str(p) for p in path): np.asarray(jax.device_get(v[...]))
          for path, v in nnx.to_flat_state(nnx.state(heads))}
  if fmt == MedusaHeads.kind:
    for name in ("w", "b"):
      x = flat[(name,)]
      if cfg.medusa_layers > 1 and not all(np.array_equal(x[:, 0], x[:, j]) for j in range(1, cfg.medusa_layers)):
        raise CheckpointFileError(f"cannot export: the Medusa layout repeats one ResBlock per head, but these heads' "
                                  f"medusa_layers={cfg.medusa_layers} blocks differ (allowed: medusa_layers=1 or "
                                  "equal blocks)")
    if not cfg.own_lm_heads:
      if target is None:
        raise CheckpointFileError("cannot export Medusa heads that use the target's unembedding without target=")
      check_heads(cfg, target.cfg)
      if getattr(target.cfg, "final_softcap", None) is not None:
        raise CheckpointFileError("cannot export: the target soft-caps its logits (final_softcap), which a Medusa "
                                  "head's linear LM head cannot express (allowed: targets without final_softcap)")
      # The target's unembedding as a [D, V] matrix: its LM head applied to the identity (exact in float32).
      eye = jnp.eye(cfg.d_model, dtype=jnp.dtype(target.cfg.param_dtype))
      head = np.asarray(jax.device_get(target.unembed(eye))).astype(flat[("w",)].dtype)
      flat[("lm_heads",)] = np.broadcast_to(head, (cfg.num_heads,) + head.shape)
  tensors: dict[str, np.ndarray] = {}
  for spec in tensor_table(fmt, cfg):
    x = flat[spec.path]
    if spec.role == "d2t":
      tensors[spec.key] = (x.astype(np.int64) - np.arange(cfg.vocab_size, dtype=np.int64))
    elif spec.role == "t2d":
      mask = np.zeros(cfg.target_vocab_size, bool)
      mask[x] = True
      tensors[spec.key] = mask
    else:
      tensors[spec.key] = spec.to_hf(x[spec.index])
  out = pathlib.Path(directory)
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.json").write_text(json.dumps(_config_to_hf(fmt, cfg, base_model), indent=2) + "\n")
  save_file(tensors, str(out / (MEDUSA_FILE if fmt == MedusaHeads.kind else "model.safetensors")),
            metadata={"format": "pt"})
  return fmt


# --------------------------------------------------------------------------------------- either


def load_head_dir(directory: str | os.PathLike, target_cfg, dtype: str | None = None):
  """A head folder of any format (:func:`detect`): specjax's own (:func:`specjax.models.heads.load_heads`) or
  a published one (:func:`load_published`), checked against ``target_cfg``; cast to ``dtype`` when given."""
  from specjax.loading import cast
  from specjax.models.heads import load_heads

  fmt = detect(directory)
  heads = load_heads(directory, target_cfg) if fmt == "specjax" else load_published(directory, target_cfg, fmt)
  return heads if dtype is None else cast(heads, dtype)
