"""``specjax bench``: target-only against speculation, measured side by side, against the cost model.

For every sampling mode and batch size the request set and target are fixed; the baseline (method
``none``) and, for each proposer (any of :mod:`specjax.proposers`), every fixed k, ``k="auto"`` and the dynamic schedule
run interleaved within each repeat (the order rotating between repeats), after a warm-up run that also
gives the compile time. The cost model's calibration is timed once per repeat as well, so that it shares
the measured runs' load conditions. Every run goes through :func:`specjax.generate`, whose results are
host arrays, so each clock is read after the device finished (the equivalent of ``block_until_ready``).
Figures are medians (and p90) over repeats:

- time to first token (a run with ``max_new_tokens=1``: prefill + one round),
- inter-token latency per run ``(t(N) - t(1)) / (N - 1)``: mean, p50, p90 over repeats,
- output tokens/s ``B * N / t(N)`` and requests/s ``B / t(N)``,
- acceptance rate, tau, acceptance by position, the k that ``auto`` chose,
- memory: parameter bytes of target and proposer, the target's KV-cache bytes and the proposer's state bytes,
  device peak bytes where reported,
- the cost model's prediction for each run (from the run's own rounds and catch-up steps), its a-priori
  prediction (from the acceptance measured at the largest k), and the measured speedup.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import costmodel, engine
from specjax.cache import cache_bytes
from specjax.config import SamplingConfig, SpecConfig
from specjax.decode import bucket_length, generate
from specjax.proposers import PROPOSERS, Proposer
SAMPLINGS = {"greedy": SamplingConfig(temperature=0.0), "sample": SamplingConfig(temperature=1.0)}


def sampling_named(name: str) -> SamplingConfig:
  """``"greedy"``, ``"sample"`` (temperature 1) or ``"t<temperature>"`` (for example ``"t0.7"``).

  Raises:
    ValueError: naming the allowed forms.
  """
  if name in SAMPLINGS:
    return SAMPLINGS[name]
  try:
    temperature = float(name[1:]) if name.startswith("t") else None
  except ValueError:
    temperature = None
  if temperature is not None:
    return SamplingConfig(temperature=temperature)  # its own errors name the value
  raise ValueError(f"samplings must be names among greedy, sample (temperature 1) or t<temperature> "
                   f"(for example t0.7), got {name!r}")

# A fixed request set: the openings of typical Python source, the domain of the bundled pair.
DEFAULT_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "    for i in range(len(self.items)):\n        if self.items[i] is None:\n",
    "from collections import defaultdict\n\n\ndef group_by(items, key):\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__,",
    "try:\n    import json\nexcept ImportError:\n    json = None\n\n",
    "    @property\n    def name(self):\n",
    "def read_lines(path, encoding='utf-8'):\n    with open(path, encoding=encoding) as f:\n",
    "        if not isinstance(value, str):\n            raise TypeError(",
    "class TestParser(unittest.TestCase):\n\n    def setUp(self):\n",
    "    return sorted(result, key=lambda x:",
    "def _check_arg(name, value, allowed):\n",
    "        self.assertEqual(",
    "__all__ = ['",
    "    while True:\n        line = stream.readline()\n        if not line:\n",
)


@dataclasses.dataclass(frozen=True)
class BenchSettings:
  """What ``specjax bench`` sweeps. ``pilot_prompts``: token-id prompts that every ``k="auto"`` case pilots on
  (:attr:`specjax.SpecConfig.pilot_prompts`, the same set at every batch size); None: each case's own prompts."""

  batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
  ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
  samplings: tuple[str, ...] = ("greedy", "sample")
  methods: tuple[str, ...] = ("draft", "ngram")
  max_new_tokens: int = 64
  repeats: int = 5
  auto: bool = True
  dynamic: bool = True
  seed: int = 0
  calibration_repeats: int = 7
  calibration_min_seconds: float = 0.01
  pilot_prompts: Any = None

  def __post_init__(self):
    if self.pilot_prompts is not None:  # checked (and made hashable) as SpecConfig checks them
      if not self.auto:
        raise ValueError("pilot_prompts are what the k='auto' cases measure acceptance on: they need auto=True")
      object.__setattr__(self, "pilot_prompts", SpecConfig(k="auto", pilot_prompts=self.pilot_prompts).pilot_prompts)
    if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
      raise ValueError(f"batch_sizes must be integers >= 1, got {self.batch_sizes}")
    if not self.ks or any(not isinstance(k, int) or not 1 <= k <= 32 for k in self.ks):
      raise ValueError(f"ks must be integers in [1, 32], got {self.ks}")
    if not self.samplings:
      raise ValueError("samplings must name at least one of greedy, sample or t<temperature>")
    for name in self.samplings:
      sampling_named(name)
    bad = [m for m in self.methods if m not in PROPOSERS]
    if bad or not self.methods:
      raise ValueError(f"methods must be a non-empty subset of {tuple(PROPOSERS)}, got {self.methods}")
    if self.max_new_tokens < 2:
      raise ValueError(f"max_new_tokens must be >= 2 (latency needs two points), got {self.max_new_tokens}")
    if self.repeats < 1:
      raise ValueError(f"repeats must be >= 1, got {self.repeats}")
    if self.calibration_repeats < 1 or not self.calibration_min_seconds > 0:
      raise ValueError(f"calibration_repeats must be >= 1 and calibration_min_seconds > 0, got "
                       f"{self.calibration_repeats} and {self.calibration_min_seconds}")


