"""The slot engine's throughput paths (issue 23): several rounds per device call give each request the same
tokens as one round per call and return when a row finishes; a step attends over a bucket of the cache, not
all of it, with the same tokens and logits within float32 rounding; the scheduler admits a request that
arrives mid-call after that call, and cancels within one; nothing is traced again after warm-up across
buckets."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import backend_compiles
from specjax import SamplingConfig, generate
from specjax.proposers import Combined, DraftModel, NGram
from specjax.request import Request
from specjax.serving.metrics import ServeMetrics
from specjax.serving.policy import SpeculationPolicy
from specjax.serving.scheduler import Job, QueueFull, Scheduler, rounds_per_call
from specjax.sampling import FULL
from specjax.serving.slots import GREEDY_STEPS, TRACE_COUNTS, CallCost, SlotEngine, keep_buckets
from test_serving import (GREEDY, KS, MAX_LEN, REF_NEW, SLOTS, WIDTHS, Collector, fixed_policy, random_requests,
                          reference, take_tokens)

ROUNDS = 4


def multi_engine(target, draft, **kwargs) -> SlotEngine:
  """test_serving's engine configuration with ``ROUNDS`` rounds per call (its own programs, shared here)."""
  return SlotEngine(target, DraftModel(draft), **{"slots": SLOTS, "max_len": MAX_LEN, "ks": KS, "widths": WIDTHS,
                                                  "rounds": ROUNDS, **kwargs})


def wait_all_free(engine: SlotEngine, seconds: float = 60) -> None:
  """Waits (at most ``seconds``) until the scheduler's thread has freed every slot of ``engine``."""
  deadline = time.perf_counter() + seconds
  while engine.free_slots < SLOTS and time.perf_counter() < deadline:
    time.sleep(0.01)
  assert engine.free_slots == SLOTS


def drive_rounds(engine: SlotEngine, requests: list[Request], rounds: int, k: int | tuple[int, ...] = 2, results=None,
                 logprobs=None):
  """As test_serving.drive, every step ``engine.step(k, rounds)`` (``k`` a tuple: step s runs
  ``k[s % len(k)]``); requests enter as slots free up. ``results`` (a list) receives each StepResult,
  ``logprobs`` (a dict) each request's token log-probabilities."""
  pending, owner, out = list(range(len(requests))), {}, {i: [] for i in range(len(requests))}
  schedule = k if isinstance(k, tuple) else (k,)
  for step in itertools.count():
    if not (pending or owner):
      break
    k = schedule[step % len(schedule)]
    while engine.free_slots and pending:
      (slot,) = engine.insert([requests[pending[0]]])
      owner[slot] = pending.pop(0)
    engine.compact()
    result = engine.step(k, rounds)
    if results is not None:
      results.append(result)
    for slot, tokens in result.tokens.items():
      out[owner[slot]] += tokens
    if logprobs is not None:
      for slot, (lp, _, _) in result.logprobs.items():
        logprobs.setdefault(owner[slot], []).extend(lp)
    for slot in result.finished:
      del owner[slot]
  return out


def test_several_rounds_per_call_give_each_request_the_tokens_of_one_round_per_call(target, draft):
  """Mixed requests (sampled neighbours, stop tokens) through calls of up to ROUNDS rounds and through calls
  of one: every request gets the same tokens (sampled ones too: per-row keys), greedy ones equal generate
  alone; a call that runs fewer rounds than it may ran until a row finished or every row was done."""
  engine = multi_engine(target, draft, shrink_after=2)
  requests = random_requests(9, seed=3, sampled_every=3)
  results = []
  multi = drive_rounds(engine, requests, ROUNDS, results=results)
  single = drive_rounds(engine, requests, 1)
  assert multi == single
  for i, r in enumerate(requests):
    if r.sampling.greedy:
      assert multi[i] == reference(target, r), i
  assert max(r.rounds for r in results) == ROUNDS and all(1 <= r.rounds <= ROUNDS for r in results)
  assert all(r.finished or r.rounds == ROUNDS or not r.tokens for r in results)
  assert engine.free_slots == SLOTS


def test_the_state_shrinks_once_its_live_requests_have_fit_a_smaller_width_for_shrink_after_rounds(target, draft):
  """shrink_after counts rounds, not calls: after calls of ROUNDS rounds with one live request at width 4, the
  state moves to width 1 once that many rounds have run, not that many calls; the tokens equal generate's."""
  engine = multi_engine(target, draft, shrink_after=1000)
  short, long = Request((4, 6, 8), 2), Request((5, 7, 9), REF_NEW)
  slots = engine.insert([short, long])
  assert engine.width == 4
  out = {s: [] for s in slots}
  result = engine.step(0, ROUNDS)
  for s, t in result.tokens.items():
    out[s] += t
  assert slots[0] in result.finished and slots[1] not in result.finished
  fitted = result.rounds  # rounds since the live request fit width 1
  engine.shrink_after = fitted + ROUNDS + 1
  for calls in (1, 2):
    result = engine.step(0, ROUNDS)
    assert result.rounds == ROUNDS and not result.finished
    out[slots[1]] += result.tokens[slots[1]]
    fitted += ROUNDS
    assert engine.compact() == (fitted >= engine.shrink_after) == (calls == 2)
  assert engine.width == 1
  while engine.live_slots:
    out[slots[1]] += engine.step(0, ROUNDS).tokens.get(slots[1], [])
  assert out[slots[0]] == reference(target, short) and out[slots[1]] == reference(target, long)


def test_a_cancel_during_a_call_drops_its_tokens_and_frees_the_slot_after_the_next(target, draft):
  """A request cancelled while a call is in flight: the call's tokens for it are dropped, the next call frees
  its slot, and its neighbour's output is unchanged."""
  engine = multi_engine(target, draft)
  keep, drop = Request((4, 8, 15), 20, SamplingConfig(temperature=0.0)), Request((16, 23, 42), 20)
  slot_keep, slot_drop = engine.insert([keep, drop])
  call = engine.launch(2, ROUNDS)
  engine.cancel(slot_drop)
  result = engine.collect(call)
  assert slot_drop not in result.tokens and engine.free_slots == SLOTS - 2
  out = list(result.tokens[slot_keep])
  while engine.live_slots:
    result = engine.step(2, ROUNDS)
    out += result.tokens.get(slot_keep, [])
  assert engine.free_slots == SLOTS and out == reference(target, keep)


def test_an_interrupt_ends_a_call_after_its_round_with_the_tokens_of_uninterrupted_calls(target, draft):
  """The engine's interrupt, set before a call (as a request arriving mid-call sets it): the call runs one
  round of its ROUNDS, says it was interrupted, and every request still gets generate's tokens; an engine
  built with interruptible=False ignores the flag (its calls run their rounds)."""
  requests = [Request((5, 1 + i, 9), 14 + 5 * i) for i in range(3)]
  for interruptible in (True, False):
    engine = multi_engine(target, draft, interruptible=interruptible)
    slots = engine.insert(requests)
    out = {slot: [] for slot in slots}
    results = []
    while engine.live_slots:
      if len(results) % 2 == 0:
        engine.interrupt.set()
      else:
        engine.interrupt.clear()
      result = engine.step(2, ROUNDS)
      results.append(result)
      for slot, tokens in result.tokens.items():
        out[slot] += tokens
    assert [out[slot] for slot in slots] == [reference(target, r) for r in requests]
    flagged, free = results[0::2], results[1::2]
    if interruptible:
      assert all(r.rounds == 1 for r in flagged)
      assert all(r.interrupted for r in flagged)
    else:
      assert not any(r.interrupted for r in results)
      assert all(r.rounds == ROUNDS or r.finished for r in flagged)
    assert all(not r.interrupted and (r.rounds == ROUNDS or r.finished) for r in free)
  with pytest.raises(ValueError, match="interruptible"):
    multi_engine(target, draft, interruptible=1)


class PollHook(threading.Event):
  """An engine's interrupt that runs ``actions[n]`` when the device polls it the n-th time (from 1): a request
  that arrives, or a cancel, while a given call runs (on the callback's thread, as another thread would)."""

  def __init__(self, actions):
    super().__init__()
    self.actions, self.polls = actions, 0

  def is_set(self):
    self.polls += 1
    if self.polls in self.actions:
      self.actions[self.polls]()
    return super().is_set()


