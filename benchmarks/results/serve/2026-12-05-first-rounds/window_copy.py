"""The bucket window of a step, alone: 12 float32 caches [8, 256, 4, 64] (the bundled target at width 8)
cut to their first b positions, n one-position writes in a loop, written back (donated), against b = 256 (no
window). Prints b, n and the median ms of 31 calls. Output: window_copy.txt."""
import jax, jax.numpy as jnp, numpy as np, time
W,S,H,D,L=8,256,4,64,6
def mk(): return [jnp.zeros((W,S,H,D)) for _ in range(2*L)]
def run(cache, b, n):
  def f(cache, pos):
    win=[c[:, :b] for c in cache]
    def body(i, win):
      return [w.at[:, pos+i].set(1.0) for w in win]
    win=jax.lax.fori_loop(0, n, body, win)
    return [c.at[:, :b].set(w) for c,w in zip(cache,win)]
  return f
for b in (64,128,256):
  for n in (1,8):
    f=jax.jit(run(None,b,n), donate_argnums=(0,))
    c=mk(); c=f(c, 3); jax.block_until_ready(c)
    ts=[]
    for _ in range(31):
      t=time.perf_counter(); c=f(c,3); jax.block_until_ready(c); ts.append(time.perf_counter()-t)
    print(b,n, round(np.median(ts)*1e3,3))
