"""Ad hoc (the record of docs/benchmarks.md, "A confidence cutoff"): what a round with a cutoff costs beyond
k = 1 on SmolLM2-135M-Instruct with its shipped EAGLE-3 head, and the ``lax.switch`` between verify windows
apart from the head's second step: ``cutoff=1.0`` limits every row to one proposal, once with the switch and once
with ``engine.verify_bucketed`` replaced by its one-proposal branch (right only because every row proposes one).
2 held-out chat prompts x 64 tokens, batch 1, greedy; medians of 3 (each timing the second of two runs)."""

import dataclasses
import statistics
import time

import jax

import specjax
from specjax import SpecConfig, engine, proposers
from specjax.cli import read_prompts

CHAT = "benchmarks/results/prompt_kinds/chat.jsonl"


def first_only(target, cache, last, drafts, num_drafts, active, sampler, aux_layers=(), invariant=False,
               widths=None):
  k = drafts.shape[1]
  p, logits, features, cache = engine.verify(target, cache, last, drafts[:, :1], sampler, aux_layers, invariant)
  pad = lambda x: None if x is None else jax.numpy.pad(x, ((0, 0), (0, k - 1)) + ((0, 0),) * (x.ndim - 2))
  return pad(p), pad(logits), engine.Features(hidden=pad(features.hidden), aux=pad(features.aux)), cache


def main():
  loaded = specjax.load("smollm2-135m-instruct")
  target, tok = loaded.model, loaded.tokenizer
  rows = [loaded.chat.encode(tok, [{"role": "user", "content": t}]) for t in read_prompts(CHAT, "--prompts")[:2]]
  stops = loaded.chat.stop_ids(tok)
  eagle = proposers.for_heads(loaded.heads["eagle"])
  cut = lambda c: dataclasses.replace(eagle, cutoff=c)
  cases = [("k1", eagle, 1, None), ("k2", eagle, 2, None), ("k2 cut1.0 switch", cut(1.0), 2, None),
           ("k2 cut1.0 noswitch", cut(0.99999), 2, first_only),  # another program: traced with the patch
           ("k2 cut0.4", cut(0.4), 2, None), ("k2 cut0.2", cut(0.2), 2, None), ("k3 cut0.2", cut(0.2), 3, None),
           ("k4 cut0.2", cut(0.2), 4, None)]
  original = engine.verify_bucketed

  def run(proposer, k, patch):
    engine.verify_bucketed = patch or original
    outs, start = [], time.perf_counter()
    for row in rows:
      out = specjax.generate(target, [row], proposer=proposer, spec=SpecConfig(k=k), max_new_tokens=64, eos_id=stops)
      jax.block_until_ready(out.tokens)
      outs.append(out)
    return time.perf_counter() - start, outs

  for _, proposer, k, patch in cases:  # compiles
    run(proposer, k, patch)
  results = {name: [] for name, _, _, _ in cases}
  for _ in range(3):
    for name, proposer, k, patch in cases:
      run(proposer, k, patch)
      seconds, outs = run(proposer, k, patch)
      results[name].append((seconds, sum(o.stats.row_rounds for o in outs)))
  for name, timings in results.items():
    seconds, rounds = statistics.median(t for t, _ in timings), timings[0][1]
    print(f"{name}: {seconds:.3f} s, {rounds} rounds, {1000 * seconds / rounds:.2f} ms/round, "
          f"tokens/s {128 / seconds:.1f}")


if __name__ == "__main__":
  main()
