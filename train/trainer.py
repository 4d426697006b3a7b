"""Target pretraining and draft distillation: jitted steps over ``(graphdef, params)`` and the run loop.

The model is split once (``nnx.split``); parameters and optimizer state are plain pytrees that flow
through ``jax.jit`` and are merged back into a module only inside the traced functions.

A run directory holds::

    config.json       the recipe (as resolved)      tokenizer.json   the BPE the model reads
    checkpoints/      orbax steps (keep-N)          metrics.jsonl    one JSON object per log/eval line
    model/            the final export (see specjax.pretrained); a heads run exports heads/ instead
                      (specjax.models.heads.save_heads)

A heads run (``kind = "heads"``) trains a head set on a frozen target: the same data, optimizer,
checkpoints, logging and resume, with the losses of :mod:`specjax.train.heads`. What differs between run
kinds lives in one task object per kind (:class:`ModelTask`, :class:`HeadsTask`; :data:`TASKS`), chosen once
by :func:`start` and held by the :class:`Run`, as MaxText picks its loss and step once at setup.

On a mesh (``start(..., mesh=)``, CLI ``--mesh data=8``) every step is one SPMD program: parameters, optimizer
state and the frozen teacher are placed by :mod:`specjax.sharding`'s rules (a ``model`` axis of size 1 is
pure data parallelism; a larger one adds tensor parallelism), each batch is split by rows over ``data``,
and the steps trace their models under the placement (its static ``placement`` argument). Checkpoints
hold the sharded state and restore onto whatever mesh the resumed run uses. In a multi-host run only process
0 logs and writes files; every process takes part in each checkpoint, as orbax requires.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time
import zipfile
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specjax import costmodel, distributed, pretrained, sharding
from specjax.config import check_int
from specjax.models.heads import check_heads, save_heads
from specjax.models.llama import Llama, LlamaConfig
from specjax.tokenizer import BPETokenizer, load_tokenizer
from specjax.train import data as data_lib
from specjax.train import heads as heads_lib
from specjax.train import losses
from specjax.train.checkpoint import CheckpointError, Checkpoints
from specjax.train.config import ConfigError, OptimConfig, TrainConfig, contradictions, from_dict
from specjax.train.tokenizer import train_bpe


# ------------------------------------------------------------------------------ pure functions


def lr_schedule(cfg: OptimConfig, steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to ``cfg.lr``, then cosine decay to ``cfg.lr * cfg.end_lr_frac`` at ``steps``."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps, decay_steps=steps,
      end_value=cfg.lr * cfg.end_lr_frac)


def make_optimizer(cfg: OptimConfig, steps: int) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW under :func:`lr_schedule`.

  Weight decay applies to matrices only (not to the RMSNorm scales).
  """
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(lr_schedule(cfg, steps), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                  mask=decay_mask))


def init_model(cfg: LlamaConfig, seed: int) -> tuple[nnx.GraphDef, dict]:
  """``(graphdef, params)``: the static structure and a nested dict of float arrays."""
  graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(seed)))
  return graphdef, nnx.to_pure_dict(state)


def full_logits(graphdef: nnx.GraphDef, params: dict, tokens: jax.Array) -> jax.Array:
  """Causal forward over whole rows from position 0: ``tokens [B, T] -> logits [B, T, V]``."""
  model = nnx.merge(graphdef, params)
  logits, _, _ = model(tokens, model.init_cache(tokens.shape[0], tokens.shape[1]))
  return logits


def step_loss(graphdef, params, rows, mask, teacher_logits, *, divergence: str, temperature: float):
  """The training loss of one batch.

  Args:
    rows: ``[B, T+1] int32``; position t of ``rows[:, :-1]`` predicts ``rows[:, t+1]``.
    mask: ``[B, T]`` float, the positions that count.
    teacher_logits: ``[B, T, V]`` frozen target logits, or None for ``divergence == "ce"``.

  Returns:
    ``[]`` float32 masked mean of the cross entropy or of the divergence between teacher and model.
  """
  logits = full_logits(graphdef, params, rows[:, :-1])  # [B, T, V]
  if divergence == "ce":
    return losses.cross_entropy(logits, rows[:, 1:], mask)
  per_pos = losses.DIVERGENCES[divergence](teacher_logits, logits, temperature)  # [B, T]
  return losses.masked_mean(per_pos, mask)


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "divergence", "temperature",
                                             "teacher_def", "placement"), donate_argnums=(1, 2))
def train_step(graphdef, params, opt_state, rows, mask, teacher_def=None, teacher_params=None, *,
               optimizer: optax.GradientTransformation, divergence: str = "ce", temperature: float = 1.0,
               placement: sharding.Placement | None = None):
  """One optimizer step. Returns ``(params, opt_state, metrics)``; params and opt_state are donated.

  Args:
    rows: ``[B, T+1] int32``. mask: ``[B, T] float32``.
    teacher_def / teacher_params: the frozen target (distillation), or None for cross entropy.
    placement: static; the mesh and rules the arguments are placed by (None: one device).
  """
  with sharding.activate(placement):
    return _train_step(graphdef, params, opt_state, rows, mask, teacher_def, teacher_params, optimizer=optimizer,
                       divergence=divergence, temperature=temperature)


def _train_step(graphdef, params, opt_state, rows, mask, teacher_def, teacher_params, *, optimizer, divergence,
                temperature):
  teacher_logits = None
  if teacher_def is not None:
    teacher_logits = jax.lax.stop_gradient(full_logits(teacher_def, teacher_params, rows[:, :-1]))
  loss, grads = jax.value_and_grad(functools.partial(
      step_loss, divergence=divergence, temperature=temperature), argnums=1)(
          graphdef, params, rows, mask, teacher_logits)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


@functools.partial(jax.jit, static_argnames=("graphdef", "teacher_def", "temperature", "placement"))
def eval_batch(graphdef, params, rows, teacher_def=None, teacher_params=None, *, temperature: float = 1.0,
               placement: sharding.Placement | None = None):
  """Validation metrics of one batch ``rows [B, T+1]``: summed cross entropy and token count, and with
  a teacher the summed expected acceptance ``Σ_v min(p, q)`` (at ``temperature``) and greedy agreement."""
  with sharding.activate(placement):
    return _eval_batch(graphdef, params, rows, teacher_def, teacher_params, temperature)