QUICK = BenchSettings(batch_sizes=(1, 4), ks=(2, 4), samplings=("greedy",), max_new_tokens=32, repeats=3,
                      calibration_repeats=5)


def cpu_name() -> str:
  """The CPU model from /proc/cpuinfo where there is one."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
  """The 1, 5 and 15 minute load averages (2 decimals), or None where the system has none."""
  return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine(**extra: Any) -> dict[str, Any]:
  """The machine a benchmark runs on, for its report (one description for ``specjax bench`` and the
  side-by-side harness in ``benchmarks/``).

  Args:
    **extra: fields a caller adds (for example a thread count, or another library's version); they may not
      replace the fields below.

  Returns:
    A JSON-ready dict: ``backend``, ``device_kind``, ``device_count``, ``cpu``, ``cores`` (all CPUs),
    ``schedulable_cpus`` (those this process may run on), ``jax``, ``python``, ``platform``, ``xla_flags``
    and ``load_average`` (now), then ``extra``.

  Raises:
    ValueError: an ``extra`` field that names one of the fields above.
  """
  dev = jax.devices()[0]
  schedulable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  out = {"backend": jax.default_backend(), "device_kind": dev.device_kind, "device_count": jax.device_count(),
         "cpu": cpu_name(), "cores": os.cpu_count(), "schedulable_cpus": schedulable, "jax": jax.__version__,
         "python": platform.python_version(), "platform": platform.platform(),
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "load_average": load_average()}
  clash = sorted(set(extra) & set(out))
  if clash:
    raise ValueError(f"machine(**extra): extra fields must not replace {sorted(out)}, got {clash}")
  return {**out, **extra}


def param_bytes(model) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def proposer_param_bytes(proposer: Proposer) -> int:
  """Parameters of the proposer's own modules (shared target parts are the target's)."""
  return sum(param_bytes(m) for m in proposer.modules())


def proposer_state_bytes(target, proposer: Proposer, batch: int, prompt_len: int, max_len: int) -> int:
  """Bytes of the proposer's decoding state (its caches, features, history), from its ``init``'s shapes."""
  tdef, tstate = nnx.split(target)
  template, defs, states = proposer.split(nnx.split)

  def init(tstate, states):
    prompts = jnp.zeros((batch, prompt_len), jnp.int32)
    return engine.prefill(nnx.merge(tdef, tstate), template.bind(defs, states), prompts,
                          jnp.ones((batch,), jnp.int32), max_len)[1]
  return int(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(jax.eval_shape(init, tstate, states))))


def device_peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats()
  return None if not stats else stats.get("peak_bytes_in_use")


def _pct(values: Sequence[float], q: float) -> float:
  return float(np.percentile(np.asarray(values), q))


@dataclasses.dataclass
class _Case:
  """One configuration of a bench case (a sampling mode and batch size) and its measurements."""

  name: str
  method: str
  k: int | str
  schedule: str = "static"
  k_max: int = 8
  pilot_prompts: Any = None  # k="auto" only: what its pilot measures acceptance on (None: the case's prompts)
  full: list = dataclasses.field(default_factory=list)
  first: list = dataclasses.field(default_factory=list)
  warmup: float = 0.0
  output: Any = None

  def spec(self) -> SpecConfig:
    if self.method == "none":
      return SpecConfig(k=0)
    return SpecConfig(k=self.k, k_max=self.k_max, schedule=self.schedule,
                      pilot_prompts=self.pilot_prompts if self.k == "auto" else None)


def _timed(fn) -> tuple[float, Any]:
  start = time.perf_counter()
  out = fn()  # generate returns host arrays: the device has finished when it returns
  return time.perf_counter() - start, out


def _configurations(methods: Sequence[str], settings: BenchSettings) -> list[_Case]:
  """The baseline, then per method every fixed k, the dynamic schedule and k="auto"."""
  k_top = max(settings.ks)
  cases = [_Case("baseline", "none", 0)]
  for m in methods:
    cases += [_Case(f"{m} k={k}", m, k) for k in settings.ks]
    if settings.dynamic:
      cases.append(_Case(f"{m} dynamic<={k_top}", m, k_top, "dynamic"))
    if settings.auto:
      cases.append(_Case(f"{m} auto", m, "auto", k_max=k_top, pilot_prompts=settings.pilot_prompts))
  return cases


def _calibrate(target, proposers: dict[str, Proposer], batch: int, sampling: SamplingConfig, prompt_len: int,
               settings: BenchSettings) -> dict[str, costmodel.Calibration]:
  """One calibration per method at this run's cache length. A first set of timings gives the table that
  k="auto" decides from (as it would in use); the caller times once more per repeat, interleaved with the
  measured runs, so that the final table shares their load conditions."""
  k_top, n = max(settings.ks), settings.max_new_tokens
  calibrations = {m: costmodel.Calibration(target, p, batch, k_top, sampling=sampling, prompt_len=prompt_len,
                                           n_tokens=n, min_seconds=settings.calibration_min_seconds).warm_up()
                  for m, p in proposers.items()}
  for _ in range(settings.calibration_repeats):
    for cal in calibrations.values():
      cal.time_once()
  for m, cal in calibrations.items():
    key = costmodel.table_key(target, proposers[m], batch, k_top, sampling, prompt_len, bucket_length(n))
    costmodel.COST_TABLES[key] = cal.table()
  return calibrations


def _measure(configs: list[_Case], calibrations: dict[str, costmodel.Calibration], call, settings: BenchSettings):
  """Warm-up (compilation and k="auto"'s pilot happen there), then ``repeats`` interleaved rounds of every
  configuration, each preceded by one more timing of every calibration program."""
  n = settings.max_new_tokens
  for c in configs:
    c.warmup, _ = _timed(lambda: call(c, 1))
    t, c.output = _timed(lambda: call(c, n))
    c.warmup += t
  for rep in range(settings.repeats):  # interleaved: drift hits every configuration alike
    for cal in calibrations.values():
      cal.time_once()
    # The order rotates between repeats, so no configuration always runs right after the calibration.
    for c in configs[rep % len(configs):] + configs[:rep % len(configs)]:
      c.first.append(_timed(lambda: call(c, 1))[0])
      c.full.append(_timed(lambda: call(c, n))[0])


def _result_row(c: _Case, base: _Case, table: costmodel.CostTable | None, acceptance: Sequence[float | None],
                sampling_name: str, batch: int, settings: BenchSettings, memory: dict[str, int]) -> dict[str, Any]:
  n, st = settings.max_new_tokens, c.output.stats
  total = statistics.median(c.full)
  itl = [(f - s) / (n - 1) for f, s in zip(c.full, c.first)]
  static = c.schedule == "static" and table is not None
  # The model's time for this very run (its own rounds and catch-ups: its measured acceptance), and its
  # a-priori prediction from the acceptance per position at the largest k (what k="auto" works from).
  predicted_s = costmodel.run_seconds(table, st.k, st.rounds, st.catch_ups) if static else None
  predicted = costmodel.run_seconds(table, 0, base.output.stats.rounds, 0) / predicted_s if static else None
  prior = costmodel.predict_speedup(table, acceptance, st.k, n_tokens=n) if static else None
  measured = statistics.median(base.full) / total
  return {
      "sampling": sampling_name, "batch": batch, "config": c.name, "method": c.method, "k": st.k,
      "k_setting": c.k, "schedule": c.schedule,
      "ttft_s": statistics.median(c.first), "ttft_p90_s": _pct(c.first, 90),
      "total_s": total, "total_p90_s": _pct(c.full, 90),
      "itl_mean_s": float(np.mean(itl)), "itl_p50_s": _pct(itl, 50), "itl_p90_s": _pct(itl, 90),
      "output_tokens_per_s": batch * n / total, "requests_per_s": batch / total,
      "warmup_s": c.warmup, "compile_s_estimate": max(0.0, c.warmup - total - statistics.median(c.first)),
      "rounds": st.rounds, "acceptance_rate": st.acceptance_rate, "tau": st.mean_accepted_length,
      "acceptance_by_position": st.acceptance_by_position,
      "catch_ups": st.catch_ups, "predicted_s": predicted_s,
      "speedup": measured, "predicted_speedup": predicted, "prior_predicted_speedup": prior,
      "measured_over_predicted": measured / predicted if predicted else None,
      "target_param_bytes": memory["target_params"],
      "proposer_param_bytes": memory.get(f"{c.method}_params", 0) if st.k else 0,
      "kv_cache_bytes": memory["target_kv"] + (memory.get(f"{c.method}_state", 0) if st.k else 0),
      "device_peak_bytes": device_peak_bytes(),
  }


def run(target, proposers: dict[str, Proposer], rows: list[list[int]], settings: BenchSettings,
        progress: bool = True) -> dict[str, Any]:
  """Runs the sweep for ``proposers`` (method name -> proposer, for the methods in ``settings.methods``);
  returns the report (see the module docstring for every field)."""
  from tqdm.auto import tqdm

  k_top, n = max(settings.ks), settings.max_new_tokens
  proposers = {m: proposers[m] for m in settings.methods if m in proposers}
  cases = [(s, b) for s in settings.samplings for b in settings.batch_sizes]
  bar = tqdm(total=len(cases), desc="bench", disable=not progress)
  report: dict[str, Any] = {
      "machine": machine(), "settings": dataclasses.asdict(settings),
      "target": {"config": dataclasses.asdict(target.cfg), "param_bytes": param_bytes(target)},
      "proposers": {m: {**p.describe(), "param_bytes": proposer_param_bytes(p)} for m, p in proposers.items()},
      "prompt_tokens": [len(r) for r in rows], "results": [], "cost_tables": []}
  for sampling_name, batch in cases:
    sampling = sampling_named(sampling_name)
    reqs = [rows[i % len(rows)] for i in range(batch)]
    prompt_len = bucket_length(max(map(len, reqs)))
    configs = _configurations(list(proposers), settings)

    def call(c: _Case, new_tokens: int):
      return generate(target, reqs, proposer=proposers.get(c.method), spec=c.spec(), max_new_tokens=new_tokens,
                      sampling=sampling, seed=settings.seed)

    calibrations = _calibrate(target, proposers, batch, sampling, prompt_len, settings)
    _measure(configs, calibrations, call, settings)
    tables = {m: cal.table() for m, cal in calibrations.items()}
    for m, table in tables.items():
      report["cost_tables"].append({"sampling": sampling_name, "method": m, **table.to_dict()})
    acceptance = {m: next(c for c in configs if c.method == m and c.k == k_top and c.schedule == "static")
                  .output.stats.acceptance_by_position for m in proposers}
    memory = {"target_params": report["target"]["param_bytes"],
              "target_kv": cache_bytes(target.cfg, batch, prompt_len + n + k_top)}
    for m, p in proposers.items():
      memory[f"{m}_params"] = report["proposers"][m]["param_bytes"]
      memory[f"{m}_state"] = proposer_state_bytes(target, p, batch, prompt_len, prompt_len + n + k_top)
    for c in configs:
      report["results"].append(_result_row(c, configs[0], tables.get(c.method), acceptance.get(c.method, []),
                                           sampling_name, batch, settings, memory))
    # Each case compiles a dozen programs; drop them before the next batch size (XLA's CPU code lives in
    # memory mappings, and a long sweep otherwise runs out of them).
    jax.clear_caches()
    bar.update(1)
    base_r = report["results"][-len(configs)]
    bar.set_postfix_str(f"{sampling_name} B={batch} base {base_r['output_tokens_per_s']:.0f} tok/s")
  bar.close()
  report["machine"]["load_average_end"] = load_average()
  report["summary"] = summarise(report["results"])
  return report


def summarise(results: list[dict]) -> list[dict]:
  """Per (sampling, batch, method): the best fixed k, auto and dynamic against it and against the baseline,
  the best configuration of the case over all methods, and the cost model's median accuracy."""
  out = []
  cases = sorted({(r["sampling"], r["batch"], r["method"]) for r in results if r["method"] != "none"})
  for sampling, batch, method in cases:
    case = [r for r in results if (r["sampling"], r["batch"]) == (sampling, batch)]
    rs = [r for r in case if r["method"] == method]
    fixed = [r for r in rs if r["schedule"] == "static" and r["k_setting"] != "auto"]
    best = max(fixed, key=lambda r: r["speedup"]) if fixed else None
    auto = next((r for r in rs if r["k_setting"] == "auto"), None)
    dyn = next((r for r in rs if r["schedule"] == "dynamic"), None)
    overall = max(case, key=lambda r: r["speedup"])
    entry = {"sampling": sampling, "batch": batch, "method": method, "best_fixed_k": best and best["k"],
             "best_fixed_speedup": best and best["speedup"], "best_config": overall["config"],
             "best_config_speedup": overall["speedup"]}
    if auto:
      entry.update(auto_k=auto["k"], auto_speedup=auto["speedup"],
                   auto_over_best=auto["speedup"] / max(best["speedup"], 1.0) if best else None)
    if dyn:
      entry.update(dynamic_speedup=dyn["speedup"])
    ratios = [r["measured_over_predicted"] for r in rs if r["measured_over_predicted"] and r["k"] > 0]
    entry["measured_over_predicted_median"] = statistics.median(ratios) if ratios else None
    out.append(entry)
  return out


# ----------------------------------------------------------------------------------------- output


def markdown(report: dict) -> str:
  m = report["machine"]
  lines = ["# specjax bench", "",
           f"{m['backend']} ({m['device_kind']}), CPU {m['cpu']} x{m['cores']}, jax {m['jax']}; "
           f"load average at start {m['load_average']}{', at end ' + str(m['load_average_end']) if 'load_average_end' in m else ''}.",
           f"Target {report['target']['param_bytes'] / 1e6:.1f} MB of parameters; proposers "
           + (", ".join(f"{name} {p['param_bytes'] / 1e6:.2f} MB" for name, p in report["proposers"].items())
              or "none") + "; "
           f"{report['settings']['max_new_tokens']} new tokens "
           f"per row, medians of {report['settings']['repeats']} interleaved repeats after warm-up"
           + (f"; k=auto piloted on {len(report['settings']['pilot_prompts'])} given prompts"
              if report["settings"].get("pilot_prompts") else "") + ".", "",
           "| sampling | B | config | k | tok/s | speedup | predicted | meas/pred | TTFT ms | ITL ms (p50/p90) "
           "| acc. rate | tau | KV MB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  fmt = lambda x, f: "-" if x is None else format(x, f)
  for r in report["results"]:
    lines.append(
        f"| {r['sampling']} | {r['batch']} | {r['config']} | {r['k']} | {r['output_tokens_per_s']:.0f} | "
        f"{r['speedup']:.2f} | {fmt(r['predicted_speedup'], '.2f')} | {fmt(r['measured_over_predicted'], '.2f')} | "
        f"{r['ttft_s'] * 1e3:.1f} | {r['itl_p50_s'] * 1e3:.2f} / {r['itl_p90_s'] * 1e3:.2f} | "
        f"{fmt(r['acceptance_rate'], '.2f')} | {r['tau']:.2f} | {r['kv_cache_bytes'] / 1e6:.2f} |")
  lines += ["", "## Auto and dynamic against the best fixed k", "",
            "| sampling | B | method | best fixed k | its speedup | auto k | auto speedup | auto / max(best, 1) "
            "| dynamic speedup | meas/pred (median over k) | best of the case |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
  for s in report["summary"]:
    lines.append(f"| {s['sampling']} | {s['batch']} | {s['method']} | {s['best_fixed_k']} | "
                 f"{fmt(s['best_fixed_speedup'], '.2f')} | {s.get('auto_k', '-')} | {fmt(s.get('auto_speedup'), '.2f')} | "
                 f"{fmt(s.get('auto_over_best'), '.2f')} | {fmt(s.get('dynamic_speedup'), '.2f')} | "
                 f"{fmt(s.get('measured_over_predicted_median'), '.3f')} | {s['best_config']} "
                 f"({s['best_config_speedup']:.2f}) |")
  lines += ["", "## Calibration (in-jit, per batch size)", "",
            "v(T) is a target pass over T tokens per row over v(1); propose(k) the proposer's own `propose` of k "
            "tokens over v(1) (k = 1 and the largest k); body(k) the engine's measured round with k proposals over "
            "body(0), and over the sum of its parts (propose(k) + v(k+1)); spread is the calibration's own noise.", "",
            "| sampling | B | method | v(1) ms | v(2) | v(3) | v(5) | v(9) | propose(1) | propose(k_max) | body(0) ms "
            "| body(2) | body(4) | body(8) | body/parts k=0/4/8 | prefill target / proposer ms | spread |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for t in report["cost_tables"]:
    v, body, ratio = ({int(a): b for a, b in t[name].items()} for name in ("verify", "rounds", "round_over_parts"))
    v1, b0 = v[1], body.get(0)
    propose = {int(a): b for a, b in t.get("propose", {}).items()}
    rel = lambda d, x, base: "-" if x not in d or not base else f"{d[x] / base:.2f}"
    lines.append(
        f"| {t['sampling']} | {t['batch']} | {t.get('method', '-')} | {v1 * 1e3:.3f} | {rel(v, 2, v1)} | {rel(v, 3, v1)} | {rel(v, 5, v1)} | "
        f"{rel(v, 9, v1)} | {rel(propose, 1, v1)} | {rel(propose, max(propose, default=1), v1)} "
        f"| {fmt(b0 and b0 * 1e3, '.3f')} | {rel(body, 2, b0)} | "
        f"{rel(body, 4, b0)} | {rel(body, 8, b0)} | "
        f"{' / '.join(fmt(ratio.get(k), '.2f') for k in (0, 4, 8))} | "
        f"{t['prefill'].get('target', 0) * 1e3:.2f} / {t['prefill'].get('proposer', 0) * 1e3:.2f} | "
        f"{t['spread']:.3f} |")
  return "\n".join(lines) + "\n"


def plots(report: dict, out_dir: str) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  files = []
  res = report["results"]
  for sampling in sorted({r["sampling"] for r in res}):
    fixed = [r for r in res if r["sampling"] == sampling and r["schedule"] == "static"
             and r["k_setting"] != "auto"]
    methods = sorted({r["method"] for r in fixed} - {"none"})
    styles = {m: ("o-", "x:") if i == 0 else ("s--", "+:") for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for batch in sorted({r["batch"] for r in fixed}):
      color = None
      for m in methods:
        rs = sorted((r for r in fixed if r["batch"] == batch and r["method"] in (m, "none")), key=lambda r: r["k"])
        measured, predicted = styles[m]
        line, = axes[0].plot([r["k"] for r in rs], [r["speedup"] for r in rs], measured, color=color,
                             label=f"{m} B={batch}")
        color = line.get_color()
        axes[0].plot([r["k"] for r in rs], [r["predicted_speedup"] for r in rs], predicted, color=color)
        axes[1].plot([r["k"] for r in rs], [r["tau"] for r in rs], measured, color=color, label=f"{m} B={batch}")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set(xlabel="k", ylabel="speedup over target-only",
                title=f"{sampling}: speedup (markers measured, dotted predicted)")
    axes[1].set(xlabel="k", ylabel="tau (tokens per round)", title=f"{sampling}: tau against k")
    shown = {"baseline"} | {f"{m} {x}" for m in methods for x in ("k=2", "k=4", "auto")}
    for name in sorted({r["config"] for r in res if r["sampling"] == sampling and r["config"] in shown},
                       key=lambda n: (n != "baseline", n)):
      rs = sorted((r for r in res if r["sampling"] == sampling and r["config"] == name), key=lambda r: r["batch"])
      axes[2].plot([r["batch"] for r in rs], [r["itl_p50_s"] * 1e3 for r in rs], "o-", label=name)
    axes[2].set(xlabel="batch size", ylabel="inter-token latency p50 (ms)", xscale="log", title=f"{sampling}: latency")
    for ax in axes:
      ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{sampling}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    files.append(path)
  return files


def write(report: dict, out_dir: str) -> list[str]:
  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")]
  with open(paths[0], "w") as f:
    json.dump(report, f, indent=1)
  with open(paths[1], "w") as f:
    f.write(markdown(report))
  return paths + plots(report, out_dir)
