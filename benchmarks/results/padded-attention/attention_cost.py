"""Ad hoc (the record of docs/benchmarks.md, "Attention without the cache's transposition"): 30 layers of attention
alone, jitted, over random float32 caches, the per-KV-head product (``dot``: what grouped_attention does for long
passes and on a mesh) against head-padded queries (``pad``: short passes), medians of 15; ``err`` the largest
difference between the two outputs. Shapes: B rows, S positions, K KV heads, G query heads per KV head, H head
size, T queries. Run from the repository root: python benchmarks/results/padded-attention/attention_cost.py"""
import time, statistics, sys, jax, jax.numpy as jnp, numpy as np
def att_dot(q, k, v):
  s = jnp.einsum("btkgh,bskh->bkgts", q, k); w = jax.nn.softmax(s, -1)
  return jnp.einsum("bkgts,bskh->btkgh", w, v)
def att_pad(q, k, v):
  b, t, K, g, h = q.shape; s_len = k.shape[1]
  eye = jnp.eye(K, dtype=q.dtype)
  qpad = (q[:, :, :, :, None, :] * eye[None, None, :, None, :, None]).reshape(b, t * K * g, K * h)
  s = jnp.einsum("bmd,bsd->bms", qpad, k.reshape(b, s_len, K * h)); w = jax.nn.softmax(s, -1)
  o = jnp.einsum("bms,bsd->bmd", w, v.reshape(b, s_len, K * h)).reshape(b, t, K, g, K, h)
  return jnp.moveaxis(jnp.diagonal(o, axis1=2, axis2=4), -1, 2)  # [b,t,g,h,K] -> [b,t,K,g,h]
for B, S, K, G, H, T in [(1, 256, 3, 3, 64, 2), (1, 256, 3, 3, 64, 1), (1, 1024, 3, 3, 64, 5), (8, 256, 3, 3, 64, 1), (1, 512, 12, 1, 64, 2), (1, 512, 32, 1, 128, 1), (1, 128, 3, 3, 64, 64)]:
  L = 30
  rng = np.random.default_rng(0)
  keys = [jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32) for _ in range(L)]
  vals = [jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32) for _ in range(L)]
  q = jnp.asarray(rng.standard_normal((B, T, K, G, H)), jnp.float32)
  res = []
  for f in (att_dot, att_pad):
    run = jax.jit(lambda q, ks, vs: [f(q, k, v) for k, v in zip(ks, vs)])
    out = jax.block_until_ready(run(q, keys, vals)); ts = []
    for _ in range(15):
      t0 = time.perf_counter(); jax.block_until_ready(run(q, keys, vals)); ts.append(time.perf_counter() - t0)
    res.append((1000 * statistics.median(ts), out[0]))
  print(f"B{B} S{S} K{K} G{G} H{H} T{T}: dot {res[0][0]:.2f} ms, pad {res[1][0]:.2f} ms, err {float(jnp.max(jnp.abs(res[0][1]-res[1][1]))):.1e}", flush=True)