def _eval_batch(graphdef, params, rows, teacher_def, teacher_params, temperature):
  logits = full_logits(graphdef, params, rows[:, :-1])  # [B, T, V]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, rows[:, 1:, None], axis=-1)[..., 0]
  out = {"nll_sum": jnp.sum(nll), "tokens": jnp.float32(nll.size)}
  if teacher_def is not None:
    teacher = full_logits(teacher_def, teacher_params, rows[:, :-1])
    out["accept_sum"] = jnp.sum(losses.expected_acceptance(teacher, logits, temperature))
    out["greedy_sum"] = jnp.sum(losses.expected_acceptance(teacher, logits, 0.0))
  return out


def _head_loss(graphdef, params, rest, teacher_def, teacher_params, rows, key, hcfg, outputs=None, mask=None):
  heads = nnx.merge(graphdef, params, rest)
  return heads_lib.head_loss(heads, nnx.merge(teacher_def, teacher_params), hcfg, rows, key, outputs, mask)


@functools.partial(jax.jit, static_argnames=("teacher_def", "aux_layers", "top_k", "dtype"))
def target_outputs(teacher_def, teacher_params, rows, *, aux_layers: tuple[int, ...], top_k: int,
                   dtype: str = "bfloat16"):
  """The frozen target's :class:`~specjax.train.heads.TargetOutputs` for ``rows [B, T+1]``, features in
  ``dtype`` (what :func:`cache_outputs` stores: ``heads.cache_dtype``)."""
  out = heads_lib.target_outputs(nnx.merge(teacher_def, teacher_params), rows, aux_layers, top_k)
  return dataclasses.replace(out, hidden=out.hidden.astype(dtype),
                             aux=None if out.aux is None else out.aux.astype(dtype))


def cache_outputs(teacher, rows: np.ndarray, aux_layers: tuple[int, ...], top_k: int, batch: int,
                  dtype: str = "bfloat16"):
  """:func:`target_outputs` for every row, computed once, held on the host (numpy leaves)."""
  from tqdm import tqdm

  parts = [jax.device_get(target_outputs(teacher[0], teacher[1], jnp.asarray(rows[i:i + batch]),
                                         aux_layers=aux_layers, top_k=top_k, dtype=dtype))
           for i in tqdm(range(0, len(rows), batch), desc="target features", leave=False)]
  return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def _as_stored(x: np.ndarray) -> np.ndarray:
  return x.view(np.uint16) if x.dtype == jnp.bfloat16 else x  # .npz holds no bfloat16: its bits as uint16


def _leaves(outputs) -> dict[str, np.ndarray]:
  return {f.name: getattr(outputs, f.name) for f in dataclasses.fields(outputs) if getattr(outputs, f.name) is not None}


# Batches of rows whose target outputs one part file keeps while the cache is computed: a run killed meanwhile
# resumes from its last part (SmolLM2-135M, 8 rows of 513 tokens a batch, on the 2-core CPU: ~5 minutes a part).
KEEP_EVERY = 32


def _read_kept(path: pathlib.Path) -> dict[str, np.ndarray] | None:
  """The arrays of a kept ``.npz`` (its ``rows`` included), or None where it is cut or foreign (said so)."""
  try:
    with np.load(path) as kept:
      return {name: kept[name] for name in kept.files}
  except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
    print(f"target features: {path} is unreadable ({e}); recomputing")
    return None


def _write_kept(path: pathlib.Path, rows: np.ndarray, leaves: dict[str, np.ndarray]) -> None:
  """``rows`` and ``leaves`` into ``path``, whole or absent: a killed write leaves only a ``.partial`` file."""
  part = path.with_name(path.name + ".partial")
  with part.open("wb") as f:
    np.savez(f, rows=rows, **{k: _as_stored(v) for k, v in leaves.items()})
  part.replace(path)


def _recipe_check(teacher, rows: np.ndarray, stored: dict[str, np.ndarray], aux_layers, top_k, batch, dtype):
  """The first batch of ``rows`` recomputed: its leaves if ``stored`` begins with the same values (the same
  target, layers, ``top_k`` and dtype), else None."""
  first = _leaves(cache_outputs(teacher, rows[:batch], aux_layers, top_k, batch, dtype))
  same = first.keys() == stored.keys() and all(
      _as_stored(x).dtype == stored[k].dtype and _as_stored(x).shape[1:] == stored[k].shape[1:]
      and np.array_equal(_as_stored(x), stored[k][:len(x)]) for k, x in first.items())
  return first if same else None


def _as_outputs(stored: dict[str, np.ndarray], bf16: set[str]):
  """Stored leaves (bfloat16 ones, named in ``bf16``, as their bits) as :class:`TargetOutputs`, without a copy."""
  return heads_lib.TargetOutputs(**{"ids": None, "aux": None, **{
      k: v.view(jnp.bfloat16) if k in bf16 else v for k, v in stored.items()}})


def _bfloat16_names(leaves: dict[str, np.ndarray]) -> set[str]:
  return {k for k, x in leaves.items() if x.dtype == jnp.bfloat16}


def kept_outputs(teacher, rows: np.ndarray, aux_layers: tuple[int, ...], top_k: int, batch: int,
                 path: pathlib.Path | None, dtype: str = "bfloat16", keep_every: int = KEEP_EVERY):
  """:func:`cache_outputs`, kept in ``path`` (an ``.npz``) for the next start of the run (``--resume``).

  A kept file is used only when it holds the same rows and the target recomputes its first batch to the
  same values (so the same target, layers and ``top_k``); otherwise everything is recomputed and the file
  replaced. While the outputs are computed, each ``keep_every`` batches of rows go to a part file beside it
  (``<path>.part-00000`` ...), so that a run killed meanwhile resumes from its last part. A part is reused
  only for the same rows, and the first part reused must pass the same one-batch check; one that fails it is
  removed with every part after it. Once all rows are done, the parts make the whole file and are removed.
  The parts are copied into arrays of every row as they come (SmolLM2's features are ~11 GB: no second copy
  is made). Only the primary process writes. ``path`` None: nothing is kept.
  """
  if path is not None and path.exists():
    stored = _read_kept(path) or {}
    if stored and np.array_equal(stored.pop("rows", None), rows):
      first = _recipe_check(teacher, rows, stored, aux_layers, top_k, batch, dtype)
      if first is not None:
        print(f"target features: read from {path}")
        return _as_outputs(stored, _bfloat16_names(first))
    if stored:
      print(f"target features: {path} was made from other rows, target or recipe; recomputing")
    del stored
  if path is None:
    return cache_outputs(teacher, rows, aux_layers, top_k, batch, dtype)
  size = batch * check_int("keep_every", keep_every, 1)
  count = math.ceil(len(rows) / size)
  part_of = lambda n: path.with_name(f"{path.name}.part-{n:05d}")
  whole: dict[str, np.ndarray] = {}  # every row's leaves, as stored (bfloat16 as uint16)
  bf16, checked, reused = None, False, 0
  for n, at in enumerate(range(0, len(rows), size)):
    chunk = rows[at:at + size]
    stored = _read_kept(part_of(n)) if part_of(n).exists() else None
    if stored is not None and not np.array_equal(stored.pop("rows", None), chunk):
      stored = None
    if stored is not None and not checked:  # the first part reused: made by this target and recipe?
      checked, first = True, _recipe_check(teacher, chunk, stored, aux_layers, top_k, batch, dtype)
      if first is None:
        print(f"target features: {part_of(n)} was made by another target or recipe; recomputing from it")
        for m in range(n, count):
          part_of(m).unlink(missing_ok=True)
        stored = None
      else:
        bf16 = _bfloat16_names(first)
    if stored is not None:
      reused += 1
    else:
      leaves = _leaves(cache_outputs(teacher, chunk, aux_layers, top_k, batch, dtype))
      bf16 = _bfloat16_names(leaves)
      stored = {k: _as_stored(x) for k, x in leaves.items()}
      if distributed.is_primary():
        _write_kept(part_of(n), chunk, stored)
    for k, x in stored.items():
      if k not in whole:
        whole[k] = np.empty((len(rows),) + x.shape[1:], x.dtype)
      whole[k][at:at + len(chunk)] = x
    del stored
  if reused:
    print(f"target features: {reused} of {count} parts read back from {path.parent}")
  if distributed.is_primary():
    _write_kept(path, rows, whole)
    for n in range(count):
      part_of(n).unlink(missing_ok=True)
  return _as_outputs(whole, bf16)


