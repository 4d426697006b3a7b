"""Window invariance: a verify pass under ``SpecConfig(invariant=True)`` computes every position bit for bit as
the target alone's one-token step does, so greedy speculation equals the target alone token for token in
bfloat16 too, on inputs built to sit on near-ties of the logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax import SpecConfig, engine, numerics
from specjax import tree as tree_lib
from specjax.loading import mixed_precision
from specjax.runtime import RUNTIME
from specjax.models import GPT2, GPT2Config, Llama, LlamaConfig
from specjax.models.heads import build_heads
from specjax.proposers import DraftModel, Eagle, NGram
from specjax.tree import parse_tree

from helpers import copy_head, perturbed_copy

# 512 wide: with attention's head-padded queries (models.llama.grouped_attention, on caches of 512 positions or
# more) narrower models (128, 256) multiply a window and a one-token step alike on this CPU, and the tests below
# would hold without per_position too.
BASE = dict(vocab_size=256, d_model=512, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=1024, max_seq_len=256)
FAMILIES = {
    "llama": lambda dt: Llama(LlamaConfig(**BASE, dtype=dt, param_dtype=dt), rngs=nnx.Rngs(0)),
    "mistral": lambda dt: Llama(LlamaConfig(**BASE, sliding_window=6, tie_embeddings=False, dtype=dt,
                                            param_dtype=dt), rngs=nnx.Rngs(1)),
    "qwen2": lambda dt: _with_biases(Llama(LlamaConfig(**BASE, qkv_bias=True, dtype=dt, param_dtype=dt),
                                           rngs=nnx.Rngs(2))),
    "gemma": lambda dt: Llama(LlamaConfig(**BASE, activation="gelu_tanh", norm_offset=1.0,
                                          embed_scale=128**0.5, dtype=dt, param_dtype=dt), rngs=nnx.Rngs(3)),
    "gemma2": lambda dt: Llama(LlamaConfig(**BASE, activation="gelu_tanh", norm_offset=1.0, post_norms=True,
                                           attn_softcap=50.0, final_softcap=30.0, sliding_window=6,
                                           sliding_layers=(True, False), dtype=dt, param_dtype=dt),
                               rngs=nnx.Rngs(4)),
    "gemma3": lambda dt: Llama(LlamaConfig(**BASE, activation="gelu_tanh", norm_offset=1.0, post_norms=True,
                                           qk_norm=True, final_softcap=30.0, sliding_window=6,
                                           sliding_layers=(True, False), local_rope_base=100.0,
                                           rope_base=1e6, dtype=dt, param_dtype=dt), rngs=nnx.Rngs(6)),
    "phi3": lambda dt: Llama(LlamaConfig(**BASE, rotary_dim=16, sliding_window=6, tie_embeddings=False,
                                         dtype=dt, param_dtype=dt), rngs=nnx.Rngs(7)),
    "gpt2": lambda dt: GPT2(GPT2Config(vocab_size=256, d_model=512, n_layers=2, n_heads=4, max_seq_len=256,
                                       dtype=dt, param_dtype=dt), rngs=nnx.Rngs(5)),
}


def _with_biases(model):
  """Qwen2's q/k/v biases, made nonzero (they start at zero)."""
  for block in model.blocks:
    for name in ("bq", "bk", "bv"):
      bias = getattr(block.attn, name)
      bias[...] = (0.1 * jax.random.normal(jax.random.key(len(name)), bias.shape)).astype(bias.dtype)
  return model


@functools.partial(jax.jit, static_argnames=("graphdef", "invariant"))
def _pass(graphdef, state, tokens, cache, invariant=False):
  with numerics.per_position(invariant):
    logits, hidden, cache = nnx.merge(graphdef, state)(tokens, cache)
  return logits, hidden, cache


