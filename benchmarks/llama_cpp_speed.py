"""llama.cpp's speed on a GGUF file, for ``benchmarks/quantized.py``'s llama.cpp row (run in its own process, by
whichever Python has ``llama_cpp``: llama-cpp-python builds llama.cpp from source and usually lives in its own venv).

    python benchmarks/llama_cpp_speed.py MODEL.gguf REQUEST.json

``REQUEST.json``: ``{"prompts": [[token ids], ...], "new_tokens": N, "repeats": R, "threads": T}``. The prompts are
token ids (specjax's tokenizer and chat template), fed to llama.cpp as they are. Prints one JSON object:
``tok_s`` (N greedy tokens of the first prompt over the median time of R runs after a warm-up run, prompt
evaluation included, as the specjax rows count it), ``greedy`` (N greedy tokens per prompt), the version and the
thread count. Exits 3, with the reason on stderr, when ``llama_cpp`` cannot be imported.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def greedy(llm, prompt: list[int], n: int) -> list[int]:
  """``n`` greedy tokens after ``prompt`` (no stop at end of turn: the specjax rows generate ``n`` too); the KV
  cache is emptied first, so every run evaluates the whole prompt."""
  llm.reset()
  out = []
  for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
    out.append(int(token))
    if len(out) == n:
      break
  return out


def main() -> int:
  try:
    import llama_cpp
  except ImportError as e:
    print(f"llama_cpp is not importable in {sys.executable}: {e}", file=sys.stderr)
    return 3
  path, request = sys.argv[1], json.load(open(sys.argv[2]))
  prompts, n, repeats, threads = request["prompts"], request["new_tokens"], request["repeats"], request["threads"]
  llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
  greedy(llm, prompts[0], n)  # warm-up
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    tokens = greedy(llm, prompts[0], n)
    samples.append(time.perf_counter() - start)
  assert len(tokens) == n
  print(json.dumps({"tok_s": n / statistics.median(samples), "seconds": samples, "threads": threads,
                    "greedy": [greedy(llm, p, n) for p in prompts], "version": llama_cpp.__version__}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
