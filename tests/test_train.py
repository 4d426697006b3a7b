"""Tests of specjax.train: losses against NumPy, data, checkpoints, resume, distillation, bad input."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax import pretrained
from specjax.models.llama import LlamaConfig
from specjax.tokenizer import TokenizerError, load_tokenizer
from specjax.train import config as config_lib
from specjax.train import data as data_lib
from specjax.train import losses, trainer
from specjax.train.checkpoint import CheckpointError, Checkpoints

VOCAB = 300

# ------------------------------------------------------------------------------------ fixtures


def _synthetic_doc(i: int, rng: np.random.Generator) -> str:
  names = ["alpha", "beta", "gamma", "delta", "value", "items", "result", "index", "count", "name"]
  lines = [f"def func_{i}({rng.choice(names)}, {rng.choice(names)}):"]
  for _ in range(int(rng.integers(3, 8))):
    a, b = rng.choice(names, 2)
    lines.append(f"    {a} = {b} + {int(rng.integers(0, 100))}")
  lines.append(f"    return {rng.choice(names)}\n")
  return "\n".join(lines)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
  """A JSONL corpus of 600 small synthetic Python functions."""
  path = tmp_path_factory.mktemp("corpus") / "code.jsonl"
  rng = np.random.default_rng(0)
  path.write_text("".join(json.dumps({"text": _synthetic_doc(i, rng)}) + "\n" for i in range(600)))
  return path


def tiny_config(corpus: pathlib.Path, **run) -> config_lib.TrainConfig:
  return config_lib.from_dict({
      "kind": "target",
      "model": {"vocab_size": VOCAB, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq_len": 64},
      "data": {"corpus": str(corpus), "tokenizer_vocab": VOCAB, "seq_len": 32, "batch_size": 4, "seed": 0},
      "optim": {"lr": 1e-2, "warmup_steps": 2},
      "run": {"steps": 24, "eval_every": 12, "eval_batches": 2, "ckpt_every": 6, "keep": 2, "log_every": 4,
              "progress": False, **run},
  })


def leaves_equal(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# -------------------------------------------------------------------------------------- losses


def _np_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_divergences_match_numpy():
  rng = np.random.default_rng(0)
  p_logits, q_logits = rng.normal(size=(2, 3, 17)) * 3, rng.normal(size=(2, 3, 17)) * 3
  for temperature in (1.0, 0.7):
    p, q = _np_softmax(p_logits / temperature), _np_softmax(q_logits / temperature)
    m = (p + q) / 2
    kl = lambda a, b: np.sum(a * np.log(a / b), -1)
    want = {"fkl": kl(p, q), "rkl": kl(q, p), "jsd": 0.5 * kl(p, m) + 0.5 * kl(q, m),
            "tvd": 0.5 * np.abs(p - q).sum(-1)}
    for name, fn in losses.DIVERGENCES.items():
      got = np.asarray(fn(jnp.asarray(p_logits), jnp.asarray(q_logits), temperature))
      np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    accept = np.asarray(losses.expected_acceptance(jnp.asarray(p_logits), jnp.asarray(q_logits), temperature))
    np.testing.assert_allclose(accept, np.minimum(p, q).sum(-1), rtol=1e-5, atol=1e-6)
  # Every divergence vanishes at p = q; JSD is bounded by log 2; greedy acceptance is argmax agreement.
  for name, fn in losses.DIVERGENCES.items():
    np.testing.assert_allclose(fn(jnp.asarray(p_logits), jnp.asarray(p_logits)), 0.0, atol=1e-6)
  assert float(jnp.max(losses.jsd(jnp.asarray(p_logits) * 50, jnp.asarray(q_logits) * 50))) <= np.log(2) + 1e-6
  greedy = losses.expected_acceptance(jnp.asarray(p_logits), jnp.asarray(q_logits), 0.0)
  np.testing.assert_array_equal(greedy, p_logits.argmax(-1) == q_logits.argmax(-1))


def test_cross_entropy_matches_numpy():
  rng = np.random.default_rng(1)
  logits, targets = rng.normal(size=(2, 5, 11)), rng.integers(0, 11, (2, 5))
  mask = (rng.random((2, 5)) > 0.3).astype(np.float32)
  nll = -np.log(np.take_along_axis(_np_softmax(logits), targets[..., None], -1)[..., 0])
  got = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  np.testing.assert_allclose(float(got), (nll * mask).sum() / mask.sum(), rtol=1e-5)


# ---------------------------------------------------------------------------------------- data


def test_split_is_deterministic_and_disjoint(corpus):
  splits = {s: data_lib.documents(str(corpus), s) for s in data_lib.SPLITS}
  assert all(splits.values())
  assert sum(map(len, splits.values())) == 600
  assert len(splits["train"]) > 0.9 * 600
  assert not set(splits["valid"]) & set(splits["train"]) and not set(splits["test"]) & set(splits["train"])
  assert data_lib.documents(str(corpus), "valid") == splits["valid"]


def test_stdlib_corpus_excludes_site_packages():
  root, files = data_lib.corpus_files("stdlib")
  assert files and all("site-packages" not in f.parts for f in files)
  assert files == sorted(files, key=lambda p: p.relative_to(root).as_posix())


def test_batches_resume_from_position():
  rows = np.arange(50 * 5).reshape(50, 5)
  a = data_lib.Batches(rows, 4, seed=3)
  seen = [a.next() for _ in range(30)]  # crosses an epoch boundary (12 batches per epoch)
  b = data_lib.Batches(rows, 4, seed=3)
  for _ in range(17):
    b.next()
  c = data_lib.Batches(rows, 4, seed=3, position=b.position)
  for want in seen[17:]:
    np.testing.assert_array_equal(c.next(), want)
  # Within an epoch every row appears at most once.
  epoch0 = np.concatenate(seen[:12])[:, 0]
  assert len(set(epoch0.tolist())) == 48


def test_tokenizer_round_trips(corpus, tmp_path):
  tok = trainer.train_bpe(data_lib.documents(str(corpus), "train"), VOCAB)
  assert tok.vocab_size == VOCAB
  text = "def func_1(alpha, beta):\n    return alpha + 7  # ünïcode\n"
  assert tok.decode(tok.encode(text)) == text
  tok.save(tmp_path / "tokenizer.json")
  again = load_tokenizer(tmp_path / "tokenizer.json")
  assert again.encode(text) == tok.encode(text) and again.fingerprint() == tok.fingerprint()
  assert tok.decode(tok.encode(text) + [tok.eos_id, -1]) == text


# ------------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
  """A tiny target trained for 24 steps without interruption."""
  out = tmp_path_factory.mktemp("run") / "full"
  return trainer.fit(trainer.start(tiny_config(corpus), out))


def test_tiny_target_loss_falls(trained):
  lines = [json.loads(l) for l in (trained.out / "metrics.jsonl").read_text().splitlines()]
  train_losses = [l["loss"] for l in lines if "loss" in l]
  evals = [l["valid_loss"] for l in lines if "valid_loss" in l]
  assert train_losses[-1] < train_losses[0] - 1.0
  assert len(evals) == 2 and evals[-1] < np.log(VOCAB)
  assert (trained.out / "model" / "params.npz").is_file()
  exported = pretrained.load_model(trained.out / "model")
  assert leaves_equal(nnx.to_pure_dict(nnx.split(exported)[1]), trained.params)


def test_resume_equals_uninterrupted(corpus, trained, tmp_path):
  cfg = tiny_config(corpus)
  killed = trainer.fit(trainer.start(cfg, tmp_path), stop_at=15)  # last checkpoint: step 12
  assert killed.step == 15
  resumed = trainer.start(cfg, tmp_path, resume=True)
  assert resumed.step == 15 and resumed.batches.position == killed.batches.position
  shutil.rmtree(tmp_path / "checkpoints" / "15")  # as if killed between checkpoints 12 and 18
  resumed = trainer.start(cfg, tmp_path, resume=True)
  assert resumed.step == 12
  trainer.fit(resumed)
  assert resumed.step == trained.step == 24
  assert leaves_equal(resumed.params, trained.params)
  assert leaves_equal(resumed.opt_state, trained.opt_state)


def test_checkpoint_round_trip_and_keep_n(tmp_path):
  graphdef, params = trainer.init_model(LlamaConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32), 0)
  opt = trainer.make_optimizer(config_lib.OptimConfig(warmup_steps=1), 10)
  state = {"params": params, "opt": opt.init(params)}
  ckpts = Checkpoints(tmp_path, keep=2)
  for step in (1, 2, 3):
    ckpts.save(step, state, {"step": step, "data": {"epoch": 0, "index": step}})
  assert ckpts.all_steps() == [2, 3]
  restored, meta = ckpts.restore(state)
  assert meta["data"]["index"] == 3
  assert leaves_equal(restored, state) and jax.tree.structure(restored) == jax.tree.structure(state)


# ---------------------------------------------------------------------------------- bad input


def test_missing_and_empty_corpus_name_the_path(tmp_path):
  with pytest.raises(data_lib.CorpusError, match=str(tmp_path / "nope")):
    data_lib.documents(str(tmp_path / "nope"), "train")
  (tmp_path / "empty").mkdir()
  with pytest.raises(data_lib.CorpusError, match="holds no text files"):
    data_lib.documents(str(tmp_path / "empty"), "train")
  (tmp_path / "blank.txt").write_text("\n  \n")
  with pytest.raises(data_lib.CorpusError, match="blank.txt is empty"):
    data_lib.documents(str(tmp_path / "blank.txt"), "train")
  (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n')
  with pytest.raises(data_lib.CorpusError, match="bad.jsonl:2"):
    data_lib.documents(str(tmp_path / "bad.jsonl"), "train")


def test_config_errors_name_the_field(corpus, tmp_path):
  raw = tiny_config(corpus).to_dict()
  raw["optim"]["learning_rate"] = 1.0
  with pytest.raises(config_lib.ConfigError, match="optim.learning_rate"):
    config_lib.from_dict(raw)
  raw = tiny_config(corpus).to_dict()
  raw["data"]["batch_size"] = 0
  with pytest.raises(config_lib.ConfigError, match="data.batch_size"):
    config_lib.from_dict(raw)
  path = tmp_path / "bad.toml"
  path.write_text('kind = "target"\n[model]\nvocab_size = 300\n')
  with pytest.raises(config_lib.ConfigError, match="bad.toml"):
    config_lib.load_config(path)


def test_cli_reports_bad_input_as_one_line(tmp_path, capsys):
  from specjax.train import cli

  assert cli.main(["train", "target", "--config", str(tmp_path / "missing.toml")]) == 2
  assert f"config file {tmp_path / 'missing.toml'} does not exist" in capsys.readouterr().err
  recipe = pathlib.Path(__file__).parents[1] / "train" / "configs" / "stdlib_target.toml"
  assert cli.main(["train", "draft", "--config", str(recipe)]) == 2
  assert "kind is 'target'" in capsys.readouterr().err


def _copy_run(trained, tmp_path) -> pathlib.Path:
  out = tmp_path / "run"
  shutil.copytree(trained.out, out)
  return out


def test_resume_with_contradicting_config_names_the_field(corpus, trained, tmp_path):
  out = _copy_run(trained, tmp_path)
  cfg = tiny_config(corpus)
  changed = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=5e-3))
  with pytest.raises(trainer.RunError, match=r"optim\.lr: checkpoint has 0.01, config has 0.005"):
    trainer.start(changed, out, resume=True)
  # Bookkeeping fields may change on resume.
  relaxed = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, log_every=1, keep=3))
  assert trainer.start(relaxed, out, resume=True).step == 24
  with pytest.raises(trainer.RunError, match="--resume"):
    trainer.start(cfg, out)


# A restore that fails part-way (the corrupt array store below) leaves orbax's event loop closed while tensorstore's
# reads of the other arrays still complete: each calls back into that loop from a tensorstore thread, which Python
# reports as an unraisable "Event loop is closed" (orbax and tensorstore, not ours; the CheckpointError is raised
# before). Found with a sys.unraisablehook that printed the reporting thread (tensorstore's, "Dummy-N").
@pytest.mark.filterwarnings("ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")
def test_corrupt_and_mismatched_checkpoints_are_clear_errors(trained, tmp_path):
  out = _copy_run(trained, tmp_path)
  ckpts = Checkpoints(out / "checkpoints")
  like = {"params": trained.params, "opt": trained.opt_state}
  # Mismatched: a model of another width.
  _, other = trainer.init_model(dataclasses.replace(trained.cfg.model, d_model=48, n_heads=2), 0)
  with pytest.raises(CheckpointError, match=r"checkpoints/24 does not match the model: .*shape"):
    ckpts.restore({"params": other, "opt": trainer.make_optimizer(trained.cfg.optim, 24).init(other)})
  # Corrupt: the array store of the newest step is overwritten with garbage.
  for f in (out / "checkpoints" / "24" / "state" / "d").iterdir():
    f.write_bytes(b"\0garbage" * 8)
  with pytest.raises(CheckpointError, match="checkpoints/24"):
    ckpts.restore(like)
  # Corrupt metadata.
  (out / "checkpoints" / "18" / "meta" / "metadata").write_text("{not json")
  with pytest.raises(CheckpointError, match="checkpoints/18"):
    ckpts.restore(like, step=18)


def test_interrupted_save_never_restores(trained, tmp_path):
  out = _copy_run(trained, tmp_path)
  ckpt_dir = out / "checkpoints"
  # An interrupted save of step 30: orbax's temporary directory, with garbage inside.
  partial = ckpt_dir / "30.orbax-checkpoint-tmp-1234567"
  shutil.copytree(ckpt_dir / "24", partial)
  for f in (partial / "state" / "d").iterdir():
    f.write_bytes(b"partial")
  ckpts = Checkpoints(ckpt_dir)
  assert ckpts.latest_step() == 24 and ckpts.all_steps() == [18, 24]  # the partial step is never listed
  restored, meta = ckpts.restore({"params": trained.params, "opt": trained.opt_state})
  assert meta["step"] == 24 and leaves_equal(restored["params"], trained.params)
  # A save that fails part-way (an array that cannot be serialised after valid ones) leaves no step.
  bad = {"params": trained.params, "opt": trained.opt_state, "zzz": object()}
  with pytest.raises(Exception):
    ckpts.save(36, bad, {"step": 36})
  assert Checkpoints(ckpt_dir).all_steps() == [18, 24]


def test_tokenizer_vocab_mismatch_names_the_path(corpus, trained, tmp_path):
  out = _copy_run(trained, tmp_path)
  small = trainer.train_bpe(data_lib.documents(str(corpus), "train"), 280)
  small.save(out / "tokenizer.json")
  with pytest.raises(TokenizerError, match=r"tokenizer.json has vocab_size 280 .* model.vocab_size 300"):
    trainer.start(tiny_config(corpus), out, resume=True)
  with pytest.raises(TokenizerError, match="missing.json: file not found"):
    load_tokenizer(tmp_path / "missing.json")


# ----------------------------------------------------------------------------- distillation


def _markov_rows(n: int, length: int, vocab: int, seed: int) -> np.ndarray:
  """Rows sampled from a fixed random first-order Markov chain with peaked transitions."""
  rng = np.random.default_rng(seed)
  trans = rng.dirichlet(np.full(vocab, 0.2), size=vocab)  # the chain is drawn from seed 0 always
  trans = np.random.default_rng(0).dirichlet(np.full(vocab, 0.2), size=vocab)
  rows = np.zeros((n, length), np.int32)
  rows[:, 0] = rng.integers(0, vocab, n)
  for t in range(1, length):
    u = rng.random(n)[:, None]
    rows[:, t] = np.minimum((u > np.cumsum(trans[rows[:, t - 1]], -1)).sum(-1), vocab - 1)
  return rows


def test_distillation_raises_measured_acceptance():
  vocab, length = 24, 33
  optim = config_lib.OptimConfig(lr=1e-2, warmup_steps=5, weight_decay=0.0)
  # 1. The target learns the Markov chain by cross entropy.
  t_cfg = LlamaConfig(vocab_size=vocab, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=128)
  t_def, t_params = trainer.init_model(t_cfg, 0)
  opt = trainer.make_optimizer(optim, 150)
  opt_state = opt.init(t_params)
  rows = _markov_rows(150 * 16, length, vocab, seed=1)
  ones = jnp.ones((16, length - 1), jnp.float32)
  for i in range(150):
    t_params, opt_state, _ = trainer.train_step(t_def, t_params, opt_state, jnp.asarray(rows[i * 16:(i + 1) * 16]),
                                                ones, optimizer=opt)
  target = nnx.merge(t_def, t_params)

  # 2. A small draft, measured before and after distillation toward the frozen target (TVD, on data the
  #    draft generates itself, as in DistillSpec).
  d_cfg = LlamaConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=1, d_ff=32, max_seq_len=128)
  d_def, d_params = trainer.init_model(d_cfg, 1)
  prompts = _markov_rows(16, 4, vocab, seed=2)

  def measured(params):
    res = specjax.generate(target, prompts, draft=nnx.merge(d_def, params), spec=specjax.SpecConfig(k=4),
                           sampling=specjax.SamplingConfig(temperature=1.0), max_new_tokens=48, seed=0)
    return res.stats.acceptance_rate

  before = measured(d_params)
  opt = trainer.make_optimizer(optim, 100)
  opt_state = opt.init(d_params)
  mask = jnp.ones((16, length - 1), jnp.float32)
  for i in range(100):
    prefix = jnp.asarray(rows[i * 16:(i + 1) * 16, :1])
    gen = trainer.sample_continuations(d_def, d_params, prefix, jax.random.key(i), gen_len=length - 1,
                                       temperature=1.0)
    d_params, opt_state, _ = trainer.train_step(d_def, d_params, opt_state, gen, mask, t_def, t_params,
                                                optimizer=opt, divergence="tvd")
  after = measured(d_params)
  assert after > before + 0.15, (before, after)


# ---------------------------------------------------------------------------------- the shipped pair


def test_shipped_pair_loads_and_speculation_is_exact():
  target, draft, tok = pretrained.load_pretrained("stdlib-coder")
  assert target.cfg.n_layers >= 4 and target.cfg.num_params >= 5_000_000
  assert target.cfg.vocab_size == draft.cfg.vocab_size == tok.vocab_size
  assert draft.cfg.num_params * 8 <= target.cfg.num_params
  text = "import os\n\ndef main(argv):\n    return os.path.join(argv[0], 'x')\n"
  assert tok.decode(tok.encode(text)) == text
  base = specjax.generate(target, "def ", tokenizer=tok, max_new_tokens=12)
  spec = specjax.generate(target, "def ", draft=draft, tokenizer=tok, max_new_tokens=12)
  assert spec.rows() == base.rows() and spec.stats.acceptance_rate > 0.2
  with pytest.raises(ValueError, match="unknown pretrained model 'nope'"):
    pretrained.load_pretrained("nope")


def test_shipped_heads_fit_the_pair_and_propose_exactly():
  """The heads shipped with the pair load for its target, keep greedy output equal to the baseline, and
  propose better than untrained ones (tau about 1.0): each accepts more than 1.2 tokens per round on code."""
  from specjax.proposers import for_heads

  loaded = specjax.load("stdlib-coder")
  assert set(loaded.heads) == {"eagle", "medusa", "mtp"}
  prompt = "class Stack:\n    def __init__(self):\n        self.items = []\n"
  base = specjax.generate(loaded.model, prompt, tokenizer=loaded.tokenizer, max_new_tokens=24)
  for method, heads in loaded.heads.items():
    out = specjax.generate(loaded.model, prompt, tokenizer=loaded.tokenizer, proposer=for_heads(heads),
                           spec=specjax.SpecConfig(k=3), max_new_tokens=24)
    assert out.rows() == base.rows(), method
    assert out.stats.mean_accepted_length > 1.2, (method, out.stats.mean_accepted_length)


def test_self_distillation_keeps_each_batch_and_resumes():
  """Self-distillation hands each batch over as soon as it exists, and a call resumed past the batches an
  interrupted run kept writes exactly the rest (each batch's sampling and seed depend on its index only)."""
  from specjax.chat import ChatFormat
  from specjax.cli import _random_pair
  from specjax.train.instructions import self_distill

  target, _, tok = _random_pair()
  chat = ChatFormat.create("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                           "{% if add_generation_prompt %}<|assistant|>{% endif %}", tok)
  prompts = ["def add(a, b):", "class Stack:", "import os", "while True:"]
  kept = []
  full = self_distill(target, tok, chat, prompts, max_new_tokens=8, batch=2, progress=False, on_batch=kept.append)
  assert kept == [full[:2], full[2:]]
  assert [t.startswith(chat.prompt(p)) for t, p in zip(full, prompts)] == [True] * 4
  assert self_distill(target, tok, chat, prompts, max_new_tokens=8, batch=2, progress=False, done=2) == full[2:]
  with pytest.raises(ValueError, match="done"):
    self_distill(target, tok, chat, prompts, batch=2, done=1)


def test_kept_answers_drop_a_line_cut_mid_write(tmp_path):
  """A run killed while appending a batch leaves a last line without its newline: resuming reads the whole
  lines before it and answers that batch again, instead of failing on the cut JSON."""
  from specjax.train.instructions import kept_answers

  partial = tmp_path / "sd.jsonl.partial"
  assert kept_answers(partial) == []
  whole = '{"text": "a"}\n{"text": "b\\nc"}\n'
  partial.write_text(whole)
  assert kept_answers(partial) == ["a", "b\nc"]
  partial.write_text(whole + '{"text": "cut he')
  assert kept_answers(partial) == ["a", "b\nc"]


def test_code_documents_are_train_split_excerpts(corpus):
  from specjax.train.instructions import code_documents

  train = data_lib.documents(str(corpus), "train")
  excerpts = code_documents(5, seed=1, max_chars=40, corpus=str(corpus))
  assert len(excerpts) == 5 and all(0 < len(e) <= 40 for e in excerpts)
  assert all(any(e in doc for doc in train) for e in excerpts)
  assert code_documents(5, seed=1, max_chars=40, corpus=str(corpus)) == excerpts
