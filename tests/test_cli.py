"""The console script: JSON output of a real run, and one clear line for every bad argument."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from specjax.cli import main


def _console_script() -> str:
  path = shutil.which("specjax", path=os.path.dirname(sys.executable)) or shutil.which("specjax")
  assert path, "the specjax console script is not installed"
  return path


def test_generate_json_random_init():
  proc = subprocess.run([_console_script(), "generate", "--prompt", "def f(x):", "--random-init", "--json",
                         "--k", "3", "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert isinstance(out["text"], str) and len(out["tokens"]) == 12
  stats = out["stats"]
  for field in ("rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length"):
    assert field in stats
  assert stats["drafted_tokens"] == 3 * stats["rounds"]
  assert 1.0 <= stats["mean_accepted_length"] <= 4.0


def test_generate_in_mixed_precision(capsys):
  """--dtype mixed converts the target (here the random-init pair's Llama) and speculation runs on it."""
  assert main(["generate", "--prompt", "abc", "--method", "draft", "--random-init", "--dtype", "mixed",
               "--max-new-tokens", "6"]) == 0
  assert "[draft k=" in capsys.readouterr().err


def test_generate_baseline_text(capsys):
  assert main(["generate", "--prompt", "abc", "--method", "none", "--random-init", "--max-new-tokens", "4"]) == 0
  captured = capsys.readouterr()
  assert captured.out.startswith("abc")
  assert "[none k=0] 4 tokens in 4 rounds" in captured.err


@pytest.mark.parametrize("argv,message", [
    (["generate"], "the following arguments are required: --prompt"),
    (["generate", "--prompt", ""], "--prompt: must not be empty"),
    (["generate", "--prompt", "x", "--k", "0"], r"k must be in [1, 32] or 'auto' for --method draft"),
    (["generate", "--prompt", "x", "--k", "40"], r"k must be an integer in [0, 32]"),
    (["generate", "--prompt", "x", "--k", "two"], "argument --k: invalid value 'two': an integer in [1, 32] or 'auto'"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["generate", "--prompt", "x", "--top-p", "0"], "argument --top-p: top_p must be"),
    (["generate", "--prompt", "x", "--min-p", "1.5"], "argument --min-p: min_p must be"),
    (["generate", "--prompt", "x", "--min-p", "abc"], "argument --min-p: invalid float value: 'abc'"),
    (["generate", "--prompt", "x", "--presence-penalty", "3"],
     "argument --presence-penalty: presence_penalty must be"),
    (["generate", "--prompt", "x", "--frequency-penalty", "-2.5"],
     "argument --frequency-penalty: frequency_penalty must be"),
    (["generate", "--prompt", "x", "--repetition-penalty", "0"],
     "argument --repetition-penalty: repetition_penalty must be"),
    (["generate", "--prompt", "x", "--repetition-penalty", "nan"],
     "argument --repetition-penalty: repetition_penalty must be"),
    (["generate", "--prompt", "x", "--logit-bias", "5"], "argument --logit-bias: invalid value '5': TOKEN=BIAS"),
    (["generate", "--prompt", "x", "--logit-bias", "a=1"], "argument --logit-bias: invalid value 'a=1': TOKEN=BIAS"),
    (["generate", "--prompt", "x", "--logit-bias", "5=200"], "argument --logit-bias: logit_bias[5] must be"),
    (["generate", "--prompt", "x", "--logit-bias=-1=2"], "argument --logit-bias: logit_bias token id must be"),
    (["generate", "--prompt", "x", "--random-init", "--logit-bias", "99999=1"],
     "argument --logit-bias: logit_bias token id 99999 is outside the vocabulary"),
    (["generate", "--prompt", "x", "--logprobs", "21"],
     "argument --logprobs: must be an integer in [0, 20], got 21"),
    (["generate", "--prompt", "x", "--logprobs", "-1"], "argument --logprobs: must be an integer in [0, 20]"),
    (["generate", "--prompt", "x", "--logprobs", "two"], "argument --logprobs: invalid int value: 'two'"),
    (["generate", "--prompt", "x", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    (["generate", "--prompt", "x", "--top-k", "-3"], "top_k must be an integer >= 0"),
    (["generate", "--prompt", "x", "--method", "eagle2"], "argument --method: invalid choice: 'eagle2'"),
    (["generate", "--prompt", "x", "--method", "medusa", "--heads", "/nonexistent/heads"],
     "head folder /nonexistent/heads does not exist"),
    (["generate", "--prompt", "x", "--random-init", "--max-new-tokens", "0"], "max_new_tokens must be"),
    (["generate", "--prompt", "x", "--random-init", "--max-new-tokens", "5000"], "exceeds the target's"),
    (["generate", "--prompt", "x", "--method", "none", "--target", "/nonexistent/dir"], "/nonexistent/dir"),
    (["generate", "--prompt", "x", "--draft", "/tmp"], "--draft needs --target"),
    (["generate", "--prompt", "x", "--target", "/tmp"], "needs --draft DIR"),
    (["generate", "--prompt", "x", "--random-init", "--target", "/tmp"], "cannot be combined"),
    (["generate", "--prompt", "x", "--random-init", "--method", "eagle", "--eagle-variant", "2"],
     "argument --eagle-variant: invalid choice: 2"),
    (["generate", "--prompt", "x", "--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["bench", "--random-init", "--prompts", "/nonexistent/prompts.txt"], "--prompts /nonexistent/prompts.txt: No such file"),
    (["bench", "--random-init", "--chat"], "bench --chat needs a model with a chat template"),
    (["bench", "--random-init", "--samplings", "t-1"], "temperature must be a finite number >= 0"),
    (["generate", "--prompt", "x", "--method", "ngram", "--ngram-max", "9"], r"NGram.n_max must be an integer in [1, 8]"),
    (["generate", "--prompt", "x", "--method", "ngram", "--ngram-min", "3", "--ngram-max", "2"],
     "NGram.n_min (3) must be <= n_max (2)"),
    (["generate", "--prompt", "x", "--ngram-min", "2"], "apply only to --method ngram, not draft"),
    (["generate", "--prompt", "x", "--method", "ngram", "--draft", "/tmp"], "--draft is used only by --method draft"),
    (["generate", "--prompt", "x", "--method", "eagle", "--tree", "4-0"],
     "TreeShape.branching[1] must be an integer in [1, 32], got 0"),
    (["generate", "--prompt", "x", "--method", "eagle", "--tree", "wide"], "--tree takes 'dynamic'"),
    (["generate", "--prompt", "x", "--method", "ngram", "--tree", "dynamic"],
     "method 'ngram' does not propose token trees"),
    (["generate", "--prompt", "x", "--method", "suffix", "--store-capacity", "1"],
     "--store-capacity must be 0 (no global store: per-request matching only) or an integer >= 2"),
    (["generate", "--prompt", "x", "--method", "suffix", "--store", "/nonexistent/answers.txt"],
     "--store /nonexistent/answers.txt: No such file"),
    (["generate", "--prompt", "x", "--members", "suffix,ngram"], "--members applies only to --method combined"),
    (["generate", "--prompt", "x", "--method", "combined", "--members", "suffix"],
     "--members must name two or more distinct methods among"),
    (["generate", "--prompt", "x", "--method", "combined", "--member-k", "99"], "--member-k must be an integer in [1, 32]"),
    (["generate", "--prompt", "x", "--method", "pard", "--tree", "dynamic"], "method 'pard' does not propose token trees"),
    (["generate", "--prompt", "x", "--method", "eagle", "--cutoff", "0"], "argument --cutoff: must be a number in (0, 1]"),
    (["generate", "--prompt", "x", "--method", "eagle", "--cutoff", "nan"], "argument --cutoff: must be a number in (0, 1]"),
    (["generate", "--prompt", "x", "--method", "ngram", "--cutoff", "0.5"],
     "--cutoff applies to --method eagle or mtp (or their members of --method combined), not ngram"),
    (["generate", "--prompt", "x", "--method", "eagle", "--tree", "dynamic", "--cutoff", "0.5"],
     "--cutoff applies to chains; a --tree grows by the head's confidence already"),
    (["serve", "--method", "medusa", "--cutoff", "0.5"], "--cutoff applies to --method eagle or mtp"),
    (["generate", "--prompt", "x", "--method", "combined", "--members", "suffix,ngram", "--cutoff", "0.5"],
     "--cutoff applies to eagle or mtp members of --method combined; its members suffix,ngram hold neither"),
    (["serve", "--slots", "0"], "--slots must be >= 1, got 0"),
    (["serve", "--grace", "0"], "--grace must be > 0 seconds"),
    (["serve", "--max-body-bytes", "0"], "--max-body-bytes must be an integer >= 1"),
    (["serve", "--max-tokens", "0"], "--max-tokens must be an integer >= 1 (or unset)"),
    (["serve", "--max-n", "0"], "--max-n must be an integer >= 1"),
    (["serve", "--slots", "4", "--max-n", "5"], "--max-n must be in [1, --slots 4]"),
    (["serve", "--client-timeout", "-1"], "--client-timeout must be a number of seconds > 0"),
    (["serve", "--api-key", "two words"], "--api-key must be None or a non-empty string without spaces"),
    (["serve", "--slots", "4", "--widths", "1,3"], "--widths must be batch sizes in [1, --slots 4] including 4"),
    (["serve", "--method", "none", "--k", "2"], "--k 2 needs a proposer"),
    (["serve", "--k", "0"], "--k 0 with --method draft would run the proposer for nothing"),
    (["serve", "--trees", "dynamic;wide"], "argument --trees: invalid tree 'wide': each of the semicolon-separated "
                                           "trees is 'dynamic', 'dynamic:K,D,N' or a shape such as '4-2-2-1'"),
    (["serve", "--trees", "4-0"], "argument --trees: invalid tree '4-0' (TreeShape.branching[1] must be"),
    (["serve", "--trees", ";"], "argument --trees: invalid value ';': semicolon-separated trees"),
    (["serve", "--k", "2", "--trees", "dynamic:2,4,8;4-2/6"], "--trees are candidates of --k auto only"),
    (["serve", "--method", "ngram", "--trees", "dynamic"],
     "--trees needs a proposer that proposes token trees (--method draft, eagle, mtp or medusa), not --method ngram"),
    (["serve", "--random-init", "--chat-template", "/nonexistent/chat.jinja"],
     "--chat-template /nonexistent/chat.jinja: No such file"),
    (["serve", "--random-init", "--max-len", "5000"], "max_len must be an integer in [16, 1024]"),
    (["serve", "--first-rounds", "0"], "--first-rounds must be in [1, --rounds-per-step 8], got 0"),
    (["serve", "--rounds-per-step", "4", "--first-rounds", "5"], "--first-rounds must be in [1, --rounds-per-step 4]"),
    (["serve", "--refill-rounds", "-1"], "--refill-rounds must be >= 0 (0: off), got -1"),
    (["serve", "--refill-share", "0"], "--refill-share must be a fraction in (0, 1], got 0.0"),
    (["serve", "--max-rounds-per-step", "4"], "--max-rounds-per-step must be >= --rounds-per-step 8, got 4"),
    (["serve", "--call-overhead", "0"], "--call-overhead must be a fraction in (0, 1], got 0.0"),
    (["serve", "--max-call-ms", "0"], "--max-call-ms must be a number of milliseconds > 0, got 0.0"),
])
def test_bad_arguments_one_line_no_traceback(capsys, argv, message):
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("specjax: error: ")
  assert message in err
  assert "Traceback" not in err


def test_generate_ngram_random_init(capsys):
  """--method ngram runs without a draft; greedy output equals the baseline's, and a looping prompt is
  looked up."""
  runs = []
  for extra in (["--method", "none"], ["--method", "ngram", "--k", "4", "--ngram-max", "4"]):
    assert main(["generate", "--prompt", "abcabcabcabc", "--random-init", "--json", "--max-new-tokens", "12",
                 *extra]) == 0
    runs.append(json.loads(capsys.readouterr().out))
  assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[1]["tokens"]) == 12
  stats = runs[1]["stats"]
  assert runs[1]["method"] == "ngram" and runs[1]["k"] == 4
  assert stats["drafted_tokens"] == 4 * stats["rounds"] and stats["accepted_tokens"] > 0


def test_generate_ngram_bundled_pair(capsys, monkeypatch):
  """The bundled pair's target with --method ngram: the proposer passed to generate is the lookup."""
  from specjax import cli
  from specjax.loading import PRETRAINED

  assert cli.DEFAULT_PAIR in PRETRAINED, "the bundled model pair ships with the package"
  import specjax

  seen = []
  real = specjax.generate
  monkeypatch.setattr(specjax, "generate", lambda *a, **kw: seen.append(kw["proposer"]) or real(*a, **kw))
  prompt = "def f(self, x, y):\n    self.x = x\n    self.y = y\n    self.x = x\n"
  assert main(["generate", "--prompt", prompt, "--method", "ngram", "--k", "4", "--max-new-tokens", "16",
               "--no-compare"]) == 0
  err = capsys.readouterr().err
  assert [type(p).__name__ for p in seen] == ["NGram"]
  assert "[ngram k=4] 16 tokens in" in err


def test_head_methods_use_the_shipped_heads_or_say_none_ship(capsys, monkeypatch):
  """--method eagle|medusa|mtp with the bundled pair uses the heads it ships; a pair that ships none for
  the method is one clear error."""
  import dataclasses

  import specjax
  from specjax import cli
  from specjax.loading import PRETRAINED

  shipped = PRETRAINED[cli.DEFAULT_PAIR]("float32").heads
  assert set(shipped) == {"eagle", "medusa", "mtp"}, "the bundled pair ships trained heads for each head method"
  seen = []
  real = specjax.generate
  monkeypatch.setattr(specjax, "generate", lambda *a, **kw: seen.append(kw["proposer"]) or real(*a, **kw))
  assert main(["generate", "--prompt", "def f(x):\n", "--method", "eagle", "--k", "3", "--max-new-tokens", "8",
               "--no-compare"]) == 0
  assert [p.heads.cfg.kind for p in seen] == ["eagle3"]
  assert "[eagle k=3] 8 tokens in" in capsys.readouterr().err
  seen.clear()
  assert main(["generate", "--prompt", "def f(x):\n", "--method", "eagle", "--tree", "dynamic:2,3,5",
               "--max-new-tokens", "8", "--no-compare"]) == 0
  assert "[eagle tree dynamic K=2 D=3 N=5] 8 tokens in" in capsys.readouterr().err
  seen.clear()
  assert main(["generate", "--prompt", "def f(x):\n", "--method", "eagle", "--k", "3", "--cutoff", "0.3",
               "--max-new-tokens", "8", "--no-compare"]) == 0
  assert [p.cutoff for p in seen] == [0.3] and "[eagle k=3] 8 tokens in" in capsys.readouterr().err
  loader = PRETRAINED[cli.DEFAULT_PAIR]
  monkeypatch.setitem(PRETRAINED, cli.DEFAULT_PAIR, lambda dtype: dataclasses.replace(loader(dtype), heads={}))
  assert main(["generate", "--prompt", "x", "--method", "mtp"]) == 2
  assert "--method mtp needs trained heads and the bundled pair ships none" in capsys.readouterr().err


def test_bad_arguments_through_console_script():
  proc = subprocess.run([_console_script(), "generate", "--prompt", "x", "--top-p", "1.5"],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.startswith("specjax: error: argument --top-p: top_p must be ") and proc.stderr.count("\n") == 1
  assert proc.stderr.endswith("got 1.5\n")
  assert proc.stdout == ""


def test_installed_layout_is_namespaced(tmp_path):
  """specjax.models and specjax.train import; no top-level `models` or `train` leaks from the install."""
  code = ("import importlib.util, specjax.models, specjax.train\n"
          "assert importlib.util.find_spec('models') is None, 'top-level models importable'\n"
          "assert importlib.util.find_spec('train') is None, 'top-level train importable'\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr


def test_generate_from_checkpoint_directories(tmp_path, capsys):
  """--target/--draft load Hugging Face directories; greedy speculative output equals the baseline."""
  from flax import nnx

  import specjax
  from specjax.models import Llama, LlamaConfig

  tok = specjax.ByteTokenizer()
  cfg = LlamaConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=256)
  specjax.save_hf(Llama(cfg, rngs=nnx.Rngs(0)), tok, str(tmp_path / "target"))
  specjax.save_hf(Llama(cfg.replace(n_layers=1), rngs=nnx.Rngs(1)), tok, str(tmp_path / "draft"))
  runs = []
  for extra in (["--method", "none"], ["--draft", str(tmp_path / "draft"), "--k", "3"]):
    assert main(["generate", "--prompt", "def f", "--target", str(tmp_path / "target"), "--json",
                 "--max-new-tokens", "10", *extra]) == 0
    runs.append(json.loads(capsys.readouterr().out))
  assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"]) == 10
  assert runs[1]["stats"]["drafted_tokens"] > 0 and runs[0]["stats"]["drafted_tokens"] == 0


def test_bench_eagle_random_init(tmp_path, capsys):
  args = ["bench", "--random-init", "--batch-sizes", "1", "--ks", "2", "--samplings", "greedy",
          "--methods", "eagle", "--max-new-tokens", "4", "--repeats", "1", "--out", str(tmp_path), "--no-progress"]
  assert main(args) == 0
  report = json.load(open(tmp_path / "report.json"))
  assert {r["method"] for r in report["results"]} == {"none", "eagle"}
  assert {t["method"] for t in report["cost_tables"]} == {"eagle"}
  assert report["proposers"]["eagle"]["kind"] == "eagle3"
  assert "| greedy | 1 | eagle k=2 |" in capsys.readouterr().out


def test_bench_bad_methods(capsys):
  assert main(["bench", "--random-init", "--methods", "medusa,lookahead"]) == 2
  assert ("methods must be a non-empty subset of ('draft', 'pard', 'ngram', 'suffix', 'medusa', 'eagle', 'mtp', "
          "'combined')") in capsys.readouterr().err


def test_eos_flag_stops_generation_at_that_token(capsys):
  argv = ["generate", "--prompt", "abc", "--random-init", "--method", "none", "--json", "--max-new-tokens", "12"]
  assert main(argv) == 0
  tokens = json.loads(capsys.readouterr().out)["tokens"]
  stop = tokens[5]
  assert main(argv + ["--eos", str(stop)]) == 0
  assert json.loads(capsys.readouterr().out)["tokens"] == tokens[:tokens.index(stop) + 1]


# ------------------------------------------------------------------------------ what generate shows

FIRST = ["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "16", "--repeats", "1"]  # the README's


def test_generate_compares_with_the_target_alone(capsys):
  """The bundled pair, greedy: the report says the target alone gives the same tokens, with the speedup and
  tau; --no-compare drops the comparison; the text on stdout is the same either way."""
  assert main(FIRST) == 0
  compared = capsys.readouterr()
  assert compared.out.startswith("def fibonacci(n):")
  assert "target alone: the same 16 tokens, token for token (greedy speculative decoding is exact)" in compared.err
  assert "speedup " in compared.err and "x with tau " in compared.err and "compilation apart" in compared.err
  assert main(FIRST + ["--no-compare"]) == 0
  alone = capsys.readouterr()
  assert alone.out == compared.out
  assert "target alone" not in alone.err and "speedup" not in alone.err and "including compilation" in alone.err


def test_generate_json_carries_the_comparison(capsys):
  assert main(FIRST + ["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  cmp = out["comparison"]
  assert cmp["identical"] is True and cmp["greedy"] is True and cmp["same_law"] is True
  assert cmp["baseline_tokens"] == out["tokens"] and cmp["baseline_text"] == out["text"]
  assert cmp["tau"] == out["stats"]["mean_accepted_length"] and cmp["repeats"] == 1
  for field in ("speedup", "seconds", "baseline_seconds", "compile_seconds", "baseline_compile_seconds"):
    assert cmp[field] >= 0, field
  assert out["sampling"]["repetition_penalty"] == 1.2, "the bundled pair's default"
  assert main(FIRST + ["--json", "--no-compare"]) == 0
  assert json.loads(capsys.readouterr().out)["comparison"] is None


def test_generate_sampled_comparison_says_same_law(capsys):
  argv = ["generate", "--prompt", "def f(x):", "--random-init", "--max-new-tokens", "8", "--repeats", "1",
          "--temperature", "1.0"]
  assert main(argv) == 0
  assert "the law is the same, the draws differ" in capsys.readouterr().err
  assert main(argv + ["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["comparison"]["greedy"] is False and out["sampling"]["repetition_penalty"] == 1.0
  assert main(["generate", "--prompt", "x", "--random-init", "--method", "none", "--json", "--max-new-tokens",
               "4"]) == 0
  assert json.loads(capsys.readouterr().out)["comparison"] is None, "the target alone has nothing to compare with"


def test_show_accepted_marks_the_accepted_proposals(capsys, monkeypatch):
  """Not a terminal: runs of accepted proposals between ⟦ and ⟧, and the text without the markers is the
  plain text; the marked tokens are those GenerateOutput.proposed flags."""
  monkeypatch.delenv("NO_COLOR", raising=False)
  assert main(FIRST + ["--no-compare"]) == 0
  plain = capsys.readouterr().out
  assert main(FIRST + ["--no-compare", "--show-accepted", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["proposed"] is not None, "GenerateOutput.proposed (the engine rewrite) is missing"
  assert len(out["proposed"]) == len(out["tokens"]) and 0 < sum(out["proposed"]) <= out["stats"]["accepted_tokens"]
  assert main(FIRST + ["--no-compare", "--show-accepted"]) == 0
  captured = capsys.readouterr()
  marked = captured.out
  assert "⟦" in marked and marked.count("⟦") == marked.count("⟧")
  assert marked.replace("⟦", "").replace("⟧", "") == plain
  assert "accepted proposals are marked ⟦like this⟧" in captured.err
  import specjax
  from specjax import cli

  tok = specjax.load(cli.DEFAULT_PAIR).tokenizer
  pieces = cli._token_pieces(tok, out["tokens"], tok.encode("def fibonacci(n):"))
  inside = "".join(part.split("⟧")[0] for part in marked.split("⟦")[1:])
  assert inside == "".join(piece for piece, p in zip(pieces, out["proposed"]) if p)


def test_marks_are_colour_on_a_terminal_unless_no_color(capsys, monkeypatch):
  from specjax import cli

  pieces, proposed = ["a", "b", "", "c", "d"], [True, True, False, False, True]
  assert cli._marked(pieces, proposed, colour=False) == "⟦ab⟧c⟦d⟧"
  assert cli._marked(pieces, proposed, colour=True) == "\x1b[32mab\x1b[0mc\x1b[32md\x1b[0m"
  monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
  monkeypatch.delenv("NO_COLOR", raising=False)
  argv = FIRST + ["--no-compare", "--show-accepted", "--max-new-tokens", "8"]
  assert main(argv) == 0
  assert "\x1b[32m" in capsys.readouterr().out
  monkeypatch.setenv("NO_COLOR", "1")
  assert main(argv) == 0
  out = capsys.readouterr().out
  assert "\x1b[" not in out and "⟦" in out


def test_token_pieces_join_to_the_text_of_byte_tokens():
  """A character split over byte tokens shows once, on the token that completes it."""
  from specjax import ByteTokenizer, cli

  tok = ByteTokenizer()
  ids = tok.encode("x = 'é€'\n")
  pieces = cli._token_pieces(tok, ids, tok.encode("# "))
  assert "".join(pieces) == tok.decode(ids) and "\ufffd" not in "".join(pieces)
  assert pieces[5:8] == ["", "é", ""] and len(pieces) == len(ids)


def test_logprobs_prints_each_token_and_its_alternatives(capsys):
  argv = ["generate", "--prompt", "def f(x):", "--random-init", "--max-new-tokens", "6", "--no-compare",
          "--logprobs", "3"]
  assert main(argv + ["--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  rows = out["logprobs"]
  assert rows is not None, "GenerateOutput.logprobs (the engine rewrite) is missing"
  assert [r["id"] for r in rows] == out["tokens"]
  for r in rows:
    assert r["logprob"] <= 0 and len(r["top"]) == 3
    assert [a["logprob"] for a in r["top"]] == sorted((a["logprob"] for a in r["top"]), reverse=True)
    assert r["top"][0]["logprob"] >= r["logprob"] - 1e-5  # nothing is more likely than the most likely
  assert main(argv) == 0
  lines = capsys.readouterr().out.splitlines()
  header = next(i for i, line in enumerate(lines) if "logprob" in line)
  assert "top 3" in lines[header] and len(lines) - header - 1 == 6


def test_suffix_combined_and_pard_methods_on_the_bundled_pair(tmp_path, capsys):
  """--method suffix with a --store document, --method combined (suffix and the shipped EAGLE head by default,
  the head capped by --member-k) and --method pard (the shipped parallel draft): each is exact and reports
  what it ran."""
  store = tmp_path / "answers.jsonl"
  store.write_text(json.dumps({"text": "def add(a, b):\n    return a + b\n"}) + "\n")
  runs = {}
  for method, extra in (("none", []), ("suffix", ["--k", "8", "--store", str(store)]),
                        ("combined", ["--k", "8", "--member-k", "2"]), ("pard", ["--k", "3"])):
    assert main(["generate", "--prompt", "def add(a, b):", "--method", method, "--max-new-tokens", "12", "--json",
                 "--no-compare", *extra]) == 0
    runs[method] = json.loads(capsys.readouterr().out)
  for method in ("suffix", "combined", "pard"):
    assert runs[method]["tokens"] == runs["none"]["tokens"], method
  assert runs["suffix"]["proposer"]["store_documents"] == 1
  members = runs["combined"]["proposer"]["members"]
  assert [m["method"] for m in members] == ["suffix", "eagle"] and runs["combined"]["proposer"]["ks"] == [None, 2]
  assert runs["pard"]["proposer"]["method"] == "pard"


@pytest.mark.parametrize("argv,greedy_steps,defer", [([], True, True), (["--no-greedy-steps"], False, True),
                                                     (["--greedy-steps-at-start"], True, False),
                                                     (["--interrupt-calls"], True, True),
                                                     (["--launch-ahead"], True, True),
                                                     (["--no-launch-ahead"], True, True),
                                                     (["--prompt-cache", "16"], True, True),
                                                     (["--prompt-buckets", "16,24,40"], True, True)])
def test_serve_passes_greedy_steps_to_the_server(monkeypatch, argv, greedy_steps, defer):
  """`specjax serve --no-greedy-steps` builds the server with the general step program only (the default
  compiles a greedy one too, while serving unless --greedy-steps-at-start); the server itself is not
  started."""
  from specjax.serving import server as serving

  seen = {}

  class Stop(Exception):
    pass

  def build_server(*args, **kwargs):
    seen.update(kwargs)
    raise Stop

  monkeypatch.setattr(serving, "build_server", build_server)
  with pytest.raises(Stop):
    main(["serve", "--method", "none", "--no-warmup"] + argv)
  assert seen["greedy_steps"] is greedy_steps and seen["defer_greedy"] is defer and seen["first_rounds"] == 1
  assert seen["interruptible"] is ("--interrupt-calls" in argv)
  # Unset: build_server decides (on without a speculation policy).
  assert seen["launch_ahead"] is {"--launch-ahead": True, "--no-launch-ahead": False}.get(next(iter(argv), None))
  assert seen["max_rounds"] == 32 and seen["call_overhead"] == 0.05 and seen["max_call_seconds"] == 0.05
  assert seen["prompt_cache"] == (16 if "--prompt-cache" in argv else 0)
  assert seen["prompt_buckets"] == ((16, 24, 40) if "--prompt-buckets" in argv else None)


def test_bench_pilot_prompts_reach_its_settings(tmp_path, capsys, monkeypatch):
  """bench --pilot-prompts FILE: encoded as --prompts are, handed to BenchSettings.pilot_prompts (the sweep
  itself is test_bench's); a missing file is one clear error naming the option."""
  from specjax import bench
  from specjax.tokenizer import ByteTokenizer

  pilot = tmp_path / "pilot.txt"
  pilot.write_text("def f(x):\nclass A:\n")
  seen = []
  monkeypatch.setattr(bench, "run", lambda target, proposers, rows, settings, progress: seen.append(settings) or {})
  monkeypatch.setattr(bench, "write", lambda report, out: [])
  monkeypatch.setattr(bench, "markdown", lambda report: "")
  assert main(["bench", "--quick", "--random-init", "--methods", "ngram", "--pilot-prompts", str(pilot)]) == 0
  tok = ByteTokenizer()
  assert seen[0].pilot_prompts == (tuple(tok.encode("def f(x):")), tuple(tok.encode("class A:")))
  assert main(["bench", "--quick", "--random-init", "--methods", "ngram",
               "--pilot-prompts", str(tmp_path / "none.txt")]) == 2
  assert f"--pilot-prompts {tmp_path / 'none.txt'}: No such file" in capsys.readouterr().err


def test_generate_pilot_prompts_reach_k_auto(tmp_path, capsys, monkeypatch):
  """--pilot-prompts FILE: each prompt encoded as --prompt is, handed to k='auto' as SpecConfig.pilot_prompts;
  without --k auto, or with a missing file, one clear error naming the option."""
  import specjax
  from specjax import SpecConfig
  from specjax.tokenizer import ByteTokenizer

  pilot = tmp_path / "pilot.jsonl"
  pilot.write_text('{"prompt": "def f(x):"}\n{"prompt": "class A:"}\n')
  seen = []
  real = specjax.generate
  monkeypatch.setattr(specjax, "generate", lambda *a, **kw: seen.append(kw["spec"]) or real(
      *a, **{**kw, "spec": SpecConfig(k=2)}))  # the pilot's own run is tested in test_costmodel.py
  assert main(["generate", "--prompt", "abc", "--random-init", "--method", "ngram", "--k", "auto",
               "--pilot-prompts", str(pilot), "--max-new-tokens", "4", "--no-compare"]) == 0
  tok = ByteTokenizer()
  assert seen[0].auto and seen[0].pilot_prompts == (tuple(tok.encode("def f(x):")), tuple(tok.encode("class A:")))
  capsys.readouterr()
  assert main(["generate", "--prompt", "abc", "--random-init", "--method", "ngram", "--k", "2",
               "--pilot-prompts", str(pilot)]) == 2
  assert "--pilot-prompts are what --k auto (or --tree auto) measures acceptance on" in capsys.readouterr().err
  assert main(["generate", "--prompt", "abc", "--random-init", "--method", "ngram", "--k", "auto",
               "--pilot-prompts", str(tmp_path / "none.jsonl")]) == 2
  assert f"--pilot-prompts {tmp_path / 'none.jsonl'}: No such file" in capsys.readouterr().err
