"""Every proposer behind the one protocol: exact greedy decoding, head caches that hold only accepted
context, reduced vocabularies, compilation, row independence, head sets saved and refused by field."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import SMALL, copy_head, make_model, perturbed_copy, run_rounds, scratch_chain, start_state
from specjax import SamplingConfig, SpecConfig, engine
from specjax.decode import TRACE_COUNTS, prepare_prompts
from specjax.models.heads import build_heads, load_heads, save_heads
from specjax.proposers import MTP, DraftModel, Eagle, Medusa, NGram
from specjax.sampling import Mode, Sampler, row_keys

GREEDY = SamplingConfig(temperature=0.0)


def proposers_for(target) -> dict:
  draft = perturbed_copy(target, scale=0.15, seed=1)
  return {
      "draft": DraftModel(draft),
      "ngram": NGram(),
      "medusa": Medusa(build_heads("medusa", target.cfg, num_heads=5)),
      "eagle1": Eagle(copy_head(build_heads("eagle1", target.cfg, seed=2), noise=0.1)),
      # Reduced vocabulary whose first id is the target's favourite token: a zero output head proposes it.
      "eagle3": Eagle(build_heads("eagle3", target.cfg, seed=3, draft_vocab_size=24, d_model=16, n_heads=2,
                                  d2t=np.r_[5, np.arange(30, 53)])),
      "mtp2": MTP(copy_head(build_heads("mtp", target.cfg, seed=4, num_heads=2), noise=0.1)),
  }


@pytest.fixture(scope="module")
def proposers(target):
  return proposers_for(target)


def mixed_prompts(batch: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, SMALL.vocab_size, int(rng.integers(1, 12))).tolist() for _ in range(batch)]


@pytest.mark.parametrize("name", ["draft", "ngram", "medusa", "eagle1", "eagle3", "mtp2"])
def test_greedy_equals_target_greedy_with_eos_and_max_new_inside_windows(target, proposers, name):
  prompts = mixed_prompts(4, seed=7)
  base = specjax.generate(target, prompts, max_new_tokens=23)
  # EOS: a token that row 1 emits mid-output, so that row ends early inside some window.
  eos = int(base.tokens[1, 9])
  base = specjax.generate(target, prompts, max_new_tokens=23, eos_id=eos)
  accepted = drafted = 0
  for k in (1, 3, 5):
    out = specjax.generate(target, prompts, proposer=proposers[name], spec=SpecConfig(k=k), max_new_tokens=23,
                           eos_id=eos)
    np.testing.assert_array_equal(out.tokens, base.tokens)
    np.testing.assert_array_equal(out.lengths, base.lengths)
    assert out.stats.drafted_tokens == k * out.stats.row_rounds
    accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
  assert base.lengths[1] < 23 and (base.lengths == 23).sum() >= 2  # EOS ended a row, others ran to max_new
  assert 0 < accepted < drafted  # both acceptance and rejection happened
  # Rows are independent: each row alone gives the same tokens as inside the batch.
  for b in (0, 1):
    alone = specjax.generate(target, [prompts[b]], proposer=proposers[name], spec=SpecConfig(k=3),
                             max_new_tokens=23, eos_id=eos)
    assert alone.rows()[0] == base.rows()[b]


@pytest.mark.parametrize("name,cutoff", [("eagle1", 1e-3), ("mtp2", 1e-4)])  # random heads: ~1/64 sure a step
def test_a_confidence_cutoff_varies_the_proposals_and_keeps_greedy_exact(target, proposers, name, cutoff):
  """``cutoff``: each row's proposals end where the head's confidence in its chain falls below it (the first
  is always made), so rows and rounds propose different counts and verify the shortest window holding them;
  the tokens are the target alone's, with EOS and max_new inside windows; a row alone gives its batch tokens."""
  prompts = mixed_prompts(4, seed=7)
  base = specjax.generate(target, prompts, max_new_tokens=23)
  eos = int(base.tokens[1, 9])
  base = specjax.generate(target, prompts, max_new_tokens=23, eos_id=eos)
  k = 5
  proposer = dataclasses.replace(proposers[name], cutoff=cutoff)
  assert proposer.varies_limit and proposer.verify_widths(k) == (1, 2, 3, 4, 5)
  out = specjax.generate(target, prompts, proposer=proposer, spec=SpecConfig(k=k), max_new_tokens=23, eos_id=eos)
  np.testing.assert_array_equal(out.tokens, base.tokens)
  np.testing.assert_array_equal(out.lengths, base.lengths)
  assert out.stats.row_rounds < out.stats.drafted_tokens < k * out.stats.row_rounds
  alone = specjax.generate(target, [prompts[2]], proposer=proposer, spec=SpecConfig(k=k), max_new_tokens=23,
                           eos_id=eos)
  assert alone.rows()[0] == base.rows()[2]
  assert proposers[name].cutoff is None and not proposers[name].varies_limit


