"""Parallel drafting (PARD): one draft pass for k proposals, exact output (greedy equality, chi-square tests
shown to fail on a broken sampler), the draft cache holds accepted context only, training raises τ."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
import specjax.acceptance
from helpers import SMALL, apply, make_model, perturbed_copy, start_state
from specjax import SamplingConfig, SpecConfig, engine
from specjax.decode import prepare_prompts
from specjax.models import Llama, LlamaConfig
from specjax.proposers import Context, DraftModel, ParallelDraft
from specjax.sampling import Mode, Sampler, row_keys
from specjax.train import config as config_lib
from specjax.train import pard as pard_lib
from specjax.train import trainer
from test_distribution import FAIL_P, PASS_P, PROMPT, TINY, chi_square_pvalue, exact_joint, sample_joint

GREEDY = SamplingConfig(temperature=0.0)


def with_mask_row(model: Llama) -> Llama:
  """``model`` with one more vocabulary row (the mask token), as ``train draft --parallel`` starts one."""
  graphdef, state = nnx.split(model)
  cfg = dataclasses.replace(model.cfg, vocab_size=model.cfg.vocab_size + 1)
  params = pard_lib.grow_vocab(nnx.to_pure_dict(state), cfg.tie_embeddings)
  new_def, new_state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(new_state, params)
  return nnx.merge(new_def, new_state)


@pytest.fixture(scope="module")
def pard(target):
  return ParallelDraft(with_mask_row(perturbed_copy(target, scale=0.15, seed=1)))


def test_greedy_equals_target_greedy(target, pard):
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, SMALL.vocab_size, int(rng.integers(1, 12))).tolist() for _ in range(3)]
  base = specjax.generate(target, prompts, max_new_tokens=23)
  eos = int(base.tokens[1, 9])
  base = specjax.generate(target, prompts, max_new_tokens=23, eos_id=eos)
  accepted = drafted = 0
  for k in (2, 5):
    out = specjax.generate(target, prompts, proposer=pard, spec=SpecConfig(k=k), max_new_tokens=23, eos_id=eos)
    np.testing.assert_array_equal(out.tokens, base.tokens)
    np.testing.assert_array_equal(out.lengths, base.lengths)
    assert out.stats.catch_ups == 0  # every round is one pass
    accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
  assert 0 < accepted < drafted


class Counted:
  """A model whose every executed call ticks ``calls`` (a host callback: a scan's k steps tick k times)."""

  def __init__(self, model):
    self.model, self.cfg, self.calls = model, model.cfg, 0

  def _tick(self):
    self.calls += 1

  def init_cache(self, batch, max_len):
    return self.model.init_cache(batch, max_len)

  def unembed(self, hidden):  # the LM head on a pass's features: not a pass
    return self.model.unembed(hidden)

  def __call__(self, tokens, cache, **kw):
    jax.debug.callback(self._tick)
    return self.model(tokens, cache, **kw)


def test_one_draft_pass_proposes_k_tokens(target, pard):
  prompts = jnp.asarray([[5, 9, 2, 7], [3, 1, 4, 1]], jnp.int32)
  lens = jnp.asarray([4, 3], jnp.int32)
  ctx = Context(last=prompts[jnp.arange(2), lens - 1], lengths=lens - 1, active=jnp.ones((2,), bool))
  sampler = Sampler(None, None, Mode(greedy=True))
  counts = {}
  for name, proposer in (("pard", ParallelDraft(Counted(pard.model))),
                         ("draft", DraftModel(Counted(perturbed_copy(target, 0.15, 1))))):
    model = proposer.model
    state = jax.jit(lambda p, n: proposer.init(target, p, n, None, 32))(prompts, lens)
    for k in (2, 4, 8):
      model.calls = 0
      drafts, q = jax.jit(lambda s, k=k: proposer.propose(s, target, ctx, row_keys(0, 2), k, sampler, None)[:2])(state)
      jax.block_until_ready(q)
      assert drafts.shape == (2, k) and q.shape == (2, k, SMALL.vocab_size)
      counts[name, k] = model.calls
  assert [counts["pard", k] for k in (2, 4, 8)] == [1, 1, 1]
  assert [counts["draft", k] for k in (2, 4, 8)] == [2, 4, 8]  # the sequential draft: one step per proposal


def test_cache_holds_only_the_accepted_context(target, pard):
  """After sampled rounds (ragged acceptance) and after rounds without proposals (catch-up), the draft cache's
  valid entries equal a from-scratch pass over the accepted context (no mask entry survives), and the next
  proposal equals that of a draft initialised on the same context."""
  sampling, schedule = SamplingConfig(temperature=1.0), (4, 4, 0, 0, 0, 4, 4)
  prompts = [[3, 7, 1, 9, 4], [12], [5, 6] * 6]
  padded, lens = prepare_prompts(prompts)

  mode = Mode.of([sampling])
  state = start_state(target, pard, padded, lens, k=4, max_new=60, sampling=sampling, max_len=96)[0]
  step = {k: jax.jit(lambda s, k=k: engine.round_step(dataclasses.replace(s, k_now=jnp.int32(k)), target=target,
                                                      proposer=pard, k=k, mode=mode)[0]) for k in set(schedule)}
  for k in schedule:
    state = step[k](state)
  cache, history = state.proposer.cache, np.asarray(state.proposer.history)
  lengths = np.asarray(state.target_cache.lengths)
  seen = np.asarray(cache.lengths)
  assert (seen <= lengths).all() and (seen < lengths).any()
  for b in range(len(prompts)):
    context = history[b, :seen[b]][None]
    _, _, ref = apply(pard.model, context, pard.model.init_cache(1, seen[b]))
    for layer in range(len(cache.k)):
      np.testing.assert_allclose(np.asarray(cache.k[layer][b, :seen[b]]), np.asarray(ref.k[layer][0]), atol=1e-5)
      np.testing.assert_allclose(np.asarray(cache.v[layer][b, :seen[b]]), np.asarray(ref.v[layer][0]), atol=1e-5)

  def proposal(state):
    ctx = Context(last=state.last, lengths=state.target_cache.lengths, active=jnp.ones((len(prompts),), bool))
    return pard.propose(state.proposer, target, ctx, row_keys(1, len(prompts)), 4, Sampler(None, None, Mode(greedy=True)),
                        None)[:2]

  contexts = [history[b, :lengths[b] + 1].tolist() for b in range(len(prompts))]
  ctx_padded, ctx_lens = prepare_prompts(contexts)
  fresh = start_state(target, pard, ctx_padded, ctx_lens, k=4, max_new=8, max_len=96)[0]
  drafts, q = jax.jit(proposal)(state)
  ref_drafts, ref_q = jax.jit(proposal)(fresh)
  np.testing.assert_allclose(np.asarray(q), np.asarray(ref_q), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(drafts), np.asarray(ref_drafts))


# ------------------------------------------------------------------------------------- distribution

TINY_PARD = dataclasses.replace(TINY, vocab_size=TINY.vocab_size + 1)


@pytest.fixture(scope="module")
def tiny_pair():
  return make_model(TINY, seed=0), ParallelDraft(make_model(TINY_PARD, seed=5))


@dataclasses.dataclass(frozen=True, eq=False)
class WrongQ(ParallelDraft):
  """Reports q_{i+1} as the law of d_i: a proposer whose q is not what its drafts were drawn from."""

  def propose(self, *args):
    out = super().propose(*args)
    return out._replace(q=jnp.roll(out.q, -1, axis=1))


SAMPLED = SamplingConfig(temperature=1.0)


def test_sampling_matches_target_distribution(tiny_pair):
  target, pard = tiny_pair
  counts, st = sample_joint(target, pard, SAMPLED, 3, 3, n=20_000, seed=0)
  assert 0.05 < st.acceptance_rate < 0.95
  assert chi_square_pvalue(counts, exact_joint(target, SAMPLED, 3)) > PASS_P


@pytest.mark.parametrize("broken", ["correction", "q"])
def test_the_test_fails_on_a_broken_sampler(tiny_pair, monkeypatch, broken):
  target, pard = tiny_pair
  jax.clear_caches()
  if broken == "correction":
    monkeypatch.setattr(specjax.acceptance, "residual", lambda p, q: p)
  else:
    pard = WrongQ(pard.model)
  try:
    counts, _ = sample_joint(target, pard, SAMPLED, 3, 3, n=20_000, seed=0)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  assert chi_square_pvalue(counts, exact_joint(target, SAMPLED, 3)) < FAIL_P


# ---------------------------------------------------------------------------------------- training


def test_training_slots_are_what_the_inference_pass_computes():
  """Each slot (block i, position j) of the packed training sequence gives the logits that the inference pass
  over ``x_0..x_{j-i}`` and i masks gives at its last mask; conditional drop keeps only slots whose
  predecessor (block i - 1, position j - 1) is there."""
  cfg = LlamaConfig(vocab_size=17, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=64)
  graphdef, params = trainer.init_model(cfg, seed=0)
  model = nnx.merge(graphdef, params)
  rows = np.random.default_rng(0).integers(0, 16, (2, 13))  # T = 12
  sizes = pard_lib.block_sizes(12, 4, 0.7, 0.2)
  pos, block = pard_lib.layout(jax.random.key(0), 2, 12, sizes)
  logits = np.asarray(jax.jit(pard_lib.parallel_logits, static_argnums=(0, 4, 5))(
      graphdef, params, jnp.asarray(rows), pos, tuple(block.tolist()), 16))
  pos = np.asarray(pos)
  for b in range(2):
    slots = set(zip(block.tolist(), pos[b].tolist()))
    assert all((i - 1, j - 1) in slots for i, j in slots if i > 0)
    buf = np.zeros((len(block), 16), np.int32)
    for s, (i, j) in enumerate(zip(block, pos[b])):
      buf[s, :j - i + 1], buf[s, j - i + 1:j + 1] = rows[b, :j - i + 1], 16
    ref = np.asarray(apply(model, buf, model.init_cache(len(block), 16))[0])
    np.testing.assert_allclose(logits[b], ref[np.arange(len(block)), pos[b]], atol=1e-4)


def test_tiny_training_raises_tau():
  """Mask-block training (conditional drop, forward KL per slot) of a fresh parallel draft against a small
  peaked target: greedy τ at k = 4 rises over the untrained draft's."""
  tcfg = LlamaConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=128)
  target = make_model(tcfg, seed=3)
  target.embed[...] = target.embed[...] * 4.0  # a peaked target: its continuations are predictable
  t_def, t_state = nnx.split(target)
  t_params = nnx.to_pure_dict(t_state)
  dcfg = dataclasses.replace(tcfg, vocab_size=33)
  d_def, params = trainer.init_model(dcfg, seed=0)
  untrained = nnx.merge(d_def, jax.tree.map(jnp.copy, params))  # the step donates params
  sizes = pard_lib.block_sizes(31, 4, 0.7, 0.2)
  steps = 80
  optimizer = trainer.make_optimizer(config_lib.OptimConfig(lr=1e-2, warmup_steps=5), steps)
  opt_state = optimizer.init(params)
  rng = np.random.default_rng(0)
  for step in range(steps):
    prefix = jnp.asarray(rng.integers(0, 32, (16, 2)), jnp.int32)
    rows = trainer.sample_continuations(t_def, t_params, prefix, jax.random.key(step), gen_len=30, temperature=1.0)
    mask = jnp.ones((16, 31), jnp.float32)
    params, opt_state, metrics = pard_lib.parallel_train_step(
        d_def, params, opt_state, rows, mask, jax.random.key(100 + step), t_def, t_params, optimizer=optimizer,
        sizes=sizes, mask_id=32, divergence="fkl", temperature=1.0)
  trained = nnx.merge(d_def, params)
  prompts = rng.integers(0, 32, (8, 3)).tolist()

  def tau(model):
    out = specjax.generate(target, prompts, proposer=ParallelDraft(model), spec=SpecConfig(k=4), max_new_tokens=24)
    return (out.stats.accepted_tokens + out.stats.row_rounds) / out.stats.row_rounds

  before, after = tau(untrained), tau(trained)
  assert after > before + 0.5, (before, after)