def test_a_request_arriving_mid_call_interrupts_it_and_a_cancel_ends_within_a_round(target, draft):
  """Through the scheduler with calls of up to 40 rounds on an interruptible engine: a request submitted while
  the call after another request's first call runs (at that call's first poll of the flag) ends the call
  after that round ("interrupted") and is admitted next; a cancel ends its request the same way; every
  greedy request equals generate."""
  engine = multi_engine(target, draft, rounds=40, interruptible=True)
  steps = []
  scheduler = Scheduler(engine, fixed_policy(engine), max_queue=8, on_step=lambda r, s: steps.append(r))
  late = Job(Request((9, 9, 2), 12), Collector())
  victim = Job(Request((1, 2, 3), 56), Collector())
  # Poll 1: the first call of `long` (one round); poll 2: the first round of its second call.
  engine.interrupt = PollHook({2: lambda: scheduler.submit(late)})
  scheduler.start()
  try:
    long = Job(Request((3, 5, 7), 24), Collector())
    scheduler.submit(long)
    for job in (long, late):
      assert job.sink.done.wait(120) and job.sink.end.reason == "length"
      assert job.sink.tokens == reference(target, job.params)
    assert [r.rounds for r in steps[:2]] == [1, 1] and steps[1].ended == "interrupted" and steps[1].interrupted
    assert late.slot in steps[2].tokens  # admitted right after the interrupted call
    engine.interrupt = PollHook({2: lambda: scheduler.cancel(victim)})  # the victim's second call, round 1
    before = len(steps)
    scheduler.submit(victim)
    assert victim.sink.done.wait(60) and victim.sink.end.reason == "cancelled"
    wait_all_free(engine)
    assert [r.rounds for r in steps[before:before + 2]] == [1, 1] and steps[before + 1].ended == "interrupted"
    assert len(victim.sink.tokens) < 56
  finally:
    scheduler.stop()


def test_the_scheduler_admits_a_request_arriving_mid_call_after_at_most_that_call(target, draft):
  """Through the scheduler (calls of ROUNDS rounds, the next dispatched before the last one's tokens are
  handed out): a request submitted while others decode is admitted before the second call after its
  arrival ends, a cancel ends its request within a call, and every greedy request equals generate."""
  engine = multi_engine(target, draft)
  ends, collect = [], engine.collect

  def timed_collect(call):  # a step ends when its results reach the host (its tokens are handed out later)
    result = collect(call)
    ends.append(time.perf_counter())
    return result

  engine.collect = timed_collect
  scheduler = Scheduler(engine, fixed_policy(engine), max_queue=8)
  scheduler.start()
  try:
    long = [Job(Request((3 + i, 5, 7), 24), Collector()) for i in range(2)]
    for job in long:
      scheduler.submit(job)
    while len(ends) < 2:
      time.sleep(0.001)
    late = Job(Request((9, 9, 2), 12), Collector())
    submitted = time.perf_counter()
    scheduler.submit(late)
    for job in long + [late]:
      assert job.sink.done.wait(120) and job.sink.end.reason == "length"
      assert job.sink.tokens == reference(target, job.params)
    ends_after = [t for t in ends if t > submitted]
    assert late.admitted <= ends_after[1]
    victim = Job(Request((1, 2, 3), 56), Collector())
    scheduler.submit(victim)
    while not victim.sink.tokens:
      time.sleep(0.001)
    scheduler.cancel(victim)
    assert victim.sink.done.wait(60) and victim.sink.end.reason == "cancelled"
    wait_all_free(engine)
  finally:
    scheduler.stop()


def test_a_programs_first_run_is_cold_and_the_policy_does_not_time_it(target, draft):
  """The first run of each step program in an engine is marked cold (its time includes one-off costs); the
  scheduler hands the policy no timing for it, nor for a call of one round (its fixed cost would count as a
  round's), and their acceptance all the same."""
  engine = multi_engine(target, draft)
  engine.insert([Request((3, 5, 7), 24)])
  assert [engine.step(k, ROUNDS).cold for k in (0, 2, 0, 2)] == [True, True, False, False]
  engine = multi_engine(target, draft)
  policy = fixed_policy(engine)
  seen, observe = [], policy.observe

  def recording(width, k, seconds, *args, **kwargs):
    seen.append((width, k, seconds))
    return observe(width, k, seconds, *args, **kwargs)

  policy.observe = recording
  rounds, queued = [], []
  scheduler = Scheduler(engine, policy, max_queue=8,
                        on_step=lambda result, _: (rounds.append(result.rounds), queued.append(result.queued)))
  scheduler.start()
  try:
    job = Job(Request((3, 5, 7), 24), Collector())
    scheduler.submit(job)
    assert job.sink.done.wait(120) and job.sink.tokens == reference(target, job.params)
  finally:
    scheduler.stop()
  first = {}
  for width, k, seconds in seen:
    first.setdefault((width, k), seconds)
  assert first and all(s is None for s in first.values())  # each (width, k)'s first step: the program's first run
  assert any(s is not None for _, _, s in seen) and policy.acceptance_by_position()[0] is not None
  assert rounds[0] == 1 and all(s is None for (_, _, s), n in zip(seen, rounds) if n == 1)  # the first call: 1 round
  assert queued[0] and all(s is None for (_, _, s), q in zip(seen, queued) if q)  # behind the insert: untimed


def test_a_step_is_dispatched_behind_inserts_and_resizes_without_waiting_for_them_and_is_marked_queued(
    target, draft, monkeypatch):
  """launch never waits for the work on the state before it (the device runs it first); a step dispatched
  behind an insert, a resize or a prefill chunk is marked queued, one after a collect with nothing between is
  not, and settle() waits for that work so that timings time the step alone."""
  import jax

  engine = multi_engine(target, draft, prefill_chunk=16)
  waits, block = [], jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready", lambda x: (waits.append(1), block(x))[1])
  engine.insert([Request((3, 5, 7), 50)])  # (live through every step below)
  steps = [engine.step(2, ROUNDS)]
  steps.append(engine.step(0, ROUNDS))
  assert not waits and [s.queued for s in steps] == [True, False]
  (slot,) = engine.insert([Request((4, 6), 20)])  # a second row: the state grows to width 4 (a resize)
  steps.append(engine.step(0, ROUNDS))
  engine.cancel(slot)  # marks the row for the next step: no work on the state
  steps.append(engine.step(0, ROUNDS))
  chunked = Request(tuple(range(1, 30)), 8)  # 29 tokens: two chunks of 16
  engine.start_prefill(chunked)
  assert engine.prefill_next() is None
  steps.append(engine.step(0, ROUNDS))
  assert not waits and [s.queued for s in steps[2:]] == [True, False, True]
  engine.insert([Request((9, 9, 2), 12)])
  engine.settle()
  assert waits and not engine.step(0, ROUNDS).queued


