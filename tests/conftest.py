"""Session fixtures (helpers live in helpers.py so tests can import them)."""

import os
import sys
import tempfile

import pytest

# One persistent XLA compilation cache per test run, shared by the xdist workers and by every subprocess
# the tests start (they inherit the environment): a program compiled once (the random pairs' generate
# loops, recompiled after each module's jax.clear_caches(), in each worker and in each CLI subprocess) is
# read back instead of compiled again. Programs are keyed by their HLO, backend and flags, so a hit is the
# same executable; what the tests check is unchanged.
# The process that makes the folder removes it at its end; a folder the caller chose (their own
# JAX_COMPILATION_CACHE_DIR) is used as it is and never removed, nor is the run's folder by a worker or by a
# pytest subprocess (they see the variable set).
MAKES_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if MAKES_CACHE:
  run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"specjax-tests-xla-{run_id}")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# JAX reads these variables when it is imported (helpers.py imports it below): they must be set first, or the
# workers compile every program afresh (they did until 2026-12-07: the cache held only the subprocesses'
# programs and the few that took over a second). A JAX imported before this file (a plugin) is told directly.
if "jax" in sys.modules:
  import jax

  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))

# The suite's programs are small and compiled once each: XLA:CPU's backend optimisation costs more than they
# run. Without it compiles take about 40 % less time (set before JAX creates its CPU backend; subprocesses
# inherit it). Every comparison in the suite is between programs compiled under these same flags, or against
# references (numpy, transformers) within tolerances that do not depend on them.
# XLA:CPU's newer fusion emitters and its parallel code generation cost about 40 % more compile time again
# (CPU seconds to compile the random pair's generate loop: 5.9 -> 3.3 without the emitters, 2.7 with one
# code-generation split, on this 2-core machine where the two workers already keep both cores busy). Those
# two flags are newer than the first two; an XLA that does not know a flag aborts, so they are kept only if
# a JAX process starts with them (checked once, by the process that sets the flags).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
FASTER_COMPILE = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"


def _xla_accepts(flags: str) -> bool:
  import subprocess

  probe = "import jax, jax.numpy as jnp; jnp.zeros(2).block_until_ready()"
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  flags = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
  if _xla_accepts(f"{flags} {FASTER_COMPILE}"):
    flags = f"{flags} {FASTER_COMPILE}"
  os.environ["XLA_FLAGS"] = flags

from helpers import SMALL, make_model, perturbed_copy  # noqa: E402  (after the environment above)


# The longest test files first (by their total time in a full run): pytest-xdist hands whole files to its two
# workers in collection order (pyproject's --no-loadscope-reorder; by default it reorders files by their
# number of tests), so a long file handed out last would leave one worker running it alone at the end.
LONG_FIRST = ("test_sharding.py", "test_trees.py", "test_proposers.py", "test_distribution.py", "test_suffix.py",
              "test_pard.py",
              "test_sampling_options.py", "test_notebooks.py", "test_docs.py", "test_train_heads.py",
              "test_train_conversations.py", "test_bench.py",
              "test_gguf.py", "test_cli.py", "test_serving.py", "test_serve_throughput.py", "test_quant.py",
              "test_structured.py", "test_device_check.py", "test_costmodel.py",
              "test_train.py", "test_generate.py", "test_hf.py", "test_mimo.py", "test_hf_families.py",
              "test_head_formats.py",
              "test_serve_http.py", "test_tree_accept.py")


def pytest_collection_modifyitems(items):
  rank = lambda item: (LONG_FIRST.index(item.path.name) if item.path.name in LONG_FIRST else len(LONG_FIRST))
  items.sort(key=rank)  # stable: the order inside a file is kept


def pytest_sessionfinish(session):
  """The run's cache goes when the run ends (the controller's session finishes after every worker's)."""
  if MAKES_CACHE and not hasattr(session.config, "workerinput"):
    import shutil

    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)



@pytest.fixture(scope="session")
def target():
  return make_model(SMALL, seed=0)


@pytest.fixture(scope="session")
def draft(target):
  return perturbed_copy(target, scale=0.15, seed=1)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Compiled CPU programs live in memory mappings; one long pytest process compiles hundreds of them.
  Dropping them after each test module keeps the suite far from the kernel's mapping limit."""
  yield
  import jax

  jax.clear_caches()
