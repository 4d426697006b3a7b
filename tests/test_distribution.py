"""Speculative sampling preserves the target's warped distribution: chi-square tests that are shown to
fail when the correction step is broken (sampling from p instead of normalize(max(0, p - q)))."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

import specjax
import specjax.acceptance
from helpers import full_logits, make_model
from specjax import SamplingConfig, SpecConfig
from specjax.models.heads import build_heads
from specjax.proposers import MTP, DraftModel, Eagle, Medusa, NGram
from specjax.sampling import row_keys
from specjax.models import LlamaConfig

TINY = LlamaConfig(vocab_size=12, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=64)
PROMPT = [3, 7, 1, 9]
NGRAM_PROMPT = [3, 7, 1, 3, 7]  # repeats itself: the n-gram lookup matches from the first round
PASS_P = 1e-3  # a correct sampler fails this at a fixed seed with probability 1e-3
FAIL_P = 1e-8


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
  """Pearson's test of ``counts`` against ``probs``; cells expecting fewer than 5 are pooled."""
  counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
  n = counts.sum()
  expected = n * probs
  small = expected < 5
  if small.any():
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
  assert np.all(counts[expected == 0] == 0), "a sample landed where the target has zero probability"
  keep = expected > 0
  stat = float(np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep]))
  return float(sps.chi2.sf(stat, keep.sum() - 1))


def exact_joint(target, sampling: SamplingConfig, steps: int, prompt: list[int] = PROMPT) -> np.ndarray:
  """The target's warped joint distribution of the first ``steps`` tokens, by enumeration: ``[V] * steps``."""
  v = TINY.vocab_size
  joint = np.ones([v] * steps)
  for prefix_len in range(steps):
    prefixes = list(itertools.product(range(v), repeat=prefix_len))
    seqs = np.array([prompt + list(p) for p in prefixes], np.int32)
    logits = full_logits(target, seqs)[:, -1]
    cond = np.asarray(specjax.warp(jnp.asarray(logits), sampling))  # [V^prefix_len, V]
    cond = cond.reshape([v] * prefix_len + [v] + [1] * (steps - prefix_len - 1))
    joint = joint * cond
  return joint


def sample_joint(target, proposer, sampling, k: int, steps: int, n: int, seed: int,
                 schedule: str = "static", prompt: list[int] = PROMPT) -> np.ndarray:
  if not isinstance(proposer, specjax.proposers.Proposer):
    proposer = DraftModel(proposer)
  out = specjax.generate(target, [prompt] * n, proposer=proposer, spec=SpecConfig(k=k, schedule=schedule),
                         sampling=sampling, max_new_tokens=steps, seed=seed)
  assert (out.lengths == steps).all()
  counts = np.zeros([TINY.vocab_size] * steps)
  np.add.at(counts, tuple(out.tokens[:, i] for i in range(steps)), 1)
  return counts, out.stats


@pytest.fixture(scope="module")
def pair():
  # A deliberately mismatched draft: another random model, so p and q differ a lot.
  return make_model(TINY, seed=0), make_model(TINY, seed=5)


@pytest.fixture
def broken_correction(monkeypatch):
  """Replaces the correction distribution max(0, p - q) by p: the classic sampler bug."""
  jax.clear_caches()
  monkeypatch.setattr(specjax.acceptance, "residual", lambda p, q: p)
  yield
  monkeypatch.undo()
  jax.clear_caches()


CASES = [
    # (sampling, k, steps): covers the bonus path (k < steps), temperature != 1, top-k and top-p.
    (SamplingConfig(temperature=1.0), 1, 2),
    (SamplingConfig(temperature=0.6), 2, 3),
    (SamplingConfig(temperature=1.4, top_k=5), 2, 2),
    (SamplingConfig(temperature=1.0, top_p=0.7), 3, 2),
]


