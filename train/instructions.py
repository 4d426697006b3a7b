"""Instruction prompts of several kinds built from text every machine has, and self-distillation data from a
chat target.

No instruction data set can be downloaded here, so the prompts are made from what is on disk and from our own
word lists. Kinds (:data:`KINDS`):

* ``code``: the standard library's functions (their names, signatures, docstrings and code): write, explain,
  document.
* ``prose``: passages of the Python documentation that ships with the standard library (``pydoc_data``'s
  topics) and module docstrings: summarise, explain simply, list key points, ask and answer questions.
* ``chat``: general requests (stories, advice, emails, comparisons, trips, recipes, translations, poems), each
  a template of our own filled from our own word lists.
* ``math``: arithmetic word problems and equations with drawn numbers, answered step by step.

Held-out prompts never occur in training (:func:`prompt_split`): a ``code`` or ``prose`` prompt belongs to the
split of the file (or documentation passage) it was made from, so held-out prompts come from text the training
prompts never saw; a ``chat`` or ``math`` prompt belongs to the split of its own text. The corpus split
(:func:`specjax.train.data.split_of`, 1 % test) leaves only four non-test files of the standard library in its
test split, so prompts hold out 5 % more of the corpus's train files (and passages, and requests) for each of
valid and test; :func:`code_documents` leaves those files out of the training text too.

Self-distillation: the target answers the training prompts through its own chat template (greedy and
sampled, alternately), and each conversation, rendered exactly as at inference, becomes a corpus document;
corpus code is mixed in. Heads and drafts trained on that text learn what the target really produces. For
data at scale, ``--conversations N`` writes the prompts as conversations for ``specjax train heads --data``
instead, which has the target answer them there (sharded and resumable; with speculation at the
conversations' k proposals a round, or the target alone at k = 0).

Usage::

    python -m specjax.train.instructions --target smollm2-135m-instruct --out runs/smollm2_sd.jsonl
    python -m specjax.train.instructions --held-out 16 --kinds code --out runs/smollm2_heldout.jsonl
    python -m specjax.train.instructions --conversations 20000 --out runs/prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import itertools
import json
import pathlib
import string
from collections.abc import Iterator, Sequence

import numpy as np

from specjax.train import data as data_lib

KINDS = ("code", "prose", "chat", "math")

_TEMPLATES = (
    "Write a Python function `{name}({args})` that {summary}",
    "Implement `{name}({args})` in Python. It should {summary}",
    "Explain what the following Python code does:\n\n```python\n{code}\n```",
    "Add a docstring and type hints to this function:\n\n```python\n{code}\n```",
    "What does the function `{qualname}` in the Python module `{module}` do?",
)

_PROSE_TEMPLATES = (
    "Summarize the following passage in two or three sentences:\n\n{passage}",
    "Explain this passage from the Python documentation in simple words, for a beginner:\n\n{passage}",
    "List the key points of the following text:\n\n{passage}",
    "Write three questions that test whether someone understood this text, and answer them:\n\n{passage}",
    "Rewrite the following paragraph so that it is shorter and easier to read:\n\n{passage}",
)
_MODULE_TEMPLATE = "What is the Python module `{module}` for? Its documentation begins:\n\n{passage}"
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


# General requests: templates of our own, each slot filled from a word list of our own.
_CHAT_SLOTS = {
    "character": ("a retired lighthouse keeper", "a young inventor", "a lost robot", "a cat who cannot sleep",
                  "two rival bakers", "a shy dragon", "a substitute teacher", "an astronaut on her last mission",
                  "a street musician", "a detective who is afraid of the dark", "a farmer and a crow",
                  "a boy who collects maps"),
    "event": ("finds a door that was not there yesterday", "has to win a competition", "loses something important",
              "meets an old friend by chance", "is stuck in a storm", "discovers a secret message",
              "must keep a promise", "wakes up in another century", "learns to ask for help"),
    "activity": ("learning a new language", "running a first marathon", "saving money on groceries",
                 "sleeping better", "working from home", "keeping houseplants alive", "public speaking",
                 "studying for an exam", "starting to draw", "cooking for a large family", "moving to a new city",
                 "making friends as an adult", "writing a novel", "preparing for a job interview",
                 "reducing screen time", "camping with children"),
    "concept": ("inflation", "photosynthesis", "the water cycle", "compound interest", "black holes",
                "how vaccines work", "supply and demand", "climate change", "how the internet works", "gravity",
                "democracy", "evolution by natural selection", "how a computer stores numbers", "the seasons",
                "what a database is", "how batteries work", "probability", "why the sky is blue"),
    "audience": ("a ten-year-old", "a busy manager", "someone who has never studied science", "a high school student",
                 "my grandmother"),
    "choice": ("renting versus buying a home", "working remotely", "electric cars", "learning to code",
               "social media for teenagers", "a four-day work week", "online classes", "owning a dog",
               "living in a big city", "freelancing", "nuclear power", "buying second-hand clothes"),
    "form": ("a short poem", "a haiku", "a limerick", "a song verse", "a two-line rhyme"),
    "thing": ("the ocean", "autumn", "a cup of coffee", "friendship", "the first day of school", "the moon",
              "a rainy Monday", "mountains", "an old bicycle", "the city at night", "a garden", "winter mornings"),
    "recipient": ("my landlord", "a colleague", "my manager", "a customer", "a teacher", "the neighbours",
                  "a hotel", "a supplier"),
    "purpose": ("asking to reschedule a meeting", "about a late payment", "requesting a day off",
                "thanking them for their help", "about a noise problem", "to report a broken heater",
                "declining an invitation", "asking for feedback on a report", "about a missing delivery"),
    "pair": (("cats", "dogs"), ("tea", "coffee"), ("Python", "JavaScript"), ("trains", "planes"),
             ("books", "films"), ("summer", "winter"), ("saving", "investing"), ("running", "swimming"),
             ("paper maps", "GPS"), ("email", "phone calls"), ("city life", "country life"),
             ("solar power", "wind power")),
    "place": ("Lisbon", "Kyoto", "the Scottish Highlands", "Mexico City", "Cape Town", "Iceland", "Rome",
              "Vancouver", "the Amalfi coast", "Istanbul", "New Zealand's South Island", "Prague"),
    "traveler": ("a family with two small children", "a student on a budget", "a retired couple",
                 "someone who loves food", "a solo hiker"),
    "task": ("fix a leaking tap", "change a flat tyre", "write a good cover letter", "back up my photos",
             "make bread without yeast", "organise a small wedding", "train a puppy to sit", "plan a weekly budget",
             "learn to touch type", "clean a cast iron pan", "start a vegetable garden", "negotiate a salary",
             "prepare for a long flight", "remove a stain from a shirt"),
    "history": ("the printing press", "the bicycle", "the Olympic Games", "coffee", "the telephone",
                "the Roman Empire", "chess", "the internet", "paper money", "the Silk Road"),
    "ingredient": ("chickpeas", "spinach", "lemons", "rice", "eggs", "mushrooms", "sweet potatoes", "lentils",
                   "tomatoes", "oats", "apples", "tofu"),
    "language": ("French", "Spanish", "German", "Italian", "Portuguese"),
    "sentence": ("Where is the nearest train station?", "I would like a table for two, please.",
                 "The meeting has been moved to Thursday.", "Could you speak more slowly?",
                 "We are looking forward to seeing you.", "How much does this cost?",
                 "My flight was delayed by three hours.", "Thank you for your patience."),
    "business": ("a bakery that only sells bread made overnight", "a bicycle repair shop", "a dog walking service",
                 "an app that reminds people to drink water", "a bookshop with a café", "a plant nursery",
                 "a language tutoring service", "a second-hand furniture store"),
}
_CHAT_TEMPLATES = (
    "Write a short story about {character} who {event}.",
    "Give me {n} practical tips for {activity}.",
    "Explain {concept} to {audience}.",
    "What are the pros and cons of {choice}?",
    "Write {form} about {thing}.",
    "Write a polite email to {recipient} {purpose}.",
    "Compare {pair[0]} and {pair[1]}. Which would you choose, and why?",
    "Plan a {days}-day trip to {place} for {traveler}.",
    "How do I {task}? Give me step-by-step instructions.",
    "Summarize the history of {history} in a few sentences.",
    "Suggest a simple recipe that uses {ingredient} and {ingredient2}.",
    "Translate into {language}: \"{sentence}\"",
    "Suggest a name and a tagline for {business}.",
    "I am nervous about {activity}. Can you encourage me and tell me how to start?",
)
_NUMBERS = {"n": (3, 4, 5, 7), "days": (2, 3, 4, 5)}

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena")
_ITEMS = ("apple", "marble", "book", "sticker", "pencil", "cookie", "stamp", "shell")


def _math_prompt(rng: np.random.Generator) -> str:
  """One arithmetic word problem or equation with drawn numbers, asked to be solved step by step."""
  name, item = _NAMES[rng.integers(len(_NAMES))], _ITEMS[rng.integers(len(_ITEMS))]
  a, b, c = (int(x) for x in rng.integers(2, 60, size=3))
  form = int(rng.integers(8))
  if form == 0:
    return (f"{name} has {a + c} {item}s, buys {b} more and gives {c} to a friend. How many {item}s does {name} "
            "have now? Explain step by step.")
  if form == 1:
    return f"A train travels {a * 10} km in {b % 5 + 2} hours. What is its average speed? Show your working."
  if form == 2:
    return f"What is {a * 7} × {b + 11}? Show each step of the multiplication."
  if form == 3:
    return f"Solve for x: {a % 9 + 2}x + {b} = {(a % 9 + 2) * c + b}. Explain each step."
  if form == 4:
    return f"A rectangle is {a} cm wide and {b + a} cm long. What are its area and its perimeter?"
  if form == 5:
    return f"What is {(a % 8 + 1) * 5}% of {b * 20}? Explain how you got the answer."
  if form == 6:
    return (f"{name} reads {a % 20 + 5} pages a day. How many days does a {(a % 20 + 5) * (b % 12 + 3) + c % 7}-page "
            "book take? Explain.")
  price, count = b % 9 + 1, c % 5 + 1
  note = 50 if price * count < 50 else 100
  return (f"A shop sells {item}s at {price} dollars each. {name} pays with a {note}-dollar note for {count} {item}s. "
          f"How much change does {name} get? Explain step by step.")


_PROMPT_HELD_OUT = 50  # of 1000 buckets, for each of test and valid, on top of the corpus's own split


def prompt_split(name: str) -> str:
  """The split of the prompts made from ``name`` (a file, passage or prompt text): the corpus split of ``name``
  (:func:`specjax.train.data.split_of`) when that is valid or test, else test or valid for another 5 % each (a
  SHA-256 bucket of its own), else train."""
  split = data_lib.split_of(name)
  if split != "train":
    return split
  bucket = int.from_bytes(hashlib.sha256(f"prompt:{name}".encode()).digest()[:8], "little") % 1000
  return "test" if bucket < _PROMPT_HELD_OUT else "valid" if bucket < 2 * _PROMPT_HELD_OUT else "train"


@functools.cache
def _chat_prompts() -> tuple[str, ...]:
  """Every general request the templates and word lists make, in a fixed order."""
  out = []
  for template in _CHAT_TEMPLATES:
    names = sorted({f.split("[")[0] for _, f, _, _ in string.Formatter().parse(template) if f})
    pools = []
    for name in names:
      if name == "ingredient2":
        pools.append(_CHAT_SLOTS["ingredient"])
      else:
        pools.append(_NUMBERS.get(name) or _CHAT_SLOTS[name])
    for values in itertools.product(*pools):
      fill = dict(zip(names, values))
      if fill.get("ingredient2") is not None and fill["ingredient2"] == fill["ingredient"]:
        continue
      out.append(template.format(**fill))
  return tuple(out)


def _passages(text: str, most: int = 900, least: int = 200) -> Iterator[str]:
  """Consecutive paragraphs of ``text`` joined into passages of ``least``..``most`` characters (a longer
  paragraph alone is skipped)."""
  chunk = ""
  for para in (p.strip() for p in text.split("\n\n")):
    if not para:
      continue
    if chunk and len(chunk) + len(para) + 2 > most:
      if len(chunk) >= least:
        yield chunk
      chunk = ""
    if len(para) <= most:
      chunk = f"{chunk}\n\n{para}" if chunk else para
  if len(chunk) >= least:
    yield chunk


@functools.cache
def _prose_items(split: str) -> tuple[tuple[str, dict], ...]:
  """``(template, fields)`` of the prose prompts of ``split``: documentation topic passages (each in the split of
  its text) and module docstrings (in the split of the module's file)."""
  items = []
  try:
    from pydoc_data.topics import topics
  except ImportError:  # a Python built without its documentation topics: module docstrings only
    topics = {}
  seen = set()
  for key in sorted(topics):
    for passage in _passages(topics[key]):
      # By its own text: topics repeat passages of one another, and a repeat must fall in the same split.
      if passage not in seen and prompt_split(f"pydoc_data/topics/{passage}") == split:
        items.extend((t, {"passage": passage}) for t in _PROSE_TEMPLATES)
      seen.add(passage)
  for name, module, path in _stdlib_modules(split):
    try:
      doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8", errors="replace")))
    except (SyntaxError, ValueError):
      continue
    passage = next(_passages(doc or "", most=700, least=120), None)
    if passage:
      items.append((_MODULE_TEMPLATE, {"module": module, "passage": passage}))
  return tuple(items)


def _stdlib_modules(split: str) -> Iterator[tuple[str, str, pathlib.Path]]:
  """``(file name, module, path)`` of the standard library's files of ``split``, test suites left out."""
  root, files = data_lib.corpus_files("stdlib")
  for path in files:
    name = path.relative_to(root).as_posix()
    if prompt_split(name) != split:
      continue
    module = name[:-3].replace("/", ".").removesuffix(".__init__")
    if any(part.startswith(("test", "idle_test")) for part in module.split(".")):
      continue  # the test suites: documented helpers of tests make poor instructions
    yield name, module, path


@functools.cache
def _code_items(split: str) -> tuple[dict, ...]:
  """The documented functions of the files of ``split``. A held-out one whose code, or name and summary, a training
  file also has (``posixpath`` and ``ntpath`` share many) is left out, so its prompts never occur in training."""
  items = tuple(item for _, module, path in _stdlib_modules(split) for item in _functions(path, module))
  if split == "train":
    return items
  seen = {key for item in _code_items("train") for key in (item["code"], (item["name"], item["summary"]))}
  return tuple(i for i in items if i["code"] not in seen and (i["name"], i["summary"]) not in seen)


def _draw(rng: np.random.Generator, size: int, count: int) -> list[int]:
  """``count`` indices into ``size`` items: a permutation's first ones, further permutations once it runs out
  (so the first ``m`` of ``count`` draws are the draws of ``m``)."""
  out = []
  while len(out) < count:
    out += rng.permutation(size).tolist()
  return out[:count]


def check_kinds(kinds: str | Sequence[str]) -> tuple[str, ...]:
  """``kinds`` (a comma-separated string or a sequence) as a tuple of known kinds, in the order given.

  Raises:
    ValueError: an empty list, or an unknown or repeated kind, naming ``kinds`` and the allowed values.
  """
  given = [k.strip() for k in kinds.split(",")] if isinstance(kinds, str) else list(kinds)
  bad = [k for k in given if k not in KINDS]
  if not given or bad or len(set(given)) != len(given):
    raise ValueError(f"kinds must be distinct values of {KINDS} (comma-separated), got {kinds!r}")
  return tuple(given)


def instruction_prompts(split: str, n: int, seed: int = 0, kinds: str | Sequence[str] = KINDS,
                        with_kinds: bool = False) -> list[str] | list[tuple[str, str]]:
  """``n`` instruction prompts of ``split`` (train/valid/test), drawn reproducibly from ``seed``.

  Each prompt's kind is drawn uniformly from ``kinds`` (see the module docstring), then the prompt from that
  kind's prompts of ``split``; drawing repeats a prompt only when a kind has fewer than asked. With
  ``with_kinds`` the result is ``[(kind, prompt)]``.

  Raises:
    ValueError: an unknown split or kind (naming the field and the allowed values), or a kind with no prompt in
      the split.
  """
  if split not in data_lib.SPLITS:
    raise ValueError(f"split must be one of {data_lib.SPLITS}, got {split!r}")
  kinds = check_kinds(kinds)
  rng = np.random.default_rng([seed, data_lib.SPLITS.index(split)])
  counts = np.bincount(rng.integers(len(kinds), size=n), minlength=len(kinds)) if len(kinds) > 1 else [n]
  out = []
  for kind, count in zip(kinds, counts):
    count = int(count)
    # A kind's own generator: its first m prompts are the same whichever other kinds are drawn.
    krng = np.random.default_rng([seed, data_lib.SPLITS.index(split), KINDS.index(kind)])
    if kind == "code":
      items = _code_items(split)
      if not items:
        raise ValueError(f"no documented functions in the {split} split of the standard library")
      picks = _draw(krng, len(items), count)
      texts = [_TEMPLATES[int(krng.integers(len(_TEMPLATES)))].format(**items[i]) for i in picks]
    elif kind == "prose":
      items = _prose_items(split)
      if not items:
        raise ValueError(f"no documentation passages in the {split} split of the standard library")
      picks = _draw(krng, len(items), count)
      texts = [items[i][0].format(**items[i][1]) for i in picks]
    elif kind == "chat":
      pool = [t for t in _chat_prompts() if prompt_split(f"chat/{t}") == split]
      texts = [pool[i] for i in _draw(krng, len(pool), count)]
    else:  # math: drawn until `count` prompts of the split are found (a draw is one of ~10^7 problems)
      texts = []
      while len(texts) < count:
        text = _math_prompt(krng)
        if prompt_split(f"math/{text}") == split:
          texts.append(text)
    out += [(kind, t) for t in texts]
  order = rng.permutation(len(out))
  out = [out[i] for i in order]
  return out if with_kinds else [t for _, t in out]


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
  (default: the standard library's code); fewer if the split holds fewer documents. Of the standard library,
  the files whose prompts are held out (:func:`prompt_split`) are left out too."""
  docs = data_lib.documents(corpus, "train")
  if corpus == "stdlib":
    root, files = data_lib.corpus_files("stdlib")
    held = {data_lib.read_text(f) for f in files if prompt_split(f.relative_to(root).as_posix()) != "train"}
    docs = [d for d in docs if d not in held]
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
  parser.add_argument("--conversations", type=int, metavar="N",
                      help="instead: write N training prompts as conversations of one user turn (OpenAI messages), "
                           "for `specjax train heads --data FILE`, which has the target answer them")
  parser.add_argument("--kinds", default=",".join(KINDS),
                      help=f"comma-separated prompt kinds, drawn uniformly, of {KINDS} (default: all)")
  parser.add_argument("--prompts", type=int, default=1500, help="training prompts answered by the target")
  parser.add_argument("--code-docs", type=int, default=300, help="standard-library code excerpts mixed in")
  parser.add_argument("--max-new-tokens", type=int, default=160)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  try:
    kinds = check_kinds(args.kinds)
  except ValueError as e:
    parser.error(f"--kinds: {e}")
  for name in ("held_out", "conversations", "prompts"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be a positive number of prompts, got {getattr(args, name)}")
  if args.held_out and args.conversations:
    parser.error("--held-out and --conversations write different files: give one")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  if args.held_out:
    prompts = instruction_prompts("test", args.held_out, args.seed, kinds, with_kinds=True)
    out.write_text("".join(json.dumps({"prompt": p, "kind": k}) + "\n" for k, p in prompts))
    print(f"wrote {len(prompts)} held-out prompts to {out}")
    return
  if args.conversations:
    prompts = instruction_prompts("train", args.conversations, args.seed, kinds, with_kinds=True)
    out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}], "kind": k}) + "\n"
                           for k, p in prompts))
    print(f"wrote {len(prompts)} training prompts as conversations to {out}")
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

  prompts = instruction_prompts("train", args.prompts, args.seed, kinds)
  texts += self_distill(loaded.model, loaded.tokenizer, loaded.chat, prompts, max_new_tokens=args.max_new_tokens,
                        batch=args.batch, seed=args.seed, done=done, on_batch=keep)
  texts += code_documents(args.code_docs, args.seed)
  order = np.random.default_rng(args.seed).permutation(len(texts))
  out.write_text(_jsonl(texts[i] for i in order))
  partial.unlink()
  print(f"wrote {len(texts)} documents to {out}")


if __name__ == "__main__":
  main()
