"""What logit adjustments (penalties, logit bias) and filters cost, side by side with plain sampling, in one run.

    python benchmarks/penalty_cost.py [--batch 8] [--tokens 64] [--repeats 5] [--out DIR]

On the bundled pair, for the target alone, the draft model and the shipped EAGLE-3 head (k = 4): tokens/s of
``generate`` at temperature 0.8 plain, with top-k / top-p / min-p, and with presence, frequency and repetition
penalties and a logit bias, each the median of ``repeats`` calls after a warm-up call (compile time reported
apart), the cases interleaved call by call. Ratios are against plain sampling with the same proposer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

import specjax
from specjax import SamplingConfig, SpecConfig
from specjax.proposers import DraftModel, for_heads

from compare_revisions import PROMPTS

SETTINGS = {
    "plain": SamplingConfig(0.8),
    "filters": SamplingConfig(0.8, top_k=50, top_p=0.95, min_p=0.05),
    "penalties": SamplingConfig(0.8, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                                logit_bias={13: -5.0}),
}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                    "penalty-cost"))
  args = parser.parse_args(argv)
  pair = specjax.load("stdlib-coder")
  rows = [pair.tokenizer.encode(p) for p in (PROMPTS * args.batch)[:args.batch]]
  proposers = {"none": None, "draft": DraftModel(pair.draft), "eagle": for_heads(pair.heads["eagle"])}
  calls, compile_s, times = {}, {}, {}
  for name, proposer in proposers.items():
    for setting, cfg in SETTINGS.items():
      spec = SpecConfig(k=0 if proposer is None else 4)
      calls[name, setting] = lambda p=proposer, c=cfg, s=spec: specjax.generate(
          pair.model, rows, proposer=p, spec=s, sampling=c, max_new_tokens=args.tokens, seed=1)
      start = time.perf_counter()
      jax.block_until_ready(calls[name, setting]().tokens)
      compile_s[name, setting] = time.perf_counter() - start
      times[name, setting] = []
  for _ in range(args.repeats):
    for case, call in calls.items():
      start = time.perf_counter()
      out = call()  # numpy outputs: the device is done
      times[case].append(time.perf_counter() - start)
      del out
  report = {"batch": args.batch, "tokens": args.tokens, "repeats": args.repeats, "backend": jax.default_backend(),
            "load_average": list(os.getloadavg()), "cases": {}}
  lines = [f"batch {args.batch}, {args.tokens} new tokens, medians of {args.repeats} calls (interleaved), "
           f"backend {jax.default_backend()}, load average {report['load_average']}", "",
           "| proposer | setting | tok/s | / plain | first call (compile) s |", "|---|---|---|---|---|"]
  for (name, setting), ts in times.items():
    tps = args.batch * args.tokens / statistics.median(ts)
    plain = args.batch * args.tokens / statistics.median(times[name, "plain"])
    report["cases"][f"{name} {setting}"] = {"tokens_per_s": tps, "over_plain": tps / plain,
                                            "first_call_s": compile_s[name, setting]}
    lines.append(f"| {name} | {setting} | {tps:.0f} | {tps / plain:.3f} | {compile_s[name, setting]:.1f} |")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(args.out, "report.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
