"""Heads trained on a frozen target: they learn the right offsets, raise τ, never move the target, resume
bit-identically, and refuse a checkpoint made for another target."""

from __future__ import annotations

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import specjax
from specjax import SpecConfig
from specjax.models import Llama, LlamaConfig
from specjax.proposers import for_heads
from specjax.train import config as config_lib
from specjax.train import heads as heads_lib
from specjax.train import trainer
from specjax.train.checkpoint import CheckpointError

V = 16
SHIFT = LlamaConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, d_ff=32, tie_embeddings=False, max_seq_len=128)


def shift_target() -> Llama:
  """A target whose next token is the current one plus 1 (mod V): the embedding is the identity, the block
  adds nothing, and the LM head is the shift permutation (sharpened by the final norm's scale)."""
  model = Llama(SHIFT, rngs=nnx.Rngs(0))
  model.embed[...] = jnp.eye(V)
  model.blocks[0].attn.wo[...] = jnp.zeros_like(model.blocks[0].attn.wo[...])
  model.blocks[0].mlp.w_down[...] = jnp.zeros_like(model.blocks[0].mlp.w_down[...])
  model.final_norm.scale[...] = jnp.full((V,), 1.0)
  model.lm_head[...] = jnp.roll(jnp.eye(V), 1, axis=1)  # row v -> column v + 1
  return model


def shift_rows(batch: int, length: int, seed: int) -> jnp.ndarray:
  starts = np.random.default_rng(seed).integers(0, V, (batch, 1))
  return jnp.asarray((starts + np.arange(length)[None, :]) % V, jnp.int32)


def train_heads(target, hcfg: heads_lib.HeadsConfig, steps: int, seed: int = 0):
  heads = hcfg.build(target.cfg, seed=seed)
  graphdef, params, rest = nnx.split(heads, nnx.Param, ...)
  # Copies: the step donates its parameters, and the untrained module must stay usable.
  params, rest = jax.tree.map(jnp.copy, nnx.to_pure_dict(params)), nnx.to_pure_dict(rest)
  optimizer = optax.adam(2e-2)
  opt_state = optimizer.init(params)
  tdef, tparams = nnx.split(target)
  tparams = nnx.to_pure_dict(tparams)
  for step in range(steps):
    params, opt_state, metrics = trainer.heads_train_step(
        graphdef, params, rest, opt_state, tdef, tparams, shift_rows(8, 33, step), jax.random.key(step),
        optimizer=optimizer, hcfg=hcfg)
  return heads, nnx.merge(graphdef, params, rest), metrics


def tau(target, heads, k: int = 4) -> float:
  prompts = [[3, 4, 5], [9], [0, 1, 2, 3, 4, 5, 6]]
  base = specjax.generate(target, prompts, max_new_tokens=24)
  out = specjax.generate(target, prompts, proposer=for_heads(heads), spec=SpecConfig(k=k), max_new_tokens=24)
  np.testing.assert_array_equal(out.tokens, base.tokens)
  return out.stats.mean_accepted_length


@pytest.mark.parametrize("hcfg", [
    heads_lib.HeadsConfig(kind="medusa", num_heads=4),
    heads_lib.HeadsConfig(kind="eagle1", n_heads=2, ttt_steps=2),
    heads_lib.HeadsConfig(kind="eagle3", n_heads=2, ttt_steps=3, draft_vocab_size=12),
    heads_lib.HeadsConfig(kind="mtp", num_heads=2, n_heads=2),
], ids=lambda c: c.kind)
def test_heads_learn_the_offsets_and_raise_tau(hcfg):
  """Medusa head j on h_t learns x_{t+2+j}; EAGLE on (h_t, x_{t+1}) learns x_{t+2}; MTP module d learns
  x_{t+d+2}: after a few dozen steps the offline greedy agreement of every position is high and τ measured
  by generate rises by at least 0.5 over the untrained head (fixed seeds)."""
  target = shift_target()
  untrained, trained, metrics = train_heads(target, hcfg, steps=40)
  agree = [float(v) for k, v in sorted(metrics.items()) if k.startswith("greedy_")]
  # EAGLE-3 proposes from 12 of the 16 ids: a quarter of the (uniform) targets lie outside its vocabulary.
  reachable = hcfg.draft_vocab_size / V if hcfg.draft_vocab_size else 1.0
  assert len(agree) >= 2 and min(agree) > 0.9 * reachable, agree
  before, after = tau(target, untrained), tau(target, trained)
  assert after >= before + 0.5, (before, after)


