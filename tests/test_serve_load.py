"""The load generator's own arithmetic (benchmarks/serve_load.py): the workload, Poisson arrivals, and the
latency figures computed from streamed chunks."""

from __future__ import annotations

import time

import numpy as np
import pytest

import serve_load


def test_workload_is_seeded_and_within_bounds():
  a, b = serve_load.workload(500, 0, 48, 8, 160), serve_load.workload(500, 0, 48, 8, 160)
  assert a == b and a != serve_load.workload(500, 1, 48, 8, 160)
  lengths = np.array([r.max_tokens for r in a])
  assert lengths.min() >= 8 and lengths.max() <= 160 and 40 <= np.median(lengths) <= 56
  assert {r.prompt for r in a} == set(serve_load.PROMPTS)
  distinct = serve_load.workload(500, 0, 48, 8, 160, distinct=True)  # the same draws, every prompt its own
  assert len({r.prompt for r in distinct}) == 500
  assert all(d.max_tokens == r.max_tokens and d.prompt == f"# request {i}\n{r.prompt}"
             for i, (d, r) in enumerate(zip(distinct, a, strict=True)))
  again = serve_load.workload(500, 0, 48, 8, 160, distinct=True, tag="1.")  # another repeat: the same draws
  assert not {r.prompt for r in again} & {r.prompt for r in distinct}
  assert all(d.max_tokens == r.max_tokens and d.prompt == f"# request 1.{i}\n{r.prompt}"
             for i, (d, r) in enumerate(zip(again, a, strict=True)))
  shared = serve_load.workload(500, 0, 48, 8, 160, distinct=True, prefix=serve_load.PREAMBLE)
  assert [r.prompt for r in shared] == [serve_load.PREAMBLE + r.prompt for r in distinct]


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
  t = serve_load.poisson_arrivals(20000, 5.0, seed=0)
  gaps = np.diff(t)
  assert t[0] == 0 and np.all(gaps >= 0)
  assert abs(1 / gaps.mean() - 5.0) < 0.15
  assert abs(np.std(gaps) / np.mean(gaps) - 1) < 0.05  # exponential: the deviation equals the mean


def test_itl_shares_a_chunk_gap_among_its_tokens_and_summarise_uses_them():
  rec = serve_load.Record(max_tokens=7, ttft=0.1, latency=0.5, chunks=[(0.1, 1), (0.2, 2), (0.5, 4)], tokens=7,
                          rounds=3, drafted=6, accepted=4)
  assert rec.itl() == pytest.approx([0.05, 0.05, 0.075, 0.075, 0.075, 0.075])
  failed = serve_load.Record(max_tokens=5, error="HTTP 503")
  s = serve_load.summarise([rec, failed], seconds=2.0)
  assert s["errors"] == 1 and s["requests_per_s"] == 0.5 and s["output_tokens_per_s"] == 3.5
  assert s["ttft_s"]["p50"] == pytest.approx(0.1) and s["tpot_s"]["p50"] == pytest.approx(0.4 / 6)
  assert s["acceptance_rate"] == pytest.approx(4 / 6) and s["tau"] == pytest.approx(7 / 3)
  assert s["exact_lengths"]


def test_each_tree_starts_its_servers_with_its_own_extra_arguments(tmp_path, monkeypatch):
  """``--server-args`` go to this tree's servers, ``--base-server-args`` to ``--baseline-src``'s (run from that
  tree: its PYTHONPATH), so an A/A check can give both servers the same pinned settings; ``--dtype`` to both."""
  started = []

  class Popen:
    def __init__(self, cmd, stdout, stderr, env):
      started.append((cmd, env))

  monkeypatch.setattr(serve_load.subprocess, "Popen", Popen)
  args = serve_load.argparse.Namespace(
      slots=8, max_len=256, proposer="draft", ks="0,1,2,4", random_init=False, target=None, out=str(tmp_path), dtype="mixed",
      server_args="--rounds-per-step 16", base_server_args="--attention-buckets 64,256", baseline_src="/base")
  for method in ("auto", "none@base"):
    serve_load.start_server(method, args)
  (mine, env), (base, base_env) = started
  assert mine[-2:] == ["--rounds-per-step", "16"] and "--attention-buckets" not in mine and env is None
  assert base[-2:] == ["--attention-buckets", "64,256"] and "--rounds-per-step" not in base
  assert base_env["PYTHONPATH"] == "/base" and base[base.index("--method") + 1] == "none"
  assert mine[mine.index("--k") + 1] == "auto" and (tmp_path / "server-none@base.log").exists()
  assert mine[mine.index("--dtype") + 1] == base[base.index("--dtype") + 1] == "mixed"