# Every family in bfloat16; in float32 Llama and GPT-2 (the Llama families' other features run with float32
# activations in the mixed-precision test below, each family there).
WINDOW_CASES = [(family, "bfloat16") for family in sorted(FAMILIES)] + [("llama", "float32"), ("gpt2", "float32")]


@pytest.mark.parametrize("family,dtype", WINDOW_CASES)
def test_window_positions_equal_one_token_steps_bit_for_bit(family, dtype):
  """Position i of a 6-token pass under per_position: logits, hidden state and the cache's keys and values
  exactly those of six one-token steps, rows at different offsets; the plain window pass does not manage it
  on every family (the products round by shape)."""
  model = FAMILIES[family](dtype)
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  batch, window = 3, 6
  prompt = rng.integers(0, 256, (batch, 16)).astype(np.int32)
  _, _, cache = _pass(graphdef, state, prompt, model.init_cache(batch, 64))
  cache = cache.with_lengths(jnp.asarray([16, 9, 13], jnp.int32))  # ragged rows
  tokens = rng.integers(0, 256, (batch, window)).astype(np.int32)

  steps, step_cache = [], cache
  for i in range(window):
    logits, hidden, step_cache = _pass(graphdef, state, tokens[:, i:i + 1], step_cache)
    steps.append((np.asarray(logits), np.asarray(hidden.astype(jnp.float32))))
  step_logits = np.concatenate([s[0] for s in steps], axis=1)
  step_hidden = np.concatenate([s[1] for s in steps], axis=1)

  logits, hidden, window_cache = _pass(graphdef, state, tokens, cache, invariant=True)
  assert logits.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(logits), step_logits)
  np.testing.assert_array_equal(np.asarray(hidden.astype(jnp.float32)), step_hidden)
  for got, want in zip(window_cache.k + window_cache.v, step_cache.k + step_cache.v):
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(window_cache.lengths), np.asarray(step_cache.lengths))


# Node 5's path (slots 0, 2, 4, 5), node 7's (0, 2, 6, 7) and others pass over sibling slots between their ancestors.
TREE_PARENTS = (-1, 0, 0, 1, 2, 4, 2, 6, 3, 7)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _tree_pass(graphdef, state, tokens, cache, mask):
  with numerics.per_position(True):
    return nnx.merge(graphdef, state)(tokens, cache, tree=mask)


@pytest.mark.parametrize("family,precision,cache_len,seed", [
    ("llama", "mixed", 64, 101), ("llama", "mixed", 512, 2), ("mistral", "mixed", 64, 101),
    ("gemma2", "mixed", 64, 101), ("gpt2", "bfloat16", 64, 101)])
