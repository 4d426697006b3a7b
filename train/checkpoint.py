"""Checkpoints: the only module that touches orbax.

A checkpoint of step ``s`` is one orbax step directory holding two items:

* ``state``: the array pytree ``{"params": ..., "opt": ...}`` (parameters and optimizer state);
* ``meta``: JSON with the step, the data position, the recipe and the tokenizer fingerprint.

Orbax writes a step into a temporary directory and renames it when complete, so an interrupted save leaves
no step that :meth:`Checkpoints.latest_step` reports or :meth:`Checkpoints.restore` reads. The ``keep``
newest steps are kept.

Sharded state is saved shard by shard (on a multi-host run every process writes its own shards and orbax's
primary process the metadata, so every process must call :meth:`Checkpoints.save`); :meth:`Checkpoints.restore`
reads each array straight into the sharding of the array it replaces, so a checkpoint written on one mesh
restores onto a mesh of another shape (or onto one device).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
  """A checkpoint is missing, corrupt, or does not match what restores it; the message names the path."""


class Checkpoints:
  """Keep-N checkpoints of a run under ``directory``.

  Args:
    directory: folder of the step directories (created if missing).
    keep: how many of the newest checkpoints to keep.
  """

  def __init__(self, directory: str | pathlib.Path, keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False)
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def step_path(self, step: int) -> pathlib.Path:
    return self.directory / str(step)

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Writes ``state`` (an array pytree) and ``meta`` (JSON-able) as step ``step``; returns when the
    checkpoint is complete on disk."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    self._manager.save(step, args=args, force=True)
    self._manager.wait_until_finished()

  def read_meta(self, step: int | None = None) -> dict[str, Any]:
    """The JSON item of a checkpoint (the newest when ``step`` is None), without reading arrays."""
    step = self._resolve(step)
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises many types for unreadable files
      raise CheckpointError(f"checkpoint {self.step_path(step)} has no readable metadata: {e}") from e
    if not isinstance(meta, dict) or meta.get("step") != step:
      raise CheckpointError(f"checkpoint {self.step_path(step)} has corrupt metadata (step field "
                            f"{meta.get('step') if isinstance(meta, dict) else meta!r}, expected {step})")
    return meta

  def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Restores a checkpoint into the structure, shapes and dtypes of ``like``.

    Args:
      like: a pytree of arrays (or ``jax.ShapeDtypeStruct``) shaped like the saved state; each restored
        array takes the sharding of its counterpart in ``like`` (for example the state of a run placed on
        another mesh than the one that saved it).
      step: the step to restore; the newest when None.

    Returns:
      ``(state, meta)``.

    Raises:
      CheckpointError: no checkpoint, unreadable files, or a tree whose structure, shapes or dtypes
        differ from ``like`` (naming the first differing leaf). After unreadable files, the reads of the other
        arrays still under way may each print "Event loop is closed" from a tensorstore thread as they end
        (orbax's event loop closed with the error); harmless, the error is the one raised here.
    """
    step = self._resolve(step)
    meta = self.read_meta(step)
    path = self.step_path(step)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)),
                            like)
    try:
      saved = self._manager.item_metadata(step)["state"]
    except Exception as e:
      raise CheckpointError(f"checkpoint {path} has no readable state metadata: {e}") from e
    if saved is None:
      raise CheckpointError(f"checkpoint {path} has no state item")
    _check_same_tree(saved, abstract, path)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    except Exception as e:
      raise CheckpointError(f"checkpoint {path} could not be restored (corrupt or incomplete files): "
                            f"{type(e).__name__}: {e}") from e
    return restored["state"], meta

  def _resolve(self, step: int | None) -> int:
    self._manager.reload()
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise CheckpointError(f"no complete checkpoint in {self.directory}")
      return steps[-1]
    if step not in steps:
      raise CheckpointError(f"no checkpoint of step {step} in {self.directory} (have {steps})")
    return step

  def close(self) -> None:
    self._manager.close()


def _key_name(path) -> str:
  """``"opt/0/count"`` for dict keys, sequence indices and named-tuple fields alike (orbax's metadata
  stores named tuples as dicts)."""
  parts = []
  for entry in path:
    for attr in ("key", "idx", "name"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
  return "/".join(parts)


def _check_same_tree(saved: Any, abstract: Any, path: pathlib.Path) -> None:
  flat_saved = {_key_name(k): v for k, v in jax.tree_util.tree_leaves_with_path(saved)}
  flat_like = {_key_name(k): v for k, v in jax.tree_util.tree_leaves_with_path(abstract)}
  missing = sorted(set(flat_like) - set(flat_saved))
  extra = sorted(set(flat_saved) - set(flat_like))
  if missing or extra:
    raise CheckpointError(f"checkpoint {path} does not match the model: "
                          + (f"missing {missing[0]}" if missing else f"unexpected {extra[0]}")
                          + f" ({len(missing)} missing, {len(extra)} unexpected leaves)")
  for key, want in flat_like.items():
    got = flat_saved[key]
    shape = tuple(getattr(got, "shape", ()) or ())
    if shape != tuple(want.shape):
      raise CheckpointError(f"checkpoint {path} does not match the model: {key} has shape {shape}, "
                            f"the model needs {tuple(want.shape)}")
