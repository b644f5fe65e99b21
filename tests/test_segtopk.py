"""The per-segment k-th largest of jaxcomp.kernels.segtopk: the sampled bracket == the 31-pass bisection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.core.layout import ROW, Segments
from jaxcomp.kernels import compaction, segtopk


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


@pytest.mark.parametrize("fooled", ["every segment", "the first segment"])
def test_a_sample_that_misses_falls_back_to_bisection(fooled):
  """Large values everywhere but at the sampled positions: the bracket misses, the answer is still exact."""
  plan = segtopk.plan(SEGS, K)
  positions = np.asarray(segtopk._sample(jnp.arange(SEGS.length, dtype=jnp.int32), plan))
  positions = positions[positions >= 0]
  rng = np.random.default_rng(0)
  if fooled == "every segment":
    x = np.full(SEGS.length, 5.0, np.float32) + rng.random(SEGS.length, np.float32)
  else:
    x = rng.standard_normal(SEGS.length).astype(np.float32)
    x[:SEGS.sizes[0]] = 5.0 + rng.random(SEGS.sizes[0], np.float32)
    positions = positions[positions < SEGS.sizes[0]]
  x[positions] = 1e-3
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


@pytest.mark.parametrize("sampled", [True, False])
def test_sbc_sides_match_numpy_on_both_paths(monkeypatch, sampled):
  """SBC's per-side k-th largest: the sampled path (XLA:CPU) and the bit-by-bit one (accelerators)."""
  from jaxcomp.kernels import binarize

  monkeypatch.setattr(segtopk, "sampled", lambda segs: sampled)
  x = np.asarray(_case("ties", np.random.default_rng(5)))
  bits = jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.int32)
  tp, tn = jax.jit(lambda b: binarize.sided_thresholds(b, SEGS, K))(bits)
  for s, (o, n, k) in enumerate(zip(SEGS.offsets, SEGS.padded_sizes, K)):
    seg = x[o:o + n]
    pos, neg = np.sort(seg[seg > 0])[::-1], np.sort(-seg[seg < 0])[::-1]
    want_p = pos[k - 1].view(np.int32) if len(pos) >= k else 0
    want_n = neg[k - 1].view(np.int32) if len(neg) >= k else 0
    assert (int(tp[s]), int(tn[s])) == (int(want_p), int(want_n))
