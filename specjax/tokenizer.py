"""Tokenizers: what specjax needs of one, the byte tokenizer, and ``tokenizers``-library tokenizers.

Every tokenizer here satisfies :class:`Tokenizer` (``vocab_size``, ``eos_id``, ``encode``, ``decode``), the
interface of ``tokenizer=`` in :func:`specjax.generate`:

- :class:`ByteTokenizer`: every UTF-8 byte is a token, plus an EOS; no files, no dependencies.
- :class:`HFTokenizer`: a ``tokenizers.Tokenizer`` as Hugging Face checkpoints ship it
  (:func:`load_hf_tokenizer`); :func:`byte_level_tokenizer` builds one with :class:`ByteTokenizer`'s ids.
- :class:`BPETokenizer`: the byte-level BPE that ``specjax.train`` trains and every specjax export ships
  (:func:`load_tokenizer`); an :class:`HFTokenizer` whose EOS is ``<|endoftext|>``.

:func:`check_same_vocab` refuses a target/draft pair whose tokenizers disagree. Every refusal is a
:class:`TokenizerError` (a ``ValueError``) naming the file or field.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

EOS = "<|endoftext|>"  # the one special token of a trained BPETokenizer
_PROBE_TEXT = ("Hello, world! 0123456789 The quick brown fox; naïve café – 日本語 🙂\n"
               "\tdef f(x): return x**2")


class TokenizerError(ValueError):
  """A tokenizer file is missing, unreadable, or does not fit the model; the message names the path."""


@runtime_checkable
class Tokenizer(Protocol):
  """What specjax needs of a tokenizer: ``tokenizer=`` of :func:`specjax.generate`, the CLI, the bench."""

  @property
  def vocab_size(self) -> int:
    """Ids are ``0 .. vocab_size - 1``; a model used with this tokenizer has this ``vocab_size``."""

  @property
  def eos_id(self) -> int | None:
    """The id that ends generation, or None when the tokenizer has none."""

  def encode(self, text: str) -> list[int]:
    """The ids of ``text``."""

  def decode(self, ids: Sequence[int]) -> str:
    """The text of ``ids``; ids outside ``[0, vocab_size)`` (such as -1 padding) are dropped."""


# ----------------------------------------------------------------------------------------- bytes


class ByteTokenizer:
  """Bytes 0..255 are tokens 0..255; ``eos_id = 256``. ``vocab_size = 257``."""

  vocab_size = 257
  eos_id = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    """Decodes byte tokens; special and out-of-range ids are dropped, invalid UTF-8 is replaced."""
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------- tokenizers library


class HFTokenizer:
  """A ``tokenizers.Tokenizer`` with the interface of :class:`Tokenizer`.

  ``encode`` adds the tokenizer's special tokens (BOS for Llama-style tokenizers), as Hugging Face's
  ``tokenizer(text)`` does; ``decode`` skips special tokens. ``vocab_size`` counts added tokens.

  Args:
    tokenizer: the ``tokenizers.Tokenizer``.
    eos_id: the id that ends generation, in ``[0, vocab_size)``, or None.
    path: the file it was read from, named in errors (None: in memory).

  Raises:
    TokenizerError: ``eos_id`` outside ``[0, vocab_size)``.
  """

  add_special_tokens = True  # what encode passes to tokenizers' encode

  def __init__(self, tokenizer, eos_id: int | None = None, path: str | None = None):
    self.tokenizer = tokenizer
    self.path = path
    self.eos_id = eos_id
    if eos_id is not None and not 0 <= eos_id < self.vocab_size:
      # Checkpoints exist whose configured EOS lies past the tokenizer's vocabulary (a model padded beyond
      # it): as transformers does, warn and go on without it; pass eos_id= (or --eos) to stop on a token.
      import warnings

      warnings.warn(f"tokenizer {self.name}: eos_id {eos_id} lies outside its vocabulary [0, {self.vocab_size}) "
                    "and is ignored; pass eos_id= to generate (--eos on the command line) to stop on a token",
                    stacklevel=2)
      self.eos_id = None

  @property
  def name(self) -> str:
    """The file the tokenizer came from, for messages."""
    return self.path or "(in memory)"

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return list(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """``[encode(t) for t in texts]``, encoded in parallel."""
    encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=self.add_special_tokens)
    return [list(e.ids) for e in encodings]

  def decode(self, ids: Sequence[int]) -> str:
    """Decodes ids; special tokens and ids outside the vocabulary (such as -1 padding) are dropped."""
    return self.tokenizer.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size],
                                 skip_special_tokens=True)

  def id_to_token(self, token_id: int) -> str | None:
    return self.tokenizer.id_to_token(int(token_id))

  def save(self, path: str | pathlib.Path) -> None:
    """Writes the tokenizer as a ``tokenizer.json`` (the ``tokenizers`` format) to ``path``."""
    self.tokenizer.save(str(path))

  def fingerprint(self) -> str:
    """SHA-256 of the serialised tokenizer: equal fingerprints encode identically."""
    return hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()[:16]

  def check_model(self, vocab_size: int, where: str) -> None:
    """Raises :class:`TokenizerError` unless the tokenizer's vocabulary equals a model's ``vocab_size``.

    Args:
      vocab_size: the model's ``vocab_size``.
      where: the model's config (a file or "the recipe"), named in the message.
    """
    if self.vocab_size != vocab_size:
      raise TokenizerError(
          f"tokenizer {self.name} has vocab_size {self.vocab_size} but {where} has model.vocab_size "
          f"{vocab_size}: they must match")


class BPETokenizer(HFTokenizer):
  """The byte-level BPE of ``specjax.train`` (:func:`specjax.train.tokenizer.train_bpe`).

  An :class:`HFTokenizer` whose EOS is its one special token ``<|endoftext|>``, which separates documents.
  Byte-level: every text is encodable and ``decode(encode(text)) == text``. Unlike :class:`HFTokenizer`,
  ``encode`` adds no special tokens (training data and prompts are plain text), and ``decode`` drops EOS
  even where a file does not mark it special.

  Raises:
    TokenizerError: the tokenizer has no ``<|endoftext|>`` token (naming ``path``).
  """

  add_special_tokens = False

  def __init__(self, tokenizer, path: str | None = None):
    super().__init__(tokenizer, path=path)
    self.eos_id = tokenizer.token_to_id(EOS)
    if self.eos_id is None:
      raise TokenizerError(f"tokenizer {self.name} has no {EOS} token")

  def decode(self, ids: Sequence[int]) -> str:
    """Decodes ids; EOS and ids outside the vocabulary (such as -1 padding) are dropped."""
    return super().decode([i for i in ids if int(i) != self.eos_id])


def byte_stand_ins() -> dict[int, str]:
  """GPT-2's byte-to-unicode table, the alphabet of byte-level BPE vocabularies: printable bytes stand
  for themselves, the others for ``chr(256 + n)`` in byte order."""
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  stand_in, extra = {}, 0
  for b in range(256):
    if b in printable:
      stand_in[b] = chr(b)
    else:
      stand_in[b] = chr(256 + extra)
      extra += 1
  return stand_in


def byte_level_tokenizer(eos_token: str = "<eos>") -> HFTokenizer:
  """A ``tokenizers`` tokenizer with exactly :class:`ByteTokenizer`'s ids (byte b is token b, EOS is 256),
  so models trained on bytes export with a tokenizer that transformers understands.

  Args:
    eos_token: the string of the EOS token (id 256).

  Returns:
    An :class:`HFTokenizer` whose ``encode`` and ``decode`` agree with :class:`ByteTokenizer`'s.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  stand_in = byte_stand_ins()
  vocab = {stand_in[b]: b for b in range(256)}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([eos_token])
  return HFTokenizer(tok, eos_id=tok.token_to_id(eos_token))


