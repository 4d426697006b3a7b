"""The ``specjax`` command line.

Bad arguments exit with status 2 and one line on stderr (``specjax: error: ...``), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

from specjax.config import MAX_K, MAX_LOGPROBS, SamplingConfig, SpecConfig
from specjax.loading import DTYPES
from specjax.models.heads import KINDS
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
  """Randomly initialised heads of ``method`` (one of ``HEAD_METHODS``) for ``target`` (``--random-init`` /
  ``--random-heads``), of the method's head kind (``eagle``: ``--eagle-variant`` picks eagle1 or eagle3)."""
  from specjax.models.heads import build_heads

  kind = method if method in KINDS else f"{method}{args.eagle_variant}"
  if method == "medusa":
    k = args.k if isinstance(getattr(args, "k", None), int) else 0
    return build_heads(kind, target.cfg, num_heads=max(4, k, max(getattr(args, "ks", None) or (0,))))
  if method == "mtp":
    return build_heads(kind, target.cfg, num_heads=args.mtp_depth)
  return build_heads(kind, target.cfg)


def _quant_group(args) -> int | None | str:
  """``--quant-group`` as :func:`specjax.load`'s ``quant_group``: ``"default"``, ``"channel"`` (None) or an integer
  (even for int4); only with ``--dtype int8|int4``."""
  text = getattr(args, "quant_group", "default")
  if text == "default":
    return "default"
  if args.dtype not in ("int8", "int4"):
    raise CliError(f"argument --quant-group: applies to --dtype int8 or int4 only, got --dtype {args.dtype}")
  group = None if text == "channel" else int(text) if text.isdigit() else text
  if group is not None and not (isinstance(group, int) and group >= 1 and (args.dtype == "int8" or group % 2 == 0)):
    raise CliError(f"argument --quant-group: must be {'an even' if args.dtype == 'int4' else 'an'} integer >= 1, "
                   f"'channel' or 'default' for --dtype {args.dtype}, got {text!r}")
  return group


def _load_models(args, methods: tuple[str, ...]):
  """(target, tokenizer, {method: proposer}, chat format or None) from --random-init, --target/--draft/--heads,
  or the bundled pair; one proposer per requested method ("none" needs none)."""
  from specjax import proposers
  from specjax.loading import PRETRAINED, load

  if args.draft and "draft" not in methods and "combined" not in methods:
    raise CliError(f"--draft is used only by --method draft (or combined), not {','.join(methods)}")
  _check_method_options(args, methods)
  if args.random_init and (args.target or args.draft or args.heads):
    raise CliError("--random-init cannot be combined with --target/--draft/--heads")
  quantized = args.dtype in ("int8", "int4")  # weight-only: loaded in float32, then quantized
  float_dtype = "float32" if quantized or args.dtype == "mixed" else args.dtype
  group = _quant_group(args)
  try:
    draft, heads, chat, pard = None, {}, None, None
    if args.random_init:
      target, draft, tok = _random_pair(float_dtype)
    elif args.target:
      if "draft" in methods and not args.draft:
        raise CliError("--method draft with --target needs --draft DIR (or use --method none)")
      if args.draft:
        from specjax.chat import hf_chat_format
        from specjax.hf import load_hf_pair

        target, draft, tok = load_hf_pair(args.target, args.draft, dtype=float_dtype)
        chat = hf_chat_format(args.target, tok)
      else:
        loaded = load(args.target, dtype=args.dtype, quant_group=group)
        target, tok, heads, chat, pard = (loaded.model, loaded.tokenizer, dict(loaded.heads), loaded.chat,
                                          getattr(loaded, "pard", None))
    else:
      if args.draft:
        raise CliError("--draft needs --target")
      if DEFAULT_PAIR not in PRETRAINED:
        raise CliError(f"the default model pair {DEFAULT_PAIR!r} is not bundled with this install: pass "
                       "--target DIR --draft DIR, or --random-init for small random models (smoke tests only)")
      loaded = load(DEFAULT_PAIR, dtype=args.dtype, quant_group=group)
      target, tok, draft, heads, chat = loaded.model, loaded.tokenizer, loaded.draft, dict(loaded.heads), loaded.chat
      pard = getattr(loaded, "pard", None)
    for directory in args.heads or ():
      from specjax.head_formats import load_head_dir

      loaded_heads = load_head_dir(directory, target.cfg, float_dtype)
      heads[proposers.for_heads(loaded_heads).name] = loaded_heads
    if quantized:  # a no-op on what specjax.load quantized already
      from specjax.quant import quantize

      q = lambda m: None if m is None else quantize(m, args.dtype, group)
      target, draft, pard, heads = q(target), q(draft), q(pard), {name: q(h) for name, h in heads.items()}
    if args.dtype == "mixed" and getattr(target.cfg, "matmul_dtype", None) is None:  # what load did not convert
      from specjax.loading import mixed_precision

      try:
        target = mixed_precision(target)
      except ValueError as e:
        raise CliError(f"argument --dtype: {e}") from e
    def build(method: str):
      if method == "draft":
        if draft is None:
          raise CliError("--method draft needs a draft model: pass --target DIR --draft DIR, or use the bundled pair")
        return proposers.DraftModel(draft)
      if method == "pard":
        if pard is None:
          source = "the bundled pair ships" if not args.target else "--target has"
          raise CliError(f"--method pard needs a parallel draft and {source} none (train one with specjax train "
                         "draft --parallel and ship it under specjax/assets/<name>/pard/)")
        return proposers.ParallelDraft(pard)
      if method == "ngram":
        options = {f"n_{x}": getattr(args, f"ngram_{x}") for x in ("max", "min")
                   if getattr(args, f"ngram_{x}", None) is not None}
        return proposers.NGram(**options)
      if method == "suffix":
        return proposers.Suffix(store=_suffix_store(args, tok, target.cfg.vocab_size))
      if method == "combined":
        members = _combined_members(args, heads, draft)
        if getattr(args, "cutoff", None) is not None and not {"eagle", "mtp"} & set(members):
          raise CliError(f"--cutoff applies to eagle or mtp members of --method combined; its members "
                         f"{','.join(members)} hold neither")
        scored = [m == "suffix" for m in members]
        return proposers.Combined(tuple(build(m) for m in members),
                                  expected=tuple(None if sc else args.expected for sc in scored),
                                  ks=tuple(None if sc else getattr(args, "member_k", None) for sc in scored))
      cutoff = getattr(args, "cutoff", None)
      options = {"cutoff": cutoff} if cutoff is not None and method in ("eagle", "mtp") else {}
      if method in heads and not args.random_heads:
        return proposers.for_heads(heads[method], **options)
      if args.random_init or args.random_heads:
        return proposers.for_heads(_random_heads(method, target, args), **options)
      source = "the bundled pair ships" if not args.target else "--target has"
      raise CliError(f"--method {method} needs trained heads and {source} none: pass --heads DIR, or "
                     "--random-heads for randomly initialised heads (exact, but they rarely propose well)")

    out = {method: build(method) for method in methods if method != "none"}
    return target, tok, out, chat
  except (ValueError, OSError) as e:
    raise CliError(str(e)) from None