def test_ttt_mask_is_what_a_chain_proposal_sees():
  # Step 2, query 5: step-0 keys at positions <= 3 (the real prefix), the step-1 key at 4, its own at 5.
  vis = np.asarray(heads_lib.ttt_visible(8, 2))
  assert vis.shape == (8, 24)
  np.testing.assert_array_equal(np.nonzero(vis[5, :8])[0], [0, 1, 2, 3])
  np.testing.assert_array_equal(np.nonzero(vis[5, 8:16])[0], [4])
  np.testing.assert_array_equal(np.nonzero(vis[5, 16:])[0], [5])
  # MTP module 3 (0-based 3) at position 6 sees positions <= 4 and itself.
  np.testing.assert_array_equal(np.nonzero(np.asarray(heads_lib.depth_visible(8, 3))[6])[0], [0, 1, 2, 3, 4, 6])


def test_frequent_tokens_picks_the_most_common_ids():
  rows = np.array([[5, 5, 5, 2, 2, 9, 1], [2, 5, 7, 7, 7, 7, 0]])
  np.testing.assert_array_equal(heads_lib.frequent_tokens(rows, 10, 3), [2, 5, 7])


# ----------------------------------------------------------------------------------------- runs


def _doc(i: int, rng: np.random.Generator) -> str:
  names = ["alpha", "beta", "gamma", "delta", "value"]
  return "\n".join([f"def f_{i}({rng.choice(names)}):"] + [
      f"    {rng.choice(names)} = {rng.choice(names)} + {int(rng.integers(0, 9))}" for _ in range(4)]) + "\n"


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> pathlib.Path:
  """A tiny trained target run directory (corpus, BPE and export), as `specjax train target` makes it."""
  root = tmp_path_factory.mktemp("heads")
  corpus = root / "code.jsonl"
  rng = np.random.default_rng(0)
  corpus.write_text("".join(json.dumps({"text": _doc(i, rng)}) + "\n" for i in range(400)))
  cfg = config_lib.from_dict({
      "kind": "target",
      "model": {"vocab_size": 300, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 64},
      "data": {"corpus": str(corpus), "tokenizer_vocab": 300, "seq_len": 32, "batch_size": 4},
      "optim": {"lr": 1e-2, "warmup_steps": 2},
      "run": {"steps": 12, "eval_every": 12, "eval_batches": 1, "ckpt_every": 12, "log_every": 4, "progress": False}})
  trainer.fit(trainer.start(cfg, root / "target"))
  return root


def heads_config(root: pathlib.Path, kind: str = "eagle3", target=None, **run) -> config_lib.TrainConfig:
  return config_lib.from_dict({
      "kind": "heads",
      "heads": ({"kind": kind, "n_heads": 2, "d_model": 16, "draft_vocab_size": 200, "ttt_steps": 2}
                if kind == "eagle3" else {"kind": kind, "num_heads": 2, "n_heads": 2}),
      # Generated rows as long as corpus rows (9 + 24 = seq_len + 1): one compiled step serves both.
      "distill": {"target": str(target or root / "target"), "mix": {"corpus": 1.0, "target": 1.0}, "prefix_len": 9,
                  "gen_len": 24},
      "data": {"corpus": str(root / "code.jsonl"), "tokenizer_vocab": 300, "seq_len": 32, "batch_size": 4},
      "optim": {"lr": 1e-2, "warmup_steps": 2},
      "run": {"steps": 8, "eval_every": 4, "eval_batches": 1, "ckpt_every": 2, "keep": 2, "log_every": 2,
              "progress": False, **run}})


