"""Sharding over a device mesh: logical axis names, one rules table, and where arrays are placed.

Every parameter of every specjax model and head set names its axes with *logical* names
(:data:`LOGICAL_AXES`: batch, sequence, heads, kv_heads, head_dim, embed, mlp, vocab), stored as flax's
``out_sharding`` metadata with ``eager_sharding=False`` (building a model needs no mesh;
``nnx.get_partition_spec(state)`` reads the names back). The KV cache and the activations that cross a
layer boundary (residual stream, queries/keys/values, MLP hidden, logits) are constrained by name inside
the models. One frozen table, :class:`ShardingRules` (after jax-llm-examples' ``ShardingRules`` and
MaxText's logical-axis rules), maps each logical name to mesh axes; the default is tensor parallelism over
``model`` (attention heads, KV heads, MLP width, vocabulary) and the batch over ``data``.

A :class:`Placement` (a mesh with Auto axes, and the rules) is what a jitted program is built for: it is
part of the program's cache key, and the program traces its model under :func:`activate`, the only time
the activation constraints exist. Without a placement (``mesh=None``, the default) :func:`constrain` returns
its input unchanged: the one-device program is exactly the one it was before any of this existed.

XLA's SPMD partitioner does the rest (Auto axes): matmuls against a sharded weight compute locally and
all-reduce their ``[B, T, D]`` outputs; the embedding lookup into a vocabulary-sharded table gathers locally
and all-reduces; reductions over a vocabulary-sharded axis (softmax, argmax, sums) all-reduce scalars per
row. See ``docs/sharding.md`` for where the vocabulary-sized gathers happen (never a weight).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from specjax.quant import QuantizedArray

DATA, MODEL = "data", "model"
MESH_AXES = (DATA, MODEL)
LOGICAL_AXES = ("batch", "sequence", "heads", "kv_heads", "head_dim", "embed", "mlp", "vocab")

# The logical names of the arrays that cross a boundary (one home; models, caches and the engine use these).
TOKENS = ("batch", "sequence")  # [B, T] int32
RESIDUAL = ("batch", "sequence", "embed")  # [B, T, D] the residual stream, hidden states
QUERIES = ("batch", "sequence", "heads", "head_dim")  # [B, T, H, Dh]
KEYS = ("batch", "sequence", "kv_heads", "head_dim")  # [B, T, Hkv, Dh], and the cache [B, S, Hkv, Dh]
MLP_HIDDEN = ("batch", "sequence", "mlp")  # [B, T, F]
ROWS = ("batch",)  # [B] per-row lengths, tokens

# What a logical axis is called in a model config (error messages name the field a user can change).
CONFIG_FIELDS = {"heads": "n_heads", "kv_heads": "n_kv_heads", "head_dim": "head_dim", "embed": "d_model",
                 "mlp": "d_ff", "vocab": "vocab_size", "batch": "batch", "sequence": "sequence length"}

AxisName = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis name -> mesh axis (a name, a tuple of names, or None: replicated). Frozen and hashable: a
  program is compiled per rules table.

  The defaults are tensor parallelism over ``model`` (Megatron-style: attention by heads, the MLP by its
  hidden width, embedding and LM head by vocabulary) and data parallelism over ``data``. ``embed`` maps to
  None: the residual stream stays whole on every device, so each layer costs one all-reduce of
  ``[B, T, D]`` after its attention and one after its MLP, and no weight ever moves.
  """

  batch: AxisName = DATA
  sequence: AxisName = None
  heads: AxisName = MODEL
  kv_heads: AxisName = MODEL
  head_dim: AxisName = None
  embed: AxisName = None
  mlp: AxisName = MODEL
  vocab: AxisName = MODEL

  def __post_init__(self):
    for name in LOGICAL_AXES:
      value = getattr(self, name)
      if isinstance(value, list):
        value = tuple(value)
        object.__setattr__(self, name, value)
      ok = value is None or isinstance(value, str) or (
          isinstance(value, tuple) and value and all(isinstance(v, str) for v in value))
      if not ok:
        raise ValueError(f"ShardingRules.{name} must be a mesh axis name, a tuple of names or None, got {value!r}")

  def mesh_axes(self, name: str | None) -> tuple[str, ...]:
    """The mesh axes logical axis ``name`` maps to (``()`` for None or a replicated axis)."""
    if name is None:
      return ()
    if name not in LOGICAL_AXES:
      raise ValueError(f"unknown logical axis {name!r}; known: {LOGICAL_AXES}")
    value = getattr(self, name)
    return () if value is None else (value,) if isinstance(value, str) else value

  def spec(self, names: Sequence[str | None]) -> PartitionSpec:
    """The ``PartitionSpec`` of an array whose axes have the logical ``names`` (None: never sharded).

    A mesh axis used by two of the names shards only the first of them (an array cannot be split twice
    over one axis; the Medusa and EAGLE projections name ``embed`` on both sides, for example).
    """
    used: set[str] = set()
    out = []
    for name in names:
      axes = tuple(a for a in self.mesh_axes(name) if a not in used)
      used.update(axes)
      out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)

  def used_mesh_axes(self) -> set[str]:
    return {a for name in LOGICAL_AXES for a in self.mesh_axes(name)}


