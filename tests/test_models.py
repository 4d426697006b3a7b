"""The model and its cache: cached incremental decoding equals one full forward."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import apply, full_logits, make_model
import specjax
import specjax.tree
from specjax import KVCache, cache_bytes
from specjax.models import LlamaConfig

CONFIGS = {
    "gqa-tied": LlamaConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48),
    "mha-untied": LlamaConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=48, tie_embeddings=False),
    "mqa-untied": LlamaConfig(vocab_size=50, d_model=48, n_layers=3, n_heads=6, n_kv_heads=1, d_ff=32,
                              tie_embeddings=False, rope_base=500.0),
    "gqa-headdim": LlamaConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                               d_ff=40),
}
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_equals_full_forward(name, seed):
  cfg = CONFIGS[name]
  model = make_model(cfg, seed)
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (3, 13)).astype(np.int32)
  expected = full_logits(model, tokens)

  # Prefill 4 tokens, then chunks of 1, 3, 2, 1, 2 into a longer cache.
  cache = model.init_cache(3, 32)
  got, start = [], 0
  for size in (4, 1, 3, 2, 1, 2):
    logits, _, cache = apply(model, tokens[:, start:start + size], cache)
    got.append(np.asarray(logits))
    start += size
  np.testing.assert_allclose(np.concatenate(got, axis=1), expected, **TOL)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [13, 13, 13])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ragged_rows_and_rollback(name):
  """Rows at different offsets, and a rejected window rolled back by lowering lengths only."""
  cfg = CONFIGS[name]
  model = make_model(cfg, 3)
  rng = np.random.default_rng(7)
  lens = np.array([3, 7, 5], np.int32)
  seqs = rng.integers(0, cfg.vocab_size, (3, 12)).astype(np.int32)

  cache = model.init_cache(3, 24)
  _, _, cache = apply(model, seqs[:, :8], cache)  # writes 8 positions, rows use fewer
  cache = cache.with_lengths(jnp.asarray(lens))
  garbage = rng.integers(0, cfg.vocab_size, (3, 4)).astype(np.int32)
  _, _, cache = apply(model, garbage, cache)  # a rejected speculative window...
  cache = cache.with_lengths(jnp.asarray(lens))  # ...rolled back
  step = np.stack([seqs[b, lens[b]:lens[b] + 3] for b in range(3)])
  logits, _, cache = apply(model, step, cache)
  np.testing.assert_array_equal(np.asarray(cache.lengths), lens + 3)
  for b in range(3):
    ref = full_logits(model, seqs[b:b + 1, : lens[b] + 3])[0, lens[b]:]
    np.testing.assert_allclose(np.asarray(logits)[b], ref, **TOL)


def test_forward_contract_shapes():
  cfg = CONFIGS["gqa-tied"]
  model = make_model(cfg)
  logits, hidden, cache = model(jnp.zeros((2, 5), jnp.int32), model.init_cache(2, 9))
  assert logits.shape == (2, 5, cfg.vocab_size) and logits.dtype == jnp.float32
  assert hidden.shape == (2, 5, cfg.d_model)
  assert len(cache.k) == cfg.n_layers and cache.k[0].shape == (2, 9, cfg.n_kv_heads, cfg.head_dim)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_forward_features_capture_the_residual_streams_entering_layers(family):
  """aux is the residual stream entering each requested block (a manual layer-by-layer capture);
  logits, hidden and cache equal the plain forward's; embed_tokens and unembed compose to it."""
  import jax

  from specjax.models import GPT2, GPT2Config, Llama

  if family == "llama":
    cfg = CONFIGS["mqa-untied"]
    model = Llama(cfg, rngs=nnx.Rngs(0))
  else:
    cfg = GPT2Config(vocab_size=50, d_model=32, n_layers=3, n_heads=4, max_seq_len=64)
    model = GPT2(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 7)), jnp.int32)
  cache = model.init_cache(2, 16)
  logits, hidden, aux, new = model.forward_features(tokens, cache, (0, 2))
  ref_logits, ref_hidden, ref_cache = model(tokens, cache)
  np.testing.assert_array_equal(logits, ref_logits)
  np.testing.assert_array_equal(hidden, ref_hidden)
  np.testing.assert_array_equal(new.k[1], ref_cache.k[1])
  positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
  x = model.embed_tokens(tokens)
  if family == "gpt2":
    x = x + model.pos_embed[...][:7]
  captured = []
  for layer, block in enumerate(model.blocks):
    captured.append(x)
    x, _, _ = block(x, positions, cache.k[layer], cache.v[layer], cache.lengths)
  np.testing.assert_allclose(aux, jnp.concatenate([captured[0], captured[2]], -1), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(model.unembed(model.final_norm(x)), logits, rtol=1e-5, atol=1e-5)
  assert model.forward_features(tokens, cache)[2] is None


PENDING = {
    "gqa": CONFIGS["gqa-tied"],
    "sliding-softcap": LlamaConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, d_ff=48,
                                   attn_softcap=20.0, sliding_window=3, sliding_layers=(True, False)),
    "gpt2": "gpt2",
}


