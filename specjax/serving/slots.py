"""The slot engine: a fixed number of decode slots, stepped together by one jitted speculative round.

The running state is one :class:`specjax.engine.DecodeState` whose rows are slots (static shapes): every
row has its own KV cache of ``max_len`` positions (with ``bucket_cache``, of the attention bucket the steps
run at: :meth:`SlotEngine.relength`), its own proposer state, its own PRNG key, and its own settings
(:class:`specjax.sampling.RowSettings`: sampling, penalties, max tokens, stop tokens), all per-row arrays, so
one compiled program (:data:`specjax.sampling.FULL` mode) serves any mix of requests. A free row is a row
marked done. The row operations are the engine's (:func:`specjax.engine.init_state`,
:func:`~specjax.engine.put_rows`, :func:`~specjax.engine.take_rows`); this class keeps the host's
bookkeeping: which request is in which row, and when to grow or shrink.

The state runs at a *width*, one of a few batch sizes compiled ahead (by default the powers of two up to
``slots``): the smallest that holds the live requests. A step computes every row of its width, live or
not, so a server with one live request of eight slots steps one row, not eight; the width grows when an
insert needs a row and shrinks (the live rows gathered to the front) once the live requests have fit a
smaller width for ``shrink_after`` rounds. A request keeps its slot id while its row moves.

- :meth:`SlotEngine.insert` prefills new requests (one compiled program per prompt bucket and number of
  requests) and writes them into free rows of the running state (one program per width and number of
  requests), in place (donated); requests with one prompt (n choices) share its prefill, their rows copied;
  with a ``prompt_cache``, a prompt prefilled before (its whole token sequence) takes its kept prefilled row.
- :meth:`SlotEngine.step` runs one round for every row: a chain of ``k`` proposals
  (:func:`specjax.engine.round_step`, ``k`` one of the compiled ``ks``) or a token tree
  (:func:`specjax.engine.tree_round_step`, one of the compiled ``trees``), compiled for greedy decoding when
  every live row is greedy (``greedy_steps``); requests that finish (a stop token, their max tokens) or were
  cancelled are freed at once and their slots can be refilled before the next step.
- :meth:`SlotEngine.compact` moves to a smaller width when the live requests have fit one long enough.

Exactness holds per request, whatever shares the batch and whatever the width: a slot's greedy output
equals :func:`specjax.generate` for its prompt alone, and its sampled output follows the target's warped
distribution, drawn from the request's own key (``seed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import math
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import engine, grammar
from specjax.cache import KVCache
from specjax.config import MAX_K, MAX_LOGPROBS, MIN_PROMPT_BUCKET, SamplingConfig, check_int
from specjax.decode import bucket_length
from specjax.proposers import Proposer
from specjax.proposers.suffix import suffix_stores
from specjax.request import Request, RequestError
from specjax.runtime import RUNTIME, SplitModels, Structure
from specjax.sampling import FULL, Mode, RowSettings
from specjax.tree import DynamicTree, TreeShape, TreeSpec, parse_tree, tree_window

# Traces of each program: "serve_empty", "serve_prefill", "serve_write", "serve_copy", "serve_resize",
# "serve_relength", "serve_step", "serve_tree_step", "serve_take", "serve_rekey".
TRACE_COUNTS = RUNTIME.trace_counts

__all__ = ["Choice", "Request", "RequestError", "SlotEngine", "StepResult", "choice_name", "default_widths",
           "keep_buckets", "tree_window"]

# What one step runs: a chain of k proposals (an int of ``ks``) or a token tree (one of ``trees``).
Choice = int | TreeShape | DynamicTree


def choice_name(choice: Choice) -> str:
  """A step candidate as text: ``"2"`` for a chain of two proposals, the tree's ``describe()`` for a tree."""
  return str(choice) if isinstance(choice, int) else choice.describe()




@dataclasses.dataclass(frozen=True)
class StepResult:
  """What one step did, on the host.

  Attributes:
    k: proposals per row this step (a tree: its depth). width: rows the step computed.
    tokens: ``{slot: new token ids}`` for every slot that emitted tokens.
    logprobs: ``{slot: (logprobs, top_ids, top_logprobs)}`` of those tokens, for the slots whose request
      asked for them (lists of floats, and ``[n, N]`` lists with N alternatives, N of the request).
    finished: ``{slot: "stop" | "length"}`` for the requests that ended this step (their slots are free).
    row_rounds, drafted, accepted: ``{slot: count}`` this step (a request's own statistics).
    reached, accepted_at: ``[k_max] int`` row-rounds in which proposal i was verified (its predecessors
      accepted) / accepted: acceptance by position (a tree step: by depth), over the live rows.
    catch_ups: proposer passes besides the proposals (the draft model catching up).
    seconds: wall time of the step, dispatch to results on the host. The step is dispatched without waiting
      for the inserts, prefill chunks and resizes before it (the device runs them in order): with ``queued``
      their remaining time is in it, so it does not time the step alone.
    tree: the tree the step proposed (its ``describe()``), or None for a chain of ``k``.
    rounds: the rounds the step ran (one device call runs up to its ``rounds``; see :meth:`SlotEngine.step`).
    bucket: the cache positions the step's attention read (see ``buckets``).
    greedy: the step ran the greedy program (:data:`GREEDY_STEPS`: every live row greedy), not the general one.
    cold: the first run of its program in this engine, which costs several rounds whatever the warm-up did
      (on the bundled pair at width 1: 65-100 ms for the first call of 4 rounds against 8-15 ms for the
      next), so its ``seconds`` do not time the step (the speculation policy skips them).
    interrupted: the call returned before its rounds ran out because :attr:`SlotEngine.interrupt` was set.
    queued: work on the state (an insert, a prefill chunk, a resize) was dispatched after the last step was
      collected and before this one: the step queued behind it, so its ``seconds`` do not time the step (the
      speculation policy skips them).
    ahead: the call was launched while the one before it was in flight (:meth:`SlotEngine.launch` with
      ``ahead``): the device ran it straight after that one. Its ``seconds`` run from when the host saw the one
      before end; where that was not seen (its outputs were ready before the host asked), or this call was
      ready before the host asked for it, the call is also ``queued`` (its ``seconds`` are no timing).
    ended: why the call returned, set by the :class:`~specjax.serving.scheduler.Scheduler`: "finished" (a
      row finished, or no row was live), "interrupted" (see ``interrupted``), else what limited its rounds:
      "waiting" (one round: a request waited for a free slot), "prefill" (one round between two chunks of a
      prompt), "first_rounds" (a new request's first call) or "rounds" (the engine's rounds ran out); "" from
      :meth:`SlotEngine.step` itself.
  """

  k: int
  width: int
  tokens: dict[int, list[int]]
  logprobs: dict[int, tuple]
  finished: dict[int, str]
  row_rounds: dict[int, int]
  drafted: dict[int, int]
  accepted: dict[int, int]
  reached: np.ndarray
  accepted_at: np.ndarray
  catch_ups: int
  seconds: float
  tree: str | None = None
  rounds: int = 1
  bucket: int = 0
  greedy: bool = False
  cold: bool = False
  interrupted: bool = False
  ended: str = ""
  queued: bool = False
  ahead: bool = False


@dataclasses.dataclass(frozen=True)
class CallCost:
  """What a device call costs at one width (:meth:`SlotEngine.time_calls`), in seconds: ``fixed`` once per call
  (dispatch, the cache window in and out, fetching the outputs, the host's bookkeeping) and ``round`` per round."""
  fixed: float
  round: float


@dataclasses.dataclass(frozen=True)
class _Call:
  """A step dispatched to the device and not yet collected (:meth:`SlotEngine.launch`)."""

  choice: Choice
  width: int
  bucket: int
  outputs: tuple | jax.Array  # (a step program's: one packed array, which ``unpack`` gives back as the tuple)
  cancelled: frozenset[int]
  start: float
  mode: Mode = FULL  # the step's program: FULL or GREEDY_STEPS
  cold: bool = False  # the first run of the step's program (see StepResult.cold)
  queued: bool = False  # dispatched behind work on the state since the last collect (see StepResult.queued)
  unpack: Callable | None = None  # a packed step's _PackedStep.unpack
  rounds: int = 1  # the most rounds it runs
  ahead: bool = False  # launched while another call was in flight (see StepResult.ahead)


@dataclasses.dataclass
class _Prefill:
  """A prompt being prefilled in chunks: the target's cache and features so far, ``done`` tokens in."""

  request: Request
  bucket: int
  cache: KVCache
  features: object
  done: int


# What a step compiles when every live row is greedy without logit adjustments: the argmax, no draws. Its rows
# evolve as under FULL (keys split, counts kept), so that the two modes may alternate on one state.
GREEDY_STEPS = Mode(greedy=True)


def default_widths(slots: int) -> tuple[int, ...]:
  """The powers of two below ``slots``, and ``slots``."""
  return tuple(sorted({1 << i for i in range(slots.bit_length()) if 1 << i < slots} | {slots}))


# The cache positions a row may use past what the host bounds (a proposer's cache ahead of the target's).
_BUCKET_MARGIN = 16


