"""Suffix decoding (Oliaro et al. 2024; ArcticInference): proposals from text already seen.

``ALGORITHMS.md``, "Suffix decoding". Each round, for every row:

1. **Match.** The row's context tail ``c`` (its newest ``max_match`` tokens, ``last`` the newest) is matched
   against two sources: the row's own context (prompt and output so far) and a global :class:`SuffixStore`
   of earlier texts. ``m`` is the longest suffix of ``c`` that occurs in the source; the occurrences are the
   positions where it ends (at most ``max_occurrences`` of them, the most recent first).
2. **Walk.** The continuation after the occurrences is read as a count model: the next token is the most
   frequent one among the occurrences' next tokens (ties: the most recent occurrence's), with probability
   its count over all of them; the walk goes on among the occurrences that agree with it. A token is
   proposed while the path probability stays ``>= min_token_prob`` and the proposal stays within the
   budget ``min(k, floor(alpha * m + beta))``: long matches earn long proposals.
3. **Choose.** Each source's candidate is scored by the sum of its path probabilities (the expected number
   of accepted tokens under the count model); the row takes the higher-scoring candidate.

Everything is static-shaped and runs inside the jitted loop: the sources are token arrays with ``-1`` for
nothing (document separators, free store space, positions past a row's length); match lengths are computed
against every position at once; the occurrences are gathered with ``top_k`` on their positions; counts
compare the ``max_occurrences`` continuations with each other (no vocabulary-sized scatter in a chain). A
row proposes a varying number of tokens (:attr:`~specjax.proposers.base.Proposal.limit`, masked in
acceptance). The proposals are deterministic (``q`` is one-hot), so the one acceptance rule keeps the output
exact at any temperature. With a token tree, each node's children are the most frequent continuations of
its path (the counts are the proposer's logits; :func:`specjax.tree.grow` builds the tree).

The store is searched through a sorted index (:class:`StoreTokens`: binary searches, about 3 log2(capacity)
steps of ``max_match`` comparisons per row), so a round's cost does not grow with the store; the row's own
context (at most ``max_len`` tokens) is matched against every position.

Memory, stated: the store is ``capacity * (2 + max_match)`` int32 on the device (tokens, sort order and keys:
4.5 MiB for the default 65 536 tokens and ``max_match`` 16), rebuilt on the host in O(capacity * max_match)
when documents are added; a row's own context is the ``[B, max_len + 1]`` history the n-gram proposer keeps
too; a round's working set is ``[B, max_len]`` during the own match and ``[B, max_occurrences, k]`` tokens
after it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, ClassVar, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.cache import write_rows
from specjax.config import MAX_K, check_int, check_number
from specjax.proposers.base import Context, Features, Proposal, Proposer, TreeProposal, Verified
from specjax.sharding import TOKENS
from specjax.tree import frontier_sizes, grow

MAX_MATCH = 64  # the longest context tail a round matches
MAX_OCCURRENCES = 256  # the most occurrences a round's counts read
DEFAULT_CAPACITY = 1 << 16
NONE = -1  # "no token": a separator, free store space, a position past the context
_CUT = -3  # in the store's keys: before the document's start (matches no context token)
_EMPTY = -4  # in the store's keys: a position that holds no token (sorts first, matches nothing)


# ------------------------------------------------------------------------------------------ the store


class StoreTokens(nnx.Module):
  """The device side of a :class:`SuffixStore`, as variables (the jitted programs take the store as an
  argument: new contents, same shapes, no recompilation):

  - ``tokens [C]``: the buffer;
  - ``keys [C, M]``: at each position j, the text read backwards from it, ``tokens[j], tokens[j - 1], ...``,
    cut at the document's start (``-3`` from there on; ``-4`` throughout for a position that holds no token);
  - ``order [C]``: the positions sorted by their keys, so that the positions whose backward text starts with
    the context's tail (the occurrences of a match) form one contiguous range, found by binary search.
  """

  def __init__(self, capacity: int, depth: int):
    self.tokens = nnx.Variable(jnp.full((capacity,), NONE, jnp.int32))
    self.order = nnx.Variable(jnp.arange(capacity, dtype=jnp.int32))
    self.keys = nnx.Variable(jnp.full((capacity, depth), _EMPTY, jnp.int32))


class SuffixStore:
  """A global store of earlier texts for :class:`Suffix`: documents of token ids, separated by ``-1``, in a
  buffer of ``capacity`` tokens; when a new document does not fit, the oldest documents are evicted first
  (FIFO). A document longer than the buffer keeps its newest ``capacity - 1`` tokens.

  Build one from token arrays, texts or earlier outputs and keep it across calls (``add`` after each call
  to let later requests reuse earlier answers); the server keeps one for all of its requests.

  Attributes:
    capacity: the buffer's length in tokens (static: stores of one capacity share compiled programs).
    max_match: the longest match its index serves (a :class:`Suffix` with a longer ``max_match`` is refused).
    vocab_size: the vocabulary its token ids belong to (a :class:`Suffix` refuses a store of another).
    module: the :class:`StoreTokens` the jitted programs read.
  """

  DEFAULT_CAPACITY: ClassVar[int] = DEFAULT_CAPACITY

  def __init__(self, vocab_size: int, capacity: int = DEFAULT_CAPACITY, max_match: int = 16):
    self.vocab_size = check_int("SuffixStore.vocab_size", vocab_size, 1)
    self.capacity = check_int("SuffixStore.capacity", capacity, 2, 1 << 24)
    self.max_match = check_int("SuffixStore.max_match", max_match, 1, MAX_MATCH)
    self._host = np.full((self.capacity,), NONE, np.int32)
    self._docs: collections.deque[int] = collections.deque()  # document lengths (with separator), oldest first
    self._used = 0
    self.module = StoreTokens(self.capacity, self.max_match)

  def _publish(self) -> None:
    """The device copy of the buffer and its index (``StoreTokens``): O(capacity * max_match) host work, once
    per ``extend``."""
    tokens, depth = self._host, self.max_match
    keys = np.full((self.capacity, depth), _CUT, np.int32)
    alive = np.ones((self.capacity,), bool)
    for i in range(depth):  # keys[j, i] = tokens[j - i] until the backward walk leaves the document
      back = np.full((self.capacity,), NONE, np.int32)
      if i < self.capacity:
        back[i:] = tokens[:self.capacity - i]
      alive &= back >= 0
      keys[:, i] = np.where(alive, back, _CUT)
    keys[tokens < 0] = _EMPTY
    order = np.lexsort(tuple(keys[:, i] for i in reversed(range(depth)))).astype(np.int32)
    self.module.tokens.set_value(jnp.asarray(tokens))
    self.module.keys.set_value(jnp.asarray(keys[order]))
    self.module.order.set_value(jnp.asarray(order))

  @classmethod
  def from_tokens(cls, documents: Iterable[Sequence[int]], vocab_size: int, capacity: int = DEFAULT_CAPACITY,
                  max_match: int = 16) -> SuffixStore:
    store = cls(vocab_size, capacity, max_match)
    store.extend(documents)
    return store

  @classmethod
  def from_texts(cls, texts: Iterable[str], tokenizer, capacity: int = DEFAULT_CAPACITY,
                 vocab_size: int | None = None, max_match: int = 16) -> SuffixStore:
    """A store of ``texts`` encoded with ``tokenizer`` (anything with ``encode(text) -> ids`` and a
    ``vocab_size``, such as the tokenizer ``specjax.load`` returns)."""
    vocab = vocab_size if vocab_size is not None else getattr(tokenizer, "vocab_size", None)
    if vocab is None:
      raise ValueError("SuffixStore.from_texts: the tokenizer has no vocab_size; pass vocab_size=")
    return cls.from_tokens((tokenizer.encode(t) for t in texts), vocab, capacity, max_match)

  def __len__(self) -> int:
    """Tokens held, separators included."""
    return self._used

  @property
  def documents(self) -> int:
    return len(self._docs)

  def tokens(self) -> np.ndarray:
    """A copy of the buffer's used part (documents separated by -1), oldest first."""
    return self._host[:self._used].copy()

  def add(self, tokens: Sequence[int]) -> None:
    """Appends one document (token ids; an output's ``-1`` padding is dropped)."""
    self.extend([tokens])

  def extend(self, documents: Iterable[Sequence[int]]) -> None:
    """Appends documents, evicting the oldest ones as needed; the device copy is updated once."""
    changed = False
    for doc in documents:
      ids = np.asarray(doc).reshape(-1)
      if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"SuffixStore documents must be token ids (integers), got dtype {ids.dtype}")
      ids = ids[ids >= 0].astype(np.int64) if ids.size else ids.astype(np.int64)  # -1: an output's padding
      if ids.size and ids.max() >= self.vocab_size:
        raise ValueError(f"SuffixStore: token id {int(ids.max())} is outside the store's vocabulary "
                         f"[0, {self.vocab_size}) (the store was built for vocab_size={self.vocab_size})")
      if not ids.size:
        continue
      ids = ids[-(self.capacity - 1):]
      need = ids.size + 1
      evict = 0
      while self._used - evict + need > self.capacity:
        evict += self._docs.popleft()
      if evict:
        self._host[:self._used - evict] = self._host[evict:self._used]
        self._used -= evict
      self._host[self._used:self._used + ids.size] = ids
      self._host[self._used + ids.size] = NONE
      self._used += need
      self._host[self._used:] = NONE
      self._docs.append(need)
      changed = True
    if changed:
      self._publish()

  def clear(self) -> None:
    self._host[:] = NONE
    self._docs.clear()
    self._used = 0
    self._publish()


