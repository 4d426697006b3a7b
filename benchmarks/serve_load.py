"""Load generator for ``specjax serve``, in the style of vLLM's ``benchmark_serving.py``.

    python benchmarks/serve_load.py [--methods none,auto] [--concurrency 1,2,4,8] [--rates 2,6]
        [--requests 48] [--batched-generate 1,8] [--soak 2000] [--baseline-src DIR] [--server-args ARGS]
        [--base-server-args ARGS] [--out benchmarks/results/serve]
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 ...   # a server started by hand

It starts one server process per method on 127.0.0.1 (``specjax serve`` with the bundled pair, or
``--random-init``, or ``--target NAME`` such as ``smollm2-135m-instruct``; method ``none``: the target alone,
``auto``: the ``--proposer`` (default the draft model) with k chosen per step among ``--ks``, ``k<N>``: the
proposer at a fixed k), warms each up, then drives them at each load:

- a concurrency sweep: ``c`` clients, each sending its next request as soon as the last one finished;
- Poisson arrivals at each request rate (exponential gaps, seeded), however many are in flight;

each load ``--repeats`` times, the methods interleaved in a rotating order (an idle server takes no CPU, so
the load of a shared machine drifts over every method alike), each run with the same ``--requests``
requests: prompts from a fixed set of code openings (the bundled
pair's domain), output lengths from a log-normal mix (median ``--median-tokens``, clipped to
``[--min-tokens, --max-tokens]``, ``ignore_eos`` so that each request generates exactly its length), greedy.
Requests stream (server-sent events with ``return_token_ids``), so every token's arrival is timed.

Reported per (method, load): TTFT (arrival to the first token), ITL (the gap between two chunks shared by
the tokens of the later chunk: a speculative round delivers several tokens at once), TPOT
(``(latency - TTFT) / (tokens - 1)`` per request), end-to-end latency, each as p50 / p90 / p99 over the
requests of every repeat; request and output-token throughput over each run's wall time, the median over
repeats; the acceptance rate and tau of the requests' own
rounds; and the steps the server ran per (width, k) during the point, from its ``/metrics`` (how the auto
policy chose k at that load).

``--baseline-src DIR`` also starts each method from the source tree DIR (``<method>@base``; for example a
``git archive`` of ``main``), so that before and after run side by side; ``--server-args`` are extra
``specjax serve`` options for this tree's servers only (``--base-server-args`` for DIR's: with DIR this tree and
both the same, an A/A check of the harness). The load average is recorded around every point.
``--distinct-prompts`` gives every request a prompt of its own, within a repeat and across the repeats and the
warm-up (a line ``# request R.i`` for request i of repeat R; the draws, so the prompts' text and output lengths,
are the same in every repeat): a ``--prompt-cache`` never hits a whole prompt; ``--shared-prefix`` opens every
prompt with the same file header (``PREAMBLE``, as a system prompt), where a prompt cache starts the rest from a
kept prompt.

``--batched-generate B[,B...]`` runs the same requests of the concurrency-``B`` point through ``specjax.generate`` in
calls of ``B`` in arrival order (static batching: a call runs to its longest request, and a request's latency
is its call's), compiled beforehand, in turn with the servers at concurrency ``B``, for the comparison with
continuous batching.
``--soak N`` sends N short requests to the first method's server at ``--soak-concurrency`` and reports its
resident memory and compiled programs after each quarter, and its traces before and after. Everything lands in ``--out`` as
``report.json``, ``report.md`` and ``serve_load.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

from specjax.bench import DEFAULT_PROMPTS

# Code openings (the bundled pair's domain): ten of the bench's prompts, in the order the recorded runs drew from.
PROMPTS = tuple(DEFAULT_PROMPTS[i] for i in (0, 1, 2, 3, 4, 5, 6, 8, 10, 15))


# A shared opening (--shared-prefix): what a system prompt or a project's file header is to every request.
PREAMBLE = """# Copyright the project authors. Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License. Unless required by applicable law or
# agreed to in writing, software distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied. See the License for the
# specific language governing permissions and limitations under the License.
#
# Style: four-space indents, type hints on public functions, docstrings that say what a function
# returns and raises, no bare except, and tests beside every module.
"""


@dataclasses.dataclass(frozen=True)
class Req:
  prompt: str
  max_tokens: int


def workload(n: int, seed: int, median: int, low: int, high: int, distinct: bool = False, prefix: str = "",
             tag: str = "") -> list[Req]:
  """``n`` requests: prompts drawn from PROMPTS, output lengths log-normal (sigma 0.6) around ``median``,
  clipped to ``[low, high]``; ``distinct``: request i's prompt opens with a line of its own (``# request
  {tag}i``), so that no two prompts are the same (a server's prompt cache never hits whole prompts; another
  ``tag`` for each repeat makes them distinct across repeats too), the draws unchanged; ``prefix``: every
  prompt opens with it (before that line; a server's prompt cache may start from it)."""
  rng = np.random.default_rng(seed)
  lengths = np.clip(np.round(median * np.exp(0.6 * rng.standard_normal(n))), low, high).astype(int)
  reqs = [Req(PROMPTS[int(rng.integers(len(PROMPTS)))], int(m)) for m in lengths]
  line = lambda i: f"# request {tag}{i}\n" if distinct else ""
  return [Req(f"{prefix}{line(i)}{r.prompt}", r.max_tokens) for i, r in enumerate(reqs)]


def bundled_requests(n: int):
  """The bundled pair's target and tokenizer, and the workload's first ``n`` requests (seed 0, the defaults of
  this harness) as they are sent (``Req``), as token ids, and as engine requests (greedy, ``ignore_eos``): what the
  in-process benchmarks (``serve_profile.py``, ``serve_inprocess.py``) drive."""
  import specjax
  from specjax import cli
  from specjax.request import Request

  pair = specjax.load(cli.DEFAULT_PAIR)
  reqs = workload(n, 0, 48, 8, 160)
  prompts = [pair.tokenizer.encode(r.prompt) for r in reqs]
  requests = [Request(tuple(ids), r.max_tokens, stop_ids=()) for ids, r in zip(prompts, reqs)]
  return pair.model, pair.tokenizer, reqs, prompts, requests


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
  """Arrival times (seconds from the start) of ``n`` requests of a Poisson process of ``rate`` per second."""
  gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
  return np.cumsum(gaps) - gaps[0]


@dataclasses.dataclass
class Record:
  """One request as the client saw it (times from its own send, in seconds)."""

  max_tokens: int
  ttft: float | None = None
  latency: float | None = None
  chunks: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (arrival, tokens in it)
  tokens: int = 0
  rounds: int = 0
  drafted: int = 0
  accepted: int = 0
  error: str | None = None

  def itl(self) -> list[float]:
    """Per token after the first chunk: the gap to the previous chunk over the tokens of the chunk."""
    out = []
    for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:]):
      out += [(t1 - t0) / n] * n
    return out


