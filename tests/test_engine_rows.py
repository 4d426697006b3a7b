"""The engine's row operations: a state's rows written from another state (``put_rows``) and taken out
(``take_rows``), as the server uses them, tested directly on the pure functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import SMALL, make_model, perturbed_copy, start_state
from specjax import SamplingConfig, engine
from specjax.decode import prepare_prompts
from specjax.proposers import DraftModel


@pytest.fixture(scope="module")
def models():
  target = make_model(SMALL, seed=0)
  return target, DraftModel(perturbed_copy(target, 0.05, seed=1))


def leaves_equal(a, b) -> bool:
  data = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(data(x)), np.asarray(data(y)))), a, b)
  return all(jax.tree.leaves(same))


def rows_of(state, rows):
  return engine.take_rows(state, jnp.asarray(rows, jnp.int32))


def test_put_then_take_gives_back_the_rows_and_leaves_the_others(models):
  target, proposer = models
  big, _ = start_state(target, proposer, *prepare_prompts([[1, 2, 3], [4], [5, 6]]), k=3, max_new=8,
                       max_len=64, keep_out=False, seed=0)
  new, _ = start_state(target, proposer, *prepare_prompts([[7, 8, 9, 10], [11, 12]]), k=3, max_new=8,
                       max_len=64, keep_out=False, seed=5)
  put = engine.put_rows(big, jnp.asarray([2, 0]), new)
  fields = lambda s: engine._batch_fields(s)
  assert leaves_equal(fields(rows_of(put, [2, 0])), fields(rows_of(new, [0, 1])))
  assert leaves_equal(fields(rows_of(put, [1])), fields(rows_of(big, [1])))
  assert put.k_now == big.k_now
  # A taken row of -1 is a free (done) row; the others keep their place.
  taken = rows_of(put, [1, -1])
  assert np.asarray(taken.done).tolist() == [False, True]
  assert taken.stats.row_rounds.shape == (2,)


def test_rows_moved_by_put_and_take_continue_exactly(models):
  """A request prefilled alone, put into row 1 of a wider state beside another, later taken to a narrower
  state, decodes exactly what generate gives it alone (greedy)."""
  target, proposer = models
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
  settings = SamplingConfig(0.0, repetition_penalty=1.5)
  mode = specjax.Mode.of([specjax.GREEDY, settings])
  from specjax.sampling import RowSettings, row_keys

  def state_of(rows, configs, seed):
    padded, lens = prepare_prompts(rows)
    s = jax.tree.map(jnp.asarray, RowSettings.of(configs, [12] * len(rows), [()] * len(rows), target.cfg.vocab_size,
                                                 mode))
    return engine.init_state(target, proposer, jnp.asarray(padded), jnp.asarray(lens), row_keys(seed, len(rows)), s,
                             k=2, mode=mode, max_len=64, out_len=None)

  state = state_of([[1], [1]], [specjax.GREEDY] * 2, 0)
  state = engine.put_rows(state, jnp.asarray([0, 1]), state_of(prompts, [specjax.GREEDY, settings], 3))
  step = jax.jit(lambda s: engine.round_step(s, target=target, proposer=proposer, k=2, mode=mode))
  got = [[], []]
  moved = False
  while not bool(np.all(np.asarray(state.done))):
    state, emitted, count = step(state)
    for r in range(state.done.shape[0]):
      row = r if not moved else 1
      got[row] += np.asarray(emitted.ids[r, :int(count[r])]).tolist()
    if not moved and bool(state.done[0]):
      state, moved = rows_of(state, [1]), True  # the second request alone, in a state of one row
  for b, (prompt, cfg) in enumerate(zip(prompts, [specjax.GREEDY, settings])):
    alone = specjax.generate(target, [prompt], sampling=cfg, max_new_tokens=12)
    assert got[b] == alone.rows()[0], b
