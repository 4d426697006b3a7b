"""Where the server's width-1 round loses to generate's loop iteration: variants of slots._rounds."""
import dataclasses, sys, time, json
import numpy as np, jax, jax.numpy as jnp
import specjax
from specjax import cli, engine as E
from specjax.request import Request
from specjax.serving import slots as S

VARIANT = sys.argv[1] if len(sys.argv) > 1 else "base"
REPEATS = 9
orig_rounds = S._rounds

def patched(structure, width, depth, logprobs, rounds, bucket, interruptible, max_len, k_max, one_round, name):
  def run(tstate, pstates, state, cancel, limit, handle):
    target, proposer = structure.models(tstate, pstates)
    full = dataclasses.replace(state, done=state.done | cancel, k_now=jnp.int32(depth),
                               stats=E.RoundStats.zeros(width, k_max))
    start_done = full.done
    out = E.Tokens.zeros(width, rounds * (depth + 1), logprobs)
    count = jnp.zeros((width,), jnp.int32)
    def cond(carry):
      i, state, _, _, stop = carry
      if "simplecond" in VARIANT:
        return (i < limit) & ~jnp.all(state.done)
      return (i == 0) | ((i < limit) & ~stop & ~jnp.any(state.done & ~start_done) & ~jnp.all(state.done))
    def body(carry):
      i, state, out, count, _ = carry
      if "mergein" in VARIANT:
        target, proposer = structure.models(tstate, pstates)
      else:
        target, proposer = structure.models(tstate, pstates)
      state, emitted, n = one_round(state, target, proposer)
      if "nowrite" in VARIANT:
        return i + 1, state, out, count + n, jnp.bool_(False)
      return i + 1, state, out.write(emitted, count), count + n, jnp.bool_(False)
    win = "nowindow" not in VARIANT
    init = (jnp.int32(0), S._window(full, bucket, max_len) if win else full, out, count, jnp.bool_(False))
    i, st, out, count, stop = jax.lax.while_loop(cond, body, init)
    st = S._unwindow(full, st, bucket, max_len) if win else st
    return st, packed.pack((out, count, st.done, st.stats, i, stop & (i < limit)))
  packed = S._PackedStep(run)
  return packed

if VARIANT != "base":
  S._rounds = patched

pair = specjax.load(cli.DEFAULT_PAIR)
target, tok = pair.model, pair.tokenizer
prompts = [tok.encode("def function_0(values):\n    return")]
TOK = 64
def generate(n):
  t = time.perf_counter(); specjax.generate(target, prompts, max_new_tokens=n, eos_id=[]).rows(); return time.perf_counter() - t
max_len = 256 if "nowindow" not in VARIANT else 128
buckets = None if "nowindow" not in VARIANT else (128,)
eng = S.SlotEngine(target, None, slots=1, widths=(1,), max_len=max_len, ks=(0,), rounds=8, buckets=buckets)
eng.warm_up()
def calls():
  eng.insert([Request(tuple(prompts[0]), TOK, stop_ids=())])
  out = []
  while eng.live_slots:
    jax.block_until_ready(eng.state)
    t = time.perf_counter(); r = eng.collect(eng.launch(0, 8)); out.append((time.perf_counter() - t, r.rounds, r.bucket))
  return out
generate(TOK); generate(1); calls()
g_full, g_one, rr = [], [], {}
for _ in range(REPEATS):
  g_full.append(generate(TOK)); g_one.append(generate(1))
  for s, n, b in calls():
    if n == 8: rr.setdefault(b, []).append(s / n)
it = (np.median(g_full) - np.median(g_one)) / (TOK - 1) * 1e3
print(json.dumps({"variant": VARIANT, "gen_iter_ms": round(it, 3),
                  "round_ms": {b: round(float(np.median(v)) * 1e3, 3) for b, v in sorted(rr.items())}}))
