"""The OpenAI protocol, without the HTTP: request bodies validated into engine requests, and the response
and chunk objects of ``/v1/completions`` and ``/v1/chat/completions``.

Every refusal is an :class:`APIError` whose body is OpenAI's ``{"error": {"message", "type", "param",
"code"}}``, ``param`` naming the offending field. Fields specjax does not implement (``n > 1``,
``echo``, ``suffix``, tools...) are refused by name rather than ignored; unknown fields are ignored, as most
OpenAI-compatible servers do.

Sampling: OpenAI's ``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``
and ``seed``, and vLLM's extensions ``top_k``, ``min_p`` and ``repetition_penalty``, all exact under
speculation (:class:`~specjax.config.SamplingConfig` holds their conventions). Log-probabilities as OpenAI
defines them (the target's own distribution, before any warp): completions ``logprobs: N`` (an integer in
``[0, MAX_LOGPROBS]``; OpenAI's legacy API stops at 5, vLLM's at 20), chat ``logprobs: true`` with
``top_logprobs: N``. Other extensions: ``ignore_eos``, ``stop_token_ids`` and ``return_token_ids`` (each
choice, and each streamed chunk, carries the ids of its tokens).

Structured output (``response_format``, :mod:`specjax.grammar`, exact under speculation): OpenAI's
``{"type": "text"}``, ``{"type": "json_object"}`` and ``{"type": "json_schema", "json_schema": {"name", "schema"}}``,
and specjax's ``{"type": "regex", "pattern": "..."}`` and ``{"type": "grammar", "grammar": "<Lark>"}``. An
invalid or unsatisfiable one is a 400 naming the field (``response_format.json_schema.schema``...).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
import time
from typing import Any

from specjax.config import MAX_LOGPROBS, MAX_STOP_TOKENS, SamplingConfig
from specjax import grammar
from specjax.request import Request, RequestError
from specjax.serving.slots import SlotEngine
from specjax.tokenizer import ByteTokenizer, byte_stand_ins


class APIError(Exception):
  """A refused request: HTTP ``status`` and an OpenAI-style error body."""

  def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None, headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
    self.headers = headers or {}

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
  return APIError(400, message, param=param)


@dataclasses.dataclass(frozen=True)
class ServedModel:
  """What the protocol layer knows of the served model.

  Attributes:
    name: the model id clients pass as ``model``.
    tokenizer: encodes prompts and decodes outputs.
    chat: a :class:`specjax.chat.ChatFormat`, or None (then chat completions are refused with a 400).
    engine: the slot engine (its limits: context, vocabulary).
    created: Unix time the server started (``/v1/models``).
  """

  name: str
  tokenizer: Any
  chat: Any
  engine: SlotEngine
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass(frozen=True)
class Parsed:
  """A validated request.

  Attributes:
    chat: a chat completion (else a text completion). request: what the engine runs.
    stop: stop strings, cut on the text. stream: server-sent events. include_usage: a final usage chunk.
    token_ids: each choice carries its token ids. logprobs: None, or the N alternatives per token of the
      log-probabilities asked for (completions ``logprobs``, chat ``top_logprobs``).
    n: choices, sampled independently (choice i runs with seed ``seed + i``).
  """

  chat: bool
  request: Request
  stop: tuple[str, ...] = ()
  stream: bool = False
  include_usage: bool = False
  token_ids: bool = False
  logprobs: int | None = None
  n: int = 1

  def choices(self) -> list[Request]:
    """The engine requests of the n choices: the same prompt and settings, seeds ``seed``, ``seed + 1``, ..."""
    return [dataclasses.replace(self.request, seed=(self.request.seed + i) % (1 << 32)) for i in range(self.n)]


def parse_body(raw: bytes) -> dict[str, Any]:
  """The request's JSON object, or a 400 naming what is wrong with it."""
  try:
    body = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise bad(None, f"the request body is not valid JSON: {e}") from None
  if not isinstance(body, dict):
    raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
  return body


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _number(body: dict, field: str, default: float, low: float, high: float | None = None,
            low_open: bool = False) -> float:
  x = body.get(field)
  if x is None:
    return default
  if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
    raise bad(field, f"{field} must be a number, got {x!r}")
  if (x <= low if low_open else x < low) or (high is not None and x > high):
    interval = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
    raise bad(field, f"{field} must be in {interval}, got {x!r}")
  return float(x)


