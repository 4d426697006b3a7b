"""Structured output (specjax.grammar): exact under speculation. The sampled law of speculative decoding under
a grammar (q and p masked at every window position) equals the constrained law computed by enumeration
(chi-square), and the same test rejects a matcher not advanced through the proposals, masks left off p, and
proposals drawn from masked q but judged with the unmasked q; greedy output is the same with and without
speculation, and a draft equal to the target has every proposal accepted; a draft that prefers forbidden
tokens never proposes one; every output of several JSON schemas parses and validates; bad formats are refused
by field from Python and with a 400 over HTTP; OpenAI's client gets structured chat and completions, streamed
too."""

from __future__ import annotations

import collections
import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from flax import nnx

import specjax
import specjax.grammar
from helpers import full_logits
from specjax import SamplingConfig, SpecConfig
from specjax.models import Llama, LlamaConfig
from specjax.proposers import DraftModel
from specjax.engine import unpack_mask
from specjax.request import Request, RequestError
from specjax.runtime import LRU, RUNTIME
from specjax.sampling import Sampler, warp_logits
from specjax.serving.slots import SlotEngine

pytest.importorskip("llguidance")

PASS_P = 1e-3
FAIL_P = 1e-8


class TinyTokenizer:
  """A 32-token vocabulary enough for small JSON and the regex below, with multi-character tokens (so that
  one text has several tokenizations), and EOS last. Characters it has no token for are dropped."""

  PIECES = ["{", "}", '"', ":", ",", " ", "[", "]", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "a", "b",
            "c", "ab", "ba", "true", "false", "null", '": ', ', "', "-", ".", "\n"]
  vocab_size = len(PIECES) + 1
  eos_id = len(PIECES)

  def token_bytes(self):
    return [p.encode() for p in self.PIECES] + [None]

  def encode(self, text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
      best = max((j for j, p in enumerate(self.PIECES) if text.startswith(p, i)), key=lambda j: len(self.PIECES[j]),
                 default=None)
      if best is None:
        i += 1
      else:
        ids.append(best)
        i += len(self.PIECES[best])
    return ids

  def decode(self, ids) -> str:
    return "".join(self.PIECES[i] for i in ids if 0 <= i < len(self.PIECES))


TOK = TinyTokenizer()
CFG = LlamaConfig(vocab_size=TOK.vocab_size, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=128)
PROMPT = [18, 19, 20, 0]
REGEX = "[ab]{1,3}c"  # 14 strings; "ab" and "ba" are also single tokens
STEPS = 5  # the longest output: 4 one-character tokens and EOS


@pytest.fixture(scope="module")
def law(pair):
  return regex_law(pair[0])


@pytest.fixture(scope="module")
def pair():
  # A draft far from the target: many proposals are rejected, many of them forbidden by the grammar.
  return Llama(CFG, rngs=nnx.Rngs(0)), Llama(CFG, rngs=nnx.Rngs(5))


def regex_law(target) -> dict[tuple[int, ...], float]:
  """The constrained law by enumeration, independently of llguidance: a token is allowed where the text so
  far and its piece stay a prefix of the language, EOS where the text is in it; p restricted and renormalised."""
  language = {"".join(s) + "c" for n in (1, 2, 3) for s in __import__("itertools").product("ab", repeat=n)}
  prefixes = {w[:i] for w in language for i in range(len(w) + 1)}
  law = {}

  def walk(seq, text, prob):
    logits = full_logits(target, np.asarray([PROMPT + seq], np.int32))[0, -1].astype(np.float64)
    allowed = [t for t, p in enumerate(TOK.PIECES) if text + p in prefixes] + ([TOK.eos_id] if text in language else [])
    z = np.exp(logits[allowed] - logits[allowed].max())
    for t, w in zip(allowed, z / z.sum()):
      if t == TOK.eos_id:
        law[tuple(seq + [t])] = prob * w
      else:
        walk(seq + [t], text + TOK.PIECES[t], prob * w)

  walk([], "", 1.0)
  return law


def law_pvalue(outputs: list[tuple[int, ...]], law: dict) -> float:
  """Pearson's test of the outputs against ``law`` (cells expecting fewer than 5 pooled); 0 if any output
  lies outside its support."""
  from scipy import stats as sps
  seen = collections.Counter(outputs)
  if set(seen) - set(law):
    return 0.0
  keys = sorted(law)
  counts = np.asarray([seen[k] for k in keys], np.float64)
  expected = len(outputs) * np.asarray([law[k] for k in keys])
  small = expected < 5
  counts = np.append(counts[~small], counts[small].sum())
  expected = np.append(expected[~small], expected[small].sum())
  stat = float(np.sum((counts - expected) ** 2 / expected))
  return float(sps.chi2.sf(stat, len(counts) - 1))


def sample_regex(target, draft, n: int, seed: int) -> list[tuple[int, ...]]:
  """n outputs of the regex at temperature 1, k = 3, through 4 slots refilled as requests end (the programs
  of the other tests' 4 rows: no compilation of a width of its own)."""
  engine = SlotEngine(target, DraftModel(draft), slots=4, widths=(4,), max_len=64, ks=(3,))
  compiled = specjax.grammar.compile_grammar(specjax.grammar.Grammar("regex", REGEX, "pattern"), TOK, (TOK.eos_id,))
  pending = [Request(tuple(PROMPT), STEPS + 3, SamplingConfig(temperature=1.0), (TOK.eos_id,), seed + i, grammar=compiled)
             for i in range(n)]
  outputs, running = [], {}
  while pending or engine.live_slots:
    while pending and engine.free_slots:
      (slot,) = engine.insert([pending.pop()])
      running[slot] = []
    result = engine.step(3)
    for slot, new in result.tokens.items():
      running[slot] += new
    for slot in result.finished:
      outputs.append(tuple(running.pop(slot)))
  return outputs


N_LAW = 600


def test_speculative_law_under_a_grammar_is_the_constrained_law(pair, law):
  target, draft = pair
  outputs = sample_regex(target, draft, N_LAW, seed=1)
  assert all(re.fullmatch(REGEX, TOK.decode(o)) and o[-1] == TOK.eos_id for o in outputs)
  assert law_pvalue(outputs, law) > PASS_P


def _tolerant_commit(self, tokens):  # a broken matcher must not stop the run: it only has to be caught
  self.m.try_consume_tokens([int(t) for t in tokens])


@pytest.mark.parametrize("broken", ["matcher not advanced through the proposals", "masks on q only",
                                    "unmasked q in acceptance"])
def test_the_law_test_rejects_a_broken_grammar_round(pair, law, monkeypatch, broken):
  target, draft = pair
  first = specjax.grammar.first_masks
  if broken.startswith("matcher"):  # every window position gets the mask before the round (no rollback logic)
    stale = lambda matchers, drafts, vocab, *rest: np.repeat(first(matchers, drafts.shape[0], vocab)[:, None],
                                                      drafts.shape[1] + 1, axis=1)
    monkeypatch.setattr(specjax.grammar, "window_masks", stale)
  elif broken.startswith("masks"):  # q restricted, p left unmasked
    monkeypatch.setattr(specjax.grammar, "window_masks", lambda matchers, drafts, vocab, *rest: np.full(
        (drafts.shape[0], drafts.shape[1] + 1, specjax.grammar.mask_words(vocab)), -1, np.int32))
  else:  # each proposal drawn from the masked q (sample renormalises), acceptance handed the unmasked q
    draw = Sampler.draw
    monkeypatch.setattr(Sampler, "warp", lambda self, logits: warp_logits(logits, self.settings, self.mode, self.counts))
    monkeypatch.setattr(Sampler, "draw", lambda self, probs, keys: draw(
        self, probs if self.allowed is None else jnp.where(self.allowed, probs, 0.0), keys))
    monkeypatch.setattr(RUNTIME, "programs", LRU(16))  # traced afresh, and kept from the other tests
  monkeypatch.setattr(specjax.grammar.Matcher, "commit", _tolerant_commit)
  assert law_pvalue(sample_regex(target, draft, N_LAW // 3, seed=1), law) < FAIL_P


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -9, "maximum": 99},
                                      "b": {"type": "boolean"}}, "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"c": {"enum": ["ab", "ba", "c"]},
                                      "a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "maxItems": 3}},
     "required": ["c"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "pattern": "^[abc]{0,3}$"}, "minItems": 1, "maxItems": 2},
]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_of_json_schemas_parses_and_validates(pair, temperature):
  target, draft = pair
  for schema in SCHEMAS:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    out = specjax.generate(target, [PROMPT, [0, 1], [5], [2, 3, 4]], proposer=DraftModel(draft), spec=SpecConfig(k=3),
                           sampling=SamplingConfig(temperature=temperature), max_new_tokens=48, seed=3,
                           tokenizer=TOK, response_format=fmt)
    for row, text in zip(out.rows(), out.text):
      assert row[-1] == TOK.eos_id, (schema, text)
      jsonschema.validate(json.loads(text), schema)