async def one_request(client, model: str, req: Req, temperature: float) -> Record:
  body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": temperature,
          "ignore_eos": True, "stream": True, "return_token_ids": True}
  rec = Record(req.max_tokens)
  start = time.perf_counter()
  try:
    async with client.stream("POST", "/v1/completions", json=body) as r:
      if r.status_code != 200:
        rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
        return rec
      async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        data = json.loads(line[6:])
        if "error" in data:
          rec.error = data["error"]["message"]
          continue
        n = len(data["choices"][0].get("token_ids") or [])
        now = time.perf_counter() - start
        if n:
          rec.ttft = now if rec.ttft is None else rec.ttft
          rec.chunks.append((now, n))
          rec.tokens += n
        spec = data.get("speculation")
        if spec:
          rec.rounds, rec.drafted, rec.accepted = spec["rounds"], spec["drafted_tokens"], spec["accepted_tokens"]
  except Exception as e:  # a failed request is reported, the run goes on
    rec.error = f"{type(e).__name__}: {e}"
  rec.latency = time.perf_counter() - start
  return rec


async def run_concurrency(url: str, model: str, reqs: list[Req], concurrency: int, temperature: float):
  import httpx

  queue = list(reversed(reqs))
  records: list[Record] = []
  async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
    async def worker():
      while queue:
        records.append(await one_request(c, model, queue.pop(), temperature))
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


