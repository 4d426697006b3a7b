"""`specjax serve` as a real process on 127.0.0.1, started and stopped by the tests: greedy output through
the HTTP API (streamed and not, concurrent, queued requests entering mid-flight) equals offline generate;
every sampling option (penalties, logit bias, min-p) gives generate's output under the same settings, and
the log-probabilities are generate's in OpenAI's shapes, streamed or not; OpenAI's own client works against
it; every bad request gets a 4xx naming its field while the server keeps serving; a client that goes away
frees its slot; a full queue answers 503 with Retry-After; the metrics parse as Prometheus text; SIGTERM
lets running requests finish and the process exit. The server requires an API key (from the environment) and
sets its per-client limits: requests without the key get 401, an oversized body 413, too many tokens 400, a
client that stalls sending its body 408."""

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
from specjax.config import GREEDY, SamplingConfig

# A chat template of the test's own: one line per message, then the assistant's header.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SLOTS, QUEUE, MAX_LEN, K = 2, 6, 64, 2
KEY, MAX_BODY, MAX_TOKENS, MAX_N, CLIENT_TIMEOUT = "sk-test-1234", 8192, MAX_LEN - K - 2, SLOTS, 3.0
AUTH = {"Authorization": f"Bearer {KEY}"}
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
    self.client = httpx.Client(base_url=url, timeout=120, headers=AUTH)

  def log(self) -> str:
    with open(self.log_path, encoding="utf-8", errors="replace") as f:
      return f.read()

  def reference(self, ids: list[int], max_tokens: int, sampling: SamplingConfig = GREEDY) -> list[int]:
    return self.reference_logprobs(ids, max_tokens, sampling)[0]

  def reference_logprobs(self, ids: list[int], max_tokens: int, sampling: SamplingConfig = GREEDY,
                         logprobs: int | None = None) -> tuple[list[int], list, list, list]:
    """generate's (tokens, logprobs, top ids, top logprobs) for ``ids`` alone, cut at EOS and ``max_tokens``."""
    out = specjax.generate(self.target, [ids], max_new_tokens=REF_NEW, sampling=sampling, logprobs=logprobs)
    row = out.rows()[0]
    stops = [i for i, t in enumerate(row) if t == self.tok.eos_id]
    n = min(max_tokens, stops[0] + 1 if stops else REF_NEW)
    if logprobs is None:
      return row[:n], [], [], []
    tops = (out.top_ids[0, :n].tolist(), out.top_logprobs[0, :n].tolist()) if logprobs else ([[]] * n, [[]] * n)
    return row[:n], out.logprobs[0, :n].tolist(), *tops

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
         "--max-body-bytes", str(MAX_BODY), "--max-tokens", str(MAX_TOKENS), "--max-n", str(MAX_N), "--client-timeout", str(CLIENT_TIMEOUT),
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", "SPECJAX_API_KEY": KEY})
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


def _request(served: Served, body: dict, chat: bool) -> tuple[str, dict, dict | None]:
  """The route and whole body of one request (token ids asked for); a non-streamed one is sent, and its
  first choice returned (None for a streamed one, which the caller reads)."""
  path = "/v1/chat/completions" if chat else "/v1/completions"
  body = {"model": MODEL, "return_token_ids": True, **body}
  if body.get("stream"):
    return path, body, None
  r = served.client.post(path, json=body)
  assert r.status_code == 200, r.text
  return path, body, r.json()["choices"][0]


def complete(served: Served, body: dict, chat: bool = False) -> tuple[list[int], str, str]:
  """(token ids, text, finish reason) of one request, streamed (SSE) or not as ``body`` says."""
  path, body, choice = _request(served, body, chat)
  if choice is not None:
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


