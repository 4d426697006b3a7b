"""Copies a trained target/draft pair, and head sets trained for its target, into the package.

Usage::

    python -m specjax.train.ship --target runs/target --draft runs/draft_distill --name stdlib-coder
    python -m specjax.train.ship --name stdlib-coder --heads eagle=runs/heads_eagle3 --heads mtp=runs/heads_mtp
    python -m specjax.train.ship --name stdlib-coder --pard runs/pard_stdlib

Writes ``specjax/assets/<name>/{target,draft}/{config.json,params.npz}`` and one ``tokenizer.json``
(``--target``/``--draft``), and ``specjax/assets/<name>/heads/<method>/`` (``--heads METHOD=RUN``), then
loads the result back (:func:`specjax.pretrained.load_pretrained`, ``load_shipped_heads``) to prove it is
complete and that every head set fits the shipped target. ``--pard RUN`` copies a parallel draft's export
(``specjax train draft --parallel``) into ``specjax/assets/<name>/pard/``, checked against the target. For a
GGUF short name, both also write ``specjax/assets/<name>/gguf.json`` (the file's size and fingerprint), so the
file brings them when loaded by its path too.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

from specjax import pretrained
from specjax.models.heads import HEAD_METHODS
from specjax.numerics import FLOAT_DTYPES
from specjax.tokenizer import load_tokenizer


def _export_dir(run: pathlib.Path) -> pathlib.Path:
  folder = run / "model" if (run / "model" / "config.json").is_file() else run
  if not (folder / "params.npz").is_file():
    raise FileNotFoundError(f"{run} holds no exported model (expected {folder / 'params.npz'})")
  return folder


def ship(target: str | pathlib.Path, draft: str | pathlib.Path, name: str,
         assets: pathlib.Path = pretrained.ASSETS) -> pathlib.Path:
  """Copies the exports of two runs into ``assets/name`` and returns that folder."""
  t_dir, d_dir = _export_dir(pathlib.Path(target)), _export_dir(pathlib.Path(draft))
  t_tok, d_tok = load_tokenizer(t_dir / "tokenizer.json"), load_tokenizer(d_dir / "tokenizer.json")
  if t_tok.fingerprint() != d_tok.fingerprint():
    raise ValueError(f"{t_dir} and {d_dir} were trained with different tokenizers")
  dest = assets / name
  shutil.rmtree(dest, ignore_errors=True)
  for role, src in (("target", t_dir), ("draft", d_dir)):
    (dest / role).mkdir(parents=True)
    for f in ("config.json", "params.npz"):
      shutil.copy2(src / f, dest / role / f)
  shutil.copy2(t_dir / "tokenizer.json", dest / "tokenizer.json")
  (dest / "source.json").write_text(json.dumps({"target": str(target), "draft": str(draft)}, indent=2) + "\n")
  pretrained.load_pretrained(str(dest))
  return dest


def _target_config(name: str, dest: pathlib.Path):
  """The configuration heads for ``name`` must fit: the shipped pair's target, or the GGUF file registered
  under that short name (loaded from this machine's cache)."""
  from specjax.loading import GGUF_NAMES, load

  if (dest / "target" / "config.json").is_file():
    return pretrained.load_model(dest / "target").cfg
  if name in GGUF_NAMES:
    return load(name).model.cfg
  raise FileNotFoundError(f"{dest} holds no shipped pair and {name!r} is not a GGUF short name "
                          f"({sorted(GGUF_NAMES)}): ship the target and draft first")


def ship_heads(name: str, heads: dict[str, str | pathlib.Path], assets: pathlib.Path = pretrained.ASSETS,
               dtype: str | None = None) -> pathlib.Path:
  """Copies head sets (``{method: run directory or heads folder}``) into ``assets/name/heads/<method>``, for
  a shipped pair or a GGUF short name, cast to ``dtype`` when given (e.g. ``"bfloat16"`` halves the files).
  Refuses a head set of another kind than its method or built for another target (naming the field)."""
  from specjax.loading import cast
  from specjax.models.heads import load_heads, save_heads
  from specjax.proposers import for_heads

  dest = assets / name
  target_cfg = _target_config(name, dest)
  for method, src in heads.items():
    if method not in HEAD_METHODS:
      raise ValueError(f"--heads method must be one of {HEAD_METHODS}, got {method!r}")
    src = pathlib.Path(src)
    src = src / "heads" if (src / "heads" / "heads.json").is_file() else src
    loaded = load_heads(src, target_cfg)
    if for_heads(loaded).name != method:
      raise ValueError(f"{src} holds {loaded.cfg.kind} heads, not heads for method {method!r}")
    shutil.rmtree(dest / "heads" / method, ignore_errors=True)
    (dest / "heads" / method).mkdir(parents=True)
    if dtype is None:
      for f in ("heads.json", "heads.safetensors"):
        shutil.copy2(src / f, dest / "heads" / method / f)
    else:
      save_heads(dest / "heads" / method, cast(loaded, dtype))
  pretrained.load_shipped_heads(str(dest), target_cfg)
  _register_file(name, dest)
  return dest


def _register_file(name: str, dest: pathlib.Path) -> None:
  """For a GGUF short name: records the file's size and fingerprint (``dest/gguf.json``), so that loading the
  file by its path brings what is shipped for it too."""
  from specjax.loading import GGUF_NAMES, find_gguf

  if name in GGUF_NAMES:
    pretrained.register_gguf(dest, find_gguf(name))


PARD_DTYPES = (None, "float32", "float16")


def ship_pard(name: str, run: str | pathlib.Path, assets: pathlib.Path = pretrained.ASSETS,
              dtype: str | None = None) -> pathlib.Path:
  """Copies a parallel draft's export into ``assets/name/pard`` (for a shipped pair or a GGUF short name),
  refusing one that does not fit the target (:meth:`specjax.proposers.ParallelDraft.check`). ``dtype``
  ``"float16"`` stores the weights in half the bytes (``params.npz`` holds numpy's float16; loading casts them
  back to the configuration's dtype); ``None`` or ``"float32"`` copies the export as it is."""
  import numpy as np

  from specjax.proposers import ParallelDraft

  if dtype not in PARD_DTYPES:
    raise ValueError(f"--dtype for a parallel draft must be one of {PARD_DTYPES} (an .npz export has no "
                     f"bfloat16), got {dtype!r}")
  dest = assets / name
  src = _export_dir(pathlib.Path(run))
  target_cfg = _target_config(name, dest)
  ParallelDraft(pretrained.load_model(src)).check(target_cfg, 1)
  shutil.rmtree(dest / "pard", ignore_errors=True)
  (dest / "pard").mkdir(parents=True)
  shutil.copy2(src / "config.json", dest / "pard" / "config.json")
  if dtype in (None, "float32"):
    shutil.copy2(src / "params.npz", dest / "pard" / "params.npz")
  else:
    with np.load(src / "params.npz") as npz:
      np.savez(dest / "pard" / "params.npz", **{k: npz[k].astype(dtype) for k in npz.files})
  pretrained.load_shipped_pard(str(dest))
  _register_file(name, dest)
  return dest


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m specjax.train.ship")
  parser.add_argument("--target")
  parser.add_argument("--draft")
  parser.add_argument("--heads", action="append", default=[], metavar="METHOD=RUN",
                      help=f"a head set for the pair's target, METHOD one of {HEAD_METHODS}; repeatable")
  parser.add_argument("--pard", metavar="RUN", help="a parallel draft run (train draft --parallel) for the target")
  parser.add_argument("--name", default="stdlib-coder", help="a shipped pair, or a GGUF short name for --heads")
  parser.add_argument("--dtype", choices=FLOAT_DTYPES,
                      help="cast the head sets (float32, bfloat16, float16) or the parallel draft (float32, "
                           "float16) before shipping them (default: as trained)")
  args = parser.parse_args(argv)
  if bool(args.target) != bool(args.draft) or not (args.target or args.heads or args.pard):
    parser.error("pass --target and --draft (a pair), --heads METHOD=RUN (heads for a shipped pair), --pard RUN "
                 "(a parallel draft), or several")
  dest = pretrained.ASSETS / args.name
  if args.target:
    dest = ship(args.target, args.draft, args.name)
  if args.heads:
    dest = ship_heads(args.name, dict(h.split("=", 1) for h in args.heads), dtype=args.dtype)
  if args.pard:
    dest = ship_pard(args.name, args.pard, dtype=args.dtype)
  size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
  print(f"shipped {dest} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
  main()