def _check_method_options(args, methods) -> None:
  """Options that belong to a method the run does not use are refused by name."""
  uses = set(methods)
  if "combined" in uses:
    uses |= {"suffix", "ngram"}
  for flag, attr, owners in (("--store", "store", {"suffix"}), ("--store-capacity", "store_capacity", {"suffix"}),
                             ("--members", "members", {"combined"}), ("--member-k", "member_k", {"combined"})):
    if getattr(args, attr, None) is not None and not uses & owners:
      raise CliError(f"{flag} applies only to --method {' or '.join(sorted(owners | {'combined'}))}, "
                     f"not {','.join(methods)}")
  if getattr(args, "store_capacity", None) is not None and args.store_capacity not in (0,) and args.store_capacity < 2:
    raise CliError(f"--store-capacity must be 0 (no global store: per-request matching only) or an integer >= 2 "
                   f"(tokens), got {args.store_capacity}")
  if getattr(args, "member_k", None) is not None and not 1 <= args.member_k <= MAX_K:
    raise CliError(f"--member-k must be an integer in [1, {MAX_K}], got {args.member_k}")


def _suffix_store(args, tok, vocab_size: int):
  """The global store of ``--store FILE`` documents (None without any), of ``--store-capacity`` tokens."""
  from specjax.proposers import SuffixStore

  store_args = getattr(args, "store", None) or ()
  if not store_args and not getattr(args, "store_always", False):
    return None
  capacity = getattr(args, "store_capacity", None)
  if capacity == 0:  # per-request matching only
    if store_args:
      raise CliError("--store-capacity 0 keeps no global store, so --store has nowhere to go")
    return None
  store = SuffixStore(vocab_size, capacity or SuffixStore.DEFAULT_CAPACITY)
  for path in store_args:
    store.extend(tok.encode(text) for text in _documents(path))
  return store


def _documents(path: str) -> list[str]:
  """A ``--store`` file's documents: one per JSON line (its ``text``, ``completion`` or ``response`` field) for
  ``.jsonl``, else the whole file."""
  try:
    raw = pathlib.Path(path).read_text(encoding="utf-8")
  except OSError as e:
    raise CliError(f"--store {path}: {e.strerror or e}") from None
  if not path.endswith(".jsonl"):
    return [raw]
  docs = []
  for i, line in enumerate(raw.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise CliError(f"--store {path}: line {i} is not JSON ({e.msg})") from None
    text = next((record[f] for f in ("text", "completion", "response") if isinstance(record, dict) and f in record),
                None)
    if not isinstance(text, str):
      raise CliError(f"--store {path}: line {i} needs a string field 'text', 'completion' or 'response'")
    docs.append(text)
  return docs


def _combined_members(args, heads: dict, draft) -> list[str]:
  """``--members`` as method names, or the default: suffix decoding and the target's shipped head (EAGLE first),
  else suffix decoding and the draft model."""
  from specjax.proposers import PROPOSERS

  if getattr(args, "members", None):
    members = [m.strip() for m in args.members.split(",") if m.strip()]
    allowed = sorted(set(PROPOSERS) - {"combined"})
    bad = [m for m in members if m not in allowed]
    if bad or len(members) < 2 or len(set(members)) != len(members):
      raise CliError(f"--members must name two or more distinct methods among {','.join(allowed)}, got {args.members!r}")
    return members
  for method in ("eagle", "mtp", "medusa"):
    if method in heads:
      return ["suffix", method]
  if draft is not None:
    return ["suffix", "draft"]
  return ["suffix", "ngram"]


# The bundled pair's 6 M target repeats itself under plain greedy decoding ("def _get_get_get..."), and its
# sampled text is noise; greedy with this penalty reads like code and stays exact (README, "Quick start").
BUNDLED_REPETITION_PENALTY = 1.2
# SamplingConfig field -> the generate flag that sets it, to name the flag in a bad value's message.
SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                  "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
                  "repetition_penalty": "--repetition-penalty", "logit_bias": "--logit-bias"}


def _logit_bias_arg(text: str) -> tuple[int, float]:
  token, sep, bias = text.partition("=")
  try:
    if not sep:
      raise ValueError
    return int(token), float(bias)
  except ValueError:
    raise argparse.ArgumentTypeError(f"invalid value {text!r}: TOKEN=BIAS, a token id and a bias in "
                                     "[-100, 100] (for example 13=-100 bans token 13)") from None


def _sampling_from_args(args) -> SamplingConfig:
  """The SamplingConfig of the generate flags; a bad value is a CliError naming its flag."""
  values = {field: getattr(args, field) for field in SAMPLING_FLAGS}
  if values["repetition_penalty"] is None:  # the default: on for the bundled pair only
    values["repetition_penalty"] = 1.0 if args.target or args.random_init else BUNDLED_REPETITION_PENALTY
  values["logit_bias"] = tuple(values["logit_bias"] or ())
  for field, flag in SAMPLING_FLAGS.items():  # one field at a time, so the message can name the flag
    try:
      SamplingConfig(**{field: values[field]})
    except ValueError as e:
      raise CliError(f"argument {flag}: {e}") from None
  try:
    return SamplingConfig(**values)
  except ValueError as e:
    raise CliError(str(e)) from None


