"""Trained models shipped with specjax, and the on-disk format of an exported model.

An exported model is a folder with ``config.json`` (the :class:`LlamaConfig` fields), ``params.npz``
(one float32 array per parameter, keyed by its path such as ``blocks/0/attn/wq``) and ``tokenizer.json``.
A shipped pair is a folder under ``specjax/assets/<name>/`` with ``target/`` and ``draft/`` exports
sharing one tokenizer, optionally ``heads/<method>/`` head sets trained for the target
(:func:`specjax.models.heads.save_heads`; method ``medusa``, ``eagle`` or ``mtp``), and optionally ``pard/``, a
parallel draft (an export whose vocabulary is the target's plus the mask token; drive it with
:class:`specjax.proposers.ParallelDraft`).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.llama import Llama, LlamaConfig
from specjax.tokenizer import load_tokenizer

ASSETS = pathlib.Path(__file__).parent / "assets"


def _flatten(tree: dict[Any, Any], prefix: str = "") -> dict[str, np.ndarray]:
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(_flatten(value, name + "/"))
    else:
      flat[name] = value
  return flat


def _unflatten(flat: dict[str, np.ndarray]) -> dict[Any, Any]:
  tree: dict[Any, Any] = {}
  for name, value in flat.items():
    node = tree
    parts = [int(p) if p.isdigit() else p for p in name.split("/")]
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = value
  return tree


def save_model(directory: str | pathlib.Path, model: Llama, tokenizer=None) -> None:
  """Exports ``model`` (and ``tokenizer.json`` when given) to ``directory``."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(dict(vars(model.cfg)), indent=2) + "\n")
  params = _flatten(nnx.to_pure_dict(nnx.split(model)[1]))
  np.savez(directory / "params.npz", **{k: np.asarray(v) for k, v in params.items()})
  if tokenizer is not None:
    tokenizer.save(directory / "tokenizer.json")


def load_model(directory: str | pathlib.Path) -> Llama:
  """Loads an export written by :func:`save_model`.

  Raises:
    FileNotFoundError / ValueError: naming the file that is missing or does not fit the config.
  """
  directory = pathlib.Path(directory)
  config_path, params_path = directory / "config.json", directory / "params.npz"
  for path in (config_path, params_path):
    if not path.is_file():
      raise FileNotFoundError(f"model file {path} does not exist")
  try:
    cfg = LlamaConfig(**json.loads(config_path.read_text()))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{config_path} is not a valid LlamaConfig: {e}") from e
  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract = nnx.split(model)
  want = _flatten(nnx.to_pure_dict(abstract))
  with np.load(params_path) as npz:
    got = {name: npz[name] for name in npz.files}
  missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
  if missing or extra:
    raise ValueError(f"{params_path} does not fit {config_path}: "
                     + (f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"))
  for name, spec in want.items():
    if got[name].shape != spec.shape:
      raise ValueError(f"{params_path}: {name} has shape {got[name].shape}, {config_path} needs {spec.shape}")
  params = _unflatten({name: jnp.asarray(got[name], spec.dtype) for name, spec in want.items()})
  return nnx.merge(graphdef, params)


def load_shipped_heads(name: str, target_cfg: LlamaConfig | None = None) -> dict:
  """``{method: head set}`` shipped for a model (empty when it ships none), each checked against the target
  configuration: ``target_cfg``, else the shipped pair's ``target/config.json``. A bundled pair keeps its
  heads in ``assets/<name>/heads/<method>/``; so does a model that ships no weights of its own (a GGUF file
  known by a short name), whose heads are checked against the configuration of the file loaded."""
  from specjax.models.heads import load_heads

  root = pathlib.Path(name) if pathlib.Path(name).is_dir() else ASSETS / name
  heads_dir = root / "heads"
  if not heads_dir.is_dir():
    return {}
  if target_cfg is None:
    target_cfg = LlamaConfig(**json.loads((root / "target" / "config.json").read_text()))
  return {d.name: load_heads(d, target_cfg) for d in sorted(heads_dir.iterdir()) if (d / "heads.json").is_file()}


def load_shipped_pard(name: str) -> Llama | None:
  """The parallel draft shipped for a model (``assets/<name>/pard/``, or ``<folder>/pard/``), or None when it
  ships none. ``specjax.proposers.ParallelDraft(load_shipped_pard("stdlib-coder"))`` is its proposer."""
  root = pathlib.Path(name) if pathlib.Path(name).is_dir() else ASSETS / name
  return load_model(root / "pard") if (root / "pard" / "config.json").is_file() else None


def gguf_registry(assets: pathlib.Path | None = None) -> dict[str, dict]:
  """``{name: entry}`` for the shipped models that are a GGUF file: ``assets/<name>/gguf.json`` holds the file's
  ``file`` name, ``size`` in bytes and ``fingerprint`` (:func:`specjax.gguf.fingerprint`), so that the file
  brings its shipped heads however it is loaded (by short name or by path)."""
  root = ASSETS if assets is None else pathlib.Path(assets)
  out = {}
  for entry in sorted(root.glob("*/gguf.json")) if root.is_dir() else ():
    out[entry.parent.name] = json.loads(entry.read_text())
  return out


def register_gguf(dest: str | pathlib.Path, path: str) -> pathlib.Path:
  """Writes ``dest/gguf.json`` (the entry :func:`gguf_registry` reads) for the GGUF file at ``path``."""
  import os

  from specjax.gguf import fingerprint

  entry = {"file": os.path.basename(path), "size": os.path.getsize(path), "fingerprint": fingerprint(path)}
  out = pathlib.Path(dest) / "gguf.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(entry, indent=2) + "\n")
  return out


def recognise_gguf(path: str, assets: pathlib.Path | None = None) -> str | None:
  """The shipped model name whose registered GGUF file ``path`` is (:func:`gguf_registry`), or None. Only a file
  whose size matches an entry is fingerprinted, so unknown files cost one ``stat``."""
  import os

  from specjax.gguf import fingerprint

  size = os.path.getsize(path)
  candidates = {name: e for name, e in gguf_registry(assets).items() if e.get("size") == size}
  if not candidates:
    return None
  found = fingerprint(path)
  return next((name for name, e in candidates.items() if e.get("fingerprint") == found), None)


def available() -> list[str]:
  """Names of the shipped model pairs."""
  if not ASSETS.is_dir():
    return []
  return sorted(p.name for p in ASSETS.iterdir() if (p / "target" / "config.json").is_file())


def load_pretrained(name: str = "stdlib-coder"):
  """Loads a shipped ``(target, draft, tokenizer)`` by name, or from a folder laid out the same way.

  Raises:
    ValueError: unknown name (listing the shipped ones); a :class:`~specjax.tokenizer.TokenizerError` (a
      ValueError) for a tokenizer that is missing, malformed or whose vocabulary does not match the models.
  """
  root = pathlib.Path(name) if pathlib.Path(name).is_dir() else ASSETS / name
  if not (root / "target").is_dir():
    raise ValueError(f"unknown pretrained model {name!r}; shipped: {available()}")
  target, draft = load_model(root / "target"), load_model(root / "draft")
  tokenizer = load_tokenizer(root / "tokenizer.json")
  for role, model in (("target", target), ("draft", draft)):
    tokenizer.check_model(model.cfg.vocab_size, f"{root / role / 'config.json'}")
  return target, draft, tokenizer
