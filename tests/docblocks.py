"""Runs the Python code blocks of a Markdown document, so the documentation cannot drift from the code.

Every fenced ```` ```python ```` block of a document runs, in order, in one namespace (a later block may use
what an earlier one defined), with the repository root as the working directory. An HTML comment on the
line just before a block's fence changes how it runs:

- ``<!-- doc-test: skip REASON -->``: the block is not meant to run (placeholder paths, a long training
  run); the reason is required.
- ``<!-- doc-test: replace "OLD" "NEW" ... -->``: run with each ``OLD`` replaced by ``NEW`` (tiny settings
  for a block that would be slow as written); every ``OLD`` must occur in the block.
- ``<!-- doc-test: requires NAME ["OLD" "NEW" ...] -->``: run only where ``specjax.load(NAME)`` finds its
  file (the GGUF models that are fetched by hand), else skip it; with the replacements, as ``replace`` does.

Shell blocks (```` ```bash ```` or ```` ```sh ````) are not run, but every line in them that starts with
``specjax`` must parse with the ``specjax`` command's own parser, and every ``--config`` file it names must
exist (:func:`commands`, :func:`check_commands`); a ``skip`` marker before the block exempts it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex

_FENCE = re.compile(r"^```python[ \t]*$")
_SHELL_FENCE = re.compile(r"^```(bash|sh|shell)[ \t]*$")
_MARKER = re.compile(r"^<!--\s*doc-test:\s*(\w+)\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
  line: int  # 1-based line of the opening fence
  code: str
  action: str = "run"  # run | skip | replace | requires
  args: tuple[str, ...] = ()


def blocks(text: str) -> list[Block]:
  """The Python blocks of a Markdown text with their markers.

  Raises:
    ValueError: an unknown marker, a skip without reason, a replace with an odd number of strings, or an
      unclosed fence (naming the line).
  """
  lines = text.splitlines()
  out, i = [], 0
  while i < len(lines):
    if not _FENCE.match(lines[i]):
      i += 1
      continue
    start = i
    j = i + 1
    while j < len(lines) and lines[j].strip() != "```":
      j += 1
    if j == len(lines):
      raise ValueError(f"line {start + 1}: a ```python block is never closed")
    action, args = "run", ()
    m = _MARKER.match(lines[start - 1]) if start > 0 else None
    if m:
      action, rest = m.group(1), m.group(2)
      args = tuple(shlex.split(rest))
      if action not in ("skip", "replace", "requires"):
        raise ValueError(f"line {start}: unknown doc-test marker {action!r} (skip, replace, requires)")
      if action == "skip" and not args:
        raise ValueError(f"line {start}: doc-test skip needs a reason")
      if action == "replace" and (not args or len(args) % 2):
        raise ValueError(f"line {start}: doc-test replace needs pairs of \"OLD\" \"NEW\" strings")
      if action == "requires" and (not args or len(args) % 2 == 0):
        raise ValueError(f"line {start}: doc-test requires needs a model name, then pairs of \"OLD\" \"NEW\"")
    out.append(Block(start + 1, "\n".join(lines[start + 1:j]), action, args))
    i = j + 1
  return out


def _available(name: str) -> bool:
  """Whether ``specjax.load(name)`` finds its model: for a GGUF model fetched by hand, whether its file is
  found (without loading it: the block loads it), else whether the name is registered."""
  from specjax import loading

  if name in loading.GGUF_NAMES:
    try:
      loading.find_gguf(name)
    except FileNotFoundError:
      return False
    return True
  return name in loading.PRETRAINED


def run(path: str | pathlib.Path, namespace: dict | None = None) -> dict:
  """Executes the document's blocks as described in the module docstring; returns what ran, by line.

  Raises:
    Whatever a block raises, with the document and line added to the message (a failing block fails).
  """
  path = pathlib.Path(path)
  namespace = {"__name__": "__doc__"} if namespace is None else namespace
  report = {}
  for block in blocks(path.read_text(encoding="utf-8")):
    code = block.code
    if block.action == "skip" or (block.action == "requires" and not _available(block.args[0])):
      report[block.line] = "skipped"
      continue
    if block.action in ("replace", "requires"):
      pairs = block.args if block.action == "replace" else block.args[1:]
      for old, new in zip(pairs[::2], pairs[1::2]):
        if old not in code:
          raise ValueError(f"{path}:{block.line}: doc-test replace: {old!r} does not occur in the block")
        code = code.replace(old, new)
    try:
      exec(compile(code, f"{path}:{block.line}", "exec"), namespace)
    except Exception as e:
      raise AssertionError(f"{path}:{block.line}: the block fails: {type(e).__name__}: {e}") from e
    report[block.line] = "ran"
  return report


@dataclasses.dataclass(frozen=True)
class Command:
  line: int  # 1-based line where the command starts
  argv: tuple[str, ...]  # the arguments after ``specjax``
  skipped: bool


def commands(text: str) -> list[Command]:
  """The ``specjax ...`` command lines of a Markdown text's shell blocks (continuation lines joined,
  comments dropped), each marked skipped when a ``doc-test: skip`` marker precedes its block."""
  lines = text.splitlines()
  out, i = [], 0
  while i < len(lines):
    if not _SHELL_FENCE.match(lines[i]):
      i += 1
      continue
    m = _MARKER.match(lines[i - 1]) if i > 0 else None
    skipped = bool(m and m.group(1) == "skip")
    j = i + 1
    while j < len(lines) and lines[j].strip() != "```":
      start, command = j, lines[j]
      while command.rstrip().endswith("\\") and j + 1 < len(lines):
        j += 1
        command = command.rstrip()[:-1] + " " + lines[j]
      words = shlex.split(command, comments=True)
      if words[:1] == ["specjax"]:
        out.append(Command(start + 1, tuple(words[1:]), skipped))
      j += 1
    if j == len(lines):
      raise ValueError(f"line {i + 1}: a shell block is never closed")
    i = j + 1
  return out


def check_commands(path: str | pathlib.Path, root: str | pathlib.Path) -> dict:
  """Parses every ``specjax`` command line of the document's shell blocks with the CLI's parser; returns
  ``{line: "parsed" | "skipped"}``.

  Raises:
    AssertionError: a command the parser refuses, or a ``--config`` file that does not exist under
      ``root``, naming the document and line.
  """
  from specjax.cli import CliError, build_parser

  path, root = pathlib.Path(path), pathlib.Path(root)
  report = {}
  for c in commands(path.read_text(encoding="utf-8")):
    if c.skipped:
      report[c.line] = "skipped"
      continue
    try:
      args = build_parser().parse_args(list(c.argv))
    except (CliError, SystemExit) as e:
      raise AssertionError(f"{path}:{c.line}: specjax {' '.join(c.argv)}: the command line is refused: {e}") from e
    config = getattr(args, "config", None)
    if config is not None and not (root / config).is_file():
      raise AssertionError(f"{path}:{c.line}: --config {config} does not exist")
    report[c.line] = "parsed"
  return report
