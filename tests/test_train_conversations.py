"""Heads trained on a user's conversations: both layouts read, bad lines named, multi-turn context rendered with
the chat template and only answers counted, the target's regenerated answers sharded and resumed after a kill
with nothing lost or repeated, raw answers kept when regeneration is off, and the online and offline modes giving
the same losses."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.chat import ChatFormat
from specjax.train import config as config_lib
from specjax.train import conversations as conv
from specjax.train import heads as heads_lib
from specjax.train import trainer

# A plain template over the stdlib-coder BPE, whose one special token <|endoftext|> ends an assistant turn.
TEMPLATE = ("{% for m in messages %}{{ '### ' + m['role'] + '\\n' + m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}")

OPENAI = {"messages": [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"},
                       {"role": "assistant", "content": "return a + b"}, {"role": "user", "content": "and sub?"},
                       {"role": "assistant", "content": "def sub(a, b):\n    return a - b"}]}
SHAREGPT = {"conversations": [{"from": "system", "value": "You write Python."}, {"from": "human", "value": "def add(a, b):"},
                              {"from": "gpt", "value": "return a + b"}, {"from": "human", "value": "and sub?"},
                              {"from": "gpt", "value": "def sub(a, b):\n    return a - b"}]}


@pytest.fixture(scope="module")
def pair():
  loaded = specjax.load("stdlib-coder")
  return loaded, ChatFormat.create(TEMPLATE, loaded.tokenizer)


def _chats(n: int) -> list[dict]:
  """``n`` conversations, alternating layouts, one and two assistant turns."""
  out = []
  for i in range(n):
    if i % 2:
      out.append({"conversations": [{"from": "human", "value": f"def f_{i}(x):"}, {"from": "gpt", "value": "    return x"},
                                    {"from": "human", "value": f"now g_{i}"}, {"from": "gpt", "value": f"def g_{i}(): pass"}]})
    else:
      out.append({"messages": [{"role": "system", "content": "You write Python."},
                               {"role": "user", "content": f"import os  # {i}"},
                               {"role": "assistant", "content": f"import sys\nprint({i})"}]})
  return out


def _write(path: pathlib.Path, records) -> pathlib.Path:
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return path


# ------------------------------------------------------------------------------------------- reading


def test_both_layouts_read_as_the_same_messages(tmp_path):
  path = _write(tmp_path / "chats.jsonl", [OPENAI, "", SHAREGPT])
  (l1, a), (l3, b) = conv.read_conversations(path)
  assert (l1, l3) == (1, 3)  # source line numbers, blank lines skipped
  assert a == b == tuple(OPENAI["messages"])
  assert [m["role"] for m in b] == ["system", "user", "assistant", "user", "assistant"]


@pytest.mark.parametrize("line,why", [
    ("{not json", r"not valid JSON"),
    (json.dumps({"text": "hi"}), r"unknown layout"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
     r"turn 0 has role 'robot'; allowed: \('system', 'user', 'assistant'\)"),
    (json.dumps({"conversations": [{"from": "human", "value": "x"}, {"from": "bot", "value": "y"}]}),
     r"turn 1 has from 'bot'"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]}),
     r"turn 1 \(assistant\) has empty or non-string content"),
    (json.dumps({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": 3}]}),
     r"turn 1 \(gpt\) has empty or non-string value 3"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}), r"has no assistant turn"),
    (json.dumps({"messages": []}), r"must be a non-empty list"),
])
def test_a_bad_line_names_the_file_and_line(tmp_path, line, why):
  path = _write(tmp_path / "chats.jsonl", [OPENAI, SHAREGPT, line, OPENAI])
  with pytest.raises(conv.ConversationError, match=rf"chats.jsonl:3: .*{why}"):
    conv.read_conversations(path)


def test_a_conversation_the_template_refuses_names_the_file_and_line(pair, tmp_path):
  """Checked before any answer of its shard is generated, and again when the rows are made."""
  loaded, _ = pair
  strict = ChatFormat.create("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}"
                             "{% endif %}" + TEMPLATE, loaded.tokenizer)
  cfg = _cfg(tmp_path)  # line 1 opens with a system turn
  answerer = dataclasses.replace(_answerer(pair), chat=strict)
  with pytest.raises(conv.ConversationError, match=r"chats.jsonl:1: chat template refused the conversation: no system"):
    conv.prepare(cfg, tmp_path / "shards", answerer=answerer, target="stdlib-coder")
  assert not list((tmp_path / "shards").glob("shard-*"))
  raw = conv.prepare(dataclasses.replace(cfg, regenerate=False), tmp_path / "raw", answerer=None, target="x")
  with pytest.raises(conv.ConversationError, match=r"chats.jsonl:1: chat template refused"):
    conv.rows_and_masks(raw, strict, loaded.tokenizer, 16, 0.3, source=cfg.path)


# ------------------------------------------------------------------------------------------ encoding


def test_multi_turn_keeps_earlier_turns_as_context_and_counts_only_answers(pair):
  loaded, chat = pair
  tok = loaded.tokenizer
  messages = OPENAI["messages"]
  ids, answer = conv.encode(chat, tok, messages)
  # The row is the template's rendering of the whole conversation (system and user turns included).
  assert tok.decode(ids.tolist()) == chat.render(messages, add_generation_prompt=False).replace("<|endoftext|>", "")
  # The last answer follows exactly the tokens generate is given for it (every earlier turn as context); the
  # first answer follows its own prompt's text.
  starts = [i for i in range(1, len(ids)) if answer[i] and not answer[i - 1]]
  assert len(starts) == 2 and not answer[0]
  assert ids[:starts[1]].tolist() == chat.encode(tok, messages[:4])
  assert tok.decode(ids[:starts[0]].tolist()) == chat.render(messages[:2])
  # Only the answers count, each through its end-of-turn token; the newline the template writes after it,
  # the user turn and the headers do not.
  eos = tok.eos_id
  assert tok.decode(ids[answer].tolist()) == "return a + b" + "def sub(a, b):\n    return a - b"
  assert [i for i in np.nonzero(answer)[0] if ids[i] == eos] == [i for i in range(len(ids)) if ids[i] == eos]
  for i in np.nonzero(ids == eos)[0]:
    assert answer[i] and not answer[i + 1]
  # Packed: mask[n, t] marks that rows[n, t + 1] is an answer token.
  rows, mask = conv.pack_masked([(ids, answer), (ids, answer)], 16)
  stream = np.concatenate([ids, ids])
  flags = np.concatenate([answer, answer])
  for n in range(len(rows)):
    np.testing.assert_array_equal(rows[n], stream[n * 16:n * 16 + 17])
    np.testing.assert_array_equal(mask[n], flags[n * 16 + 1:n * 16 + 17])


def test_the_head_loss_counts_only_masked_positions():
  """A row whose mask is zero changes nothing: the loss of [row 0, row 1] with row 1 masked out is the loss of
  row 0 alone; and masking a position removes exactly the terms that predict its next token."""
  target = specjax.models.Llama(specjax.models.LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32,
                                                           max_seq_len=64), rngs=nnx.Rngs(0))
  rows = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 13)), jnp.int32)
  for hcfg in (heads_lib.HeadsConfig(kind="eagle3", n_heads=2, ttt_steps=2),
               heads_lib.HeadsConfig(kind="medusa", num_heads=2)):
    heads = hcfg.build(target.cfg, seed=1)
    loss = jax.jit(lambda rows, mask: heads_lib.head_loss(heads, target, hcfg, rows, jax.random.key(0), mask=mask)[1])
    both = loss(rows, jnp.ones((2, 12)).at[1].set(0.0))
    alone = loss(rows[:1], jnp.ones((1, 12)))
    for name in ("loss", "loss_1", "loss_2", "accept_1"):
      np.testing.assert_allclose(float(both[name]), float(alone[name]), rtol=1e-5, err_msg=name)
    some = loss(rows, jnp.ones((2, 12)).at[:, 3].set(0))
    assert abs(float(some["loss_1"]) - float(both["loss_1"])) > 1e-6  # a sensitive test


# ------------------------------------------------------------------------------------ shards, resume


def _cfg(tmp_path, **kw) -> conv.ConversationsConfig:
  (tmp_path / "chat.jinja").write_text(TEMPLATE)
  base = dict(path=str(_write(tmp_path / "chats.jsonl", _chats(7))), shard_size=3, batch=2, max_new_tokens=6,
              chat_template=str(tmp_path / "chat.jinja"))
  return conv.ConversationsConfig(**{**base, **kw})


def _answerer(pair) -> conv.Answerer:
  loaded, chat = pair
  return conv.Answerer(loaded.model, loaded.tokenizer, chat, specjax.proposers.for_heads(loaded.heads["eagle"]))


def _records(folder: pathlib.Path) -> list[dict]:
  return [json.loads(line) for p in sorted(folder.glob("shard-*.jsonl")) for line in p.read_text().splitlines()]


def test_regeneration_resumes_after_a_kill_with_nothing_lost_or_repeated(pair, tmp_path, monkeypatch):
  cfg = _cfg(tmp_path, batching="static")  # calls of generate (continuous batching: the test after the last)
  answerer = _answerer(pair)
  clean = conv.prepare(cfg, tmp_path / "clean", answerer=answerer, target="stdlib-coder")
  assert [p.name for p in clean] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
  records = _records(tmp_path / "clean")
  assert [r["line"] for r in records] == list(range(1, 8))

  # The answers are the target's own: what plain greedy generation (no speculation) gives for the prompt, the
  # second answer following the regenerated first one.
  loaded, chat = pair
  second = records[1]["messages"]  # a two-answer conversation
  prompt = chat.encode(loaded.tokenizer, second[:3])
  plain = specjax.generate(loaded.model, [prompt], max_new_tokens=6, eos_id=chat.stop_ids(loaded.tokenizer))
  assert second[3]["content"] == loaded.tokenizer.decode([t for t in plain.rows()[0] if t != loaded.tokenizer.eos_id])
  assert second[1]["content"] != "    return x"  # regenerated, not the file's

  # Killed in the middle of shard 1 (its third generate call): shard 0 is whole on disk, shard 1 absent.
  calls = []
  real = conv.generate

  def dying(*args, **kwargs):
    calls.append(1)
    if len(calls) == 6:  # shard 0 takes 3 calls (2 + 1 first answers, 1 second), shard 1 dies at its 3rd
      raise KeyboardInterrupt("killed")
    return real(*args, **kwargs)

  monkeypatch.setattr(conv, "generate", dying)
  with pytest.raises(KeyboardInterrupt):
    conv.prepare(cfg, tmp_path / "run", answerer=answerer, target="stdlib-coder")
  assert sorted(p.name for p in (tmp_path / "run").glob("shard-*")) == ["shard-00000.jsonl"]
  monkeypatch.setattr(conv, "generate", real)
  made = []
  conv.prepare(cfg, tmp_path / "run", answerer=answerer, target="stdlib-coder", on_shard=made.append)
  assert made == [1, 2]  # shard 0 is not made again
  resumed = _records(tmp_path / "run")
  lines = [r["line"] for r in resumed]
  assert sorted(lines) == list(range(1, 8)) and len(set(lines)) == len(lines)  # none lost, none twice
  assert resumed == records  # and the same answers as the uninterrupted run
  assert not list((tmp_path / "run").glob("*.partial"))

  # Shards made otherwise are refused, naming what differs.
  with pytest.raises(conv.ConversationError, match=r"max_new_tokens: shards have 6, now 7"):
    conv.prepare(_cfg(tmp_path, max_new_tokens=7), tmp_path / "run", answerer=answerer, target="stdlib-coder")

  # Kept compressed (xz) beside a copy of the prompts file elsewhere, the shards are continued as they are:
  # nothing made again, the same conversations read back; a missing shard is made uncompressed.
  import lzma
  import shutil

  moved = tmp_path / "elsewhere" / "chats.jsonl"
  moved.parent.mkdir()
  shutil.copy(cfg.path, moved)
  for p in (tmp_path / "run").glob("shard-*.jsonl"):
    p.with_name(p.name + ".xz").write_bytes(lzma.compress(p.read_bytes()))
    p.unlink()
  (tmp_path / "run" / "shard-00002.jsonl.xz").unlink()
  made = []
  paths = conv.prepare(dataclasses.replace(cfg, path=str(moved)), tmp_path / "run", answerer=answerer,
                       target="stdlib-coder", on_shard=made.append)
  assert made == [2] and [p.name for p in paths] == ["shard-00000.jsonl.xz", "shard-00001.jsonl.xz",
                                                     "shard-00002.jsonl"]
  assert [(line, list(m)) for line, m in conv.read_shards(paths)] == [
      (r["line"], r["messages"]) for r in records]
  # The source grows (conversations appended): the short last shard is made again with the new conversations
  # that fill it, then the new shards; the shards made before are kept as they are.
  grown = _write(tmp_path / "elsewhere" / "grown.jsonl", _chats(10))
  made = []
  paths = conv.prepare(dataclasses.replace(cfg, path=str(grown)), tmp_path / "run", answerer=answerer,
                       target="stdlib-coder", on_shard=made.append)
  assert made == [2, 3] and [p.name for p in paths][:2] == ["shard-00000.jsonl.xz", "shard-00001.jsonl.xz"]
  more = list(conv.read_shards(paths))
  assert [line for line, _ in more] == list(range(1, 11))  # each once, in order
  assert [(line, list(m)) for line, m in more[:7]] == [(r["line"], r["messages"]) for r in records]
  # An edited source (a conversation of a made shard changed) or a shorter one is refused, naming the shard.
  edited = _chats(10)
  edited[3]["conversations"][0]["value"] = "def changed(x):"
  for other, shard in (((_chats(10)[:5]), 1), (edited, 1)):
    with pytest.raises(conv.ConversationError, match=rf"shard {shard} was made from other conversations"):
      conv.prepare(dataclasses.replace(cfg, path=str(_write(tmp_path / "other.jsonl", other))), tmp_path / "run",
                   answerer=answerer, target="stdlib-coder")


def test_a_turn_too_long_for_the_target_ends_its_conversation(pair, tmp_path):
  """stdlib-coder holds 1024 positions: a conversation whose second prompt does not fit keeps its first answer;
  one whose first prompt does not fit is kept empty in its shard and skipped when rows are made."""
  long = " ".join(["value"] * 1100)
  chats = [{"messages": [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "a"},
                         {"role": "user", "content": long}, {"role": "assistant", "content": "b"}]},
           {"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "c"}]},
           {"messages": [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "d"}]}]
  cfg = dataclasses.replace(_cfg(tmp_path), path=str(_write(tmp_path / "long.jsonl", chats)))
  conv.prepare(cfg, tmp_path / "shards", answerer=_answerer(pair), target="stdlib-coder")
  first, second, third = _records(tmp_path / "shards")
  assert [m["role"] for m in first["messages"]] == ["user", "assistant"] and first["messages"][1]["content"] != "a"
  assert second["messages"] == [] and len(third["messages"]) == 2
  assert [line for line, _ in conv.read_shards(sorted((tmp_path / "shards").glob("shard-*")))] == [1, 3]


def test_regeneration_off_keeps_the_raw_answers(tmp_path):
  cfg = _cfg(tmp_path, regenerate=False)
  conv.prepare(cfg, tmp_path / "raw", answerer=None, target="stdlib-coder")
  got = [tuple(r["messages"]) for r in _records(tmp_path / "raw")]
  assert got == [m for _, m in conv.read_conversations(cfg.path)]
  assert got[1][1] == {"role": "assistant", "content": "    return x"}  # ShareGPT written in the OpenAI layout


# ------------------------------------------------------------------------------- online and offline


def _heads_recipe(tmp_path, **heads) -> config_lib.TrainConfig:
  (tmp_path / "chat.jinja").write_text(TEMPLATE)
  _write(tmp_path / "chats.jsonl", _chats(24))
  return config_lib.from_dict({
      "kind": "heads",
      "heads": {"kind": "eagle3", "d_model": 64, "n_heads": 2, "ttt_steps": 2, **heads},
      "distill": {"target": "stdlib-coder"},
      "conversations": {"path": str(tmp_path / "chats.jsonl"), "regenerate": False, "valid_fraction": 0.3,
                        "chat_template": str(tmp_path / "chat.jinja"), "shards": str(tmp_path / "shards")},
      "data": {"tokenizer_vocab": 4096, "seq_len": 32, "batch_size": 2},
      "optim": {"lr": 1e-3, "warmup_steps": 1},
      "run": {"steps": 3, "eval_every": 3, "eval_batches": 1, "ckpt_every": 3, "log_every": 1, "progress": False}})


def _losses(out: pathlib.Path) -> list[float]:
  lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return [r["loss"] for r in lines if "loss" in r]


def test_online_and_offline_training_give_the_same_losses(tmp_path, capsys):
  """The same head, loss and data: the target's forward inside the step (online, run here through
  `specjax train heads --data`) or cached before training (offline, float32 features and the whole distribution)
  give the first steps' losses within 1e-5 relative, and a run stopped and resumed gives them again. The
  default cache (bfloat16 features, the top 64 of 4096 ids) is an approximation the test tells apart."""
  from specjax.train import cli as train_cli

  online_cfg = _heads_recipe(tmp_path)
  recipe = tmp_path / "online.json"
  raw = online_cfg.to_dict()
  recipe.write_text(json.dumps({**raw, "conversations": {**raw["conversations"], "path": "elsewhere.jsonl"}}))
  assert train_cli.main(["train", "heads", "--config", str(recipe), "--out", str(tmp_path / "online"),
                         "--data", str(tmp_path / "chats.jsonl")]) == 0
  assert f"from {tmp_path / 'chats.jsonl'}" in capsys.readouterr().out
  offline_cfg = _heads_recipe(tmp_path, cache_features=True, cache_top_k=0, cache_dtype="float32")
  offline = trainer.fit(trainer.start(offline_cfg, tmp_path / "offline"))
  assert offline.task.features is not None and offline.task.features.hidden.dtype == np.float32
  assert 0 < offline.batches.masks.mean() < 1  # answers only
  a, b = _losses(tmp_path / "online"), _losses(tmp_path / "offline")
  assert len(a) == len(b) == 3
  np.testing.assert_allclose(b, a, rtol=1e-5)
  # Stopped after a step and resumed: the same losses (the answer masks follow their rows).
  trainer.fit(trainer.start(online_cfg, tmp_path / "split"), stop_at=1)
  trainer.fit(trainer.start(online_cfg, tmp_path / "split", resume=True))
  assert _losses(tmp_path / "split") == a
  approx = trainer.fit(trainer.start(_heads_recipe(tmp_path, cache_features=True), tmp_path / "approx"))
  assert approx.task.features.hidden.dtype == jnp.bfloat16
  assert abs(_losses(tmp_path / "approx")[0] - a[0]) > 1e-5 * abs(a[0])
  # --data on a recipe without [conversations]: the default section renders with the target's own template,
  # which stdlib-coder does not have.
  recipe.write_text(json.dumps({**raw, "conversations": None}))
  assert train_cli.main(["train", "heads", "--config", str(recipe), "--out", str(tmp_path / "none"),
                         "--data", str(tmp_path / "chats.jsonl")]) == 2
  assert "conversations.chat_template: the target stdlib-coder has no chat template" in capsys.readouterr().err


def test_prepare_only_makes_the_shards_and_stops_and_a_run_then_reads_them(tmp_path, capsys):
  """`specjax train heads --prepare-only`: the conversations' shards are made and encoded (counts printed), no
  feature cache, checkpoint or metrics; the training run after it reads the same shards without making any;
  refused with --export-checkpoint."""
  from specjax.train import cli as train_cli

  cfg = _heads_recipe(tmp_path, cache_features=True)
  recipe = tmp_path / "recipe.json"
  recipe.write_text(json.dumps(cfg.to_dict()))
  out = tmp_path / "run"
  assert train_cli.main(["train", "heads", "--config", str(recipe), "--out", str(out), "--prepare-only"]) == 0
  said = capsys.readouterr().out
  shards = sorted((tmp_path / "shards").glob("shard-*.jsonl"))
  assert shards and f"prepared: 24 conversations in {len(shards)} shards" in said
  assert not (out / "checkpoints").exists() and not list(out.glob("target_features*")) and not (out / "metrics.jsonl").exists()
  stamps = [p.stat().st_mtime_ns for p in shards]
  assert train_cli.main(["train", "heads", "--config", str(recipe), "--out", str(out)]) == 0
  assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "shards").glob("shard-*.jsonl"))] == stamps
  assert len(_losses(out)) == 3
  # a killed process's leftover and a shard beyond the source are neither counted nor read
  (tmp_path / "shards" / f"{shards[0].name}.999.partial").write_text(shards[0].read_text())
  (tmp_path / "shards" / "shard-09999.jsonl").write_text(shards[0].read_text())
  assert train_cli.main(["train", "heads", "--config", str(recipe), "--out", str(out), "--prepare-only"]) == 0
  assert f"prepared: 24 conversations in {len(shards)} shards" in capsys.readouterr().out
  assert train_cli.main(["train", "heads", "--config", str(recipe), "--out", str(out), "--prepare-only",
                         "--export-checkpoint"]) == 2
  assert "--prepare-only and --export-checkpoint" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ recipes


@pytest.mark.parametrize("raw,match", [
    ({"conversations": {"path": "c.jsonl", "regenerate": "yes"}}, r"conversations.regenerate must be true or false"),
    ({"conversations": {"path": "c.jsonl", "valid_fraction": 0.9}}, r"conversations.valid_fraction must be a number > 0.0 and <= 0.5"),
    ({"conversations": {"path": "c.jsonl", "shard_size": 0}}, r"conversations.shard_size"),
    ({"conversations": {}}, r"conversations.path must name a JSONL file"),
    ({"conversations": {"path": "c.jsonl", "k": 33}}, r"conversations.k must be an integer in \[0, 32\] \(0: the target alone\), got 33"),
    ({"conversations": {"path": "c.jsonl", "k": "auto"}}, r"conversations.k must be an integer in \[0, 32\]"),
    ({"conversations": {"path": "c.jsonl", "layout": "x"}}, r"unknown field conversations.layout"),
    ({"conversations": {"path": "c.jsonl", "batching": "dynamic"}},
     r"conversations.batching must be one of \('static', 'continuous'\), got 'dynamic'"),
    ({"conversations": {"path": "c.jsonl"}, "distill": {"target": "stdlib-coder", "mix": {"corpus": 1, "target": 1}}},
     r"distill.mix must be \{corpus = 1\} with \[conversations\]"),
    ({"heads": {"kind": "eagle3", "d_model": "wide"}}, r"heads.d_model must be \"target\""),
    ({"heads": {"kind": "eagle3", "cache_dtype": "float16"}}, r"heads.cache_dtype must be one of \('bfloat16', 'float32'\)"),
])
def test_bad_conversation_and_width_recipes_are_named(raw, match):
  base = {"kind": "heads", "heads": {"kind": "eagle3"}, "distill": {"target": "stdlib-coder"},
          "data": {"tokenizer_vocab": 4096}}
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.from_dict({**base, **raw})


def test_a_draft_recipe_takes_no_conversations():
  with pytest.raises(config_lib.ConfigError, match=r"a draft recipe takes no \[conversations\] section"):
    config_lib.from_dict({"kind": "draft", "model": {"vocab_size": 300, "d_model": 8, "n_layers": 1, "n_heads": 1,
                                                     "d_ff": 8},
                          "distill": {"target": "x"}, "data": {"tokenizer_vocab": 300},
                          "conversations": {"path": "c.jsonl"}})
  with pytest.raises(config_lib.ConfigError, match=r"--data trains heads on conversations; this recipe is kind"):
    config_lib.with_data(config_lib.from_dict({"kind": "target", "model": {
        "vocab_size": 300, "d_model": 8, "n_layers": 1, "n_heads": 1, "d_ff": 8}, "data": {"tokenizer_vocab": 300}}),
        "c.jsonl")


def test_head_width_is_the_target_s_or_narrower():
  target = specjax.models.LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64)
  for width in ("target", 0, 32):
    assert heads_lib.HeadsConfig(kind="eagle3", d_model=width).build(target, seed=0).cfg.d_model == 32
  assert heads_lib.HeadsConfig(kind="medusa", d_model="target").build(target, seed=0).cfg.d_model == 32
  assert heads_lib.HeadsConfig(kind="eagle3", d_model=16, n_heads=2).build(target, seed=0).cfg.d_model == 16
  for hcfg, match in ((heads_lib.HeadsConfig(kind="eagle3", d_model=48), r"heads.d_model \(48\) must be \"target\" "
                       r"\(the target's width, 32\) or a narrower width \(< 32\)"),
                      (heads_lib.HeadsConfig(kind="mtp", d_model=16), r"heads.d_model \(16\) of a mtp head must be "
                       r"\"target\""),
                      (heads_lib.HeadsConfig(kind="eagle3", d_model=18), r"heads.d_model \(18\) must be divisible by "
                       r"heads.n_heads \(4, the target's\)")):
    with pytest.raises(config_lib.ConfigError, match=match):
      hcfg.build(target, seed=0)


def test_prompts_alone_are_answered_by_the_target_when_answers_are_regenerated(pair, tmp_path):
  """A conversation may end with a user turn when the answers are regenerated: the target answers it (what
  plain greedy generation gives for that prompt), after any earlier answers; without regeneration such a line
  has nothing to train on and is refused, naming the file, the line and what would make it data."""
  loaded, chat = pair
  records = [{"messages": [{"role": "user", "content": "def add(a, b):"}]},
             {"conversations": [{"from": "human", "value": "import os"}, {"from": "gpt", "value": "import sys"},
                                {"from": "human", "value": "now json"}]},
             {"messages": [{"role": "user", "content": "class Stack:"}, {"role": "assistant", "content": "pass"}]}]
  cfg = dataclasses.replace(_cfg(tmp_path), path=str(_write(tmp_path / "prompts.jsonl", records)))
  conv.prepare(cfg, tmp_path / "shards", answerer=_answerer(pair), target="stdlib-coder")
  first, second, third = (r["messages"] for r in _records(tmp_path / "shards"))
  assert [m["role"] for m in first] == ["user", "assistant"]
  assert [m["role"] for m in second] == ["user", "assistant", "user", "assistant"]
  assert [m["role"] for m in third] == ["user", "assistant"]
  stops = chat.stop_ids(loaded.tokenizer)
  for messages in (first, second):
    prompt = chat.encode(loaded.tokenizer, messages[:-1])
    plain = specjax.generate(loaded.model, [prompt], max_new_tokens=6, eos_id=stops).rows()[0]
    assert messages[-1]["content"] == loaded.tokenizer.decode([t for t in plain if t not in stops])
  ids, answer = conv.encode(chat, loaded.tokenizer, second)  # both answers of the second count
  assert answer.any() and len(ids) == len(answer)
  with pytest.raises(conv.ConversationError, match=r"prompts.jsonl:1: has no assistant turn.*regenerate = true"):
    conv.prepare(dataclasses.replace(cfg, regenerate=False), tmp_path / "raw", answerer=None, target="x")


def test_an_empty_regenerated_answer_is_kept_and_teaches_the_end_of_turn(pair, tmp_path, monkeypatch):
  """The target may end its turn at once: its empty answer is written to the shard, read back, and its row
  counts the end-of-turn token alone; an empty answer in a user's own file is still refused."""
  loaded, chat = pair
  answerer = _answerer(pair)
  monkeypatch.setattr(conv.Answerer, "answer", lambda self, prompts, cfg, seed: [""] * len(prompts))
  monkeypatch.setattr(conv.Answerer, "answer_all", lambda self, prompts, cfg, seeds: [""] * len(prompts))
  cfg = _cfg(tmp_path)
  paths = conv.prepare(cfg, tmp_path / "shards", answerer=answerer, target="stdlib-coder")
  read = list(conv.read_shards(paths))
  assert len(read) == 7 and all(m["content"] == "" for _, ms in read for m in ms if m["role"] == "assistant")
  ids, answer = conv.encode(chat, loaded.tokenizer, read[0][1])
  assert ids[answer].tolist() == list(chat.end_of_turn_ids[:1])
  rows = conv.rows_and_masks(paths, chat, loaded.tokenizer, 16, 0.3, source=cfg.path)
  assert rows["train"][1].any()