def test_heads_run_freezes_the_target_resumes_exactly_and_exports(tiny_target):
  before = dict(np.load(tiny_target / "target" / "model" / "params.npz"))
  full = trainer.fit(trainer.start(heads_config(tiny_target), tiny_target / "full"))
  # The target the run held is bit-identical to the export it was loaded from, and so is the export.
  teacher = jax.tree.leaves(full.teacher[1])
  loaded = jax.tree.leaves(nnx.to_pure_dict(nnx.split(trainer.load_target(tiny_target / "target")[0])[1]))
  assert all(np.array_equal(a, b) for a, b in zip(teacher, loaded, strict=True))
  after = dict(np.load(tiny_target / "target" / "model" / "params.npz"))
  assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
  # Interrupted after 4 steps, resumed: the same parameters as the uninterrupted run, bit for bit.
  trainer.fit(trainer.start(heads_config(tiny_target), tiny_target / "split"), stop_at=4)
  resumed = trainer.fit(trainer.start(heads_config(tiny_target), tiny_target / "split", resume=True))
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params),
                                                  strict=True))
  heads = specjax.models.heads.load_heads(tiny_target / "full" / "heads", trainer.load_target(tiny_target / "target")[0].cfg)
  assert heads.cfg.kind == "eagle3" and heads.cfg.draft_vocab_size == 200
  lines = [json.loads(line) for line in (tiny_target / "full" / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in lines if "valid_accept_1" in r]
  assert evals and {"valid_accept_2", "valid_greedy_1", "valid_tau_t1"} <= set(evals[-1])


def test_heads_checkpoint_for_another_target_is_refused(tiny_target, tmp_path):
  import shutil

  shutil.copytree(tiny_target / "target" / "model", tmp_path / "target" / "model")
  cfg = heads_config(tiny_target, target=tmp_path / "target", steps=4)
  trainer.fit(trainer.start(cfg, tmp_path / "run"), stop_at=2)
  # The same recipe and path, but the target there is now a wider model (same tokenizer).
  model, tok = trainer.load_target(tmp_path / "target")
  specjax.pretrained.save_model(tmp_path / "target" / "model", Llama(model.cfg.replace(d_model=48), rngs=nnx.Rngs(1)),
                                tok)
  with pytest.raises(CheckpointError, match=r"checkpoints/2 were built for a target with d_model=32, but this "
                                            r"target has d_model=48 \(HeadConfig.target_d_model\)"):
    trainer.start(cfg, tmp_path / "run", resume=True)


@pytest.mark.parametrize("raw,match", [
    ({"heads": {"kind": "hydra"}}, r"heads.kind must be one of"),
    ({"heads": {"kind": "medusa", "ttt_steps": 3}}, r"ttt_steps > 1 needs a chain head with one depth"),
    ({"heads": {"kind": "eagle3", "decay": 0.0}}, r"heads.decay must be a number > 0.0"),
    ({"heads": {"kind": "eagle3"}, "model": {"vocab_size": 300, "d_model": 8, "n_layers": 1, "n_heads": 1,
                                              "d_ff": 8}}, "takes no \\[model\\] section"),
    ({"heads": {"kind": "eagle3", "unknown": 1}}, r"unknown field heads.unknown"),
    ({"heads": {"kind": "eagle3", "init": 3}}, r"heads.init must be a model's short name or a head folder"),
    ({"heads": {"kind": "eagle3", "init": "x", "init_vocab": "fresh"}}, r"heads.init_vocab must be one of \('keep', 'data'\)"),
    ({"heads": {"kind": "eagle3", "init_vocab": "data"}}, r"heads.init_vocab = \"data\" .* needs heads.kind = \"eagle3\" "
                                                          r"and heads.init, got kind 'eagle3' and init ''"),
    ({}, r"a heads recipe needs a \[heads\] section"),
])
def test_bad_heads_recipes_are_named(raw, match):
  base = {"kind": "heads", "distill": {"target": "stdlib-coder"}, "data": {"tokenizer_vocab": 4096}}
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.from_dict({**base, **raw})


def test_heads_start_from_an_init_head_set_in_any_layout_and_refuse_one_that_does_not_fit(tiny_target, tmp_path):
  """heads.init: a run directory or its export gives the run's first parameters bit for bit (and its draft
  vocabulary); a shape field given must agree; a kind, path or name that holds no such head set is refused by
  field."""
  def with_heads(**fields):
    raw = heads_config(tiny_target, steps=4).to_dict()
    raw["heads"].update({"d_model": 32, **fields})  # the target's width: the published EAGLE-3 layout's
    return config_lib.from_dict(raw)

  first = trainer.fit(trainer.start(with_heads(), tmp_path / "first"))

  def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

  # A different seed would give other fresh parameters and another draft vocabulary would follow other data:
  # what the run starts from is the init's, in each layout.
  for i, init in enumerate((tmp_path / "first", tmp_path / "first" / "heads")):
    run = trainer.start(with_heads(init=str(init)), tmp_path / f"from{i}")
    assert same(run.params, first.params), init
    assert same(run.task.rest, first.task.rest), init  # EAGLE-3's d2t
  # Shape fields left at their defaults take the init's; a relative path is also read against the recipe's folder.
  run = trainer.start(with_heads(init="first", d_model=0, n_heads=0, draft_vocab_size=0), tmp_path / "relative",
                      config_dir=tmp_path)
  assert same(run.params, first.params)
  tuned = trainer.fit(run)
  assert not same(tuned.params, first.params)
  # Its metrics start with the init's own evaluation (step 0): the first run's last one, on the same rows.
  evals = lambda name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                        if "valid_loss" in line]
  start, last = evals("relative")[0], evals("first")[-1]
  assert start["step"] == 0 and last["step"] == 4 and evals("first")[0]["step"] == 4  # a fresh run: no step 0
  assert start["valid_loss"] == pytest.approx(last["valid_loss"], rel=1e-6)
  assert start["valid_tau_greedy"] == pytest.approx(last["valid_tau_greedy"], rel=1e-6)
  assert evals("relative")[-1]["step"] == 4

  # heads.init_vocab = "data": the draft vocabulary made again from the train split at a new size, every other
  # parameter the init's; the output columns of tokens in both vocabularies kept.
  refit = trainer.start(with_heads(init="first", draft_vocab_size=240, init_vocab="data"), tmp_path / "refit",
                        config_dir=tmp_path)
  d2t, old_d2t = np.asarray(refit.task.rest["d2t"]), np.asarray(first.task.rest["d2t"])
  np.testing.assert_array_equal(d2t, heads_lib.frequent_tokens(refit.batches.rows, 300, 240))
  assert set(old_d2t) < set(d2t)  # the first run's 200 are the 200 most frequent of the same rows
  new_w, old_w = np.asarray(refit.params["lm_head"]["w"]), np.asarray(first.params["lm_head"]["w"])
  np.testing.assert_array_equal(new_w[:, np.isin(d2t, old_d2t)], old_w)
  others = lambda p: {k: v for k, v in p.items() if k != "lm_head"}
  assert same(others(refit.params), others(first.params))

  init = str(tmp_path / "first")
  refused = {
      "heads.d_model = 24, but heads.init": with_heads(init=init, d_model=24, n_heads=2),
      "heads.draft_vocab_size = 100, but heads.init": with_heads(init=init, draft_vocab_size=100),
      "is a eagle3 head set, the recipe's heads.kind is 'mtp'": config_lib.from_dict({
          **heads_config(tiny_target, kind="mtp").to_dict(),
          "heads": {**heads_config(tiny_target, kind="mtp").to_dict()["heads"], "init": init}}),
      "is neither a model that ships heads": with_heads(init=str(tmp_path / "missing")),
      "holds no head set": with_heads(init=str(tiny_target / "target")),
  }
  for match, cfg in refused.items():
    with pytest.raises(config_lib.ConfigError, match=re.escape(match)):
      trainer.start(cfg, tmp_path / "refused")
  with pytest.raises(config_lib.ConfigError, match=r"heads.init = 'smollm2-135m-instruct': that model ships no "
                                                   r"medusa heads \(it ships eagle\)"):
    heads_lib.init_folder("smollm2-135m-instruct", "medusa")
  assert heads_lib.init_folder("smollm2-135m-instruct", "eagle3").name == "eagle"


