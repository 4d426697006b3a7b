"""Token trees: several candidates per position, verified in one target pass (``ALGORITHMS.md``, "Token trees").

A round may propose a tree instead of a chain. Every row's tree has the same static number of slots ``N + 1``:
slot 0 is the root (the round's ``last`` token), slots ``1..N`` the candidate nodes, in topological order
(a node's parent has a smaller slot). A :class:`Tree` holds, per row, each slot's token, parent, depth, rank
among its siblings (0: the proposer's first choice) and whether it is a node at all (``valid``: a dynamic
tree may keep fewer real nodes than slots). The shapes are static; only the values differ per row.

Two ways to choose the nodes (the *spec* of a round):

- :class:`TreeShape`: a fixed shape, ``branching[d]`` children for every node of depth ``d`` (Medusa's and
  SpecInfer's cartesian trees), optionally pruned to ``max_nodes`` (the nodes of smallest rank sum, which
  are the likeliest under any proposer whose ranks mean something);
- :class:`DynamicTree`: EAGLE-2's tree, grown by the proposer's cumulative log-probability: ``top_k``
  frontier nodes expanded ``top_k`` children each for ``depth`` levels, the ``nodes`` best kept.

How the candidates were chosen decides the acceptance rule (``TreeShape.select``):

- ``"top"`` (and every dynamic tree): the candidates are the proposer's most probable tokens, a choice that
  does not depend on the target's randomness. :func:`accept_tree` draws one token from ``p`` at each node on
  the walk; a child holding that token is accepted. Exact at any temperature, whatever the candidates.
- ``"sample"`` / ``"sample_distinct"``: each node's children are drawn from ``q`` (with, or without
  replacement); SpecInfer's multi-round speculative sampling (with the RSD correction without replacement).

Verification: :func:`verify_mask` gives the target pass each node at position ``length + depth``, attending
to the cache and to its own ancestors (:class:`TreeMask`); :func:`compact` moves the accepted path's keys and
values to consecutive cache positions, the tree form of "rejected positions are not counted".
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache import KVCache
from specjax.config import MAX_K, check_int
from specjax.sampling import first_argmax, sample, split_keys, uniform

SELECTS = ("top", "sample", "sample_distinct")
MAX_RANKS = 8  # sibling ranks the statistics tell apart (higher ranks are counted in the last bin)


# ------------------------------------------------------------------------------------------- specs


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """A fixed tree: every node of depth ``d`` (the root has depth 0) has ``branching[d]`` children.

  Attributes:
    branching: children per node at each depth, e.g. ``(4, 2, 2, 1)``; its length is the tree's depth.
    max_nodes: keep only this many nodes (the ones whose sibling ranks sum lowest, shallower first); None
      keeps the whole cartesian tree. At most :data:`specjax.config.MAX_K` nodes in all.
    select: how the children are chosen: ``"top"`` (the proposer's most probable tokens), ``"sample"``
      (drawn from the proposer's distribution, with replacement) or ``"sample_distinct"`` (without).
    keep: None, or exactly the nodes to keep, as rank paths (``(0, 1)``: the second choice under the first
      choice), closed under parents (:meth:`from_paths`; the cost model's :func:`specjax.costmodel.best_tree`
      builds such trees). ``branching`` must then cover them and ``max_nodes`` stays None.
  """

  branching: tuple[int, ...]
  max_nodes: int | None = None
  select: Literal["top", "sample", "sample_distinct"] = "top"
  keep: tuple[tuple[int, ...], ...] | None = None

  @classmethod
  def from_paths(cls, paths, select: str = "top") -> TreeShape:
    """The tree of exactly ``paths`` (rank paths, each one's parent among them)."""
    paths = tuple(tuple(int(r) for r in p) for p in paths)
    if not paths or not all(paths):
      raise ValueError(f"TreeShape.keep must be a non-empty sequence of non-empty rank paths, got {paths!r}")
    depth = max(map(len, paths))
    branching = tuple(1 + max([p[d] for p in paths if len(p) > d], default=0) for d in range(depth))
    return cls(branching, select=select, keep=tuple(sorted(set(paths), key=lambda p: (len(p), p))))

  def __post_init__(self):
    branching = tuple(self.branching) if isinstance(self.branching, (tuple, list)) else None
    if not branching:
      raise ValueError(f"TreeShape.branching must be a non-empty sequence of integers >= 1, got {self.branching!r}")
    for i, b in enumerate(branching):
      check_int(f"TreeShape.branching[{i}]", b, 1, MAX_K)
    object.__setattr__(self, "branching", tuple(int(b) for b in branching))
    if self.max_nodes is not None:
      check_int("TreeShape.max_nodes", self.max_nodes, 1, MAX_K)
    if self.keep is not None:
      self._check_keep()
    full = self._full_nodes()
    if self.max_nodes is None and self.keep is None and len(full) > MAX_K:
      raise ValueError(f"TreeShape{self.branching} has {len(full)} nodes, more than the maximum {MAX_K}: "
                       f"set max_nodes (<= {MAX_K}) to prune it")
    if self.select not in SELECTS:
      raise ValueError(f"TreeShape.select must be one of {SELECTS}, got {self.select!r}")

  def _check_keep(self) -> None:
    keep = set(self.keep)
    if self.max_nodes is not None:
      raise ValueError("TreeShape: give either keep (the exact nodes) or max_nodes, not both")
    if len(keep) > MAX_K:
      raise ValueError(f"TreeShape.keep has {len(keep)} nodes, more than the maximum {MAX_K}")
    for p in keep:
      if not p or any(not 0 <= r < b for r, b in zip(p, self.branching)) or len(p) > len(self.branching):
        raise ValueError(f"TreeShape.keep: path {p!r} is not a node of branching {self.branching}")
      if len(p) > 1 and p[:-1] not in keep:
        raise ValueError(f"TreeShape.keep: path {p!r} is kept but its parent {p[:-1]!r} is not")
    if max(map(len, keep)) != len(self.branching):
      raise ValueError(f"TreeShape.keep reaches depth {max(map(len, keep))}, branching has {len(self.branching)}")

  def _full_nodes(self) -> list[tuple[int, ...]]:
    """Every node of the cartesian tree as its path of sibling ranks, parents first."""
    nodes, level = [], [()]
    for b in self.branching:
      level = [path + (r,) for path in level for r in range(b)]
      nodes += level
      if len(nodes) > 4096:  # only the best few are kept; the tail of a huge tree cannot be among them
        break
    return nodes

  def paths(self) -> list[tuple[int, ...]]:
    """The kept nodes as rank paths, in slot order (1..N): by rank sum, then depth, then lexicographically,
    which keeps every ancestor of a kept node (its rank sum and depth are both smaller)."""
    if self.keep is not None:
      return sorted(self.keep, key=lambda p: (len(p), p))
    nodes = sorted(self._full_nodes(), key=lambda p: (sum(p), len(p), p))
    nodes = nodes[:self.max_nodes] if self.max_nodes is not None else nodes
    return sorted(nodes, key=lambda p: (len(p), p))  # breadth first: parents before children

  @property
  def nodes(self) -> int:
    return len(self.paths())

  @property
  def depth(self) -> int:
    return max(len(p) for p in self.paths())

  def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``parents``, ``depths`` and ``ranks``, each ``[N + 1] int32`` (slot 0 the root, its parent -1)."""
    paths = self.paths()
    slot = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
    parents = np.array([-1] + [slot[p[:-1]] for p in paths], np.int32)
    depths = np.array([0] + [len(p) for p in paths], np.int32)
    ranks = np.array([0] + [p[-1] for p in paths], np.int32)
    return parents, depths, ranks

  def describe(self) -> str:
    if self.keep is not None:
      return "paths:" + "|".join(".".join(map(str, p)) for p in self.paths()) + (
          f" ({self.select})" if self.select != "top" else "")
    text = "-".join(map(str, self.branching))
    return text + (f"/{self.max_nodes}" if self.max_nodes is not None else "") + (
        f" ({self.select})" if self.select != "top" else "")


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """EAGLE-2's dynamic tree: ``depth`` levels, the ``top_k`` frontier nodes of highest cumulative
  log-probability expanded ``top_k`` children each per level, the ``nodes`` best candidates kept."""

  top_k: int = 4
  depth: int = 4
  nodes: int = 16

  select = "top"

  def __post_init__(self):
    check_int("DynamicTree.top_k", self.top_k, 1, MAX_K)
    check_int("DynamicTree.depth", self.depth, 1, MAX_K)
    check_int("DynamicTree.nodes", self.nodes, 1, MAX_K)
    if self.top_k * (self.depth - 1) > MAX_K:
      raise ValueError(f"DynamicTree: top_k * (depth - 1) = {self.top_k * (self.depth - 1)} frontier entries "
                       f"exceed the maximum {MAX_K}")
    candidates = self.top_k + (self.depth - 1) * self.top_k**2
    if self.nodes > candidates:
      raise ValueError(f"DynamicTree.nodes ({self.nodes}) exceeds the {candidates} candidates that top_k="
                       f"{self.top_k} and depth={self.depth} produce")

  def describe(self) -> str:
    return f"dynamic K={self.top_k} D={self.depth} N={self.nodes}"


TreeSpec = TreeShape | DynamicTree


def parse_tree(text: str) -> TreeSpec:
  """The command line's ``--tree``: ``dynamic`` or ``dynamic:K,D,N``, a shape ``4-2-2-1`` optionally
  pruned (``4-2-2-1/16``) and sampled (``4-2-2-1:sample``, ``:sample_distinct``), or explicit rank paths
  ``paths:0|1|0.0`` (what :meth:`TreeShape.describe` prints for such a tree, e.g. one ``k="auto"`` chose)."""
  text = text.strip()
  if text.startswith("paths:"):
    try:
      paths = [tuple(int(r) for r in p.split(".")) for p in text[len("paths:"):].split("|")]
    except ValueError:
      raise ValueError(f"--tree paths:... takes rank paths such as 'paths:0|1|0.0' (each node's sibling ranks from "
                       f"the root, '.'-separated; nodes '|'-separated), got {text!r}") from None
    return TreeShape.from_paths(paths)
  if text == "dynamic" or text.startswith("dynamic:"):
    if text == "dynamic":
      return DynamicTree()
    try:
      k, d, n = (int(x) for x in text.split(":", 1)[1].split(","))
    except ValueError:
      raise ValueError(f"--tree dynamic:K,D,N takes three integers, got {text!r}") from None
    return DynamicTree(top_k=k, depth=d, nodes=n)
  shape, _, select = text.partition(":")
  shape, _, nodes = shape.partition("/")
  try:
    branching = tuple(int(x) for x in shape.split("-"))
    max_nodes = int(nodes) if nodes else None
  except ValueError:
    raise ValueError(f"--tree takes 'dynamic', 'dynamic:K,D,N', a shape such as '4-2-2-1', '4-2-2-1/16' "
                     f"or '4-2:sample', or rank paths such as 'paths:0|1|0.0', got {text!r}") from None
  return TreeShape(branching, max_nodes, select or "top")


# ------------------------------------------------------------------------------------------- trees


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
  """One tree per row, ``[B, N + 1]`` each (slot 0: the root; see the module docstring).

  Attributes:
    tokens: ``int32`` the token of each slot (the root's is ``last``).
    parents: ``int32`` each slot's parent slot (smaller than the slot; -1 for the root).
    depths: ``int32`` 0 for the root.
    ranks: ``int32`` rank among the siblings in the proposer's order (0: its first choice).
    valid: ``bool`` the slot holds a node (invalid slots are never accepted).
  """

  tokens: jax.Array
  parents: jax.Array
  depths: jax.Array
  ranks: jax.Array
  valid: jax.Array

  @property
  def slots(self) -> int:
    return self.tokens.shape[1]


def ancestors(parents: jax.Array, depth: int) -> jax.Array:
  """``anc [B, S, S] bool``: ``anc[b, i, j]`` iff slot j is slot i or one of its ancestors (``depth``: the
  tree's static depth bound)."""
  b, s = parents.shape
  anc = jnp.broadcast_to(jnp.eye(s, dtype=bool), (b, s, s))
  cur = jnp.broadcast_to(jnp.arange(s)[None, :], (b, s))
  for _ in range(depth):
    cur = jnp.where(cur > 0, jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1), -1)  # one level up
    anc = anc | jax.nn.one_hot(cur, s, dtype=bool)  # one_hot(-1) is all False
  return anc


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeMask:
  """What a model pass needs to score tree nodes instead of a chain.

  The pass writes its ``T`` tokens at cache indices ``lengths .. lengths + T - 1`` as always, but token t sits
  at position ``positions[b, t]``, and sees the cache entries ``< start`` (the context, masked by position as
  usual) and the entries ``start + w`` (``w < W``, the tree's region) where ``visible[b, t, w]``; entries at or
  past ``start + W`` are not visible. A target's verify pass has ``start = lengths`` and ``W = T``; a head
  growing its own tree reads a region written over several steps.

  Attributes:
    positions: ``[B, T] int32``; start: ``[B] int32``; visible: ``[B, T, W] bool``;
    entry_positions: ``[B, W] int32`` the positions of the region's entries (sliding windows read them).
  """

  positions: jax.Array
  start: jax.Array
  visible: jax.Array
  entry_positions: jax.Array


def visibility(positions: jax.Array, cache_len: int, tree: TreeMask | None = None, window: int | None = None,
               first: int = 0) -> jax.Array:
  """``visible [B, T, S]``: which cache entries each query of a pass sees. Without a tree, a query at position
  p sees the entries at positions ``<= p`` (and ``> p - window`` with a sliding window, ``>= first`` always);
  with one, as :class:`TreeMask` says."""
  s = jnp.arange(cache_len)[None, None, :]  # [1, 1, S]
  if tree is None:
    entry_pos, allowed = s, True
  else:
    w = tree.visible.shape[-1]
    rel = s - tree.start[:, None, None]  # [B, 1, S]
    region = (rel >= 0) & (rel < w)
    idx = jnp.clip(rel, 0, w - 1)
    entry_pos = jnp.where(region, jnp.take_along_axis(tree.entry_positions[:, None, :], idx, axis=2), s)
    in_tree = jnp.take_along_axis(tree.visible, jnp.broadcast_to(idx, tree.visible.shape[:2] + (cache_len,)), axis=2)
    allowed = jnp.where(region, in_tree, rel < 0)
  q = positions[:, :, None]
  visible = (entry_pos <= q) & allowed
  if window is not None:
    visible &= entry_pos > q - window
  if first:
    visible &= s >= first
  return visible


def pending_visibility(positions: jax.Array, offsets: jax.Array, cache_len: int, window: int | None = None,
                       first: int = 0) -> tuple[jax.Array, jax.Array]:
  """What each query of a chain pass sees when the pass's own keys stay out of the cache
  (``forward_pending``): ``(cache [B, T, S], own [B, T, T])``, the cache entries before the row's
  ``offsets [B]`` and the pass's tokens up to its own, with :func:`visibility`'s window and ``first`` rules.
  Together they are :func:`visibility` of the pass that writes first and attends after."""
  before = jnp.arange(cache_len)[None, None, :] < offsets[:, None, None]
  key, query = positions[:, None, :], positions[:, :, None]  # [B, 1, T], [B, T, 1]
  own = key <= query
  if window is not None:
    own &= key > query - window
  if first:
    own &= key >= first
  return visibility(positions, cache_len, None, window, first) & before, own


def path_slots(tree: TreeMask) -> jax.Array:
  """``[B, T, T] int32``: for each node of a verify pass (``W = T``), the pass's slots of its path by depth
  (entry ``j``: its ancestor at depth ``j``, itself at its own depth), then the other slots in slot order (never
  visible to it: a one-token step's mask hides every entry past its own). Where the one-token steps that decode
  a node's path keep its keys and values (:func:`specjax.models.llama.attend_along_paths`)."""
  t = tree.visible.shape[-1]
  depths = tree.entry_positions - tree.start[:, None]  # [B, T]
  key = jnp.where(tree.visible, depths[:, None, :], t + jnp.arange(t)[None, None, :])  # [B, T, T]
  return jnp.argsort(key, axis=-1).astype(jnp.int32)


def verify_mask(tree: Tree, lengths: jax.Array, depth: int) -> TreeMask:
  """The target's :class:`TreeMask` for scoring ``tree.tokens`` written at ``lengths``: node i at position
  ``lengths + depth_i``, seeing its ancestors and itself."""
  positions = lengths[:, None] + tree.depths
  return TreeMask(positions=positions, start=lengths, visible=ancestors(tree.parents, depth),
                  entry_positions=positions)


def node_counts(tree: Tree, vocab: int, depth: int) -> jax.Array:
  """``[B, N + 1, V] int32``: per node, how often each token occurs on its path from the root's child down to
  the node itself (what a penalty at the node's children counts besides the row's output)."""
  anc = ancestors(tree.parents, depth) & (jnp.arange(tree.slots) > 0)[None, None, :]
  return jnp.einsum("bij,bjv->biv", anc.astype(jnp.int32), jax.nn.one_hot(tree.tokens, vocab, dtype=jnp.int32))


# ---------------------------------------------------------------------------------------- acceptance


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeOutcome:
  """What :func:`accept_tree` decides, per row.

  Attributes:
    path: ``[B, D + 1] int32`` the accepted path's slots (``path[:, 0] = 0``; entries past ``n`` repeat the
      last accepted slot).
    n: ``[B] int32`` accepted nodes (the depth of the last one).
    token: ``[B] int32`` the token drawn after them.
  """

  path: jax.Array
  n: jax.Array
  token: jax.Array


def accept_tree(p: jax.Array, tree: Tree, keys: jax.Array, *, depth: int, select: str, greedy: bool,
                q: jax.Array | None = None) -> TreeOutcome:
  """Walks each row's tree from the root, as ``ALGORITHMS.md`` ("Token trees") states the rules.

  Args:
    p: ``[B, N + 1, V]`` the target's warped distribution at each slot (its next-token distribution after
      the path to the slot).
    tree: the rows' :class:`Tree`. keys: row keys ``[B]``. depth: static depth bound.
    select: static, how the children were chosen (:data:`SELECTS`): ``"top"``: one draw ``y ~ p`` per
      visited node (the argmax when ``greedy``); the first child holding ``y`` is accepted, else ``y`` ends
      the round. ``"sample"``/``"sample_distinct"``: multi-round speculative sampling over the node's
      children in slot order, ``q [B, N + 1, V]`` being the distribution each slot's children were drawn
      from (without replacement: each sibling from ``q`` with the earlier siblings removed).
    greedy: static; ``p`` is one-hot (temperature 0) and no random numbers are drawn.

  Returns:
    The :class:`TreeOutcome`. Invariant: the emitted tokens (the path's tokens, then ``token``) follow ``p``
    along the path exactly.
  """
  if select not in SELECTS:
    raise ValueError(f"select must be one of {SELECTS}, got {select!r}")
  b, s, v = p.shape
  rows = jnp.arange(b)
  path0 = jnp.zeros((b, depth + 1), jnp.int32)
  u_key, s_key = split_keys(keys, 2)  # the tests' uniforms, and the draws from p or the residual
  if select == "top" or greedy:
    # One draw per slot from p (Gumbel-max in sample): the walk reads the draws of the slots it visits.
    y = first_argmax(p) if greedy else sample(p, s_key)  # [B, N + 1]

    def step(carry, j):
      cur, path = carry
      hit = tree.valid[:, j] & (tree.parents[:, j] == cur) & (tree.tokens[:, j] == y[rows, cur])
      path = jnp.where(hit[:, None] & (jnp.arange(depth + 1)[None, :] == tree.depths[:, j][:, None]), j, path)
      return (jnp.where(hit, j, cur), path), None

    (cur, path), _ = jax.lax.scan(step, (jnp.zeros((b,), jnp.int32), path0), jnp.arange(1, s))
    n = tree.depths[rows, cur]
    return TreeOutcome(path=_fill_path(path, n), n=n, token=y[rows, cur])

  if q is None:
    raise ValueError(f"select={select!r} needs q, the distributions the children were drawn from")
  u = uniform(u_key, (b, s))  # one uniform per slot: the test of the slot's own token

  def step(carry, j):
    cur, path, r, qm = carry  # r: the residual target law at cur; qm: the law the next sibling came from
    cand = tree.valid[:, j] & (tree.parents[:, j] == cur)
    tok = tree.tokens[:, j]
    r_t, q_t = r[rows, tok], qm[rows, tok]
    ok = cand & (u[:, j] * q_t < r_t)
    reject = cand & ~ok
    new_r = _normalize(jnp.maximum(r - qm, 0.0), r)
    new_q = qm
    if select == "sample_distinct":
      removed = qm.at[rows, tok].set(0.0)
      new_q = _normalize(removed, removed)
      # Rejected: the next sibling came from q without this one; the residual is taken against q as it was.
    p_j, q_j = p[:, j], q[:, j]
    cur = jnp.where(ok, j, cur)
    r = jnp.where(ok[:, None], p_j, jnp.where(reject[:, None], new_r, r))
    qm = jnp.where(ok[:, None], q_j, jnp.where(reject[:, None], new_q, qm))
    path = jnp.where(ok[:, None] & (jnp.arange(depth + 1)[None, :] == tree.depths[:, j][:, None]), j, path)
    return (cur, path, r, qm), None

  init = (jnp.zeros((b,), jnp.int32), path0, p[:, 0], q[:, 0])
  (cur, path, r, _), _ = jax.lax.scan(step, init, jnp.arange(1, s))
  n = tree.depths[rows, cur]
  return TreeOutcome(path=_fill_path(path, n), n=n, token=sample(r, s_key))


def offered_ranks(tree: Tree, path: jax.Array, n: jax.Array, depth: int, max_ranks: int) -> jax.Array:
  """``[B, D, max_ranks] bool``: whether the node the walk reached at depth i (``path[:, i]``, for ``i <= n``)
  had a child of sibling rank r (ranks past the last counted in the last bin). With the top-choice rule a
  child of rank r is accepted with probability P(y = the proposer's r-th choice), whatever its siblings, so
  accepted / offered per (depth, rank) estimates that probability from any tree (the cost model's input)."""
  reached = path[:, :depth]  # [B, D]
  child = (tree.parents[:, None, :] == reached[:, :, None]) & tree.valid[:, None, :]  # [B, D, S]
  child = child & (jnp.arange(tree.slots) > 0)[None, None, :]
  rank = jax.nn.one_hot(jnp.minimum(tree.ranks, max_ranks - 1), max_ranks, dtype=jnp.int32)  # [B, S, R]
  has = jnp.einsum("bds,bsr->bdr", child.astype(jnp.int32), rank) > 0
  return has & (jnp.arange(depth)[None, :] <= n[:, None])[..., None]


def _normalize(x: jax.Array, fallback: jax.Array) -> jax.Array:
  """``x / sum(x)`` on the last axis; ``fallback`` (normalised) where ``x`` has no mass."""
  total = jnp.sum(x, axis=-1, keepdims=True)
  fb = fallback / jnp.maximum(jnp.sum(fallback, axis=-1, keepdims=True), 1e-30)
  return jnp.where(total > 0.0, x / jnp.where(total > 0.0, total, 1.0), fb)


def _fill_path(path: jax.Array, n: jax.Array) -> jax.Array:
  """Entries past ``n`` repeat the slot at ``n`` (so gathers along the path stay inside the tree)."""
  last = jnp.take_along_axis(path, n[:, None], axis=1)
  return jnp.where(jnp.arange(path.shape[1])[None, :] <= n[:, None], path, last)


# ------------------------------------------------------------------------------------------- caches


def compact(cache: KVCache, start: jax.Array, path: jax.Array, slots: int) -> KVCache:
  """The cache with the entries of slots ``path [B, D + 1]`` of a tree of ``slots`` slots (written at
  ``start [B]`` by one pass) moved to ``start .. start + D``; lengths unchanged. Slot 0 (the root) is
  already at ``start``. Callers keep ``start + slots <= max_len``."""

  def move(buf):
    def one(row, s, idx):
      window = jax.lax.dynamic_slice_in_dim(row, s, slots, axis=0)
      return jax.lax.dynamic_update_slice_in_dim(row, window[idx], s, axis=0)
    return jax.vmap(one)(buf, start, path)

  return dataclasses.replace(cache, k=tuple(move(x) for x in cache.k), v=tuple(move(x) for x in cache.v))


# ------------------------------------------------------------------------------------------ building


def fixed_arrays(shape: TreeShape, batch: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A shape's ``parents``, ``depths``, ``ranks`` broadcast to ``[B, N + 1]``."""
  return tuple(jnp.broadcast_to(jnp.asarray(a)[None], (batch, a.shape[0])) for a in shape.arrays())


def frontier_sizes(spec: TreeSpec) -> list[int]:
  """The number of nodes a proposer expands at each level ``1..D`` (level 1: the root alone)."""
  if isinstance(spec, DynamicTree):
    return [1] + [spec.top_k] * (spec.depth - 1)
  _, depths, _ = spec.arrays()
  return [int(np.sum(depths == d)) for d in range(spec.depth)]


def tree_window(spec: TreeSpec) -> int:
  """The cache entries a round with tree ``spec`` may write from a row's length: the root and its N nodes in
  the target's cache, and the frontier entries (``1 + top_k * (depth - 1)`` for a dynamic tree, which may
  exceed N + 1) in a draft model's or a head's cache."""
  return max(spec.nodes + 1, sum(frontier_sizes(spec)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Frontier:
  """The nodes a proposer expands at one level, ``[B, F]``.

  Attributes:
    tokens: their tokens (level 1: the root's, ``last``).
    parent: the index of each node's parent in the previous level's frontier (level 1: 0).
  """

  tokens: jax.Array
  parent: jax.Array


def grow(spec: TreeSpec, last: jax.Array, expand, carry, sampler, keys: jax.Array
         ) -> tuple[Tree, jax.Array | None, object]:
  """Builds each row's tree level by level (the one builder of every proposer that proposes trees).

  Args:
    spec: the :class:`TreeShape` or :class:`DynamicTree`.
    last: ``[B]`` the root tokens.
    expand: ``expand(level, frontier, carry) -> (logits [B, F, V], carry)``: the proposer's logits for the
      children of each frontier node (level 1: the root), from its own state ``carry``.
    sampler: the round's :class:`~specjax.sampling.Sampler` (sampled selections warp with it, each node
      counting its own path). keys: row keys ``[B]``.

  Returns:
    The :class:`Tree`, ``q [B, N + 1, V]`` (the law each slot's children were drawn from; None for
    ``select="top"``), and the final ``carry``.
  """
  batch = last.shape[0]
  frontier = Frontier(tokens=last[:, None], parent=jnp.zeros((batch, 1), jnp.int32))
  if isinstance(spec, DynamicTree):
    return _grow_dynamic(spec, last, frontier, expand, carry)
  parents, depths, ranks = spec.arrays()
  slots = parents.shape[0]
  paths = [()] + spec.paths()
  slot_of = {p: i for i, p in enumerate(paths)}
  tokens = jnp.zeros((batch, slots), jnp.int32).at[:, 0].set(last)
  valid = jnp.ones((batch, slots), bool)
  q_tree, counts = None, None
  sampled = spec.select != "top"
  vocab = None
  level_keys = split_keys(keys, spec.depth)
  for level in range(1, spec.depth + 1):
    front = [i for i in range(slots) if depths[i] == level - 1]
    logits, carry = expand(level, frontier, carry)  # [B, F, V]
    vocab = logits.shape[-1]
    b = spec.branching[level - 1]
    if not sampled:
      kids = jax.lax.top_k(logits, b)[1].astype(jnp.int32)  # [B, F, b] the proposer's first choices in order
      kid_ok = jnp.ones(kids.shape, bool)
    else:
      if counts is None:
        counts = jnp.zeros((batch, 1, vocab), jnp.int32) if sampler.counts_tokens else None
      q = sampler.warp_nodes(logits, counts)  # [B, F, V]
      if q_tree is None:
        q_tree = jnp.zeros((batch, slots, vocab), jnp.float32)
      q_tree = q_tree.at[:, jnp.asarray(front)].set(q)
      if spec.select == "sample":
        kids = sample(jnp.broadcast_to(q[:, :, None], q.shape[:2] + (b, vocab)), level_keys[level - 1])
        kid_ok = jnp.ones(kids.shape, bool)
      else:  # without replacement: Gumbel-top-b is b sequential draws, each without the earlier ones
        g = jax.vmap(lambda k: jax.random.gumbel(k, q.shape[1:], jnp.float32))(level_keys[level - 1])
        kids = jax.lax.top_k(jnp.log(q) + g, b)[1].astype(jnp.int32)
        kid_ok = jnp.take_along_axis(q, kids, axis=-1) > 0.0  # fewer tokens with mass than children
    # Scatter the children into their static slots (pruned ones have none).
    dest, src_f, src_r = [], [], []
    for fi, f in enumerate(front):
      for r in range(b):
        child = slot_of.get(paths[f] + (r,))
        if child is not None:
          dest.append(child), src_f.append(fi), src_r.append(r)
    if not dest:
      break
    dest, src_f, src_r = (np.asarray(x) for x in (dest, src_f, src_r))
    tokens = tokens.at[:, dest].set(kids[:, src_f, src_r])
    valid = valid.at[:, dest].set(kid_ok[:, src_f, src_r] & valid[:, parents[dest]])
    if level == spec.depth:
      break
    nxt = [i for i in range(slots) if depths[i] == level]
    parent_index = np.asarray([front.index(int(parents[i])) for i in nxt], np.int32)
    frontier = Frontier(tokens=tokens[:, np.asarray(nxt)],
                        parent=jnp.broadcast_to(jnp.asarray(parent_index)[None], (batch, len(nxt))))
    if counts is not None:
      counts = counts[:, parent_index] + jax.nn.one_hot(frontier.tokens, vocab, dtype=jnp.int32)
  b_parents, b_depths, b_ranks = fixed_arrays(spec, batch)
  tree = Tree(tokens=tokens, parents=b_parents, depths=b_depths, ranks=b_ranks, valid=valid)
  return tree, q_tree, carry


def _grow_dynamic(spec: DynamicTree, last, frontier: Frontier, expand, carry):
  """EAGLE-2: expand the ``top_k`` likeliest frontier nodes (by cumulative log-probability under the
  proposer's own, unwarped distribution) ``top_k`` children each, for ``depth`` levels; keep the ``nodes``
  likeliest candidates (a child's cumulative probability never exceeds its parent's, and ``top_k`` breaks
  ties towards the earlier candidate, the parent, so the kept set is a tree)."""
  batch, k = last.shape[0], spec.top_k
  cum = jnp.zeros((batch, 1), jnp.float32)
  glob = jnp.full((batch, 1), -1, jnp.int32)  # the frontier's candidate indices (-1: the root)
  c_tok, c_par, c_cum, c_dep, c_rank = [], [], [], [], []
  count = 0
  for level in range(1, spec.depth + 1):
    logits, carry = expand(level, frontier, carry)  # [B, F, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp, tok = jax.lax.top_k(logp, k)  # [B, F, K]
    f = lp.shape[1]
    new_cum = (cum[:, :, None] + lp).reshape(batch, f * k)
    c_tok.append(tok.reshape(batch, f * k).astype(jnp.int32))
    c_par.append(jnp.repeat(glob, k, axis=1))
    c_cum.append(new_cum)
    c_dep.append(jnp.full((batch, f * k), level, jnp.int32))
    c_rank.append(jnp.tile(jnp.arange(k, dtype=jnp.int32), (batch, f)))
    if level < spec.depth:
      cum, pick = jax.lax.top_k(new_cum, k)  # [B, K] the next frontier
      glob = count + pick.astype(jnp.int32)
      frontier = Frontier(tokens=jnp.take_along_axis(c_tok[-1], pick, axis=1), parent=(pick // k).astype(jnp.int32))
    count += f * k
  tok, par, cum_all, dep, rank = (jnp.concatenate(x, axis=1) for x in (c_tok, c_par, c_cum, c_dep, c_rank))
  _, keep = jax.lax.top_k(jnp.where(jnp.isnan(cum_all), -jnp.inf, cum_all), spec.nodes)
  keep = jnp.sort(keep, axis=1)  # candidate order is topological (parents were created first)
  rows = jnp.arange(batch)[:, None]
  slot_of = jnp.full((batch, count), -1, jnp.int32).at[rows, keep].set(jnp.arange(1, spec.nodes + 1, dtype=jnp.int32))
  kp = jnp.take_along_axis(par, keep, axis=1)
  parents = jnp.where(kp < 0, 0, jnp.take_along_axis(slot_of, jnp.maximum(kp, 0), axis=1))  # -1: parent not kept
  valid = parents >= 0
  parents = jnp.maximum(parents, 0)
  tokens = jnp.concatenate([last[:, None], jnp.take_along_axis(tok, keep, axis=1)], axis=1)
  parents = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), parents], axis=1)
  valid = jnp.concatenate([jnp.ones((batch, 1), bool), valid], axis=1)
  for _ in range(spec.depth):  # a node is valid when its whole path is kept
    valid = valid & jnp.take_along_axis(valid, jnp.maximum(parents, 0), axis=1)
  depths = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.take_along_axis(dep, keep, axis=1)], axis=1)
  ranks = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.take_along_axis(rank, keep, axis=1)], axis=1)
  return Tree(tokens=tokens, parents=parents, depths=depths, ranks=ranks, valid=valid), None, carry