def test_answers_regenerated_by_the_target_alone_equal_the_speculative_ones(pair, tmp_path):
  """conversations.k = 0 answers with the target alone (no proposer is called): greedy, the same answers as
  speculation gives, since speculation is exact."""
  cfg = _cfg(tmp_path)
  conv.prepare(cfg, tmp_path / "spec", answerer=_answerer(pair), target="stdlib-coder")

  class Refuses:
    def __getattr__(self, name):
      raise AssertionError(f"the proposer was used ({name}) at k = 0")

  alone = dataclasses.replace(_answerer(pair), proposer=Refuses(), k=0)
  conv.prepare(dataclasses.replace(cfg, k=0), tmp_path / "alone", answerer=alone, target="stdlib-coder")
  assert _records(tmp_path / "alone") == _records(tmp_path / "spec")


def test_continuous_batching_answers_as_static_calls_do_and_a_sampled_answer_follows_its_own_seed(pair, tmp_path):
  """batching = "continuous" streams the turns through slots refilled as answers end: greedy, every shard equals
  the static calls' (plain greedy answers); sampled, the shards do not depend on the number of slots (each
  answer drawn from its conversation's own seed), differ from the greedy ones, and follow the seed."""
  cfg = _cfg(tmp_path, max_new_tokens=12)
  assert cfg.batching == "continuous"  # the default
  answerer = _answerer(pair)
  conv.prepare(dataclasses.replace(cfg, batching="static"), tmp_path / "static", answerer=answerer,
               target="stdlib-coder")
  conv.prepare(dataclasses.replace(cfg, batching="continuous"), tmp_path / "continuous", answerer=answerer,
               target="stdlib-coder")
  greedy = _records(tmp_path / "static")
  assert _records(tmp_path / "continuous") == greedy
  assert answerer._engines and not dataclasses.replace(answerer, k=0)._engines  # another answerer: its own engines
  sampled = dict(batching="continuous", temperature=1.0, max_new_tokens=12)
  for batch in (2, 3):
    conv.prepare(dataclasses.replace(cfg, batch=batch, **sampled), tmp_path / f"sampled-{batch}", answerer=answerer,
                 target="stdlib-coder")
  assert _records(tmp_path / "sampled-2") == _records(tmp_path / "sampled-3") != greedy
  conv.prepare(dataclasses.replace(cfg, seed=1, **sampled), tmp_path / "seed-1", answerer=answerer,
               target="stdlib-coder")
  assert _records(tmp_path / "seed-1") != _records(tmp_path / "sampled-2")


