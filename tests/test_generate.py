"""The speculative loop: exact greedy equality, invariants, statistics, compilation and validation."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from flax import nnx

from helpers import SMALL, make_model, naive_greedy, perturbed_copy
from specjax import SamplingConfig, SpecConfig
from specjax.decode import TRACE_COUNTS, bucket_length
from specjax.models import LlamaConfig

GREEDY = SamplingConfig(temperature=0.0)


def mixed_prompts(batch: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, SMALL.vocab_size, int(rng.integers(1, 12))).tolist() for _ in range(batch)]


def test_baseline_equals_naive_greedy(target):
  prompts = mixed_prompts(3, seed=0)
  out = specjax.generate(target, prompts, max_new_tokens=20)
  assert out.stats.k == 0 and out.stats.drafted_tokens == 0 and out.stats.acceptance_rate is None
  for row, prompt in zip(out.rows(), prompts):
    assert row == naive_greedy(target, prompt, 20)


@pytest.mark.parametrize("batch,k", [(1, 1), (2, 7), (3, 2), (5, 4), (8, 7), (8, 1)])
def test_speculative_greedy_equals_target_greedy(target, draft, batch, k):
  prompts = mixed_prompts(batch, seed=batch * 10 + k)
  base = specjax.generate(target, prompts, max_new_tokens=29)
  spec = specjax.generate(target, prompts, draft=draft, spec=SpecConfig(k=k), max_new_tokens=29)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  np.testing.assert_array_equal(spec.lengths, [29] * batch)
  s = spec.stats
  # The draft is a noisy copy: the run must exercise both acceptance and rejection.
  assert 0 < s.accepted_tokens < s.drafted_tokens
  assert s.drafted_tokens == k * s.row_rounds
  assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.drafted_tokens)
  assert 1.0 <= s.mean_accepted_length <= k + 1
  assert s.rounds < base.stats.rounds


@pytest.mark.parametrize("batch,k", [(1, 6), (4, 4)])
def test_dynamic_schedule_greedy_equals_target_greedy(target, draft, batch, k):
  prompts = mixed_prompts(batch, seed=40 + k)
  base = specjax.generate(target, prompts, max_new_tokens=33)
  spec = specjax.generate(target, prompts, draft=draft, spec=SpecConfig(k=k, schedule="dynamic"),
                          max_new_tokens=33)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  s = spec.stats
  # The schedule shrinks after rejections: fewer proposals than k per round on average, never 0.
  assert s.row_rounds <= s.drafted_tokens < k * s.row_rounds
  assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.drafted_tokens)


def test_dynamic_schedule_with_perfect_draft_keeps_k(target):
  out = specjax.generate(target, mixed_prompts(2, seed=1), draft=target,
                         spec=SpecConfig(k=3, schedule="dynamic"), max_new_tokens=16)
  assert out.stats.drafted_tokens == out.stats.accepted_tokens == 3 * out.stats.row_rounds


@pytest.mark.parametrize("k", [2, 4])
def test_eos_inside_window_ends_rows_exactly(target, k):
  prompts = mixed_prompts(4, seed=3)
  base = specjax.generate(target, prompts, max_new_tokens=24)
  # Pick as EOS a token that appears mid-output in row 0, so the speculative run meets it inside a window
  # (a draft equal to the target proposes k tokens at a time).
  eos = int(base.tokens[0, 9])
  spec = specjax.generate(target, prompts, draft=target, spec=SpecConfig(k=k), max_new_tokens=24,
                          eos_id=eos)
  for b, prompt in enumerate(prompts):
    expected = naive_greedy(target, prompt, 24, eos_id=eos)
    assert spec.rows()[b] == expected
    assert spec.lengths[b] == len(expected)
    assert (spec.tokens[b, len(expected):] == -1).all()
  assert spec.lengths[0] <= 10 and spec.rows()[0][-1] == eos


@pytest.mark.parametrize("max_new", [1, 2, 13, 17])
def test_max_new_tokens_exact_inside_window(target, max_new):
  prompts = mixed_prompts(3, seed=5)
  out = specjax.generate(target, prompts, draft=target, spec=SpecConfig(k=4), max_new_tokens=max_new)
  np.testing.assert_array_equal(out.lengths, [max_new] * 3)
  base = specjax.generate(target, prompts, max_new_tokens=max_new)
  np.testing.assert_array_equal(out.tokens, base.tokens)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.7, top_k=10, top_p=0.9)])
@pytest.mark.parametrize("k", [1, 3])
def test_draft_equal_to_target_accepts_everything(target, sampling, k):
  prompts = mixed_prompts(4, seed=11)
  out = specjax.generate(target, prompts, draft=target, spec=SpecConfig(k=k), sampling=sampling,
                         max_new_tokens=4 * (k + 1), seed=2)
  s = out.stats
  assert s.accepted_tokens == s.drafted_tokens
  assert s.mean_accepted_length == k + 1
  assert s.acceptance_by_position == [1.0] * k
  assert s.rounds == 4


def test_statistics_by_position_are_consistent(target, draft):
  out = specjax.generate(target, mixed_prompts(6, seed=2), draft=draft, spec=SpecConfig(k=4),
                         sampling=SamplingConfig(temperature=1.0), max_new_tokens=40)
  s = out.stats
  # E[n] = sum_i P(n >= i) = sum_i prod_{j<=i} a_j over rounds; here both are counts of the same rounds.
  a = np.array([x if x is not None else 0.0 for x in s.acceptance_by_position])
  assert s.accepted_tokens / s.row_rounds == pytest.approx(float(np.sum(np.cumprod(a))), rel=1e-6)
  assert s.new_tokens == int(out.lengths.sum()) == 6 * 40


def test_seed_reproducibility(target, draft):
  kw = dict(draft=draft, spec=SpecConfig(k=3), sampling=SamplingConfig(temperature=1.0),
            max_new_tokens=16)
  prompts = mixed_prompts(3, seed=4)
  a = specjax.generate(target, prompts, seed=7, **kw)
  b = specjax.generate(target, prompts, seed=7, **kw)
  c = specjax.generate(target, prompts, seed=8, **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert a.stats == b.stats
  assert not np.array_equal(a.tokens, c.tokens)


def test_one_trace_per_prompt_bucket(target, draft):
  assert bucket_length(5) == bucket_length(9) == 16 and bucket_length(17) == 32
  kw = dict(draft=draft, spec=SpecConfig(k=2), max_new_tokens=6, seed=123)
  specjax.generate(target, [[1, 2, 3, 4, 5], [6, 7]], **kw)
  before = TRACE_COUNTS["generate_tokens"]
  specjax.generate(target, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [3]], **kw)
  specjax.generate(target, [[9] * 16, [3, 4, 5]], **kw)
  assert TRACE_COUNTS["generate_tokens"] == before
  specjax.generate(target, [[9] * 17, [3, 4, 5]], **kw)  # next bucket: one new trace
  assert TRACE_COUNTS["generate_tokens"] == before + 1


def test_weights_updated_in_place_are_used_without_a_new_trace():
  # generate keeps each model's split; an in-place weight update must be seen, and must not recompile.
  model = make_model(SMALL, 5)
  other = perturbed_copy(model, 0.5, 6)
  prompts = [[1, 2, 3], [4, 5]]
  kw = dict(draft=model, spec=SpecConfig(k=2), max_new_tokens=8)
  before_update = specjax.generate(model, prompts, **kw)
  traces = TRACE_COUNTS["generate_tokens"]
  nnx.update(model, nnx.state(other))
  after_update = specjax.generate(model, prompts, **kw)
  assert TRACE_COUNTS["generate_tokens"] == traces
  np.testing.assert_array_equal(after_update.tokens, specjax.generate(other, prompts, **{**kw, "draft": other}).tokens)
  assert not np.array_equal(after_update.tokens, before_update.tokens)
  np.testing.assert_array_equal(after_update.tokens, [naive_greedy(other, p, 8) for p in prompts])


def test_a_submodule_replaced_whole_is_used_after_forget_model():
  """The kept split notices arrays replaced in place (above), not a submodule replaced whole (its variables are
  new objects; the kept ones still hold their arrays): generate keeps decoding with the old blocks until
  RUNTIME.forget_model drops the split, as split_model's docstring says."""
  from specjax.runtime import RUNTIME

  model = make_model(SMALL, 5)
  other = perturbed_copy(model, 0.5, 6)
  prompts = [[1, 2, 3], [4, 5]]
  before = specjax.generate(model, prompts, max_new_tokens=8)
  model.blocks = other.blocks
  want = [naive_greedy(model, p, 8) for p in prompts]  # the model as it now is (its own embedding, other's blocks)
  assert want != before.rows()
  assert specjax.generate(model, prompts, max_new_tokens=8).rows() == before.rows()  # the kept split
  RUNTIME.forget_model(model)
  assert specjax.generate(model, prompts, max_new_tokens=8).rows() == want


