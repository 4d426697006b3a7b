"""Parallel draft training (PARD, An et al. 2025): mask-block sequences with conditional drop.

A parallel draft reads the committed tokens followed by ``k - 1`` copies of a mask token and predicts
``d_1..d_k`` at the last real position and the masks (:class:`specjax.proposers.ParallelDraft`). Its
vocabulary is the target's plus one: the mask token is the last row, ``mask_id = target vocab_size``.

Training repeats each row in ``k`` blocks (``ALGORITHMS.md``, "Parallel drafting"):

1. Block 0 is the row itself: position ``j`` reads ``x_j`` and predicts ``x_{j+1}``.
2. Block ``i >= 1`` holds masks: its position ``j`` sees the real tokens ``x_0..x_{j-i}`` (block 0) and the
   masks at ``j - i + 1 .. j`` (blocks ``1..i``, one each: exactly what the mask at ``L + i`` sees at
   inference, ``L = j - i`` the last real position) and predicts ``x_{j+1}``.
3. Conditional drop keeps ``max(r^i, r_min)`` of block i's positions, chosen at random among those whose
   predecessor in block ``i - 1`` was kept (the masks a position reads must be there): the whole sequence is
   about ``1 + r + r^2 + ...`` row lengths instead of ``k``.

The packed sequence goes through the draft in one pass with a :class:`specjax.tree.TreeMask` (each slot's
own visibility, rotary positions ``j``); the distillation losses apply per slot against the frozen target's
logits at position ``j``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib


import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specjax import costmodel, pretrained, sharding
from specjax.tree import TreeMask
from specjax.train import losses
from specjax.train.config import ConfigError
from specjax.train.trainer import ModelTask, _on_devices, _placed, full_logits, init_model


def block_sizes(seq_len: int, k: int, r: float, r_min: float) -> tuple[int, ...]:
  """Slots kept per block (static): ``seq_len`` for block 0, ``ceil(max(r^i, r_min) * seq_len)`` for block i,
  capped so that block i can always be filled from the successors of block ``i - 1``'s slots."""
  sizes = [seq_len]
  for i in range(1, k):
    want = math.ceil(max(r ** i, r_min) * seq_len)
    sizes.append(max(1, min(want, sizes[-1] - 1, seq_len - i)))
  return tuple(sizes)


def layout(key: jax.Array, batch: int, seq_len: int, sizes: tuple[int, ...]) -> tuple[jax.Array, np.ndarray]:
  """The packed sequence's slots: ``(pos [B, N] int32, block [N] int32)``, ``N = sum(sizes)``.

  Block 0 is every position; block i keeps ``sizes[i]`` positions ``j >= i`` of each row drawn uniformly among
  those whose ``j - 1`` block ``i - 1`` kept (conditional drop), sorted.
  """
  arange = jnp.arange(seq_len)
  kept = jnp.ones((batch, seq_len), bool)
  parts = [jnp.broadcast_to(arange, (batch, seq_len))]
  for i, (size, sub) in enumerate(zip(sizes[1:], jax.random.split(key, len(sizes) - 1)), start=1):
    eligible = jnp.pad(kept[:, :-1], ((0, 0), (1, 0))) & (arange >= i)[None, :]  # predecessor kept
    score = jnp.where(eligible, jax.random.uniform(sub, (batch, seq_len)), -1.0)
    sel = jnp.sort(jax.lax.top_k(score, size)[1], axis=1)  # [B, size]
    kept = jnp.zeros((batch, seq_len), bool).at[jnp.arange(batch)[:, None], sel].set(True)
    parts.append(sel)
  block = np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)
  return jnp.concatenate(parts, axis=1).astype(jnp.int32), block


def visibility(pos: jax.Array, block: np.ndarray) -> jax.Array:
  """``[B, N, N] bool``: slot (i, j) sees block 0 up to ``j - i`` and the mask ``(m, j - i + m)`` of each block
  ``1 <= m <= i`` (itself included)."""
  bq, bk = jnp.asarray(block)[None, :, None], jnp.asarray(block)[None, None, :]
  pq, pk = pos[:, :, None], pos[:, None, :]
  real = (bk == 0) & (pk <= pq - bq)
  masks = (bk >= 1) & (bk <= bq) & (pk - bk == pq - bq)
  return real | masks


def parallel_logits(graphdef, params, rows: jax.Array, pos: jax.Array, block: np.ndarray, mask_id: int
                    ) -> jax.Array:
  """The draft's logits ``[B, N, V + 1]`` over the packed sequence of ``rows [B, T+1]`` (inputs ``rows[:, :-1]``)."""
  model = nnx.merge(graphdef, params)
  inputs = jnp.take_along_axis(rows[:, :-1], pos, axis=1)
  block = np.asarray(block)
  tokens = jnp.where(jnp.asarray(block)[None, :] == 0, inputs, mask_id)  # [B, N]
  batch, n = tokens.shape
  tree = TreeMask(positions=pos, start=jnp.zeros((batch,), jnp.int32), visible=visibility(pos, block),
                  entry_positions=pos)
  logits, _, _ = model(tokens, model.init_cache(batch, n), tree=tree)
  return logits


