"""The head-kind registry (``specjax.models.heads.HEADS``): one table from kind to module class and proposer
method, read by building, loading, ``for_heads`` and the command lines; every kind round-trips through it."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax.cli
import specjax.loading
import specjax.proposers
import specjax.proposers.eagle
import specjax.proposers.medusa
import specjax.proposers.mtp
import specjax.train.cli
import specjax.train.ship
from helpers import SMALL, make_model
from specjax.loading import cast
from specjax.models.heads import (HEAD_METHODS, HEADS, KINDS, ChainHeadModule, HeadConfig, build_heads, kinds_of,
                                  load_heads, save_heads)
from specjax.proposers import PROPOSERS, for_heads

OPTIONS = {"medusa": {"num_heads": 3}, "eagle1": {}, "eagle3": {"draft_vocab_size": 20, "d2t": np.arange(20) * 3},
           "mtp": {"num_heads": 2}}


def test_every_kind_has_one_class_and_one_proposer():
  assert KINDS == tuple(HEADS) == tuple(OPTIONS)
  assert HEAD_METHODS == ("medusa", "eagle", "mtp")
  assert {method: kinds_of(method) for method in HEAD_METHODS} == {
      "medusa": ("medusa",), "eagle": ("eagle1", "eagle3"), "mtp": ("mtp",)}
  for kind, cls in HEADS.items():
    heads = build_heads(kind, SMALL, **OPTIONS[kind])
    assert type(heads) is cls and cls.kind == kind == heads.cfg.kind
    proposer = for_heads(heads)
    assert type(proposer) is PROPOSERS[cls.method] and proposer.name == cls.method
    proposer.check(SMALL, 16)  # the proposer accepts every kind the registry gives it
  assert specjax.proposers.Eagle.kinds == ("eagle1", "eagle3") and specjax.proposers.MTP.kinds == ("mtp",)
  with pytest.raises(ValueError, match="kind must be one of"):
    HeadConfig.for_target("hydra", SMALL)
  with pytest.raises(ValueError, match="Eagle3Head needs HeadConfig.kind 'eagle3', got 'eagle1'"):
    HEADS["eagle3"](HeadConfig.for_target("eagle1", SMALL), rngs=nnx.Rngs(0))


def test_the_readers_hold_no_kind_table_of_their_own():
  """The CLI, shipping, training CLI, loading and the proposers name no head kind or method list literally:
  they read the registry (a second table is where the two would drift apart)."""
  modules = (specjax.cli, specjax.train.cli, specjax.train.ship, specjax.loading, specjax.proposers,
             specjax.proposers.eagle, specjax.proposers.medusa, specjax.proposers.mtp)
  for module in modules:
    source = inspect.getsource(module)
    for literal in ('"eagle1"', '"eagle3"', '("medusa", "eagle", "mtp")', '{"eagle": "eagle1"}'):
      assert literal not in source, f"{module.__name__} spells {literal}"


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_round_trips_build_save_load_and_cast(kind, tmp_path):
  heads = build_heads(kind, SMALL, seed=4, **OPTIONS[kind])
  save_heads(tmp_path / kind, heads)
  for loaded in (load_heads(tmp_path / kind, SMALL), cast(load_heads(tmp_path / kind), "bfloat16")):
    assert type(loaded) is type(heads) and loaded.cfg.kind == kind
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(heads)), nnx.to_flat_state(nnx.state(loaded)),
                                 strict=True):
      a, b = np.asarray(a[...]), np.asarray(b[...])
      np.testing.assert_allclose(b.astype(a.dtype), a, rtol=1e-2, atol=1e-2, err_msg=str(path))
      if loaded.cfg.dtype == "float32" or not np.issubdtype(a.dtype, np.floating):
        np.testing.assert_array_equal(a, b, err_msg=str(path))


def test_chain_heads_score_their_own_vocabulary():
  """What the training losses read from a chain head: a reduced-vocabulary head (EAGLE-3) gives its draft
  logits and their target ids, and its full logits are those scattered to the ids (-inf elsewhere); every
  other chain head predicts over the target's vocabulary."""
  target = make_model()
  out = jax.random.normal(jax.random.key(0), (2, 3, SMALL.d_model))
  for kind in ("eagle1", "mtp"):
    heads = build_heads(kind, SMALL, **OPTIONS[kind])
    assert isinstance(heads, ChainHeadModule) and heads.vocab_map() is None
    np.testing.assert_array_equal(heads.draft_logits(0, target, out), heads.logits(0, target, out))
  assert HEADS["eagle1"].regresses_features and not HEADS["eagle3"].regresses_features
  assert build_heads("eagle3", SMALL).vocab_map() is None  # the whole vocabulary: nothing to restrict
  heads = build_heads("eagle3", SMALL, **OPTIONS["eagle3"])
  d2t = np.asarray(heads.vocab_map())
  np.testing.assert_array_equal(d2t, OPTIONS["eagle3"]["d2t"])
  small, full = heads.draft_logits(0, target, out), heads.logits(0, target, out)
  assert small.shape == (2, 3, 20) and full.shape == (2, 3, SMALL.vocab_size)
  np.testing.assert_array_equal(full[..., d2t], small)
  assert bool(jnp.all(jnp.isneginf(jnp.delete(full, d2t, axis=-1))))
