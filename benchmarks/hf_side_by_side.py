"""specjax against Hugging Face transformers on the same weights, CPU and thread count (harness: peer.py, here).

    python benchmarks/hf_side_by_side.py --pair random-100m [--threads 1] [--repeats 3] [--k 4]
        [--max-new-tokens 128] [--prompt-lookup 10] [--stem NAME] [--out benchmarks/results/hf_side_by_side]

Writes <out>/<stem>.json (every figure, every output) and <out>/<stem>.md (the table); stem defaults to
the pair name. Needs the `peer` extra (torch, transformers). Pairs: random-100m, random-small, tiny, and
embedded once the trained pair ships (or any pair added with peer.register_pair in benchmarks/peer.py).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pair", default="random-small",
                      help="random-100m | random-small | tiny | embedded | smollm2 (default random-small)")
  parser.add_argument("--threads", type=int, default=1, help="CPU threads for XLA and torch alike")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--k", type=int, default=4, help="proposals per round (constant schedule)")
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--prompt-lookup", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
  parser.add_argument("--no-assisted-default", action="store_true",
                      help="skip transformers' assisted generation with its default settings")
  parser.add_argument("--prompts", help="a prompt file (JSONL with 'prompt' fields, or one per line); default: "
                                        "three code openings")
  parser.add_argument("--chat", action="store_true", help="wrap each prompt with the pair's chat template")
  parser.add_argument("--stem", default=None, help="output file name without extension (default: the pair)")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                    "hf_side_by_side"))
  args = parser.parse_args(argv)

  # Before JAX and torch start their thread pools: both engines get the same CPUs.
  allowed = len(os.sched_getaffinity(0))
  if not 1 <= args.threads <= allowed:
    parser.error(f"--threads must be in [1, {allowed}], got {args.threads}")
  # benchmarks/peer.py, found beside this script. It imports jax, whose CPU backend starts lazily: after the
  # pinning below.
  import peer

  if args.pair not in peer.PAIRS:
    parser.error(f"--pair must be one of {sorted(peer.PAIRS)}, got {args.pair!r}")
  peer.pin_threads(args.threads)
  try:
    pair = peer.build_pair(args.pair)
  except (ValueError, peer.PairUnavailable) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  prompts = peer.DEFAULT_PROMPTS
  if args.prompts:
    from specjax.cli import CliError, read_prompts

    try:
      prompts = read_prompts(args.prompts)
    except CliError as e:
      parser.error(str(e))
  report = peer.side_by_side(
      pair, pair_name=args.pair, prompts=prompts, max_new_tokens=args.max_new_tokens, k=args.k,
      repeats=args.repeats, prompt_lookup=args.prompt_lookup, threads=args.threads,
      assisted_default=not args.no_assisted_default, chat=args.chat,
      progress=lambda msg: print(msg, file=sys.stderr, flush=True))
  json_path, md_path = peer.write_report(report, args.out, args.stem)
  with open(md_path) as f:
    print(f.read())
  print(f"wrote {json_path} and {md_path}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