# ----------------------------------------------------------------------------------------- files


def _read_tokenizer_file(file: str | pathlib.Path):
  """The ``tokenizers.Tokenizer`` in ``file``, refusing a missing or malformed file by name."""
  from tokenizers import Tokenizer

  if not os.path.isfile(file):
    raise TokenizerError(f"{file}: file not found (a tokenizers-format tokenizer.json is required)")
  try:
    return Tokenizer.from_file(str(file))
  except Exception as e:  # tokenizers raises a bare Exception on malformed files
    raise TokenizerError(f"{file}: not a valid tokenizers-format tokenizer.json ({e})") from e


def load_tokenizer(path: str | pathlib.Path) -> BPETokenizer:
  """Loads the tokenizer of a specjax export or training run.

  Args:
    path: a ``tokenizer.json`` or a folder holding one.

  Returns:
    The :class:`BPETokenizer` it holds.

  Raises:
    TokenizerError: a missing or malformed file, or one without ``<|endoftext|>``; naming the file.
  """
  path = pathlib.Path(path)
  file = str(path / "tokenizer.json" if path.is_dir() else path)
  return BPETokenizer(_read_tokenizer_file(file), path=file)


def _json_value(file: str, key: str):
  """``key`` of the JSON object in ``file``; None when the file or the key is absent."""
  if not os.path.isfile(file):
    return None
  try:
    with open(file, encoding="utf-8") as f:
      data = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TokenizerError(f"{file}: not valid JSON ({e})") from e
  if not isinstance(data, dict):
    raise TokenizerError(f"{file}: expected a JSON object, got {type(data).__name__}")
  return data.get(key)