def test_refit_vocab_keeps_shared_columns_and_predicts_new_ones_from_the_targets_embeddings():
  """refit_vocab: a column of a token in both vocabularies is kept bit for bit, a new token's is what a linear
  map of the target's embeddings gives where the head's columns follow one (R^2 ~ 1), every other parameter is
  the same, and the new head proposes only the new vocabulary. On columns that follow no map, R^2 says so."""
  from specjax.models.heads import build_heads

  target_cfg = LlamaConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=64)
  target = Llama(target_cfg, rngs=nnx.Rngs(0))
  old = np.arange(0, 64, 2, dtype=np.int32)  # the even ids
  head = build_heads("eagle3", target_cfg, seed=3, n_heads=2, d_model=8, draft_vocab_size=32, d2t=old)
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
  embeds = np.asarray(target.embed_tokens(jnp.arange(64)[None]), np.float32)[0]  # [64, 16]
  head.lm_head.w[...] = jnp.asarray((embeds[old] @ a + b).T)  # [8, 32]: the columns a linear map of the embeddings
  new = np.sort(np.concatenate([old[:20], np.arange(1, 24, 2)])).astype(np.int32)  # 20 kept, 12 odd ids new
  refit, fit = heads_lib.refit_vocab(head, target, new, ridge=1e-6)
  assert (fit["kept"], fit["new"]) == (20, 12) and fit["r2"] > 0.999
  np.testing.assert_array_equal(np.asarray(refit.d2t[...]), new)
  w = np.asarray(refit.lm_head.w[...])
  kept = np.isin(new, old)
  np.testing.assert_array_equal(w[:, kept], np.asarray(head.lm_head.w[...])[:, np.isin(old, new)])
  np.testing.assert_allclose(w[:, ~kept], (embeds[new[~kept]] @ a + b).T, rtol=1e-3, atol=1e-3)
  flat = lambda m: {p: v[...] for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param)) if p[0] != "lm_head"}
  before, after = flat(head), flat(refit)
  assert before.keys() == after.keys() and all(np.array_equal(before[p], after[p]) for p in before)
  logits = np.asarray(refit.logits(0, target, jnp.ones((1, 8), jnp.float32)))[0]
  assert np.isfinite(logits[new]).all() and np.isneginf(np.delete(logits, new)).all()
  head.lm_head.w[...] = jnp.asarray(rng.standard_normal((8, 32)), head.lm_head.w[...].dtype)  # no map to find
  assert heads_lib.refit_vocab(head, target, new)[1]["r2"] < 0.5


