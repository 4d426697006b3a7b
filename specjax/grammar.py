"""Structured output: a request's ``response_format`` (a JSON schema, any JSON object, a regular expression or a
Lark grammar) as token masks along the speculative window, through llguidance (``pip install
'specjax[grammar]'``).

Exactness (``docs/guide.md``, "Structured output"): at every window position i the target's logits are
restricted to the tokens the grammar allows after the context and the proposals ``d_<i`` (the matcher is
advanced through the proposals, then rolled back), before the warp; so p_i is the target's law restricted to
the grammar, a forbidden proposal has p = 0 and is always rejected, and the residual and the bonus token are
drawn from masked p. The output then follows the law of constrained decoding without speculation, whatever q
is. The proposer's first distribution q_1 is restricted too (the matcher's state before the round is known
when proposing), which raises acceptance; later q_i are the proposer's own (their masks depend on the
proposals, which the device draws without a round trip to the host).

The round is stepped by the host (:meth:`specjax.serving.slots.SlotEngine.step`): the masks at the first
position (host), the proposals (device), the masks along the proposals (host: :func:`window_masks`), the
verification with the masks (device), and the matcher advanced by the emitted tokens (host:
:meth:`Matcher.commit`). EOS (every stop token of the request) is allowed only where the grammar accepts;
once the grammar is complete only a stop token is, so the request stops.

Errors name the field: ``response_format.type``, ``response_format.json_schema.schema``,
``response_format.pattern``, ``response_format.grammar`` (:class:`specjax.request.RequestError`, a
``ValueError``; the server answers 400 with it as ``param``).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from specjax.request import RequestError
from specjax.tokenizer import ByteTokenizer

# How JSON is laid out unless the schema's "x-guidance" object says otherwise (llguidance's options, such as
# {"whitespace_flexible": true}): one space after ':' and ',', no other whitespace. A model may otherwise spend
# its tokens on whitespace, which the grammar cannot bound.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# The ``type`` values of a response format, and the field that holds each one's grammar.
FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")


def _llguidance():
  try:
    import llguidance
  except ImportError:  # an optional dependency
    raise ImportError("structured output needs llguidance: pip install 'specjax[grammar]'") from None
  return llguidance


@dataclasses.dataclass(frozen=True)
class Grammar:
  """What a response must match, before compilation against a tokenizer.

  Attributes:
    kind: ``"json_schema"`` (``source``: the schema as JSON text), ``"json_object"`` (any JSON object),
      ``"regex"`` (a Rust-regex pattern the whole output matches) or ``"grammar"`` (a Lark grammar in
      llguidance's dialect, start rule ``start``).
    source: the schema, pattern or grammar text ("" for ``json_object``).
    field: the request field that holds ``source``, named in errors.
  """

  kind: str
  source: str
  field: str

  @classmethod
  def from_response_format(cls, fmt: Any, name: str = "response_format") -> Grammar | None:
    """The grammar of an OpenAI-style response format (None for ``{"type": "text"}`` or None):

    - ``{"type": "json_object"}``: any JSON object;
    - ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``: OpenAI's structured output;
    - ``{"type": "regex", "pattern": "..."}`` (a specjax extension): the output matches the pattern;
    - ``{"type": "grammar", "grammar": "..."}`` (a specjax extension): a Lark grammar.

    Raises:
      RequestError: naming the field (``response_format.type``, ``response_format.json_schema.schema``...).
    """
    if fmt is None:
      return None
    if isinstance(fmt, Grammar):
      return fmt
    if not isinstance(fmt, dict):
      raise RequestError(name, f"{name} must be an object such as {{'type': 'json_object'}}, got {fmt!r}")
    kind = fmt.get("type")
    if kind not in FORMATS:
      raise RequestError(f"{name}.type", f"{name}.type must be one of {', '.join(FORMATS)}, got {kind!r}")
    if kind == "text":
      return None
    if kind == "json_object":
      return cls("json_object", "", name)
    if kind == "json_schema":
      spec = fmt.get("json_schema")
      if not isinstance(spec, dict):
        raise RequestError(f"{name}.json_schema", f"{name}.json_schema must be an object like "
                                                  f"{{'name': ..., 'schema': {{...}}}}, got {spec!r}")
      schema = spec.get("schema")
      field = f"{name}.json_schema.schema"
      if not isinstance(schema, (dict, bool)):
        raise RequestError(field, f"{field} must be a JSON schema (an object), got {schema!r}")
      return cls("json_schema", json.dumps(schema), field)
    key = "pattern" if kind == "regex" else "grammar"
    source = fmt.get(key)
    if not isinstance(source, str) or not source:
      raise RequestError(f"{name}.{key}", f"{name}.{key} must be a non-empty string, got {source!r}")
    return cls(kind, source, f"{name}.{key}")

  def text(self) -> str:
    """The grammar in llguidance's serialised form; RequestError naming ``field`` where it cannot be built."""
    ll = _llguidance()
    try:
      if self.kind in ("json_object", "json_schema"):
        schema = self.source if self.kind == "json_schema" else json.dumps({"type": "object"})
        return ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
      if self.kind == "regex":
        return ll.LLMatcher.grammar_from_regex(self.source)
      return ll.LLMatcher.grammar_from_lark(self.source)
    except Exception as e:  # llguidance raises ValueError/RuntimeError for text it cannot read
      raise RequestError(self.field, f"{self.field}: {e}") from None


class _Tokenizers:
  """llguidance's view of a specjax tokenizer with a request's stop tokens as its EOS tokens, built once per
  (tokenizer, stop tokens): building one reads the whole vocabulary (about a second for 49 k tokens)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._cache: dict[tuple, Any] = {}

  def get(self, tokenizer, stop_ids: tuple[int, ...]):
    key = (id(tokenizer), stop_ids)
    with self._lock:
      if key not in self._cache:
        self._cache[key] = (tokenizer, ll_tokenizer(tokenizer, stop_ids))  # the tokenizer kept alive: id stays
      return self._cache[key][1]


TOKENIZERS = _Tokenizers()


def ll_tokenizer(tokenizer, stop_ids: Sequence[int]):
  """An ``llguidance.LLTokenizer`` of a specjax tokenizer (:class:`~specjax.tokenizer.HFTokenizer`,
  :class:`~specjax.tokenizer.BPETokenizer` or :class:`~specjax.tokenizer.ByteTokenizer`) whose EOS tokens are
  ``stop_ids``."""
  ll = _llguidance()
  stops = list(stop_ids)
  inner = getattr(tokenizer, "tokenizer", None)
  if inner is not None and hasattr(inner, "to_str"):  # a `tokenizers` tokenizer: llguidance reads its JSON
    return ll.LLTokenizer(inner.to_str(), n_vocab=tokenizer.vocab_size, eos_token=stops)

  if hasattr(tokenizer, "token_bytes"):  # any tokenizer that lists its tokens' bytes (None: a special token)
    pieces = list(tokenizer.token_bytes())
  elif isinstance(tokenizer, ByteTokenizer):
    pieces = [bytes([i]) for i in range(256)] + [None] * (tokenizer.vocab_size - 256)
  else:
    raise RequestError("tokenizer", f"structured output needs a `tokenizers` tokenizer, a ByteTokenizer or one with "
                                    f"token_bytes(), got {type(tokenizer).__name__}")

  class Wrapped:  # what llguidance.TokenizerWrapper reads
    eos_token_id = stops[0]
    bos_token_id = None
    tokens = [b"<special>" if p is None else p for p in pieces]
    special_token_ids = [i for i, p in enumerate(pieces) if p is None]

    def __call__(self, s):
      return tokenizer.encode(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s)

  return ll.LLTokenizer(ll.TokenizerWrapper(Wrapped()), n_vocab=tokenizer.vocab_size, eos_token=stops)


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
  """A grammar checked against a tokenizer and a request's stop tokens; :meth:`matcher` starts a response."""

  grammar: Grammar
  text: str
  tokenizer: Any  # llguidance.LLTokenizer
  vocab_size: int
  stop_ids: frozenset[int]

  def matcher(self) -> Matcher:
    return Matcher(self)


def compile_grammar(grammar: Grammar, tokenizer, stop_ids: Sequence[int]) -> CompiledGrammar:
  """``grammar`` compiled for ``tokenizer`` with ``stop_ids`` as its end tokens.

  Raises:
    RequestError: naming ``grammar.field`` for an invalid schema, pattern or grammar, or one that no output
      satisfies; naming ``stop_ids`` when there is no stop token (a grammar's end is a stop token).
  """
  if not stop_ids:
    raise RequestError("stop_ids", "structured output needs a stop token (EOS) to end a response where the grammar "
                                   "is complete: the tokenizer has none, or ignore_eos is set")
  ll = _llguidance()
  text = grammar.text()
  lltok = TOKENIZERS.get(tokenizer, tuple(stop_ids))
  error = ll.LLMatcher.validate_grammar(text, lltok)
  if error:
    raise RequestError(grammar.field, f"{grammar.field}: {error.strip()}")
  compiled = CompiledGrammar(grammar, text, lltok, tokenizer.vocab_size, frozenset(int(t) for t in stop_ids))
  probe = compiled.matcher()
  allowed = probe.allowed()  # llguidance finds a dead grammar here: it stops at once, not accepting
  if not allowed.any() or (probe.m.is_stopped() and not probe.m.is_accepting()):
    raise RequestError(grammar.field, f"{grammar.field}: no output satisfies it with this vocabulary of "
                                      f"{tokenizer.vocab_size} tokens (the grammar is unsatisfiable)")
  return compiled


def mask_words(vocab_size: int) -> int:
  """int32 words of one token bitmask (bit ``v % 32`` of word ``v // 32``: token v allowed)."""
  return (vocab_size + 31) // 32


class Matcher:
  """One response's position in its grammar (llguidance's ``LLMatcher``)."""

  def __init__(self, compiled: CompiledGrammar):
    self.compiled = compiled
    self.m = _llguidance().LLMatcher(compiled.tokenizer, compiled.text, log_level=0)

  def error(self) -> str:
    return self.m.get_error() if self.m.is_error() else ""

  def allowed(self) -> np.ndarray:
    """``[V] bool`` the tokens allowed next."""
    bits = np.full((1, mask_words(self.compiled.vocab_size)), -1, np.int32)
    self.m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.compiled.vocab_size].astype(bool)

  def commit(self, tokens: Sequence[int]) -> None:
    """Advances by a round's emitted tokens (after :func:`window_masks` rolled the proposals back)."""
    for t in tokens:
      if int(t) in self.compiled.stop_ids and (self.m.is_stopped() or self.m.is_accepting()):
        return  # the response ends here (llguidance may refuse EOS once it has stopped: nothing can follow)
      if not self.m.consume_token(int(t)):
        raise RuntimeError(f"the grammar refused an emitted token (a bug: masks should forbid it): {self.error()}")

  @property
  def done(self) -> bool:
    return self.m.is_stopped()


