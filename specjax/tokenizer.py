"""A byte-level tokenizer: every UTF-8 byte is a token, plus an end-of-sequence token."""

from __future__ import annotations

from collections.abc import Sequence


class ByteTokenizer:
  """Bytes 0..255 are tokens 0..255; ``eos_id = 256``. ``vocab_size = 257``."""

  vocab_size = 257
  eos_id = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    """Decodes byte tokens; special and out-of-range ids are dropped, invalid UTF-8 is replaced."""
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