@functools.partial(jax.jit, static_argnames=("graphdef", "teacher_def", "optimizer", "hcfg", "placement"),
                   donate_argnums=(1, 3))
def heads_train_step(graphdef, params, rest, opt_state, teacher_def, teacher_params, rows, key, outputs=None,
                     mask=None, *, optimizer: optax.GradientTransformation, hcfg,
                     placement: sharding.Placement | None = None):
  """One optimizer step of a head set on a frozen target (only ``params`` move; the target's never do).
  ``outputs``: the target's cached outputs for ``rows`` (offline), or None (online: the target's forward runs
  here, under the same placement as the head). ``mask``: ``[B, T]`` the positions whose next token counts
  (conversation data: answer tokens), or None (all; see :func:`specjax.train.heads.head_loss`).
  Returns ``(params, opt_state, metrics)``; params and opt_state are donated."""
  with sharding.activate(placement):
    (_, metrics), grads = jax.value_and_grad(_head_loss, argnums=1, has_aux=True)(
        graphdef, params, rest, teacher_def, teacher_params, rows, key, hcfg, outputs, mask)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, opt_state, {**metrics, "grad_norm": optax.tree.norm(grads)}


@functools.partial(jax.jit, static_argnames=("graphdef", "teacher_def", "hcfg", "placement"))
def heads_eval_batch(graphdef, params, rest, teacher_def, teacher_params, rows, outputs=None, mask=None, *, hcfg,
                     placement: sharding.Placement | None = None):
  """The head losses and per-position acceptance metrics of one validation batch (no noise)."""
  with sharding.activate(placement):
    return _head_loss(graphdef, params, rest, teacher_def, teacher_params, rows, jax.random.key(0),
                      dataclasses.replace(hcfg, feature_noise=0.0), outputs, mask)[1]


@functools.partial(jax.jit, static_argnames=("graphdef", "gen_len", "temperature", "placement"))
def sample_continuations(graphdef, params, prefix: jax.Array, key: jax.Array, *, gen_len: int,
                         temperature: float, placement: sharding.Placement | None = None) -> jax.Array:
  """Samples ``gen_len`` tokens after each prefix with a KV cache.

  Args:
    prefix: ``[B, P] int32``. key: PRNG key. temperature: > 0. placement: static (see :func:`train_step`).

  Returns:
    ``[B, P + gen_len] int32``: the prefix followed by the sampled continuation.
  """
  with sharding.activate(placement):
    return _sample_continuations(graphdef, params, prefix, key, gen_len, temperature)


def _sample_continuations(graphdef, params, prefix, key, gen_len, temperature):
  model = nnx.merge(graphdef, params)
  b, p = prefix.shape
  logits, _, cache = model(prefix, model.init_cache(b, p + gen_len))

  def step(carry, step_key):
    cache, logits = carry  # logits [B, V] of the next token
    token = jax.random.categorical(step_key, logits / temperature, axis=-1).astype(jnp.int32)  # [B]
    next_logits, _, cache = model(token[:, None], cache)
    return (cache, next_logits[:, 0]), token

  _, tokens = jax.lax.scan(step, (cache, logits[:, -1]), jax.random.split(key, gen_len))
  return jnp.concatenate([prefix, tokens.T], axis=1)


# --------------------------------------------------------------------------------- the run


class RunError(ValueError):
  """A run directory cannot be started or resumed as asked; the message names the path or field."""


def _log(path: pathlib.Path, record: dict[str, Any]) -> None:
  if not distributed.is_primary():  # one log per run, not one per host
    return
  with path.open("a") as f:
    f.write(json.dumps(record) + "\n")


def _float_tree(tree):
  return jax.tree.map(lambda x: float(x), jax.device_get(tree))


def _target_dir(cfg: TrainConfig, config_dir: pathlib.Path | None) -> pathlib.Path | None:
  if cfg.distill is None or not cfg.distill.target:
    return None
  path = pathlib.Path(cfg.distill.target)
  from specjax.loading import GGUF_NAMES

  if (not path.is_absolute() and not path.exists() and config_dir is not None
      and cfg.distill.target not in pretrained.available() and cfg.distill.target not in GGUF_NAMES):
    path = config_dir / path
  return path


def load_target(name_or_dir: str | pathlib.Path, config_dir: pathlib.Path | None = None):
  """``(model, tokenizer)`` of a trained target: a shipped pair's name (``"stdlib-coder"``), a GGUF file or
  its short name (``"smollm2-135m-instruct"``), a Hugging Face checkpoint directory, a run directory (its
  ``model/`` export) or an export folder (relative paths also against ``config_dir``).

  Raises:
    RunError: naming the path when it holds no exported model.
  """
  from specjax.loading import GGUF_NAMES, load

  if str(name_or_dir) in pretrained.available():
    target, _, tokenizer = pretrained.load_pretrained(str(name_or_dir))
    return target, tokenizer
  path = pathlib.Path(name_or_dir)
  if not path.exists() and config_dir is not None and (config_dir / path).exists():
    path = config_dir / path
  if str(name_or_dir) in GGUF_NAMES or path.suffix == ".gguf" or (path / "config.json").is_file() and any(
      path.glob("*.safetensors")):
    loaded = load(str(name_or_dir) if str(name_or_dir) in GGUF_NAMES else str(path))
    return loaded.model, loaded.tokenizer
  folder = path / "model" if (path / "model" / "config.json").is_file() else path
  if not (folder / "config.json").is_file():
    raise RunError(f"distill.target: {path} holds no exported target (train the target first, or name a "
                   f"shipped pair: {pretrained.available()})")
  return pretrained.load_model(folder), load_tokenizer(folder / "tokenizer.json")


