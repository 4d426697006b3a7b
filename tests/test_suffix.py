"""Suffix decoding (``specjax.proposers.Suffix``, ``SuffixStore``) and the combined proposer (``Combined``):
the match, the counts, the budget and the rows' isolation against plain references; the store's FIFO bound;
exactness in the engine (greedy equality with the target alone, chi-square tests of the sampled law shown
to fail on a broken sampler); a combined proposer with a member disabled equals the other member; the server's
store learns finished requests; bad input named by field."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import specjax.acceptance
from helpers import SMALL, make_model, naive_greedy, perturbed_copy
from specjax import SamplingConfig, SpecConfig
from specjax.config import MAX_K
from specjax.proposers import Combined, DraftModel, NGram, ParallelDraft, Suffix, SuffixStore
from specjax.proposers.base import Context, Features, Proposal, Proposer
from specjax.proposers.suffix import MAX_MATCH, suffix_stores
from specjax.request import Request
from specjax.sampling import Mode, Sampler, row_keys
from specjax.serving.slots import SlotEngine
from test_distribution import FAIL_P, PASS_P, TINY, broken_correction, chi_square_pvalue, exact_joint  # noqa: F401

V = 50
FAKE_TARGET = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=V))


def propose(proposer: Suffix, rows: list[list[int]], k: int, width: int = 64):
  """``(drafts, limit, score)`` of one round for rows whose contexts are ``rows`` (the last token is ``last``);
  the history past each row's length holds junk that must never be read."""
  history = np.full((len(rows), width), 7, np.int32)  # junk: 7 is a token the tests' contexts use too
  for b, row in enumerate(rows):
    history[b, :len(row)] = row
  lengths = np.asarray([len(r) - 1 for r in rows], np.int32)
  ctx = Context(last=jnp.asarray([r[-1] for r in rows]), lengths=jnp.asarray(lengths),
                active=jnp.ones((len(rows),), bool))
  bound = proposer
  if proposer.store is not None:  # what the jitted program sees: the store's module
    bound = proposer.bind(*zip(*[nnx_split(m) for m in proposer.modules()]))
  out = bound.propose(jnp.asarray(history), FAKE_TARGET, ctx, row_keys(0, len(rows)), k, None, None)
  assert out.q.shape == (len(rows), k, V)
  np.testing.assert_array_equal(np.asarray(out.q).argmax(-1), np.asarray(out.drafts))  # deterministic: one-hot
  return np.asarray(out.drafts), np.asarray(out.limit), np.asarray(out.score)


def nnx_split(module):
  from flax import nnx

  return nnx.split(module)


def proposed(drafts, limit, b):
  return drafts[b, :limit[b]].tolist()


# ---------------------------------------------------------------------------------------- the match


def test_a_passage_repeated_in_the_prompt_is_proposed_in_full():
  passage = [11, 12, 13, 14, 15, 16, 17, 18, 19]
  row = [1, 2] + passage + [3, 4] + passage[:4]  # the tail "11 12 13 14" matches the first passage
  drafts, limit, score = propose(Suffix(), [row], k=8)
  assert proposed(drafts, limit, 0) == passage[4:8]  # its continuation, up to the budget
  assert limit[0] == 4  # budget floor(1 * m) with m = 4 matched tokens
  np.testing.assert_allclose(score[0], 4.0)  # one occurrence: every path probability is 1
  drafts, limit, _ = propose(Suffix(alpha=2.0), [row], k=8)
  assert proposed(drafts, limit, 0) == passage[4:] + [3, 4, 11]  # twice the match: the passage and beyond


