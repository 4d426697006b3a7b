"""Side by side with Hugging Face transformers: the same weights, prompts and greedy decoding in both engines.

A pair of specjax models (a :class:`specjax.loading.Loaded` with a draft) is exported with
:func:`specjax.hf.save_hf` and loaded back as ``transformers.LlamaForCausalLM`` (float32). Then, batch 1, greedy, ``max_new_tokens`` exact:

- specjax: the baseline (``SpecConfig(k=0)``, no proposer), the draft model (``proposer=DraftModel(draft)``,
  ``SpecConfig(k=k)``) and the n-gram lookup (``NGram()``, and ``NGram(n_max=2)`` at transformers' setting);
- transformers: target-only ``generate(do_sample=False)``, assisted generation with ``assistant_model=``
  (a constant schedule of ``k`` proposals matched to specjax's, and the library's default settings), and
  prompt lookup (``prompt_lookup_num_tokens=``).

Each speculative system runs with the small draft and with the draft equal to the target: in greedy mode
both engines then accept every proposal and run the same number of target passes, so the ratio measures the
engines alone. Every output is compared token for token with each engine's target-only greedy output; a
disagreement is explained by the reference logits at the first differing position (a near tie between the
top two tokens flips under float rounding differences; anything else is a bug).

Timing: a first call per (system, prompt) is made untimed and reported separately (it holds the jit compile
and transformers' first-call set-up); then, per repeat, every system runs every prompt, the order of systems
rotating between repeats so slow drifts of the shared machine spread over all of them. JAX outputs are
``block_until_ready`` before the clock is read. Tokens/s = generated tokens / the sum over prompts of the
per-prompt median time.

torch and transformers (the ``peer`` extra) are imported inside the functions that need them, never at
module import. This harness is not part of the installed package: ``benchmarks/hf_side_by_side.py`` (its
command line) imports it from beside itself, the tests through pytest's ``pythonpath``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax import bench
from specjax.config import GREEDY, SpecConfig
from specjax.engine import forward
from specjax.hf import save_hf
from specjax.loading import Loaded
from specjax.proposers import DraftModel, NGram, for_heads
from specjax.models.llama import Llama, LlamaConfig
from specjax.tokenizer import ByteTokenizer

NEAR_TIE = 1e-3  # a top-2 logit gap below this can flip between two float32 engines
# Three short openings (31-36 byte tokens), not specjax.bench.DEFAULT_PROMPTS (16 longer ones): the recorded
# results under benchmarks/results/hf_side_by_side/ were measured on these.
DEFAULT_PROMPTS = (
    "def fibonacci(n):\n    if n < 2:",
    "import os\nimport sys\n\ndef main(",
    "class Stack:\n    def __init__(self):",
)


# ------------------------------------------------------------------------------------------- pairs


@dataclasses.dataclass(frozen=True)
class Pair(Loaded):
  """A :class:`specjax.loading.Loaded` whose ``draft`` is set (a smaller model sharing the target's
  vocabulary), with a one-line description for the report. ``target`` reads ``model``."""

  description: str = ""

  @property
  def target(self):
    return self.model

  @classmethod
  def of(cls, loaded: Loaded, description: str) -> Pair:
    """``loaded`` (every field kept) with ``description``."""
    return cls(**{f.name: getattr(loaded, f.name) for f in dataclasses.fields(Loaded)}, description=description)


def random_pair(target_cfg: LlamaConfig, draft_cfg: LlamaConfig, description: str, seed: int = 0) -> Pair:
  """Randomly initialised Llama target and draft (float32) with the byte tokenizer."""
  if draft_cfg.vocab_size != target_cfg.vocab_size:
    raise ValueError(f"draft vocab_size ({draft_cfg.vocab_size}) must equal the target's "
                     f"({target_cfg.vocab_size})")
  return Pair(model=Llama(target_cfg, rngs=nnx.Rngs(seed)), tokenizer=ByteTokenizer(),
              draft=Llama(draft_cfg, rngs=nnx.Rngs(seed + 1)), description=description)


# About 100 M parameters (97.6 M: 16384 x 768 tied embedding + 12 layers of 7.1 M), a 2-layer draft (5.9 M).
TARGET_100M = LlamaConfig(vocab_size=16384, d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_seq_len=512)
DRAFT_100M = LlamaConfig(vocab_size=16384, d_model=256, n_layers=2, n_heads=4, d_ff=768, max_seq_len=512)
# The shape of the README's example pair: a 6-layer byte-level target (4.5 M) and a 1-layer draft.
TARGET_SMALL = LlamaConfig(vocab_size=257, d_model=256, n_layers=6, n_heads=8, n_kv_heads=2, d_ff=768,
                           max_seq_len=512)
DRAFT_SMALL = LlamaConfig(vocab_size=257, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=192,
                          max_seq_len=512)
TARGET_TINY = LlamaConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                          max_seq_len=256)
DRAFT_TINY = LlamaConfig(vocab_size=257, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                         max_seq_len=256)


class PairUnavailable(RuntimeError):
  """A named pair that cannot be built on this installation (the message says why)."""


def _embedded_pair() -> Pair:
  """The trained pair shipped with specjax."""
  return Pair.of(specjax.load("stdlib-coder"), "the embedded trained pair (stdlib-coder)")


def _smollm2_pair() -> Pair:
  """SmolLM2-135M-Instruct (the GGUF file, by short name) with its shipped head, and the distilled draft of
  ``train/configs/smollm2_draft.toml`` from ``$SPECJAX_SMOLLM2_DRAFT`` (default ``runs/smollm2_draft``)."""
  from specjax.train.trainer import load_target

  try:
    loaded = specjax.load("smollm2-135m-instruct")
  except FileNotFoundError as e:
    raise PairUnavailable(str(e)) from None
  draft_dir = os.environ.get("SPECJAX_SMOLLM2_DRAFT", "runs/smollm2_draft")
  try:
    draft, draft_tok = load_target(draft_dir)
  except ValueError as e:
    raise PairUnavailable(f"the SmolLM2 pair needs its distilled draft: {e}") from None
  specjax.check_same_vocab(loaded.tokenizer, draft_tok)
  return Pair(model=loaded.model, tokenizer=loaded.tokenizer, draft=draft, heads=dict(loaded.heads),
              chat=loaded.chat, description="SmolLM2-135M-Instruct (Q4_1 GGUF, float32) with its distilled draft")


PAIRS: dict[str, Callable[[], Pair]] = {
    "random-100m": lambda: random_pair(TARGET_100M, DRAFT_100M, "random Llama target of ~100 M parameters "
                                       "(d_model 768, 12 layers, vocab 16384) with a random 2-layer draft"),
    "random-small": lambda: random_pair(TARGET_SMALL, DRAFT_SMALL, "random byte-level Llama target of 4.5 M "
                                        "parameters (d_model 256, 6 layers) with a random 1-layer draft"),
    "tiny": lambda: random_pair(TARGET_TINY, DRAFT_TINY, "tiny random Llama pair (tests)"),
    "embedded": _embedded_pair,
    "smollm2": _smollm2_pair,
}


def register_pair(name: str, builder: Callable[[], Loaded | tuple]) -> None:
  """Adds a named pair.

  Args:
    name: the key in ``PAIRS`` (and the description when the builder gives none).
    builder: returns a :class:`Pair`, any :class:`specjax.loading.Loaded` with a draft (``specjax.load``'s
      result), or a tuple ``(target, draft, tokenizer)``.
  """

  def build() -> Pair:
    out = builder()
    if isinstance(out, Pair):
      return out
    if isinstance(out, Loaded):
      return Pair.of(out, name)
    target, draft, tokenizer = out
    return Pair(model=target, tokenizer=tokenizer, draft=draft, description=name)

  PAIRS[name] = build


def build_pair(name: str) -> Pair:
  """The pair registered as ``name``.

  Raises:
    ValueError: ``name`` is not a key of ``PAIRS``.
    PairUnavailable: the pair has no draft.
  """
  if name not in PAIRS:
    raise ValueError(f"pair must be one of {sorted(PAIRS)}, got {name!r}")
  pair = PAIRS[name]()
  if pair.draft is None:
    raise PairUnavailable(f"pair {name!r} has no draft; the side-by-side run needs a target and a draft")
  return pair


# ------------------------------------------------------------------------------------------ machine


def pin_threads(n: int) -> list[int]:
  """Restricts this process to ``n`` CPUs, so XLA's CPU thread pool (sized from the schedulable CPUs when
  the backend starts) and torch (``set_num_threads(n)``, in :func:`load_transformers`) use ``n`` threads.
  Call before JAX initialises its backend. Returns the CPUs kept."""
  allowed = sorted(os.sched_getaffinity(0))
  if not 1 <= n <= len(allowed):
    raise ValueError(f"threads must be in [1, {len(allowed)}] (the CPUs this process may use), got {n}")
  os.sched_setaffinity(0, allowed[:n])
  for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = str(n)
  return allowed[:n]


def machine(threads: int) -> dict[str, Any]:
  """:func:`specjax.bench.machine` with the thread count both engines were given, torch's own thread count
  and the torch and transformers versions."""
  import torch
  import transformers

  return bench.machine(threads=threads, torch_threads=torch.get_num_threads(), torch=torch.__version__,
                       transformers=transformers.__version__)


# ------------------------------------------------------------------------------------------ systems


@dataclasses.dataclass
class System:
  """One way of generating: ``run(prompt_ids) -> generated ids`` (exactly max_new_tokens of them)."""

  name: str
  engine: str  # "specjax" | "transformers"
  method: str  # "none" | "draft" | "assisted" | "prompt_lookup"
  draft: str | None  # "small" | "target" | None
  settings: dict[str, Any]
  run: Callable[[list[int]], list[int]]
  last_stats: dict[str, Any] | None = None
  counted: dict[str, Any] = dataclasses.field(default_factory=dict)  # transformers: role -> model


def load_transformers(model, tokenizer, path: str, threads: int):
  """Exports ``model`` with ``save_hf`` to ``path`` and loads it as a float32 ``LlamaForCausalLM``
  (eval mode, EOS switched off so generation always runs to ``max_new_tokens``)."""
  import torch
  import transformers

  torch.set_num_threads(threads)
  save_hf(model, tokenizer, path)
  hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
  hf.eval()
  _no_eos(hf)
  return hf


def _no_eos(hf) -> None:
  # generate() fills unset options from the model's generation_config, which carries the exported EOS:
  # with it unset, nothing stops a row early and no logits processor touches the EOS logit.
  for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
    setattr(hf.generation_config, name, None)


def _assistant_settings(mode: str, k: int) -> dict[str, Any]:
  """The assisted-generation options read from the assistant's generation_config."""
  if mode == "constant":  # k proposals every round, as specjax's static schedule; no confidence cut-off
    return {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}
  from transformers import GenerationConfig

  defaults = GenerationConfig._get_default_generation_params()  # what transformers fills in when unset
  return {name: defaults[name] for name in
          ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}