async def run_rate(url: str, model: str, reqs: list[Req], rate: float, temperature: float, seed: int):
  import httpx

  arrivals = poisson_arrivals(len(reqs), rate, seed)
  async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=len(reqs) + 4)) as c:
    start = time.perf_counter()

    async def at(t: float, req: Req) -> Record:
      await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
      return await one_request(c, model, req, temperature)

    records = await asyncio.gather(*(at(t, r) for t, r in zip(arrivals, reqs)))
    return list(records), time.perf_counter() - start


def _pct(values, qs=(50, 90, 99)) -> dict[str, float | None]:
  values = np.asarray(values, float)
  return {f"p{q}": float(np.percentile(values, q)) if values.size else None for q in qs}


def summarise(records: list[Record], seconds: float) -> dict:
  ok = [r for r in records if r.error is None and r.tokens]
  rounds, drafted, accepted = (sum(getattr(r, f) for r in ok) for f in ("rounds", "drafted", "accepted"))
  tokens = sum(r.tokens for r in ok)
  return {
      "requests": len(records), "errors": len(records) - len(ok), "seconds": seconds,
      "ttft_s": _pct([r.ttft for r in ok]), "itl_s": _pct(sum((r.itl() for r in ok), [])),
      "tpot_s": _pct([(r.latency - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1 and len(r.chunks) > 1]),
      "latency_s": _pct([r.latency for r in ok]),
      "requests_per_s": len(ok) / seconds, "output_tokens_per_s": tokens / seconds, "output_tokens": tokens,
      "acceptance_rate": accepted / drafted if drafted else None,
      "tau": (accepted + rounds) / rounds if rounds else None,
      "exact_lengths": all(r.tokens == r.max_tokens for r in ok),
  }


# ------------------------------------------------------------------------------------------- servers


def scrape(url: str) -> dict:
  """The server's counters and gauges of interest, from /metrics."""
  import httpx
  from prometheus_client.parser import text_string_to_metric_families

  out: dict = {"steps": {}, "traces": {}}
  for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
    for s in family.samples:
      if s.name == "specjax_steps_total":
        out["steps"][f"w{s.labels['width']}/k{s.labels['k']}"] = s.value
      elif s.name in ("specjax_calls_total", "specjax_call_rounds_total"):
        out["steps"][f"{s.name.removeprefix('specjax_').removesuffix('_total')}/{s.labels['ended']}"] = s.value
      elif s.name == "specjax_prompt_cache_hits_total":  # requests that skipped their prefill (--prompt-cache)
        out["steps"]["prompt_cache/hits"] = s.value
      elif s.name == "specjax_prompt_cache_prefix_hits_total":  # requests prefilled from a kept prompt's caches
        out["steps"]["prompt_cache/prefix_hits"] = s.value
      elif s.name == "specjax_traces":
        out["traces"][s.labels["program"]] = s.value
      elif s.name == "process_cpu_seconds_total":  # the server process's CPU time (every thread)
        out["steps"]["cpu/server_s"] = s.value
      elif s.name == "specjax_policy_step_seconds":
        out.setdefault("policy_step_ms", {})[f"w{s.labels['width']}/k{s.labels['k']}"] = round(1e3 * s.value, 3)
      elif s.name == "specjax_rounds_per_call":
        out.setdefault("rounds_per_call", {})[f"w{s.labels['width']}"] = int(s.value)
      elif s.name == "specjax_attention_bucket" and s.value:
        out.setdefault("attention_buckets", {}).setdefault(f"w{s.labels['width']}", []).append(int(s.labels["bucket"]))
      elif s.name == "specjax_policy_expected_tau":
        out.setdefault("policy_expected_tau", {})[f"k{s.labels['k']}"] = round(s.value, 3)
      elif s.name in ("process_resident_memory_bytes", "specjax_compiled_programs", "specjax_generated_tokens_total",
                      "specjax_greedy_steps_pending"):
        out[s.name] = s.value
  return out


def _delta(after: dict, before: dict) -> dict:
  return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def start_server(method: str, args) -> tuple[subprocess.Popen, str]:
  """Starts ``specjax serve`` for ``method`` (its log in ``args.out``); wait for it with :func:`_wait_healthy`.
  ``<method>@base``: the same server from the source tree ``--baseline-src`` (for before/after in one run),
  with ``--base-server-args`` instead of ``--server-args``."""
  base = method.endswith("@base")
  method = method.removesuffix("@base")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  spec = (["--method", "none"] if method == "none" else ["--method", args.proposer, "--k", "auto", "--ks", args.ks]
          if method == "auto" else ["--method", args.proposer, "--k", method[1:]])
  cmd = [sys.executable, "-P", "-m", "specjax.cli", "serve", "--port", str(port), "--slots", str(args.slots),
         "--max-len", str(args.max_len), "--max-queue", "100000", "--log-level", "warning", *spec]
  if args.random_init:
    cmd.append("--random-init")
  elif args.target:
    cmd += ["--target", args.target]
  if args.dtype != "float32":
    cmd += ["--dtype", args.dtype]
  cmd += (args.base_server_args if base else args.server_args).split()
  env = dict(os.environ, PYTHONPATH=args.baseline_src) if base else None
  with open(os.path.join(args.out, f"server-{method}{'@base' if base else ''}.log"), "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
  return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc, url: str, log: str, seconds: float = 1800) -> None:
  import httpx

  deadline = time.monotonic() + seconds
  while True:
    if proc is not None and proc.poll() is not None:
      raise SystemExit(f"the server exited with {proc.returncode}: see {log}")
    try:
      if httpx.get(url + "/health", timeout=2).status_code == 200:
        return
    except httpx.TransportError:
      pass
    if time.monotonic() > deadline:
      raise SystemExit(f"the server did not start within {seconds:.0f} s: see {log}")
    time.sleep(1)


def model_name(url: str) -> str:
  import httpx

  return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


# ------------------------------------------------------------------------------------------- runs


def run_point(url: str, kind: str, value: float, reqs: list[Req], seed: int) -> tuple[list[Record], float, dict]:
  """One load point against one server: the records, the wall time and the steps the server ran (with the CPU
  seconds of the server process and of this client over the run: ``cpu/server_s``, ``cpu/client_s``)."""
  model = model_name(url)
  before = scrape(url)
  cpu = time.process_time()  # the load generator's own CPU time: it shares the machine with the server
  if kind == "concurrency":
    records, seconds = asyncio.run(run_concurrency(url, model, reqs, int(value), 0.0))
  else:
    records, seconds = asyncio.run(run_rate(url, model, reqs, float(value), 0.0, seed))
  cpu = time.process_time() - cpu
  after = scrape(url)
  after["steps"]["cpu/client_s"], before["steps"]["cpu/client_s"] = cpu, 0.0
  policy = {key: after[key] for key in ("policy_step_ms", "policy_expected_tau", "rounds_per_call", "attention_buckets")
            if key in after}
  return records, seconds, {**_delta(after["steps"], before["steps"]), **({"policy": policy} if policy else {})}


def sweep(urls: dict[str, str], args, reqs_for, generate_calls=None) -> list[dict]:
  """Every load point, each repeated ``args.repeats`` times with the methods interleaved (the order rotating),
  so that the machine's load drifts over all methods alike; every method runs ``reqs_for(R)`` in repeat R
  (``reqs_for("w")`` in the warm-up). At each concurrency B of ``generate_calls`` (``{B: runner}``) the batched
  generate calls of B take their turn among them. Throughputs are medians over the repeats; latency percentiles
  pool the requests of every repeat."""
  for url in urls.values():  # warm-up: every width, and acceptance for the policy
    asyncio.run(run_concurrency(url, model_name(url), reqs_for("w")[:2 * args.slots], args.slots, 0.0))
  rows = []
  for kind, value in [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.rates]:
    runners = {m: (lambda rep, url=url: run_point(url, kind, value, reqs_for(rep), args.seed + rep))
               for m, url in urls.items()}
    if kind == "concurrency" and value in (generate_calls or {}):
      runners["generate"] = generate_calls[value]
    methods = list(runners)
    runs: dict[str, list] = {m: [] for m in methods}
    from specjax.bench import load_average

    loads = [load_average()]
    for rep in range(args.repeats):
      for method in methods[rep % len(methods):] + methods[:rep % len(methods)]:
        runs[method].append(runners[method](rep))
    loads.append(load_average())
    for method in methods:
      records = [r for recs, _, _ in runs[method] for r in recs]
      per_rep = [summarise(recs, seconds) for recs, seconds, _ in runs[method]]
      steps: dict[str, float] = {}
      policy = None  # the auto policy's view after the point's last run
      for _, _, st in runs[method]:
        policy = st.get("policy", policy)
        for key, n in st.items():
          if key != "policy":
            steps[key] = steps.get(key, 0) + n
      load = ("batch", value) if method == "generate" else (kind, value)
      row = {"method": method, "load": load[0], "value": load[1],
             **summarise(records, sum(x for _, x, _ in runs[method])), "steps": steps, "repeats": args.repeats,
             "load_average": loads, **({"policy": policy} if policy else {})}
      for key in ("requests_per_s", "output_tokens_per_s"):
        row[key] = float(np.median([x[key] for x in per_rep]))
        row[key + "_repeats"] = [x[key] for x in per_rep]
      rows.append(row)
      print(f"{method:>8} {kind} {value}: {row['output_tokens_per_s']:.0f} tok/s (repeats "
            f"{[round(x) for x in row['output_tokens_per_s_repeats']]}), {row['errors']} errors, steps {steps}",
            file=sys.stderr, flush=True)
  return rows


def soak(url: str, args, parts: int = 4) -> dict:
  """``args.soak`` short requests at ``args.soak_concurrency``, in ``parts`` equal parts with the server's
  resident memory, compiled programs and traces read before and after each."""
  model = model_name(url)
  reqs = workload(args.soak, args.seed + 1, median=12, low=4, high=32)
  marks, records, seconds = [scrape(url)], [], 0.0
  for i in range(parts):
    part = reqs[i * len(reqs) // parts:(i + 1) * len(reqs) // parts]
    recs, secs = asyncio.run(run_concurrency(url, model, part, args.soak_concurrency, 0.0))
    records, seconds = records + recs, seconds + secs
    marks.append(scrape(url))
  return {"requests": len(reqs), "errors": sum(r.error is not None for r in records), "seconds": seconds,
          "concurrency": args.soak_concurrency, "output_tokens": sum(r.tokens for r in records),
          "after_requests": [i * len(reqs) // parts for i in range(parts + 1)],
          "rss_bytes": [m.get("process_resident_memory_bytes") for m in marks],
          "compiled_programs": [m.get("specjax_compiled_programs") for m in marks],
          "traces_before": marks[0]["traces"], "traces_after": marks[-1]["traces"]}


def batched_generate(args, reqs_for, batch: int):
  """A runner for :func:`sweep`: repeat R's requests (``reqs_for(R)``) through specjax.generate in calls of
  ``batch`` (target alone, greedy), each call to its longest request, a request's latency its call's. Every
  call of every repeat is compiled here."""
  import specjax
  from specjax import cli

  if args.random_init:
    target, _, tok = cli._random_pair()
  else:
    pair = specjax.load(args.target or cli.DEFAULT_PAIR, dtype=args.dtype)
    target, tok = pair.model, pair.tokenizer
  from specjax.decode import bucket_length, new_tokens_bound

  groups = lambda reqs: [reqs[i:i + batch] for i in range(0, len(reqs), batch)]
  call = lambda g: specjax.generate(target, [tok.encode(r.prompt) for r in g], max_new_tokens=max(r.max_tokens for r in g),
                                    eos_id=[])
  shapes = set()
  for rep in range(args.repeats):  # compile each program once: a call's batch, prompt bucket and length bound
    for g in groups(reqs_for(rep)):
      shape = (len(g), bucket_length(max(len(tok.encode(r.prompt)) for r in g)),
               new_tokens_bound(max(r.max_tokens for r in g)))
      if shape not in shapes:
        shapes.add(shape)
        call(g)

  def run(rep: int) -> tuple[list[Record], float, dict]:
    records, start = [], time.perf_counter()
    for g in groups(reqs_for(rep)):
      t = time.perf_counter()
      call(g)
      latency = time.perf_counter() - t
      records += [Record(r.max_tokens, ttft=latency, latency=latency, chunks=[(latency, r.max_tokens)],
                         tokens=r.max_tokens) for r in g]
    return records, time.perf_counter() - start, {}
  return run


# ------------------------------------------------------------------------------------------- output


def markdown(report: dict) -> str:
  m, s = report["machine"], report["settings"]
  ms = lambda d, q: "-" if d[q] is None else f"{d[q] * 1e3:.0f}"
  lines = ["# specjax serve under load", "",
           f"{m['cpu']} x{m['cores']}, jax {m['jax']}; load average at start {m['load_average']}, at end "
           f"{m.get('load_average_end')}. Model: {s['model']}; {s['slots']} slots, max_len {s['max_len']}, auto k "
           f"among {s['ks']}. {s['requests']} requests per run, {s['repeats']} runs per point and method interleaved "
           f"(throughputs: medians over runs; percentiles: over all requests), output lengths log-normal around "
           f"{s['median_tokens']} in [{s['min_tokens']}, {s['max_tokens']}] (ignore_eos), greedy, streamed.", "",
           "| method | load | req/s | tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | TPOT p50 ms "
           "| latency p50/p90/p99 ms | acc. | tau | load avg (1 min) | steps by width/k |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in report["results"]:
    load = f"c={r['value']}" if r["load"] == "concurrency" else f"{r['value']} req/s" if r["load"] == "rate" \
        else f"batches of {r['value']}"
    steps = ", ".join(f"{k}: {v:.1f}" if k.startswith("cpu/") else f"{k}: {int(v)}"
                      for k, v in sorted(r["steps"].items())) or "-"
    f2 = lambda x: "-" if x is None else f"{x:.2f}"
    lines.append(
        f"| {r['method']} | {load} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
        f"{'/'.join(ms(r['ttft_s'], q) for q in ('p50', 'p90', 'p99'))} | "
        f"{'/'.join(ms(r['itl_s'], q) for q in ('p50', 'p90', 'p99'))} | {ms(r['tpot_s'], 'p50')} | "
        f"{'/'.join(ms(r['latency_s'], q) for q in ('p50', 'p90', 'p99'))} | {f2(r['acceptance_rate'])} | "
        f"{f2(r['tau'])} | {'-' if 'load_average' not in r else '/'.join(f'{x[0]:.1f}' for x in r['load_average'])}"
        f" | {steps} |")
  views = [r for r in report["results"] if r.get("policy")]
  if views:
    lines += ["", "The server's view after each point's last run (the rounds of a full call by width; with auto, the "
              "policy's step-cost estimates in ms by width/k and E[tau] by k from the online acceptance):", ""]
    for r in views:
      load = f"c={r['value']}" if r["load"] == "concurrency" else f"{r['value']} req/s"
      view = r["policy"]
      lines.append(f"- {r['method']} {load}: rounds a call {view.get('rounds_per_call')}"
                   + (f", attention buckets {view['attention_buckets']}" if "attention_buckets" in view else "")
                   + (f", step ms {view['policy_step_ms']}, E[tau] {view.get('policy_expected_tau')}"
                      if "policy_step_ms" in view else ""))
  if report.get("goals"):
    lines += ["", "## Goals", ""] + [f"- {g}" for g in report["goals"]]
  if report.get("soak"):
    k = report["soak"]
    lines += ["", "## Soak", "",
              f"{k['requests']} requests ({k['output_tokens']} tokens, {k['errors']} errors) at concurrency "
              f"{k['concurrency']} in {k['seconds']:.0f} s, to the `{k['method']}` server after the sweep. Resident "
              "memory after 0, ... requests: " + ", ".join(f"{n}: {b / 2 ** 20:.1f} MiB" for n, b in
                                                          zip(k["after_requests"], k["rss_bytes"]))
              + f"; compiled programs {', '.join(f'{x:.0f}' for x in k['compiled_programs'])}; traces before "
              f"{k['traces_before']}, after {k['traces_after']}."]
  return "\n".join(lines) + "\n"


def paired_ratio(a: dict, b: dict, key: str) -> float:
  """The median over repeats of ``a[key] / b[key]`` run by run: the runs of one repeat ran back to back, so
  the ratio cancels the machine's load drifting between repeats (a median of medians does not)."""
  return float(np.median([x / y for x, y in zip(a[key + "_repeats"], b[key + "_repeats"])]))


def goals(results: list[dict], batches: list[int]) -> list[str]:
  """The issue's goals checked on this run's rows (ratios paired by repeat, :func:`paired_ratio`)."""
  out = []
  by = {(r["method"], r["load"], r["value"]): r for r in results}
  for batch in batches:
    gen = by.get(("generate", "batch", batch))
    for method in ("none", "none@base"):
      cb = by.get((method, "concurrency", batch))
      if not (cb and gen):
        continue
      ratio = paired_ratio(cb, gen, "requests_per_s")
      tok = paired_ratio(cb, gen, "output_tokens_per_s")
      out.append(f"`{method}` at concurrency {batch} (target alone): {ratio:.2f}x the request throughput "
                 f"({tok:.2f}x the tokens/s) of generate calls of {batch} (goal at 8: >= 1.5x; at 1: within 10 %); p90 "
                 f"latency {cb['latency_s']['p90'] * 1e3:.0f} ms against {gen['latency_s']['p90'] * 1e3:.0f} ms (goal: "
                 f"lower); load average {cb['load_average'][0]} .. {cb['load_average'][-1]}")
  for (method, load, value), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
    base = by.get(("none", load, value))
    if method != "auto" or base is None:
      continue
    ratios = [x / y for x, y in zip(r["output_tokens_per_s_repeats"], base["output_tokens_per_s_repeats"])]
    out.append(f"auto against the baseline at {load} {value}: {paired_ratio(r, base, 'output_tokens_per_s'):.3f}x "
               f"tokens/s (per repeat {', '.join(f'{x:.2f}' for x in ratios)}; goal >= 0.97"
               + (", > 1 at concurrency 1)" if (load, value) == ("concurrency", 1) else ")"))
  return out


def plot(report: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for method in sorted({r["method"] for r in report["results"]} - {"generate"}):
    rows = [r for r in report["results"] if r["method"] == method and r["load"] == "concurrency"]
    xs = [r["value"] for r in rows]
    axes[0].plot(xs, [r["output_tokens_per_s"] for r in rows], "o-", label=method)
    axes[1].plot(xs, [r["ttft_s"]["p50"] * 1e3 for r in rows], "o-", label=method)
    axes[2].plot(xs, [r["itl_s"]["p90"] * 1e3 for r in rows], "o-", label=method)
  for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "ITL p90 (ms)")):
    ax.set(xlabel="concurrency", xscale="log", title=title)
    ax.set_xticks(report["settings"]["concurrency"], [str(c) for c in report["settings"]["concurrency"]])
    ax.minorticks_off()
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ints = lambda s: [int(x) for x in s.split(",") if x]
  floats = lambda s: [float(x) for x in s.split(",") if x]
  p.add_argument("--url", help="drive this running server instead of starting one per method")
  p.add_argument("--methods", default="none,auto", help="none, auto or k<N>, comma-separated (default: none,auto)")
  p.add_argument("--concurrency", type=ints, default=[1, 2, 4, 8])
  p.add_argument("--rates", type=floats, default=[], help="Poisson request rates per second")
  p.add_argument("--requests", type=int, default=32, help="requests per load point and repeat")
  p.add_argument("--repeats", type=int, default=3, help="runs of each load point per method, interleaved")
  p.add_argument("--median-tokens", type=int, default=48)
  p.add_argument("--distinct-prompts", action="store_true",
                 help="each request's prompt opens with a line of its own (# request R.i), so that no two are the same "
                      "within a repeat or across the repeats and the warm-up (a server's --prompt-cache never hits a "
                      "whole prompt; the default workload draws its requests from 10 prompts)")
  p.add_argument("--shared-prefix", action="store_true",
                 help="every prompt opens with the same 8-line file header (PREAMBLE: 139 tokens of SmolLM2), as requests "
                      "share a system prompt (a server's --prompt-cache starts the rest from it)")
  p.add_argument("--min-tokens", type=int, default=8)
  p.add_argument("--max-tokens", type=int, default=160)
  p.add_argument("--slots", type=int, default=8)
  p.add_argument("--max-len", type=int, default=256)
  p.add_argument("--ks", default="0,1,2,4", help="the k the auto policy chooses among")
  p.add_argument("--batched-generate", type=ints, default=[], metavar="B,B...",
                 help="also run the requests through generate calls of each B (at concurrency B; default: not)")
  p.add_argument("--baseline-src", metavar="DIR",
                 help="also run each method from this source tree (method@base: before/after in one run)")
  p.add_argument("--server-args", default="", help="extra `specjax serve` options for this tree's servers")
  p.add_argument("--base-server-args", default="", help="extra `specjax serve` options for --baseline-src's servers "
                 "(an A/A check: --baseline-src this tree, both args the same)")
  p.add_argument("--soak", type=int, default=0, metavar="N", help="N short requests to the first method's server")
  p.add_argument("--soak-concurrency", type=int, default=8)
  p.add_argument("--random-init", action="store_true", help="small random models instead of the bundled pair")
  p.add_argument("--target", help="serve this model (a short name or path specjax.load takes; default: the bundled "
                 "pair's target)")
  p.add_argument("--proposer", default="draft", choices=("draft", "ngram", "suffix", "eagle", "medusa", "mtp"),
                 help="the proposer of auto and k<N> (default: draft, the bundled pair's draft model)")
  p.add_argument("--dtype", default="float32", help="the model's dtype, for the servers (`specjax serve --dtype`) "
                 "and the batched generate calls alike (a specjax.load dtype: float32, mixed, ...)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="benchmarks/results/serve")
  args = p.parse_args(argv)
  methods = [m for m in args.methods.split(",") if m]
  bad = [m for m in methods if m not in ("none", "auto") and not (m.startswith("k") and m[1:].isdigit())]
  if bad or not methods:
    p.error(f"--methods: none, auto or k<N>, got {args.methods!r}")
  if any(b not in args.concurrency for b in args.batched_generate):
    p.error(f"--batched-generate {args.batched_generate} compares with concurrencies of the sweep: add them to "
            "--concurrency")
  if args.random_init and args.target:
    p.error("--random-init and --target exclude each other")
  if args.baseline_src:
    methods += [m + "@base" for m in methods]
  if args.url and len(methods) != 1:
    p.error("--url drives one running server: pass the one method it runs in --methods")
  os.makedirs(args.out, exist_ok=True)

  from specjax.bench import load_average, machine

  reqs_for = lambda rep: workload(args.requests, args.seed, args.median_tokens, args.min_tokens, args.max_tokens,
                                  args.distinct_prompts, PREAMBLE if args.shared_prefix else "",
                                  f"{rep}." if args.distinct_prompts else "")
  reqs = reqs_for(0)
  report = {"machine": machine(), "results": [], "settings": {
      **{k: v for k, v in vars(args).items() if k not in ("url",)},
      "model": ("random-init" if args.random_init else args.target or "stdlib-coder (bundled pair)")
               + ("" if args.dtype == "float32" else f", dtype {args.dtype}"),
      "output_lengths": [r.max_tokens for r in reqs]}}
  procs, urls = [], {}
  try:
    # One server at a time, each alone on the machine while it compiles and takes its start-up timings (the
    # policy's cost of each k, the calls' fixed cost): servers compiling side by side skew each other's.
    for method in methods:
      if args.url:
        urls[method] = args.url
        continue
      proc, urls[method] = start_server(method, args)
      procs.append(proc)
      _wait_healthy(proc, urls[method], f"server-{method}.log")
      # steady state: the greedy step programs a server compiles while serving, compiled
      while scrape(urls[method]).get("specjax_greedy_steps_pending", 0):
        time.sleep(2)
    calls = {b: batched_generate(args, reqs_for, b) for b in args.batched_generate}
    report["results"] += sweep(urls, args, reqs_for, calls)
    if args.soak:
      report["soak"] = {"method": methods[0], **soak(urls[methods[0]], args)}
      print(f"soak: {report['soak']}", file=sys.stderr, flush=True)
  finally:
    for proc in procs:
      proc.terminate()
      proc.wait(120)
  report["goals"] = goals(report["results"], args.batched_generate)
  report["machine"]["load_average_end"] = load_average()
  with open(os.path.join(args.out, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(args.out, "report.md"), "w") as f:
    f.write(markdown(report))
  plot(report, os.path.join(args.out, "serve_load.png"))
  print(markdown(report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