def test_counts_pick_the_most_frequent_continuation_and_stop_below_the_threshold():
  store = SuffixStore.from_tokens([[5, 6, 8, 9, 10]] * 3 + [[5, 6, 20, 21]], V, capacity=64)
  drafts, limit, score = propose(Suffix(store=store, own=False, alpha=4.0), [[30, 5, 6]], k=5)
  assert proposed(drafts, limit, 0) == [8, 9, 10]  # 3 of 4 occurrences continue with 8; the text ends after 10
  np.testing.assert_allclose(score[0], 0.75 * 3)
  drafts, limit, _ = propose(Suffix(store=store, own=False, alpha=4.0, min_token_prob=0.8), [[30, 5, 6]], k=5)
  assert limit[0] == 0  # 0.75 is below the threshold
  # Ties go to the most recent occurrence.
  store = SuffixStore.from_tokens([[5, 6, 8], [5, 6, 9]], V, capacity=64)
  drafts, limit, _ = propose(Suffix(store=store, own=False, min_token_prob=0.5), [[5, 6]], k=2)
  assert proposed(drafts, limit, 0) == [9]


def test_the_budget_follows_the_match_length():
  base = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]
  for m in (1, 2, 3, 5):
    row = [40] + base + [41, 42] + base[:m]
    for alpha, beta in ((1.0, 0.0), (2.0, 0.0), (0.5, 1.0)):
      _, limit, _ = propose(Suffix(alpha=alpha, beta=beta), [row], k=8)
      assert limit[0] == min(8, int(np.floor(alpha * m + beta))), (m, alpha, beta)
  _, limit, _ = propose(Suffix(max_match=2), [[40] + base + [41] + base[:5]], k=8)
  assert limit[0] == 2  # the match is capped at max_match, and so is the budget


def test_rows_never_read_past_their_length_nor_another_rows_context():
  # Row 0's context repeats; row 1's does not, and the junk past its length (7s) would match "7".
  rows = [[3, 4, 5, 6, 3, 4], [8, 9, 10, 7]]
  drafts, limit, _ = propose(Suffix(), rows, k=4)
  assert proposed(drafts, limit, 0) == [5, 6]
  assert limit[1] == 0  # no earlier 7 in its own context; row 0 and the junk are invisible to it
  # A match may not be the row's own tail, and a continuation stops at the row's newest token.
  drafts, limit, _ = propose(Suffix(alpha=4.0), [[1, 2, 1, 2]], k=4)
  assert proposed(drafts, limit, 0) == [1, 2]


def test_per_request_and_global_candidates_are_chosen_by_score():
  store = SuffixStore.from_tokens([[33, 34, 35, 36, 37, 38]], V, capacity=32)
  # Own context: "34 35" (m = 2, score 2); the store matches "33 34 35" (m = 3, score 3): the store wins.
  drafts, limit, score = propose(Suffix(store=store), [[34, 35, 1, 9, 33, 34, 35]], k=4)
  assert proposed(drafts, limit, 0) == [36, 37, 38] and score[0] == 3
  # Own context "40 34 35" (m = 3, score 3) against the store's "34 35" (m = 2): the own context wins.
  drafts, limit, score = propose(Suffix(store=store), [[40, 34, 35, 2, 3, 40, 34, 35]], k=4)
  assert proposed(drafts, limit, 0) == [2, 3, 40] and score[0] == 3
  # The score, not the match length, decides: a budget of 4 over the own context (alpha = 2) scores 4 > 3.
  drafts, limit, score = propose(Suffix(store=store, alpha=2.0), [[34, 35, 1, 9, 33, 34, 35]], k=4)
  assert proposed(drafts, limit, 0) == [1, 9, 33, 34] and score[0] == 4