def _token_pieces(tok, ids: list[int], context: list[int] = ()) -> list[str]:
  """The text each of ``ids`` adds after ``context``, from decodes of growing prefixes.

  A byte-level token that stops inside a UTF-8 character adds "" and the token that completes it adds the
  character, so the pieces join to the decoded text.
  """
  pieces, shown = [], tok.decode(list(context))
  for i in range(len(ids)):
    text = tok.decode([*context, *ids[:i + 1]])
    if text.endswith("\ufffd") and i + 1 < len(ids):  # an incomplete character: the next token completes it
      pieces.append("")
      continue
    pieces.append(text[len(shown):])
    shown = text
  return pieces


def _marked(pieces: list[str], proposed, colour: bool) -> str:
  """``pieces`` with runs of accepted proposals marked: green on a terminal, else between ⟦ and ⟧."""
  start, end = ("\x1b[32m", "\x1b[0m") if colour else ("⟦", "⟧")
  out, inside = [], False
  for piece, accepted in zip(pieces, proposed):
    if not piece:
      continue
    if bool(accepted) != inside:
      out.append(start if accepted else end)
      inside = bool(accepted)
    out.append(piece)
  return "".join(out) + (end if inside else "")


def _logprob_rows(out, tok, row: list[int], context: list[int]) -> list[dict] | None:
  """Per emitted token of row 0: its text, log-probability and the top alternatives; None without them."""
  logprobs, top_ids, top_logprobs = (getattr(out, name, None) for name in ("logprobs", "top_ids", "top_logprobs"))
  if logprobs is None:
    return None
  pieces, rows = _token_pieces(tok, row, context), []
  for i, (token, piece) in enumerate(zip(row, pieces)):
    top = []
    if top_ids is not None and top_logprobs is not None:
      top = [{"id": int(t), "text": _token_pieces(tok, [int(t)], [*context, *row[:i]])[0], "logprob": float(lp)}
             for t, lp in zip(top_ids[0, i], top_logprobs[0, i])]
    rows.append({"id": int(token), "text": piece, "logprob": float(logprobs[0, i]), "top": top})
  return rows


def _timed(call, repeats: int):
  """(first output, seconds of the first call: it compiles, median seconds of ``repeats`` warm calls)."""
  import statistics

  import jax

  start = time.perf_counter()
  out = call()
  jax.block_until_ready((out.tokens, out.lengths))  # numpy already; the clock reads after the device is done
  first = time.perf_counter() - start
  warm = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready((call().tokens,))
    warm.append(time.perf_counter() - start)
  return out, first, statistics.median(warm) if warm else None


def _first_difference(rows: list[list[int]], others: list[list[int]]) -> list[int] | None:
  """[row, token index] of the first token where ``rows`` and ``others`` differ; None where they are equal."""
  for b, (row, other) in enumerate(zip(rows, others)):
    if row != other:
      return [b, next((i for i, (x, y) in enumerate(zip(row, other)) if x != y), min(len(row), len(other)))]
  return None


def _compare_lines(cmp: dict, head: str, dtype: str) -> list[str]:
  """The comparison's report lines (stderr); ``head`` is printed before the target alone's text."""
  lines = []
  if cmp["identical"]:
    lines.append(f"target alone: the same {len(cmp['baseline_tokens'])} tokens, token for token ("
                 + ("greedy speculative decoding is exact)" if cmp["greedy"] else
                    "sampled: the law is the same, and here so are the draws)"))
  elif cmp["greedy"]:
    row, token = cmp["first_difference"]
    lines.append(f"target alone: DIFFERS from row {row}'s token {token} on; greedy speculative decoding "
                 "should equal it token for token" + ("" if dtype == "float32" else
                                                      f" (in {dtype} a near-tie can flip a token)") + ":")
    lines.append(head + cmp["baseline_text"])
  else:
    lines.append("target alone, same seed (sampled: the law is the same, the draws differ, because speculation "
                 "spends random numbers differently):")
    lines.append(head + cmp["baseline_text"])
  lines.append(f"speedup {cmp['speedup']:.2f}x with tau {cmp['tau']:.2f}: {cmp['seconds']:.3f}s against "
               f"{cmp['baseline_seconds']:.3f}s for the target alone (median of {cmp['repeats']} warm calls each; "
               f"compilation apart: {cmp['compile_seconds']:.2f}s and {cmp['baseline_compile_seconds']:.2f}s)")
  return lines