def default_buckets(max_len: int) -> tuple[int, ...]:
  """``max_len`` and its halves down to an eighth, none below 64: the attention lengths a step compiles (a
  short request attends over 64 positions, not 128: a step of the bundled pair costs ~10 % less)."""
  return tuple(sorted({max_len} | {max_len // d for d in (2, 4, 8) if max_len // d >= 64}))


def default_prompt_buckets(max_len: int) -> tuple[int, ...]:
  """The padded lengths a server prefills prompts at: 16, 32, and from there each power of two and the length
  halfway to the next (48, 64, 96, 128, 192, 256, 384, ...) below ``max_len``, and ``max_len``. On a CPU a
  prefill costs what its padded tokens cost (it is compute-bound past ~10 tokens), so a 165-token prompt padded
  to 192 rather than 256 saves a quarter of its prefill; each length compiles its own prefill."""
  ladder = {MIN_PROMPT_BUCKET, 2 * MIN_PROMPT_BUCKET}
  power = 2 * MIN_PROMPT_BUCKET
  while power < max_len:
    ladder |= {power + power // 2, 2 * power}
    power *= 2
  return tuple(sorted({b for b in ladder if b < max_len} | {max_len}))


# How much cheaper a call over a smaller attention bucket must measure than over the next larger bucket kept,
# for the smaller one to be kept (:func:`keep_buckets`): repeats of one timing on this 2-core machine differ by a
# few percent, and a bucket kept for nothing costs a window copy a call.
BUCKET_MARGIN = 0.03


def keep_buckets(times: Mapping[int, float], margin: float = BUCKET_MARGIN) -> tuple[int, ...]:
  """The attention buckets worth attending over, from ``times``: ``{bucket: seconds of a call over it}``
  (:meth:`SlotEngine.time_buckets`). The largest is always kept; going down, a bucket is kept when its call
  costs less than ``1 - margin`` times the call over the smallest bucket kept so far. A smaller bucket reads
  fewer cache positions but copies its window out of the cache and back each call: on a memory-bound target
  with many layers (SmolLM2-135M on CPU) the copy costs more than the reads save.

  Raises:
    ValueError: ``times`` empty or not positive finite seconds by integer bucket, ``margin`` outside [0, 1).
  """
  if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0 <= margin < 1:
    raise ValueError(f"margin must be a fraction in [0, 1), got {margin!r}")
  if not times or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in times) or any(
      not isinstance(t, (int, float)) or not np.isfinite(t) or t <= 0 for t in times.values()):
    raise ValueError(f"times must map positive integer buckets to positive finite seconds, got {dict(times)!r}")
  kept = [max(times)]
  for bucket in sorted(times, reverse=True)[1:]:
    if times[bucket] < (1 - margin) * times[kept[-1]]:
      kept.append(bucket)
  return tuple(sorted(kept))


class SlotEngine:
  """A fixed number of decode slots over one target (and optionally a proposer), stepped together.

  Args:
    target: the target model. proposer: any :class:`specjax.proposers.Proposer`, or None (plain decoding).
    slots: the number of requests served at once (the largest width).
    max_len: positions per slot: a request needs ``len(prompt) + max_new_tokens + reserve <= max_len``, the
      ``reserve`` the largest of ``max(ks)`` and each tree's :func:`tree_window` less one (the positions the
      last round may write past the request's end).
    ks: the speculation lengths to compile a step for (``(0,)`` without a proposer).
    trees: token trees to compile a step for besides ``ks``: :class:`specjax.tree.TreeShape` or
      :class:`~specjax.tree.DynamicTree` objects, or strings :func:`specjax.tree.parse_tree` reads
      (``"dynamic:4,4,16"``, ``"4-2-1/6"``); the proposer must propose trees.
    widths: the batch sizes the state may run at (each compiles its own step per k); default
      :func:`default_widths`; ``(slots,)``: always every slot.
    shrink_after: rounds the live requests must fit a smaller width before the state moves to it (counted in
      rounds, not calls: a resize costs about a call, and a narrower width saves on every round).
    rounds: the most rounds one step (one device call) may run: :meth:`step` with ``rounds > 1`` loops on
      the device until a row finishes or that many rounds have run, so the host is visited once per call.
    buckets: the attention lengths to compile a step for (each at most ``max_len``, which is always one): a
      step attends over (and reads the caches of) the smallest bucket that covers every live row's context
      through the step, not all ``max_len`` positions; default :func:`default_buckets`.
    prompt_buckets: the padded lengths prompts are prefilled at (each in ``[16, max_len]``; ``max_len`` is
      always one): a prompt is padded to the smallest that holds it, and each compiles its own prefill;
      default :func:`default_prompt_buckets` (powers of two and the lengths halfway between them);
      :attr:`prompt_buckets` holds them.
    prefill_chunk: a power of two: prompts longer than it may be prefilled that many tokens at a time
      (:meth:`start_prefill`, :meth:`prefill_next`), between steps; None: every prompt in one pass.
    greedy_steps: a step whose live rows are all greedy without logit adjustments (penalties, logit bias) runs
      a program compiled for greedy decoding (argmax, no random draws; :data:`GREEDY_STEPS`), the same tokens
      as the general program at less cost; False: every step runs the general program (half the step
      programs to compile).
    interruptible: a call of several rounds asks the host after each round whether :attr:`interrupt` is set
      (a host callback), and returns then: a request that arrives mid-call waits one round, not the call
      (the :class:`~specjax.serving.scheduler.Scheduler` sets it for an arrival with a free slot and for a
      cancel). Off by default: on CPU, XLA runs a program with a host callback synchronously (the launch
      returns when the call is done, so the host no longer overlaps the device) and a round of the bundled
      pair costs 10-23 % more at width 8 and 31 % more at width 1; calls then run out their rounds or end at
      a finished row.
    bucket_cache: keep the state's KV caches at the length of the attention bucket the steps run at, rather
      than at ``max_len``: a step then reads and writes its caches in place, where otherwise each call copies
      its bucket's window of every cache out of the ``max_len`` buffers and back (most of a call's fixed cost
      at width 8 on the bundled pair). The caches are cut or grown (:meth:`relength`) when the live rows need
      a larger bucket, or have fit a smaller one for ``shrink_after`` rounds (at the first call after an insert
      into an engine with no live row: nothing is then kept that an older row may need); inserts write the new
      rows at the state's length. Structured-output steps run at ``max_len``. The same tokens either way.
    prompt_cache: how many prompts' prefilled rows to keep (least recently used dropped first), so that a
      request whose whole prompt (every token) was prefilled before skips its prefill: its row is the kept
      one with the request's own key and settings, which is what its own prefill gives (the same program on
      the same prompt), so the same tokens. Each kept row holds a one-row state at ``max_len``
      (:attr:`prompt_cache_bytes`) and the target's features over its prompt. 0 (the default): none kept.
      Retries, separate requests for choices of one prompt and repeated evaluation prompts hit it. A prompt
      that shares a prefix with a kept one (a system prompt, an earlier turn) starts from its caches and
      features there and passes only the rest through the target, where that rest fits a smaller prompt
      bucket than the whole (:attr:`prefix_hits`, :attr:`prefix_tokens`); what its own prefill gives, to
      float32 rounding (as a chunked prompt).

  Raises:
    ValueError: naming the argument and its allowed values.
  """

  def __init__(self, target, proposer: Proposer | None = None, *, slots: int = 8, max_len: int = 512,
               ks: Sequence[int] = (0,), trees: Sequence[TreeSpec | str] = (),
               widths: Sequence[int] | None = None, shrink_after: int = 8, rounds: int = 1,
               buckets: Sequence[int] | None = None, prefill_chunk: int | None = None, greedy_steps: bool = True,
               interruptible: bool = False, bucket_cache: bool = False, prompt_cache: int = 0,
               prompt_buckets: Sequence[int] | None = None):
    cfg = getattr(target, "cfg", None)
    if cfg is None or not hasattr(cfg, "vocab_size"):
      raise ValueError(f"target must be a specjax model (with a .cfg config), got {type(target).__name__}")
    if proposer is not None and not isinstance(proposer, Proposer):
      raise ValueError(f"proposer must be a specjax.proposers.Proposer or None, got {type(proposer).__name__}")
    check_int("slots", slots, 1)
    check_int("max_len", max_len, MIN_PROMPT_BUCKET, cfg.max_seq_len)
    check_int("shrink_after", shrink_after, 1)
    check_int("rounds", rounds, 1, 1024)
    if not isinstance(greedy_steps, bool):
      raise ValueError(f"greedy_steps must be True or False, got {greedy_steps!r}")
    if not isinstance(interruptible, bool):
      raise ValueError(f"interruptible must be True or False, got {interruptible!r}")
    if not isinstance(bucket_cache, bool):
      raise ValueError(f"bucket_cache must be True or False, got {bucket_cache!r}")
    check_int("prompt_cache", prompt_cache, 0)
    if prefill_chunk is not None:
      check_int("prefill_chunk", prefill_chunk, MIN_PROMPT_BUCKET, max_len)
      if prefill_chunk & (prefill_chunk - 1):
        raise ValueError(f"prefill_chunk must be a power of two (its chunks tile a power-of-two bucket), "
                         f"got {prefill_chunk}")
    buckets = default_buckets(max_len) if buckets is None else tuple(sorted(set(buckets) | {max_len}))
    if prompt_buckets is None:
      prompt_buckets = default_prompt_buckets(max_len)
    elif isinstance(prompt_buckets, (str, bytes)) or not isinstance(prompt_buckets, Iterable) or any(
        not isinstance(b, (int, np.integer)) or isinstance(b, (bool, np.bool_)) or not MIN_PROMPT_BUCKET <= b <= max_len
        for b in prompt_buckets):
      raise ValueError(f"prompt_buckets must be integers in [{MIN_PROMPT_BUCKET}, max_len={max_len}], "
                       f"got {prompt_buckets!r}")
    self._prompt_buckets = tuple(sorted({int(b) for b in prompt_buckets} | {max_len}))
    if any(not isinstance(b, int) or isinstance(b, bool) or not MIN_PROMPT_BUCKET <= b <= max_len for b in buckets):
      raise ValueError(f"buckets must be integers in [{MIN_PROMPT_BUCKET}, max_len={max_len}], got {buckets!r}")
    ks = tuple(sorted(set(ks)))
    if not ks or any(not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K for k in ks):
      raise ValueError(f"ks must be integers in [0, {MAX_K}], got {ks!r}")
    if proposer is None and ks != (0,):
      raise ValueError(f"ks={ks} needs a proposer; without one the only speculation length is 0")
    trees = _tree_specs(trees)
    if trees and proposer is None:
      raise ValueError(f"trees={[t.describe() for t in trees]} needs a proposer that proposes trees (DraftModel, "
                       "Eagle, MTP or Medusa)")
    widths = default_widths(slots) if widths is None else tuple(sorted(set(widths)))
    if not widths or any(not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= slots for w in widths) \
        or widths[-1] != slots:
      raise ValueError(f"widths must be integers in [1, slots={slots}] including slots, got {widths!r}")
    if proposer is not None:
      if proposer.max_k is not None and max(ks) > proposer.max_k:
        raise ValueError(f"ks holds {max(ks)}, more than the {proposer.max_k} proposals per round this "
                         f"{proposer.name} proposer can make")
      for i, tree in enumerate(trees):
        try:
          proposer.check_tree(tree)
        except ValueError as e:
          raise ValueError(f"trees[{i}] ({tree.describe()}): {str(e).removeprefix('SpecConfig.tree: ')}") from None
      proposer.check(cfg, max_len)
    # The positions a round may write past a row's length, less one (the chain's k + 1 entries from the
    # length: k): the room a request leaves for its last round.
    reserve = max([max(ks)] + [tree_window(t) - 1 for t in trees])
    if max_len - reserve < 2:
      worst = max(trees, key=tree_window) if trees and reserve > max(ks) else None
      what = (f"ks holds {max(ks)}: a round writes {max(ks) + 1}" if worst is None else
              f"trees holds {worst.describe()}: a round writes up to {tree_window(worst)}")
      raise ValueError(f"{what} cache entries past a row's length, which leaves max_len={max_len} no room for a "
                       f"prompt and a token (max_len must be at least {reserve + 2})")
    if not any(ks) and not trees:
      proposer = None  # it would never propose (ks (0,)): the target alone, with no proposer state to keep
    self.target, self.proposer = target, proposer
    self.slots, self.max_len, self.ks, self.trees = slots, max_len, ks, trees
    # RoundStats are sized for the longest chain or the deepest tree (acceptance by position / by depth).
    self.k_max = max([max(ks)] + [t.depth for t in trees])
    self.reserve = reserve
    self.widths, self.shrink_after = widths, shrink_after
    self.rounds, self.buckets, self.prefill_chunk = rounds, buckets, prefill_chunk
    # The buckets a step at each width chooses among (:meth:`use_buckets`; all compiled ones until then).
    self._active: dict[int, tuple[int, ...]] = {w: buckets for w in widths}
    self.modes = (FULL, GREEDY_STEPS) if greedy_steps else (FULL,)
    # Set (from any thread) to end the call in flight after its current round; cleared by whoever drives the
    # engine (the engine never clears it: a flag set before a launch ends that call after one round).
    self.interrupt = threading.Event()
    self.interruptible = interruptible
    self.bucket_cache = bucket_cache
    self.relengths = 0  # the times the caches were cut or grown to another bucket (bucket_cache)
    self._handle = next(_HANDLES) if interruptible else 0
    if interruptible:
      _INTERRUPTS[self._handle] = weakref.ref(self)
      weakref.finalize(self, _INTERRUPTS.pop, self._handle, None)
    # (width, choice, bucket) whose greedy step is compiled, after a warm-up that deferred them; None: any
    # greedy step may run (compiled on first use if no warm-up compiled it).
    self._greedy_ready: set | None = None
    self.vocab_size = cfg.vocab_size
    self._models = SplitModels(target, proposer)
    # Global suffix stores (suffix decoding, alone or combined) learn every finished request's output.
    self.stores = suffix_stores(proposer)
    self._ran: set[tuple] = set()  # the step programs that have run (a program's first run is not timed)
    self.prefills = 0  # prefills run (each of one group of requests, or of one prompt prefilled in chunks)
    self.copies = 0  # rows filled by copying a row prefilled for the same prompt
    self.prompt_cache = prompt_cache
    # prompt -> (bucket, its prefilled row, the target's features over it [1, bucket, ..])
    self._kept: OrderedDict[tuple[int, ...], tuple[int, engine.DecodeState, engine.Features]] = OrderedDict()
    self.prompt_hits = 0  # requests whose prompt's prefilled row was kept (no prefill run)
    self.prefix_hits = 0  # requests prefilled from a kept prompt's caches (only the rest of the prompt passed)
    self.prefix_tokens = 0  # the prompt tokens those requests did not pass through the target
    self.reset()

  # ------------------------------------------------------------------------------------------ host

  def _program(self, kind: str, build, *settings):
    return self._models.cached(kind, build, *settings, self.max_len, self.k_max)

  def prompt_bucket(self, n: int) -> int:
    """The padded length a prompt (or a prompt's rest after a kept prefix) of ``n <= max_len`` tokens is
    passed at: the smallest of :attr:`prompt_buckets` that holds it."""
    if n > self.max_len:
      raise ValueError(f"a prompt of {n} tokens does not fit a slot of max_len={self.max_len} positions")
    return next(b for b in self._prompt_buckets if b >= n)

  @property
  def prompt_buckets(self) -> tuple[int, ...]:
    """The padded lengths prompts are prefilled at (the ``prompt_buckets`` argument, with ``max_len``)."""
    return self._prompt_buckets

  def _step_program(self, width: int, choice: Choice, logprobs: int | None, bucket: int, mode: Mode):
    """``(step, args)``: the step of ``choice`` (a chain's k or a tree), called ``step(*args, state, cancel,
    limit, handle)`` (see :func:`_rounds`); with ``bucket_cache``, on a state whose caches are at ``bucket``
    (no window: built as if ``max_len`` were the bucket)."""
    kind, build = ("serve-step", _build_step) if isinstance(choice, int) else ("serve-tree-step", _build_tree_step)
    settings = (width, choice, logprobs, self.rounds, bucket, mode, self.interruptible)
    if self.bucket_cache:
      return self._models.cached(kind, build, *settings, bucket, self.k_max)
    return self._program(kind, build, *settings)

  def _state_at(self, length: int, width: int):
    """An empty state of ``width`` rows with its caches at ``length`` (for ahead-of-time lowering; the
    engine's own state is not touched)."""
    empty, args = self._program("serve-empty", _build_empty, width)
    state = empty(*args)
    if length == self.max_len:
      return state
    program, _ = self._program("serve-relength", _build_relength, self.max_len, length)
    return program(state)

  @property
  def length(self) -> int:
    """The positions the state's target cache holds per row: ``max_len``, or with ``bucket_cache`` the
    bucket the steps run at."""
    return self._length

  def relength(self, length: int) -> None:
    """(``bucket_cache``) Cuts or grows the state's KV caches to ``length`` positions, one of the compiled
    buckets that holds every live row's context (the positions cut hold nothing any row reads; grown ones
    start at zero, past every row's length).

    Raises:
      ValueError: ``length`` not a compiled bucket, or too short for a live row.
    """
    if length not in self.buckets:
      raise ValueError(f"length must be one of the compiled buckets {self.buckets}, got {length!r}")
    if not self.bucket_cache and length != self.max_len:
      raise ValueError(f"length {length}: an engine without bucket_cache keeps its caches at max_len={self.max_len}")
    need = max((self._context[s] for s in self._live), default=0)
    if length < need:
      raise ValueError(f"length {length} is shorter than a live row's context ({need} positions)")
    self._idle("relength")
    if length == self._length:
      return
    program, _ = self._program("serve-relength", _build_relength, self._length, length)
    self.state = program(self.state)
    self._queued = True
    self._length, self._fits_shorter = length, 0
    self.relengths += 1

  def reset(self) -> None:
    """Drops every request: all slots free, the smallest width (after a failed step, or to start over)."""
    self._free = list(range(self.slots))  # slot ids, a heap: the lowest first
    self._row: dict[int, int] = {}  # slot -> its row in the state, for live and cancelled slots
    self._live: dict[int, Request] = {}  # live slot -> its request
    self._produced: dict[int, list[int]] = {}  # live slot -> its output so far (kept for a suffix store only)
    self._matchers: dict[int, grammar.Matcher] = {}  # live slot -> its grammar's matcher (structured output)
    self._cancelled: set[int] = set()  # slots whose rows the next step marks done
    self._context: dict[int, int] = {}  # live slot -> its prompt and output so far, in tokens
    self._call: _Call | None = None  # the step in flight, if any (the older of two: see launch's ahead)
    self._ahead: _Call | None = None  # a step launched behind it, if any
    self._seen_end: float | None = None  # when the host saw the last collected call end (None: it was done before)
    self._prefilling: dict[int, _Prefill] = {}  # slot -> its request's prefill in chunks, oldest first
    self._fresh: set[int] = set()  # live slots that no step has run yet
    self._fits_smaller = 0  # rounds of the consecutive steps whose live requests fit a smaller width
    self._queued = True  # work on the state dispatched since the last collect: the next step queues behind it
    self._set_empty(self.widths[0])

  def _set_empty(self, width: int) -> None:
    program, args = self._program("serve-empty", _build_empty, width)
    self.state = program(*args)
    self.width = width
    self._length, self._fits_shorter = self.max_len, 0  # rounds the live rows have fit a shorter bucket
    if self.bucket_cache:
      self.relength(self.buckets[0])

  @property
  def candidates(self) -> tuple[Choice, ...]:
    """What a step may run: the chains ``ks``, then the ``trees``."""
    return self.ks + self.trees

  @property
  def free_slots(self) -> int:
    return len(self._free)

  @property
  def live_slots(self) -> list[int]:
    return sorted(self._live)

  @property
  def fresh(self) -> bool:
    """Some live request has not been stepped yet (inserted since the last step was launched)."""
    return bool(self._fresh)

  @property
  def pending_cancels(self) -> bool:
    """Cancelled slots wait for the next step (which marks their rows done) before they are free."""
    return bool(self._cancelled)

  def check(self, request: Request) -> None:
    """Raises :class:`RequestError` (naming the field) unless ``request`` fits this engine."""
    if not isinstance(request, Request):
      raise RequestError("request", f"expected a specjax.request.Request, got {type(request).__name__}")
    room = self.max_len - self.reserve
    request.check(self.vocab_size, room, room_name=f"the {room} tokens a slot holds (max_len {self.max_len} - "
                                                  f"{self.reserve} for the last round's proposals)")

  def insert(self, requests: Sequence[Request]) -> list[int]:
    """Prefills ``requests`` and writes them into free rows of the running state (growing its width when
    the rows in use and the new ones do not fit).

    Requests with the same prompt share one prefill: the first is prefilled, the others' rows are copies of
    its row with their own keys (``seed``) and settings (one copy program per width:
    :func:`specjax.engine.copy_rows`), which is what their own prefills would give (n choices of one
    prompt). A request whose prompt's prefilled row is kept (``prompt_cache``) takes it (one write, no
    prefill); one whose prompt shares a long enough prefix with a kept prompt (:meth:`_prefix_hit`) starts from
    that prompt's caches and passes only the rest of its own through the target. The other requests are
    grouped by prompt bucket; each group is one prefill and one write (and, with a ``prompt_cache``, its rows
    kept). A server inserts one request at a time, or the choices of one
    prompt together.

    Returns:
      The slot of each request, in order.

    Raises:
      RequestError: a request that does not fit (nothing is inserted then).
      ValueError: more requests than free slots.
    """
    for request in requests:
      self.check(request)
    self._idle("insert")
    if len(requests) > len(self._free):
      raise ValueError(f"{len(requests)} requests but only {len(self._free)} free slots")
    alone = not self._live  # no row before these: nothing keeps the caches at the length the last ones left
    rows = self._take_rows(len(requests))
    slots = [heapq.heappop(self._free) for _ in requests]
    first: dict[tuple[int, ...], int] = {}  # prompt -> the request prefilled for it
    copies: dict[int, list[int]] = {}  # that request -> the requests whose rows copy its row
    groups: dict[int, list[int]] = {}
    kept: list[int] = []  # requests whose prompt's prefilled row is kept (prompt_cache)
    prefixed: dict[int, tuple[tuple[int, ...], int]] = {}  # requests prefilled from a kept prompt's caches
    for i, request in enumerate(requests):
      source = first.setdefault(tuple(request.prompt), i)
      if source != i:
        copies.setdefault(source, []).append(i)
      elif tuple(request.prompt) in self._kept:
        kept.append(i)
      elif (hit := self._prefix_hit(request.prompt)) is not None:
        prefixed[i] = hit
      else:
        groups.setdefault(self.prompt_bucket(len(request.prompt)), []).append(i)
    try:
      for i in kept:
        self._insert_kept(requests[i], rows[i])
      for i, hit in prefixed.items():
        self._insert_prefixed(requests[i], rows[i], *hit)
      for bucket, members in groups.items():
        self._insert_group(bucket, [requests[i] for i in members], [rows[i] for i in members])
      for source, members in copies.items():
        self._copy_row(rows[source], [requests[i] for i in members], [rows[i] for i in members])
      for members in [*groups.values(), kept, list(prefixed)]:
        for i in [j for i in members for j in [i] + copies.get(i, [])]:
          self._row[slots[i]] = rows[i]
          self._live[slots[i]] = requests[i]
          self._context[slots[i]] = len(requests[i].prompt)
          self._fresh.add(slots[i])
          if requests[i].grammar is not None:
            self._matchers[slots[i]] = requests[i].grammar.matcher()
          if self.stores:
            self._produced[slots[i]] = []
    except Exception:
      for slot in slots:
        self._row.pop(slot, None)
        self._live.pop(slot, None)
        self._context.pop(slot, None)
        self._matchers.pop(slot, None)
        self._fresh.discard(slot)
        heapq.heappush(self._free, slot)
      raise
    if alone:  # (bucket_cache) the next call cuts the caches to the bucket these rows need at once
      self._fits_shorter = self.shrink_after
    return slots

  def _take_rows(self, n: int) -> list[int]:
    """``n`` rows of the state no slot uses (the state grown to a wider width when they do not fit)."""
    used = set(self._row.values())
    if len(used) + n > self.width:
      self._resize(min(w for w in self.widths if w >= len(used) + n), sorted(self._row, key=self._row.get))
      used = set(self._row.values())
    return [r for r in range(self.width) if r not in used][:n]

  def _copy_row(self, source: int, requests: list[Request], rows: list[int]) -> None:
    """Rows ``rows`` become copies of the freshly prefilled row ``source`` for ``requests`` (their keys and
    settings); one program per width, the rows padded to ``width - 1`` (padding dropped)."""
    pad = self.width - 1
    requests = requests + [requests[0]] * (pad - len(requests))
    dst = np.full((pad,), self.width, np.int32)  # past the last row: dropped
    dst[:len(rows)] = rows
    settings = RowSettings.of([r.sampling for r in requests], [r.max_new_tokens for r in requests],
                              [r.stop_ids for r in requests], self.vocab_size, FULL)
    seeds = np.asarray([int(r.seed) % (1 << 32) for r in requests], np.uint32)
    copy, _ = self._program("serve-copy", _build_copy, self.width)
    self.state = copy(self.state, np.int32(source), dst, seeds, settings)
    self._queued = True
    self.copies += len(rows)

  def _insert_group(self, bucket: int, requests: list[Request], rows: list[int], prefilled=None) -> None:
    group = len(requests)
    prompts = np.zeros((group, bucket), np.int32)
    for row, request in zip(prompts, requests):
      row[:len(request.prompt)] = request.prompt
    settings = RowSettings.of([r.sampling for r in requests], [r.max_new_tokens for r in requests],
                              [r.stop_ids for r in requests], self.vocab_size, FULL)
    seeds = np.asarray([int(r.seed) % (1 << 32) for r in requests], np.uint32)
    lens = np.asarray([len(r.prompt) for r in requests], np.int32)
    self.prefills += 1
    if prefilled is None:
      prefill, args = self._prefill_program(bucket, group)
      new = prefill(*args, prompts, lens, seeds, settings)
      new, features = new if self.prompt_cache else (new, None)
    else:  # the target's pass made in chunks (start_prefill): the rest of the prefill
      finish, args = self._program("serve-chunk-finish", _build_chunk_finish, bucket)
      new, features = finish(*args, *prefilled, prompts, lens, seeds, settings), prefilled[1]
    if self.prompt_cache:
      for i, request in enumerate(requests):
        if group == 1:
          row, feats = new, features
        else:
          take, _ = self._program("serve-take", _build_take, group)
          row, feats = take(new, features, np.asarray([i], np.int32))
        self._keep(tuple(request.prompt), bucket, row, feats)
    self._write(requests, rows, new)

  def _prefill_program(self, bucket: int, group: int):
    """The prefill of ``group`` prompts of ``bucket`` tokens; with a ``prompt_cache`` it also returns the
    target's features over the prompts (what a prompt sharing a prefix with them starts from)."""
    return self._program("serve-prefill", _build_prefill, bucket, group, bool(self.prompt_cache))

  def _write(self, requests: list[Request], rows: list[int], new: engine.DecodeState) -> None:
    """Writes the prefilled rows ``new`` of ``requests`` into rows ``rows`` of the state (its caches grown to
    a bucket that holds their prompts first, with ``bucket_cache``)."""
    need = max(len(r.prompt) for r in requests) + _BUCKET_MARGIN  # (bucket_cache) the new rows' prompts
    if self._length < need:
      self.relength(next((b for b in self.buckets if b >= need), self.max_len))
    write, _ = self._program("serve-write", _build_write, self.width, len(requests), self._length)
    self.state = write(self.state, np.asarray(rows, np.int32), new)
    self._queued = True

  def _keep(self, prompt: tuple[int, ...], bucket: int, row: engine.DecodeState, features: engine.Features
            ) -> None:
    """Keeps ``row`` (a one-row prefilled state) and the target's ``features`` over ``prompt`` (``[1, bucket,
    ..]``), dropping the least recently used beyond ``prompt_cache``."""
    self._kept[prompt] = (bucket, row, features)
    self._kept.move_to_end(prompt)
    while len(self._kept) > self.prompt_cache:
      self._kept.popitem(last=False)

  def _insert_kept(self, request: Request, row: int) -> None:
    """Writes ``request`` into ``row`` from its prompt's kept prefilled row, with its own key and settings."""
    prompt = tuple(request.prompt)
    bucket, kept, _ = self._kept[prompt]
    self._kept.move_to_end(prompt)
    settings = RowSettings.of([request.sampling], [request.max_new_tokens], [request.stop_ids], self.vocab_size, FULL)
    seeds = np.asarray([int(request.seed) % (1 << 32)], np.uint32)
    rekey, _ = self._program("serve-rekey", _build_rekey, bucket)
    self._write([request], [row], rekey(kept, seeds, settings))
    self.prompt_hits += 1

  def _prefix_hit(self, prompt: Sequence[int]) -> tuple[tuple[int, ...], int] | None:
    """``(kept prompt, shared)``: the kept prompt (``prompt_cache``) that shares the longest prefix with
    ``prompt``, ``shared`` tokens long, where starting from its caches pays: the rest of ``prompt`` fits a
    smaller prompt bucket than the whole (or nothing is left: ``prompt`` is a prefix of the kept one), and its
    pass fits ``max_len``; else None."""
    if not self._kept:
      return None
    prompt = tuple(prompt)
    best, shared = None, 0
    for kept in self._kept:
      n = min(len(kept), len(prompt))
      same = next((i for i in range(n) if kept[i] != prompt[i]), n)
      if same > shared:
        best, shared = kept, same
    if best is None:
      return None
    rest = len(prompt) - shared
    if rest == 0:
      return best, shared
    chunk = self.prompt_bucket(rest)
    if chunk >= self.prompt_bucket(len(prompt)) or shared + chunk > self.max_len:
      return None
    return best, shared

  def _insert_prefixed(self, request: Request, row: int, source: tuple[int, ...], shared: int) -> None:
    """Writes ``request`` into ``row``, its prefill started from the kept prompt ``source``'s caches and
    features over their first ``shared`` positions (equal to ``request``'s own), the rest of its prompt passed
    through the target in one chunk (:func:`_build_chunk`); then it is kept too."""
    prompt = tuple(request.prompt)
    if source not in self._kept:  # dropped by a prompt kept since (an insert of several requests)
      hit = self._prefix_hit(prompt)
      if hit is None:
        self._insert_group(self.prompt_bucket(len(prompt)), [request], [row])
        return
      source, shared = hit
    bucket, kept, features = self._kept[source]
    self._kept.move_to_end(source)
    start, args = self._program("serve-prefix-start", _build_prefix_start, bucket)
    cache, features = start(*args, kept.target_cache, features)
    rest = len(prompt) - shared
    if rest:
      chunk = self.prompt_bucket(rest)
      tokens = np.zeros((1, chunk), np.int32)
      tokens[0, :rest] = prompt[shared:]
      program, args = self._program("serve-chunk", _build_chunk, self.max_len, chunk)
      cache, features = program(*args, cache, features, tokens, np.int32(shared))
    prompts = np.zeros((1, self.max_len), np.int32)
    prompts[0, :len(prompt)] = prompt
    settings = RowSettings.of([request.sampling], [request.max_new_tokens], [request.stop_ids], self.vocab_size, FULL)
    seeds = np.asarray([int(request.seed) % (1 << 32)], np.uint32)
    finish, args = self._program("serve-chunk-finish", _build_chunk_finish, self.max_len)
    new = finish(*args, cache, features, prompts, np.asarray([len(prompt)], np.int32), seeds, settings)
    self._keep(prompt, self.max_len, new, features)
    self._write([request], [row], new)
    self.prefix_hits += 1
    self.prefix_tokens += shared

  @property
  def kept_prompts(self) -> int:
    """Prompts whose prefilled rows are kept (``prompt_cache``)."""
    return len(self._kept)

  @property
  def prompt_cache_bytes(self) -> int:
    """Device bytes the kept prefilled rows hold."""
    return sum(x.nbytes for kept in self._kept.values() for x in jax.tree.leaves(kept[1:]) if hasattr(x, "nbytes"))

  def clear_prompt_cache(self) -> None:
    """Drops every kept prefilled row (after changing the models' weights in place, for one)."""
    self._kept.clear()

  def chunks(self, request: Request) -> bool:
    """Whether ``request``'s prompt is prefilled in chunks (:meth:`start_prefill`) rather than at once (a
    prompt whose prefilled row is kept is not prefilled at all: :meth:`insert` takes it; nor is one that starts
    from a kept prompt's caches with at most a chunk left)."""
    return (self.prefill_chunk is not None and len(request.prompt) > self.prefill_chunk
            and bucket_length(len(request.prompt)) <= self.max_len  # the chunks tile the prompt's bucket
            and tuple(request.prompt) not in self._kept
            and not self._short_rest(request.prompt))

  def _short_rest(self, prompt: Sequence[int]) -> bool:
    """Whether ``prompt`` starts from a kept prompt's caches with at most ``prefill_chunk`` tokens left to pass
    (then it is one chunk's work, done at once by :meth:`insert`)."""
    hit = self._prefix_hit(prompt)
    return hit is not None and len(prompt) - hit[1] <= self.prefill_chunk

  @property
  def prefilling(self) -> list[int]:
    """The slots whose prompts are being prefilled in chunks, oldest first."""
    return list(self._prefilling)

  def start_prefill(self, request: Request) -> int:
    """Takes a slot for ``request`` (a prompt longer than ``prefill_chunk``) whose prompt :meth:`prefill_next`
    then prefills a chunk at a time; the request joins the running state (and its steps) after its last
    chunk. Returns the slot."""
    self.check(request)
    if not self.chunks(request):
      raise ValueError(f"a prompt of {len(request.prompt)} tokens is prefilled at once (prefill_chunk "
                       f"{self.prefill_chunk}): use insert")
    if not self._free:
      raise ValueError("no free slot")
    bucket = bucket_length(len(request.prompt))
    start, args = self._program("serve-chunk-start", _build_chunk_start, bucket)
    cache, features = start(*args)
    slot = heapq.heappop(self._free)
    self._prefilling[slot] = _Prefill(request, bucket, cache, features, 0)
    return slot

  def prefill_next(self) -> int | None:
    """Prefills the next chunk of the oldest prompt being prefilled in chunks; after its last chunk, writes
    the request into a free row of the running state (as :meth:`insert`). Returns its slot then, else None."""
    self._idle("prefill")
    slot = next(iter(self._prefilling))
    job = self._prefilling[slot]
    request = job.request
    part = request.prompt[job.done:job.done + self.prefill_chunk]
    chunk = min(self.prompt_bucket(len(part)), self.prefill_chunk)  # a last chunk padded to a prompt bucket
    tokens = np.zeros((1, chunk), np.int32)
    tokens[0, :len(part)] = part
    program, args = self._program("serve-chunk", _build_chunk, job.bucket, chunk)
    job.cache, job.features = program(*args, job.cache, job.features, tokens, np.int32(job.done))
    self._queued = True  # (not the state, but the device runs the chunk before a step dispatched after it)
    job.done += len(part)
    if job.done < len(request.prompt):
      return None
    del self._prefilling[slot]
    try:
      (row,) = self._take_rows(1)
      self._insert_group(job.bucket, [request], [row], (job.cache, job.features))
    except Exception:
      heapq.heappush(self._free, slot)
      raise
    self._row[slot], self._live[slot], self._context[slot] = row, request, len(request.prompt)
    self._fresh.add(slot)
    if request.grammar is not None:
      self._matchers[slot] = request.grammar.matcher()
    if self.stores:
      self._produced[slot] = []
    return slot

  def settle(self) -> None:
    """Waits for the work dispatched on the state (inserts, prefill chunks, resizes), so that the next step's
    ``seconds`` are its own (``queued`` False); for timings. Serving never waits here."""
    self._idle("settle")
    jax.block_until_ready((self.state, [(job.cache, job.features) for job in self._prefilling.values()]))
    self._queued = False

  def _idle(self, what: str) -> None:
    if self._call is not None:
      raise RuntimeError(f"{what} while a step is in flight: collect it first")

  def cancel(self, slot: int) -> None:
    """Ends the request in ``slot``: the next step marks its row done, and the slot is free after it (a
    step in flight when it is called runs the row on, and its tokens are dropped)."""
    if slot in self._prefilling:
      del self._prefilling[slot]
      heapq.heappush(self._free, slot)
    elif slot in self._live:
      del self._live[slot]
      self._matchers.pop(slot, None)
      self._produced.pop(slot, None)
      self._context.pop(slot, None)
      self._fresh.discard(slot)
      self._cancelled.add(slot)

  def compact(self) -> bool:
    """Moves the state to the smallest width that holds the live requests, once they have fit a smaller
    width for ``shrink_after`` rounds (cancelled rows are dropped on the way). Returns whether it moved."""
    if self._fits_smaller < self.shrink_after or self._call is not None:
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
    self._idle("resize")
    src = np.full((width,), -1, np.int32)
    src[:len(keep)] = [self._row[s] for s in keep]
    program, _ = self._program("serve-resize", _build_resize, self.width, width)
    self.state = program(self.state, src)
    self._queued = True
    for slot in set(self._row) - set(keep):
      self._cancelled.discard(slot)
      heapq.heappush(self._free, slot)
    self._row = {slot: i for i, slot in enumerate(keep)}
    self.width, self._fits_smaller = width, 0

  def _choice(self, choice) -> Choice:
    """``choice`` as one of :attr:`candidates` (a tree may be given as its string), else ValueError."""
    if isinstance(choice, str) and self.trees:
      try:
        choice = parse_tree(choice)
      except ValueError:
        pass
    if isinstance(choice, (TreeShape, DynamicTree)):
      if choice not in self.trees:
        raise ValueError(f"the tree must be one of the compiled trees {[t.describe() for t in self.trees]}, got "
                         f"{choice.describe()!r}")
      return choice
    if not isinstance(choice, int) or isinstance(choice, bool) or choice not in self.ks:
      trees = f" or one of the compiled trees {[t.describe() for t in self.trees]}" if self.trees else ""
      raise ValueError(f"k must be one of the compiled speculation lengths {self.ks}{trees}, got {choice!r}")
    return choice

  def step(self, k: Choice, rounds: int = 1, bucket: int | None = None) -> StepResult:
    """Speculative rounds for every row of the current width: each a chain of ``k`` proposals (``k`` one of
    ``ks``), or a token tree when ``k`` is one of ``trees`` (its spec, or the string it was parsed from).

    One device call runs up to ``rounds`` rounds (at most the engine's ``rounds``): it returns after the
    round in which a row finished, or when every row is done, or after ``rounds`` rounds; a request gets
    the same tokens whatever the rounds per call. :meth:`launch` and :meth:`collect` split it in two.
    ``bucket``: the compiled attention bucket to attend over (at least :meth:`bucket_for` the call); None: the
    smallest of the width's :attr:`active_buckets` that holds the rows.

    Returns:
      :class:`StepResult` (a tree step: ``k`` the tree's depth, ``tree`` its description); the slots of
      finished requests are free when it returns.
    """
    return self.collect(self.launch(k, rounds, bucket))

  @property
  def in_flight(self) -> int:
    """The steps launched and not yet collected: 0, 1, or 2 (one launched ``ahead`` of the other's collect)."""
    return (self._call is not None) + (self._ahead is not None)

  def _window_of(self, choice: Choice | None) -> int:
    """The cache positions a round of ``choice`` may write per row (any candidate's for None)."""
    return self.reserve + 1 if choice is None else choice + 1 if isinstance(choice, int) else tree_window(choice)

  def can_launch_ahead(self, k: Choice, rounds: int) -> bool:
    """Whether :meth:`launch` with ``ahead`` would take a step of ``rounds`` rounds of ``k`` now: one step in
    flight and none ahead of it, a live row, no structured-output row (their rounds are stepped by the host),
    and (with ``bucket_cache``) the caches' length holds every live row through both steps, and the caches are
    not due to be cut to a shorter bucket (the rows have fit one for ``shrink_after`` rounds: the next step,
    launched after a collect, cuts them first)."""
    k = self._choice(k)
    if (self._call is None or self._ahead is not None or not self._live or self._matchers
        or self._call.unpack is None):
      return False
    if not self.bucket_cache:
      return True
    need = self.bucket_for(rounds, k)
    return need <= self._length and not (need < self._length and self._fits_shorter >= self.shrink_after)

  def sure_rounds(self) -> int | None:
    """The rounds that every live request is sure to run, not done, after the steps in flight: the least over
    the live requests of their tokens left (``max_new_tokens`` less those collected) less the rounds in flight,
    since a round gives a live row at least one token (a stop token or a cancel may end it sooner). None
    without a live request. A step launched ahead with more rounds runs its last ones on a done row, and the
    request that takes the slot next waits for them (:meth:`launch` with ``ahead``)."""
    left = [r.max_new_tokens - (self._context[s] - len(r.prompt)) for s, r in self._live.items()
            if s not in self._cancelled]
    if not left:
      return None
    return min(left) - sum(c.rounds for c in (self._call, self._ahead) if c is not None)

  def bucket_for(self, rounds: int, choice: Choice | None = None) -> int:
    """The smallest compiled bucket that holds every live row's context through ``rounds`` more rounds of
    ``choice`` (each writes at most its window: ``k + 1`` positions for a chain of ``k``, :func:`tree_window`
    for a tree; any candidate's, ``reserve + 1``, for None), and the row's own end at most; beyond the steps in
    flight, whose rounds the host has not seen yet."""
    window = self._window_of(choice)
    # A step in flight writes up to its rounds' windows past the contexts the host knows.
    pending = sum(c.rounds * self._window_of(c.choice) for c in (self._call, self._ahead) if c is not None)
    need = max((min(self._context[s] + pending + (rounds + 1) * window,
                    len(r.prompt) + r.max_new_tokens + self.reserve)
                for s, r in self._live.items()), default=0) + _BUCKET_MARGIN
    return next((b for b in self._active[self.width] if b >= need), self.max_len)

  @property
  def active_buckets(self) -> dict[int, tuple[int, ...]]:
    """``{width: buckets}``: the attention buckets a step at each width chooses among (:meth:`use_buckets`)."""
    return dict(self._active)

  def use_buckets(self, buckets: Mapping[int, Sequence[int]]) -> None:
    """Restricts the steps at each width of ``buckets`` to those of its compiled attention buckets (``max_len``
    is always added); a step then attends over the smallest of them that holds its rows. The programs stay
    compiled; widths not named keep theirs. :meth:`choose_buckets` sets them by measurement.

    Raises:
      ValueError: a width that is not compiled, or a bucket that is not (naming the allowed ones).
    """
    active = dict(self._active)
    for width, kept in dict(buckets).items():
      if width not in self.widths:
        raise ValueError(f"buckets: width {width!r} is not one of the engine's widths {self.widths}")
      kept = tuple(sorted(set(kept) | {self.max_len}))
      if any(b not in self.buckets for b in kept):
        raise ValueError(f"buckets at width {width}: {kept} holds a bucket that is not compiled; the engine's "
                         f"buckets are {self.buckets}")
      active[width] = kept
    self._active = active

  def launch(self, k: Choice, rounds: int = 1, bucket: int | None = None, ahead: bool = False) -> _Call:
    """Dispatches a step (see :meth:`step`) and returns at once; :meth:`collect` waits for its results.
    Between the two the state may only be stepped on and requests cancelled: inserts, resizes and cache
    cuts wait for the collect.

    ``ahead``: launched while one step is in flight, before the host collects it, so that the device runs the
    two back to back and the host's work on the first (its tokens handed out, the next decision) overlaps the
    second (:meth:`can_launch_ahead` says whether it may; the steps are collected in order). It runs the rows as
    they are now: a row that the first step finishes runs on done, and a slot freed by the first is free for an
    insert only after the second is collected too. The same tokens per request either way. With
    ``bucket_cache`` it attends at the caches' present length."""
    if not isinstance(ahead, bool):
      raise ValueError(f"ahead must be True or False, got {ahead!r}")
    if ahead:
      if self._call is None or self._ahead is not None:
        raise RuntimeError("launch(ahead=True) needs exactly one step in flight (and none ahead of it)")
      if self._matchers or self._call.unpack is None:
        raise RuntimeError("launch(ahead=True) with structured-output rows: their rounds are stepped by the host")
    else:
      self._idle("launch")
    k = self._choice(k)
    check_int("rounds", rounds, 1, self.rounds)
    if ahead and self.bucket_cache:
      if self.bucket_for(rounds, k) > self._length:
        raise ValueError(f"launch(ahead=True): {rounds} rounds need a bucket of {self.bucket_for(rounds, k)}, past "
                         f"the caches' length {self._length} (see can_launch_ahead)")
      bucket = self._length if bucket is None else bucket
      if bucket != self._length:
        raise ValueError(f"bucket: a step launched ahead runs at the caches' length {self._length}, got {bucket!r}")
      self._fits_shorter = self._fits_shorter + rounds if self.bucket_for(rounds, k) < bucket else 0
    if bucket is not None and (bucket not in self.buckets or bucket < self.bucket_for(rounds, k)):
      raise ValueError(f"bucket must be one of the compiled buckets {self.buckets} that holds the live rows through "
                       f"{rounds} rounds (at least {self.bucket_for(rounds, k)}), got {bucket!r}")
    width = self.width
    cancel = np.zeros((width,), bool)
    cancel[[self._row[s] for s in self._cancelled]] = True
    logprobs = max((r.logprobs for r in self._live.values() if r.logprobs is not None), default=None)
    logprobs = None if logprobs is None else MAX_LOGPROBS if logprobs > 0 else 0  # two step programs at most
    # Inserts, prefill chunks and resizes run asynchronously, and the step is dispatched behind them without
    # waiting: the device runs them in order and the host does not stand between them (waiting for an insert's
    # prefill, then dispatching, left the device idle for the dispatch). Such a step's time holds theirs too:
    # `queued` tells the speculation policy not to compare k by it.
    if self.bucket_cache and not ahead:  # the caches to the call's bucket first (the step is then queued behind it)
      need = self.max_len if self._matchers else self.bucket_for(rounds, k)
      if bucket is None:
        keep = (need <= self._length and self._fits_shorter < self.shrink_after
                and self._length in self._active[width])
        bucket = self._length if keep else need
      self.relength(bucket)
      self._fits_shorter = self._fits_shorter + rounds if need < bucket else 0
    queued, self._queued = self._queued, False
    start = time.perf_counter()
    if self._matchers:  # structured output: the host masks each window, one round a call, over the whole cache
      k = k if isinstance(k, int) else max((c for c in self.ks if c <= k.depth), default=min(self.ks))
      bucket = self.max_len  # (a tree runs as a chain of its depth)
      mode = self.step_mode()
      program = ("grammar", width, k, logprobs)
      outputs = (*self._grammar_round(width, k, logprobs, cancel), np.int32(1), np.False_)
      unpack = None
    else:
      bucket = self.bucket_for(rounds, k) if bucket is None else bucket
      mode = self.step_mode(k if logprobs is None else None, bucket)
      step, args = self._step_program(width, k, logprobs, bucket, mode)
      self.state, outputs = step(*args, self.state, cancel, np.int32(rounds), np.int32(self._handle))
      unpack = step.unpack  # the outputs come as one array
      program = ("step", width, k, logprobs, bucket, mode)
    cold = program not in self._ran
    self._ran.add(program)
    call = _Call(choice=k, width=width, bucket=bucket, outputs=outputs, cancelled=frozenset(self._cancelled),
                 start=start, mode=mode, cold=cold, queued=queued or ahead, unpack=unpack, rounds=rounds, ahead=ahead)
    if ahead:
      self._ahead = call
    else:
      self._call = call
    self._fresh.clear()
    return call

  def step_mode(self, choice: Choice | None = None, bucket: int | None = None) -> Mode:
    """What the next step compiles for: :data:`GREEDY_STEPS` when every live request is greedy without logit
    adjustments (and the engine has ``greedy_steps``), else :data:`specjax.sampling.FULL`. Both give a greedy
    row the same tokens, and evolve every row's state alike (keys, counts).

    After ``warm_up(defer_greedy=True)``, a step of ``choice`` at ``bucket`` (both given) runs the greedy
    program only once :meth:`compile_greedy_steps` has compiled it: until then the general program, which
    is compiled, serves it (the same tokens), so that no request waits for a compile."""
    if GREEDY_STEPS in self.modes and self._live and all(
        r.sampling.greedy and not r.sampling.adjusts for r in self._live.values()):
      ready = self._greedy_ready
      if ready is None or choice is None or bucket is None or (self.width, choice, bucket) in ready:
        return GREEDY_STEPS
    return FULL

  def collect(self, call: _Call) -> StepResult:
    """Waits for the step ``call`` (the one in flight) and does the host's bookkeeping: the tokens of each
    live request, the slots of finished and cancelled requests freed."""
    if call is not self._call:
      raise RuntimeError("collect takes the oldest step in flight, from launch")
    ready = call.unpack is not None and call.outputs.is_ready()  # done before the host asked: its end unseen
    try:
      outputs = jax.device_get(call.outputs) if call.unpack is None else call.unpack(np.asarray(call.outputs))
      emitted, count, done, stats, rounds, interrupted = outputs
    finally:
      self._call, self._ahead = self._ahead, None
    end = time.perf_counter()
    seconds, queued = end - call.start, call.queued
    if call.ahead:  # it started when the call before it ended, if the host saw that end
      began = self._seen_end if self._seen_end is not None and self._seen_end > call.start else None
      queued = began is None or ready
      seconds = end - (call.start if began is None else began)
    self._seen_end = None if ready else end
    for slot in call.cancelled & self._cancelled:  # (a call launched ahead may carry the one before's cancels)
      del self._row[slot]
      self._cancelled.discard(slot)
      heapq.heappush(self._free, slot)
    width, k = call.width, call.choice

    tokens, logprobs, finished, row_rounds, drafted, accepted = {}, {}, {}, {}, {}, {}
    finished_outputs = []
    for slot, request in list(self._live.items()):
      row = self._row[slot]
      n = int(count[row])
      new = emitted.ids[row, :n].tolist()
      if slot in self._matchers:
        self._matchers[slot].commit(new)
      if n:
        tokens[slot] = new
        self._context[slot] += n
        if slot in self._produced:
          self._produced[slot].extend(new)
        if request.logprobs is not None:
          top = request.logprobs
          logprobs[slot] = (emitted.logprobs[row, :n].tolist(),
                            [] if not top else emitted.top_ids[row, :n, :top].tolist(),
                            [] if not top else emitted.top_logprobs[row, :n, :top].tolist())
      row_rounds[slot], drafted[slot] = int(stats.row_rounds[row]), int(stats.drafted[row])
      accepted[slot] = int(stats.accepted[row])
      if done[row]:
        finished[slot] = "stop" if new and new[-1] in request.stop_ids else "length"
        del self._live[slot], self._row[slot], self._context[slot]
        self._matchers.pop(slot, None)
        heapq.heappush(self._free, slot)
        if slot in self._produced:
          finished_outputs.append(self._produced.pop(slot))
    if finished_outputs:
      for store in self.stores:
        store.extend(finished_outputs)
      self._models.refresh()  # the store's new contents, same shapes: no recompilation
    smaller = [w for w in self.widths if w < width]
    fits = bool(smaller) and len(self._live) <= smaller[-1]
    self._fits_smaller = self._fits_smaller + max(int(rounds), 1) if fits else 0
    tree = None if isinstance(k, int) else k
    return StepResult(k=k if tree is None else tree.depth, width=width, tokens=tokens, logprobs=logprobs,
                      finished=finished, row_rounds=row_rounds, drafted=drafted, accepted=accepted,
                      reached=np.asarray(stats.reached), accepted_at=np.asarray(stats.accepted_at),
                      catch_ups=int(stats.catch_ups), seconds=seconds,
                      tree=None if tree is None else tree.describe(), rounds=int(rounds), bucket=call.bucket,
                      greedy=call.mode.greedy, cold=call.cold, interrupted=bool(interrupted), queued=queued,
                      ahead=call.ahead)

  def _grammar_round(self, width: int, k: int, logprobs: int | None, cancel: np.ndarray):
    """One host-stepped round under the rows' grammars (:mod:`specjax.grammar`): the first position's masks,
    the proposals (device; each q_i restricted by the mask the host's rollout computes after d_<i), the masks
    along them (the rollout's), then verification with them (device). Returns the step's outputs; the
    matchers advance by the emitted tokens in :meth:`collect`."""
    matchers = {self._row[s]: m for s, m in self._matchers.items()}
    first = grammar.first_masks(matchers, width, self.vocab_size)  # [W, words]
    if k == 0:
      window = first[:, None]  # [W, 1, words]
      proposed = None
    else:
      propose, args = self._program("serve-propose", _build_propose, width, k)
      with grammar.Rollout(matchers, width, self.vocab_size, first) as rollout:
        proposed = propose(*args, self.state, cancel, first, np.int32(rollout.handle))
        drafts = np.asarray(proposed.drafts)  # the proposals drawn (the rollout's callbacks answered)
        window = grammar.window_masks(matchers, drafts, self.vocab_size, first, rollout)  # [W, k+1, words]
    finish, args = self._program("serve-finish", _build_finish, width, k, logprobs)
    self.state, outputs = finish(*args, self.state, proposed, window, cancel)
    return outputs

  # ---------------------------------------------------------------------------------- compilation

  def warm_up(self, defer_greedy: bool = False) -> None:
    """Compiles every program a request can need, without touching the state: the prefill of one request
    for each prompt bucket up to ``max_len`` (with a ``prompt_cache``, also a kept row's new key), and for
    each width its write, its step for each k and each tree at each attention bucket, and its resizes to
    every other width (ahead-of-time lowering with the states' shapes).

    ``defer_greedy``: the greedy step programs (``greedy_steps``; half the step programs) are left for
    :meth:`compile_greedy_steps`, which a server runs beside its serving thread; until a step's greedy
    program is compiled, the general program runs it (:meth:`step_mode`)."""
    if self._live or self._cancelled or self._prefilling:
      raise RuntimeError("warm_up needs an engine without requests")
    if not isinstance(defer_greedy, bool):
      raise ValueError(f"defer_greedy must be True or False, got {defer_greedy!r}")
    modes = tuple(m for m in self.modes if not (defer_greedy and m == GREEDY_STEPS))
    if len(modes) < len(self.modes):
      self._greedy_ready = set()
    self.compile_prefills()
    chunked = [] if self.prefill_chunk is None else [  # the buckets of prompts prefilled in chunks (powers of two)
        1 << i for i in range(self.prefill_chunk.bit_length(), self.max_len.bit_length()) if 1 << i <= self.max_len]
    kept = sorted(set(self.prompt_buckets) | set(chunked)) if self.prompt_cache else []
    for bucket in kept:  # a kept row's new key and settings; a prompt starting from a kept one's
      rekey, args = self._program("serve-rekey", _build_rekey, bucket)
      *_, settings = _prefill_operands(bucket, 1, self.vocab_size)
      row, features = self._prefill_shape(bucket, 1)
      rekey.lower(row, np.zeros((1,), np.uint32), settings).compile()
      start, _ = self._program("serve-prefix-start", _build_prefix_start, bucket)
      start.lower(*args, row.target_cache, features).compile()
      cache, features = jax.eval_shape(start, *args, row.target_cache, features)
      if bucket == self.max_len:  # where a prompt started from a kept one is finished (and kept)
        finish, _ = self._program("serve-chunk-finish", _build_chunk_finish, self.max_len)
        finish.lower(*args, cache, features, *_prefill_operands(self.max_len, 1, self.vocab_size)).compile()
      elif bucket in self.prompt_buckets:  # the rest of such a prompt, padded to a bucket shorter than a whole
        chunk, _ = self._program("serve-chunk", _build_chunk, self.max_len, bucket)
        chunk.lower(*args, cache, features, np.zeros((1, bucket), np.int32), np.int32(0)).compile()
    for bucket in chunked:
      start, args = self._program("serve-chunk-start", _build_chunk_start, bucket)
      start.lower(*args).compile()
      cache, features = jax.eval_shape(start, *args)
      # A whole chunk, and a prompt's last chunk padded to a shorter prompt bucket.
      for size in sorted({b for b in self.prompt_buckets if b < self.prefill_chunk} | {self.prefill_chunk}):
        chunk, _ = self._program("serve-chunk", _build_chunk, bucket, size)
        chunk.lower(*args, cache, features, np.zeros((1, size), np.int32), np.int32(0)).compile()
      finish, _ = self._program("serve-chunk-finish", _build_chunk_finish, bucket)
      finish.lower(*args, cache, features, *_prefill_operands(bucket, 1, self.vocab_size)).compile()
    start = self.width
    for width in self.widths:
      self._set_empty(width)
      # With bucket_cache the state may be at any bucket's length: each program for each length (a step at
      # the bucket its state is at), and the cut or growth between any two.
      for length in self.buckets if self.bucket_cache else (self.max_len,):
        state = self._state_at(length, width)
        write, _ = self._program("serve-write", _build_write, width, 1, length)
        new = self._prefill_shape(MIN_PROMPT_BUCKET, 1)
        write.lower(state, np.zeros((1,), np.int32), new[0] if self.prompt_cache else new).compile()
        if width > 1:
          copy, _ = self._program("serve-copy", _build_copy, width)
          settings = _prefill_operands(MIN_PROMPT_BUCKET, width - 1, self.vocab_size)[-1]
          copy.lower(state, np.int32(0), np.zeros((width - 1,), np.int32), np.zeros((width - 1,), np.uint32),
                     settings).compile()
        for bucket in (length,) if self.bucket_cache else self.buckets:
          for choice in self.candidates:
            for mode in modes:
              step, args = self._step_program(width, choice, None, bucket, mode)
              step.lower(*args, state, np.zeros((width,), bool), np.int32(1), np.int32(0)).compile()
        for other in self.widths:
          if other != width:
            resize, _ = self._program("serve-resize", _build_resize, width, other)
            resize.lower(state, np.zeros((other,), np.int32)).compile()
        for other in self.buckets if self.bucket_cache else ():
          if other != length:
            relength, _ = self._program("serve-relength", _build_relength, length, other)
            relength.lower(state).compile()
    self._set_empty(start)

  def compile_greedy_steps(self) -> int:
    """Compiles the greedy step programs that ``warm_up(defer_greedy=True)`` left, one at a time, each
    usable by :meth:`step_mode` as soon as it is compiled; returns how many it compiled. Safe to run in a
    thread beside the one that steps the engine: it reads only the engine's settings and builds its own
    empty states (the state being stepped is never touched)."""
    if self._greedy_ready is None:
      return 0
    compiled = 0
    for width in self.widths:
      state = None if self.bucket_cache else self._state_at(self.max_len, width)
      for bucket in self.buckets:
        at = self._state_at(bucket, width) if self.bucket_cache else state
        for choice in self.candidates:
          if (width, choice, bucket) in self._greedy_ready:
            continue
          step, args = self._step_program(width, choice, None, bucket, GREEDY_STEPS)
          step.lower(*args, at, np.zeros((width,), bool), np.int32(1), np.int32(0)).compile()
          self._greedy_ready = self._greedy_ready | {(width, choice, bucket)}  # a new set: readers see either
          compiled += 1
      del state
    return compiled

  @property
  def greedy_steps_pending(self) -> int:
    """Greedy step programs that a deferred warm-up left and :meth:`compile_greedy_steps` has not compiled
    yet (0 without ``greedy_steps`` or a deferred warm-up)."""
    if self._greedy_ready is None or GREEDY_STEPS not in self.modes:
      return 0
    return len(self.widths) * len(self.buckets) * len(self.candidates) - len(self._greedy_ready)

  def compile_prefills(self, groups: Iterable[int] = (1,)) -> None:
    """Compiles the prefill for every prompt bucket (:attr:`prompt_buckets`) and each number of requests."""
    for bucket in self.prompt_buckets:
      for group in groups:
        prefill, args = self._prefill_program(bucket, group)
        prefill.lower(*args, *_prefill_operands(bucket, group, self.vocab_size)).compile()

  def _prefill_shape(self, bucket: int, group: int):
    """The shapes of a prefill's output: the rows a write takes (and, with a ``prompt_cache``, the features)."""
    prefill, args = self._prefill_program(bucket, group)
    return jax.eval_shape(prefill, *args, *_prefill_operands(bucket, group, self.vocab_size))

  def time_steps(self, repeats: int = 5) -> dict[int, dict[Choice, float]]:
    """``{width: {candidate: seconds}}``: the median time of one round for each compiled width and candidate
    (each k of ``ks`` and each tree of ``trees``), the start-up timings of :class:`SpeculationPolicy`.

    Each width is timed on live rows, as it serves: every row holds a one-token prompt sampled at
    temperature 1 (the general program, which :meth:`warm_up` compiles), and each candidate runs calls of up to
    the engine's ``rounds`` (8 at most, and no more than the rows' room allows), interleaved, ``repeats`` times,
    each call's time divided by its rounds. Empty rows would time one round and a call's fixed cost: on the
    bundled pair at width 1 a plain round measured 4.2 ms there against 1.8 ms served, and every candidate
    looked alike. The engine is empty afterwards, at its first width; the rows leave nothing behind (no
    counts, no suffix store entries)."""
    check_int("repeats", repeats, 1)
    per_round = sum(1 + (c if isinstance(c, int) else c.depth) for c in self.candidates)  # tokens at most
    times: dict[int, dict[Choice, list[float]]] = {w: {c: [] for c in self.candidates} for w in self.widths}
    with self._timing_rows("time_steps", per_round) as (fill, rounds):
      for width in self.widths:
        for _ in range(repeats):
          fill(width)
          for choice in self.candidates:
            result = self.step(choice, rounds)
            times[width][choice].append(result.seconds / result.rounds)
    return {w: {k: float(np.median(v)) for k, v in by_k.items()} for w, by_k in times.items()}

  def time_calls(self, repeats: int = 5) -> dict[int, CallCost]:
    """``{width: CallCost}``: what a device call of the first candidate (``ks[0]``, plain decoding where it is
    0) costs at each compiled width, apart from its rounds: calls of one round and of several (up to the
    engine's ``rounds``, 8 at most), interleaved on live rows as :meth:`time_steps` times them, give the cost
    of a round (the slope) and the call's fixed cost (dispatch, the cache window, fetching the outputs, the
    bookkeeping: what one round's call costs beyond a round). The scheduler sizes a width's calls by them
    (:func:`specjax.serving.scheduler.rounds_per_call`). The engine is empty afterwards, at its first width."""
    check_int("repeats", repeats, 1)
    if self.rounds < 2:
      raise ValueError(f"time_calls needs calls of several rounds: the engine's rounds is {self.rounds}")
    choice = self.candidates[0]
    window = 1 + (choice if isinstance(choice, int) else choice.depth)
    costs = {}
    # A call of one round and one of `rounds` on the same rows: room for twice the window a round.
    with self._timing_rows("time_calls", 2 * window) as (fill, rounds):
      if rounds < 2:
        raise ValueError(f"max_len={self.max_len} leaves no room for calls of 2 rounds to time")
      for width in self.widths:
        one, many = [], []
        for i in range(repeats + 1):
          fill(width)
          t1, tn = self.step(choice, 1).seconds, self.step(choice, rounds).seconds
          if i:  # the first: a program's first run costs more than any later one
            one.append(t1)
            many.append(tn)
        round_s = max((float(np.median(many)) - float(np.median(one))) / (rounds - 1), 0.0)
        costs[width] = CallCost(fixed=max(float(np.median(one)) - round_s, 0.0), round=round_s)
    return costs

  def time_buckets(self, repeats: int = 3) -> dict[int, dict[int, float]]:
    """``{width: {bucket: seconds}}``: the median time of a call of the first candidate (``ks[0]``) over each
    compiled attention bucket at each compiled width, on live rows as :meth:`time_calls` times them (calls of
    the engine's rounds, 8 at most, the buckets interleaved, ``repeats`` times after one untimed pass). A call
    over a bucket below ``max_len`` copies the bucket's window of every cache out and back, and reads fewer
    positions: :func:`keep_buckets` weighs the two. A bucket too small for such a call (a long chain's
    windows) is not timed. The engine is empty afterwards, at its first width."""
    check_int("repeats", repeats, 1)
    choice = self.candidates[0]
    window = 1 + (choice if isinstance(choice, int) else choice.depth)
    times: dict[int, dict[int, list[float]]] = {}
    with self._timing_rows("time_buckets", window) as (fill, rounds):
      for width in self.widths:
        fill(width)
        timed = [b for b in self.buckets if b >= self.bucket_for(rounds, choice)]
        times[width] = {b: [] for b in timed}
        for i in range(repeats + 1):
          for bucket in timed:  # each call moves the rows on; a fresh fill when the next could outgrow a bucket
            if self.bucket_for(rounds, choice) > timed[0]:
              fill(width)
            if self.bucket_cache:  # the caches cut or grown to the bucket outside the timed call
              self.relength(bucket)
              self.settle()
            seconds = self.step(choice, rounds, bucket).seconds
            if i:  # the first pass: each program's first run costs more than any later one
              times[width][bucket].append(seconds)
    return {w: {b: float(np.median(v)) for b, v in by_b.items()} for w, by_b in times.items()}

  def choose_buckets(self, repeats: int = 3, margin: float = BUCKET_MARGIN) -> dict[int, tuple[int, ...]]:
    """Times the buckets (:meth:`time_buckets`) and keeps at each width those worth attending over
    (:func:`keep_buckets`; a bucket too small to time is kept); returns :attr:`active_buckets`."""
    times = self.time_buckets(repeats)
    self.use_buckets({w: keep_buckets(t, margin) + tuple(b for b in self.buckets if b not in t)
                      for w, t in times.items()})
    return self.active_buckets

  @contextlib.contextmanager
  def _timing_rows(self, what: str, per_round: int):
    """For the timings: ``(fill, rounds)``, ``fill(width)`` starting the engine over with ``width`` live rows
    (one-token prompts sampled at temperature 1, which never finish within the timed calls) and ``rounds`` the
    rounds a timed call may run (the engine's, 8 at most, no more than the rows' room for ``per_round`` tokens
    a round allows). The engine is empty afterwards, at its first width, and its counters as
    before."""
    if self._live or self._cancelled or self._prefilling:
      raise RuntimeError(f"{what} needs an engine without requests")
    room = self.max_len - self.reserve
    rounds = max(1, min(self.rounds, 8, (room - 2) // per_round))
    row = Request((0,), room - 1, SamplingConfig(temperature=1.0))

    def fill(width: int) -> None:
      self.reset()
      self.insert([dataclasses.replace(row, seed=i) for i in range(width)])
      self.settle()  # the timed calls time their rounds, not the prefill

    counters = self.prefills, self.copies, self.prompt_hits, self.prefix_hits, self.prefix_tokens
    kept = OrderedDict(self._kept)
    try:
      yield fill, rounds
    finally:
      self.reset()
      self.prefills, self.copies, self.prompt_hits, self.prefix_hits, self.prefix_tokens = counters
      self._kept = kept


def _tree_specs(trees) -> tuple[TreeSpec, ...]:
  """``trees`` as distinct tree specs in their order (strings parsed), else ValueError naming ``trees``."""
  if isinstance(trees, (str, TreeShape, DynamicTree)) or not isinstance(trees, Iterable):
    raise ValueError(f"trees must be a sequence of tree specs (TreeShape, DynamicTree or strings such as "
                     f"'dynamic:4,4,16' or '4-2-1/6'), got {trees!r}")
  specs = []
  for i, tree in enumerate(trees):
    if isinstance(tree, str):
      try:
        tree = parse_tree(tree)
      except ValueError as e:
        raise ValueError(f"trees[{i}]: {e}") from None
    if not isinstance(tree, (TreeShape, DynamicTree)):
      raise ValueError(f"trees[{i}] must be a specjax.tree.TreeShape, a specjax.tree.DynamicTree or a string such "
                       f"as 'dynamic:4,4,16' or '4-2-1/6', got {tree!r}")
    if tree not in specs:
      specs.append(tree)
  return tuple(specs)


def _prefill_operands(bucket: int, group: int, vocab_size: int) -> tuple:
  """Operands of the prefill program's shapes (ahead-of-time compilation)."""
  settings = RowSettings.of([Request((0,), 1).sampling] * group, [1] * group, [()] * group, vocab_size, FULL)
  return np.zeros((group, bucket), np.int32), np.ones((group,), np.int32), np.zeros((group,), np.uint32), settings


# ------------------------------------------------------------------------------------------- programs


def _build_empty(structure: Structure, width: int, max_len: int, k_max: int):
  """``run(tstate, pstates) -> state``: ``width`` free (done) rows, the caches allocated."""
  def run(tstate, pstates):
    TRACE_COUNTS["serve_empty"] += 1
    target, proposer = structure.models(tstate, pstates)
    vocab = target.cfg.vocab_size
    settings = jax.tree.map(jnp.asarray, RowSettings.of([Request((0,), 1).sampling] * width, [0] * width,
                                                        [()] * width, vocab, FULL))
    state = engine.init_state(target, proposer, jnp.ones((width, MIN_PROMPT_BUCKET), jnp.int32),
                              jnp.ones((width,), jnp.int32), jax.random.split(jax.random.key(0), width), settings,
                              k=k_max, mode=FULL, max_len=max_len, out_len=None)
    return dataclasses.replace(state, done=jnp.ones((width,), bool))
  return jax.jit(run)


def _build_prefill(structure: Structure, bucket: int, group: int, features: bool, max_len: int, k_max: int):
  """``run(tstate, pstates, prompts [G, bucket], lens [G], seeds [G], settings) -> state``: the prefill of
  ``group`` requests as a state of their rows, ready to be written into the running state; ``features``:
  ``(state, features [G, bucket, ..])``, the target's features over the prompts too (for a prompt cache)."""
  def run(tstate, pstates, prompts, lens, seeds, settings):
    TRACE_COUNTS["serve_prefill"] += 1
    target, proposer, aux_layers = _chunk_models(structure, tstate, pstates, k_max)
    keys = jax.vmap(jax.random.key)(seeds)
    if not features:
      return engine.init_state(target, proposer, prompts, lens, keys, settings, k=k_max, mode=FULL,
                               max_len=max_len, out_len=None)
    # The pass init_state would make, its features kept.
    _, feats, cache = engine.target_pass(target, prompts, target.init_cache(prompts.shape[0], max_len), aux_layers)
    return engine.init_state(target, proposer, prompts, lens, keys, settings, k=k_max, mode=FULL, max_len=max_len,
                             out_len=None, prefilled=(cache, feats)), feats
  return jax.jit(run)


def _chunk_models(structure: Structure, tstate, pstates, k_max: int):
  target, proposer = structure.models(tstate, pstates)
  return target, proposer if k_max > 0 else None, proposer.aux_layers if proposer is not None and k_max > 0 else ()


def _build_chunk_start(structure: Structure, bucket: int, max_len: int, k_max: int):
  """``run(tstate, pstates) -> (cache, features)``: one row's empty target cache and zero features
  ``[1, bucket, ..]`` for a prompt prefilled in chunks (:func:`_build_chunk`)."""
  def run(tstate, pstates):
    TRACE_COUNTS["serve_chunk_start"] += 1
    target, _, aux_layers = _chunk_models(structure, tstate, pstates, k_max)
    cache = target.init_cache(1, max_len)
    shapes = jax.eval_shape(lambda c: engine.target_pass(target, jnp.zeros((1, bucket), jnp.int32), c, aux_layers)[1],
                            cache)
    return cache, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  return jax.jit(run)


def _build_chunk(structure: Structure, bucket: int, chunk: int, max_len: int, k_max: int):
  """``run(tstate, pstates, cache, features, tokens [1, chunk], start) -> (cache, features)``: the target's
  pass over the prompt's tokens ``start .. start + chunk - 1`` (past the prompt: padding, rolled back at the
  end), its features written at those positions of ``features [1, bucket, ..]`` (cache and features donated)."""
  def run(tstate, pstates, cache, features, tokens, start):
    TRACE_COUNTS["serve_chunk"] += 1
    target, _, aux_layers = _chunk_models(structure, tstate, pstates, k_max)
    _, new, cache = engine.target_pass(target, tokens, cache.with_lengths(jnp.full((1,), start)), aux_layers)
    put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), start, axis=1)
    return cache, jax.tree.map(put, features, new)
  return jax.jit(run, donate_argnums=(2, 3))


def _build_chunk_finish(structure: Structure, bucket: int, max_len: int, k_max: int):
  """``run(tstate, pstates, cache, features, prompts [1, bucket], lens, seeds, settings) -> state``: a prompt
  prefilled in chunks as the one-row state :func:`_build_prefill` gives (the proposer's state from the
  chunks' features)."""
  def run(tstate, pstates, cache, features, prompts, lens, seeds, settings):
    TRACE_COUNTS["serve_chunk_finish"] += 1
    target, proposer = structure.models(tstate, pstates)
    return engine.init_state(target, proposer, prompts, lens, jax.vmap(jax.random.key)(seeds), settings, k=k_max,
                             mode=FULL, max_len=max_len, out_len=None, prefilled=(cache, features))
  return jax.jit(run)


def _build_write(structure: Structure, width: int, group: int, length: int, max_len: int, k_max: int):
  """``run(state, rows [G], new) -> state``: the ``group`` prefilled requests ``new`` (caches at ``max_len``)
  written into rows ``rows`` of a state whose caches are at ``length`` (:func:`specjax.engine.put_rows`; the
  state donated)."""
  def run(state, rows, new):
    TRACE_COUNTS["serve_write"] += 1
    return engine.put_rows(state, rows, _window(new, length, max_len))
  return jax.jit(run, donate_argnums=(0,))


def _build_relength(structure: Structure, length: int, new_length: int, max_len: int, k_max: int):
  """``run(state) -> state`` with every KV cache (as :func:`_window` cuts them) moved from ``length`` to
  ``new_length`` positions: cut, or grown with zeros past the old positions (past every row's length)."""
  def run(state):
    TRACE_COUNTS["serve_relength"] += 1
    return _relength(state, length, new_length)
  return jax.jit(run)  # (no buffer of another length to reuse)


def _relength(state: engine.DecodeState, length: int, new_length: int) -> engine.DecodeState:
  """``state`` (its target cache at ``length`` positions) with every KV cache ``new_length - length``
  positions longer (grown with zeros) or shorter (cut); a proposer cache longer than the target's keeps its
  extra positions."""
  if new_length == length:
    return state
  if new_length < length:
    return _window(state, new_length, length)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, new_length - length)] + [(0, 0)] * (x.ndim - 2))
  grow = lambda c: dataclasses.replace(c, k=tuple(map(pad, c.k)), v=tuple(map(pad, c.v)))
  is_cache = lambda x: isinstance(x, KVCache)
  return dataclasses.replace(state, target_cache=grow(state.target_cache),
                             proposer=jax.tree.map(lambda x: grow(x) if is_cache(x) else x, state.proposer,
                                                   is_leaf=is_cache))