@pytest.mark.parametrize("vocab", [3, 12])  # long and frequent matches, short and rare ones
def test_the_stores_sorted_index_finds_what_a_scan_of_every_position_finds(vocab):
  """The binary searches over the store's sorted keys give the longest match of a scan of every position, and
  the same occurrences (their continuations, as a multiset) whenever the match has at most max_occurrences of
  them."""
  from specjax.proposers.suffix import _tail, occurrences, store_occurrences

  rng = np.random.default_rng(vocab)
  docs = [rng.integers(0, vocab, int(rng.integers(1, 30))).tolist() for _ in range(12)]
  store = SuffixStore.from_tokens(docs, vocab, capacity=200, max_match=8)
  history = jnp.asarray(rng.integers(0, vocab, (64, 20)), jnp.int32)
  newest = jnp.asarray(rng.integers(0, 20, 64), jnp.int32)
  tail = _tail(history, newest, 8)
  tokens = jnp.asarray(store.module.tokens[...])[None, :]
  m_scan, ahead_scan = occurrences(tokens, tail, tokens >= 0, 5, 256)
  m_index, ahead_index = store_occurrences(store.module, tail, 5, 256)
  np.testing.assert_array_equal(m_index, m_scan)
  assert np.any(np.asarray(m_scan) >= 3) and np.any(np.asarray(m_scan) <= 1)
  for b in range(64):
    rows = lambda a: sorted(map(tuple, np.asarray(a[b])[np.asarray(a[b])[:, 0] >= 0].tolist()))
    assert rows(ahead_index) == rows(ahead_scan), b


def test_the_store_keeps_its_bound_by_evicting_the_oldest_documents():
  store = SuffixStore(V, capacity=10)
  store.add([1, 2, 3])
  store.add([4, 5])
  assert store.tokens().tolist() == [1, 2, 3, -1, 4, 5, -1] and store.documents == 2
  store.add([6, 7, 8, 9])  # 5 more: the oldest document goes
  assert store.tokens().tolist() == [4, 5, -1, 6, 7, 8, 9, -1] and len(store) == 8 <= store.capacity
  store.add(list(range(20, 40)))  # longer than the buffer: its newest capacity - 1 tokens, alone
  assert store.tokens().tolist() == list(range(31, 40)) + [-1] and store.documents == 1
  np.testing.assert_array_equal(np.asarray(store.module.tokens[...]), store.tokens())
  store.add(np.asarray([41, 42, -1, -1]))  # an output's -1 padding is dropped
  assert store.tokens().tolist() == [41, 42, -1]


# -------------------------------------------------------------------------------------- exactness


@pytest.fixture(scope="module")
def target():
  return make_model(SMALL, seed=0)


REPEAT_PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22, 23, 20, 21], [30, 31, 32, 33, 34, 35, 36]]


def test_greedy_suffix_and_combined_equal_the_target_alone(target):
  reference = [naive_greedy(target, p, 20) for p in REPEAT_PROMPTS]
  # The store holds the target's own answers to the first two prompts: long matches, many proposals.
  store = SuffixStore.from_tokens([p + r for p, r in zip(REPEAT_PROMPTS[:2], reference)], SMALL.vocab_size, 256)
  draft = make_model(SMALL, seed=3)
  for proposer, spec in ((Suffix(), SpecConfig(k=4)), (Suffix(store=store), SpecConfig(k=8)),
                         (Suffix(store=store, own=False), SpecConfig(k=8, schedule="dynamic")),
                         (Suffix(store=store), SpecConfig(k=4, tree="3-2-1")),
                         (Suffix(store=store), SpecConfig(k=4, tree="dynamic:2,4,6")),
                         (Combined((Suffix(store=store), DraftModel(draft))), SpecConfig(k=4)),
                         (Combined((Suffix(store=store), DraftModel(draft))), SpecConfig(k=4, tree="dynamic:2,4,6"))):
    out = specjax.generate(target, REPEAT_PROMPTS, proposer=proposer, spec=spec, max_new_tokens=20)
    assert out.tokens.tolist() == reference, (proposer.name, spec)
    if isinstance(proposer, Suffix) and proposer.store is not None and spec.tree is None:
      assert out.stats.mean_accepted_length > 2  # the stored answers are proposed and accepted


