"""benchmarks/compile_copies.py: a method's buckets against copies of one, compiled (a small run)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import benchmark_script

from jaxcomp_bench import shapes as shp


def test_the_forms_give_the_same_means_and_a_row_is_printed(capsys):
  mod = benchmark_script("compile_copies")
  group = mod.buckets("topk", shp.abstract(shp.resnet50_shapes()[:12]), bucket_bytes=2 ** 18)
  assert len(group) > 1 and len({b.length for b in group}) > 1  # buckets of several layouts
  programs = mod.forms(group)
  _, (xs, key) = programs["copies"]
  rng = np.random.default_rng(0)
  data = [jnp.asarray(rng.normal(size=x.shape) * 1e-4, jnp.float32) for x in xs]
  copies = jax.jit(programs["copies"][0])(data, key)
  mapped = jax.jit(programs["map"][0])(jnp.stack(data), key)
  for i, c in enumerate(copies):  # top-k draws nothing: the keys do not matter
    np.testing.assert_array_equal(np.asarray(c), np.asarray(mapped[i]))
    assert 0 < int(jnp.sum(c != 0)) < c.size
  equal = mod.equalized(group)  # one length, one number of segments; each bucket's own entries unchanged
  assert len({b.length for b in equal}) == 1 and len({b.segments.count for b in equal}) == 1
  own = [data[0][:b.length] for b in group]
  model = jax.jit(programs["model"][0])(own, key)
  built = jax.jit(programs["loop"][0])(own, key)  # top-k's buckets in one loop: the same bits
  for m, b in zip(model, built):
    np.testing.assert_array_equal(np.asarray(m), np.asarray(b))
  padded = [jnp.pad(x, (0, e.length - x.size)) for x, e in zip(own, equal)]
  padded = jax.jit(programs["equal"][0])(padded, key)
  for m, p, b in zip(model, padded, group):
    np.testing.assert_array_equal(np.asarray(m), np.asarray(p[:b.length]))
    assert not np.any(np.asarray(p[b.length:]))
  assert mod.equalized(mod.buckets("powersgd", shp.abstract(shp.resnet50_shapes()[:12]))) is None
  mod.main(["--methods", "qsgd", "--leaves", "12", "--bucket-bytes", str(2 ** 18), "--reps", "1"])
  row = capsys.readouterr().out.splitlines()[-1].split()
  assert row[0] == "qsgd" and int(row[1]) > 1 and all(float(v) > 0 for v in row[2:])


@pytest.mark.parametrize("argv", [["--methods", "bogus"], ["--model", "gpt2"], ["--reps", "0"],
                                  ["--methods", "acpsgd", "--leaves", "3"]])
def test_bad_arguments_are_refused(argv):
  with pytest.raises(SystemExit):
    benchmark_script("compile_copies").main(argv)
