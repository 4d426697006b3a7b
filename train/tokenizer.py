"""A byte-level BPE tokenizer trained with the ``tokenizers`` library, and the wrapper specjax uses.

Byte-level: every byte sequence is encodable (no unknown token), and decoding inverts encoding exactly.
The only special token is ``<|endoftext|>``, the EOS that separates documents and ends generation.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Iterable, Sequence

EOS = "<|endoftext|>"


class TokenizerError(ValueError):
  """A tokenizer file is missing, unreadable, or does not fit the model; the message names the path."""


class BPETokenizer:
  """``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``, ``eos_id``.

  Usable as ``tokenizer=`` in :func:`specjax.generate`.
  """

  def __init__(self, tokenizer, path: str | None = None):
    self._tok = tokenizer
    self.path = path
    self.vocab_size = tokenizer.get_vocab_size()
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
      raise TokenizerError(f"tokenizer {path or '(in memory)'} has no {EOS} token")
    self.eos_id = eos

  @classmethod
  def load(cls, path: str | pathlib.Path) -> BPETokenizer:
    """Loads ``tokenizer.json`` (or a folder holding it)."""
    from tokenizers import Tokenizer

    path = pathlib.Path(path)
    if path.is_dir():
      path = path / "tokenizer.json"
    if not path.is_file():
      raise TokenizerError(f"tokenizer file {path} does not exist")
    try:
      tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception on malformed JSON
      raise TokenizerError(f"tokenizer file {path} is not a valid tokenizers JSON file: {e}") from e
    return cls(tok, str(path))

  def save(self, path: str | pathlib.Path) -> None:
    self._tok.save(str(path))

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Sequence[int]) -> str:
    """Decodes ids; EOS and ids outside the vocabulary (such as -1 padding) are dropped."""
    ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size and int(i) != self.eos_id]
    return self._tok.decode(ids, skip_special_tokens=True)

  def fingerprint(self) -> str:
    """SHA-256 of the serialised tokenizer: equal fingerprints encode identically."""
    return hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()[:16]

  def check_model(self, vocab_size: int, where: str) -> None:
    """Raises :class:`TokenizerError` unless the tokenizer's vocabulary equals a model's ``vocab_size``."""
    if self.vocab_size != vocab_size:
      raise TokenizerError(
          f"tokenizer {self.path or '(in memory)'} has vocab_size {self.vocab_size} but {where} has model.vocab_size "
          f"{vocab_size}: they must match")


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
  """Trains a byte-level BPE with exactly ``vocab_size`` tokens (256 bytes, merges and EOS).

  Deterministic for the same texts (single pass, fixed order).
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
  tok.train_from_iterator(texts, trainer=trainer)
  out = BPETokenizer(tok)
  if out.vocab_size != vocab_size:
    raise TokenizerError(f"the corpus is too small for data.tokenizer_vocab={vocab_size}: BPE found only "
                         f"{out.vocab_size} tokens")
  return out