def test_greedy_under_a_grammar_is_the_same_with_and_without_speculation(pair):
  target, draft = pair
  fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMAS[0]}}
  prompts = [PROMPT, [0, 1], [5], [2, 3, 4]]
  kw = dict(max_new_tokens=48, tokenizer=TOK, response_format=fmt)
  plain = specjax.generate(target, prompts, **kw)
  spec = specjax.generate(target, prompts, proposer=DraftModel(target), spec=SpecConfig(k=3), **kw)
  other = specjax.generate(target, prompts, proposer=DraftModel(draft), spec=SpecConfig(k=3), **kw)
  assert plain.rows() == spec.rows() == other.rows()
  # The draft is the target: every proposal, drawn under the grammar's mask at its position, is the target's
  # choice there (with q masked at the first position only, positions 2-3 accepted 0.17 and 0.5).
  assert spec.stats.acceptance_by_position == [1.0, 1.0, 1.0]


class Biased(nnx.Module):
  """A draft model whose logits favour ``tokens`` by ``bias``: one that prefers what the grammar forbids."""

  def __init__(self, model: Llama, tokens: list[int], bias: float):
    self.model, self.cfg = model, model.cfg
    self.bias = nnx.Param(jnp.zeros((model.cfg.vocab_size,)).at[jnp.asarray(tokens)].set(bias))

  def init_cache(self, batch: int, max_len: int):
    return self.model.init_cache(batch, max_len)

  def __call__(self, tokens, cache, tree=None):
    logits, hidden, cache = self.model(tokens, cache, tree=tree)
    return logits + self.bias[...], hidden, cache