TENSOR_PARALLEL = ShardingRules()
DATA_PARALLEL = ShardingRules(heads=None, kv_heads=None, mlp=None, vocab=None)


def param(value: jax.Array, axes: Sequence[str | None]) -> nnx.Param:
  """An ``nnx.Param`` holding ``value`` whose axes have the logical names ``axes`` (one per dimension).

  The names are flax's ``out_sharding`` metadata, not applied at construction (``eager_sharding=False``):
  :meth:`Placement.place` applies them through the rules."""
  axes = tuple(axes)
  if len(axes) != np.ndim(value):
    raise ValueError(f"a parameter of shape {np.shape(value)} needs {np.ndim(value)} logical axis names, got {axes}")
  for name in axes:
    if name is not None and name not in LOGICAL_AXES:
      raise ValueError(f"unknown logical axis {name!r}; known: {LOGICAL_AXES}")
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
  """A variable's logical axis names; an unnamed variable is replicated (all None)."""
  names = variable.get_metadata().get("out_sharding")
  return tuple(names) if names else (None,) * np.ndim(variable.get_value())


# ------------------------------------------------------------------------------------------- meshes


def parse_mesh(text: str) -> dict[str, int]:
  """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}`` (the CLI's ``--mesh``).

  Raises:
    ValueError: naming the text and the part that is not ``axis=size`` with an axis of ``MESH_AXES``.
  """
  sizes: dict[str, int] = {}
  for part in (p.strip() for p in str(text).split(",")):
    name, _, size = part.partition("=")
    name = name.strip()
    if name not in MESH_AXES or not size.strip().isdigit() or int(size) < 1 or name in sizes:
      raise ValueError(f"--mesh {text!r}: each part must be axis=size with axis one of {MESH_AXES} (once each) "
                       f"and size an integer >= 1, got {part!r}")
    sizes[name] = int(size)
  return sizes


