"""Chains against token trees, side by side in one run, on real prompts: τ, accepted depth, sibling ranks, speed.

    python benchmarks/trees.py --target smollm2-135m-instruct --prompts runs/smollm2_heldout.jsonl \
        --methods eagle --n 4 --max-new-tokens 64 --repeats 3 --out benchmarks/results/trees/smollm2

    python benchmarks/trees.py --target stdlib-coder --methods eagle,mtp,medusa --n 4 --auto --out DIR

    python benchmarks/trees.py --target smollm2-135m-instruct --heads tuned=RUN/heads --methods eagle,tuned ...

    python benchmarks/trees.py --target smollm2-135m-instruct --prompts benchmarks/results/prompt_kinds/chat.jsonl \
        --methods eagle --ks 1,2 --trees "" --auto --pilot-prompts benchmarks/results/prompt_kinds/chat-pilot.jsonl

For each method (``draft``, ``ngram``, the head methods the target ships, ``--heads``' labels, ``suffix+HEAD``): the chain at k = 2, 4, 6 and trees (``--trees``, default dynamic trees
of 8, 16 and 32 nodes and a fixed 4-2-2-1/16), every prompt greedy at batch 1 (``--temperature`` for sampled
runs), the target alone in the same run. Speed: the median over ``--repeats`` interleaved repeats after a
first call that compiles (its time reported apart), ``block_until_ready`` before each clock read; the speedup
is tokens a second against the target alone's (sampled rows differ in length from the baseline's). Also
v(T)/v(1), a target pass over T tokens against a one-token pass, for T = k + 1 and N + 1 of every case.
Prompts: a chat-prompt file (wrapped in the target's chat template) or, without ``--prompts``, held-out
source files of the standard library (``specjax.train.data``'s test split), whose first 48 tokens are the prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import time

import jax
import numpy as np
from flax import nnx

import specjax
from specjax import SamplingConfig, SpecConfig, numerics, proposers
from specjax.bench import machine
from specjax.tree import parse_tree

DEFAULT_TREES = "dynamic:2,4,8;dynamic:4,4,16;dynamic:4,6,32;4-2-2-1/16"


@functools.partial(jax.jit, static_argnames=("graphdef", "invariant"))
def _pass(graphdef, state, tokens, cache, invariant=False):
  with numerics.per_position(invariant):
    return nnx.merge(graphdef, state)(tokens, cache)[0]


def pass_cost(target, widths: list[int], repeats: int = 15) -> dict[int, float]:
  """v(T)/v(1) for each T in ``widths``: median seconds of a jitted T-token pass at batch 1 over a cache of
  256 positions holding 64, over that of a one-token pass (position by position where the engine verifies so:
  a mixed-precision target, ``engine.always_invariant``)."""
  graphdef, state = nnx.split(target)
  invariant = numerics.row_invariant(target.cfg)
  cache = target.init_cache(1, 256).with_lengths(jax.numpy.full((1,), 64, jax.numpy.int32))
  seconds = {}
  for t in sorted(set([1] + widths)):
    tokens = jax.numpy.ones((1, t), jax.numpy.int32)
    jax.block_until_ready(_pass(graphdef, state, tokens, cache, invariant))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(_pass(graphdef, state, tokens, cache, invariant))
      times.append(time.perf_counter() - start)
    seconds[t] = statistics.median(times)
  return {t: seconds[t] / seconds[1] for t in seconds}


def prompt_rows(loaded, args, path=None, flag="--prompts") -> tuple[list[list[int]], list[int] | None]:
  tok = loaded.tokenizer
  if path or args.prompts:
    from specjax.cli import read_prompts

    texts = read_prompts(path or args.prompts, flag)[: args.n]
    if loaded.chat is not None:
      return [loaded.chat.encode(tok, [{"role": "user", "content": t}]) for t in texts], loaded.chat.stop_ids(tok)
    return [tok.encode(t) for t in texts], None
  from specjax.train.data import documents

  docs = documents("stdlib", "test")[: args.n]  # files the shipped heads and drafts never trained on
  return [tok.encode(d)[:48] for d in docs], None


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="smollm2-135m-instruct")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "mixed"))
  parser.add_argument("--reference-dtype", default=None, choices=("float32", "bfloat16", "mixed"),
                      help="also time the target alone loaded in this dtype, in the same interleaved repeats, and "
                           "report every case's speed against it too (e.g. --dtype mixed --reference-dtype float32)")
  parser.add_argument("--prompts", default=None, help="chat prompts (JSONL or text); default: held-out stdlib code")
  parser.add_argument("--n", type=int, default=4, help="prompts")
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--methods", default="eagle",
                      help="comma-separated: draft, ngram, the head methods the target ships, the labels of --heads, "
                           "and suffix+HEAD (suffix decoding combined with that head, capped at 2 proposals)")
  parser.add_argument("--heads", action="append", default=[], metavar="LABEL=DIR",
                      help="a head folder (a heads run's heads/, specjax's or a published layout) to compare under "
                           "LABEL beside the shipped heads; repeatable")
  parser.add_argument("--heads-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                      help="--heads' parameters rounded to this dtype first (default bfloat16: as heads ship)")
  parser.add_argument("--ks", default="2,4,6")
  parser.add_argument("--cutoffs", default="",
                      help="comma-separated confidence cutoffs (ChainHeads.cutoff): each head method's chains of k > 1 "
                           "again with each")
  parser.add_argument("--trees", default=DEFAULT_TREES, help="';'-separated --tree specs")
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--auto", action="store_true",
                      help="also run k='auto', tree='auto' per method (k_max 4, trees of 4, 8 and 16 nodes): what "
                           "the cost model chooses, its calibration in the first call")
  parser.add_argument("--pilot-prompts", default=None, metavar="FILE",
                      help="with --auto: also k='auto' whose pilot measures acceptance on these prompts (the first "
                           "--n, encoded as --prompts are), not on each call's one prompt (SpecConfig.pilot_prompts)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)

  if args.pilot_prompts and not args.auto:
    raise SystemExit("--pilot-prompts are what --auto's pilot measures acceptance on: they need --auto")
  loaded = specjax.load(args.target, dtype=args.dtype)
  target = loaded.model
  for spec in args.heads:
    from specjax.head_formats import load_head_dir
    from specjax.loading import cast, mixed_precision

    label, sep, folder = spec.partition("=")
    if not sep or not label or not folder:
      raise SystemExit(f"--heads must be LABEL=DIR, got {spec!r}")
    if label in loaded.heads or label == "draft":
      raise SystemExit(f"--heads label {label!r} is taken (shipped: {sorted(loaded.heads)}, draft)")
    rounded = cast(load_head_dir(folder, target.cfg), args.heads_dtype)
    loaded.heads[label] = mixed_precision(cast(rounded, "float32")) if args.dtype == "mixed" else cast(rounded, args.dtype)
  rows, stops = prompt_rows(loaded, args)
  pilot = prompt_rows(loaded, args, args.pilot_prompts, "--pilot-prompts")[0] if args.pilot_prompts else None
  sampling = SamplingConfig(temperature=args.temperature)
  trees = [parse_tree(t) for t in args.trees.split(";") if t]
  cases = [("none", None, SpecConfig(k=0))]
  reference = None
  if args.reference_dtype:
    reference = f"target alone ({args.reference_dtype})"
    cases.append((reference, None, SpecConfig(k=0)))
    targets = {reference: specjax.load(args.target, dtype=args.reference_dtype).model}
  else:
    targets = {}
  for method in args.methods.split(","):
    if method == "draft":
      if loaded.draft is None:
        raise SystemExit(f"{args.target} ships no draft model")
      proposer = proposers.DraftModel(loaded.draft)
    elif method == "ngram":
      proposer = proposers.NGram()
    elif method.startswith("suffix+"):  # suffix decoding and a head, chosen per row and round; the head at most 2
      head = method.removeprefix("suffix+")
      if head not in loaded.heads:
        raise SystemExit(f"{method}: no {head} heads (there are {sorted(loaded.heads)})")
      proposer = proposers.Combined((proposers.Suffix(), proposers.for_heads(loaded.heads[head])), ks=(None, 2))
    elif method not in loaded.heads:
      raise SystemExit(f"{args.target} ships no {method} heads and --heads names none (there are "
                       f"{sorted(loaded.heads)})")
    else:
      proposer = proposers.for_heads(loaded.heads[method])
    cases += [(f"{method} chain k={k}", proposer, SpecConfig(k=int(k))) for k in args.ks.split(",")
              if proposer.max_k is None or int(k) <= proposer.max_k]
    for cutoff in [float(c) for c in args.cutoffs.split(",") if c]:
      if "cutoff" not in {f.name for f in dataclasses.fields(proposer)}:
        continue  # proposers without a confidence cutoff (n-gram, draft, Medusa, suffix + head)
      cut = dataclasses.replace(proposer, cutoff=cutoff)
      cases += [(f"{method} chain k={k} cutoff={cutoff:g}", cut, SpecConfig(k=int(k))) for k in args.ks.split(",")
                if int(k) > 1]
    for tree in trees:
      try:
        proposer.check_tree(tree)
      except ValueError as e:
        print(f"skipping {method} {tree.describe()}: {e}")
        continue
      cases.append((f"{method} {tree.describe()}", proposer, SpecConfig(tree=tree)))
    if args.auto:  # with --pilot-prompts, beside k='auto' piloting on each call's prompt
      auto = SpecConfig(k="auto", tree="auto", k_max=4, tree_sizes=(4, 8, 16))
      cases.append((f"{method} auto", proposer, auto))
      if pilot:
        cases.append((f"{method} auto, pilot on --pilot-prompts", proposer,
                      dataclasses.replace(auto, pilot_prompts=pilot)))

  def run(name, proposer, spec):
    outs = []
    for row in rows:  # batch 1
      out = specjax.generate(targets.get(name, target), [row], proposer=proposer, spec=spec, sampling=sampling,
                             max_new_tokens=args.max_new_tokens, eos_id=stops, seed=0)
      jax.block_until_ready(out.tokens)
      outs.append(out)
    return outs

  first, results = {}, {}
  for name, proposer, spec in cases:  # first calls: compilation and the tokens
    start = time.perf_counter()
    results[name] = run(name, proposer, spec)
    first[name] = time.perf_counter() - start
    print(f"{name}: first call {first[name]:.1f} s", flush=True)
  times = {name: [] for name, _, _ in cases}
  for _ in range(args.repeats):  # interleaved: the machine's drift hits every case alike
    for name, proposer, spec in cases:
      start = time.perf_counter()
      run(name, proposer, spec)
      times[name].append(time.perf_counter() - start)
  median = {name: statistics.median(t) for name, t in times.items()}
  def width(name, spec) -> int:  # the verify window: a chain's k + 1, a tree's N + 1 (auto: what it chose)
    if spec.auto:
      chosen = results[name][0].stats
      return chosen.k + 1 if chosen.tree is None else parse_tree(chosen.tree).nodes + 1
    return spec.k + 1 if spec.tree is None else spec.tree.nodes + 1

  v = pass_cost(target, [width(name, spec) for name, _, spec in cases[1:]])
  ref_rate = None
  if reference:
    ref_emitted = sum(o.stats.new_tokens for o in results[reference])
    ref_rate = ref_emitted / median[reference]
    v_ref = pass_cost(targets[reference], [2, 3, 5, 9, 17])

  base_rows = [o.rows()[0] for o in results["none"]]
  report = {"machine": machine(), "args": vars(args), "v": {str(t): r for t, r in v.items()}, "cases": {}}
  lines = [f"# Chains and trees: {args.target} ({args.dtype}), {len(rows)} prompts x {args.max_new_tokens} tokens, "
           f"batch 1, temperature {args.temperature}", "",
           f"Target alone: {median['none']:.2f} s (median of {args.repeats}); machine: {machine()}", ""]
  if reference:
    base_rate = sum(o.stats.new_tokens for o in results["none"]) / median["none"]
    lines += [f"Target alone in {args.reference_dtype} (the reference): {median[reference]:.2f} s; the target alone "
              f"({args.dtype}) runs {base_rate / ref_rate:.3f}x its tokens a second; its v(T)/v(1): "
              + ", ".join(f"v({t}) {r:.2f}" for t, r in v_ref.items() if t > 1)
              + f"; same tokens as the target alone: "
              f"{sum(o.rows()[0] == b for o, b in zip(results[reference], [r.rows()[0] for r in results['none']]))} / "
              f"{len(rows)}", ""]
    report["reference"] = {"dtype": args.reference_dtype, "seconds": median[reference],
                           "target_over_reference": base_rate / ref_rate, "v": {str(t): r for t, r in v_ref.items()}}
  lines += [
           "| case | tau | accepted by depth | accepted by sibling rank | same tokens as target alone | seconds | "
           "tokens (target alone) | speedup (tokens/s) | v(window)/v(1) | proposals a round |"
           + (" speedup over the reference |" if reference else ""),
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if reference else "")]
  base_emitted = sum(o.stats.new_tokens for o in results["none"])
  for name, _, spec in cases[1:]:
    if name == reference:
      continue
    outs = results[name]
    emitted = sum(o.stats.new_tokens for o in outs)
    row_rounds = sum(o.stats.row_rounds for o in outs)
    proposed = sum(o.stats.drafted_tokens for o in outs) / max(row_rounds, 1)  # a cutoff's: below k
    by_rank = np.sum([o.stats.accepted_by_rank or [0] for o in outs], axis=0).tolist()
    depth = [None if a is None else round(a, 3) for a in outs[0].stats.acceptance_by_position]
    same = sum(o.rows()[0] == b for o, b in zip(outs, base_rows))
    wide = width(name, spec)
    chosen = [o.stats.tree or f"k={o.stats.k}" for o in outs]
    trees_ran = any(o.stats.tree for o in outs)
    # Tokens a second against the target alone's: sampled rows differ in length from the baseline's (a row
    # ends at its stop token), so the ratio of times alone would compare different amounts of work.
    speedup = (emitted / median[name]) / (base_emitted / median["none"])
    entry = {"tau": emitted / max(row_rounds, 1), "seconds": median[name], "speedup": speedup,
             "new_tokens": emitted, "baseline_new_tokens": base_emitted,
             "compile_seconds": max(first[name] - median[name], 0.0), "same_tokens": same, "of": len(rows),
             "accepted_by_rank": by_rank if trees_ran else None, "v_window": v[wide],
             "acceptance_by_depth_first_prompt": depth, "chosen": chosen if spec.auto else None,
             "proposals_per_round": proposed,
             "speedup_over_reference": None if ref_rate is None else (emitted / median[name]) / ref_rate}
    report["cases"][name] = entry
    label = f"{name} (chose {', '.join(dict.fromkeys(chosen))})" if spec.auto else name
    lines.append(f"| {label} | {entry['tau']:.2f} | {depth} | {by_rank if trees_ran else '-'} | "
                 f"{same} / {len(rows)} | {median[name]:.2f} | {emitted} ({base_emitted}) | {entry['speedup']:.3f}x | "
                 f"{v[wide]:.2f} | {proposed:.2f} |"
                 + (f" {entry['speedup_over_reference']:.3f}x |" if reference else ""))
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trees.json").write_text(json.dumps(report, indent=1))
    (out / "trees.md").write_text(text)
  return report


if __name__ == "__main__":
  main()