def _load_teacher(cfg: TrainConfig, target_dir: pathlib.Path, placement: sharding.Placement | None,
                  model=None) -> tuple[nnx.GraphDef, dict]:
  """The frozen target ``(graphdef, params)``, placed on the mesh: ``model`` when already loaded, else read
  from ``target_dir``."""
  teacher = load_target(target_dir)[0] if model is None else model
  if cfg.model is not None and teacher.cfg.vocab_size != cfg.data.tokenizer_vocab:
    raise RunError(f"distill.target {target_dir} has vocab_size {teacher.cfg.vocab_size}, "
                   f"data.tokenizer_vocab is {cfg.data.tokenizer_vocab}")
  if placement is not None:
    placement.place(teacher, f"the frozen target {target_dir}")
  graphdef, state = nnx.split(teacher)
  return graphdef, nnx.to_pure_dict(state)


def _near(path: str, config_dir: pathlib.Path | None) -> pathlib.Path:
  """A recipe's path as given, or against the recipe's folder when it does not exist as given."""
  p = pathlib.Path(path).expanduser()
  if not p.is_absolute() and not p.exists() and config_dir is not None and (config_dir / p).exists():
    return config_dir / p
  return p


def conversation_source(target_dir: pathlib.Path, ccfg, config_dir: pathlib.Path | None = None):
  """``(model, tokenizer, chat, proposer)`` of the target that renders (and regenerates) conversations: its chat
  format (``conversations.chat_template`` when set, else the target's own), and what :func:`specjax.generate`
  speculates with: the target's shipped head (EAGLE, else MTP, else Medusa) or n-gram lookup.

  Raises:
    ConfigError: the target has no chat template and ``conversations.chat_template`` names none (or a missing
      file).
  """
  from specjax.chat import ChatFormat, ChatTemplateError
  from specjax.loading import PRETRAINED, load
  from specjax.proposers import NGram, for_heads

  name = str(target_dir)
  if name in PRETRAINED or name.endswith(".gguf") or ((target_dir / "config.json").is_file()
                                                       and any(target_dir.glob("*.safetensors"))):
    loaded = load(name)
    model, tokenizer, chat, heads = loaded.model, loaded.tokenizer, loaded.chat, loaded.heads
  else:
    (model, tokenizer), chat, heads = load_target(target_dir, config_dir), None, {}
  if ccfg.chat_template:
    path = _near(ccfg.chat_template, config_dir)
    if not path.is_file():
      raise ConfigError(f"conversations.chat_template: {path} does not exist")
    try:
      chat = ChatFormat.create(path.read_text(), tokenizer)
    except ChatTemplateError as e:
      raise ConfigError(f"conversations.chat_template: {path}: {e}") from e
  if chat is None:
    raise ConfigError(f"conversations.chat_template: the target {name} has no chat template of its own; name a "
                      "Jinja file to render the conversations with")
  shipped = next((heads[m] for m in ("eagle", "mtp", "medusa") if m in heads), None)
  return model, tokenizer, chat, NGram() if shipped is None else for_heads(shipped)


def _conversation_rows(cfg: TrainConfig, out: pathlib.Path, target_dir: pathlib.Path, tokenizer,
                       config_dir: pathlib.Path | None):
  """The target model, the ``(rows, masks)`` of the train and valid conversations of ``[conversations]``, and
  the paths of the shards they were read from, made first where missing
  (:func:`specjax.train.conversations.prepare`)."""
  from specjax.train import conversations as conv

  ccfg = cfg.conversations
  ccfg = dataclasses.replace(ccfg, path=str(_near(ccfg.path, config_dir)))
  model, gen_tokenizer, chat, proposer = conversation_source(target_dir, ccfg, config_dir)
  folder = pathlib.Path(ccfg.shards) if ccfg.shards else out / "conversations"
  answerer = conv.Answerer(model, gen_tokenizer, chat, proposer, ccfg.k) if ccfg.regenerate else None
  paths = conv.prepare(ccfg, folder, answerer=answerer, target=str(cfg.distill.target),
                       progress=cfg.run.progress and distributed.is_primary())
  split = conv.rows_and_masks(paths, chat, tokenizer, cfg.data.seq_len, ccfg.valid_fraction, ccfg.path)
  return model, split["train"], split["valid"], paths


def prepare_conversations(cfg: TrainConfig, out: str | pathlib.Path, config_dir: pathlib.Path | None = None) -> dict:
  """Makes the missing shards of a heads recipe's ``[conversations]`` (the target's answers regenerated where
  ``regenerate``) in ``conversations.shards`` (default ``<out>/conversations``), and encodes them as the run
  would, without caching features or training (``specjax train heads --prepare-only``): the long part of a run
  on a small machine, or on one host before the others join. Resumable as a run is (whole shards only).

  Returns:
    ``{"shards", "conversations", "train_rows", "valid_rows", "train_tokens"}`` (rows of ``data.seq_len + 1``
    tokens; ``train_tokens`` counts the answer tokens the loss sees).

  Raises:
    ConfigError: a recipe without ``[conversations]`` (and no ``--data``).
  """
  from specjax.train import conversations as conv

  if cfg.kind != "heads" or cfg.conversations is None:
    raise ConfigError("--prepare-only prepares a heads recipe's conversations: it needs a [conversations] "
                      "section or --data FILE.jsonl")
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  target_dir = _target_dir(cfg, config_dir)
  tokenizer = _tokenizer_for(cfg, out, target_dir, resume=True)
  _, (train_rows, train_masks), (valid_rows, _), paths = _conversation_rows(cfg, out, target_dir, tokenizer,
                                                                             config_dir)
  return {"shards": len(paths), "conversations": sum(1 for _ in conv.read_shards(paths)),
          "train_rows": int(len(train_rows)), "valid_rows": int(len(valid_rows)),
          "train_tokens": int(np.asarray(train_masks).sum())}


