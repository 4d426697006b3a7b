"""Evaluation of proposers for one target on held-out text: estimated and real acceptance, cost, speed.

Every proposer is evaluated the same way: draft models, head sets (Medusa, EAGLE, MTP; trained runs or the
ones shipped with a pair) and the n-gram lookup.

* Offline acceptance estimate on the test split: ``E[Σ_v min(p, q)]`` at temperature 1 and the greedy
  agreement ``P(argmax p = argmax q)``: per token for a draft model, per proposal position for heads (the
  losses' metrics of :mod:`specjax.train.heads`), with the τ they predict.
* Real acceptance rate, acceptance by position and τ from :func:`specjax.generate` at ``k`` on prompts cut
  from the test split, greedy and at temperature 1.
* Cost: the proposer's ``propose`` of k tokens and the engine's round over one target step, and the
  target's pass over 1 and over 5 tokens, from the calibrated cost model (in-jit timings, batch 1).
* Speed at batch 1, at each of ``speed_temperatures``: wall time per prompt of the baseline (target alone)
  and of speculative decoding, alternated in the same process, after an untimed call per prompt-length
  bucket that compiles its program; output tokens per second over all prompts, and the median per prompt.

Prompts are cut from the corpus's test split, or read from a prompt file (``prompts``) and, with ``chat``,
wrapped as one user turn with the target's chat template; rows then end at the template's end of turn.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import statistics
import time
import tomllib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax import pretrained
from specjax.decode import bucket_length
from specjax.train import data as data_lib
from specjax.train.config import ConfigError, build_section
from specjax.train.trainer import eval_batch, heads_eval_batch, load_target


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """What to evaluate and how.

  Attributes:
    target: a run directory (its ``model/`` export) or an export folder, or a shipped pair name.
    drafts: ``{label: run directory or export}`` of the draft models to compare (a shipped pair's name:
      its draft).
    heads: ``{label: heads run directory or heads folder, or "shipped"}``: head sets for the target;
      ``"shipped"`` takes the set the pair ships for method ``label`` (``medusa``, ``eagle``, ``mtp``).
    ngram: also evaluate the n-gram lookup (no model).
    corpus: the corpus whose test split supplies held-out text and prompts.
    n_prompts / prompt_len / max_new_tokens: held-out prompts (cut at random offsets of test documents,
      drawn from ``seed``) and how much to generate after each.
    k: speculation length. temperatures: sampling temperatures (0 = greedy).
    text_rows / seq_len: held-out rows for the per-token acceptance estimate.
    speed_prompts: prompts timed at batch 1 (the first of each prompt-length bucket also run once untimed).
    speed_temperatures: the temperatures speed is measured at (0 = greedy).
    prompts: a prompt file (JSONL with ``prompt`` fields, or one prompt per line; relative paths also
      against the config's folder): its first ``n_prompts`` prompts replace the corpus cuts ("": cuts).
    chat: wrap each file prompt as one user turn with the target's chat template and end rows at its end of
      turn (needs ``prompts`` and a target with a template: a GGUF file or a Hugging Face checkpoint).
    seed: prompt selection and sampling.
  """

  target: str
  drafts: tuple[tuple[str, str], ...] = ()
  heads: tuple[tuple[str, str], ...] = ()
  ngram: bool = False
  corpus: str = "stdlib"
  n_prompts: int = 32
  prompt_len: int = 64
  max_new_tokens: int = 128
  k: int = 4
  temperatures: tuple[float, ...] = (0.0, 1.0)
  text_rows: int = 64
  seq_len: int = 256
  speed_prompts: int = 8
  speed_temperatures: tuple[float, ...] = (0.0,)
  prompts: str = ""
  chat: bool = False
  seed: int = 0

  def __post_init__(self):
    for name in ("drafts", "heads"):
      value = getattr(self, name)
      value = value.items() if isinstance(value, dict) else value
      object.__setattr__(self, name, tuple((str(a), str(b)) for a, b in value))
    for name in ("temperatures", "speed_temperatures"):
      value = getattr(self, name)
      if not isinstance(value, (list, tuple)) or not value or not all(
          isinstance(t, (int, float)) and not isinstance(t, bool) for t in value):
        raise ConfigError(f"eval.{name} must be a non-empty list of numbers >= 0, got {value!r}")
      object.__setattr__(self, name, tuple(float(t) for t in value))
    if not (self.drafts or self.heads or self.ngram):
      raise ConfigError("eval needs at least one proposer: eval.drafts, eval.heads or eval.ngram = true")
    for name in ("ngram", "chat"):
      if not isinstance(getattr(self, name), bool):
        raise ConfigError(f"eval.{name} must be true or false, got {getattr(self, name)!r}")
    if not isinstance(self.prompts, str):
      raise ConfigError(f"eval.prompts must be a prompt file path (a string), got {self.prompts!r}")
    if self.chat and not self.prompts:
      raise ConfigError("eval.chat = true wraps the prompts of a prompt file: set eval.prompts too")
    for name in ("n_prompts", "prompt_len", "max_new_tokens", "k", "text_rows", "seq_len", "speed_prompts"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"eval.{name} must be an integer >= 1, got {value!r}")
    for name in ("temperatures", "speed_temperatures"):
      if any(t < 0 for t in getattr(self, name)):
        raise ConfigError(f"eval.{name} must be >= 0, got {getattr(self, name)}")


def load_eval_config(path: str | pathlib.Path) -> EvalConfig:
  path = pathlib.Path(path)
  if not path.is_file():
    raise ConfigError(f"config file {path} does not exist")
  raw = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
  if set(raw) != {"eval"}:
    raise ConfigError(f"{path}: an evaluation file holds exactly one section [eval], got {sorted(raw)}")
  try:
    return build_section("eval", EvalConfig, raw["eval"])
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from e


def load_model_and_tokenizer(path: str, config_dir: pathlib.Path | None = None):
  """A model and its tokenizer: a run directory, an export folder, or a shipped pair's target."""
  return load_target(path, config_dir)


def load_draft(path: str, config_dir: pathlib.Path | None = None):
  """A draft model and its tokenizer: a run directory or export folder, or a shipped pair's draft."""
  if path in pretrained.available():
    _, draft, tokenizer = pretrained.load_pretrained(path)
    return draft, tokenizer
  return load_target(path, config_dir)


def load_head_set(label: str, path: str, target, cfg: EvalConfig, config_dir: pathlib.Path | None = None):
  """A head set for ``target``: ``"shipped"`` (the pair's set for method ``label``), or a heads run / folder."""
  from specjax.models.heads import load_heads

  if path == "shipped":
    shipped = pretrained.load_shipped_heads(cfg.target, target.cfg)
    if label not in shipped:
      raise ValueError(f"eval.heads.{label} = 'shipped', but {cfg.target!r} ships heads for {sorted(shipped)}")
    return shipped[label]
  p = pathlib.Path(path)
  if not p.exists() and config_dir is not None and (config_dir / p).exists():
    p = config_dir / p
  return load_heads(p / "heads" if (p / "heads" / "heads.json").is_file() else p, target.cfg)


def target_and_chat(cfg: EvalConfig, config_dir: pathlib.Path | None = None):
  """``(model, tokenizer, chat)``: the target, and its chat format when ``cfg.chat`` (else None).

  Raises:
    ConfigError: ``eval.chat`` set for a target without a chat template (naming it).
  """
  if not cfg.chat:
    return (*load_model_and_tokenizer(cfg.target, config_dir), None)
  from specjax.loading import GGUF_NAMES, load

  path = pathlib.Path(cfg.target)
  if cfg.target not in GGUF_NAMES and not path.exists() and config_dir is not None and (config_dir / path).exists():
    path = config_dir / path
  loaded = load(cfg.target if cfg.target in GGUF_NAMES or cfg.target in pretrained.available() else str(path))
  if loaded.chat is None:
    raise ConfigError(f"eval.chat = true, but the target {cfg.target} has no chat template (a GGUF file's "
                      "tokenizer.chat_template, or tokenizer_config.json / chat_template.jinja beside a checkpoint)")
  return loaded.model, loaded.tokenizer, loaded.chat


def eval_prompts(cfg: EvalConfig, tokenizer, chat=None, config_dir: pathlib.Path | None = None):
  """``(prompts, eos_id)``: the held-out prompts as token-id lists and the tokens that end a row (None: rows
  run to ``max_new_tokens``). From ``cfg.prompts`` (wrapped with ``chat`` when given) or cut from the test
  split of ``cfg.corpus``."""
  if not cfg.prompts:
    return [r.tolist() for r in held_out_prompts(cfg.corpus, tokenizer, cfg.n_prompts, cfg.prompt_len, cfg.seed)], None
  from specjax.cli import CliError, read_prompts

  path = pathlib.Path(cfg.prompts)
  if not path.exists() and config_dir is not None and (config_dir / path).exists():
    path = config_dir / path
  try:
    texts = read_prompts(str(path))[: cfg.n_prompts]
  except CliError as e:
    raise ConfigError(f"eval.prompts: {str(e).removeprefix('--prompts ')}") from None
  if chat is None:
    return [tokenizer.encode(t) for t in texts], None
  return [chat.encode(tokenizer, [{"role": "user", "content": t}]) for t in texts], chat.stop_ids(tokenizer)


def held_out_prompts(corpus: str, tokenizer, n: int, length: int, seed: int) -> np.ndarray:
  """``[n, length] int32`` prompts cut at random offsets of the test split's token stream."""
  stream = data_lib.token_stream(data_lib.documents(corpus, "test"), tokenizer)
  if len(stream) < length + 1:
    raise ValueError(f"the test split of {corpus} has {len(stream)} tokens, fewer than prompt_len {length}")
  starts = np.random.default_rng([seed, 1]).integers(0, len(stream) - length, n)
  return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def acceptance_estimate(target, draft, rows: np.ndarray, batch: int = 8) -> dict[str, float]:
  """Mean ``Σ_v min(p, q)`` (temperature 1) and greedy agreement over all positions of ``rows``."""
  t_def, t_params = nnx.split(target)
  d_def, d_params = nnx.split(draft)
  sums: dict[str, float] = {}
  for i in range(0, len(rows), batch):
    part = eval_batch(d_def, d_params, jnp.asarray(rows[i:i + batch]), t_def, t_params, temperature=1.0)
    for k, v in jax.device_get(part).items():
      sums[k] = sums.get(k, 0.0) + float(v)
  return {"accept_estimate_t1": sums["accept_sum"] / sums["tokens"],
          "accept_estimate_greedy": sums["greedy_sum"] / sums["tokens"],
          "draft_test_loss": sums["nll_sum"] / sums["tokens"]}


def head_acceptance_estimate(target, heads, rows: np.ndarray, batch: int = 8) -> dict[str, Any]:
  """Per proposal position i: mean ``Σ_v min(p, q)`` (temperature 1) and greedy agreement of a head set over
  the held-out rows, and the τ they predict (see :mod:`specjax.train.heads`)."""
  from specjax import costmodel
  from specjax.train import heads as heads_lib

  graphdef, params, rest = nnx.split(heads, nnx.Param, ...)
  t_def, t_params = nnx.split(target)
  hcfg = heads_lib.HeadsConfig(kind=heads.cfg.kind, num_heads=heads.cfg.num_heads)
  sums: dict[str, float] = {}
  starts = range(0, len(rows), batch)
  for i in starts:
    part = heads_eval_batch(graphdef, params, rest, t_def, t_params, jnp.asarray(rows[i:i + batch]), hcfg=hcfg)
    for k, v in jax.device_get(part).items():
      sums[k] = sums.get(k, 0.0) + float(v) / len(starts)
  positions = sorted(int(k.split("_")[1]) for k in sums if k.startswith("accept_"))
  t1, greedy = [sums[f"accept_{i}"] for i in positions], [sums[f"greedy_{i}"] for i in positions]
  return {"accept_estimate_t1_by_position": t1, "accept_estimate_greedy_by_position": greedy,
          "tau_estimate_t1": costmodel.expected_tau(t1, len(t1)),
          "tau_estimate_greedy": costmodel.expected_tau(greedy, len(greedy))}


def real_acceptance(target, proposer, prompts: list[list[int]], cfg: EvalConfig,
                    eos_id: list[int] | None = None) -> dict[str, Any]:
  """Acceptance rate, acceptance by position and τ of :func:`specjax.generate` per temperature (all prompts
  in one batch; rows end at ``eos_id`` when given)."""
  out = {}
  for t in cfg.temperatures:
    res = specjax.generate(target, prompts, proposer=proposer, spec=specjax.SpecConfig(k=cfg.k),
                           sampling=specjax.SamplingConfig(temperature=t),
                           max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, eos_id=eos_id)
    out[f"t{t:g}"] = {"acceptance_rate": res.stats.acceptance_rate, "tau": res.stats.mean_accepted_length,
                      "acceptance_by_position": res.stats.acceptance_by_position,
                      "generated_tokens": int(np.sum(res.lengths))}
  return out


def _timed(fn):
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def speed(target, proposer, prompts: list[list[int]], cfg: EvalConfig, temperature: float = 0.0,
          eos_id: list[int] | None = None) -> dict[str, Any]:
  """Batch-1 wall time per prompt, baseline against speculative decoding, alternated prompt by prompt so that
  machine load affects both alike; the first prompt of each prompt-length bucket is run once untimed first,
  which compiles its program.

  Returns the output tokens per second of each over all prompts and their ratio (``speedup``), the median
  seconds per prompt, and (greedy) whether both gave the same tokens.
  """
  sampling = specjax.SamplingConfig(temperature=temperature)

  def run(spec, prompt):
    return specjax.generate(target, [prompt], proposer=proposer if spec.k else None, spec=spec, sampling=sampling,
                            max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, eos_id=eos_id)

  base, spec = specjax.SpecConfig(k=0), specjax.SpecConfig(k=cfg.k)
  times = {"baseline": [], "speculative": []}
  tokens = {"baseline": 0, "speculative": 0}
  same, compiled = True, set()
  for p in prompts:
    outs = {}
    for name, sc in (("baseline", base), ("speculative", spec)):
      if (name, bucket_length(len(p))) not in compiled:  # one program per prompt-length bucket
        run(sc, p)
        compiled.add((name, bucket_length(len(p))))
      seconds, outs[name] = _timed(functools.partial(run, sc, p))
      times[name].append(seconds)
      tokens[name] += int(np.sum(outs[name].lengths))
    same &= outs["baseline"].rows() == outs["speculative"].rows()
  tps = {name: tokens[name] / sum(times[name]) for name in times}
  out = {"baseline_tokens_per_s": tps["baseline"], "speculative_tokens_per_s": tps["speculative"],
         "speedup": tps["speculative"] / tps["baseline"], "baseline_s": statistics.median(times["baseline"]),
         "speculative_s": statistics.median(times["speculative"]), "baseline_tokens": tokens["baseline"],
         "speculative_tokens": tokens["speculative"], "prompts": len(prompts)}
  if temperature == 0:
    out["greedy_outputs_equal"] = same
  return out


def pass_costs(model, prompt_len: int, max_new_tokens: int) -> dict[str, float]:
  """Milliseconds of one cached pass of ``model`` over 1 and over 5 tokens at batch 1 (``t1_ms``, ``t5_ms``):
  the cost model's in-jit timings (:func:`specjax.costmodel.calibrate_costs` without a proposer), over the
  cache a call with ``prompt_len`` and ``max_new_tokens`` has, filled to its middle."""
  from specjax import costmodel

  table = costmodel.calibrate_costs(model, None, 1, 4, prompt_len=bucket_length(prompt_len),
                                    n_tokens=bucket_length(max_new_tokens), repeats=5, windows=(1, 5), prefill=False)
  return {"t1_ms": 1e3 * table.verify[1], "t5_ms": 1e3 * table.verify[5]}


def proposer_cost(target, proposer, k: int, prompt_len: int, max_new_tokens: int) -> dict[str, float]:
  """The proposer's ``propose`` of k tokens and the engine's round with k proposals, over one target step
  and over the baseline round, from the calibrated cost model at batch 1 (in-jit timings)."""
  from specjax import costmodel

  table = costmodel.calibrate_costs(target, proposer, 1, k, prompt_len=bucket_length(prompt_len),
                                    n_tokens=bucket_length(max_new_tokens), repeats=5, rounds=(k,),
                                    windows=(1, k + 1), propose=(k,), prefill=False)  # only the figures read
  return {"propose_k_over_target_step": table.propose[k] / table.verify[1],
          "round_k_over_baseline_round": table.rounds[k] / table.rounds[0],
          "verify_k1_over_target_step": table.verify[k + 1] / table.verify[1]}


def _proposers(cfg: EvalConfig, target, tokenizer, config_dir) -> dict[str, Any]:
  from specjax.proposers import DraftModel, NGram, for_heads

  out = {}
  for label, path in cfg.drafts:
    draft, draft_tok = load_draft(path, config_dir)
    if draft_tok.fingerprint() != tokenizer.fingerprint():
      raise ValueError(f"draft {label!r} ({path}) uses a different tokenizer than the target ({cfg.target})")
    out[label] = DraftModel(draft)
  for label, path in cfg.heads:
    out[label] = for_heads(load_head_set(label, path, target, cfg, config_dir))
  if cfg.ngram:
    out["ngram"] = NGram()
  return out


def run_eval(cfg: EvalConfig, out: pathlib.Path | None = None, config_dir: pathlib.Path | None = None):
  """Runs every measurement of the module docstring for every proposer; returns (and optionally writes) a
  JSON-able dict: ``config``, ``target`` and one entry per proposer label."""
  target, tokenizer, chat = target_and_chat(cfg, config_dir)
  prompts, eos_id = eval_prompts(cfg, tokenizer, chat, config_dir)
  prompt_len = max(map(len, prompts))
  results: dict[str, Any] = {"config": dataclasses.asdict(cfg), "target": {
      "params": target.cfg.num_params, **pass_costs(target, prompt_len, cfg.max_new_tokens)}}
  proposers = _proposers(cfg, target, tokenizer, config_dir)
  if any(p.modules() for p in proposers.values()):  # held-out text for the offline estimates (not n-gram's)
    stream = data_lib.token_stream(data_lib.documents(cfg.corpus, "test"), tokenizer)
    rows = data_lib.pack(stream, cfg.seq_len)[: cfg.text_rows]
  for label, proposer in proposers.items():
    res: dict[str, Any] = {"method": proposer.name, **proposer.describe(),
                           "params": sum(int(np.prod(x.shape)) for m in proposer.modules()
                                         for x in jax.tree.leaves(nnx.state(m, nnx.Param)))}
    if proposer.name == "draft":
      res.update(acceptance_estimate(target, proposer.model, rows))
    elif proposer.modules():
      res.update(head_acceptance_estimate(target, proposer.modules()[0], rows))
    res["cost"] = proposer_cost(target, proposer, cfg.k, prompt_len, cfg.max_new_tokens)
    res["generate"] = real_acceptance(target, proposer, prompts, cfg, eos_id)
    res["speed"] = {f"t{t:g}": speed(target, proposer, prompts[: cfg.speed_prompts], cfg, t, eos_id)
                    for t in cfg.speed_temperatures}
    results[label] = res
  if out is not None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
  return results


def summary_table(results: dict[str, Any]) -> str:
  """A Markdown table of :func:`run_eval` results: one row per proposer, the measured acceptance and τ at
  each of the run's temperatures."""
  fmt = lambda x, f=".3f": "-" if x is None else format(x, f)
  by_pos = lambda xs: "/".join("-" if a is None else f"{a:.2f}" for a in xs) if xs else "-"
  name = lambda t: "greedy" if t == "t0" else t.replace("t", "t=", 1)
  temps = list(dict.fromkeys(t for label, r in results.items() if label not in ("config", "target")
                             for t in r["generate"]))
  head = ("| proposer | params | propose(k) / target step | round(k) / round(0) | Σmin(p,q) t=1 (by position) | "
          "τ est. t=1 | " + "".join(f"accept {name(t)} (by position) | τ {name(t)} | " for t in temps)
          + "speedup b=1 (by temperature) |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for label, r in results.items():
    if label in ("config", "target"):
      continue
    est = r.get("accept_estimate_t1_by_position") or ([r["accept_estimate_t1"]] if "accept_estimate_t1" in r else [])
    measured = "".join(f"{by_pos(r['generate'].get(t, {}).get('acceptance_by_position'))} | "
                       f"{fmt(r['generate'].get(t, {}).get('tau'), '.2f')} | " for t in temps)
    lines.append(
        f"| {label} | {r['params']:,} | {r['cost']['propose_k_over_target_step']:.3f} | "
        f"{r['cost']['round_k_over_baseline_round']:.2f} | {by_pos(est)} | {fmt(r.get('tau_estimate_t1'), '.2f')} | "
        + measured + ", ".join(f"{name(t)}: {v['speedup']:.2f}x" for t, v in r["speed"].items()) + " |")
  t = results["target"]
  lines.append(f"\ntarget: {t['params']:,} parameters, {t['t1_ms']:.3f} ms per 1-token step, "
               f"{t['t5_ms']:.3f} ms per 5-token pass (ratio {t['t5_ms'] / t['t1_ms']:.2f}).")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  """``python -m specjax.train.evaluate [--pair NAME] [--prompts N]``: batch-1 greedy speed of a shipped
  pair on held-out prompts (the ``speed`` part of :func:`run_eval`, with more prompts)."""
  import argparse

  parser = argparse.ArgumentParser(prog="python -m specjax.train.evaluate")
  parser.add_argument("--pair", default="stdlib-coder")
  parser.add_argument("--prompts", type=int, default=24)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  args = parser.parse_args(argv)
  target, draft, tokenizer = pretrained.load_pretrained(args.pair)
  cfg = EvalConfig(target=args.pair, drafts={"draft": args.pair}, max_new_tokens=args.max_new_tokens)
  prompts = held_out_prompts(cfg.corpus, tokenizer, args.prompts, cfg.prompt_len, cfg.seed)
  from specjax.proposers import DraftModel

  prompts = [r.tolist() for r in prompts]
  costs = lambda model: pass_costs(model, cfg.prompt_len, cfg.max_new_tokens)
  out = {"target": costs(target), "draft": costs(draft), **speed(target, DraftModel(draft), prompts, cfg)}
  print(json.dumps(out, indent=2))


if __name__ == "__main__":
  main()
