"""`specjax bench`: the report carries every figure the issue names (no wall-clock assertions)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from helpers import SMALL, make_model, perturbed_copy
from specjax import bench
from specjax.models.heads import build_heads
from specjax.proposers import DraftModel, Medusa

RESULT_FIELDS = {
    "sampling", "batch", "config", "method", "k", "k_setting", "schedule", "ttft_s", "ttft_p90_s", "total_s",
    "total_p90_s", "itl_mean_s", "itl_p50_s", "itl_p90_s", "output_tokens_per_s", "requests_per_s",
    "warmup_s", "compile_s_estimate", "rounds", "acceptance_rate", "tau", "acceptance_by_position",
    "speedup", "predicted_speedup", "prior_predicted_speedup", "predicted_s", "catch_ups",
    "measured_over_predicted", "target_param_bytes", "proposer_param_bytes",
    "kv_cache_bytes", "device_peak_bytes"}


@pytest.fixture(scope="module")
def report():
  target = make_model(SMALL, 0)
  draft = perturbed_copy(target, 0.15, 1)
  rows = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
  settings = bench.BenchSettings(batch_sizes=(2,), ks=(2,), samplings=("greedy",),
                                 methods=("draft", "medusa"), max_new_tokens=6, repeats=2, calibration_repeats=1, calibration_min_seconds=1e-4)
  proposers = {"draft": DraftModel(draft), "medusa": Medusa(build_heads("medusa", target.cfg, num_heads=2))}
  return bench.run(target, proposers, rows, settings, progress=False)


def test_report_has_every_field(report):
  for field in ("backend", "device_kind", "cpu", "cores", "jax"):
    assert field in report["machine"]
  configs = {(r["sampling"], r["batch"], r["config"]) for r in report["results"]}
  assert len(configs) == len(report["results"]) == 7  # baseline; per method k=2, dynamic, auto
  for r in report["results"]:
    assert RESULT_FIELDS <= set(r), RESULT_FIELDS - set(r)
    assert r["ttft_s"] > 0 and r["total_s"] > 0 and r["kv_cache_bytes"] > 0
    if r["method"] == "none":
      assert r["speedup"] == 1.0 and r["acceptance_rate"] is None and r["proposer_param_bytes"] == 0
    elif r["schedule"] == "static" and r["k"] > 0:
      assert 0.0 <= r["acceptance_rate"] <= 1.0 and 1.0 <= r["tau"] <= r["k"] + 1
      assert r["predicted_speedup"] > 0
  assert len(report["summary"]) == 2  # greedy x (draft, medusa)
  assert {"best_fixed_k", "auto_k", "auto_speedup", "auto_over_best", "dynamic_speedup",
          "measured_over_predicted_median", "best_config", "method"} <= set(report["summary"][0])
  assert len(report["cost_tables"]) == 2 and {t["method"] for t in report["cost_tables"]} == {"draft", "medusa"}
  for t in report["cost_tables"]:
    assert sorted(t["rounds"]) == [0, 1, 2] and sorted(t["propose"]) == [1, 2]
    assert t["catch_up"] == (t["method"] == "draft")
  assert report["proposers"]["medusa"] == {"method": "medusa", "heads": 2, "param_bytes": 2 * (32 * 32 + 32) * 4}
  kv = {r["config"]: r["kv_cache_bytes"] for r in report["results"]}
  assert kv["draft k=2"] > kv["medusa k=2"] > kv["baseline"]  # the draft's cache; Medusa keeps one hidden state per row


def test_report_files(report, tmp_path):
  paths = bench.write(report, str(tmp_path))
  names = sorted(os.path.basename(p) for p in paths)
  assert names == ["greedy.png", "report.json", "report.md"]
  assert json.load(open(tmp_path / "report.json"))["results"] == json.loads(json.dumps(report["results"]))
  md = open(tmp_path / "report.md").read()
  assert md.count("| greedy | 2 | draft k=2 |") == 1
  assert md.count("| greedy | 2 | medusa k=2 |") == 1
  # results (7 rows), summary and calibration (a row per method each)
  assert "## Calibration" in md and md.count("| greedy | 2 | ") == 7 + 2 + 2
  assert open(tmp_path / "greedy.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_sizes=(0,)), "batch_sizes must be integers >= 1"),
    (dict(ks=(0, 2)), r"ks must be integers in \[1, 32\]"),
    (dict(samplings=("beam",)), r"samplings must be names among greedy, sample .* got 'beam'"),
        (dict(samplings=()), "samplings must name at least one"),
    (dict(methods=("lookahead",)), r"methods must be a non-empty subset of \('draft', 'pard', 'ngram', 'suffix', 'medusa'"),
    (dict(max_new_tokens=1), "max_new_tokens must be >= 2"),
])
def test_settings_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    bench.BenchSettings(**kwargs)


def test_pilot_prompts_reach_every_auto_case_and_the_report():
  """BenchSettings.pilot_prompts: every k='auto' case's SpecConfig carries them (the fixed-k and dynamic cases
  none), checked as SpecConfig checks them; the report says how many; refused without the auto cases."""
  settings = bench.BenchSettings(batch_sizes=(1,), ks=(2,), samplings=("greedy",), methods=("draft", "ngram"),
                                 pilot_prompts=[[1, 2, 3], (4, 5)])
  assert settings.pilot_prompts == ((1, 2, 3), (4, 5))
  cases = bench._configurations(list(settings.methods), settings)
  specs = {c.name: c.spec() for c in cases}
  assert {n for n, s in specs.items() if s.pilot_prompts is not None} == {"draft auto", "ngram auto"}
  assert specs["draft auto"].pilot_prompts == ((1, 2, 3), (4, 5))
  with pytest.raises(ValueError, match=r"pilot_prompts\[1\] must be a non-empty sequence"):
    bench.BenchSettings(pilot_prompts=[[1], []])
  with pytest.raises(ValueError, match="need auto=True"):
    bench.BenchSettings(auto=False, pilot_prompts=[[1]])
  report = {"machine": bench.machine(), "settings": json.loads(json.dumps(dataclasses.asdict(settings))),
            "target": {"param_bytes": 1}, "proposers": {}, "results": [], "summary": [], "cost_tables": []}
  assert "k=auto piloted on 2 given prompts" in bench.markdown(report)
