"""Regenerating conversations' answers: static calls of ``generate`` against continuous batching, in one run.

    python benchmarks/regeneration.py --target smollm2-135m-instruct --data RUNS/smollm2_kinds_prompts.jsonl \
        --n 32 --batch 16 --max-new-tokens 256 --repeats 2 --out benchmarks/results/regeneration

The first ``--n`` conversations of ``--data`` (OpenAI messages or ShareGPT lines, as ``specjax train heads --data``
reads them) have their assistant turns answered by the target (``--k`` proposals a round with its shipped head,
0: the target alone), once with ``conversations.batching = "static"`` (calls of ``--batch`` prompts to
``specjax.generate``, each running to its longest answer) and once with ``"continuous"`` (``--batch`` slots of
the serving engine, refilled as answers end), the two interleaved ``--repeats`` times after a first pass of each
over the same conversations (it compiles; its time is reported apart). Reported per method: answer tokens, seconds
(median), answer tokens a second, the ratio of the two, and whether greedy answers were equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import tempfile
import time

from specjax.bench import machine
from specjax.train import conversations as conv


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--target", default="smollm2-135m-instruct")
  ap.add_argument("--data", required=True, help="conversations or prompts, one JSON object a line")
  ap.add_argument("--n", type=int, default=32, help="conversations timed")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--k", type=int, default=0)
  ap.add_argument("--max-new-tokens", type=int, default=256)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)

  from specjax.train.trainer import conversation_source

  model, tokenizer, chat, proposer = conversation_source(pathlib.Path(args.target), conv.ConversationsConfig(path="-"))
  answerer = conv.Answerer(model, tokenizer, chat, proposer, args.k)
  lines = [line for line in pathlib.Path(args.data).read_text().splitlines() if line.strip()]
  timed = lines[:args.n]
  if len(timed) < args.n:
    raise SystemExit(f"--data has {len(lines)} lines; --n needs {args.n}")
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="regeneration-"))
  (tmp / "timed.jsonl").write_text("\n".join(timed) + "\n")
  base = conv.ConversationsConfig(path=str(tmp / "timed.jsonl"), shard_size=args.n, batch=args.batch,
                                  k=args.k, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
  methods = ("static", "continuous")

  def run(method: str, path: str, folder: pathlib.Path) -> tuple[float, list[dict]]:
    cfg = dataclasses.replace(base, batching=method, path=path)
    start = time.perf_counter()
    conv.prepare(cfg, folder, answerer=answerer, target=args.target)
    seconds = time.perf_counter() - start
    records = [json.loads(x) for p in sorted(folder.glob("shard-*.jsonl")) for x in p.read_text().splitlines()]
    return seconds, records

  warm_up = {m: run(m, str(tmp / "timed.jsonl"), tmp / f"first-{m}")[0] for m in methods}
  seconds: dict[str, list[float]] = {m: [] for m in methods}
  answers: dict[str, list[dict]] = {}
  for r in range(args.repeats):
    for m in (methods if r % 2 == 0 else methods[::-1]):
      s, records = run(m, str(tmp / "timed.jsonl"), tmp / f"{m}-{r}")
      seconds[m].append(s)
      answers[m] = records
  tokens = {m: sum(len(tokenizer.encode(t["content"])) for rec in answers[m] for t in rec["messages"]
                   if t["role"] == "assistant") for m in methods}
  report = {"machine": machine(), "args": vars(args), "warm_up_seconds": warm_up, "seconds": seconds,
            "answer_tokens": tokens, "greedy": args.temperature == 0,
            "same_answers": answers["static"] == answers["continuous"]}
  rate = {m: tokens[m] / statistics.median(seconds[m]) for m in methods}
  report["tokens_per_second"] = rate
  report["continuous_over_static"] = rate["continuous"] / rate["static"]
  for m in methods:
    print(f"{m:>10}: {tokens[m]} answer tokens, {statistics.median(seconds[m]):.1f} s (median of {args.repeats}; "
          f"warm-up {warm_up[m]:.1f} s), {rate[m]:.1f} tokens/s")
  print(f"continuous / static: {report['continuous_over_static']:.2f}x; same answers: {report['same_answers']}")
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "regeneration.json").write_text(json.dumps(report, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
