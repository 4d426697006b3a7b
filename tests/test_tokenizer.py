"""Tokenizers (specjax.tokenizer): round trips on varied Unicode, the byte tokenizer's two forms agree, the
trained BPE round-trips, check_same_vocab names what differs, loaders name the file, and the engine
package loads a trained model without importing the training package."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, normalizers, pre_tokenizers, processors

from specjax.tokenizer import (EOS, BPETokenizer, ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError,
                               byte_level_tokenizer, check_same_vocab, load_hf_tokenizer, load_tokenizer)
from specjax.train.tokenizer import train_bpe

VOCAB = 300
# Code point ranges to draw from: ASCII with controls, Latin-1, combining marks, Greek and Cyrillic,
# CJK, emoji (4-byte UTF-8) and the last plane's private use area.
_RANGES = [(0x00, 0x7F), (0x80, 0xFF), (0x300, 0x36F), (0x370, 0x4FF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF),
           (0x100000, 0x10FFFD)]


def _texts(seed: int, n: int = 100, max_len: int = 40) -> list[str]:
  """``n`` random strings mixing every range of ``_RANGES`` (no surrogates: they are not valid text)."""
  rng = np.random.default_rng(seed)
  texts = []
  for _ in range(n):
    ranges = [_RANGES[r] for r in rng.integers(0, len(_RANGES), size=int(rng.integers(0, max_len + 1)))]
    texts.append("".join(chr(int(rng.integers(lo, hi + 1))) for lo, hi in ranges))
  return texts + ["", " ", "\n\t\r\x00", "naïve café – 日本語 🙂", "e\u0301 vs \u00e9"]


def _corpus(lines: int = 400) -> list[str]:
  """A few hundred lines of code-like text with some Unicode, enough for ``VOCAB`` BPE tokens."""
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "return", "def", "self", "value", "naïve", "café", "日本", "count"]
  return [f"def {rng.choice(words)}_{i}({rng.choice(words)}): return {rng.choice(words)} + {i % 97}\n"
          for i in range(lines)]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
  return train_bpe(_corpus(), VOCAB)


def _word_level(order: list[str]) -> HFTokenizer:
  """A word-level tokenizer whose token ``i`` is ``order[i]``."""
  tok = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(order)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  return HFTokenizer(tok)


# ---------------------------------------------------------------------------------------- round trips


def test_every_tokenizer_satisfies_the_protocol(bpe):
  for tok in (ByteTokenizer(), byte_level_tokenizer(), bpe):
    assert isinstance(tok, Tokenizer)
    assert 0 <= tok.eos_id < tok.vocab_size


def test_byte_tokenizer_and_byte_level_tokenizer_agree_and_round_trip():
  ours, hf = ByteTokenizer(), byte_level_tokenizer()
  assert (hf.vocab_size, hf.eos_id) == (ours.vocab_size, ours.eos_id)
  for text in _texts(seed=1):
    ids = ours.encode(text)
    assert hf.encode(text) == ids == list(text.encode("utf-8"))
    assert ours.decode(ids) == hf.decode(ids) == text
    # EOS and padding are dropped by both.
    assert ours.decode([ours.eos_id, *ids, -1]) == hf.decode([hf.eos_id, *ids, -1]) == text


def test_bpe_round_trips_text_in_and_out_of_its_corpus(bpe, tmp_path):
  assert bpe.vocab_size == VOCAB and bpe.eos_id == bpe.tokenizer.token_to_id(EOS)
  texts = _corpus(20) + _texts(seed=2)
  for text in texts:
    ids = bpe.encode(text)
    assert all(0 <= i < VOCAB and i != bpe.eos_id for i in ids)
    assert bpe.decode(ids) == text
    assert bpe.decode([bpe.eos_id, *ids, bpe.eos_id, -1]) == text  # EOS and padding are dropped
  assert len(bpe.encode(_corpus(1)[0])) < len(_corpus(1)[0])  # the merges compress the corpus
  assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]
  bpe.save(tmp_path / "tokenizer.json")
  again = load_tokenizer(tmp_path)  # the folder holding tokenizer.json
  assert isinstance(again, BPETokenizer) and again.path == str(tmp_path / "tokenizer.json")
  assert again.fingerprint() == bpe.fingerprint()
  assert [again.encode(t) for t in texts] == [bpe.encode(t) for t in texts]
  check_same_vocab(bpe, again)


def test_hf_encode_adds_special_tokens_and_bpe_encode_does_not(bpe):
  """Both wrap the same tokenizers.Tokenizer; only the policy on special tokens differs."""
  raw = RawTokenizer.from_str(bpe.tokenizer.to_str())
  raw.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, bpe.eos_id)])
  as_hf, as_bpe = HFTokenizer(raw, eos_id=bpe.eos_id), BPETokenizer(raw)
  text = "def alpha(beta): return 7"
  assert as_hf.encode(text) == [bpe.eos_id, *bpe.encode(text)]
  assert as_bpe.encode(text) == bpe.encode(text)
  assert as_hf.encode_batch([text]) == [as_hf.encode(text)]
  assert as_hf.decode(as_hf.encode(text)) == as_bpe.decode(as_hf.encode(text)) == text


# ------------------------------------------------------------------------------------- bad input


def test_check_same_vocab_names_what_differs(bpe):
  with pytest.raises(TokenizerError, match=r"draft tokenizer vocab_size \(300\) differs from the target's \(257\)"):
    check_same_vocab(ByteTokenizer(), bpe)
  words = ["<unk>", "a", "b", "c"]
  with pytest.raises(TokenizerError, match="draft tokenizer maps token id 1 to 'b' but the target's maps it to 'a'"):
    check_same_vocab(_word_level(words), _word_level(["<unk>", "b", "a", "c"]))
  # Same size, same token strings, different encoding (the draft lowercases first).
  lower = byte_level_tokenizer()
  lower.tokenizer.normalizer = normalizers.Lowercase()
  with pytest.raises(TokenizerError, match=r"encodes the probe text differently .* position 0: target ids \[72"):
    check_same_vocab(byte_level_tokenizer(), lower)
  check_same_vocab(_word_level(words), _word_level(words))
  assert issubclass(TokenizerError, ValueError)


def test_loaders_name_the_file(bpe, tmp_path):
  with pytest.raises(TokenizerError, match="missing.json: file not found"):
    load_tokenizer(tmp_path / "missing.json")
  with pytest.raises(TokenizerError, match=f"{tmp_path / 'tokenizer.json'}: file not found"):
    load_tokenizer(tmp_path)
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(TokenizerError, match="bad.json: not a valid tokenizers-format tokenizer.json"):
    load_tokenizer(tmp_path / "bad.json")
  byte_level_tokenizer().save(tmp_path / "bytes.json")
  with pytest.raises(TokenizerError, match=r"bytes.json has no <\|endoftext\|> token"):
    load_tokenizer(tmp_path / "bytes.json")
  bpe.save(tmp_path / "tokenizer.json")
  with pytest.raises(TokenizerError, match=r"tokenizer.json has vocab_size 300 but cfg.json has model.vocab_size 512"):
    load_tokenizer(tmp_path).check_model(512, "cfg.json")


def test_hf_tokenizer_loader_names_the_file(bpe, tmp_path):
  with pytest.raises(TokenizerError, match=f"{tmp_path / 'tokenizer.json'}: file not found"):
    load_hf_tokenizer(str(tmp_path))
  bpe.save(tmp_path / "tokenizer.json")
  assert load_hf_tokenizer(str(tmp_path)).eos_id is None
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOS}}))
  assert load_hf_tokenizer(str(tmp_path)).eos_id == bpe.eos_id
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": VOCAB}))  # past the tokenizer's vocabulary
  with pytest.warns(UserWarning, match=r"eos_id 300 lies outside its vocabulary \[0, 300\) and is ignored"):
    assert load_hf_tokenizer(str(tmp_path)).eos_id is None
  (tmp_path / "generation_config.json").write_text("[1]")
  with pytest.raises(TokenizerError, match="generation_config.json: expected a JSON object, got list"):
    load_hf_tokenizer(str(tmp_path))


# ------------------------------------------------------------------------------------ packaging


def test_the_engine_loads_a_trained_pair_without_the_training_package(tmp_path):
  """specjax.train is the training package; importing specjax and loading the bundled pair (a model
  trained by it, with its BPE tokenizer) must not import it. Run outside the checkout, so that the
  installed package is imported and not the source folder (which holds no specjax/models)."""
  code = ("import sys, specjax\n"
          "from specjax import pretrained\n"
          "if pretrained.available(): specjax.load(pretrained.available()[0])\n"
          "print(sorted(m for m in sys.modules if m.startswith('specjax.train')))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]", out.stdout
