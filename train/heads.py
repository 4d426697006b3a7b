"""Training heads on a frozen target: Medusa, EAGLE-1/3 (with training-time test) and MTP.

Every loss distils the target's own next-token distributions, computed on the fly from the same batch (the
target is run inside the jitted step, its outputs under ``stop_gradient``: its parameters never change).
For a batch ``rows [B, T+1]`` the target gives, at every position t, ``p_t`` (the distribution of
``x_{t+1}``), its final hidden state ``h_t`` and, for EAGLE-3, the residual streams entering the chosen
layers. The conventions are the inference ones (:mod:`specjax.proposers`), so a trained head is used
as trained:

- Medusa head j on ``h_t`` predicts ``x_{t+2+j}``: forward KL to ``p_{t+1+j}``, head j weighted
  ``decay^j`` (Medusa's later recipe; Hydra++ found the teacher's distributions better than data labels).
- EAGLE (chain, one depth): the pair ``(F_t, x_{t+1})`` at position t gives ``o_t``, whose logits predict
  ``x_{t+2}``: soft cross entropy against ``p_{t+1}``. EAGLE-1 adds ``SmoothL1(o_t, h_{t+1})`` (feature
  regression, weight ``regression``) with the token term weighted ``token_loss`` (EAGLE-1: 1.0 and 0.1)
  and uniform noise on the input features. EAGLE-3 predicts over its draft vocabulary: the target's
  distribution restricted to it and renormalised, positions whose target argmax lies outside it dropped.
- Training-time test (``ttt_steps = m > 1``, EAGLE-3's recipe): step s feeds the head its own step-(s-1)
  outputs, ``(o^{s-1}_{t-1}, x_{t+1})`` at position t, attending to the step-0 keys at positions
  ``<= t - s`` (the real prefix) and to its own keys of steps 1..s at ``t - s + r``: exactly what a chain
  proposal ``s + 1`` sees at inference. Step s is weighted ``decay^s``.
- MTP (DeepSeek-V3): module d (0-based) reads ``(h^d_t, x_{t+d+1})`` (``h^0`` the target's hidden state,
  ``h^{d}`` module d-1's output) and predicts ``x_{t+d+2}``: forward KL to ``p_{t+d+1}``, weighted
  ``decay^d``. Module d >= 2 at position t does not see positions ``t-d+1 .. t-1`` (their tokens lie past
  the accepted context at inference); a one-module MTP head can take the training-time test as EAGLE does.

Each loss also reports, per proposal position, ``Σ_v min(p, q)`` (the expected acceptance of a token drawn
from q at temperature 1) and the greedy agreement: the offline predictors of acceptance that
``specjax eval`` puts next to the measured ones.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.heads import KINDS, ChainHeadModule, build_heads

_HUBER_DELTA = 1.0
CACHE_DTYPES = ("bfloat16", "float32")
INIT_VOCABS = ("keep", "data")  # HeadsConfig.init_vocab


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
  """The ``[heads]`` section of a head recipe.

  Attributes:
    kind: one of ``medusa``, ``eagle1``, ``eagle3``, ``mtp``.
    num_heads: Medusa heads (the most proposals per round) or MTP modules.
    d_model: the head layer's width: ``"target"`` (or 0, or omitted: the target's own width, EAGLE's default and
      the only width Medusa, EAGLE-1 and MTP take) or, for EAGLE-3, a narrower width (``< `` the target's,
      divisible by ``n_heads``); checked against the target when the run starts.
    n_heads, n_kv_heads, d_ff: the head layer's attention heads, key/value heads and MLP width (0 = the
      target's heads, ``3 * d_model`` for d_ff).
    draft_vocab_size: EAGLE-3: the reduced draft vocabulary, the most frequent training tokens (0 = all).
    aux_layers: EAGLE-3: target layers whose incoming residual streams are fused (empty = the default
      low/middle/high layers).
    ttt_steps: chain heads with one depth: steps of the training-time test (1 = none).
    decay: weight ratio between successive heads, TTT steps or MTP modules.
    regression, token_loss: EAGLE-1's weights of the feature regression and of the token loss.
    feature_noise: EAGLE-1: half-width of the uniform noise added to the input features.
    medusa_layers: residual blocks per Medusa head.
    cache_features: the training mode. ``true`` (offline): the target's features and distributions are
      computed once for every training row before training and held on the host (a large target: its forward
      would dominate a step; needs a corpus-only data mix). ``false`` (online): the target's forward runs inside
      the jitted training step, placed on the mesh with the head; no features are cached (the host holds
      only the token rows), so the data may be far larger than a feature cache allows. The loss and the head
      are the same either way.
    cache_top_k: offline: keep each position's ``k`` most likely tokens and their probabilities (0: the whole
      distribution, for small vocabularies); the losses then use the top-k.
    cache_dtype: offline: the dtype of the cached features, ``"bfloat16"`` (half the memory) or ``"float32"``
      (with ``cache_top_k = 0``, exactly what the online mode computes).
    init: the head set training starts from (empty: a fresh one): the short name of a model that ships heads
      (its heads of this kind, e.g. ``"smollm2-135m-instruct"``), a heads run directory (its ``heads/``
      export) or a head folder in specjax's layout or a published one (EAGLE-3, EAGLE-1, Medusa:
      :mod:`specjax.head_formats`); relative paths also against the recipe's folder. Its shape is the
      run's: the shape fields above left at their defaults take the init's values, and a field given must
      agree with it (refused by field otherwise); EAGLE-3 keeps the init's draft vocabulary unless ``init_vocab``
      says otherwise.
    init_vocab: EAGLE-3 with ``init``: ``"keep"`` (default) the init's draft vocabulary, or ``"data"``: the
      vocabulary made again from this run's train split (its ``draft_vocab_size`` most frequent answer tokens;
      ``draft_vocab_size`` 0 keeps the init's size), every other parameter kept: the output rows of tokens in
      both vocabularies are kept, the new tokens' rows predicted from the target's embeddings of them
      (:func:`refit_vocab`). For a head whose vocabulary came from other text (a code head fine-tuned on chat).
  """

  kind: str = "eagle3"
  num_heads: int = 4
  d_model: int | str = 0
  n_heads: int = 0
  n_kv_heads: int = 0
  d_ff: int = 0
  draft_vocab_size: int = 0
  aux_layers: tuple[int, ...] = ()
  ttt_steps: int = 1
  decay: float = 0.8
  regression: float = 1.0
  token_loss: float = 0.1
  feature_noise: float = 0.0
  medusa_layers: int = 1
  cache_features: bool = False
  cache_top_k: int = 64
  cache_dtype: str = "bfloat16"
  init: str = ""
  init_vocab: str = "keep"

  def __post_init__(self):
    from specjax.train.config import ConfigError, check_float, check_field_int

    if self.kind not in KINDS:
      raise ConfigError(f"heads.kind must be one of {KINDS}, got {self.kind!r}")
    if self.d_model == "target":
      object.__setattr__(self, "d_model", 0)
    elif isinstance(self.d_model, str):
      raise ConfigError(f"heads.d_model must be \"target\" (the target's width) or a positive width, "
                        f"got {self.d_model!r}")
    if self.cache_dtype not in CACHE_DTYPES:
      raise ConfigError(f"heads.cache_dtype must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}")
    for name in ("num_heads", "ttt_steps", "medusa_layers"):
      check_field_int("heads", name, getattr(self, name))
    for name in ("d_model", "n_heads", "n_kv_heads", "d_ff", "draft_vocab_size", "cache_top_k"):
      check_field_int("heads", name, getattr(self, name), 0)
    if not isinstance(self.cache_features, bool):
      raise ConfigError(f"heads.cache_features must be true or false, got {self.cache_features!r}")
    if not isinstance(self.init, str):
      raise ConfigError(f"heads.init must be a model's short name or a head folder (a string), got {self.init!r}")
    if self.init_vocab not in INIT_VOCABS:
      raise ConfigError(f"heads.init_vocab must be one of {INIT_VOCABS}, got {self.init_vocab!r}")
    if self.init_vocab == "data" and (self.kind != "eagle3" or not self.init):
      raise ConfigError(f"heads.init_vocab = \"data\" makes an initial EAGLE-3 head's draft vocabulary again: it needs "
                        f"heads.kind = \"eagle3\" and heads.init, got kind {self.kind!r} and init {self.init!r}")
    for name in ("regression", "token_loss", "feature_noise"):
      check_float("heads", name, getattr(self, name), 0.0)
    check_float("heads", "decay", self.decay, 0.0, 1.0, low_open=True)
    object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
    if self.ttt_steps > 1 and (self.kind == "medusa" or (self.kind == "mtp" and self.num_heads > 1)):
      raise ConfigError(f"heads.ttt_steps > 1 needs a chain head with one depth (eagle1, eagle3, or mtp with "
                        f"num_heads = 1), got kind {self.kind!r} with num_heads {self.num_heads}")
    if self.kind in ("eagle1", "eagle3") and self.num_heads != 1:
      object.__setattr__(self, "num_heads", 1)

  def check_target(self, target_cfg) -> None:
    """Refuses a head width the target cannot take, naming the field: ``d_model`` must be the target's
    (``"target"``) or, for EAGLE-3, narrower and divisible by the head's attention heads.

    Raises:
      ConfigError: naming ``heads.d_model`` (or ``heads.n_heads``), the value and the allowed ones.
    """
    from specjax.train.config import ConfigError

    width = target_cfg.d_model
    if not self.d_model or self.d_model == width:
      return
    if self.kind != "eagle3":
      raise ConfigError(f"heads.d_model ({self.d_model}) of a {self.kind} head must be \"target\" (the target's "
                        f"width, {width}): its outputs feed the target's unembedding; only eagle3 may be narrower")
    if self.d_model > width:
      raise ConfigError(f"heads.d_model ({self.d_model}) must be \"target\" (the target's width, {width}) or a "
                        f"narrower width (< {width})")
    n_heads = self.n_heads or target_cfg.n_heads
    if self.d_model % n_heads:
      whose = "" if self.n_heads else ", the target's"
      raise ConfigError(f"heads.d_model ({self.d_model}) must be divisible by heads.n_heads ({n_heads}{whose}); "
                        "set heads.n_heads to a divisor of it")

  def build(self, target_cfg, *, seed: int, d2t: np.ndarray | None = None):
    """The randomly initialised head set for ``target_cfg`` this section describes (its width checked by
    :meth:`check_target` first)."""
    self.check_target(target_cfg)
    options: dict[str, Any] = {}
    if self.kind in ("medusa", "mtp"):
      options["num_heads"] = self.num_heads
    if self.kind == "medusa":
      options["medusa_layers"] = self.medusa_layers
    for name in ("d_model", "n_heads", "n_kv_heads", "d_ff"):
      if getattr(self, name):
        options[name] = getattr(self, name)
    if self.kind == "eagle3":
      if self.aux_layers:
        options["aux_layers"] = self.aux_layers
      if self.draft_vocab_size:
        options["draft_vocab_size"] = self.draft_vocab_size
    return build_heads(self.kind, target_cfg, seed=seed, d2t=d2t, **options)


# The shape fields of [heads], each the HeadConfig field of the same name (init: the default means "the init's").
_SHAPE_FIELDS = ("num_heads", "d_model", "n_heads", "n_kv_heads", "d_ff", "draft_vocab_size", "aux_layers",
                 "medusa_layers")


def init_folder(init: str, kind: str, config_dir: pathlib.Path | None = None) -> pathlib.Path:
  """The head folder ``heads.init`` names: a shipped model's heads of ``kind`` (``assets/<name>/heads/``), a
  heads run directory (its ``heads/`` export) or a head folder of any layout (relative paths also against
  ``config_dir``).

  Raises:
    ConfigError: naming ``heads.init``, what it was and what it may be.
  """
  from specjax import pretrained
  from specjax.head_formats import detect
  from specjax.train.config import ConfigError

  shipped = {n: pretrained.ASSETS / n / "heads" for n in sorted(p.name for p in pretrained.ASSETS.iterdir())
             if (pretrained.ASSETS / n / "heads").is_dir()}
  if init in shipped:
    methods = {d.name: d for d in sorted(shipped[init].iterdir()) if (d / "heads.json").is_file()}
    found = {m: d for m, d in methods.items() if json.loads((d / "heads.json").read_text())["config"]["kind"] == kind}
    if not found:
      raise ConfigError(f"heads.init = {init!r}: that model ships no {kind} heads (it ships "
                        f"{', '.join(methods) or 'none'}); set heads.kind to theirs or heads.init to a head folder")
    return next(iter(found.values()))
  path = pathlib.Path(init)
  if not path.exists() and config_dir is not None and (config_dir / path).exists():
    path = config_dir / path
  if not path.is_dir():
    raise ConfigError(f"heads.init = {init!r} is neither a model that ships heads ({', '.join(shipped)}) nor a "
                      "folder")
  folder = path / "heads" if (path / "heads" / "heads.json").is_file() else path
  try:
    detect(folder)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"heads.init = {init!r}: {folder} holds no head set (a heads run directory, or a head folder "
                      f"in specjax's or a published layout): {e}") from None
  return folder


def initial_heads(hcfg: HeadsConfig, target_cfg, *, seed: int, d2t: np.ndarray | None = None,
                  config_dir: pathlib.Path | None = None):
  """The head set a run starts from: :meth:`HeadsConfig.build` (fresh), or ``hcfg.init``'s head set in the
  target's dtype, its shape checked against the recipe's field by field (``d2t`` is then the init's).

  Raises:
    ConfigError: naming ``heads.init`` and the field that does not fit (the head's kind, a shape field, or a
      target field of :func:`specjax.models.heads.check_heads`).
  """
  from specjax.head_formats import load_head_dir
  from specjax.loading import cast
  from specjax.train.config import ConfigError

  if not hcfg.init:
    return hcfg.build(target_cfg, seed=seed, d2t=d2t)
  folder = init_folder(hcfg.init, hcfg.kind, config_dir)
  try:
    heads = load_head_dir(folder, target_cfg)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"heads.init = {hcfg.init!r} ({folder}): {e}") from None
  got = heads.cfg
  if got.kind != hcfg.kind:
    raise ConfigError(f"heads.init = {hcfg.init!r} ({folder}) is a {got.kind} head set, the recipe's heads.kind is "
                      f"{hcfg.kind!r}")
  defaults = {f.name: f.default for f in dataclasses.fields(HeadsConfig)}
  actual = {"d_model": got.d_model or target_cfg.d_model, "n_kv_heads": got.n_kv_heads or got.n_heads,
            "d_ff": got.d_ff, "draft_vocab_size": got.draft_vocab_size or 0}
  for name in _SHAPE_FIELDS:
    given = getattr(hcfg, name)
    if given == defaults[name] or (name == "aux_layers" and not given):
      continue
    if name in ("num_heads", "medusa_layers") and got.kind in ("eagle1", "eagle3"):
      continue  # EAGLE heads have one head; medusa_layers is Medusa's
    if name == "draft_vocab_size" and hcfg.init_vocab == "data":
      continue  # the vocabulary is made again (refit_vocab), at this size
    have = actual.get(name, getattr(got, name))
    if (tuple(given) if name == "aux_layers" else given) != have:
      raise ConfigError(f"heads.{name} = {given!r}, but heads.init = {hcfg.init!r} ({folder}) has {have!r}: leave "
                        f"heads.{name} out to take the init's, or start fresh without heads.init")
  return cast(heads, target_cfg.param_dtype)


def refit_vocab(heads, target, d2t: np.ndarray, *, ridge: float = 1e-3, held_out: float = 0.1,
                seed: int = 0) -> tuple[Any, dict[str, float]]:
  """An EAGLE-3 head set with the draft vocabulary ``d2t`` (sorted target ids), every other parameter the same.

  The output projection's column of a token in both vocabularies is kept as it was. A new token's column is
  predicted from the target's input embedding of it by a ridge regression (penalty ``ridge`` times the mean
  diagonal of the centred embeddings' Gram matrix) fitted on the kept tokens: the head's output rows and the target's embeddings both place tokens by
  meaning, so a new token starts near the kept tokens like it, not at random. Returns the head set and
  ``{"kept", "new", "r2"}``: the columns kept and predicted, and the regression's R² on ``held_out`` of the kept
  tokens (fitted without them), which says how much of a new column the fit gets right.
  """
  from specjax.models.heads import Eagle3Head, check_vocab_map

  if not isinstance(heads, Eagle3Head):
    raise ValueError(f"refit_vocab takes an EAGLE-3 head set, got {type(heads).__name__}")
  cfg = dataclasses.replace(heads.cfg, draft_vocab_size=len(d2t))
  d2t = check_vocab_map(np.asarray(d2t, np.int32), cfg)
  old = np.asarray(heads.d2t[...])
  w = np.asarray(heads.lm_head.w[...], np.float32)  # [d, V_old]
  column = {int(t): i for i, t in enumerate(old)}
  kept = np.array([t for t in d2t if int(t) in column], np.int32)
  embed = lambda ids: np.asarray(target.embed_tokens(jnp.asarray(ids)[None]), np.float32)[0]  # [n, D]

  def fit(ids):
    x, y = embed(ids), w[:, [column[int(t)] for t in ids]].T  # [n, D], [n, d]
    mx, my = x.mean(0), y.mean(0)
    xc = x - mx
    gram = xc.T @ xc
    a = np.linalg.solve(gram + ridge * np.trace(gram) / len(gram) * np.eye(len(gram)), xc.T @ (y - my))
    return lambda ids: my + (embed(ids) - mx) @ a

  order = np.random.default_rng(seed).permutation(len(kept))
  test = kept[order[:int(len(kept) * held_out)]]
  r2 = float("nan")
  if len(test) and len(kept) - len(test) > 1:
    y = w[:, [column[int(t)] for t in test]].T
    r2 = 1.0 - float(((fit(kept[order[len(test):]])(test) - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())
  new_w = np.empty((w.shape[0], len(d2t)), np.float32)
  is_kept = np.array([int(t) in column for t in d2t])
  new_w[:, is_kept] = w[:, [column[int(t)] for t in d2t[is_kept]]]
  if (~is_kept).any():
    if len(kept) < 2:
      raise ValueError("refit_vocab: the new vocabulary shares fewer than 2 tokens with the head's, nothing to fit")
    new_w[:, ~is_kept] = fit(kept)(d2t[~is_kept]).T
  out = type(heads)(cfg, rngs=nnx.Rngs(seed), d2t=d2t)
  params = nnx.to_pure_dict(nnx.state(heads, nnx.Param))
  params["lm_head"]["w"] = jnp.asarray(new_w, heads.lm_head.w[...].dtype)
  state = nnx.state(out, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(out, state)
  return out, {"kept": int(is_kept.sum()), "new": int((~is_kept).sum()), "r2": r2}


def frequent_tokens(rows: np.ndarray, vocab_size: int, n: int) -> np.ndarray:
  """The ``n`` most frequent ids of ``rows`` (ties to the smaller id), sorted: EAGLE-3's draft vocabulary."""
  counts = np.bincount(np.asarray(rows).ravel(), minlength=vocab_size)[:vocab_size]
  order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
  return np.sort(order[:n]).astype(np.int32)


# -------------------------------------------------------------------------------------- pieces


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetOutputs:
  """What the frozen target gives the losses, per position ``[B, T+1, ...]``.

  Attributes:
    probs: the next-token distributions at temperature 1: dense ``[..., V]``, or the ``k`` most likely
      tokens' probabilities ``[..., k]`` (descending) when ``ids`` is set.
    ids: ``[..., k] int32`` the tokens of a top-k ``probs``; None for dense.
    hidden: ``[..., D]`` the final-norm hidden states. aux: ``[..., A]`` fused layer streams, or None.
  """

  probs: jax.Array
  ids: jax.Array | None
  hidden: jax.Array
  aux: jax.Array | None


def _shift(x, s: int, t: int):
  """Positions ``s .. s + t - 1`` of ``x [B, T+1, ...]`` (zero-padded past the end); a pytree works too."""
  return jax.tree.map(lambda a: jnp.pad(a[:, s:], ((0, 0), (0, s - 1 if s else 0)) + ((0, 0),) * (a.ndim - 2))[:, :t],
                      x)


def _soft_ce(p, logits: jax.Array) -> jax.Array:
  """``-Σ_v p(v) log softmax(logits)(v)`` per position (forward KL up to p's entropy); ``p`` dense
  ``[..., V]`` or ``(probs, ids)`` top-k, renormalised over its k tokens (truncated soft labels)."""
  logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  if isinstance(p, tuple):
    probs, ids = p
    probs = probs / jnp.maximum(jnp.sum(probs, -1, keepdims=True), 1e-9)
    return -jnp.sum(probs * jnp.take_along_axis(logq, ids, axis=-1), axis=-1)
  return -jnp.sum(jnp.where(p > 0, p * logq, 0.0), axis=-1)


def _acceptance(p, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``Σ min(p, softmax(logits))`` and greedy agreement per position (top-k ``p``: over its k tokens)."""
  q = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  if isinstance(p, tuple):
    probs, ids = p
    accept = jnp.sum(jnp.minimum(probs, jnp.take_along_axis(q, ids, axis=-1)), axis=-1)
    return accept, (ids[..., 0] == jnp.argmax(logits, -1)).astype(jnp.float32)
  return jnp.sum(jnp.minimum(p, q), axis=-1), (jnp.argmax(p, -1) == jnp.argmax(logits, -1)).astype(jnp.float32)


def _draft_ids(d2t: jax.Array, target_vocab: int, ids: jax.Array) -> jax.Array:
  """The draft-vocabulary index of each target id in ``ids`` (-1 for one outside it)."""
  t2d = jnp.full((target_vocab,), -1, jnp.int32).at[d2t].set(jnp.arange(d2t.shape[0], dtype=jnp.int32))
  return t2d[ids]


def _restrict(p, d2t: jax.Array, target_vocab: int):
  """``p`` restricted to the draft vocabulary and renormalised, and 1 where the target's most likely token
  lies inside it (else 0). A dense ``p [..., V]`` gives a dense ``[..., V_draft]``; a top-k ``(probs, ids)``
  stays top-k, ``(probs, draft ids)``: a token outside the draft vocabulary gets probability 0 (and index 0,
  which it then never weighs), so no ``[..., k, V_draft]`` one-hot is built (at 8 x 512 positions, k = 64 and
  8,192 draft tokens that was 8.6 GB of float32 a step)."""
  if isinstance(p, tuple):
    probs, ids = p
    idx = _draft_ids(d2t, target_vocab, ids)  # [..., k], -1 outside
    probs = jnp.where(idx >= 0, probs, 0.0)
    restricted = (probs / jnp.maximum(jnp.sum(probs, -1, keepdims=True), 1e-9), jnp.maximum(idx, 0))
    return restricted, (idx[..., 0] >= 0).astype(jnp.float32)
  restricted = p[..., d2t]
  inside = jnp.isin(jnp.argmax(p, -1), d2t).astype(jnp.float32)
  return restricted / jnp.maximum(jnp.sum(restricted, -1, keepdims=True), 1e-9), inside


def _draft_acceptance(p, draft_logits: jax.Array, d2t: jax.Array, target_vocab: int) -> tuple[jax.Array, jax.Array]:
  """:func:`_acceptance` of a head whose logits over the target's vocabulary are ``draft_logits [..., V_draft]``
  at the target ids ``d2t`` and -inf elsewhere, computed over the draft vocabulary (the same sums: q is 0
  outside it), without the ``[..., V]`` logits and softmax."""
  q = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1)  # [..., V_draft]
  top = d2t[jnp.argmax(draft_logits, -1)]  # the head's most likely target id
  if isinstance(p, tuple):
    probs, ids = p
    idx = _draft_ids(d2t, target_vocab, ids)
    q_at = jnp.where(idx >= 0, jnp.take_along_axis(q, jnp.maximum(idx, 0), axis=-1), 0.0)
    return jnp.sum(jnp.minimum(probs, q_at), axis=-1), (ids[..., 0] == top).astype(jnp.float32)
  return jnp.sum(jnp.minimum(p[..., d2t], q), axis=-1), (jnp.argmax(p, -1) == top).astype(jnp.float32)


def _mean(x: jax.Array, mask) -> jax.Array:
  """Mean of ``x`` over the entries where ``mask`` (broadcast to ``x``) is set."""
  mask = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), x.shape)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def ttt_visible(t: int, step: int) -> jax.Array:
  """The attention mask of training-time-test step ``step`` over the keys of steps 0..step, ``[T, (step+1) T]``:
  query t sees step-0 keys at positions ``<= t - step`` and the step-r key at ``t - step + r`` (r >= 1)."""
  q = jnp.arange(t)[:, None]
  k = jnp.arange(t)[None, :]
  blocks = [k <= q - step] + [k == q - step + r for r in range(1, step + 1)]
  return jnp.concatenate(blocks, axis=1)


def depth_visible(t: int, depth: int) -> jax.Array:
  """Causal mask ``[T, T]`` of MTP module ``depth`` (0-based): position t sees ``t' <= t - depth + 1``
  (all of ``t' <= t`` for depths 0 and 1) and itself."""
  q = jnp.arange(t)[:, None]
  k = jnp.arange(t)[None, :]
  return (k <= q - max(depth - 1, 0)) | (k == q)


def target_outputs(target, rows: jax.Array, aux_layers: tuple[int, ...], top_k: int = 0) -> TargetOutputs:
  """The frozen target over ``rows [B, T+1]`` (no gradient): its distributions (dense, or top-k), hidden
  states and the streams entering ``aux_layers``."""
  b, t1 = rows.shape
  logits, hidden, aux, _ = target.forward_features(rows, target.init_cache(b, t1), aux_layers)
  p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  ids = None
  if top_k:
    p, ids = jax.lax.top_k(p, top_k)
    ids = ids.astype(jnp.int32)
  return jax.lax.stop_gradient(TargetOutputs(probs=p, ids=ids, hidden=hidden, aux=aux))


def _dist(out: TargetOutputs, shift: int, t: int):
  """The distributions at positions ``shift .. shift + t - 1``: dense ``[B, T, V]`` or ``(probs, ids)``."""
  probs = _shift(out.probs, shift, t)
  return probs if out.ids is None else (probs, _shift(out.ids, shift, t))


def _counted(mask: jax.Array, shift: int, t: int) -> jax.Array:
  """``[B, T]`` float: whether the term at position t that learns ``p_{t+shift}`` (the distribution of
  ``x_{t+shift+1}``) counts: ``mask [B, T+1]`` read ``shift`` positions on (0 past the row's end)."""
  return _shift(mask, shift, t)


def _medusa_loss(heads, target, hcfg: HeadsConfig, rows, outputs: TargetOutputs, key, mask):
  t = rows.shape[1] - 1
  z = heads(outputs.hidden[:, :t])  # [B, T, H, D]
  losses, accept, greedy, weights = [], [], [], []
  for j in range(heads.cfg.num_heads):
    valid = _counted(mask, 1 + j, t)  # p_{t+1+j} exists and x_{t+2+j} counts
    target_p = _dist(outputs, 1 + j, t)  # p_{t+1+j}
    logits = heads.logits(target, z[:, :, j:j + 1], first=j)[:, :, 0]
    losses.append(_mean(_soft_ce(target_p, logits), valid))
    a, g = _acceptance(target_p, logits)
    accept.append(_mean(a, valid))
    greedy.append(_mean(g, valid))
    weights.append(hcfg.decay ** j)
  return losses, accept, greedy, weights


def _chain_logits_and_target(heads, target, depth: int, out, target_p):
  """``(logits, target distribution, position weights)`` for one chain step: a head with a reduced
  vocabulary (EAGLE-3's, ``heads.vocab_map()``) over it (target restricted and renormalised; positions whose
  argmax lies outside dropped)."""
  d2t = heads.vocab_map()
  if d2t is None:
    return heads.logits(depth, target, out), target_p, 1.0
  restricted, inside = _restrict(target_p, d2t, heads.cfg.target_vocab_size)
  return heads.draft_logits(depth, target, out), restricted, inside  # [B, T, V_draft]


def _chain_loss(heads, target, hcfg: HeadsConfig, rows, outputs: TargetOutputs, key, mask):
  t = rows.shape[1] - 1
  batch = rows.shape[0]
  hidden = outputs.hidden
  positions = jnp.broadcast_to(jnp.arange(t), (batch, t))
  feats = heads.input_features(hidden, outputs.aux)[:, :t]  # F_t for the pairs t = 0..T-1
  if hcfg.feature_noise:
    feats = feats + jax.random.uniform(key, feats.shape, feats.dtype, -hcfg.feature_noise, hcfg.feature_noise)
  losses, accept, greedy, weights = [], [], [], []

  def score(step_index: int, depth: int, out):
    shift = depth + 1  # depth d predicts x_{t+d+2}: target p_{t+d+1}
    valid = (jnp.arange(t) >= (step_index if depth == 0 else 0)).astype(jnp.float32)[None, :]
    valid = valid * _counted(mask, shift, t)  # [B, T]: p_{t+shift} exists and x_{t+shift+1} counts
    target_p = _dist(outputs, shift, t)
    logits, target_q, weight = _chain_logits_and_target(heads, target, depth, out, target_p)
    loss = _soft_ce(target_q, logits)
    d2t = heads.vocab_map()
    if d2t is None:
      a, g = _acceptance(target_p, logits)
    else:  # over the whole vocabulary, where the head's q is 0 outside its own
      a, g = _draft_acceptance(target_p, logits, d2t, heads.cfg.target_vocab_size)
    if heads.regresses_features:  # EAGLE-1
      reg_target = hidden[:, 1:t + 1]  # h_{t+1}
      reg = jnp.sum(optax_huber(out - reg_target.astype(out.dtype)), -1) / out.shape[-1]
      loss = hcfg.token_loss * loss + hcfg.regression * reg
    losses.append(_mean(loss, valid * weight))
    accept.append(_mean(a, valid))
    greedy.append(_mean(g, valid))

  for depth in range(heads.num_depths):  # MTP's cascade; EAGLE has one depth
    tokens = jnp.pad(rows[:, depth + 1:], ((0, 0), (0, depth)))[:, :t]  # x_{t+d+1}
    attn_in, residual = heads.inputs(depth, target, feats, tokens)
    att = heads.attention(depth)
    q, k, v = att.project(attn_in, positions)
    visible = jnp.broadcast_to(depth_visible(t, depth), (batch, t, t))
    out = heads.finish(depth, residual, att.attend(q, k, v, visible))
    score(0, depth, out)
    weights.append(hcfg.decay ** depth)
    feats = out
  if hcfg.ttt_steps > 1:  # one depth: its own outputs fed back, seeing the real prefix and its own steps
    tokens = rows[:, 1:]
    keys, values = [k], [v]
    for s in range(1, hcfg.ttt_steps):
      shifted = jnp.pad(out[:, :-1], ((0, 0), (1, 0), (0, 0)))  # o^{s-1}_{t-1} at position t
      attn_in, residual = heads.inputs(0, target, shifted, tokens)
      q, k, v = att.project(attn_in, positions)
      keys.append(k)
      values.append(v)
      visible = jnp.broadcast_to(ttt_visible(t, s), (batch, t, (s + 1) * t))
      out = heads.finish(0, residual, att.attend(q, jnp.concatenate(keys, 1), jnp.concatenate(values, 1), visible))
      score(s, 0, out)
      weights.append(hcfg.decay ** s)
  return losses, accept, greedy, weights


def optax_huber(x: jax.Array) -> jax.Array:
  """Smooth L1 (Huber with delta 1) per element, as EAGLE-1's feature regression."""
  ax = jnp.abs(x)
  return jnp.where(ax < _HUBER_DELTA, 0.5 * x * x / _HUBER_DELTA, ax - 0.5 * _HUBER_DELTA)


def head_loss(heads, target, hcfg: HeadsConfig, rows: jax.Array, key: jax.Array,
              outputs: TargetOutputs | None = None, mask: jax.Array | None = None):
  """The training loss of a head set on one batch, and its per-position metrics.

  Args:
    heads: the head set (a module merged inside the trace). target: the frozen target.
    hcfg: the recipe's ``[heads]`` section. rows: ``[B, T+1] int32``. key: noise key (EAGLE-1).
    outputs: the target's :class:`TargetOutputs` for ``rows`` when cached (offline); None: computed here.
    mask: ``[B, T]`` float, 1 where position t predicts a token that counts (``rows[:, t+1]``: an assistant
      answer's token in conversation data), or None (all). Every term that learns to propose token
      ``x_j`` (any head, depth or training-time-test step) is weighted by the mask of position ``j - 1``; the
      inputs (features, earlier tokens) are never masked.

  Returns:
    ``(loss [], metrics)``: metrics ``loss_i``, ``accept_i`` (mean ``Σ min(p, q)``) and ``greedy_i`` for
    each proposal position i (Medusa head i, chain step i, MTP module i), 1-based.
  """
  if outputs is None:
    outputs = target_outputs(target, rows, heads.cfg.aux_layers)
  outputs = dataclasses.replace(outputs, hidden=outputs.hidden.astype(jnp.dtype(heads.cfg.dtype)),
                                aux=None if outputs.aux is None else outputs.aux.astype(jnp.dtype(heads.cfg.dtype)))
  # [B, T+1]: entry i weights the terms that learn p_i. Without a mask every p_i of the row counts, p_T (whose
  # token lies past the row) included; with one, p_T's token is unknown and does not.
  mask = (jnp.ones(rows.shape, jnp.float32) if mask is None
          else jnp.pad(jnp.asarray(mask, jnp.float32), ((0, 0), (0, 1))))
  fn = _chain_loss if isinstance(heads, ChainHeadModule) else _medusa_loss
  losses, accept, greedy, weights = fn(heads, target, hcfg, rows, outputs, key, mask)
  total = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
  metrics = {"loss": total}
  for i, (l, a, g) in enumerate(zip(losses, accept, greedy), start=1):
    metrics.update({f"loss_{i}": l, f"accept_{i}": a, f"greedy_{i}": g})
  return total, metrics