def _placed(placement: sharding.Placement | None, graphdef: nnx.GraphDef, parts: tuple[dict, ...],
            role: str) -> tuple[dict, ...]:
  """The pure-dict parts of a split module (``nnx.split(module)``: one part; a head set split into trained
  parameters and the rest: two) moved onto the placement's mesh as its rules say; unchanged for None."""
  if placement is None:
    return parts
  module = nnx.merge(graphdef, *parts)
  placement.place(module, role)
  filters = (nnx.Param, ...) if len(parts) == 2 else ()
  return tuple(nnx.to_pure_dict(part) for part in nnx.split(module, *filters)[1:])


def _on_devices(placement: sharding.Placement | None, host):
  """A batch ``[B, ...]`` on the run's devices: split by rows over ``data`` where B divides evenly (every
  training batch: :func:`start` checks), else replicated (a short last validation batch). A pytree of such
  arrays (a heads run's cached target outputs) is placed leaf by leaf; None stays None."""
  if host is None:
    return None
  if not isinstance(host, (np.ndarray, jax.Array)):
    return jax.tree.map(lambda x: _on_devices(placement, x), host)
  if placement is None or isinstance(host, jax.Array):
    return jnp.asarray(host)
  host = np.asarray(host)
  rows = host.shape[0] % placement.split_ways(sharding.ROWS)[0][1] == 0
  return placement.put(host, (("batch",) if rows else (None,)) + (None,) * (host.ndim - 1))


def _tokenizer_for(cfg: TrainConfig, out: pathlib.Path, target_dir: pathlib.Path | None,
                   resume: bool) -> BPETokenizer:
  """The run's tokenizer: the one in the run directory when resuming, the target's for a draft, else a
  BPE trained on the train split."""
  path = out / "tokenizer.json"
  if resume and path.exists():
    tok = load_tokenizer(path)
  elif target_dir is not None:
    tok = load_target(target_dir)[1]
  else:
    tok = train_bpe(data_lib.documents(cfg.data.corpus, "train"), cfg.data.tokenizer_vocab)
  tok.check_model(cfg.data.tokenizer_vocab, "the recipe (data.tokenizer_vocab)")
  if not path.exists() and distributed.is_primary():
    tok.save(path)
  return tok


def has_checkpoint(out: str | pathlib.Path) -> bool:
  """Whether the run directory ``out`` holds a checkpoint to resume from."""
  ckpt_dir = pathlib.Path(out) / "checkpoints"
  return ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())


