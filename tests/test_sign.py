"""jaxcomp.transforms.sign: signsgd, signum and onebit (GRACE's sign methods).

Each deterministic method is checked against a numpy version of its algorithm
over a few steps on 8 workers; majority-vote ties; signsgd's error feedback.
"""

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import check_against, run_steps, small_params, step_grads

import jaxcomp
from jaxcomp.collectives import packing
from jaxcomp.core.builder import build
from jaxcomp.core.layout import Segments
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import CodecExchange, Memory, flat_route
from jaxcomp.transforms import sign

pytestmark = pytest.mark.usefixtures("every_leaf_module")  # small trees on purpose: compress every leaf

N, AXIS = harness.N, harness.AXIS


@functools.cache
def pmapped(name):
  """The transforms of the numpy comparisons, shared with the pmap == shard_map test (one compile)."""
  return {
      "onebit": lambda: jaxcomp.onebit(axis_name=AXIS),
      "signum": lambda: jaxcomp.signum(momentum=0.9, axis_name=AXIS),
  }[name]()


# ----------------------------------------------------------------------------
# numpy references


def np_onebit(g, e):
  x = g + (0 if e is None else e)
  flat = x.reshape(N, -1)
  neg = flat < 0
  mean_neg = np.where(neg, flat, 0).sum(1) / np.maximum(neg.sum(1), 1)
  mean_pos = np.where(neg, 0, flat).sum(1) / np.maximum((~neg).sum(1), 1)
  dec = np.where(neg, mean_neg[:, None], mean_pos[:, None]).reshape(x.shape)
  return dec.mean(0), x - dec


def np_signum(beta):
  def ref(g, m):
    m = (1 - beta) * g + (0 if m is None else beta * m)
    return np.sign(np.where(m >= 0, 1, -1).sum(0)).astype(np.float32), m
  return ref


# ----------------------------------------------------------------------------
# against numpy, 8 workers, 3 steps


def test_onebit_matches_numpy():
  check_against(run_steps(pmapped("onebit"), small_params()), np_onebit)


def test_signum_matches_numpy():
  check_against(run_steps(pmapped("signum"), small_params()), np_signum(0.9))