def _only(body: dict, field: str, allowed: tuple, what: str) -> None:
  """Refuses an unimplemented field unless it holds one of its neutral values."""
  if field in body and body[field] not in allowed:
    raise bad(field, f"{field}={body[field]!r} is not supported by specjax ({what})")


_UNSUPPORTED = (
    ("best_of", (None, 1), "the choices are not ranked: ask for n"),
    ("echo", (None, False), "the prompt is not echoed"), ("suffix", (None,), "no insertion"),
    ("tools", (None, []), "no tool calls"), ("tool_choice", (None, "none"), "no tool calls"),
    ("functions", (None, []), "no tool calls"), ("function_call", (None, "none"), "no tool calls"),
)


def _prompt_ids(body: dict, model: ServedModel) -> list[int]:
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # a batch of one
  if isinstance(prompt, str):
    if not prompt:
      raise bad("prompt", "prompt must not be empty")
    return list(model.tokenizer.encode(prompt))
  if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
    if not prompt:
      raise bad("prompt", "prompt must not be empty")
    return prompt
  if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
    raise bad("prompt", f"prompt holds {len(prompt)} prompts; specjax takes one prompt per request")
  raise bad("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            if prompt is not None else "prompt is required")


def _chat_ids(body: dict, model: ServedModel) -> list[int]:
  if model.chat is None:
    raise bad("messages", f"model {model.name!r} has no chat template: use /v1/completions with a plain prompt "
                          "(or serve a model whose tokenizer ships a chat template)")
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise bad("messages", "messages must be a non-empty list of {role, content} objects")
  clean = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise bad(f"messages[{i}]", f"messages[{i}] must be an object with a string role")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
      if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        raise bad(f"messages[{i}].content", "content parts must be {type: 'text', text: string} (text only)")
      content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
      raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string")
    clean.append({"role": m["role"], "content": content})
  try:
    return model.chat.encode(model.tokenizer, clean)
  except ValueError as e:  # the template refused the conversation
    raise bad("messages", str(e)) from None


def _stop(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  stops = [stop] if isinstance(stop, str) else stop
  if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
    raise bad("stop", f"stop must be a non-empty string or a list of up to 4 of them, got {stop!r}")
  return tuple(stops)


def _stop_ids(body: dict, model: ServedModel, chat: bool) -> tuple[int, ...]:
  ids: list[int] = []
  if not body.get("ignore_eos", False):
    if chat:
      ids += list(model.chat.end_of_turn_ids)
    eos = getattr(model.tokenizer, "eos_id", None)
    if eos is not None:
      ids.append(int(eos))
  extra = body.get("stop_token_ids") or []
  if not isinstance(extra, list) or not all(_is_int(t) for t in extra):
    raise bad("stop_token_ids", f"stop_token_ids must be a list of token ids, got {extra!r}")
  ids = list(dict.fromkeys(ids + extra))
  if len(ids) > MAX_STOP_TOKENS:
    raise bad("stop_token_ids", f"at most {MAX_STOP_TOKENS} stop tokens in all (EOS and end of turn "
                                f"included), got {len(ids)}")
  return tuple(ids)


_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias")


def _sampling(body: dict, temperature: float, top_k: int, top_p: float) -> SamplingConfig:
  """The request's :class:`SamplingConfig`; its range checks are the config's own, their field as ``param``."""
  bias = body.get("logit_bias")
  if bias is not None and not isinstance(bias, dict):
    raise bad("logit_bias", f"logit_bias must be an object mapping token ids (as strings, like \"50256\") to "
                            f"biases in [-100, 100], got {bias!r}")
  pairs = {}
  for key, value in (bias or {}).items():
    if not (key.isascii() and key.isdigit()):
      raise bad("logit_bias", f"logit_bias keys must be token ids like \"50256\", got {key!r}")
    pairs[int(key)] = value
  values = {f: body[f] for f in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
            if body.get(f) is not None}
  try:
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, logit_bias=pairs, **values)
  except ValueError as e:  # the message starts with the field: "min_p must be ...", "logit_bias[5] must be ..."
    field = re.match(r"\w*", str(e)).group()
    raise bad(field if field in _SAMPLING_FIELDS else None, str(e)) from None


def _logprobs(body: dict, chat: bool) -> int | None:
  """The alternatives per token of the log-probabilities asked for, or None: completions ``logprobs: N``;
  chat ``logprobs: true`` with ``top_logprobs: N`` (0 when absent)."""
  want = body.get("logprobs")
  if not chat:
    if want is None or want is False:
      return None
    if not _is_int(want) or not 0 <= want <= MAX_LOGPROBS:
      raise bad("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the alternatives per token), "
                            f"got {want!r}")
    return want
  if want is not None and not isinstance(want, bool):
    raise bad("logprobs", f"logprobs must be a boolean (top_logprobs gives the alternatives per token), got {want!r}")
  top = body.get("top_logprobs")
  if top is not None:
    if not want:
      raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
      raise bad("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
  return (top or 0) if want else None


def _response_format(body: dict) -> grammar.Grammar | None:
  """The request's grammar (None for text), or a 400 naming the field (``response_format.type``,
  ``response_format.json_schema.schema``, ``response_format.pattern``, ``response_format.grammar``)."""
  try:
    return grammar.Grammar.from_response_format(body.get("response_format"))
  except RequestError as e:
    raise bad(e.field, str(e)) from None


def parse(body: dict[str, Any], model: ServedModel, chat: bool, max_tokens_limit: int | None = None,
          max_n: int = 1) -> Parsed:
  """Validates a completion (``chat=False``) or chat completion body into a :class:`Parsed` request.
  ``max_tokens_limit``: the server's cap on new tokens per request (None: a slot's room); ``max_n``: on ``n``.

  Raises:
    APIError: 404 for an unknown model, else 400, naming the field.
  """
  name = body.get("model")
  if not isinstance(name, str):
    raise bad("model", "model is required: a string naming the served model (see /v1/models)")
  if name != model.name:
    raise APIError(404, f"the model {name!r} does not exist; this server serves {model.name!r}", param="model",
                   code="model_not_found")
  for field, allowed, what in _UNSUPPORTED:
    _only(body, field, allowed, what)
  structured = _response_format(body)
  for field in ("stream", "ignore_eos", "return_token_ids"):
    if not isinstance(body.get(field, False), bool):
      raise bad(field, f"{field} must be a boolean, got {body[field]!r}")
  options = body.get("stream_options")
  if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
    raise bad("stream_options", "stream_options must be an object like {'include_usage': true}")

  ids = _chat_ids(body, model) if chat else _prompt_ids(body, model)
  temperature = _number(body, "temperature", 1.0, 0.0)
  top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
  top_k = body.get("top_k", 0)
  if not _is_int(top_k) or top_k < -1:
    raise bad("top_k", f"top_k must be an integer >= 0 (0 or -1: off), got {top_k!r}")
  seed = body.get("seed")
  if seed is not None and not _is_int(seed):
    raise bad("seed", f"seed must be an integer, got {seed!r}")
  n = body.get("n", 1)
  n = 1 if n is None else n
  if not _is_int(n) or not 1 <= n <= max_n:
    raise bad("n", f"n must be an integer in [1, {max_n}] (this server's limit, specjax serve --max-n, at most its "
                       f"--slots), got {n!r}")
  engine = model.engine
  room = engine.max_len - engine.reserve - len(ids)
  limit_field = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
  max_tokens = body.get(limit_field)
  if max_tokens is None:
    max_tokens = max(room, 1) if chat else 16
    if max_tokens_limit is not None:
      max_tokens = min(max_tokens, max_tokens_limit)
  if not _is_int(max_tokens) or max_tokens < 1:
    raise bad(limit_field, f"{limit_field} must be an integer >= 1, got {max_tokens!r}")
  if max_tokens_limit is not None and max_tokens > max_tokens_limit:
    raise bad(limit_field, f"{limit_field}={max_tokens} is over this server's limit of {max_tokens_limit} new "
                           f"tokens per request (specjax serve --max-tokens)")
  logprobs = _logprobs(body, chat)
  stop_ids = _stop_ids(body, model, chat)
  compiled = None
  if structured is not None:
    try:
      compiled = grammar.compile_grammar(structured, model.tokenizer, stop_ids)
    except RequestError as e:
      raise bad("ignore_eos" if e.field == "stop_ids" else e.field, str(e)) from None
  request = Request(prompt=tuple(ids), max_new_tokens=max_tokens,
                    sampling=_sampling(body, temperature, max(top_k, 0), top_p), stop_ids=stop_ids,
                    seed=secrets.randbits(32) if seed is None else seed, logprobs=logprobs, grammar=compiled)
  try:
    engine.check(request)
  except RequestError as e:
    field = {"max_new_tokens": limit_field, "prompt": "messages" if chat else "prompt",
             "logprobs": "top_logprobs" if chat else "logprobs"}.get(e.field, e.field)
    raise bad(field, str(e).replace("max_new_tokens", limit_field)) from None
  return Parsed(chat=chat, request=request, stop=_stop(body), stream=body.get("stream", False),
                include_usage=bool((options or {}).get("include_usage", False)),
                token_ids=body.get("return_token_ids", False), logprobs=logprobs, n=n)


# ------------------------------------------------------------------------------------------ responses


def usage(prompt_tokens: int, completion_tokens: int, accepted: int | None = None,
          drafted: int | None = None) -> dict[str, Any]:
  """OpenAI's usage object. With speculation counts, ``completion_tokens_details`` says how many proposed
  tokens the target accepted and rejected (OpenAI's ``accepted_prediction_tokens`` and
  ``rejected_prediction_tokens``, the fields of its predicted outputs)."""
  out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
  if drafted is not None:
    out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                        "rejected_prediction_tokens": drafted - accepted}
  return out


def speculation(request) -> dict[str, Any]:
  """A request's own speculation statistics (an extension field of the final response)."""
  rounds, drafted, accepted = request.rounds, request.drafted, request.accepted
  return {"rounds": rounds, "drafted_tokens": drafted, "accepted_tokens": accepted,
          "acceptance_rate": accepted / drafted if drafted else None,
          "mean_accepted_length": (accepted + rounds) / rounds if rounds else None}


NO_LOGPROB = -9999.0  # what OpenAI writes for a log-probability of -inf (JSON has no infinities)


class TokenStrings:
  """Each token as OpenAI's ``logprobs`` show it: its text decoded alone by the served tokenizer, and its bytes
  (cached per id).

  The bytes are the token's own where the tokenizer says them: a :class:`~specjax.tokenizer.ByteTokenizer`
  byte, a byte-level BPE token (GPT-2's byte alphabet), a byte-fallback ``<0xHH>`` piece; else the UTF-8 of
  its text. A token holding part of a character decodes alone to U+FFFD; its bytes let a client rebuild it.
  """

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._cache: dict[int, tuple[str, list[int]]] = {}
    self._byte_of = {c: b for b, c in byte_stand_ins().items()}

  def __call__(self, token: int) -> tuple[str, list[int]]:
    """``(text, bytes)`` of ``token``."""
    if token not in self._cache:
      text = self.tokenizer.decode([token])
      self._cache[token] = (text, list(self._raw(token, text)))
    return self._cache[token]

  def _raw(self, token: int, text: str) -> bytes:
    if isinstance(self.tokenizer, ByteTokenizer):
      return bytes([token]) if 0 <= token < 256 else b""  # EOS decodes to nothing
    piece = self.tokenizer.id_to_token(token) if hasattr(self.tokenizer, "id_to_token") else None
    if piece:
      fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
      raw = (bytes([int(fallback.group(1), 16)]) if fallback else
             bytes(self._byte_of[c] for c in piece) if all(c in self._byte_of for c in piece) else None)
      if raw is not None and raw.decode("utf-8", errors="replace") == text:  # the vocabulary is what we took it for
        return raw
    return text.encode("utf-8")


def _logprob(x: float) -> float:
  return float(x) if math.isfinite(x) else NO_LOGPROB


def chat_logprobs(strings: TokenStrings, entries: list[tuple]) -> dict:
  """OpenAI's chat ``logprobs`` object, ``{"content": [...]}``, for ``entries``: one ``(token, logprob, top
  ids, top logprobs)`` per token (the top lists most likely first, empty without alternatives)."""
  def item(token: int, logprob: float) -> dict:
    text, raw = strings(token)
    return {"token": text, "logprob": _logprob(logprob), "bytes": raw}

  return {"content": [{**item(token, logprob), "top_logprobs": [item(a, b) for a, b in zip(top_ids, top_lps)]}
                      for token, logprob, top_ids, top_lps in entries]}


def completion_logprobs(strings: TokenStrings, entries: list[tuple], alternatives: int,
                        offset: int = 0) -> tuple[dict, int]:
  """OpenAI's legacy completions ``logprobs`` object for ``entries`` (as :func:`chat_logprobs` takes them),
  and the text offset after them.

  ``text_offset`` counts the characters of the token strings before each token, from ``offset`` (vLLM's
  convention). ``top_logprobs`` maps each alternative's string to its log-probability, most likely first;
  alternatives that decode to the same string (bytes of one character, each U+FFFD) keep the likeliest.
  Without alternatives (``logprobs: 0``) it is None.
  """
  tokens, offsets, tops = [], [], []
  for token, _, top_ids, top_lps in entries:
    text = strings(token)[0]
    tokens.append(text)
    offsets.append(offset)
    offset += len(text)
    top: dict[str, float] = {}
    for a, b in zip(top_ids, top_lps):
      top.setdefault(strings(a)[0], _logprob(b))
    tops.append(top)
  return {"tokens": tokens, "token_logprobs": [_logprob(e[1]) for e in entries],
          "top_logprobs": tops if alternatives else None, "text_offset": offsets}, offset


def _choice(chat: bool, text: str, finish_reason: str | None, delta: bool, first: bool = False,
            token_ids: list[int] | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
  if not chat:
    choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
  elif delta:
    body = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    choice = {"index": index, "delta": body, "finish_reason": finish_reason, "logprobs": logprobs}
  else:
    choice = {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
              "logprobs": logprobs}
  if token_ids is not None:
    choice["token_ids"] = token_ids
  return choice


def response(rid: str, model: str, chat: bool, choices: list[tuple], usage_: dict, extra: dict) -> dict:
  """The whole (non-streamed) response object; ``choices``: (text, finish reason, token ids, logprobs) each."""
  return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
          "model": model, "choices": [_choice(chat, text, reason, False, token_ids=ids, logprobs=lp, index=i)
                                      for i, (text, reason, ids, lp) in enumerate(choices)],
          "usage": usage_, **extra}


def chunk(rid: str, model: str, chat: bool, text: str, finish_reason: str | None = None, first: bool = False,
          extra: dict | None = None, token_ids: list[int] | None = None, logprobs: dict | None = None,
          index: int = 0) -> dict:
  """One streamed chunk of choice ``index``: a piece of text (with the token ids and log-probabilities of the
  tokens since the previous chunk, when asked for), or the last one with the finish reason."""
  return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
          "model": model, "choices": [_choice(chat, text, finish_reason, True, first, token_ids, logprobs, index)],
          **(extra or {})}


def usage_chunk(rid: str, model: str, chat: bool, usage_: dict) -> dict:
  """The final chunk of ``stream_options.include_usage``: no choices, the usage."""
  return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
          "model": model, "choices": [], "usage": usage_}