def test_confident_limit_reads_the_earlier_draws_and_the_next_distribution():
  from specjax.proposers.chain import confident_limit

  drawn = jnp.array([[0.9, 0.5, 0.9, 0.1], [0.1, 0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0], [0.9, 0.9, 0.0, 0.0]])
  top = jnp.array([[0.9, 0.9, 0.9, 0.9], [0.2, 0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0], [0.9, 0.9, 0.0, 0.0]])
  # proposal j's score: drawn_1 .. drawn_(j-1) x top_j: [.9, .81, .405, .36], [.2, .09, ..], [1, ..], [.9, .81, 0, 0]
  np.testing.assert_array_equal(confident_limit(drawn, top, 0.4), [3, 1, 4, 2])
  np.testing.assert_array_equal(confident_limit(drawn, top, 1.0), [1, 1, 4, 1])
  np.testing.assert_array_equal(confident_limit(drawn, top, 0.05), [4, 4, 4, 2])


@pytest.mark.parametrize("name", ["medusa", "eagle1", "eagle3", "mtp2"])
def test_one_compile_per_prompt_bucket_and_new_weights_reuse_it(target, proposers, name):
  proposer = proposers[name]
  specjax.generate(target, [[1, 2, 3]], proposer=proposer, spec=SpecConfig(k=2), max_new_tokens=5)
  before = TRACE_COUNTS["generate_tokens"]
  specjax.generate(target, [[4, 5, 6, 7, 8, 9], [1]], proposer=proposer, spec=SpecConfig(k=2), max_new_tokens=5)
  specjax.generate(target, [[9] * 15], proposer=proposer, spec=SpecConfig(k=2), max_new_tokens=5)
  assert TRACE_COUNTS["generate_tokens"] == before + 1  # batch 2 is a new shape; bucket 16 holds all lengths
  heads = proposer.heads
  graphdef, state = nnx.split(heads)
  scale = lambda x: (x * 1.01).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  retrained = nnx.merge(graphdef, jax.tree.map(scale, state))  # same structure, new weights
  specjax.generate(target, [[7, 7]], proposer=type(proposer)(retrained), spec=SpecConfig(k=2), max_new_tokens=5)
  assert TRACE_COUNTS["generate_tokens"] == before + 1


