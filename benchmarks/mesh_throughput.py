"""Sharded against one-device generation throughput on fake CPU devices: a sanity check that the sharded
programs run and cost what they should, not a speed claim (the fake devices share this machine's cores, so
every collective is overhead and no mesh can win).

    python benchmarks/mesh_throughput.py [--devices 8] [--repeats 3] [--out FILE.json]

For one device and every (data, model) mesh of ``--devices`` devices: tokens/s of greedy ``generate`` at
batch 8 (64 new tokens per row) for the target alone and with a draft model at k = 4, medians over repeats
after a compiling call; the tokens of every mesh are checked against one device's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="benchmarks/mesh_throughput.py")
  parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (default 8)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", help="write the rows as JSON to this file")
  args = parser.parse_args(argv)
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"

  import jax
  import numpy as np
  from flax import nnx

  import specjax
  from specjax import sharding
  from specjax.bench import machine
  from specjax.models import Llama, LlamaConfig

  cfg = LlamaConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, d_ff=1024, max_seq_len=512)
  target = Llama(cfg, rngs=nnx.Rngs(0))
  draft = Llama(cfg.replace(n_layers=1), rngs=nnx.Rngs(1))
  rows = [[int(t) for t in np.random.default_rng(i).integers(0, cfg.vocab_size, 12 + i)] for i in range(8)]
  meshes = [None] + [f"data={args.devices // m},model={m}" for m in (1, 2, 4, 8) if args.devices % m == 0]
  results, reference = [], {}
  for text in meshes:
    mesh = None if text is None else sharding.make_mesh(text)
    for k in (0, 4):
      call = lambda: specjax.generate(target, rows, draft=draft if k else None, spec=specjax.SpecConfig(k=k),
                                      max_new_tokens=64, mesh=mesh)
      out = call()  # compiles
      times = []
      for _ in range(args.repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
      reference.setdefault(k, out.tokens)
      row = {"mesh": text or "one device", "k": k, "tokens_per_s": len(rows) * 64 / statistics.median(times),
             "same_tokens": bool((out.tokens == reference[k]).all()), "tau": out.stats.mean_accepted_length}
      results.append(row)
      print(json.dumps(row), flush=True)
  one = {r["k"]: r["tokens_per_s"] for r in results if r["mesh"] == "one device"}
  print("\n| mesh | target alone tok/s | vs one device | draft k=4 tok/s | vs one device | same tokens |")
  print("|---|---|---|---|---|---|")
  for text in dict.fromkeys(r["mesh"] for r in results):
    base, spec = (next(r for r in results if r["mesh"] == text and r["k"] == k) for k in (0, 4))
    print(f"| {text} | {base['tokens_per_s']:.0f} | {base['tokens_per_s'] / one[0]:.2f} | {spec['tokens_per_s']:.0f} | "
          f"{spec['tokens_per_s'] / one[4]:.2f} | {base['same_tokens'] and spec['same_tokens']} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"machine": machine(), "results": results}, f, indent=2)
  return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
