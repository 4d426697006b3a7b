"""Validation curves against training tokens, read from runs' ``metrics.jsonl``: how much data a head (or a
draft) needs before its τ (or perplexity) stops improving.

    specjax train curve runs/heads_a runs/heads_b --out curve.png

A heads run gives ``valid_tau_greedy`` and ``valid_tau_t1`` (the τ its per-position validation acceptance
predicts at k = its depth, greedy and at temperature 1); a target or draft run gives ``valid_ppl``. Training
tokens are ``step * data.batch_size * data.seq_len`` from the run's ``config.json`` (rows of ``seq_len + 1``
tokens, the last one a label only).
"""

from __future__ import annotations

import json
import pathlib

HEADS_METRICS = ("valid_tau_greedy", "valid_tau_t1")
MODEL_METRICS = ("valid_ppl",)


def read_curves(run: str | pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  """``{metric: [(training tokens, value), ...]}`` of one run directory, in step order.

  Raises:
    FileNotFoundError: naming the missing ``config.json`` or ``metrics.jsonl``.
    ValueError: naming the run whose metrics hold no validation line.
  """
  run = pathlib.Path(run)
  for name in ("config.json", "metrics.jsonl"):
    if not (run / name).is_file():
      raise FileNotFoundError(f"{run} is not a training run: {run / name} does not exist")
  cfg = json.loads((run / "config.json").read_text())
  per_step = int(cfg["data"]["batch_size"]) * int(cfg["data"]["seq_len"])
  metrics = HEADS_METRICS if cfg.get("kind") == "heads" else MODEL_METRICS
  curves: dict[str, dict[int, float]] = {m: {} for m in metrics}
  for line in (run / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line) if line.strip() else {}
    for m in metrics:
      if m in record:
        curves[m][int(record["step"])] = float(record[m])  # a resumed run's later line wins
  if not any(curves.values()):
    raise ValueError(f"{run / 'metrics.jsonl'} holds no validation line ({' or '.join(metrics)})")
  return {m: [(step * per_step, v) for step, v in sorted(points.items())] for m, points in curves.items() if points}


def plot(series: dict[str, list[tuple[int, float]]], out: str | pathlib.Path, title: str = "",
         ylabel: str | None = None) -> pathlib.Path:
  """Draws each ``{label: [(tokens, value), ...]}`` series against training tokens into ``out`` (PNG); the y
  axis is ``ylabel``, else named after the metrics in the labels."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
  for label, points in series.items():
    ax.plot([t / 1e6 for t, _ in points], [v for _, v in points], marker="o", label=label)
  ax.set_xlabel("training tokens (millions)")
  if ylabel is None:
    ylabel = ("τ predicted by validation acceptance" if all("tau" in k for k in series)
              else "validation perplexity" if all("ppl" in k for k in series) else "validation metric")
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out)
  plt.close(fig)
  return out


def curve_command(runs: list[str], out: str) -> dict[str, list[tuple[int, float]]]:
  """``specjax train curve``: every run's curves in one plot (labelled ``run: metric``); returns the series."""
  series = {}
  for run in runs:
    for metric, points in read_curves(run).items():
      series[f"{pathlib.Path(run).name}: {metric}"] = points
  plot(series, out)
  return series