def transformers_systems(hf_target, hf_draft, hf_target_copy, k: int, max_new: int, prompt_lookup: int,
                         assisted_default: bool = True) -> list[System]:
  """transformers' target-only, assisted and prompt-lookup generation. ``hf_target_copy`` (a second load of
  the target) is the assistant of draft=target, so the two models' forward passes can be counted apart."""
  import torch

  def generate(prompt, **kw):
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
      out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=max_new, eos_token_id=None, pad_token_id=None, **kw)
    return out[0, len(prompt):].tolist()

  def assisted(assistant, settings):
    def run(prompt):
      for name, value in settings.items():  # one draft serves systems with different settings
        setattr(assistant.generation_config, name, value)
      _no_eos(assistant)
      return generate(prompt, assistant_model=assistant)
    return run

  common = {"do_sample": False, "max_new_tokens": max_new, "eos_token_id": None}
  target_only = {"target": hf_target}
  systems = [System("hf none", "transformers", "none", None, dict(common), generate, counted=target_only)]
  for label, assistant in (("small", hf_draft), ("target", hf_target_copy)):
    settings = _assistant_settings("constant", k)
    systems.append(System(f"hf assisted k={k} draft={label}", "transformers", "assisted", label,
                          dict(common, **settings), assisted(assistant, settings),
                          counted={"target": hf_target, "assistant": assistant}))
  if assisted_default:
    settings = _assistant_settings("default", k)
    systems.append(System("hf assisted default draft=small", "transformers", "assisted", "small",
                          dict(common, **settings, note="transformers' own defaults"),
                          assisted(hf_draft, settings), counted={"target": hf_target, "assistant": hf_draft}))
  systems.append(System(f"hf prompt lookup {prompt_lookup}", "transformers", "prompt_lookup", None,
                        dict(common, prompt_lookup_num_tokens=prompt_lookup, max_matching_ngram_size=2),
                        lambda p: generate(p, prompt_lookup_num_tokens=prompt_lookup), counted=target_only))
  return systems