# --------------------------------------------------------------------------------------- bad input


def test_bad_input_names_the_field(target):
  plain = perturbed_copy(target, 0.1, 2)
  with pytest.raises(ValueError, match=r"ParallelDraft.model has no mask token.*vocab_size"):
    specjax.generate(target, [[1, 2]], proposer=ParallelDraft(plain), spec=SpecConfig(k=2), max_new_tokens=4)
  draft = with_mask_row(plain)
  with pytest.raises(ValueError, match=r"ParallelDraft.mask_id must be in \[64, 65\)"):
    specjax.generate(target, [[1, 2]], proposer=ParallelDraft(draft, mask_id=3), spec=SpecConfig(k=2),
                     max_new_tokens=4)
  with pytest.raises(ValueError, match=r"vocab_size \(66\) must be the target's vocab_size \+ 1"):
    specjax.generate(target, [[1, 2]], proposer=ParallelDraft(with_mask_row(draft)), spec=SpecConfig(k=2),
                     max_new_tokens=4)
  with pytest.raises(ValueError, match=r"method .pard. does not propose token trees"):
    specjax.generate(target, [[1, 2]], proposer=ParallelDraft(draft), spec=SpecConfig(tree="2-1/3"),
                     max_new_tokens=4)


def test_parallel_recipe_errors_name_the_field():
  raw = {"kind": "draft", "model": {"vocab_size": 300, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64},
         "data": {"tokenizer_vocab": 300, "seq_len": 32}, "run": {"steps": 200},
         "distill": {"divergence": "ce", "prefix_len": 8, "gen_len": 8}, "parallel": {"k": 4}}
  with pytest.raises(config_lib.ConfigError, match=r"model.vocab_size \(300\) of a parallel draft"):
    config_lib.from_dict(raw)
  cfg = config_lib.as_parallel(config_lib.from_dict({**raw, "parallel": None}))
  assert cfg.model.vocab_size == 301 and cfg.parallel.k == 8
  with pytest.raises(config_lib.ConfigError, match=r"parallel.r_min must be"):
    config_lib.from_dict({**raw, "model": {**raw["model"], "vocab_size": 301}, "parallel": {"r_min": 0}})