def test_each_sampling_option_gives_generate_output_under_the_same_settings(served):
  """Greedy requests with each penalty and a logit bias, streamed and not, completions and chat, running
  together: each gives generate's tokens under the same settings, and each option changes the greedy output
  (the plain greedy output of these prompts is a loop of one token). min-p 1 keeps only the most likely
  token, so sampling with it gives the greedy output."""
  tok = served.tok
  chat_prompt = [{"role": "user", "content": "Hi!"}]
  cases = [({"prompt": "def f(x):", "repetition_penalty": 1.5}, False),
           ({"prompt": "def f(x):", "presence_penalty": 1.0, "stream": True}, False),
           ({"prompt": "def f(x):", "frequency_penalty": 0.5, "presence_penalty": -0.2}, False),
           ({"prompt": "def f(x):", "logit_bias": {"97": 100, "5": -100}, "stream": True}, False),
           ({"messages": chat_prompt, "repetition_penalty": 1.3, "frequency_penalty": 0.3, "stream": True}, True),
           ({"prompt": "def f(x):", "temperature": 1.0, "min_p": 1.0, "seed": 7}, False)]
  with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
    futures = [pool.submit(complete, served, {"temperature": 0, "max_tokens": 12, **body}, chat)
               for body, chat in cases]
    results = [f.result() for f in futures]
  for (body, chat), (ids, text, _) in zip(cases, results):
    prompt_ids = served.chat.encode(tok, body["messages"]) if chat else tok.encode(body["prompt"])
    plain = served.reference(prompt_ids, 12)
    assert text == tok.decode(ids)
    if "min_p" in body:
      assert ids == plain
      continue
    options = {f: v for f, v in body.items() if f.endswith("_penalty")}
    bias = {int(t): b for t, b in body.get("logit_bias", {}).items()}
    assert ids == served.reference(prompt_ids, 12, SamplingConfig(temperature=0, logit_bias=bias, **options)), body
    assert ids != plain, body
    if bias:
      assert ids == [97] * 12
  served.wait_idle()


def _merged_logprobs(pieces: list[dict], chat: bool) -> dict:
  """The logprobs objects of a stream's chunks, concatenated."""
  if chat:
    return {"content": [entry for p in pieces for entry in p["content"]]}
  tops = [p["top_logprobs"] for p in pieces]
  return {"tokens": [t for p in pieces for t in p["tokens"]],
          "token_logprobs": [x for p in pieces for x in p["token_logprobs"]],
          "top_logprobs": None if all(t is None for t in tops) else [d for t in tops for d in t],
          "text_offset": [x for p in pieces for x in p["text_offset"]]}


def complete_logprobs(served: Served, body: dict, chat: bool = False) -> tuple[list[int], dict]:
  """(token ids, logprobs object) of one request; streamed, each chunk's logprobs are checked to hold its
  own tokens and the chunks' objects are concatenated."""
  path, body, choice = _request(served, body, chat)
  if choice is not None:
    return choice["token_ids"], choice["logprobs"]
  with served.client.stream("POST", path, json=body) as r:
    assert r.status_code == 200
    lines = [line for line in r.iter_lines() if line]
  assert lines[-1] == "data: [DONE]"
  ids, pieces = [], []
  for line in lines[:-1]:
    choice = json.loads(line.removeprefix("data: "))["choices"][0]
    if choice["logprobs"] is None:  # the chat stream's first chunk: the role alone
      assert chat and not choice.get("token_ids")
      continue
    ids += choice["token_ids"]
    pieces.append(choice["logprobs"])
    assert len(pieces[-1]["content" if chat else "tokens"]) == len(choice["token_ids"])
  return ids, _merged_logprobs(pieces, chat)


def _close(a: list[float], b: list[float]) -> bool:
  """Log-probabilities of the same tokens from the serving step and from generate (float32, other shapes)."""
  return len(a) == len(b) and all(abs(x - y) <= 1e-4 for x, y in zip(a, b))


def _byte_id(entry: dict) -> int:
  """The id of a ByteTokenizer token from its logprobs entry: its byte, or EOS (no bytes)."""
  return entry["bytes"][0] if entry["bytes"] else 256