def test_scrape_reads_the_prompt_cache_hits_beside_the_steps(monkeypatch):
  """scrape takes the server's prompt-cache hits and prefix hits into the counted steps (a load point reports
  their change)."""
  import httpx

  text = ("# TYPE specjax_prompt_cache_hits counter\nspecjax_prompt_cache_hits_total 3.0\n"
          "# TYPE specjax_prompt_cache_prefix_hits counter\nspecjax_prompt_cache_prefix_hits_total 2.0\n"
          "# TYPE specjax_steps counter\nspecjax_steps_total{width=\"8\",k=\"0\"} 5.0\n")
  monkeypatch.setattr(httpx, "get", lambda url, timeout: type("R", (), {"text": text})())
  assert serve_load.scrape("http://x")["steps"] == {"prompt_cache/hits": 3.0, "prompt_cache/prefix_hits": 2.0,
                                                    "w8/k0": 5.0}


def test_a_load_point_reports_the_cpu_seconds_of_the_server_and_of_the_client(monkeypatch):
  """run_point adds the server process's CPU seconds over the run (the change of its process_cpu_seconds_total)
  and the load generator's own (process time), beside the server's step counts, and markdown prints them with a
  decimal."""
  scrapes = iter([{"steps": {"calls/finished": 4.0, "cpu/server_s": 10.0}},
                  {"steps": {"calls/finished": 9.0, "cpu/server_s": 12.5}}])
  monkeypatch.setattr(serve_load, "scrape", lambda url: next(scrapes))
  monkeypatch.setattr(serve_load, "model_name", lambda url: "m")

  async def busy(url, model, reqs, concurrency, temperature):
    end = time.process_time() + 0.05
    while time.process_time() < end:  # the client's own work
      pass
    return [], 0.1

  monkeypatch.setattr(serve_load, "run_concurrency", busy)
  records, seconds, steps = serve_load.run_point("http://x", "concurrency", 8, [], 0)
  assert records == [] and seconds == 0.1
  assert steps["calls/finished"] == 5.0 and steps["cpu/server_s"] == 2.5
  assert 0.05 <= steps["cpu/client_s"] < 5.0
  row = {"method": "none", "load": "concurrency", "value": 8, "requests_per_s": 1.0, "output_tokens_per_s": 10.0,
         **{k: {"p50": None, "p90": None, "p99": None} for k in ("ttft_s", "itl_s", "tpot_s", "latency_s")},
         "acceptance_rate": None, "tau": None, "steps": steps}
  report = {"machine": {"cpu": "x", "cores": 2, "jax": "0", "load_average": [0, 0, 0]},
            "settings": {k: 0 for k in ("model", "slots", "max_len", "ks", "requests", "repeats", "median_tokens",
                                        "min_tokens", "max_tokens")}, "results": [row]}
  assert "cpu/server_s: 2.5" in serve_load.markdown(report) and "calls/finished: 5," in serve_load.markdown(report)


def test_bundled_requests_are_the_workload_encoded_for_the_engine():
  """The in-process benchmarks' requests: the workload's, each prompt encoded by the bundled pair's tokenizer,
  greedy, no stop tokens, and as many new tokens as the HTTP request asks for."""
  target, tok, reqs, prompts, requests = serve_load.bundled_requests(5)
  assert reqs == serve_load.workload(5, 0, 48, 8, 160) and target.cfg.vocab_size > 0
  for req, ids, request in zip(reqs, prompts, requests):
    assert tok.decode(ids) == req.prompt and request.prompt == tuple(ids)
    assert request.max_new_tokens == req.max_tokens and request.stop_ids == () and request.sampling.greedy
