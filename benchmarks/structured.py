"""Structured output: what a grammar's token masks cost per step, by library, and what they do to speculation.

    python benchmarks/structured.py [--batch 8] [--tokens 64] [--repeats 5] [--out DIR] [--smollm2-tokenizer FILE]

Outputs cut by the token limit are counted apart from those that ended by EOS (every one of which should
validate).

1. Masks, by library (llguidance, xgrammar, outlines-core: each where installed), for the bundled pair's
   vocabulary (4096) and SmolLM2's (49152 tokens, its tokenizer.json): ``batch`` matchers step through a valid
   document of a JSON schema token by token; the host time of the batch's masks per step (the library's
   batched call where it has one), and of a speculative window's k + 1 masks (k = 4; the matcher advanced
   through the next 4 tokens of the document, the worst case where every proposal is allowed, then rolled
   back), medians over the steps of ``repeats`` passes (the first pass apart, as warm-up), plus the grammar's
   compile time.
2. Decoding, on the bundled pair: ``batch`` rows under the same schema (``response_format``), greedy and at
   temperature 1, without speculation and with the draft model (k = 4), interleaved call by call: median wall
   time of ``repeats`` calls after a warm-up call (compile time apart), tokens/s, τ, acceptance by position,
   and the host's mask time per step measured inside the same calls; the unconstrained fused loop beside it.

Writes ``results.json`` and ``results.md`` under ``--out`` (default ``benchmarks/results/structured``),
with the machine's load average before and after (others share this CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

import specjax
import specjax.grammar as grammars
from specjax import SamplingConfig, SpecConfig
from specjax.bench import load_average, machine
from specjax.proposers import DraftModel
from specjax.tokenizer import byte_stand_ins, load_hf_tokenizer, load_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "line": {"type": "integer", "minimum": 0},
    "kind": {"enum": ["function", "class", "module"]}, "args": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                                  "maxItems": 4},
    "public": {"type": "boolean"}}, "required": ["name", "line", "kind", "args", "public"], "additionalProperties": False}
DOCUMENT = {"name": "parse_args", "line": 1204, "kind": "function", "args": ["argv", "namespace"], "public": True}
K = 4
PROMPTS = ["# the symbol table of argparse as JSON\nsymbol = ", "def describe(node):\n    return ",
           "CONFIG = ", "import json\n\ndata = "]


def token_pieces(tokenizer) -> list[bytes | None]:
  """Each token's bytes (byte-level BPE: GPT-2's stand-ins read back), None for added (special) tokens."""
  inner = tokenizer.tokenizer
  byte_of = {c: b for b, c in byte_stand_ins().items()}
  special = set(inner.get_added_tokens_decoder()) if hasattr(inner, "get_added_tokens_decoder") \
      else set()
  out = []
  for i in range(tokenizer.vocab_size):
    piece = inner.id_to_token(i)
    out.append(None if piece is None or i in special else bytes(byte_of.get(c, 0) for c in piece))
  return out


# ------------------------------------------------------------------------------------------- libraries


class LLGuidance:
  name = "llguidance"

  def __init__(self, tokenizer, eos):
    self.lltok = grammars.ll_tokenizer(tokenizer, [eos])
    self.words = grammars.mask_words(tokenizer.vocab_size)
    self.vocab = tokenizer.vocab_size
    self.eos = eos

  def compile(self, schema):
    g = grammars.Grammar("json_schema", json.dumps(schema), "schema").text()
    return g

  def matchers(self, compiled, batch):
    import llguidance
    self.executor = llguidance.LLExecutor()
    return [llguidance.LLMatcher(self.lltok, compiled, log_level=0) for _ in range(batch)]

  def masks(self, ms, bits):  # specjax's own loop (specjax.grammar.first_masks)
    bits[:] = grammars.first_masks({i: _Wrapped(m, self.eos) for i, m in enumerate(ms)}, len(ms), self.vocab)

  def masks_parallel(self, ms, bits):  # llguidance's thread pool
    self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], bits.ctypes.data, self.words * 4,
                                          len(ms))

  def window(self, ms, drafts, bits):  # bits [B * (k+1), words]: specjax's own loop (specjax.grammar)
    matchers = {i: _Wrapped(m, self.eos) for i, m in enumerate(ms)}
    k = len(drafts[0])
    bits.reshape(len(ms), k + 1, -1)[:] = grammars.window_masks(matchers, np.asarray(drafts), self.vocab)

  def window_parallel(self, ms, drafts, bits):  # llguidance's own call for draft tokens, on its thread pool
    k = len(drafts[0])
    self.executor.unsafe_compute_mask_ptr_with_draft_token(
        [(m, i * (k + 1), d) for i, (m, d) in enumerate(zip(ms, drafts))], bits.ctypes.data, self.words * 4,
        len(ms) * (k + 1))

  def consume(self, ms, token):
    for m in ms:
      assert m.consume_token(token), m.get_error()


class _Wrapped:  # what specjax.grammar.window_masks reads of a matcher
  def __init__(self, m, eos):
    self.m = m
    self.compiled = argparse.Namespace(stop_ids=frozenset([eos]))


class LLGuidanceParallel(LLGuidance):
  name = "llguidance (its thread-pool calls)"

  def masks(self, ms, bits):
    self.masks_parallel(ms, bits)

  def window(self, ms, drafts, bits):
    self.window_parallel(ms, drafts, bits)


class XGrammar:
  name = "xgrammar"

  def __init__(self, tokenizer, eos):
    import xgrammar as xgr
    self.xgr = xgr
    pieces = token_pieces(tokenizer)
    self.info = xgr.TokenizerInfo([b"" if p is None else p for p in pieces], xgr.VocabType.RAW,
                                  vocab_size=tokenizer.vocab_size, stop_token_ids=[eos])
    self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)

  def compile(self, schema):
    return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

  def matchers(self, compiled, batch):
    self.batch = self.xgr.BatchGrammarMatcher(max_threads=2)
    return [self.xgr.GrammarMatcher(compiled, max_rollback_tokens=K) for _ in range(batch)]

  def masks(self, ms, bits):
    import torch
    t = torch.from_numpy(bits)
    self.batch.batch_fill_next_token_bitmask(ms, t)

  def window(self, ms, drafts, bits):
    import torch
    t = torch.from_numpy(bits)
    k = len(drafts[0])
    for i, (m, d) in enumerate(zip(ms, drafts)):
      n = 0
      m.fill_next_token_bitmask(t, i * (k + 1))
      for j, tok in enumerate(d):
        if not m.accept_token(tok):
          break
        n += 1
        if m.is_terminated():
          break
        m.fill_next_token_bitmask(t, i * (k + 1) + j + 1)
      m.rollback(n)

  def consume(self, ms, token):
    for m in ms:
      assert m.accept_token(token)


class OutlinesCore:
  name = "outlines-core"

  def __init__(self, tokenizer, eos):
    from outlines_core import Vocabulary
    pieces = token_pieces(tokenizer)
    table: dict[bytes, list[int]] = {}
    for i, p in enumerate(pieces):
      if p is not None and i != eos:
        table.setdefault(p, []).append(i)
    self.vocab = Vocabulary(eos, table)
    self.words = grammars.mask_words(tokenizer.vocab_size)

  def compile(self, schema):
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema
    return Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern="[ ]?"), self.vocab)

  def matchers(self, compiled, batch):
    from outlines_core import Guide
    return [Guide(compiled, max_rollback=K) for _ in range(batch)]

  def masks(self, ms, bits):
    for i, g in enumerate(ms):
      g.write_mask_into(bits[i].ctypes.data, self.words, 4)

  def window(self, ms, drafts, bits):
    k = len(drafts[0])
    for i, (g, d) in enumerate(zip(ms, drafts)):
      g.write_mask_into(bits[i * (k + 1)].ctypes.data, self.words, 4)
      n = 0
      for j, tok in enumerate(d):
        if not g.accepts_tokens([tok]):
          break
        g.advance(tok, return_tokens=False)
        n += 1
        if g.is_finished():
          break
        g.write_mask_into(bits[i * (k + 1) + j + 1].ctypes.data, self.words, 4)
      g.rollback_state(n)

  def consume(self, ms, token):
    for g in ms:
      g.advance(token, return_tokens=False)


def bench_masks(lib, tokenizer, eos, batch: int, repeats: int) -> dict:
  start = time.perf_counter()
  compiled = lib.compile(SCHEMA)
  compile_s = time.perf_counter() - start
  doc = tokenizer.encode(json.dumps(DOCUMENT, separators=(", ", ": ")))
  words = grammars.mask_words(tokenizer.vocab_size)
  step_s, window_s = [], []
  for rep in range(repeats + 1):
    ms = lib.matchers(compiled, batch)
    bits = np.full((batch, words), -1, np.int32)
    wbits = np.full((batch * (K + 1), words), -1, np.int32)
    for i, token in enumerate(doc):
      t0 = time.perf_counter()
      lib.masks(ms, bits)
      t1 = time.perf_counter()
      drafts = [doc[i:i + K] + [eos] * max(0, i + K - len(doc))] * batch
      lib.window(ms, [d[:K] for d in drafts], wbits)
      t2 = time.perf_counter()
      allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little")
      assert allowed[token], (lib.name, i, token)
      lib.consume(ms, token)
      if rep:  # pass 0: warm-up
        step_s.append(t1 - t0)
        window_s.append(t2 - t1)
  return {"library": lib.name, "vocab": tokenizer.vocab_size, "batch": batch, "document_tokens": len(doc),
          "compile_ms": round(1e3 * compile_s, 2),
          "mask_step_us": round(1e6 * statistics.median(step_s), 1),
          "mask_per_token_us": round(1e6 * statistics.median(step_s) / batch, 1),
          "window_step_us": round(1e6 * statistics.median(window_s), 1),
          "window_per_row_us": round(1e6 * statistics.median(window_s) / batch, 1)}


# ------------------------------------------------------------------------------------------- decoding


class MaskClock:
  """Host time spent in the grammar's masks and the matchers' commits, wrapped around specjax.grammar."""

  def __init__(self):
    self.seconds, self.steps = 0.0, 0
    self._first, self._window, self._commit = grammars.first_masks, grammars.window_masks, grammars.Matcher.commit
    self._rollout = grammars.Rollout.masks  # the masks along the proposals, asked by the device while it draws

    def timed(fn, count):
      def run(*a, **kw):
        start = time.perf_counter()
        try:
          return fn(*a, **kw)
        finally:
          self.seconds += time.perf_counter() - start
          self.steps += count
      return run

    grammars.first_masks = timed(self._first, 1)
    grammars.window_masks = timed(self._window, 0)
    grammars.Matcher.commit = timed(self._commit, 0)
    grammars.Rollout.masks = timed(self._rollout, 0)

  def take(self) -> tuple[float, int]:
    out = (self.seconds, self.steps)
    self.seconds, self.steps = 0.0, 0
    return out


def bench_decode(batch: int, tokens: int, repeats: int) -> list[dict]:
  pair = specjax.load("stdlib-coder")
  rows = [pair.tokenizer.encode(p) for p in (PROMPTS * batch)[:batch]]
  fmt = {"type": "json_schema", "json_schema": {"name": "symbol", "schema": SCHEMA}}
  clock = MaskClock()
  cases = {}
  for temperature in (0.0, 1.0):
    for name, proposer, k, structured in (("target alone", None, 0, True), ("draft k=4", DraftModel(pair.draft), K, True),
                                          ("target alone, no grammar", None, 0, False),
                                          ("draft k=4, no grammar", DraftModel(pair.draft), K, False)):
      kw = dict(proposer=proposer, spec=SpecConfig(k=k), sampling=SamplingConfig(temperature=temperature),
                max_new_tokens=tokens, seed=1, tokenizer=pair.tokenizer)
      if structured:
        kw["response_format"] = fmt
      cases[temperature, name] = lambda kw=kw: specjax.generate(pair.model, rows, **kw)
  compile_s, times, outs, masks = {}, {c: [] for c in cases}, {}, {c: [] for c in cases}
  for case, call in cases.items():
    start = time.perf_counter()
    call()
    compile_s[case] = time.perf_counter() - start
    clock.take()
  for _ in range(repeats):
    for case, call in cases.items():
      start = time.perf_counter()
      outs[case] = call()  # numpy outputs: the device is done
      times[case].append(time.perf_counter() - start)
      masks[case].append(clock.take())
  results = []
  for (temperature, name), out in outs.items():
    wall = statistics.median(times[temperature, name])
    mask_s = statistics.median(s for s, _ in masks[temperature, name])
    steps = statistics.median(n for _, n in masks[temperature, name])
    valid = finished = None
    if "no grammar" not in name:
      valid = sum(_valid(t) for t in out.text)
      finished = sum(int(row[-1]) == pair.tokenizer.eos_id for row in out.rows())
    results.append({
        "temperature": temperature, "case": name, "wall_s": round(wall, 4),
        "tokens": int(out.lengths.sum()), "tokens_per_s": round(float(out.lengths.sum()) / wall, 1),
        "tau": round(out.stats.mean_accepted_length, 3), "rounds": out.stats.rounds,
        "acceptance_by_position": [None if a is None else round(a, 3) for a in out.stats.acceptance_by_position],
        "host_mask_ms_per_step": round(1e3 * mask_s / steps, 3) if steps else None,
        "host_mask_share": round(mask_s / wall, 3) if steps else None,
        "valid_json": valid, "finished_by_eos": finished, "rows": len(out.text), "compile_s": round(compile_s[temperature, name], 2),
        "sample": out.text[0][:120]})
  return results


def _valid(text: str) -> bool:
  try:
    import jsonschema
    jsonschema.validate(json.loads(text), SCHEMA)
    return True
  except Exception:
    return False


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--smollm2-tokenizer", default=os.path.join(HERE, "..", "runs", "smollm2_pard", "tokenizer.json"),
                      help="SmolLM2's tokenizer.json (49152 tokens)")
  parser.add_argument("--skip-decode", action="store_true")
  parser.add_argument("--out", default=os.path.join(HERE, "results", "structured"))
  args = parser.parse_args(argv)
  before = load_average()
  vocabs = {"stdlib-coder": load_tokenizer(os.path.join(HERE, "..", "specjax", "assets", "stdlib-coder",
                                                        "tokenizer.json"))}
  if os.path.exists(args.smollm2_tokenizer):
    vocabs["smollm2"] = load_hf_tokenizer(os.path.dirname(os.path.abspath(args.smollm2_tokenizer)))
  else:
    print(f"no SmolLM2 tokenizer at {args.smollm2_tokenizer}: its vocabulary is skipped", file=sys.stderr)
  masks = []
  for vocab_name, tok in vocabs.items():
    eos = tok.eos_id if tok.eos_id is not None else tok.tokenizer.token_to_id("<|endoftext|>")
    for cls in (LLGuidance, LLGuidanceParallel, XGrammar, OutlinesCore):
      try:
        lib = cls(tok, eos)
      except ImportError as e:
        print(f"{cls.name}: not installed ({e})", file=sys.stderr)
        continue
      row = {"tokenizer": vocab_name, **bench_masks(lib, tok, eos, args.batch, args.repeats)}
      print(json.dumps(row), file=sys.stderr)
      masks.append(row)
  decode = [] if args.skip_decode else bench_decode(args.batch, args.tokens, args.repeats)
  for row in decode:
    print(json.dumps(row), file=sys.stderr)
  report = {"machine": machine(load_before=before), "load_after": load_average(), "batch": args.batch, "k": K,
            "schema": SCHEMA, "masks": masks, "decode": decode}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(markdown(report))
  print(markdown(report))
  return 0


def markdown(report: dict) -> str:
  lines = [f"# Structured output (batch {report['batch']}, k = {report['k']})", "",
           f"Load average before {report['machine']['load_before']}, after {report['load_after']} "
           f"({report['machine']['cpu']}, {report['machine']['schedulable_cpus']} schedulable CPUs).", "",
           "## Masks by library (host time, medians over the document's steps)", "",
           "| vocabulary | library | compile ms | batch masks µs/step | µs/token | window (k+1 masks) µs/step | µs/row |",
           "|---|---|---|---|---|---|---|"]
  for r in report["masks"]:
    lines.append(f"| {r['tokenizer']} ({r['vocab']}) | {r['library']} | {r['compile_ms']} | {r['mask_step_us']} | "
                 f"{r['mask_per_token_us']} | {r['window_step_us']} | {r['window_per_row_us']} |")
  if report["decode"]:
    lines += ["", "## Decoding on the bundled pair under the schema", "",
              "| T | case | wall s | tokens/s | τ | acceptance by position | host mask ms/step | mask share | valid / ended by EOS |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in report["decode"]:
      valid = "" if r["valid_json"] is None else f"{r['valid_json']} / {r['finished_by_eos']} of {r['rows']}"
      lines.append(f"| {r['temperature']} | {r['case']} | {r['wall_s']} | {r['tokens_per_s']} | {r['tau']} | "
                   f"{r['acceptance_by_position']} | {r['host_mask_ms_per_step']} | {r['host_mask_share']} | {valid} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
