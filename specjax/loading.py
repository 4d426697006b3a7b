"""``specjax.load``: one entry point for Hugging Face checkpoint directories and bundled model pairs."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A loaded model with its tokenizer, and its draft and heads where the source ships them.

  Unpacks as ``model, tokenizer = specjax.load(dir)`` or ``target, tokenizer, draft = ...``. ``heads`` maps
  a method name (``"medusa"``, ``"eagle"``, ``"mtp"``) to a trained head set for this target
  (:mod:`specjax.models.heads`); ``specjax.proposers.for_heads(loaded.heads["eagle"])`` is its proposer.
  """

  model: Any
  tokenizer: Any
  draft: Any = None
  heads: dict = dataclasses.field(default_factory=dict)

  def __iter__(self):
    return iter((self.model, self.tokenizer) if self.draft is None else (self.model, self.tokenizer, self.draft))


def register_pretrained(name: str, loader: Callable[[str], Loaded]) -> None:
  PRETRAINED[name] = loader


def cast(model, dtype: str):
  """``model`` with parameters and activations in ``dtype`` (a new model; the input is unchanged)."""
  if model.cfg.param_dtype == dtype and model.cfg.dtype == dtype:
    return model
  from flax import nnx

  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: x.astype(dtype), state)
  cfg = model.cfg.replace(dtype=dtype, param_dtype=dtype)
  abstract = nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0)))
  new_def, _ = nnx.split(abstract)
  return nnx.merge(new_def, state)


def _bundled(name: str) -> Callable[[str], Loaded]:
  def loader(dtype: str) -> Loaded:
    from specjax.pretrained import load_pretrained

    target, draft, tokenizer = load_pretrained(name)
    return Loaded(model=cast(target, dtype), tokenizer=tokenizer, draft=cast(draft, dtype))
  return loader


def _register_shipped() -> None:
  from specjax.pretrained import available

  for name in available():
    register_pretrained(name, _bundled(name))


def load(name_or_path: str, dtype: str = "float32") -> Loaded:
  """Loads a bundled pair by name (for example ``"stdlib-coder"``) or a Hugging Face checkpoint directory.

  Args:
    name_or_path: a name in ``specjax.loading.PRETRAINED`` or a directory with ``config.json``,
      ``*.safetensors`` and ``tokenizer.json``.
    dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` for the parameters.

  Raises:
    ValueError: for an unknown name or a path that is not a checkpoint directory (naming it).
  """
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
  if name_or_path in PRETRAINED:
    return PRETRAINED[name_or_path](dtype)
  if os.path.isdir(name_or_path):
    from specjax.hf import load_hf

    model, tokenizer = load_hf(name_or_path, dtype=dtype)
    return Loaded(model=model, tokenizer=tokenizer)
  known = ", ".join(sorted(PRETRAINED)) or "none bundled"
  raise ValueError(f"{name_or_path!r} is neither a bundled model ({known}) nor a checkpoint directory")


# name -> loader(dtype) returning Loaded; the pairs shipped under specjax/assets/ are registered here.
PRETRAINED: dict[str, Callable[[str], Loaded]] = {}
_register_shipped()
