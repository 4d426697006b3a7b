"""Instruction prompts built from the Python standard library, and self-distillation data from a chat target.

No instruction data set can be downloaded here, so the prompts are made from the corpus every machine has:
the standard library's functions (their names, signatures and docstrings) and code. A prompt belongs to the
split of the file it was made from (:func:`specjax.train.data.split_of`), so held-out prompts come from files
the training never saw.

Self-distillation: the target answers the training prompts through its own chat template (greedy and
sampled, alternately), and each conversation, rendered exactly as at inference, becomes a corpus document;
corpus code is mixed in. Heads and drafts trained on that text learn what the target really produces.

Usage::

    python -m specjax.train.instructions --target smollm2-135m-instruct --out runs/smollm2_sd.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
from collections.abc import Iterator

import numpy as np

from specjax.train import data as data_lib

_TEMPLATES = (
    "Write a Python function `{name}({args})` that {summary}",
    "Implement `{name}({args})` in Python. It should {summary}",
    "Explain what the following Python code does:\n\n```python\n{code}\n```",
    "Add a docstring and type hints to this function:\n\n```python\n{code}\n```",
    "What does the function `{qualname}` in the Python module `{module}` do?",
)


def _functions(path: pathlib.Path, module: str) -> Iterator[dict]:
  """Top-level and method functions of one file with a docstring: name, args, summary, code."""
  try:
    source = path.read_text(encoding="utf-8", errors="replace")
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return
  lines = source.splitlines()
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith(("_", "test")):
      continue
    doc = ast.get_docstring(node)
    if not doc:
      continue
    summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    if not 20 <= len(summary) <= 240:
      continue
    code = "\n".join(lines[node.lineno - 1:node.end_lineno])
    if len(code) > 1200:
      continue
    args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
    summary = summary[0].lower() + summary[1:]
    yield {"name": node.name, "args": args, "summary": summary.rstrip(".") + ".", "code": code,
           "qualname": node.name, "module": module}


def instruction_prompts(split: str, n: int, seed: int = 0) -> list[str]:
  """``n`` instruction prompts made from the standard library files of ``split`` (train/valid/test),
  drawn reproducibly from ``seed``."""
  if split not in data_lib.SPLITS:
    raise ValueError(f"split must be one of {data_lib.SPLITS}, got {split!r}")
  root, files = data_lib.corpus_files("stdlib")
  items = []
  for path in files:
    name = path.relative_to(root).as_posix()
    if data_lib.split_of(name) != split:
      continue
    module = name[:-3].replace("/", ".").removesuffix(".__init__")
    if any(part.startswith(("test", "idle_test")) for part in module.split(".")):
      continue  # the test suites: documented helpers of tests make poor instructions
    items.extend(_functions(path, module))
  if not items:
    raise ValueError(f"no documented functions in the {split} split of the standard library")
  rng = np.random.default_rng([seed, data_lib.SPLITS.index(split)])
  picks = rng.choice(len(items), size=n, replace=len(items) < n)
  return [_TEMPLATES[int(rng.integers(len(_TEMPLATES)))].format(**items[i]) for i in picks]


def self_distill(target, tokenizer, chat, prompts: list[str], *, max_new_tokens: int = 160, batch: int = 32,
                 temperature: float = 0.7, seed: int = 0, progress: bool = True, done: int = 0,
                 on_batch=None) -> list[str]:
  """The target's answers to ``prompts`` through its chat template, as rendered conversations (prompt text,
  answer, end-of-turn token): greedy for even batches, sampled at ``temperature`` (top-p 0.95) for odd ones.

  ``done``: the first ``done`` prompts (a multiple of ``batch``) were answered by an earlier, interrupted call
  and are skipped. ``on_batch(texts)``: called with each batch's conversations as soon as they exist."""
  if done % batch:
    raise ValueError(f"done ({done}) must be a multiple of batch ({batch})")
  import specjax
  from tqdm import tqdm

  stops = chat.stop_ids(tokenizer)
  spell = getattr(tokenizer, "id_to_token", None) or (lambda i: tokenizer.decode([i]))
  end = spell(chat.end_of_turn_ids[0]) if chat.end_of_turn_ids else ""
  texts = []
  for b, i in enumerate(tqdm(range(0, len(prompts), batch), desc="self-distillation", disable=not progress)):
    if i < done:
      continue
    rendered = [chat.prompt(p) for p in prompts[i:i + batch]]
    ids = [chat.encode(tokenizer, [{"role": "user", "content": p}]) for p in prompts[i:i + batch]]
    sampling = specjax.GREEDY if b % 2 == 0 else specjax.SamplingConfig(temperature=temperature, top_p=0.95)
    out = specjax.generate(target, ids, sampling=sampling, max_new_tokens=max_new_tokens, seed=seed + b,
                           eos_id=stops)
    answers = []
    for prompt_text, row in zip(rendered, out.rows()):
      answer = tokenizer.decode([t for t in row if t not in stops])
      answers.append(prompt_text + answer + (end if row and row[-1] in stops else ""))
    texts += answers
    if on_batch is not None:
      on_batch(answers)
  return texts