def test_logprobs_equal_generate_streamed_or_not(served):
  """Greedy completions and chat completions asking for 3 alternatives, streamed and not, running together:
  the tokens' log-probabilities and alternatives are generate's (logprobs=3) for the same prompt, in OpenAI's
  shapes (token strings decoded alone, their bytes, alternatives most likely first), and the streamed chunks'
  entries, concatenated, are the non-streamed ones."""
  tok = served.tok
  messages = [{"role": "user", "content": "Why?"}]
  cases = [({"prompt": "def f(x):", "logprobs": 3}, False),
           ({"prompt": "def f(x):", "logprobs": 3, "stream": True}, False),
           ({"messages": messages, "logprobs": True, "top_logprobs": 3}, True),
           ({"messages": messages, "logprobs": True, "top_logprobs": 3, "stream": True}, True)]
  with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
    futures = [pool.submit(complete_logprobs, served, {"temperature": 0, "max_tokens": 10, **body}, chat)
               for body, chat in cases]
    results = [f.result() for f in futures]
  for (body, chat), (ids, logprobs) in zip(cases, results):
    prompt_ids = served.chat.encode(tok, body["messages"]) if chat else tok.encode(body["prompt"])
    ref_ids, ref_lp, ref_top_ids, ref_top_lp = served.reference_logprobs(prompt_ids, 10, logprobs=3)
    assert ids == ref_ids, body
    if chat:
      content = logprobs["content"]
      assert [e["token"] for e in content] == [tok.decode([t]) for t in ids]
      assert [_byte_id(e) for e in content] == ids
      assert _close([e["logprob"] for e in content], ref_lp)
      for entry, top_ids, top_lp in zip(content, ref_top_ids, ref_top_lp):
        top = entry["top_logprobs"]
        assert [_byte_id(a) for a in top] == top_ids and [a["token"] for a in top] == [tok.decode([a]) for a in top_ids]
        assert _close([a["logprob"] for a in top], top_lp)
        assert [a["logprob"] for a in top] == sorted((a["logprob"] for a in top), reverse=True)
    else:
      strings = [tok.decode([t]) for t in ids]
      assert logprobs["tokens"] == strings and _close(logprobs["token_logprobs"], ref_lp)
      assert logprobs["text_offset"] == [sum(map(len, strings[:i])) for i in range(len(ids))]
      for top, top_ids, top_lp in zip(logprobs["top_logprobs"], ref_top_ids, ref_top_lp):
        likeliest = {}
        for a, b in zip(top_ids, top_lp):
          likeliest.setdefault(tok.decode([a]), b)
        assert list(top) == list(likeliest) and _close(list(top.values()), list(likeliest.values()))
  for streamed, plain in ((results[1][1], results[0][1]), (results[3][1], results[2][1])):
    if "content" in plain:
      strings = lambda lp: [(e["token"], e["bytes"], [(a["token"], a["bytes"]) for a in e["top_logprobs"]])
                            for e in lp["content"]]
      assert strings(streamed) == strings(plain)
      assert _close([e["logprob"] for e in streamed["content"]], [e["logprob"] for e in plain["content"]])
    else:
      assert streamed["tokens"] == plain["tokens"] and streamed["text_offset"] == plain["text_offset"]
      assert _close(streamed["token_logprobs"], plain["token_logprobs"])
      assert [list(d) for d in streamed["top_logprobs"]] == [list(d) for d in plain["top_logprobs"]]
  served.wait_idle()


def test_logprobs_are_the_model_own_before_the_warp(served):
  """A logit bias of +100 on one token makes greedy output all that token, whose warped probability is ~1;
  the log-probabilities returned are the model's own (generate's under the same settings), far below 0.
  Without alternatives (completions logprobs 0, chat without top_logprobs) the top lists are None / empty."""
  body = {"prompt": "x", "temperature": 0, "max_tokens": 6, "logit_bias": {"97": 100}}
  ids, logprobs = complete_logprobs(served, {**body, "logprobs": 0, "stream": True})
  _, ref_lp, _, _ = served.reference_logprobs(served.tok.encode("x"), 6, SamplingConfig(temperature=0,
                                                                                        logit_bias={97: 100}), 3)
  assert ids == [97] * 6 and logprobs["top_logprobs"] is None
  assert _close(logprobs["token_logprobs"], ref_lp) and max(ref_lp) < -1
  messages = [{"role": "user", "content": "Hi!"}]
  ids, logprobs = complete_logprobs(served, {"messages": messages, "temperature": 0, "max_tokens": 5, "logprobs": True},
                                    chat=True)
  _, ref_lp, _, _ = served.reference_logprobs(served.chat.encode(served.tok, messages), 5, logprobs=3)
  assert _close([e["logprob"] for e in logprobs["content"]], ref_lp)
  assert all(e["top_logprobs"] == [] for e in logprobs["content"])


