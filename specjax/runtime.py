"""The host-side caches of one process, in one owner with bounds: model splits, compiled programs,
``k="auto"`` decisions, calibrated cost tables and which models sit on which mesh.

Everything here is a cache: dropping any entry only costs time (a split, a compile, a calibration). The
bounds keep a long-running process (a notebook sweeping configurations, a server) from growing without
limit; a lock makes the caches safe to share between threads.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from flax import nnx

V = TypeVar("V")


class LRU(Generic[V]):
  """A dict with at most ``capacity`` entries; the least recently used goes first. Thread-safe."""

  def __init__(self, capacity: int):
    if not isinstance(capacity, int) or capacity < 1:
      raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
    self.capacity = capacity
    self._data: collections.OrderedDict[Hashable, V] = collections.OrderedDict()
    self._lock = threading.RLock()

  def get(self, key: Hashable, default: Any = None) -> V | Any:
    with self._lock:
      if key not in self._data:
        return default
      self._data.move_to_end(key)
      return self._data[key]

  def __getitem__(self, key: Hashable) -> V:
    with self._lock:
      value = self._data[key]
      self._data.move_to_end(key)
      return value

  def __setitem__(self, key: Hashable, value: V) -> None:
    with self._lock:
      self._data[key] = value
      self._data.move_to_end(key)
      while len(self._data) > self.capacity:
        self._data.popitem(last=False)

  def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
    """The entry for ``key``, made (outside the lock, so a slow ``make`` blocks no other key) if absent."""
    value = self.get(key, _MISSING)
    if value is _MISSING:
      value = make()
      self[key] = value
    return value

  def __contains__(self, key: Hashable) -> bool:
    with self._lock:
      return key in self._data

  def __len__(self) -> int:
    return len(self._data)

  def pop(self, key: Hashable, default: Any = None) -> V | Any:
    with self._lock:
      return self._data.pop(key, default)

  def clear(self) -> None:
    with self._lock:
      self._data.clear()


_MISSING = object()


class Runtime:
  """The caches ``generate``, ``k="auto"`` and the cost model share (one instance, :data:`RUNTIME`).

  Attributes:
    programs: compiled generation programs, keyed by graphdef identity and static settings.
    auto_k: ``k="auto"`` decisions per (models, sampling, batch, prompt and length buckets, backend).
    cost_tables: calibrated :class:`specjax.costmodel.CostTable` objects.
    trace_counts: how often each jitted entry point was traced (recompilation diagnostics).
    placements: ``(id(model), placement) -> state`` of the split a model had when it was last moved onto a
      mesh (:meth:`place_model`).
  """

  def __init__(self, max_programs: int = 256, max_auto_k: int = 1024, max_cost_tables: int = 256):
    self.programs: LRU[tuple] = LRU(max_programs)
    self.auto_k: LRU[int] = LRU(max_auto_k)
    self.cost_tables: LRU[Any] = LRU(max_cost_tables)
    self.trace_counts: collections.Counter[str] = collections.Counter()
    self.placements: LRU[Any] = LRU(64)
    # id(model) -> (weak reference, graphdef, state, its variables, their arrays); an entry lives as long
    # as its model (the weak reference's callback drops it), so this needs no bound of its own.
    self._splits: dict[int, tuple] = {}
    self._graphdefs: LRU[nnx.GraphDef] = LRU(max_programs)
    self._lock = threading.RLock()

  def split_model(self, model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split(model)``, kept per model for as long as every variable still holds the same array.

    Walking the module graph costs about a millisecond of Python per call for a small model, as much as
    decoding a token; ``generate`` therefore splits each model once. Updating weights in place (assigning a
    variable's value, ``nnx.update``, an optimizer step) replaces arrays and is noticed by an identity check
    of each variable's array (microseconds). Replacing a whole submodule is not noticed: call
    :meth:`forget_model` after doing that.

    Equal graphdefs (models of one structure: a retrained or reloaded head set, a copy) are returned as one
    object, so that the programs keyed by graphdef identity serve all of them without recompiling.
    """
    with self._lock:
      entry = self._splits.get(id(model))
      if entry is not None:
        ref, graphdef, state, variables, arrays = entry
        if ref() is model and all(v.get_raw_value() is a for v, a in zip(variables, arrays)):
          return graphdef, state
      graphdef, state = nnx.split(model)
      graphdef = self._graphdefs.get_or_make(graphdef, lambda: graphdef)  # one object per structure
      variables = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]
      key = id(model)
      splits = self._splits
      ref = weakref.ref(model, lambda _: splits.pop(key, None))
      splits[key] = (ref, graphdef, state, variables, [v.get_raw_value() for v in variables])
      return graphdef, state

  def place_model(self, model: nnx.Module, placement, role: str = "model") -> None:
    """Moves ``model``'s variables onto ``placement``'s mesh (:meth:`specjax.sharding.Placement.place`, in
    place), unless the split kept for the model is the one placed there last time (an identity check: a
    model whose weights changed since is placed again)."""
    key = (id(model), placement)
    _, state = self.split_model(model)
    if self.placements.get(key) is state:
      return
    placement.place(model, role)
    self.placements[key] = self.split_model(model)[1]

  def forget_model(self, model: nnx.Module) -> None:
    """Drops the split kept for ``model`` (after replacing one of its submodules)."""
    with self._lock:
      self._splits.pop(id(model), None)

  def clear(self) -> None:
    """Drops every cached program, decision and table (splits stay: they follow their models)."""
    self.programs.clear()
    self.auto_k.clear()
    self.cost_tables.clear()