def _cmd_generate(args) -> int:
  import inspect
  import os

  if args.prompt == "":
    raise CliError("argument --prompt: must not be empty")
  if args.batch < 1:
    raise CliError(f"argument --batch: must be an integer >= 1, got {args.batch}")
  if args.repeats < 1:
    raise CliError(f"argument --repeats: must be an integer >= 1, got {args.repeats}")
  if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
    raise CliError(f"argument --logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {args.logprobs}")
  if (args.ngram_max is not None or args.ngram_min is not None) and args.method != "ngram":
    if args.method != "combined":
      raise CliError(f"--ngram-max/--ngram-min apply only to --method ngram, not {args.method}")
  _check_cutoff(args, args.method)
  sampling = _sampling_from_args(args)
  try:
    if args.method == "none":
      spec = SpecConfig(k=0)
    elif args.k == 0:
      raise ValueError(f"k must be in [1, {MAX_K}] or 'auto' for --method {args.method} (use --method none "
                       "for target-only decoding)")
    elif args.tree == "auto":  # the cost model chooses among chains, trees and the target alone
      spec = SpecConfig(k="auto", tree="auto", invariant=args.invariant)
    elif args.tree is not None:
      spec = SpecConfig(tree=args.tree, invariant=args.invariant)
    else:
      spec = SpecConfig(k=args.k, invariant=args.invariant)
  except ValueError as e:
    raise CliError(str(e)) from None
  if args.pilot_prompts is not None and not spec.auto:
    raise CliError("--pilot-prompts are what --k auto (or --tree auto) measures acceptance on: they need one of "
                   f"those, got --method {args.method} --k {args.k}" + (f" --tree {args.tree}" if args.tree else ""))
  pilot_texts = read_prompts(args.pilot_prompts, flag="--pilot-prompts") if args.pilot_prompts else None
  try:
    mesh = mesh_from_args(args)
  except ValueError as e:
    raise CliError(str(e)) from None
  target, tok, proposers, chat = _load_models(args, (args.method,))
  try:
    sampling.check_vocab(target.cfg.vocab_size)
  except ValueError as e:
    raise CliError(f"argument --logit-bias: {e}") from None

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
  if pilot_texts:  # encoded as the prompt is (through the chat template with --chat)
    try:
      pilot = [chat.encode(tok, [{"role": "user", "content": t}]) if args.chat else tok.encode(t)
               for t in pilot_texts]
      spec = dataclasses.replace(spec, pilot_prompts=pilot)
    except ValueError as e:
      raise CliError(f"--pilot-prompts {args.pilot_prompts}: {e}") from None
  notes = []
  extra = {}
  if args.logprobs is not None:
    if "logprobs" in inspect.signature(specjax.generate).parameters:
      extra["logprobs"] = args.logprobs
    else:
      notes.append("--logprobs is unavailable: this specjax.generate returns no log-probabilities yet")

  def run(proposer, spec):
    return specjax.generate(target, prompt * args.batch, proposer=proposer, spec=spec, sampling=sampling,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, tokenizer=tok, eos_id=eos, mesh=mesh,
                            **extra)

  compare = not args.no_compare and args.method != "none"
  try:  # every process runs the same programs, in the same order (multi-host); one prints
    out, first, warm = _timed(lambda: run(proposers.get(args.method), spec), args.repeats if compare else 0)
    cmp = None
    if compare:
      base, base_first, base_warm = _timed(lambda: run(None, SpecConfig(k=0)), args.repeats)
      rows, base_rows = out.rows(), base.rows()
      cmp = {
          "baseline_text": base.text[0],
          "baseline_tokens": base_rows[0],
          "identical": rows == base_rows,
          "first_difference": _first_difference(rows, base_rows),  # [row, token] or None
          "greedy": sampling.greedy,
          "same_law": True,  # speculative decoding is exact for every proposer and sampling setting
          "tau": out.stats.mean_accepted_length,
          "speedup": base_warm / warm,
          "seconds": warm,
          "baseline_seconds": base_warm,
          "compile_seconds": max(first - warm, 0.0),  # the first call compiles; the rest of it is one run
          "baseline_compile_seconds": max(base_first - base_warm, 0.0),
          "repeats": args.repeats,
      }
  except ValueError as e:
    raise CliError(str(e)) from None
  from specjax import distributed

  if not distributed.is_primary():
    return 0
  context = list(prompt[0]) if args.chat else tok.encode(args.prompt)
  row = out.rows()[0]
  proposed = getattr(out, "proposed", None)
  logprob_rows = _logprob_rows(out, tok, row, context) if "logprobs" in extra else None
  if "logprobs" in extra and logprob_rows is None:
    notes.append("--logprobs is unavailable: this specjax.generate returned no log-probabilities")
  if args.json:
    print(json.dumps({
        "text": out.text[0],
        "tokens": row,
        "stats": out.stats.to_dict(),
        "method": args.method,
        "proposer": proposers[args.method].describe() if args.method in proposers else None,
        "k": out.stats.k,
        "sampling": {**{f: getattr(sampling, f) for f in SAMPLING_FLAGS if f != "logit_bias"},
                     "logit_bias": {str(t): b for t, b in sampling.logit_bias}},
        "seconds_including_compile": first,
        "comparison": cmp,
        "proposed": None if proposed is None else [bool(p) for p in proposed[0, :len(row)]],
        "logprobs": logprob_rows,
        "notes": notes,
    }))
    return 0
  head = "" if args.chat else args.prompt
  if args.show_accepted and proposed is not None:
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    print(head + _marked(_token_pieces(tok, row, context), proposed[0, :len(row)], colour))
    notes.append("accepted proposals are " + ("green" if colour else "marked ⟦like this⟧")
                 + "; the rest are the target's own tokens")
  else:
    print(head + out.text[0])
    if args.show_accepted:
      notes.append("--show-accepted is unavailable: this specjax.generate does not report which tokens were "
                   "proposed (GenerateOutput.proposed)")
  shown = lambda text: json.dumps(text, ensure_ascii=False)  # quoted, escapes visible
  if logprob_rows:
    print(f"\n{'#':>4}  {'token':<16}{'logprob':>8}" + (f"  top {args.logprobs}" if args.logprobs else ""))
  for i, r in enumerate(logprob_rows or ()):
    alternatives = "  ".join(f"{shown(a['text'])} {a['logprob']:.3f}" for a in r["top"])
    print(f"{i:>4}  {shown(r['text']):<16}{r['logprob']:8.3f}" + (f"  {alternatives}" if alternatives else ""))
  s = out.stats
  rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.3f}"
  by_position = ", ".join("-" if a is None else f"{a:.2f}" for a in s.acceptance_by_position)
  shape = f"tree {s.tree}" if s.tree else f"k={s.k}"
  by_rank = f", accepted by sibling rank {s.accepted_by_rank}" if s.tree else ""
  report = [f"[{args.method} {shape}] {s.new_tokens} tokens in {s.rounds} rounds, acceptance rate {rate}, tau "
            f"{s.mean_accepted_length:.2f}" + (f" (by {'depth' if s.tree else 'position'} {by_position})"
                                              if by_position else "") + by_rank
            + ("" if compare else f", {first:.2f}s including compilation")]
  report += _compare_lines(cmp, head, args.dtype) if compare else []
  sys.stdout.flush()  # the text first, then the report, also when both streams go to one pipe
  print("\n".join(report + notes), file=sys.stderr)
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


