"""Every Python block of README.md and docs/*.md runs (or says in a marker why it does not): the
documentation cannot drift from the code. See tests/docblocks.py for the markers."""

from __future__ import annotations

import os
import pathlib

import pytest

import docblocks

ROOT = pathlib.Path(__file__).parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_python_block_runs(path, monkeypatch):
  monkeypatch.chdir(ROOT)
  report = docblocks.run(path)
  assert all(v in ("ran", "skipped") for v in report.values())


def test_the_runner_fails_on_a_broken_block(tmp_path):
  broken = tmp_path / "README.md"
  broken.write_text((ROOT / "README.md").read_text() + "\n```python\nimport specjax\nspecjax.generate(None, [])\n```\n")
  with pytest.raises(AssertionError, match=r"README.md:\d+: the block fails"):
    docblocks.run(broken)


def test_markers_are_checked(tmp_path):
  doc = tmp_path / "x.md"
  doc.write_text('<!-- doc-test: replace "a = 1" "a = 2" -->\n```python\na = 1\n```\n'
                 "<!-- doc-test: skip placeholder paths -->\n```python\nraise SystemExit\n```\n"
                 "```python\nassert a == 2\n```\n")
  assert docblocks.run(doc) == {2: "ran", 6: "skipped", 9: "ran"}  # by the line of each opening fence
  doc.write_text('<!-- doc-test: replace "b = 1" "b = 2" -->\n```python\na = 1\n```\n')
  with pytest.raises(ValueError, match="does not occur"):
    docblocks.run(doc)
  for bad, match in (("<!-- doc-test: skip -->", "needs a reason"), ("<!-- doc-test: maybe -->", "unknown doc-test"),
                     ('<!-- doc-test: replace "x" -->', "pairs")):
    doc.write_text(f"{bad}\n```python\npass\n```\n")
    with pytest.raises(ValueError, match=match):
      docblocks.run(doc)
