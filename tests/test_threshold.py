"""jaxcomp.transforms.threshold: threshold and adaq (GRACE's threshold sparsifiers), refine_threshold.

Each method is checked against a numpy version of its algorithm over a few
steps on 8 workers; the fixed-capacity payloads against their overflow and
empty cases.
"""

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import check_against, memory_trees, run_steps, small_params

import jaxcomp
from jaxcomp.core.layout import Segments
from jaxcomp.kernels import thresholds
from jaxcomp.transforms import threshold as thr_mod

N, AXIS = harness.N, harness.AXIS


@functools.cache
def pmapped(name):
  """The transforms of the numpy comparisons, shared with the pmap == shard_map test (one compile)."""
  return {
      "threshold": lambda: jaxcomp.threshold(v=0.5, capacity=1.0, axis_name=AXIS),
      "adaq": lambda: jaxcomp.adaq(ratio=0.3, encoding="map", axis_name=AXIS),
      "adaq_indices": lambda: jaxcomp.adaq(ratio=0.3, encoding="indices", axis_name=AXIS),
  }[name]()


# ----------------------------------------------------------------------------
# numpy references


def np_threshold(v):
  def ref(g, e):
    x = g + (0 if e is None else e)
    sent = np.where(np.abs(x) > v, x, 0.0)
    return sent.mean(0), x - sent
  return ref


def np_adaq(ratio):
  def side(a):
    k = int(np.ceil(ratio * np.sum(a > 0) - 1e-3))
    if k == 0:
      return np.zeros(a.shape, bool)
    return (a >= np.sort(a)[::-1][k - 1]) & (a > 0)

  def ref(g, e):
    x = g + (0 if e is None else e)
    dec = np.zeros_like(x)
    for w in range(N):
      flat = x[w].ravel()
      plus, minus = side(np.where(flat > 0, flat, 0)), side(np.where(flat < 0, -flat, 0))
      d = np.zeros_like(flat)
      d[plus] = flat[plus].mean() if plus.any() else 0
      d[minus] = flat[minus].mean() if minus.any() else 0
      dec[w] = d.reshape(x.shape[1:])
    return dec.mean(0), x - dec
  return ref


# ----------------------------------------------------------------------------
# against numpy, 8 workers, 3 steps


def test_threshold_matches_numpy():
  check_against(run_steps(pmapped("threshold"), small_params()),
                np_threshold(0.5))


@pytest.mark.parametrize("name", ["adaq", "adaq_indices"])
def test_adaq_matches_numpy(name):
  check_against(run_steps(pmapped(name), small_params()), np_adaq(0.3))


# ----------------------------------------------------------------------------
# fixed capacity: overflow, empty selection, counts


def _local_steps(tx, steps=2):
  """Local round trips on ``harness.params_tree()`` (one bucket); memories read as trees."""
  params = harness.params_tree()
  state = tx.init(params)
  for t in range(steps):
    g = jax.tree.map(lambda a: a[0], harness.worker_grads(params, seed=t))
    before = jaxcomp.memory_tree(tx, state, params)
    out, state = harness.local_round_trip(tx, g, state)
    yield g, before, out, state._replace(memory=jaxcomp.memory_tree(tx, state, params))


def _residual_steps(tx, steps=2):
  for g, e, out, state in _local_steps(tx, steps):
    yield jax.tree.map(lambda g, e: np.asarray(g) + np.asarray(e), g, e), out, state


def test_threshold_overflow_stays_in_residual():
  tx = jaxcomp.threshold(v=0.1, capacity=0.05)
  for x, out, state in _residual_steps(tx):
    for path, xi in jax.tree_util.tree_leaves_with_path(x):
      o = np.asarray(dict(jax.tree_util.tree_leaves_with_path(out))[path])
      e = np.asarray(dict(jax.tree_util.tree_leaves_with_path(state.memory))[path])
      np.testing.assert_array_equal(o + e, xi)  # nothing lost, exactly
      cap = max(1, int(np.ceil(0.05 * xi.size)))
      assert np.count_nonzero(o) == min(cap, np.count_nonzero(np.abs(xi) > 0.1))
      np.testing.assert_array_equal(o[o != 0], xi[o != 0])


def test_threshold_empty_selection():
  params = small_params()
  tx = jaxcomp.threshold(v=1e6, axis_name=AXIS)
  g = harness.worker_grads(params)
  out, state = harness.run_pmap(tx, g, harness.init_stacked(tx, params))
  for o in jax.tree.leaves(out):
    np.testing.assert_array_equal(o, 0.0)
  harness.assert_trees_close(memory_trees(tx, state, params).memory, g, rtol=0, atol=0)