def _check_cutoff(args, method: str) -> None:
  cutoff = args.cutoff
  if cutoff is None:
    return
  if not 0.0 < cutoff <= 1.0:  # (NaN fails too)
    raise CliError(f"argument --cutoff: must be a number in (0, 1], got {cutoff}")
  if method not in ("eagle", "mtp", "combined"):
    raise CliError(f"--cutoff applies to --method eagle or mtp (or their members of --method combined), not {method}")
  if getattr(args, "tree", None):
    raise CliError("--cutoff applies to chains; a --tree grows by the head's confidence already")


def _cmd_serve(args) -> int:
  import logging
  import os

  import prometheus_client

  from specjax.serving import server as serving

  method = args.method or ("none" if args.target and not args.draft else "draft")
  if (args.ngram_max is not None or args.ngram_min is not None) and method != "ngram":
    raise CliError(f"--ngram-max/--ngram-min apply only to --method ngram, not {method}")
  _check_cutoff(args, method)
  if method == "none" and args.k not in ("auto", 0):
    raise CliError(f"--k {args.k} needs a proposer: pick --method draft, ngram, medusa, eagle or mtp")
  if method != "none" and args.k == 0:
    raise CliError(f"--k 0 with --method {method} would run the proposer for nothing: use --method none")
  if args.trees and args.k != "auto":
    raise CliError(f"--trees are candidates of --k auto only: a fixed --k {args.k} steps chains of {args.k} "
                   "(drop --trees, or use --k auto)")
  if args.trees and method in ("none", "ngram", "pard"):
    raise CliError(f"--trees needs a proposer that proposes token trees (--method draft, eagle, mtp or medusa), "
                   f"not --method {method}")
  for name, low in (("port", 0), ("slots", 1), ("max_queue", 0)):
    if getattr(args, name) < low:
      raise CliError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
  if not args.grace > 0:
    raise CliError(f"--grace must be > 0 seconds, got {args.grace}")
  if args.max_n is not None and args.slots >= 1 and args.max_n > args.slots:
    raise CliError(f"--max-n must be in [1, --slots {args.slots}] (the n choices of a request run at once, one slot "
                   f"each), got {args.max_n}")
  api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
  try:
    limits = serving.Limits(api_key=api_key, max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens,
                            max_n=args.max_n, client_timeout=args.client_timeout)
  except ValueError as e:
    flag = {"api_key": "--api-key", "max_body_bytes": "--max-body-bytes", "max_tokens": "--max-tokens",
            "client_timeout": "--client-timeout", "max_n": "--max-n"}
    message = str(e)
    for field, name in flag.items():
      message = message.replace(f"Limits.{field}", name)
    raise CliError(message) from None
  if args.widths is not None and (max(args.widths) != args.slots or min(args.widths) < 1):
    raise CliError(f"--widths must be batch sizes in [1, --slots {args.slots}] including {args.slots}, "
                   f"got {','.join(map(str, args.widths))}")
  if args.rounds_per_step < 1:
    raise CliError(f"--rounds-per-step must be >= 1, got {args.rounds_per_step}")
  if not 1 <= args.first_rounds <= args.rounds_per_step:
    raise CliError(f"--first-rounds must be in [1, --rounds-per-step {args.rounds_per_step}], got {args.first_rounds}")
  if args.refill_rounds < 0:
    raise CliError(f"--refill-rounds must be >= 0 (0: off), got {args.refill_rounds}")
  if not 0 < args.refill_share <= 1:
    raise CliError(f"--refill-share must be a fraction in (0, 1], got {args.refill_share}")
  if args.max_rounds_per_step is not None and args.max_rounds_per_step < args.rounds_per_step:
    raise CliError(f"--max-rounds-per-step must be >= --rounds-per-step {args.rounds_per_step}, got "
                   f"{args.max_rounds_per_step}")
  if not 0 < args.call_overhead <= 1:
    raise CliError(f"--call-overhead must be a fraction in (0, 1], got {args.call_overhead}")
  if not args.max_call_ms > 0:
    raise CliError(f"--max-call-ms must be a number of milliseconds > 0, got {args.max_call_ms}")
  handler = logging.StreamHandler()
  handler.setFormatter(logging.Formatter("specjax serve: %(message)s"))
  logger = logging.getLogger("specjax.serve")
  logger.addHandler(handler)
  logger.setLevel(args.log_level.upper())
  prometheus_client.disable_created_metrics()  # this process serves: no *_created series
  args.store_always = True  # a server's suffix decoding keeps a global store of its finished requests' outputs
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
                                  max_len=max_len, k=args.k, ks=args.ks, trees=args.trees or (), widths=args.widths,
                                  max_queue=args.max_queue, warm_up=not args.no_warmup, limits=limits,
                                  rounds=args.rounds_per_step, buckets=args.attention_buckets,
                                  prefill_chunk=args.prefill_chunk or None, first_rounds=args.first_rounds,
                                  greedy_steps=not args.no_greedy_steps,
                                  defer_greedy=not args.greedy_steps_at_start, interruptible=args.interrupt_calls,
                                  max_rounds=max(args.rounds_per_step, args.max_rounds_per_step or 32),
                                  call_overhead=args.call_overhead, max_call_seconds=args.max_call_ms / 1e3,
                                  refill_rounds=args.refill_rounds or None, refill_share=args.refill_share,
                                  bucket_cache=args.bucket_cache, launch_ahead=args.launch_ahead,
                                  prompt_cache=args.prompt_cache, prompt_buckets=args.prompt_buckets)
  except ValueError as e:
    raise CliError(str(e)) from None
  logging.getLogger("specjax.serve").info("serving %r (method %s) on http://%s:%d%s", name, method, args.host,
                                          args.port, " (API key required)" if api_key else "")
  serving.run(server, host=args.host, port=args.port, grace=args.grace, log_level=args.log_level)
  return 0


API_KEY_ENV = "SPECJAX_API_KEY"


def _int_list(text: str) -> tuple[int, ...]:
  try:
    values = tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"invalid value {text!r}: a comma-separated list of integers") from None
  if not values:
    raise argparse.ArgumentTypeError("invalid value: an empty list")
  return values


