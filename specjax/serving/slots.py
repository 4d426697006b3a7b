"""The slot engine: a fixed number of decode slots, stepped together by one jitted speculative round.

The running state is one :class:`specjax.engine.DecodeState` whose rows are slots (static shapes): every
row has its own KV cache of ``max_len`` positions, its own proposer state, its own PRNG key, and its own
settings in a :class:`SlotSettings` (sampling, max tokens, stop tokens), all per-row arrays, so one
compiled program serves any mix of requests. A free row is a row marked done.

The state runs at a *width*, one of a few batch sizes compiled ahead (by default the powers of two up to
``slots``): the smallest that holds the live requests. A step computes every row of its width, live or
not, so a server with one live request of eight slots steps one row, not eight; the width grows when an
insert needs a row and shrinks (the live rows gathered to the front) once the live requests have fit a
smaller width for ``shrink_after`` steps. A request keeps its slot id while its row moves.

- :meth:`SlotEngine.insert` prefills new requests (one compiled program per prompt bucket and number of
  requests) and writes them into free rows of the running state (one program per width and number of
  requests; ``.at[rows].set``: every cache and proposer-state leaf is batch-major), in place (donated).
- :meth:`SlotEngine.step` runs one round (:func:`specjax.engine.round_step`) for every row with ``k``
  proposals, ``k`` one of the compiled ``ks``; requests that finish (a stop token, their max tokens) or
  were cancelled are freed at once and their slots can be refilled before the next step.
- :meth:`SlotEngine.compact` moves to a smaller width when the live requests have fit one long enough.

Exactness holds per request, whatever shares the batch and whatever the width: a slot's greedy output
equals :func:`specjax.generate` for its prompt alone, and its sampled output follows the target's warped
distribution, drawn from the request's own key (``seed``).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import engine
from specjax.config import GREEDY, MAX_K, SamplingConfig
from specjax.decode import MAX_STOP_TOKENS, MIN_PROMPT_BUCKET, bucket_length
from specjax.engine import DecodeState, RoundStats
from specjax.proposers import Proposer
from specjax.runtime import RUNTIME, SplitModels, Structure
from specjax.sampling import RowSampling

# Traces of each program: "serve_empty", "serve_prefill", "serve_write", "serve_resize", "serve_step".
TRACE_COUNTS = RUNTIME.trace_counts


class RequestError(ValueError):
  """A request the engine cannot run; ``field`` names the offending request field."""

  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field = field


@dataclasses.dataclass(frozen=True)
class SlotRequest:
  """What one request asks of the engine.

  Attributes:
    prompt: token ids, at least one.
    max_new_tokens: tokens to generate at most (>= 1).
    sampling: temperature / top-k / top-p of this request (temperature 0: greedy).
    stop_ids: up to ``MAX_STOP_TOKENS`` token ids that end the request (included in its output).
    seed: the request's PRNG seed (any integer; its draws depend on it alone).
  """

  prompt: tuple[int, ...]
  max_new_tokens: int
  sampling: SamplingConfig = GREEDY
  stop_ids: tuple[int, ...] = ()
  seed: int = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSettings:
  """The per-row settings a step reads, arrays over the ``W`` rows of the width."""

  max_new: jax.Array  # [W] int32
  stop_ids: jax.Array  # [W, MAX_STOP_TOKENS] int32, padded with -1
  sampling: RowSampling  # [W] each


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What one step did, on the host.

  Attributes:
    k: proposals per row this step. width: rows the step computed.
    tokens: ``{slot: new token ids}`` for every slot that emitted tokens.
    finished: ``{slot: "stop" | "length"}`` for the requests that ended this step (their slots are free).
    row_rounds, drafted, accepted: ``{slot: count}`` this step (a request's own statistics).
    reached, accepted_at: ``[k_max] int`` row-rounds in which proposal i was verified (its predecessors
      accepted) / accepted: acceptance by position, over the live rows.
    catch_ups: proposer passes besides the proposals (the draft model catching up).
    seconds: wall time of the step, dispatch to results on the host.
  """

  k: int
  width: int
  tokens: dict[int, list[int]]
  finished: dict[int, str]
  row_rounds: dict[int, int]
  drafted: dict[int, int]
  accepted: dict[int, int]
  reached: np.ndarray
  accepted_at: np.ndarray
  catch_ups: int
  seconds: float


