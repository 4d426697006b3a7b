"""Structured output: a request's ``response_format`` (a JSON schema, any JSON object, a regular expression or a
Lark grammar) as token masks along the speculative window, through llguidance (``pip install
'specjax[grammar]'``).

Exactness (``docs/guide.md``, "Structured output"): at every window position i the target's logits are
restricted to the tokens the grammar allows after the context and the proposals ``d_<i`` (the matcher is
advanced through the proposals, then rolled back), before the warp; so p_i is the target's law restricted to
the grammar, a forbidden proposal has p = 0 and is always rejected, and the residual and the bonus token are
drawn from masked p. The output then follows the law of constrained decoding without speculation, whatever q
is. The proposer's distributions are restricted the same way at every position, before its warp: q_1 by the
mask before the round, q_i by the mask after ``d_<i``, which the device asks of the host after each draw
(:class:`GrammarSteps`, a callback into the round's :class:`Rollout`). Acceptance gets exactly those masked
q_i, the laws the proposals were drawn from, so the rule stays exact, and a sampled proposer never proposes
what the grammar forbids (a deterministic proposer's proposals are its own; a forbidden one is rejected).

The round is stepped by the host (:meth:`specjax.serving.slots.SlotEngine.step`): the masks at the first
position (host), the proposals (device, with the rollout's masks along them), the masks of the whole window
(host: :func:`window_masks`, reusing the rollout's), the verification with the masks (device), and the
matcher advanced by the emitted tokens (host: :meth:`Matcher.commit`). Masking q costs no extra mask (the
window needs the same k + 1 masks per row) but the device waits on the host once per proposal after the
first. EOS (every stop token of the request) is allowed only where the grammar accepts;
once the grammar is complete only a stop token is, so the request stops.

Errors name the field: ``response_format.type``, ``response_format.json_schema.schema``,
``response_format.pattern``, ``response_format.grammar`` (:class:`specjax.request.RequestError`, a
``ValueError``; the server answers 400 with it as ``param``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine import unpack_mask
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
                 first: np.ndarray | None = None, rollout: Rollout | None = None) -> np.ndarray:
  """``[W, k+1, words] int32``: for row r with a matcher, the bitmask at window position i is the grammar's
  after the row's context and ``drafts[r, :i]`` (the matcher advanced through the proposals, then rolled back
  to where it was); all ones past a proposal the grammar forbids (never read: that proposal is rejected) and
  past a proposed stop token (the response ends there), and for rows without a matcher. ``first``
  (``[W, words]``, :func:`first_masks`): position 0, already computed. ``rollout``: the round's
  :class:`Rollout`, whose masks along the proposals (computed while the device drew them) are reused; None:
  a rollout of its own, closed before returning (the matchers back where they were)."""
  if rollout is not None:
    return rollout.window(drafts)
  with Rollout(matchers, drafts.shape[0], vocab_size, first) as own:
    return own.window(drafts)


class Rollout:
  """The host's side of one round's proposals under the rows' grammars: the mask of every proposal prefix the
  device asks for (:class:`GrammarSteps`, while the proposer draws), then of the whole window
  (:meth:`window`), each row's matcher moved along the prefix asked for and its masks kept by prefix; on
  :meth:`close` every matcher is rolled back to where the round found it.

  Row by row, one mask at a time: llguidance's own call for draft tokens (on its thread pool) measured no
  faster on this 2-core machine (``benchmarks/structured.py``). A prefix holding a forbidden token or a stop
  token gets no mask (all ones: what follows is never emitted); stop tokens are never consumed (llguidance's
  rollback over a consumed EOS did not restore the state). Thread-safe: the device's callbacks run on the
  runtime's threads.

  Use as a context manager: ``with Rollout(...) as rollout:`` registers it (``rollout.handle``, the operand
  that names it to the device's callbacks) and closes it on exit.
  """

  def __init__(self, matchers: dict[int, Matcher], width: int, vocab_size: int, first: np.ndarray | None = None):
    self.matchers, self.width, self.vocab_size = matchers, width, vocab_size
    self.words = mask_words(vocab_size)
    self.handle: int | None = None
    self._consumed: dict[int, list[int]] = {r: [] for r in matchers}  # what each matcher has consumed this round
    self._masks: dict[tuple[int, tuple[int, ...]], np.ndarray | None] = {}  # (row, prefix) -> bits, None: all
    self._lock = threading.Lock()
    if first is not None:
      for r in matchers:
        self._masks[r, ()] = first[r]

  def __enter__(self) -> Rollout:
    with _ROLLOUTS_LOCK:
      self.handle = next(_HANDLES)
      _ROLLOUTS[self.handle] = self
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Every matcher rolled back to where the round found it; the handle is no longer valid."""
    with _ROLLOUTS_LOCK:
      _ROLLOUTS.pop(self.handle, None)
    with self._lock:
      for r, consumed in self._consumed.items():
        if consumed:
          self.matchers[r].m.rollback(len(consumed))
          consumed.clear()

  def _mask(self, r: int, prefix: tuple[int, ...]) -> np.ndarray | None:
    """Row r's bits after ``prefix`` (kept; computed with its matcher moved there), None where the prefix
    holds a forbidden or stop token."""
    key = (r, prefix)
    if key in self._masks:
      return self._masks[key]
    matcher = self.matchers[r]
    if prefix:
      before = self._mask(r, prefix[:-1])
      token = prefix[-1]
      if before is None or not (before[token // 32] >> (token % 32)) & 1 or token in matcher.compiled.stop_ids:
        self._masks[key] = None  # checked first: a refused token leaves the matcher in its error state
        return None
    consumed = self._consumed[r]
    common = 0
    while common < min(len(consumed), len(prefix)) and consumed[common] == prefix[common]:
      common += 1
    if len(consumed) > common:
      matcher.m.rollback(len(consumed) - common)
      del consumed[common:]
    for token in prefix[common:]:
      if not matcher.m.consume_token(token):
        raise RuntimeError(f"the grammar refused a token its mask allows: {matcher.error()}")
      consumed.append(token)
    bits = np.full((self.words,), -1, np.int32)
    matcher.m.unsafe_compute_mask_ptr(bits.ctypes.data, self.words * 4)
    self._masks[key] = bits
    return bits

  def masks(self, prefixes: np.ndarray) -> np.ndarray:
    """``[W, words] int32`` the masks after ``prefixes [W, i]`` (each row's proposals so far), all ones for
    rows without a matcher and past a forbidden or stop token."""
    bits = np.full((self.width, self.words), -1, np.int32)
    with self._lock:
      for r in self.matchers:
        mask = self._mask(r, tuple(int(t) for t in prefixes[r]))
        if mask is not None:
          bits[r] = mask
    return bits

  def window(self, drafts: np.ndarray) -> np.ndarray:
    """``[W, k+1, words] int32`` the masks after ``drafts[:, :i]`` for i = 0..k (see :func:`window_masks`)."""
    width, k = drafts.shape
    bits = np.full((width, k + 1, self.words), -1, np.int32)
    with self._lock:
      for r in self.matchers:
        row = tuple(int(t) for t in drafts[r])
        for i in range(k + 1):
          mask = self._mask(r, row[:i])
          if mask is None:
            break
          bits[r, i] = mask
    return bits


_ROLLOUTS: dict[int, Rollout] = {}  # the open rounds, by handle
_ROLLOUTS_LOCK = threading.Lock()
_HANDLES = itertools.count(1)


def _device_masks(handle: np.ndarray, drawn: np.ndarray, count: np.ndarray) -> np.ndarray:
  """The host callback of :class:`GrammarSteps`: the masks after the first ``count`` proposals ``drawn``."""
  with _ROLLOUTS_LOCK:
    rollout = _ROLLOUTS[int(handle)]
  return rollout.masks(np.asarray(drawn)[:, :int(count)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarSteps:
  """Inside a proposer's rollout (:class:`specjax.sampling.Sampler`'s ``grammar``): after each draw, the
  grammar's mask of the next position, asked of the host's :class:`Rollout` by a callback
  (``jax.pure_callback``: a pure function of the round's handle and the proposals so far; the rollout keeps
  its masks by prefix, so a repeated or reordered call answers the same). So q_i is the proposer's law
  restricted to what the grammar allows after ``d_<i``, exactly the law d_i is drawn from, and a proposal
  the grammar forbids is never drawn.

  Why a callback rather than one device call per position: the proposers' rollouts stay as they are (one
  compiled program, the draft model's scan, the chain heads' depths), every sampled proposer is masked
  through the one :meth:`~specjax.sampling.Sampler.push` it already calls, and the device waits for the
  host's mask at each position either way (a per-position call adds a dispatch and a transfer each).

  Attributes:
    handle: ``[] int32`` the round's :class:`Rollout`. drawn: ``[B, k] int32`` the proposals so far.
    count: ``[] int32`` how many. vocab_size: static.
  """

  handle: jax.Array
  drawn: jax.Array
  count: jax.Array
  vocab_size: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def start(cls, handle: jax.Array, batch: int, k: int, vocab_size: int) -> GrammarSteps:
    return cls(jnp.asarray(handle, jnp.int32), jnp.zeros((batch, k), jnp.int32), jnp.zeros((), jnp.int32),
               vocab_size)

  def advance(self, tokens: jax.Array) -> tuple[GrammarSteps, jax.Array]:
    """After each row drew ``tokens [B]``: the steps that follow and ``[B, V] bool`` the tokens the grammar
    allows next."""
    drawn = self.drawn.at[:, self.count].set(tokens.astype(jnp.int32))
    count = self.count + 1
    batch = drawn.shape[0]
    bits = jax.pure_callback(_device_masks, jax.ShapeDtypeStruct((batch, mask_words(self.vocab_size)), jnp.int32),
                             self.handle, drawn, count)
    return dataclasses.replace(self, drawn=drawn, count=count), unpack_mask(bits, self.vocab_size)  # [B, V]