def _slot_terms(graphdef, params, rows, mask, teacher_logits, key, *, sizes, mask_id, divergence, temperature):
  """Per slot: the loss term ``[B, N]``, the weight ``[B, N]`` and the slots' blocks, for one batch."""
  batch, seq_len = mask.shape
  pos, block = layout(key, batch, seq_len, sizes)
  logits = parallel_logits(graphdef, params, rows, pos, block, mask_id)[..., :mask_id]  # [B, N, V]
  weight = jnp.take_along_axis(mask, pos, axis=1)
  if divergence == "ce":
    targets = jnp.take_along_axis(rows[:, 1:], pos, axis=1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    term = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  else:
    teacher = jnp.take_along_axis(teacher_logits, pos[..., None], axis=1)  # [B, N, V]
    term = losses.DIVERGENCES[divergence](teacher, logits, temperature)
  return term, weight, pos, block, logits


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "sizes", "mask_id", "divergence",
                                             "temperature", "teacher_def", "placement"), donate_argnums=(1, 2))
def parallel_train_step(graphdef, params, opt_state, rows, mask, key, teacher_def=None, teacher_params=None, *,
                        optimizer: optax.GradientTransformation, sizes: tuple[int, ...], mask_id: int,
                        divergence: str, temperature: float, placement: sharding.Placement | None = None):
  """One optimizer step of a parallel draft on ``rows [B, T+1]``, ``mask [B, T]`` (the positions that count),
  with a fresh conditional-drop layout from ``key``. Returns ``(params, opt_state, metrics)`` (donated)."""
  with sharding.activate(placement):
    teacher_logits = None
    if teacher_def is not None:
      teacher_logits = jax.lax.stop_gradient(full_logits(teacher_def, teacher_params, rows[:, :-1]))

    def loss_fn(p):
      term, weight, *_ = _slot_terms(graphdef, p, rows, mask, teacher_logits, key, sizes=sizes, mask_id=mask_id,
                                     divergence=divergence, temperature=temperature)
      return losses.masked_mean(term, weight)

    loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


@functools.partial(jax.jit, static_argnames=("graphdef", "teacher_def", "sizes", "mask_id", "placement"))
def parallel_eval_batch(graphdef, params, rows, key, teacher_def=None, teacher_params=None, *,
                        sizes: tuple[int, ...], mask_id: int, placement: sharding.Placement | None = None):
  """Per block i: summed cross entropy, slot count and, with a teacher, summed expected acceptance at
  temperature 1 and greedy agreement (keys ``nll_i``, ``n_i``, ``accept_i``, ``greedy_i``)."""
  with sharding.activate(placement):
    mask = jnp.ones((rows.shape[0], rows.shape[1] - 1), jnp.float32)
    teacher = None if teacher_def is None else full_logits(teacher_def, teacher_params, rows[:, :-1])
    nll, _, pos, block, logits = _slot_terms(graphdef, params, rows, mask, teacher, key, sizes=sizes,
                                             mask_id=mask_id, divergence="ce", temperature=1.0)
    out = {}
    if teacher is not None:
      p = jnp.take_along_axis(teacher, pos[..., None], axis=1)
      accept, greedy = losses.expected_acceptance(p, logits, 1.0), losses.expected_acceptance(p, logits, 0.0)
    for i in range(len(sizes)):
      sel = jnp.asarray(block == i)[None, :]
      out[f"nll_{i}"] = jnp.sum(jnp.where(sel, nll, 0.0))
      out[f"n_{i}"] = jnp.sum(jnp.broadcast_to(sel, nll.shape).astype(jnp.float32))
      if teacher is not None:
        out[f"accept_{i}"] = jnp.sum(jnp.where(sel, accept, 0.0))
        out[f"greedy_{i}"] = jnp.sum(jnp.where(sel, greedy, 0.0))
    return out


def grow_vocab(params: dict, tie_embeddings: bool) -> dict:
  """A draft's pure-dict parameters with one more vocabulary row (the mask token): its embedding the mean of
  the others; an untied LM head gets a zero column (the mask's logit is never used)."""
  params = dict(params)
  embed = np.asarray(params["embed"])
  params["embed"] = jnp.asarray(np.concatenate([embed, embed.mean(0, keepdims=True)], 0), embed.dtype)
  if not tie_embeddings:
    head = np.asarray(params["lm_head"])
    params["lm_head"] = jnp.asarray(np.concatenate([head, np.zeros_like(head[:, :1])], 1), head.dtype)
  return params