def _tied_grads(params):
  """Half the workers +1, half -1 on even entries (a tied vote); all +1 or all -1 elsewhere."""
  def one(p):
    n = max(p.size, 1)
    sign = np.where(np.arange(N) < N // 2, 1.0, -1.0)[:, None]
    tied = np.arange(n)[None, :] % 2 == 0
    clear = np.where(np.arange(n) % 4 == 1, 1.0, -1.0)[None, :]
    g = np.where(tied, sign, clear) * (1.0 + np.arange(n)[None, :] % 3)
    return g.reshape((N,) + p.shape).astype(np.float32)
  return jax.tree.map(one, params)


@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_majority_vote_ties(name):
  """A tie gives 0 by default and +1 with ties="positive" (GRACE's sum >= 0 -> +1)."""
  params = small_params()
  g = _tied_grads(params)
  kwargs = {"momentum": 0.0} if name == "signum" else {}
  for ties in ("zero", "positive"):
    tx = jaxcomp.METHODS[name](axis_name=AXIS, ties=ties, **kwargs)
    out, _ = harness.run_pmap(tx, g, harness.init_stacked(tx, params))
    harness.assert_replicas_equal(out)
    for k in g:
      votes = np.where(g[k] >= 0, 1, -1).sum(0)
      want = np.sign(votes) if ties == "zero" else np.where(votes >= 0, 1.0, -1.0)
      assert (votes == 0).any() and (votes != 0).any()
      np.testing.assert_array_equal(out[k][0], want, err_msg=f"{k} {ties}")


def test_signsgd_error_feedback_stays_in_gradient_units():
  """The residual is x - mean|x| sign(x): a constant gradient 0.01 comes out as 0.01 every step."""
  params = small_params()
  tx = jaxcomp.signsgd(error_feedback=True)
  g = jax.tree.map(lambda p: jnp.full(p.shape, 0.01, jnp.float32), params)
  state = tx.init(params)
  for _ in range(4):
    out, state = harness.local_round_trip(tx, g, state)
    for k in g:
      np.testing.assert_allclose(out[k], 0.01, rtol=1e-6)
  # Conservation on random gradients: sent + new residual == old residual + gradient.
  state = tx.init(params)
  for t in range(3):
    grads = jax.tree.map(lambda a: a[0], step_grads(params, t))
    before = jaxcomp.memory_tree(tx, state, params)
    out, state = harness.local_round_trip(tx, grads, state)
    after = jaxcomp.memory_tree(tx, state, params)
    for k in grads:
      x = np.asarray(before[k]) + grads[k]
      np.testing.assert_allclose(np.asarray(out[k]) + np.asarray(after[k]), x, rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(np.asarray(out[k]), np.mean(np.abs(x)) * np.where(x >= 0, 1.0, -1.0),
                                 rtol=1e-6, atol=1e-7)
  # Over 8 workers: the vote times the workers' mean scale of each leaf, and one float32 scale per leaf.
  tx = jaxcomp.signsgd(error_feedback=True, axis_name=AXIS)
  grads = step_grads(params, 0)
  out, _ = harness.run_pmap(tx, grads, harness.init_stacked(tx, params))
  for k in grads:
    flat = grads[k].reshape(N, -1)
    scale = np.abs(flat).mean(1).mean()
    want = np.sign(np.where(flat >= 0, 1, -1).sum(0)) * scale
    np.testing.assert_allclose(out[k][0].reshape(-1), want, rtol=1e-5, atol=1e-7)
  # Each leaf padded to 128 entries (1 bit each), two float32 scales (a NaN/Inf makes its scale
  # non-finite, so no non-finite flag travels).
  assert jaxcomp.wire_bytes(tx, params) == 2 * 128 // 8 + 2 * 4


# ----------------------------------------------------------------------------
# pmap == shard_map, wire bytes == nominal


METHODS = ["signum", "onebit"]


@pytest.mark.parametrize("name", METHODS)
def test_pmap_equals_shard_map_and_wire_bytes(name):
  params = small_params()  # test_properties covers harness.params_tree()
  tx = pmapped(name)  # the defaults are covered by test_properties
  harness.check_pmap_equals_shard_map(tx, params)


# ----------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize("call, exc, match", [
    (lambda: jaxcomp.signum(momentum=1.5), ValueError, "momentum must be in"),
    (lambda: jaxcomp.signum(momentum=True), TypeError, "momentum must be"),
    (lambda: jaxcomp.signum(ties="up"), ValueError, r"ties must be one of \('zero', 'positive'\)"),
    (lambda: jaxcomp.signsgd(ties=0), ValueError, "ties must be one of"),
    (lambda: jaxcomp.onebit(error_feedback="yes"), TypeError, "error_feedback must be"),
])
def test_bad_arguments(call, exc, match):
  with pytest.raises(exc, match=match):
    call()


@pytest.mark.parametrize("name,make", [
    ("efsignsgd", lambda: jaxcomp.efsignsgd(1.0, axis_name=AXIS)),  # lr 1: the memory does not scale it
    ("signsgd", lambda: jaxcomp.signsgd(error_feedback=True, axis_name=AXIS)),
    ("onebit", lambda: jaxcomp.onebit(axis_name=AXIS))])
