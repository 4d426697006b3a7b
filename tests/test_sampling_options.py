"""Logit bias, repetition / presence / frequency penalties and min-p under speculation, per-row settings in one
batch, and the target's log-probabilities.

The chi-square tests compare speculative samples with the exact law of plain decoding under the same settings,
computed by enumeration with a numpy warp written from the definitions (not with specjax's warp); each
count-dependent case is shown to fail when the penalty counts of window position i leave out the proposals
before it, and the others to fail against the law without the option (the test has power).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import specjax.sampling
from helpers import full_logits, make_model, naive_greedy
from specjax import SamplingConfig, SpecConfig
from specjax.models.heads import build_heads
from specjax.proposers import DraftModel, Eagle, Medusa
from specjax.request import Request, RequestError
from specjax.serving.slots import SlotEngine
from test_distribution import FAIL_P, PASS_P, TINY, chi_square_pvalue

PROMPT = [3, 7, 1, 9]
V = TINY.vocab_size


def ref_warp(logits: np.ndarray, cfg: SamplingConfig, prompt: list[int], generated: list[int]) -> np.ndarray:
  """The warp from its definitions (OpenAI / transformers / vLLM conventions), for one position."""
  z = logits.astype(np.float64).copy()
  for token, bias in cfg.logit_bias:
    z[token] += bias
  counts = np.bincount(np.asarray(generated, np.int64), minlength=len(z)).astype(np.float64)
  for t in set(prompt) | set(generated):
    z[t] = z[t] / cfg.repetition_penalty if z[t] > 0 else z[t] * cfg.repetition_penalty
  z -= cfg.frequency_penalty * counts + cfg.presence_penalty * (counts > 0)
  if cfg.greedy:
    return np.eye(len(z))[np.argmax(z)]
  z = z / cfg.temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  if cfg.min_p:
    p = np.where(p >= cfg.min_p * p.max(), p, 0.0)
  if cfg.top_k:
    p = np.where(p >= np.sort(p)[-cfg.top_k], p, 0.0)
  p /= p.sum()
  if cfg.top_p < 1:
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    p[order[before >= cfg.top_p]] = 0
    p /= p.sum()
  return p


def exact_joint(target, cfg: SamplingConfig, steps: int, prompt: list[int] = PROMPT) -> np.ndarray:
  """The law of the first ``steps`` tokens of plain decoding with ``cfg``, by enumeration: ``[V] * steps``."""
  joint = np.ones([V] * steps)
  for prefix_len in range(steps):
    prefixes = list(itertools.product(range(V), repeat=prefix_len))
    logits = full_logits(target, np.array([prompt + list(p) for p in prefixes], np.int32))[:, -1]
    cond = np.stack([ref_warp(z, cfg, prompt, list(p)) for p, z in zip(prefixes, logits)])  # [V^len, V]
    joint = joint * cond.reshape([V] * prefix_len + [V] + [1] * (steps - prefix_len - 1))
  return joint


def sample_joint(target, proposer, cfg: SamplingConfig, k: int, steps: int, n: int, seed: int):
  out = specjax.generate(target, [PROMPT] * n, proposer=proposer, spec=SpecConfig(k=k), sampling=cfg,
                         max_new_tokens=steps, seed=seed)
  assert (out.lengths == steps).all()
  counts = np.zeros([V] * steps)
  np.add.at(counts, tuple(out.tokens[:, i] for i in range(steps)), 1)
  return counts, out.stats


@pytest.fixture(scope="module")
def pair():
  return make_model(TINY, seed=0), make_model(TINY, seed=5)


PROPOSERS = {
    "draft": lambda target, draft: DraftModel(draft),
    "eagle": lambda target, draft: Eagle(build_heads("eagle1", target.cfg, seed=2)),
    "medusa": lambda target, draft: Medusa(build_heads("medusa", target.cfg, num_heads=3, seed=1)),
}
# Strong settings, so that a wrong count moves the law far more than the test's noise.
OPTIONS = {
    "presence": SamplingConfig(1.0, presence_penalty=2.0),
    "frequency": SamplingConfig(1.0, frequency_penalty=1.5),
    "repetition": SamplingConfig(1.0, repetition_penalty=3.0),
    "min_p": SamplingConfig(1.0, min_p=0.3),
    "logit_bias": SamplingConfig(1.0, logit_bias={2: 3.0, 4: -5.0, 11: 1.5}),
    "combined": SamplingConfig(0.8, top_k=8, top_p=0.95, min_p=0.05, presence_penalty=0.7, frequency_penalty=0.5,
                               repetition_penalty=1.6, logit_bias={2: 2.0, 5: -1.0}),
}
STEPS, K, N, SEED = 3, 2, 20_000, 12


@pytest.fixture(scope="module")
def joints(pair):
  target, _ = pair
  return {name: exact_joint(target, cfg, STEPS) for name, cfg in OPTIONS.items()}


# Every option with the draft model; the head (EAGLE's chain rollout, which pushes each draw) on the options
# that read counts; Medusa (all logits at once, drawn in turn) on the combination below.
CASES = [(option, "draft") for option in sorted(OPTIONS)] + [(option, "eagle") for option in ("combined", "presence")]


@pytest.mark.parametrize("option,proposer", CASES)
def test_each_option_keeps_the_law_of_plain_decoding(pair, joints, proposer, option):
  target, draft = pair
  counts, st = sample_joint(target, PROPOSERS[proposer](target, draft), OPTIONS[option], K, STEPS, N, seed=SEED)
  assert 0.05 < st.acceptance_rate < 0.95  # acceptance and correction both exercised
  assert chi_square_pvalue(counts, joints[option]) > PASS_P


def test_medusa_draws_its_heads_in_turn_under_penalties(pair, joints):
  """Medusa's k heads give all logits at once; with counts, d_i is drawn after d_<i are counted."""
  target, draft = pair
  counts, _ = sample_joint(target, PROPOSERS["medusa"](target, draft), OPTIONS["combined"], K, STEPS, N, seed=12)
  assert chi_square_pvalue(counts, joints["combined"]) > PASS_P