def test_no_proposal_is_one_the_grammar_forbids(pair, monkeypatch):
  target, draft = pair
  forbidden = [TOK.PIECES.index(p) for p in ("{", "}", "null", "true", "0")]  # no string of REGEX has them
  biased = DraftModel(Biased(draft, forbidden, 6.0))
  window_masks, rounds = specjax.grammar.window_masks, []

  def spy(matchers, drafts, vocab, *rest):
    bits = window_masks(matchers, drafts, vocab, *rest)
    rounds.append((sorted(matchers), drafts.copy(), np.asarray(unpack_mask(bits, vocab))))
    return bits

  monkeypatch.setattr(specjax.grammar, "window_masks", spy)
  stats = []
  for seed in range(3):
    out = specjax.generate(target, [PROMPT, [0, 1], [5], [2, 3, 4]], proposer=biased, spec=SpecConfig(k=3),
                           sampling=SamplingConfig(temperature=1.0), max_new_tokens=8, seed=seed, tokenizer=TOK,
                           response_format={"type": "regex", "pattern": REGEX})
    assert all(re.fullmatch(REGEX, t) for t in out.text)
    stats.append(out.stats)
  checked = collections.Counter()
  for rows, drafts, allowed in rounds:
    for r in rows:
      for i, token in enumerate(drafts[r]):
        assert allowed[r, i, token], (drafts[r], i)  # allowed after the row's context and drafts[r, :i]
        checked[i] += 1
        if token == TOK.eos_id:
          break  # the response ends there: what follows is never emitted
  assert all(checked[i] > 0 for i in range(3)), checked


