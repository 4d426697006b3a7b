"""Tree acceptance (:func:`specjax.tree.accept_tree`) keeps the target's law (``ALGORITHMS.md``, "Token trees").

The target and the proposer are tables indexed by the path of tokens (a real model's distribution at a slot
depends on the slot's path only, so two slots with the same path hold the same ``p``). Each row's tree is
drawn by the test itself, from its own numpy generator: the proposer's top tokens (``"top"``), i.i.d. draws
from ``q`` (``"sample"``) or draws without replacement (``"sample_distinct"``, Gumbel-top-k). The emitted
tokens are checked level by level: the first against ``p`` at the root, the ``L + 1``-th, among the rows
that accepted ``L`` nodes, against ``p`` after the ``L`` accepted tokens (chi-square). A numpy
re-implementation of the walk passes the same tests and fails them with one line changed (the power of the
test); greedy walks are checked against a pure-Python reference, and a one-child-per-node tree against the
chain rule :func:`specjax.accept` and the exact law of the emitted sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

import specjax
from specjax.sampling import row_keys
from specjax.tree import Tree, TreeShape, accept_tree, fixed_arrays

V = 6  # vocabulary
B = 60_000  # rows per statistical run, all in one call
SHAPE = (3, 2)  # the statistical runs' tree: 3 children at the root, 2 below each
SELECTS = ("top", "sample", "sample_distinct")  # how the test draws the children (draw_trees)
PASS_P = 1e-3  # 27 level checks at fixed seeds: a correct rule fails any one with probability 1e-3
FAIL_P = 1e-6

run_tree = jax.jit(accept_tree, static_argnames=("depth", "select", "greedy"))


# ------------------------------------------------------------------------------------------ laws


def table_size(depth: int) -> int:
  """Paths of at most ``depth`` tokens, indexed as a complete V-ary tree: the root (empty path) is 0 and the
  path ``prefix + (t,)`` is ``index(prefix) * V + t + 1``."""
  return sum(V**d for d in range(depth + 1))


def child_index(parent: np.ndarray, token: np.ndarray) -> np.ndarray:
  return parent * V + token + 1


def path_law(rng: np.random.Generator, depth: int, kind: str) -> np.ndarray:
  """``[table_size(depth), V]`` float64: one distribution per path. ``kind``: ``"dense"`` (Dirichlet),
  ``"top3"`` (zero outside each row's 3 likeliest tokens, as top-k filtering leaves it) or ``"no45"`` (zero on
  tokens 4 and 5, as a proposer over a reduced vocabulary)."""
  law = rng.dirichlet(np.full(V, 0.8), size=table_size(depth))
  if kind == "top3":
    kth = np.sort(law, axis=-1)[:, -3][:, None]
    law = np.where(law >= kth, law, 0.0)
  elif kind == "no45":
    law[:, 4:] = 0.0
  else:
    assert kind == "dense", kind
  return law / law.sum(-1, keepdims=True)


# (p kind, q kind): random p and q; p sparse as after top-k (candidates of zero target probability); q zero where
# p is not (mass that only the residual can give).
CASES = {"dense": ("dense", "dense"), "sparse_p": ("top3", "dense"), "sparse_q": ("dense", "no45")}


def laws(case: str, depth: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng([seed, list(CASES).index(case)])
  p_kind, q_kind = CASES[case]
  return path_law(rng, depth, p_kind), path_law(rng, depth, q_kind)


def draw_trees(select: str, shape: TreeShape, q_law: np.ndarray, rng: np.random.Generator, batch: int):
  """Each row's tree tokens (``[B, S]``, the root's token 0) and each slot's path index (``[B, S]``), the
  children of a slot chosen from ``q`` at the slot by ``select`` (sibling ``r`` is the one of rank ``r``)."""
  parents, _, ranks = shape.arrays()
  s = len(parents)
  tokens = np.zeros((batch, s), np.int64)
  index = np.zeros((batch, s), np.int64)
  # Gumbel-top-k: the order of log q + one noise vector per parent slot (shared by its children) is a draw
  # without replacement, sibling of rank r the r-th.
  noise = rng.gumbel(size=(batch, s, V)) if select == "sample_distinct" else None
  with np.errstate(divide="ignore"):
    for j in range(1, s):
      par = parents[j]
      qd = q_law[index[:, par]]  # [B, V]
      if select == "top":
        tok = np.argsort(-qd, axis=-1, kind="stable")[:, ranks[j]]
      elif select == "sample":
        cdf = np.cumsum(qd, axis=-1)
        cdf /= cdf[:, -1:]  # exactly 1 from the last token of positive q on: zero-q tokens are never drawn
        tok = (cdf <= rng.random(batch)[:, None]).sum(-1)
      else:
        tok = np.argsort(-(np.log(qd) + noise[:, par]), axis=-1, kind="stable")[:, ranks[j]]
      tokens[:, j] = tok
      index[:, j] = child_index(index[:, par], tok)
  return tokens, index


def make_tree(shape: TreeShape, tokens: np.ndarray, valid: np.ndarray | None = None) -> Tree:
  batch = tokens.shape[0]
  parents, depths, ranks = fixed_arrays(shape, batch)
  valid = np.ones(tokens.shape, bool) if valid is None else valid
  return Tree(tokens=jnp.asarray(tokens, jnp.int32), parents=parents, depths=depths, ranks=ranks,
              valid=jnp.asarray(valid))


# ------------------------------------------------------------------------------------- statistics


def pearson(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
  """Pearson's statistic and degrees of freedom of ``counts`` against ``probs`` (as ``test_distribution``'s
  ``chi_square_pvalue``: cells expecting fewer than 5 are pooled)."""
  counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
  expected = counts.sum() * probs
  small = expected < 5
  if small.any():
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
  assert np.all(counts[expected == 0] == 0), "a sample landed where the target has zero probability"
  keep = expected > 0
  return float(np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep])), int(keep.sum() - 1)


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
  stat, dof = pearson(counts, probs)
  return float(sps.chi2.sf(stat, dof))


def emitted(tokens: np.ndarray, path: np.ndarray, n: np.ndarray, token: np.ndarray) -> np.ndarray:
  """``[B, D + 1]``: the row's emitted tokens (the path's tokens, then ``token``), -1 past them."""
  depth = path.shape[1] - 1
  rows = np.arange(len(n))[:, None]
  out = tokens[rows, path[:, 1:]]  # [B, D]
  out = np.concatenate([out, np.full((len(n), 1), -1)], axis=1)
  out[np.arange(len(n)), n] = token
  out[np.arange(depth + 1)[None, :] > n[:, None]] = -1
  return out


def level_pvalues(p_law: np.ndarray, index: np.ndarray, path: np.ndarray, n: np.ndarray, out: np.ndarray):
  """One p-value per level L (0..D): among the rows that accepted at least L nodes, the emitted token L given
  the L tokens before it (its path index) against ``p`` at that path; one Pearson test over all the paths
  (independent multinomials given the path counts: the statistics and degrees of freedom add)."""
  rows = np.arange(len(n))
  pvalues = []
  for level in range(path.shape[1]):
    at = n >= level
    prefix = index[rows, path[:, level]][at]
    counts = np.zeros(p_law.shape)
    np.add.at(counts, (prefix, out[at, level]), 1)
    stat, dof = 0.0, 0
    for i in np.flatnonzero(counts.sum(-1)):
      s, d = pearson(counts[i], p_law[i])
      stat, dof = stat + s, dof + d
    assert dof > 0
    pvalues.append(float(sps.chi2.sf(stat, dof)))
  return pvalues


def check_invariants(tree: Tree, path, n, token, vocab: int):
  """path[:, 0] = 0; the path's slot at ``n`` has depth ``n``; each entry up to ``n`` is the parent of the
  next; every accepted slot is valid; entries past ``n`` repeat the slot at ``n``; tokens are in range."""
  path, n, token = np.asarray(path), np.asarray(n), np.asarray(token)
  parents, depths, valid = (np.asarray(a) for a in (tree.parents, tree.depths, tree.valid))
  rows = np.arange(len(n))
  depth = path.shape[1] - 1
  assert np.all(path[:, 0] == 0)
  assert np.all((n >= 0) & (n <= depth))
  np.testing.assert_array_equal(depths[rows, path[rows, n]], n)
  for i in range(depth):
    live = i < n
    np.testing.assert_array_equal(parents[rows, path[:, i + 1]][live], path[live, i])
    assert np.all(valid[rows, path[:, i + 1]][live])
    np.testing.assert_array_equal(path[~live, i + 1], path[rows, n][~live])
  assert np.all((token >= 0) & (token < vocab))


# ------------------------------------------------------------------ reference walk (for the power tests)


def numpy_walk(p, q, tokens, shape: TreeShape, select: str, rng: np.random.Generator, bug: str | None = None):
  """The acceptance rule of ``ALGORITHMS.md`` ("Token trees") in numpy, every row at once, with optional
  deliberate bugs (each one line, marked BUG):

  - ``"shared_noise"`` (``"top"``): one Gumbel noise vector per row shared by every node, instead of one per node;
  - ``"no_residual"`` (``"sample"``/``"sample_distinct"``): a rejected sibling leaves ``r`` as it was, so the
    later siblings are tested against it and the final token is drawn from ``p`` instead of the residual;
  - ``"no_removal"`` (``"sample_distinct"``): the with-replacement rule on distinct siblings (``q`` is not
    renormalised without the rejected ones).

  Returns ``path [B, D + 1]``, ``n [B]``, ``token [B]``."""
  parents, depths, _ = shape.arrays()
  b, s, v = p.shape
  rows = np.arange(b)
  cur = np.zeros(b, np.int64)
  path = np.zeros((b, shape.depth + 1), np.int64)
  with np.errstate(divide="ignore"):
    logp = np.log(p)
  if select == "top":
    noise = rng.gumbel(size=(b, s, v))
    if bug == "shared_noise":
      noise = np.broadcast_to(rng.gumbel(size=(b, 1, v)), (b, s, v))  # BUG: one noise vector for all nodes
    y = np.argmax(logp + noise, axis=-1)  # [B, S]
    for j in range(1, s):
      hit = (parents[j] == cur) & (tokens[:, j] == y[rows, cur])
      cur = np.where(hit, j, cur)
      path[hit, depths[j]] = j
    return _filled(path, depths[cur]), depths[cur], y[rows, cur]
  u = rng.random((b, s))
  r, qm = p[:, 0].copy(), q[:, 0].copy()
  for j in range(1, s):
    cand = parents[j] == cur
    tok = tokens[:, j]
    ok = cand & (u[:, j] * qm[rows, tok] < r[rows, tok])
    reject = cand & ~ok
    resid = np.maximum(r - qm, 0.0)
    total = resid.sum(-1, keepdims=True)
    new_r = np.where(total > 0, resid / np.where(total > 0, total, 1.0), r)
    if bug == "no_residual":
      new_r = r  # BUG: the residual is not updated on rejection
    new_q = qm
    if select == "sample_distinct" and bug != "no_removal":  # BUG when skipped: q keeps the rejected sibling
      new_q = qm.copy()
      new_q[rows, tok] = 0.0
      new_q /= np.maximum(new_q.sum(-1, keepdims=True), 1e-300)
    r = np.where(ok[:, None], p[:, j], np.where(reject[:, None], new_r, r))
    qm = np.where(ok[:, None], q[:, j], np.where(reject[:, None], new_q, qm))
    cur = np.where(ok, j, cur)
    path[ok, depths[j]] = j
  with np.errstate(divide="ignore"):
    final = np.argmax(np.log(r) + rng.gumbel(size=(b, v)), axis=-1)  # Gumbel-max: a draw from r
  return _filled(path, depths[cur]), depths[cur], final


def _filled(path, n):
  last = path[np.arange(len(n)), n]
  return np.where(np.arange(path.shape[1])[None, :] <= n[:, None], path, last[:, None])


# ---------------------------------------------------------------------------------- distribution


def statistical_run(select: str, case: str, walk=None):
  """One big batch of rows at ``SHAPE``: the per-level p-values and the law of ``n``. ``walk``: a numpy rule
  (``numpy_walk``'s signature, less the arrays) instead of ``accept_tree``."""
  shape = TreeShape(SHAPE, select=select)
  p_law, q_law = laws(case, shape.depth)
  seed = [1, SELECTS.index(select), list(CASES).index(case)]
  tokens, index = draw_trees(select, shape, q_law, np.random.default_rng(seed), B)
  p, q = p_law[index].astype(np.float32), q_law[index].astype(np.float32)
  root_kids = np.sort(tokens[:, 1:SHAPE[0] + 1], axis=-1)
  repeats = np.mean(np.any(root_kids[:, 1:] == root_kids[:, :-1], axis=-1))
  assert repeats > 0.1 if select == "sample" else repeats == 0  # duplicate siblings only with replacement
  if walk is None:
    tree = make_tree(shape, tokens)
    res = run_tree(jnp.asarray(p), tree, row_keys(8, B), depth=shape.depth, select=select, greedy=False,
                   q=None if select == "top" else jnp.asarray(q))
    check_invariants(tree, res.path, res.n, res.token, V)
    path, n, token = (np.asarray(x) for x in (res.path, res.n, res.token))
  else:
    path, n, token = walk(p.astype(np.float64), q.astype(np.float64), tokens, shape, select,
                          np.random.default_rng([2] + seed))
  out = emitted(tokens, path, n, token)
  return level_pvalues(p_law, index, path, n, out), np.bincount(n, minlength=shape.depth + 1) / B



@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("select", SELECTS)
def test_emitted_tokens_follow_p_along_the_path(select, case):
  """First token ~ p[root]; given the first L accepted tokens, the next one ~ p after them (every level)."""
  pvalues, n_law = statistical_run(select, case)
  assert np.all(n_law > 0.02), n_law  # rejection at the root, one and two accepted nodes all occur often
  assert min(pvalues) > PASS_P, pvalues


# The numpy rule passes as it is and fails with its one-line bug: the tests above can tell a broken rule.
BUGS = {"top": "shared_noise", "sample": "no_residual", "sample_distinct": "no_removal"}


@pytest.mark.parametrize("select", SELECTS)
def test_reference_walk_passes(select):
  pvalues, _ = statistical_run(select, "sparse_p", walk=numpy_walk)
  assert min(pvalues) > PASS_P, pvalues


@pytest.mark.parametrize("select,bug", [(s, b) for s, b in BUGS.items()] + [("sample_distinct", "no_residual")])
def test_the_test_fails_on_a_broken_rule(select, bug):
  walk = lambda *args: numpy_walk(*args, bug=bug)
  pvalues, _ = statistical_run(select, "sparse_p", walk=walk)
  assert min(pvalues) < FAIL_P, pvalues


# ----------------------------------------------------------------------------------------- chain


def exact_chain_law(p_law, q_law, k: int) -> np.ndarray:
  """The exact law of a k-chain's emitted sequence (by its path index): accepting d_i has probability
  ``min(p_i, q_i)(d_i)`` (drawn from q, kept with min(1, p/q)), a rejection followed by t
  ``max(0, p - q)(t)``, the bonus after k accepted ``p_{k+1}(t)``."""
  law = np.zeros(table_size(k + 1))
  reach = {0: 1.0}  # path index of accepted prefixes -> probability
  for depth in range(k + 1):
    nxt = {}
    for idx, prob in reach.items():
      for t in range(V):
        child = int(child_index(idx, t))
        end = p_law[idx, t] if depth == k else max(p_law[idx, t] - q_law[idx, t], 0.0)
        law[child] += prob * end
        if depth < k:
          nxt[child] = prob * min(p_law[idx, t], q_law[idx, t])
    reach = nxt
  assert abs(law.sum() - 1) < 1e-9
  return law


@pytest.mark.parametrize("case", ["dense", "sparse_p"])
def test_a_chain_tree_is_the_chain_rule(case):
  """TreeShape((1, 1, 1)) with sampled children: the emitted sequence (hence (n, token)) follows the exact law
  of the chain rule, and so does :func:`specjax.accept` on the same drafts."""
  k, batch = 3, 100_000
  shape = TreeShape((1,) * k, select="sample")
  p_law, q_law = laws(case, k)
  tokens, index = draw_trees("sample", shape, q_law, np.random.default_rng([3, k]), batch)
  p, q = jnp.asarray(p_law[index], jnp.float32), jnp.asarray(q_law[index], jnp.float32)
  tree = make_tree(shape, tokens)
  res = run_tree(p, tree, row_keys(11, batch), depth=k, select="sample", greedy=False, q=q)
  check_invariants(tree, res.path, res.n, res.token, V)
  n_chain, tok_chain = jax.jit(specjax.accept)(p, q[:, :k], jnp.asarray(tokens[:, 1:], jnp.int32),
                                               row_keys(12, batch))
  exact = exact_chain_law(p_law, q_law, k)
  straight = lambda n: _filled(np.broadcast_to(np.arange(k + 1), (batch, k + 1)), n)  # slots 0..n, padded
  for path, n, token in [(res.path, res.n, res.token), (None, n_chain, tok_chain)]:
    n, token = np.asarray(n), np.asarray(token)
    path = straight(n) if path is None else np.asarray(path)
    np.testing.assert_array_equal(path, straight(n))
    seq = index[np.arange(batch), path[np.arange(batch), n]]
    seq = child_index(seq, token)
    counts = np.bincount(seq, minlength=len(exact))
    assert np.all(np.bincount(n, minlength=k + 1) > 0.02 * batch)
    assert chi_square_pvalue(counts, exact) > PASS_P


# ---------------------------------------------------------------------------------------- greedy


def greedy_reference(tokens, parents, valid, argmax):
  """One row: from the root, follow the first valid child (in slot order) holding the argmax at the current
  node; emit the path and the argmax at its last node. Returns the slot path and the token."""
  cur, path = 0, [0]
  while True:
    kids = [j for j in range(1, len(tokens)) if parents[j] == cur and valid[j] and tokens[j] == argmax[cur]]
    if not kids:
      return path, argmax[cur]
    cur = kids[0]
    path.append(cur)


def random_trees(rng, batch: int, slots: int):
  """Per-row random topological trees: parents, depths, ranks ``[B, S]`` and the depth bound."""
  parents = np.full((batch, slots), -1, np.int64)
  depths = np.zeros((batch, slots), np.int64)
  ranks = np.zeros((batch, slots), np.int64)
  for j in range(1, slots):
    # Lean towards recent slots so that the trees are deep as well as wide.
    par = np.minimum(rng.integers(0, j, batch), np.maximum(j - 1 - rng.geometric(0.5, batch) + 1, 0))
    parents[:, j] = par
    depths[:, j] = depths[np.arange(batch), par] + 1
    ranks[:, j] = (parents[:, 1:j] == par[:, None]).sum(-1)
  return parents, depths, ranks, int(depths.max())


@pytest.mark.parametrize("layout", ["shape", "random"])
def test_greedy_walk_matches_reference(layout):
  """One-hot p: the emitted sequence is the greedy walk, for every select (greedy draws nothing) and for the
  sampling rule at "top" on the same one-hot p; invalid slots are never accepted even when they match."""
  rng = np.random.default_rng(5 if layout == "shape" else 6)
  batch, v = 400, 3  # a small vocabulary: children often match the argmax, siblings often repeat
  if layout == "shape":
    shape = TreeShape((3, 2, 2), max_nodes=12)
    parents, depths, ranks = (np.broadcast_to(a, (batch, len(a))) for a in shape.arrays())
    depth = shape.depth
  else:
    parents, depths, ranks, depth = random_trees(rng, batch, 14)
  s = parents.shape[1]
  tokens = rng.integers(0, v, (batch, s))
  valid = rng.random((batch, s)) < 0.75
  valid[:, 0] = True
  argmax = rng.integers(0, v, (batch, s))
  p = jax.nn.one_hot(jnp.asarray(argmax), v)
  q = jnp.full((batch, s, v), 1.0 / v)
  tree = Tree(*(jnp.asarray(a, jnp.int32) for a in (tokens, parents, depths, ranks)), valid=jnp.asarray(valid))
  want = [greedy_reference(tokens[b], parents[b], valid[b], argmax[b]) for b in range(batch)]
  want_n = np.array([len(path) - 1 for path, _ in want])
  want_token = np.array([t for _, t in want])
  # Coverage: deep walks, and walks that passed an invalid slot holding the argmax.
  assert want_n.max() >= 3 and (want_n == 0).any()
  skipped = sum(any(parents[b, j] == cur and not valid[b, j] and tokens[b, j] == argmax[b, cur]
                    for cur in path for j in range(1, s)) for b, (path, _) in enumerate(want))
  assert skipped > batch // 10
  runs = [(select, True) for select in SELECTS] + [("top", False)]
  for select, greedy in runs:
    res = accept_tree(p, tree, row_keys(0, batch), depth=depth, select=select, greedy=greedy,
                      q=None if select == "top" else q)
    check_invariants(tree, res.path, res.n, res.token, v)
    path, n = np.asarray(res.path), np.asarray(res.n)
    np.testing.assert_array_equal(n, want_n, err_msg=f"{select} greedy={greedy}")
    np.testing.assert_array_equal(np.asarray(res.token), want_token, err_msg=f"{select} greedy={greedy}")
    for b, (ref_path, _) in enumerate(want):
      assert list(path[b, : len(ref_path)]) == ref_path, (select, greedy, b)


# ------------------------------------------------------------------------------------ invariants


@pytest.mark.parametrize("select", SELECTS)
def test_path_invariants_on_random_trees(select):
  """Per-row random trees with invalid slots and random p, q: the outcome is a path from the root along
  parents, of valid slots, ending at depth n, padded with its last slot."""
  rng = np.random.default_rng(SELECTS.index(select))
  batch, v = 2000, 4
  parents, depths, ranks, depth = random_trees(rng, batch, 12)
  s = parents.shape[1]
  tokens = rng.integers(0, v, (batch, s))
  valid = rng.random((batch, s)) < 0.8
  valid[:, 0] = True
  p = jnp.asarray(rng.dirichlet(np.full(v, 0.5), (batch, s)), jnp.float32)
  q = jnp.asarray(rng.dirichlet(np.full(v, 0.5), (batch, s)), jnp.float32)
  tree = Tree(*(jnp.asarray(a, jnp.int32) for a in (tokens, parents, depths, ranks)), valid=jnp.asarray(valid))
  res = accept_tree(p, tree, row_keys(3, batch), depth=depth, select=select, greedy=False,
                    q=None if select == "top" else q)
  check_invariants(tree, res.path, res.n, res.token, v)
  assert np.asarray(res.n).max() >= 2