def test_tree_nodes_equal_one_token_steps_along_their_paths_bit_for_bit(family, precision, cache_len, seed):
  """A tree verify pass under per_position: each node's logits and hidden state are bit for bit those of the
  one-token steps that decode its path in order from the same cache (rows at different lengths), though in the
  pass its ancestors sit at the tree's slots with masked siblings between them; and the pass leaves the nodes'
  keys and values at the tree's slots (what :func:`specjax.tree.compact` moves). Attention that read the
  ancestors where the pass wrote them summed its terms at other offsets and rounded apart: the three mixed
  models at 64 positions fail so (under the suite's XLA flags), and so does Llama with a cache of 512 positions
  (attention's head-padded form) at its seed (at 9 of the 15 seeds tried; not at 101); GPT-2 in bfloat16, which
  did not depart without the reordering, checks its wiring."""
  model = mixed_precision(FAMILIES[family]("float32")) if precision == "mixed" else FAMILIES[family](precision)
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(seed)
  starts = [24, 11, 17, 30, 6, 21]
  batch = len(starts)
  prompt = rng.integers(0, 256, (batch, 30)).astype(np.int32)
  _, _, cache = _pass(graphdef, state, prompt, model.init_cache(batch, cache_len))  # 512: head-padded attention
  cache = cache.with_lengths(jnp.asarray(starts, jnp.int32))
  parents = jnp.broadcast_to(jnp.asarray(TREE_PARENTS, jnp.int32), (batch, len(TREE_PARENTS)))
  depths = [0]
  for parent in TREE_PARENTS[1:]:
    depths.append(depths[parent] + 1)
  depths = jnp.broadcast_to(jnp.asarray(depths, jnp.int32), parents.shape)
  tokens = rng.integers(0, 256, parents.shape).astype(np.int32)
  nodes = tree_lib.Tree(tokens=jnp.asarray(tokens), parents=parents, depths=depths, ranks=jnp.zeros_like(parents),
                        valid=jnp.ones(parents.shape, bool))
  mask = tree_lib.verify_mask(nodes, cache.lengths, int(depths.max()))
  logits, hidden, tree_cache = _tree_pass(graphdef, state, tokens, cache, mask)

  for node in range(len(TREE_PARENTS)):
    path = [node]
    while TREE_PARENTS[path[-1]] >= 0:
      path.append(TREE_PARENTS[path[-1]])
    step_cache = cache
    for slot in reversed(path):
      step_logits, step_hidden, step_cache = _pass(graphdef, state, tokens[:, slot:slot + 1], step_cache)
    np.testing.assert_array_equal(np.asarray(logits[:, node]), np.asarray(step_logits[:, 0]), err_msg=f"node {node}")
    np.testing.assert_array_equal(np.asarray(hidden[:, node].astype(jnp.float32)),
                                  np.asarray(step_hidden[:, 0].astype(jnp.float32)), err_msg=f"node {node}")
    for got, want in zip(tree_cache.k + tree_cache.v, step_cache.k + step_cache.v):  # at the node's slot
      for row, start in enumerate(starts):
        np.testing.assert_array_equal(np.asarray(got[row, start + node].astype(jnp.float32)),
                                      np.asarray(want[row, start + len(path) - 1].astype(jnp.float32)))
  for got, want in zip(tree_cache.k + tree_cache.v, cache.k + cache.v):  # the context untouched
    for row, start in enumerate(starts):
      np.testing.assert_array_equal(np.asarray(got[row, :start].astype(jnp.float32)),
                                    np.asarray(want[row, :start].astype(jnp.float32)))


def test_plain_window_pass_rounds_differently_here():
  """The premise, on this backend and at these models' width: without per_position the same pass is not bit
  for bit the one-token steps (if this ever passes, the backend's products have become shape-invariant and the
  option costs for nothing)."""
  differs = []
  for family in ("llama", "gpt2"):
    model = FAMILIES[family]("float32")
    graphdef, state = nnx.split(model)
    tokens = np.random.default_rng(1).integers(0, 256, (2, 6)).astype(np.int32)
    cache = model.init_cache(2, 32)
    window = np.asarray(_pass(graphdef, state, tokens, cache)[0])
    step_cache, steps = cache, []
    for i in range(6):
      logits, _, step_cache = _pass(graphdef, state, tokens[:, i:i + 1], step_cache)
      steps.append(np.asarray(logits))
    differs.append(not np.array_equal(window, np.concatenate(steps, axis=1)))
  assert any(differs)


def _near_tie_target(seed: int = 0, dtype: str = "bfloat16", width: int = 256) -> Llama:
  """A random bfloat16 target whose vocabulary comes in near-twin pairs: token 2j + 1's output row is token
  2j's with each weight moved by about 2^-8 of itself (one bfloat16 step), so whenever the argmax falls in a
  pair the winner is decided by differences at the rounding level of the hidden state. Wide enough (256, the
  default ``width``) that this backend's products round by shape."""
  cfg = LlamaConfig(vocab_size=512, d_model=width, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=2 * width,
                    max_seq_len=512, tie_embeddings=False, dtype=dtype, param_dtype=dtype)
  model = Llama(cfg, rngs=nnx.Rngs(seed))
  head = np.array(model.lm_head[...].astype(jnp.float32))  # [D, V]
  noise = np.random.default_rng(seed).normal(size=head[:, 1::2].shape) * np.abs(head[:, ::2]) * 2.0**-8
  head[:, 1::2] = head[:, ::2] + noise
  model.lm_head[...] = jnp.asarray(head).astype(jnp.bfloat16).astype(dtype)  # twins apart by a bfloat16 step
  return model


