"""Issue 22: every method's defaults are scale-free (dgc, threshold, inceptionn, fp16).

Real gradients are 1e-4 to 1e-7 per entry. At its defaults a method's output must be
scale-equivariant: ``output(c g) == c output(g)``, bit for bit at a power-of-two ``c``
(4 workers under ``jax.pmap``, several steps, so the memories are exercised too), and to a
float tolerance at another ``c``. The old defaults broke it: DGC clipped at an absolute norm,
threshold's ``v=0.01`` and INCEPTIONN's error bound ``2**-10`` were absolute, and fp16 flushed
gradients of 1e-7 to zero.
"""

from __future__ import annotations

import functools
import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import AXIS

import jaxcomp
from jaxcomp.transforms import dense
from jaxcomp.transforms import dgc as dgc_mod
from jaxcomp.transforms import inceptionn as inc
from jaxcomp.transforms import threshold as thr_mod

W = 4  # workers
STEPS = 3
POW2 = [2.0 ** -27, 2.0 ** -14, 2.0 ** 10, 2.0 ** 13]
FACTORIES = {
    "dgc": jaxcomp.dgc,
    "threshold": jaxcomp.threshold,
    "inceptionn": jaxcomp.inceptionn,
    "fp16": jaxcomp.fp16,
}


@functools.lru_cache(maxsize=None)
def _tx(name, **kwargs):
  return FACTORIES[name](axis_name=AXIS, **kwargs)


def _run(tx, c, steps=STEPS):
  """The outputs (worker 0's, float32) of ``steps`` steps on gradients ``c * g``."""
  params = harness.params_tree()
  state = harness.init_stacked(tx, params, W)
  outs = []
  for t in range(steps):
    g = jax.tree.map(lambda a: a * np.float32(c), harness.worker_grads(params, seed=t, n=W))
    out, state = harness.run_pmap(tx, g, state)
    harness.assert_replicas_equal(out)
    outs.append([np.asarray(o[0], np.float32) for o in jax.tree.leaves(out)])
  return outs


@functools.lru_cache(maxsize=None)
def _reference(name):
  return _run(_tx(name), 1.0)


@pytest.mark.parametrize("c", POW2, ids=lambda c: f"2**{int(math.log2(c))}")
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_defaults_are_bit_exact_under_power_of_two_scaling(name, c):
  ref = _reference(name)
  got = _run(_tx(name), c)
  for t, (a_t, b_t) in enumerate(zip(got, ref)):
    for a, b in zip(a_t, b_t):
      assert np.any(b != 0)
      np.testing.assert_array_equal(a, b * np.float32(c), err_msg=f"{name}, step {t}, c={c}")


@pytest.mark.parametrize("name", ["dgc", "threshold", "fp16"])
def test_defaults_are_equivariant_at_1e_7(name):
  """A scale that is not a power of two rounds every input: the outputs agree to float tolerance
  (fp16's to its 11 bits)."""
  c = 1e-7
  ref = _reference(name)
  got = _run(_tx(name), c)
  tol = 4e-3 if name == "fp16" else 1e-6  # of the leaf's largest output (a mean of 4 can cancel)
  for a_t, b_t in zip(got, ref):
    for a, b in zip(a_t, b_t):
      want = b.astype(np.float64) * c
      np.testing.assert_allclose(a, want, rtol=0, atol=tol * np.max(np.abs(want)))
      if name != "fp16":  # the same entries sent
        np.testing.assert_array_equal(a != 0, want != 0)


def test_inceptionn_relative_bound_at_1e_7():
  """INCEPTIONN's grid step is 2**-9 of each leaf's largest value (not a power of two): at a
  scale that is not a power of two a value rounds to the other grid point only when it lies
  within float rounding of the midpoint, so the same values take the same widths and fit in
  the stream alike. Room for every value (capacity 4) or not (the default, 1 byte per value)."""
  c = 1e-7
  for kwargs in ({}, {"capacity": 4.0}):
    tx = _tx("inceptionn", **kwargs)
    ref = _reference("inceptionn") if not kwargs else _run(tx, 1.0)
    got = _run(tx, c)
    for a_t, b_t in zip(got, ref):
      for a, b in zip(a_t, b_t):
        want = b.astype(np.float64) * c
        np.testing.assert_allclose(a, want, rtol=0, atol=2.0 ** -7 * np.max(np.abs(want)))


# ----------------------------------------------------------------------------
# fp16: a power-of-two scale shared by the workers


