"""benchmarks/device_check.py runs end to end on CPU with --tiny and writes what the device run will write."""

from __future__ import annotations

import json

import device_check  # benchmarks/ is on the test path (pyproject.toml)


def test_tiny_device_check_writes_every_stage(tmp_path):
  assert device_check.main(["--tiny", str(tmp_path)]) == 0
  report = json.loads((tmp_path / "device_check.json").read_text())
  assert not report["errors"] and not report["skipped"]
  assert report["machine"]["backend"] == "cpu"
  pair = {r["config"]: r for r in report["pair"]["results"]}
  assert set(pair) == {"baseline", "ngram k=1"} and pair["ngram k=1"]["predicted_speedup"] > 0
  assert (tmp_path / "pair" / "report.json").is_file()
  (size,) = report["sizes"]
  assert size["name"] == "tiny" and size["config"]["dtype"] == "bfloat16"
  assert sorted(map(int, size["v"])) == [1, 2] and size["v"]["1"] == 1.0
  base, spec = size["runs"]
  assert base["k"] == 0 and spec["k"] == 1
  assert spec["tau"] == 2.0, "the target as its own draft accepts every greedy proposal: tau = k + 1"
  for key in ("speedup", "predicted_speedup", "predicted_from_v"):
    assert spec[key] > 0, key
  assert spec["compile_s"] > 0  # the first call traces (and compiles) the speculative program; a warm one does not
  (tree,) = size["trees"]
  assert tree["tree"] == "dynamic K=2 D=2 N=3" and tree["speedup"] > 0 and tree["v_window"] > 0
  assert tree["tau"] == 3.0, "draft = target: every tree's path of first choices is accepted, tau = depth + 1"
  cases = {r["case"]: r for r in report["pair_trees"]["results"]}
  assert set(cases) == {"eagle chain k=1", "eagle dynamic K=2 D=2 N=3"}  # the auto case: FULL settings only
  assert cases["eagle dynamic K=2 D=2 N=3"]["ran"] == ["dynamic K=2 D=2 N=3"] and cases["eagle chain k=1"]["ran"] == ["k=1"]
  assert all(r["tau"] >= 1 and r["speedup"] > 0 for r in cases.values())
  text = (tmp_path / "device_check.md").read_text()
  assert "| v(T) |" in text and "| tree (draft = target) |" in text and "chains against token trees" in text