def _build_copy(structure: Structure, width: int, max_len: int, k_max: int):
  """``run(state, source [], rows [width-1], seeds [width-1], settings) -> state``: rows ``rows`` (padding: past
  the last row) copies of row ``source`` with keys from ``seeds`` and ``settings``
  (:func:`specjax.engine.copy_rows`; the state donated)."""
  def run(state, source, rows, seeds, settings):
    TRACE_COUNTS["serve_copy"] += 1
    return engine.copy_rows(state, source, rows, jax.vmap(jax.random.key)(seeds), settings)
  return jax.jit(run, donate_argnums=(0,))


def _build_take(structure: Structure, group: int, max_len: int, k_max: int):
  """``run(new, features, row [1]) -> (state, features)``: row ``row`` of the ``group`` freshly prefilled rows
  ``new`` and of their features, as a state of its own (a prompt's row kept for :class:`SlotEngine`'s
  ``prompt_cache``)."""
  def run(new, features, row):
    TRACE_COUNTS["serve_take"] += 1
    return engine.take_rows(new, row), jax.tree.map(lambda x: x[row], features)
  return jax.jit(run)


def _build_prefix_start(structure: Structure, bucket: int, max_len: int, k_max: int):
  """``run(tstate, pstates, cache, features [1, bucket, ..]) -> (cache, features [1, max_len, ..])``: a kept
  prompt's target cache and features (:class:`SlotEngine`'s ``prompt_cache``), copied (the chunk that follows
  donates them; the kept ones stay), the features padded to ``max_len`` positions: where a prompt that shares
  a prefix with it is prefilled from (:func:`_build_chunk` from the shared length)."""
  def run(tstate, pstates, cache, features):
    TRACE_COUNTS["serve_prefix_start"] += 1
    pad = lambda x: jnp.pad(x, [(0, 0), (0, max_len - bucket)] + [(0, 0)] * (x.ndim - 2))
    return jax.tree.map(jnp.copy, cache), jax.tree.map(pad, features)
  return jax.jit(run)