def _check_int(field: str, value, low: int, high: int | None = None) -> None:
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= low
  if not ok or (high is not None and value > high):
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    raise ValueError(f"{field} must be {allowed}, got {value!r}")


def default_widths(slots: int) -> tuple[int, ...]:
  """The powers of two below ``slots``, and ``slots``."""
  return tuple(sorted({1 << i for i in range(slots.bit_length()) if 1 << i < slots} | {slots}))


class SlotEngine:
  """A fixed number of decode slots over one target (and optionally a proposer), stepped together.

  Args:
    target: the target model. proposer: any :class:`specjax.proposers.Proposer`, or None (plain decoding).
    slots: the number of requests served at once (the largest width).
    max_len: positions per slot: a request needs ``len(prompt) + max_new_tokens + max(ks) <= max_len``.
      Attention reads all of them at every step, so a step's cost grows with it.
    ks: the speculation lengths to compile a step for (``(0,)`` without a proposer).
    widths: the batch sizes the state may run at (each compiles its own step per k); default
      :func:`default_widths`; ``(slots,)``: always every slot.
    shrink_after: steps the live requests must fit a smaller width before the state moves to it.

  Raises:
    ValueError: naming the argument and its allowed values.
  """

  def __init__(self, target, proposer: Proposer | None = None, *, slots: int = 8, max_len: int = 512,
               ks: Sequence[int] = (0,), widths: Sequence[int] | None = None, shrink_after: int = 8):
    cfg = getattr(target, "cfg", None)
    if cfg is None or not hasattr(cfg, "vocab_size"):
      raise ValueError(f"target must be a specjax model (with a .cfg config), got {type(target).__name__}")
    if proposer is not None and not isinstance(proposer, Proposer):
      raise ValueError(f"proposer must be a specjax.proposers.Proposer or None, got {type(proposer).__name__}")
    _check_int("slots", slots, 1)
    _check_int("max_len", max_len, MIN_PROMPT_BUCKET, cfg.max_seq_len)
    _check_int("shrink_after", shrink_after, 1)
    ks = tuple(sorted(set(ks)))
    if not ks or any(not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K for k in ks):
      raise ValueError(f"ks must be integers in [0, {MAX_K}], got {ks!r}")
    if proposer is None and ks != (0,):
      raise ValueError(f"ks={ks} needs a proposer; without one the only speculation length is 0")
    widths = default_widths(slots) if widths is None else tuple(sorted(set(widths)))
    if not widths or any(not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= slots for w in widths) \
        or widths[-1] != slots:
      raise ValueError(f"widths must be integers in [1, slots={slots}] including slots, got {widths!r}")
    if proposer is not None:
      if proposer.max_k is not None and max(ks) > proposer.max_k:
        raise ValueError(f"ks holds {max(ks)}, more than the {proposer.max_k} proposals per round this "
                         f"{proposer.name} proposer can make")
      proposer.check(cfg, max_len)
    self.target, self.proposer = target, proposer
    self.slots, self.max_len, self.ks, self.k_max = slots, max_len, ks, max(ks)
    self.widths, self.shrink_after = widths, shrink_after
    self.vocab_size = cfg.vocab_size
    self._models = SplitModels(target, proposer)
    self.reset()

  # ------------------------------------------------------------------------------------------ host

  def _program(self, kind: str, build, *settings):
    return self._models.cached(kind, build, *settings, self.max_len, self.k_max)

  def reset(self) -> None:
    """Drops every request: all slots free, the smallest width (after a failed step, or to start over)."""
    self._set_empty(self.widths[0])
    self._free = list(range(self.slots))  # slot ids, a heap: the lowest first
    self._row: dict[int, int] = {}  # slot -> its row in the state, for live and cancelled slots
    self._live: dict[int, frozenset[int]] = {}  # live slot -> its stop ids
    self._cancelled: set[int] = set()  # slots whose rows the next step marks done
    self._fits_smaller = 0  # consecutive steps whose live requests fit a smaller width

  def _set_empty(self, width: int) -> None:
    program, args = self._program("serve-empty", _build_empty, width)
    self.state, self.settings = program(*args)
    self.width = width

  @property
  def free_slots(self) -> int:
    return len(self._free)

  @property
  def live_slots(self) -> list[int]:
    return sorted(self._live)

  @property
  def pending_cancels(self) -> bool:
    """Cancelled slots wait for the next step (which marks their rows done) before they are free."""
    return bool(self._cancelled)

  def check(self, request: SlotRequest) -> None:
    """Raises :class:`RequestError` (naming the field) unless ``request`` fits this engine."""
    prompt = request.prompt
    if len(prompt) == 0:
      raise RequestError("prompt", "the prompt is empty: it needs at least 1 token")
    bad = [t for t in prompt if not (isinstance(t, (int, np.integer)) and 0 <= t < self.vocab_size)]
    if bad:
      raise RequestError("prompt", f"the prompt holds token id {bad[0]!r} outside the vocabulary "
                                   f"[0, {self.vocab_size})")
    n = request.max_new_tokens
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
      raise RequestError("max_new_tokens", f"max_new_tokens must be an integer >= 1, got {n!r}")
    room = self.max_len - self.k_max
    if len(prompt) + n > room:
      raise RequestError("max_new_tokens" if len(prompt) < room else "prompt",
                         f"the prompt ({len(prompt)} tokens) + max_new_tokens ({n}) = {len(prompt) + n} exceeds "
                         f"the {room} tokens a slot holds (max_len {self.max_len} - {self.k_max} for the last "
                         f"round's proposals)")
    if len(request.stop_ids) > MAX_STOP_TOKENS:
      raise RequestError("stop_ids", f"at most {MAX_STOP_TOKENS} stop tokens, got {len(request.stop_ids)}")
    bad = [t for t in request.stop_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < self.vocab_size)]
    if bad:
      raise RequestError("stop_ids", f"stop token {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
    if not isinstance(request.sampling, SamplingConfig):
      raise RequestError("sampling", f"sampling must be a SamplingConfig, got {type(request.sampling).__name__}")
    if not isinstance(request.seed, (int, np.integer)) or isinstance(request.seed, bool):
      raise RequestError("seed", f"seed must be an integer, got {request.seed!r}")

  def insert(self, requests: Sequence[SlotRequest]) -> list[int]:
    """Prefills ``requests`` and writes them into free rows of the running state (growing its width when
    the rows in use and the new ones do not fit).

    Requests are grouped by prompt bucket; each group is one prefill and one write. A server inserts one
    request at a time; a batch of equal-bucket requests shares the calls.

    Returns:
      The slot of each request, in order.

    Raises:
      RequestError: a request that does not fit (nothing is inserted then).
      ValueError: more requests than free slots.
    """
    for request in requests:
      self.check(request)
    if len(requests) > len(self._free):
      raise ValueError(f"{len(requests)} requests but only {len(self._free)} free slots")
    used = set(self._row.values())
    if len(used) + len(requests) > self.width:
      self._resize(min(w for w in self.widths if w >= len(used) + len(requests)),
                   sorted(self._row, key=self._row.get))
      used = set(self._row.values())
    rows = [r for r in range(self.width) if r not in used][:len(requests)]
    slots = [heapq.heappop(self._free) for _ in requests]
    groups: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
      groups.setdefault(bucket_length(len(request.prompt)), []).append(i)
    try:
      for bucket, members in groups.items():
        self._insert_group(bucket, [requests[i] for i in members], [rows[i] for i in members])
        for i in members:
          self._row[slots[i]] = rows[i]
          self._live[slots[i]] = frozenset(requests[i].stop_ids)
    except Exception:
      for slot in slots:
        self._row.pop(slot, None)
        self._live.pop(slot, None)
        heapq.heappush(self._free, slot)
      raise
    return slots

  def _insert_group(self, bucket: int, requests: list[SlotRequest], rows: list[int]) -> None:
    group = len(requests)
    prompts = np.zeros((group, bucket), np.int32)
    for row, request in zip(prompts, requests):
      row[:len(request.prompt)] = request.prompt
    stop = np.full((group, MAX_STOP_TOKENS), -1, np.int32)
    for row, request in zip(stop, requests):
      row[:len(request.stop_ids)] = request.stop_ids
    arrays = dict(
        rows=np.asarray(rows, np.int32),
        seeds=np.asarray([int(r.seed) % (1 << 32) for r in requests], np.uint32),
        max_new=np.asarray([r.max_new_tokens for r in requests], np.int32), stop_ids=stop,
        temperature=np.asarray([r.sampling.temperature for r in requests], np.float32),
        top_k=np.asarray([r.sampling.top_k for r in requests], np.int32),
        top_p=np.asarray([r.sampling.top_p for r in requests], np.float32))
    prefill, args = self._program("serve-prefill", _build_prefill, bucket, group)
    new = prefill(*args, prompts, np.asarray([len(r.prompt) for r in requests], np.int32))
    write, _ = self._program("serve-write", _build_write, self.width, group)
    self.state, self.settings = write(self.state, self.settings, new, arrays)

  def cancel(self, slot: int) -> None:
    """Ends the request in ``slot``: the next step marks its row done, and the slot is free after it."""
    if slot in self._live:
      del self._live[slot]
      self._cancelled.add(slot)

  def compact(self) -> bool:
    """Moves the state to the smallest width that holds the live requests, once they have fit a smaller
    width for ``shrink_after`` steps (cancelled rows are dropped on the way). Returns whether it moved."""
    if self._fits_smaller < self.shrink_after:
      return False
    live = sorted(self._live, key=self._row.get)
    width = min(w for w in self.widths if w >= len(live))
    if width == self.width:  # requests inserted since the last step fill the width again
      self._fits_smaller = 0
      return False
    self._resize(width, live)
    return True

  def _resize(self, width: int, keep: list[int]) -> None:
    """The state at ``width`` with the rows of the slots in ``keep`` moved to rows 0, 1, ... in that order;
    the rows of other slots (cancelled ones) are dropped and their slots freed."""
    src = np.full((width,), -1, np.int32)
    src[:len(keep)] = [self._row[s] for s in keep]
    program, _ = self._program("serve-resize", _build_resize, self.width, width)
    self.state, self.settings = program(self.state, self.settings, src)
    for slot in set(self._row) - set(keep):
      self._cancelled.discard(slot)
      heapq.heappush(self._free, slot)
    self._row = {slot: i for i, slot in enumerate(keep)}
    self.width, self._fits_smaller = width, 0

  def step(self, k: int) -> StepResult:
    """One speculative round with ``k`` proposals (one of ``ks``) for every row of the current width.

    Returns:
      :class:`StepResult`; the slots of finished requests are free when it returns.
    """
    if k not in self.ks:
      raise ValueError(f"k must be one of the compiled speculation lengths {self.ks}, got {k!r}")
    width = self.width
    cancel = np.zeros((width,), bool)
    cancel[[self._row[s] for s in self._cancelled]] = True
    program, args = self._program("serve-step", _build_step, width, k)
    start = time.perf_counter()
    self.state, outputs = program(*args, self.state, self.settings, cancel)
    emitted, count, done, stats = jax.device_get(outputs)
    seconds = time.perf_counter() - start
    for slot in self._cancelled:
      del self._row[slot]
      heapq.heappush(self._free, slot)
    self._cancelled.clear()

    tokens, finished, row_rounds, drafted, accepted = {}, {}, {}, {}, {}
    for slot, stop_ids in list(self._live.items()):
      row = self._row[slot]
      n = int(count[row])
      new = emitted[row, :n].tolist()
      if n:
        tokens[slot] = new
      row_rounds[slot], drafted[slot] = int(stats.row_rounds[row]), int(stats.drafted[row])
      accepted[slot] = int(stats.accepted[row])
      if done[row]:
        finished[slot] = "stop" if new and new[-1] in stop_ids else "length"
        del self._live[slot], self._row[slot]
        heapq.heappush(self._free, slot)
    smaller = [w for w in self.widths if w < width]
    fits = bool(smaller) and len(self._live) <= smaller[-1]
    self._fits_smaller = self._fits_smaller + 1 if fits else 0
    return StepResult(k=k, width=width, tokens=tokens, finished=finished, row_rounds=row_rounds,
                      drafted=drafted, accepted=accepted, reached=np.asarray(stats.reached),
                      accepted_at=np.asarray(stats.accepted_at), catch_ups=int(stats.catch_ups), seconds=seconds)

  # ---------------------------------------------------------------------------------- compilation

  def warm_up(self) -> None:
    """Compiles every program a request can need, without touching the state: the prefill of one request
    for each prompt bucket up to ``max_len``, and for each width its write, its step for each k and its
    resizes to every other width (ahead-of-time lowering with the states' shapes)."""
    if self._live or self._cancelled:
      raise RuntimeError("warm_up needs an engine without requests")
    self.compile_prefills()
    start = self.width
    for width in self.widths:
      self._set_empty(width)
      self._lower("serve-write", _build_write, width, 1)
      for k in self.ks:
        self._lower("serve-step", _build_step, width, k)
      for other in self.widths:
        if other != width:
          self._lower("serve-resize", _build_resize, width, other)
    self._set_empty(start)

  def compile_prefills(self, groups: Iterable[int] = (1,)) -> None:
    """Compiles the prefill for every prompt bucket up to ``max_len`` and each number of requests."""
    bucket = MIN_PROMPT_BUCKET
    while bucket <= self.max_len:
      for group in groups:
        self._lower("serve-prefill", _build_prefill, bucket, group)
      bucket *= 2

  def _lower(self, kind: str, build, *settings) -> None:
    program, args = self._program(kind, build, *settings)
    if kind == "serve-prefill":
      bucket, group = settings
      operands = (*args, np.zeros((group, bucket), np.int32), np.ones((group,), np.int32))
    elif kind == "serve-write":
      new = jax.eval_shape(self._program("serve-prefill", _build_prefill, MIN_PROMPT_BUCKET, settings[1])[0],
                           *args, jax.ShapeDtypeStruct((settings[1], MIN_PROMPT_BUCKET), jnp.int32),
                           jax.ShapeDtypeStruct((settings[1],), jnp.int32))
      operands = (self.state, self.settings, new, _write_arrays(settings[1]))
    elif kind == "serve-resize":
      operands = (self.state, self.settings, np.zeros((settings[1],), np.int32))
    else:
      operands = (*args, self.state, self.settings, np.zeros((settings[0],), bool))
    program.lower(*operands).compile()

  def time_steps(self, repeats: int = 5) -> dict[int, dict[int, float]]:
    """``{width: {k: seconds}}``: the median time of a step for each compiled width and k, timed
    interleaved on empty states (a step computes every row of its width all the same)."""
    _check_int("repeats", repeats, 1)
    if self._live or self._cancelled:
      raise RuntimeError("time_steps needs an engine without requests")
    times: dict[int, dict[int, list[float]]] = {w: {k: [] for k in self.ks} for w in self.widths}
    start = self.width
    for width in self.widths:
      self._set_empty(width)
      for _ in range(repeats):
        for k in self.ks:
          times[width][k].append(self.step(k).seconds)
    self._set_empty(start)
    self._fits_smaller = 0
    return {w: {k: float(np.median(v)) for k, v in by_k.items()} for w, by_k in times.items()}


def _write_arrays(group: int) -> dict[str, np.ndarray]:
  return dict(rows=np.zeros((group,), np.int32), seeds=np.zeros((group,), np.uint32),
              max_new=np.ones((group,), np.int32), stop_ids=np.full((group, MAX_STOP_TOKENS), -1, np.int32),
              temperature=np.zeros((group,), np.float32), top_k=np.zeros((group,), np.int32),
              top_p=np.ones((group,), np.float32))


# ------------------------------------------------------------------------------------------- programs


def _build_empty(structure: Structure, width: int, max_len: int, k_max: int):
  """``run(tstate, pstates) -> (state, settings)``: ``width`` free (done) rows, the caches allocated."""
  def run(tstate, pstates):
    TRACE_COUNTS["serve_empty"] += 1
    target, proposer = structure.models(tstate, pstates)
    prompts = jnp.ones((width, MIN_PROMPT_BUCKET), jnp.int32)
    cache, pstate = engine.prefill(target, proposer, prompts, jnp.ones((width,), jnp.int32), max_len)
    state = DecodeState(target_cache=cache, proposer=pstate, last=prompts[:, 0], out=None,
                        n_out=jnp.zeros((width,), jnp.int32), done=jnp.ones((width,), bool),
                        k_now=jnp.int32(k_max), key=jax.random.split(jax.random.key(0), width),
                        stats=RoundStats.zeros(width, k_max))
    settings = SlotSettings(max_new=jnp.zeros((width,), jnp.int32),
                            stop_ids=jnp.full((width, MAX_STOP_TOKENS), -1, jnp.int32),
                            sampling=RowSampling.of(GREEDY, width))
    return state, settings
  return jax.jit(run)


def _build_prefill(structure: Structure, bucket: int, group: int, max_len: int, k_max: int):
  """``run(tstate, pstates, prompts [G, bucket], lens [G]) -> (cache, proposer state, last [G])``: the
  prefill of ``group`` requests, rows ready to be written into a state."""
  def run(tstate, pstates, prompts, lens):
    TRACE_COUNTS["serve_prefill"] += 1
    target, proposer = structure.models(tstate, pstates)
    cache, pstate = engine.prefill(target, proposer, prompts, lens, max_len)
    return cache, pstate, prompts[jnp.arange(group), lens - 1]
  return jax.jit(run)


def _build_write(structure: Structure, width: int, group: int, max_len: int, k_max: int):
  """``run(state, settings, new, arrays) -> (state, settings)``: ``group`` prefilled requests (``new``,
  from the prefill) written into rows ``arrays["rows"]`` with their settings (state and settings donated)."""
  def run(state, settings, new, arrays):
    TRACE_COUNTS["serve_write"] += 1
    cache, pstate, last = new
    rows = arrays["rows"]  # [G]
    put = lambda big, small: big.at[rows].set(small)
    state = dataclasses.replace(
        state,
        target_cache=jax.tree.map(put, state.target_cache, cache),
        proposer=jax.tree.map(put, state.proposer, pstate),
        last=put(state.last, last),
        n_out=put(state.n_out, jnp.zeros((group,), jnp.int32)),
        done=put(state.done, jnp.zeros((group,), bool)),
        key=put(state.key, jax.vmap(jax.random.key)(arrays["seeds"])))
    sampling = RowSampling(temperature=put(settings.sampling.temperature, arrays["temperature"]),
                           top_k=put(settings.sampling.top_k, arrays["top_k"]),
                           top_p=put(settings.sampling.top_p, arrays["top_p"]))
    settings = SlotSettings(max_new=put(settings.max_new, arrays["max_new"]),
                            stop_ids=put(settings.stop_ids, arrays["stop_ids"]), sampling=sampling)
    return state, settings
  return jax.jit(run, donate_argnums=(0, 1))


def _build_resize(structure: Structure, width: int, new_width: int, max_len: int, k_max: int):
  """``run(state, settings, src [new_width]) -> (state, settings)`` at ``new_width`` rows: row i is the old
  row ``src[i]``, or a free row where ``src[i] < 0``."""
  def run(state, settings, src):
    TRACE_COUNTS["serve_resize"] += 1
    valid = src >= 0
    take = lambda x: x[jnp.where(valid, src, 0)]  # every leaf is batch-major
    state = DecodeState(target_cache=jax.tree.map(take, state.target_cache),
                        proposer=jax.tree.map(take, state.proposer), last=take(state.last), out=None,
                        n_out=take(state.n_out), done=take(state.done) | ~valid, k_now=state.k_now,
                        key=take(state.key), stats=RoundStats.zeros(new_width, k_max))
    return state, jax.tree.map(take, settings)
  return jax.jit(run)


def _build_step(structure: Structure, width: int, k: int, max_len: int, k_max: int):
  """``run(tstate, pstates, state, settings, cancel) -> (state, (emitted, count, done, stats))``: one round
  with ``k`` proposals for every row; ``cancel [W] bool`` rows are marked done first (state donated)."""
  def run(tstate, pstates, state, settings, cancel):
    TRACE_COUNTS["serve_step"] += 1
    target, proposer = structure.models(tstate, pstates)
    # The round's statistics alone (the host accumulates them); RoundStats sized for k_max serve any k.
    state = dataclasses.replace(state, done=state.done | cancel, k_now=jnp.int32(k),
                                stats=RoundStats.zeros(width, k_max))
    state, emitted, count = engine.round_step(state, target=target, proposer=proposer, k=k,
                                              max_new=settings.max_new, sampling=settings.sampling,
                                              eos_ids=settings.stop_ids, outputs=True)
    return state, (emitted, count, state.done, state.stats)
  return jax.jit(run, donate_argnums=(2,))
