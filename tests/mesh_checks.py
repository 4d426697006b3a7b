"""Checks on 8 devices, run by ``tests/test_sharding.py`` in one subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the main pytest process keeps its one device).

Tiny models (vocabulary 64, width 32, 16 query heads over 8 KV heads) so that every mesh of 8 devices
divides them; one reference run per proposer on one device, then every mesh. The last check starts two
processes of 4 devices each (``tests/multihost_worker.py``): a multi-host run on one machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import perturbed_copy, start_state
from specjax import sharding
from specjax.models import Llama, LlamaConfig
from specjax.models.heads import HeadConfig, MedusaHeads, build_heads
from specjax.proposers import MTP, DraftModel, Eagle, Medusa, NGram
from specjax.runtime import RUNTIME
from specjax.config import GREEDY
from specjax.sampling import Mode, RowSettings, row_keys

CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=16, n_kv_heads=8, head_dim=4, d_ff=64,
                  max_seq_len=128)
# Every mesh runs the draft model, the n-gram proposer and one kind of head (each kind on a tensor-parallel
# mesh; one compiled program per mesh and proposer is what the time of this file goes to).
MESHES = {"data=1,model=8": "mtp", "data=2,model=4": "eagle3", "data=4,model=2": "medusa", "data=8,model=1": "eagle3"}
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(0, 64, n)]
           for i, n in enumerate((3, 9, 5, 12, 4, 7, 10, 2))]
NEW = 12
SAMPLE = specjax.SamplingConfig(temperature=1.0, top_k=20, top_p=0.9)
HERE = pathlib.Path(__file__).parent


def test_runs_on_eight_devices():
  assert jax.device_count() == 8


class Models:
  """A target and one proposer of each kind (or of the kinds named); ``generate(mesh=)`` moves them onto each
  mesh in turn."""

  def __init__(self, cfg: LlamaConfig = CFG, kinds: tuple[str, ...] = ("draft", "ngram", "medusa", "eagle3", "mtp")):
    self.target = Llama(cfg, rngs=nnx.Rngs(0))
    make = {
        "draft": lambda: DraftModel(perturbed_copy(self.target, scale=0.3, seed=1)),
        "ngram": lambda: NGram(n_max=2),
        "medusa": lambda: Medusa(MedusaHeads(HeadConfig.for_target("medusa", cfg, num_heads=4), rngs=nnx.Rngs(2),
                                             zero_init=False)),
        "eagle3": lambda: Eagle(build_heads("eagle3", cfg, seed=3, draft_vocab_size=32, d2t=np.arange(0, 64, 2))),
        "mtp": lambda: MTP(build_heads("mtp", cfg, seed=4, num_heads=2)),
    }
    self.proposers = {kind: make[kind]() for kind in kinds}

  def run(self, name: str | None, mesh=None, sampling=specjax.GREEDY, **kw):
    proposer = None if name is None else self.proposers[name]
    spec = specjax.SpecConfig(k=3 if proposer is not None else 0)
    return specjax.generate(self.target, PROMPTS, proposer=proposer, spec=spec, sampling=sampling,
                            max_new_tokens=NEW, seed=7, mesh=mesh, **kw)


@pytest.fixture(scope="module")
def models() -> Models:
  return Models()


@pytest.fixture(scope="module")
def reference(models) -> dict:
  """One-device outputs, computed before any model is placed on a mesh."""
  out = {name: models.run(name).tokens for name in models.proposers}
  out["draft sampled"] = models.run("draft", sampling=SAMPLE).tokens
  return out


@pytest.mark.parametrize("mesh_text", MESHES)
def test_greedy_on_every_mesh_equals_one_device(models, reference, mesh_text):
  mesh = sharding.make_mesh(mesh_text)
  for name in ("draft", "ngram", MESHES[mesh_text]):
    out = models.run(name, mesh)
    np.testing.assert_array_equal(out.tokens, reference[name], err_msg=f"{name} on {mesh_text}")
    assert isinstance(out.tokens, np.ndarray) and out.stats.new_tokens == len(PROMPTS) * NEW
  # Another call on the same mesh: no new trace, no second placement (the weights stay the same arrays).
  traces, weights = dict(specjax.decode.TRACE_COUNTS), models.target.embed.get_raw_value()
  models.run("draft", jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=mesh.axis_types))
  assert specjax.decode.TRACE_COUNTS == traces and models.target.embed.get_raw_value() is weights


def test_sampling_with_a_seed_equals_one_device(models, reference):
  """Top-k and top-p over a vocabulary split 4 ways, the acceptance draws and the residual: the same tokens."""
  out = models.run("draft", sharding.make_mesh("data=2,model=4"), sampling=SAMPLE)
  np.testing.assert_array_equal(out.tokens, reference["draft sampled"])


def test_a_users_own_mesh_and_rules(models, reference):
  """A mesh from ``jax.make_mesh`` (Explicit axes, used as Auto) and rules that split the width over ``data``
  too (FSDP-style weights): the same tokens, the weights placed as those rules say."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  out = models.run("draft", mesh, rules=sharding.ShardingRules(embed="data"))
  np.testing.assert_array_equal(out.tokens, reference["draft"])
  assert _spec(models.target.blocks[0].attn.wq[...]) == ("data", "model", None)
  assert _spec(models.proposers["draft"].model.blocks[0].mlp.w_down[...]) == ("model", "data")


