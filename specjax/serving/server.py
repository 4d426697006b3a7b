"""``specjax serve``: an OpenAI-compatible HTTP server (Starlette on uvicorn) over the slot engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true`` as
server-sent events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

Handlers run on uvicorn's event loop and never touch the engine: they validate the request
(:mod:`specjax.serving.api`), submit it to the :class:`~specjax.serving.scheduler.Scheduler` (the one thread
that owns the device), and turn its token events into text (:mod:`specjax.serving.text`: stable UTF-8,
stop strings; the log-probabilities of the tokens, in OpenAI's shapes, go with the chunk that carries their
text). A full queue answers 503 with ``Retry-After``; a client that goes away mid-stream cancels
its request (the slot is freed at the next step). SIGTERM or SIGINT drains: requests still waiting are
refused, running ones finish within the grace period, then the engine thread stops.

Who may call it and how much (:class:`Limits`): with an API key every route but ``/health`` needs
``Authorization: Bearer KEY`` (compared in constant time; else a 401); a body over ``max_body_bytes`` gets a
413, a ``max_tokens`` over ``max_tokens`` or an ``n`` over ``max_n`` a 400, each naming the limit; a client that takes longer than
``client_timeout`` seconds to send its body gets a 408, and one that stops reading a stream for that long loses
its request (the slot is freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import signal
import threading
import time
import types
import uuid
from collections.abc import AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specjax.serving import api
from specjax.serving.api import APIError, ServedModel
from specjax.serving.metrics import CONTENT_TYPE, ServeMetrics
from specjax.serving.scheduler import Event, Job, QueueFull, Scheduler, ShuttingDown
from specjax.request import RequestError
from specjax.serving.text import StopStrings, TextStream

log = logging.getLogger("specjax.serve")

RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streamed request checks that its client is still there


def error_response(e: APIError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one client may ask of the server (``specjax serve --api-key --max-body-bytes --max-tokens
  --client-timeout``).

  Attributes:
    api_key: None (open), or the key every route but ``/health`` requires as ``Authorization: Bearer KEY``.
    max_body_bytes: the largest request body read; a larger one gets a 413 before it is parsed.
    max_tokens: None (a slot's room: ``max_len`` minus the prompt), or the most new tokens a request may ask
      for (``max_tokens`` / ``max_completion_tokens``; a chat request that names none gets at most this).
    max_n: the most choices a request may ask for (``n``), at most the server's slots (more is refused when the
      server is built): the choices run at once, one slot each, sharing the prompt's prefill. None: the slots.
    client_timeout: seconds a client may take to send its request body (else 408), and that one send of a
      streamed chunk may wait for the client to read (else the stream ends and the request is cancelled).
  """

  api_key: str | None = None
  max_body_bytes: int = 1 << 20
  max_tokens: int | None = None
  max_n: int | None = None
  client_timeout: float = 60.0

  def __post_init__(self):
    if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()
                                     or any(c.isspace() for c in self.api_key)):
      raise ValueError("Limits.api_key must be None or a non-empty string without spaces")
    for name, value in (("max_body_bytes", self.max_body_bytes), ("max_tokens", self.max_tokens),
                        ("max_n", self.max_n)):
      if (value is None and name == "max_body_bytes") or (
          value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1)):
        raise ValueError(f"Limits.{name} must be an integer >= 1{'' if name == 'max_body_bytes' else ' (or unset)'}, "
                         f"got {value!r}")
    if isinstance(self.client_timeout, bool) or not isinstance(self.client_timeout, (int, float)) or not (
        self.client_timeout > 0):
      raise ValueError(f"Limits.client_timeout must be a number of seconds > 0, got {self.client_timeout!r}")

  def authorized(self, header: str | None) -> bool:
    """Whether an ``Authorization`` header value carries the key (constant-time comparison)."""
    if self.api_key is None:
      return True
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode())


OPEN_ROUTES = ("/health",)  # answered without the API key (load balancers' probes)


class _Output:
  """One request's text: stable UTF-8 pieces (:class:`TextStream`), cut at its stop strings."""

  def __init__(self, tokenizer, stops: tuple[str, ...]):
    self.text = TextStream(tokenizer)
    self.stops = StopStrings(stops) if stops else None

  def push(self, tokens) -> str:
    piece = self.text.push(tokens)
    return self.stops.push(piece) if self.stops is not None else piece

  def finish(self) -> str:
    piece = self.text.finish()
    return self.stops.push(piece) + self.stops.finish() if self.stops is not None else piece

  @property
  def stopped(self) -> bool:
    return self.stops is not None and self.stops.stopped


