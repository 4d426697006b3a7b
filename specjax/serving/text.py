"""Text out of a token stream: incremental decoding that only emits stable text, and stop strings.

Decoding tokens one at a time is wrong twice over: a multi-byte UTF-8 character can span several tokens
(byte-level BPE, byte tokenizers, byte fallback), and tokenizers that merge or strip spaces decode a token
differently depending on what precedes it. :class:`TextStream` therefore decodes a window that starts a
little before the newest tokens (one earlier token of context) and emits only the text past what it has
already emitted from that window, holding back trailing U+FFFD (the replacement character): an incomplete
character decodes to U+FFFD until its last byte arrives, and a run of invalid bytes is only known to stay
invalid once something valid follows it. The concatenation of what it emits, ``finish()`` included,
equals ``tokenizer.decode(all ids)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
  """Turns a growing sequence of token ids into text pieces that never change once emitted.

  Args:
    tokenizer: anything with ``decode(ids) -> str``.
  """

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.ids: list[int] = []
    self._start = 0  # the window decoded: ids[_start:]
    self._shown = ""  # the part of the window's text already emitted
    self.text = ""  # everything emitted so far

  def push(self, ids: Iterable[int]) -> str:
    """Adds ``ids``; returns the text that became stable (possibly "")."""
    self.ids.extend(int(i) for i in ids)
    now = self.tokenizer.decode(self.ids[self._start:])
    if not now.startswith(self._shown):  # the window's text changed under what was emitted: wait
      return ""
    stable = now.rstrip(REPLACEMENT)
    piece = stable[len(self._shown):]
    self._shown = max(stable, self._shown, key=len)
    if stable == now and len(self.ids) - self._start > 1:
      # Everything decoded is final: the next window starts at the newest token (its left context).
      self._start = len(self.ids) - 1
      self._shown = self.tokenizer.decode(self.ids[self._start:])
    return self._emit(piece)

  def finish(self) -> str:
    """The text not emitted yet (call once the sequence is complete)."""
    now = self.tokenizer.decode(self.ids[self._start:])
    done = len(os.path.commonprefix([now, self._shown]))
    self._start, self._shown = len(self.ids), ""
    return self._emit(now[done:])

  def _emit(self, piece: str) -> str:
    self.text += piece
    return piece


class StopStrings:
  """Cuts a text stream at the first of some stop strings (OpenAI's ``stop``), never emitting text that
  might be the start of one.

  Args:
    stops: the stop strings (non-empty).
  """

  def __init__(self, stops: Sequence[str]):
    if any(not isinstance(s, str) or not s for s in stops):
      raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
    self.stops = tuple(stops)
    self._held = ""
    self.stopped = False

  def push(self, text: str) -> str:
    """Adds ``text``; returns what can be emitted. After a stop string is found (``stopped``), returns
    the text before it once, then nothing."""
    if self.stopped:
      return ""
    held = self._held + text
    cuts = [i for i in (held.find(s) for s in self.stops) if i >= 0]
    if cuts:
      self.stopped, self._held = True, ""
      return held[:min(cuts)]
    # Hold back the longest tail that begins some stop string.
    keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(held)), 0, -1)
                if held.endswith(s[:n])), default=0)
    self._held = held[len(held) - keep:] if keep else ""
    return held[:len(held) - keep]

  def finish(self) -> str:
    """The held-back text (the stream ended without a stop string)."""
    held, self._held = self._held, ""
    return "" if self.stopped else held
