"""benchmarks/sort_keys.py: jnp.sort against SketchML's int32-key sort (a small run)."""

import jax
import numpy as np
import pytest
from harness import benchmark_script

from jaxcomp.core.layout import Segments


def _module():
  return benchmark_script("sort_keys")


def test_both_sorts_give_sketchmls_split_points_and_a_row_prints(capsys):
  mod = _module()
  segs = Segments((0, 256), (200, 1000), ((200,), (1000,)), 128)
  x = np.random.default_rng(0).standard_normal(segs.length).astype(np.float32)
  key = jax.random.PRNGKey(3)
  floats, keys = mod.FloatSortCodec(16, 512), mod.sketchml.SketchCodec(16, 512)
  np.testing.assert_array_equal(np.asarray(floats.edges(x, key, segs)), np.asarray(keys.edges(x, key, segs)))
  mod.main(["--shape", "2,64", "--reps", "1", "--models", ""])
  rows = capsys.readouterr().out.splitlines()
  assert rows[1].startswith("sort 2x64") and all(float(v) > 0 for v in rows[1].split()[-2:])


@pytest.mark.parametrize("argv", [["--shape", "4"], ["--reps", "0"], ["--models", "vgg"]])
def test_bad_arguments_are_refused(argv):
  with pytest.raises(SystemExit):
    _module().main(argv)
