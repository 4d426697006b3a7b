"""`specjax serve` as a real process on 127.0.0.1, started and stopped by the tests: greedy output through
the HTTP API (streamed and not, concurrent, queued requests entering mid-flight) equals offline generate;
OpenAI's own client works against it; every bad request gets a 4xx naming its field while the server keeps
serving; a client that goes away frees its slot; a full queue answers 503 with Retry-After; the metrics
parse as Prometheus text; SIGTERM lets running requests finish and the process exit."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import specjax
import specjax.cli
from specjax.chat import ChatFormat

# A chat template of the test's own: one line per message, then the assistant's header.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SLOTS, QUEUE, MAX_LEN, K = 2, 6, 64, 2
REF_NEW = 24  # references are generate's first REF_NEW tokens, cut at EOS and max_tokens
MODEL = "random-init"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Served:
  """The server process, its base URL and the same random models in this process (the references)."""

  def __init__(self, proc: subprocess.Popen, url: str, log_path: str):
    self.proc, self.url, self.log_path = proc, url, log_path
    self.target, _, self.tok = specjax.cli._random_pair()  # seeded: the server's own weights
    self.chat = ChatFormat.create(TEMPLATE, self.tok)
    self.client = httpx.Client(base_url=url, timeout=120)

  def log(self) -> str:
    with open(self.log_path, encoding="utf-8", errors="replace") as f:
      return f.read()

  def reference(self, ids: list[int], max_tokens: int) -> list[int]:
    row = specjax.generate(self.target, [ids], max_new_tokens=REF_NEW).rows()[0]
    stops = [i for i, t in enumerate(row) if t == self.tok.eos_id]
    return row[:min(max_tokens, stops[0] + 1 if stops else REF_NEW)]

  def health(self) -> dict:
    return self.client.get("/health").json()

  def wait_idle(self, seconds: float = 30) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
      h = self.health()
      if h["slots_used"] == 0 and h["queue_length"] == 0:
        return h
      time.sleep(0.05)
    raise AssertionError(f"the server did not become idle: {self.health()}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  folder = tmp_path_factory.mktemp("serve")
  (folder / "chat.jinja").write_text(TEMPLATE)
  port = _free_port()
  log_path = str(folder / "server.log")
  with open(log_path, "w") as log:
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "specjax.cli", "serve", "--random-init", "--host", "127.0.0.1", "--port", str(port),
         "--slots", str(SLOTS), "--widths", str(SLOTS), "--max-len", str(MAX_LEN), "--k", str(K),
         "--max-queue", str(QUEUE), "--chat-template", str(folder / "chat.jinja"), "--grace", "60",
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
  server = Served(proc, f"http://127.0.0.1:{port}", log_path)
  try:
    deadline = time.monotonic() + 600  # start-up compiles every program
    while True:
      assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{server.log()}"
      try:
        if server.client.get("/health", timeout=2).status_code == 200:
          break
      except httpx.TransportError:
        pass
      assert time.monotonic() < deadline, f"the server did not start:\n{server.log()}"
      time.sleep(0.5)
    yield server
  finally:
    server.client.close()
    if proc.poll() is None:
      proc.kill()
      proc.wait(30)


def complete(served: Served, body: dict, chat: bool = False) -> tuple[list[int], str, str]:
  """(token ids, text, finish reason) of one request, streamed (SSE) or not as ``body`` says."""
  path = "/v1/chat/completions" if chat else "/v1/completions"
  body = {"model": MODEL, "return_token_ids": True, **body}
  if not body.get("stream"):
    r = served.client.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["message"]["content"] if chat else choice["text"], choice["finish_reason"]
  ids, text, reason = [], "", None
  with served.client.stream("POST", path, json=body) as r:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in r.iter_lines() if line]
  assert lines[-1] == "data: [DONE]"
  for line in lines[:-1]:
    choice = json.loads(line.removeprefix("data: "))["choices"][0]
    ids += choice.get("token_ids", [])
    text += choice["delta"].get("content", "") if chat else choice["text"]
    reason = choice["finish_reason"] or reason
  return ids, text, reason


def test_greedy_through_the_server_equals_generate(served):
  """Six concurrent requests (2 slots, 6 queue places: some wait and enter mid-flight as others finish),
  streamed and not, completions and chat, beside a sampled neighbour: each greedy one gives generate's
  tokens for its prompt alone, its text is their decoding, and its finish reason is right."""
  tok = served.tok
  cases = [({"prompt": "def f(x):", "max_tokens": 20, "temperature": 0}, False),
           ({"prompt": "héllo wörld, this is a longer prompt", "max_tokens": 7, "temperature": 0, "stream": True}, False),
           ({"prompt": "x", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 3, "stream": True}, False),
           ({"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16, "temperature": 0, "stream": True},
            True),
           ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
             "max_completion_tokens": 9, "temperature": 0}, True),
           ({"prompt": [5, 6, 7, 8], "max_tokens": 15, "temperature": 0}, False)]
  with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
    futures = [pool.submit(complete, served, body, chat) for body, chat in cases]
    results = [f.result() for f in futures]
  for (body, chat), (ids, text, reason) in zip(cases, results):
    assert text == tok.decode(ids)
    if body["temperature"] > 0:
      assert 1 <= len(ids) <= body["max_tokens"]
      continue
    prompt = body.get("prompt")
    prompt_ids = served.chat.encode(tok, body["messages"]) if chat else prompt if isinstance(prompt, list) \
        else tok.encode(prompt)
    limit = body.get("max_tokens", body.get("max_completion_tokens"))
    assert ids == served.reference(prompt_ids, limit), body
    assert reason == ("stop" if ids[-1] == tok.eos_id else "length")
  served.wait_idle()


def test_the_openai_client_works_against_it(served):
  client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
  assert [m.id for m in client.models.list().data] == [MODEL]
  out = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=10, temperature=0)
  ids = served.reference(served.tok.encode("def f(x):"), 10)
  assert out.choices[0].text == served.tok.decode(ids) and out.usage.completion_tokens == len(ids)
  messages = [{"role": "user", "content": "Hi!"}]
  chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  ids = served.reference(served.chat.encode(served.tok, messages), 8)
  assert text == served.tok.decode(ids) and chunks[-1].usage.completion_tokens == len(ids)
  with pytest.raises(openai.BadRequestError, match="temperature"):
    client.completions.create(model=MODEL, prompt="x", temperature=-1)


BAD = [  # (path, body, status, the field the error names)
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", b'{"model": "random-init", "prompt": ', 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "y" * 200}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 300]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=lambda x: None)
def test_a_bad_request_gets_a_4xx_naming_its_field(served, path, body, status, param):
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  r = served.client.post(path, content=content, headers={"content-type": "application/json"})
  assert r.status_code == status, r.text
  error = r.json()["error"]
  assert error["param"] == param and error["message"] and error["type"]
  if param:
    assert param.split("[")[0] in error["message"]


def test_the_server_keeps_serving_after_bad_requests(served):
  for path, body, _, _ in BAD[:4]:
    served.client.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode())
  assert served.client.get("/nothing").status_code == 404 and served.client.get("/v1/completions").status_code == 405
  ids, _, _ = complete(served, {"prompt": "def f(x):", "max_tokens": 5, "temperature": 0})
  assert ids == served.reference(served.tok.encode("def f(x):"), 5)


def _metric(served: Served, name: str, labels: dict | None = None, default: float | None = None) -> float:
  for family in text_string_to_metric_families(served.client.get("/metrics").text):
    for sample in family.samples:
      if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
        return sample.value
  if default is None:
    raise AssertionError(f"no sample {name} {labels or ''} in /metrics")
  return default


def test_a_client_that_goes_away_mid_stream_frees_its_slot(served):
  cancelled = _metric(served, "specjax_requests_total", {"outcome": "cancelled"}, default=0.0)
  body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "ignore_eos": True, "temperature": 0, "stream": True}
  with httpx.Client(base_url=served.url, timeout=60) as client:  # its own connection, closed mid-stream
    with client.stream("POST", "/v1/completions", json=body) as r:
      assert next(line for line in r.iter_lines() if line).startswith("data: ")
  served.wait_idle(30)  # well before 50 tokens: the slot was freed
  assert _metric(served, "specjax_requests_total", {"outcome": "cancelled"}) == cancelled + 1
  ids, _, reason = complete(served, {"prompt": "x", "max_tokens": 3, "temperature": 0})
  assert len(ids) == 3 and reason == "length"


def test_a_full_queue_answers_503_with_retry_after(served):
  """Three times as many requests at once as there are slots and queue places, each of 60 tokens (at most
  2 at a time run): those past the bound are refused at once with Retry-After, the others finish."""
  body = {"model": MODEL, "prompt": "x", "max_tokens": MAX_LEN - K - 2, "ignore_eos": True, "temperature": 0}
  refused_before = _metric(served, "specjax_requests_total", {"outcome": "queue_full"}, default=0.0)
  n = 3 * (SLOTS + QUEUE)
  barrier = threading.Barrier(n)

  def post():
    barrier.wait()
    return served.client.post("/v1/completions", json=body)

  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    responses = list(pool.map(lambda _: post(), range(n)))
  refused = [r for r in responses if r.status_code == 503]
  assert refused and all(r.status_code == 200 for r in responses if r not in refused)
  assert len(responses) - len(refused) >= QUEUE  # at least the queue's places were taken
  for r in refused:
    assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"
  assert _metric(served, "specjax_requests_total", {"outcome": "queue_full"}) == refused_before + len(refused)
  served.wait_idle()


def test_metrics_are_prometheus_text_with_the_serving_figures(served):
  text = served.client.get("/metrics").text
  names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
  for name in ("specjax_acceptance_rate", "specjax_mean_accepted_length", "specjax_tokens_per_second",
               "specjax_queue_length", "specjax_slots_used", "specjax_generated_tokens_total",
               "specjax_time_to_first_token_seconds_bucket", "specjax_steps_total", "process_resident_memory_bytes"):
    assert name in names, name
  assert 0 <= _metric(served, "specjax_acceptance_rate") <= 1
  assert 1 <= _metric(served, "specjax_mean_accepted_length") <= K + 1
  assert _metric(served, "specjax_steps_total", {"width": str(SLOTS), "k": str(K)}) > 0


def test_sigterm_lets_running_requests_finish_and_exits(served):
  """Last in this module: it stops the server."""
  body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
  got: dict = {}

  def run():
    got["result"] = complete(served, body)

  thread = threading.Thread(target=run)
  thread.start()
  deadline = time.monotonic() + 60
  while served.health()["slots_used"] == 0:
    assert time.monotonic() < deadline
    time.sleep(0.01)
  served.proc.send_signal(signal.SIGTERM)
  thread.join(120)
  ids, _, reason = got["result"]
  assert len(ids) == 40 and reason == "length"  # it ran to its end after the signal
  assert served.proc.wait(60) == 0, served.log()
  with pytest.raises(httpx.TransportError):
    served.client.get("/health", timeout=5)
