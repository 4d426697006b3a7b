"""``specjax train curve``: validation τ (heads) or perplexity (models) against training tokens, from runs."""

from __future__ import annotations

import json

import pytest

import specjax.cli
from specjax.train import curves


def write_run(folder, kind: str, lines: list[dict], batch: int = 8, seq_len: int = 256):
  folder.mkdir(parents=True)
  (folder / "config.json").write_text(json.dumps({"kind": kind, "data": {"batch_size": batch, "seq_len": seq_len}}))
  (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  return folder


def test_curves_read_validation_lines_against_tokens_and_plot(tmp_path, capsys):
  heads = write_run(tmp_path / "heads", "heads", [
      {"step": 10, "loss": 3.0}, {"step": 100, "valid_tau_greedy": 1.4, "valid_tau_t1": 1.3},
      {"step": 200, "valid_tau_greedy": 1.5, "valid_tau_t1": 1.45},
      {"step": 200, "valid_tau_greedy": 1.55, "valid_tau_t1": 1.5},  # resumed: the later line wins
      {"step": 150, "valid_tau_greedy": 1.45, "valid_tau_t1": 1.4}])
  got = curves.read_curves(heads)
  assert got == {"valid_tau_greedy": [(100 * 2048, 1.4), (150 * 2048, 1.45), (200 * 2048, 1.55)],
                 "valid_tau_t1": [(100 * 2048, 1.3), (150 * 2048, 1.4), (200 * 2048, 1.5)]}
  draft = write_run(tmp_path / "draft", "draft", [{"step": 50, "valid_ppl": 300.0, "valid_loss": 5.7}], batch=4,
                    seq_len=128)
  assert curves.read_curves(draft) == {"valid_ppl": [(50 * 512, 300.0)]}
  out = tmp_path / "curve.png"
  assert specjax.cli.main(["train", "curve", str(heads), str(draft), "--out", str(out)]) == 0
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  printed = capsys.readouterr().out
  assert "heads: valid_tau_greedy: 0.20M 1.400, 0.31M 1.450, 0.41M 1.550" in printed


def test_a_folder_that_is_no_run_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"is not a training run: .*config.json does not exist"):
    curves.read_curves(tmp_path)
  empty = write_run(tmp_path / "run", "heads", [{"step": 10, "loss": 2.0}])
  with pytest.raises(ValueError, match=r"metrics.jsonl holds no validation line \(valid_tau_greedy or valid_tau_t1\)"):
    curves.read_curves(empty)