def test_fp16_keeps_gradients_of_1e_7():
  params = {"w": jnp.zeros((40, 24)), "k": jnp.zeros((3, 3, 4, 8))}
  tx = _tx("fp16")
  g = jax.tree.map(lambda a: a * np.float32(1e-7), harness.worker_grads(params, seed=5, n=W))
  out, _ = harness.run_pmap(tx, g, harness.init_stacked(tx, params, W))
  for o, gi in zip(jax.tree.leaves(out), jax.tree.leaves(g)):
    mean = np.asarray(gi, np.float64).mean(axis=0)
    o = np.asarray(o[0], np.float64)
    assert np.mean(o != 0) >= 0.99
    assert np.max(np.abs(o - mean)) <= 2e-3 * np.max(np.abs(mean))
    rel = np.abs(o - mean) / np.abs(mean)
    assert np.median(rel) <= 1e-3
    assert np.all(np.isfinite(o))


def test_fp16_does_not_overflow_and_carries_nan():
  params = {"w": jnp.zeros((40, 24))}
  tx = _tx("fp16")
  g = harness.worker_grads(params, seed=6, n=W)
  big = jax.tree.map(lambda a: a * np.float32(1e6), g)  # each worker's values up to ~4e6 > 65504
  out, _ = harness.run_pmap(tx, big, harness.init_stacked(tx, params, W))
  mean = np.asarray(big["w"], np.float64).mean(axis=0)
  o = np.asarray(out["w"][0], np.float64)
  assert np.all(np.isfinite(o))
  assert np.max(np.abs(o - mean)) <= 2e-3 * np.max(np.abs(mean))
  # A NaN on one worker makes that entry of the mean NaN on every worker; an Inf an Inf or NaN.
  bad = np.array(g["w"])
  bad[2, 3, 5] = np.nan
  bad[1, 0, 0] = np.inf
  out, _ = harness.run_pmap(tx, {"w": jnp.asarray(bad)}, harness.init_stacked(tx, params, W))
  o = np.asarray(out["w"])
  assert np.all(np.isnan(o[:, 3, 5])) and np.all(np.isinf(o[:, 0, 0]))
  assert np.all(np.isfinite(np.delete(o.reshape(W, -1), [0, 3 * 24 + 5], axis=1)))


@pytest.mark.usefixtures("every_leaf")  # its trees are small on purpose: compress every leaf
def test_fp16_wire_bytes_count_the_exponents():
  params = {"w": jnp.zeros((40, 24)), "b": jnp.zeros((24,)), "k": jnp.zeros((3, 3, 4, 8))}
  tx = _tx("fp16")
  (bucket,) = tx.method.buckets(params)
  assert isinstance(bucket.exchange, dense.ScaledCastExchange)
  nominal = jaxcomp.wire_bytes(tx, params)
  assert nominal == 2 * bucket.length + 4 * 3  # float16 payload + one int32 exponent per leaf
  assert harness.pmap_wire_bytes(tx, params, n=W)["total"] == nominal
  # bf16 needs no scale: float32's exponent range
  assert jaxcomp.wire_bytes(jaxcomp.bf16(axis_name=AXIS), params) == 2 * bucket.length


# ----------------------------------------------------------------------------
# threshold: relative to each leaf's RMS by default


def test_threshold_default_fraction_on_a_gaussian_leaf():
  """The default v_rms=2 sends |x| >= 2 rms: 4.55% of a standard normal leaf."""
  g = {"w": jax.random.normal(jax.random.PRNGKey(0), (1 << 16,))}
  tx = jaxcomp.threshold()
  out, _ = harness.local_round_trip(tx, g, tx.init(g))
  frac = float(np.mean(np.asarray(out["w"]) != 0))
  assert 0.042 <= frac <= 0.049, frac
  scaled = jax.tree.map(lambda a: a * np.float32(3e-6), g)  # the same fraction at any scale
  out, _ = harness.local_round_trip(tx, scaled, tx.init(g))
  assert abs(float(np.mean(np.asarray(out["w"]) != 0)) - frac) < 1e-3


def test_threshold_relative_sends_small_and_constant_leaves():
  """A leaf's largest entry always passes: a scalar (its own RMS) and a constant leaf are sent."""
  g = {"s": jnp.float32(3e-5), "c": jnp.full((256,), -2e-6, jnp.float32)}
  tx = jaxcomp.threshold(capacity=1.0)
  out, _ = harness.local_round_trip(tx, g, tx.init(g))
  np.testing.assert_array_equal(np.asarray(out["s"]), np.asarray(g["s"]))
  np.testing.assert_array_equal(np.asarray(out["c"]), np.asarray(g["c"]))