@pytest.mark.parametrize("sampling,k,steps", CASES)
def test_speculative_sampling_matches_target_distribution(pair, sampling, k, steps):
  target, draft = pair
  counts, st = sample_joint(target, draft, sampling, k, steps, n=20_000, seed=0)
  assert 0.05 < st.acceptance_rate < 0.95  # both acceptance and correction are exercised
  assert chi_square_pvalue(counts, exact_joint(target, sampling, steps)) > PASS_P


def test_dynamic_schedule_matches_target_distribution(pair):
  """A dynamic schedule masks proposals past its current length; the output law must not change."""
  target, draft = pair
  sampling = SamplingConfig(temperature=1.0)
  counts, st = sample_joint(target, draft, sampling, 3, 3, n=20_000, seed=1, schedule="dynamic")
  assert st.drafted_tokens < 3 * st.row_rounds  # the schedule did shrink
  assert chi_square_pvalue(counts, exact_joint(target, sampling, 3)) > PASS_P


@pytest.mark.parametrize("sampling,k,steps", CASES[:2])
def test_the_test_fails_on_a_broken_correction(pair, broken_correction, sampling, k, steps):
  target, draft = pair
  counts, _ = sample_joint(target, draft, sampling, k, steps, n=20_000, seed=0)
  assert chi_square_pvalue(counts, exact_joint(target, sampling, steps)) < FAIL_P


NGRAM_CASES = [
    # (sampling, k, steps): the bonus path (k < steps) at temperature 1, and top-k, where proposals outside
    # the top k have p = 0 and are always rejected.
    (SamplingConfig(temperature=1.0), 2, 3),
    (SamplingConfig(temperature=1.4, top_k=5), 3, 2),
]


@pytest.mark.parametrize("sampling,k,steps", NGRAM_CASES)
def test_ngram_sampling_matches_target_distribution(pair, sampling, k, steps):
  """A deterministic proposer (q = one-hot) keeps the output law: accept with p(d), else p without d."""
  target, _ = pair
  counts, st = sample_joint(target, NGram(), sampling, k, steps, n=20_000, seed=2,
                            prompt=NGRAM_PROMPT)
  assert 0.05 < st.acceptance_rate < 0.95  # both acceptance and correction are exercised
  assert chi_square_pvalue(counts, exact_joint(target, sampling, steps, NGRAM_PROMPT)) > PASS_P


def test_ngram_dynamic_schedule_matches_target_distribution(pair):
  """Under a dynamic schedule the one-hot q is zero past the current length, as a draft's skipped steps. With
  k = 2 and 3 tokens, rows that reject in round 1 draw token 3 after accepting the single proposal of round 2
  (k_now = 1), where a one-hot q left at position 2 would wrongly remove d_2 (this test then fails)."""
  target, _ = pair
  sampling = SamplingConfig(temperature=1.0)
  counts, st = sample_joint(target, NGram(), sampling, 2, 3, n=20_000, seed=4, schedule="dynamic",
                            prompt=NGRAM_PROMPT)
  assert st.drafted_tokens < 2 * st.row_rounds  # the schedule did shrink
  assert chi_square_pvalue(counts, exact_joint(target, sampling, 3, NGRAM_PROMPT)) > PASS_P


@pytest.mark.parametrize("sampling,k,steps", NGRAM_CASES)
def test_the_ngram_test_fails_on_a_broken_correction(pair, broken_correction, sampling, k, steps):
  target, _ = pair
  counts, _ = sample_joint(target, NGram(), sampling, k, steps, n=20_000, seed=2,
                           prompt=NGRAM_PROMPT)
  assert chi_square_pvalue(counts, exact_joint(target, sampling, steps, NGRAM_PROMPT)) < FAIL_P