def test_bucketed_attention_equals_full_length_attention_and_nothing_retraces(target, draft):
  """An engine attending over buckets of 48, 96 and 128 positions gives the tokens of one attending over all
  128, and their log-probabilities within float32 rounding; once every bucket has run, rows moving across
  buckets trace no program again."""
  kwargs = dict(slots=2, max_len=128, ks=(2,), widths=(2,), rounds=ROUNDS)
  bucketed = SlotEngine(target, DraftModel(draft), buckets=(48, 96), **kwargs)
  assert bucketed.buckets == (48, 96, 128)
  rng = np.random.default_rng(5)
  requests = [Request(tuple(rng.integers(0, 64, n).tolist()), m, logprobs=0)
              for n, m in ((5, 60), (12, 20), (30, 70), (70, 40))]
  results, logprobs = [], {}
  out = drive_rounds(bucketed, requests, ROUNDS, results=results, logprobs=logprobs)  # compiles what it needs
  assert {r.bucket for r in results} == {48, 96, 128}
  traces = {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")}
  assert drive_rounds(bucketed, requests, ROUNDS) == out
  assert {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")} == traces
  full_logprobs = {}
  full = SlotEngine(target, DraftModel(draft), buckets=(128,), **kwargs)  # shares the 128 programs
  assert drive_rounds(full, requests, ROUNDS, logprobs=full_logprobs) == out
  for i in out:
    np.testing.assert_allclose(logprobs[i], full_logprobs[i], rtol=1e-5, atol=1e-5)
  assert out[0][:24] == reference(target, Request(requests[0].prompt, 24))


def test_caches_kept_at_their_bucket_give_the_windowed_tokens_and_move_between_buckets(target, draft):
  """bucket_cache: the state's caches cut and grown between buckets of 48, 96 and 128 positions as rows come
  and go (a long prompt grows them at its insert, widths change, sampled neighbours, a chunked prompt, n
  choices copied from one prefill) give every request the tokens of the windowed engine (sampled ones too: any
  change in the logits would move their draws); a third pass over the same requests traces no program again."""
  kwargs = dict(slots=4, max_len=128, ks=(0, 2), widths=(1, 4), rounds=ROUNDS, buckets=(48, 96),
                shrink_after=2, prefill_chunk=32)
  rng = np.random.default_rng(11)
  requests = [Request(tuple(rng.integers(0, 64, n).tolist()), m, seed=i,
                      sampling=SamplingConfig(temperature=0.8) if i % 3 == 1 else GREEDY)
              for i, (n, m) in enumerate(((5, 10), (3, 8), (12, 6), (9, 30), (30, 70), (70, 40), (50, 12),
                                          (6, 80), (20, 5), (4, 9)))]
  kept = SlotEngine(target, DraftModel(draft), bucket_cache=True, **kwargs)
  assert kept.length == 48  # an empty state starts at the shortest bucket
  results = []
  out = drive_rounds(kept, requests, ROUNDS, k=(2, 0, 2), results=results)
  assert {r.bucket for r in results} == {48, 96, 128} and kept.relengths >= 4  # grown and cut again
  assert any(a.bucket > b.bucket for a, b in zip(results, results[1:]))
  windowed = SlotEngine(target, DraftModel(draft), **kwargs)
  assert drive_rounds(windowed, requests, ROUNDS, k=(2, 0, 2)) == out
  for i, r in enumerate(requests):
    if r.sampling.greedy and r.max_new_tokens <= REF_NEW:
      assert out[i] == reference(target, r), i
  assert drive_rounds(kept, requests, ROUNDS, k=(2, 0, 2)) == out  # from where the first pass left the state
  traces = {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")}
  assert drive_rounds(kept, requests, ROUNDS, k=(2, 0, 2)) == out
  assert {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")} == traces
  # A chunked prompt, and n choices of one prompt (one prefill, the rows copied), at the state's length.
  long = Request(tuple(rng.integers(0, 64, 70).tolist()), 20)
  choices = [Request((7, 3, 9), 30, seed=s, sampling=SamplingConfig(temperature=0.8)) for s in (1, 2)]
  got = {}
  for engine in (kept, windowed):
    slot = engine.start_prefill(long)
    while engine.prefill_next() is None:
      pass
    slots = [slot] + engine.insert(choices)
    tokens = {s: [] for s in slots}
    while engine.live_slots:
      for s, t in engine.step(2, ROUNDS).tokens.items():
        tokens[s] += t
    got[engine.bucket_cache] = [tokens[s] for s in slots]
  assert got[True] == got[False] and got[True][0] == reference(target, long)
  # A request inserted when no row is live: its first call runs at the bucket it needs, not at the length the
  # long prompt left (which shrink_after would otherwise keep for two rounds).
  assert kept.length == 96 and not kept.live_slots
  kept.insert([Request((7, 3, 9), 4)])
  assert kept.step(0, 1).bucket == 48 and kept.length == 48
  with pytest.raises(ValueError, match="bucket_cache must be True or False"):
    SlotEngine(target, DraftModel(draft), bucket_cache=1, **kwargs)
  with pytest.raises(ValueError, match=r"length must be one of the compiled buckets \(48, 96, 128\)"):
    kept.relength(64)


@pytest.mark.parametrize("kind", ["eagle3", "tree"])
def test_caches_kept_at_their_bucket_keep_other_proposers_and_trees_exact(target, draft, kind):
  """bucket_cache with EAGLE-3 heads (a draft cache and features) and token trees (a round's window of several
  positions): across buckets 48, 96 and 128 and both widths, every greedy request gets the windowed engine's
  tokens, and generate's."""
  from specjax.models.heads import build_heads
  from specjax.proposers import Eagle
  from test_serving import TREE

  def make(kept: bool) -> SlotEngine:
    proposer = (DraftModel(draft) if kind == "tree" else
                Eagle(build_heads("eagle3", target.cfg, seed=3, draft_vocab_size=32, d2t=np.arange(0, 64, 2))))
    return SlotEngine(target, proposer, slots=2, max_len=128, ks=(2,), trees=(TREE,) if kind == "tree" else (),
                      widths=(1, 2), rounds=ROUNDS, buckets=(48, 96), shrink_after=2, bucket_cache=kept)

  rng = np.random.default_rng(13)
  requests = [Request(tuple(rng.integers(0, 64, n).tolist()), m) for n, m in ((5, 8), (3, 10), (40, 20), (70, 20),
                                                                              (6, 12))]
  schedule = (TREE, 2) if kind == "tree" else (2,)
  kept, results = make(True), []
  out = drive_rounds(kept, requests, ROUNDS, k=schedule, results=results)
  assert {r.bucket for r in results} == {48, 96, 128} and kept.relengths >= 3
  assert drive_rounds(make(False), requests, ROUNDS, k=schedule) == out
  for i, r in enumerate(requests):
    assert out[i] == reference(target, r), i


def test_a_warmed_up_engine_with_caches_at_their_bucket_compiles_nothing_while_it_serves(target, draft):
  """warm_up with bucket_cache compiles each program at each bucket's length and every cut and growth: then
  requests that take the state across every width and bucket trace no program (the target alone: the programs
  are per length whatever the proposer)."""
  engine = SlotEngine(target, None, slots=2, max_len=128, widths=(1, 2), rounds=ROUNDS, buckets=(48, 96),
                      shrink_after=2, bucket_cache=True)
  engine.warm_up()
  traces = {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")}
  rng = np.random.default_rng(12)
  requests = [Request(tuple(rng.integers(0, 64, n).tolist()), m) for n, m in ((5, 6), (3, 10), (40, 50), (70, 30))]
  results = []
  drive_rounds(engine, requests, ROUNDS, k=0, results=results)
  assert {r.bucket for r in results} == {48, 96, 128} and {r.width for r in results} == {1, 2}
  assert {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")} == traces


def test_keep_buckets_keeps_a_shorter_bucket_only_where_its_call_measured_cheaper_by_the_margin():
  """The largest bucket is always kept; a shorter one when its call costs under (1 - margin) of the call over the
  shortest one kept above it (so a run of buckets each a little cheaper is weighed against what is kept, not
  against its neighbour)."""
  assert keep_buckets({64: 3.3, 128: 4.5, 256: 6.0}) == (64, 128, 256)  # every window pays (the bundled pair)
  assert keep_buckets({128: 66.3, 256: 61.3}) == (256,)  # the copy costs more than the reads save (SmolLM2)
  assert keep_buckets({64: 0.98, 128: 0.99, 256: 1.0}) == (256,)  # within the margin: not worth a copy
  assert keep_buckets({64: 0.955, 128: 0.98, 256: 1.0}) == (64, 256)  # 64 weighed against 256, not 128
  assert keep_buckets({64: 0.98, 128: 0.99, 256: 1.0}, margin=0.0) == (64, 128, 256)
  assert keep_buckets({256: 1.0}) == (256,)
  for times, margin, field in (({}, 0.03, "times"), ({64: 0.0, 128: 1.0}, 0.03, "times"),
                               ({64: float("nan")}, 0.03, "times"), ({"64": 1.0}, 0.03, "times"),
                               ({64: 1.0}, 1.0, "margin"), ({64: 1.0}, -0.1, "margin"), ({64: 1.0}, True, "margin")):
    with pytest.raises(ValueError, match=field):
      keep_buckets(times, margin)


def test_buckets_chosen_per_width_bound_its_steps_with_the_tokens_of_every_bucket(target, draft):
  """time_buckets times a call over every bucket at every width and leaves the engine empty; buckets kept at a
  width (use_buckets, choose_buckets) bound what its steps attend over, max_len always among them, other
  widths unchanged, and every request gets the tokens of an engine using all its buckets; a bucket too short
  for the call, a width or a bucket that is not compiled, is refused by name."""
  kwargs = dict(slots=2, max_len=128, ks=(2,), widths=(1, 2), rounds=ROUNDS, buckets=(48, 96))
  engine = SlotEngine(target, DraftModel(draft), **kwargs)
  prefills = engine.prefills
  times = engine.time_buckets(repeats=1)
  assert set(times) == {1, 2} and all(set(t) == {48, 96, 128} for t in times.values()), times
  assert all(s > 0 for t in times.values() for s in t.values())
  assert engine.free_slots == 2 and engine.width == 1 and engine.prefills == prefills
  assert engine.active_buckets == {1: (48, 96, 128), 2: (48, 96, 128)}
  rng = np.random.default_rng(5)
  requests = [Request(tuple(rng.integers(0, 64, n).tolist()), m) for n, m in ((5, 60), (12, 20), (30, 70), (70, 40))]
  every = drive_rounds(SlotEngine(target, DraftModel(draft), **kwargs), requests, ROUNDS)
  engine.use_buckets({2: (96,)})
  assert engine.active_buckets == {1: (48, 96, 128), 2: (96, 128)}
  results = []
  assert drive_rounds(engine, requests, ROUNDS, results=results) == every
  assert {r.bucket for r in results if r.width == 2} == {96, 128}
  assert every[0][:24] == reference(target, Request(requests[0].prompt, 24))
  chosen = engine.choose_buckets(repeats=1)
  assert set(chosen) == {1, 2} and all(b[-1] == 128 and set(b) <= {48, 96, 128} for b in chosen.values()), chosen
  assert engine.active_buckets == chosen
  engine.use_buckets({1: (48, 96)})
  engine.insert([Request(tuple(range(1, 41)), 40)])  # 40 + 5 rounds of 3 + a margin of 16: 71 positions
  assert engine.bucket_for(ROUNDS, 2) == 96
  for bucket in (64, 48):  # not compiled; compiled but too short
    with pytest.raises(ValueError, match=r"bucket must be one of the compiled buckets \(48, 96, 128\).*at least 96"):
      engine.step(2, ROUNDS, bucket=bucket)
  assert engine.step(2, ROUNDS, bucket=128).bucket == 128
  with pytest.raises(ValueError, match="width 4 is not one of the engine's widths"):
    engine.use_buckets({4: (128,)})
  with pytest.raises(ValueError, match=r"not compiled; the engine's buckets are \(48, 96, 128\)"):
    engine.use_buckets({1: (64,)})


@pytest.mark.parametrize("combined", [False, True], ids=["draft", "ngram+draft"])
def test_plain_calls_that_leave_the_drafts_cache_whole_give_the_tokens_of_full_length_attention(target, draft,
                                                                                                 combined):
  """Plain calls of a draft-model engine carry the draft's cache whole (its commit leaves the cache alone: the
  draft catches up before its next proposals), speculative calls cut it to the bucket: with calls switching
  between k = 0 and k = 2 across buckets of 48, 96 and 128 positions, every request gets the tokens of an
  engine attending over all 128, greedy ones those of generate alone. The same for a combination of the draft
  with the n-gram proposer (no KV cache, so it keeps the combination's caches whole); one member that does not
  say it keeps them makes the combination cut them."""
  assert DraftModel.plain_rounds_keep_caches
  make = (lambda: Combined((NGram(), DraftModel(draft)))) if combined else (lambda: DraftModel(draft))
  assert make().plain_rounds_keep_caches

  class Opaque(DraftModel):
    plain_rounds_keep_caches = False

  assert not Combined((NGram(), Opaque(draft))).plain_rounds_keep_caches
  kwargs = dict(slots=2, max_len=128, ks=(0, 2), widths=(2,), rounds=ROUNDS)
  rng = np.random.default_rng(6)
  requests = [Request(tuple(rng.integers(0, 64, n).tolist()), m, sampling=sampling, seed=n)
              for n, m, sampling in ((5, 60, GREEDY), (12, 20, SamplingConfig(0.9)), (30, 70, GREEDY),
                                     (70, 40, SamplingConfig(0.8, top_k=5)))]
  results = []
  bucketed = drive_rounds(SlotEngine(target, make(), buckets=(48, 96), **kwargs), requests, ROUNDS,
                          k=(0, 0, 2), results=results)
  seen = {(r.bucket, r.k) for r in results}
  assert {(48, 0), (96, 0)} <= seen and any(k == 2 and bucket < 128 for bucket, k in seen), seen
  full = drive_rounds(SlotEngine(target, make(), buckets=(128,), **kwargs), requests, ROUNDS, k=(0, 0, 2))
  assert bucketed == full
  assert bucketed[0][:24] == reference(target, Request(requests[0].prompt, 24))
  assert bucketed[2][:24] == reference(target, Request(requests[2].prompt, 24))


def test_a_prompt_prefilled_in_chunks_between_steps_gives_the_tokens_of_one_prefilled_at_once(target, draft):
  """A 40-token prompt prefilled 16 tokens at a time while another request decodes (a step between every two
  chunks): both greedy requests equal generate alone, as the same prompt prefilled at once does; a cancel
  during the chunks frees the slot."""
  engine = SlotEngine(target, DraftModel(draft), slots=SLOTS, max_len=MAX_LEN, ks=KS, widths=WIDTHS, prefill_chunk=16)
  rng = np.random.default_rng(9)
  running = Request(tuple(rng.integers(0, 64, 6).tolist()), 20)
  long = Request(tuple(rng.integers(0, 64, 40).tolist()), 16)
  assert engine.chunks(long) and not engine.chunks(running)
  (first,) = engine.insert([running])
  slot = engine.start_prefill(long)
  out, chunks = {first: [], slot: []}, 0
  while engine.live_slots or engine.prefilling:
    if engine.prefilling:
      engine.prefill_next()
      chunks += 1
    for s, tokens in engine.step(2).tokens.items():
      out[s] += tokens
  assert chunks == 3 and engine.free_slots == SLOTS
  assert out[first] == reference(target, running) and out[slot] == reference(target, long)
  (at_once,) = engine.insert([long])
  whole = []
  while engine.live_slots:
    whole += engine.step(2).tokens.get(at_once, [])
  assert whole == out[slot]
  slot = engine.start_prefill(long)
  engine.prefill_next()
  engine.cancel(slot)
  assert not engine.prefilling and engine.free_slots == SLOTS

  # Chunks of 32: the last chunk's 8 tokens are passed padded to a prompt bucket of 16, not to 32 (a program
  # the warm-up compiled: slots of 80 positions, whose programs no engine above compiled), with the same tokens.
  engine = SlotEngine(target, DraftModel(draft), slots=SLOTS, max_len=80, ks=KS, widths=WIDTHS, prefill_chunk=32)
  engine.warm_up()
  sizes, program = [], engine._program
  engine._program = lambda kind, build, *settings: (sizes.append(settings) if kind == "serve-chunk" else None,
                                                    program(kind, build, *settings))[1]
  with backend_compiles() as compiled:
    slot = engine.start_prefill(long)
    while engine.prefill_next() is None:
      pass
    tokens = []
    while engine.live_slots:
      tokens += engine.step(2).tokens.get(slot, [])
  assert sizes == [(64, 32), (64, 16)] and not compiled
  assert tokens == reference(target, long)


def test_greedy_steps_give_the_tokens_of_the_general_program(target, draft):
  """An engine that runs its greedy program when every live row is greedy (no penalties) gives every request
  the tokens of one that always runs the general program: greedy requests equal generate, sampled ones their
  own seed's tokens (the two programs evolve keys and counts alike, so the modes may alternate under one
  request); a step runs the greedy program exactly when its live rows are all greedy and unadjusted."""
  requests = random_requests(5, seed=11) + random_requests(6, seed=12, sampled_every=2)  # greedy ones first
  penalised = dataclasses.replace(requests[0], sampling=SamplingConfig(temperature=0.0, repetition_penalty=1.3))
  requests.append(penalised)
  results = []
  fast = drive_rounds(multi_engine(target, draft), requests, ROUNDS, results=results)
  general = multi_engine(target, draft, greedy_steps=False)
  assert general.modes == (FULL,)
  assert drive_rounds(general, requests, ROUNDS) == fast
  assert {r.greedy for r in results} == {True, False}  # both programs ran, under requests that span both
  for i, r in enumerate(requests[:-1]):
    if r.sampling.greedy:
      assert fast[i] == reference(target, r), i
  engine = multi_engine(target, draft)
  (slot,) = engine.insert([penalised])
  assert engine.step_mode() == FULL and not engine.step(2, ROUNDS).greedy
  engine.cancel(slot)
  engine.step(2)
  engine.insert([requests[2]])  # greedy, no adjustments
  assert engine.step_mode() == GREEDY_STEPS and engine.step(2, ROUNDS).greedy


def test_a_deferred_warm_up_runs_greedy_steps_on_the_general_program_until_theirs_are_compiled(target, draft):
  """warm_up(defer_greedy=True) leaves the greedy step programs: greedy requests step on the general program
  (none waits for a compile); compile_greedy_steps, in a thread while requests are stepped, compiles each,
  after which every greedy step runs its greedy program with nothing traced again; the tokens are generate's
  throughout."""
  engine = multi_engine(target, draft)
  with pytest.raises(ValueError, match="defer_greedy must be True or False"):
    engine.warm_up(defer_greedy="yes")
  engine.warm_up(defer_greedy=True)
  total = len(engine.widths) * len(engine.buckets) * len(engine.candidates)
  assert engine.greedy_steps_pending == total
  requests = random_requests(4, seed=21)
  assert all(r.sampling.greedy for r in requests)
  want = {i: reference(target, r) for i, r in enumerate(requests)}
  before = []
  assert drive_rounds(engine, requests, ROUNDS, results=before) == want
  assert before and not any(r.greedy for r in before)  # nothing compiled yet: the general program ran

  compiled = []
  thread = threading.Thread(target=lambda: compiled.append(engine.compile_greedy_steps()))
  thread.start()
  assert drive_rounds(engine, requests, ROUNDS) == want  # stepped while the programs compile
  thread.join()
  assert compiled == [total] and engine.greedy_steps_pending == 0 and engine.compile_greedy_steps() == 0
  traces, after = dict(TRACE_COUNTS), []
  assert drive_rounds(engine, requests, ROUNDS, results=after) == want
  assert all(r.greedy for r in after) and dict(TRACE_COUNTS) == traces


def test_a_server_compiles_its_greedy_steps_while_serving_and_says_how_many_are_left(target):
  """build_server with a warm-up defers the greedy step programs to a thread started with the server: the
  specjax_greedy_steps_pending gauge counts them down to 0; defer_greedy=False compiles them all first."""
  from starlette.testclient import TestClient

  from specjax.serving.server import build_server
  from specjax.tokenizer import ByteTokenizer

  def pending(http) -> float:
    (line,) = [x for x in http.get("/metrics").text.splitlines() if x.startswith("specjax_greedy_steps_pending ")]
    return float(line.split()[1])

  for defer in (True, False):
    server = build_server(target, ByteTokenizer(), None, name="t", slots=2, widths=(2,), max_len=MAX_LEN, k=0,
                          buckets=(MAX_LEN,), defer_greedy=defer)
    engine = server.model.engine
    try:
      with TestClient(server.asgi) as http:
        deadline = time.monotonic() + 300
        while (left := pending(http)) and time.monotonic() < deadline:  # read once: it may reach 0 meanwhile
          assert defer and 0 < left <= 1
          time.sleep(0.2)
        assert pending(http) == 0 and engine.greedy_steps_pending == 0
        assert (engine._greedy_ready is not None) is defer
    finally:
      server.scheduler.stop()


def test_a_server_keeps_the_buckets_its_start_up_timing_chooses_and_reports_them(target, monkeypatch):
  """build_server with the default buckets and a warm-up keeps at each width what SlotEngine.choose_buckets
  measures (here made to drop 64 at width 2 and keep it at width 1), reports them in the
  specjax_attention_bucket gauge and serves within them; buckets given explicitly are all used unmeasured."""
  from starlette.testclient import TestClient

  from specjax.serving.server import build_server
  from specjax.tokenizer import ByteTokenizer

  timed = []

  def time_buckets(self, repeats=3):
    timed.append(repeats)
    return {1: {64: 0.5, 128: 1.0}, 2: {64: 0.99, 128: 1.0}}

  monkeypatch.setattr(SlotEngine, "time_buckets", time_buckets)
  for buckets, kept in ((None, {1: (64, 128), 2: (128,)}), ((64, 128), {1: (64, 128), 2: (64, 128)})):
    server = build_server(target, ByteTokenizer(), None, name="t", slots=2, widths=(1, 2), max_len=128, k=0,
                          buckets=buckets, defer_greedy=False)
    try:
      assert server.model.engine.buckets == (64, 128) and server.model.engine.active_buckets == kept
      assert server.scheduler.ahead  # launch_ahead unset: on, with no speculation policy
      with TestClient(server.asgi) as http:
        body = {"model": "t", "prompt": [1, 2], "max_tokens": 12, "temperature": 0.8, "n": 2, "seed": 1,
                "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        gauge = {(s.labels["width"], s.labels["bucket"]): s.value
                 for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples
                 if s.name == "specjax_attention_bucket"}
      assert gauge == {(str(w), str(b)): float(b in kept[w]) for w in (1, 2) for b in (64, 128)}
      ran = {(r[1], r[4]) for r in server.model.engine._ran if r[0] == "step"}  # (width, bucket) of each step run
      assert (2, min(kept[2])) in ran and all(b in kept[w] for w, b in ran), ran
    finally:
      server.scheduler.stop()
  assert timed == [3]  # measured once: not when the buckets are given


def test_a_server_with_caches_at_their_bucket_serves_the_same_tokens_and_reports_their_length(target):
  """build_server(bucket_cache=True): a greedy completion that outgrows the 64-position bucket gets the tokens of
  the server whose caches stay at max_len (and launches no call ahead); /metrics reports the caches' length and
  the times they moved."""
  from starlette.testclient import TestClient

  from specjax.serving.server import build_server
  from specjax.tokenizer import ByteTokenizer

  texts, seen = {}, {}
  for kept in (False, True):
    server = build_server(target, ByteTokenizer(), None, name="t", slots=2, widths=(1, 2), max_len=128, k=0,
                          buckets=(64, 128), defer_greedy=False, bucket_cache=kept, launch_ahead=kept)
    try:
      with TestClient(server.asgi) as http:
        body = {"model": "t", "prompt": [1, 2, 3], "max_tokens": 90, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        texts[kept] = response.json()["choices"][0]
        seen[kept] = {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text)
                      for s in f.samples if s.name.startswith("specjax_cache_")}
    finally:
      server.scheduler.stop()
  assert texts[True] == texts[False]
  assert seen[False] == {"specjax_cache_length": 128.0, "specjax_cache_relengths_total": 0.0}
  # An empty engine starts at 64; the request grew it to 128 (at least once; later cut again is allowed).
  assert seen[True]["specjax_cache_relengths_total"] >= 1 and seen[True]["specjax_cache_length"] in (64.0, 128.0)


def test_a_server_with_a_prompt_cache_answers_a_repeated_prompt_without_a_prefill_and_counts_it(target):
  """build_server(prompt_cache=2): the same completion twice (greedy), then sampled with a seed twice: each
  repeat the tokens of the first; every request after the first takes the kept row (the engine runs one
  prefill, /metrics counts three hits and one kept prompt); then a prompt that extends it starts from its
  caches (generate's tokens, one prefix hit of 20 tokens, no prefill)."""
  from starlette.testclient import TestClient

  from specjax.serving.server import build_server
  from specjax.tokenizer import ByteTokenizer

  server = build_server(target, ByteTokenizer(), None, name="t", slots=2, widths=(1, 2), max_len=128, k=0,
                        buckets=(128,), defer_greedy=False, prompt_cache=2)
  try:
    with TestClient(server.asgi) as http:
      answers = []
      for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 5}):
        body = {"model": "t", "prompt": list(range(4, 24)), "max_tokens": 12, "ignore_eos": True,
                "return_token_ids": True, **sampling}
        for _ in range(2):
          response = http.post("/v1/completions", json=body)
          assert response.status_code == 200, response.text
          answers.append(response.json()["choices"][0]["token_ids"])
      # The next turn of that prompt starts from its caches: its 20 tokens kept, the other 3 passed.
      body = {"model": "t", "prompt": list(range(4, 27)), "max_tokens": 12, "ignore_eos": True,
              "return_token_ids": True, "temperature": 0}
      response = http.post("/v1/completions", json=body)
      assert response.status_code == 200, response.text
      longer = response.json()["choices"][0]["token_ids"]
      seen = {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text)
              for s in f.samples if s.name.startswith("specjax_prompt_cache")}
  finally:
    server.scheduler.stop()
  assert answers[0] == answers[1] and answers[2] == answers[3] and answers[0] != answers[2]
  assert longer == generate(target, [list(range(4, 27))], max_new_tokens=12).rows()[0]
  assert seen == {"specjax_prompt_cache_hits_total": 3.0, "specjax_prompt_cache_prompts": 2.0,
                  "specjax_prompt_cache_prefix_hits_total": 1.0, "specjax_prompt_cache_prefix_tokens_total": 20.0}
  assert server.model.engine.prefills == 1


def test_the_first_call_after_an_admission_runs_one_round_then_full_calls(target, draft):
  """Through the scheduler with first_rounds=1: the first step that runs a new request runs one round (its first
  token comes after one round), the steps after it up to ROUNDS; the request's tokens equal generate's and
  those of a scheduler whose first call runs ROUNDS rounds (first_rounds=None); a bad first_rounds is refused
  by name."""
  outputs = {}
  for first_rounds in (1, None):
    engine = multi_engine(target, draft)
    steps, timed = [], []
    policy = fixed_policy(engine)
    choose = policy.choose
    policy.choose = lambda width, t=True: timed.append(t) or choose(width, t)  # what the scheduler says
    scheduler = Scheduler(engine, policy, max_queue=8, first_rounds=first_rounds,
                          on_step=lambda r, s: steps.append(r))
    scheduler.start()
    try:
      jobs = [Job(Request((7, 3, 5 + i), 20 + 4 * i), Collector()) for i in range(2)]
      for job in jobs:
        scheduler.submit(job)
        assert job.sink.done.wait(120) and job.sink.end.reason == "length"
      outputs[first_rounds] = [job.sink.tokens for job in jobs]
    finally:
      scheduler.stop()
    firsts = [next(r for r in steps if job.slot in r.tokens and r.row_rounds.get(job.slot)) for job in jobs]
    # Why each call returned: its rows' ends, else the limit the scheduler set on its rounds (the jobs ran one
    # after the other: each one's first call is the first, or follows the call that finished the job before).
    opening = [0] + [i + 1 for i, r in enumerate(steps[:-1]) if r.finished]
    for i, r in enumerate(steps):
      assert r.ended == ("finished" if r.finished else "first_rounds" if i in opening and first_rounds == 1
                         else "rounds"), (i, r.ended, r.rounds, r.finished)
      assert r.ended != "rounds" or r.rounds == ROUNDS
      # A one-round call is no timing: the policy is told so (it probes only on timed calls).
      assert timed[i] == (r.ended != "first_rounds"), (i, r.ended, timed[i])
    if first_rounds == 1:
      assert [r.rounds for r in firsts] == [1, 1]
      assert max(r.rounds for r in steps) == ROUNDS
    else:
      assert all(r.rounds > 1 for r in firsts)
  assert outputs[1] == outputs[None]
  assert all(out == reference(target, job.params) for out, job in zip(outputs[1], jobs))
  engine = multi_engine(target, draft)
  for bad in (0, ROUNDS + 1, 1.5, True):
    with pytest.raises(ValueError, match="first_rounds"):
      Scheduler(engine, fixed_policy(engine), first_rounds=bad)
  with pytest.raises(ValueError, match="greedy_steps"):
    multi_engine(target, draft, greedy_steps=1)


def test_a_freed_slot_is_offered_in_short_calls_that_double_and_a_request_sent_on_an_end_takes_it_at_once(
    target, draft):
  """After a call in which a request finished, while its slot stays free (and at least refill_share of the
  width's rows are), the scheduler's next calls run refill_rounds, then twice that, up to a full call; a request
  submitted by the finished one's end event (a closed-loop client in process) runs in the very next call. Every
  request's tokens equal generate's; bad refill_rounds and refill_share are refused by name."""

  def plain(engine):  # k = 0 every call: one token a round, so that the rounds of each call are known
    policy = fixed_policy(engine)
    policy.choose = lambda width, timed=True: 0
    return policy

  def run(jobs, refill_rounds, refill_share):
    engine = multi_engine(target, draft)
    steps = []
    scheduler = Scheduler(engine, plain(engine), max_queue=8, refill_rounds=refill_rounds, refill_share=refill_share,
                          on_step=lambda r, s: steps.append(r))
    scheduler.start()
    try:
      scheduler.submit(jobs)  # admitted together
      for job in jobs:
        assert job.sink.done.wait(120) and job.sink.end.reason == "length"
        assert job.sink.tokens == reference(target, job.params)
      wait_all_free(engine)
    finally:
      scheduler.stop()
    return steps

  # A short and a long request at width 4: once the short one ends, the long one runs alone in calls of 1, 2,
  # then ROUNDS (3 of the 4 rows are free: at least refill_share); full calls when refill_share asks for 4 of 4.
  for refill_rounds, share, expected in ((1, 0.25, [1, 2, ROUNDS]), (1, 1.0, [ROUNDS] * 3), (None, 0.25, [ROUNDS] * 3)):
    short, long = Job(Request((4, 6, 8), 3), Collector()), Job(Request((5, 7, 9), REF_NEW), Collector())
    steps = run([short, long], refill_rounds, share)
    after = steps[next(i for i, r in enumerate(steps) if short.slot in r.finished) + 1:]
    assert [r.rounds for r in after[:3]] == expected, [(r.rounds, r.ended) for r in steps]
    assert [r.ended for r in after[:3]] == (["refill"] * 2 + ["rounds"] if expected[0] == 1 else ["rounds"] * 3)

  # Two closed-loop clients of three requests each: each next request is submitted by its predecessor's end
  # event, on the engine thread, and runs in the next call: no call runs one request while both have more.
  class Chain(Collector):
    def __init__(self, follow=None):
      super().__init__()
      self.follow, self.scheduler = follow, None

    def __call__(self, event):
      super().__call__(event)
      if event.kind != "tokens" and self.follow is not None:
        self.scheduler.submit(self.follow)

  chains = []
  for c in range(2):
    jobs = [Job(Request((3 + c, 8, 2 + i), 6 + 3 * i + c), Chain()) for i in range(3)]
    for a, b in zip(jobs, jobs[1:]):
      a.sink.follow = b
    chains.append(jobs)
  steps = []  # (when on_step ran, the requests the call ran)
  engine = multi_engine(target, draft)
  scheduler = Scheduler(engine, plain(engine), max_queue=8, refill_rounds=None,
                        on_step=lambda r, s: steps.append((time.perf_counter(), len(r.row_rounds))))
  for job in (j for chain in chains for j in chain):
    job.sink.scheduler = scheduler
  scheduler.start()
  try:
    scheduler.submit([chain[0] for chain in chains])  # admitted together
    for job in (j for chain in chains for j in chain):
      assert job.sink.done.wait(120) and job.sink.end.reason == "length"
      assert job.sink.tokens == reference(target, job.params)
    wait_all_free(engine)
  finally:
    scheduler.stop()
  # Until the first chain's last request ended, every call ran both chains' requests.
  first_end = min(chain[-1].finished for chain in chains)
  assert len(steps) > 4 and all(n == 2 for t, n in steps if t < first_end), steps

  engine = multi_engine(target, draft)
  for bad in (0, -2, 1.5, True):
    with pytest.raises(ValueError, match="refill_rounds"):
      Scheduler(engine, fixed_policy(engine), refill_rounds=bad)
  for bad in (0, 1.5, True, "1"):
    with pytest.raises(ValueError, match="refill_share"):
      Scheduler(engine, fixed_policy(engine), refill_share=bad)


def test_rounds_per_call_lengthen_a_call_whose_fixed_cost_is_dear():
  """A call runs the base rounds unless its fixed cost is over the overhead of them: then the fewest rounds that
  bring it to the overhead, at most ``most``; bad arguments are refused by name."""
  cases = [(CallCost(1.1e-3, 1.2e-3), 19), (CallCost(1.1e-3, 3.3e-3), 8), (CallCost(13e-3, 61e-3), 8),
           (CallCost(5e-3, 0.1e-3), 32), (CallCost(0.0, 0.0), 32), (CallCost(0.0, 1.0), 8)]
  for cost, rounds in cases:
    assert rounds_per_call(cost, 8, 32) == rounds, cost
    assert rounds_per_call(cost, 8, 8) == 8
  assert rounds_per_call(CallCost(1.1e-3, 1.2e-3), 8, 32, overhead=0.2) == 8
  assert rounds_per_call(CallCost(1.0, 1.0), 1, 64, 0.05, 100) == 20  # exactly the overhead: no 21st round
  # The longest call: 20 rounds would bring the fixed cost to 5 %, but 50 ms hold 5 rounds of 10 ms; a base above
  # that stays.
  assert rounds_per_call(CallCost(10e-3, 10e-3), 2, 32) == 5 and rounds_per_call(CallCost(10e-3, 10e-3), 8, 32) == 8
  assert rounds_per_call(CallCost(10e-3, 10e-3), 2, 32, longest=1.0) == 20
  cost = CallCost(1.0, 1.0)
  for args, name in [((cost, 0, 8), "rounds"), ((cost, 8, 4), "most"), ((cost, 8, 32, 0.0), "overhead"),
                     ((cost, 8, 32, 1.5), "overhead"), ((cost, 2.0, 8), "rounds"), ((cost, 8, True), "most"),
                     (((1.0, 1.0), 8, 32), "cost"), ((CallCost(-1.0, 1.0), 8, 32), "cost"),
                     ((CallCost(float("nan"), 1.0), 8, 32), "cost"), ((cost, 8, 32, 0.05, 0), "longest")]:
    with pytest.raises(ValueError, match=name):
      rounds_per_call(*args)


def test_time_calls_splits_a_calls_cost_into_fixed_and_per_round_at_every_width(target, draft):
  """time_calls gives every width a fixed cost and a cost a round (calls of one round and of ROUNDS on live
  rows), and leaves the engine empty at its first width with its counters as they were."""
  engine = multi_engine(target, draft)
  prefills = engine.prefills
  costs = engine.time_calls(repeats=2)
  assert set(costs) == set(engine.widths)
  # (a one-round call takes time: its cost is the fixed part, the round, or both; each clipped at 0 when the
  # median of the longer calls comes out below it on a busy machine)
  assert all(isinstance(c, CallCost) and c.fixed >= 0 and c.round >= 0 and c.fixed + c.round > 0
             for c in costs.values()), costs
  assert engine.free_slots == SLOTS and engine.width == engine.widths[0] and engine.prefills == prefills
  with pytest.raises(ValueError, match="repeats"):
    engine.time_calls(repeats=0)
  with pytest.raises(ValueError, match="rounds is 1"):
    multi_engine(target, draft, rounds=1).time_calls()


def test_calls_run_longer_where_their_fixed_cost_is_dear_with_the_same_tokens_within_the_base_bucket(target, draft):
  """A scheduler with call costs that make width 1's calls dear (a fixed cost of 4 % of a round, at 1 %
  overhead: ROUNDS rounds) and width 4's free (the base, 2): requests get generate's tokens; full calls at
  width 4 ran 2 rounds; at width 1 more than 2, at most ROUNDS, and never a larger bucket than 2 rounds of
  their k need; bad call costs and rounds are refused by name."""
  engine = multi_engine(target, draft, ks=(2,), shrink_after=1, buckets=(32,))
  seen = []
  launch = engine.launch

  def launch_and_record(k, rounds=1):
    need = engine.bucket_for(2, k)
    call = launch(k, rounds)
    seen.append((engine.width, rounds, call.bucket, need))
    return call

  engine.launch = launch_and_record
  steps = []
  costs = {1: CallCost(fixed=4e-5, round=1e-3), 4: CallCost(fixed=0.0, round=1e-3)}
  scheduler = Scheduler(engine, max_queue=8, rounds=2, call_costs=costs, call_overhead=0.01,
                        on_step=lambda r, s: steps.append(r))
  assert scheduler.call_rounds(1, 2) == ROUNDS and scheduler.call_rounds(4, 2) == 2
  scheduler.start()
  try:
    together = [Job(Request((7, 3, 5 + i), 12 + 4 * i), Collector()) for i in range(3)]
    for job in together:
      scheduler.submit(job)
    for job in together:
      assert job.sink.done.wait(120) and job.sink.end.reason == "length"
    # Width 1; its first full call starts at a context of 4 to 6 (after a first call of one round), where 2 rounds
    # of k = 2 fit the 32 bucket (with its margin of 16) and ROUNDS do not.
    alone = Job(Request((2, 9, 4), 24), Collector())
    scheduler.submit(alone)
    assert alone.sink.done.wait(120) and alone.sink.end.reason == "length"
  finally:
    scheduler.stop()
  for job in together + [alone]:
    assert job.sink.tokens == reference(target, job.params)
  full = [(seen[i], r) for i, r in enumerate(steps) if r.ended == "rounds"]
  assert any(width == 4 for (width, *_), _ in full) and any(width == 1 for (width, *_), _ in full)
  for (width, rounds, bucket, need), r in full:
    assert (rounds == 2 if width == 4 else 2 <= rounds <= ROUNDS) and r.rounds == rounds
    assert bucket <= need, (width, rounds, bucket, need)
  assert any(rounds == ROUNDS for (width, rounds, *_), _ in full if width == 1)
  assert any(rounds < ROUNDS for (width, rounds, *_), _ in full if width == 1)  # held back by the bucket
  for bad, name in [({1: costs[1]}, "call_costs"), ({1: costs[1], 4: (0.0, 1.0)}, "cost"), ([costs[1]], "call_costs")]:
    with pytest.raises(ValueError, match=name):
      Scheduler(engine, call_costs=bad)
  for bad in (0, ROUNDS + 1, 1.5):
    with pytest.raises(ValueError, match="rounds must be"):
      Scheduler(engine, rounds=bad)
  with pytest.raises(ValueError, match="overhead"):
    Scheduler(engine, call_costs=costs, call_overhead=0)
  with pytest.raises(ValueError, match="longest"):
    Scheduler(engine, call_costs=costs, max_call_seconds=-1.0)


def test_a_calls_rounds_follow_the_round_cost_of_its_k():
  """With a policy, a full call's rounds weigh the width's fixed cost against the policy's estimate of a round of
  the call's k: a dearer k runs fewer rounds."""
  from types import SimpleNamespace

  engine = SimpleNamespace(candidates=(0, 4), ks=(0, 4), trees=(), rounds=32, widths=(1, 8))
  policy = SpeculationPolicy({1: {0: 1e-3, 4: 4e-3}, 8: {0: 4e-3, 4: 16e-3}})
  scheduler = Scheduler(engine, policy, rounds=8, call_costs={1: CallCost(2e-3, 1e-3), 8: CallCost(2e-3, 4e-3)})
  assert [scheduler.call_rounds(1, k) for k in (0, 4)] == [32, 10]
  assert [scheduler.call_rounds(8, k) for k in (0, 4)] == [10, 8]
  assert Scheduler(engine, policy, rounds=8).call_rounds(1, 0) == 8  # no call costs: the base at every width


def test_n_choices_of_one_prompt_share_one_prefill_and_each_equals_its_own_prefill(target, draft):
  """Requests with one prompt inserted together (n choices: sampled ones with their own seeds, a greedy one)
  run one prefill and fill the other rows by copying its row (target cache and the draft's state): each gets
  the tokens it gets when prefilled alone, sampled choices differ among themselves, the greedy one equals
  generate. Through the scheduler, the choices submitted together (all or none) are admitted with one prefill
  too."""
  engine = multi_engine(target, draft)
  prompt, sampled = (5, 9, 13, 2, 7), SamplingConfig(temperature=0.9, top_k=8)
  choices = [Request(prompt, 16, sampled, seed=100 + i) for i in range(2)] + [Request(prompt, 12, seed=7)]
  other = Request((8, 1, 8), 10)  # another prompt in the same insert: its own prefill
  prefills, copies = engine.prefills, engine.copies
  slots = engine.insert(choices + [other])[:len(choices)]
  assert (engine.prefills - prefills, engine.copies - copies) == (1, len(choices) - 1)
  shared = {slot: [] for slot in slots}
  while engine.live_slots:
    for slot, tokens in engine.step(2, ROUNDS).tokens.items():
      shared.setdefault(slot, []).extend(tokens)
  shared = [shared[slot] for slot in slots]
  prefills = engine.prefills
  alone = [drive_rounds(engine, [r], ROUNDS)[0] for r in choices]
  assert engine.prefills - prefills == len(choices)
  assert shared == alone
  assert shared[0] != shared[1] and shared[2] == reference(target, choices[2])

  engine = multi_engine(target, draft)
  always_2 = SpeculationPolicy({w: {2: 1.0} for w in engine.widths})  # k = 2 every step, as above
  scheduler = Scheduler(engine, always_2, max_queue=8)
  jobs = [Job(r, Collector()) for r in choices]
  prefills = engine.prefills
  scheduler.start()
  try:
    with pytest.raises(QueueFull):  # all or none
      scheduler.submit([Job(r, Collector()) for r in choices * 3])
    scheduler.submit(jobs)  # together in the queue, whenever the engine thread looks
    for job, tokens in zip(jobs, alone):
      assert job.sink.done.wait(120) and job.sink.tokens == tokens
  finally:
    scheduler.stop()
  assert engine.prefills - prefills == 1 and engine.copies == 2


def test_a_step_program_hands_back_its_outputs_as_one_array_that_unpacks_bit_for_bit():
  """_PackedStep: the outputs of a step program come back as one int32 array (one transfer a call), and
  unpack gives each output its own shape, dtype and bits (floats with -inf and NaN, booleans, unsigned,
  scalars, a None in the tree); an output of another width is refused by its dtype."""
  import jax
  import jax.numpy as jnp

  from specjax.serving.slots import _PackedStep

  def outputs(a, b, state):
    return ({"f": a * 2.0, "none": None}, a > 0, (b + 1).astype(jnp.uint32), jnp.int32(7), state.sum(), -b)

  def run(a, b, state):
    return state + 1, packed.pack(outputs(a, b, state))

  packed = _PackedStep(run)
  a = jnp.asarray([[1.5, -jnp.inf], [jnp.nan, -0.0]], jnp.float32)
  b = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
  state = jnp.ones((3,), jnp.float32)
  want = jax.device_get(outputs(a, b, state))
  new_state, flat = packed(a, b, state)
  assert isinstance(flat, jax.Array) and flat.dtype == jnp.int32 and flat.ndim == 1
  got = packed.unpack(np.asarray(flat))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype
    assert g.tobytes() == np.asarray(w).tobytes()
  assert np.array_equal(np.asarray(new_state), np.full((3,), 2.0, np.float32))

  wide = _PackedStep(lambda a, b, state: (state, wide.pack((a.astype(jnp.int8),))))
  with pytest.raises(TypeError, match="boolean or a 4-byte type, got int8"):
    wide(a, b, jnp.ones((3,), jnp.float32))


def drive_ahead(engine: SlotEngine, requests: list[Request], rounds: int, k: int = 2, results=None,
                cancel_at: int | None = None):
  """As :func:`drive_rounds`, with a second call launched ahead of each collect whenever no request waits for
  a free slot (and the engine takes it); ``cancel_at``: the request of that index is cancelled once it has
  tokens, while two calls are in flight."""
  pending, owner, out = list(range(len(requests))), {}, {i: [] for i in range(len(requests))}
  flight: list = []
  while pending or owner or flight:
    if not flight:
      if not (pending or owner):
        break
      while engine.free_slots and pending:
        (slot,) = engine.insert([requests[pending[0]]])
        owner[slot] = pending.pop(0)
      engine.compact()
      flight.append(engine.launch(k, rounds))
    if not (pending and engine.free_slots) and engine.can_launch_ahead(k, rounds):
      flight.append(engine.launch(k, rounds, ahead=True))
      if cancel_at is not None and out[cancel_at] and cancel_at in owner.values():
        slot = next(s for s, i in owner.items() if i == cancel_at)
        engine.cancel(slot)
        del owner[slot]
    take_tokens(engine.collect(flight.pop(0)), owner, out, results)
  return out


@pytest.mark.parametrize("bucket_cache", [False, True])
def test_calls_launched_ahead_give_every_request_the_tokens_of_calls_one_at_a_time(target, draft, bucket_cache):
  """A second call launched before the first is collected (the rows as they are: a row the first finishes runs
  on done, its slot free only after both) gives each request, greedy and sampled, the tokens of calls one at a
  time; a request cancelled with two calls in flight loses nothing for its neighbours; misuse is refused."""
  requests = random_requests(9, seed=23, sampled_every=3)
  kwargs = dict(bucket_cache=True, buckets=(32,)) if bucket_cache else {}
  engine = multi_engine(target, draft, **kwargs)
  results = []
  out = drive_ahead(engine, requests, ROUNDS, results=results)
  assert out == drive_rounds(multi_engine(target, draft, **kwargs), requests, ROUNDS)
  ahead = [r for r in results if r.ahead]
  assert ahead and any(a.finished for a, b in zip(results, results[1:]) if b.ahead)  # a row ran on done
  assert engine.free_slots == SLOTS and not engine.in_flight
  # A cancel while two calls are in flight: the others' tokens are unchanged, every slot comes back.
  cancelled = drive_ahead(engine, requests, ROUNDS, cancel_at=4)
  assert all(cancelled[i] == out[i] for i in range(len(requests)) if i != 4)
  assert cancelled[4] == out[4][:len(cancelled[4])] and engine.free_slots == SLOTS
  # An ahead call collected when it is already done has no timing (queued); collects keep their order.
  assert engine.sure_rounds() is None  # no live request
  slots = engine.insert(requests[:2])
  least = min(r.max_new_tokens for r in requests[:2])
  assert engine.sure_rounds() == least
  first = engine.launch(2, ROUNDS)
  assert engine.sure_rounds() == least - ROUNDS  # a round gives a live row one token at least
  second = engine.launch(2, ROUNDS, ahead=True)
  assert engine.sure_rounds() == least - 2 * ROUNDS
  with pytest.raises(RuntimeError, match="exactly one step in flight"):
    engine.launch(2, ROUNDS, ahead=True)
  with pytest.raises(RuntimeError, match="while a step is in flight"):
    engine.insert(requests[2:3])
  with pytest.raises(RuntimeError, match="the oldest step in flight"):
    engine.collect(second)
  second.outputs.block_until_ready()
  engine.collect(first)
  assert engine.collect(second).queued and engine.in_flight == 0
  with pytest.raises(RuntimeError, match="exactly one step in flight"):
    engine.launch(0, 1, ahead=True)
  with pytest.raises(ValueError, match="ahead must be True or False"):
    engine.launch(0, 1, ahead=1)
  for slot in slots:
    engine.cancel(slot)
  engine.step(0, 1)


def test_a_scheduler_launching_ahead_serves_every_request_its_tokens_and_says_so(target, draft):
  """Scheduler(ahead=True): calls go ahead while every slot is taken (counted by ``/metrics``), each request
  (greedy, sampled) gets the tokens of a scheduler without it, greedy ones generate's; a bad value is refused
  by name."""
  requests = random_requests(10, seed=5, sampled_every=3)
  got = {}
  for ahead in (False, True):
    engine = multi_engine(target, draft, ks=(2,))  # one k: a sampled request's draws follow its k
    seen, launches = [], []
    scheduler = Scheduler(engine, None, max_queue=16, ahead=ahead)
    launch = engine.launch

    def recorded(k, rounds=1, bucket=None, ahead=False, launch=launch):
      if ahead:  # no round of a call launched ahead may fall on a row already done by its length
        launches.append((rounds, engine.sure_rounds(), scheduler.full_rounds(k)))
      return launch(k, rounds, bucket, ahead)

    engine.launch = recorded
    metrics = ServeMetrics(scheduler)
    scheduler.on_step = lambda result, s: (seen.append(result.ahead), metrics.on_step(result, s))
    jobs = [Job(r, Collector()) for r in requests]
    scheduler.start()
    try:
      scheduler.submit(jobs)
      for job in jobs:
        assert job.sink.done.wait(120) and job.sink.end.reason in ("length", "stop")
      wait_all_free(engine)
    finally:
      scheduler.stop()
    got[ahead] = [job.sink.tokens for job in jobs]
    assert any(seen) == ahead and metrics.calls_ahead._value.get() == sum(seen)
    assert all(1 <= rounds <= sure for rounds, sure, _ in launches)
    assert any(sure < full for _, sure, full in launches) == ahead  # the bound cut some of them short
  assert got[True] == got[False]
  for job, tokens in zip(requests, got[True]):
    if job.sampling.greedy:
      assert tokens == reference(target, job)
  with pytest.raises(ValueError, match="ahead must be True or False"):
    Scheduler(engine, None, ahead="yes")


def test_a_switch_from_plain_rounds_catches_the_draft_up_in_an_untimed_round_before_the_call_that_times_k(
    target, draft):
  """After CATCH_UP_ROUNDS plain rounds a draft model is far behind, and the first call of k > 0 feeds what it
  missed (catch-up passes) before proposing: that call runs one round, untimed (``ended="catch_up"``), and the
  next runs the same k without asking the policy again, timed with no more catch-up passes than rounds. The
  request's tokens are generate's."""
  from specjax.serving.scheduler import CATCH_UP_ROUNDS

  engine = multi_engine(target, draft)
  policy = fixed_policy(engine)
  chosen, seen, steps = [], [], []
  choose, observe = policy.choose, policy.observe

  def scripted(width, timed=True):  # plain decoding for 4 calls (>= CATCH_UP_ROUNDS rounds), then k = 2
    choose(width, timed)
    chosen.append(0 if len(chosen) < 4 else 2)
    return chosen[-1]

  def recording(width, k, seconds, *args, **kwargs):
    seen.append((k, seconds))
    return observe(width, k, seconds, *args, **kwargs)

  policy.choose, policy.observe = scripted, recording
  scheduler = Scheduler(engine, policy, max_queue=8, on_step=lambda result, _: steps.append(result))
  scheduler.start()
  try:
    job = Job(Request((3, 5, 7), REF_NEW), Collector())
    scheduler.submit(job)
    assert job.sink.done.wait(120) and job.sink.tokens == reference(target, job.params)
  finally:
    scheduler.stop()
  ks = [k for k, _ in seen]
  switch = ks.index(2)
  assert sum(s.rounds for s in steps[:switch]) >= CATCH_UP_ROUNDS  # plain rounds before it
  caught, timed = steps[switch], steps[switch + 1]
  assert caught.ended == "catch_up" and caught.rounds == 1 and seen[switch][1] is None
  assert caught.catch_ups > caught.rounds  # the catch-up passes fell in that round (a sensitive split)
  assert ks[switch + 1] == 2 and timed.rounds > 1 and timed.catch_ups <= timed.rounds
  assert len(chosen) == len(steps) - 1  # the call after the catch-up took k without asking the policy
  assert "catch_up" not in [s.ended for s in steps[switch + 1:]]  # once: the draft keeps up while k > 0 runs


def test_a_requests_first_tokens_go_out_before_the_next_call_is_dispatched(target, draft):
  """The call that gives a request its first tokens is followed by their event before the next call is
  launched (its time to first token does not wait for a dispatch), with the tokens generate gives; later
  tokens still go out after the next call is dispatched (the device runs it meanwhile)."""
  engine = multi_engine(target, draft, ks=(0,))
  timeline = []
  launch, collect = engine.launch, engine.collect

  def launched(*args, **kwargs):
    timeline.append(("launch", None))
    return launch(*args, **kwargs)

  def collected(*args, **kwargs):
    result = collect(*args, **kwargs)
    timeline.append(("collect", None))
    return result

  engine.launch, engine.collect = launched, collected

  class Sink(Collector):
    def __call__(self, event):
      if event.kind == "tokens":
        timeline.append(("first" if not self.tokens else "more", self))
      super().__call__(event)

  scheduler = Scheduler(engine, None, max_queue=8)
  scheduler.start()
  try:
    jobs = [Job(Request((7, 3, 5 + i), 12 + 3 * i), Sink()) for i in range(3)]
    scheduler.submit(jobs)
    late = Job(Request((2, 9), 10), Sink())
    assert jobs[0].sink.done.wait(120)
    scheduler.submit(late)
    for job in jobs + [late]:
      assert job.sink.done.wait(120) and job.sink.tokens == reference(target, job.params)
  finally:
    scheduler.stop()
  def since_collect(i):  # what happened between the collect before timeline[i] and it
    c = max(j for j in range(i) if timeline[j][0] == "collect")
    return [kind for kind, _ in timeline[c + 1:i]]
  firsts = [i for i, (kind, _) in enumerate(timeline) if kind == "first"]
  assert len(firsts) == 4 and all("launch" not in since_collect(i) for i in firsts)
  assert any("launch" in since_collect(i) for i, (kind, _) in enumerate(timeline) if kind == "more")
