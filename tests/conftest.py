"""8 CPU devices for every test, set up safely before any JAX work.

``jaxcomp.cpu_devices`` sets PJRT_NPROC=16 before JAX creates its CPU client:
8 devices on a 2-core machine otherwise deadlock inside XLA's all-reduce.
"""

import os

os.environ.setdefault("PJRT_NPROC", "16")


def _fast_compile_flags():
  """XLA:CPU settings that compile the tests' programs about twice as fast.

  Compiling is three quarters of the suite's time: about a thousand small programs, each run a
  few times. LLVM's expensive passes go off (JAX's own ``jax_disable_most_optimizations``:
  the optimised HLO, its fusions and collectives, is the same text) and, on the jaxlib versions
  that still have the switch, XLA:CPU writes its loops with its older emitter, which compiles
  faster but forms other fusions: a test that reads fusions or buffers compiles with the
  emitter users get (``harness.compile_as_users``). The suite passes under these settings and
  under XLA's defaults. A test marked ``optimized`` (``_optimized``) compiles with XLA's HLO
  optimizations but LLVM at its first level, its expensive passes off (JAX's setting, when on,
  overrides both). The environment carries these to the processes the tests start; the benchmarks
  keep XLA's defaults.
  Set ``JAXCOMP_TEST_XLA_DEFAULTS=1`` to run the suite with XLA's defaults.
  """
  if os.environ.get("JAXCOMP_TEST_XLA_DEFAULTS") == "1":
    return
  from importlib.metadata import version

  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  flags = os.environ.get("XLA_FLAGS", "").split()
  # what a test marked ``optimized`` compiles with (JAX's setting above overrides both elsewhere)
  flags += [f for f in ("--xla_backend_optimization_level=1", "--xla_llvm_disable_expensive_passes=true")
            if f.split("=")[0] not in " ".join(flags)]
  jaxlib = tuple(int(p) for p in version("jaxlib").split(".")[:2])
  if jaxlib < (0, 11) and "xla_cpu_use_fusion_emitters" not in " ".join(flags):
    flags.append("--xla_cpu_use_fusion_emitters=false")  # gone from jaxlib 0.12, whose XLA refuses it
  os.environ["XLA_FLAGS"] = " ".join(flags)


_fast_compile_flags()


def _shared_compile_cache():
  """One persistent compilation cache for this run's processes, fresh for each run.

  Modules compile the same programs again (the same method over the harness's tree in the
  property, scale, finite and nnx tests; the processes the tests start), and each module drops
  JAX's in-memory caches when it ends (``_release_compiled_programs``). A cache on disk that the
  run's processes share (the test workers and every process they start inherit its path from
  the environment) serves those compiles; it starts empty, so no run reads another's programs,
  and is removed when the run ends.
  """
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  import tempfile

  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxcomp-tests-cache-")
  os.environ["JAXCOMP_TEST_CACHE_OWNER"] = str(os.getpid())
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


_shared_compile_cache()


def pytest_unconfigure(config):
  if os.environ.get("JAXCOMP_TEST_CACHE_OWNER") == str(os.getpid()):
    import shutil

    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


import jaxcomp  # noqa: E402

jaxcomp.cpu_devices(8)

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")

import jaxcomp.core.policy  # noqa: E402

DEFAULT_MIN_SIZE = jaxcomp.core.policy.MIN_SIZE  # the library's policy, which every test runs under


import contextlib  # noqa: E402
import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def every_leaf(monkeypatch):
  """Compress every leaf (``min_size`` 1) in a test whose trees are small on purpose.

  The tests' trees are small (a 3x3x4x8 kernel, a 40x24 matrix, a bias, a scalar) so that every
  codec runs on every kind of leaf; under the library's default policy (leaves under 1024 entries
  travel dense) most of them would not be compressed at all. A module or test that needs the
  codec on every leaf says so (``pytest.mark.usefixtures("every_leaf")``); every other test runs
  the defaults users get, and tests/test_layout.py checks the policy itself.
  """
  monkeypatch.setattr(jaxcomp.core.policy, "MIN_SIZE", 1)


@pytest.fixture(scope="module")
def every_leaf_module():
  """:func:`every_leaf` for a whole module (hypothesis tests take no function-scoped fixture)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(jaxcomp.core.policy, "MIN_SIZE", 1)
    yield


@contextlib.contextmanager
def _optimized(marked: bool):
  """Compiles with XLA's optimizations inside a module or test marked ``optimized``.

  The suite's fast-compile setting (``_fast_compile_flags``) halves compile time but runs
  XLA:CPU's programs two to six times slower: the few tests that train for hundreds of steps lose
  more in running than they save in compiling (docs/benchmarks.md). A module (``pytestmark``) or test marked
  ``pytest.mark.optimized`` compiles with the optimizations on (LLVM at level 1: ``_fast_compile_flags``);
  the processes it starts keep the suite's setting.
  """
  before = jax.config.values["jax_disable_most_optimizations"]
  if marked:
    jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(autouse=True, scope="module")
def _module_optimized(request):
  with _optimized(request.node.get_closest_marker("optimized") is not None):
    yield


@pytest.fixture(autouse=True)
def _test_optimized(request):
  with _optimized(any(m.name == "optimized" for m in request.node.own_markers)):
    yield


def _fewer_garbage_collections():
  """Python's cycle collector, run less often: tracing allocates millions of short-lived objects.

  At Python's default thresholds (700, 10, 10) the collector runs every few hundred allocations and
  walks the objects JAX and the libraries hold from import on each full collection, a few percent
  of a module's seconds (docs/benchmarks.md, "The test suite's time"). The objects alive after the
  imports are frozen (never walked again) and the first generation is collected after 20,000
  allocations. Cycles still go, at the latest at each module's end (``_release_compiled_programs``);
  values and programs are the same.
  """
  gc.collect()
  gc.freeze()
  gc.set_threshold(20_000, 20, 20)


_fewer_garbage_collections()


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


# The heaviest modules (the most seconds of a run), started first: xdist hands whole modules to
# its workers in collection order (``--no-loadscope-reorder`` in pyproject.toml), so that the
# workers end together instead of one running a long module alone at the end of the run.
HEAVIEST_FIRST = ("test_examples.py", "test_suite.py", "test_recipes.py", "test_scatter.py",
                  "test_properties.py", "test_checkpoint.py", "test_nnx.py", "test_fuzz.py", "test_scale.py",
                  "test_long_runs.py", "test_lm.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(HEAVIEST_FIRST)))  # stable: the rest in order
