"""Corpus reading, the deterministic train/valid/test split, and packed, shuffled, resumable batches.

* A corpus is ``"stdlib"`` (every ``*.py`` under this Python's standard library, ``site-packages``
  excluded), a folder (its text files), a text file or a JSONL file of ``{"text": ...}`` records.
* Documents go to a split by a hash of their name (the path relative to the corpus root, plus a chunk or
  line number inside a file): the split never depends on the order files are listed in or on the machine.
* A split is one token stream, documents joined by EOS, cut into ``seq_len + 1``-token rows.
* :class:`Batches` shuffles the rows with a permutation drawn from ``(seed, epoch)``; its position
  ``(epoch, index)`` is all a checkpoint needs to continue the same stream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np

SPLITS = ("train", "valid", "test")
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".jsonl")
# Out of 1000 hash buckets: test, valid, then train (about 1/1/98 %).
_TEST_BUCKETS, _VALID_BUCKETS = 10, 10
_CHUNK_CHARS = 4096  # a plain text file is split into documents of about this many characters


class CorpusError(ValueError):
  """A corpus path is missing, empty or unreadable; the message names the path."""


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def split_of(name: str) -> str:
  """The split of a document name: stable across machines and listing orders (a SHA-256 bucket)."""
  bucket = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little") % 1000
  if bucket < _TEST_BUCKETS:
    return "test"
  if bucket < _TEST_BUCKETS + _VALID_BUCKETS:
    return "valid"
  return "train"


def read_text(path: pathlib.Path) -> str:
  """A corpus file's text as the corpus reads it (UTF-8, undecodable bytes replaced)."""
  return path.read_bytes().decode("utf-8", errors="replace")


def _file_documents(path: pathlib.Path, name: str) -> Iterator[tuple[str, str]]:
  """Documents of one file: JSONL records, or the text cut at line ends into ~4 KB chunks (plain
  files), or the whole file (source files, kept intact so that the split is by file)."""
  if path.suffix == ".jsonl":
    for lineno, line in enumerate(read_text(path).splitlines(), 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise CorpusError(f"{path}:{lineno} is not valid JSON: {e.msg}") from e
      if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise CorpusError(f'{path}:{lineno} must be an object with a string "text" field')
      yield f"{name}:{lineno}", record["text"]
  elif path.suffix == ".txt":
    text, start, chunk = read_text(path), 0, 0
    while start < len(text):
      end = text.find("\n", start + _CHUNK_CHARS)
      end = len(text) if end < 0 else end + 1
      yield f"{name}#{chunk}", text[start:end]
      start, chunk = end, chunk + 1
  else:
    yield name, read_text(path)


def corpus_files(corpus: str) -> tuple[pathlib.Path, list[pathlib.Path]]:
  """The root and the sorted files of a corpus.

  Raises:
    CorpusError: the path does not exist or holds no text files.
  """
  if corpus == "stdlib":
    root = stdlib_root()
    files = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
  else:
    root = pathlib.Path(corpus).expanduser()
    if not root.exists():
      raise CorpusError(f"corpus path {root} does not exist")
    if root.is_file():
      return root.parent, [root]
    files = [p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
  files = sorted(files, key=lambda p: p.relative_to(root).as_posix())
  if not files:
    raise CorpusError(f"corpus path {root} holds no text files (looked for {', '.join(TEXT_SUFFIXES)})")
  return root, files


def documents(corpus: str, split: str) -> list[str]:
  """The texts of one split of a corpus, in a deterministic order.

  Raises:
    CorpusError: missing path, no text, or a split left empty (the corpus is too small to split).
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  root, files = corpus_files(corpus)
  docs, total = [], 0
  for path in files:
    for name, text in _file_documents(path, path.relative_to(root).as_posix()):
      if not text.strip():
        continue
      total += 1
      if split_of(name) == split:
        docs.append(text)
  if total == 0:
    raise CorpusError(f"corpus path {root if corpus == 'stdlib' else corpus} is empty: no non-blank text")
  if not docs:
    raise CorpusError(f"corpus {corpus} has {total} documents but none in the {split!r} split "
                      "(about 1 % go to valid and test: give it more documents)")
  return docs


def token_stream(docs: list[str], tokenizer) -> np.ndarray:
  """Encodes documents into one ``int32`` stream, each document followed by ``tokenizer.eos_id``."""
  pieces = []
  for ids in tokenizer.encode_batch(docs):
    pieces.append(np.asarray(ids, np.int32))
    pieces.append(np.array([tokenizer.eos_id], np.int32))
  return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
  """Cuts a stream into rows ``[N, seq_len + 1]``; row i starts at ``i * seq_len`` (rows overlap by one
  token so that every token is a target exactly once). The tail that fills no row is dropped."""
  n = (len(stream) - 1) // seq_len
  if n < 1:
    raise CorpusError(f"the token stream ({len(stream)} tokens) is shorter than one row of "
                      f"seq_len + 1 = {seq_len + 1} tokens")
  idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
  return stream[idx]


@dataclasses.dataclass(frozen=True)
class DataPosition:
  """Where a :class:`Batches` stream stands: the next batch is batch ``index`` of epoch ``epoch``."""

  epoch: int = 0
  index: int = 0


class Batches:
  """Shuffled fixed-size batches of packed rows, reproducible from ``(seed, position)``.

  Epoch ``e`` visits the rows in ``default_rng([seed, e]).permutation(N)`` order, ``batch_size`` at a
  time; a partial last batch is dropped. ``next()`` returns ``[batch_size, seq_len + 1] int32``.
  ``masks`` (``[N, seq_len]``, conversation data: which positions predict an answer token) travel with their
  rows: the batch of indices ``i`` is ``rows[i]``, ``masks[i]``.
  """

  def __init__(self, rows: np.ndarray, batch_size: int, seed: int, position: DataPosition = DataPosition(),
               masks: np.ndarray | None = None):
    if len(rows) < batch_size:
      raise CorpusError(f"{len(rows)} packed rows cannot fill one batch of {batch_size}")
    if masks is not None and masks.shape != (rows.shape[0], rows.shape[1] - 1):
      raise ValueError(f"masks must be [N, T] = {(rows.shape[0], rows.shape[1] - 1)} for rows {rows.shape}, "
                       f"got {masks.shape}")
    self.rows, self.batch_size, self.seed, self.masks = rows, batch_size, seed, masks
    self.position = position
    self._order = None

  @property
  def batches_per_epoch(self) -> int:
    return len(self.rows) // self.batch_size

  def _perm(self, epoch: int) -> np.ndarray:
    if self._order is None or self._order[0] != epoch:
      self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.rows)))
    return self._order[1]

  def next_indices(self) -> np.ndarray:
    """The row indices of the next batch ``[batch_size]`` (advances the position, as :meth:`next`)."""
    epoch, index = self.position.epoch, self.position.index
    if index >= self.batches_per_epoch:
      epoch, index = epoch + 1, 0
    rows = self._perm(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
    self.position = DataPosition(epoch, index + 1)
    return rows

  def next(self) -> np.ndarray:
    return self.rows[self.next_indices()]
