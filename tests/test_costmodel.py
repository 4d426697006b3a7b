"""The cost model predicts a synthetic cost table exactly; k="auto" follows it, down to k = 0."""

from __future__ import annotations

import dataclasses
import itertools
import statistics

import numpy as np
import pytest

import specjax
from helpers import SMALL, make_model
from specjax import SpecConfig, costmodel
from specjax.costmodel import CostTable
from specjax.proposers import DraftModel, NGram
from specjax.runtime import RUNTIME
from specjax.tree import TreeShape

TABLE = CostTable(batch=1, verify={1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5, 5: 3.0}, proposer_step=0.1, catch_up=True,
                  overhead={0: 0.05, 1: 0.06, 2: 0.07, 3: 0.08, 4: 0.09})
ACCEPT = [0.9, 0.8, 0.7, 0.6]


def test_prediction_matches_hand_computation():
  # k = 2: tau = 1 + .9 + .9*.8 = 2.62; round = 2*.1 + v(3) + P(all)*.1 + r = .2 + 2 + .072 + .07 = 2.342;
  # baseline round = v(1) + r0 = 1.05 seconds per token.
  assert costmodel.expected_tau(ACCEPT, 2) == pytest.approx(2.62, rel=1e-12)
  assert costmodel.round_seconds(TABLE, ACCEPT, 2) == pytest.approx(2.342, rel=1e-12)
  assert costmodel.predict_speedup(TABLE, ACCEPT, 2) == pytest.approx(2.62 / 2.342 * 1.05, rel=1e-12)
  assert costmodel.predict_speedup(TABLE, ACCEPT, 0) == 1.0
  by_k = costmodel.speedup_table(TABLE, ACCEPT, 4)
  assert costmodel.choose_k(TABLE, ACCEPT) == max(by_k, key=by_k.get)


