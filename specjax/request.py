"""One validated request type, shared by :func:`specjax.generate`, :func:`specjax.stream` and the server.

A :class:`Request` is what one row is asked to do: its prompt tokens, how many tokens, how to sample, which
tokens stop it, its seed and whether to return log-probabilities. :meth:`Request.check` raises a
:class:`RequestError` naming the offending field (a ``ValueError``: ``generate`` and ``stream`` let it
propagate, the CLI exits 2 with it, the server answers 400 with the field as OpenAI's ``param``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from specjax.config import GREEDY, MAX_LOGPROBS, MAX_STOP_TOKENS, SamplingConfig, check_int


class RequestError(ValueError):
  """A request that cannot run; ``field`` names the offending request field."""

  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field = field


@dataclasses.dataclass(frozen=True)
class Request:
  """What one row is asked to do.

  Attributes:
    prompt: token ids, at least one.
    max_new_tokens: tokens to generate at most (>= 1).
    sampling: how to draw (:class:`~specjax.config.SamplingConfig`; temperature 0: greedy).
    stop_ids: up to ``MAX_STOP_TOKENS`` token ids that end the row (included in its output).
    seed: the row's PRNG seed (a server's request draws from its own key alone).
    logprobs: None, or N in ``[0, MAX_LOGPROBS]``: return each emitted token's log-probability under the
      target's own distribution and the N most likely alternatives.
    grammar: None, or a :class:`specjax.grammar.CompiledGrammar` the output must match (structured output;
      compiled with the request's stop tokens).
  """

  prompt: tuple[int, ...]
  max_new_tokens: int
  sampling: SamplingConfig = GREEDY
  stop_ids: tuple[int, ...] = ()
  seed: int = 0
  logprobs: int | None = None
  grammar: object | None = None

  def check(self, vocab_size: int, room: int, *, prompt_name: str = "the prompt", stop_name: str = "stop_ids",
            room_name: str | None = None) -> None:
    """Raises :class:`RequestError` (naming the field) unless the request is well formed for a vocabulary
    of ``vocab_size`` and fits ``room`` positions (prompt + max new tokens). The names say what the caller
    calls the prompt (``generate``: ``prompts[3]``), the stop tokens (``eos_id``) and the room's bound."""
    def fail(field: str, message: str):
      raise RequestError(field, message)

    if len(self.prompt) == 0:
      fail("prompt", f"{prompt_name} is empty: every prompt needs at least 1 token")
    bad = [t for t in self.prompt if isinstance(t, bool) or not isinstance(t, (int, np.integer))
           or not 0 <= t < vocab_size]
    if bad:
      fail("prompt", f"{prompt_name} holds token id {bad[0]!r} outside the vocabulary [0, {vocab_size})")
    for field, check in (("max_new_tokens", lambda: check_int("max_new_tokens", self.max_new_tokens, 1)),
                         ("seed", lambda: check_int("seed", self.seed)),
                         ("logprobs", lambda: self.logprobs is None or check_int("logprobs", self.logprobs, 0,
                                                                                  MAX_LOGPROBS))):
      try:
        check()
      except ValueError as e:
        fail(field, str(e))
    if not isinstance(self.sampling, SamplingConfig):
      fail("sampling", f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
    try:
      self.sampling.check_vocab(vocab_size)
    except ValueError as e:
      fail("logit_bias", str(e))
    if len(self.stop_ids) > MAX_STOP_TOKENS:
      fail("stop_ids", f"{stop_name} holds {len(self.stop_ids)} tokens; at most {MAX_STOP_TOKENS} stop tokens are "
                       "supported")
    bad = [t for t in self.stop_ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
           or not 0 <= t < vocab_size]
    if bad:
      fail("stop_ids", f"{stop_name} must be token ids in [0, {vocab_size}), got {bad[0]!r} (outside the vocabulary)")
    if len(self.prompt) + self.max_new_tokens > room:
      fail("max_new_tokens" if len(self.prompt) < room else "prompt",
           f"prompt length ({len(self.prompt)}) + max_new_tokens ({self.max_new_tokens}) = "
           f"{len(self.prompt) + self.max_new_tokens} exceeds {room_name or f'the {room} positions available'}")


def token_rows(prompts, tokenizer=None) -> list[list[int]]:
  """Prompts as token-id rows: a text (with ``tokenizer``), a list of texts or of token-id lists, a list of
  ids (one row), or a ``[B, P]`` array. Raises ValueError naming what is wrong."""
  if isinstance(prompts, str):
    prompts = [prompts]
  if isinstance(prompts, (np.ndarray, jax.Array)):
    arr = np.asarray(prompts)
    if arr.ndim == 1:
      arr = arr[None]
    if arr.ndim != 2:
      raise ValueError(f"prompts array must be [B, P] token ids, got shape {arr.shape}")
    return [list(map(int, row)) for row in arr]
  if not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
  if all(isinstance(p, (int, np.integer)) for p in prompts):
    prompts = [prompts]
  rows = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if tokenizer is None:
        raise ValueError(f"prompts[{i}] is text: pass tokenizer= to encode it")
      rows.append(list(tokenizer.encode(p)))
    else:
      rows.append([int(t) for t in p])
  return rows


def stop_ids(eos_id, tokenizer=None) -> tuple[int, ...]:
  """The stop tokens of a call: ``eos_id`` (one id or several), else the tokenizer's ``eos_id`` if it has
  one, else none. Checked against the vocabulary by :meth:`Request.check`."""
  if eos_id is None and tokenizer is not None:
    eos_id = getattr(tokenizer, "eos_id", None)
  if eos_id is None:
    return ()
  if isinstance(eos_id, (int, np.integer)) and not isinstance(eos_id, bool):
    return (int(eos_id),)
  if not isinstance(eos_id, Sequence) or isinstance(eos_id, str):
    raise RequestError("eos_id", f"eos_id must be a token id or a list of them, got {eos_id!r}")
  return tuple(eos_id)