def _build_rekey(structure: Structure, bucket: int, max_len: int, k_max: int):
  """``run(kept, seeds [1], settings) -> state``: a kept prefilled row with a request's own key and settings
  (what the request's own prefill gives: :func:`specjax.engine.init_state` reads neither before its rounds)."""
  def run(kept, seeds, settings):
    TRACE_COUNTS["serve_rekey"] += 1
    return dataclasses.replace(kept, keys=jax.vmap(jax.random.key)(seeds), settings=settings)
  return jax.jit(run)


def _build_resize(structure: Structure, width: int, new_width: int, max_len: int, k_max: int):
  """``run(state, src [new_width]) -> state`` at ``new_width`` rows (:func:`specjax.engine.take_rows`)."""
  def run(state, src):
    TRACE_COUNTS["serve_resize"] += 1
    return engine.take_rows(state, src)
  return jax.jit(run)


def _window(state: engine.DecodeState, bucket: int, max_len: int, proposer: bool = True) -> engine.DecodeState:
  """``state`` with every KV cache (the target's, and any in the proposer's state unless ``proposer`` is
  False) cut to its first ``bucket`` positions (a proposer cache longer than ``max_len`` keeps its extra
  positions): attention then reads ``bucket`` positions. Rows whose context fits the bucket compute what they
  would over all of them (the positions past a row's length are masked either way)."""
  if bucket == max_len:
    return state
  if not proposer:
    return dataclasses.replace(_window(dataclasses.replace(state, proposer=None), bucket, max_len),
                               proposer=state.proposer)
  cut = lambda c: dataclasses.replace(c, k=tuple(x[:, :bucket + c.max_len - max_len] for x in c.k),
                                      v=tuple(x[:, :bucket + c.max_len - max_len] for x in c.v))
  is_cache = lambda x: isinstance(x, KVCache)
  return dataclasses.replace(state, target_cache=cut(state.target_cache),
                             proposer=jax.tree.map(lambda x: cut(x) if is_cache(x) else x, state.proposer,
                                                   is_leaf=is_cache))