@pytest.mark.parametrize("alpha", [0.3, 0.75, 0.95])
def test_tau_with_iid_acceptance_matches_closed_form(alpha):
  for k in range(0, 9):
    assert costmodel.expected_tau([alpha] * 3, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_choose_k_is_zero_when_verification_is_expensive():
  expensive = CostTable(batch=1, verify={t: 10.0 * t for t in range(1, 6)}, proposer_step=0.1)
  assert costmodel.choose_k(expensive, ACCEPT) == 0
  cheap = CostTable(batch=1, verify={t: 1.0 for t in range(1, 6)}, proposer_step=0.01)
  assert costmodel.choose_k(cheap, [1.0] * 4) == 4


def test_cost_table_validation():
  with pytest.raises(ValueError, match="must hold T=1"):
    CostTable(batch=1, verify={2: 1.0}, proposer_step=0.0)
  with pytest.raises(ValueError, match="must be > 0"):
    CostTable(batch=1, verify={1: 0.0}, proposer_step=0.0)
  with pytest.raises(ValueError, match="no verification time for a window of 6"):
    costmodel.round_seconds(TABLE, ACCEPT, 5)


@pytest.fixture
def pair():
  target = make_model(SMALL, 0)
  return target, target  # a perfect draft: acceptance 1 at every position


def _inject(target, draft, batch, k_max, verify_cost, proposer_step, n_tokens):
  table = CostTable(batch=batch, verify={t: verify_cost(t) for t in range(1, k_max + 2)},
                    proposer_step=proposer_step, catch_up=True)
  key = costmodel.table_key(target, DraftModel(draft), batch, k_max, specjax.GREEDY, n_tokens=n_tokens)
  RUNTIME.clear()
  costmodel.COST_TABLES[key] = table
  return table


def test_auto_picks_zero_when_verification_is_artificially_expensive(pair):
  target, draft = pair
  _inject(target, draft, 2, 4, verify_cost=lambda t: 5.0 * t, proposer_step=0.5, n_tokens=16)
  prompts = [[1, 2, 3], [4, 5]]
  out = specjax.generate(target, prompts, draft=draft, spec=SpecConfig(k="auto", k_max=4),
                         max_new_tokens=12)
  assert out.stats.k == 0 and out.stats.drafted_tokens == 0
  np.testing.assert_array_equal(out.tokens, specjax.generate(target, prompts, max_new_tokens=12).tokens)


def test_auto_picks_k_max_when_speculation_is_cheap(pair):
  target, draft = pair
  _inject(target, draft, 2, 4, verify_cost=lambda t: 1.0, proposer_step=0.01, n_tokens=32)
  out = specjax.generate(target, [[1, 2, 3], [4, 5]], draft=draft, spec=SpecConfig(k="auto", k_max=4),
                         max_new_tokens=20)  # 32 tokens per row (the bucket): k=4 takes 7 rounds, k=3 takes 8
  assert out.stats.k == 4 and out.stats.acceptance_rate == 1.0


def test_calibration_measures_every_window_and_round():
  target, draft = make_model(SMALL, 0), make_model(SMALL.replace(n_layers=1), 1)
  table = costmodel.calibrate_costs(target, DraftModel(draft), 2, 3, n_tokens=8, repeats=1, min_seconds=1e-4)
  assert sorted(table.verify) == [1, 2, 3, 4] and sorted(table.rounds) == [0, 1, 2, 3]
  assert all(s > 0 for s in table.verify.values()) and table.proposer_step > 0
  assert sorted(table.propose) == [1, 3] and table.propose[1] == table.proposer_step and table.catch_up
  assert set(table.prefill) == {"target", "proposer"} and table.prompt_len == 16 and table.spread >= 0
  assert table.n_tokens == 8
  assert sorted(table.to_dict()["round_over_parts"]) == [0, 1, 2, 3]
  with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
    costmodel.calibrate_costs(target, DraftModel(draft), 2, 3, repeats=0)


WHOLE = CostTable(batch=1, verify={1: 1.0, 2: 1.5, 3: 2.0}, proposer_step=0.1, catch_up=True,
                  rounds={0: 1.2, 1: 2.0, 2: 2.6},
                  prefill={"target": 5.0, "proposer": 0.5}, prompt_len=16)


def test_measured_rounds_replace_the_sum_of_parts():
  # round(k) = body(k) + P(all accepted) * c, body measured whole.
  assert costmodel.round_seconds(WHOLE, ACCEPT, 0) == 1.2
  assert costmodel.round_seconds(WHOLE, ACCEPT, 2) == pytest.approx(2.6 + 0.72 * 0.1, rel=1e-12)
  assert costmodel.parts_seconds(WHOLE, 2) == pytest.approx(2.2, rel=1e-12)
  assert WHOLE.to_dict()["round_over_parts"][2] == pytest.approx(2.6 / 2.2, rel=1e-12)
  assert costmodel.predict_speedup(WHOLE, ACCEPT, 2) == pytest.approx(2.62 / (2.6 + 0.072) * 1.2, rel=1e-12)
  # A whole call: prefill of both models, rounds and catch-ups.
  assert costmodel.run_seconds(WHOLE, 2, rounds=10, catch_ups=3) == pytest.approx(5.5 + 26.0 + 0.3, rel=1e-12)
  assert costmodel.run_seconds(WHOLE, 0, rounds=12, catch_ups=0) == pytest.approx(5.0 + 14.4, rel=1e-12)


def test_expected_rounds_deterministic_cases():
  # Everything accepted: k + 1 tokens per round, a catch-up before every round but the first.
  assert costmodel.expected_rounds([1.0], 3, batch=4, n_tokens=20) == (5.0, 4.0)
  # Nothing accepted: one token per round, never a catch-up.
  assert costmodel.expected_rounds([0.0], 3, batch=4, n_tokens=20) == (20.0, 0.0)
  assert costmodel.expected_rounds([0.5], 0, batch=4, n_tokens=20) == (20.0, 0.0)
  # All accepted: the whole-call prediction is exact arithmetic.
  want = (5.0 + 20 * 1.2) / (5.5 + 7 * 2.6 + 6 * 0.1)  # 20 tokens in 7 rounds of 3
  assert costmodel.predict_speedup(WHOLE, [1.0], 2, n_tokens=20) == pytest.approx(want, rel=1e-12)


def test_expected_rounds_single_row_matches_tau_and_batches_wait_for_the_slowest_row():
  acc = [0.8, 0.6, 0.5, 0.4]
  rounds, _ = costmodel.expected_rounds(acc, 4, batch=1, n_tokens=2000)
  assert rounds == pytest.approx(2000 / costmodel.expected_tau(acc, 4), rel=0.01)
  # Against a simulation of the loop (rows accept independently), 4000 batches of 4 rows, 40 tokens each.
  rng = np.random.default_rng(0)
  ok = rng.random((4000, 4, 40, 4)) < np.array(acc)
  made = np.cumsum(np.cumprod(ok, -1).sum(-1) + 1, -1)  # [S, B, R]
  row_rounds = np.argmax(made >= 40, -1) + 1
  exact, _ = costmodel.expected_rounds(acc, 4, batch=4, n_tokens=40)
  assert exact == pytest.approx(row_rounds.max(1).mean(), rel=0.01)
  r1, r16 = (costmodel.expected_rounds(acc, 4, batch=b, n_tokens=64)[0] for b in (1, 16))
  assert r16 > 1.1 * r1  # the loop runs until the slowest of 16 rows is done


def test_calibration_can_be_interleaved_with_other_work():
  target = make_model(SMALL, 0)
  cal = costmodel.Calibration(target, NGram(n_max=2), 1, 2, prompt_len=16, n_tokens=8, min_seconds=1e-4)
  with pytest.raises(ValueError, match="call time_once"):
    cal.table()
  cal.time_once()  # warms up on first use
  cal.time_once()
  assert all(len(ts) == 2 for ts in cal.times.values())
  table = cal.table()
  assert sorted(table.rounds) == [0, 1, 2] and not table.catch_up and set(table.prefill) == {"target", "proposer"}
  with pytest.raises(ValueError, match="proposer must be a specjax.proposers.Proposer or None"):
    costmodel.Calibration(target, target, 1, 2)
  with pytest.raises(ValueError, match="min_seconds must be > 0"):
    costmodel.Calibration(target, None, 1, 2, min_seconds=0)


def test_calibration_of_only_the_figures_asked_for():
  # specjax eval reads five figures: the calibration builds only their programs (and always T = 1, k = 0).
  target = make_model(SMALL, 0)
  cal = costmodel.Calibration(target, NGram(n_max=2), 1, 3, prompt_len=16, n_tokens=8, min_seconds=1e-4,
                              rounds=(3,), windows=(4,), propose=(3,), prefill=False)
  assert sorted(cal.programs) == [("propose", 3), ("round", 0), ("round", 3), ("verify", 1), ("verify", 4)]
  cal.time_once()
  table = cal.table()
  assert sorted(table.verify) == [1, 4] and sorted(table.rounds) == [0, 3] and sorted(table.propose) == [3]
  assert table.prefill == {} and table.proposer_step == 0.0 and all(s > 0 for s in table.verify.values())
  for kwargs, match in [({"windows": (5,)}, r"windows must be integers in \[1, k_max \+ 1 = 4\]"),
                        ({"windows": (True,)}, "windows must be integers"),
                        ({"propose": (0,)}, r"propose must be integers in \[1, k_max=3\]"),
                        ({"prefill": 1}, "prefill must be True or False")]:
    with pytest.raises(ValueError, match=match):
      costmodel.Calibration(target, NGram(n_max=2), 1, 3, **kwargs)


def test_calibration_is_robust_to_a_busy_machine(monkeypatch):
  """Timings disturbed by other processes (contention only adds time) still give each program's cost per
  iteration: the least disturbed runs count, where single differences t(2n) - t(n) go negative."""
  import itertools

  clock = [0.0]
  cost, overhead, n = {("verify", 1): 1e-3, ("round", 1): 3e-3}, 5e-3, 8
  # The disturbance each successive run suffers: the first pair of every program is quiet, later n-runs
  # are hit hard, so that the median (and every later single difference) of t(2n) - t(n) is negative.
  hits = itertools.cycle([0.0, 0.0, 0.0, 0.0] + [0.5, 0.0] * 8)

  def program(name):
    def run(iters):
      clock[0] += overhead + iters * cost[name] + next(hits)
    return run, ()

  cal = costmodel.Calibration.__new__(costmodel.Calibration)
  cal.programs = {name: program(name) for name in cost}
  cal.iters = {name: n for name in cost}
  cal.runs = {name: [] for name in cost}
  cal.times = {name: [] for name in cost}
  cal.batch, cal.prompt_len, cal.n_tokens, cal.catch_up = 1, 16, 8, 0.0
  monkeypatch.setattr(costmodel.time, "perf_counter", lambda: clock[0])
  for _ in range(7):
    cal.time_once()
  assert statistics.median(cal.times[("verify", 1)]) < 1e-6  # what the median of differences would give
  table = cal.table()
  assert table.verify[1] == pytest.approx(cost[("verify", 1)], rel=1e-6)
  assert table.rounds[1] == pytest.approx(cost[("round", 1)], rel=1e-6)


# ------------------------------------------------------------------------------------------ trees

RANKS = [[0.6, 0.2, 0.1], [0.7, 0.15, 0.05], [0.5, 0.3, 0.1]]  # c[depth][rank]


def _closed_subsets(universe: list[tuple[int, ...]], size: int):
  """Every set of ``size`` rank paths from ``universe`` that holds each member's parent."""
  def grow(chosen: frozenset, seen: set):
    if len(chosen) == size:
      yield chosen
      return
    for path in universe:
      if path not in chosen and (len(path) == 1 or path[:-1] in chosen):
        bigger = chosen | {path}
        if bigger not in seen:
          seen.add(bigger)
          yield from grow(bigger, seen)
  yield from grow(frozenset(), set())


@pytest.mark.parametrize("nodes", [1, 3, 5, 6])
def test_best_tree_is_the_best_static_tree_by_exhaustive_search(nodes):
  universe = [p for d in range(1, 4) for p in itertools.product(range(3), repeat=d)]
  best = max(costmodel.tree_tau(RANKS, TreeShape.from_paths(s)) for s in _closed_subsets(universe, nodes))
  tree = costmodel.best_tree(RANKS, nodes, depth=3, ranks=3)
  assert tree.nodes == nodes
  assert costmodel.tree_tau(RANKS, tree) == pytest.approx(best, rel=1e-12)


def test_tree_tau_by_hand_and_against_a_simulated_walk():
  tree = TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
  # n >= 1: .6 + .2; n >= 2: .6*.7 + .6*.15 + .2*.7; n >= 3: .6*.7*.5
  want = [0.8, 0.42 + 0.09 + 0.14, 0.21]
  assert costmodel.tree_survival(RANKS, tree) == pytest.approx(want, rel=1e-12)
  assert costmodel.tree_tau(RANKS, tree) == pytest.approx(1 + sum(want), rel=1e-12)
  # The walk the model describes: at depth d one child rank r is accepted with probability c[d][r].
  rng, kept, total = np.random.default_rng(0), set(tree.paths()), 0
  for _ in range(40000):
    path = ()
    while True:
      depth = len(path)
      u, r = rng.random(), None
      if depth < 3:
        edges = np.cumsum(RANKS[depth])
        r = int(np.searchsorted(edges, u, side="right")) if u < edges[-1] else None
      if r is None or path + (r,) not in kept:
        break
      path += (r,)
    total += len(path) + 1
  assert total / 40000 == pytest.approx(costmodel.tree_tau(RANKS, tree), rel=0.01)
  # A chain of first choices is the chain's prediction.
  chain = TreeShape.from_paths([(0,) * d for d in range(1, 4)])
  assert costmodel.tree_tau(RANKS, chain) == pytest.approx(costmodel.expected_tau([0.6, 0.7, 0.5], 3), rel=1e-12)


def test_best_tree_takes_only_what_was_measured_and_accepted():
  assert costmodel.best_tree([[0.0, None]], 4, depth=2) is None
  measured = [[1.0, 0.0, None], [0.9, None, None], [None] * 3]  # depth 3 never reached: not extrapolated
  assert costmodel.best_tree(measured, 8, depth=3).paths() == [(0,), (0, 0)]
  assert costmodel.path_probability(RANKS, (0, 0, 0, 1)) == 0.0  # deeper than measured
  assert costmodel.path_probability(RANKS, (0, 0, 2)) == pytest.approx(0.6 * 0.7 * 0.1, rel=1e-12)


TREE_TABLE = dataclasses.replace(WHOLE, tree_rounds={TreeShape.from_paths([(0,), (1,), (0, 0)]): 2.4})


def test_tree_predictions_use_the_tree_round_and_the_catch_up_at_full_depth():
  tree = next(iter(TREE_TABLE.tree_rounds))
  tau = 1 + 0.8 + 0.42  # n >= 1: .6 + .2; n >= 2: .6 * .7
  seconds = 2.4 + 0.42 * 0.1  # the draft's catch-up after a round that accepted the full depth
  assert costmodel.tree_round_seconds(TREE_TABLE, RANKS, tree) == pytest.approx(seconds, rel=1e-12)
  assert costmodel.predict_tree_speedup(TREE_TABLE, RANKS, tree) == pytest.approx(tau / seconds * 1.2, rel=1e-12)
  # Everything accepted: 3 tokens a round, so a call of 20 tokens takes 7 rounds and 6 catch-ups.
  want = (5.0 + 20 * 1.2) / (5.5 + 7 * 2.4 + 6 * 0.1)
  assert costmodel.predict_tree_speedup(TREE_TABLE, [[1.0, 1.0]] * 2, tree, n_tokens=20) == pytest.approx(want, rel=1e-12)
  # The tree (tau 2.22 for 2.442 s) beats every chain here (k = 1: 1.6 for 2.06 s; k = 2: 2.02 for 2.642 s).
  assert costmodel.choose_speculation(TREE_TABLE, [0.6, 0.7], RANKS, k_max=2) == tree
  slow = dataclasses.replace(TREE_TABLE, tree_rounds={tree: 9.0})
  assert costmodel.choose_speculation(slow, [0.6, 0.7], RANKS, k_max=2) == 0  # nothing beats the baseline
  with pytest.raises(ValueError, match="no round time for tree"):
    costmodel.tree_round_seconds(WHOLE, RANKS, tree)
  assert TREE_TABLE.to_dict()["tree_rounds"] == {"paths:0|1|0.0": 2.4}


def test_rank_acceptance_is_measured_where_a_rank_was_offered(pair):
  target, draft = pair  # a perfect draft: the first choice is always accepted, the others never
  prompts = [[1, 2, 3], [4, 5]]
  pilot = specjax.decode.pilot_tree(3)
  assert pilot.paths() == [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (0, 3), (0, 0, 0), (0, 0, 1), (0, 0, 2)]
  out = specjax.generate(target, prompts, draft=draft, spec=SpecConfig(tree=pilot), max_new_tokens=12)
  assert out.stats.rank_acceptance[:3] == [[1.0, 0.0, 0.0, 0.0] + [None] * 4] * 2 + [[1.0, 0.0, 0.0] + [None] * 5]
  chain = specjax.generate(target, prompts, draft=draft, spec=SpecConfig(k=3), max_new_tokens=12)
  assert [row[0] for row in chain.stats.rank_acceptance] == chain.stats.acceptance_by_position == [1.0] * 3
  assert all(a is None for row in chain.stats.rank_acceptance for a in row[1:])


def _inject_trees(target, draft, batch, k_max, n_tokens, chain_round, tree_round):
  """A cost table for k="auto", tree="auto" with a perfect draft: its pilot accepts only first choices, so
  every size's best tree is the chain of first choices to depth k_max, as a TreeShape."""
  tree = TreeShape.from_paths([(0,) * d for d in range(1, k_max + 1)])
  table = CostTable(batch=batch, verify={t: 1.0 for t in range(1, k_max + 2)}, proposer_step=0.01, catch_up=True,
                    rounds={k: chain_round(k) for k in range(k_max + 1)}, tree_rounds={tree: tree_round})
  key = costmodel.table_key(target, DraftModel(draft), batch, k_max, specjax.GREEDY, n_tokens=n_tokens, trees=(tree,))
  RUNTIME.auto_k.clear()  # the decisions only: the compiled pilots serve every case
  costmodel.COST_TABLES[key] = table
  return tree


def test_auto_chooses_between_chains_trees_and_the_target_alone(pair):
  target, draft = pair
  prompts = [[1, 2, 3], [4, 5]]
  base = specjax.generate(target, prompts, max_new_tokens=12)
  spec = SpecConfig(k="auto", tree="auto", k_max=3, tree_sizes=(4, 8))
  tree = _inject_trees(target, draft, 2, 3, 16, chain_round=lambda k: 1.0 + k, tree_round=1.1)
  out = specjax.generate(target, prompts, draft=draft, spec=spec, max_new_tokens=12)
  assert out.stats.tree == tree.describe() and out.stats.k == 3
  np.testing.assert_array_equal(out.tokens, base.tokens)
  _inject_trees(target, draft, 2, 3, 16, chain_round=lambda k: 1.0 + 0.01 * k, tree_round=9.0)
  out = specjax.generate(target, prompts, draft=draft, spec=spec, max_new_tokens=12)
  assert out.stats.tree is None and out.stats.k == 3
  _inject_trees(target, draft, 2, 3, 16, chain_round=lambda k: 1.0 + 9.0 * k, tree_round=40.0)
  out = specjax.generate(target, prompts, draft=draft, spec=spec, max_new_tokens=12)
  assert out.stats.tree is None and out.stats.k == 0
  np.testing.assert_array_equal(out.tokens, base.tokens)


def test_calibration_times_tree_rounds_and_refuses_what_cannot_propose_trees():
  target, draft = make_model(SMALL, 0), make_model(SMALL.replace(n_layers=1), 1)
  tree = TreeShape((2, 1))
  table = costmodel.calibrate_costs(target, DraftModel(draft), 1, 2, n_tokens=8, repeats=1, min_seconds=1e-4,
                                    trees=(tree,))
  assert list(table.tree_rounds) == [tree] and table.tree_rounds[tree] > 0
  with pytest.raises(ValueError, match="does not propose token trees"):
    costmodel.Calibration(target, NGram(n_max=2), 1, 2, trees=(tree,))
  with pytest.raises(ValueError, match="trees need a proposer"):
    costmodel.Calibration(target, None, 1, 2, trees=(tree,))


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=4, tree="auto"), "tree='auto' .* needs k='auto'"),
    (dict(k="auto", tree="auto", tree_sizes=()), "tree_sizes must be a non-empty sequence"),
    (dict(k="auto", tree="auto", tree_sizes=(4, 33)), r"tree_sizes\[1\] must be"),
])
def test_auto_tree_settings_are_checked(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SpecConfig(**kwargs)


def test_auto_pilots_on_the_given_prompts(monkeypatch):
  """SpecConfig.pilot_prompts: the acceptance k="auto" decides on is measured on them (one batch), not on the
  call's prompts; the decision is kept per pilot set; bad pilots are refused by field."""
  target, draft = make_model(SMALL, 0), make_model(SMALL.replace(n_layers=1), 0)  # acceptance varies by prompt
  _inject(target, draft, 1, 2, verify_cost=lambda t: 1.0 + 0.1 * t, proposer_step=0.05, n_tokens=16)
  seen = []
  choose = costmodel.choose_speculation
  monkeypatch.setattr(costmodel, "choose_speculation", lambda table, accept, *a, **kw: (
      seen.append(list(accept)), choose(table, accept, *a, **kw))[1])
  call, pilots = [[5, 6, 7]], ([[1, 2, 3, 4], [9, 8], [30, 31, 32]], [[40, 41], [7, 7, 7, 7, 7]])
  base = specjax.generate(target, call, max_new_tokens=12)

  def measured(rows):  # what a pilot at k_max = 2 sees on rows: 8 * (k_max + 1) tokens
    return list(specjax.generate(target, rows, draft=draft, spec=SpecConfig(k=2), max_new_tokens=24)
                .stats.acceptance_by_position)

  for pilot in (None, *pilots):
    out = specjax.generate(target, call, draft=draft, max_new_tokens=12,
                           spec=SpecConfig(k="auto", k_max=2, pilot_prompts=pilot))
    np.testing.assert_array_equal(out.tokens, base.tokens)
    assert seen[-1] == measured(pilot or call)
  assert len(seen) == 3 and seen[0] != seen[1] != seen[2]  # a decision per pilot set, each on its own prompts
  specjax.generate(target, call, draft=draft, max_new_tokens=12,
                   spec=SpecConfig(k="auto", k_max=2, pilot_prompts=pilots[0]))
  assert len(seen) == 3  # reused
  with pytest.raises(ValueError, match=r"spec.pilot_prompts\[0\] holds token id 999 outside the vocabulary \[0, 64\)"):
    specjax.generate(target, call, draft=draft, spec=SpecConfig(k="auto", k_max=2, pilot_prompts=[[999]]))
  with pytest.raises(ValueError, match=r"prompt length \(511\) \+ max_new_tokens \(2\) = 513 exceeds the target's cache"):
    specjax.generate(target, call, draft=draft, spec=SpecConfig(k="auto", k_max=2, pilot_prompts=[[1], [2] * 511]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=4, pilot_prompts=[[1, 2]]), "pilot_prompts .* need k='auto', got k=4"),
    (dict(k="auto", pilot_prompts=[]), "pilot_prompts must be a non-empty sequence"),
    (dict(k="auto", pilot_prompts="hello"), "pilot_prompts must be a non-empty sequence"),
    (dict(k="auto", pilot_prompts=[[1], "hi"]), r"pilot_prompts\[1\] must be a non-empty sequence of token ids"),
    (dict(k="auto", pilot_prompts=[[1, -2]]), r"pilot_prompts\[0\]\[1\] must be an integer >= 0"),
    (dict(k="auto", pilot_prompts=[[1]] * 65), "pilot_prompts holds 65 prompts; at most 64"),
])
def test_pilot_prompts_are_checked(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SpecConfig(**kwargs)