def test_shipping_in_float16_halves_the_file_and_loads_back_as_float32(tmp_path, pard):
  """``python -m specjax.train.ship --pard RUN --dtype float16``: the shipped weights are the export's rounded
  to float16, loaded back in the configuration's float32; a dtype an .npz cannot hold is refused by name."""
  from specjax import pretrained
  from specjax.train import ship

  run = tmp_path / "run"
  pretrained.save_model(run / "model", pard.model)
  dest = tmp_path / "assets" / "pair"
  pretrained.save_model(dest / "target", make_model(SMALL, seed=0))  # the pair's target: checked against
  ship.ship_pard("pair", run, assets=tmp_path / "assets", dtype="float16")
  shipped = pretrained.load_shipped_pard(str(dest))
  want = nnx.to_pure_dict(nnx.split(pard.model)[1])
  got = nnx.to_pure_dict(nnx.split(shipped)[1])
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w).astype(np.float16).astype(np.float32))
  with np.load(dest / "pard" / "params.npz") as npz:
    assert {npz[k].dtype for k in npz.files} == {np.dtype(np.float16)}
  size16 = (dest / "pard" / "params.npz").stat().st_size
  ship.ship_pard("pair", run, assets=tmp_path / "assets")
  assert size16 < 0.6 * (dest / "pard" / "params.npz").stat().st_size
  with pytest.raises(ValueError, match=r"--dtype for a parallel draft must be one of .*'float16'.*got 'bfloat16'"):
    ship.ship_pard("pair", run, assets=tmp_path / "assets", dtype="bfloat16")