def _unwindow(full: engine.DecodeState, state: engine.DecodeState, bucket: int, max_len: int,
              proposer: bool = True) -> engine.DecodeState:
  """``state`` (cut by :func:`_window` with the same ``proposer``) with its caches written back into
  ``full``'s buffers (in place when ``full`` is donated)."""
  if bucket == max_len:
    return state
  if not proposer:
    return dataclasses.replace(_unwindow(dataclasses.replace(full, proposer=None),
                                         dataclasses.replace(state, proposer=None), bucket, max_len),
                               proposer=state.proposer)
  put = lambda big, small: dataclasses.replace(
      small, k=tuple(b.at[:, :s.shape[1]].set(s) for b, s in zip(big.k, small.k)),
      v=tuple(b.at[:, :s.shape[1]].set(s) for b, s in zip(big.v, small.v)))
  is_cache = lambda x: isinstance(x, KVCache)
  return dataclasses.replace(state, target_cache=put(full.target_cache, state.target_cache),
                             proposer=jax.tree.map(lambda b, x: put(b, x) if is_cache(x) else x, full.proposer,
                                                   state.proposer, is_leaf=is_cache))


def _rounds(structure: Structure, width: int, depth: int, logprobs: int | None, rounds: int, bucket: int,
            interruptible: bool, max_len: int, k_max: int, one_round, name: str):
  """``run(tstate, pstates, state, cancel, limit, handle) -> (state, (emitted, count, done, stats, rounds_run,
  interrupted))``: rounds of ``one_round(state, target, proposer)`` (each giving ``(state, emitted [W,
  depth+1], count [W])``) for every row, until a row finishes, every row is done, ``limit`` (at most
  ``rounds``) rounds have run, or (``interruptible``) the engine ``handle`` names has its interrupt set when
  a round ends (one round at least); ``cancel [W] bool`` rows are marked done first. ``emitted [W, rounds *
  (depth+1)]`` holds each row's tokens of every round in order, ``count [W]`` how many; ``interrupted``: the
  flag ended the loop before ``limit``. The state is donated and its caches read at ``bucket`` positions
  (:func:`_window`)."""
  def run(tstate, pstates, state, cancel, limit, handle):
    TRACE_COUNTS[name] += 1
    target, proposer = structure.models(tstate, pstates)
    # The call's statistics alone (the host accumulates them); RoundStats sized for k_max serve any k.
    full = dataclasses.replace(state, done=state.done | cancel, k_now=jnp.int32(depth),
                               stats=engine.RoundStats.zeros(width, k_max))
    start_done = full.done
    out = engine.Tokens.zeros(width, rounds * (depth + 1), logprobs)
    count = jnp.zeros((width,), jnp.int32)

    def cond(carry):
      i, state, _, _, stop = carry
      return (i == 0) | ((i < limit) & ~stop & ~jnp.any(state.done & ~start_done) & ~jnp.all(state.done))

    def body(carry):
      i, state, out, count, _ = carry
      state, emitted, n = one_round(state, target, proposer)
      # The host's flag, read once the round is done (its operands tie it to the round: never hoisted).
      stop = (jax.pure_callback(_interrupted, jax.ShapeDtypeStruct((), jnp.bool_), handle, i)
              if interruptible else jnp.bool_(False))
      return i + 1, state, out.write(emitted, count), count + n, stop

    # Plain rounds of a proposer whose commit then leaves its caches alone (the draft model's) carry those
    # caches whole: cutting and writing them back cost the bundled pair's plain calls ~5 %.
    cut = depth > 0 or not getattr(proposer, "plain_rounds_keep_caches", False)
    i, state, out, count, stop = jax.lax.while_loop(
        cond, body, (jnp.int32(0), _window(full, bucket, max_len, cut), out, count, jnp.bool_(False)))
    state = _unwindow(full, state, bucket, max_len, cut)
    return state, packed.pack((out, count, state.done, state.stats, i, stop & (i < limit)))
  packed = _PackedStep(run)
  return packed


