"""Session fixtures (helpers live in helpers.py so tests can import them)."""

import pytest

from helpers import SMALL, make_model, perturbed_copy


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
