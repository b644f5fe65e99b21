"""8 CPU devices for every test, set up safely before any JAX work.

``jaxcomp.cpu_devices`` sets PJRT_NPROC=16 before JAX creates its CPU client:
8 devices on a 2-core machine otherwise deadlock inside XLA's all-reduce.
"""

import os

os.environ.setdefault("PJRT_NPROC", "16")


import jaxcomp  # noqa: E402

jaxcomp.cpu_devices(8)

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")

# The tests' trees are small (a 3x3x4x8 kernel, a 40x24 matrix, a bias, a
# scalar) so that every codec runs on every kind of leaf; with the library's
# default policy (leaves under 1024 entries travel dense) most of them would
# not be compressed at all. Factories read this default when they are called;
# tests/test_layout.py checks the default policy itself.
import jaxcomp.core.layout  # noqa: E402

DEFAULT_MIN_SIZE = jaxcomp.core.policy.MIN_SIZE
jaxcomp.core.policy.MIN_SIZE = 1


import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's caches of traced and compiled programs after each test module.

  One process compiles a few thousand programs over the suite; holding all of
  them keeps growing XLA:CPU's memory (a compile late in an earlier CI run
  crashed inside XLA). Modules share few programs, so little is recompiled.
  """
  yield
  jax.clear_caches()
  gc.collect()