def first_masks(matchers: dict[int, Matcher], width: int, vocab_size: int) -> np.ndarray:
  """``[W, words] int32`` bitmasks of the next token for each row: row r's matcher's, all ones for rows
  without one (:func:`mask_words`)."""
  bits = np.full((width, mask_words(vocab_size)), -1, np.int32)
  for r, m in matchers.items():
    m.m.unsafe_compute_mask_ptr(bits[r].ctypes.data, bits.shape[1] * 4)
  return bits


def window_masks(matchers: dict[int, Matcher], drafts: np.ndarray, vocab_size: int,
                 first: np.ndarray | None = None) -> np.ndarray:
  """``[W, k+1, words] int32``: for row r with a matcher, the bitmask at window position i is the grammar's
  after the row's context and ``drafts[r, :i]`` (the matcher advanced through the proposals, then rolled back
  to where it was); all ones past a proposal the grammar forbids (never read: that proposal is rejected) and
  for rows without a matcher. ``first`` (``[W, words]``, :func:`first_masks`): position 0, already computed.

  Row by row, one mask at a time: llguidance's own call for draft tokens (on its thread pool) measured no
  faster on this 2-core machine (``benchmarks/structured.py``), and the loop stops before a stop token
  instead of consuming it (llguidance's rollback over a consumed EOS did not restore the state)."""
  width, k = drafts.shape
  words = mask_words(vocab_size)
  bits = np.full((width, k + 1, words), -1, np.int32)
  if first is not None:
    bits[:, 0] = first
  for r, matcher in matchers.items():
    m = matcher.m
    if first is None:
      m.unsafe_compute_mask_ptr(bits[r, 0].ctypes.data, words * 4)
    advanced = 0
    for i, token in enumerate(drafts[r]):
      token = int(token)
      if not (bits[r, i, token // 32] >> (token % 32)) & 1 or token in matcher.compiled.stop_ids:
        break  # forbidden (checked first: a refused token leaves the matcher in its error state), or an allowed
        # stop token: the response ends there (not consumed: llguidance's rollback over EOS is not exact)
      if not m.consume_token(token):
        raise RuntimeError(f"the grammar refused a token its mask allows: {matcher.error()}")
      advanced += 1
      m.unsafe_compute_mask_ptr(bits[r, i + 1].ctypes.data, words * 4)
    m.rollback(advanced)
  return bits
