"""Token trees in the engine: greedy equality for every tree proposer and model family, tree attention against
chain passes, cache compaction against from-scratch passes, the output law with every acceptance rule (with a
broken rule shown to fail), statistics, and refusals. The acceptance function alone: tests/test_tree_accept.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import specjax.tree
from helpers import SMALL, copy_head, full_logits, make_model, perturbed_copy, run_rounds, scratch_chain
from specjax import SamplingConfig, SpecConfig
from specjax.config import MAX_K
from specjax.models import GPT2, GPT2Config, Llama, LlamaConfig
from specjax.models.heads import build_heads
from specjax.proposers import MTP, DraftModel, Eagle, Medusa, NGram
from specjax.tree import DynamicTree, Tree, TreeShape, parse_tree, verify_mask
from test_distribution import TINY, chi_square_pvalue, exact_joint, sample_joint

from flax import nnx


def tree_proposers(target) -> dict:
  return {
      "draft": DraftModel(perturbed_copy(target, scale=0.15, seed=1)),
      "medusa": Medusa(build_heads("medusa", target.cfg, num_heads=4)),
      "eagle1": Eagle(copy_head(build_heads("eagle1", target.cfg, seed=2), noise=0.1)),
      "eagle3": Eagle(build_heads("eagle3", target.cfg, seed=3, draft_vocab_size=24, d_model=16, n_heads=2,
                                  d2t=np.r_[5, np.arange(30, 53)])),
      "mtp2": MTP(copy_head(build_heads("mtp", target.cfg, seed=4, num_heads=2), noise=0.1)),
      "mtp3": MTP(copy_head(build_heads("mtp", target.cfg, seed=6, num_heads=3), noise=0.1)),
  }


@pytest.fixture(scope="module")
def proposers(target):
  return tree_proposers(target)


PROMPTS = [[3, 7, 1, 9, 4], [12], [5, 6] * 6, [40, 41, 42, 43, 44, 45, 46]]
TREES = {"dynamic": DynamicTree(top_k=3, depth=4, nodes=10), "fixed": TreeShape((3, 2, 1), max_nodes=8)}


@pytest.mark.parametrize("name,tree", [("draft", "dynamic"), ("medusa", "fixed"), ("eagle1", "dynamic"),
                                       ("eagle3", "fixed"), ("mtp2", "dynamic"), ("mtp3", "fixed")])
def test_greedy_trees_equal_target_greedy_with_eos_and_max_new_inside_trees(target, proposers, name, tree):
  """Every tree proposer, each with one of the two kinds of tree (the other kind is in the tests below)."""
  base = specjax.generate(target, PROMPTS, max_new_tokens=21)
  eos = int(base.tokens[1, 8])  # row 1 ends early, inside some tree's path
  base = specjax.generate(target, PROMPTS, max_new_tokens=21, eos_id=eos)
  out = specjax.generate(target, PROMPTS, proposer=proposers[name], spec=SpecConfig(tree=TREES[tree]),
                         max_new_tokens=21, eos_id=eos)
  np.testing.assert_array_equal(out.tokens, base.tokens)
  np.testing.assert_array_equal(out.lengths, base.lengths)
  assert base.lengths[1] < 21 and (base.lengths == 21).sum() >= 2
  st = out.stats
  assert st.tree == TREES[tree].describe() and st.k == TREES[tree].depth
  assert st.accepted_tokens == sum(st.accepted_by_rank)  # every accepted node counted once, by rank
  assert st.accepted_tokens < st.drafted_tokens <= st.row_rounds * TREES[tree].nodes
  if name in ("draft", "medusa", "eagle3"):  # proposers that agree with this random target often
    assert st.accepted_tokens > 0
  if name == "draft":  # the accepted path is moved into the draft's cache: a catch-up pass only after a round
    assert st.catch_ups < st.rounds / 2  # whose last accepted node was never expanded (re-feeding: one a round)


def test_a_chain_shaped_tree_is_the_chain(target, proposers):
  """TreeShape((1,) * k) proposes and accepts exactly what the chain of k does (greedy: same statistics)."""
  for name in ("draft", "mtp3"):  # a proposer with its own cache and one of per-depth head caches
    chain = specjax.generate(target, PROMPTS, proposer=proposers[name], spec=SpecConfig(k=3), max_new_tokens=17)
    tree = specjax.generate(target, PROMPTS, proposer=proposers[name], spec=SpecConfig(tree=TreeShape((1, 1, 1))),
                            max_new_tokens=17)
    np.testing.assert_array_equal(tree.tokens, chain.tokens)
    for field in ("rounds", "accepted_tokens", "drafted_tokens", "acceptance_by_position"):
      assert getattr(tree.stats, field) == getattr(chain.stats, field), (name, field)


def test_wider_trees_accept_more_than_the_chain(target, proposers):
  """A tree containing the chain's path accepts at least the chain's tokens per round, and the siblings pay:
  accepted nodes of rank >= 1 occur."""
  chain = specjax.generate(target, PROMPTS, proposer=proposers["medusa"], spec=SpecConfig(k=3), max_new_tokens=24)
  tree = specjax.generate(target, PROMPTS, proposer=proposers["medusa"], spec=SpecConfig(tree="4-2-1"),
                          max_new_tokens=24)
  np.testing.assert_array_equal(tree.tokens, chain.tokens)
  assert tree.stats.mean_accepted_length > chain.stats.mean_accepted_length
  assert sum(tree.stats.accepted_by_rank[1:]) > 0


# ---------------------------------------------------------------------------------- model families


FAMILIES = {
    "sliding": LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=128,
                           sliding_window=3, sliding_layers=(True, False)),
    "gemma2": LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, d_ff=64, max_seq_len=128,
                          activation="gelu_tanh", norm_offset=1.0, embed_scale=32**0.5, attn_softcap=20.0,
                          final_softcap=15.0, post_norms=True, sliding_window=4, sliding_layers=(True, False)),
    "gpt2": GPT2Config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=128),
}


def family_model(name: str):
  cfg = FAMILIES[name]
  return (GPT2 if isinstance(cfg, GPT2Config) else Llama)(cfg, rngs=nnx.Rngs(3))


def random_tree(shape: TreeShape, batch: int, vocab: int, seed: int) -> Tree:
  parents, depths, ranks = specjax.tree.fixed_arrays(shape, batch)
  tokens = jax.random.randint(jax.random.key(seed), parents.shape, 0, vocab).astype(jnp.int32)
  return Tree(tokens=tokens, parents=parents, depths=depths, ranks=ranks, valid=jnp.ones(parents.shape, bool))


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["llama"])
def test_tree_attention_gives_each_node_the_logits_of_a_chain_over_its_ancestors(target, family):
  """Node i scored in one tree pass (at position length + depth, seeing its ancestors) has the logits of a
  plain pass over the prompt and its path; sliding windows shorter than the tree's depth included."""
  model = target if family == "llama" else family_model(family)
  prompts = [[3, 7, 1, 9, 4, 8, 2], [12, 5]]
  shape = TreeShape((3, 2, 2))
  tree = random_tree(shape, len(prompts), 64, seed=1)
  tree = dataclasses.replace(tree, tokens=tree.tokens.at[:, 0].set(jnp.asarray([p[-1] for p in prompts])))
  lens = jnp.asarray([len(p) - 1 for p in prompts], jnp.int32)
  padded = jnp.asarray([p + [0] * (8 - len(p)) for p in prompts], jnp.int32)
  _, _, cache = model(padded, model.init_cache(2, 40))
  cache = cache.with_lengths(lens)
  logits, _, _ = jax.jit(lambda t, c, m: model(t, c, tree=m))(tree.tokens, cache, verify_mask(tree, lens, shape.depth))
  parents = np.asarray(tree.parents[0])
  for b, prompt in enumerate(prompts):
    for i in range(tree.slots):
      path, j = [], i
      while j > 0:
        path.append(int(tree.tokens[b, j]))
        j = parents[j]
      ref = full_logits(model, np.asarray([prompt + path[::-1]], np.int32))[0, -1]
      np.testing.assert_allclose(np.asarray(logits[b, i]), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_trees_in_every_model_family(family):
  model = family_model(family)
  proposers = [Medusa(build_heads("medusa", model.cfg, num_heads=3, seed=1))]
  if family != "gpt2":  # chain heads are Llama-style modules on Llama-family targets
    proposers.append(Eagle(copy_head(build_heads("eagle1", model.cfg, seed=2), noise=0.1)))
  prompts = [[3, 7, 1, 9, 4, 8, 2, 11, 13], [12, 5]]
  base = specjax.generate(model, prompts, max_new_tokens=19)
  for proposer in proposers:
    out = specjax.generate(model, prompts, proposer=proposer, spec=SpecConfig(tree=DynamicTree(3, 3, 8)),
                           max_new_tokens=19)
    np.testing.assert_array_equal(out.tokens, base.tokens)


# ------------------------------------------------------------------------------------------- caches


@pytest.mark.parametrize("kind,options", [("eagle1", {}), ("mtp", {"num_heads": 3})])
def test_caches_after_tree_rounds_equal_a_pass_over_the_accepted_sequence(target, kind, options):
  """After sampled tree rounds (every depth accepted somewhere), the target's cache and each head depth's
  cache hold exactly what from-scratch passes over the accepted sequence give: the accepted path was moved to
  consecutive positions, nothing of the rejected branches is left inside the rows' lengths."""
  heads = copy_head(build_heads(kind, target.cfg, seed=11, **options), noise=0.1)
  proposer = Eagle(heads) if kind == "eagle1" else MTP(heads)
  prompts = [[3, 7, 1, 9, 4], [12], [5, 5, 5, 5, 5, 5, 5, 5]]
  tree = TreeShape((3, 2, 2), max_nodes=10, select="sample")
  state = run_rounds(target, proposer, prompts, rounds=6, k=tree.depth, sampling=SamplingConfig(temperature=0.8),
                     seed=2, tree=tree)
  lengths = np.asarray(state.target_cache.lengths)
  assert 0 < int(np.sum(state.stats.accepted)) and int(np.sum(state.stats.ranks[1:])) > 0  # siblings accepted
  for b, prompt in enumerate(prompts):
    context = prompt + np.asarray(state.out.ids[b, :int(state.n_out[b])]).tolist()
    assert len(context) == lengths[b] + 1
    _, _, ref = target(jnp.asarray([context[:-1]], jnp.int32), target.init_cache(1, state.target_cache.max_len))
    for layer in range(target.cfg.n_layers):
      for got, want in ((state.target_cache.k[layer], ref.k[layer]), (state.target_cache.v[layer], ref.v[layer])):
        np.testing.assert_allclose(np.asarray(got[b, :lengths[b]]), np.asarray(want[0, :lengths[b]]),
                                   rtol=1e-4, atol=1e-5)
    start = heads.num_depths - 1
    for d, (ref_k, ref_v, ref_feat) in enumerate(scratch_chain(target, heads, context, state.target_cache.max_len)):
      cache = state.proposer.caches[d]
      got = int(cache.lengths[b]) - start
      assert got == ref_k.shape[0]
      np.testing.assert_allclose(cache.k[0][b, start:start + got], ref_k, rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(cache.v[0][b, start:start + got], ref_v, rtol=1e-4, atol=1e-5)
      if ref_feat is not None:
        np.testing.assert_allclose(state.proposer.feat[b], ref_feat, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tree", [TreeShape((3, 2, 2), max_nodes=10, select="sample"), DynamicTree(3, 3, 8)],
                         ids=lambda t: t.describe())
def test_the_draft_compacts_its_cache_to_the_accepted_path_after_tree_rounds(target, tree):
  """After each sampled tree round the draft's cache holds the accepted path's keys and values at consecutive
  positions (moved from its frontier entries, found by the accepted tokens), equal to a
  from-scratch draft pass over the accepted sequence: as far as the new ``last`` (``seen = L'``) when the last
  accepted node was expanded, one short of it (one catch-up step next round) when it was a leaf. The old
  behaviour (keeping the root's entry only and re-feeding the path, ``seen = L + 1``) fails the ``seen``
  check after any round that accepted a node."""
  from specjax import engine
  from specjax.decode import prepare_prompts
  from helpers import start_state

  draft = perturbed_copy(target, scale=0.15, seed=1)
  proposer = DraftModel(draft)
  prompts = [[3, 7, 1, 9, 4], [12], [5, 5, 5, 5, 5, 5, 5, 5]]
  padded, lens = prepare_prompts(prompts)
  depth = tree.depth
  state, mode = start_state(target, proposer, padded, lens, k=depth, max_new=40, seed=3,
                            sampling=SamplingConfig(temperature=0.8))
  step = jax.jit(lambda s: engine.tree_round_step(s, target=target, proposer=proposer, tree=tree, mode=mode)[0])
  behind, catch_ups, moved = False, 0, 0
  for _ in range(6):
    accepted = np.asarray(state.stats.accepted)
    state = step(state)
    catch_ups += int(behind)  # this round caught up iff some row was one token behind after the last one
    assert int(state.stats.catch_ups) == catch_ups
    assert state.proposer.region is None  # commit drops the round's layout
    n = np.asarray(state.stats.accepted) - accepted
    lengths, seen = np.asarray(state.target_cache.lengths), np.asarray(state.proposer.cache.lengths)
    # Both trees expand every depth-1 node (the dynamic one's second frontier is all top_k of the root's top_k
    # children), so a round that accepted at most one node leaves the draft fully caught up.
    assert np.all((seen == lengths) | (seen == lengths - 1)) and np.all(seen[n <= 1] == lengths[n <= 1])
    if isinstance(tree, TreeShape):  # a fixed shape expands every node above the deepest level
      np.testing.assert_array_equal(seen, lengths - (n == depth))
    moved += int(np.sum(n >= 1))
    behind = bool(np.any(seen < lengths))
  assert moved > 0 and int(np.sum(state.stats.accepted)) > 0 and int(np.sum(state.stats.ranks[..., 1:])) > 0
  assert catch_ups < int(state.stats.rounds)
  cache = state.proposer.cache
  for b, prompt in enumerate(prompts):
    context = prompt + np.asarray(state.out.ids[b, :int(state.n_out[b])]).tolist()
    seen = int(cache.lengths[b])
    assert len(context) - 2 <= seen <= len(context) - 1
    _, _, ref = draft(jnp.asarray([context[:seen]], jnp.int32), draft.init_cache(1, cache.max_len))
    for layer in range(draft.cfg.n_layers):
      for got, want in ((cache.k[layer], ref.k[layer]), (cache.v[layer], ref.v[layer])):
        np.testing.assert_allclose(np.asarray(got[b, :seen]), np.asarray(want[0, :seen]), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(state.proposer.history[b, :len(context)]), context)


# ------------------------------------------------------------------------------------ distributions


# (head, tree, sampling): every acceptance rule, T = 1 and T = 0.7 with top-k, every head family.
LAW_CASES = [
    ("eagle3", DynamicTree(top_k=2, depth=2, nodes=4), SamplingConfig(temperature=1.0)),
    ("medusa", TreeShape((2, 2), select="sample"), SamplingConfig(temperature=0.7, top_k=5)),
    ("mtp", TreeShape((3, 1), select="sample_distinct"), SamplingConfig(temperature=0.7, top_k=5)),
    ("eagle1", TreeShape((2, 2), max_nodes=4), SamplingConfig(temperature=1.0)),
    ("draft", TreeShape((2, 2), select="sample"), SamplingConfig(temperature=1.0)),
]
LAW_HEADS = {
    "medusa": lambda t: Medusa(build_heads("medusa", t.cfg, num_heads=3, seed=1)),
    "eagle1": lambda t: Eagle(build_heads("eagle1", t.cfg, seed=2)),
    "eagle3": lambda t: Eagle(build_heads("eagle3", t.cfg, seed=3, draft_vocab_size=8,
                                          d2t=np.array([0, 2, 3, 5, 7, 8, 10, 11]))),
    "mtp": lambda t: MTP(build_heads("mtp", t.cfg, num_heads=2, seed=4)),
    "draft": lambda t: DraftModel(make_model(TINY, seed=5)),
}
PASS_P, FAIL_P = 1e-3, 1e-8


@pytest.fixture(scope="module")
def tiny():
  return make_model(TINY, seed=0)


def tree_joint(target, head: str, tree, sampling, steps: int = 3, n: int = 20_000, seed: int = 0):
  out = specjax.generate(target, [[3, 7, 1, 9]] * n, proposer=LAW_HEADS[head](target), spec=SpecConfig(tree=tree),
                         sampling=sampling, max_new_tokens=steps, seed=seed)
  counts = np.zeros([TINY.vocab_size] * steps)
  np.add.at(counts, tuple(out.tokens[:, i] for i in range(steps)), 1)
  return counts, out.stats


@pytest.mark.parametrize("head,tree,sampling", LAW_CASES, ids=lambda x: getattr(x, "describe", lambda: str(x))())
def test_trees_keep_the_target_distribution(tiny, head, tree, sampling):
  counts, st = tree_joint(tiny, head, tree, sampling)
  # Thousands of accepted nodes, hundreds of them siblings of rank >= 1, and thousands of rejections.
  assert st.accepted_tokens > 1000 and sum(st.accepted_by_rank[1:]) > 100 and st.acceptance_rate < 0.9
  assert chi_square_pvalue(counts, exact_joint(tiny, sampling, 3)) > PASS_P


@pytest.fixture
def broken(monkeypatch):
  """Two classic tree-sampler bugs: the residual never updated after a rejected sibling, and the walk's draw
  at a node taken as the argmax of p instead of a sample."""
  jax.clear_caches()
  monkeypatch.setattr(specjax.tree, "_normalize", lambda x, fallback: fallback / jnp.sum(fallback, -1, keepdims=True))
  real_sample = specjax.tree.sample
  monkeypatch.setattr(specjax.tree, "sample", lambda w, k: jnp.argmax(w, axis=-1).astype(jnp.int32)
                      if w.ndim == 3 else real_sample(w, k))
  yield
  monkeypatch.undo()
  jax.clear_caches()


@pytest.mark.parametrize("case", [0, 1])
def test_the_tree_law_test_fails_on_a_broken_rule(tiny, broken, case):
  head, tree, sampling = LAW_CASES[case]
  counts, _ = tree_joint(tiny, head, tree, sampling)
  assert chi_square_pvalue(counts, exact_joint(tiny, sampling, 3)) < FAIL_P


# --------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make,match", [
    (lambda: TreeShape((4, 0)), r"TreeShape.branching\[1\] must be an integer in \[1, 32\], got 0"),
    (lambda: TreeShape(()), "TreeShape.branching must be a non-empty sequence"),
    (lambda: TreeShape((4, 4, 4)), f"has 84 nodes, more than the maximum {MAX_K}: set max_nodes"),
    (lambda: TreeShape((4, 4, 4), max_nodes=33), r"TreeShape.max_nodes must be an integer in \[1, 32\]"),
    (lambda: TreeShape((2,), select="beam"), "TreeShape.select must be one of"),
    (lambda: DynamicTree(top_k=0), r"DynamicTree.top_k must be an integer in \[1, 32\]"),
    (lambda: DynamicTree(top_k=8, depth=6), "frontier entries exceed the maximum 32"),
    (lambda: DynamicTree(top_k=2, depth=2, nodes=7), r"DynamicTree.nodes \(7\) exceeds the 6 candidates"),
    (lambda: parse_tree("4-x"), "--tree takes 'dynamic'"),
    (lambda: parse_tree("dynamic:4,4"), "--tree dynamic:K,D,N takes three integers"),
    (lambda: SpecConfig(tree=3), "tree must be None, a specjax.tree.TreeShape"),
    (lambda: SpecConfig(k="auto", tree="dynamic"), "a token tree takes neither k='auto'"),
])
def test_bad_trees_are_refused_naming_the_field(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_trees_need_a_proposer_that_proposes_them(target, proposers):
  for proposer, match in ((NGram(), "method 'ngram' does not propose token trees"),
                          (proposers["medusa"], r"depth 5 exceeds what method 'medusa' can propose \(4 levels\)")):
    with pytest.raises(ValueError, match=match):
      specjax.generate(target, [[1, 2]], proposer=proposer, spec=SpecConfig(tree="2-1-1-1-1"), max_new_tokens=4)
  with pytest.raises(ValueError, match="spec.tree needs a proposer"):
    specjax.generate(target, [[1, 2]], spec=SpecConfig(tree="dynamic"), max_new_tokens=4)


def test_tree_specs_parse_and_describe():
  assert parse_tree("dynamic") == DynamicTree()
  assert parse_tree("dynamic:4,5,16") == DynamicTree(4, 5, 16)
  assert parse_tree("4-2-2-1/16:sample_distinct") == TreeShape((4, 2, 2, 1), 16, "sample_distinct")
  shape = TreeShape((4, 2, 2, 1), max_nodes=16)
  assert shape.nodes == 16 and shape.depth == 4
  parents, depths, ranks = shape.arrays()
  assert all(parents[i] < i for i in range(1, 17)) and np.all(np.diff(depths) >= 0)  # breadth first
  # Every kept node's ancestors are kept, and ranks are siblings' order.
  paths = shape.paths()
  assert all(p[:-1] in paths or len(p) == 1 for p in paths)
  assert SpecConfig(tree="4-2-1").k == 3