# Heads on the target, randomly initialised (so q differs from p a lot); EAGLE-3 over a reduced draft
# vocabulary (8 of the 12 ids: q is zero on the others, whose mass only the residual can give).
HEADS = {
    "medusa": lambda t: Medusa(build_heads("medusa", t.cfg, num_heads=3, seed=1)),
    "eagle1": lambda t: Eagle(build_heads("eagle1", t.cfg, seed=2)),
    "eagle3": lambda t: Eagle(build_heads("eagle3", t.cfg, seed=3, draft_vocab_size=8,
                                          d2t=np.array([0, 2, 3, 5, 7, 8, 10, 11]))),
    "mtp": lambda t: MTP(build_heads("mtp", t.cfg, num_heads=2, seed=4)),
}
HEAD_CASES = [(SamplingConfig(temperature=1.0), 2, 3), (SamplingConfig(temperature=0.7, top_k=5), 3, 2)]
# Every head at the first case; at the second (a warp, k = 3 past the steps) a head that draws its proposals in
# turn from its own rollout (EAGLE-1) and one that has all its logits at once (Medusa). EAGLE-3 and MTP roll out
# as EAGLE-1 does (chain.py), and the warp is the engine's, the same for every proposer.
HEAD_LAW_CASES = [(head, *case) for head in sorted(HEADS) for case in HEAD_CASES
                  if case is HEAD_CASES[0] or head in ("eagle1", "medusa")]


@pytest.mark.parametrize("head,sampling,k,steps", HEAD_LAW_CASES)
def test_heads_keep_the_target_distribution(pair, head, sampling, k, steps):
  """Every head proposer hands accept() the q it sampled from: the output law is the target's."""
  target, _ = pair
  counts, st = sample_joint(target, HEADS[head](target), sampling, k, steps, n=20_000, seed=5)
  assert 0.02 < st.acceptance_rate < 0.98  # both acceptance and correction are exercised (thousands of each)
  assert chi_square_pvalue(counts, exact_joint(target, sampling, steps)) > PASS_P


# The correction is the engine's, one for every proposer: the heads test's power is shown on EAGLE-3 over its
# reduced vocabulary (q is zero on 4 of the 12 ids, whose mass only the correction gives) and on MTP's two heads.
@pytest.mark.parametrize("head", ["eagle3", "mtp"])
def test_the_heads_test_fails_on_a_broken_correction(pair, broken_correction, head):
  target, _ = pair
  sampling, k, steps = HEAD_CASES[0]
  counts, _ = sample_joint(target, HEADS[head](target), sampling, k, steps, n=20_000, seed=5)
  assert chi_square_pvalue(counts, exact_joint(target, sampling, steps)) < FAIL_P


# A confidence cutoff (specjax.proposers.chain.ChainHeads.cutoff) at which this random head keeps its second
# proposal in about 4 rounds of 10: rows and rounds verify windows of both lengths.
def _cutoff_head(target):
  return Eagle(build_heads("eagle1", target.cfg, seed=2), cutoff=0.02)


def test_a_confidence_cutoff_keeps_the_target_distribution(pair):
  """Proposals cut where the head's own confidence falls (a per-row, per-round count, and a shorter verify
  pass when every row stops early) leave the law the target's: the count reads only the head's probabilities."""
  target, _ = pair
  sampling, k, steps = HEAD_CASES[0]
  counts, st = sample_joint(target, _cutoff_head(target), sampling, k, steps, n=20_000, seed=5)
  assert 1.2 < st.drafted_tokens / st.row_rounds < 1.8  # one proposal in some rounds, two in others
  assert 0.02 < st.acceptance_rate < 0.98
  assert chi_square_pvalue(counts, exact_joint(target, sampling, steps)) > PASS_P