def make_mesh(sizes: Mapping[str, int] | str | None = None, devices: Sequence[Any] | None = None) -> Mesh:
  """A ``(data, model)`` mesh with Auto axes over the first ``data * model`` of ``devices``.

  Args:
    sizes: ``{"data": D, "model": M}``, or its text form ``"data=2,model=4"``; a missing axis takes the
      devices the other leaves (``{"model": 4}`` on 8 devices: ``data = 2``); None: all devices on ``data``.
    devices: default ``jax.devices()`` (every process's devices on a multi-host slice).

  Raises:
    ValueError: naming the sizes and the number of devices when they do not fit.
  """
  sizes = parse_mesh(sizes) if isinstance(sizes, str) else dict(sizes or {})
  devices = list(jax.devices() if devices is None else devices)
  unknown = sorted(set(sizes) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"mesh axes must be among {MESH_AXES}, got {unknown[0]!r}")
  model = sizes.get(MODEL, 1)
  data = sizes.get(DATA, max(1, len(devices) // model))
  for name, size in ((DATA, data), (MODEL, model)):
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
      raise ValueError(f"mesh axis {name!r} must have an integer size >= 1, got {size!r}")
  if data * model > len(devices):
    raise ValueError(f"a mesh of data={data} x model={model} needs {data * model} devices, "
                     f"but {len(devices)} are available")
  return jax.make_mesh((data, model), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                       devices=devices[:data * model])


def auto_axes(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis of type Auto (XLA propagates shardings; an Explicit mesh, the default of
  ``jax.make_mesh``, would make every op state its output sharding)."""
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


# --------------------------------------------------------------------------------------- placement


@dataclasses.dataclass(frozen=True)
class Placement:
  """A mesh (Auto axes) and the rules that map logical axes onto it: what a sharded program is built for.
  Frozen and hashable (part of the program caches' keys). Build it with :meth:`create`."""

  mesh: Mesh
  rules: ShardingRules

  @classmethod
  def create(cls, mesh: Mesh | None, rules: ShardingRules | None = None) -> Placement | None:
    """The placement for ``mesh`` and ``rules`` (default :data:`TENSOR_PARALLEL`); None for no mesh.

    Raises:
      ValueError: a mesh that is not a ``jax.sharding.Mesh``, rules that are not :class:`ShardingRules`, or
        rules naming a mesh axis the mesh lacks (naming both).
    """
    if mesh is None:
      if rules is not None:
        raise ValueError("rules= needs mesh= (a jax.sharding.Mesh, e.g. specjax.sharding.make_mesh('data=2,model=4'))")
      return None
    if not isinstance(mesh, Mesh):
      raise ValueError(f"mesh must be a jax.sharding.Mesh (e.g. specjax.sharding.make_mesh('data=2,model=4')), "
                       f"got {type(mesh).__name__}")
    rules = TENSOR_PARALLEL if rules is None else rules
    if not isinstance(rules, ShardingRules):
      raise ValueError(f"rules must be a specjax.sharding.ShardingRules, got {type(rules).__name__}")
    missing = sorted(rules.used_mesh_axes() - set(mesh.axis_names))
    if missing:
      raise ValueError(f"the sharding rules use mesh axis {missing[0]!r}, which the mesh (axes {mesh.axis_names}) "
                       f"lacks: build the mesh with specjax.sharding.make_mesh (axes {MESH_AXES}, size 1 allowed) "
                       "or map that axis to None in ShardingRules")
    return cls(auto_axes(mesh), rules)

  def split_ways(self, names: Sequence[str | None]) -> list[tuple[tuple[str, ...], int]]:
    """Per dimension of an array with logical ``names``: the mesh axes it is split over and into how many
    pieces (``((), 1)`` where it is whole)."""
    out = []
    for entry in self.rules.spec(names):
      axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      out.append((axes, math.prod(self.mesh.shape[a] for a in axes)))
    return out

  def sharding(self, names: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(self.mesh, self.rules.spec(names))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  # ------------------------------------------------------------------------------------ checks

  def check(self, names: Sequence[str | None], shape: Sequence[int], what: str) -> None:
    """Raises ValueError unless every dimension of ``shape`` divides evenly over the mesh axes its logical
    name maps to, naming ``what``, the config field, both numbers and the mesh axis."""
    for name, size, (axes, ways) in zip(names, shape, self.split_ways(names)):
      if size % ways:
        axis = "x".join(map(repr, axes))
        field = CONFIG_FIELDS.get(name, name)
        raise ValueError(
            f"{what}: mesh axis {axis} (size {ways}) does not divide {field} = {size} (logical axis {name!r}); "
            f"use a mesh whose {axis} size divides {size}, or map {name!r} to None in ShardingRules")

  def check_batch(self, batch: int) -> None:
    self.check(ROWS, (batch,), "the batch (number of prompts)")

  def check_module(self, module: nnx.Module, role: str) -> None:
    """Every variable of ``module`` divides evenly over the mesh (see :meth:`check`; a quantized weight's groups
    too, see :meth:`quantized_specs`); ``role`` names it."""
    for path, var in nnx.to_flat_state(nnx.state(module)):
      where = f"{role} (parameter {'/'.join(map(str, path))})"
      self.check(logical_axes(var), np.shape(var.get_value()), where)
      if isinstance(var.get_value(), QuantizedArray):
        self.quantized_specs(var.get_value(), logical_axes(var), where)

  def quantized_specs(self, w: QuantizedArray, names: Sequence[str | None], what: str) -> QuantizedArray:
    """The ``PartitionSpec`` of each array of quantized weight ``w`` (a :class:`~specjax.quant.QuantizedArray` of
    them) whose logical axes are ``names``: codes, scales and minima split along the same axes as a float weight
    would be. Along the contracting axis (``w.axis``) a shard holds whole groups; a weight with one group there
    (one scale per output channel) keeps its scales whole on every device.

    Raises:
      ValueError: the mesh axis that splits the contracting axis does not divide the number of groups (a shard
        would cut a group), naming ``what``, the group, the config field and the mesh axis.
    """
    spec = tuple(self.rules.spec(names)) + (None,) * (w.ndim - len(names))
    axes, ways = self.split_ways(names)[w.axis]
    groups = w.shape[w.axis] // w.group
    scale_spec = spec
    if ways > 1 and groups == 1:
      scale_spec = spec[:w.axis] + (None,) + spec[w.axis + 1:]
    if ways > 1 and (groups % ways if groups > 1 else w.q.shape[w.axis] % ways):
      axis, name = "x".join(map(repr, axes)), names[w.axis]
      field = CONFIG_FIELDS.get(name, name)
      raise ValueError(
          f"{what}: mesh axis {axis} (size {ways}) splits the quantized weight's contracting axis ({field} = "
          f"{w.shape[w.axis]}, logical axis {name!r}) into slices of {w.shape[w.axis] // ways}, which would cut its "
          f"groups of {w.group}: quantize with a group that divides {w.shape[w.axis] // ways}, or map {name!r} to "
          "None in ShardingRules")
    return dataclasses.replace(w, q=PartitionSpec(*spec), scale=PartitionSpec(*scale_spec),
                               low=None if w.low is None else PartitionSpec(*scale_spec))

  # ------------------------------------------------------------------------------------ placing

  def shardings(self, state: nnx.State) -> nnx.State:
    """The ``NamedSharding`` of every variable of ``state`` under the rules (a state of the same structure; for a
    quantized weight, a :class:`~specjax.quant.QuantizedArray` of shardings, see :meth:`quantized_specs`)."""

    def one(v: nnx.Variable):
      if isinstance(v.get_value(), QuantizedArray):
        specs = self.quantized_specs(v.get_value(), logical_axes(v), "a quantized weight")
        named = lambda p: None if p is None else NamedSharding(self.mesh, p)
        return v.replace(dataclasses.replace(specs, q=named(specs.q), scale=named(specs.scale), low=named(specs.low)))
      return v.replace(self.sharding(logical_axes(v)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def place(self, model: nnx.Module, role: str = "model") -> None:
    """Moves every variable of ``model`` onto the mesh as the rules say, in place (the arrays it held are
    replaced, so no second copy stays alive). Validates divisibility first (:meth:`check_module`)."""
    self.check_module(model, role)
    state = nnx.state(model)
    if jax.process_count() == 1:
      placed = jax.device_put(state, self.shardings(state))  # device to device
    else:  # every process holds the whole model; each fills its own devices' shards from it
      placed = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]), state,
                            self.shardings(state))
    nnx.update(model, placed)

  def put(self, host: np.ndarray, names: Sequence[str | None]) -> jax.Array:
    """A host array (the same on every process) as a global array sharded by logical ``names``; works on
    one host and on many (each process fills its own devices' shards)."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, self.sharding(names), lambda index: host[index])


# The placement whose constraints apply while a program is traced (see `activate`).
_ACTIVE: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("specjax_placement", default=None)


@contextlib.contextmanager
def activate(placement: Placement | None) -> Iterator[None]:
  """While tracing a program built for ``placement``, :func:`constrain` applies its rules; None (one
  device): nothing changes. Enter it *inside* the traced function of a jit whose cache key includes the
  placement (``generate``'s program cache, the training steps' static ``placement`` argument): a jit keyed
  otherwise could reuse a trace made under another placement."""
  token = _ACTIVE.set(placement)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def placed() -> bool:
  """Whether a placement is active: a program traced for a mesh."""
  return _ACTIVE.get() is not None


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """``x`` constrained to the sharding its logical axis ``names`` have under the active placement; ``x``
  itself when none is active (no op is added to a one-device program)."""
  placement = _ACTIVE.get()
  if placement is None:
    return x
  return jax.lax.with_sharding_constraint(x, placement.sharding(names))


def constrain_rows(x: jax.Array, last: str | None) -> jax.Array:
  """``x [B, ..., N]`` constrained by rows (``batch``), positions (``sequence``, every axis between) and its
  last axis (``last``): hidden states with ``last="embed"``, logits ``[B, ..., V]`` with ``last="vocab"``."""
  if _ACTIVE.get() is None or x.ndim < 2:
    return x
  return constrain(x, ("batch",) + ("sequence",) * (x.ndim - 2) + (last,))