@pytest.mark.parametrize("name", sorted(PENDING))
def test_a_pending_pass_equals_the_pass_that_writes(name):
  """forward_pending reads the cache only: its logits, hidden and aux equal forward_features' (float32
  tolerance), and cache.append(pending) is the cache that pass wrote, on ragged rows whose stale entries past
  their lengths must stay invisible, with a sliding window shorter than the pass."""
  import jax

  from specjax.models import GPT2, GPT2Config

  if PENDING[name] == "gpt2":
    cfg = GPT2Config(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
    model = GPT2(cfg, rngs=nnx.Rngs(1))
  else:
    cfg = PENDING[name]
    model = make_model(cfg, 1)
  rng = np.random.default_rng(1)
  cache = model.init_cache(3, 24)
  _, _, cache = model(jnp.asarray(rng.integers(0, 50, (3, 10)), jnp.int32), cache)
  cache = cache.with_lengths(jnp.asarray([10, 4, 7]))  # rows 1 and 2 hold stale entries past their lengths
  window = jnp.asarray(rng.integers(0, 50, (3, 5)), jnp.int32)
  logits, hidden, aux, written = jax.jit(lambda c: model.forward_features(window, c, (1,)))(cache)
  p_logits, p_hidden, p_aux, pending = jax.jit(lambda c: model.forward_pending(window, c, (1,)))(cache)
  tol = dict(rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(p_logits, logits, **tol)
  np.testing.assert_allclose(p_hidden, hidden, **tol)
  np.testing.assert_allclose(p_aux, aux, **tol)
  appended = cache.append(pending)
  np.testing.assert_array_equal(appended.lengths, written.lengths)
  for got, want in zip(appended.k + appended.v, written.k + written.v):
    np.testing.assert_allclose(got, want, **tol)
  with pytest.raises(ValueError, match="write=False"):
    model.forward_features(window, cache, tree=specjax.tree.verify_mask(
        specjax.tree.Tree(tokens=window, parents=jnp.zeros((3, 5), jnp.int32), depths=jnp.ones((3, 5), jnp.int32),
                          ranks=jnp.zeros((3, 5), jnp.int32), valid=jnp.ones((3, 5), bool)), cache.lengths, 2),
        write=False)


@pytest.mark.parametrize("name", ["gqa", "sliding-softcap", "gpt2"])
def test_short_passes_over_a_long_cache_equal_the_full_forward(name, monkeypatch):
  """Decode steps and a window over a cache of >= PADDED_MIN_POSITIONS positions attend with head-padded
  queries (models.llama.grouped_attention): their logits equal one full forward's (which contracts per head)
  within float32 tolerance, and the padded path is the one taken (a broken padded product must fail here)."""
  import jax

  from specjax.models import GPT2, GPT2Config
  from specjax.models import llama

  if PENDING[name] == "gpt2":
    model = GPT2(GPT2Config(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_seq_len=640), rngs=nnx.Rngs(2))
  else:
    model = make_model(PENDING[name].replace(max_seq_len=640), 2)
  tokens = np.random.default_rng(2).integers(0, 50, (2, 520)).astype(np.int32)
  expected = full_logits(model, tokens)
  taken = []
  original = llama.grouped_attention

  def spy(q, blocks, *args, **kwargs):
    taken.append(q.shape[1] <= llama.PADDED_MAX_QUERIES and blocks[0][0].shape[1] >= llama.PADDED_MIN_POSITIONS)
    return original(q, blocks, *args, **kwargs)

  monkeypatch.setattr(llama, "grouped_attention", spy)
  if PENDING[name] == "gpt2":
    monkeypatch.setattr("specjax.models.gpt2.grouped_attention", spy)
  cache = model.init_cache(2, 600)
  _, _, cache = model(jnp.asarray(tokens[:, :512]), cache)
  got = []
  for start, size in ((512, 1), (513, 1), (514, 4), (518, 2)):
    logits, _, cache = jax.jit(model.__call__)(jnp.asarray(tokens[:, start:start + size]), cache)
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, axis=1), expected[:, 512:], **TOL)
  assert any(taken) and not all(taken)  # the prefill per head, the short passes padded


def test_bfloat16_model_runs_close_to_float32():
  cfg = CONFIGS["gqa-tied"]
  ref = make_model(cfg, 0)
  low = make_model(cfg.replace(dtype="bfloat16", param_dtype="bfloat16"), 0)
  assert low.embed[...].dtype == jnp.bfloat16
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6))
  a, b = full_logits(ref, tokens), full_logits(low, tokens)
  assert b.dtype == np.float32
  assert np.linalg.norm(a - b) / np.linalg.norm(a) < 3e-2


@pytest.mark.parametrize("cfg", [CONFIGS["gqa-tied"], CONFIGS["mqa-untied"],
                                 CONFIGS["gqa-tied"].replace(dtype="bfloat16")])
def test_cache_bytes_matches_buffers(cfg):
  cache = KVCache.init(cfg, 3, 17)
  actual = sum(x.nbytes for x in cache.k + cache.v) + cache.lengths.nbytes
  assert cache_bytes(cfg, 3, 17) == actual


@pytest.mark.parametrize("field,value,match", [
    ("n_kv_heads", 3, "multiple of n_kv_heads"),
    ("n_kv_heads", 8, "n_kv_heads must be in"),
    ("d_model", 30, "divisible by n_heads"),
    ("n_layers", 0, "n_layers must be an integer >= 1"),
    ("vocab_size", -1, "vocab_size must be an integer >= 1"),
    ("dtype", "float64", "dtype must be one of"),
    ("rope_base", 0.5, "rope_base must be > 1"),
    ("head_dim", 7, "head_dim must be an even integer"),
])
def test_config_validation(field, value, match):
  kwargs = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
  kwargs[field] = value
  with pytest.raises(ValueError, match=match):
    LlamaConfig(**kwargs)
