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

llama.cpp beside them (optional): the same GGUF file, the same chat-formatted token ids and ``--new-tokens``, greedy,
``--llama-cpp-threads`` threads (default 2), timed the same way (median of ``--repeats`` after a warm-up, prompt
evaluation included), at the start and again at the end of the run (the load drifts), by
``benchmarks/llama_cpp_speed.py`` in the Python given by ``--llama-cpp-python`` (default: this one; llama-cpp-python
builds llama.cpp from source and usually has its own venv). Skipped, with the reason printed and recorded, when that
Python cannot import ``llama_cpp`` or the target is not a GGUF file; ``--no-llama-cpp`` skips it outright.

Also a matrix-vector micro-benchmark at the model's MLP shape that shows what XLA:CPU does with a quantized
weight (its optimized HLO materialises the dequantized float32 matrix before the dot). The load average is
recorded before and after: other processes share this CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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


def gguf_path(target: str) -> str | None:
  """The GGUF file behind ``--target`` (a path or a GGUF short name), or None."""
  from specjax.loading import GGUF_NAMES, find_gguf

  if target.endswith(".gguf"):
    return target
  return find_gguf(target) if target in GGUF_NAMES else None


def chat_rows(tokenizer, chat) -> list[list[int]]:
  return [chat.encode(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]


def llama_cpp_run(python: str, path: str, rows: list[list[int]], n: int, repeats: int, threads: int) -> dict:
  """llama.cpp's row (``benchmarks/llama_cpp_speed.py`` run by ``python``), or ``{"skipped": reason}``."""
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump({"prompts": rows, "new_tokens": n, "repeats": repeats, "threads": threads}, f)
  try:
    proc = subprocess.run([python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_speed.py"),
                           path, f.name], capture_output=True, text=True, timeout=1800)
  finally:
    os.unlink(f.name)
  if proc.returncode == 3:
    return {"skipped": proc.stderr.strip()}
  if proc.returncode != 0:
    raise RuntimeError(f"llama_cpp_speed.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
  return dict(json.loads(proc.stdout.strip().splitlines()[-1]), load_average=load_average())


def leading_equal(tokens: list[list[int]], reference: list[list[int]]) -> list[int]:
  """Per prompt, how many leading tokens equal the reference's."""
  return [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), min(len(t), len(r)))
          for t, r in zip(tokens, reference)]


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
  parser.add_argument("--llama-cpp-python", default=sys.executable,
                      help="a Python that can import llama_cpp (default: this one)")
  parser.add_argument("--llama-cpp-threads", type=int, default=2)
  parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp row")
  args = parser.parse_args()

  report = {"machine": machine(), "load_average_start": load_average(), "target": args.target,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "k": K, "context": CONTEXT, "dtypes": {}}
  path = gguf_path(args.target)
  llama = []  # llama.cpp at the start and at the end of the run
  if args.no_llama_cpp or path is None:
    report["llama_cpp"] = {"skipped": "--no-llama-cpp" if args.no_llama_cpp else f"{args.target} is not a GGUF file"}
    print(f"llama.cpp row skipped: {report['llama_cpp']['skipped']}", flush=True)
  else:
    from specjax.gguf import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(path)
    llama_rows = chat_rows(tokenizer, tokenizer.chat)
    run_llama = lambda: llama_cpp_run(args.llama_cpp_python, path, llama_rows, args.new_tokens, args.repeats,
                                      args.llama_cpp_threads)
    llama.append(run_llama())
    if "skipped" in llama[0]:
      report["llama_cpp"] = llama.pop()
      print(f"llama.cpp row skipped: {report['llama_cpp']['skipped']}", flush=True)
    else:
      print(json.dumps({"llama.cpp (start)": {k: v for k, v in llama[0].items() if k != "greedy"}}), flush=True)
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
    entry["agreement_with_float32"] = leading_equal(tokens, reference)
    report["dtypes"][dtype] = entry
    print(json.dumps({dtype: entry}), flush=True)
  if llama:
    llama.append(run_llama())
    mean = statistics.mean(r["tok_s"] for r in llama)
    report["llama_cpp"] = {"file": path, "param_bytes": os.path.getsize(path), "version": llama[0]["version"],
                           "threads": args.llama_cpp_threads, "runs": llama, "tok_s": mean,
                           "agreement_with_float32": leading_equal(llama[0]["greedy"], reference)}
    for entry in report["dtypes"].values():  # within this run: specjax over llama.cpp (its mean of two runs)
      entry["target_over_llama_cpp"] = entry["target_tok_s"] / mean
    print(json.dumps({"llama.cpp (end)": {k: v for k, v in llama[1].items() if k != "greedy"}}), flush=True)
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
           "| dtype | param MB | step ms | v(5)/v(1) | target tok/s | target / llama.cpp | eagle tok/s | speedup | "
           f"tau | agreement with float32 (leading equal tokens of {args.new_tokens}, per prompt) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for dtype, e in report["dtypes"].items():
    lines.append(f"| {dtype} | {e['param_bytes'] / 1e6:.0f} | {e['step_ms']:.1f} | {e['v5']:.2f} | "
                 f"{e['target_tok_s']:.1f} | {e.get('target_over_llama_cpp', float('nan')):.2f} | "
                 f"{e.get('eagle_tok_s', float('nan')):.1f} | {e.get('speedup', float('nan')):.2f}x | "
                 f"{e.get('tau', float('nan')):.2f} | {e['agreement_with_float32']} |")
  lc = report["llama_cpp"]
  if "skipped" in lc:
    lines += ["", f"llama.cpp row skipped: {lc['skipped']}"]
  else:
    runs = " and ".join(f"{r['tok_s']:.1f} (load {r['load_average'][0]})" for r in lc["runs"])
    lines.append(f"| llama.cpp {lc['version']} ({lc['threads']} threads, the file) | {lc['param_bytes'] / 1e6:.0f} "
                 f"| | | {lc['tok_s']:.1f} | 1.00 | | | | {lc['agreement_with_float32']} |")
    lines += ["", f"llama.cpp: {runs} tokens/s at the start and the end of the run (row: their mean)."]
  mv = report["matvec"]
  lines += ["", f"Matrix-vector {mv['shape']}: float32 {mv['float32_us']:.0f} us, int8 dequantized in the same "
            f"jit {mv['int8_us']:.0f} us. XLA's optimized HLO:", "", "```", *mv["optimized_hlo_ops"], "```"]
  with open(os.path.join(args.out, "quantized.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