def test_suffix_proposes_fewer_tokens_per_row_and_counts_them():
  target = make_model(SMALL, seed=0)
  out = specjax.generate(target, [[5, 6, 7, 5, 6]], proposer=Suffix(), spec=SpecConfig(k=6), max_new_tokens=8)
  st = out.stats
  assert st.drafted_tokens < 6 * st.row_rounds  # rows proposed what their matches support, not k each


def sample_joint(target, proposer, sampling, k, steps, n, seed, prompt):
  out = specjax.generate(target, [prompt] * n, proposer=proposer, spec=SpecConfig(k=k), sampling=sampling,
                         max_new_tokens=steps, seed=seed)
  assert (out.lengths == steps).all()
  counts = np.zeros([TINY.vocab_size] * steps)
  np.add.at(counts, tuple(out.tokens[:, i] for i in range(steps)), 1)
  return counts, out.stats


@pytest.fixture(scope="module")
def tiny_case():
  """A random target and draft over 12 tokens, and a prompt that repeats its opening after the target's own
  greedy continuation of it: the suffix match proposes tokens the target finds likely (and not certain)."""
  target, draft = make_model(TINY, seed=0), make_model(TINY, seed=5)
  opening = [3, 7, 1, 9]
  greedy = naive_greedy(target, opening, 4)
  prompt = opening + greedy + [2] + opening
  members = (Suffix(store=SuffixStore.from_tokens([opening + greedy[::-1]], TINY.vocab_size, capacity=32),
                    alpha=2.0, min_token_prob=0.3), DraftModel(draft))
  return target, prompt, (Suffix(alpha=2.0), Combined(members, expected=(None, 1.5)))


SAMPLED = [(SamplingConfig(temperature=1.0), 3, 3), (SamplingConfig(temperature=0.7, top_k=5), 4, 2)]


@pytest.mark.parametrize("sampling,k,steps", SAMPLED)
def test_suffix_and_combined_sampling_match_the_target_distribution(tiny_case, sampling, k, steps):
  target, prompt, proposers = tiny_case
  exact = exact_joint(target, sampling, steps, prompt)
  for proposer in proposers:
    counts, st = sample_joint(target, proposer, sampling, k, steps, n=20_000, seed=3, prompt=prompt)
    assert 0.05 < st.acceptance_rate < 0.95, proposer.name  # both acceptance and correction are exercised
    assert st.drafted_tokens < k * st.row_rounds  # rows proposed fewer than k: the per-row limit is exercised
    assert chi_square_pvalue(counts, exact) > PASS_P, proposer.name


@pytest.mark.parametrize("sampling,k,steps", SAMPLED[:1])
def test_the_suffix_test_fails_on_a_broken_correction(tiny_case, broken_correction, sampling, k, steps):
  target, prompt, proposers = tiny_case
  exact = exact_joint(target, sampling, steps, prompt)
  combined = proposers[-1]  # its rounds are the suffix's where the suffix's score wins: both corrections run
  counts, _ = sample_joint(target, combined, sampling, k, steps, n=20_000, seed=3, prompt=prompt)
  assert chi_square_pvalue(counts, exact) < FAIL_P, combined.name


def test_a_combined_proposer_with_a_member_disabled_equals_the_other_member(target):
  prompts = REPEAT_PROMPTS
  store = SuffixStore.from_tokens([p + naive_greedy(target, p, 12) for p in prompts[:1]], SMALL.vocab_size, 128)
  suffix, ngram = Suffix(store=store), NGram(n_max=2)
  sampling = SamplingConfig(temperature=0.8)
  for alone, expected in ((ngram, (float("-inf"), 1.0)), (suffix, (None, float("-inf")))):
    a = specjax.generate(target, prompts, proposer=alone, spec=SpecConfig(k=4), sampling=sampling,
                         max_new_tokens=16, seed=7)
    b = specjax.generate(target, prompts, proposer=Combined((suffix, ngram), expected=expected),
                         spec=SpecConfig(k=4), sampling=sampling, max_new_tokens=16, seed=7)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert (a.stats.rounds, a.stats.drafted_tokens, a.stats.accepted_tokens, a.stats.acceptance_by_position) == (
        b.stats.rounds, b.stats.drafted_tokens, b.stats.accepted_tokens, b.stats.acceptance_by_position)