def load_hf_tokenizer(path: str) -> HFTokenizer:
  """Loads the tokenizer of a Hugging Face checkpoint directory.

  Args:
    path: a directory with ``tokenizer.json``. The EOS id comes from ``generation_config.json``,
      ``config.json`` (``eos_token_id``; the first id when a list is given) or ``tokenizer_config.json``
      (``eos_token``), the first found; else None.

  Returns:
    An :class:`HFTokenizer`.

  Raises:
    TokenizerError: a missing or malformed file, or an EOS id outside the vocabulary; naming the file.
  """
  file = os.path.join(path, "tokenizer.json")
  tok = _read_tokenizer_file(file)
  eos_id = None
  for name in ("generation_config.json", "config.json"):
    if eos_id is None:
      eos = _json_value(os.path.join(path, name), "eos_token_id")
      eos_id = eos[0] if isinstance(eos, list) and eos else eos
  if eos_id is None:
    eos = _json_value(os.path.join(path, "tokenizer_config.json"), "eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = tok.token_to_id(eos) if isinstance(eos, str) else None
  return HFTokenizer(tok, eos_id=eos_id, path=file)


# ------------------------------------------------------------------------------- target and draft


def _token_string(tokenizer: Tokenizer, token_id: int) -> str | None:
  if hasattr(tokenizer, "id_to_token"):
    return tokenizer.id_to_token(token_id)
  return tokenizer.decode([token_id])


def check_same_vocab(target_tokenizer: Tokenizer, draft_tokenizer: Tokenizer,
                     probe: str = _PROBE_TEXT) -> None:
  """Refuses a target/draft pair whose tokenizers disagree on the vocabulary.

  Checks, in order: equal ``vocab_size``; the same token string for a spread of up to 512 ids (every
  id for small vocabularies); the same ids for ``probe`` text. Speculative decoding compares token ids
  across the two models, so any disagreement makes the draft's proposals meaningless.

  Args:
    target_tokenizer: the target model's tokenizer.
    draft_tokenizer: the draft model's tokenizer.
    probe: a text both must encode to the same ids.

  Raises:
    TokenizerError: naming what differs (the size, the first differing id and both tokens, or the first
      differing position of the probe's ids).
  """
  va, vb = target_tokenizer.vocab_size, draft_tokenizer.vocab_size
  if va != vb:
    raise TokenizerError(
        f"draft tokenizer vocab_size ({vb}) differs from the target's ({va}): target and draft must share "
        "one vocabulary")
  for i in sorted(set(np.linspace(0, va - 1, min(va, 512)).astype(int).tolist())):
    a, b = _token_string(target_tokenizer, i), _token_string(draft_tokenizer, i)
    if a != b:
      raise TokenizerError(
          f"draft tokenizer maps token id {i} to {b!r} but the target's maps it to {a!r}: target and draft "
          "must share one vocabulary")
  ia, ib = list(target_tokenizer.encode(probe)), list(draft_tokenizer.encode(probe))
  if ia != ib:
    first = next((n for n, (x, y) in enumerate(zip(ia, ib)) if x != y), min(len(ia), len(ib)))
    raise TokenizerError(
        f"draft tokenizer encodes the probe text differently from the target's (first difference at "
        f"position {first}: target ids {ia[first:first + 4]}, draft ids {ib[first:first + 4]}): target "
        "and draft must share one vocabulary")