def test_the_step_flag_read_from_the_scales_catches_nan_inf_and_overflow(name, make):
  """The sign codecs' step flag comes from their scales or means (``Codec.witness``), not the mean: a NaN or
  Inf on one worker, or finite gradients whose mean over the workers overflows float32 (a 2-entry
  leaf at 1e38: each worker's scale is finite, their sum is not), still give NaN in every entry on
  every worker; a finite step at 1e-7 gives a finite one."""
  tx = make()
  params = {"w": jnp.zeros((10, 10), jnp.float32), "t": jnp.zeros((2,), jnp.float32)}
  state = harness.host(harness.init_stacked(tx, params))
  grads = jax.tree.map(lambda g: 1e-7 * g, harness.worker_grads(params, seed=2))
  out, state = harness.run_pmap(tx, grads, state)
  assert all(np.isfinite(np.asarray(o)).all() for o in jax.tree.leaves(out))
  for leaf, bad in (("w", np.nan), ("w", np.inf), ("t", 1e38)):
    index = (slice(None),) if bad == 1e38 else (3, 1)  # the overflow on every worker
    out, _ = harness.run_pmap(tx, dict(grads, **{leaf: harness.set_at(grads[leaf], index, bad)}), state)
    for o in jax.tree.leaves(out):
      assert np.isnan(np.asarray(o)).all(), (name, leaf, bad, o)


# ----------------------------------------------------------------------------
# signSGD's signs packed leaf by leaf


def test_signs_packed_segment_by_segment_are_the_bucket_packing():
  """``pack_by_segment`` gives ``pack_checked``'s words and flag for segments back to back on whole rows
  (signed zeros, NaN and Inf included) and declines segments that are not."""
  segs = Segments((0, 256, 384), (200, 128, 1000), ((200,), (128,), (1000,)), 128)
  x = np.random.default_rng(0).standard_normal(segs.length).astype(np.float32)
  x[[3, 260]], x[200:256] = (0.0, -0.0), 0.0  # a zero, a negative zero, the first segment's padding
  for planted in (None, np.nan, -np.inf):
    y = harness.set_at(x, 700, planted) if planted is not None else x
    got_flag, got = sign.pack_by_segment(jnp.asarray(y), segs)
    want_flag, want = packing.pack_checked(jnp.asarray(y) >= 0, 1, jnp.asarray(y))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_flag), np.asarray(want_flag))
  assert sign.pack_by_segment(jnp.zeros(16), Segments((0, 8), (8, 8), ((8,), (8,)), 8)) is None
  assert sign.pack_by_segment(jnp.zeros(256), Segments((128,), (128,), ((128,),), 128)) is None


def _signsgd(by_segment: bool, axis_name):
  codec = sign.SignCodec(by_segment=by_segment)
  return build(Method("signsgd", flat_route(CodecExchange(codec)), Memory(enabled=False)), axis_name)


def test_signsgd_packs_each_leaf_where_it_lies():
  """signSGD without memory packs each leaf's signs from the leaf itself: its outputs are those of the
  bucket's packing (8 workers, two steps, a NaN on one worker in the second), and its compiled update
  writes no bucket out (the bucket's packing writes the concatenated leaves first)."""
  params = {f"w{i}": jnp.zeros((32, 20 + i)) for i in range(12)}  # twelve leaves, one bucket
  assert all(b.exchange.codec.by_segment for b in jaxcomp.signsgd(axis_name=AXIS).method.buckets(params))
  leaves, whole = _signsgd(True, AXIS), _signsgd(False, AXIS)
  s_leaves, s_whole = harness.init_stacked(leaves, params), harness.init_stacked(whole, params)
  for t in range(2):
    g = harness.worker_grads(params, seed=t)
    if t:
      g["w3"] = harness.set_at(g["w3"], (5, 1, 2), np.nan)
    out_l, s_leaves = harness.run_pmap(leaves, g, s_leaves)
    out_w, s_whole = harness.run_pmap(whole, g, s_whole)
    harness.assert_trees_close(out_l, out_w, rtol=0, atol=0)
    harness.assert_trees_close(s_leaves, s_whole, rtol=0, atol=0)
  assert np.isnan(out_l["w3"]).all()
  grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
  temp = {}
  for name, tx in (("leaves", _signsgd(True, None)), ("whole", _signsgd(False, None))):
    lowered = jax.jit(tx.update).lower(grads, tx.init(params))
    temp[name] = harness.compile_as_users(lowered).memory_analysis().temp_size_in_bytes
  bucket = 4 * sum(p.size for p in jax.tree.leaves(params))
  assert temp["leaves"] < bucket / 2 < bucket <= temp["whole"], (temp, bucket)