def test_text_prompts_with_byte_tokenizer():
  tok = specjax.ByteTokenizer()
  cfg = LlamaConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=128)
  model = make_model(cfg)
  out = specjax.generate(model, ["héllo", "a"], tokenizer=tok, max_new_tokens=5)
  assert isinstance(out.text, list) and len(out.text) == 2
  assert out.text[0] == tok.decode(out.rows()[0])
  assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"


def test_any_of_several_stop_tokens_ends_a_row(target, draft):
  """eos_id may list stop tokens (EOS and a chat template's end of turn): a row ends at the first of any."""
  prompts = mixed_prompts(4, seed=11)
  base = specjax.generate(target, prompts, max_new_tokens=20)
  stops = [int(base.tokens[0, 6]), int(base.tokens[2, 11])]
  out = specjax.generate(target, prompts, draft=draft, spec=SpecConfig(k=3), max_new_tokens=20, eos_id=stops)
  for b, row in enumerate(base.rows()):
    cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
    assert out.rows()[b] == row[:cut]
  assert out.lengths[0] <= 7 and out.lengths[2] <= 12


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[]]), r"prompts\[0\] is empty"),
    (dict(prompts=[[1, 2], []]), r"prompts\[1\] is empty"),
    (dict(prompts=[]), "prompts must be a non-empty list"),
    (dict(prompts=[[1, 64]]), r"token id 64 outside the vocabulary \[0, 64\)"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(max_new_tokens=510), r"exceeds the target's cache length max_seq_len=512"),
    (dict(eos_id=99), r"eos_id must be token ids in \[0, 64\), got 99"),
    (dict(eos_id=[1, 2, 3, 4, 5]), "at most 4 stop tokens"),
    (dict(spec=SpecConfig(k=2)), r"spec.k=2 needs a proposer: pass proposer="),
    (dict(spec=SpecConfig(k="auto")), r"spec.k='auto' needs a proposer"),
    (dict(proposer="ngram"), "proposer must be a specjax.proposers.Proposer"),
    (dict(prompts=["text"]), "pass tokenizer="),
    (dict(sampling="greedy"), "sampling must be a SamplingConfig"),
])
def test_generate_rejects_bad_input(target, kwargs, match):
  kwargs = {"prompts": [[1, 2, 3]], **kwargs}
  prompts = kwargs.pop("prompts")
  with pytest.raises(ValueError, match=match):
    specjax.generate(target, prompts, **kwargs)