def test_the_openai_client_reads_logprobs_and_refuses_bad_options(served):
  client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
  out = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5, temperature=0, logprobs=2,
                                  presence_penalty=0.5, frequency_penalty=0.5)
  lp = out.choices[0].logprobs
  ids = served.reference(served.tok.encode("def f(x):"), 5, SamplingConfig(temperature=0, presence_penalty=0.5,
                                                                          frequency_penalty=0.5))
  assert lp.tokens == [served.tok.decode([t]) for t in ids] and out.choices[0].text == served.tok.decode(ids)
  assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
  chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=4,
                                        temperature=0, logprobs=True, top_logprobs=2, logit_bias={"98": 100})
  content = chat.choices[0].logprobs.content
  assert [c.token for c in content] == ["b"] * 4 and all(c.bytes == [98] and len(c.top_logprobs) == 2 for c in content)
  for kwargs, field in (({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"98": 300}}, "logit_bias"),
                        ({"top_logprobs": 2}, "top_logprobs"),
                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
    with pytest.raises(openai.BadRequestError, match=field) as e:
      client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, **kwargs)
    assert e.value.param == field


def test_the_openai_client_works_against_it(served):
  client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
  assert [m.id for m in client.models.list().data] == [MODEL]
  out = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=10, temperature=0)
  ids = served.reference(served.tok.encode("def f(x):"), 10)
  assert out.choices[0].text == served.tok.decode(ids) and out.usage.completion_tokens == len(ids)
  # The usage counts the proposals the target accepted and rejected, as the response's speculation says.
  raw = served.client.post("/v1/completions", json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 10,
                                                    "temperature": 0}).json()
  details, spec = raw["usage"]["completion_tokens_details"], raw["speculation"]
  assert details["accepted_prediction_tokens"] == spec["accepted_tokens"]
  assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == spec["drafted_tokens"] > 0
  assert out.usage.completion_tokens_details.accepted_prediction_tokens == details["accepted_prediction_tokens"]
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
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": SLOTS + 1}, 400, "n"),  # more choices than slots
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 1.5}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": True}, 400, "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": "up"}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"257": 1}}, 400, "logit_bias"),  # vocab 257
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 3}, 400,
     "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": False,
                              "top_logprobs": 0}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 1.5}, 400, "top_logprobs"),
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


def test_n_choices_are_the_requests_with_seeds_seed_to_seed_plus_n_minus_1(served):
  """n choices, streamed or not: choice i is what a request with seed + i alone gives; the prompt counts once
  in the usage, the choices' tokens add up."""
  sampling = {"temperature": 1.0, "top_k": 20}
  prompt, n, seed = "def f(x):", MAX_N, 11
  alone = [complete(served, {"prompt": prompt, "max_tokens": 8, "seed": seed + i, **sampling})[0] for i in range(n)]
  assert len({tuple(a) for a in alone}) > 1  # the seeds give different samples
  r = served.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "n": n,
                                                   "seed": seed, "return_token_ids": True, **sampling})
  assert r.status_code == 200, r.text
  out = r.json()
  assert [c["index"] for c in out["choices"]] == list(range(n))
  assert [c["token_ids"] for c in out["choices"]] == alone
  assert out["usage"]["completion_tokens"] == sum(map(len, alone))
  assert out["usage"]["prompt_tokens"] == len(served.tok.encode(prompt))
  body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6, "n": n, "seed": seed,
          "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, **sampling}
  ids, reasons = [[] for _ in range(n)], [None] * n
  with served.client.stream("POST", "/v1/chat/completions", json=body) as stream:
    lines = [line for line in stream.iter_lines() if line]
  assert lines[-1] == "data: [DONE]"
  chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
  for c in chunks[:-1]:
    (choice,) = c["choices"]
    ids[choice["index"]] += choice.get("token_ids", [])
    reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
  chat_ids = served.chat.encode(served.tok, body["messages"])
  singles = [complete(served, {"messages": body["messages"], "max_tokens": 6, "seed": seed + i, **sampling},
                      chat=True)[0] for i in range(n)]
  assert ids == singles and all(reasons) and chunks[-1]["usage"]["prompt_tokens"] == len(chat_ids)
  served.wait_idle()