# ------------------------------------------------------------------------------------- matching (pure)


def _tail(history: jax.Array, newest: jax.Array, max_match: int) -> jax.Array:
  """``[B, max_match]`` the context read backwards from ``newest``; ``-2`` before the row's start (it
  matches nothing, not even a separator)."""
  back = newest[:, None] - jnp.arange(max_match)[None, :]
  return jnp.where(back >= 0, jnp.take_along_axis(history, jnp.maximum(back, 0), axis=1), -2)


def match_lengths(corpus: jax.Array, tail: jax.Array, ends_ok: jax.Array) -> jax.Array:
  """``[B, W] int32``: at each corpus position j, how many tokens of ``tail`` (read backwards, ``tail[:, 0]``
  the newest) equal ``corpus[.., j], corpus[.., j - 1], ...``; 0 where ``ends_ok`` is False.

  Args:
    corpus: ``[B, W]`` or ``[1, W]`` (shared by the rows) int32, ``-1`` for no token.
    tail: ``[B, M]`` int32.
    ends_ok: ``[B, W]`` or ``[1, W]`` bool: where an occurrence may end.
  """
  width = corpus.shape[1]
  run = ends_ok
  length = jnp.zeros((tail.shape[0], width), jnp.int32)
  for i in range(tail.shape[1]):
    shifted = jnp.pad(corpus, ((0, 0), (i, 0)), constant_values=NONE)[:, :width]  # corpus[j - i]
    run = run & (shifted == tail[:, i:i + 1])
    length = length + run
  return length


