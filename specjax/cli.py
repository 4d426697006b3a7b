"""The ``specjax`` command line.

Bad arguments exit with status 2 and one line on stderr (``specjax: error: ...``), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from specjax.config import MAX_K, MAX_NGRAM, METHODS, SamplingConfig, SpecConfig

DEFAULT_PAIR = "stdlib-coder"


class CliError(Exception):
  """A user error: printed as one line, exit status 2."""


def _k_arg(text: str) -> int | str:
  if text == "auto":
    return text
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"invalid value {text!r}: an integer in [1, {MAX_K}] or 'auto'") from None


class _Parser(argparse.ArgumentParser):

  def error(self, message):  # one clear line instead of usage + message
    raise CliError(message)


def _random_pair():
  """Small randomly initialised byte-level models, for smoke runs only (``--random-init``)."""
  from flax import nnx

  from specjax.models import Llama, LlamaConfig
  from specjax.tokenizer import ByteTokenizer

  tok = ByteTokenizer()
  target_cfg = LlamaConfig(vocab_size=tok.vocab_size, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                           d_ff=384, max_seq_len=1024)
  draft_cfg = target_cfg.replace(d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=128)
  return Llama(target_cfg, rngs=nnx.Rngs(0)), Llama(draft_cfg, rngs=nnx.Rngs(1)), tok


def _load_models(args, method: str):
  """(target, draft or None, tokenizer) from --random-init, --target/--draft, or the bundled pair."""
  from specjax.loading import PRETRAINED, load

  if args.draft and method != "draft":
    raise CliError(f"--draft is used only by --method draft, not {method}")
  if args.random_init:
    if args.target or args.draft:
      raise CliError("--random-init cannot be combined with --target/--draft")
    return _random_pair()
  try:
    if args.target:
      if method == "draft" and not args.draft:
        raise CliError("--method draft with --target needs --draft DIR (or use --method none)")
      if args.draft and method == "draft":
        from specjax.hf import load_hf_pair

        return load_hf_pair(args.target, args.draft, dtype=args.dtype)
      target, tok = load(args.target, dtype=args.dtype)
      return target, None, tok
    if args.draft:
      raise CliError("--draft needs --target")
    if DEFAULT_PAIR not in PRETRAINED:
      raise CliError(f"the default model pair {DEFAULT_PAIR!r} is not bundled with this install: pass "
                     "--target DIR --draft DIR, or --random-init for small random models (smoke tests only)")
    target, tok, draft = load(DEFAULT_PAIR, dtype=args.dtype)
    return target, draft, tok
  except (ValueError, OSError) as e:
    raise CliError(str(e)) from None


def _cmd_generate(args) -> int:
  if args.prompt == "":
    raise CliError("argument --prompt: must not be empty")
  try:
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    ngram = {name: getattr(args, name) for name in ("ngram_max", "ngram_min") if getattr(args, name) is not None}
    if ngram and args.method != "ngram":
      raise CliError(f"--ngram-max/--ngram-min apply only to --method ngram, not {args.method}")
    spec = SpecConfig(args.method, args.k if args.method != "none" else 0, **ngram)
  except ValueError as e:
    raise CliError(str(e)) from None
  target, draft, tok = _load_models(args, spec.method)

  import specjax

  start = time.perf_counter()
  try:
    out = specjax.generate(target, [args.prompt], draft=draft if spec.method == "draft" else None, spec=spec,
                           sampling=sampling, max_new_tokens=args.max_new_tokens, seed=args.seed,
                           tokenizer=tok)
  except ValueError as e:
    raise CliError(str(e)) from None
  seconds = time.perf_counter() - start
  if args.json:
    print(json.dumps({
        "text": out.text[0],
        "tokens": out.rows()[0],
        "stats": out.stats.to_dict(),
        "method": spec.method,
        "k": out.stats.k,
        "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p},
        "seconds_including_compile": seconds,
    }))
  else:
    s = out.stats
    print(args.prompt + out.text[0])
    rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.3f}"
    print(f"[{spec.method} k={out.stats.k}] {s.new_tokens} tokens in {s.rounds} rounds, acceptance rate "
          f"{rate}, tau {s.mean_accepted_length:.2f}, {seconds:.2f}s including compilation", file=sys.stderr)
  return 0


def _int_list(text: str) -> tuple[int, ...]:
  try:
    values = tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"invalid value {text!r}: a comma-separated list of integers") from None
  if not values:
    raise argparse.ArgumentTypeError("invalid value: an empty list")
  return values


def _cmd_bench(args) -> int:
  import dataclasses

  from specjax import bench

  base = bench.QUICK if args.quick else bench.BenchSettings()
  changes = {name: getattr(args, name) for name in ("batch_sizes", "ks", "max_new_tokens", "repeats")
             if getattr(args, name) is not None}
  for name in ("samplings", "methods"):
    if getattr(args, name) is not None:
      changes[name] = tuple(s for s in getattr(args, name).split(",") if s)
  try:
    settings = dataclasses.replace(base, **changes)
  except ValueError as e:
    raise CliError(str(e)) from None
  if args.target and not args.draft and "draft" in settings.methods:
    raise CliError("bench with --target and method draft needs --draft DIR (or pass --methods ngram)")
  target, draft, tok = _load_models(args, "draft" if args.draft or not args.target else "ngram")
  rows = [tok.encode(p) for p in bench.DEFAULT_PROMPTS]
  report = bench.run(target, draft, rows, settings, progress=not args.no_progress)
  paths = bench.write(report, args.out)
  print(bench.markdown(report))
  print("wrote " + ", ".join(paths), file=sys.stderr)
  return 0


def _add_model_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--target", help="target model: a Hugging Face checkpoint directory or a bundled name")
  p.add_argument("--draft", help="draft model directory (same tokenizer as the target)")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                 help="parameter dtype when loading (default: float32)")
  p.add_argument("--random-init", action="store_true",
                 help="use small randomly initialised models (smoke tests only)")


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="specjax", description="Speculative decoding for JAX/Flax language models.")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  gen = sub.add_parser("generate", help="generate text from a prompt")
  gen.add_argument("--prompt", required=True, help="the prompt text")
  gen.add_argument("--method", choices=METHODS, default="draft",
                   help="proposer: a draft model, ngram (prompt lookup, no model) or none (default: draft)")
  gen.add_argument("--k", type=_k_arg, default=4,
                   help=f"speculation length, 1..{MAX_K}, or 'auto' (calibrated cost model; default: 4)")
  gen.add_argument("--ngram-max", type=int,
                   help=f"--method ngram: longest n-gram looked up, 1..{MAX_NGRAM} (default: 3)")
  gen.add_argument("--ngram-min", type=int, help="--method ngram: shortest n-gram looked up (default: 1)")
  gen.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 is greedy (default: 0)")
  gen.add_argument("--top-k", type=int, default=0, help=">= 0; 0 disables (default: 0)")
  gen.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 disables (default: 1)")
  gen.add_argument("--max-new-tokens", type=int, default=64, help=">= 1 (default: 64)")
  gen.add_argument("--seed", type=int, default=0, help="PRNG seed (default: 0)")
  gen.add_argument("--json", action="store_true", help="print one JSON object")
  _add_model_args(gen)
  gen.set_defaults(func=_cmd_generate)

  b = sub.add_parser("bench", help="baseline against speculation, with the calibrated cost model")
  b.add_argument("--quick", action="store_true", help="a small sweep (greedy; batch 1,4; k 2,4; 32 tokens; 3 repeats)")
  b.add_argument("--batch-sizes", type=_int_list, help="comma-separated (default: 1,2,4,8,16)")
  b.add_argument("--ks", type=_int_list, help="comma-separated speculation lengths (default: 1,2,3,4,6,8)")
  b.add_argument("--samplings", help="comma-separated subset of greedy,sample (default: both)")
  b.add_argument("--methods", help="comma-separated subset of draft,ngram (default: both)")
  b.add_argument("--max-new-tokens", type=int, help="tokens per row (default: 64)")
  b.add_argument("--repeats", type=int, help="timed repeats per configuration (default: 5)")
  b.add_argument("--out", default="bench-results", help="output folder (default: bench-results)")
  b.add_argument("--no-progress", action="store_true", help="no progress bar")
  _add_model_args(b)
  b.set_defaults(func=_cmd_bench)

  from specjax.train.cli import register as register_training

  register_training(sub)
  return parser


def main(argv: list[str] | None = None) -> int:
  try:
    args = build_parser().parse_args(argv)
    return args.func(args)
  except CliError as e:
    print(f"specjax: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