class _PackedStep:
  """A jitted step program (``donate_argnums=(2,)``: the state) whose outputs come back as one int32 array, so
  that the host fetches one buffer a call rather than one per output (~15: on this CPU 120 against 16 us a
  call); :meth:`unpack` gives them back in their own shapes and dtypes. Called and lowered as the jitted
  function is; the layout is recorded when the program is traced."""

  def __init__(self, run):
    self.layout = None  # (treedef, [(shape, dtype)]) of the outputs, set when traced
    self._jitted = jax.jit(run, donate_argnums=(2,))

  def __call__(self, *args):
    return self._jitted(*args)

  def lower(self, *args):
    return self._jitted.lower(*args)

  def pack(self, outputs) -> jax.Array:
    """(traced) The leaves of ``outputs`` as one flat int32 array: 4-byte dtypes bitcast, booleans as 0/1."""
    leaves, treedef = jax.tree.flatten(outputs)
    for x in leaves:
      if x.dtype != jnp.bool_ and x.dtype.itemsize != 4:
        raise TypeError(f"a packed step output must be a boolean or a 4-byte type, got {x.dtype}")
    self.layout = treedef, [(x.shape, x.dtype) for x in leaves]
    return jnp.concatenate([(x.astype(jnp.int32) if x.dtype == jnp.bool_ else
                             jax.lax.bitcast_convert_type(x, jnp.int32)).reshape(-1) for x in leaves])

  def unpack(self, flat: np.ndarray):
    """The outputs :meth:`pack` packed, as numpy arrays in their own shapes and dtypes (the host's copy)."""
    treedef, shapes = self.layout
    leaves, at = [], 0
    for shape, dtype in shapes:
      n = math.prod(shape)
      piece = flat[at:at + n].reshape(shape)
      leaves.append(piece != 0 if dtype == jnp.bool_ else piece.view(dtype))
      at += n
    return jax.tree.unflatten(treedef, leaves)


