"""The per-segment k-th largest of jaxcomp.kernels.segtopk: the sampled bracket == the 31-pass bisection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.kernels import compaction, segtopk
from jaxcomp.layout import ROW, Segments


def _segments(sizes):
  offsets, at = [], 0
  for n in sizes:
    offsets.append(at)
    at += -(-n // ROW) * ROW
  return Segments(tuple(offsets), tuple(sizes), tuple((n,) for n in sizes), ROW)


SEGS = _segments([200_000, 1000, 50_000, 9000, 30_000])
K = np.maximum(1, (np.asarray(SEGS.sizes) * 0.01).astype(np.int64))


def _bucket(x):
  x = np.array(x, np.float32)
  for o, n, p in zip(SEGS.offsets, SEGS.sizes, SEGS.padded_sizes):
    x[o + n:o + p] = 0.0
  return jnp.asarray(x)


def _both(x, k=K):
  bits = compaction.abs_bits(x)
  fast = jax.jit(lambda b: segtopk.kth_largest_bits(b, SEGS, k))(bits)
  slow = jax.jit(lambda b: segtopk.bisect_kth(b, SEGS, k))(bits)
  return np.asarray(fast), np.asarray(slow)


def _case(name, rng):
  n = SEGS.length
  x = rng.standard_normal(n)
  if name == "ties":
    x = np.round(x * 3) / 3
  elif name == "zeros":
    x[: n // 2] = 0.0
  elif name == "heavy":
    x = x * rng.standard_cauchy(n)
  elif name == "scale":
    x = x * 1e-7
  elif name == "nan":
    x[rng.integers(0, n, 100)] = np.nan
    x[rng.integers(0, n, 100)] = np.inf
  return _bucket(x)


@pytest.mark.parametrize("name", ["normal", "ties", "zeros", "heavy", "scale", "nan"])
def test_sampled_bracket_is_exact(name):
  fast, slow = _both(_case(name, np.random.default_rng(len(name))))
  np.testing.assert_array_equal(fast, slow)


def test_a_sample_that_misses_falls_back_to_bisection():
  """Large values everywhere but at the sampled positions: the bracket misses, the answer is still exact."""
  plan = segtopk._plan(SEGS, tuple(int(v) for v in K))
  positions = np.asarray(segtopk._sample(jnp.arange(SEGS.length, dtype=jnp.int32), SEGS, plan))
  x = np.full(SEGS.length, 5.0, np.float32) + np.random.default_rng(0).random(SEGS.length, np.float32)
  x[positions[positions >= 0]] = 1e-3
  fast, slow = _both(_bucket(x))
  np.testing.assert_array_equal(fast, slow)


def test_segmented_topk_matches_argsort():
  x = _case("ties", np.random.default_rng(3))
  idx = np.asarray(jax.jit(lambda v: segtopk.segmented_topk(v, SEGS, K))(x))
  xs = np.asarray(x)
  at = 0
  for o, n, k in zip(SEGS.offsets, SEGS.sizes, K):
    want = np.sort(o + np.argsort(-np.abs(xs[o:o + n]), kind="stable")[:k])
    np.testing.assert_array_equal(idx[at:at + k], want)
    at += k