class _Mailbox:
  """Hands events from the engine thread to the event loop, one wake-up of the loop for everything posted
  since the last (a step's events for every live request), not one per event."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop = loop
    self._lock = threading.Lock()
    self._pending: list[tuple[asyncio.Queue, Event]] = []

  def post(self, queue: asyncio.Queue, event: Event) -> None:
    """On any thread: ``event`` goes into ``queue`` on the loop's thread; dropped once the loop has closed (the
    server stopped while the engine thread still ended its requests: nobody is left to read them)."""
    with self._lock:
      self._pending.append((queue, event))
      wake = len(self._pending) == 1
    if wake:
      try:
        self.loop.call_soon_threadsafe(self._deliver)
      except RuntimeError:
        if not self.loop.is_closed():
          raise

  def _deliver(self) -> None:
    with self._lock:
      pending, self._pending = self._pending, []
    for queue, event in pending:
      queue.put_nowait(event)


class _Run:
  """One choice of a submitted request seen from the event loop: its events, posted to the request's queue as
  ``(index, event)``, turned into (text, finish reason)."""

  def __init__(self, served: Server, parsed: api.Parsed, request, index: int, events: asyncio.Queue):
    mailbox = served.mailbox()
    self.index = index
    self.request = Job(request, sink=lambda e: mailbox.post(events, (index, e)))
    self.output = _Output(served.model.tokenizer, parsed.stop)
    self.served, self.parsed = served, parsed
    self.completion_tokens = 0
    self._ids: list[int] = []  # token ids not yet attached to a chunk (return_token_ids)
    self._logprobs: list[tuple] = []  # (token, logprob, top ids, top logprobs) not yet attached to a chunk
    self._offset = 0  # completions' text_offset of the next token

  def handle(self, event: Event) -> tuple[str, str | None]:
    """``(text, finish_reason or None)`` for one event. Raises RuntimeError for an engine error."""
    if event.kind == "tokens":
      self.completion_tokens += len(event.tokens)
      self._ids += event.tokens
      if self.parsed.logprobs is not None:
        if event.logprobs is None or len(event.logprobs[0]) != len(event.tokens):
          raise RuntimeError("the engine returned no log-probabilities for the tokens of a request that asked "
                             "for them")
        logprobs, top_ids, top_logprobs = event.logprobs
        none = [()] * len(event.tokens)
        self._logprobs += zip(event.tokens, logprobs, top_ids or none, top_logprobs or none)
      piece = self.output.push(event.tokens)
      if self.output.stopped:  # a stop string: the request ends here, its slot is freed
        self.served.scheduler.cancel(self.request)
        return piece, "stop"
      return piece, None
    if event.kind == "done":
      return self.output.finish(), event.reason
    raise RuntimeError(event.error)

  def token_ids(self) -> list[int] | None:
    """The ids since the last call, when the client asked for them (``return_token_ids``)."""
    if not self.parsed.token_ids:
      return None
    ids, self._ids = self._ids, []
    return ids

  def logprobs(self) -> dict | None:
    """OpenAI's ``logprobs`` object of the tokens since the last call, when the client asked for them."""
    if self.parsed.logprobs is None:
      return None
    entries, self._logprobs = self._logprobs, []
    if self.parsed.chat:
      return api.chat_logprobs(self.served.strings, entries)
    out, self._offset = api.completion_logprobs(self.served.strings, entries, self.parsed.logprobs, self._offset)
    return out



class _Choices:
  """A request's n choices (:class:`_Run` each) under one id, their events in one queue."""

  def __init__(self, served: Server, parsed: api.Parsed):
    self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    self.parsed = parsed
    self.runs = [_Run(served, parsed, request, i, self.events) for i, request in enumerate(parsed.choices())]
    self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex

  def usage(self) -> dict:
    """The prompt counted once (as OpenAI does for n choices), the choices' tokens and proposals summed."""
    jobs = [r.request for r in self.runs]
    return api.usage(len(self.parsed.request.prompt), sum(r.completion_tokens for r in self.runs),
                     sum(j.accepted for j in jobs), sum(j.drafted for j in jobs))

  def final_extra(self) -> dict:
    """The speculation statistics of the choices together (one choice: its own)."""
    jobs = [r.request for r in self.runs]
    total = types.SimpleNamespace(rounds=sum(j.rounds for j in jobs), drafted=sum(j.drafted for j in jobs),
                                  accepted=sum(j.accepted for j in jobs))
    return {"speculation": api.speculation(total)}


