"""Ad hoc (2026-12-06): a heads training step (value and gradient of head_loss, offline top-64 labels) before and after the top-k
restriction change (git show 16dff99~1:train/heads.py > /tmp/flt/heads_before.py):
SmolLM2's shapes, 8 rows of 513 tokens, medians of 5 after a compile. Each version draws its own random batch,
so the losses differ; that the two compute the same loss is tests/test_train_heads.py's to show."""
import importlib.util, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import specjax
from specjax.train import heads as new_lib

spec = importlib.util.spec_from_file_location("heads_before", "/tmp/flt/heads_before.py")
old_lib = importlib.util.module_from_spec(spec); sys.modules["heads_before"] = old_lib; spec.loader.exec_module(old_lib)
target = specjax.load("smollm2-135m-instruct").model
b, t1, k = 8, 513, 64
rng = np.random.default_rng(0)
for width, vocab in ((576, 6144), (256, 8192)):
  results = {}
  for name, lib in (("before", old_lib), ("after", new_lib)):
    hcfg = lib.HeadsConfig(kind="eagle3", d_model="target" if width == 576 else width, n_heads=9 if width == 576 else 4,
                           n_kv_heads=3 if width == 576 else 2, draft_vocab_size=vocab, ttt_steps=3, decay=0.8)
    heads = hcfg.build(target.cfg, seed=0)
    rows = jnp.asarray(rng.integers(0, 49152, (b, t1)), jnp.int32)  # each version draws its own batch (as run)
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, t1, k)), jnp.float32), -1)
    probs = -jnp.sort(-probs, -1)
    ids = jnp.asarray(rng.integers(0, 49152, (b, t1, k)), jnp.int32)
    hid = jnp.asarray(rng.normal(size=(b, t1, 576)), jnp.bfloat16)
    aux = jnp.asarray(rng.normal(size=(b, t1, 3 * 576)), jnp.bfloat16)
    outputs = lib.TargetOutputs(probs=probs, ids=ids, hidden=hid, aux=aux)
    gdef, params, rest = nnx.split(heads, nnx.Param, ...)
    @jax.jit
    def step(params):
      def f(params):
        return lib.head_loss(nnx.merge(gdef, params, rest), target, hcfg, rows, jax.random.key(0), outputs)
      return jax.value_and_grad(f, has_aux=True)(params)
    t0 = time.perf_counter(); (loss, _), g = step(params); jax.block_until_ready(g); first = time.perf_counter() - t0
    times = []
    for _ in range(5):
      t0 = time.perf_counter(); (loss, _), g = step(params); jax.block_until_ready(g); times.append(time.perf_counter() - t0)
    results[name] = (float(loss), statistics.median(times), first)
    print(f"width {width}, draft vocabulary {vocab}, {name}: loss {float(loss):.5f}, step {statistics.median(times):.2f} s "
          f"(median of 5; {min(times):.2f}-{max(times):.2f}), first call {first:.1f} s", flush=True)
  print(f"  ratio {results['before'][1] / results['after'][1]:.2f}x, loss difference {abs(results['before'][0] - results['after'][0]):.2e}")
