"""The ``optimized`` marker (tests/conftest.py): XLA's optimizations on inside, the suite's setting outside.

A module marked as a whole: tests/test_long_runs.py checks it from inside.
"""

import os

import jax
import pytest

SUITE_SETTING = jax.config.values["jax_disable_most_optimizations"]


@pytest.mark.optimized
def test_a_marked_test_compiles_with_the_optimizations():
  assert jax.config.values["jax_disable_most_optimizations"] is False


def test_an_unmarked_test_keeps_the_suite_setting():
  assert jax.config.values["jax_disable_most_optimizations"] == SUITE_SETTING
  assert SUITE_SETTING or os.environ.get("JAXCOMP_TEST_XLA_DEFAULTS") == "1"  # the fast-compile setting


def test_a_marked_test_compiles_with_llvm_at_its_first_level():
  """The optimized tests' LLVM setting (tests/conftest.py): XLA's HLO passes, LLVM at level 1."""
  if os.environ.get("JAXCOMP_TEST_XLA_DEFAULTS") == "1":
    pytest.skip("the suite runs with XLA's defaults")
  flags = os.environ["XLA_FLAGS"].split()
  assert "--xla_backend_optimization_level=1" in flags and "--xla_llvm_disable_expensive_passes=true" in flags