def test_a_draft_model_member_that_was_not_chosen_keeps_its_cache_current(target):
  """A combined round verifies the suffix's proposals; the draft model's cache holds its own, which the
  commit must not count as seen: its next proposals equal a draft model's that saw only the accepted text."""
  draft = make_model(SMALL, seed=3)
  prompt = REPEAT_PROMPTS[0]
  greedy = naive_greedy(target, prompt, 16)
  store = SuffixStore.from_tokens([prompt + greedy], SMALL.vocab_size, 64)
  combined = Combined((Suffix(store=store), DraftModel(draft)))
  out = specjax.generate(target, [prompt], proposer=combined, spec=SpecConfig(k=4), max_new_tokens=16)
  assert out.tokens.tolist() == [greedy]
  alone = specjax.generate(target, [prompt], proposer=DraftModel(draft), spec=SpecConfig(k=4), max_new_tokens=16)
  assert out.stats.rounds < alone.stats.rounds  # the stored answer was chosen and accepted in long runs


def test_members_skipped_in_some_rounds_and_chosen_in_others_keep_greedy_exact(target):
  """Suffix decoding with an EAGLE-3 head and with a parallel draft (which catches up on what it skipped): the store holds the start of the target's
  answer and, apart, its continuation from token 10, so the suffix match is chosen, then the member (which
  proposed nothing while the suffix was chosen: its state as its last commit left it), then the suffix again."""
  from test_pard import with_mask_row
  from test_proposers import proposers_for

  prompt = REPEAT_PROMPTS[2]
  reference = naive_greedy(target, prompt, 24)
  store = SuffixStore.from_tokens([prompt + reference[:8], reference[10:]], SMALL.vocab_size, 128)
  members = proposers_for(target)
  for member in (members["eagle3"], ParallelDraft(with_mask_row(perturbed_copy(target, 0.15, 1)))):
    combined = Combined((Suffix(store=store, own=False), member), ks=(None, 2))
    out = specjax.generate(target, [prompt], proposer=combined, spec=SpecConfig(k=6), max_new_tokens=24)
    assert out.tokens.tolist() == [reference], member.name
    assert out.stats.accepted_tokens >= 8 + 6, member.name  # the stored stretches were chosen and accepted


class Counting(Proposer):
  """A member that proposes token 0 and counts its proposal passes per row in its state."""

  name = "counting"
  may_skip_propose = True

  def init(self, target, prompts, prompt_lens, features, max_len):
    return jnp.zeros(prompts.shape[:1], jnp.int32)

  def propose(self, state, target, ctx, keys, k, sampler, steps):
    batch = ctx.last.shape[0]
    q = jnp.zeros((batch, k, SMALL.vocab_size)).at[:, :, 0].set(1.0)
    return Proposal(jnp.zeros((batch, k), jnp.int32), q, state + 1, jnp.zeros((), jnp.int32))

  def commit(self, state, target, verified):
    return state


