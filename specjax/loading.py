"""``specjax.load``: one entry point for Hugging Face checkpoint directories and bundled model pairs."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

# name -> loader(dtype) returning Loaded; bundled pairs register themselves here.
PRETRAINED: dict[str, Callable[[str], Loaded]] = {}


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A loaded model with its tokenizer, and its draft where the source ships one.

  Unpacks as ``model, tokenizer = specjax.load(dir)`` or ``target, tokenizer, draft = ...``.
  """

  model: Any
  tokenizer: Any
  draft: Any = None

  def __iter__(self):
    return iter((self.model, self.tokenizer) if self.draft is None else (self.model, self.tokenizer, self.draft))


def register_pretrained(name: str, loader: Callable[[str], Loaded]) -> None:
  PRETRAINED[name] = loader


def load(name_or_path: str, dtype: str = "float32") -> Loaded:
  """Loads a bundled pair by name (for example ``"stdlib-coder"``) or a Hugging Face checkpoint directory.

  Args:
    name_or_path: a name in ``specjax.loading.PRETRAINED`` or a directory with ``config.json``,
      ``*.safetensors`` and ``tokenizer.json``.
    dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` for the parameters.

  Raises:
    ValueError: for an unknown name or a path that is not a checkpoint directory (naming it).
  """
  if name_or_path in PRETRAINED:
    return PRETRAINED[name_or_path](dtype)
  if os.path.isdir(name_or_path):
    from specjax.hf import load_hf

    model, tokenizer = load_hf(name_or_path, dtype=dtype)
    return Loaded(model=model, tokenizer=tokenizer)
  known = ", ".join(sorted(PRETRAINED)) or "none bundled"
  raise ValueError(f"{name_or_path!r} is neither a bundled model ({known}) nor a checkpoint directory")