def draft_export(name_or_dir: str, config_dir: pathlib.Path | None = None) -> pathlib.Path:
  """The export folder ``parallel.init`` names: a shipped pair's draft (``"stdlib-coder"``), a run directory
  (its ``model/``) or an export folder (relative paths also against ``config_dir``)."""
  if name_or_dir in pretrained.available():
    return pretrained.ASSETS / name_or_dir / "draft"
  path = pathlib.Path(name_or_dir)
  if not path.exists() and config_dir is not None and (config_dir / path).exists():
    path = config_dir / path
  folder = path / "model" if (path / "model" / "config.json").is_file() else path
  if not (folder / "params.npz").is_file():
    raise ConfigError(f"parallel.init: {path} holds no exported draft (a shipped pair {pretrained.available()}, "
                      "a run directory or an export folder)")
  return folder


def initial_params(cfg, seed: int, config_dir: pathlib.Path | None) -> tuple[nnx.GraphDef, dict]:
  """``(graphdef, params)`` of a parallel draft: ``parallel.init``'s draft with a mask row added, or fresh."""
  graphdef, params = init_model(cfg.model, seed)
  if not cfg.parallel.init:
    return graphdef, params
  folder = draft_export(cfg.parallel.init, config_dir)
  base = pretrained.load_model(folder)
  want = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size - 1)
  if base.cfg != want:
    diff = [f.name for f in dataclasses.fields(want) if getattr(base.cfg, f.name) != getattr(want, f.name)]
    raise ConfigError(f"parallel.init: {folder} has model.{diff[0]} = {getattr(base.cfg, diff[0])!r}, the recipe "
                      f"needs {getattr(want, diff[0])!r} (model.vocab_size is the draft's + 1: the mask token)")
  return graphdef, grow_vocab(nnx.to_pure_dict(nnx.split(base)[1]), cfg.model.tie_embeddings)


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class ParallelTask(ModelTask):
  """A parallel draft run (a draft recipe with ``[parallel]``): mask-block steps with conditional drop, the
  distillation divergence per slot; evaluation reports each block's acceptance and the τ they predict
  (``valid_accept_i``, ``valid_greedy_i``, ``valid_tau_t1``, ``valid_tau_greedy``)."""

  @property
  def sizes(self) -> tuple[int, ...]:
    p = self.cfg.parallel
    return block_sizes(self.cfg.data.seq_len, p.k, p.r, p.r_min)

  @property
  def mask_id(self) -> int:
    return self.cfg.model.vocab_size - 1

  @classmethod
  def create(cls, cfg, teacher, train_rows, valid_rows, *, target_dir, placement, out, training, config_dir=None):
    graphdef, params = initial_params(cfg, cfg.run.seed, config_dir)
    (params,) = _placed(placement, graphdef, (params,), "the model")
    return cls(cfg=cfg, graphdef=graphdef, teacher=teacher), params

  def step(self, run, rows, mask, features):
    d = self.cfg.distill
    teacher_def, teacher_params = self.teacher if self.teacher is not None else (None, None)
    key = jax.random.fold_in(jax.random.key(self.cfg.run.seed + 2), run.step)
    return parallel_train_step(
        self.graphdef, run.params, run.opt_state, _on_devices(run.placement, rows),
        _on_devices(run.placement, mask), key, teacher_def, teacher_params, optimizer=run.optimizer,
        sizes=self.sizes, mask_id=self.mask_id, divergence=d.divergence, temperature=d.temperature,
        placement=run.placement)

  def evaluate(self, run) -> dict[str, float]:
    sums: dict[str, float] = {}
    teacher_def, teacher_params = self.teacher if self.teacher is not None else (None, None)
    batch = self.cfg.data.batch_size
    for n, i in enumerate(range(0, len(run.valid_rows), batch)):
      part = parallel_eval_batch(self.graphdef, run.params, _on_devices(run.placement, run.valid_rows[i:i + batch]),
                                 jax.random.key(n), teacher_def, teacher_params, sizes=self.sizes,
                                 mask_id=self.mask_id, placement=run.placement)
      for k, v in jax.device_get(part).items():
        sums[k] = sums.get(k, 0.0) + float(v)
    k = len(self.sizes)
    count = [max(sums[f"n_{i}"], 1.0) for i in range(k)]
    out = {"valid_loss": sums["nll_0"] / count[0], "valid_ppl": math.exp(min(sums["nll_0"] / count[0], 50.0))}
    out.update({f"valid_nll_{i}": sums[f"nll_{i}"] / count[i] for i in range(1, k)})
    if "accept_0" in sums:
      for name, prefix in (("t1", "accept"), ("greedy", "greedy")):
        accept = [sums[f"{prefix}_{i}"] / count[i] for i in range(k)]
        out.update({f"valid_{prefix}_{i + 1}": a for i, a in enumerate(accept)})
        out[f"valid_tau_{name}"] = costmodel.expected_tau(accept, k)
    return out
