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
  """A README whose last block calls the API wrongly fails, naming the file and the block's line (the blocks
  before it ran: their names are seen by it)."""
  broken = tmp_path / "README.md"
  broken.write_text("# x\n\n```python\nimport specjax\nprompts = []\n```\n\ntext\n\n"
                    "```python\nspecjax.generate(None, prompts)\n```\n")
  with pytest.raises(AssertionError, match=r"README.md:10: the block fails"):
    docblocks.run(broken)
  broken.write_text(broken.read_text().replace("specjax.generate(None, prompts)", "assert prompts == []"))
  assert docblocks.run(broken) == {3: "ran", 10: "ran"}


def test_markers_are_checked(tmp_path):
  doc = tmp_path / "x.md"
  doc.write_text('<!-- doc-test: replace "a = 1" "a = 2" -->\n```python\na = 1\n```\n'
                 "<!-- doc-test: skip placeholder paths -->\n```python\nraise SystemExit\n```\n"
                 "```python\nassert a == 2\n```\n")
  assert docblocks.run(doc) == {2: "ran", 6: "skipped", 9: "ran"}  # by the line of each opening fence
  doc.write_text('<!-- doc-test: requires stdlib-coder "a = 1" "a = 3" -->\n```python\na = 1\n```\n'
                 '<!-- doc-test: requires no-such-model -->\n```python\nraise SystemExit\n```\n'
                 "```python\nassert a == 3\n```\n")
  assert docblocks.run(doc) == {2: "ran", 6: "skipped", 9: "ran"}
  doc.write_text('<!-- doc-test: replace "b = 1" "b = 2" -->\n```python\na = 1\n```\n')
  with pytest.raises(ValueError, match="does not occur"):
    docblocks.run(doc)
  for bad, match in (("<!-- doc-test: skip -->", "needs a reason"), ("<!-- doc-test: maybe -->", "unknown doc-test"),
                     ('<!-- doc-test: requires x "a" -->', "a model name, then pairs"),
                     ('<!-- doc-test: replace "x" -->', "pairs")):
    doc.write_text(f"{bad}\n```python\npass\n```\n")
    with pytest.raises(ValueError, match=match):
      docblocks.run(doc)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_command_line_parses(path):
  report = docblocks.check_commands(path, ROOT)
  assert all(v in ("parsed", "skipped") for v in report.values())


def test_the_guide_runs_and_checks_its_command_lines():
  """The guide exists, has runnable blocks and command lines, and skips only what is not on main."""
  guide = ROOT / "docs" / "guide.md"
  text = guide.read_text()
  blocks = docblocks.blocks(text)
  assert sum(b.action != "skip" for b in blocks) >= 8
  assert all("not on main" in " ".join(b.args) for b in blocks if b.action == "skip")
  assert len([c for c in docblocks.commands(text) if not c.skipped]) >= 8


def test_a_broken_command_line_fails(tmp_path):
  doc = tmp_path / "guide.md"
  good = "```bash\nspecjax generate --prompt 'x' --k auto  # a comment\nspecjax train heads --kind mtp \\\n" \
         "  --config train/configs/stdlib_heads_mtp.toml\n```\n"
  doc.write_text(good)
  assert docblocks.check_commands(doc, ROOT) == {2: "parsed", 3: "parsed"}
  for bad, match in (("specjax generate --prompt x --method sideways", "refused"),
                     ("specjax generate --k 0.5 --prompt x", "refused"),
                     ("specjax train draft --config train/configs/missing.toml", "does not exist")):
    doc.write_text(f"```bash\n{bad}\n```\n")
    with pytest.raises(AssertionError, match=match):
      docblocks.check_commands(doc, ROOT)
  doc.write_text(f'<!-- doc-test: skip "not on main" -->\n```bash\nspecjax serve --port 1\n```\n')
  assert docblocks.check_commands(doc, ROOT) == {3: "skipped"}


def test_a_broken_block_in_a_copy_of_the_guide_fails(tmp_path):
  """Teeth: the guide with one call changed to a wrong keyword fails the run, naming the line."""
  text = (ROOT / "docs" / "guide.md").read_text()
  assert "tau = costmodel.expected_tau(a, 4)" in text
  broken = tmp_path / "guide.md"
  broken.write_text(text.replace("tau = costmodel.expected_tau(a, 4)", "tau = costmodel.expected_tau(a, k=4, n=1)", 1))
  with pytest.raises(AssertionError, match=r"guide.md:\d+: the block fails: TypeError"):
    docblocks.run(broken)