# ----------------------------------------------------------------------------------- run kinds


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class ModelTask:
  """A language-model run (``kind`` ``target`` or ``draft``): the model is trained with cross entropy, or
  distilled from the frozen ``teacher`` with ``distill.divergence``; the export is ``model/``.

  A task is what one run kind contributes to the loop that every run shares (:func:`fit`): its step, its
  evaluation, what its checkpoints hold beyond parameters and optimizer state, and its export. :func:`start`
  picks the task once; nothing else branches on the run kind.
  """

  cfg: TrainConfig
  graphdef: nnx.GraphDef
  teacher: tuple[nnx.GraphDef, dict] | None

  export_dir: ClassVar[str] = "model"

  @staticmethod
  def needs_teacher(cfg: TrainConfig) -> bool:
    return cfg.distill is not None and cfg.distill.divergence != "ce"

  @classmethod
  def create(cls, cfg: TrainConfig, teacher, train_rows: np.ndarray, valid_rows: np.ndarray, *, target_dir,
             placement: sharding.Placement | None, out: pathlib.Path, training: bool) -> tuple[ModelTask, dict]:
    """The task and the freshly initialised parameters, placed on the mesh."""
    graphdef, params = init_model(cfg.model, cfg.run.seed)
    (params,) = _placed(placement, graphdef, (params,), "the model")
    return cls(cfg=cfg, graphdef=graphdef, teacher=teacher), params

  def checkpoint_state(self, params, opt_state) -> dict:
    """The pytree a checkpoint holds (and :func:`start` restores into)."""
    return {"params": params, "opt": opt_state}

  def restored(self, state: dict) -> ModelTask:
    """The task after a restore of :meth:`checkpoint_state` (what it holds besides params and optimizer)."""
    return self

  def checkpoint_meta(self, params) -> dict[str, Any]:
    """What a checkpoint's metadata records beyond the step, data position, recipe and tokenizer."""
    return {}

  def check_checkpoint(self, meta: dict, where) -> None:
    """Refuses a checkpoint this task cannot resume from (raises CheckpointError naming ``where``)."""

  def train_features(self, indices: np.ndarray):
    """The cached target outputs of the train rows ``indices`` (None: none cached)."""
    return None

  def step(self, run: Run, rows, mask, features) -> tuple[dict, Any, dict[str, jax.Array]]:
    """One optimizer step on ``rows [B, T+1]``, ``mask [B, T]``: ``(params, opt_state, metrics)``."""
    d = self.cfg.distill
    teacher_def, teacher_params = self.teacher if self.teacher is not None else (None, None)
    return train_step(
        self.graphdef, run.params, run.opt_state, _on_devices(run.placement, rows), _on_devices(run.placement, mask),
        teacher_def, teacher_params, optimizer=run.optimizer, divergence="ce" if d is None else d.divergence,
        temperature=1.0 if d is None else d.temperature, placement=run.placement)

  def evaluate(self, run: Run) -> dict[str, float]:
    """Validation loss and perplexity; with a teacher also the mean expected acceptance (temperature 1,
    ``accept_t1``) and greedy agreement (``accept_greedy``) per token."""
    sums: dict[str, float] = {}
    teacher_def, teacher_params = self.teacher if self.teacher is not None else (None, None)
    batch = self.cfg.data.batch_size
    for i in range(0, len(run.valid_rows), batch):
      part = eval_batch(self.graphdef, run.params, _on_devices(run.placement, run.valid_rows[i:i + batch]),
                        teacher_def, teacher_params, temperature=1.0, placement=run.placement)
      for k, v in jax.device_get(part).items():
        sums[k] = sums.get(k, 0.0) + float(v)
    loss = sums["nll_sum"] / sums["tokens"]
    out = {"valid_loss": loss, "valid_ppl": math.exp(min(loss, 50.0))}
    if "accept_sum" in sums:
      out["accept_t1"] = sums["accept_sum"] / sums["tokens"]
      out["accept_greedy"] = sums["greedy_sum"] / sums["tokens"]
    return out

  def export(self, run: Run, folder: pathlib.Path) -> None:
    """Writes the run's model as it stands to ``folder``, from the primary process (every process gathers)."""
    params = distributed.host_copy(run.params)  # every process takes part in the gather
    if distributed.is_primary():
      pretrained.save_model(folder, nnx.merge(self.graphdef, params), run.tokenizer)


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class HeadsTask:
  """A heads run (``kind = "heads"``): a head set trained on the frozen ``teacher`` with the losses of
  :mod:`specjax.train.heads`; the export is ``heads/`` (:func:`specjax.models.heads.save_heads`).

  Attributes:
    rest: the head set's variables that are not trained (EAGLE-3's ``d2t``), checkpointed with the params.
    features / valid_features: ``heads.cache_features``: the target's outputs for every train / validation
      row (host arrays), or None.
  """

  cfg: TrainConfig
  graphdef: nnx.GraphDef
  teacher: tuple[nnx.GraphDef, dict]
  rest: dict
  features: Any = None
  valid_features: Any = None

  export_dir: ClassVar[str] = "heads"

  @staticmethod
  def needs_teacher(cfg: TrainConfig) -> bool:
    return True

  @classmethod
  def create(cls, cfg: TrainConfig, teacher, train_rows: np.ndarray, valid_rows: np.ndarray, *, target_dir,
             placement: sharding.Placement | None, out: pathlib.Path, training: bool,
             train_masks: np.ndarray | None = None,
             config_dir: pathlib.Path | None = None) -> tuple[HeadsTask, dict]:
    """A fresh head set for the frozen target (or ``heads.init``'s, :func:`heads_lib.initial_heads`), placed
    on the mesh; a fresh EAGLE-3 head's draft vocabulary is the most frequent tokens of the train split (of its
    answer tokens, where ``train_masks`` marks them). With ``heads.cache_features`` and ``training``, the
    target's outputs for every row are computed (or read back, :func:`kept_outputs`) here."""
    target_cfg = nnx.merge(*teacher).cfg
    if target_cfg.max_seq_len < cfg.data.seq_len + 1:
      raise RunError(f"data.seq_len + 1 ({cfg.data.seq_len + 1}) exceeds the target's max_seq_len "
                     f"({target_cfg.max_seq_len}) ({target_dir})")
    cfg.heads.check_target(target_cfg)
    d2t = None
    counted = lambda: train_rows if train_masks is None else train_rows[:, 1:][train_masks > 0]
    if cfg.heads.kind == "eagle3" and cfg.heads.draft_vocab_size and not cfg.heads.init:
      d2t = heads_lib.frequent_tokens(counted(), target_cfg.vocab_size, cfg.heads.draft_vocab_size)
    heads = heads_lib.initial_heads(cfg.heads, target_cfg, seed=cfg.run.seed, d2t=d2t, config_dir=config_dir)
    if cfg.heads.init and distributed.is_primary():
      print(f"heads: start from {heads_lib.init_folder(cfg.heads.init, cfg.heads.kind, config_dir)} (heads.init)")
    if cfg.heads.init_vocab == "data":
      size = cfg.heads.draft_vocab_size or heads.cfg.vocab_size
      heads, fit = heads_lib.refit_vocab(heads, nnx.merge(*teacher),
                                         heads_lib.frequent_tokens(counted(), target_cfg.vocab_size, size),
                                         seed=cfg.run.seed)
      if distributed.is_primary():
        print(f"heads: draft vocabulary made again from the train split (heads.init_vocab): {size} tokens, "
              f"{fit['kept']} of the init's kept, {fit['new']} new, their output rows predicted from the target's "
              f"embeddings (R^2 {fit['r2']:.2f} on held-out kept rows)")
    graphdef, params, rest = nnx.split(heads, nnx.Param, ...)
    params, rest = _placed(placement, graphdef, (nnx.to_pure_dict(params), nnx.to_pure_dict(rest)), "the heads")
    features = valid_features = None
    if cfg.heads.cache_features and training:
      aux_layers = nnx.merge(graphdef, params, rest).cfg.aux_layers
      features, valid_features = (kept_outputs(teacher, r, aux_layers, cfg.heads.cache_top_k, cfg.data.batch_size,
                                               out / f"target_features.{split}.npz", cfg.heads.cache_dtype)
                                  for r, split in ((train_rows, "train"), (valid_rows, "valid")))
    return cls(cfg=cfg, graphdef=graphdef, teacher=teacher, rest=rest, features=features,
               valid_features=valid_features), params

  def module(self, params):
    """The head set with ``params``, as a module."""
    return nnx.merge(self.graphdef, params, self.rest)

  def checkpoint_state(self, params, opt_state) -> dict:
    return {"params": params, "opt": opt_state, "rest": self.rest}

  def restored(self, state: dict) -> HeadsTask:
    return dataclasses.replace(self, rest=state["rest"])

  def checkpoint_meta(self, params) -> dict[str, Any]:
    return {"heads": self.module(params).cfg.to_json()}

  def check_checkpoint(self, meta: dict, where) -> None:
    """Refuses to resume heads trained for another target, naming the field that differs."""
    from specjax.models.heads import HeadConfig

    saved = meta.get("heads")
    if not isinstance(saved, dict):
      raise CheckpointError(f"checkpoint {where} holds no head configuration")
    try:
      head_cfg = HeadConfig(**{**saved, "aux_layers": tuple(saved.get("aux_layers", ()))})
    except (TypeError, ValueError) as e:
      raise CheckpointError(f"checkpoint {where} holds an invalid head configuration: {e}") from e
    try:
      check_heads(head_cfg, nnx.merge(*self.teacher).cfg, where=f"the heads in checkpoint {where}")
    except ValueError as e:
      raise CheckpointError(str(e)) from None

  def train_features(self, indices: np.ndarray):
    return None if self.features is None else jax.tree.map(lambda x: x[indices], self.features)

  def step(self, run: Run, rows, mask, features) -> tuple[dict, Any, dict[str, jax.Array]]:
    key = jax.random.fold_in(jax.random.key(self.cfg.run.seed + 1), run.step)
    mask = None if self.cfg.conversations is None else mask  # corpus text: every position counts
    return heads_train_step(
        self.graphdef, run.params, self.rest, run.opt_state, self.teacher[0], self.teacher[1],
        _on_devices(run.placement, rows), key, _on_devices(run.placement, features), _on_devices(run.placement, mask),
        optimizer=run.optimizer, hcfg=self.cfg.heads, placement=run.placement)

  def evaluate(self, run: Run) -> dict[str, float]:
    """The head losses and, per proposal position i, ``valid_accept_i`` (mean ``Σ min(p, q)``) and
    ``valid_greedy_i``, and the τ they predict at temperature 1 and greedy."""
    sums: dict[str, float] = {}
    size = self.cfg.data.batch_size
    batches = range(0, len(run.valid_rows), size)
    for i in batches:
      cached = (None if self.valid_features is None
                else jax.tree.map(lambda x: x[i:i + size], self.valid_features))
      mask = None if run.valid_masks is None else run.valid_masks[i:i + size]
      part = heads_eval_batch(self.graphdef, run.params, self.rest, self.teacher[0], self.teacher[1],
                              _on_devices(run.placement, run.valid_rows[i:i + size]),
                              _on_devices(run.placement, cached), _on_devices(run.placement, mask),
                              hcfg=self.cfg.heads, placement=run.placement)
      for k, v in jax.device_get(part).items():
        sums[k] = sums.get(k, 0.0) + float(v) / len(batches)
    out = {f"valid_{k}": v for k, v in sums.items()}
    positions = sorted(int(k.split("_")[1]) for k in sums if k.startswith("accept_"))
    for name, prefix in (("t1", "accept"), ("greedy", "greedy")):
      accept = [sums[f"{prefix}_{i}"] for i in positions]
      out[f"valid_tau_{name}"] = costmodel.expected_tau(accept, len(accept))
    return out

  def export(self, run: Run, folder: pathlib.Path) -> None:
    params, rest = distributed.host_copy((run.params, self.rest))  # every process takes part in the gather
    if distributed.is_primary():
      save_heads(folder, nnx.merge(self.graphdef, params, rest))


