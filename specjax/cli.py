"""The ``specjax`` command line.

Bad arguments exit with status 2 and one line on stderr (``specjax: error: ...``), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from specjax.config import MAX_K, SamplingConfig, SpecConfig
from specjax.proposers import MAX_NGRAM, METHODS

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


HEAD_METHODS = ("medusa", "eagle", "mtp")


def _random_pair(dtype: str = "float32"):
  """Small randomly initialised byte-level models in ``dtype``, for smoke runs only (``--random-init``)."""
  from flax import nnx

  from specjax.models import Llama, LlamaConfig
  from specjax.tokenizer import ByteTokenizer

  tok = ByteTokenizer()
  target_cfg = LlamaConfig(vocab_size=tok.vocab_size, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                           d_ff=384, max_seq_len=1024, dtype=dtype, param_dtype=dtype)
  draft_cfg = target_cfg.replace(d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=128)
  return Llama(target_cfg, rngs=nnx.Rngs(0)), Llama(draft_cfg, rngs=nnx.Rngs(1)), tok


def _random_heads(method: str, target, args):
  """Randomly initialised heads of ``method`` for ``target`` (``--random-init`` / ``--random-heads``)."""
  from specjax.models.heads import build_heads

  if method == "medusa":
    k = args.k if isinstance(getattr(args, "k", None), int) else 0
    return build_heads("medusa", target.cfg, num_heads=max(4, k, max(getattr(args, "ks", None) or (0,))))
  if method == "eagle":
    return build_heads(f"eagle{args.eagle_variant}", target.cfg)
  return build_heads("mtp", target.cfg, num_heads=args.mtp_depth)


def _load_models(args, methods: tuple[str, ...]):
  """(target, tokenizer, {method: proposer}, chat format or None) from --random-init, --target/--draft/--heads,
  or the bundled pair; one proposer per requested method ("none" needs none)."""
  from specjax import proposers
  from specjax.loading import PRETRAINED, load

  if args.draft and "draft" not in methods:
    raise CliError(f"--draft is used only by --method draft, not {','.join(methods)}")
  if args.random_init and (args.target or args.draft or args.heads):
    raise CliError("--random-init cannot be combined with --target/--draft/--heads")
  try:
    draft, heads, chat = None, {}, None
    if args.random_init:
      target, draft, tok = _random_pair(args.dtype)
    elif args.target:
      if "draft" in methods and not args.draft:
        raise CliError("--method draft with --target needs --draft DIR (or use --method none)")
      if args.draft:
        from specjax.chat import hf_chat_format
        from specjax.hf import load_hf_pair

        target, draft, tok = load_hf_pair(args.target, args.draft, dtype=args.dtype)
        chat = hf_chat_format(args.target, tok)
      else:
        loaded = load(args.target, dtype=args.dtype)
        target, tok, heads, chat = loaded.model, loaded.tokenizer, dict(loaded.heads), loaded.chat
    else:
      if args.draft:
        raise CliError("--draft needs --target")
      if DEFAULT_PAIR not in PRETRAINED:
        raise CliError(f"the default model pair {DEFAULT_PAIR!r} is not bundled with this install: pass "
                       "--target DIR --draft DIR, or --random-init for small random models (smoke tests only)")
      loaded = load(DEFAULT_PAIR, dtype=args.dtype)
      target, tok, draft, heads, chat = loaded.model, loaded.tokenizer, loaded.draft, dict(loaded.heads), loaded.chat
    for directory in args.heads or ():
      from specjax.models.heads import load_heads

      loaded_heads = load_heads(directory, target.cfg)
      heads[proposers.for_heads(loaded_heads).name] = loaded_heads
    out = {}
    for method in methods:
      if method == "none":
        continue
      if method == "draft":
        out[method] = proposers.DraftModel(draft)
      elif method == "ngram":
        options = {f"n_{x}": getattr(args, f"ngram_{x}") for x in ("max", "min")
                   if getattr(args, f"ngram_{x}", None) is not None}
        out[method] = proposers.NGram(**options)
      elif method in heads and not args.random_heads:
        out[method] = proposers.for_heads(heads[method])
      elif args.random_init or args.random_heads:
        out[method] = proposers.for_heads(_random_heads(method, target, args))
      else:
        source = "the bundled pair ships" if not args.target else "--target has"
        raise CliError(f"--method {method} needs trained heads and {source} none: pass --heads DIR, or "
                       "--random-heads for randomly initialised heads (exact, but they rarely propose well)")
    return target, tok, out, chat
  except (ValueError, OSError) as e:
    raise CliError(str(e)) from None


def _cmd_generate(args) -> int:
  if args.prompt == "":
    raise CliError("argument --prompt: must not be empty")
  if args.batch < 1:
    raise CliError(f"argument --batch: must be an integer >= 1, got {args.batch}")
  if (args.ngram_max is not None or args.ngram_min is not None) and args.method != "ngram":
    raise CliError(f"--ngram-max/--ngram-min apply only to --method ngram, not {args.method}")
  try:
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.method == "none":
      spec = SpecConfig(k=0)
    elif args.k == 0:
      raise ValueError(f"k must be in [1, {MAX_K}] or 'auto' for --method {args.method} (use --method none "
                       "for target-only decoding)")
    else:
      spec = SpecConfig(k=args.k)
  except ValueError as e:
    raise CliError(str(e)) from None
  try:
    mesh = mesh_from_args(args)
  except ValueError as e:
    raise CliError(str(e)) from None
  target, tok, proposers, chat = _load_models(args, (args.method,))

  import specjax

  prompt, eos = [args.prompt], args.eos
  if args.chat:
    if chat is None:
      raise CliError("--chat needs a model with a chat template (a GGUF file's tokenizer.chat_template, or "
                     "tokenizer_config.json / chat_template.jinja beside a checkpoint); this model has none")
    try:
      prompt = [chat.encode(tok, [{"role": "user", "content": args.prompt}])]
    except ValueError as e:
      raise CliError(str(e)) from None
    eos = list(dict.fromkeys([*chat.stop_ids(tok), *(args.eos or [])]))
  start = time.perf_counter()
  try:
    out = specjax.generate(target, prompt * args.batch, proposer=proposers.get(args.method), spec=spec,
                           sampling=sampling, max_new_tokens=args.max_new_tokens, seed=args.seed, tokenizer=tok,
                           eos_id=eos, mesh=mesh)
  except ValueError as e:
    raise CliError(str(e)) from None
  from specjax import distributed

  if not distributed.is_primary():  # every process ran the program; one prints
    return 0
  seconds = time.perf_counter() - start
  if args.json:
    print(json.dumps({
        "text": out.text[0],
        "tokens": out.rows()[0],
        "stats": out.stats.to_dict(),
        "method": args.method,
        "proposer": proposers[args.method].describe() if args.method in proposers else None,
        "k": out.stats.k,
        "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p},
        "seconds_including_compile": seconds,
    }))
  else:
    s = out.stats
    print(out.text[0] if args.chat else args.prompt + out.text[0])
    rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.3f}"
    by_position = ", ".join("-" if a is None else f"{a:.2f}" for a in s.acceptance_by_position)
    print(f"[{args.method} k={out.stats.k}] {s.new_tokens} tokens in {s.rounds} rounds, acceptance rate "
          f"{rate}, tau {s.mean_accepted_length:.2f}" + (f" (by position {by_position})" if by_position else "")
          + f", {seconds:.2f}s including compilation", file=sys.stderr)
  return 0


def mesh_from_args(args):
  """The device mesh of ``--mesh`` (after ``--distributed`` joined the processes), or None.

  Raises:
    ValueError: naming the ``--mesh`` text or the device count it does not fit.
  """
  from specjax import distributed, sharding

  if args.distributed:
    distributed.initialize()
  return None if args.mesh is None else sharding.make_mesh(sharding.parse_mesh(args.mesh))


def add_mesh_args(p: argparse.ArgumentParser) -> None:
  """``--mesh`` and ``--distributed`` (generate and every training command)."""
  p.add_argument("--mesh", metavar="data=D,model=M",
                 help="run on a device mesh: the batch split over data, tensor parallelism over model (a missing "
                      "axis takes the remaining devices / size 1; default: one device)")
  p.add_argument("--distributed", action="store_true",
                 help="join a multi-host run first (jax.distributed.initialize: Cloud TPU slices need nothing "
                      "else; GPU hosts read the cluster's environment)")


def _cmd_serve(args) -> int:
  import logging
  import os

  import prometheus_client

  from specjax.serving import server as serving

  method = args.method or ("none" if args.target and not args.draft else "draft")
  if (args.ngram_max is not None or args.ngram_min is not None) and method != "ngram":
    raise CliError(f"--ngram-max/--ngram-min apply only to --method ngram, not {method}")
  if method == "none" and args.k not in ("auto", 0):
    raise CliError(f"--k {args.k} needs a proposer: pick --method draft, ngram, medusa, eagle or mtp")
  if method != "none" and args.k == 0:
    raise CliError(f"--k 0 with --method {method} would run the proposer for nothing: use --method none")
  for name, low in (("port", 0), ("slots", 1), ("max_queue", 0)):
    if getattr(args, name) < low:
      raise CliError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
  if not args.grace > 0:
    raise CliError(f"--grace must be > 0 seconds, got {args.grace}")
  if args.widths is not None and (max(args.widths) != args.slots or min(args.widths) < 1):
    raise CliError(f"--widths must be batch sizes in [1, --slots {args.slots}] including {args.slots}, "
                   f"got {','.join(map(str, args.widths))}")
  handler = logging.StreamHandler()
  handler.setFormatter(logging.Formatter("specjax serve: %(message)s"))
  logger = logging.getLogger("specjax.serve")
  logger.addHandler(handler)
  logger.setLevel(args.log_level.upper())
  prometheus_client.disable_created_metrics()  # this process serves: no *_created series
  target, tok, proposers, chat = _load_models(args, (method,))
  if args.chat_template:
    from specjax.chat import ChatFormat, ChatTemplateError

    try:
      with open(args.chat_template, encoding="utf-8") as f:
        chat = ChatFormat.create(f.read(), tok)
    except OSError as e:
      raise CliError(f"--chat-template {args.chat_template}: {e.strerror}") from None
    except ChatTemplateError as e:
      raise CliError(f"--chat-template {args.chat_template}: {e}") from None
  name = args.model_name or (os.path.basename(os.path.normpath(args.target)) if args.target
                             else "random-init" if args.random_init else DEFAULT_PAIR)
  max_len = args.max_len or min(512, target.cfg.max_seq_len)
  try:
    server = serving.build_server(target, tok, proposers.get(method), chat, name=name, slots=args.slots,
                                  max_len=max_len, k=args.k, ks=args.ks, widths=args.widths,
                                  max_queue=args.max_queue, warm_up=not args.no_warmup)
  except ValueError as e:
    raise CliError(str(e)) from None
  logging.getLogger("specjax.serve").info("serving %r (method %s) on http://%s:%d", name, method, args.host,
                                          args.port)
  serving.run(server, host=args.host, port=args.port, grace=args.grace, log_level=args.log_level)
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
  target, tok, proposers, chat = _load_models(args, settings.methods)
  prompts = bench.DEFAULT_PROMPTS if args.prompts is None else _read_prompts(args.prompts)
  if args.chat and chat is None:
    raise CliError("bench --chat needs a model with a chat template")
  rows = [chat.encode(tok, [{"role": "user", "content": p}]) if args.chat else tok.encode(p) for p in prompts]
  report = bench.run(target, proposers, rows, settings, progress=not args.no_progress)
  paths = bench.write(report, args.out)
  print(bench.markdown(report))
  print("wrote " + ", ".join(paths), file=sys.stderr)
  return 0


def _read_prompts(path: str) -> list[str]:
  """Prompts from a file: JSONL records with a ``prompt`` (or ``text``) field, or one prompt per line."""
  import pathlib

  try:
    lines = [line for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
  except OSError as e:
    raise CliError(f"--prompts {path}: {e.strerror}") from None
  if not lines:
    raise CliError(f"--prompts {path}: the file holds no prompt")
  if path.endswith(".jsonl"):
    try:
      records = [json.loads(line) for line in lines]
    except json.JSONDecodeError as e:
      raise CliError(f"--prompts {path}: not valid JSONL ({e.msg})") from None
    if not all(isinstance(r, dict) and isinstance(r.get("prompt", r.get("text")), str) for r in records):
      raise CliError(f'--prompts {path}: every record needs a string "prompt" (or "text") field')
    return [r.get("prompt", r.get("text")) for r in records]
  return lines


def _add_model_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--target", help="target model: a Hugging Face checkpoint directory or a bundled name")
  p.add_argument("--draft", help="draft model directory (same tokenizer as the target)")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                 help="parameter dtype when loading (default: float32)")
  p.add_argument("--heads", action="append", metavar="DIR",
                 help="a head set saved by specjax (Medusa, EAGLE or MTP) for --method medusa|eagle|mtp; repeatable")
  p.add_argument("--random-init", action="store_true",
                 help="use small randomly initialised models and heads (smoke tests only)")
  p.add_argument("--random-heads", action="store_true",
                 help="randomly initialised heads on the chosen target (exact, but they rarely propose well)")
  p.add_argument("--eagle-variant", type=int, choices=(1, 3), default=3,
                 help="random EAGLE heads: EAGLE-1 or EAGLE-3 (default: 3)")
  p.add_argument("--mtp-depth", type=int, default=1, help="random MTP heads: number of modules (default: 1)")


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="specjax", description="Speculative decoding for JAX/Flax language models.")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  gen = sub.add_parser("generate", help="generate text from a prompt")
  gen.add_argument("--prompt", required=True, help="the prompt text")
  gen.add_argument("--method", choices=METHODS, default="draft",
                   help="proposer: a draft model, ngram (prompt lookup, no model), heads on the target (medusa, "
                        "eagle, mtp) or none (default: draft)")
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
  gen.add_argument("--eos", type=int, action="append", metavar="ID",
                   help="a token id that ends generation (repeatable; default: the tokenizer's EOS)")
  gen.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user turn with the model's chat template; stop at its end of turn")
  gen.add_argument("--batch", type=int, default=1,
                   help="generate for this many copies of the prompt at once (a multiple of the mesh's data axis)")
  _add_model_args(gen)
  add_mesh_args(gen)
  gen.set_defaults(func=_cmd_generate)

  b = sub.add_parser("bench", help="baseline against speculation, with the calibrated cost model")
  b.add_argument("--quick", action="store_true", help="a small sweep (greedy; batch 1,4; k 2,4; 32 tokens; 3 repeats)")
  b.add_argument("--batch-sizes", type=_int_list, help="comma-separated (default: 1,2,4,8,16)")
  b.add_argument("--ks", type=_int_list, help="comma-separated speculation lengths (default: 1,2,3,4,6,8)")
  b.add_argument("--samplings", help="comma-separated: greedy, sample (temperature 1), t<temperature> such as t0.7 "
                                     "(default: greedy,sample)")
  b.add_argument("--prompts", help="a prompt file (JSONL with 'prompt' fields, or one per line); default: code openings")
  b.add_argument("--chat", action="store_true", help="wrap each prompt as one user turn with the chat template")
  b.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS[1:])} (default: draft,ngram)")
  b.add_argument("--max-new-tokens", type=int, help="tokens per row (default: 64)")
  b.add_argument("--repeats", type=int, help="timed repeats per configuration (default: 5)")
  b.add_argument("--out", default="bench-results", help="output folder (default: bench-results)")
  b.add_argument("--no-progress", action="store_true", help="no progress bar")
  _add_model_args(b)
  b.set_defaults(func=_cmd_bench)

  sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: continuous batching, speculation per step")
  sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
  sv.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
  sv.add_argument("--method", choices=METHODS,
                  help="proposer (default: draft, or none with --target and no --draft)")
  sv.add_argument("--k", type=_k_arg, default="auto",
                  help="speculation length, or 'auto': chosen per step among --ks by the cost policy (default)")
  sv.add_argument("--ks", type=_int_list, default=(0, 1, 2, 4),
                  help="the speculation lengths --k auto chooses among (default: 0,1,2,4)")
  sv.add_argument("--slots", type=int, default=8, help="decode slots: requests served at once (default: 8)")
  sv.add_argument("--widths", type=_int_list,
                  help="batch sizes a step may run at, the smallest holding the live requests (default: the powers "
                       "of two below --slots, and --slots)")
  sv.add_argument("--chat-template", metavar="FILE",
                  help="a Jinja2 chat template for /v1/chat/completions (default: the model's own, if any)")
  sv.add_argument("--max-len", type=int,
                  help="positions per slot, prompt + max_tokens + k (default: 512 or the model's max_seq_len)")
  sv.add_argument("--max-queue", type=int, default=64,
                  help="requests that may wait for a slot; more get 503 (default: 64)")
  sv.add_argument("--model-name", help="the model id of the API (default: the model's name)")
  sv.add_argument("--grace", type=float, default=30.0,
                  help="seconds running requests may take to finish on SIGTERM (default: 30)")
  sv.add_argument("--no-warmup", action="store_true", help="compile on first use instead of at start-up")
  sv.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info")
  sv.add_argument("--ngram-max", type=int, help="--method ngram: longest n-gram looked up")
  sv.add_argument("--ngram-min", type=int, help="--method ngram: shortest n-gram looked up")
  _add_model_args(sv)
  sv.set_defaults(func=_cmd_serve)

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
