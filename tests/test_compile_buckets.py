"""benchmarks/compile_buckets.py (compile seconds of three forms per number of buckets, a small run)
and benchmarks/compile_flags.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from harness import benchmark_script


def _module():
  return benchmark_script("compile_buckets")


def test_the_three_forms_compute_the_same_and_print_a_row_per_count(capsys):
  mod = _module()
  length = 64 * 128
  xs = [jnp.asarray(np.random.default_rng(i).normal(size=length), jnp.float32) for i in range(3)]
  results = {}
  for name, (fn, args) in mod.forms(3, length).items():
    args = ((xs,) + args[1:]) if name != "map + data" else ((jnp.stack(xs),) + args[1:])
    results[name] = np.asarray(jnp.stack(list(fn(*args))))
  np.testing.assert_allclose(results["constants"], results["int32 data"], rtol=1e-6)
  np.testing.assert_allclose(results["constants"], results["map + data"], rtol=1e-6)
  mod.main(["--buckets", "1,2", "--length", str(length), "--reps", "1"])
  rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
  assert [r[0] for r in rows] == ["1", "2"] and all(float(v) > 0 for r in rows for v in r[1:])


@pytest.mark.parametrize("argv", [["--buckets", "0"], ["--length", "1000"], ["--reps", "0"]])
def test_bad_arguments_are_refused(argv):
  with pytest.raises(SystemExit):
    _module().main(argv)


def test_compile_flags_compiles_a_method_and_prints_its_seconds(capsys, monkeypatch):
  """benchmarks/compile_flags.py: the child's step compiles and prints ``name seconds``."""
  import jaxcomp.core.policy

  monkeypatch.setattr(jaxcomp.core.policy, "MIN_SIZE", jaxcomp.core.policy.MIN_SIZE)  # the child sets 1
  benchmark_script("compile_flags").child(["qsgd"])
  name, seconds = capsys.readouterr().out.split()
  assert name == "qsgd" and float(seconds) > 0