@pytest.mark.parametrize("name", ["draft", "ngram", "medusa", "eagle1", "eagle3", "mtp2"])
def test_rounds_without_proposals_keep_every_proposer_in_step(target, proposers, name):
  """A server mixes rounds without proposals (k = 0: the proposer only commits) with speculative ones.
  Output stays the target's greedy, and after stretches of k = 0 rounds the proposer proposes exactly
  what one initialised on the same context proposes (the draft catches up on everything it missed)."""
  proposer, prompts, schedule, max_new = proposers[name], [[3, 7, 1, 9, 4], [12], [5, 6] * 6], [3, 0, 0, 0, 2, 0, 3, 0, 0], 40
  padded, lens = prepare_prompts(prompts)

  mode = Mode.of([GREEDY])
  # One compiled round per distinct k (3, 0, 2), run in the schedule's order: the same rounds as one
  # program unrolling all nine, at a third of the compile.
  step = {k: jax.jit(lambda s, k=k: engine.round_step(dataclasses.replace(s, k_now=jnp.int32(k)), target=target,
                                                      proposer=proposer, k=k, mode=mode)[0])
          for k in set(schedule)}

  def rounds(padded, lens):
    state = jax.jit(lambda p, n: start_state(target, proposer, p, n, k=3, max_new=max_new, max_len=96)[0])(
        padded, lens)
    for k in schedule:
      state = step[k](state)
    return state

  def proposal(state):
    ctx = specjax.proposers.Context(last=state.last, lengths=state.target_cache.lengths,
                                    active=jnp.ones((len(prompts),), bool))
    sampler = Sampler(state.settings, state.counts, Mode.of([GREEDY]))
    return proposer.propose(state.proposer, target, ctx, row_keys(1, len(prompts)), 3, sampler, None)[:2]

  state = rounds(jnp.asarray(padded), jnp.asarray(lens))
  base = specjax.generate(target, prompts, max_new_tokens=max_new)
  contexts = []
  for b, prompt in enumerate(prompts):
    out = np.asarray(state.out.ids[b, :int(state.n_out[b])]).tolist()
    assert out == base.rows()[b][:len(out)]
    contexts.append(prompt + out)
  drafts, q = jax.jit(proposal)(state)
  ctx_padded, ctx_lens = prepare_prompts(contexts)
  fresh = jax.jit(lambda p, n: start_state(target, proposer, p, n, k=3, max_new=8, max_len=96)[0])(
      jnp.asarray(ctx_padded), jnp.asarray(ctx_lens))
  ref_drafts, ref_q = jax.jit(proposal)(fresh)
  np.testing.assert_allclose(np.asarray(q), np.asarray(ref_q), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(drafts), np.asarray(ref_drafts))


@pytest.mark.parametrize("kind,options", [
    ("eagle1", {}), ("eagle3", {"draft_vocab_size": 40, "d_model": 16, "n_heads": 2}),
    ("mtp", {"num_heads": 2}), ("mtp", {"num_heads": 3})])
