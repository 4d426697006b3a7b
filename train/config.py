"""Training recipes as frozen, validated configs, read from one JSON or TOML file.

A recipe file holds every hyperparameter of a run, so ``specjax train target --config FILE`` reproduces
it. Sections: ``model`` (a :class:`~specjax.models.llama.LlamaConfig`), ``data``, ``optim``, ``run`` and,
for drafts, ``distill`` and, for a parallel draft (PARD), ``parallel``; a head recipe (``kind = "heads"``) has ``heads``
(:class:`specjax.train.heads.HeadsConfig`) and ``distill`` (the frozen target and the data mix) instead of
``model``, and may have ``conversations`` (:class:`specjax.train.conversations.ConversationsConfig`: train on
a user's chats instead of ``data.corpus``). Unknown keys are errors that name the section and key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import tomllib
from typing import Any

from specjax.config import check_int
from specjax.models.llama import LlamaConfig

KINDS = ("target", "draft", "heads")
DIVERGENCES = ("ce", "fkl", "rkl", "jsd", "tvd")
SOURCES = ("corpus", "target", "draft")
# Fields that only change bookkeeping; a resumed run may change them without changing its parameters.
RESUMABLE_FIELDS = frozenset({"run.log_every", "run.eval_every", "run.ckpt_every", "run.keep",
                              "run.progress",
                              # how the shards of regenerated answers are made (what they hold is the shards'
                              # manifest's to check): rows at once, batching, proposals a round
                              "conversations.batch", "conversations.batching", "conversations.k"})


class ConfigError(ValueError):
  """A recipe value is missing, unknown or out of range; the message names the field."""


def check_field_int(section: str, name: str, value: Any, low: int = 1) -> None:
  """:func:`specjax.config.check_int` for the recipe field ``section.name``, as a :class:`ConfigError`."""
  try:
    check_int(f"{section}.{name}", value, low)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def check_float(section: str, name: str, value: Any, low: float, high: float = math.inf,
                low_open: bool = False) -> None:
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  ok = ok and (value > low if low_open else value >= low) and value <= high
  if not ok:
    bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high != math.inf else "")
    raise ConfigError(f"{section}.{name} must be a number {bound}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where text comes from and how it is cut.

  Attributes:
    corpus: ``"stdlib"`` (this Python's standard library source) or a folder, text file or JSONL file.
    tokenizer_vocab: vocabulary size of the byte-level BPE trained on the train split.
    seq_len: tokens per training sequence (each row holds ``seq_len + 1`` tokens: inputs and targets).
    batch_size: sequences per step.
    seed: seed of the shuffling; epoch ``e`` uses a permutation drawn from ``(seed, e)``.
  """

  corpus: str = "stdlib"
  tokenizer_vocab: int = 4096
  seq_len: int = 256
  batch_size: int = 16
  seed: int = 0

  def __post_init__(self):
    if not isinstance(self.corpus, str) or not self.corpus:
      raise ConfigError(f"data.corpus must be 'stdlib' or a path, got {self.corpus!r}")
    check_field_int("data", "tokenizer_vocab", self.tokenizer_vocab, 260)
    check_field_int("data", "seq_len", self.seq_len, 2)
    check_field_int("data", "batch_size", self.batch_size)
    check_field_int("data", "seed", self.seed, 0)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warm-up then cosine decay to ``end_lr_frac * lr``, after global-norm clipping."""

  lr: float = 3e-3
  warmup_steps: int = 100
  end_lr_frac: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0

  def __post_init__(self):
    check_float("optim", "lr", self.lr, 0.0, low_open=True)
    check_field_int("optim", "warmup_steps", self.warmup_steps, 0)
    check_float("optim", "end_lr_frac", self.end_lr_frac, 0.0, 1.0)
    check_float("optim", "weight_decay", self.weight_decay, 0.0)
    check_float("optim", "b1", self.b1, 0.0, 1.0)
    check_float("optim", "b2", self.b2, 0.0, 1.0)
    check_float("optim", "clip_norm", self.clip_norm, 0.0, low_open=True)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Length of the run and its bookkeeping.

  Attributes:
    steps: total optimizer steps (the cosine schedule ends here).
    seed: seed of the parameter initialisation and of on-policy sampling.
    eval_every / eval_batches: validation cadence and size (batches of ``data.batch_size``).
    ckpt_every / keep: checkpoint cadence and how many checkpoints to keep.
    log_every: steps between JSONL metric lines. progress: show a tqdm bar.
  """

  steps: int = 1000
  seed: int = 0
  eval_every: int = 200
  eval_batches: int = 8
  ckpt_every: int = 200
  keep: int = 2
  log_every: int = 10
  progress: bool = True

  def __post_init__(self):
    for name in ("steps", "eval_every", "eval_batches", "ckpt_every", "keep", "log_every"):
      check_field_int("run", name, getattr(self, name))
    check_field_int("run", "seed", self.seed, 0)
    if not isinstance(self.progress, bool):
      raise ConfigError(f"run.progress must be true or false, got {self.progress!r}")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """How a draft learns from a frozen target.

  Attributes:
    target: run directory of the trained target (its final export is read from ``<target>/model``).
    divergence: ``"ce"`` (corpus cross entropy only: no target needed), ``"fkl"`` KL(p‖q), ``"rkl"``
      KL(q‖p), ``"jsd"`` or ``"tvd"`` (1 − TVD is the expected acceptance).
    temperature: temperature applied to both logits inside the divergence and when sampling continuations.
    mix: weights of the data sources, drawn per step: ``corpus`` text, ``target``-generated
      continuations, ``draft``-generated continuations scored by the target (on-policy).
    prefix_len / gen_len: a generated row is a corpus prefix of ``prefix_len`` tokens followed by
      ``gen_len`` sampled tokens; the loss covers the generated positions only.
  """

  target: str = ""
  divergence: str = "fkl"
  temperature: float = 1.0
  mix: tuple[tuple[str, float], ...] = (("corpus", 1.0),)
  prefix_len: int = 32
  gen_len: int = 96

  def __post_init__(self):
    if self.divergence not in DIVERGENCES:
      raise ConfigError(f"distill.divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
    if self.divergence != "ce" and not self.target:
      raise ConfigError(f"distill.target must name the target run directory for divergence "
                        f"{self.divergence!r}")
    check_float("distill", "temperature", self.temperature, 0.0, low_open=True)
    mix = self.mix.items() if isinstance(self.mix, dict) else self.mix
    mix = tuple((str(k), v) for k, v in mix)
    for name, weight in mix:
      if name not in SOURCES:
        raise ConfigError(f"distill.mix has unknown source {name!r}; allowed: {SOURCES}")
      check_float("distill", f"mix.{name}", weight, 0.0)
    if not mix or sum(w for _, w in mix) <= 0:
      raise ConfigError("distill.mix must give a positive weight to at least one source")
    if self.divergence == "ce" and any(n != "corpus" and w > 0 for n, w in mix):
      raise ConfigError("distill.mix may only use 'corpus' when distill.divergence is 'ce'")
    object.__setattr__(self, "mix", mix)
    check_field_int("distill", "prefix_len", self.prefix_len)
    check_field_int("distill", "gen_len", self.gen_len)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """A parallel draft (PARD): mask-block training with conditional drop (:mod:`specjax.train.pard`).

  The draft's vocabulary is the target's plus the mask token (``model.vocab_size = data.tokenizer_vocab + 1``,
  ``mask_id = data.tokenizer_vocab``).

  Attributes:
    k: blocks per sequence: the most proposals per pass the draft is trained for.
    r / r_min: conditional drop: block i keeps ``max(r^i, r_min)`` of its positions.
    init: a draft to start from (a shipped pair's name such as ``"stdlib-coder"``, a run directory or an
      export folder) whose configuration equals ``model`` but for the mask row; ``""``: from scratch.
  """

  k: int = 8
  r: float = 0.7
  r_min: float = 0.2
  init: str = ""

  def __post_init__(self):
    check_field_int("parallel", "k", self.k, 2)
    check_float("parallel", "r", self.r, 0.0, 1.0, low_open=True)
    check_float("parallel", "r_min", self.r_min, 0.0, 1.0, low_open=True)
    if not isinstance(self.init, str):
      raise ConfigError(f"parallel.init must be a path or a shipped pair's name, got {self.init!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A whole recipe. ``kind`` is ``"target"`` (pretraining), ``"draft"`` (needs ``distill``) or ``"heads"``
  (heads on a frozen target: needs ``heads`` and ``distill``, takes no ``model``)."""

  kind: str
  model: LlamaConfig | None = None
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  run: RunConfig = RunConfig()
  distill: DistillConfig | None = None
  heads: Any = None  # specjax.train.heads.HeadsConfig for kind "heads"
  parallel: ParallelConfig | None = None  # a parallel draft (PARD), kind "draft" only
  conversations: Any = None  # specjax.train.conversations.ConversationsConfig: a heads recipe's chat data

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ConfigError(f"kind must be one of {KINDS}, got {self.kind!r}")
    if self.kind in ("draft", "heads") and self.distill is None:
      raise ConfigError(f"a {self.kind} recipe needs a [distill] section (the frozen target, the data mix)")
    if self.kind == "target" and self.distill is not None:
      raise ConfigError("a target recipe takes no [distill] section")
    if (self.kind == "heads") != (self.heads is not None):
      raise ConfigError("a heads recipe needs a [heads] section" if self.kind == "heads"
                        else f"a {self.kind} recipe takes no [heads] section")
    if self.kind == "heads":
      if self.model is not None:
        raise ConfigError("a heads recipe takes no [model] section: the heads are shaped by the target and [heads]")
      if any(n == "draft" and w > 0 for n, w in self.distill.mix):
        raise ConfigError("distill.mix of a heads recipe may use 'corpus' and 'target' only")
      if self.heads.cache_features and any(n != "corpus" and w > 0 for n, w in self.distill.mix):
        raise ConfigError("heads.cache_features needs distill.mix = {corpus = 1}: features are computed once for "
                          "the corpus rows (put the target's own text in the corpus instead)")
      if self.conversations is not None and any(n != "corpus" and w > 0 for n, w in self.distill.mix):
        raise ConfigError("distill.mix must be {corpus = 1} with [conversations]: the conversations' answers are "
                          "the target's own (conversations.regenerate) instead of sampled continuations")
    elif self.model is None:
      raise ConfigError("missing section [model]")
    if self.conversations is not None and self.kind != "heads":
      raise ConfigError(f"a {self.kind} recipe takes no [conversations] section (conversation data trains heads)")
    if self.parallel is not None:
      if self.kind != "draft":
        raise ConfigError(f"a {self.kind} recipe takes no [parallel] section (parallel drafts are kind 'draft')")
      if self.model.vocab_size != self.data.tokenizer_vocab + 1:
        raise ConfigError(f"model.vocab_size ({self.model.vocab_size}) of a parallel draft must be "
                          f"data.tokenizer_vocab + 1 ({self.data.tokenizer_vocab + 1}): the last row is the mask token")
      if any(n == "draft" and w > 0 for n, w in self.distill.mix):
        raise ConfigError("distill.mix of a parallel draft may use 'corpus' and 'target' only")
      if self.parallel.k > self.data.seq_len:
        raise ConfigError(f"parallel.k ({self.parallel.k}) must be <= data.seq_len ({self.data.seq_len})")
    elif self.model is not None and self.model.vocab_size != self.data.tokenizer_vocab:
      raise ConfigError(f"model.vocab_size ({self.model.vocab_size}) must equal data.tokenizer_vocab "
                        f"({self.data.tokenizer_vocab})")
    if self.model is not None and self.model.max_seq_len < self.data.seq_len:
      raise ConfigError(f"model.max_seq_len ({self.model.max_seq_len}) must be >= data.seq_len "
                        f"({self.data.seq_len})")
    generates = self.distill is not None and any(n != "corpus" and w > 0 for n, w in self.distill.mix)
    if generates and self.distill.prefix_len + self.distill.gen_len > self.data.seq_len + 1:
      # A generated row (prefix + continuation) is at most as long as a corpus row (seq_len + 1 tokens).
      raise ConfigError(f"distill.prefix_len + distill.gen_len ({self.distill.prefix_len} + "
                        f"{self.distill.gen_len}) must be <= data.seq_len + 1 ({self.data.seq_len + 1})")
    if self.run.steps <= self.optim.warmup_steps:
      raise ConfigError(f"run.steps ({self.run.steps}) must exceed optim.warmup_steps "
                        f"({self.optim.warmup_steps})")

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    if self.distill is not None:
      out["distill"]["mix"] = dict(self.distill.mix)
    if self.heads is not None:
      out["heads"]["aux_layers"] = list(self.heads.aux_layers)
    return out

  def flat(self) -> dict[str, Any]:
    """``{"section.field": value}``, for comparing two recipes field by field."""
    flat = {}
    for key, value in self.to_dict().items():
      if isinstance(value, dict):
        flat.update({f"{key}.{k}": v for k, v in value.items()})
      else:
        flat[key] = value
    return flat


def _heads_config():
  from specjax.train.heads import HeadsConfig  # imported late: heads.py validates with this module's checks

  return HeadsConfig


def _conversations_config():
  from specjax.train.conversations import ConversationsConfig  # imported late, as _heads_config

  return ConversationsConfig


_SECTIONS = {"model": LlamaConfig, "data": DataConfig, "optim": OptimConfig, "run": RunConfig,
             "distill": DistillConfig, "heads": _heads_config, "parallel": ParallelConfig,
             "conversations": _conversations_config}


def build_section(section: str, cls, values: Any):
  if cls in (_heads_config, _conversations_config):
    cls = cls()
  if not isinstance(values, dict):
    raise ConfigError(f"[{section}] must be a table of fields, got {type(values).__name__}")
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ConfigError(f"unknown field {section}.{unknown[0]}; allowed: {sorted(known)}")
  try:
    return cls(**values)
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(f"[{section}]: {e}") from e


def from_dict(raw: dict[str, Any]) -> TrainConfig:
  """Builds and validates a :class:`TrainConfig` from nested plain data (a parsed JSON/TOML file)."""
  raw = dict(raw)
  unknown = sorted(set(raw) - set(_SECTIONS) - {"kind"})
  if unknown:
    raise ConfigError(f"unknown top-level field {unknown[0]!r}; allowed: kind, {', '.join(_SECTIONS)}")
  if "kind" not in raw:
    raise ConfigError(f"missing field 'kind' (one of {KINDS})")
  sections = {name: build_section(name, cls, raw[name]) for name, cls in _SECTIONS.items()
              if raw.get(name) is not None}  # a saved recipe writes an absent section as null
  return TrainConfig(kind=raw["kind"], **sections)


def load_config(path: str | pathlib.Path) -> TrainConfig:
  """Reads a recipe from a ``.json`` or ``.toml`` file.

  Raises:
    ConfigError: naming the file for unreadable files and the field for invalid values.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise ConfigError(f"config file {path} does not exist")
  try:
    if path.suffix == ".toml":
      raw = tomllib.loads(path.read_text())
    elif path.suffix == ".json":
      raw = json.loads(path.read_text())
    else:
      raise ConfigError(f"config file {path} must end in .json or .toml")
  except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
    raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {e}") from e
  try:
    return from_dict(raw)
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from e


def as_parallel(cfg: TrainConfig) -> TrainConfig:
  """``cfg`` as a parallel draft recipe (``train draft --parallel``): unchanged when it has ``[parallel]``,
  else with the default :class:`ParallelConfig` and ``model.vocab_size`` grown by the mask token."""
  if cfg.parallel is not None:
    return cfg
  if cfg.kind != "draft":
    raise ConfigError(f"--parallel trains drafts; this recipe is kind {cfg.kind!r}")
  model = dataclasses.replace(cfg.model, vocab_size=cfg.data.tokenizer_vocab + 1)
  return dataclasses.replace(cfg, model=model, parallel=ParallelConfig())


def contradictions(saved: TrainConfig, current: TrainConfig) -> list[str]:
  """Fields whose values differ between two recipes, except bookkeeping fields a resume may change."""
  a, b = saved.flat(), current.flat()
  return [f"{key}: checkpoint has {a.get(key)!r}, config has {b.get(key)!r}"
          for key in sorted(set(a) | set(b)) if key not in RESUMABLE_FIELDS and a.get(key) != b.get(key)]


def with_data(cfg: TrainConfig, path: str) -> TrainConfig:
  """``cfg`` training on the conversations of ``path`` (``specjax train heads --data FILE``): its
  ``[conversations]`` section with ``path`` replaced, or a default section (regeneration on) when it has none.

  Raises:
    ConfigError: ``cfg`` is not a heads recipe, or its data mix is not corpus-only (see :class:`TrainConfig`).
  """
  if cfg.kind != "heads":
    raise ConfigError(f"--data trains heads on conversations; this recipe is kind {cfg.kind!r}")
  section = cfg.conversations.__class__ if cfg.conversations is not None else _conversations_config()
  values = dataclasses.asdict(cfg.conversations) if cfg.conversations is not None else {}
  return dataclasses.replace(cfg, conversations=section(**{**values, "path": str(path)}))