def test_continuous_regeneration_resumes_after_a_kill_mid_shard_with_nothing_lost_or_repeated(pair, tmp_path,
                                                                                            monkeypatch):
  cfg = _cfg(tmp_path, batching="continuous")
  answerer = _answerer(pair)
  conv.prepare(cfg, tmp_path / "clean", answerer=answerer, target="stdlib-coder")
  clean = _records(tmp_path / "clean")
  assert [r["line"] for r in clean] == list(range(1, 8))
  made, real = [], conv.step

  def dying(*args):
    if len(made) == 1:  # in shard 1, after shard 0 was written
      raise KeyboardInterrupt("killed")
    return real(*args)

  monkeypatch.setattr(conv, "step", dying)
  with pytest.raises(KeyboardInterrupt):
    conv.prepare(cfg, tmp_path / "run", answerer=answerer, target="stdlib-coder", on_shard=made.append)
  assert made == [0] and sorted(p.name for p in (tmp_path / "run").glob("shard-*")) == ["shard-00000.jsonl"]
  monkeypatch.setattr(conv, "step", real)
  conv.prepare(cfg, tmp_path / "run", answerer=answerer, target="stdlib-coder", on_shard=made.append)
  assert made == [0, 1, 2] and _records(tmp_path / "run") == clean
  assert not list((tmp_path / "run").glob("*.partial"))


def test_a_run_resumes_with_other_regeneration_batching_but_not_other_answers():
  """How answers are regenerated (rows at once, batching, k) may change on --resume; what they are (length,
  temperature, seed) may not: the checkpoint's recipe contradicts that."""
  raw = {"kind": "heads", "heads": {"kind": "eagle3"}, "distill": {"target": "stdlib-coder"},
         "data": {"tokenizer_vocab": 4096}, "conversations": {"path": "c.jsonl"}}
  saved = config_lib.from_dict(raw)
  how = config_lib.from_dict({**raw, "conversations": {"path": "c.jsonl", "batch": 4, "batching": "static", "k": 0}})
  assert config_lib.contradictions(saved, how) == []
  what = config_lib.from_dict({**raw, "conversations": {"path": "c.jsonl", "max_new_tokens": 64, "seed": 3}})
  assert [d.split(":")[0] for d in config_lib.contradictions(saved, what)] == ["conversations.max_new_tokens",
                                                                              "conversations.seed"]