TREE_FORMS = ("'dynamic', 'dynamic:K,D,N' or a shape such as '4-2-2-1', '4-2-2-1/16' (pruned to 16 nodes) or "
              "'4-2:sample' (also ':sample_distinct')")


def _tree_list(text: str) -> tuple:
  """``--trees``: semicolon-separated tree specs, each read by :func:`specjax.tree.parse_tree`."""
  from specjax.tree import parse_tree

  parts = [part.strip() for part in text.split(";")]
  if not any(parts):
    raise argparse.ArgumentTypeError(f"invalid value {text!r}: semicolon-separated trees, each {TREE_FORMS}")
  specs = []
  for part in parts:
    if not part:
      continue
    try:
      specs.append(parse_tree(part))
    except ValueError as e:
      detail = "" if str(e).startswith("--tree") else f" ({e})"
      raise argparse.ArgumentTypeError(f"invalid tree {part!r}{detail}: each of the semicolon-separated trees is "
                                       f"{TREE_FORMS}") from None
  return tuple(specs)


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
  prompts = bench.DEFAULT_PROMPTS if args.prompts is None else read_prompts(args.prompts)
  if args.chat and chat is None:
    raise CliError("bench --chat needs a model with a chat template")
  encode = lambda p: chat.encode(tok, [{"role": "user", "content": p}]) if args.chat else tok.encode(p)
  rows = [encode(p) for p in prompts]
  if args.pilot_prompts is not None:  # encoded as the prompts are
    try:
      settings = dataclasses.replace(
          settings, pilot_prompts=[encode(p) for p in read_prompts(args.pilot_prompts, flag="--pilot-prompts")])
    except ValueError as e:
      raise CliError(f"--pilot-prompts {args.pilot_prompts}: {e}") from None
  report = bench.run(target, proposers, rows, settings, progress=not args.no_progress)
  paths = bench.write(report, args.out)
  print(bench.markdown(report))
  print("wrote " + ", ".join(paths), file=sys.stderr)
  return 0