def test_head_cache_holds_only_accepted_context(target, kind, options):
  """After rounds of mixed acceptance (sampling, so every n in 0..k occurs), each depth's cache and the
  frontier feature equal a from-scratch pass over the accepted sequence: the head never keeps its own
  rejected guesses."""
  heads = build_heads(kind, target.cfg, seed=11, **options)
  proposer = Eagle(heads) if kind.startswith("eagle") else MTP(heads)
  prompts = [[3, 7, 1, 9, 4], [12], [5, 5, 5, 5, 5, 5, 5, 5]]
  k = 3
  state = run_rounds(target, proposer, prompts, rounds=6, k=k, sampling=SamplingConfig(temperature=1.0), seed=1)
  lengths = np.asarray(state.target_cache.lengths)
  accepted = np.asarray(state.stats.accepted)
  assert 0 < accepted.sum() < 6 * k * len(prompts)
  for b, prompt in enumerate(prompts):
    context = prompt + np.asarray(state.out.ids[b, :int(state.n_out[b])]).tolist()
    assert len(context) == lengths[b] + 1  # the target cache holds all but last
    reference = scratch_chain(target, heads, context, max_len=state.target_cache.max_len)
    for d, (ref_k, ref_v, ref_feat) in enumerate(reference):
      cache = state.proposer.caches[d]
      got = int(cache.lengths[b]) - (heads.num_depths - 1)
      assert got == ref_k.shape[0] == lengths[b] - d  # true pairs: i <= L' - (d + 1)
      start = heads.num_depths - 1
      np.testing.assert_allclose(cache.k[0][b, start:start + got], ref_k, rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(cache.v[0][b, start:start + got], ref_v, rtol=1e-4, atol=1e-5)
      if ref_feat is not None:
        np.testing.assert_allclose(state.proposer.feat[b], ref_feat, rtol=1e-4, atol=1e-5)


def test_medusa_state_is_the_target_hidden_state_before_last(target):
  heads = build_heads("medusa", target.cfg, num_heads=3)
  prompts = [[3, 7, 1, 9, 4], [12, 30]]
  state = run_rounds(target, Medusa(heads), prompts, rounds=5, k=3, sampling=SamplingConfig(temperature=1.0), seed=2)
  for b, prompt in enumerate(prompts):
    context = prompt + np.asarray(state.out.ids[b, :int(state.n_out[b])]).tolist()
    _, hidden, _ = target(jnp.asarray([context]), target.init_cache(1, 64))
    np.testing.assert_allclose(state.proposer[b], hidden[0, len(context) - 2], rtol=1e-4, atol=1e-5)


def test_reduced_vocabulary_head_proposes_only_mapped_tokens(target):
  d2t = np.arange(0, 64, 3)  # 22 of the 64 ids
  heads = build_heads("eagle3", target.cfg, seed=5, draft_vocab_size=d2t.size, d2t=d2t)
  proposer = Eagle(heads)
  state = run_rounds(target, proposer, mixed_prompts(4, seed=3), rounds=2, k=4,
                     sampling=SamplingConfig(temperature=1.0), seed=3)
  ctx = specjax.proposers.Context(last=state.last, lengths=state.target_cache.lengths,
                                  active=jnp.ones((4,), bool))
  cfg = SamplingConfig(temperature=1.5)
  sampler = Sampler(state.settings, state.counts, Mode.of([cfg]))
  propose = jax.jit(lambda keys: proposer.propose(state.proposer, target, ctx, keys, 4, sampler, None)[:2])
  outside = np.setdiff1d(np.arange(64), d2t)
  for seed in range(20):
    drafts, q = propose(row_keys(seed, 4))
    assert np.isin(np.asarray(drafts), d2t).all()
    assert float(jnp.abs(q[..., outside]).max()) == 0.0
    np.testing.assert_allclose(np.asarray(q.sum(-1)), 1.0, rtol=1e-5)


def test_head_sets_round_trip_and_refuse_another_target(target, tmp_path):
  for kind, options in (("medusa", {"num_heads": 3}), ("eagle3", {"draft_vocab_size": 20, "d2t": np.arange(20) * 2}),
                        ("mtp", {"num_heads": 2})):
    heads = build_heads(kind, target.cfg, seed=9, **options)
    save_heads(tmp_path / kind, heads)
    loaded = load_heads(tmp_path / kind, target.cfg)
    assert loaded.cfg == heads.cfg
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(heads)), nnx.to_flat_state(nnx.state(loaded))):
      np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
  for change, field in ((dict(d_model=64, n_heads=4), "d_model=32"), (dict(vocab_size=65), "vocab_size=64"),
                        (dict(n_layers=3), "n_layers=2")):
    with pytest.raises(ValueError, match=rf"built for a target with {field}.*HeadConfig.target_"):
      load_heads(tmp_path / "mtp", SMALL.replace(**change))
  other = make_model(SMALL.replace(n_layers=3), 1)
  with pytest.raises(ValueError, match=r"n_layers=2, but this target has n_layers=3"):
    specjax.generate(other, [[1, 2]], proposer=MTP(load_heads(tmp_path / "mtp")), max_new_tokens=2)
  (tmp_path / "mtp" / "heads.safetensors").write_bytes(b"")
  with pytest.raises(Exception, match="heads.safetensors"):
    load_heads(tmp_path / "mtp", target.cfg)


