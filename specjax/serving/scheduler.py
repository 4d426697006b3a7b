"""The engine thread: one thread owns the slot engine (and the device); requests queue for it with a bound.

Each iteration of the thread's loop

1. frees the slots of cancelled requests (a client went away, a stop string matched),
2. admits waiting requests into free slots (one insert each, first come first served; consecutive requests
   with the same prompt, such as the n choices of one request, in one insert that prefills it once),
3. lets the engine move to a smaller width if the live requests have fit one for a while, picks k or a
   token tree for the width (:class:`~specjax.serving.policy.SpeculationPolicy`, or the fixed k) and runs
   one step: up to ``rounds`` rounds in one device call (more where the call's fixed cost is dear against
   a round of its k: :meth:`Scheduler.call_rounds`), which returns early when a row
   finishes (its slot can then take a waiting request) or, after the round in which it was set, when the
   engine's ``interrupt`` is (set by :meth:`Scheduler.submit` when a free slot can take the request, and by
   :meth:`Scheduler.cancel`); one round when a request waits for a free slot, ``first_rounds`` (one by
   default) when a request admitted since the last step runs for the first time (its first token streams
   after one round, not after a full call); the first call of k > 0 after ``CATCH_UP_ROUNDS`` plain rounds
   or more runs one round when the proposer catches up (a draft model), untimed, and the call after it the same
   k: the speculation policy times k there, not the catch-up over every plain round,
4. hands each request that finished its last tokens and its finish reason, so that a request sent on that end
   (by a client in this process) waits for a free slot already, and each request that got its first tokens
   those (its time to first token does not wait for the next call's dispatch), then
5. when nothing waits for the host (no cancel, no request that a free slot could take), dispatches the next
   step at once (after a call in which a request finished, while its slot is free, a short one: ``refill_rounds``,
   doubling each call), so that the device runs it while the host
6. hands every other request its new tokens of the step (one event per request and step).

With ``ahead``, step 3 also launches the next full call before collecting the one in flight, when nothing
above waits (see :class:`Scheduler`): the device then runs the two back to back while the host works.

A request that arrives during a step while a slot is free therefore waits for the step's current round (an
engine built with ``interruptible=False``: for the step, and the one dispatched before its arrival was
seen), and a cancel takes effect after the current round.

Requests talk to the thread through :class:`Job` objects: ``submit`` queues one (or refuses it:
:class:`QueueFull`, :class:`ShuttingDown`, or :class:`~specjax.serving.slots.RequestError`), its ``sink``
receives :class:`Event` objects on the engine thread (it must be quick and must not block; a server's sink
hands them to its event loop), and ``cancel`` ends it. A request whose insert or sink raises fails alone;
a step that raises fails the requests it was running, and the engine starts over with every slot free.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from specjax.serving.policy import SpeculationPolicy
from specjax.request import Request
from specjax.serving.slots import CallCost, SlotEngine, StepResult

log = logging.getLogger("specjax.serve")

# Plain rounds after which a proposer that catches up (a draft model, which skips k = 0 rounds and feeds what it
# missed before its next proposals) is far enough behind for the catch-up to weigh on a call: the first call of
# k > 0 after that many runs one round alone (untimed), so that the next one times k, not the switch to it.
CATCH_UP_ROUNDS = 8


class QueueFull(Exception):
  """The waiting queue is at its bound; retry later."""


class ShuttingDown(Exception):
  """The scheduler is draining or stopped and takes no new requests."""


@dataclasses.dataclass(frozen=True)
class Event:
  """What a request's sink receives: ``kind`` is "tokens" (``tokens``, and ``logprobs`` when the request asked
  for them), "done" (``reason``: "stop", "length" or "cancelled") or "error" (``error``: a message).

  ``logprobs`` is the engine's ``(logprobs, top_ids, top_logprobs)`` of exactly these tokens
  (:attr:`~specjax.serving.slots.StepResult.logprobs`: a float per token, and per token its N alternatives,
  most likely first; the top lists are empty when N is 0), or None.
  """

  kind: str
  tokens: tuple[int, ...] = ()
  reason: str | None = None
  error: str | None = None
  logprobs: tuple[list[float], list[list[int]], list[list[float]]] | None = None


_ids = itertools.count()


def rounds_per_call(cost: CallCost, rounds: int, most: int, overhead: float = 0.05, longest: float = 0.05) -> int:
  """The rounds of a full call whose fixed cost and round cost are ``cost``: ``rounds``, or more where the
  fixed cost is over ``overhead`` of them: the fewest that bring it to ``overhead`` (``ceil(fixed / (overhead *
  round))``), at most ``most`` and no more than ``longest`` seconds of rounds hold. Longer calls visit the host
  less often, but a request that arrives for a free slot waits for the call in flight: ``longest`` bounds that
  wait, so a call whose rounds are dear keeps ``rounds``.

  On the bundled pair (this CPU, plain rounds, timed at a server's start-up) a call costs ~2 ms beyond its
  rounds and a round 1.7-2.2 ms at width 1: such calls run ~20 rounds.

  Raises:
    ValueError: naming the argument: ``rounds`` and ``most`` integers with ``1 <= rounds <= most``, ``overhead``
      in (0, 1], ``longest`` seconds > 0, ``cost`` a :class:`CallCost` of finite non-negative seconds.
  """
  if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
    raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
  if isinstance(most, bool) or not isinstance(most, int) or most < rounds:
    raise ValueError(f"most must be an integer >= rounds ({rounds}), got {most!r}")
  if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not 0 < overhead <= 1:
    raise ValueError(f"overhead must be a fraction in (0, 1], got {overhead!r}")
  if isinstance(longest, bool) or not isinstance(longest, (int, float)) or not longest > 0:
    raise ValueError(f"longest must be a number of seconds > 0, got {longest!r}")
  if not isinstance(cost, CallCost) or not all(math.isfinite(x) and x >= 0 for x in (cost.fixed, cost.round)):
    raise ValueError(f"cost must be a CallCost of finite seconds >= 0, got {cost!r}")
  if cost.round == 0:
    return most
  need = math.ceil(cost.fixed / (overhead * cost.round) - 1e-9)
  return max(rounds, min(most, need, math.floor(longest / cost.round + 1e-9)))


@dataclasses.dataclass(eq=False)
class Job:
  """One request and its bookkeeping (times from ``time.perf_counter``; counts filled by the engine thread).

  Attributes:
    params: what to run. sink: receives :class:`Event` objects on the engine thread.
    arrival, admitted, first_token, finished: when it was submitted, got a slot, got its first token, ended.
    generated: tokens generated. rounds, drafted, accepted: its row-rounds and proposals.
  """

  params: Request
  sink: Callable[[Event], None]
  id: int = dataclasses.field(default_factory=lambda: next(_ids))
  arrival: float = dataclasses.field(default_factory=time.perf_counter)
  admitted: float | None = None
  first_token: float | None = None
  finished: float | None = None
  generated: int = 0
  rounds: int = 0
  drafted: int = 0
  accepted: int = 0
  slot: int | None = None
  cancelled: bool = False


class Scheduler:
  """Runs a :class:`SlotEngine` on its own thread for the requests submitted to it.

  Args:
    engine: the slot engine (only the scheduler's thread touches it once started).
    policy: picks k (or a tree) per step; None: the engine's one k (its ``ks`` must then hold exactly one,
      and it has no ``trees``).
    max_queue: requests that may wait for a slot; more are refused with :class:`QueueFull`.
    on_step: called on the engine thread after each step with ``(result, scheduler)`` (metrics).
    on_finish: called with each request that ended and its last event (any reason; on the engine thread,
      or on the thread that called :meth:`drain`).
    first_rounds: the most rounds of a step that runs a newly admitted request for the first time (so that
      its first token comes after that many rounds); None: as any step (the width's ``rounds``).
    rounds: the rounds of the other steps (a full call); None: the engine's ``rounds``.
    call_costs: ``{width: CallCost}`` (:meth:`SlotEngine.time_calls`): a full call of k then runs
      :func:`rounds_per_call` of its width's fixed cost and k's round (the policy's estimate of a round of k;
      without a policy, the timed one), between ``rounds`` and the engine's ``rounds`` — fewer where more would
      attend over a larger bucket than ``rounds`` need (a dearer round costs more than the call it saves).
      None: ``rounds`` at every width.
    call_overhead, max_call_seconds: the share of a call's time its fixed cost may take, and the longest a call
      is lengthened to (:func:`rounds_per_call`'s ``overhead`` and ``longest``).
    refill_rounds, refill_share: after a call in which a request finished, while at least ``refill_share`` of the
      width's rows are free and no request waits, the next calls run at most ``refill_rounds``, then twice that,
      and so on up to a full call: a request sent when the last one ended (a closed-loop client, the n-th of a
      batch of work) waits about as many rounds as its slot has been free, not a full call, for a few more calls
      when none comes. Where a smaller share of the rows is free, the idle rows cost less than the extra calls'
      fixed cost, and calls end often anyway (whenever one of the many rows finishes). None: full calls.
    ahead: launch the next full call before collecting the one in flight (:meth:`SlotEngine.launch` with
      ``ahead``), whenever the next call would be a full one anyway: no request waits for a free slot, no
      cancel or prompt chunk waits, and no slot freed by a finished request may be waiting for its client's
      next request (every slot taken, or no request finished in the last two calls); it runs no more rounds
      than every live request is sure to need after the call in flight (:meth:`SlotEngine.sure_rounds`: a row
      done by its length would run the rest on done, and the request sent on that end wait for them), and none
      where a row is sure to end in the call in flight. The device then runs the
      two back to back, and the host's work between them (collecting the first, handing out its tokens,
      choosing the next) overlaps the second, where otherwise the device waits for it. A request that arrives
      meanwhile waits for both. The same tokens per request either way.
  """

  def __init__(self, engine: SlotEngine, policy: SpeculationPolicy | None = None, *, max_queue: int = 64,
               on_step: Callable[[StepResult, Scheduler], None] | None = None,
               on_finish: Callable[[Job, Event], None] | None = None, first_rounds: int | None = 1,
               rounds: int | None = None, call_costs: Mapping[int, CallCost] | None = None,
               call_overhead: float = 0.05, max_call_seconds: float = 0.05, refill_rounds: int | None = 2,
               refill_share: float = 0.25, ahead: bool = False):
    if policy is None and len(engine.candidates) != 1:
      raise ValueError(f"an engine compiled for several k {engine.ks}"
                       + (f" and trees {[t.describe() for t in engine.trees]}" if engine.trees else "")
                       + " needs a policy to choose among them")
    if not isinstance(max_queue, int) or max_queue < 0:
      raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
    if first_rounds is not None and (isinstance(first_rounds, bool) or not isinstance(first_rounds, int)
                                     or not 1 <= first_rounds <= engine.rounds):
      raise ValueError(f"first_rounds must be None or an integer in [1, the engine's rounds {engine.rounds}], got "
                       f"{first_rounds!r}")
    self.first_rounds = first_rounds
    if refill_rounds is not None and (isinstance(refill_rounds, bool) or not isinstance(refill_rounds, int)
                                      or refill_rounds < 1):
      raise ValueError(f"refill_rounds must be None or an integer >= 1 (one a full call's rounds or more: full "
                       f"calls), got {refill_rounds!r}")
    if isinstance(refill_share, bool) or not isinstance(refill_share, (int, float)) or not 0 < refill_share <= 1:
      raise ValueError(f"refill_share must be a fraction in (0, 1], got {refill_share!r}")
    self.refill_rounds, self.refill_share = refill_rounds, refill_share
    if not isinstance(ahead, bool):
      raise ValueError(f"ahead must be True or False, got {ahead!r}")
    self.ahead = ahead
    self._since_finish = 0  # calls collected since the last one that finished a request
    self._plain_rounds = 0  # rounds of k = 0 collected since the last call of k > 0 (how far a draft is behind)
    self._next: object | None = None  # the k (or tree) a catch-up call chose for the call after it
    self._refill: int | None = None  # the most rounds of the next full call while a freed slot waits for a request
    rounds = engine.rounds if rounds is None else rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= engine.rounds:
      raise ValueError(f"rounds must be None or an integer in [1, the engine's rounds {engine.rounds}], got {rounds!r}")
    if call_costs is not None:
      if not isinstance(call_costs, Mapping) or set(call_costs) != set(engine.widths):
        raise ValueError(f"call_costs must be None or a mapping of every width {engine.widths} to a CallCost, got "
                         f"{call_costs!r}")
      for cost in call_costs.values():
        rounds_per_call(cost, rounds, engine.rounds, call_overhead, max_call_seconds)  # checks each cost
    rounds_per_call(CallCost(0.0, 1.0), rounds, engine.rounds, call_overhead, max_call_seconds)
    self.rounds, self.call_costs = rounds, call_costs
    self.call_overhead, self.max_call_seconds = call_overhead, max_call_seconds
    self.engine, self.policy, self.max_queue = engine, policy, max_queue
    self.on_step, self.on_finish = on_step, on_finish
    self._waiting: deque[Job] = deque()
    self._cancels: list[Job] = []
    self._live: dict[int, Job] = {}
    self._cond = threading.Condition()
    self._accepting = True
    self._stopping = False
    self._thread: threading.Thread | None = None
    # The engine's steps in flight, oldest first (k, call, limit): one dispatched before the last one's tokens
    # were handed out, and with ``ahead`` one more launched before that one was collected.
    self._calls: deque[tuple] = deque()
    self.error: BaseException | None = None  # what killed the thread, if anything did

  # ------------------------------------------------------------------------------- any thread

  @property
  def queue_length(self) -> int:
    return len(self._waiting)

  @property
  def slots_used(self) -> int:
    return len(self._live)

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  @property
  def accepting(self) -> bool:
    """New requests are taken (before :meth:`start` too: they wait for the thread)."""
    return self._accepting and (self._thread is None or self._thread.is_alive())

  def start(self) -> Scheduler:
    self._thread = threading.Thread(target=self._run, name="specjax-engine", daemon=True)
    self._thread.start()
    return self

  def submit(self, request: Job | list[Job]) -> None:
    """Queues ``request``, or a list of requests together (all or none, one after the other in the queue: the
    n choices of one prompt, admitted with one prefill when there are slots for them).

    Raises:
      RequestError: one does not fit the engine (naming the field). QueueFull: ``max_queue`` are waiting (or
      would be, with these). ShuttingDown: the scheduler takes no new requests.
    """
    requests = request if isinstance(request, list) else [request]
    for r in requests:
      self.engine.check(r.params)
    with self._cond:
      if not self.accepting:
        raise ShuttingDown("the server is shutting down")
      if len(self._waiting) + len(requests) > self.max_queue:
        raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue holds {self.max_queue})")
      self._waiting.extend(requests)
      if self.engine.free_slots > 0:
        self.engine.interrupt.set()  # the call in flight returns after its round: the request gets the slot
      self._cond.notify()

  def cancel(self, request: Job) -> None:
    """Ends ``request`` (its slot is freed at the next step); a no-op once it has finished."""
    with self._cond:
      if request.cancelled or request.finished is not None:
        return
      request.cancelled = True
      self._cancels.append(request)
      self.engine.interrupt.set()  # ended within the call's current round
      self._cond.notify()

  def drain(self) -> None:
    """Stops taking requests: those still waiting are refused (an error event), admitted ones finish."""
    with self._cond:
      self._accepting = False
      refused = list(self._waiting)
      self._waiting.clear()
    for request in refused:
      self._end(request, Event("error", error="the server is shutting down"))

  def stop(self, timeout: float = 10.0) -> None:
    """Drains, ends the requests still running (cancelled) and joins the thread (at most ``timeout`` s)."""
    self.drain()
    with self._cond:
      self._stopping = True
      self.engine.interrupt.set()
      self._cond.notify()
    if self._thread is not None:
      self._thread.join(timeout)

  # -------------------------------------------------------------------------------- the engine thread

  def _run(self) -> None:
    try:
      while True:
        with self._cond:
          while not (self._stopping or self._waiting or self._cancels or self._live
                     or self.engine.pending_cancels or self._calls):
            self._cond.wait()
          if self._stopping:
            break
          if self._calls:  # collect the steps in flight first: rows move only between steps
            cancels, admit = [], []
          else:
            cancels, self._cancels = self._cancels, []
            admit = [self._waiting.popleft() for _ in range(min(len(self._waiting), self.engine.free_slots))]
        for request in cancels:
          if request.slot is not None and self._live.get(request.slot) is request:
            self.engine.cancel(request.slot)
            del self._live[request.slot]
          self._end(request, Event("done", reason="cancelled"))
        for group in self._same_prompt(admit):
          self._admit(group)
        if not self._calls and self.engine.prefilling:
          self._prefill()
        if self.engine.live_slots or self.engine.pending_cancels or self._calls:
          self._step()
    except BaseException as e:  # never expected: keep the reason for /health and fail what is running
      self.error = e
      log.exception("the engine thread stopped")
    finally:
      with self._cond:
        self._accepting = False
        stranded = list(self._live.values()) + list(self._waiting)
        self._live.clear()
        self._waiting.clear()
      for request in stranded:
        self._end(request, Event("error", error="the server stopped before the request finished"))

  def _same_prompt(self, admit: list[Job]) -> list[list[Job]]:
    """``admit`` cut into runs of consecutive requests with the same prompt (the n choices of one request),
    each inserted at once so that they share one prefill (a prompt prefilled in chunks: a run of one)."""
    groups: list[list[Job]] = []
    for request in admit:
      if request.cancelled:
        self._end(request, Event("done", reason="cancelled"))
      elif (groups and groups[-1][0].params.prompt == request.params.prompt
            and not self.engine.chunks(request.params)):
        groups[-1].append(request)
      else:
        groups.append([request])
    return groups

  def _admit(self, requests: list[Job]) -> None:
    """Inserts ``requests`` (one, or the choices of one prompt: one prefill); they fail together if it raises."""
    try:
      if len(requests) == 1 and self.engine.chunks(requests[0].params):
        slots = [self.engine.start_prefill(requests[0].params)]
      else:
        slots = self.engine.insert([r.params for r in requests])
    except Exception as e:  # these requests alone fail
      log.exception("insert failed for requests %s", [r.id for r in requests])
      for request in requests:
        self._end(request, Event("error", error=f"the engine could not start the request: {e}"))
      return
    now = time.perf_counter()
    for request, slot in zip(requests, slots):
      request.slot, request.admitted = slot, now
      self._live[slot] = request
    self._refill = None

  def _prefill(self) -> None:
    """One chunk of the oldest prompt prefilled in chunks (between two steps: running requests wait for one
    chunk, not the whole prompt); its request fails alone if it raises."""
    slot = self.engine.prefilling[0]
    try:
      self.engine.prefill_next()
    except Exception as e:
      log.exception("prefill failed for the request in slot %s", slot)
      request = self._live.pop(slot, None)
      self.engine.cancel(slot)
      if request is not None:
        self._end(request, Event("error", error=f"the engine could not start the request: {e}"))

  def _launch(self) -> None:
    """Dispatches the next step: up to the width's ``rounds``; one while a prompt is prefilled in chunks (a
    chunk between every two rounds) or when a request could take a free slot; ``first_rounds`` when it runs
    a request for the first time."""
    self.engine.compact()
    with self._cond:
      # Under the lock that submit and cancel set it under: what arrives from here on interrupts this call.
      self.engine.interrupt.clear()
      waiting = bool(self._waiting) and self.engine.free_slots > 0
    if waiting or self.engine.prefilling:
      rounds, limit = 1, "waiting" if waiting else "prefill"
    elif self.engine.fresh and self.first_rounds is not None and self.first_rounds < self.rounds:
      rounds, limit = self.first_rounds, "first_rounds"
    else:
      rounds, limit = None, "rounds"  # a full call: its rounds depend on k
    idle = self.engine.width - len(self.engine.live_slots)  # rows of the width no request runs in
    refill = (rounds is None and self._refill is not None and self.engine.free_slots > 0
              and idle >= self.refill_share * self.engine.width)
    if rounds is None and not refill:
      self._refill = None
    # A call of one round where calls run several is no timing (see _step), nor a refill call (its few rounds
    # carry the call's fixed cost): no probe on either.
    timed = (rounds is None and not refill) or (rounds is not None and rounds >= min(2, self.engine.rounds))
    k, self._next = (self._next, None) if self._next is not None and timed else (self._choose(timed), None)
    if timed and self._behind(k):  # the switch first, untimed; then the call that times k
      self._next = k
      rounds, limit = 1, "catch_up"
    if rounds is None:
      rounds = self.full_rounds(k)
      if refill and self._refill < rounds:
        rounds, limit = self._refill, "refill"
        self._refill *= 2
      else:
        self._refill = None
    self._calls.append((k, self.engine.launch(k, rounds), limit))

  def _choose(self, timed: bool = True):
    return self.policy.choose(self.engine.width, timed) if self.policy is not None else self.engine.ks[0]

  def _behind(self, k) -> bool:
    """Whether a call of ``k`` would first catch the proposer up over many plain rounds: its time would hold
    the switch from k = 0 (one catch-up pass per ``CATCH_UP_WIDTH`` tokens of every row), which the policy
    would read as k's cost and, where it runs k = 0 and probes k now and then, hold against k at every probe."""
    return (k != 0 and self.policy is not None and self.engine.rounds > 1  # (one-round calls are all timed)
            and self._plain_rounds >= CATCH_UP_ROUNDS and getattr(self.engine.proposer, "catch_up", False))

  def _launch_ahead(self) -> None:
    """With ``ahead``, launches the next full call before the one in flight is collected, when the next call
    would be a full one anyway (see the class's ``ahead``)."""
    with self._cond:
      go = (len(self._calls) == 1 and self._live and not self._cancels and not self._stopping and self._accepting
            and not (self._waiting and self.engine.free_slots))
    # A slot freed in the last two calls may be waiting for its client's next request (a closed-loop client
    # sends it on the end): that request would wait for both calls, so no call goes ahead then.
    if not (go and not self.engine.pending_cancels and not self.engine.prefilling
            and (not self.engine.free_slots or self._since_finish >= 2)):
      return
    # No round of it on a row already done by its length: the request sent on that end would wait for them.
    sure = self.engine.sure_rounds()
    if sure is None or sure < 1:
      return
    if self._next is not None:
      return  # the call that times a k after its catch-up call goes through _launch
    k = self._choose()
    rounds, limit = (1, "catch_up") if self._behind(k) else (min(self.full_rounds(k), sure), "rounds")
    while rounds > 1 and not self.engine.can_launch_ahead(k, rounds):
      rounds //= 2
    if self.engine.can_launch_ahead(k, rounds):
      self._calls.append((k, self.engine.launch(k, rounds, ahead=True), limit))
      if limit == "catch_up":
        self._next = k

  def call_rounds(self, width: int, k) -> int:
    """The rounds of a full call of ``k`` at ``width`` (before the bucket's bound: :meth:`full_rounds`)."""
    if self.call_costs is None:
      return self.rounds
    cost = self.call_costs[width]
    if self.policy is not None:
      cost = CallCost(cost.fixed, self.policy.step_seconds(width, k))
    return rounds_per_call(cost, self.rounds, self.engine.rounds, self.call_overhead, self.max_call_seconds)

  def full_rounds(self, k) -> int:
    """The rounds of the next full call of ``k`` (at the engine's width, with its live rows): :meth:`call_rounds`,
    fewer where more would attend over a larger bucket than ``rounds`` need."""
    rounds = self.call_rounds(self.engine.width, k)
    if rounds > self.rounds:
      bucket = self.engine.bucket_for(self.rounds, k)
      while rounds > self.rounds and self.engine.bucket_for(rounds, k) > bucket:
        rounds -= 1
    return rounds

  def _step(self) -> None:
    finished: dict[int, Job] = {}  # the requests the step finished (out of _live, their events still to send)
    try:
      if not self._calls:
        self._launch()
      if self.ahead:
        self._launch_ahead()
      k, call, limit = self._calls.popleft()
      result = self.engine.collect(call)
      # Why the call returned: a row finished (or every row is done), the interrupt (a request arrived, a
      # cancel), else the limit on its rounds ran out.
      ended = "finished" if result.finished or not result.tokens else "interrupted" if result.interrupted else limit
      result = dataclasses.replace(result, ended=ended)
      for slot in result.finished:
        finished[slot] = self._live.pop(slot)
      self._since_finish = 0 if finished else self._since_finish + 1
      self._plain_rounds = self._plain_rounds + result.rounds if k == 0 else 0
      if finished and self.refill_rounds is not None:
        self._refill = self.refill_rounds
      # The finished requests end before the next call is dispatched: a request sent on an end (a closed-loop
      # client in this process, the next item of a batch job) then takes the freed slot in that call.
      self._hand_out(result, finished, time.perf_counter())
      with self._cond:
        chain = (self._live and not self._cancels and not self._stopping and self._accepting
                 and not (self._waiting and self.engine.free_slots))
      if self.policy is not None:
        # A program's first run is no timing, nor is a call of one round where calls run several, nor a refill
        # call: the call's fixed cost (the cache windowing, the host round trip) would weigh on its few rounds.
        # Nor a call dispatched behind an insert or a resize (queued): their time is in its own.
        untimed = result.cold or result.queued or result.rounds < min(2, self.engine.rounds) or limit == "refill"
        seconds = None if untimed else result.seconds / result.rounds
        self.policy.observe(result.width, k, seconds, result.reached, result.accepted_at,
                            accepted=sum(result.accepted.values()), row_rounds=sum(result.row_rounds.values()))
      # A request's first tokens go out before the next call is dispatched too (its time to first token, not
      # the dispatch: ~1-3 ms on a CPU, where XLA runs part of a program on the dispatching thread).
      fresh = {slot: r for slot, r in self._live.items() if r.first_token is None and result.tokens.get(slot)}
      self._hand_out(result, fresh, time.perf_counter())
      if (chain and not self._calls and not self.engine.pending_cancels and not self.engine.prefilling
          and self.engine.live_slots):
        self._launch()  # the device runs the next step while the host hands out the other tokens
    except Exception as e:  # the step itself failed: every running request fails, the engine starts over
      log.exception("a step failed; failing the %d requests it ran", len(self._live))
      running, self._live = list(self._live.values()) + list(finished.values()), {}
      self._calls.clear()
      self.engine.reset()
      for request in running:
        self._end(request, Event("error", error=f"the engine failed: {e}"))
      return
    self._hand_out(result, {slot: r for slot, r in self._live.items() if slot not in fresh}, time.perf_counter())
    if self.on_step is not None:
      try:
        self.on_step(result, self)
      except Exception:
        log.exception("on_step failed")

  def _hand_out(self, result: StepResult, requests: Mapping[int, Job], now: float) -> None:
    """Gives each of ``requests`` (by slot) its tokens of ``result`` and, if it finished, its end."""
    for slot, request in list(requests.items()):
      request.rounds += result.row_rounds.get(slot, 0)
      request.drafted += result.drafted.get(slot, 0)
      request.accepted += result.accepted.get(slot, 0)
      tokens = result.tokens.get(slot)
      if tokens:
        request.generated += len(tokens)
        request.first_token = request.first_token or now
        if not self._deliver(request, Event("tokens", tokens=tuple(tokens), logprobs=result.logprobs.get(slot))):
          continue
      if slot in result.finished:
        self._end(request, Event("done", reason=result.finished[slot]))

  def _deliver(self, request: Job, event: Event) -> bool:
    """Hands ``event`` to the request's sink; a sink that raises fails its request alone."""
    try:
      request.sink(event)
      return True
    except Exception as e:
      log.exception("request %s failed while taking its tokens", request.id)
      if request.slot is not None and self._live.get(request.slot) is request:
        self.engine.cancel(request.slot)
        del self._live[request.slot]
      self._end(request, Event("error", error=f"the request failed: {e}"))
      return False

  def _end(self, request: Job, event: Event) -> None:
    if request.finished is not None:
      return
    request.finished = time.perf_counter()
    try:
      request.sink(event)
    except Exception:
      log.exception("request %s failed while ending", request.id)
    if self.on_finish is not None:
      try:
        self.on_finish(request, event)
      except Exception:
        log.exception("on_finish failed")
