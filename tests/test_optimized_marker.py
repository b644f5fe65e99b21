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
