"""MiMo checkpoints: a Qwen2 body plus multi-token-prediction layers, imported as a target and its MTP proposer.

A MiMo directory (``config.json`` with ``architectures: ["MiMoForCausalLM"]``, ``model_type: "mimo"``) is a
Qwen2 causal LM whose ``num_nextn_predict_layers`` MTP layers are stored in the same safetensors files under
``model.mtp_layers.{i}.``. The layout was read from Xiaomi's ``modeling_mimo.py`` (``MiMoMTPLayers``) and the
MiMo MTP models of vLLM (``vllm/model_executor/models/mimo_mtp.py``) and SGLang
(``python/sglang/srt/models/mimo_mtp.py``). Layer i holds

- ``token_layernorm.weight`` and ``hidden_layernorm.weight``: RMSNorms of the token embedding and of the
  incoming hidden state;
- ``input_proj.weight`` ``[D, 2D]`` (no bias) over the concatenation ``[hidden_layernorm(h), token_layernorm(e)]``
  (hidden first, the reverse of DeepSeek-V3's ``eh_proj`` order);
- one Qwen2 decoder layer under the same prefix: ``input_layernorm``, ``self_attn.{q,k,v}_proj`` (with biases),
  ``self_attn.o_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``;
- ``final_layernorm.weight``, applied to the layer's output; the logits are the body's ``lm_head`` of it, and
  the token embedding is the body's ``embed_tokens`` (the MTP layers own neither).

The incoming hidden state of layer 0 is the body's final-norm hidden state (vLLM's ``Qwen2Model`` returns it
after ``norm``). This maps onto :class:`specjax.models.heads.MTPHeads` with ``qkv_bias`` and ``normed_output``
(the module's output is the normed state, which the next layer, or a rollout past the last one, reads); the
concatenation order is absorbed by swapping the two halves of ``input_proj`` on import and back on export.

Differences from the runtimes, none of which touches exactness (the proposer is verified by the target):
vLLM and SGLang run layer 0 only, rolled out on its own outputs, while specjax runs layer ``min(j, D)`` for
proposal j as it does for every MTP head (with ``num_nextn_predict_layers = 1`` the two agree); and both
zero the token embedding of the pair at position 0 (``inputs_embeds[positions == 0] = 0``), which specjax does
not (modeling_mimo.py does not either).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.hf import (_BUFFER_SUFFIXES, MIMO_MTP_PREFIX, CheckpointFileError, _open_files, _read_json, config_to_hf,
                        save_hf)
from specjax.head_formats import HeadTensor
from specjax.models.heads import HEADS, HeadConfig, MTPHeads

FIELD = "num_nextn_predict_layers"
_LAYER = re.compile(re.escape(MIMO_MTP_PREFIX) + r"(\d+)\.(.+)$")


@dataclasses.dataclass(frozen=True)
class _InputProj(HeadTensor):
  """``input_proj.weight``: MiMo concatenates ``[hidden, embedding]``, specjax's ``proj`` reads
  ``[embedding, hidden]``; the two halves of the input axis swap (an involution, so export undoes import)."""

  def to_ours(self, x: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
    w = super().to_ours(x, ours)  # [2D, D], rows [hidden; embedding]
    return np.concatenate([w[w.shape[0] // 2:], w[:w.shape[0] // 2]])

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    return super().to_hf(np.concatenate([x[x.shape[0] // 2:], x[:x.shape[0] // 2]]))


def tensor_table(cfg: HeadConfig) -> list[HeadTensor]:
  """Every MTP tensor of a MiMo checkpoint for a head config ``cfg`` (``num_heads`` layers): the one table
  import, export and the shape checks share."""
  T = HeadTensor
  specs = []
  for i in range(cfg.num_heads):
    h, m = f"{MIMO_MTP_PREFIX}{i}.", ("modules", i)
    b = m + ("block",)
    specs += [
        T(h + "token_layernorm.weight", m + ("embed_norm", "scale")),
        T(h + "hidden_layernorm.weight", m + ("hidden_norm", "scale")),
        _InputProj(h + "input_proj.weight", m + ("proj", "w"), 1, True),
        T(h + "input_layernorm.weight", b + ("attn_norm", "scale")),
        *(T(h + f"self_attn.{x}_proj.weight", b + ("attn", f"w{x}"), 1, True) for x in "qkv"),
        *(T(h + f"self_attn.{x}_proj.bias", b + ("attn", f"b{x}")) for x in "qkv"),
        T(h + "self_attn.o_proj.weight", b + ("attn", "wo"), 2, True),
        T(h + "post_attention_layernorm.weight", b + ("mlp_norm", "scale")),
        *(T(h + f"mlp.{x}_proj.weight", b + ("mlp", f"w_{x}"), 1, True) for x in ("gate", "up")),
        T(h + "mlp.down_proj.weight", b + ("mlp", "w_down"), 1, True),
        T(h + "final_layernorm.weight", m + ("out_norm", "scale")),
    ]
  return specs


def num_layers(hf: dict) -> int:
  """``num_nextn_predict_layers`` of a parsed MiMo ``config.json`` (absent: 0)."""
  n = hf.get(FIELD, 0)
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise CheckpointFileError(f"config.json: {FIELD} must be an integer >= 0, got {n!r}")
  return n


def head_config(target_cfg, n: int, dtype: str | None = None) -> HeadConfig:
  """The :class:`HeadConfig` of ``n`` MiMo MTP layers on a body with config ``target_cfg``: each layer is a
  decoder layer of the body's shape (heads, head size, MLP width, eps, rope) with q/k/v biases and a normed
  output."""
  dtype = dtype or target_cfg.dtype
  head_dim = None if target_cfg.head_dim == target_cfg.d_model // target_cfg.n_heads else target_cfg.head_dim
  return HeadConfig.for_target("mtp", target_cfg, num_heads=n, d_ff=target_cfg.d_ff, head_dim=head_dim,
                               rope_scaling=target_cfg.rope_scaling, qkv_bias=True, normed_output=True,
                               dtype=dtype, param_dtype=dtype)


def _check_body(target_cfg, where: str) -> None:
  """Refuses bodies whose MTP layer specjax would have to guess (naming the field)."""
  for field, ok, why in (("sliding_window", target_cfg.sliding_window is None, "the MTP layer's window is not defined"),
                         ("qkv_bias", target_cfg.qkv_bias, "a MiMo body is a Qwen2 body, with q/k/v biases")):
    if not ok:
      raise CheckpointFileError(f"{where}: the body's {field}={getattr(target_cfg, field)!r} does not fit MiMo MTP "
                                f"layers ({why})")


def load_mtp(path: str, target_cfg, dtype: str = "float32") -> MTPHeads | None:
  """The MTP proposer's head set of the MiMo checkpoint directory ``path`` (whose body has config
  ``target_cfg``), in ``dtype``; None when ``num_nextn_predict_layers`` is 0 and there are no MTP tensors.

  Raises:
    CheckpointFileError (a ValueError): MTP layers that do not fit the body or the config, naming the field or
      tensor: a layer index at or past ``num_nextn_predict_layers``, a missing or unexpected tensor, a tensor
      whose shape disagrees with ``hidden_size`` (or the other sizes of config.json), a non-float tensor.
  """
  hf = _read_json(os.path.join(path, "config.json"))
  n = num_layers(hf)
  tensors: dict[str, np.ndarray] = {}
  for file, f, keys in _open_files(path):
    for key in keys:
      if key.endswith(_BUFFER_SUFFIXES):  # recomputed rotary tables, skipped as for the body (and by vLLM)
        continue
      match = _LAYER.match(key)
      if match is None:
        if key.startswith(MIMO_MTP_PREFIX):
          raise CheckpointFileError(f"{file}: unexpected tensor {key!r} (MTP tensors are {MIMO_MTP_PREFIX}<i>.<name>)")
        continue
      layer = int(match.group(1))
      if layer >= n:
        raise CheckpointFileError(
            f"{file}: tensor {key!r} belongs to MTP layer {layer}, but config.json has {FIELD}={n} (layers "
            f"0..{n - 1})" if n else f"{file}: tensor {key!r} is an MTP layer, but config.json has {FIELD}=0")
      try:
        source_dtype = f.get_slice(key).get_dtype()
        if source_dtype not in ("F32", "F16", "BF16", "F64"):  # as the body's loader (BF16 reads as ml_dtypes')
          raise CheckpointFileError(f"{file}: tensor {key!r} has dtype {source_dtype}; only float tensors load")
        tensors[key] = f.get_tensor(key)
      except CheckpointFileError:
        raise
      except Exception as e:
        raise CheckpointFileError(f"{file}: cannot read tensor {key!r} ({e})") from e
  if n == 0:
    return None
  _check_body(target_cfg, path)
  try:
    cfg = head_config(target_cfg, n, dtype)
  except ValueError as e:
    raise CheckpointFileError(f"{path}: config.json does not make valid MTP layers: {e}") from None
  graphdef, state = nnx.split(nnx.eval_shape(lambda: MTPHeads(cfg, rngs=nnx.Rngs(0))))
  flat = {tuple(path_): var for path_, var in nnx.to_flat_state(state)}
  table = tensor_table(cfg)
  values = {}
  for spec in table:
    x = tensors.get(spec.key)
    if x is None:
      raise CheckpointFileError(f"{path}: the checkpoint lacks tensor {spec.key!r}, which {FIELD}={n} in config.json "
                                "needs")
    ours = tuple(flat[spec.path].shape)
    want = spec.hf_shape(ours)
    if tuple(x.shape) != want:
      raise CheckpointFileError(
          f"{path}: tensor {spec.key!r} has shape {list(x.shape)}, but config.json (hidden_size={target_cfg.d_model}, "
          f"num_attention_heads={target_cfg.n_heads}, num_key_value_heads={target_cfg.n_kv_heads}, "
          f"intermediate_size={target_cfg.d_ff}) implies {list(want)}")
    values[spec.path] = spec.to_ours(x, ours)
  extra = sorted(set(tensors) - {s.key for s in table})
  if extra:
    raise CheckpointFileError(f"{path}: unexpected tensor {extra[0]!r} (not part of a MiMo MTP layer)")
  missing = sorted("/".join(map(str, p)) for p in set(flat) - set(values))
  assert not missing, f"the MiMo table misses head parameters {missing}"
  return nnx.merge(graphdef, nnx.from_flat_state({p: var.replace(jnp.asarray(values[p], var.dtype))
                                                  for p, var in flat.items()}))


def save_mimo(model, heads: MTPHeads, tokenizer, path: str) -> None:
  """Writes a Qwen2-bodied specjax model and its MiMo-form MTP heads as a MiMo checkpoint directory:
  ``config.json`` (``MiMoForCausalLM``, ``num_nextn_predict_layers``), ``model.safetensors`` (body and MTP
  layers) and ``tokenizer.json``; ``specjax.load`` of it gives bit-identical parameters back.

  Raises:
    CheckpointFileError: a body that is not a Qwen2 body, or heads that MiMo's layout cannot express (another
      kind, or a :class:`HeadConfig` field that differs from what a MiMo MTP layer on this body has), naming it.
  """
  from safetensors.numpy import load_file, save_file

  hf = config_to_hf(model.cfg)
  if hf["model_type"] != "qwen2":
    raise CheckpointFileError(f"cannot export as MiMo: the body exports as {hf['model_type']!r}, MiMo's body is "
                              "Qwen2 (q/k/v biases, no sliding window, no other family's features)")
  _check_body(model.cfg, "cannot export as MiMo")
  cfg = getattr(heads, "cfg", None)
  if not isinstance(heads, HEADS["mtp"]) or cfg is None:
    raise CheckpointFileError(f"cannot export as MiMo: the heads must be MTPHeads, got {type(heads).__name__}")
  want = head_config(model.cfg, cfg.num_heads, cfg.dtype)
  diff = [f.name for f in dataclasses.fields(cfg)
          if f.name != "param_dtype" and getattr(cfg, f.name) != getattr(want, f.name)]
  if diff:
    raise CheckpointFileError(
        f"cannot export as MiMo: HeadConfig fields {diff} are {[getattr(cfg, d) for d in diff]}, a MiMo MTP layer on "
        f"this body has {[getattr(want, d) for d in diff]}")
  save_hf(model, tokenizer, path)
  config_file, weights_file = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
  hf = _read_json(config_file)
  hf.update(architectures=["MiMoForCausalLM"], model_type="mimo", attention_bias=True, **{FIELD: cfg.num_heads})
  with open(config_file, "w", encoding="utf-8") as f:
    json.dump(hf, f, indent=2)
  flat = {tuple(p): np.asarray(jax.device_get(v[...])) for p, v in nnx.to_flat_state(nnx.state(heads, nnx.Param))}
  tensors = load_file(weights_file)
  tensors.update({spec.key: spec.to_hf(flat[spec.path]) for spec in tensor_table(cfg)})
  save_file(tensors, weights_file, metadata={"format": "pt"})