def test_draft_vocab_must_match(target):
  other = make_model(SMALL.replace(vocab_size=65), 1)
  with pytest.raises(ValueError, match=r"draft vocab_size \(65\) must equal the target's \(64\)"):
    specjax.generate(target, [[1]], draft=other, spec=SpecConfig(k=2))


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=-1), r"k must be an integer in \[0, 32\] or 'auto', got -1"),
    (dict(k=33), r"k must be an integer in \[0, 32\]"),
    (dict(k=2.0), "k must be an integer"),
    (dict(k="fast"), "or 'auto'"),
    (dict(k=0, schedule="dynamic"), "needs k >= 1"),
    (dict(k="auto", k_max=0), r"k_max must be an integer in \[1, 32\]"),
    (dict(schedule="adaptive"), r"schedule must be one of \('static', 'dynamic'\)"),
    (dict(k="auto", schedule="dynamic"), "needs an integer k"),
])
def test_spec_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SpecConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
])
def test_sampling_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingConfig(**kwargs)


def test_max_new_tokens_in_one_bucket_share_a_program_and_cut_exactly(target, draft):
  """20 and 30 new tokens compile one program (bound 32); each call stops at its own max_new_tokens, and the
  shorter call is the longer one's prefix, greedy and sampled (the rows' draws do not depend on the bound)."""
  assert specjax.decode.new_tokens_bound(20) == specjax.decode.new_tokens_bound(32) == 32
  assert specjax.decode.new_tokens_bound(33) == 64 and specjax.decode.new_tokens_bound(1) == 32
  prompts = [[1, 2, 3, 4, 5], [6, 7]]
  for sampling in (specjax.GREEDY, SamplingConfig(temperature=0.9, top_k=10)):
    kw = dict(draft=draft, spec=SpecConfig(k=3), sampling=sampling, seed=5, logprobs=2)
    long = specjax.generate(target, prompts, max_new_tokens=30, **kw)
    before = TRACE_COUNTS["generate_tokens"]
    short = specjax.generate(target, prompts, max_new_tokens=20, **kw)
    assert TRACE_COUNTS["generate_tokens"] == before
    assert short.tokens.shape == (2, 20) and short.top_ids.shape == (2, 20, 2) and (short.lengths == 20).all()
    np.testing.assert_array_equal(short.tokens, long.tokens[:, :20])
    np.testing.assert_array_equal(short.logprobs, long.logprobs[:, :20])
    assert short.stats.new_tokens == 40 and long.stats.new_tokens == 60
