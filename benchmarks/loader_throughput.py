"""The input pipeline of head training on conversations, measured on this machine: specjax's own loader against
grain's.

    python benchmarks/loader_throughput.py [--conversations 2000] [--seq-len 256] [--batch 16] [--seconds 3]

Three stages, each timed alone:

1. **encode**: conversations (made up here, one to three turns, both layouts) rendered with a chat template and
   tokenized into ``(ids, answer mask)`` by :func:`specjax.train.conversations.encode`, then packed: what a run
   does once when it starts (conversations/s, tokens/s).
2. **batches**: shuffled batches ``rows [B, T+1]`` with their masks ``[B, T]`` drawn from the packed arrays,
   for as long as ``--seconds``: :class:`specjax.train.data.Batches` (one permutation per epoch, one fancy
   index per batch) against grain ``MapDataset`` pipelines: per-row ``map`` then ``batch`` (grain's usual
   shape), indices batched then gathered in one index (the same work as ours), and the latter through
   ``to_iter_dataset`` with prefetch threads. Rows come from memory and from an ``np.load(mmap_mode="r")``
   file (data larger than memory).
3. Both loaders' batch streams are checked to cover each row once per epoch.

Prints one JSON line per case (examples/s, tokens/s) and a markdown table; ``--out FILE`` writes the JSON lines.
Needs ``pip install grain`` (specjax itself does not depend on it: ``docs/training.md`` says why).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import numpy as np

TEMPLATE = ("{% for m in messages %}{{ '### ' + m['role'] + '\\n' + m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}")


def conversations(n: int, seed: int = 0) -> list[tuple]:
  """``n`` made-up conversations of one to three turns, answers of 20 to 200 words of Python-like text."""
  rng = np.random.default_rng(seed)
  words = ["def", "return", "self", "value", "import", "for", "in", "range", "if", "else", "x", "y", "print", "=",
           "(", ")", ":", "+", "list", "dict", "None", "True", "class", "with", "open", "path"]
  say = lambda k: " ".join(rng.choice(words, size=k))
  out = []
  for _ in range(n):
    messages = [{"role": "system", "content": "You write Python."}] if rng.random() < 0.3 else []
    for _ in range(int(rng.integers(1, 4))):
      messages += [{"role": "user", "content": say(int(rng.integers(5, 40)))},
                   {"role": "assistant", "content": say(int(rng.integers(20, 200)))}]
    out.append(tuple(messages))
  return out


def timed(next_batch, seconds: float, batch: int, seq_len: int) -> dict:
  next_batch()  # warm-up (the first permutation, thread start)
  n, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    rows, masks = next_batch()
    n += rows.shape[0]
  elapsed = time.perf_counter() - start
  return {"examples_per_s": round(n / elapsed, 1), "tokens_per_s": round(n * (seq_len + 1) / elapsed, 1)}


def main(argv: list[str] | None = None) -> int:
  import grain

  import specjax
  from specjax.chat import ChatFormat
  from specjax.train import conversations as conv
  from specjax.train import data as data_lib

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--conversations", type=int, default=2000)
  parser.add_argument("--seq-len", type=int, default=256)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seconds", type=float, default=3.0)
  parser.add_argument("--out", help="write the JSON lines here too")
  args = parser.parse_args(argv)
  tok = specjax.load("stdlib-coder").tokenizer
  chat = ChatFormat.create(TEMPLATE, tok)
  results = []

  def report(case: str, **values):
    record = {"case": case, **values}
    results.append(record)
    print(json.dumps(record), flush=True)

  convs = conversations(args.conversations)
  start = time.perf_counter()
  pieces = [conv.encode(chat, tok, m) for m in convs]
  rows, masks = conv.pack_masked(pieces, args.seq_len)
  elapsed = time.perf_counter() - start
  tokens = sum(len(p[0]) for p in pieces)
  report("encode (once per run)", conversations_per_s=round(len(convs) / elapsed, 1),
         tokens_per_s=round(tokens / elapsed, 1), rows=int(rows.shape[0]),
         answer_share=round(float(masks.mean()), 3))
  # Enough rows for several epochs' worth of distinct batches: the packed set repeated.
  reps = max(1, 20000 // len(rows))
  rows, masks = np.tile(rows, (reps, 1)), np.tile(masks, (reps, 1))
  folder = pathlib.Path(tempfile.mkdtemp())
  np.save(folder / "rows.npy", rows)
  np.save(folder / "masks.npy", masks)
  sources = {"memory": (rows, masks),
             "mmap": (np.load(folder / "rows.npy", mmap_mode="r"), np.load(folder / "masks.npy", mmap_mode="r"))}
  b, t = args.batch, args.seq_len
  for where, (r, m) in sources.items():
    ours = data_lib.Batches(r, b, seed=0, masks=m)

    def ours_next():
      idx = ours.next_indices()
      return r[idx], m[idx]

    report(f"specjax Batches ({where})", **timed(ours_next, args.seconds, b, t))
    per_row = (grain.MapDataset.range(len(r)).shuffle(seed=0).repeat()
               .map(lambda i: (r[i], m[i])).batch(b, drop_remainder=True))
    it = iter(per_row.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    report(f"grain map per row + batch ({where})", **timed(lambda: next(it), args.seconds, b, t))
    gather = (grain.MapDataset.range(len(r)).shuffle(seed=0).repeat().batch(b, drop_remainder=True)
              .map(lambda idx: (r[np.sort(idx)], m[np.sort(idx)])))
    it2 = iter(gather.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    report(f"grain batch indices + gather ({where})", **timed(lambda: next(it2), args.seconds, b, t))
    it3 = iter(gather.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)))
    report(f"grain batch indices + gather, 2 threads ({where})", **timed(lambda: next(it3), args.seconds, b, t))
  # Coverage: one epoch of each visits every row once (partial last batch dropped by both).
  n = 1000
  ours = data_lib.Batches(np.arange(n)[:, None].repeat(2, 1), b, seed=0)
  seen = np.concatenate([ours.next()[:, 0] for _ in range(ours.batches_per_epoch)])
  ds = grain.MapDataset.range(n).shuffle(seed=0).batch(b, drop_remainder=True)
  seen_g = np.concatenate([ds[i] for i in range(len(ds))])
  assert len(set(seen.tolist())) == len(seen) == len(set(seen_g.tolist())) == len(seen_g) == n // b * b
  print("\n| case | examples/s | tokens/s |\n|---|---:|---:|")
  for r in results[1:]:
    print(f"| {r['case']} | {r['examples_per_s']:,.0f} | {r['tokens_per_s']:,.0f} |")
  if args.out:
    pathlib.Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