def test_the_cutoff_test_fails_on_a_rule_that_reads_the_draw(pair, monkeypatch):
  """The test's power, on the natural mistake: keeping proposal j when the head's probability of the token it
  drew there is high (instead of its largest probability, known before the draw) keeps likely draws more often,
  so a kept proposal no longer follows q. The test above sees it. (Its power on a broken correction is the
  heads test's above, same head, sampling and k.)"""
  import specjax.proposers.chain as chain

  target, _ = pair
  sampling, k, steps = HEAD_CASES[0]
  jax.clear_caches()
  monkeypatch.setattr(chain, "top_probability", lambda probs, drawn: jnp.take_along_axis(probs, drawn[:, None], 1)[:, 0])
  try:
    counts, _ = sample_joint(target, _cutoff_head(target), sampling, k, steps, n=20_000, seed=5)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  assert chi_square_pvalue(counts, exact_joint(target, sampling, steps)) < FAIL_P


def _accept_first_token(p, q, n, seed):
  """First emitted token of one k=1 window, n times, with d ~ q."""
  key_d, key_a = jax.random.split(jax.random.key(seed))
  b = n
  pb = jnp.broadcast_to(p, (b,) + p.shape)
  qb = jnp.broadcast_to(q, (b,) + q.shape)
  d = specjax.sample(qb[:, 0], row_keys(key_d, b))[:, None]  # [B, 1]
  nacc, token = jax.jit(specjax.accept)(pb, qb, d, row_keys(key_a, b))
  first = jnp.where(nacc > 0, d[:, 0], token)
  return np.bincount(np.asarray(first), minlength=p.shape[-1])


@pytest.mark.parametrize("seed", [0, 1])
def test_accept_rule_first_token_follows_p(seed):
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.full(10, 0.5), size=2).astype(np.float32)  # [k+1=2, V]
  q = rng.dirichlet(np.full(10, 0.5), size=1).astype(np.float32)  # [k=1, V]
  counts = _accept_first_token(jnp.asarray(p), jnp.asarray(q), 200_000, seed)
  assert chi_square_pvalue(counts, p[0]) > PASS_P


def test_accept_rule_unit_test_fails_when_broken(broken_correction):
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.full(10, 0.5), size=2).astype(np.float32)
  q = rng.dirichlet(np.full(10, 0.5), size=1).astype(np.float32)
  counts = _accept_first_token(jnp.asarray(p), jnp.asarray(q), 200_000, 0)
  assert chi_square_pvalue(counts, p[0]) < FAIL_P


def test_greedy_accept_table():
  """Temperature 0 makes p and q one-hot: accept while d_i = argmax p_i, then emit argmax p_{n+1}."""
  v = 5
  onehot = lambda idx: jax.nn.one_hot(jnp.asarray(idx), v)
  target_argmax = jnp.array([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 4, 4]])  # [B, k+1]
  drafts = jnp.array([[1, 2], [1, 0], [0, 2], [4, 4]])  # [B, k]
  for greedy in (False, True):  # the general rule and its random-free greedy path agree
    n, tok = specjax.accept(onehot(target_argmax), onehot(drafts), drafts, row_keys(0, 4), greedy=greedy)
    np.testing.assert_array_equal(n, [2, 1, 0, 2])
    np.testing.assert_array_equal(tok, [3, 2, 1, 4])


def test_accept_without_proposals_draws_the_bonus_from_p1():
  """k = 0 (target-only rounds): n = 0 and the token follows p_1 (chi-square), greedy its argmax."""
  rng = np.random.default_rng(3)
  p = jnp.asarray(rng.dirichlet(np.full(10, 0.5), size=1).astype(np.float32))  # [k+1=1, V]
  b = 200_000
  pb = jnp.broadcast_to(p, (b,) + p.shape)
  no_drafts = jnp.zeros((b, 0), jnp.int32)
  n, token = jax.jit(specjax.accept)(pb, jnp.zeros((b, 0, 10)), no_drafts, row_keys(1, b))
  assert not np.any(np.asarray(n))
  assert chi_square_pvalue(np.bincount(np.asarray(token), minlength=10), np.asarray(p[0])) > PASS_P
  n, token = specjax.accept(pb[:4], jnp.zeros((4, 0, 10)), no_drafts[:4], row_keys(1, 4), greedy=True)
  np.testing.assert_array_equal(token, np.full(4, int(np.argmax(p[0]))))


