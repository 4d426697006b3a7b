"""The n-gram proposer: lookup against a plain reference, and method "ngram" in the engine (exact greedy
equality, EOS and max_new_tokens inside a window, the dynamic schedule, k="auto") and its validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import SMALL, naive_greedy
from specjax import SamplingConfig, SpecConfig, costmodel
from specjax.proposers import NGram, ngram_propose
from specjax.runtime import RUNTIME


def reference_propose(context: list[int], k: int, n_max: int, n_min: int) -> tuple[list[int], int]:
  """The lookup written out with Python loops over one row's context."""
  newest = len(context) - 1
  for n in range(n_max, n_min - 1, -1):
    suffix = context[len(context) - n:] if n <= len(context) else None
    for j in range(newest - 1, n - 2, -1):  # the most recent occurrence first
      if suffix is not None and context[j - n + 1: j + 1] == suffix:
        period = newest - j
        return [context[j + 1 + i % period] for i in range(k)], n
  return [context[-1]] * k, 0


def random_histories(rng, batch: int, size: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
  """Random rows with ragged lengths, some with a copied segment ending at the row's end; the entries past
  each row's length are random too (they must be ignored)."""
  history = rng.integers(0, vocab, (batch, size)).astype(np.int32)
  length = rng.integers(1, size + 1, batch).astype(np.int32)
  for b in range(batch):
    n = int(length[b])
    if n >= 4 and rng.random() < 0.6:  # plant a repeat: the row's last m tokens copy an earlier span
      m = int(rng.integers(1, min(9, n // 2) + 1))
      start = int(rng.integers(0, n - 2 * m + 1))
      history[b, n - m: n] = history[b, start: start + m]
  return history, length


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 3), (2, 2), (2, 5), (3, 8), (8, 8)])
@pytest.mark.parametrize("vocab", [3, 40])  # many matches, few matches
def test_propose_matches_reference(n_min, n_max, vocab):
  rng = np.random.default_rng(n_min * 100 + n_max * 10 + vocab)
  history, length = random_histories(rng, 64, 24, vocab)
  propose = jax.jit(ngram_propose, static_argnums=(2, 3, 4))
  for k in (1, 5, 12):
    drafts, matched = propose(jnp.asarray(history), jnp.asarray(length), k, n_max, n_min)
    expected = [reference_propose(row[:n].tolist(), k, n_max, n_min) for row, n in zip(history, length)]
    np.testing.assert_array_equal(drafts, [d for d, _ in expected])
    np.testing.assert_array_equal(matched, [m for _, m in expected])
  # The random histories cover rows without a match and matches at the longest n tried.
  assert np.any(matched == 0) and np.any(matched == n_max)


def test_propose_by_hand():
  history = jnp.array([
      [1, 2, 3, 1, 2, 3, 1, 2, 0, 0],  # a loop: "1 2" last seen at 3..4, continue 3 1 2 3 1
      [5, 6, 7, 8, 9, 0, 0, 0, 0, 0],  # 9 never seen before: no match, repeat it
      [4, 4, 4, 4, 7, 7, 7, 7, 7, 7],  # a run: "4 4 4" ends at 2, period 1
      [1, 2, 9, 1, 2, 5, 1, 2, 7, 7],  # "1 2": most recent is at 3..4, followed by 5 then wraps to "1 2"
      [3, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # one token: nothing earlier
      [6, 6, 0, 0, 0, 0, 0, 0, 0, 0],  # "6" occurs at 0 (overlapping the suffix is fine)
  ], jnp.int32)
  length = jnp.array([8, 5, 4, 8, 1, 2], jnp.int32)
  drafts, matched = ngram_propose(history, length, 5, 3, 1)
  np.testing.assert_array_equal(drafts, [[3, 1, 2, 3, 1], [9] * 5, [4] * 5, [5, 1, 2, 5, 1], [3] * 5, [6] * 5])
  np.testing.assert_array_equal(matched, [3, 0, 3, 2, 0, 1])
  # Only n >= 4: row 0's loop still matches (its last 5 tokens occur at 0..4), the rest have no match.
  drafts, matched = ngram_propose(history, length, 2, 8, 4)
  np.testing.assert_array_equal(matched, [5, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(drafts[0], [3, 1])


# ------------------------------------------------------------------------------------- the engine

GREEDY = SamplingConfig(temperature=0.0)


def loop_prompts(batch: int, seed: int) -> list[list[int]]:
  """Mixed lengths; a repeating pattern in most rows, so that lookups match in the prompt already."""
  rng = np.random.default_rng(seed)
  rows = []
  for b in range(batch):
    pattern = rng.integers(0, SMALL.vocab_size, int(rng.integers(1, 5))).tolist()
    length = int(rng.integers(1, 14))
    rows.append((pattern * 14)[:length] if b % 3 != 2 else rng.integers(0, SMALL.vocab_size, length).tolist())
  return rows


def simulate_greedy_rounds(prompt: list[int], greedy: list[int], k: int, max_new: int, n_max: int = 3,
                           n_min: int = 1) -> tuple[int, int]:
  """(rounds, accepted proposals) of greedy n-gram speculation, replayed on the host: each round proposes
  from the true context by the reference lookup and accepts while the proposals equal the target's greedy
  continuation ``greedy`` (at least max_new + k tokens long)."""
  emitted = rounds = accepted = 0
  while emitted < max_new:
    drafts, _ = reference_propose(prompt + greedy[:emitted], k, n_max, n_min)
    n = 0
    while n < k and drafts[n] == greedy[emitted + n]:
      n += 1
    rounds, accepted, emitted = rounds + 1, accepted + n, emitted + n + 1
  return rounds, accepted


@pytest.mark.parametrize("batch,k", [(1, 1), (2, 3), (3, 8), (4, 1), (4, 3), (4, 8)])
def test_ngram_greedy_equals_target_greedy(target, batch, k):
  prompts = loop_prompts(batch, seed=batch * 10 + k)
  base = specjax.generate(target, prompts, max_new_tokens=29 + k)
  spec = specjax.generate(target, prompts, proposer=NGram(), spec=SpecConfig(k=k), max_new_tokens=29)  # no draft=
  np.testing.assert_array_equal(spec.tokens, base.tokens[:, :29])
  np.testing.assert_array_equal(spec.lengths, [29] * batch)
  s = spec.stats
  assert s.drafted_tokens == k * s.row_rounds and s.k == k
  # The engine proposed from each row's true context: its rounds and acceptances match a host replay.
  replay = [simulate_greedy_rounds(p, row, k, 29) for p, row in zip(prompts, base.rows())]
  assert (s.row_rounds, s.accepted_tokens) == tuple(map(sum, zip(*replay)))
  # Small random targets fall into loops under greedy decoding: the lookup then proposes the loop.
  assert 0 < s.accepted_tokens
  assert s.rounds < base.stats.rounds
  assert 1.0 < s.mean_accepted_length <= k + 1


def test_ngram_accepts_a_constant_loop(target):
  """A constant prompt: the lookup proposes the constant; whatever the target does, it is repetitive soon
  and the acceptance is high (the only rejections are where its output changes)."""
  prompts = [[7] * 12, [30] * 5]
  out = specjax.generate(target, prompts, proposer=NGram(), spec=SpecConfig(k=4), max_new_tokens=40)
  np.testing.assert_array_equal(out.tokens, specjax.generate(target, prompts, max_new_tokens=40).tokens)
  assert out.stats.acceptance_rate > 0.5


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (2, 2), (1, 8)])
def test_ngram_lengths_keep_exactness(target, n_min, n_max):
  prompts = loop_prompts(3, seed=n_min + n_max)
  base = specjax.generate(target, prompts, max_new_tokens=20)
  spec = specjax.generate(target, prompts, proposer=NGram(n_max=n_max, n_min=n_min), spec=SpecConfig(k=3),
                          max_new_tokens=20)
  np.testing.assert_array_equal(spec.tokens, base.tokens)


@pytest.mark.parametrize("k", [3, 8])
def test_ngram_eos_inside_window_ends_rows_exactly(target, k):
  # Row 0's prompt is a prompt followed by its own greedy output: the continuation repeats tokens of the
  # prompt, so EOS (a token of the continuation seen in the prompt) can arrive as an accepted proposal.
  head = [5, 9, 13]
  first = naive_greedy(target, head, 16)
  prompts = [head + first, [2, 4] * 4, [11]]
  base = specjax.generate(target, prompts, max_new_tokens=24)
  later = [int(t) for t in base.tokens[0, 2:12] if int(t) in prompts[0]]
  assert later, "the continuation shares no token with the prompt: pick another head"
  eos = later[0]
  spec = specjax.generate(target, prompts, proposer=NGram(), spec=SpecConfig(k=k), max_new_tokens=24, eos_id=eos)
  for b, prompt in enumerate(prompts):
    expected = naive_greedy(target, prompt, 24, eos_id=eos)
    assert spec.rows()[b] == expected
    assert spec.lengths[b] == len(expected)
    assert (spec.tokens[b, len(expected):] == -1).all()
  assert spec.rows()[0][-1] == eos and spec.stats.accepted_tokens > 0


@pytest.mark.parametrize("max_new", [1, 2, 13, 17])
def test_ngram_max_new_tokens_exact_inside_window(target, max_new):
  prompts = [[3, 4] * 6, [8] * 9, [1, 2, 3]]
  out = specjax.generate(target, prompts, proposer=NGram(), spec=SpecConfig(k=8), max_new_tokens=max_new)
  np.testing.assert_array_equal(out.lengths, [max_new] * 3)
  np.testing.assert_array_equal(out.tokens, specjax.generate(target, prompts, max_new_tokens=max_new).tokens)


def test_ngram_dynamic_schedule_greedy_equals_target_greedy(target):
  prompts = loop_prompts(4, seed=3)
  base = specjax.generate(target, prompts, max_new_tokens=33)
  spec = specjax.generate(target, prompts, proposer=NGram(), spec=SpecConfig(k=6, schedule="dynamic"), max_new_tokens=33)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  s = spec.stats
  assert s.row_rounds <= s.drafted_tokens < 6 * s.row_rounds  # the schedule did shrink


def test_ngram_auto_k_follows_the_calibrated_costs(target):
  """k="auto" with the n-gram proposer picks k_max when verification is cheap and 0 when it is expensive
  (the tables are placed by hand where the calibration would put them)."""
  prompts = [[1, 2, 3] * 3, [4, 5]]
  base = specjax.generate(target, prompts, max_new_tokens=20)
  proposer = NGram()
  for verify_cost, expected_k in ((lambda t: 1.0, 4), (lambda t: 5.0 * t, 0)):
    key = costmodel.table_key(target, proposer, 2, 4, GREEDY, n_tokens=32)
    costmodel.COST_TABLES[key] = costmodel.CostTable(batch=2, verify={t: verify_cost(t) for t in range(1, 6)},
                                                     proposer_step=0.0)
    RUNTIME.auto_k.clear()
    out = specjax.generate(target, prompts, proposer=proposer, spec=SpecConfig(k="auto", k_max=4), max_new_tokens=20)
    assert out.stats.k == expected_k
    np.testing.assert_array_equal(out.tokens, base.tokens)
  RUNTIME.clear()


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_max=0), r"NGram.n_max must be an integer in \[1, 8\], got 0"),
    (dict(n_max=9), r"NGram.n_max must be an integer in \[1, 8\], got 9"),
    (dict(n_max=2.0), r"NGram.n_max must be an integer in \[1, 8\], got 2.0"),
    (dict(n_min=0), r"NGram.n_min must be an integer in \[1, 8\], got 0"),
    (dict(n_min=True), r"NGram.n_min must be an integer in \[1, 8\], got True"),
    (dict(n_min=4, n_max=3), r"NGram.n_min \(4\) must be <= n_max \(3\)"),
])
def test_ngram_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    NGram(**kwargs)