def occurrences(corpus: jax.Array, tail: jax.Array, ends_ok: jax.Array, depth: int, occurrences_max: int
                ) -> tuple[jax.Array, jax.Array]:
  """The longest match's occurrences and what follows each.

  Returns:
    ``m [B] int32`` the longest match length (0: none), and ``ahead [B, R, depth] int32``: the ``depth``
    tokens after each of the ``R = occurrences_max`` most recent occurrences, ``-1`` past a separator, past
    the corpus, or for missing occurrences.
  """
  lengths = match_lengths(corpus, tail, ends_ok)  # [B, W]
  m = jnp.max(lengths, axis=1)  # [B]
  width = corpus.shape[1]
  pos = jnp.arange(width, dtype=jnp.int32)[None, :]
  hit = (lengths == m[:, None]) & (m[:, None] > 0)
  r = min(occurrences_max, width)
  key, ends = jax.lax.top_k(jnp.where(hit, pos, -1), r)  # [B, R] most recent first
  found = key >= 0
  index = ends[:, :, None] + 1 + jnp.arange(depth)[None, None, :]  # [B, R, depth]
  flat = jnp.broadcast_to(corpus, (tail.shape[0], width))
  ahead = jnp.take_along_axis(flat, jnp.minimum(index, width - 1).reshape(tail.shape[0], -1), axis=1)
  ahead = jnp.where(found[:, :, None] & (index < width), ahead.reshape(index.shape), NONE)
  ahead = jnp.where(jnp.cumprod(ahead >= 0, axis=2).astype(bool), ahead, NONE)  # a separator ends the text
  return m, ahead