RUNTIME = Runtime()


@dataclasses.dataclass(frozen=True, eq=False)
class Structure:
  """The static half of a (target, proposer) pair: what a jitted program closes over (graphdefs and the
  proposer's template, no weights)."""

  tdef: Any
  template: Any
  pdefs: tuple

  def models(self, tstate, pstates):
    """Inside a trace: the target and the bound proposer (None without one) merged from their states."""
    bound = None if self.template is None else self.template.bind(self.pdefs, pstates)
    return nnx.merge(self.tdef, tstate), bound


class SplitModels:
  """A target and an optional proposer split once (:meth:`Runtime.split_model`: one graphdef object per
  structure); their weights are the arguments of the programs built on :attr:`structure`.

  Attributes:
    structure: the :class:`Structure` programs close over. tstate, pstates: the target's and the proposer's
      modules' states (the programs' traced arguments).
  """

  def __init__(self, target: nnx.Module, proposer=None):
    tdef, self.tstate = RUNTIME.split_model(target)
    template, pdefs, self.pstates = (None, (), ()) if proposer is None else proposer.split(RUNTIME.split_model)
    self.structure = Structure(tdef, template, pdefs)
    self._proposer = proposer

  def refresh(self) -> None:
    """Takes the proposer's modules' current states (a suffix store that learned new documents); their
    structure is unchanged, so the programs built on :attr:`structure` serve them without recompiling."""
    if self._proposer is not None:
      _, pdefs, self.pstates = self._proposer.split(RUNTIME.split_model)
      if tuple(map(id, pdefs)) != tuple(map(id, self.structure.pdefs)):
        raise RuntimeError("the proposer's module structure changed; build a new engine for it")

  def args(self) -> tuple:
    return (self.tstate, self.pstates)

  def cached(self, kind: str, build: Callable[..., Any], *settings: Hashable) -> tuple:
    """``(program, args)``: ``program = build(structure, *settings)`` kept in :data:`RUNTIME` per (kind, the
    models' structure, settings), so that models of one structure share it."""
    st = self.structure
    options = None if st.template is None else (type(st.template), st.template.options())
    key = (kind, id(st.tdef), options, tuple(map(id, st.pdefs))) + settings
    return RUNTIME.programs.get_or_make(key, lambda: (build(st, *settings), st))[0], self.args()