# The live interruptible engines, by the handle their step programs take (0: none).
_INTERRUPTS: dict[int, weakref.ref] = {}
_HANDLES = itertools.count(1)


def _interrupted(handle: np.ndarray, _round: np.ndarray) -> np.ndarray:
  """The host callback of an interruptible step: whether the engine ``handle`` names has its interrupt set."""
  ref = _INTERRUPTS.get(int(handle))
  owner = None if ref is None else ref()
  return np.bool_(owner is not None and owner.interrupt.is_set())


def _build_step(structure: Structure, width: int, k: int, logprobs: int | None, rounds: int, bucket: int, mode: Mode,
                interruptible: bool, max_len: int, k_max: int):
  """Rounds with ``k`` proposals for every row (:func:`specjax.engine.round_step`; see :func:`_rounds`), under
  ``mode`` (:data:`specjax.sampling.FULL`, or :data:`GREEDY_STEPS` when every live row is greedy)."""
  def one_round(state, target, proposer):
    return engine.round_step(state, target=target, proposer=proposer, k=k, mode=mode, logprobs=logprobs)
  return _rounds(structure, width, k, logprobs, rounds, bucket, interruptible, max_len, k_max, one_round,
                 "serve_step")


def _build_tree_step(structure: Structure, width: int, tree: TreeSpec, logprobs: int | None, rounds: int,
                     bucket: int, mode: Mode, interruptible: bool, max_len: int, k_max: int):
  """Rounds with token tree ``tree`` for every row (:func:`specjax.engine.tree_round_step`; see
  :func:`_rounds`), under ``mode`` (as :func:`_build_step`)."""
  def one_round(state, target, proposer):
    return engine.tree_round_step(state, target=target, proposer=proposer, tree=tree, mode=mode, logprobs=logprobs)
  return _rounds(structure, width, tree.depth, logprobs, rounds, bucket, interruptible, max_len, k_max, one_round,
                 "serve_tree_step")