def _spec(array) -> tuple:
  """A sharding's spec padded with None to the array's rank (``P('model')`` == ``P('model', None)``)."""
  spec = tuple(array.sharding.spec)
  return spec + (None,) * (array.ndim - len(spec))


def _expected(rules: sharding.ShardingRules, var) -> tuple:
  spec = tuple(rules.spec(sharding.logical_axes(var)))
  return spec + (None,) * (np.ndim(var.get_value()) - len(spec))


def test_parameters_and_caches_are_sharded_as_the_rules_say(models):
  mesh = sharding.make_mesh("data=2,model=4")
  placement = sharding.Placement.create(mesh)
  models.run("eagle3", mesh)
  models.run("draft", mesh)
  target, draft = models.target, models.proposers["draft"].model
  # Spot checks against the rules table written out by hand, then every variable against the rules.
  assert _spec(target.embed[...]) == ("model", None)
  assert _spec(target.blocks[0].attn.wq[...]) == (None, "model", None)
  assert _spec(target.blocks[0].attn.wk[...]) == (None, "model", None)
  assert _spec(target.blocks[0].attn.wo[...]) == ("model", None, None)
  assert _spec(target.blocks[0].mlp.w_up[...]) == (None, "model")
  assert _spec(target.blocks[0].mlp.w_down[...]) == ("model", None)
  assert _spec(target.final_norm.scale[...]) == (None,)
  assert _spec(models.proposers["eagle3"].heads.lm_head.w[...]) == (None, "model")
  for role, module in (("target", target), ("draft", draft), ("eagle3", models.proposers["eagle3"].heads)):
    for path, var in nnx.to_flat_state(nnx.state(module)):
      assert len(var.get_value().sharding.device_set) == 8, (role, path)
      assert _spec(var.get_value()) == _expected(placement.rules, var), (role, path)

  # The caches the program builds: rows over data, KV heads over model.
  tdef, tstate = nnx.split(target)
  template, pdefs, pstates = models.proposers["draft"].split(nnx.split)
  prompts = placement.put(np.ones((8, 16), np.int32), sharding.TOKENS)
  lens = placement.put(np.full((8,), 5, np.int32), sharding.ROWS)

  @jax.jit
  def init(tstate, pstates, prompts, lens):
    with sharding.activate(placement):
      return start_state(nnx.merge(tdef, tstate), template.bind(pdefs, pstates), prompts, lens, k=3, max_new=4)[0]

  state = init(tstate, pstates, prompts, lens)
  for cache in (state.target_cache, state.proposer.cache):
    for buf in cache.k + cache.v:
      assert _spec(buf) == ("data", None, "model", None)
    assert _spec(cache.lengths) == ("data",)