def test_threshold_absolute_form_is_one_argument_away():
  (b,) = jaxcomp.threshold(v=0.01).method.buckets({"w": jnp.zeros((300,))})
  assert b.exchange.codec == thr_mod.ThresholdCodec(0.01, 0.1, False)
  (b,) = jaxcomp.threshold().method.buckets({"w": jnp.zeros((300,))})
  assert b.exchange.codec == thr_mod.ThresholdCodec(thr_mod.V_RMS, 0.1, True)
  (b,) = jaxcomp.threshold(v_rms=2.5).method.buckets({"w": jnp.zeros((300,))})
  assert b.exchange.codec == thr_mod.ThresholdCodec(2.5, 0.1, True)
  params = {"w": jnp.zeros((1000,))}
  assert jaxcomp.wire_bytes(jaxcomp.threshold(), params) == \
      jaxcomp.wire_bytes(jaxcomp.threshold(v=0.01), params)


# ----------------------------------------------------------------------------
# INCEPTIONN: the bound relative to each leaf's largest value


@pytest.mark.usefixtures("every_leaf")  # its trees are small on purpose: compress every leaf
def test_inceptionn_relative_bound_keeps_small_gradients():
  """Gradients of 1e-4: the old absolute bound rounded every value to 0; the relative bound's
  error is at most 2**-10 of each leaf's largest value, with room for every value."""
  x = (1e-4 * np.random.default_rng(3).standard_normal(1000)).astype(np.float32)
  tx = jaxcomp.inceptionn(capacity=4.0, error_feedback=False)
  g = {"w": jnp.asarray(x), "v": jnp.asarray(1e3 * x[:300])}
  out, _ = harness.local_round_trip(tx, g, tx.init(g))
  for k in g:
    a, o = np.asarray(g[k], np.float64), np.asarray(out[k], np.float64)
    top = np.max(np.abs(a))
    assert np.max(np.abs(o - a)) <= inc.RELATIVE_BOUND * top * (1 + 1e-6)
    assert np.mean(o != 0) > 0.99
  old = jaxcomp.inceptionn(error_bound=2.0 ** -10, capacity=4.0, error_feedback=False)
  out, _ = harness.local_round_trip(old, g, old.init(g))
  np.testing.assert_array_equal(np.asarray(out["w"]), 0.0)  # the absolute form, as before


def test_inceptionn_relative_bound_wire_bytes():
  """The float32 step lives in each leaf's stream: the bytes are those of the absolute form,
  except for streams too short for it and the largest value (at least 6 bytes)."""
  params = {"w": jnp.zeros((64, 64))}
  assert jaxcomp.wire_bytes(jaxcomp.inceptionn(), params) == \
      jaxcomp.wire_bytes(jaxcomp.inceptionn(error_bound=2.0 ** -10), params) == 4096 // 4 + 4096
  (b,) = jaxcomp.inceptionn().method.buckets(params)
  assert b.exchange.codec == inc.InceptionnCodec(inc.lsb_exponent(inc.RELATIVE_BOUND), 1.0, True)
  assert b.exchange.codec.stream_bytes(1) == 6
  assert inc.InceptionnCodec(inc.lsb_exponent(2.0 ** -4), 1.0, True).stream_bytes(1) == 5
  assert b.exchange.codec.stream_bytes(1000) == 1000
  tx = _tx("inceptionn")
  small = {"kernel": jnp.zeros((40, 24)), "bias": jnp.zeros((24,)), "s": jnp.zeros(())}
  assert harness.pmap_wire_bytes(tx, small, n=W)["total"] == jaxcomp.wire_bytes(tx, small)


# ----------------------------------------------------------------------------
# DGC: no absolute clipping by default


def test_dgc_clips_only_when_asked():
  assert jaxcomp.dgc().method.memory.clip_norm is None is dgc_mod.CLIP_NORM
  assert jaxcomp.dgc(clip_norm=5.0).method.memory.clip_norm == 5.0


# ----------------------------------------------------------------------------
# Arguments


@pytest.mark.parametrize("call, exc, match", [
    (lambda: jaxcomp.threshold(v=0.01, v_rms=2.0), ValueError, "give v .* or v_rms .*, not both"),
    (lambda: jaxcomp.threshold(v_rms=-1.0), ValueError, "v_rms must be"),
    (lambda: jaxcomp.threshold(v_rms="2"), TypeError, "v_rms must be"),
    (lambda: jaxcomp.inceptionn(error_bound=2.0 ** -10, relative_bound=2.0 ** -10), ValueError,
     "give error_bound .* or relative_bound .*, not both"),
    (lambda: jaxcomp.inceptionn(relative_bound=0.75), ValueError,
     r"relative_bound must be in \[2\*\*-23, 0.5\]"),
    (lambda: jaxcomp.inceptionn(relative_bound=0.0), ValueError, "relative_bound must be"),
    (lambda: jaxcomp.inceptionn(error_bound=0.0), ValueError, "error_bound must be"),
])
def test_bad_arguments(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