def _round_state(state, cancel, width: int, k: int, k_max: int):
  """The state a step starts from: ``cancel`` rows done, k proposals, the round's statistics alone."""
  return dataclasses.replace(state, done=state.done | cancel, k_now=jnp.int32(k),
                             stats=engine.RoundStats.zeros(width, k_max))


def _build_propose(structure: Structure, width: int, k: int, max_len: int, k_max: int):
  """``run(tstate, pstates, state, cancel, first [W, words], handle []) -> Proposed``: the proposals of a
  structured round, d_1 drawn under the grammar's first mask and each later one under the mask the host's
  :class:`specjax.grammar.Rollout` ``handle`` computes after the proposals before it
  (:func:`specjax.engine.propose_round`)."""
  def run(tstate, pstates, state, cancel, first, handle):
    TRACE_COUNTS["serve_propose"] += 1
    target, proposer = structure.models(tstate, pstates)
    state = _round_state(state, cancel, width, k, k_max)
    vocab = target.cfg.vocab_size
    allowed = engine.unpack_mask(first, vocab)  # [W, V]
    steps = grammar.GrammarSteps.start(handle, width, k, vocab)
    return engine.propose_round(state, target=target, proposer=proposer, k=k, mode=FULL, allowed=allowed,
                                grammar=steps)
  return jax.jit(run)


def _build_finish(structure: Structure, width: int, k: int, logprobs: int | None, max_len: int, k_max: int):
  """``run(tstate, pstates, state, proposed, window [W, k+1, words], cancel) -> (state, outputs)``: the rest of
  a structured round with the grammar's masks along the window (:func:`specjax.engine.finish_round`);
  ``proposed`` None for k = 0. As :func:`_build_step` otherwise."""
  def run(tstate, pstates, state, proposed, window, cancel):
    TRACE_COUNTS["serve_finish"] += 1
    target, proposer = structure.models(tstate, pstates)
    state = _round_state(state, cancel, width, k, k_max)
    if proposed is None:
      proposed = engine.propose_round(state, target=target, proposer=proposer, k=0, mode=FULL)
    allowed = engine.unpack_mask(window, target.cfg.vocab_size)  # [W, k+1, V]
    state, emitted, count = engine.finish_round(state, proposed, target=target, proposer=proposer, k=k, mode=FULL,
                                                logprobs=logprobs, allowed=allowed)
    return state, (emitted, count, state.done, state.stats)
  return jax.jit(run, donate_argnums=(2,))