def _all_gathers(hlo: str) -> list[tuple[int, ...]]:
  """Result shapes of the all-gathers in compiled HLO text."""
  shapes = []
  for line in hlo.splitlines():
    m = re.search(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*?\ball-gather(?:-start)?\(", line)
    if m:
      shapes.append(tuple(int(d) for d in m.group(2).split(",") if d))
  return shapes


def test_compiled_loop_gathers_no_weight(models):
  mesh = sharding.make_mesh("data=2,model=4")
  placement = sharding.Placement.create(mesh)
  weights = set()
  for module in (models.target, models.proposers["draft"].model, models.proposers["eagle3"].heads):
    for _, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
      if np.ndim(var.get_value()) >= 2:
        shape = tuple(np.shape(var.get_value()))
        weights |= {shape, tuple(sorted(shape)), (int(np.prod(shape[:-1])), shape[-1]),
                    (shape[0], int(np.prod(shape[1:])))}
  gathered = {}
  for name in ("draft", "eagle3"):
    models.run(name, mesh)  # places the models and compiles the program
    program = next(v[0] for k, v in RUNTIME.programs._data.items()
                   if k[0] == "generate" and k[-1] == placement and k[2] is not None
                   and k[2][0] is type(models.proposers[name]))
    tdef, tstate = nnx.split(models.target)
    template, pdefs, pstates = models.proposers[name].split(nnx.split)
    padded, lens = specjax.decode.prepare_prompts(PROMPTS)
    settings = RowSettings.of([GREEDY] * len(PROMPTS), [4] * len(PROMPTS), [()] * len(PROMPTS), CFG.vocab_size,
                              Mode.of([GREEDY]))
    hlo = program.lower(tstate, pstates, placement.put(padded, sharding.TOKENS), placement.put(lens, sharding.ROWS),
                        row_keys(0, len(PROMPTS)), settings).compile().as_text()
    gathered[name] = _all_gathers(hlo)
    assert "all-reduce" in hlo, "tensor parallelism all-reduces activations"
    bad = [s for s in gathered[name] if s in weights or tuple(sorted(s)) in weights]
    assert not bad, f"{name}: all-gathers of weight-shaped arrays {bad} (all: {gathered[name]})"
  print("all-gathers", json.dumps({k: [list(s) for s in v] for k, v in gathered.items()}))


@pytest.mark.parametrize("field,value,rules,numbers", [
    ("n_kv_heads", dict(n_heads=8, n_kv_heads=4), None, ("size 8", "n_kv_heads = 4")),
    ("n_heads", dict(n_heads=4, n_kv_heads=4), sharding.ShardingRules(kv_heads=None), ("size 8", "n_heads = 4")),
    ("vocab_size", dict(vocab_size=60), None, ("size 8", "vocab_size = 60")),
])
def test_a_mesh_axis_that_does_not_divide_is_one_clear_error(field, value, rules, numbers):
  target = Llama(CFG.replace(**value), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=field) as err:
    specjax.generate(target, [[1, 2, 3]] * 8, max_new_tokens=2, mesh=sharding.make_mesh("data=1,model=8"),
                     rules=rules)
  assert all(n in str(err.value) for n in numbers), str(err.value)
  assert "'model'" in str(err.value)


def test_a_batch_the_data_axis_does_not_divide_is_one_clear_error(models):
  with pytest.raises(ValueError, match=r"'data' \(size 4\) does not divide batch = 3"):
    specjax.generate(models.target, PROMPTS[:3], max_new_tokens=2, mesh=sharding.make_mesh("data=4,model=2"))


def test_command_line_generates_on_a_mesh(capsys):
  from specjax.cli import main

  argv = ["generate", "--prompt", "def f(x):", "--random-init", "--method", "ngram", "--json", "--max-new-tokens",
          "6", "--batch", "4"]
  assert main(argv + ["--mesh", "data=4"]) == 0
  sharded = json.loads(capsys.readouterr().out)
  assert main(argv) == 0
  assert sharded["tokens"] == json.loads(capsys.readouterr().out)["tokens"]


def test_bfloat16_speculation_on_a_mesh_equals_bfloat16_without():
  """A bfloat16 target with a bfloat16 draft model and EAGLE-3 head set: token for token its own greedy output."""
  cfg = CFG.replace(dtype="bfloat16", param_dtype="bfloat16")
  bf16 = Models(cfg, kinds=("draft", "eagle3"))
  mesh = sharding.make_mesh("data=2,model=4")
  base = bf16.run(None, mesh).tokens
  for name in bf16.proposers:
    np.testing.assert_array_equal(bf16.run(name, mesh).tokens, base, err_msg=name)
  for module in (bf16.target, bf16.proposers["draft"].model, bf16.proposers["eagle3"].heads):
    assert {x.dtype for x in jax.tree.leaves(nnx.state(module, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}


def test_quantized_speculation_on_a_mesh_equals_one_device_quantized_greedy():
  """An int4 target (groups of 4, so that every shard of the MLP width holds whole groups) with a draft model:
  greedy speculation on a tensor-parallel mesh gives the quantized target's own one-device greedy tokens; codes,
  scales and minima are split along the float weight's axes. Groups a shard would cut (16 over the MLP width of 64
  split 8 ways) are refused by name; a per-channel int8 weight split along its contracting axis keeps its scales
  whole on every device and computes the one-device logits."""
  from helpers import full_logits
  from specjax.quant import QuantizedArray, quantize

  floats = Llama(CFG, rngs=nnx.Rngs(0))  # not the shared models: those have been on meshes already
  target = quantize(floats, "int4", group=4)
  draft = DraftModel(quantize(perturbed_copy(floats, scale=0.3, seed=1), "int4", group=4))
  base = specjax.generate(target, PROMPTS, max_new_tokens=NEW)
  mesh = sharding.make_mesh("data=2,model=4")
  spec = specjax.generate(target, PROMPTS, proposer=draft, spec=specjax.SpecConfig(k=3), max_new_tokens=NEW,
                          mesh=mesh)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  assert 0 < spec.stats.accepted_tokens < spec.stats.drafted_tokens
  w_down, wq = target.blocks[0].mlp.w_down.get_value(), target.blocks[0].attn.wq.get_value()
  assert isinstance(w_down, QuantizedArray) and w_down.bits == 4
  assert _spec(w_down.q) == _spec(w_down.scale) == _spec(w_down.low) == ("model", None)
  assert _spec(wq.q) == _spec(wq.scale) == (None, "model", None)

  with pytest.raises(ValueError, match=r"parameter blocks/0/mlp/w_down.*mesh axis 'model' \(size 8\) splits the "
                                       r"quantized weight's contracting axis \(d_ff = 64, logical axis 'mlp'\) into "
                                       r"slices of 8, which would cut its groups of 16"):
    specjax.generate(quantize(floats, "int4", group=16), PROMPTS, max_new_tokens=2,
                     mesh=sharding.make_mesh("data=1,model=8"))

  per_channel = quantize(floats, "int8")
  tokens = np.asarray(PROMPTS[1])[None]
  want = full_logits(per_channel, tokens)
  sharding.Placement.create(sharding.make_mesh("data=1,model=8")).place(per_channel, "target")
  w = per_channel.blocks[0].mlp.w_down.get_value()
  assert w.group == 64 and _spec(w.q) == ("model", None) and _spec(w.scale) == (None, None)
  np.testing.assert_allclose(full_logits(per_channel, tokens), want, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------ training


def _corpus(path: pathlib.Path) -> pathlib.Path:
  rng = np.random.default_rng(0)
  names = ["alpha", "beta", "gamma", "value", "items", "count"]
  docs = [f"def f_{i}({rng.choice(names)}):\n    return {rng.choice(names)} + {int(rng.integers(0, 99))}\n"
          for i in range(400)]
  path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  return path


def _train_config(corpus: pathlib.Path):
  from specjax.train import config as config_lib

  return config_lib.from_dict({
      "kind": "target",
      "model": {"vocab_size": 320, "d_model": 32, "n_layers": 1, "n_heads": 4, "d_ff": 64, "max_seq_len": 32},
      "data": {"corpus": str(corpus), "tokenizer_vocab": 320, "seq_len": 16, "batch_size": 8, "seed": 0},
      "optim": {"lr": 1e-2, "warmup_steps": 1},
      "run": {"steps": 6, "eval_every": 6, "eval_batches": 1, "ckpt_every": 6, "keep": 2, "log_every": 1,
              "progress": False},
  })


def _losses(out: pathlib.Path) -> np.ndarray:
  lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  return np.array([r["loss"] for r in lines if "loss" in r])


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
  """A target trained 6 steps on one device: its recipe, its folder (the exported model) and loss curve."""
  from specjax.train import trainer

  tmp = tmp_path_factory.mktemp("train")
  cfg = _train_config(_corpus(tmp / "code.jsonl"))
  trainer.fit(trainer.start(cfg, tmp / "one"))
  return cfg, tmp / "one", _losses(tmp / "one")


def test_training_on_meshes_follows_the_one_device_loss_curve_and_checkpoints_move_between_meshes(
    tmp_path, one_device_run):
  from specjax.train import trainer

  cfg, one_dir, one = one_device_run

  # Data parallel on 8 x 1 for three steps; its checkpoint resumed on 2 x 4 (tensor and data parallel).
  dp = trainer.start(cfg, tmp_path / "mesh", mesh=sharding.make_mesh("data=8"))
  trainer.fit(dp, stop_at=3, export=False)
  np.testing.assert_allclose(_losses(tmp_path / "mesh"), one[:3], rtol=1e-5)
  assert _spec(dp.params["embed"]) == (None, None) and len(dp.params["embed"].sharding.device_set) == 8
  # A heads run's cached target outputs (a pytree, some fields None) are split by rows like its batches.
  from specjax.train.heads import TargetOutputs

  cached = trainer._on_devices(dp.placement, TargetOutputs(probs=np.ones((8, 5, 4), np.float32), ids=None,
                                                           hidden=np.ones((8, 5, 32), np.float32), aux=None))
  assert cached.ids is None and cached.aux is None
  assert _spec(cached.probs) == ("data", None, None) and _spec(cached.hidden) == ("data", None, None)
  moved = trainer.start(cfg, tmp_path / "mesh", resume=True, mesh=sharding.make_mesh("data=2,model=4"))
  assert moved.step == 3
  for a, b in zip(jax.tree.leaves((moved.params, moved.opt_state)), jax.tree.leaves((dp.params, dp.opt_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _spec(moved.params["embed"]) == ("model", None)
  assert _spec(moved.opt_state[1][0].mu["embed"]) == ("model", None)
  assert dict(moved.params["embed"].sharding.mesh.shape) == {"data": 2, "model": 4}
  trainer.fit(moved, export=False)
  assert _spec(moved.params["blocks"][0]["mlp"]["w_up"]) == (None, "model"), "steps keep the placement"
  np.testing.assert_allclose(_losses(tmp_path / "mesh"), one, rtol=1e-4)

  # Heads on the frozen target, on 4 x 2: the teacher and the head set placed, target-generated rows sampled
  # on the mesh, the export gathered to the host.
  from specjax.models.heads import load_heads
  from specjax.train import config as config_lib

  heads_cfg = config_lib.from_dict({
      "kind": "heads", "heads": {"kind": "eagle3", "d_model": 16, "n_heads": 2, "draft_vocab_size": 160},
      "distill": {"target": str(one_dir), "mix": {"corpus": 1.0, "target": 1.0}, "prefix_len": 5,
                  "gen_len": 12},
      "data": {**dataclasses.asdict(cfg.data)}, "optim": {"lr": 1e-2, "warmup_steps": 1},
      "run": {"steps": 2, "eval_every": 2, "eval_batches": 1, "ckpt_every": 2, "log_every": 1, "progress": False}})
  heads_run = trainer.fit(trainer.start(heads_cfg, tmp_path / "heads", mesh=sharding.make_mesh("data=4,model=2")))
  assert np.isfinite(_losses(tmp_path / "heads")).all()
  assert _spec(heads_run.params["lm_head"]["w"]) == (None, "model")
  assert _spec(heads_run.teacher[1]["embed"]) == ("model", None)
  assert load_heads(tmp_path / "heads" / "heads", trainer.load_target(one_dir)[0].cfg).cfg.kind == "eagle3"


def test_online_heads_on_conversations_follow_the_one_device_losses(tmp_path, one_device_run):
  """Heads trained online (the target's forward inside each step) on conversation rows and their answer masks:
  on a 4 x 2 mesh (rows, masks and the target split as the rules say), the one-device losses."""
  from specjax.train import config as config_lib
  from specjax.train import trainer

  _, one_dir, _ = one_device_run
  template = ("{% for m in messages %}{{ '### ' + m['role'] + '\\n' + m['content'] }}"
              "{% if m['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}")
  (tmp_path / "chat.jinja").write_text(template)
  chats = [{"messages": [{"role": "user", "content": f"def f_{i}(x):"},
                         {"role": "assistant", "content": f"    return x + {i}"}]} for i in range(64)]
  (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
  cfg = config_lib.from_dict({
      "kind": "heads", "heads": {"kind": "eagle3", "d_model": 16, "n_heads": 2, "ttt_steps": 2},
      "distill": {"target": str(one_dir)},
      "conversations": {"path": str(tmp_path / "chats.jsonl"), "regenerate": False, "valid_fraction": 0.2,
                        "chat_template": str(tmp_path / "chat.jinja"), "shards": str(tmp_path / "shards")},
      "data": {"tokenizer_vocab": 320, "seq_len": 16, "batch_size": 8}, "optim": {"lr": 1e-2, "warmup_steps": 1},
      "run": {"steps": 3, "eval_every": 3, "eval_batches": 1, "ckpt_every": 3, "log_every": 1, "progress": False}})
  trainer.fit(trainer.start(cfg, tmp_path / "one"))
  run = trainer.fit(trainer.start(cfg, tmp_path / "mesh", mesh=sharding.make_mesh("data=4,model=2")))
  assert 0 < run.batches.masks.mean() < 1 and _spec(run.teacher[1]["embed"]) == ("model", None)
  np.testing.assert_allclose(_losses(tmp_path / "mesh"), _losses(tmp_path / "one"), rtol=1e-5)


def test_two_processes_generate_and_train_over_one_mesh(tmp_path, reference, one_device_run):
  """Multi-host on one machine: two processes of 4 CPU devices each (``tests/multihost_worker.py``) join
  through the environment, as on a GPU cluster, and share one 8-device mesh: generate gives the one-device
  tokens; two training steps follow the one-device loss curve, are logged once, and their checkpoint (each
  process writes its shards) resumes on a mesh of another shape."""
  cfg, _, one = one_device_run
  (tmp_path / "recipe.json").write_text(json.dumps(cfg.to_dict()))
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=4",
         "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
         "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}
  procs = [subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py"), str(tmp_path / "recipe.json"),
                             str(tmp_path / "run")], env={**env, "JAX_PROCESS_ID": str(i)}, cwd=HERE.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    outs = [p.communicate(timeout=600) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    (report,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    np.testing.assert_array_equal(report.pop("tokens"), reference["draft"], err_msg=f"process {i}")
    assert report == {"process": i, "step": 2, "same_state": True, "mesh": {"data": 8, "model": 1}}, report
  np.testing.assert_allclose(_losses(tmp_path / "run"), one[:2], rtol=1e-5)  # each step logged once