def test_heads_init_reads_a_published_eagle3_folder(tmp_path):
  """A head in the layout vLLM and SGLang load (three fused layers, the target's width) is a run's start too."""
  from specjax import head_formats
  from specjax.models.heads import build_heads

  target_cfg = LlamaConfig(vocab_size=64, d_model=16, n_layers=4, n_heads=2, d_ff=32, max_seq_len=64)
  published = build_heads("eagle3", target_cfg, seed=3, n_heads=2, draft_vocab_size=32,
                          d2t=np.arange(0, 64, 2, dtype=np.int32))
  assert head_formats.save_published(tmp_path / "eagle3", published) == "eagle3"
  started = heads_lib.initial_heads(heads_lib.HeadsConfig(kind="eagle3", init=str(tmp_path / "eagle3")), target_cfg,
                                    seed=0)
  want, got = nnx.to_flat_state(nnx.state(published)), nnx.to_flat_state(nnx.state(started))
  assert [p for p, _ in want] == [p for p, _ in got]
  assert all(np.array_equal(a[...], b[...]) for (_, a), (_, b) in zip(want, got, strict=True))
  with pytest.raises(config_lib.ConfigError, match=r"heads.n_heads = 4, but heads.init = .* has 2"):
    heads_lib.initial_heads(heads_lib.HeadsConfig(kind="eagle3", n_heads=4, init=str(tmp_path / "eagle3")),
                            target_cfg, seed=0)