def test_a_draft_that_gives_no_allowed_token_any_mass_keeps_its_own_law(pair):
  # Masking would leave nothing to draw from (a reduced draft vocabulary's -inf): the draft proposes from its
  # own law (q stays a distribution, not NaN), the proposal is rejected, and the output is the target's under
  # the grammar all the same.
  target, draft = pair
  allowed = [TOK.PIECES.index(p) for p in ("a", "b", "c", "ab", "ba")] + [TOK.eos_id]
  out = specjax.generate(target, [PROMPT, [0, 1], [5], [2, 3, 4]], proposer=DraftModel(Biased(draft, allowed, -np.inf)),
                         spec=SpecConfig(k=3), sampling=SamplingConfig(temperature=1.0), max_new_tokens=8, seed=0,
                         tokenizer=TOK, response_format={"type": "regex", "pattern": REGEX})
  assert all(re.fullmatch(REGEX, t) for t in out.text) and out.stats.accepted_tokens == 0


@pytest.mark.parametrize("fmt, field", [
    ({"type": "json"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"allOf": [{"type": "string"}, {"type": "integer"}]}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "regex", "pattern": "a("}, "response_format.pattern"),
    ({"type": "regex", "pattern": "z+"}, "response_format.pattern"),  # no token spells a z: unsatisfiable
    ({"type": "grammar", "grammar": "start: start"}, "response_format.grammar"),
])
def test_bad_formats_are_refused_naming_the_field(pair, fmt, field):
  with pytest.raises(RequestError, match=re.escape(field)) as e:
    specjax.generate(pair[0], [PROMPT], max_new_tokens=4, tokenizer=TOK, response_format=fmt)
  assert e.value.field == field


# ------------------------------------------------------------------------------------------------ HTTP


@pytest.fixture(scope="module")
def client(pair):
  from starlette.testclient import TestClient

  from specjax.chat import ChatFormat
  from specjax.serving.server import build_server
  template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  # generate's programs for 4 rows serve these 4 slots (one compilation for both)
  server = build_server(pair[0], TOK, DraftModel(pair[1]), ChatFormat.create(template, TOK), name="tiny", slots=4,
                        widths=(4,), max_len=64, k=3, warm_up=False)
  try:
    with TestClient(server.asgi) as http:
      yield http
  finally:
    server.scheduler.stop()


SCHEMA = SCHEMAS[0]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}


@pytest.mark.parametrize("fmt, field", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema"),
    ({"type": "regex", "pattern": "a("}, "response_format.pattern"),
])
def test_http_refuses_bad_formats_naming_the_field(client, fmt, field):
  r = client.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "response_format": fmt})
  assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
  r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "a"}],
                                                "response_format": {"type": "json_object"}, "ignore_eos": True})
  assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text


def test_openai_client_structured_chat_and_completions_streamed_too(client):
  import openai
  oa = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
  messages = [{"role": "user", "content": "ab"}]
  chat = oa.chat.completions.create(model="tiny", messages=messages, response_format=JSON_FORMAT, temperature=1.0,
                                    seed=1, max_tokens=40)
  jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
  assert chat.choices[0].finish_reason == "stop"
  done = oa.completions.create(model="tiny", prompt="ab", max_tokens=40, temperature=0,
                               extra_body={"response_format": {"type": "regex", "pattern": REGEX}})
  assert re.fullmatch(REGEX, done.choices[0].text)
  pieces = oa.chat.completions.create(model="tiny", messages=messages, response_format=JSON_FORMAT, temperature=0,
                                      max_tokens=40, stream=True)
  text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
  jsonschema.validate(json.loads(text), SCHEMA)
  pieces = oa.completions.create(model="tiny", prompt="ab", max_tokens=40, temperature=0, stream=True,
                                 extra_body={"response_format": {"type": "regex", "pattern": REGEX}})
  assert "".join(c.choices[0].text for c in pieces) == done.choices[0].text