Task = ModelTask | HeadsTask
TASKS: dict[str, type[Task]] = {"target": ModelTask, "draft": ModelTask, "heads": HeadsTask}


@dataclasses.dataclass
class Run:
  """Everything one training run holds between steps (host side): the run kind's :class:`ModelTask` or
  :class:`HeadsTask` (its model structure, frozen teacher and cached data) and the training state
  (``params``, ``opt_state``, ``step``, the data position in ``batches``)."""

  cfg: TrainConfig
  out: pathlib.Path
  tokenizer: BPETokenizer
  task: Task
  params: dict
  opt_state: Any
  optimizer: optax.GradientTransformation
  step: int
  batches: data_lib.Batches
  valid_rows: np.ndarray
  placement: sharding.Placement | None = None  # the mesh and rules everything is placed by (None: one device)
  valid_masks: np.ndarray | None = None  # [N, T] answer masks of valid_rows (conversation data), or None

  @property
  def graphdef(self) -> nnx.GraphDef:
    return self.task.graphdef

  @property
  def teacher(self) -> tuple[nnx.GraphDef, dict] | None:
    """The frozen target ``(graphdef, params)``, or None (a target trained with cross entropy)."""
    return self.task.teacher


def start(cfg: TrainConfig, out: str | pathlib.Path, *, resume: bool = False,
          config_dir: pathlib.Path | None = None, mesh: jax.sharding.Mesh | None = None,
          rules: sharding.ShardingRules | None = None, training: bool = True) -> Run:
  """Prepares a run: tokenizer, data, the run kind's task (:data:`TASKS`: model or head set, frozen target)
  and optimizer, restored from the newest checkpoint when ``resume`` is set and one exists.

  Args:
    training: False when the run will only be exported (:func:`export_now`): the target's outputs are not
      cached (``heads.cache_features``), since no step will read them.
    mesh: a ``jax.sharding.Mesh`` with axes ``data`` and ``model`` (:func:`specjax.sharding.make_mesh`), or
      None (one device). A resumed run may use another mesh than the run that saved the checkpoint.
    rules: :class:`specjax.sharding.ShardingRules` (default tensor parallel over ``model``, which is plain
      data parallelism when the mesh's ``model`` axis has size 1).

  Raises:
    RunError / CheckpointError / ConfigError / CorpusError / TokenizerError: naming the path or field;
    ValueError: a mesh axis that does not divide the batch, the heads, the vocabulary... (naming both).
  """
  task_cls = TASKS[cfg.kind]
  extra = {}
  if cfg.parallel is not None:  # a parallel draft (PARD): mask-block steps (imported here: it builds on ModelTask)
    from specjax.train.pard import ParallelTask

    task_cls, extra = ParallelTask, {"config_dir": config_dir}
  if cfg.kind == "heads":
    extra["config_dir"] = config_dir  # heads.init may be relative to the recipe
  placement = sharding.Placement.create(mesh, rules)
  if placement is not None:
    placement.check(sharding.ROWS, (cfg.data.batch_size,), "data.batch_size")
  out = pathlib.Path(out)
  ckpt_dir = out / "checkpoints"
  has_ckpt = has_checkpoint(out)
  if has_ckpt and not resume:
    raise RunError(f"{out} already holds checkpoints: pass --resume to continue, or choose another --out")
  out.mkdir(parents=True, exist_ok=True)
  target_dir = _target_dir(cfg, config_dir)
  tokenizer = _tokenizer_for(cfg, out, target_dir, resume)
  n_valid = cfg.run.eval_batches * cfg.data.batch_size
  train_masks = valid_masks = model = None
  if cfg.conversations is not None:  # prepared (regenerated, sharded) first: the target is still unplaced
    model, (train_rows, train_masks), (valid_rows, valid_masks), _ = _conversation_rows(
        cfg, out, target_dir, tokenizer, config_dir)
    valid_rows, valid_masks = valid_rows[:n_valid], valid_masks[:n_valid]
    extra["train_masks"] = train_masks
  teacher = _load_teacher(cfg, target_dir, placement, model) if task_cls.needs_teacher(cfg) else None

  if cfg.conversations is None:
    enc = lambda split: data_lib.token_stream(data_lib.documents(cfg.data.corpus, split), tokenizer)
    train_rows = data_lib.pack(enc("train"), cfg.data.seq_len)
    valid_rows = data_lib.pack(enc("valid"), cfg.data.seq_len)[:n_valid]

  task, params = task_cls.create(cfg, teacher, train_rows, valid_rows, target_dir=target_dir, placement=placement,
                                 out=out, training=training, **extra)
  optimizer = make_optimizer(cfg.optim, cfg.run.steps)
  opt_state = optimizer.init(params)  # moments take their parameter's sharding (zeros_like)
  if placement is not None:  # the step counters: replicated
    opt_state = jax.tree.map(lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding)
                             else jax.device_put(x, placement.replicated), opt_state)
  step, position = 0, data_lib.DataPosition()
  if resume and has_ckpt:
    ckpts = Checkpoints(ckpt_dir, cfg.run.keep)
    meta = ckpts.read_meta()
    try:
      saved_cfg = from_dict(meta["config"])
    except (KeyError, ConfigError) as e:
      raise CheckpointError(f"checkpoint {ckpts.step_path(meta['step'])} holds no valid recipe: {e}") from e
    diff = contradictions(saved_cfg, cfg)
    if diff:
      raise RunError(f"the config contradicts the checkpoint in {ckpt_dir}: " + "; ".join(diff))
    if meta.get("tokenizer") != tokenizer.fingerprint():
      raise RunError(f"{out / 'tokenizer.json'} is not the tokenizer the checkpoint in {ckpt_dir} was "
                     "trained with")
    task.check_checkpoint(meta, ckpts.step_path(meta["step"]))
    state, meta = ckpts.restore(task.checkpoint_state(params, opt_state))
    ckpts.close()
    task, params, opt_state = task.restored(state), state["params"], state["opt"]
    step, position = meta["step"], data_lib.DataPosition(**meta["data"])
  if distributed.is_primary():
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
  batches = data_lib.Batches(train_rows, cfg.data.batch_size, cfg.data.seed, position, masks=train_masks)
  return Run(cfg=cfg, out=out, tokenizer=tokenizer, task=task, params=params, opt_state=opt_state,
             optimizer=optimizer, step=step, batches=batches, valid_rows=valid_rows, placement=placement,
             valid_masks=valid_masks)