@pytest.mark.parametrize("build,match", [
    (lambda cfg: build_heads("eagle3", cfg, aux_layers=(0, 5)), r"aux_layers must be layer ids in \[0, 2\).*got 5"),
    (lambda cfg: build_heads("eagle3", cfg, aux_layers=(1, 0)), "distinct and increasing"),
    (lambda cfg: build_heads("eagle3", cfg, draft_vocab_size=4, d2t=[0, 1, 2, 64]),
     r"holds id 64 outside the target's vocabulary \[0, 64\)"),
    (lambda cfg: build_heads("eagle3", cfg, draft_vocab_size=3, d2t=[1, 1, 2]), "distinct target ids"),
    (lambda cfg: build_heads("eagle3", cfg, draft_vocab_size=65), r"draft_vocab_size must be an integer in \[1, "),
    (lambda cfg: build_heads("eagle1", cfg, d_model=16), "must equal target_d_model"),
    (lambda cfg: build_heads("medusa", cfg, num_heads=0), "num_heads must be an integer >= 1"),
    (lambda cfg: build_heads("hydra", cfg), "kind must be one of"),
])
def test_bad_head_configurations_are_named(build, match):
  with pytest.raises(ValueError, match=match):
    build(SMALL)


@pytest.mark.parametrize("cutoff", [0, 0.0, -0.5, 1.5, True, "0.5", float("nan")])
def test_a_bad_cutoff_is_named(target, cutoff):
  heads = build_heads("eagle1", target.cfg, seed=2)
  with pytest.raises(ValueError, match=r"cutoff must be None or a number in \(0, 1\]"):
    Eagle(heads, cutoff=cutoff)
  with pytest.raises(ValueError, match=r"eagle takes the options \['cutoff'\], not \['cut'\]"):
    specjax.proposers.for_heads(heads, cut=0.5)
  assert specjax.proposers.for_heads(heads, cutoff=0.5).describe()["cutoff"] == 0.5


def test_proposers_refuse_what_they_cannot_run(target):
  with pytest.raises(ValueError, match="method 'medusa' needs Medusa heads"):
    specjax.generate(target, [[1]], proposer=Medusa(None), max_new_tokens=2)
  with pytest.raises(ValueError, match="method 'eagle' needs a head set of kind eagle1 or eagle3"):
    specjax.generate(target, [[1]], proposer=Eagle(build_heads("mtp", target.cfg)), max_new_tokens=2)
  with pytest.raises(ValueError, match="spec.k=4 exceeds the 3 proposals per round that this medusa proposer"):
    specjax.generate(target, [[1]], proposer=Medusa(build_heads("medusa", target.cfg, num_heads=3)),
                     spec=SpecConfig(k=4), max_new_tokens=2)
  with pytest.raises(ValueError, match="pass either draft="):
    specjax.generate(target, [[1]], draft=target, proposer=NGram(), max_new_tokens=2)


def test_auto_k_works_through_the_protocol_for_heads(target):
  """k="auto" decides from the same cost table and pilot for any proposer: cheap verification -> the
  Medusa head count (its largest k), expensive -> 0; output exact either way."""
  from specjax import costmodel
  from specjax.runtime import RUNTIME

  proposer = Medusa(build_heads("medusa", target.cfg, num_heads=3))
  prompts = [[1, 2, 3, 1, 2, 3], [4, 5]]
  base = specjax.generate(target, prompts, max_new_tokens=20)
  for verify_cost, expected_k in ((lambda t: 1.0, 3), (lambda t: 5.0 * t, 0)):
    RUNTIME.clear()
    key = costmodel.table_key(target, proposer, 2, 3, GREEDY, n_tokens=32)  # k_max capped at the 3 heads
    costmodel.COST_TABLES[key] = costmodel.CostTable(batch=2, verify={t: verify_cost(t) for t in range(1, 5)},
                                                     proposer_step=0.01)
    out = specjax.generate(target, prompts, proposer=proposer, spec=SpecConfig(k="auto", k_max=8), max_new_tokens=20)
    assert out.stats.k == expected_k
    np.testing.assert_array_equal(out.tokens, base.tokens)
  RUNTIME.clear()
