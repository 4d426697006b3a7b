"""float32, bfloat16, int8 and int4 weights side by side: memory, the target alone's speed, v(5)/v(1), the
speedup of speculation with the shipped EAGLE head, and greedy agreement with float32.

    python benchmarks/quantized.py [--target smollm2-135m-instruct] [--dtypes float32,bfloat16,int8,int8-g32,int4] \
        [--new-tokens 24] [--repeats 3] [--out benchmarks/results/quantized]

For each dtype (``specjax.load(target, dtype=...)``; int8/int4 are weight-only, float32 activations; ``int8-g32``
is ``dtype="int8", quant_group=32``, ``-gchannel`` one scale per output channel), batch 1,
greedy, chat-formatted prompts written for this benchmark (no head was trained on them), every clock read after
``block_until_ready``, medians over ``--repeats`` after a compile run:

- ``param_bytes``: the target's parameters as stored (codes + scales for int8/int4);
- ``step_ms`` and ``v5``: one cached target forward over 1 and 5 tokens inside jit (64 tokens of context);
  ``v5 = cost(5) / cost(1)``, the verify/step ratio of k = 4;
- ``target tok/s`` and ``eagle tok/s``: ``--new-tokens`` greedy tokens over the median time of ``specjax.generate``
  (compiled beforehand; prefill included), target alone and with the shipped EAGLE head (k = 4);
- agreement: per prompt, how many leading greedy tokens equal float32's (target alone).

Also a matrix-vector micro-benchmark at the model's MLP shape that shows what XLA:CPU does with a quantized
weight (its optimized HLO materialises the dequantized float32 matrix before the dot). The load average is
recorded before and after: other processes share this CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

import specjax
from specjax.bench import load_average, machine, param_bytes
from specjax.engine import forward

from forward_cost import median_time  # benchmarks/ is the script's folder: on sys.path

DTYPES = ("float32", "bfloat16", "int8", "int8-g32", "int4")
PROMPTS = (
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn rain.",
)
CONTEXT, K = 64, 4


def parse_dtype(entry: str) -> tuple[str, int | None | str]:
  """``"int8-g32"`` -> ``("int8", 32)``; ``"int8-gchannel"`` -> ``("int8", None)``; ``"int4"`` -> ``("int4",
  "default")``: the ``dtype`` and ``quant_group`` of ``specjax.load``."""
  dtype, _, group = entry.partition("-g")
  if not group:
    return dtype, "default"
  if group != "channel" and not group.isdigit():
    raise SystemExit(f"--dtypes: {entry!r}: the group after -g must be an integer or 'channel'")
  return dtype, None if group == "channel" else int(group)


def forward_s(model, t: int, repeats: int) -> float:
  graphdef, state = nnx.split(model)
  fwd = jax.jit(forward, static_argnums=0)
  cache = model.init_cache(1, 2 * CONTEXT).with_lengths(jnp.array([CONTEXT]))
  tokens = jnp.ones((1, t), jnp.int32)
  return median_time(lambda: fwd(graphdef, state, tokens, cache)[0], repeats)


def per_token_s(target, row: list[int], n: int, repeats: int, **kw) -> tuple[float, specjax.GenerateOutput]:
  """Seconds per generated token: median time of an ``n``-token ``generate`` (after a compile run) over ``n``
  (prefill included: a small bias, the same for every dtype); and the output. (A difference of two lengths
  cancels prefill but went negative under this CPU's load, so it is not used.)"""
  run = lambda: specjax.generate(target, [row], max_new_tokens=n, **kw)
  out = run()  # compile
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = run()
    samples.append(time.perf_counter() - start)
  return statistics.median(samples) / n, out


def matvec_micro(d: int, f: int, repeats: int) -> dict:
  """``x[1, d] @ W[d, f]``: float32 W against int8 codes dequantized in the same jit, and XLA's fusions."""
  from specjax.quant import quantize_array

  w = jax.random.normal(jax.random.key(0), (d, f), jnp.float32)
  x = jnp.ones((1, d), jnp.float32)
  qa = quantize_array(w, 8)
  f32 = jax.jit(lambda x, w: x @ w)
  q8 = jax.jit(lambda x, qa: x @ qa.astype(jnp.float32))
  hlo = q8.lower(x, qa).compile().as_text()
  ops = [line.strip().split(", metadata")[0] for line in hlo.splitlines()
         if line.strip().startswith(("%", "ROOT")) and (" fusion(" in line or " dot(" in line) and "ENTRY" not in line]
  return {"shape": [d, f], "float32_us": median_time(lambda: f32(x, w), repeats * 10) * 1e6,
          "int8_us": median_time(lambda: q8(x, qa), repeats * 10) * 1e6, "optimized_hlo_ops": ops}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="smollm2-135m-instruct")
  parser.add_argument("--dtypes", default=",".join(DTYPES))
  parser.add_argument("--new-tokens", type=int, default=24)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quantized"))
  args = parser.parse_args()

  report = {"machine": machine(), "load_average_start": load_average(), "target": args.target,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "k": K, "context": CONTEXT, "dtypes": {}}
  reference = None
  dtypes = args.dtypes.split(",")
  if "float32" not in dtypes:  # the agreement reference still comes from float32 (its greedy tokens only)
    loaded = specjax.load(args.target)
    rows = [loaded.chat.encode(loaded.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    reference = [r[:args.new_tokens] for r in specjax.generate(loaded.model, rows, max_new_tokens=args.new_tokens).rows()]
  for dtype in dtypes:
    name, group = parse_dtype(dtype)
    loaded = specjax.load(args.target, dtype=name, quant_group=group)
    target, head = loaded.model, loaded.heads.get("eagle")
    rows = [loaded.chat.encode(loaded.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    step = forward_s(target, 1, args.repeats)
    verify = forward_s(target, K + 1, args.repeats)
    target_s, _ = per_token_s(target, rows[0], args.new_tokens, args.repeats)
    entry = {"param_bytes": param_bytes(target), "step_ms": step * 1e3, "v5": verify / step,
             "target_tok_s": 1.0 / target_s, "load_average": load_average()}
    if head is not None:
      spec_s, out = per_token_s(target, rows[0], args.new_tokens, args.repeats,
                                proposer=specjax.proposers.for_heads(head), spec=specjax.SpecConfig(k=K))
      entry.update(head=head.cfg.kind, head_param_bytes=param_bytes(head), eagle_tok_s=1.0 / spec_s,
                   speedup=target_s / spec_s, tau=out.stats.mean_accepted_length)
    greedy = specjax.generate(target, rows, max_new_tokens=args.new_tokens)
    tokens = [row[:args.new_tokens] for row in greedy.rows()]
    if reference is None:
      reference = tokens
    entry["agreement_with_float32"] = [
        next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), min(len(t), len(r))) for t, r in zip(tokens, reference)]
    report["dtypes"][dtype] = entry
    print(json.dumps({dtype: entry}), flush=True)
  cfg = loaded.model.cfg
  report["matvec"] = matvec_micro(cfg.d_model, cfg.d_ff, args.repeats)
  report["load_average_end"] = load_average()
  print(json.dumps(report["matvec"], indent=1), flush=True)

  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "quantized.json"), "w") as f:
    json.dump(report, f, indent=1)
  lines = [f"# Quantized weights: {args.target} on {report['machine'].get('cpu', '?')}", "",
           f"Batch 1, greedy, k = {K}, {args.new_tokens} new tokens, medians of {args.repeats}; load average "
           f"{report['load_average_start']} at the start, {report['load_average_end']} at the end.", "",
           "| dtype | param MB | step ms | v(5)/v(1) | target tok/s | eagle tok/s | speedup | tau | "
           f"agreement with float32 (leading equal tokens of {args.new_tokens}, per prompt) |",
           "|---|---|---|---|---|---|---|---|---|"]
  for dtype, e in report["dtypes"].items():
    lines.append(f"| {dtype} | {e['param_bytes'] / 1e6:.0f} | {e['step_ms']:.1f} | {e['v5']:.2f} | "
                 f"{e['target_tok_s']:.1f} | {e.get('eagle_tok_s', float('nan')):.1f} | "
                 f"{e.get('speedup', float('nan')):.2f}x | {e.get('tau', float('nan')):.2f} | "
                 f"{e['agreement_with_float32']} |")
  mv = report["matvec"]
  lines += ["", f"Matrix-vector {mv['shape']}: float32 {mv['float32_us']:.0f} us, int8 dequantized in the same "
            f"jit {mv['int8_us']:.0f} us. XLA's optimized HLO:", "", "```", *mv["optimized_hlo_ops"], "```"]
  with open(os.path.join(args.out, "quantized.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