@pytest.fixture
def counts_ignore_proposals(monkeypatch):
  """The bug the rule guards against: every window position (and every proposal) warped with the counts at
  the start of the round, as if the proposals before it were not there."""
  jax.clear_caches()
  monkeypatch.setattr(specjax.sampling.Sampler, "warp_window", lambda self, logits, drafts: self.warp(logits))
  monkeypatch.setattr(specjax.sampling.Sampler, "push", lambda self, tokens: self)
  yield
  monkeypatch.undo()
  jax.clear_caches()


def deviation_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
  """:func:`chi_square_pvalue`, or 0 when a sample landed where the law has no mass (a certain deviation)."""
  if np.any(counts[probs == 0]):
    return 0.0
  return chi_square_pvalue(counts, probs)


# Presence alone, and the combination (presence, frequency and repetition at once): a count that ignores the
# proposals moves each of them, and the frequency and repetition penalties read the same counts as presence.
@pytest.mark.parametrize("option", ["presence", "combined"])
def test_the_test_fails_when_counts_ignore_the_proposals(pair, joints, counts_ignore_proposals, option):
  target, draft = pair
  counts, _ = sample_joint(target, PROPOSERS["draft"](target, draft), OPTIONS[option], K, STEPS, N, seed=SEED)
  assert deviation_pvalue(counts, joints[option]) < FAIL_P


@pytest.mark.parametrize("option", ["min_p", "logit_bias"])
def test_the_test_has_power_against_the_law_without_the_option(pair, option):
  target, draft = pair
  counts, _ = sample_joint(target, PROPOSERS["draft"](target, draft), OPTIONS[option], K, STEPS, N, seed=SEED)
  assert deviation_pvalue(counts, exact_joint(target, SamplingConfig(1.0), STEPS)) < FAIL_P


def test_greedy_with_penalties_equals_plain_greedy_with_them(pair):
  """Temperature 0 with penalties: the argmax of the adjusted logits, the same tokens with every proposer,
  and the same as a from-scratch reference (full forward each step, numpy warp)."""
  target, draft = pair
  cfg = SamplingConfig(0.0, repetition_penalty=1.8, frequency_penalty=0.6, presence_penalty=0.3, logit_bias={4: 1.0})
  prompts = [PROMPT, [5, 5, 2], [11]]
  ref = []
  for prompt in prompts:
    seq = []
    for _ in range(12):
      z = full_logits(target, np.array([prompt + seq], np.int32))[0, -1]
      seq.append(int(np.argmax(ref_warp(z, cfg, prompt, seq))))
    ref.append(seq)
  assert ref != [naive_greedy(target, p, 12) for p in prompts]  # the penalties change the output
  for name in (None, "draft", "eagle", "medusa"):
    proposer = None if name is None else PROPOSERS[name](target, draft)
    out = specjax.generate(target, prompts, proposer=proposer, sampling=cfg, max_new_tokens=12,
                           spec=SpecConfig(k=0 if proposer is None else 3))
    assert out.rows() == ref, name


