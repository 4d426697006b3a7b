"""Shared test helpers: small random models that are cheap to compile on CPU, and references."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.engine import forward
from specjax.models import Llama, LlamaConfig

jax.config.update("jax_default_matmul_precision", "highest")

SMALL = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                    max_seq_len=512)


@contextlib.contextmanager
def backend_compiles():
  """The programs XLA compiled while the block runs, as a list whose length is their number: what a warm-up
  left uncompiled compiles here, even where it was traced before. Counted from jax.monitoring: XLA's compiles
  (``backend_compile_duration``) and, with the persistent compilation cache the suite runs with
  (``tests/conftest.py``), every compile request that reached it, hit or miss (a program another test already
  compiled is read back from the cache, not compiled, and still counts)."""
  seen: list[str] = []

  def on_duration(event: str, seconds: float, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      seen.append(event)

  def on_event(event: str, **_):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
      seen.append(event)

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(on_duration)
    jax.monitoring.unregister_event_listener(on_event)


def make_model(cfg: LlamaConfig = SMALL, seed: int = 0) -> Llama:
  return Llama(cfg, rngs=nnx.Rngs(seed))


def perturbed_copy(model: Llama, scale: float, seed: int) -> Llama:
  """A copy of ``model`` with Gaussian noise of relative size ``scale`` on every weight: a draft that
  agrees with the target often but not always."""
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


_jit_forward = jax.jit(forward, static_argnums=0)


def apply(model, tokens, cache):
  """``model(tokens, cache)`` through the jitted pure forward (eager NNX calls are slow on CPU)."""
  graphdef, state = nnx.split(model)
  return _jit_forward(graphdef, state, jnp.asarray(tokens, jnp.int32), cache)


def full_logits(model: Llama, tokens: np.ndarray) -> np.ndarray:
  """Logits of one uncached forward over ``tokens [B, T]``."""
  tokens = np.asarray(tokens)
  logits, _, _ = apply(model, tokens, model.init_cache(tokens.shape[0], tokens.shape[1]))
  return np.asarray(logits)


def naive_greedy(model: Llama, prompt: list[int], n: int, eos_id: int | None = None) -> list[int]:
  """Greedy decoding by re-running the whole sequence each step: no cache reuse, no speculation."""
  pad = 128
  fwd = lambda toks: apply(model, toks, model.init_cache(1, pad))[0]
  seq = list(prompt)
  out = []
  for _ in range(n):
    buf = np.zeros((1, pad), np.int32)
    buf[0, : len(seq)] = seq
    tok = int(np.argmax(np.asarray(fwd(jnp.asarray(buf)))[0, len(seq) - 1]))
    out.append(tok)
    seq.append(tok)
    if tok == eos_id:
      break
  return out


def start_state(target, proposer, padded, lens, *, k: int, max_new: int, sampling=None, seed: int = 0,
                max_len: int | None = None, keep_out: bool = True):
  """The engine's state before the first round for ``padded [B, P]`` prompts, every row with ``sampling``
  (default greedy) and ``max_new`` tokens: ``(state, mode)`` for :func:`specjax.engine.round_step`."""
  from specjax import engine
  from specjax.config import GREEDY
  from specjax.sampling import Mode, RowSettings, row_keys

  sampling = GREEDY if sampling is None else sampling
  batch = len(lens)
  mode = Mode.of([sampling])
  settings = jax.tree.map(jnp.asarray, RowSettings.of([sampling] * batch, [max_new] * batch, [()] * batch,
                                                      target.cfg.vocab_size, mode))
  max_len = engine.cache_length(padded.shape[1], max_new) if max_len is None else max_len
  state = engine.init_state(target, proposer, jnp.asarray(padded), jnp.asarray(lens), row_keys(seed, batch), settings,
                            k=k, mode=mode, max_len=max_len,
                            out_len=engine.output_length(max_new, k) if keep_out else None)
  return state, mode


def copy_head(heads, noise: float = 0.0, seed: int = 0):
  """Makes a chain head propose (almost) what the target's own head predicts from the feature it reads:
  the layer's own contributions are scaled by ``noise`` and the input projection passes the feature
  through. On a looping target such a head proposes ``last`` again and again: accepted where the target
  repeats, rejected elsewhere (mixed acceptance, as a trained head would see)."""
  graphdef, state = nnx.split(heads)
  keys = iter(jax.random.split(jax.random.key(seed), 64))

  def edit(path, x):
    name = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
    if name.endswith(("attn/wo", "mlp/w_down")):
      return noise * x
    if name.endswith(("fc/w", "proj/w")):  # [2D, D]: embedding half off, feature half the identity
      d = x.shape[1]
      return jnp.concatenate([noise * jax.random.normal(next(keys), (d, d)) / d, jnp.eye(d)], axis=0)
    return x
  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(edit, state))


def run_rounds(target, proposer, prompts, rounds: int, k: int, sampling, seed: int, tree=None):
  """The engine's own state after ``rounds`` rounds (no host loop in generate exposes it); with ``tree`` (a
  tree spec of depth ``k``) each round proposes a token tree."""
  from specjax import engine
  from specjax.decode import prepare_prompts

  padded, lens = prepare_prompts(prompts)
  state, mode = start_state(target, proposer, padded, lens, k=k, max_new=4 * rounds * (k + 1), sampling=sampling,
                            seed=seed)
  if tree is None:
    step = jax.jit(lambda s: engine.round_step(s, target=target, proposer=proposer, k=k, mode=mode)[0])
  else:
    step = jax.jit(lambda s: engine.tree_round_step(s, target=target, proposer=proposer, tree=tree, mode=mode)[0])
  for _ in range(rounds):
    state = step(state)
  return state


def scratch_chain(target, heads, context: list[int], max_len: int):
  """A from-scratch pass of every depth of a chain head over one accepted context (the reference):
  returns per depth the keys and values of its valid positions, and depth 1's output at the frontier."""
  from specjax import engine

  tokens = jnp.asarray([context], jnp.int32)
  aux_layers = heads.cfg.aux_layers
  _, features, _ = engine.target_pass(target, tokens, target.init_cache(1, max_len), aux_layers)
  feats = heads.input_features(features.hidden, features.aux)  # [1, T, F], T = L' + 1 positions
  depths, t = heads.num_depths, len(context)
  out = []
  for d, cache in enumerate(heads.init_caches(1, max_len + depths - 1)):
    shifted = jnp.asarray([context[d + 1:] + [0] * (d + 1)], jnp.int32)  # x_{i+d+1} at position i
    cache = cache.with_lengths(jnp.full((1,), depths - 1))
    new, cache = heads.step(d, target, feats, shifted, cache)
    valid = depths - 1 + (t - 1) - d  # i <= L' - (d + 1), L' = t - 1
    out.append((cache.k[0][0, depths - 1:valid], cache.v[0][0, depths - 1:valid],
                new[0, t - 2] if d == 0 else None))
    feats = new
  return out