def count_forwards(system: System, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
  """Runs a transformers system once with forward hooks counting each model's calls (untimed)."""
  calls = {role: 0 for role in system.counted}
  handles = []
  for role, model in system.counted.items():
    def hook(*_, role=role):
      calls[role] += 1
    handles.append(model.register_forward_pre_hook(hook))
  try:
    tokens = system.run(prompt)
  finally:
    for h in handles:
      h.remove()
  return tokens, calls


def specjax_systems(target, draft, k: int, max_new: int, prompt_lookup: int | None = None,
                    heads: dict | None = None) -> list[System]:
  def make(name, method, label, spec, proposer):
    system = System(name, "specjax", method, label, {"sampling": "greedy (temperature 0)",
                                                      "max_new_tokens": max_new, "eos_id": None,
                                                      "spec": repr(spec)}, None)

    def run(prompt):
      out = specjax.generate(target, [prompt], proposer=proposer, spec=spec, sampling=GREEDY,
                             max_new_tokens=max_new, seed=0, eos_id=None)
      jax.block_until_ready(out.tokens)
      system.last_stats = out.stats.to_dict()
      return out.rows()[0]

    system.run = run
    return system

  systems = [make("specjax none", "none", None, SpecConfig(k=0), None)]
  for label, model in (("small", draft), ("target", target)):
    systems.append(make(f"specjax draft k={k} draft={label}", "draft", label, SpecConfig(k=k), DraftModel(model)))
  systems.append(make(f"specjax ngram k={k}", "ngram", None, SpecConfig(k=k), NGram()))
  if prompt_lookup and prompt_lookup != k:  # the setting of transformers' prompt lookup run
    systems.append(make(f"specjax ngram k={prompt_lookup} n<=2", "ngram", None, SpecConfig(k=prompt_lookup),
                        NGram(n_max=2)))
  for method, head_set in sorted((heads or {}).items()):  # heads on the target (no transformers counterpart)
    proposer = for_heads(head_set)
    systems.append(make(f"specjax {method} k={min(k, proposer.max_k or k)}", method, None,
                        SpecConfig(k=min(k, proposer.max_k or k)), proposer))
  return systems


# ------------------------------------------------------------------------------------------ checking


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
  """The first index where two token lists differ (a length difference counts), or None."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


_jit_forward = jax.jit(forward, static_argnums=0)


def _specjax_last_logits(model, context: list[int]) -> np.ndarray:
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray([context], jnp.int32)
  logits, _, _ = _jit_forward(graphdef, state, tokens, model.init_cache(1, len(context)))
  return np.asarray(logits[0, -1])


def _hf_last_logits(hf, context: list[int]) -> np.ndarray:
  import torch

  with torch.inference_mode():
    return hf(torch.tensor([context], dtype=torch.long)).logits[0, -1].float().numpy()


def explain(target, hf_target, prompt: list[int], reference: list[int], other: list[int]) -> dict[str, Any]:
  """Why ``other`` leaves ``reference`` at their first difference: both engines' target logits there
  (uncached full forward over prompt + common prefix), the top-2 gap, and the verdict."""
  i = first_difference(reference, other)
  context = list(prompt) + list(reference[:i])
  ours, theirs = _specjax_last_logits(target, context), _hf_last_logits(hf_target, context)
  entry: dict[str, Any] = {"position": i, "reference_token": reference[i] if i < len(reference) else None,
                           "other_token": other[i] if i < len(other) else None,
                           "max_abs_logit_diff_specjax_vs_hf": float(np.max(np.abs(ours - theirs)))}
  gaps = []
  for name, logits in (("specjax", ours), ("transformers", theirs)):
    top = np.argsort(logits)[::-1][:2]
    gap = float(logits[top[0]] - logits[top[1]])
    gaps.append(gap)
    entry[f"{name}_top2"] = [int(t) for t in top]
    entry[f"{name}_top2_gap"] = gap
  pair = {entry["reference_token"], entry["other_token"]}
  tie = min(gaps) < NEAR_TIE and pair <= set(entry["specjax_top2"]) | set(entry["transformers_top2"])
  entry["cause"] = (f"near tie: the top two logits differ by {min(gaps):.2e} (< {NEAR_TIE}), within float32 "
                    "rounding differences between computations" if tie else
                    "unexplained: the reference's top token wins by a clear margin")
  return entry


# ------------------------------------------------------------------------------------------ running


@dataclasses.dataclass(frozen=True)
class _Setup:
  """The arguments of :func:`side_by_side` that its steps share, with the prompts encoded."""

  prompts: tuple[str, ...]
  prompt_ids: tuple[list[int], ...]  # each prompt encoded with the pair's tokenizer
  max_new_tokens: int
  k: int
  prompt_lookup: int
  repeats: int
  threads: int
  assisted_default: bool


@dataclasses.dataclass
class _Runs:
  """What the systems did, per system name, then per prompt (filled by :func:`_first_calls` and
  :func:`_timed_repeats`)."""

  outputs: dict[str, list[list[int]]]  # the first call's tokens: the reference for repeats and agreement
  first_call_s: dict[str, list[float]]
  stats: dict[str, list[dict | None]]  # specjax: the first call's stats; transformers: forward calls
  times_s: dict[str, list[list[float]]]  # one time per repeat
  nondeterministic: list[str]  # "<system> prompt <p> repeat <r>": a repeat whose tokens left the first call's

  @classmethod
  def empty(cls, systems: list[System], num_prompts: int) -> _Runs:
    names = [s.name for s in systems]
    return cls(outputs={n: [] for n in names}, first_call_s={n: [] for n in names}, stats={n: [] for n in names},
               times_s={n: [[] for _ in range(num_prompts)] for n in names}, nondeterministic=[])


def side_by_side(pair: Pair, *, pair_name: str, prompts: Sequence[str] = DEFAULT_PROMPTS,
                 max_new_tokens: int = 128, k: int = 4, repeats: int = 3, prompt_lookup: int = 10,
                 threads: int = 1, assisted_default: bool = True, workdir: str | None = None,
                 chat: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
  """Runs every system on every prompt and returns the report.

  The steps: export the pair and load it in transformers (:func:`_load_in_transformers`), one untimed call
  per (system, prompt) (:func:`_first_calls`), the timed repeats (:func:`_timed_repeats`), every output
  against both engines' target-only output (:func:`_agreement`), the report (:func:`_report`).

  Args:
    pair: the target and its draft (:func:`build_pair`).
    pair_name: the pair's name in the report.
    prompts: text prompts, encoded with ``pair.tokenizer``.
    chat: wrap each prompt as one user turn with ``pair.chat`` (the model's chat template).
    max_new_tokens: the number of tokens every system generates, exactly.
    k: proposals per round: specjax's draft and n-gram systems, transformers' constant assisted schedule.
    repeats: timed runs of every (system, prompt); 0 leaves the timings empty (tokens/s None).
    prompt_lookup: transformers' ``prompt_lookup_num_tokens`` (and the k of a second specjax n-gram system
      with transformers' n-gram size, when it differs from ``k``).
    threads: torch's thread count, recorded in the report (:func:`pin_threads` gives both engines the CPUs).
    assisted_default: also run transformers' assisted generation with its own default settings.
    workdir: the folder for the temporary Hugging Face export (default: the system's temporary folder).
    progress: called with one line per step and run.

  Returns:
    The report: a JSON-ready dict with the keys ``REPORT_FIELDS`` (machine: ``MACHINE_FIELDS``; each system:
    ``SYSTEM_FIELDS``).

  Raises:
    ValueError: the longest prompt, ``max_new_tokens`` and a window of ``max(k, prompt_lookup)`` do not fit
      a model's ``max_seq_len``.
    RuntimeError: a system that did not generate exactly ``max_new_tokens`` tokens.
  """
  say = progress or (lambda _: None)
  if chat and pair.chat is None:
    raise ValueError(f"chat: the pair {pair_name!r} has no chat template")
  encode = ((lambda p: pair.chat.encode(pair.tokenizer, [{"role": "user", "content": p}])) if chat
            else (lambda p: list(pair.tokenizer.encode(p))))
  setup = _Setup(tuple(prompts), tuple(encode(p) for p in prompts), max_new_tokens, k, prompt_lookup, repeats,
                 threads, assisted_default)
  longest, window = max(map(len, setup.prompt_ids)), max(k, prompt_lookup)
  for role, cfg in (("target", pair.target.cfg), ("draft", pair.draft.cfg)):
    if longest + max_new_tokens + window + 1 > cfg.max_seq_len:
      raise ValueError(f"max_new_tokens: the longest prompt ({longest} tokens) + max_new_tokens "
                       f"({max_new_tokens}) + max(k, prompt_lookup) ({window}) + 1 must be <= the {role}'s "
                       f"max_seq_len ({cfg.max_seq_len})")
  load_before = bench.load_average()
  hf_target, hf_draft, hf_target_copy = _load_in_transformers(pair, threads, workdir, say)
  systems = specjax_systems(pair.target, pair.draft, k, max_new_tokens, prompt_lookup, pair.heads) + transformers_systems(
      hf_target, hf_draft, hf_target_copy, k, max_new_tokens, prompt_lookup, assisted_default)
  runs = _first_calls(systems, setup, say)
  _timed_repeats(systems, setup, runs, say)
  load_after = bench.load_average()
  agreement, disagreements = _agreement(systems, setup, runs.outputs, pair.target, hf_target)
  return _report(pair, pair_name, setup, systems, runs, agreement, disagreements,
                 attention=str(hf_target.config._attn_implementation), load_averages=(load_before, load_after))


def _load_in_transformers(pair: Pair, threads: int, workdir: str | None, say: Callable[[str], None]):
  """The pair exported with ``save_hf`` into a temporary folder and loaded with transformers.

  Returns:
    ``(hf_target, hf_draft, hf_target_copy)``: the copy, a second load of the target, is the assistant of
    the draft = target system, so the two models' forward passes are counted apart.
  """
  with tempfile.TemporaryDirectory(dir=workdir) as tmp:
    say("exporting to Hugging Face format and loading with transformers")
    target_dir = os.path.join(tmp, "target")
    return (load_transformers(pair.target, pair.tokenizer, target_dir, threads),
            load_transformers(pair.draft, pair.tokenizer, os.path.join(tmp, "draft"), threads),
            load_transformers(pair.target, pair.tokenizer, target_dir, threads))


def _run_once(system: System, setup: _Setup, p: int) -> tuple[list[int], float]:
  """``system`` on prompt ``p``: the generated tokens and the wall-clock seconds of the call (specjax blocks
  on its output inside ``run``).

  Raises:
    RuntimeError: the system did not generate exactly ``setup.max_new_tokens`` tokens.
  """
  start = time.perf_counter()
  tokens = system.run(setup.prompt_ids[p])
  elapsed = time.perf_counter() - start
  if len(tokens) != setup.max_new_tokens:
    raise RuntimeError(f"{system.name} generated {len(tokens)} tokens for prompt {p}, not {setup.max_new_tokens}")
  return tokens, elapsed


def _first_calls(systems: list[System], setup: _Setup, say: Callable[[str], None]) -> _Runs:
  """One untimed call per (system, prompt), system by system: jit compilation and transformers' first-call
  set-up happen here, not in the timed repeats.

  Returns:
    A :class:`_Runs` with ``outputs`` (these calls' tokens), ``first_call_s`` and ``stats`` per prompt
    (specjax: the call's decoding stats; transformers: each model's forward calls and the new tokens per
    target call, counted with hooks in a second untimed call), and no timings yet.

  Raises:
    RuntimeError: see :func:`_run_once`.
  """
  runs = _Runs.empty(systems, len(setup.prompt_ids))
  for system in systems:
    for p, prompt in enumerate(setup.prompt_ids):
      say(f"first call: {system.name}, prompt {p}")
      tokens, elapsed = _run_once(system, setup, p)
      runs.outputs[system.name].append(tokens)
      runs.first_call_s[system.name].append(elapsed)
      if system.engine == "transformers":
        _, calls = count_forwards(system, prompt)
        system.last_stats = {f"{role}_forward_calls": n for role, n in calls.items()}
        system.last_stats["tokens_per_target_call"] = setup.max_new_tokens / calls["target"]
      runs.stats[system.name].append(system.last_stats)
  return runs


def _timed_repeats(systems: list[System], setup: _Setup, runs: _Runs, say: Callable[[str], None]) -> None:
  """``setup.repeats`` timed rounds in which every system runs every prompt, prompt by prompt; the order of
  the systems rotates by one per repeat, so no system is always first and slow drifts of a shared machine
  spread over all of them.

  Appends each call's seconds to ``runs.times_s`` and lists in ``runs.nondeterministic`` every call whose
  tokens differ from the same system's first call (``runs.outputs``).

  Raises:
    RuntimeError: see :func:`_run_once`.
  """
  for r in range(setup.repeats):
    order = systems[r % len(systems):] + systems[:r % len(systems)]
    for p in range(len(setup.prompt_ids)):
      for system in order:
        say(f"repeat {r + 1}/{setup.repeats}: {system.name}, prompt {p}")
        tokens, elapsed = _run_once(system, setup, p)
        runs.times_s[system.name][p].append(elapsed)
        if tokens != runs.outputs[system.name][p]:
          runs.nondeterministic.append(f"{system.name} prompt {p} repeat {r}")


def _agreement(systems: list[System], setup: _Setup, outputs: dict[str, list[list[int]]], target,
               hf_target) -> tuple[dict[str, dict[str, bool]], list[dict[str, Any]]]:
  """Every system's outputs against the target-only greedy outputs of both engines.

  Each speculative system's differences from its own engine's baseline, and those of specjax's baseline
  from transformers', are explained (:func:`explain`); a speculative system against the other engine's
  baseline is only marked, as its cause is then the baselines' difference.

  Returns:
    ``(agreement, disagreements)``: per system name ``{"vs_specjax_none": bool, "vs_transformers_none":
    bool}`` (every prompt the same); one :func:`explain` entry per explained differing (system, prompt),
    with ``system``, ``reference`` and ``prompt`` added.
  """
  references = {"specjax": outputs["specjax none"], "transformers": outputs["hf none"]}
  agreement, disagreements = {}, []
  for system in systems:
    agreement[system.name] = {}
    for engine, ref in references.items():
      same = [out == want for out, want in zip(outputs[system.name], ref)]
      agreement[system.name][f"vs_{engine}_none"] = all(same)
      own = engine == system.engine and system.method != "none"
      if own or (system.name == "specjax none" and engine == "transformers"):
        for p in (p for p, ok in enumerate(same) if not ok):
          entry = explain(target, hf_target, setup.prompt_ids[p], ref[p], outputs[system.name][p])
          disagreements.append(dict(entry, system=system.name, reference=f"{engine} none", prompt=p))
  return agreement, disagreements


def _system_result(system: System, setup: _Setup, runs: _Runs, agreement: dict[str, bool]) -> dict[str, Any]:
  """One system's entry in the report (the keys ``SYSTEM_FIELDS``): its settings, every time, the median
  per prompt, and tokens/s from the sum of the medians and from the fastest repeat per prompt (the run
  least disturbed by other load on a shared machine); None without repeats."""
  times = runs.times_s[system.name]
  total_tokens = setup.max_new_tokens * len(setup.prompt_ids)
  medians = [statistics.median(t) if t else None for t in times]
  timed_total = sum(medians) if setup.repeats else None
  best_total = sum(min(t) for t in times) if setup.repeats else None
  return {
      "engine": system.engine, "method": system.method, "draft": system.draft, "settings": system.settings,
      "first_call_s": runs.first_call_s[system.name], "times_s": times, "median_s": medians,
      "tokens_per_s": total_tokens / timed_total if timed_total else None,
      "tokens_per_s_best": total_tokens / best_total if best_total else None,
      "agreement": agreement, "stats": runs.stats[system.name],
  }


def _report(pair: Pair, pair_name: str, setup: _Setup, systems: list[System], runs: _Runs,
            agreement: dict[str, dict[str, bool]], disagreements: list[dict[str, Any]], *, attention: str,
            load_averages: tuple) -> dict[str, Any]:
  """The report of :func:`side_by_side` (the keys ``REPORT_FIELDS``): what ran where, under which
  conditions, every system's result (:func:`_system_result`) and the tokens/s ratios between them
  (:func:`_ratios`), every output, and the disagreements and nondeterministic runs.

  Args:
    attention: transformers' attention implementation of the loaded target.
    load_averages: the machine's load averages before the export and after the timed repeats.
  """
  results = {s.name: _system_result(s, setup, runs, agreement[s.name]) for s in systems}
  load_before, load_after = load_averages
  return {
      "benchmark": "hf_side_by_side",
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "pair": pair_name,
      "pair_description": pair.description,
      "machine": dict(machine(setup.threads), load_average_before=load_before, load_average_after=load_after),
      "conditions": {
          "batch": 1, "decoding": "greedy", "dtype": "float32", "max_new_tokens": setup.max_new_tokens,
          "k": setup.k, "prompt_lookup_num_tokens": setup.prompt_lookup, "repeats": setup.repeats,
          "prompts": list(setup.prompts), "prompt_lengths": [len(p) for p in setup.prompt_ids],
          "exact_length": "specjax: eos_id=None (no EOS); transformers: eos_token_id=None in generate() and "
                          "in the generation_config of target and assistant (no stopping criterion, no "
                          "min-length processor), so every system generates exactly max_new_tokens",
          "transformers_model": "LlamaForCausalLM.from_pretrained(save_hf export, dtype=torch.float32), "
                                f"default attention implementation ({attention})",
          "timing": "first call per (system, prompt) untimed (compile / set-up, in first_call_s); then per "
                    "repeat every system runs every prompt, system order rotated per repeat; medians per "
                    "prompt; tokens/s = tokens / sum of per-prompt medians; JAX outputs block_until_ready",
      },
      "models": {"target_params": pair.target.cfg.num_params, "draft_params": pair.draft.cfg.num_params,
                 "target_config": _config_dict(pair.target.cfg),
                 "draft_config": _config_dict(pair.draft.cfg)},
      "systems": results,
      "ratios": {stat: _ratios(results, stat, setup) for stat in ("tokens_per_s", "tokens_per_s_best")},
      "outputs": runs.outputs,
      "disagreements": disagreements,
      "nondeterministic_runs": runs.nondeterministic,
  }


def _ratios(results: dict, stat: str, setup: _Setup) -> dict[str, Any]:
  """specjax / transformers for the baseline and each speculative pairing, and speculation / baseline per
  engine, from the ``stat`` tokens/s of each system."""
  k, prompt_lookup = setup.k, setup.prompt_lookup

  def ratio(a, b):
    x, y = results[a][stat], results[b][stat]
    return x / y if x and y else None

  out = {"specjax_over_hf": {"baseline": ratio("specjax none", "hf none")},
         "speculation_over_baseline": {"specjax": {}, "transformers": {}}}
  for label in ("small", "target"):
    sj, hf = f"specjax draft k={k} draft={label}", f"hf assisted k={k} draft={label}"
    out["specjax_over_hf"][f"speculation draft={label}"] = ratio(sj, hf)
    out["speculation_over_baseline"]["specjax"][f"draft k={k} draft={label}"] = ratio(sj, "specjax none")
    out["speculation_over_baseline"]["transformers"][f"assisted k={k} draft={label}"] = ratio(hf, "hf none")
  if setup.assisted_default:
    out["speculation_over_baseline"]["transformers"]["assisted default draft=small"] = ratio(
        "hf assisted default draft=small", "hf none")
  out["speculation_over_baseline"]["transformers"][f"prompt lookup {prompt_lookup}"] = ratio(
      f"hf prompt lookup {prompt_lookup}", "hf none")
  lookups = [name for name in (f"specjax ngram k={k}", f"specjax ngram k={prompt_lookup} n<=2") if name in results]
  for name in lookups:
    out["speculation_over_baseline"]["specjax"][name.removeprefix("specjax ")] = ratio(name, "specjax none")
    out["specjax_over_hf"][f"{name.removeprefix('specjax ')} vs prompt lookup {prompt_lookup}"] = ratio(
        name, f"hf prompt lookup {prompt_lookup}")
  return out


REPORT_FIELDS = ("benchmark", "date", "pair", "pair_description", "machine", "conditions", "models",
                 "systems", "ratios", "outputs", "disagreements", "nondeterministic_runs")
MACHINE_FIELDS = ("cpu", "cores", "threads", "torch_threads", "backend", "jax", "torch", "transformers",
                  "load_average_before", "load_average_after")
SYSTEM_FIELDS = ("engine", "method", "draft", "settings", "first_call_s", "times_s", "median_s",
                 "tokens_per_s", "tokens_per_s_best", "agreement", "stats")


def _config_dict(cfg) -> dict[str, Any]:
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
          if f.name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                        "tie_embeddings")}


# ------------------------------------------------------------------------------------------ report


def _fmt(x, spec=".2f"):
  return "—" if x is None else format(x, spec)


def to_markdown(report: dict[str, Any]) -> str:
  m, c, mod = report["machine"], report["conditions"], report["models"]
  lines = [
      f"# Side by side with Hugging Face transformers: {report['pair']}", "",
      f"{report['pair_description']}: target {mod['target_params'] / 1e6:.1f} M parameters, draft "
      f"{mod['draft_params'] / 1e6:.2f} M.", "",
      f"{m['cpu']}, {m['threads']} thread(s) for both engines (CPU affinity {m['schedulable_cpus']} of "
      f"{m['cores']} cores; torch.get_num_threads() = {m['torch_threads']}); "
      f"jax {m['jax']} ({m['backend']}), "
      f"torch {m['torch']}, transformers {m['transformers']}. Load average (1, 5, 15 min) before "
      f"{m['load_average_before']}, after {m['load_average_after']}: the machine is shared. "
      f"{report['date']}.",
      "",
      f"Batch 1, greedy, float32, {c['max_new_tokens']} new tokens exactly, k = {c['k']}, "
      f"{len(c['prompts'])} prompts ({c['prompt_lengths']} tokens), medians of {c['repeats']} interleaved "
      "repeats; first calls (compile, set-up) excluded and listed separately.", "",
      "| system | tokens/s (median) | ×own baseline | tokens/s (best) | ×own baseline | first calls s | "
      "same tokens as specjax none | as hf none | τ |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  baseline = {"specjax": report["systems"]["specjax none"], "transformers": report["systems"]["hf none"]}
  for name, s in report["systems"].items():
    own = baseline[s["engine"]]
    cells = []
    for stat in ("tokens_per_s", "tokens_per_s_best"):
      tps, base = s[stat], own[stat]
      cells += [_fmt(tps, ".1f"), _fmt(tps / base if tps and base else None)]
    key = "mean_accepted_length" if s["engine"] == "specjax" else "tokens_per_target_call"
    tau = statistics.mean(st[key] for st in s["stats"]) if s["method"] != "none" else None
    lines.append(
        f"| {name} | {' | '.join(cells)} | {_fmt(sum(s['first_call_s']), '.2f')} | "
        f"{'yes' if s['agreement']['vs_specjax_none'] else 'NO'} | "
        f"{'yes' if s['agreement']['vs_transformers_none'] else 'NO'} | {_fmt(tau)} |")
  median, best = report["ratios"]["tokens_per_s"], report["ratios"]["tokens_per_s_best"]
  lines += ["", "Median: per prompt over repeats; best: the fastest repeat per prompt (least disturbed by "
            "the other load on the shared machine). τ: tokens per round; specjax: `mean_accepted_length`; "
            "transformers: new tokens per target forward call, counted with forward hooks in one extra "
            "untimed call per prompt.", "", "specjax / transformers tokens/s (median; best):", ""]
  lines += [f"- {name}: {_fmt(v)}×; {_fmt(best['specjax_over_hf'][name])}×"
            for name, v in median["specjax_over_hf"].items()]
  lines += ["", "Settings: " + "; ".join(
      f"{name}: " + ", ".join(f"{k}={v}" for k, v in s["settings"].items() if k not in ("max_new_tokens",))
      for name, s in report["systems"].items() if s["method"] in ("assisted", "prompt_lookup"))]
  lines += ["", f"Exact length: {c['exact_length']}.", ""]
  if report["disagreements"]:
    lines += ["Output disagreements:", ""]
    for d in report["disagreements"]:
      lines.append(f"- {d['system']} vs {d['reference']}, prompt {d['prompt']}, position {d['position']}: "
                   f"{d['cause']}")
  else:
    lines.append("Every system's output agrees token for token with both engines' target-only greedy output.")
  if report["nondeterministic_runs"]:
    lines += ["", "Runs whose output differed from the same system's first call: "
              + ", ".join(report["nondeterministic_runs"])]
  return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: str, stem: str | None = None) -> tuple[str, str]:
  """Writes ``<stem>.json`` and ``<stem>.md`` (stem: the pair name); returns both paths."""
  os.makedirs(out_dir, exist_ok=True)
  stem = stem or report["pair"]
  paths = os.path.join(out_dir, stem + ".json"), os.path.join(out_dir, stem + ".md")
  with open(paths[0], "w") as f:
    json.dump(report, f, indent=1)
  with open(paths[1], "w") as f:
    f.write(to_markdown(report))
  return paths