def read_prompts(path: str, flag: str = "--prompts") -> list[str]:
  """Prompts from a file: JSONL records with a ``prompt`` (or ``text``) field, or one prompt per line. Errors
  name ``flag`` (the option that gave the file) and the file."""
  import pathlib

  try:
    lines = [line for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
  except OSError as e:
    raise CliError(f"{flag} {path}: {e.strerror}") from None
  if not lines:
    raise CliError(f"{flag} {path}: the file holds no prompt")
  if path.endswith(".jsonl"):
    try:
      records = [json.loads(line) for line in lines]
    except json.JSONDecodeError as e:
      raise CliError(f"{flag} {path}: not valid JSONL ({e.msg})") from None
    if not all(isinstance(r, dict) and isinstance(r.get("prompt", r.get("text")), str) for r in records):
      raise CliError(f'{flag} {path}: every record needs a string "prompt" (or "text") field')
    return [r.get("prompt", r.get("text")) for r in records]
  return lines


def _add_model_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--target", help="target model: a Hugging Face checkpoint directory or a bundled name")
  p.add_argument("--draft", help="draft model directory (same tokenizer as the target)")
  p.add_argument("--dtype", choices=DTYPES, default="float32",
                 help="parameter dtype when loading; int8 / int4: weight-only quantization of target and "
                      "proposers, float32 activations; mixed: a Llama-family target with bfloat16 weights and "
                      "weight products, float32 activations, proposers in float32 (default: float32)")
  p.add_argument("--quant-group", default="default", metavar="N|channel|default",
                 help="with --dtype int8/int4: weights per scale along each weight's contracting axis (an integer, "
                      "even for int4), 'channel' (one scale per output channel) or 'default' (int8: channel, int4: "
                      "32); a GGUF file's own Q8_0/Q4 blocks stay groups of 32")
  p.add_argument("--heads", action="append", metavar="DIR",
                 help="a head set for --method medusa|eagle|mtp: a folder saved by specjax (heads.json), or a published "
                      "EAGLE-3/EAGLE-1 head (config.json + safetensors, as vLLM and SGLang load them) or Medusa head "
                      "(config.json + medusa_lm_head.safetensors); checked against the target; repeatable")
  p.add_argument("--random-init", action="store_true",
                 help="use small randomly initialised models and heads (smoke tests only)")
  p.add_argument("--random-heads", action="store_true",
                 help="randomly initialised heads on the chosen target (exact, but they rarely propose well)")
  p.add_argument("--eagle-variant", type=int, choices=(1, 3), default=3,
                 help="random EAGLE heads: EAGLE-1 or EAGLE-3 (default: 3)")
  p.add_argument("--mtp-depth", type=int, default=1, help="random MTP heads: number of modules (default: 1)")
  p.add_argument("--store", action="append", metavar="FILE",
                 help="--method suffix/combined: a document for the global suffix store (a text file, or JSONL with "
                      "a 'text', 'completion' or 'response' field per line); repeatable")
  p.add_argument("--store-capacity", type=int, metavar="TOKENS",
                 help="--method suffix/combined: the global store's size in tokens; the oldest documents are evicted "
                      "first; 0: no global store, each request matches its own context only (default: 65536)")
  p.add_argument("--members", metavar="M1,M2",
                 help="--method combined: the proposers combined per row (default: suffix and the target's shipped "
                      "head, else suffix and the draft model)")
  p.add_argument("--member-k", type=int, metavar="K",
                 help="--method combined: the most proposals a member other than suffix makes per round (a head "
                      "does best at 2 on a CPU); a round verifies only the window its chosen proposals need "
                      "(default: all --k)")
  p.add_argument("--expected", type=float, default=1.0,
                 help="--method combined: the accepted proposals per round credited to each member that does not "
                      "score its own proposals; a row takes the suffix match when its score is higher (default: 1)")


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
  gen.add_argument("--tree",
                   help="propose a token tree each round instead of a chain of --k (draft, medusa, eagle, mtp): "
                        "'dynamic' (EAGLE-2, K=4 D=4 N=16), 'dynamic:K,D,N', a fixed shape such as '4-2-2-1', "
                        "'4-2-2-1/16' (pruned to 16 nodes) or '4-2:sample' (children sampled; also "
                        "':sample_distinct'), explicit rank paths 'paths:0|1|0.0', or 'auto' (the calibrated cost "
                        "model picks a chain, a tree or neither)")
  gen.add_argument("--pilot-prompts", metavar="FILE",
                   help="with --k auto or --tree auto: prompts like the ones you will send (JSONL with 'prompt' "
                        "fields, or one per line, encoded as --prompt is) that the pilot measures acceptance on, "
                        "instead of --prompt alone")
  gen.add_argument("--invariant", action="store_true",
                   help="verify windows position by position (SpecConfig.invariant): greedy output bit for bit the "
                        "target alone's in any dtype, at the cost of one product per window position")
  gen.add_argument("--cutoff", type=float,
                   help="--method eagle or mtp: end a row's proposals where the head's confidence that its chain "
                        "gets that far falls below this, in (0, 1] (ChainHeads.cutoff; the target then verifies a "
                        "shorter window; default: none, k proposals every round)")
  gen.add_argument("--ngram-max", type=int,
                   help=f"--method ngram: longest n-gram looked up, 1..{MAX_NGRAM} (default: 3)")
  gen.add_argument("--ngram-min", type=int, help="--method ngram: shortest n-gram looked up (default: 1)")
  gen.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 is greedy (default: 0)")
  gen.add_argument("--top-k", type=int, default=0, help=">= 0; 0 disables (default: 0)")
  gen.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 disables (default: 1)")
  gen.add_argument("--min-p", type=float, default=0.0,
                   help="in [0, 1]: drop tokens below min-p times the most likely one's probability; 0 disables "
                        "(default: 0)")
  gen.add_argument("--repetition-penalty", type=float,
                   help="> 0: divide the positive logits of tokens already in the prompt or output by it (multiply "
                        f"the negative ones); 1 disables (default: {BUNDLED_REPETITION_PENALTY} for the bundled "
                        "pair, whose 6 M target loops without it; 1 with --target or --random-init)")
  gen.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted from the logit of every token generated so far (default: 0)")
  gen.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted once per earlier occurrence in the output (default: 0)")
  gen.add_argument("--logit-bias", type=_logit_bias_arg, action="append", metavar="TOKEN=BIAS",
                   help="add BIAS (in [-100, 100]) to token id TOKEN's logit; repeatable")
  gen.add_argument("--logprobs", type=int, metavar="N",
                   help=f"print each emitted token's log-probability and the N (0..{MAX_LOGPROBS}) most likely "
                        "alternatives")
  gen.add_argument("--show-accepted", action="store_true",
                   help="mark the tokens that were proposals the target accepted (colour on a terminal; "
                        "⟦brackets⟧ when stdout is not one or NO_COLOR is set)")
  gen.add_argument("--no-compare", action="store_true",
                   help="skip the comparison with the target alone (same prompt, proposer none, k 0)")
  gen.add_argument("--repeats", type=int, default=3,
                   help="timed warm calls of each side of the comparison; the median is reported (default: 3)")
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
  b.add_argument("--pilot-prompts", metavar="FILE",
                 help="prompts (as --prompts) that every k=auto case pilots on, the same set at every batch size "
                      "(default: each case's own batch of prompts)")
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
  sv.add_argument("--trees", type=_tree_list, metavar="TREE;TREE...",
                  help="token trees --k auto chooses among besides --ks (draft, eagle, mtp, medusa), semicolon-"
                       f"separated, each {TREE_FORMS}; e.g. 'dynamic:2,4,8;4-2/6' (default: none)")
  sv.add_argument("--slots", type=int, default=8, help="decode slots: requests served at once (default: 8)")
  sv.add_argument("--widths", type=_int_list,
                  help="batch sizes a step may run at, the smallest holding the live requests (default: the powers "
                       "of two below --slots, and --slots)")
  sv.add_argument("--rounds-per-step", type=int, default=8,
                  help="most speculative rounds one device call runs; it returns early when a request finishes, "
                       "one round when a request waits for a free slot (default: 8)")
  sv.add_argument("--first-rounds", type=int, default=1,
                  help="most rounds of the step that runs a new request for the first time, so that its first "
                       "token streams after them; then steps of up to --rounds-per-step (default: 1)")
  sv.add_argument("--refill-rounds", type=int, default=2,
                  help="after a call in which a request finished, while its slot is free and no request waits, "
                       "the next calls run this many rounds, then twice as many, up to a full call, so that a "
                       "request sent when another ends waits about as long as the slot has been free; 0: full "
                       "calls (default: 2)")
  sv.add_argument("--refill-share", type=float, default=0.25,
                  help="--refill-rounds applies while at least this share of the step's rows are free (at width 8, "
                       "one free row of 8 costs less than the extra calls; default: 0.25)")
  sv.add_argument("--max-rounds-per-step", type=int,
                  help="a width whose device call costs more than --call-overhead of its --rounds-per-step rounds "
                       "beyond them (timed at start-up) runs longer calls, up to this many rounds; set it to "
                       "--rounds-per-step for the same rounds at every width (default: 32, or --rounds-per-step "
                       "if larger)")
  sv.add_argument("--call-overhead", type=float, default=0.05,
                  help="the share of a call's time its fixed cost may take before the width runs more rounds a "
                       "call (default: 0.05)")
  sv.add_argument("--max-call-ms", type=float, default=50.0,
                  help="the longest a call is lengthened to by --call-overhead: a request arriving for a free slot "
                       "waits for the call in flight (default: 50)")
  sv.add_argument("--interrupt-calls", action="store_true",
                  help="a device call asks the host after each round whether a request arrived for a free slot (or "
                       "was cancelled), and returns then: arrivals wait one round, not the call. Costs a host "
                       "callback per round; on CPU, where XLA then runs each call synchronously, 12-23 %% more per "
                       "round on the bundled pair (default: off)")
  sv.add_argument("--launch-ahead", action=argparse.BooleanOptionalAction, default=None,
                  help="launch the next full device call before collecting the one in flight, so that the host's "
                       "work between calls (tokens handed out, the next call chosen) overlaps the device; not "
                       "while a slot freed in the last two calls may be waiting for its client (default: on where "
                       "calls run one k, off with --k auto over several)")
  sv.add_argument("--bucket-cache", action=argparse.BooleanOptionalAction, default=True,
                  help="keep the KV caches at the attention bucket the steps run at, cut or grown when the live "
                       "requests need another, instead of copying each call's bucket window out of the --max-len "
                       "buffers and back (default: on; --no-bucket-cache: the caches at --max-len)")
  sv.add_argument("--no-greedy-steps", action="store_true",
                  help="run every step with the general sampling program; by default a step whose requests are all "
                       "greedy runs a greedy one, faster per round but twice the step programs to compile")
  sv.add_argument("--greedy-steps-at-start", action="store_true",
                  help="compile the greedy step programs before serving; by default they compile while the server "
                       "serves, the general program running greedy steps until theirs is ready")
  sv.add_argument("--attention-buckets", type=_int_list,
                  help="cache lengths a step may attend over, the smallest holding every live request, all used at "
                       "every width (default: --max-len and its halves down to an eighth, none below 64, each width "
                       "keeping those a call measured at start-up at least 3 %% cheaper over than over the next "
                       "longer one kept: a shorter one copies its window of the cache out and back each call)")
  sv.add_argument("--prompt-buckets", type=_int_list, metavar="N,N,...",
                  help="the padded lengths prompts are prefilled at, each compiled at start-up: a prompt is padded "
                       "to the smallest that holds it (default: 16, 32, then each power of two and the length "
                       "halfway to the next, 48, 64, 96, 128, 192, ..., below --max-len, and --max-len)")
  sv.add_argument("--prefill-chunk", type=int, default=256,
                  help="prompts longer than this (a power of two) are prefilled this many tokens at a time between "
                       "steps, so running requests keep streaming while they join; 0: at once (default: 256)")
  sv.add_argument("--prompt-cache", type=int, default=0, metavar="N",
                  help="keep the prefilled rows of the last N distinct prompts, so that a request whose whole prompt "
                       "(every token) was seen before skips its prefill, with the same tokens, and one that shares "
                       "a long prefix with a kept prompt (a system prompt, an earlier turn) passes only the rest; "
                       "each holds one slot's caches (default: 0, none kept)")
  sv.add_argument("--chat-template", metavar="FILE",
                  help="a Jinja2 chat template for /v1/chat/completions (default: the model's own, if any)")
  sv.add_argument("--max-len", type=int,
                  help="positions per slot, prompt + max_tokens + k (default: 512 or the model's max_seq_len)")
  sv.add_argument("--max-queue", type=int, default=64,
                  help="requests that may wait for a slot; more get 503 (default: 64)")
  sv.add_argument("--model-name", help="the model id of the API (default: the model's name)")
  sv.add_argument("--api-key", metavar="KEY",
                  help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV} "
                       "if set, else open)")
  sv.add_argument("--max-body-bytes", type=int, default=1 << 20,
                  help="largest request body; larger ones get 413 (default: 1048576)")
  sv.add_argument("--max-tokens", type=int,
                  help="most new tokens a request may ask for; more get 400 (default: a slot's room)")
  sv.add_argument("--max-n", type=int,
                  help="most choices a request may ask for with n, at most --slots (the choices run at once, one "
                       "slot each, sharing the prompt's prefill); more get 400 (default: --slots)")
  sv.add_argument("--client-timeout", type=float, default=60.0,
                  help="seconds a client may take to send its body (else 408) or to read one streamed chunk (else "
                       "its request is cancelled and the slot freed) (default: 60)")
  sv.add_argument("--grace", type=float, default=30.0,
                  help="seconds running requests may take to finish on SIGTERM (default: 30)")
  sv.add_argument("--no-warmup", action="store_true", help="compile on first use instead of at start-up")
  sv.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info")
  sv.add_argument("--cutoff", type=float,
                  help="--method eagle or mtp: end a row's proposals where the head's confidence that its chain "
                       "gets that far falls below this, in (0, 1] (ChainHeads.cutoff; the target then verifies a "
                       "shorter window; default: none, k proposals every round)")
  sv.add_argument("--ngram-max", type=int, help="--method ngram: longest n-gram looked up")
  sv.add_argument("--ngram-min", type=int, help="--method ngram: shortest n-gram looked up")
  _add_model_args(sv)
  sv.set_defaults(func=_cmd_serve)

  ex = sub.add_parser("export-heads", help="write a specjax head set in its published layout (EAGLE-3/EAGLE-1 as vLLM "
                                             "and SGLang load them, Medusa as the Medusa repository does)")
  ex.add_argument("--heads", required=True, metavar="DIR", help="a specjax head folder (heads.json)")
  ex.add_argument("--out", required=True, metavar="DIR", help="the folder to write (config.json + safetensors)")
  ex.add_argument("--target", help=f"the heads' target (a name, .gguf file or checkpoint directory; default: "
                                   f"{DEFAULT_PAIR}): the heads are checked against it, and Medusa heads copy its LM head")
  ex.set_defaults(func=_cmd_export_heads)

  from specjax.train.cli import register as register_training

  register_training(sub)
  return parser


def _cmd_export_heads(args) -> int:
  from specjax.head_formats import save_published
  from specjax.loading import load
  from specjax.models.heads import load_heads

  try:
    target = load(args.target or DEFAULT_PAIR).model
    heads = load_heads(args.heads, target.cfg)
    fmt = save_published(args.out, heads, target=target, base_model=args.target or DEFAULT_PAIR)
  except (ValueError, OSError) as e:
    raise CliError(str(e)) from None
  print(f"wrote {heads.cfg.kind} heads from {args.heads} to {args.out} in the published {fmt} layout")
  return 0


def _log_loading() -> None:
  """One line on stderr for what loading attaches on its own (a recognised GGUF file's shipped heads)."""
  import logging

  logger = logging.getLogger("specjax.loading")
  if not logger.handlers:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("specjax: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
  _log_loading()
  try:
    args = build_parser().parse_args(argv)
    return args.func(args)
  except CliError as e:
    print(f"specjax: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