def test_rows_with_different_settings_each_get_what_they_get_alone(pair):
  """One batch of the slot engine holds greedy, sampled, penalised and filtered rows: each row's tokens equal
  the same request alone (its draws depend on its own key; its warp on its own settings)."""
  target, draft = pair
  settings = [SamplingConfig(0.0), SamplingConfig(0.0, repetition_penalty=2.0, logit_bias={3: 2.0}),
              SamplingConfig(0.9), SamplingConfig(1.0, presence_penalty=1.0, frequency_penalty=0.5),
              SamplingConfig(0.8, top_k=4, min_p=0.1)]
  requests = [Request(tuple(PROMPT[: 2 + i % 3]), 16, s, seed=i) for i, s in enumerate(settings)]

  def run(batch):
    engine = SlotEngine(target, DraftModel(draft), slots=len(batch), max_len=64, ks=(2,))
    slots = engine.insert(batch)
    out = {s: [] for s in slots}
    while engine.live_slots:
      for slot, tokens in engine.step(2).tokens.items():
        out[slot] += tokens
    return [out[s] for s in slots]

  together = run(requests)
  for i, request in enumerate(requests):
    assert run([request])[0] == together[i], i
  for request, tokens in zip(requests[:2], together[:2]):  # greedy rows: what generate gives
    alone = specjax.generate(target, [list(request.prompt)], sampling=request.sampling, max_new_tokens=16)
    assert tokens == alone.rows()[0]


@pytest.mark.parametrize("cfg", [SamplingConfig(0.0), SamplingConfig(0.9, top_k=6, repetition_penalty=1.5)])
@pytest.mark.parametrize("proposer", [None, "draft"])
def test_logprobs_are_the_targets_own_log_softmax(pair, cfg, proposer):
  """Each emitted token's log-probability and the top alternatives equal the log-softmax of the target's
  logits (a full forward), before any warp, with and without speculation."""
  target, draft = pair
  prompts = [PROMPT, [2, 8]]
  prop = None if proposer is None else PROPOSERS[proposer](target, draft)
  out = specjax.generate(target, prompts, proposer=prop, sampling=cfg, max_new_tokens=10, logprobs=3, seed=4)
  for b, prompt in enumerate(prompts):
    row = out.rows()[b]
    logits = full_logits(target, np.array([prompt + row], np.int32))[0, len(prompt) - 1: -1]  # [n, V]
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    n = len(row)
    np.testing.assert_allclose(out.logprobs[b, :n], logp[np.arange(n), row], atol=2e-5)
    np.testing.assert_array_equal(out.top_ids[b, :n], np.argsort(-logp, axis=-1, kind="stable")[:, :3])
    np.testing.assert_allclose(out.top_logprobs[b, :n], np.sort(logp, axis=-1)[:, ::-1][:, :3], atol=2e-5)
  # The flags mark accepted proposals that were emitted (a round cut at max_new_tokens accepts a few more).
  assert out.stats.accepted_tokens - 4 * len(prompts) <= out.proposed.sum() <= out.stats.accepted_tokens


def test_without_logprobs_nothing_is_computed(pair):
  target, _ = pair
  out = specjax.generate(target, [PROMPT], max_new_tokens=4)
  assert out.logprobs is None and out.top_ids is None
  out = specjax.generate(target, [PROMPT], max_new_tokens=4, logprobs=0)
  assert out.logprobs.shape == (1, 4) and out.top_ids is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_p=1.5), r"min_p must be a number in \[0.0, 1.0\], got 1.5"),
    (dict(min_p=-0.1), "min_p must be"),
    (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2.0, 2.0\], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0.0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be"),
    (dict(logit_bias={1: 101}), r"logit_bias\[1\] must be a number in \[-100.0, 100.0\]"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token id must be an integer >= 0"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a {token id: bias} mapping"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300"),
])
def test_bad_sampling_options_are_refused_by_name(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingConfig(**kwargs)


def test_generate_refuses_out_of_vocabulary_bias_and_bad_logprobs(pair):
  target, _ = pair
  with pytest.raises(ValueError, match=r"logit_bias token id 12 is outside the vocabulary \[0, 12\)"):
    specjax.generate(target, [PROMPT], sampling=SamplingConfig(1.0, logit_bias={12: 1.0}), max_new_tokens=2)
  for bad in (-1, 21, 1.5, True):
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
      specjax.generate(target, [PROMPT], max_new_tokens=2, logprobs=bad)
  engine = SlotEngine(target, slots=1, max_len=32)
  with pytest.raises(RequestError, match="logit_bias") as e:
    engine.check(Request((1,), 2, SamplingConfig(1.0, logit_bias={40: 1.0})))
  assert e.value.field == "logit_bias"