def test_eval_reports_every_proposer_side_by_side(tiny_target, tmp_path):
  """`specjax eval` on a draft, a trained head set and the n-gram lookup: offline estimates (per position for
  heads), measured acceptance by position and τ, cost from the calibrated model, speed; one table row each."""
  from specjax.train import evaluate

  run = trainer.fit(trainer.start(heads_config(tiny_target, kind="mtp", steps=4), tmp_path / "mtp"))
  cfg = evaluate.EvalConfig(target=str(tiny_target / "target"), drafts={"self": str(tiny_target / "target")},
                            heads={"mtp": str(run.out)}, ngram=True, corpus=str(tiny_target / "code.jsonl"),
                            n_prompts=2, prompt_len=8, max_new_tokens=8, k=2, text_rows=4, seq_len=32,
                            speed_prompts=1)
  results = evaluate.run_eval(cfg, out=tmp_path / "eval.json")
  assert set(results) == {"config", "target", "self", "mtp", "ngram"}
  assert results["self"]["generate"]["t0"]["acceptance_rate"] == 1.0  # the target as its own draft
  mtp = results["mtp"]
  assert len(mtp["accept_estimate_t1_by_position"]) == 2 and 1.0 <= mtp["tau_estimate_t1"] <= 3.0
  assert len(mtp["generate"]["t1"]["acceptance_by_position"]) == 2
  for r in (results["self"], mtp, results["ngram"]):
    assert r["cost"]["propose_k_over_target_step"] > 0 and r["speed"]["t0"]["greedy_outputs_equal"]
  table = evaluate.summary_table(results)
  assert table.count("\n| ") == 3 and "| mtp |" in table  # one row per proposer


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_cached_target_outputs_give_the_losses_of_the_live_target(kind):
  """Cached outputs (bfloat16 features; dense, or the top-k of each distribution) give the losses the
  live target gives, within bfloat16 / truncation tolerance; top-k over the whole vocabulary is dense."""
  target = shift_target()
  hcfg = heads_lib.HeadsConfig(kind=kind, n_heads=2, num_heads=2, ttt_steps=2 if kind == "eagle3" else 1,
                               draft_vocab_size=12 if kind == "eagle3" else 0)
  heads = hcfg.build(target.cfg, seed=1)
  rows = jnp.asarray(np.random.default_rng(0).integers(0, V, (4, 17)), jnp.int32)
  tdef, tparams = nnx.split(target)
  live = heads_lib.head_loss(heads, target, hcfg, rows, jax.random.key(0))[1]
  for top_k in (0, V, 4):
    cached = trainer.target_outputs(tdef, tparams, rows, aux_layers=heads.cfg.aux_layers, top_k=top_k)
    got = heads_lib.head_loss(heads, target, hcfg, rows, jax.random.key(0), cached)[1]
    assert float(got["greedy_1"]) == float(live["greedy_1"])  # the top token is kept
    if top_k == 4:  # truncated: a lower bound of the acceptance, a loss over renormalised labels
      assert float(got["accept_1"]) <= float(live["accept_1"]) + 1e-6
      continue
    for name in ("loss_1", "loss_2", "accept_1"):
      assert abs(float(got[name]) - float(live[name])) <= 0.02 * max(1.0, abs(float(live[name]))), (top_k, name)