@pytest.fixture(scope="module")
def near_ties():
  """The target, 12 prompts, and the target alone's 96 greedy tokens for each."""
  target = _near_tie_target()
  prompts = np.random.default_rng(3).integers(0, 512, (12, 9)).tolist()
  return target, prompts, specjax.generate(target, prompts, max_new_tokens=96)


def _proposer(method: str, target):
  if method == "draft":  # the target itself: every proposal is the target alone's token
    return DraftModel(perturbed_copy(target, 0.0, seed=1))
  if method == "ngram":
    return NGram()
  return Eagle(copy_head(build_heads("eagle1", target.cfg, seed=2), noise=0.1))


@pytest.mark.parametrize("method", ["draft", "ngram", "eagle"])
def test_bfloat16_greedy_speculation_equals_target_alone_on_near_ties(near_ties, method):
  """bfloat16, near-tied logits, 12 rows of 96 tokens: with invariant=True every proposer's output is the
  target alone's token for token, and a draft equal to the target has every proposal accepted. Without it
  the same draft's runs differ and see rejections (the test's power, on this backend)."""
  target, prompts, alone = near_ties
  proposer = _proposer(method, target)
  exact = specjax.generate(target, prompts, proposer=proposer, spec=SpecConfig(k=4, invariant=True),
                           max_new_tokens=96)
  np.testing.assert_array_equal(exact.tokens, alone.tokens)
  assert exact.stats.accepted_tokens > 0
  if method == "draft":
    assert exact.stats.acceptance_rate == 1.0
    plain = specjax.generate(target, prompts, proposer=proposer, spec=SpecConfig(k=4), max_new_tokens=96)
    assert (plain.tokens != alone.tokens).any(axis=1).sum() >= 1
    assert plain.stats.acceptance_rate < 1.0


def test_spec_config_invariant_is_checked():
  with pytest.raises(ValueError, match="invariant must be True or False, got 1"):
    SpecConfig(invariant=1)


LLAMA_FAMILIES = sorted(f for f in FAMILIES if f != "gpt2")


def _mixed_window(graphdef, state, model, batch: int, window: int, lengths=None, plain: bool = True):
  """A window pass at ``batch`` ragged rows under per_position, checked bit for bit against ``window`` one-token
  steps (logits, hidden, cache); with ``plain``, returns whether the plain window pass (without per_position)
  equals them too."""
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 256, (batch, 16)).astype(np.int32)
  _, _, cache = _pass(graphdef, state, prompt, model.init_cache(batch, 64))
  lengths = rng.integers(8, 17, batch) if lengths is None else lengths
  cache = cache.with_lengths(jnp.asarray(lengths, jnp.int32))
  tokens = rng.integers(0, 256, (batch, window)).astype(np.int32)
  steps, step_cache = [], cache
  for i in range(window):
    logits, hidden, step_cache = _pass(graphdef, state, tokens[:, i:i + 1], step_cache)
    steps.append((np.asarray(logits), np.asarray(hidden)))
  logits, hidden, window_cache = _pass(graphdef, state, tokens, cache, invariant=True)
  want = np.concatenate([s[0] for s in steps], axis=1)
  np.testing.assert_array_equal(np.asarray(logits), want)
  np.testing.assert_array_equal(np.asarray(hidden), np.concatenate([s[1] for s in steps], axis=1))
  for got, expected in zip(window_cache.k + window_cache.v, step_cache.k + step_cache.v):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  return plain and np.array_equal(np.asarray(_pass(graphdef, state, tokens, cache)[0]), want)


