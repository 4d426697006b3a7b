"""Parallel draft (PARD) against the sequential draft, in one run: propose cost, τ and speedup.

    python benchmarks/pard.py --target stdlib-coder --out benchmarks/results/pard
    # SmolLM2-135M-Instruct: its shipped parallel draft (train/configs/smollm2_pard.toml) against the same
    # weights run sequentially (or --draft runs/smollm2_draft, a distilled draft), on held-out chat prompts
    # wrapped in its chat template, rows ending at its end of turn:
    python benchmarks/pard.py --target smollm2-135m-instruct --draft pard-sequential \
        --prompts runs/smollm2_heldout.jsonl --out benchmarks/results/pard/smollm2

1. Propose cost at k = 1, 2, 4, 8: the median seconds of one jitted ``propose`` at batch 1 (greedy) over a
   48-token context, for :class:`ParallelDraft` (one pass of 2k tokens) and :class:`DraftModel` (k one-token
   steps), compiled apart, ``block_until_ready`` before each clock read; reported as ratios to propose(1).
2. τ (tokens per round) and speedup over the target alone at k = 2, 4, 8 for both drafts: greedy, batch 1,
   held-out standard-library files (``specjax.train.data``'s test split, first 48 tokens each) or, with
   ``--prompts``, held-out chat prompts in the target's chat template; each configuration's first call
   (compilation) timed apart, then the median of ``--repeats`` interleaved repeats.

The parallel draft is the target's shipped one (``assets/<name>/pard/``) or ``--pard``, the sequential draft the
shipped one or ``--draft`` (each a run directory or an export folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

import specjax
from specjax import SamplingConfig, SpecConfig
from specjax.bench import machine
from specjax.proposers import Context, DraftModel, ParallelDraft
from specjax.sampling import Mode, Sampler, row_keys

GREEDY = SamplingConfig(temperature=0.0)
SAME_WEIGHTS = "pard-sequential"  # --draft: the parallel draft's own weights, run as a sequential draft


def without_mask_row(model):
  """The parallel draft as an ordinary draft over the target's vocabulary: its mask token's embedding row
  (and an untied LM head's column) dropped; proposals come from k one-token passes, no masks."""
  import dataclasses

  from flax import nnx

  from specjax.models import Llama

  graphdef, state = nnx.split(model)
  params = dict(nnx.to_pure_dict(state))
  params["embed"] = params["embed"][:-1]
  if not model.cfg.tie_embeddings:
    params["lm_head"] = params["lm_head"][:, :-1]
  cfg = dataclasses.replace(model.cfg, vocab_size=model.cfg.vocab_size - 1)
  new_def, new_state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(new_state, params)
  return nnx.merge(new_def, new_state)


def propose_cost(target, proposer, context: list[int], ks: list[int], repeats: int) -> dict[int, float]:
  """Median seconds of one ``propose`` at batch 1 after ``context``, per k (each k compiled apart). The state
  is donated and returned with its cache lengths reset, as a decode loop carries it (the cache written in
  place, every call from the same context)."""
  prompts = jnp.asarray([context], jnp.int32)
  lens = jnp.asarray([len(context)], jnp.int32)
  state = jax.jit(lambda p, n: proposer.init(target, p, n, None, 512))(prompts, lens)
  ctx = Context(last=prompts[:, -1], lengths=lens - 1, active=jnp.ones((1,), bool))
  sampler = Sampler(None, None, Mode(greedy=True))
  keys = row_keys(0, 1)
  fns = {}
  for k in ks:  # compiled apart, first
    def step(s, k=k):
      p = proposer.propose(s, target, ctx, keys, k, sampler, None)
      return p.drafts, p.q, dataclasses.replace(p.state, cache=p.state.cache.with_lengths(s.cache.lengths))

    fns[k] = jax.jit(step, donate_argnums=0)
    *_, state = jax.block_until_ready(fns[k](state))
  times = {k: [] for k in ks}
  for _ in range(repeats):  # interleaved: the machine's drift hits every k alike
    for k in ks:
      start = time.perf_counter()
      *_, state = jax.block_until_ready(fns[k](state))
      times[k].append(time.perf_counter() - start)
  out = {k: statistics.median(t) for k, t in times.items()}
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python benchmarks/pard.py")
  parser.add_argument("--target", default="stdlib-coder", help="a shipped pair with a draft and a parallel draft")
  parser.add_argument("--pard", default=None, help="a parallel draft run or export (default: the shipped one)")
  parser.add_argument("--draft", default=None,
                      help=f"a sequential draft run or export (default: the shipped one); {SAME_WEIGHTS!r}: the parallel "
                           "draft's own weights run sequentially (its mask row dropped)")
  parser.add_argument("--prompts", default=None,
                      help="held-out chat prompts (a text or JSONL file) instead of standard-library files")
  parser.add_argument("--n", type=int, default=4, help="held-out prompts")
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=2, help="timed repeats of each generation configuration")
  parser.add_argument("--propose-repeats", type=int, default=50)
  parser.add_argument("--out", default="benchmarks/results/pard")
  args = parser.parse_args(argv)

  from specjax import pretrained
  from specjax.train.data import documents

  def load_run(arg):
    path = pathlib.Path(arg)
    return pretrained.load_model(path / "model" if (path / "model" / "config.json").is_file() else path)

  loaded = specjax.load(args.target)
  target, tok = loaded.model, loaded.tokenizer
  pard_model = load_run(args.pard) if args.pard else loaded.pard
  draft_model = (without_mask_row(pard_model) if args.draft == SAME_WEIGHTS else load_run(args.draft) if args.draft
                 else loaded.draft)
  if pard_model is None:
    raise SystemExit(f"{args.target} ships no parallel draft: pass --pard RUN")
  if draft_model is None:
    raise SystemExit(f"{args.target} ships no sequential draft: pass --draft RUN")
  drafts = {"draft": DraftModel(draft_model), "pard": ParallelDraft(pard_model)}
  stop = None
  if args.prompts:
    from specjax.cli import read_prompts

    rows = [loaded.chat.encode(tok, [{"role": "user", "content": t}]) for t in read_prompts(args.prompts)[: args.n]]
    stop = loaded.chat.stop_ids(tok)
  else:
    rows = [tok.encode(d)[:48] for d in documents("stdlib", "test")[: args.n]]

  ks = [1, 2, 4, 8]
  cost = {name: propose_cost(target, p, rows[0], ks, args.propose_repeats) for name, p in drafts.items()}
  for name in drafts:
    print(f"propose {name}: " + ", ".join(f"k={k} {cost[name][k] * 1e3:.3f} ms" for k in ks), flush=True)

  cases = [("target alone", None, None)] + [(f"{name} k={k}", p, SpecConfig(k=k))
                                            for k in (2, 4, 8) for name, p in drafts.items()]

  def run(proposer, spec):
    outs = []
    for row in rows:  # batch 1
      out = specjax.generate(target, [row], proposer=proposer, spec=spec, sampling=GREEDY,
                             max_new_tokens=args.max_new_tokens, eos_id=stop, seed=0)
      jax.block_until_ready(out.tokens)
      outs.append(out)
    return outs

  first, results = {}, {}
  for name, proposer, spec in cases:
    start = time.perf_counter()
    results[name] = run(proposer, spec)
    first[name] = time.perf_counter() - start
    print(f"{name}: first call {first[name]:.1f} s", flush=True)
  times = {name: [] for name, _, _ in cases}
  for _ in range(args.repeats):
    for name, proposer, spec in cases:
      start = time.perf_counter()
      run(proposer, spec)
      times[name].append(time.perf_counter() - start)
  median = {name: statistics.median(t) for name, t in times.items()}
  base_tokens = [o.rows()[0] for o in results["target alone"]]
  table = []
  for name, proposer, spec in cases:
    outs = results[name]
    assert [o.rows()[0] for o in outs] == base_tokens, f"{name}: greedy output differs from the target's"
    new = sum(int(o.lengths[0]) for o in outs)
    row = {"case": name, "seconds": median[name], "first_call_s": first[name], "tokens": new,
           "tokens_per_s": new / median[name], "speedup": median["target alone"] / median[name]}
    if proposer is not None:
      rounds = sum(o.stats.row_rounds for o in outs)
      accepted = sum(o.stats.accepted_tokens for o in outs)
      row.update(tau=(accepted + rounds) / rounds, rounds=rounds, catch_ups=sum(o.stats.catch_ups for o in outs))
    table.append(row)
    print(json.dumps(row), flush=True)

  report = {"machine": machine(), "target": args.target, "prompts": len(rows), "prompt_source": args.prompts or "stdlib test split",
            "prompt_tokens": [len(r) for r in rows],
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
            "propose_seconds": {name: {str(k): v for k, v in c.items()} for name, c in cost.items()},
            "propose_ratio_to_k1": {name: {str(k): c[k] / c[1] for k in ks} for name, c in cost.items()},
            "generate": table}
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "pard.json").write_text(json.dumps(report, indent=2) + "\n")
  source = (f"held-out chat prompts ({args.prompts}, chat template, ending at end of turn)" if args.prompts
            else "held-out stdlib files (48-token prompts)")
  lines = [f"# Parallel draft against the sequential draft: {args.target}, greedy, batch 1", "",
           f"{len(rows)} {source} x up to {args.max_new_tokens} new tokens; median of "
           f"{args.repeats} repeats after a compiling first call; propose cost the median of {args.propose_repeats}.",
           "", "| k | propose draft (ms) | propose pard (ms) | draft / draft(1) | pard / pard(1) |",
           "|---|---|---|---|---|"]
  for k in ks:
    lines.append(f"| {k} | {cost['draft'][k] * 1e3:.3f} | {cost['pard'][k] * 1e3:.3f} | "
                 f"{cost['draft'][k] / cost['draft'][1]:.2f} | {cost['pard'][k] / cost['pard'][1]:.2f} |")
  lines += ["", "| case | τ | tokens/s | speedup vs target alone |", "|---|---|---|---|"]
  for row in table:
    tau = f"{row['tau']:.2f}" if "tau" in row else "-"
    lines.append(f"| {row['case']} | {tau} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x |")
  (out / "pard.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return report


if __name__ == "__main__":
  main()