def test_warp_matches_numpy_reference():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 9)).astype(np.float32) * 2
  for cfg in [SamplingConfig(0.7), SamplingConfig(1.3, top_k=3), SamplingConfig(1.0, top_p=0.6),
              SamplingConfig(0.9, top_k=5, top_p=0.8)]:
    z = logits / cfg.temperature
    if cfg.top_k:
      kth = np.sort(z, axis=-1)[:, -cfg.top_k][:, None]
      z = np.where(z >= kth, z, -np.inf)
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    if cfg.top_p < 1:
      for row in ref:
        order = np.argsort(-row)
        before = np.cumsum(row[order]) - row[order]
        row[order[before >= cfg.top_p]] = 0
        row /= row.sum()
    np.testing.assert_allclose(np.asarray(specjax.warp(jnp.asarray(logits), cfg)), ref, rtol=1e-5, atol=1e-7)
  greedy = np.asarray(specjax.warp(jnp.asarray(logits), SamplingConfig(0.0)))
  np.testing.assert_array_equal(greedy, np.eye(9)[logits.argmax(-1)])


def test_per_row_settings_warp_each_row_as_its_own_config():
  from specjax.sampling import FULL, Counts, Mode, RowSettings, warp_logits

  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(6, 3, 11)).astype(np.float32) * 2)
  configs = [SamplingConfig(0.0), SamplingConfig(0.7), SamplingConfig(1.3, top_k=3), SamplingConfig(1.0, top_p=0.6),
             SamplingConfig(0.9, top_k=5, top_p=0.8), SamplingConfig(1.1, min_p=0.2, top_p=0.9)]

  def rows(configs, mode):
    return jax.tree.map(jnp.asarray, RowSettings.of(configs, [1] * len(configs), [()] * len(configs), 11, mode))

  for mode in (FULL, Mode.of(configs)):
    counts = None
    if mode.adjusts:
      counts = Counts(jnp.zeros((len(configs), 11), jnp.int32), jnp.zeros((len(configs), 11), bool))
    got = np.asarray(warp_logits(logits, rows(configs, mode), mode, counts))
    for b, cfg in enumerate(configs):
      np.testing.assert_allclose(got[b], np.asarray(specjax.warp(logits[b], cfg)), rtol=1e-5, atol=1e-7)
  # No row filtering: the sort-free branch, same result.
  plain = [SamplingConfig(0.5), SamplingConfig(0.0), SamplingConfig(2.0)]
  got = np.asarray(warp_logits(logits[:3], rows(plain, Mode.of(plain)), Mode.of(plain)))
  for b, cfg in enumerate(plain):
    np.testing.assert_allclose(got[b], np.asarray(specjax.warp(logits[b], cfg)), rtol=1e-5, atol=1e-7)


def test_per_row_keys_make_each_rows_draws_its_own_and_follow_the_weights():
  from specjax.sampling import sample, split_keys, uniform

  keys = jax.random.split(jax.random.key(3), 4)
  w = jnp.asarray(np.random.default_rng(0).dirichlet(np.ones(6), size=4).astype(np.float32))
  # Row 2's draws depend on its key alone: the same key in another batch draws the same.
  alone = sample(w[2:3], keys[2:3])
  np.testing.assert_array_equal(sample(w, keys)[2:3], alone)
  np.testing.assert_array_equal(uniform(keys, (4, 3))[1], uniform(keys[1:2], (1, 3))[0])
  assert split_keys(keys, 5).shape == (5, 4)
  # And the draws follow the weights (one row, many keys).
  many = jax.random.split(jax.random.key(4), 60_000)
  counts = np.bincount(np.asarray(sample(jnp.broadcast_to(w[0], (60_000, 6)), many)), minlength=6)
  assert chi_square_pvalue(counts, np.asarray(w[0])) > PASS_P