def code_documents(n: int, seed: int = 0, max_chars: int = 2000, corpus: str = "stdlib") -> list[str]:
  """``n`` excerpts (at most ``max_chars`` each) of distinct documents of the train split of ``corpus``
  (default: the standard library's code); fewer if the split holds fewer documents."""
  docs = data_lib.documents(corpus, "train")
  rng = np.random.default_rng([seed, 7])
  out = []
  for i in rng.choice(len(docs), size=min(n, len(docs)), replace=False):
    text = docs[int(i)]
    start = int(rng.integers(0, max(1, len(text) - max_chars)))
    out.append(text[start:start + max_chars])
  return out


def _jsonl(texts) -> str:
  """Corpus JSONL lines, ``{"text": ...}`` per text."""
  return "".join(json.dumps({"text": t}) + "\n" for t in texts)


def kept_answers(partial: pathlib.Path) -> list[str]:
  """The answers an interrupted run kept in ``partial``: every whole JSONL line, in order. A last line cut
  mid-write (no newline at its end) is dropped, and its batch is answered again."""
  if not partial.exists():
    return []
  lines = partial.read_text().split("\n")
  return [json.loads(line)["text"] for line in lines[:-1]]  # the piece after the last newline is "" or cut


def main(argv: list[str] | None = None) -> None:
  import specjax

  parser = argparse.ArgumentParser(prog="python -m specjax.train.instructions")
  parser.add_argument("--target", help="a chat model specjax.load can open (name, .gguf, directory)")
  parser.add_argument("--out", required=True, help="JSONL file to write ({'text': ...} per line)")
  parser.add_argument("--held-out", type=int, metavar="N",
                      help="instead: write N held-out prompts (test split) as {'prompt': ...} lines, for evaluation")
  parser.add_argument("--prompts", type=int, default=1500, help="training prompts answered by the target")
  parser.add_argument("--code-docs", type=int, default=300, help="standard-library code excerpts mixed in")
  parser.add_argument("--max-new-tokens", type=int, default=160)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  if args.held_out:
    prompts = instruction_prompts("test", args.held_out, args.seed)
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} held-out prompts to {out}")
    return
  if not args.target:
    parser.error("--target is needed to generate self-distillation data")
  loaded = specjax.load(args.target)
  if loaded.chat is None:
    parser.error(f"{args.target} has no chat template")
  # Answers go to OUT.partial batch by batch, so an interrupted run keeps them; running the same command again
  # answers only the prompts that are left.
  partial = out.with_name(out.name + ".partial")
  texts = kept_answers(partial)
  done = len(texts) - len(texts) % args.batch
  texts = texts[:done]
  if done:
    print(f"resuming: {done} answers found in {partial}")
  partial.write_text(_jsonl(texts))

  def keep(batch_texts):
    with partial.open("a") as f:
      f.write(_jsonl(batch_texts))

  texts += self_distill(loaded.model, loaded.tokenizer, loaded.chat, instruction_prompts("train", args.prompts, args.seed),
                        max_new_tokens=args.max_new_tokens, batch=args.batch, seed=args.seed, done=done,
                        on_batch=keep)
  texts += code_documents(args.code_docs, args.seed)
  order = np.random.default_rng(args.seed).permutation(len(texts))
  out.write_text(_jsonl(texts[i] for i in order))
  partial.unlink()
  print(f"wrote {len(texts)} documents to {out}")


if __name__ == "__main__":
  main()