def test_reduced_vocabulary_losses_match_the_dense_reference():
  """A reduced-vocabulary head's loss and metrics, computed over its own vocabulary and (top-k labels) without
  a one-hot: equal to the dense formulas (labels scattered into the draft vocabulary; logits scattered into the
  target's, -inf elsewhere) within float32 tolerance, for top-k and dense labels, tokens outside included."""
  rng = np.random.default_rng(0)
  vocab, draft, k = 40, 12, 6
  d2t = jnp.asarray(np.sort(rng.choice(vocab, draft, replace=False)), jnp.int32)
  dense = jax.nn.softmax(jnp.asarray(rng.normal(size=(3, 5, vocab)) * 3, jnp.float32), -1)
  dense = dense.at[0, 0].set(jax.nn.one_hot(int(d2t[0]), vocab))  # a position whose labels all lie inside
  dense = dense.at[0, 1, d2t].set(0.0)  # and one whose labels all lie outside
  probs, ids = jax.lax.top_k(dense, k)
  draft_logits = jnp.asarray(rng.normal(size=(3, 5, draft)) * 2, jnp.float32)
  full_logits = jnp.full((3, 5, vocab), -jnp.inf).at[..., d2t].set(draft_logits)
  t2d = {int(t): i for i, t in enumerate(np.asarray(d2t))}
  onehot = np.zeros((3, 5, k, draft), np.float32)  # the reference: the one-hot the top-k labels no longer build
  for idx in np.ndindex(3, 5, k):
    if int(ids[idx]) in t2d:
      onehot[idx + (t2d[int(ids[idx])],)] = 1.0
  ref = np.einsum("abk,abkv->abv", np.asarray(probs), onehot)
  ref = ref / np.maximum(ref.sum(-1, keepdims=True), 1e-9)
  for p in ((probs, ids), dense):
    restricted, inside = heads_lib._restrict(p, d2t, vocab)
    want = ref if isinstance(p, tuple) else np.asarray(dense)[..., np.asarray(d2t)] / np.maximum(
        np.asarray(dense)[..., np.asarray(d2t)].sum(-1, keepdims=True), 1e-9)
    np.testing.assert_allclose(heads_lib._soft_ce(restricted, draft_logits),
                               heads_lib._soft_ce(jnp.asarray(want), draft_logits), rtol=1e-5, atol=1e-6)
    assert np.asarray(inside).tolist() == np.isin(np.argmax(dense, -1), np.asarray(d2t)).astype(float).tolist()
    got, want = heads_lib._draft_acceptance(p, draft_logits, d2t, vocab), heads_lib._acceptance(p, full_logits)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert np.asarray(got[1]).tolist() == np.asarray(want[1]).tolist()
  assert float(heads_lib._soft_ce(heads_lib._restrict((probs, ids), d2t, vocab)[0], draft_logits)[0, 1]) == 0.0


def test_a_stopped_run_exports_its_newest_checkpoint(tiny_target, tmp_path, capsys):
  """`specjax train heads --export-checkpoint`: the heads of the newest checkpoint, without training on."""
  from specjax.train import cli as train_cli

  stopped = trainer.fit(trainer.start(heads_config(tiny_target), tmp_path / "run"), stop_at=4)  # ckpt at 4
  config = tmp_path / "heads.json"
  config.write_text(json.dumps(heads_config(tiny_target).to_dict()))
  assert train_cli.main(["train", "heads", "--config", str(config), "--out", str(tmp_path / "run"),
                         "--export-checkpoint"]) == 0
  assert "exported step 4/8" in capsys.readouterr().out
  target = trainer.load_target(tiny_target / "target")[0]
  heads = specjax.models.heads.load_heads(tmp_path / "run" / "heads", target.cfg)
  exported = jax.tree.leaves(nnx.to_pure_dict(nnx.split(heads, nnx.Param, ...)[1]))
  assert all(np.array_equal(a, b) for a, b in zip(exported, jax.tree.leaves(stopped.params), strict=True))
  assert train_cli.main(["train", "heads", "--config", str(config), "--out", str(tmp_path / "none"),
                         "--export-checkpoint"]) != 0
  assert "holds no checkpoint" in capsys.readouterr().err


