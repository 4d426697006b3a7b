"""Command line of the training module: ``specjax train target|draft`` and ``specjax eval``.

:func:`register` adds the subcommands to the ``specjax`` command's argparse subparsers;
``python -m specjax.train.cli ...`` runs them without the main CLI.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def _reporting_errors(command):
  """Every validation error of the training module is a ValueError subclass naming the path or field:
  print it as one line and exit with status 2 instead of a traceback."""

  def run(args: argparse.Namespace) -> int:
    try:
      return command(args)
    except ValueError as e:
      print(f"specjax: error: {e}", file=sys.stderr)
      return 2

  return run


@_reporting_errors
def _train(args: argparse.Namespace) -> int:
  import jax

  from specjax import distributed
  from specjax.cli import mesh_from_args
  from specjax.models.heads import HEAD_METHODS, kinds_of
  from specjax.train import config, trainer

  mesh = mesh_from_args(args)  # first: joining a multi-host run must precede any JAX computation
  cfg = config.load_config(args.config)
  if cfg.kind != args.kind:
    raise config.ConfigError(f"{args.config}: kind is {cfg.kind!r}, but this is `train {args.kind}`")
  if getattr(args, "parallel", False):
    cfg = config.as_parallel(cfg)
  elif cfg.parallel is not None:
    raise config.ConfigError(f"{args.config} has a [parallel] section: train it with `train draft --parallel`")
  if getattr(args, "data", None):
    cfg = config.with_data(cfg, args.data)
  head_kind = getattr(args, "head_kind", None)
  if head_kind in HEAD_METHODS:  # a method name stands for its first kind (eagle: eagle1)
    head_kind = kinds_of(head_kind)[0]
  if head_kind and head_kind != cfg.heads.kind:
    raise config.ConfigError(f"{args.config}: heads.kind is {cfg.heads.kind!r}, but --kind is {args.head_kind!r}")
  out = pathlib.Path(args.out) if args.out else pathlib.Path("runs") / pathlib.Path(args.config).stem
  if getattr(args, "prepare_only", False):
    if args.export_checkpoint:
      raise config.ConfigError("--prepare-only and --export-checkpoint do not go together")
    made = trainer.prepare_conversations(cfg, out, config_dir=pathlib.Path(args.config).parent)
    if distributed.is_primary():
      print(f"prepared: {made['conversations']:,} conversations in {made['shards']} shards, "
            f"{made['train_rows']:,} train rows ({made['train_tokens']:,} answer tokens) and {made['valid_rows']:,} "
            f"valid rows of {cfg.data.seq_len + 1} tokens; train with the same command without --prepare-only",
            flush=True)
    return 0
  if args.export_checkpoint:
    if not trainer.has_checkpoint(out):
      raise trainer.RunError(f"--export-checkpoint: {out / 'checkpoints'} holds no checkpoint to export")
    run = trainer.start(cfg, out, resume=True, config_dir=pathlib.Path(args.config).parent, mesh=mesh,
                        training=False)
    folder = trainer.export_now(run)
    if distributed.is_primary():
      print(f"exported step {run.step}/{cfg.run.steps}: {folder}", flush=True)
    return 0
  run = trainer.start(cfg, out, resume=args.resume, config_dir=pathlib.Path(args.config).parent, mesh=mesh)
  params = sum(x.size for x in jax.tree.leaves(run.params))
  say = print if distributed.is_primary() else lambda *a, **k: None
  say(f"{cfg.kind}: {params:,} trained parameters, step {run.step}/{cfg.run.steps}, "
      f"{len(run.batches.rows):,} train rows of {cfg.data.seq_len + 1} tokens"
      + ("" if cfg.conversations is None else f" from {cfg.conversations.path}") + f", out {out}"
      + ("" if mesh is None else f", mesh {dict(mesh.shape)}"), flush=True)
  trainer.fit(run)
  say(f"done: {out / ('heads' if cfg.kind == 'heads' else 'model')}", flush=True)
  return 0


@_reporting_errors
def _eval(args: argparse.Namespace) -> int:
  from specjax.train import evaluate

  cfg = evaluate.load_eval_config(args.config)
  out = pathlib.Path(args.out) if args.out else None
  results = evaluate.run_eval(cfg, out=out, config_dir=pathlib.Path(args.config).parent)
  print(json.dumps(results, indent=2))
  print(evaluate.summary_table(results))
  return 0


def register(subparsers) -> None:
  """Adds ``train`` (with ``target`` and ``draft``) and ``eval`` to an argparse subparsers object."""
  from specjax.cli import add_mesh_args
  from specjax.models.heads import HEAD_METHODS, kinds_of

  # --kind: every method that drives heads and each of its kinds (medusa, eagle, eagle1, eagle3, mtp)
  head_kinds = tuple(dict.fromkeys(name for method in HEAD_METHODS for name in (method, *kinds_of(method))))
  train = subparsers.add_parser("train", help="train a target, distill a draft or train heads from a recipe file")
  kinds = train.add_subparsers(dest="kind", required=True)
  for kind, text in (("target", "pretrain a target model"), ("draft", "train or distill a draft model"),
                     ("heads", "train Medusa, EAGLE or MTP heads on a frozen target")):
    p = kinds.add_parser(kind, help=text)
    if kind == "draft":
      p.add_argument("--parallel", action="store_true",
                     help="a parallel draft (PARD): mask-block training with conditional drop; the recipe's "
                          "[parallel] section, or its defaults (k = 8, r = 0.7, r_min = 0.2) with model.vocab_size "
                          "grown by the mask token")
    if kind == "heads":
      p.add_argument("--kind", dest="head_kind", choices=head_kinds,
                     help="the head kind the recipe must train (a method name: its first kind, eagle = eagle1); "
                          "checked against heads.kind")
      p.add_argument("--data", metavar="FILE.jsonl",
                     help="train on these conversations (OpenAI messages or ShareGPT layout, one a line): sets "
                          "conversations.path, adding a default [conversations] section (answers regenerated by "
                          "the target) when the recipe has none")
      p.add_argument("--prepare-only", action="store_true",
                     help="make the conversations' missing shards (the target's answers regenerated) and stop: "
                          "no feature cache, no training (resumable; train later with the same --out)")
    p.add_argument("--config", required=True, help="recipe file (.toml or .json), e.g. train/configs/...")
    p.add_argument("--out", help="run directory (default runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--export-checkpoint", action="store_true",
                   help="export the newest checkpoint in --out as it stands (model/ or heads/), without training")
    add_mesh_args(p)
    p.set_defaults(func=_train)
  cv = kinds.add_parser("curve", help="plot runs' validation tau (heads) or perplexity (target, draft) against "
                                      "training tokens")
  cv.add_argument("runs", nargs="+", metavar="RUN", help="run directories (config.json and metrics.jsonl)")
  cv.add_argument("--out", required=True, help="the PNG to write")
  cv.set_defaults(func=_curve)
  ev = subparsers.add_parser("eval", help="acceptance and speed of a target/draft pair on held-out text")
  ev.add_argument("--config", required=True, help="evaluation file (.toml or .json)")
  ev.add_argument("--out", help="write the results as JSON to this file")
  ev.add_argument("--resume", action="store_true", help="accepted for symmetry; evaluation is stateless")
  ev.set_defaults(func=_eval)


def _curve(args) -> int:
  from specjax.cli import CliError
  from specjax.train.curves import curve_command

  try:
    series = curve_command(args.runs, args.out)
  except (FileNotFoundError, ValueError) as e:
    raise CliError(str(e)) from None
  for label, points in series.items():
    print(f"{label}: " + ", ".join(f"{t / 1e6:.2f}M {v:.3f}" for t, v in points))
  print(f"wrote {args.out}")
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m specjax.train.cli")
  register(parser.add_subparsers(dest="command", required=True))
  args = parser.parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