def test_requests_without_the_api_key_get_401_and_health_stays_open(served):
  body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
  with httpx.Client(base_url=served.url, timeout=60) as bare:
    assert bare.get("/health").status_code == 200  # load balancers' probes need no key
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY},
                    {"Authorization": f"Bearer {KEY}x"}):
      for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics")):
        r = bare.request(method, path, json=body if method == "POST" else None, headers=headers)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert bare.get("/metrics", headers=AUTH).status_code == 200
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=served.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
  assert _metric(served, "specjax_requests_total", {"outcome": "unauthorized"}) >= 15


def test_the_limits_refuse_by_name(served):
  big = {"model": MODEL, "prompt": "x", "max_tokens": 2, "user": "z" * MAX_BODY}
  r = served.client.post("/v1/completions", json=big)
  assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"], r.text
  r = served.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": MAX_TOKENS + 1})
  assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
  assert f"limit of {MAX_TOKENS}" in r.json()["error"]["message"]
  ids, _, reason = complete(served, {"prompt": "x", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
  assert len(ids) == MAX_TOKENS and reason == "length"  # the limit itself is allowed
  # A client that sends its headers and half of its body, then stalls: 408 after the timeout.
  with socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1])), timeout=30) as sock:
    payload = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                 + payload[:10])
    start = time.monotonic()
    reply = sock.recv(4096).decode()
    while reply.count("{") > reply.count("}") or "\r\n\r\n{" not in reply:  # the JSON body may come apart
      reply += sock.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply, reply
    assert CLIENT_TIMEOUT * 0.9 <= time.monotonic() - start
  served.wait_idle()


def test_a_stream_whose_client_stops_reading_ends_and_closes_its_events():
  """The send timeout on its own (a full socket buffer is what makes a real send wait): the client takes the
  headers, then reads nothing; after the timeout the stream ends and its event generator is closed (whose
  ``finally`` cancels the request and frees the slot)."""
  import anyio

  from specjax.serving.server import _EventStream

  closed, sent = [], []

  async def events():
    try:
      while True:
        yield "data: {}\n\n"
    finally:
      closed.append(True)

  async def receive():  # the client says nothing (no disconnect either)
    await anyio.sleep_forever()

  async def send(message):
    sent.append(message["type"])
    if message["type"] == "http.response.body":
      await anyio.sleep_forever()  # its socket buffer is full: the send never completes

  response = _EventStream(events(), media_type="text/event-stream", send_timeout=0.2)

  async def main():
    with anyio.fail_after(10):
      await response({"type": "http", "method": "POST", "path": "/"}, receive, send)

  anyio.run(main)
  assert response.timed_out and closed == [True] and sent == ["http.response.start", "http.response.body"]


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
  with httpx.Client(base_url=served.url, timeout=60, headers=AUTH) as client:  # its own connection, closed mid-stream
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
  # Every call counted once, by why it returned, with at least one round each.
  calls = {s.labels["ended"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.name == "specjax_calls_total"}
  rounds = {s.labels["ended"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "specjax_call_rounds_total"}
  ended = {"finished", "interrupted", "waiting", "prefill", "first_rounds", "refill", "rounds"}
  assert calls and set(calls) <= ended, calls
  assert calls["finished"] > 0 and set(rounds) == set(calls)
  assert all(rounds[e] >= calls[e] for e in calls)
  # The rounds of a full call at the one width: the default 8, or up to 32 where its calls' fixed cost is dear
  # (timed at start-up); no call ran more.
  per_call = _metric(served, "specjax_rounds_per_call", {"width": str(SLOTS)})
  assert 8 <= per_call <= 32 and all(rounds[e] <= calls[e] * per_call for e in calls)
  steps = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "specjax_steps_total")
  assert sum(calls.values()) == steps


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


def test_events_posted_after_the_loop_closed_are_dropped():
  """The engine thread may end a request after the server's event loop has closed (a client gone at shutdown):
  its events are dropped, not raised on the engine thread (an unraisable RuntimeError before)."""
  import asyncio

  from specjax.serving.scheduler import Event
  from specjax.serving.server import _Mailbox

  loop = asyncio.new_event_loop()
  box = _Mailbox(loop)
  queue: asyncio.Queue = asyncio.Queue()
  box.post(queue, Event("tokens", tokens=(1,)))
  loop.run_until_complete(asyncio.sleep(0))  # delivered while the loop runs
  assert queue.get_nowait() == Event("tokens", tokens=(1,))
  loop.close()
  box.post(queue, Event("done", reason="stop"))
  assert queue.empty()