def test_kept_target_outputs_are_reused_only_for_the_same_rows_target_and_recipe(tmp_path, monkeypatch, capsys):
  """`heads.cache_features` keeps the target's outputs in the run folder: a resumed run reads them back after
  recomputing one batch, and recomputes everything when the rows, the target or `top_k` differ, or the file
  is cut. What comes back equals what a fresh computation gives, bfloat16 leaves included."""
  computed = []
  real = trainer.cache_outputs
  monkeypatch.setattr(trainer, "cache_outputs", lambda teacher, rows, *a: computed.append(len(rows)) or
                      real(teacher, rows, *a))

  def leaves(out):
    return {k: np.asarray(v) for k, v in vars(out).items() if v is not None}

  def same(a, b):
    a, b = leaves(a), leaves(b)
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)

  teacher = tuple(nnx.split(shift_target()))
  other = tuple(nnx.split(Llama(SHIFT, rngs=nnx.Rngs(7))))
  rows = np.asarray(np.random.default_rng(0).integers(0, V, (10, 17)), np.int32)
  path = tmp_path / "target_features.train.npz"
  keep = lambda t, r, k=4: trainer.kept_outputs(t, r, (0,), k, 4, path)

  first = keep(teacher, rows)
  assert computed == [10] and path.exists() and not path.with_name(path.name + ".partial").exists()
  assert first.hidden.dtype == jnp.bfloat16 and first.ids is not None
  assert same(keep(teacher, rows), first) and computed == [10, 4]  # read back after one batch
  assert "read from" in capsys.readouterr().out
  assert same(keep(teacher, rows[::-1].copy()), real(teacher, rows[::-1].copy(), (0,), 4, 4))
  assert computed[2:] == [10]  # other rows: recomputed
  keep(teacher, rows)
  computed.clear()
  assert same(keep(other, rows), real(other, rows, (0,), 4, 4)) and computed == [4, 10]  # another target
  computed.clear()
  assert same(keep(other, rows, 8), real(other, rows, (0,), 8, 4)) and computed == [4, 10]  # another top_k
  assert "recomputing" in capsys.readouterr().out
  path.write_bytes(path.read_bytes()[:100])  # cut
  computed.clear()
  assert same(keep(teacher, rows), first) and computed == [10]
  assert "unreadable" in capsys.readouterr().out
  assert same(trainer.kept_outputs(teacher, rows, (0,), 4, 4, None), first)


def test_target_outputs_killed_mid_cache_resume_from_the_parts_kept(tmp_path, monkeypatch, capsys):
  """While the cache is computed, every `keep_every` batches go to a part file: a run killed mid-cache resumes
  from the parts (after one batch's check), and gets what a fresh computation gives; parts of other rows are
  recomputed, parts made by another target are removed from the first one checked on; once whole, the parts
  are gone."""
  real, computed, fail_at = trainer.cache_outputs, [], [None]

  def counted(teacher, rows, *a):
    if fail_at[0] is not None and len(computed) == fail_at[0]:
      raise KeyboardInterrupt("killed")
    computed.append(len(rows))
    return real(teacher, rows, *a)

  monkeypatch.setattr(trainer, "cache_outputs", counted)

  def same(a, b):
    a, b = ({k: np.asarray(v) for k, v in vars(x).items() if v is not None} for x in (a, b))
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)

  teacher = tuple(nnx.split(shift_target()))
  other = tuple(nnx.split(Llama(SHIFT, rngs=nnx.Rngs(7))))
  rows = np.asarray(np.random.default_rng(1).integers(0, V, (10, 17)), np.int32)
  path = tmp_path / "target_features.train.npz"
  parts = lambda: sorted(p.name.rsplit("-", 1)[1] for p in tmp_path.glob("*.part-*"))
  keep = lambda t, r: trainer.kept_outputs(t, r, (0,), 4, 2, path, keep_every=1)  # parts of 2 rows: 5

  def killed(t, r, after: int):
    computed.clear()
    fail_at[0] = after
    with pytest.raises(KeyboardInterrupt):
      keep(t, r)
    fail_at[0] = None
    computed.clear()

  killed(teacher, rows, 2)
  assert parts() == ["00000", "00001"] and not path.exists()
  assert same(keep(teacher, rows), real(teacher, rows, (0,), 4, 2))
  assert computed == [2, 2, 2, 2]  # the check of the first part, then the three parts left
  assert "2 of 5 parts read back" in capsys.readouterr().out and parts() == [] and path.exists()
  path.unlink()
  killed(teacher, rows, 3)  # three parts kept by this target ...
  assert same(keep(other, rows), real(other, rows, (0,), 4, 2))  # ... resumed by another: all recomputed
  assert computed == [2] + [2] * 5 and "made by another target" in capsys.readouterr().out and parts() == []
  path.unlink()
  killed(teacher, rows, 2)
  moved = rows[::-1].copy()  # other rows in every part: recomputed, no check
  assert same(keep(teacher, moved), real(teacher, moved, (0,), 4, 2)) and computed == [2] * 5
  with pytest.raises(ValueError, match="keep_every must be an integer >= 1"):
    trainer.kept_outputs(teacher, rows, (0,), 4, 2, tmp_path / "x.npz", keep_every=0)
