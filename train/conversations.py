"""Conversations as head-training data: a user's chats, answered again by the target, as masked token rows.

The pipeline a heads recipe with a ``[conversations]`` section (or ``specjax train heads --data FILE``) runs:

1. **Read** a JSONL file, one conversation a line, in either layout (detected per line):

   * OpenAI messages: ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}]}``;
   * ShareGPT: ``{"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}]}``.

   A bad line (invalid JSON, neither layout, an unknown role, empty or non-string content, no assistant turn)
   raises :class:`ConversationError` naming the file and the line number. With regeneration on, a conversation
   may end with a user turn, which the target answers: a file of prompts alone
   (``python -m specjax.train.instructions --conversations N``) is data too.
2. **Regenerate** (``regenerate = true``, self-distillation as EAGLE does): every assistant turn is replaced by
   the target's own answer to the conversation so far (earlier turns, themselves regenerated, included), rendered
   with the target's chat template. Turn r of every conversation of a shard is answered before turn r + 1, in
   batches, through :func:`specjax.generate` with speculation (the target's shipped head when it has one, else
   n-gram lookup): exact, so the answers are the target's greedy (or sampled) answers. ``regenerate = false``
   keeps the file's own answers.
3. **Shard**: conversations ``[i * shard_size, (i + 1) * shard_size)`` of the file (in line order) are written
   as ``shard-<i>.jsonl`` in the OpenAI layout with their source line (``{"line": n, "messages": [...]}``), each
   shard written whole to a ``.partial`` file and renamed: a killed preparation leaves only whole shards, and
   running it again makes only the missing ones (a shard cut mid-way is made again from its first
   conversation; nothing is kept twice or lost). ``manifest.json`` records the settings the shards were made
   with and, per shard, the SHA-256 of the source conversations it was made from; it refuses to continue them
   with other settings (naming the field) or from a source whose conversations of a made shard changed (naming
   the shard and its lines). The source may move and may grow: conversations appended to the file make new
   shards, and a last shard that was short is made again with the new conversations that fill it. Shards
   compressed with ``xz`` (``shard-<i>.jsonl.xz``) are read as they are.
4. **Encode** (:func:`encode`): a conversation's row is what the target reads when it writes the last answer:
   that turn's prompt (every earlier turn, then the assistant header) rendered with the chat template and
   tokenized as one text, exactly what :func:`specjax.generate` was given, then the answer's tokens. The loss
   mask marks each answer's tokens up to and including its first end-of-turn token (earlier answers found in
   the prompt by their characters); system and user turns, the headers and anything the template writes after
   the end-of-turn token are context only. Conversations are joined into one stream and
   packed as corpus text is (:func:`specjax.train.data.pack`), with a mask row per token row: ``mask[b, t] = 1``
   where position t predicts an answer token.

A conversation goes to validation when a hash of its source line number falls under ``valid_fraction``: the
same split for every run on the same file, whatever the shard size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
import os
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# What shards must share to be continued. The source file is compared by the conversations each shard was made
# from (manifest "shards": {index: {"n": count, "sha256": digest}}), not by its path or its whole contents, so the
# prompts file and the shards may move and the file may grow.
_MANIFEST_FIELDS = ("shard_size", "regenerate", "max_new_tokens", "temperature", "seed", "target", "chat_template")

Messages = tuple[dict[str, str], ...]
_ASK = {"role": "assistant", "content": ""}  # the answer to a last user turn, before the target writes it


class ConversationError(ValueError):
  """A conversation file, line or shard folder that cannot be used; the message names the file (and line)."""


# ------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class ConversationsConfig:
  """The ``[conversations]`` section of a heads recipe: train on a user's chats (see the module docstring).

  Attributes:
    path: the JSONL file of conversations (``specjax train heads --data FILE`` sets it); relative paths are
      read against the recipe's folder when they do not exist as given.
    regenerate: replace every assistant turn by the target's own answer (self-distillation); false keeps the
      file's answers.
    shards: folder of the prepared shards ("" = ``<run>/conversations``); a folder may serve several runs.
    shard_size: conversations per shard (the unit written atomically and redone after a kill).
    batch: conversations answered at once: per :func:`specjax.generate` call (``batching = "static"``), or the
      slots of the continuous batch (``"continuous"``).
    batching: ``"continuous"`` (the default): the turns to answer stream through the serving engine's slots
      (:class:`specjax.serving.slots.SlotEngine`), a finished answer's slot refilled at once, so no row idles
      while the longest answer of its batch runs on, and each sampled answer depends on its own seed alone
      (not on the batch it shared); ``"static"``: calls of ``batch`` prompts to :func:`specjax.generate`, each
      running to its longest answer. Greedy answers are the same either way; on SmolLM2 at batch 16 on two CPU
      cores, continuous batching answered 1.28x as many tokens a second (``benchmarks/regeneration.py``).
    k: proposals per round of that call's speculation, in ``[0, 32]``; 0 decodes with the target alone, which
      is faster where the proposer accepts little at this batch size (SmolLM2 on two CPU cores at batch 16: the
      shipped head at k = 4 took 1.48x the target alone's time).
    max_new_tokens: the longest regenerated answer (a longer one is cut, and ends without end-of-turn token).
    temperature: 0 answers greedily; > 0 samples (top-p 0.95), seeded per shard, turn and batch from ``seed``.
    seed: seed of sampled answers.
    chat_template: a Jinja file to render with ("" = the target's own template; needed for a target without
      one, such as a run directory).
    valid_fraction: the share of conversations held out for validation, in (0, 0.5].
  """

  path: str = ""
  regenerate: bool = True
  shards: str = ""
  shard_size: int = 256
  batch: int = 16
  batching: str = "continuous"
  k: int = 4
  max_new_tokens: int = 256
  temperature: float = 0.0
  seed: int = 0
  chat_template: str = ""
  valid_fraction: float = 0.02

  def __post_init__(self):
    from specjax.train.config import ConfigError, check_field_int, check_float

    for name in ("path", "shards", "chat_template"):
      if not isinstance(getattr(self, name), str):
        raise ConfigError(f"conversations.{name} must be a path (a string), got {getattr(self, name)!r}")
    if not self.path:
      raise ConfigError("conversations.path must name a JSONL file of conversations (or pass --data FILE)")
    if not isinstance(self.regenerate, bool):
      raise ConfigError(f"conversations.regenerate must be true or false, got {self.regenerate!r}")
    for name in ("shard_size", "batch", "max_new_tokens"):
      check_field_int("conversations", name, getattr(self, name))
    check_field_int("conversations", "seed", self.seed, 0)
    from specjax.config import MAX_K

    if isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 <= self.k <= MAX_K:
      raise ConfigError(f"conversations.k must be an integer in [0, {MAX_K}] (0: the target alone), got {self.k!r}")
    if self.batching not in BATCHING:
      raise ConfigError(f"conversations.batching must be one of {BATCHING}, got {self.batching!r}")
    check_float("conversations", "temperature", self.temperature, 0.0)
    check_float("conversations", "valid_fraction", self.valid_fraction, 0.0, 0.5, low_open=True)


# ------------------------------------------------------------------------------------------ reading


def _fail(path, lineno: int, why: str):
  raise ConversationError(f"{path}:{lineno}: {why}")


def parse_line(line: str, path: str | os.PathLike = "<string>", lineno: int = 1, *, prompts: bool = False,
               empty_answers: bool = False) -> Messages:
  """One JSONL line as OpenAI-layout messages ``({"role", "content"}, ...)``, either layout accepted.

  ``prompts``: a conversation may also end with a user turn that has no answer yet (the target answers it when
  the answers are regenerated), so a list of prompts is data too. ``empty_answers``: an assistant turn may be
  empty (a regenerated answer where the target ended its turn at once: it still teaches the end of turn).

  Raises:
    ConversationError: ``"{path}:{lineno}: ..."`` for invalid JSON, an unknown layout or role, empty or
      non-string content, or a conversation with nothing to train on (no assistant turn, nor, with
      ``prompts``, a last user turn).
  """
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    _fail(path, lineno, f"not valid JSON ({e.msg})")
  if isinstance(record, dict) and "messages" in record:
    turns, role_key, text_key, roles = record["messages"], "role", "content", {r: r for r in ROLES}
  elif isinstance(record, dict) and "conversations" in record:
    turns, role_key, text_key, roles = record["conversations"], "from", "value", SHAREGPT_ROLES
  else:
    _fail(path, lineno, 'unknown layout: expected an object with "messages" (OpenAI: role/content) or '
                        '"conversations" (ShareGPT: from/value)')
  if not isinstance(turns, list) or not turns:
    _fail(path, lineno, f'"{"messages" if role_key == "role" else "conversations"}" must be a non-empty list')
  messages = []
  for i, turn in enumerate(turns):
    if not isinstance(turn, dict):
      _fail(path, lineno, f"turn {i} must be an object, got {type(turn).__name__}")
    role = turn.get(role_key)
    if role not in roles:
      _fail(path, lineno, f"turn {i} has {role_key} {role!r}; allowed: {tuple(roles)}")
    content = turn.get(text_key)
    if not isinstance(content, str) or not (content.strip() or empty_answers and roles[role] == "assistant"):
      _fail(path, lineno, f"turn {i} ({role}) has empty or non-string {text_key} {content!r}")
    messages.append({"role": roles[role], "content": content})
  if prompts and messages[-1]["role"] == "user":
    return tuple(messages)
  if not any(m["role"] == "assistant" for m in messages):
    _fail(path, lineno, "has no assistant turn: nothing to train on" + (
        "" if prompts else " (with conversations.regenerate = true a conversation may end with a user turn, "
                           "which the target answers)"))
  return tuple(messages)


def read_conversations(path: str | os.PathLike, *, prompts: bool = False) -> list[tuple[int, Messages]]:
  """``(line number, messages)`` of every non-blank line of a JSONL file, in order (1-based line numbers);
  ``prompts`` as in :func:`parse_line`.

  Raises:
    ConversationError: the file is missing or empty, or a line is bad (naming the file and line).
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise ConversationError(f"conversation file {path} does not exist")
  out = []
  with path.open(encoding="utf-8", errors="replace") as f:
    for lineno, line in enumerate(f, 1):
      if line.strip():
        out.append((lineno, parse_line(line, path, lineno, prompts=prompts)))
  if not out:
    raise ConversationError(f"conversation file {path} holds no conversation")
  return out


def is_valid(lineno: int, fraction: float) -> bool:
  """Whether the conversation of source line ``lineno`` is held out for validation (a SHA-256 bucket)."""
  digest = hashlib.sha256(f"conversation:{lineno}".encode()).digest()
  return int.from_bytes(digest[:8], "little") % 1_000_000 < fraction * 1_000_000


# ------------------------------------------------------------------------------------------ encoding


def _with_offsets(tokenizer, text: str) -> tuple[list[int], list[int]] | None:
  """Ids of chat text (as ``ChatFormat.tokenize``) and each token's start offset in ``text``; None for a
  tokenizer without a ``tokenizers`` backend."""
  backend = getattr(tokenizer, "tokenizer", None)
  if not hasattr(backend, "encode"):
    return None
  encoding = backend.encode(text, add_special_tokens=False)
  return list(encoding.ids), [start for start, _ in encoding.offsets]


def answer_spans(chat, messages: Sequence[dict[str, str]]) -> tuple[list[tuple[int, int]], str]:
  """The character spans ``[start, end)`` of each assistant turn (through what the template writes after it) in
  the conversation rendered up to its last assistant turn, and that text.

  Raises:
    ConversationError: the template does not render the conversation as the concatenation of its prefixes (a
      template that rewrites earlier turns), or refuses it (its ``raise_exception``).
  """
  from specjax.chat import ChatTemplateError

  spans, done = [], ""
  last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
  for i in range(last + 1):
    if messages[i]["role"] != "assistant":
      continue
    try:
      prompt = chat.render(messages[:i], add_generation_prompt=True)
      turn = chat.render(messages[:i + 1], add_generation_prompt=False)
    except ChatTemplateError as e:
      raise ConversationError(str(e)) from e
    if not (prompt.startswith(done) and turn.startswith(prompt)):
      raise ConversationError("the chat template does not render a conversation as the concatenation of its "
                              f"turns (turn {i}): it cannot give each answer the prompt it was generated from")
    spans.append((len(prompt), len(turn)))
    done = turn
  return spans, done


def encode(chat, tokenizer, messages: Sequence[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
  """A conversation's tokens and its answer mask, rendered with ``chat`` (a ChatFormat).

  The row is what the target reads when it writes the last answer: the prompt of that turn (every earlier turn,
  then the assistant header) tokenized as one text, exactly :meth:`ChatFormat.encode` (what
  :func:`specjax.generate` was given), followed by the answer's tokens. Earlier answers are found in the prompt
  by their characters (a token counts when it starts inside the answer); each answer counts through its first
  end-of-turn token. Turns after the last assistant turn are dropped (nothing to predict there).

  Returns:
    ``(ids [N] int32, answer [N] bool)``.

  Raises:
    ConversationError: the template does not render a conversation as the concatenation of its prefixes
      (a template that rewrites earlier turns): an answer's prompt would not be part of the row.
  """
  ends = set(chat.end_of_turn_ids)
  spans, done = answer_spans(chat, messages)
  prompt = done[:spans[-1][0]]
  with_offsets = _with_offsets(tokenizer, prompt)
  if with_offsets is None:  # no offsets: the prompt's pieces tokenized one by one
    context, inside, cut = [], [], 0
    for a, b in spans[:-1]:
      for piece, flag in ((prompt[cut:a], False), (prompt[a:b], True)):
        piece_ids = chat.tokenize(tokenizer, piece)
        context += piece_ids
        inside += [flag] * len(piece_ids)
      cut = b
    tail = chat.tokenize(tokenizer, prompt[cut:])
    context, inside = context + tail, inside + [False] * len(tail)
  else:
    context, starts = with_offsets
    inside = [any(a <= s < b for a, b in spans[:-1]) for s in starts]
  reply = chat.tokenize(tokenizer, done[spans[-1][0]:])
  ids = context + reply
  # Each answer counts through its first end-of-turn token; what the template writes after it does not.
  answer, closed = [], False
  for t, flag in zip(ids, inside + [True] * len(reply)):
    closed = closed and flag  # a new answer opens after non-answer tokens
    answer.append(flag and not closed)
    closed = closed or (flag and t in ends)
  return np.asarray(ids, np.int32), np.asarray(answer, bool)


def pack_masked(pieces: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Conversations joined into one stream and cut as :func:`specjax.train.data.pack` cuts text.

  Returns:
    ``(rows [N, seq_len + 1] int32, mask [N, seq_len] bool)``; ``mask[n, t]`` is set where token
    ``rows[n, t + 1]`` is an answer token (position t predicts it).
  """
  from specjax.train import data as data_lib

  stream = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros((0,), np.int32)
  answer = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros((0,), bool)
  rows = data_lib.pack(stream, seq_len)
  token_mask = data_lib.pack(answer, seq_len)
  return rows, token_mask[:, 1:]


# ------------------------------------------------------------------------------------ regeneration


# How the turns of a regeneration are batched (ConversationsConfig.batching).
BATCHING = ("static", "continuous")

# Rounds one device call of the continuous batch may run (it returns sooner when an answer ends).
_CALL_ROUNDS = 8


def _sampling(cfg: ConversationsConfig):
  """How answers are drawn: greedy at ``conversations.temperature`` 0, else that temperature with top-p 0.95."""
  import specjax

  return specjax.GREEDY if cfg.temperature == 0 else specjax.SamplingConfig(temperature=cfg.temperature, top_p=0.95)


@dataclasses.dataclass(frozen=True)
class Answerer:
  """What regenerates answers: the target, its tokenizer and chat format, the proposer it speculates with (its
  shipped head, or n-gram lookup) and the proposals per round (``conversations.k``; 0: the target alone)."""

  model: Any
  tokenizer: Any
  chat: Any
  proposer: Any
  k: int = 4
  # The continuous batch's slot engines by (slots, k, max_len), made on first use (answer_all); not an argument,
  # so that dataclasses.replace (another proposer, say) starts with none rather than sharing these.
  _engines: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

  def answer(self, prompts: list[list[int]], cfg: ConversationsConfig, seed: int) -> list[str]:
    """The target's answers to token prompts (at most ``cfg.batch``), decoded without the stop tokens. A short
    batch is filled up with copies of its first prompt, so that every call has ``cfg.batch`` rows and one
    compiled program serves each prompt length bucket."""
    import specjax

    sampling, stops = _sampling(cfg), self.chat.stop_ids(self.tokenizer)
    padded = list(prompts) + [prompts[0]] * (cfg.batch - len(prompts))
    proposer = self.proposer if self.k else None  # k = 0: the target alone
    out = generate(self.model, padded, proposer=proposer, spec=specjax.SpecConfig(k=self.k), sampling=sampling,
                   max_new_tokens=cfg.max_new_tokens, seed=seed, eos_id=stops)
    return [self.tokenizer.decode([t for t in row if t not in stops]) for row in out.rows()[:len(prompts)]]

  def answer_all(self, prompts: list[list[int]], cfg: ConversationsConfig, seeds: list[int]) -> list[str]:
    """The target's answers to any number of token prompts, streamed through ``cfg.batch`` slots of the serving
    engine (continuous batching: a slot whose answer ended takes the next prompt before the next call), each
    sampled answer drawn from its own ``seeds[i]``; decoded without the stop tokens, as :meth:`answer`."""
    from specjax.request import Request

    sampling, stops = _sampling(cfg), tuple(self.chat.stop_ids(self.tokenizer))
    requests = [Request(tuple(p), cfg.max_new_tokens, sampling, stop_ids=stops, seed=seed)
                for p, seed in zip(prompts, seeds)]
    need = max(len(p) for p in prompts) + cfg.max_new_tokens + self.k  # (a last round writes k past the end)
    engine = self._engine(cfg, min(max(256, 1 << (need - 1).bit_length()), self.model.cfg.max_seq_len))
    engine.reset()  # (rows an interrupted call left behind)
    pending, owner, out = list(range(len(requests))), {}, [[] for _ in requests]
    while pending or owner:
      while engine.free_slots and pending:  # one at a time: one prefill program per prompt bucket
        i = pending.pop(0)
        (slot,) = engine.insert([requests[i]])
        owner[slot] = i
      engine.compact()
      result = step(engine, self.k, _CALL_ROUNDS)
      for slot, tokens in result.tokens.items():
        out[owner[slot]].extend(tokens)
      for slot in result.finished:
        del owner[slot]
    return [self.tokenizer.decode([t for t in row if t not in stops]) for row in out]

  def _engine(self, cfg: ConversationsConfig, max_len: int):
    """The slot engine of ``cfg.batch`` slots of ``max_len`` positions (a power of two that holds the longest prompt
    and its answer), made once per Answerer and settings; its programs compile on first use. It runs at widths
    of a quarter, half and all of the slots (fewer rows once the prompts run out, three widths to compile), and
    a step attends over the shortest of ``max_len`` and its halves down to an eighth that holds its rows."""
    from specjax.serving.slots import SlotEngine

    key = (cfg.batch, self.k, max_len)
    if key not in self._engines:
      widths = sorted({max(1, cfg.batch // 4), max(1, cfg.batch // 2), cfg.batch})
      self._engines[key] = SlotEngine(self.model, self.proposer if self.k else None, slots=cfg.batch,
                                      max_len=max_len, ks=(self.k,), widths=widths, rounds=_CALL_ROUNDS)
    return self._engines[key]


def step(engine, k: int, rounds: int):
  """``engine.step(k, rounds)`` (one name here, so a test can interrupt the regeneration mid-shard)."""
  return engine.step(k, rounds)


def generate(*args, **kwargs):
  """:func:`specjax.generate` (one name here, so a test can interrupt the regeneration mid-shard)."""
  import specjax

  return specjax.generate(*args, **kwargs)


def regenerate(conversations: list[Messages], answerer: Answerer, cfg: ConversationsConfig, shard: int
               ) -> list[Messages]:
  """``conversations`` with every assistant turn answered again by the target, turn r of all of them before
  turn r + 1 (so a later answer follows the regenerated earlier ones), ``cfg.batch`` at a time
  (``cfg.batching``: calls of that many prompts, or that many slots refilled as answers end).

  A turn whose prompt leaves no room for ``cfg.max_new_tokens`` in the target's ``max_seq_len`` ends its
  conversation: the conversation keeps the turns answered before it (an empty tuple when even its first
  prompt is too long).
  """
  convs = [list(m) for m in conversations]
  turns = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
  room = answerer.model.cfg.max_seq_len - cfg.max_new_tokens
  for r in range(max(len(t) for t in turns)):
    todo = []
    for c, t in enumerate(turns):
      if r >= len(t):
        continue
      prompt = answerer.chat.encode(answerer.tokenizer, convs[c][:t[r]])
      if len(prompt) > room:  # the conversation ends after its last answered turn
        convs[c], turns[c] = convs[c][:t[r - 1] + 1] if r else [], t[:r]
        continue
      todo.append((c, t[r], prompt))
    if cfg.batching == "continuous":  # a seed per conversation: its answer does not depend on its batch
      seeds = [int(np.random.default_rng([cfg.seed, shard, r, c]).integers(2**31)) for c, _, _ in todo]
      for (c, i, _), text in zip(todo, answerer.answer_all([p for _, _, p in todo], cfg, seeds) if todo else []):
        convs[c][i] = {"role": "assistant", "content": text}
      continue
    for start in range(0, len(todo), cfg.batch):
      part = todo[start:start + cfg.batch]
      seed = int(np.random.default_rng([cfg.seed, shard, r, start]).integers(2**31))
      for (c, i, _), text in zip(part, answerer.answer([p for _, _, p in part], cfg, seed)):
        convs[c][i] = {"role": "assistant", "content": text}
  return [tuple(c) for c in convs]


# -------------------------------------------------------------------------------------------- shards


def _sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with path.open("rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _inputs_sha256(part: Sequence[tuple[int, Messages]]) -> str:
  """The digest of the source conversations a shard is made from (their line numbers and messages)."""
  return hashlib.sha256(json.dumps([[line, list(m)] for line, m in part], sort_keys=True).encode()).hexdigest()


def shard_path(folder: pathlib.Path, index: int) -> pathlib.Path:
  """Shard ``index`` of ``folder``: ``shard-<index>.jsonl``, or ``shard-<index>.jsonl.xz`` where only that one
  exists (shards compressed with ``xz`` are read as they are, so a run's shards can be kept compressed, in a
  repository for instance, and continued); a shard still to make is written uncompressed."""
  plain = folder / f"shard-{index:05d}.jsonl"
  packed = plain.with_name(plain.name + ".xz")
  return packed if not plain.exists() and packed.exists() else plain


def _write_atomic(path: pathlib.Path, text: str) -> None:
  """Writes ``path`` whole or not at all: a ``.partial`` file of this process, renamed (so processes that make
  the same shard at once never write into one file)."""
  part = path.with_name(f"{path.name}.{os.getpid()}.partial")
  part.write_text(text, encoding="utf-8")
  part.replace(path)


def prepare(cfg: ConversationsConfig, folder: pathlib.Path, *, answerer: Answerer | None, target: str,
            progress: bool = False, on_shard: Callable[[int], None] | None = None) -> list[pathlib.Path]:
  """Makes the shards of ``cfg.path`` in ``folder`` that are not there yet (see the module docstring).

  Args:
    answerer: what regenerates the answers (needed when ``cfg.regenerate``; None otherwise).
    target: the target's name, recorded in the manifest (shards of another target are refused).
    on_shard: called with each shard's index once it is written.

  Returns:
    The shard files, in order.

  Raises:
    ConversationError: a bad line (file and line number), or a folder made with other settings (the field).
  """
  source = pathlib.Path(cfg.path)
  conversations = read_conversations(source, prompts=cfg.regenerate)
  manifest = {"source": str(source.resolve()), "source_sha256": _sha256(source), "shard_size": cfg.shard_size,
              "regenerate": cfg.regenerate, "target": target if cfg.regenerate else "",
              "max_new_tokens": cfg.max_new_tokens if cfg.regenerate else 0,
              "temperature": cfg.temperature if cfg.regenerate else 0.0, "seed": cfg.seed if cfg.regenerate else 0,
              "chat_template": cfg.chat_template, "shards": {}}
  folder.mkdir(parents=True, exist_ok=True)
  kept = folder / "manifest.json"
  n = -(-len(conversations) // cfg.shard_size)
  parts = [conversations[s * cfg.shard_size:(s + 1) * cfg.shard_size] for s in range(n)]
  remake = set()
  if kept.exists():
    old = json.loads(kept.read_text())
    diff = [f"{k}: shards have {old.get(k)!r}, now {manifest[k]!r}" for k in _MANIFEST_FIELDS if old.get(k) != manifest[k]]
    if diff:
      raise ConversationError(f"{folder} holds shards made otherwise ({'; '.join(diff)}): choose another "
                              "conversations.shards folder or delete it")
    made = {int(s): r for s, r in old.get("shards", {}).items()}
    if not made and old.get("source_sha256") == manifest["source_sha256"]:  # a manifest of before the records
      made = {s: {"n": len(parts[s]), "sha256": _inputs_sha256(parts[s])} for s in range(n)
              if shard_path(folder, s).exists()}
    for s in sorted(made):
      if not shard_path(folder, s).exists():
        continue
      count, part = made[s]["n"], parts[s] if s < n else []
      if len(part) < count or _inputs_sha256(part[:count]) != made[s]["sha256"]:
        lines = f"lines {part[0][0]}-{part[-1][0]}" if part else "no conversation"
        raise ConversationError(
            f"{folder}: shard {s} was made from other conversations than {source}'s (now {lines}): the source "
            "changed; choose another conversations.shards folder or delete it")
      if len(part) > count:  # a short last shard, now filled by conversations appended to the source
        remake.add(s)
    unrecorded = [s for s in range(n) if shard_path(folder, s).exists() and s not in made]
    if unrecorded:
      raise ConversationError(f"{folder}: shard(s) {unrecorded} are not recorded in manifest.json (made from "
                              f"another source): choose another conversations.shards folder or delete it")
    manifest["shards"] = {str(s): r for s, r in sorted(made.items())}
  _write_atomic(kept, json.dumps(manifest, indent=2) + "\n")
  if cfg.regenerate and answerer is None:
    raise ValueError("conversations.regenerate needs the target to answer (an Answerer)")
  from tqdm import tqdm

  for s in tqdm(range(n), desc="conversations", disable=not progress):
    path = shard_path(folder, s)
    if path.exists() and s not in remake:
      continue
    if s in remake:  # a short shard, made again whole (removed first: a kill now leaves it missing, so made)
      path.unlink()
      path = shard_path(folder, s)
    # Recorded before it is written: a kill in between leaves a recorded shard missing, which is made again.
    manifest["shards"][str(s)] = {"n": len(parts[s]), "sha256": _inputs_sha256(parts[s])}
    _write_atomic(kept, json.dumps(manifest, indent=2) + "\n")
    part = parts[s]
    if cfg.regenerate:  # a last user turn is asked too: an empty answer, which the target writes
      part = [(line, m + (_ASK,) if m[-1]["role"] == "user" else m) for line, m in part]
    messages = [m for _, m in part]
    if cfg.regenerate:
      for line, m in part:  # a conversation the template refuses stops the run before its shard is generated
        try:
          answer_spans(answerer.chat, m)
        except ConversationError as e:
          raise ConversationError(f"{source}:{line}: {e}") from e
      messages = regenerate(messages, answerer, cfg, s)
    cut = sum(len(m) < len(given) for m, (_, given) in zip(messages, part))
    if cut:
      print(f"conversations: shard {s}: {cut} conversation(s) end early, a prompt longer than the target's "
            f"max_seq_len - conversations.max_new_tokens ({answerer.model.cfg.max_seq_len - cfg.max_new_tokens} "
            "tokens); an empty one is skipped")
    _write_atomic(path, "".join(json.dumps({"line": line, "messages": list(m)}) + "\n"
                                for (line, _), m in zip(part, messages)))
    if on_shard is not None:
      on_shard(s)
  return [shard_path(folder, s) for s in range(n)]


def read_shards(paths: Sequence[pathlib.Path]) -> Iterator[tuple[int, Messages]]:
  """``(source line, messages)`` of every conversation of the shards, in order (a conversation regeneration left
  empty, its first prompt too long for the target, is skipped)."""
  for path in paths:
    if path.suffix == ".xz":
      with lzma.open(path, "rt", encoding="utf-8") as f:
        text = f.read()
    else:
      text = path.read_text(encoding="utf-8")
    for lineno, line in enumerate(text.splitlines(), 1):
      record = json.loads(line)
      if record["messages"]:
        yield record["line"], parse_line(json.dumps({"messages": record["messages"]}), path, lineno,
                                         empty_answers=True)


def rows_and_masks(paths: Sequence[pathlib.Path], chat, tokenizer, seq_len: int, valid_fraction: float,
                   source: str = "conversations") -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """``{"train": (rows, mask), "valid": (rows, mask)}`` of the shards (see :func:`pack_masked`).

  Raises:
    ConversationError: a conversation the template refuses (naming ``source`` and its line), or a split too
      small to fill one row of ``seq_len + 1`` tokens (naming the field).
  """
  pieces: dict[str, list] = {"train": [], "valid": []}
  for line, messages in read_shards(paths):
    try:
      piece = encode(chat, tokenizer, messages)
    except ConversationError as e:
      raise ConversationError(f"{source}:{line}: {e}") from e
    pieces["valid" if is_valid(line, valid_fraction) else "train"].append(piece)
  out = {}
  for split, parts in pieces.items():
    tokens = sum(len(p[0]) for p in parts)
    if tokens < seq_len + 1:
      raise ConversationError(f"the {split} conversations ({len(parts)}, {tokens} tokens) fill no row of "
                              f"data.seq_len + 1 = {seq_len + 1} tokens: give more conversations"
                              + (" or raise conversations.valid_fraction" if split == "valid" else ""))
    out[split] = pack_masked(parts, seq_len)
  return out
