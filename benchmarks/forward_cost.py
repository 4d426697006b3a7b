"""Cost of a target pass over T tokens, and of one speculative round against the sum of its parts.

    python benchmarks/forward_cost.py [--repeats 30] [--out benchmarks/results]

For two target sizes (weights that fit in this CPU's cache, and about 100 MB) it measures, batch 1,
float32, inside jit, `block_until_ready` before every clock read, medians over repeats:
- one cached target forward over T = 1, 2, 5, 9 tokens (v(T) = cost(T) / cost(1) is the verify/step ratio
  that decides whether speculation pays on this hardware);
- one draft step, one verification of k + 1 tokens, warp + acceptance, and one whole round of the jitted
  `generate` loop (from the difference of two runs of different lengths, so prefill and compilation drop
  out); round / (k * draft + verify + accept) is the loop overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax.bench import cpu_name
from specjax.engine import forward
from specjax.models import Llama, LlamaConfig

SIZES = {
    "small (fits in cache)": LlamaConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                                         d_ff=384, max_seq_len=1024),
    "100MB": LlamaConfig(vocab_size=4096, d_model=768, n_layers=3, n_heads=12, n_kv_heads=4, d_ff=2048,
                         max_seq_len=1024),
}
WINDOWS = (1, 2, 5, 9)
CONTEXT = 128  # tokens already in the cache
CACHE_LEN = 256
K = 4


def median_time(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # warm-up (and compile)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def forward_timer(model, t: int):
  graphdef, state = nnx.split(model)
  fwd = jax.jit(forward, static_argnums=0, donate_argnums=3)
  cache = [model.init_cache(1, CACHE_LEN).with_lengths(jnp.array([CONTEXT]))]
  tokens = jnp.ones((1, t), jnp.int32)

  def run():
    logits, _, new = fwd(graphdef, state, tokens, cache[0])
    cache[0] = new.with_lengths(jnp.array([CONTEXT]))  # roll back: the next call writes the same slots
    return logits

  return run


def accept_timer(vocab: int):
  p = jax.nn.softmax(jax.random.normal(jax.random.key(0), (1, K + 1, vocab)), -1)
  q = jax.nn.softmax(jax.random.normal(jax.random.key(1), (1, K, vocab)), -1)
  logits = jnp.log(p)
  d = jnp.zeros((1, K), jnp.int32)
  sampling = specjax.SamplingConfig(temperature=1.0)
  fn = jax.jit(lambda l, q, d, key: specjax.accept(specjax.warp(l, sampling), q, d, key))
  return lambda: fn(logits, q, d, jax.random.key(2))


def round_time(target, draft, repeats: int) -> tuple[float, float]:
  """Seconds per round of the jitted loop, sampling at temperature 1, batch 1; and the measured tau."""
  sampling = specjax.SamplingConfig(temperature=1.0)
  prompt = [[1] * 16]
  kw = dict(draft=draft, spec=specjax.SpecConfig(k=K), sampling=sampling, seed=0)
  results = {}
  for n in (8, 72):
    runs = []
    specjax.generate(target, prompt, max_new_tokens=n, **kw)  # compile
    for _ in range(max(3, repeats // 5)):
      start = time.perf_counter()
      out = specjax.generate(target, prompt, max_new_tokens=n, **kw)
      runs.append(time.perf_counter() - start)
    results[n] = (statistics.median(runs), out.stats.rounds, out.stats.mean_accepted_length)
  (t0, r0, _), (t1, r1, tau) = results[8], results[72]
  return (t1 - t0) / (r1 - r0), tau


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args()

  report = {"machine": {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
                        "cpu": cpu_name(), "cores": os.cpu_count(),
                        "jax": jax.__version__},
            "batch": 1, "context": CONTEXT, "k": K, "sizes": {}}
  for name, cfg in SIZES.items():
    target = Llama(cfg, rngs=nnx.Rngs(0))
    draft_cfg = cfg.replace(d_model=cfg.d_model // 4, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=cfg.d_ff // 4)
    draft = Llama(draft_cfg, rngs=nnx.Rngs(1))
    entry = {"target_params": cfg.num_params, "target_bytes": cfg.num_params * 4,
             "draft_params": draft_cfg.num_params, "forward_s": {}}
    for t in WINDOWS:
      entry["forward_s"][t] = median_time(forward_timer(target, t), args.repeats)
    step = entry["forward_s"][1]
    entry["verify_step_ratio"] = {t: entry["forward_s"][t] / step for t in WINDOWS}
    draft_step = median_time(forward_timer(draft, 1), args.repeats)
    verify = median_time(forward_timer(target, K + 1), args.repeats)
    acc = median_time(accept_timer(cfg.vocab_size), args.repeats)
    per_round, tau = round_time(target, draft, args.repeats)
    parts = K * draft_step + verify + acc
    entry.update(draft_step_s=draft_step, draft_step_over_target_step=draft_step / step,
                 verify_k_plus_1_s=verify, warp_accept_s=acc, sum_of_parts_s=parts, round_s=per_round,
                 round_over_parts=per_round / parts, tau_random_draft=tau)
    report["sizes"][name] = entry
    print(json.dumps({name: entry}, indent=1), flush=True)

  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "forward_cost.json"), "w") as f:
    json.dump(report, f, indent=1)
  lines = [f"# Forward cost on {report['machine']['cpu']} ({report['machine']['cores']} cores), "
           f"jax {report['machine']['jax']}, {report['machine']['backend']}", "",
           f"Batch 1, float32, {CONTEXT} tokens in the cache, medians of {args.repeats} timed calls after "
           "warm-up.", "",
           "| target | params | T=1 ms | T=2 | T=5 | T=9 | draft step / target step | round (k=4) ms | "
           "sum of parts ms | round / parts |", "|---|---|---|---|---|---|---|---|---|---|"]
  for name, e in report["sizes"].items():
    f, r = e["forward_s"], e["verify_step_ratio"]
    lines.append(f"| {name} | {e['target_params'] / 1e6:.1f} M | {f[1] * 1e3:.3f} | {r[2]:.2f}x | {r[5]:.2f}x | "
                 f"{r[9]:.2f}x | {e['draft_step_over_target_step']:.3f} | {e['round_s'] * 1e3:.3f} | "
                 f"{e['sum_of_parts_s'] * 1e3:.3f} | {e['round_over_parts']:.2f} |")
  lines += ["", "T=2/5/9 columns: cost of a pass over T tokens relative to one token (v(T) of the cost model)."]
  with open(os.path.join(args.out, "forward_cost.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