def _lcp(a: jax.Array, b: jax.Array, upto: jax.Array | int) -> jax.Array:
  """``[B]`` the length of the common prefix of ``a`` and ``b`` (``[B, M]``), at most ``upto``."""
  differ = a != b
  first = jnp.where(jnp.any(differ, axis=1), jnp.argmax(differ, axis=1), a.shape[1])
  return jnp.minimum(first, upto)


def _bound(keys: jax.Array, tail: jax.Array, m: jax.Array, upper: bool) -> jax.Array:
  """``[B]`` the first sorted index whose key's first ``m`` tokens are ``>= tail``'s (``upper``: ``>``), by
  binary search (keys sorted lexicographically)."""
  size = keys.shape[0]
  lo, hi = jnp.zeros_like(m), jnp.full_like(m, size)

  def step(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) // 2
    key = keys[jnp.minimum(mid, size - 1)]  # [B, M]
    common = _lcp(key, tail, m)
    at = jnp.minimum(common, tail.shape[1] - 1)[:, None]
    key_less = (common < m) & (jnp.take_along_axis(key, at, 1)[:, 0] < jnp.take_along_axis(tail, at, 1)[:, 0])
    go_right = key_less | ((common >= m) & upper)  # keys[mid] < tail (or == on m tokens, for the upper bound)
    open_ = lo < hi
    return jnp.where(open_ & go_right, mid + 1, lo), jnp.where(open_ & ~go_right, mid, hi)

  lo, _ = jax.lax.fori_loop(0, int(np.ceil(np.log2(size + 1))) + 1, step, (lo, hi))
  return lo


def store_occurrences(store: StoreTokens, tail: jax.Array, depth: int, occurrences_max: int
                      ) -> tuple[jax.Array, jax.Array]:
  """:func:`occurrences` in a store through its sorted index: binary searches instead of a pass over every
  position, so a round's cost does not grow with the store's capacity. The longest match is the longer common
  prefix of the tail with the two sorted keys around its insertion point; its occurrences are the range of
  keys sharing that prefix, of which the ``occurrences_max`` first (in key order: all of them for a long
  match, a subset for a short and frequent one) are read, the most recent first."""
  tokens, order, keys = store.tokens[...], store.order[...], store.keys[...]
  width = min(tail.shape[1], keys.shape[1])
  tail, keys = tail[:, :width], keys[:, :width]
  size = keys.shape[0]
  full = jnp.full(tail.shape[:1], width, jnp.int32)
  at = _bound(keys, tail, full, upper=False)
  m = jnp.maximum(_lcp(keys[jnp.clip(at - 1, 0, size - 1)], tail, width) * (at > 0),
                  _lcp(keys[jnp.minimum(at, size - 1)], tail, width) * (at < size))
  lo, hi = _bound(keys, tail, m, upper=False), _bound(keys, tail, m, upper=True)
  r = min(occurrences_max, size)
  index = lo[:, None] + jnp.arange(r)[None, :]  # [B, R]
  found = (index < hi[:, None]) & (m[:, None] > 0)
  ends = jnp.where(found, order[jnp.minimum(index, size - 1)], -1)
  ends = -jnp.sort(-ends, axis=1)  # the most recent first (ties in the counts go to it)
  found = ends >= 0
  ahead_at = ends[:, :, None] + 1 + jnp.arange(depth)[None, None, :]
  ahead = jnp.where(found[:, :, None] & (ahead_at < size), tokens[jnp.minimum(ahead_at, size - 1)], NONE)
  ahead = jnp.where(jnp.cumprod(ahead >= 0, axis=2).astype(bool), ahead, NONE)
  return m, ahead