def test_threshold_payload_count_within_capacity():
  codec = thr_mod.ThresholdCodec(0.0, 0.25)
  # Two leaves in one bucket (1000 and 300 entries, each padded to rows of 128): 250 + 75 slots.
  segs = Segments((0, 1024), (1000, 300), ((1000,), (300,)), codec.block)
  x = np.zeros(segs.length, np.float32)
  x[:1000] = np.random.default_rng(0).normal(size=1000)
  x[1024:1324] = np.random.default_rng(1).normal(size=300)
  values, idx, count = codec.encode(jnp.asarray(x), jax.random.PRNGKey(3), segs)
  assert values.shape == (325,) and idx.dtype == jnp.uint16 and int(count) == 325
  idx = np.asarray(idx)
  assert len(np.unique(idx)) == 325
  assert np.sum(idx < 1000) == 250 and np.sum((idx >= 1024) & (idx < 1324)) == 75  # per leaf, no padding
  np.testing.assert_array_equal(np.asarray(values), x[idx])


def np_refine(a, t, k, low=0.7, high=1.3, up=1.3, down=0.7, iterations=10):
  count = lambda t: np.sum((a >= t) & (a > 0))
  m = count(t)
  best = t
  for _ in range(iterations):
    if low * k <= m <= high * k:
      return t
    t = np.float32(t * (up if m > high * k else down))
    m = count(t)
    best = t if abs(m - k) < abs(count(best) - k) else best
  return t if low * k <= m <= high * k else best


def test_refine_threshold_matches_numpy():
  # |a| uniform on [0, 1): k = 200 of 4000 pass above 0.95. x1.3 from 0.73 and x0.7 from
  # 1.36 land in 0.7-1.3 k; 0.95 is already there; 0.5 cycles (x1.3 x0.7 = 0.91) for
  # 10 steps and the closest count seen wins.
  a = np.abs(np.random.default_rng(1).uniform(-1, 1, 4000)).astype(np.float32)
  refine = jax.jit(lambda t: thresholds.refine_threshold(jnp.asarray(a), t, 200, 0.7, 1.3, 1.3, 0.7, 10))
  for start in (0.73, 1.36, 0.95, 0.5, 1e-3):
    got, want = float(refine(jnp.float32(start))), np_refine(a, np.float32(start), 200)
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=str(start))
  assert not 140 <= np.sum(a >= np_refine(a, np.float32(0.5), 200)) <= 260


def test_adaq_encoding_choice():
  codec = thr_mod.AdaQCodec(0.3, 0.01, 0.39, "auto")
  assert codec.uses_map(1000) and codec.uses_map(10**6)
  sparse = thr_mod.AdaQCodec(0.01, 0.01, 0.013, "auto")
  assert not sparse.uses_map(10**6)  # 0.013 * 32 bits < 2 bits per entry
  # A bucket decides for all its leaves: 2 bits per bucket entry against its slots' positions.
  segs = Segments((0, 1024), (1000, 1000), ((1000,), (1000,)), codec.block)
  assert codec.uses_map(segs) and not sparse.uses_map(segs)  # 512 bytes vs 26 uint16 positions


def test_adaq_indices_overflow_conserves():
  tx = jaxcomp.adaq(ratio=0.3, encoding="indices", capacity=0.1)
  for x, out, state in _residual_steps(tx):
    for xi, o, e in zip(*map(jax.tree.leaves, (x, out, state.memory))):
      np.testing.assert_allclose(np.asarray(o) + np.asarray(e), xi, rtol=1e-6, atol=1e-6)
      assert np.count_nonzero(o) <= max(1, int(np.ceil(0.1 * xi.size)))


# ----------------------------------------------------------------------------
# pmap == shard_map, wire bytes == nominal


METHODS = ["threshold", "adaq", "adaq_indices"]


@pytest.mark.parametrize("name", METHODS)
def test_pmap_equals_shard_map_and_wire_bytes(name):
  params = small_params()  # test_properties covers harness.params_tree()
  tx = pmapped(name)  # the defaults are covered by test_properties
  harness.check_pmap_equals_shard_map(tx, params)


# ----------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize("call, exc, match", [
    (lambda: jaxcomp.threshold(v=-1.0), ValueError, "v must be"),
    (lambda: jaxcomp.threshold(v="x"), TypeError, "v must be"),
    (lambda: jaxcomp.threshold(capacity=0.0), ValueError, "capacity must be in"),
    (lambda: jaxcomp.threshold(capacity=1.5), ValueError, "capacity must be in"),
    (lambda: jaxcomp.adaq(ratio=0.0), ValueError, "ratio must be in"),
    (lambda: jaxcomp.adaq(capacity=2.0), ValueError, "capacity must be in"),
    (lambda: jaxcomp.adaq(encoding="bits"), ValueError, "encoding must be one of"),
])
def test_bad_arguments(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