class _EventStream(StreamingResponse):
  """Server-sent events that notice a client going away while nothing is being sent, give up on a client that
  does not read one chunk within ``send_timeout`` seconds, and always close the event generator (whose
  ``finally`` cancels the request)."""

  def __init__(self, *args, send_timeout: float = 60.0, **kwargs):
    super().__init__(*args, **kwargs)
    self.send_timeout = send_timeout
    self.timed_out = False

  async def __call__(self, scope, receive, send) -> None:
    async def timed_send(message):
      with anyio.move_on_after(self.send_timeout) as scope:
        await send(message)
      if scope.cancelled_caught:
        self.timed_out = True
        raise OSError(f"the client read nothing for {self.send_timeout} s")

    async def stream(scope_to_cancel):
      with contextlib.suppress(OSError):
        await self.stream_response(timed_send)
      scope_to_cancel.cancel()

    try:
      async with anyio.create_task_group() as tg:
        tg.start_soon(stream, tg.cancel_scope)
        await self.listen_for_disconnect(receive)
        tg.cancel_scope.cancel()
    finally:
      with contextlib.suppress(Exception):
        await self.body_iterator.aclose()


def _sse(data: dict | str) -> str:
  return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class Server:
  """The served model, its scheduler and metrics, and the Starlette app over them.

  Args:
    model: the served model (name, tokenizer, chat format, slot engine).
    scheduler: the started scheduler running ``model.engine``.
    metrics: its metrics.
  """

  def __init__(self, model: ServedModel, scheduler: Scheduler, metrics: ServeMetrics, limits: Limits = Limits()):
    limits = _fit_max_n(limits, model.engine.slots)
    self.model, self.scheduler, self.metrics, self.limits = model, scheduler, metrics, limits
    self.strings = api.TokenStrings(model.tokenizer)  # token texts and bytes of the logprobs
    self._mailbox: _Mailbox | None = None
    self.app = Starlette(routes=[
        Route("/v1/completions", self.completions, methods=["POST"]),
        Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        Route("/v1/models", self.models, methods=["GET"]),
        Route("/health", self.health, methods=["GET"]),
        Route("/metrics", self.metrics_text, methods=["GET"]),
    ], exception_handlers={HTTPException: self._http_error, Exception: self._internal_error})
    if limits.api_key is not None:
      inner = self.app

      async def guarded(scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
          header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
          if not limits.authorized(header):
            self.metrics.on_rejected("unauthorized")
            response = error_response(APIError(
                401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                type="invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            await response(scope, receive, send)
            return
        await inner(scope, receive, send)

      self.asgi = guarded
    else:
      self.asgi = self.app

  def mailbox(self) -> _Mailbox:
    """The mailbox of the running event loop (made on first use: the app is built before the loop runs)."""
    loop = asyncio.get_running_loop()
    if self._mailbox is None or self._mailbox.loop is not loop:
      self._mailbox = _Mailbox(loop)
    return self._mailbox

  # ------------------------------------------------------------------------------------- routes

  async def completions(self, request: HTTPRequest) -> Response:
    return await self._complete(request, chat=False)

  async def chat_completions(self, request: HTTPRequest) -> Response:
    return await self._complete(request, chat=True)

  async def models(self, request: HTTPRequest) -> Response:
    m = self.model
    return JSONResponse({"object": "list", "data": [{"id": m.name, "object": "model", "created": m.created,
                                                     "owned_by": "specjax", "max_model_len": m.engine.max_len}]})

  async def health(self, request: HTTPRequest) -> Response:
    s = self.scheduler
    if not s.accepting:
      reason = "the engine thread stopped" if not s.alive else "shutting down"
      return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ok", "slots_used": s.slots_used, "slots": s.engine.slots,
                         "queue_length": s.queue_length})

  async def metrics_text(self, request: HTTPRequest) -> Response:
    return Response(self.metrics.render(), media_type=CONTENT_TYPE)

  async def _http_error(self, request: HTTPRequest, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return error_response(APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)), type=kind))

  async def _internal_error(self, request: HTTPRequest, exc: Exception) -> Response:
    log.exception("request failed")
    return error_response(APIError(500, f"internal error: {exc}", type="server_error"))

  # ------------------------------------------------------------------------------------ completions

  async def _read_body(self, http: HTTPRequest) -> bytes:
    """The request body, at most ``limits.max_body_bytes`` of it, sent within ``limits.client_timeout``."""
    limit = self.limits.max_body_bytes
    too_large = APIError(413, f"the request body is larger than the server's limit of {limit} bytes "
                              f"(specjax serve --max-body-bytes)", type="invalid_request_error", code="body_too_large")
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
      raise too_large
    chunks, size = [], 0
    with anyio.move_on_after(self.limits.client_timeout) as scope:
      async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
          raise too_large
        chunks.append(chunk)
    if scope.cancelled_caught:
      raise APIError(408, f"the request body did not arrive within {self.limits.client_timeout:g} s "
                          f"(specjax serve --client-timeout)", type="invalid_request_error", code="request_timeout")
    return b"".join(chunks)

  async def _complete(self, http: HTTPRequest, chat: bool) -> Response:
    try:
      body = api.parse_body(await self._read_body(http))
      parsed = api.parse(body, self.model, chat, max_tokens_limit=self.limits.max_tokens, max_n=self.limits.max_n)
    except APIError as e:
      self.metrics.on_rejected({408: "timeout", 413: "too_large"}.get(e.status, "invalid"))
      return error_response(e)
    choices = _Choices(self, parsed)
    try:  # all or none, together in the queue: the choices share the prompt's prefill
      self.scheduler.submit([run.request for run in choices.runs])
    except (QueueFull, ShuttingDown, RequestError) as e:
      if isinstance(e, QueueFull):
        self.metrics.on_rejected("queue_full")
        return error_response(APIError(503, f"the server is busy: {e}; retry after {RETRY_AFTER_SECONDS} s",
                                       type="server_overloaded", code="queue_full",
                                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}))
      if isinstance(e, ShuttingDown):
        self.metrics.on_rejected("shutting_down")
        return error_response(APIError(503, str(e), type="server_unavailable", code="shutting_down",
                                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}))
      self.metrics.on_rejected("invalid")  # parse() checked already; kept for a changed engine
      return error_response(api.bad(e.field, str(e)))
    if parsed.stream:
      return _EventStream(self._stream(choices), media_type="text/event-stream", send_timeout=self.limits.client_timeout,
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await self._collect(choices, http)

  async def _collect(self, choices: _Choices, http: HTTPRequest) -> Response:
    runs = choices.runs
    pieces = [[] for _ in runs]
    reasons: list[str | None] = [None] * len(runs)
    try:
      while any(r is None for r in reasons):
        try:
          i, event = await asyncio.wait_for(choices.events.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
          if await http.is_disconnected():
            return Response(status_code=499)  # nobody reads it; the finally frees the slots
          continue
        if reasons[i] is not None:
          continue  # a choice cut by a stop string: what its request still sends
        try:
          piece, reasons[i] = runs[i].handle(event)
        except RuntimeError as e:
          return error_response(APIError(500, f"the request failed in the engine: {e}", type="server_error"))
        pieces[i].append(piece)
      out = [("".join(p), reason, run.token_ids(), run.logprobs()) for p, reason, run in zip(pieces, reasons, runs)]
      return JSONResponse(api.response(choices.id, self.model.name, choices.parsed.chat, out, choices.usage(),
                                       choices.final_extra()))
    finally:
      for run in runs:
        self.scheduler.cancel(run.request)  # a no-op once the request finished

  async def _stream(self, choices: _Choices) -> AsyncIterator[str]:
    chat, name, rid, runs = choices.parsed.chat, self.model.name, choices.id, choices.runs
    done = [False] * len(runs)
    try:
      if chat:
        for run in runs:
          yield _sse(api.chunk(rid, name, chat, "", first=True, index=run.index))
      while not all(done):
        events = [await choices.events.get()]
        while not choices.events.empty():  # the client fell behind: one chunk per choice for every event waiting
          events.append(choices.events.get_nowait())
        piece, reason = [""] * len(runs), [None] * len(runs)
        try:
          for i, event in events:
            if done[i] or reason[i] is not None:
              continue
            more, reason[i] = runs[i].handle(event)
            piece[i] += more
        except RuntimeError as e:
          yield _sse(APIError(500, f"the request failed in the engine: {e}", type="server_error").body())
          yield _sse("[DONE]")
          return
        for i, run in enumerate(runs):
          # Tokens whose text the stream still holds back go with the next chunk that has text, or the last.
          if piece[i] and reason[i] is None:
            yield _sse(api.chunk(rid, name, chat, piece[i], token_ids=run.token_ids(), logprobs=run.logprobs(),
                                 index=i))
          if reason[i] is not None:
            done[i] = True
            last = all(done)
            yield _sse(api.chunk(rid, name, chat, piece[i], finish_reason=reason[i], index=i,
                                 extra=choices.final_extra() if last else None, token_ids=run.token_ids(),
                                 logprobs=run.logprobs()))
      if choices.parsed.include_usage:
        yield _sse(api.usage_chunk(rid, name, chat, choices.usage()))
      yield _sse("[DONE]")
    finally:
      for run in runs:
        self.scheduler.cancel(run.request)


# ------------------------------------------------------------------------------------- building, running


def _fit_max_n(limits: Limits, slots: int) -> Limits:
  """``limits`` with ``max_n`` set to ``slots`` when it is None; ValueError naming it when it exceeds them."""
  if limits.max_n is None:
    return dataclasses.replace(limits, max_n=slots)
  if limits.max_n > slots:
    raise ValueError(f"Limits.max_n ({limits.max_n}) must be at most slots ({slots}): the n choices of a request "
                     "run at once, one slot each")
  return limits


def build_server(target, tokenizer, proposer=None, chat=None, *, name: str, slots: int = 8, max_len: int = 512,
                 k: int | str = "auto", ks: tuple[int, ...] = (0, 1, 2, 4), trees: tuple = (),
                 widths: tuple[int, ...] | None = None, max_queue: int = 64, warm_up: bool = True,
                 limits: Limits = Limits(), log=log, rounds: int = 8, buckets: tuple[int, ...] | None = None,
                 prefill_chunk: int | None = 256, first_rounds: int = 1, greedy_steps: bool = True,
                 defer_greedy: bool = True, interruptible: bool = False, max_rounds: int | None = 32,
                 call_overhead: float = 0.05, max_call_seconds: float = 0.05,
                 refill_rounds: int | None = 2, refill_share: float = 0.25, bucket_cache: bool = True,
                 launch_ahead: bool | None = None, prompt_cache: int = 0,
                 prompt_buckets: tuple[int, ...] | None = None) -> Server:
  """The server for one model: slot engine (compiled for every prompt bucket, width, k and tree), policy,
  scheduler (started) and metrics.

  Args:
    target, tokenizer: the model and its tokenizer. proposer: any proposer, or None (plain decoding).
    chat: the model's :class:`specjax.chat.ChatFormat`, or None (chat completions refused with a 400).
    name: the model id of the API. slots, max_len, widths: the engine's (see :class:`SlotEngine`).
    rounds, buckets, prefill_chunk: the engine's too: the most rounds one device call runs, the attention
      lengths, and the prompt length prefilled at a time between steps (a longer prompt in chunks; None,
      or ``max_len`` or more: every prompt at once). ``buckets`` None: the engine's default buckets, and with
      ``warm_up`` each width keeps those that a timed call says are worth their window's copy
      (:meth:`SlotEngine.choose_buckets`); given: every one of them at every width.
    first_rounds: the most rounds of a step that runs a new request for the first time (the scheduler's): its
      first token streams after them, then the steps run up to ``rounds``.
    max_rounds, call_overhead, max_call_seconds: where a device call costs more than ``call_overhead`` of its
      ``rounds`` beyond them (a call's fixed cost timed at start-up at every width, :meth:`SlotEngine.time_calls`,
      against a round of the call's k), calls run longer, up to ``max_rounds`` rounds and ``max_call_seconds``
      of them (:func:`specjax.serving.scheduler.rounds_per_call`);
      None, at most ``rounds``, or no ``warm_up`` (which would compile the steps of every width to time them):
      ``rounds`` at every width.
    greedy_steps: the engine's: steps whose live rows are all greedy run a program compiled for greedy
      decoding (faster per round; twice the step programs to compile at warm-up, which matters with ``k="auto"``
      and many widths and buckets). False: one program for every step.
    defer_greedy: with ``greedy_steps`` and ``warm_up``, the greedy step programs compile in a thread after the
      server starts serving (the general program runs greedy steps until theirs is compiled; the
      ``specjax_greedy_steps_pending`` metric counts what is left), so that the server is up after half the
      step compiles. False: all compiled before serving.
    refill_rounds, refill_share: the scheduler's: after a call in which a request finished, while at least
      ``refill_share`` of the width's rows are free, the next calls run ``refill_rounds`` rounds, then twice as
      many, up to a full call (a request sent on the last one's end waits about as long as its slot has been
      free); None: full calls.
    interruptible: the engine's (:class:`SlotEngine`): a call returns after the round in which a request arrived
      for a free slot or was cancelled (a host callback per round), not when its rounds run out.
    bucket_cache: the engine's (:class:`SlotEngine`): the KV caches kept at the attention bucket the steps
      run at, so that a call reads and writes them in place instead of copying its bucket's window out of the
      ``max_len`` buffers and back (on by default here: SmolLM2-135M served 1.05-1.06x faster at concurrency 8,
      the bundled pair within noise; False: the caches at ``max_len``).
    launch_ahead: the scheduler's ``ahead``: the next full call launched before the one in flight is collected,
      so that the host's work between calls overlaps the device (:class:`Scheduler`). None (the default): on
      where every call runs one candidate (the target alone, or a fixed k), off with a speculation policy
      (``k="auto"`` over several candidates). On this CPU it served the plain server 1.05x (in process) and
      1.05-1.21x (HTTP) faster at concurrency 1 and the same at 8; with ``k="auto"`` the policy, timing plain
      rounds cheaper with it, chose k = 0 at concurrency 1 over HTTP (0.86x the plain server in one run, 1.02x
      ``auto`` without it in another), and concurrency 8 with ``auto`` is not settled (``docs/benchmarks.md``,
      "Calls launched ahead" and "Launched ahead by default without a speculation policy").
    prompt_cache: the engine's (:class:`SlotEngine`): how many prompts' prefilled rows to keep, so that a request
      whose whole prompt was prefilled before skips its prefill (the same tokens), and one that shares a long
      prefix with a kept prompt passes only the rest of its own; 0: none.
    prompt_buckets: the engine's: the padded lengths prompts are prefilled at (None: its default, powers of two
      and the lengths halfway between them, each compiled at warm-up).
    k: a fixed speculation length, or "auto": per step among ``ks`` and ``trees`` (:class:`SpeculationPolicy`).
    trees: token trees (specs or strings :func:`specjax.tree.parse_tree` reads) that ``k="auto"`` chooses
      among besides ``ks``; the proposer must propose trees. A fixed k takes none.
    max_queue: requests that may wait for a slot.
    warm_up: compile every program before serving (else on first use: the first requests wait).
    limits: the API key and the per-client limits (:class:`Limits`).
  """
  from specjax.serving.policy import SpeculationPolicy
  from specjax.serving.slots import BUCKET_MARGIN, SlotEngine, choice_name

  trees = tuple(trees or ())
  _fit_max_n(limits, slots)  # before minutes of compiling
  if launch_ahead is not None and not isinstance(launch_ahead, bool):
    raise ValueError(f"launch_ahead must be True, False or None (on without a speculation policy), got {launch_ahead!r}")
  if trees and k != "auto":
    raise ValueError(f"trees are candidates of k='auto' only: a fixed k={k!r} runs chains of {k} (drop the trees, "
                     "or use k='auto')")
  if trees and proposer is None:
    raise ValueError("trees need a proposer that proposes trees (draft, eagle, mtp or medusa)")
  if proposer is None:
    ks = (0,)
  elif k != "auto":
    ks = (k,)
  else:
    ks = tuple(x for x in ks if proposer.max_k is None or x <= proposer.max_k)
  from specjax.serving.scheduler import rounds_per_call
  from specjax.serving.slots import CallCost

  most = rounds if max_rounds is None or not warm_up else max(rounds, max_rounds)
  rounds_per_call(CallCost(0.0, 1.0), rounds, most, call_overhead, max_call_seconds)  # checked before compiling
  engine = SlotEngine(target, proposer, slots=slots, max_len=max_len, ks=ks, trees=trees, widths=widths,
                      rounds=most, buckets=buckets, greedy_steps=greedy_steps, interruptible=interruptible,
                      bucket_cache=bucket_cache, prompt_cache=prompt_cache, prompt_buckets=prompt_buckets,
                      prefill_chunk=None if prefill_chunk is None or prefill_chunk >= max_len else prefill_chunk)
  if warm_up:
    log.info("compiling the prefill for each prompt bucket up to %d and the step at widths %s, attention "
             "lengths %s, for k in %s%s", max_len, engine.widths, engine.buckets, ks, f" and trees {[t.describe() for t in engine.trees]}" if engine.trees else "")
    engine.warm_up(defer_greedy=defer_greedy)
    if buckets is None and len(engine.buckets) > 1:
      chosen = engine.choose_buckets(repeats=3)
      log.info("attention lengths kept by width (a call over each measured at least %d %% cheaper than over the "
               "next longer one kept): %s", round(100 * BUCKET_MARGIN), chosen)
  policy = None
  if len(engine.candidates) > 1:
    policy = SpeculationPolicy(engine.time_steps(repeats=5))
    log.info("step ms by width and candidate: %s",
             {w: {choice_name(x): round(1e3 * policy.step_seconds(w, x), 3) for x in engine.candidates}
              for w in engine.widths})
  costs = None
  if most > rounds:
    costs = engine.time_calls(repeats=5)
    log.info("a call's fixed cost and a plain round by width (ms): %s",
             {w: (round(1e3 * c.fixed, 3), round(1e3 * c.round, 3)) for w, c in costs.items()})
  if launch_ahead is None:
    launch_ahead = policy is None
  scheduler = Scheduler(engine, policy, max_queue=max_queue, first_rounds=first_rounds, rounds=rounds,
                        call_costs=costs, call_overhead=call_overhead, max_call_seconds=max_call_seconds,
                        refill_rounds=refill_rounds, refill_share=refill_share, ahead=launch_ahead)
  log.info("rounds a full call by width: %s", {w: scheduler.call_rounds(w, ks[0]) for w in engine.widths})
  metrics = ServeMetrics(scheduler)
  scheduler.on_step, scheduler.on_finish = metrics.on_step, metrics.on_finish
  scheduler.start()
  if engine.greedy_steps_pending:
    def compile_greedy():
      started = time.perf_counter()
      try:
        n = engine.compile_greedy_steps()
      except Exception:  # the general program keeps serving greedy steps
        log.exception("compiling the greedy step programs failed; greedy steps keep the general program")
      else:
        log.info("compiled %d greedy step programs in %.1f s while serving", n, time.perf_counter() - started)
    threading.Thread(target=compile_greedy, name="specjax-greedy-compile", daemon=True).start()
  return Server(ServedModel(name=name, tokenizer=tokenizer, chat=chat, engine=engine), scheduler, metrics, limits)


def run(server: Server, host: str = "127.0.0.1", port: int = 8000, grace: float = 30.0,
        log_level: str = "info") -> None:
  """Serves until SIGTERM/SIGINT: then refuses new and waiting requests, lets running ones finish for up
  to ``grace`` seconds, cancels the rest and stops the engine thread."""
  import uvicorn

  class _Uvicorn(uvicorn.Server):
    def handle_exit(self, sig, frame):
      # Drain first (waiting requests are refused at once), then uvicorn's graceful shutdown. The signal is
      # not recorded for uvicorn to raise again after the shutdown: a clean stop exits with status 0.
      server.scheduler.drain()
      if self.should_exit and sig == signal.SIGINT:
        self.force_exit = True  # a second Ctrl-C: stop waiting for running requests
      self.should_exit = True

  config = uvicorn.Config(server.asgi, host=host, port=port, log_level=log_level, lifespan="off",
                          timeout_graceful_shutdown=grace, access_log=False)
  try:
    _Uvicorn(config).run()
  finally:
    server.scheduler.stop(timeout=10.0)
