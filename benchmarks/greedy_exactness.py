"""Greedy speculation against the target alone, token for token, in a chosen weight dtype, on real prompts.

    python benchmarks/greedy_exactness.py --target smollm2-135m-instruct --dtype bfloat16 \
        --prompts runs/smollm2_heldout.jsonl [--batch 16] [--max-new-tokens 128] [--out DIR]

Held-out chat prompts (``python -m specjax.train.instructions --held-out 16 --out FILE``) are wrapped in the
target's chat template and decoded greedily with the target alone, then with n-gram and the shipped EAGLE
head at k = 4 (SpecConfig's ``invariant`` as given by ``--invariant``). For each proposer: how many prompts
differ from the target alone, and at the first difference the target's two best logits (the target alone's
pass there). Then the side-by-side speed of the same runs: medians over ``--repeats`` after a warm-up.
Writes ``<out>/greedy_exactness.json`` and ``.md`` when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import time

import jax
import numpy as np

import specjax
from flax import nnx
from specjax import SpecConfig, proposers
from specjax.bench import machine
from specjax.cli import read_prompts
from specjax.decode import bucket_length


def _two_best(target, row: list[int]) -> tuple[float, float]:
  """The target's two best logits after ``row`` (one pass over it, padded to a bucket: few compilations)."""
  padded = np.zeros((1, bucket_length(len(row))), np.int32)
  padded[0, :len(row)] = row
  logits = _forward(target, padded)
  top = np.sort(np.asarray(logits[0, len(row) - 1], np.float32))[::-1]
  return float(top[0]), float(top[1])


@functools.partial(jax.jit, static_argnums=1)
def _pass(state, graphdef, tokens):
  model = nnx.merge(graphdef, state)
  return model(tokens, model.init_cache(tokens.shape[0], tokens.shape[1]))[0]


def _forward(target, tokens):
  graphdef, state = nnx.split(target)
  return _pass(state, graphdef, tokens)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="smollm2-135m-instruct")
  parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
  parser.add_argument("--prompts", required=True)
  parser.add_argument("--n", type=int, default=16)
  parser.add_argument("--batch", type=int, default=16, help="rows per generate call")
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--invariant", action="store_true", help="SpecConfig(invariant=True) for speculation")
  parser.add_argument("--methods", default="ngram,eagle")
  parser.add_argument("--repeats", type=int, default=3, help="timed repeats after the first calls (0: no timing)")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)

  loaded = specjax.load(args.target, dtype=args.dtype)
  target, tok, chat = loaded.model, loaded.tokenizer, loaded.chat
  texts = read_prompts(args.prompts)[: args.n]
  rows = [chat.encode(tok, [{"role": "user", "content": t}]) for t in texts]
  stops = chat.stop_ids(tok)
  made = {"none": None}
  for m in args.methods.split(","):
    made[m] = proposers.NGram() if m == "ngram" else proposers.for_heads(loaded.heads[m])

  def run(method, batch_rows):
    proposer = made[method]
    spec = SpecConfig(k=0) if proposer is None else SpecConfig(k=args.k, invariant=args.invariant)
    out = specjax.generate(target, batch_rows, proposer=proposer, spec=spec, max_new_tokens=args.max_new_tokens,
                           eos_id=stops)
    jax.block_until_ready(out.tokens)
    return out

  outputs, timings, taus = {}, {}, {}
  for method in made:  # first calls: compile, and the tokens compared below
    toks, emitted, rounds = [], 0, 0
    for i in range(0, len(rows), args.batch):
      out = run(method, rows[i:i + args.batch])
      toks += [list(map(int, r[:n])) for r, n in zip(np.asarray(out.tokens), np.asarray(out.lengths))]
      emitted, rounds = emitted + out.stats.new_tokens, rounds + out.stats.row_rounds
    outputs[method], taus[method] = toks, emitted / max(rounds, 1)
    print(f"{method}: generated", flush=True)
  times = {method: [] for method in made}
  for _ in range(args.repeats):  # interleaved, so that the machine's drift hits every method alike
    for method in made:
      start = time.perf_counter()
      for i in range(0, len(rows), args.batch):
        run(method, rows[i:i + args.batch])
      times[method].append(time.perf_counter() - start)
  if args.repeats:
    timings = {method: statistics.median(t) for method, t in times.items()}

  report = {"machine": machine(), "args": vars(args), "methods": {}}
  base = outputs["none"]
  for method in made:
    if method == "none":
      continue
    differ, gaps = 0, []
    for prompt, a, b in zip(rows, base, outputs[method]):
      if a == b:
        continue
      differ += 1
      at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
      gaps.append(_two_best(target, prompt + a[:at]))
    entry = {"differ": differ, "of": len(rows), "first_difference_top2": gaps, "tau": taus[method]}
    if timings:
      entry["speedup"] = timings["none"] / timings[method]
      entry["seconds"] = timings[method]
    report["methods"][method] = entry
  report["seconds_target_alone"] = timings.get("none")
  lines = [f"# Greedy exactness: {args.target} in {args.dtype}, k = {args.k}, invariant = {args.invariant}", "",
           f"{len(rows)} held-out chat prompts, {args.max_new_tokens} new tokens, batch {args.batch}.", "",
           "| proposer | prompts differing | tau | speedup vs target alone | top-2 logits at first differences |",
           "| --- | --- | --- | --- | --- |"]
  for method, e in report["methods"].items():
    gaps = ", ".join(f"{a:.4g}/{b:.4g}" for a, b in e["first_difference_top2"][:4])
    speedup = f"{e['speedup']:.3f}x" if "speedup" in e else "not timed"
    lines.append(f"| {method} | {e['differ']} / {e['of']} | {e['tau']:.2f} | {speedup} | {gaps} |")
  if timings:
    lines += ["", f"Target alone: {timings['none']:.2f} s for the {len(rows)} prompts (median of {args.repeats})."]
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "greedy_exactness.json").write_text(json.dumps(report, indent=1))
    (out / "greedy_exactness.md").write_text(text)
  return report


if __name__ == "__main__":
  main()
