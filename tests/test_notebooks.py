"""The notebooks in colab/ run as written (their install cells aside)."""

from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "colab").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
  monkeypatch.setenv("SPECJAX_NOTEBOOK_TINY", "1")  # notebooks with a parameters cell run their tiny settings
  cells = json.loads(path.read_text())["cells"]
  code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
  code = [c for c in code if not c.lstrip().startswith(("!", "%", "# Install"))]
  assert code, f"{path.name} has no code cells"
  exec(compile("\n\n".join(code), str(path), "exec"), {"__name__": "__notebook__"})


def test_there_is_a_notebook():
  assert NOTEBOOKS