@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_mixed_precision_window_equals_one_token_steps_bit_for_bit(family):
  """Mixed precision (bfloat16 weight products, float32 activations): position i of a 6-token pass at 3 ragged
  rows equals six one-token steps bit for bit (logits, hidden, cache) with only attention and the norms taken
  position by position; the products run on the whole window. Without per_position the norms' row reductions
  round some rows differently and the logits differ (the power, on Llama): at 3 rows (18 window rows) on the
  Xeons of 2026-12, at 5 rows (30) on an AMD EPYC, whose 3-row window happens to round like the steps."""
  model = mixed_precision(FAMILIES[family]("float32"))
  graphdef, state = nnx.split(model)
  plain_equal = _mixed_window(graphdef, state, model, 3, 6, lengths=[16, 9, 13], plain=family == "llama")
  if family == "llama":
    assert not (plain_equal and _mixed_window(graphdef, state, model, 5, 6))


def _mixed_near_ties(monkeypatch, width: int, heads: bool = True) -> bool:
  """The checks of the test below on a mixed target of this width (with ``heads``, the EAGLE head's chain and
  tree too); returns whether, with the engine's rule switched off, the equal draft's run departs from the
  target alone (the test's power)."""
  target = mixed_precision(_near_tie_target(dtype="float32", width=width))
  prompts = np.random.default_rng(3).integers(0, 512, (8, 9)).tolist()
  alone = specjax.generate(target, prompts, max_new_tokens=64)
  draft = DraftModel(perturbed_copy(target, 0.0, seed=1))
  cases = [(draft, SpecConfig(k=4))]
  if heads:  # the head proposes the last token again: accepted where the target repeats itself, as this one does
    eagle = Eagle(copy_head(build_heads("eagle1", target.cfg, seed=2), noise=0.1))
    cases += [(eagle, SpecConfig(k=4)), (eagle, SpecConfig(tree=parse_tree("dynamic:2,3,6")))]
  for proposer, spec in cases:
    exact = specjax.generate(target, prompts, proposer=proposer, spec=spec, max_new_tokens=64)
    np.testing.assert_array_equal(exact.tokens, alone.tokens)
    assert exact.stats.accepted_tokens > 0
  assert specjax.generate(target, prompts, proposer=draft, spec=SpecConfig(k=4),
                          max_new_tokens=64).stats.acceptance_rate == 1.0
  monkeypatch.setattr(engine, "always_invariant", lambda target, invariant: invariant)
  try:
    jax.clear_caches()  # the programs traced above verify position by position
    RUNTIME.clear()
    plain = specjax.generate(target, prompts, proposer=draft, spec=SpecConfig(k=4), max_new_tokens=64)
  finally:  # no program traced with the rule off may outlive the test
    monkeypatch.undo()
    jax.clear_caches()
    RUNTIME.clear()
  return (plain.tokens != alone.tokens).any(axis=1).sum() >= 1 and plain.stats.acceptance_rate < 1.0


def test_mixed_precision_greedy_speculation_equals_target_alone_on_near_ties(monkeypatch):
  """A mixed-precision target with near-tied logits, 8 rows of 64 tokens: speculation with a draft equal to
  the target and with an EAGLE head (a chain and a tree), at the default SpecConfig (the engine verifies a mixed
  target position by position by itself), equals the target alone token for token, and the equal draft has
  every proposal accepted. With the engine's rule switched off the equal draft's runs differ and see
  rejections: at width 256 on the Xeons of 2026-12; an AMD EPYC (AVX512-BF16) rounds that target's windows
  like its steps, so the equal draft's checks run again at width 1024, where it does not."""
  assert _mixed_near_ties(monkeypatch, 256) or _mixed_near_ties(monkeypatch, 1024, heads=False)
