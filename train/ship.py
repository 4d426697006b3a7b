"""Copies a trained target/draft pair into the package as a named pretrained model.

Usage: python -m specjax.train.ship --target runs/target --draft runs/draft_distill --name stdlib-coder

Writes ``specjax/assets/<name>/{target,draft}/{config.json,params.npz}`` and one ``tokenizer.json``,
then loads the result back with :func:`specjax.pretrained.load_pretrained` to prove it is complete.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

from specjax import pretrained
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


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m specjax.train.ship")
  parser.add_argument("--target", required=True)
  parser.add_argument("--draft", required=True)
  parser.add_argument("--name", default="stdlib-coder")
  args = parser.parse_args(argv)
  dest = ship(args.target, args.draft, args.name)
  size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
  print(f"shipped {dest} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
  main()
