"""Sharding: logical axis names on every parameter, the rules table, meshes and their errors, bfloat16 end to
end; the checks that need 8 devices run in one subprocess (``tests/mesh_checks.py``)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import specjax
from helpers import SMALL, make_model, start_state
from specjax import engine, sharding
from specjax.cli import main
from specjax.models import GPT2, GPT2Config, Llama
from specjax.models.heads import KINDS, build_heads
from specjax.proposers import Eagle
from specjax.sampling import Sampler

HERE = pathlib.Path(__file__).parent


def _every_module():
  """A Llama with every optional parameter, a GPT-2 and one head set of each kind (abstract: shapes and
  metadata, no arrays)."""
  llama = lambda: Llama(SMALL.replace(qkv_bias=True, post_norms=True, tie_embeddings=False), rngs=nnx.Rngs(0))
  gpt2 = lambda: GPT2(GPT2Config(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=32), rngs=nnx.Rngs(0))
  heads = {kind: (lambda kind=kind: build_heads(kind, SMALL, draft_vocab_size=16 if kind == "eagle3" else None))
           for kind in KINDS}
  return {name: nnx.eval_shape(make) for name, make in {"llama": llama, "gpt2": gpt2, **heads}.items()}


def test_every_parameter_names_each_of_its_axes():
  for role, module in _every_module().items():
    params = nnx.state(module, nnx.Param)
    specs = nnx.get_partition_spec(params)  # flax reads the names back
    for (path, var), (_, spec) in zip(nnx.to_flat_state(params), nnx.to_flat_state(specs)):
      names = var.get_metadata().get("out_sharding")
      assert names is not None and len(names) == len(var.get_value().shape), (role, path, names)
      assert set(names) - {None} <= set(sharding.LOGICAL_AXES), (role, path, names)
      assert tuple(spec.get_value()) == tuple(names), (role, path)
  llama = _every_module()["llama"]
  assert sharding.logical_axes(llama.embed) == ("vocab", "embed")
  assert sharding.logical_axes(llama.lm_head) == ("embed", "vocab")
  assert sharding.logical_axes(llama.blocks[0].attn.wk) == ("embed", "kv_heads", "head_dim")
  assert sharding.logical_axes(llama.blocks[0].mlp.w_down) == ("mlp", "embed")


def test_rules_map_logical_axes_to_mesh_axes():
  rules = sharding.ShardingRules()
  assert rules.spec(("batch", "sequence", "kv_heads", "head_dim")) == P("data", None, "model", None)
  assert rules.spec(("vocab", "embed")) == P("model", None)
  assert sharding.DATA_PARALLEL.spec(("embed", "mlp")) == P(None, None)
  fsdp = sharding.ShardingRules(embed="data", batch=("data", "model"))
  assert fsdp.spec(("batch", "embed")) == P(("data", "model"), None), "a mesh axis splits one dimension only"
  assert fsdp.spec(("embed", "embed")) == P("data", None)
  with pytest.raises(ValueError, match=r"ShardingRules.heads must be a mesh axis name"):
    sharding.ShardingRules(heads=3)
  with pytest.raises(ValueError, match="unknown logical axis 'width'"):
    rules.spec(("width",))


def test_meshes_and_their_errors():
  mesh = sharding.make_mesh()  # every device on data
  assert dict(mesh.shape) == {"data": jax.device_count(), "model": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert sharding.parse_mesh("data=2, model=4") == {"data": 2, "model": 4}
  for text in ("data=2,tensor=4", "data=0", "model", "data=2,data=2", "model=x"):
    with pytest.raises(ValueError, match=r"each part must be axis=size"):
      sharding.parse_mesh(text)
  with pytest.raises(ValueError, match=rf"needs 16 devices, but {jax.device_count()} are available"):
    sharding.make_mesh("data=4,model=4")
  explicit = jax.make_mesh((1,), ("data",))
  with pytest.raises(ValueError, match=r"mesh axis 'model', which the mesh \(axes \('data',\)\) lacks"):
    sharding.Placement.create(explicit)
  placement = sharding.Placement.create(explicit, sharding.ShardingRules(heads=None, kv_heads=None, mlp=None,
                                                                         vocab=None))
  assert placement.mesh.axis_types == (jax.sharding.AxisType.Auto,), "an Explicit mesh is used with Auto axes"
  with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
    sharding.Placement.create("data=2")
  with pytest.raises(ValueError, match="rules= needs mesh="):
    specjax.generate(make_model(), [[1, 2]], rules=sharding.ShardingRules(), max_new_tokens=2)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "x", "--random-init", "--mesh", "data=2;model=4"], "each part must be axis=size"),
    (["generate", "--prompt", "x", "--random-init", "--mesh", "data=64"], "needs 64 devices"),
    (["generate", "--prompt", "x", "--random-init", "--batch", "0"], "--batch: must be an integer >= 1"),
    (["train", "target", "--config", "nonexistent.toml", "--mesh", "tensor=2"], "each part must be axis=size"),
])
def test_bad_mesh_arguments_are_one_line(capsys, argv, message):
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("specjax: error: ") and message in err


def test_one_device_program_has_no_sharding_constraint():
  """mesh=None traces exactly the program it always did: no constraint, no collective."""
  target = make_model()
  tdef, tstate = nnx.split(target)
  tokens = jnp.ones((2, 4), jnp.int32)
  text = jax.jit(lambda s: nnx.merge(tdef, s)(tokens, target.init_cache(2, 8))[0]).lower(tstate).as_text()
  assert "sharding_constraint" not in text and "Sharding" not in text


def test_bfloat16_end_to_end():
  """Weights, activations and caches bfloat16; logits and warped distributions float32. (That bfloat16
  speculation gives the bfloat16 target's own greedy tokens: ``tests/mesh_checks.py``.)"""
  cfg = SMALL.replace(dtype="bfloat16", param_dtype="bfloat16")
  target = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  heads = nnx.eval_shape(lambda: build_heads("eagle3", cfg, seed=3, draft_vocab_size=32))
  params = jax.tree.leaves((nnx.state(target, nnx.Param), nnx.state(heads, nnx.Param)))
  assert params and all(x.dtype == jnp.bfloat16 for x in params)
  tdef, tstate = nnx.split(target)
  template, pdefs, pstates = Eagle(heads).split(nnx.split)

  def one_round(tstate, pstates):
    t, p = nnx.merge(tdef, tstate), template.bind(pdefs, pstates)
    sampling = specjax.SamplingConfig(temperature=0.7)
    state, mode = start_state(t, p, jnp.ones((2, 8), jnp.int32), jnp.full((2,), 8), k=3, max_new=4,
                              sampling=sampling)
    logits, hidden, _ = t(jnp.ones((2, 1), jnp.int32), state.target_cache)
    p_dist, _, features, _ = engine.verify(t, state.target_cache, state.last, jnp.zeros((2, 3), jnp.int32),
                                           Sampler(state.settings, state.counts, mode))
    return state, logits, hidden, p_dist

  state, logits, hidden, p_dist = jax.eval_shape(one_round, tstate, pstates)
  assert state.target_cache.k[0].dtype == jnp.bfloat16 and state.proposer.caches[0].k[0].dtype == jnp.bfloat16
  assert hidden.dtype == jnp.bfloat16 and logits.dtype == jnp.float32 and p_dist.dtype == jnp.float32


def test_on_eight_devices():
  """The mesh checks (``tests/mesh_checks.py``) in one subprocess with 8 CPU devices."""
  # XLA_FLAGS already holds the suite's fast-compile flags (tests/conftest.py); every check compares programs
  # compiled in that one process, under the same flags.
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
  env = {**os.environ, "XLA_FLAGS": flags.strip()}
  proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                         str(HERE / "mesh_checks.py")], cwd=HERE.parent, env=env, capture_output=True, text=True,
                        timeout=1200)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
