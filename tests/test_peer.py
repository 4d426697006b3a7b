"""The side-by-side harness against transformers (benchmarks/peer.py), on a tiny random pair.

Properties: the harness runs end to end and its report has every field; greedy outputs agree token for
token between specjax and transformers for target-only and assisted generation, with the draft equal to
the target and with a different draft; disagreements are located and explained. No wall-clock assertion.
"""

from __future__ import annotations

import os

import pytest

import peer  # benchmarks/peer.py (benchmarks/ is on pytest's pythonpath)

K = 2
MAX_NEW = 6
PROMPTS = ("def f(x):", "import os\n")


@pytest.fixture(scope="module")
def pair():
  return peer.build_pair("tiny")


@pytest.fixture(scope="module")
def report(pair):
  return peer.side_by_side(pair, pair_name="tiny", prompts=PROMPTS, max_new_tokens=MAX_NEW, k=K, repeats=1,
                           prompt_lookup=3, threads=1)


def test_report_has_every_field(report, tmp_path):
  for field in peer.REPORT_FIELDS:
    assert field in report, field
  for field in peer.MACHINE_FIELDS:
    assert field in report["machine"], field
  names = {"specjax none", f"specjax draft k={K} draft=small", f"specjax draft k={K} draft=target", "hf none",
           f"hf assisted k={K} draft=small", f"hf assisted k={K} draft=target",
           "hf assisted default draft=small", "hf prompt lookup 3", f"specjax ngram k={K}", "specjax ngram k=3 n<=2"}
  assert names <= set(report["systems"])
  for name, system in report["systems"].items():
    for field in peer.SYSTEM_FIELDS:
      assert field in system, (name, field)
    assert system["tokens_per_s"] > 0 and system["tokens_per_s_best"] >= system["tokens_per_s"]
    assert len(system["first_call_s"]) == len(PROMPTS) and all(len(t) == 1 for t in system["times_s"])
    assert all(len(row) == MAX_NEW for row in report["outputs"][name])
    assert len(system["stats"]) == len(PROMPTS)
  ratios = report["ratios"]
  assert set(ratios) == {"tokens_per_s", "tokens_per_s_best"}
  ratios = ratios["tokens_per_s"]
  assert set(ratios["specjax_over_hf"]) == {"baseline", "speculation draft=small", "speculation draft=target",
                                            f"ngram k={K} vs prompt lookup 3", "ngram k=3 n<=2 vs prompt lookup 3"}
  assert all(v > 0 for v in ratios["specjax_over_hf"].values())
  assert report["conditions"]["max_new_tokens"] == MAX_NEW and report["machine"]["threads"] == 1
  json_path, md_path = peer.write_report(report, str(tmp_path))
  assert os.path.isfile(json_path)
  markdown = open(md_path).read()
  assert all(name in markdown for name in names)


def test_greedy_outputs_agree_across_engines(report):
  """Target-only and assisted generation, draft == target and a different draft: the same tokens."""
  assert report["disagreements"] == [] and report["nondeterministic_runs"] == []
  for name, system in report["systems"].items():
    assert system["agreement"] == {"vs_specjax_none": True, "vs_transformers_none": True}, name
  assert report["outputs"]["specjax none"] == report["outputs"]["hf none"]


def test_draft_equal_to_target_accepts_everything_in_both_engines(report):
  sj = report["systems"][f"specjax draft k={K} draft=target"]["stats"]
  hf = report["systems"][f"hf assisted k={K} draft=target"]["stats"]
  assert all(s["acceptance_rate"] == 1.0 for s in sj)
  # 6 tokens with k=2: rounds of 3 tokens in both engines, so the same number of target passes.
  assert all(s["rounds"] == 2 for s in sj) and all(s["target_forward_calls"] == 2 for s in hf)
  assert all(s["target_forward_calls"] == MAX_NEW for s in report["systems"]["hf none"]["stats"])


def test_explain_locates_a_disagreement(pair, report, tmp_path):
  hf_target = peer.load_transformers(pair.target, pair.tokenizer, str(tmp_path), threads=1)
  prompt = list(pair.tokenizer.encode(PROMPTS[0]))
  reference = report["outputs"]["specjax none"][0]
  other = list(reference)
  other[3] = (other[3] + 1) % pair.target.cfg.vocab_size
  entry = peer.explain(pair.target, hf_target, prompt, reference, other)
  assert entry["position"] == 3 and entry["reference_token"] == reference[3]
  assert entry["specjax_top2"][0] == entry["transformers_top2"][0] == reference[3]
  assert entry["max_abs_logit_diff_specjax_vs_hf"] < 1e-3
  assert entry["cause"].startswith(("near tie", "unexplained"))


def test_first_difference():
  assert peer.first_difference([1, 2, 3], [1, 2, 3]) is None
  assert peer.first_difference([1, 2, 3], [1, 5, 3]) == 1
  assert peer.first_difference([1, 2], [1, 2, 3]) == 2


def test_pairs_are_named_and_extensible():
  with pytest.raises(ValueError, match="pair must be one of"):
    peer.build_pair("no-such-pair")
  tiny = peer.build_pair("tiny")
  peer.register_pair("custom", lambda: (tiny.target, tiny.draft, tiny.tokenizer))
  try:
    built = peer.build_pair("custom")
    assert built.target is tiny.target and built.description == "custom"
  finally:
    del peer.PAIRS["custom"]