def test_a_combined_member_no_row_chose_does_not_propose(target):
  """Row 0 continues a stored text (the suffix match scores above the counting member's 0.5); row 1 matches
  nothing. The counting member proposes only in rounds where an active row chose it."""
  stored = [40, 41, 42, 43, 44, 45, 46, 47]
  store = SuffixStore.from_tokens([stored], SMALL.vocab_size, 64)
  suffix = Suffix(store=store, own=False)
  suffix = suffix.bind(*zip(*[nnx_split(m) for m in suffix.modules()]))  # the store as the program sees it
  combined = Combined((suffix, Counting()), expected=(None, 0.5))
  prompts = jnp.asarray([[40, 41, 42, 43], [7, 3, 9, 11]], jnp.int32)
  lens = jnp.asarray([4, 4], jnp.int32)
  state = combined.init(target, prompts, lens, Features(hidden=None, aux=None), 32)
  sampler = Sampler(None, None, Mode(greedy=True))

  def passes(active):
    ctx = Context(last=prompts[:, -1], lengths=lens - 1, active=jnp.asarray(active))
    proposal = jax.jit(lambda s: combined.propose(s, target, ctx, row_keys(0, 2), 4, sampler, None))(state)
    return proposal, proposal.state[1].tolist()

  proposal, counted = passes([True, False])
  assert counted == [0, 0]  # only row 0 is active, and it took the suffix match
  assert proposal.drafts[0].tolist() == [44, 45, 46, 47] and int(proposal.limit[0]) == 4
  proposal, counted = passes([True, True])
  assert counted == [1, 1]  # row 1 chose the counting member: it proposed (for the whole batch)
  assert proposal.drafts[1].tolist() == [0, 0, 0, 0] and proposal.drafts[0].tolist() == [44, 45, 46, 47]


# --------------------------------------------------------------------------------------- the server


def test_the_servers_store_learns_finished_requests_and_proposes_them_again(target):
  store = SuffixStore(SMALL.vocab_size, capacity=256)
  engine = SlotEngine(target, Suffix(store=store, own=False), slots=2, max_len=96, ks=(8,))
  prompt = (40, 41, 42, 43)

  def serve_one():
    slot = engine.insert([Request(prompt, 24)])[0]
    tokens, accepted, rounds = [], 0, 0
    while slot in engine.live_slots:
      result = engine.step(8)
      tokens += result.tokens.get(slot, [])
      accepted += result.accepted.get(slot, 0)
      rounds += 1
    return tokens, rounds

  first, rounds_first = serve_one()
  assert first == naive_greedy(target, list(prompt), 24)
  assert store.tokens().tolist() == first + [-1]  # the finished request's output, and nothing else
  second, rounds_second = serve_one()
  assert second == first
  assert rounds_second <= 24 // 8 + 2 < rounds_first  # proposed from the store: up to 9 tokens a round
  assert suffix_stores(engine.proposer) == [store]


# --------------------------------------------------------------------------------------- bad input


def test_bad_input_is_named():
  target = make_model(SMALL, seed=0)
  with pytest.raises(ValueError, match="vocab_size=7"):
    specjax.generate(target, [[1, 2]], proposer=Suffix(store=SuffixStore(7, 16)), max_new_tokens=2)
  with pytest.raises(ValueError, match=r"outside the store's vocabulary \[0, 7\)"):
    SuffixStore.from_tokens([[1, 9]], 7)
  with pytest.raises(ValueError, match=f"k must be .*{MAX_K}"):
    SpecConfig(k=MAX_K + 1)
  with pytest.raises(ValueError, match="Suffix.max_match"):
    Suffix(max_match=MAX_MATCH + 1)
  with pytest.raises(ValueError, match="Suffix.min_token_prob"):
    Suffix(min_token_prob=1.5)
  with pytest.raises(ValueError, match="Suffix.store must be"):
    Suffix(store=[1, 2, 3])
  with pytest.raises(ValueError, match="own=False needs a store"):
    specjax.generate(target, [[1, 2]], proposer=Suffix(own=False), max_new_tokens=2)
  with pytest.raises(ValueError, match="SuffixStore.capacity"):
    SuffixStore(10, capacity=1)
  with pytest.raises(ValueError, match="Combined.members"):
    Combined((Suffix(),))
  with pytest.raises(ValueError, match=r"Combined.expected\[1\].*does not score"):
    Combined((Suffix(), NGram()), expected=(None, None))
  with pytest.raises(ValueError, match="one entry per member"):
    Combined((Suffix(), NGram()), expected=(1.0,))