def source_at(cfg: TrainConfig, step: int) -> str:
  """The data source of a step, drawn from ``(seed, step)`` by the mix weights: reproducible on resume."""
  if cfg.distill is None:
    return "corpus"
  names = [n for n, _ in cfg.distill.mix]
  weights = np.array([w for _, w in cfg.distill.mix], np.float64)
  return str(np.random.default_rng([cfg.run.seed, step]).choice(names, p=weights / weights.sum()))


def batch_at(run: Run, step: int) -> tuple[np.ndarray | jax.Array, np.ndarray, str, Any]:
  """The rows ``[B, T+1]``, mask ``[B, T]``, source and cached target outputs (or None) of a step
  (advances the data position once)."""
  cfg = run.cfg
  indices = run.batches.next_indices()
  rows = run.batches.rows[indices]
  source = source_at(cfg, step)
  if source == "corpus":
    mask = (np.ones((rows.shape[0], rows.shape[1] - 1), np.float32) if run.batches.masks is None
            else np.asarray(run.batches.masks[indices], np.float32))
    return rows, mask, source, run.task.train_features(indices)
  d = cfg.distill
  graphdef, params = (run.teacher if source == "target" else (run.graphdef, run.params))
  key = jax.random.fold_in(jax.random.key(cfg.run.seed), step)
  gen = sample_continuations(graphdef, params, _on_devices(run.placement, rows[:, : d.prefix_len]), key,
                             gen_len=d.gen_len, temperature=d.temperature, placement=run.placement)  # [B, P + G]
  mask = np.zeros((gen.shape[0], gen.shape[1] - 1), np.float32)
  mask[:, d.prefix_len - 1:] = 1.0  # positions that predict generated tokens
  return gen, mask, source, None


def train_one(run: Run, rows, mask, features=None) -> dict[str, jax.Array]:
  """One step of the run's task on a batch of :func:`batch_at`; advances ``run`` and returns the metrics."""
  run.params, run.opt_state, metrics = run.task.step(run, rows, mask, features)
  run.step += 1
  return metrics


def evaluate(run: Run) -> dict[str, float]:
  """The run's validation metrics (:meth:`ModelTask.evaluate`, :meth:`HeadsTask.evaluate`)."""
  return run.task.evaluate(run)


def save_checkpoint(run: Run, ckpts: Checkpoints) -> None:
  meta = {"step": run.step, "data": dataclasses.asdict(run.batches.position), "config": run.cfg.to_dict(),
          "tokenizer": run.tokenizer.fingerprint(), "vocab_size": run.tokenizer.vocab_size,
          **run.task.checkpoint_meta(run.params)}
  ckpts.save(run.step, run.task.checkpoint_state(run.params, run.opt_state), meta)


def fit(run: Run, *, stop_at: int | None = None, export: bool = True) -> Run:
  """Trains until ``run.cfg.run.steps`` (or ``stop_at``, for tests that simulate a killed run),
  logging, evaluating, checkpointing, and exporting ``model/`` at the end.
  """
  from tqdm import tqdm

  cfg = run.cfg
  end = cfg.run.steps if stop_at is None else min(stop_at, cfg.run.steps)
  metrics_path = run.out / "metrics.jsonl"
  ckpts = Checkpoints(run.out / "checkpoints", cfg.run.keep)
  bar = tqdm(total=cfg.run.steps, initial=run.step, disable=not (cfg.run.progress and distributed.is_primary()),
             dynamic_ncols=True, desc=f"{cfg.kind} {run.out.name}")
  window_tokens, window_start = 0, time.perf_counter()
  try:
    if run.step == 0 and end > 0 and cfg.heads is not None and cfg.heads.init:
      _evaluate_and_log(run, metrics_path, bar)  # the init's own metrics: what the run starts from
    while run.step < end:
      rows, mask, source, features = batch_at(run, run.step)
      metrics = train_one(run, rows, mask, features)
      window_tokens += int(mask.sum())
      bar.update(1)
      if run.step % cfg.run.log_every == 0 or run.step == end:
        m = _float_tree(metrics)
        elapsed = time.perf_counter() - window_start
        record = {"step": run.step, "source": source, **m, "tokens_per_s": window_tokens / elapsed,
                  "lr": float(lr_schedule(cfg.optim, cfg.run.steps)(run.step)), "time": time.time()}
        _log(metrics_path, record)
        bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        window_tokens, window_start = 0, time.perf_counter()
      paused = time.perf_counter()  # evaluation and checkpoints do not count against tokens/s
      if run.step % cfg.run.eval_every == 0 or run.step == cfg.run.steps:
        _evaluate_and_log(run, metrics_path, bar)
      if run.step % cfg.run.ckpt_every == 0 or run.step == end:
        save_checkpoint(run, ckpts)
      window_start += time.perf_counter() - paused
  finally:
    bar.close()
    ckpts.close()
  if export and run.step == cfg.run.steps:
    export_now(run)
  return run


def _evaluate_and_log(run: Run, metrics_path: pathlib.Path, bar) -> None:
  ev = evaluate(run)
  _log(metrics_path, {"step": run.step, **ev, "time": time.time()})
  if distributed.is_primary():
    bar.write(f"step {run.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))


def export_now(run: Run) -> pathlib.Path:
  """Writes the run's model (``model/``) or head set (``heads/``) as it stands, from process 0, its arrays
  gathered to the host first; :func:`fit` calls it at the last step, and a run stopped early, resumed from
  its newest checkpoint, becomes usable without training to the end. Returns the export folder."""
  folder = run.out / run.task.export_dir
  run.task.export(run, folder)
  return folder
