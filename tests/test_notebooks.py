"""The notebooks in colab/ run top to bottom in a real Jupyter kernel (nbclient + ipykernel), as a user's
runtime runs them, with their tiny settings (``SPECJAX_NOTEBOOK_TINY=1``, read by each parameters cell).

Cells tagged ``install`` (the pip cell for a fresh runtime) are left out: specjax is installed here. Every
notebook checks what it shows with its own assertions; a failing cell fails the test.
"""

from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "colab").glob("*.ipynb"))


def run_notebook(path: pathlib.Path, timeout: int = 600):
  """Executes ``path`` in a fresh ``python3`` kernel (this interpreter's); returns the executed notebook."""
  import nbformat
  from nbclient import NotebookClient

  nb = nbformat.read(str(path), as_version=4)
  nb.cells = [c for c in nb.cells if "install" not in c.get("metadata", {}).get("tags", [])]
  client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
  client.execute()
  return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch, tmp_path):
  monkeypatch.setenv("SPECJAX_NOTEBOOK_TINY", "1")  # the kernel inherits it: every parameters cell goes tiny
  monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' tempfile.mkdtemp folders go with the test's
  nb = run_notebook(path)
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  assert any(o.get("output_type") in ("stream", "execute_result", "display_data") for o in outputs), \
      f"{path.name} shows nothing"


def test_every_notebook_has_a_parameters_cell_and_an_install_cell():
  import nbformat

  for path in NOTEBOOKS:
    nb = nbformat.read(str(path), as_version=4)
    tags = [t for c in nb.cells for t in c.get("metadata", {}).get("tags", [])]
    assert "parameters" in tags and "install" in tags, path.name
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]  # as stored (nbformat.read adds missing ids)
    ids = [c.get("id") for c in cells]
    assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: a cell without an id of its own (nbformat 4.5)"


def test_a_failing_cell_fails_the_run(tmp_path):
  import nbformat
  from nbclient.exceptions import CellExecutionError

  nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("assert x == 2")])
  path = tmp_path / "broken.ipynb"
  nbformat.write(nb, str(path))
  with pytest.raises(CellExecutionError):
    run_notebook(path, timeout=120)
