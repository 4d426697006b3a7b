"""The server's Prometheus metrics (``GET /metrics``, text exposition format), in one registry per server.

Counters and histograms are updated by the engine thread (:meth:`ServeMetrics.on_step`,
:meth:`ServeMetrics.on_finish`) and by request handlers (:meth:`ServeMetrics.on_rejected`); gauges that
describe the present (queue length, slot use, tokens/s, acceptance, the policy's view, compiled programs)
are read from the scheduler at scrape time.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specjax.runtime import RUNTIME
from specjax.serving.scheduler import Event, Request, Scheduler
from specjax.serving.slots import StepResult, choice_name

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RATE_WINDOW = 10.0  # seconds over which tokens/s is measured
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServeMetrics:
  """Every metric of one server.

  Args:
    scheduler: read at scrape time (queue, slots, policy).
  """

  def __init__(self, scheduler: Scheduler):
    self.scheduler = scheduler
    self.registry = CollectorRegistry()
    ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends
    r = self.registry
    self.requests = Counter("specjax_requests", "Requests that ended, by outcome "
                            "(stop, length, cancelled, error, invalid, unauthorized, too_large, timeout, queue_full, shutting_down)", ["outcome"],
                            registry=r)
    self.prompt_tokens = Counter("specjax_prompt_tokens", "Prompt tokens of requests that got a slot", registry=r)
    self.generated = Counter("specjax_generated_tokens", "Tokens generated", registry=r)
    self.steps = Counter("specjax_steps", "Engine steps, by batch width and speculation length k (a token tree: "
                         "its description)", ["width", "k"], registry=r)
    self.calls = Counter("specjax_calls", "Device calls (a step of up to the engine's rounds), by why each "
                         "returned: finished (a row finished), interrupted (a request arrived for a free slot, or a cancel, "
                         "with --interrupt-calls), waiting (one round: a request waited for a slot), "
                         "prefill (one round between two chunks of a prompt), first_rounds (a new request's first "
                         "call), refill (a short call while a freed slot waits for a request), catch_up (one round: a draft "
                         "catching up after plain rounds, before the call that times the k switched to), rounds "
                         "(the engine's rounds ran out)", ["ended"], registry=r)
    self.call_rounds = Counter("specjax_call_rounds", "Rounds run by the device calls, by why each returned (see "
                               "specjax_calls): call_rounds / calls is the rounds per call", ["ended"], registry=r)
    self.calls_ahead = Counter("specjax_calls_ahead", "Device calls launched before the call in flight was "
                               "collected (--launch-ahead)", registry=r)
    self.row_rounds = Counter("specjax_row_rounds", "Rounds of live rows (a row's round emits tau tokens)",
                              registry=r)
    self.drafted = Counter("specjax_drafted_tokens", "Proposals verified", registry=r)
    self.accepted = Counter("specjax_accepted_tokens", "Proposals accepted", registry=r)
    self.catch_ups = Counter("specjax_catch_up_passes", "Proposer passes besides the proposals", registry=r)
    self.reached = Counter("specjax_reached", "Live row-rounds that verified proposal i with all before it accepted "
                           "(by position i, from 1)", ["position"], registry=r)
    self.accepted_at = Counter("specjax_accepted_at", "Live row-rounds that accepted proposal i (by position i, "
                               "from 1): accepted_at / reached is the acceptance by position", ["position"], registry=r)
    self.step_seconds = Histogram("specjax_step_seconds", "Wall time of one engine step (a device call, dispatch "
                                  "to results; one dispatched behind an insert holds its rest), by width and k "
                                  "(or tree)",
                                  ["width", "k"], buckets=_LATENCY_BUCKETS, registry=r)
    self.ttft = Histogram("specjax_time_to_first_token_seconds", "Arrival to first generated token",
                          buckets=_LATENCY_BUCKETS, registry=r)
    self.latency = Histogram("specjax_request_latency_seconds", "Arrival to the end of the request",
                             buckets=_LATENCY_BUCKETS, registry=r)
    self.queue_time = Histogram("specjax_queue_seconds", "Arrival to a slot", buckets=_LATENCY_BUCKETS,
                                registry=r)
    self._lock = threading.Lock()
    self._recent: collections.deque[tuple[float, int]] = collections.deque()
    self._totals = {"row_rounds": 0, "drafted": 0, "accepted": 0}
    self.registry.register(_Present(self))

  def on_step(self, result: StepResult, scheduler: Scheduler) -> None:
    tokens = sum(map(len, result.tokens.values()))
    rounds, drafted, accepted = (sum(d.values()) for d in (result.row_rounds, result.drafted, result.accepted))
    self.generated.inc(tokens)
    k = result.tree if result.tree is not None else str(result.k)
    self.steps.labels(width=str(result.width), k=k).inc()
    self.step_seconds.labels(width=str(result.width), k=k).observe(result.seconds)
    if result.ended:
      self.calls.labels(ended=result.ended).inc()
      self.call_rounds.labels(ended=result.ended).inc(result.rounds)
    if result.ahead:
      self.calls_ahead.inc()
    self.row_rounds.inc(rounds)
    self.drafted.inc(drafted)
    self.accepted.inc(accepted)
    self.catch_ups.inc(result.catch_ups)
    for i, (reached, accepted_i) in enumerate(zip(result.reached, result.accepted_at), start=1):
      if reached:
        self.reached.labels(position=str(i)).inc(float(reached))
        self.accepted_at.labels(position=str(i)).inc(float(accepted_i))
    now = time.perf_counter()
    with self._lock:
      self._recent.append((now, tokens))
      while self._recent and self._recent[0][0] < now - RATE_WINDOW:
        self._recent.popleft()
      for name, n in (("row_rounds", rounds), ("drafted", drafted), ("accepted", accepted)):
        self._totals[name] += n

  def on_finish(self, request: Request, event: Event) -> None:
    outcome = event.reason if event.kind == "done" else "error"
    self.requests.labels(outcome=outcome).inc()
    if request.admitted is not None:
      self.prompt_tokens.inc(len(request.params.prompt))
      self.queue_time.observe(request.admitted - request.arrival)
    if request.first_token is not None:
      self.ttft.observe(request.first_token - request.arrival)
    if outcome in ("stop", "length"):
      self.latency.observe(request.finished - request.arrival)

  def on_rejected(self, outcome: str) -> None:
    """A request refused before it was queued: "invalid", "unauthorized", "too_large", "timeout", "queue_full"
    or "shutting_down"."""
    self.requests.labels(outcome=outcome).inc()

  def tokens_per_second(self) -> float:
    now = time.perf_counter()
    with self._lock:
      return sum(n for t, n in self._recent if t >= now - RATE_WINDOW) / RATE_WINDOW

  def render(self) -> bytes:
    return generate_latest(self.registry)


class _Present:
  """Gauges computed at scrape time."""

  def __init__(self, metrics: ServeMetrics):
    self.metrics = metrics

  def collect(self):
    m, s = self.metrics, self.metrics.scheduler

    def gauge(name, doc, value, labels=()):
      """``value``: a number, or ``{label value(s): number}`` (a tuple of values for several labels)."""
      family = GaugeMetricFamily(name, doc, labels=list(labels) or None)
      if labels:
        for key, v in value.items():
          family.add_metric([str(x) for x in (key if isinstance(key, tuple) else (key,))], v)
      else:
        family.add_metric([], value)
      return family

    yield gauge("specjax_queue_length", "Requests waiting for a slot", s.queue_length)
    yield gauge("specjax_slots_used", "Slots running a request", s.slots_used)
    yield gauge("specjax_slots_total", "Slots of the engine", s.engine.slots)
    yield gauge("specjax_batch_width", "Rows each step computes (the smallest compiled width holding the live "
                "requests)", s.engine.width)
    best = dict(s.policy.best) if s.policy is not None else {}
    yield gauge("specjax_rounds_per_call", "The rounds of a full device call at each width, for the k the policy "
                "prefers there (more than --rounds-per-step where a call's fixed cost, timed at start-up, is dear "
                "against its rounds)", {w: s.call_rounds(w, best.get(w, s.engine.ks[0])) for w in s.engine.widths},
                labels=["width"])
    active = s.engine.active_buckets
    yield gauge("specjax_attention_bucket", "1 where a step at the width may attend over this many cache positions "
                "(the buckets kept at start-up, --attention-buckets), 0 where the bucket is compiled but not used",
                {(w, b): float(b in active[w]) for w in s.engine.widths for b in s.engine.buckets},
                labels=["width", "bucket"])
    yield gauge("specjax_cache_length", "Positions per row the KV caches hold now: --max-len, or with "
                "--bucket-cache the attention bucket the steps run at", s.engine.length)
    yield CounterMetricFamily("specjax_cache_relengths", "Times the KV caches were cut or grown to another "
                              "attention bucket (--bucket-cache)", value=s.engine.relengths)
    yield CounterMetricFamily("specjax_prompt_cache_hits", "Requests whose whole prompt's prefilled row was kept "
                              "(--prompt-cache): no prefill ran for them", value=s.engine.prompt_hits)
    yield CounterMetricFamily("specjax_prompt_cache_prefix_hits", "Requests prefilled from a kept prompt's caches "
                              "(--prompt-cache): only the rest of their prompt passed", value=s.engine.prefix_hits)
    yield CounterMetricFamily("specjax_prompt_cache_prefix_tokens", "Prompt tokens those requests took from a kept "
                              "prompt's caches instead of passing them", value=s.engine.prefix_tokens)
    yield gauge("specjax_prompt_cache_prompts", "Prompts whose prefilled rows are kept (--prompt-cache)",
                s.engine.kept_prompts)
    yield gauge("specjax_tokens_per_second", f"Generated tokens per second over the last {RATE_WINDOW:g} s",
                m.tokens_per_second())
    with m._lock:
      totals = dict(m._totals)
    if totals["drafted"]:
      yield gauge("specjax_acceptance_rate", "Accepted / drafted proposals since start",
                  totals["accepted"] / totals["drafted"])
    if totals["row_rounds"]:
      yield gauge("specjax_mean_accepted_length", "tau: tokens emitted per row-round since start",
                  (totals["accepted"] + totals["row_rounds"]) / totals["row_rounds"])
    policy = s.policy
    if policy is not None:
      view, best = policy.describe(), dict(policy.best)
      yield gauge("specjax_speculation_k", "The k the policy currently prefers at each width (a tree: its depth)",
                  {w: c if isinstance(c, int) else c.depth for w, c in best.items()}, labels=["width"])
      if policy.trees:
        yield gauge("specjax_speculation_tree", "1 where the policy currently prefers this token tree at the width",
                    {(w, t.describe()): float(best[w] == t) for w in best for t in policy.trees},
                    labels=["width", "tree"])
      yield gauge("specjax_policy_step_seconds", "The policy's estimate of one step's cost, by width and k (or tree)",
                  {(w, k): v for w, by_k in view["step_seconds"].items() for k, v in by_k.items()},
                  labels=["width", "k"])
      yield gauge("specjax_policy_expected_tau", "The policy's E[tau] from the online acceptance, by k (or tree)",
                  {choice_name(c): policy.expected_tau(c) for c in policy.candidates}, labels=["k"])
    else:
      yield gauge("specjax_speculation_k", "The fixed k of every step", {w: s.engine.ks[0] for w in s.engine.widths},
                  labels=["width"])
    yield gauge("specjax_compiled_programs", "Programs held in the runtime's cache", len(RUNTIME.programs))
    yield gauge("specjax_greedy_steps_pending", "Greedy step programs still compiling after the server started "
                "(the general program runs those steps meanwhile)", s.engine.greedy_steps_pending)
    yield gauge("specjax_traces", "Times each jitted entry point was traced", dict(RUNTIME.trace_counts),
                labels=["program"])
