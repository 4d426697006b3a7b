"""Instruction prompts of several kinds (``specjax.train.instructions``): every kind made, held-out prompts never
in training, reproducible draws, refusals by name, and the files the command writes."""

from __future__ import annotations

import collections
import json

import pytest

from specjax.train import conversations as conv
from specjax.train import data as data_lib
from specjax.train import instructions as ins


@pytest.fixture
def small_stdlib(monkeypatch):
  """The standard library cut to its held-out files and 40 training files, so that the code and prose kinds
  parse a few dozen files instead of a thousand; the kinds' caches are emptied before and after."""
  root, files = data_lib.corpus_files("stdlib")
  name = lambda p: p.relative_to(root).as_posix()
  held = [p for p in files if ins.prompt_split(name(p)) != "train"]
  train = [p for p in files if ins.prompt_split(name(p)) == "train" and "test" not in name(p)][::25][:40]
  train += [p for p in files if name(p) == "ntpath.py"]  # shares functions with posixpath.py, a held-out file
  small = sorted(set(held + train), key=name)
  real = data_lib.corpus_files
  monkeypatch.setattr(data_lib, "corpus_files", lambda corpus: (root, small) if corpus == "stdlib" else real(corpus))
  for cached in (ins._code_items, ins._prose_items):
    cached.cache_clear()
  yield root, small
  for cached in (ins._code_items, ins._prose_items):
    cached.cache_clear()


def test_every_kind_is_made_and_held_out_prompts_never_occur_in_training(small_stdlib):
  train = ins.instruction_prompts("train", 800, seed=3, kinds=ins.KINDS, with_kinds=True)
  test = ins.instruction_prompts("test", 200, seed=3, kinds=ins.KINDS, with_kinds=True)
  for drawn in (train, test):
    counts = collections.Counter(k for k, _ in drawn)
    assert set(counts) == set(ins.KINDS) and min(counts.values()) > len(drawn) / 8, counts  # drawn uniformly
  assert not {t for _, t in train} & {t for _, t in test}
  # The sources too: a held-out code prompt's function and a held-out prose prompt's passage come from files
  # and passages no training prompt was made from.
  train_code = {(i["module"], i["name"]) for i in ins._code_items("train")}
  test_code = {(i["module"], i["name"]) for i in ins._code_items("test")}
  assert test_code and train_code and not train_code & test_code
  assert not {i["module"] for i in ins._code_items("train")} & {i["module"] for i in ins._code_items("test")}
  assert ins.prompt_split("posixpath.py") == "test" and ins.prompt_split("ntpath.py") == "train"
  shared = {"isabs", "basename", "dirname", "normpath"}  # documented alike in both files
  assert shared <= {i["name"] for i in ins._code_items("train") if i["module"] == "ntpath"}
  assert not shared & {i["name"] for i in ins._code_items("test") if i["module"] == "posixpath"}
  assert {i["name"] for i in ins._code_items("test") if i["module"] == "posixpath"}  # the rest of it is kept
  train_keys = {k for i in ins._code_items("train") for k in (i["code"], (i["name"], i["summary"]))}
  assert not any(i["code"] in train_keys or (i["name"], i["summary"]) in train_keys for i in ins._code_items("test"))
  passages = lambda split: {f["passage"] for _, f in ins._prose_items(split)}
  assert passages("test") and not passages("train") & passages("test")
  # The held-out share is about 6 % of the corpus's files, not the corpus split's 1 %.
  root, small = small_stdlib
  held = [p for p in small if ins.prompt_split(p.relative_to(root).as_posix()) == "test"]
  assert len(held) >= 20 and all(data_lib.split_of(p.relative_to(root).as_posix()) != "valid" for p in held)


def test_draws_are_reproducible_and_a_kinds_prompts_do_not_depend_on_the_others():
  chat = ins.instruction_prompts("train", 40, seed=1, kinds="chat")
  assert chat == ins.instruction_prompts("train", 40, seed=1, kinds=["chat"])
  assert chat != ins.instruction_prompts("train", 40, seed=2, kinds="chat")
  mixed = ins.instruction_prompts("train", 40, seed=1, kinds="math,chat", with_kinds=True)
  mixed_chat = [t for k, t in mixed if k == "chat"]
  assert 0 < len(mixed_chat) < 40 and set(mixed_chat) <= set(chat)
  mixed_math = [t for k, t in mixed if k == "math"]
  assert len(mixed_math) == 40 - len(mixed_chat)
  assert set(mixed_math) <= set(ins.instruction_prompts("train", 40, seed=1, kinds="math"))


@pytest.mark.parametrize("kinds", ["code,bogus", "", "chat,chat", ["prose", "poetry"]])
def test_unknown_or_repeated_kinds_are_refused_by_name(kinds):
  with pytest.raises(ValueError, match=r"kinds must be distinct values of \('code', 'prose', 'chat', 'math'\)"):
    ins.instruction_prompts("test", 4, kinds=kinds)


def test_an_unknown_split_is_refused_by_name():
  with pytest.raises(ValueError, match=r"split must be one of \('train', 'valid', 'test'\), got 'eval'"):
    ins.instruction_prompts("eval", 4, kinds="chat")


def test_code_documents_leave_out_the_files_whose_prompts_are_held_out(small_stdlib):
  root, small = small_stdlib
  texts = {p: data_lib.read_text(p) for p in small}
  kept = {t for p, t in texts.items() if ins.prompt_split(p.relative_to(root).as_posix()) == "train" and t.strip()}
  got = ins.code_documents(10**6, max_chars=10**9)
  assert set(got) == kept and len(got) == len(kept)


def test_the_command_writes_held_out_prompts_and_training_conversations(tmp_path, capsys):
  from specjax.cli import read_prompts

  ins.main(["--held-out", "6", "--kinds", "chat,math", "--out", str(tmp_path / "heldout.jsonl")])
  records = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
  assert [r["kind"] for r in records] and {r["kind"] for r in records} <= {"chat", "math"}
  assert read_prompts(str(tmp_path / "heldout.jsonl")) == [r["prompt"] for r in records]
  assert [r["prompt"] for r in records] == ins.instruction_prompts("test", 6, kinds="chat,math")

  ins.main(["--conversations", "5", "--kinds", "chat", "--out", str(tmp_path / "prompts.jsonl")])
  read = conv.read_conversations(tmp_path / "prompts.jsonl", prompts=True)
  assert [m for _, m in read] == [({"role": "user", "content": p},)
                                   for p in ins.instruction_prompts("train", 5, kinds="chat")]
  with pytest.raises(conv.ConversationError, match=r"prompts.jsonl:1: has no assistant turn"):
    conv.read_conversations(tmp_path / "prompts.jsonl")
  for argv, why in ((["--held-out", "0"], "--held-out must be a positive number of prompts, got 0"),
                    (["--conversations", "2", "--kinds", "chat,poem"], "--kinds: kinds must be distinct values"),
                    (["--held-out", "2", "--conversations", "2"], "--held-out and --conversations")):
    with pytest.raises(SystemExit):
      ins.main(argv + ["--out", str(tmp_path / "x.jsonl")])
    assert why in capsys.readouterr().err
