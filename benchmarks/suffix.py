"""Suffix decoding, the combined proposer and the others, side by side in one run, on two workloads.

    # A repetitive workload through `specjax serve` (one server per method, requests interleaved):
    python benchmarks/suffix.py server --target smollm2-135m-instruct --out benchmarks/results/suffix/server
    # Held-out chat prompts through `specjax.generate` at batch 1:
    python benchmarks/suffix.py chat --target smollm2-135m-instruct --prompts runs/smollm2_heldout.jsonl \
        --out benchmarks/results/suffix/chat

**server**: code from held-out files of the standard library (the valid and test splits: no head or draft trained on them),
each function asked about in four ways that copy it (add a docstring, comment it, the docstring request
phrased again, copy it and explain it), wrapped in the chat template, greedy, ``--max-tokens`` each. One
``specjax serve`` process per method (``--methods``; default: the target alone, suffix decoding on the
request's own context only (``--store-capacity 0``), suffix decoding with the server's global store of
finished answers, the shipped EAGLE head at k = 2, and the combination of suffix decoding and the head), all
warmed up first; then every request goes to every server in turn (a rotating order), one at a time (batch 1),
so that the machine's drift falls on every method alike; the servers not being asked are paused (SIGSTOP), so
that their idle threads take no CPU from the one that is. Reported per method: τ and the acceptance rate from
the responses' usage, acceptance by position from the server's metrics, the sum of request latencies and its
ratio to the target alone's (the speedup), the median of per-request ratios, and whether every answer equals
the target alone's. A request runs once per server (repeating it would let the global store see its own
answer), so each figure is over the workload's requests, not repeats.

**chat**: held-out chat prompts at batch 1, greedy (and ``--temperature``), through ``generate``: the target
alone, the head (k = 2), n-gram (k = 4), suffix decoding (k = 8), and the combination (suffix at k = 8, the head
capped at 2 proposals); the median over ``--repeats`` interleaved repeats after a first call that compiles
(reported apart), ``block_until_ready`` before each clock read; also v(T)/v(1) for the windows used.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from serve_load import _wait_healthy  # benchmarks/ is the script's folder

DEFAULT_SERVER_METHODS = "none,suffix-own,suffix,eagle,combined"
SERVER_SPECS = {  # method -> `specjax serve` arguments
    "none": ["--method", "none"],
    "suffix-own": ["--method", "suffix", "--k", "8", "--store-capacity", "0"],
    "suffix": ["--method", "suffix", "--k", "8"],
    "ngram": ["--method", "ngram", "--k", "4"],
    "eagle": ["--method", "eagle", "--k", "2"],
    "combined": ["--method", "combined", "--k", "8", "--member-k", "2"],
}
TASKS = (
    "Add a docstring to this Python function and show the whole function:\n\n```python\n{code}\n```",
    "Rewrite this function with a comment above each line. Keep the code the same.\n\n```python\n{code}\n```",
    "Please add a short docstring to the following function. Reply with the complete function.\n\n```python\n{code}\n```",
    "Copy this function exactly, then say in one sentence what it does:\n\n```python\n{code}\n```",
)


def repetitive_prompts(n_functions: int, seed: int) -> list[str]:
  """Four copy-heavy requests about each of ``n_functions`` held-out standard-library functions, in order."""
  from specjax.train import data as data_lib
  from specjax.train.instructions import _functions

  root, files = data_lib.corpus_files("stdlib")
  items = []
  for path in files:
    name = path.relative_to(root).as_posix()
    if data_lib.split_of(name) == "train" or "test" in name:  # held out: the valid and test splits
      continue
    items += [f for f in _functions(path, name) if 6 <= f["code"].count("\n") <= 20]
  rng = np.random.default_rng(seed)
  picks = rng.choice(len(items), size=n_functions, replace=False)
  return [task.format(code=items[i]["code"]) for i in picks for task in TASKS]


# ------------------------------------------------------------------------------------------- server


def start_server(method: str, args) -> tuple[subprocess.Popen, str]:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, "-P", "-m", "specjax.cli", "serve", "--port", str(port), "--slots", "1", "--target",
         args.target, "--max-len", str(args.max_len), "--log-level", "warning", *SERVER_SPECS[method]]
  with open(os.path.join(args.out, f"server-{method}.log"), "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
  return proc, f"http://127.0.0.1:{port}"


def by_position(url: str) -> list[float | None]:
  """Acceptance by position since the server started, from its metrics."""
  import httpx
  from prometheus_client.parser import text_string_to_metric_families

  reached, accepted = {}, {}
  for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
    for s in family.samples:
      if s.name == "specjax_reached_total":
        reached[int(s.labels["position"])] = s.value
      elif s.name == "specjax_accepted_at_total":
        accepted[int(s.labels["position"])] = s.value
  return [round(accepted.get(i, 0) / reached[i], 3) if reached.get(i) else None for i in range(1, max(reached, default=0) + 1)]


def run_server(args) -> dict:
  import httpx

  methods = args.methods.split(",")
  bad = [m for m in methods if m not in SERVER_SPECS]
  if bad or "none" not in methods:
    raise SystemExit(f"--methods must include none and be among {sorted(SERVER_SPECS)}, got {args.methods}")
  prompts = repetitive_prompts(args.functions, args.seed)
  procs, urls = {}, {}
  try:
    for method in methods:  # one at a time: each compiles on both cores
      procs[method], urls[method] = start_server(method, args)
      start = time.perf_counter()
      _wait_healthy(procs[method], urls[method], os.path.join(args.out, f"server-{method}.log"))
      print(f"{method}: up in {time.perf_counter() - start:.0f} s", flush=True)
    for proc in procs.values():  # an idle server's threads still wake up: only the one being asked runs
      proc.send_signal(signal.SIGSTOP)
    results = {m: [] for m in methods}
    client = httpx.Client(timeout=600)
    for i, prompt in enumerate(prompts):
      order = methods[i % len(methods):] + methods[:i % len(methods)]
      for method in order:
        body = {"model": args.target, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
                "temperature": 0.0}
        procs[method].send_signal(signal.SIGCONT)
        start = time.perf_counter()
        reply = client.post(urls[method] + "/v1/chat/completions", json=body)
        seconds = time.perf_counter() - start
        procs[method].send_signal(signal.SIGSTOP)
        if reply.status_code != 200:
          raise SystemExit(f"{method}: request {i} failed: {reply.status_code} {reply.text[:300]}")
        data = reply.json()
        results[method].append({"seconds": seconds, "text": data["choices"][0]["message"]["content"],
                                "usage": {**data["usage"], **data.get("speculation", {})}})
      print(f"request {i + 1}/{len(prompts)}: " + ", ".join(
          f"{m} {results[m][-1]['seconds']:.2f}s" for m in methods), flush=True)
    positions = {}
    for m in methods:
      procs[m].send_signal(signal.SIGCONT)
      positions[m] = by_position(urls[m])
  finally:
    for proc in procs.values():
      proc.send_signal(signal.SIGCONT)
      proc.terminate()
    for proc in procs.values():
      proc.wait(timeout=60)
  base = results["none"]
  report = {"machine": _machine(), "args": vars(args), "requests": len(prompts), "methods": {}}
  lines = [f"# A repetitive workload through specjax serve: {args.target}, {len(prompts)} requests "
           f"({args.functions} held-out functions x {len(TASKS)} copy-heavy tasks), greedy, batch 1, "
           f"max_tokens {args.max_tokens}", "", f"Machine: {_machine()}", "",
           "| method | server arguments | tau | acceptance rate | acceptance by position | seconds (sum) | speedup | "
           "median per-request speedup | same text as target alone |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for method in methods:
    rows = results[method]
    rounds = sum(r["usage"].get("rounds") or 0 for r in rows)
    drafted = sum(r["usage"].get("drafted_tokens") or 0 for r in rows)
    accepted = sum(r["usage"].get("accepted_tokens") or 0 for r in rows)
    total = sum(r["seconds"] for r in rows)
    entry = {"tau": (accepted + rounds) / rounds if rounds else None,
             "acceptance_rate": accepted / drafted if drafted else None,
             "acceptance_by_position": positions[method], "seconds": total,
             "speedup": sum(r["seconds"] for r in base) / total,
             "median_request_speedup": statistics.median(b["seconds"] / r["seconds"] for b, r in zip(base, rows)),
             "same_text": sum(r["text"] == b["text"] for r, b in zip(rows, base)),
             "completion_tokens": sum(r["usage"]["completion_tokens"] for r in rows)}
    report["methods"][method] = entry
    fmt = lambda x: "-" if x is None else f"{x:.2f}"
    lines.append(f"| {method} | `{' '.join(SERVER_SPECS[method])}` | {fmt(entry['tau'])} | "
                 f"{fmt(entry['acceptance_rate'])} | {positions[method] or '-'} | {total:.1f} | "
                 f"{entry['speedup']:.3f}x | {entry['median_request_speedup']:.3f}x | "
                 f"{entry['same_text']} / {len(rows)} |")
  report["texts"] = {m: [r["text"] for r in results[m]] for m in methods}
  return report, "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- chat


def run_chat(args) -> dict:
  import jax

  import specjax
  from specjax import SamplingConfig, SpecConfig, proposers
  from specjax.cli import read_prompts
  from trees import pass_cost

  loaded = specjax.load(args.target)
  target, tok = loaded.model, loaded.tokenizer
  texts = read_prompts(args.prompts)[:args.n]
  rows = [loaded.chat.encode(tok, [{"role": "user", "content": t}]) for t in texts]
  stops = loaded.chat.stop_ids(tok)
  head = proposers.for_heads(loaded.heads["eagle"])
  suffix = proposers.Suffix()
  cases = [("none", None, SpecConfig(k=0)), ("eagle k=2", head, SpecConfig(k=2)),
           ("ngram k=4", proposers.NGram(), SpecConfig(k=4)), ("suffix k=8", suffix, SpecConfig(k=8)),
           ("suffix k=4", suffix, SpecConfig(k=4)),
           ("combined suffix k=8 + eagle <= 2", proposers.Combined((suffix, head), ks=(None, 2)), SpecConfig(k=8)),
           ("combined suffix k=4 + eagle <= 2", proposers.Combined((suffix, head), ks=(None, 2)), SpecConfig(k=4))]
  if args.cases:
    wanted = ["none"] + [c.strip() for c in args.cases.split(";") if c.strip()]
    unknown = [c for c in wanted if c not in [name for name, _, _ in cases]]
    if unknown:
      raise SystemExit(f"--cases: unknown {unknown}; the cases are {[name for name, _, _ in cases]}")
    cases = [c for c in cases if c[0] in wanted]
  report = {"machine": _machine(), "args": vars(args), "temperatures": {}}
  lines = [f"# Held-out chat prompts: {args.target}, {len(rows)} prompts x {args.max_new_tokens} tokens, batch 1", "",
           f"Machine: {_machine()}", ""]
  for temperature in args.temperatures:
    sampling = SamplingConfig(temperature=temperature)

    def run(proposer, spec):
      outs = []
      for row in rows:
        out = specjax.generate(target, [row], proposer=proposer, spec=spec, sampling=sampling,
                               max_new_tokens=args.max_new_tokens, eos_id=stops, seed=0)
        jax.block_until_ready(out.tokens)
        outs.append(out)
      return outs

    first, results = {}, {}
    for name, proposer, spec in cases:
      start = time.perf_counter()
      results[name] = run(proposer, spec)
      first[name] = time.perf_counter() - start
    times = {name: [] for name, _, _ in cases}
    for _ in range(args.repeats):
      for name, proposer, spec in cases:
        start = time.perf_counter()
        run(proposer, spec)
        times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    base_rows = [o.rows()[0] for o in results["none"]]
    entries = {}
    lines += [f"## temperature {temperature}", "", f"Target alone: {median['none']:.2f} s (median of {args.repeats})", "",
              "| case | tau | acceptance by position (first prompt) | same tokens | seconds | speedup | compile s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, _, spec in cases[1:]:
      outs = results[name]
      tau = sum(o.stats.new_tokens for o in outs) / max(sum(o.stats.row_rounds for o in outs), 1)
      depth = [None if a is None else round(a, 2) for a in outs[0].stats.acceptance_by_position]
      same = sum(o.rows()[0] == b for o, b in zip(outs, base_rows))
      entries[name] = {"tau": tau, "seconds": median[name], "speedup": median["none"] / median[name],
                       "compile_seconds": max(first[name] - median[name], 0.0), "same_tokens": same,
                       "acceptance_by_position_first_prompt": depth}
      lines.append(f"| {name} | {tau:.2f} | {depth} | {same} / {len(rows)} | {median[name]:.2f} | "
                   f"{median['none'] / median[name]:.3f}x | {entries[name]['compile_seconds']:.1f} |")
    lines.append("")
    report["temperatures"][str(temperature)] = {"target_alone_seconds": median["none"], "cases": entries}
  v = pass_cost(target, [3, 5, 9])
  report["v"] = v
  lines.append("v(T)/v(1): " + ", ".join(f"v({t}) {r:.2f}" for t, r in sorted(v.items())))
  return report, "\n".join(lines) + "\n"


def _machine() -> str:
  from specjax.bench import machine

  return machine()


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("part", choices=("server", "chat"))
  parser.add_argument("--target", default="smollm2-135m-instruct")
  parser.add_argument("--out", default=None)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--methods", default=DEFAULT_SERVER_METHODS, help=f"server: among {sorted(SERVER_SPECS)}")
  parser.add_argument("--functions", type=int, default=3, help="server: held-out functions (4 requests each)")
  parser.add_argument("--max-tokens", type=int, default=160, help="server: max_tokens per request")
  parser.add_argument("--max-len", type=int, default=768, help="server: positions per slot")
  parser.add_argument("--prompts", default="runs/smollm2_heldout.jsonl", help="chat: held-out chat prompts")
  parser.add_argument("--n", type=int, default=4, help="chat: prompts")
  parser.add_argument("--max-new-tokens", type=int, default=64, help="chat: tokens per prompt")
  parser.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cases", default=None,
                      help="chat: a ';'-separated subset of the cases (the target alone always runs), e.g. "
                           "'eagle k=2;suffix k=4;combined suffix k=4 + eagle <= 2'")
  args = parser.parse_args(argv)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
  else:
    args.out = "."
  report, text = run_server(args) if args.part == "server" else run_chat(args)
  print(text)
  out = pathlib.Path(args.out)
  (out / f"{args.part}.json").write_text(json.dumps(report, indent=1))
  (out / f"{args.part}.md").write_text(text)


if __name__ == "__main__":
  main()