def _counts(tokens: jax.Array, live: jax.Array) -> jax.Array:
  """``[..., R]``: for each occurrence, how many live occurrences continue with its token (0 where not live)."""
  same = (tokens[..., :, None] == tokens[..., None, :]) & live[..., None, :]
  return jnp.sum(same, axis=-1) * live


def walk(ahead: jax.Array, budget: jax.Array, min_token_prob: float, k: int
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The chain of most frequent continuations (see the module docstring).

  Returns:
    drafts ``[B, k] int32`` (the walk's tokens; past the limit they are whatever it read, or 0), limit
    ``[B] int32`` (how many are proposals: ``<= budget``, stopped at path probability ``< min_token_prob``
    or at the end of every occurrence), and score ``[B] float32`` (the sum of the proposals' path
    probabilities).
  """
  batch, r, _ = ahead.shape
  live = ahead[:, :, 0] >= 0 if ahead.shape[2] else jnp.zeros((batch, r), bool)
  prob = jnp.ones((batch,), jnp.float32)
  going = jnp.ones((batch,), bool)
  drafts, limit, score = [], jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.float32)
  for t in range(k):
    tokens = ahead[:, :, t] if t < ahead.shape[2] else jnp.full((batch, r), NONE)
    live = live & (tokens >= 0)
    counts = _counts(tokens, live)  # [B, R]
    total = jnp.sum(live, axis=1)
    best = jnp.argmax(counts, axis=1)  # the first maximum: the most recent occurrence among ties
    token = jnp.take_along_axis(tokens, best[:, None], axis=1)[:, 0]
    prob = prob * jnp.take_along_axis(counts, best[:, None], axis=1)[:, 0] / jnp.maximum(total, 1)
    going = going & (total > 0) & (prob >= min_token_prob) & (t < budget)
    limit = limit + going
    score = score + jnp.where(going, prob, 0.0)
    drafts.append(jnp.maximum(token, 0))
    live = live & (tokens == token[:, None])
  return jnp.stack(drafts, axis=1).astype(jnp.int32), limit, score


def count_logits(ahead: jax.Array, occ: jax.Array, level: int, vocab: int) -> jax.Array:
  """``[B, F, V]`` the log-counts of the tokens at offset ``level - 1`` after each frontier node's live
  occurrences ``occ [B, F, R]`` (``-1e9`` for tokens that never follow): a count model as logits."""
  tokens = ahead[:, None, :, level - 1]  # [B, 1, R]
  live = occ & (tokens >= 0)  # [B, F, R]
  counts = _counts(jnp.broadcast_to(tokens, live.shape), live)
  value = jnp.where(live, jnp.log(jnp.maximum(counts, 1).astype(jnp.float32)), -1e9)
  batch, f, r = live.shape
  b = jnp.broadcast_to(jnp.arange(batch)[:, None, None], live.shape)
  fi = jnp.broadcast_to(jnp.arange(f)[None, :, None], live.shape)
  return jnp.full((batch, f, vocab), -1e9, jnp.float32).at[b, fi, jnp.where(live, tokens, 0)].max(value)


# ----------------------------------------------------------------------------------------- the proposer


@dataclasses.dataclass(frozen=True, eq=False)
class Suffix(Proposer):
  """Suffix decoding over the row's own context and an optional global :class:`SuffixStore`.

  Attributes:
    store: the global store, or None for per-request matching only.
    own: match the row's own prompt and output (the per-request source); False: the store only.
    max_match: the longest context tail matched, in ``[1, MAX_MATCH]``; with ``alpha = 1`` a match of m
      tokens earns up to m proposals, so ``max_match`` caps the budget too.
    max_occurrences: how many of the longest match's occurrences (the most recent) the counts read, in
      ``[1, MAX_OCCURRENCES]``.
    alpha, beta: the budget ``min(k, floor(alpha * m + beta))`` for a match of length m (``alpha >= 0``).
    min_token_prob: proposals stop once the path probability falls below it, in ``[0, 1]``.
  """

  store: Any = None
  own: bool = True
  max_match: int = 16
  max_occurrences: int = 32
  alpha: float = 1.0
  beta: float = 0.0
  min_token_prob: float = 0.1

  name: ClassVar[str] = "suffix"
  may_skip_propose: ClassVar[bool] = True  # commit reads only the previous commit's state (base.Proposer)
  plain_rounds_keep_caches: ClassVar[bool] = True  # it holds no KV cache
  module_fields: ClassVar[tuple[str, ...]] = ("store",)
  scores_proposals: ClassVar[bool] = True

  def __post_init__(self):
    if self.store is not None and not isinstance(self.store, (SuffixStore, StoreTokens)):
      raise ValueError(f"Suffix.store must be a specjax.proposers.SuffixStore or None, got {type(self.store).__name__}")
    if not isinstance(self.own, bool):
      raise ValueError(f"Suffix.own must be True or False, got {self.own!r}")
    check_int("Suffix.max_match", self.max_match, 1, MAX_MATCH)
    check_int("Suffix.max_occurrences", self.max_occurrences, 1, MAX_OCCURRENCES)
    check_number("Suffix.alpha", self.alpha, 0.0, float(MAX_K))
    check_number("Suffix.beta", self.beta, -float(MAX_K), float(MAX_K))
    check_number("Suffix.min_token_prob", self.min_token_prob, 0.0, 1.0)

  # Parameters: the store's tokens (the jitted programs' argument); a proposer without a store has none.
  def modules(self) -> tuple[Any, ...]:
    if self.store is None:
      return ()
    return (self.store.module if isinstance(self.store, SuffixStore) else self.store,)

  @property
  def varies_limit(self) -> bool:
    return True

  def describe(self) -> dict[str, Any]:
    out = {"method": self.name, "own": self.own, "max_match": self.max_match, "alpha": self.alpha,
           "beta": self.beta, "min_token_prob": self.min_token_prob}
    if isinstance(self.store, SuffixStore):
      out.update(store_capacity=self.store.capacity, store_tokens=len(self.store), store_documents=self.store.documents)
    return out

  def check(self, target_cfg, needed_len: int) -> None:
    if isinstance(self.store, SuffixStore) and self.store.max_match < self.max_match:
      raise ValueError(f"Suffix.max_match ({self.max_match}) exceeds what its store indexes (SuffixStore.max_match="
                       f"{self.store.max_match}): build the store with max_match >= {self.max_match}")
    if not self.own and self.store is None:
      raise ValueError("Suffix: own=False needs a store (there is nothing else to match)")
    if isinstance(self.store, SuffixStore) and self.store.vocab_size != target_cfg.vocab_size:
      raise ValueError(f"Suffix.store was built for vocab_size={self.store.vocab_size}, but the target's vocabulary "
                       f"has {target_cfg.vocab_size} tokens: build the store with the target's tokenizer")

  # ------------------------------------------------------------------------------------------ pure

  def init(self, target, prompts, prompt_lens, features: Features, max_len: int) -> jax.Array:
    batch, padded = prompts.shape
    return jnp.zeros((batch, max_len + 1), jnp.int32).at[:, :padded].set(prompts)

  def _sources(self, history: jax.Array, ctx: Context, depth: int):
    """Each source's ``(m, ahead)``: the row's own context first (when ``own``), then the store's."""
    newest = ctx.lengths  # last sits at lengths
    tail = _tail(history, newest, self.max_match)
    out = []
    if self.own:
      pos = jnp.arange(history.shape[1])[None, :]
      own = jnp.where(pos <= newest[:, None], history, NONE)  # nothing past the row's context
      out.append(occurrences(own, tail, pos < newest[:, None], depth, self.max_occurrences))
    if self.store is not None:
      out.append(store_occurrences(self.store, tail, depth, self.max_occurrences))
    return out

  def _budget(self, m: jax.Array, k: int) -> jax.Array:
    return jnp.clip(jnp.floor(self.alpha * m.astype(jnp.float32) + self.beta), 0, k).astype(jnp.int32)

  def candidates(self, history: jax.Array, ctx: Context, k: int):
    """Per source ``(drafts, limit, score, ahead)`` (:func:`walk` over its occurrences)."""
    out = []
    for m, ahead in self._sources(history, ctx, k):
      drafts, limit, score = walk(ahead, self._budget(m, k), self.min_token_prob, k)
      out.append((drafts, limit, score, ahead))
    return out

  def propose(self, state, target, ctx: Context, keys, k, sampler, steps) -> Proposal:
    cands = self.candidates(state, ctx, k)
    drafts, limit, score, _ = cands[0]
    for d, l, s, _ in cands[1:]:  # the higher score wins (the own context on ties)
      better = s > score
      drafts, limit, score = jnp.where(better[:, None], d, drafts), jnp.where(better, l, limit), jnp.maximum(s, score)
    drafts = jnp.where(jnp.arange(k)[None, :] < limit[:, None], drafts, 0)
    q = jax.nn.one_hot(drafts, target.cfg.vocab_size, dtype=jnp.float32)  # a deterministic proposal
    return Proposal(drafts, q, state, jnp.zeros((), jnp.int32), limit=limit, score=score)

  def propose_tree(self, state, target, ctx: Context, keys, spec, sampler) -> TreeProposal:
    """Each node's children are its path's most frequent continuations, from the source whose chain scores
    higher for the row (what :meth:`propose` would choose)."""
    depth = len(frontier_sizes(spec))
    cands = self.candidates(state, ctx, depth)
    _, _, score, ahead = cands[0]
    for _, _, s, a in cands[1:]:
      better = s > score
      ahead, score = jnp.where(better[:, None, None], a, ahead), jnp.maximum(s, score)
    vocab = target.cfg.vocab_size

    def expand(level, frontier, occ):
      if level == 1:
        occ = (ahead[:, :, 0] >= 0)[:, None, :]  # [B, 1, R]
      else:
        parent = jnp.take_along_axis(occ, frontier.parent[..., None], axis=1)  # [B, F, R]
        occ = parent & (ahead[:, None, :, level - 2] == frontier.tokens[..., None])
      return count_logits(ahead, occ, level, vocab), occ

    tree, q, _ = grow(spec, ctx.last, expand, None, sampler, keys)
    return TreeProposal(tree, q, state, jnp.zeros((), jnp.int32), score=score)

  def commit(self, state, target, verified: Verified) -> jax.Array:
    return write_rows(state, verified.emitted, verified.lengths + 1, TOKENS)


def suffix_stores(proposer) -> list[SuffixStore]:
  """The global stores ``proposer`` reads: a :class:`Suffix`'s, or those of a combined proposer's members."""
  members = getattr(proposer, "members", None) or (proposer,)
  return [m.store for m in members if isinstance(m, Suffix) and isinstance(m.store, SuffixStore)]
