"""Non-finite steps in the compositions users write: jaxcomp.apply_if_finite, optax's wrapper, MultiSteps.

A NaN on one of 8 workers must skip the step on every worker (or raise a clear
error at trace time), never leave the other workers waiting in a collective.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import AXIS, N, assert_replicas_equal, params_tree, worker_grads

import jaxcomp


def _nan_on_worker(grads, worker=3):
  return jax.tree.map(lambda g: harness.set_at(g, worker, jnp.nan), grads)


def _run(tx, grads_steps):
  params = params_tree()
  state = jaxcomp.per_worker(tx.init(params), N)
  params8 = jaxcomp.per_worker(params, N)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, u

  step = jax.pmap(step, axis_name=AXIS)
  outs = []
  for g in grads_steps:
    params8, state, u = step(params8, state, g)
    outs.append((params8, state, u))
  return outs


def test_jaxcomp_apply_if_finite_skips_on_every_worker():
  inner = optax.chain(jaxcomp.topk(ratio=0.1, axis_name=AXIS), optax.sgd(0.1, momentum=0.9))
  tx = jaxcomp.apply_if_finite(inner, max_consecutive_errors=2, axis_name=AXIS)
  g0 = worker_grads(params_tree(), seed=0)
  g1 = _nan_on_worker(worker_grads(params_tree(), seed=1))
  g2 = worker_grads(params_tree(), seed=2)
  (p0, s0, _), (p1, s1, u1), (p2, s2, u2) = _run(tx, [g0, g1, g2])
  for leaf in jax.tree.leaves(u1):  # skipped everywhere: zero updates, no NaN reaches the parameters
    np.testing.assert_array_equal(np.asarray(leaf), 0.0)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p1, p0)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               s1.inner_state, s0.inner_state)  # residuals and momentum untouched on every worker
  np.testing.assert_array_equal(np.asarray(s1.notfinite_count), 1)
  np.testing.assert_array_equal(np.asarray(s1.last_finite), False)
  for leaf in jax.tree.leaves(p2):  # the next finite step trains on every worker alike
    assert np.all(np.isfinite(np.asarray(leaf)))
  assert_replicas_equal(p2)
  assert_replicas_equal(u2)
  np.testing.assert_array_equal(np.asarray(s2.notfinite_count), 0)


def test_jaxcomp_apply_if_finite_gives_up_after_max_consecutive_errors():
  tx = jaxcomp.apply_if_finite(optax.chain(jaxcomp.topk(ratio=0.1, axis_name=AXIS), optax.sgd(0.1)),
                               max_consecutive_errors=1, axis_name=AXIS)
  bad = _nan_on_worker(worker_grads(params_tree(), seed=1))
  (_, _, u1), (_, _, u2) = _run(tx, [bad, bad])
  assert all(np.all(np.asarray(leaf) == 0.0) for leaf in jax.tree.leaves(u1))
  assert any(np.any(np.isnan(np.asarray(leaf))) for leaf in jax.tree.leaves(u2))  # accepted: NaN everywhere
  assert_replicas_equal(u2)


def test_optax_apply_if_finite_around_a_communicating_chain_is_a_clear_error():
  tx = optax.apply_if_finite(optax.chain(jaxcomp.topk(ratio=0.1, axis_name=AXIS), optax.sgd(0.1)), 3)
  with pytest.raises(ValueError, match=r"jaxcomp.apply_if_finite\(inner, max_consecutive_errors"):
    _run(tx, [worker_grads(params_tree(), seed=0)])


def test_optax_apply_if_finite_after_the_compressor_skips_on_every_worker():
  tx = optax.chain(jaxcomp.topk(ratio=0.1, axis_name=AXIS), optax.apply_if_finite(optax.sgd(0.1), 3))
  g0 = worker_grads(params_tree(), seed=0)
  (p0, _, _), (p1, s1, u1) = _run(tx, [g0, _nan_on_worker(worker_grads(params_tree(), seed=1))])
  for leaf in jax.tree.leaves(u1):
    np.testing.assert_array_equal(np.asarray(leaf), 0.0)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p1, p0)
  np.testing.assert_array_equal(np.asarray(s1[1].notfinite_count), 1)


def test_multisteps_around_a_compressor_is_not_refused():
  # MultiSteps' cond is on the step count (the same on every worker): collectives inside it are fine.
  tx = optax.MultiSteps(optax.chain(jaxcomp.topk(ratio=0.1, axis_name=AXIS), optax.sgd(0.1)), 2)
  outs = _run(tx, [worker_grads(params_tree(), seed=s) for s in range(3)])
  for p, _, u in outs:
    assert_replicas_equal(p)
    assert_replicas_equal(u)


def test_jaxcomp_apply_if_finite_under_shard_map_skips_on_every_worker():
  from harness import mesh
  from jax.sharding import PartitionSpec as P

  tx = jaxcomp.apply_if_finite(optax.chain(jaxcomp.topk(ratio=0.1, axis_name=AXIS), optax.sgd(0.1)), 3,
                               axis_name=AXIS)
  params = params_tree()
  state = jaxcomp.per_worker(tx.init(params), mesh(), AXIS)

  def step(g, s):
    u, s = tx.update(jaxcomp.local(g), jaxcomp.local(s), params)
    return jaxcomp.stacked(u), jaxcomp.stacked(s)

  step = jax.jit(jax.shard_map(step, mesh=mesh(), in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS)),
                               check_vma=False))
  u, s = step(_nan_on_worker(worker_grads(params, seed=1)), state)
  for leaf in jax.tree.leaves(u):
    np.testing.assert_array_equal(np.asarray(leaf), 0.0)
  np.testing.assert_array_equal(np.asarray(s.notfinite_count), 1)
  u, s = step(worker_grads(params, seed=2), s)
  assert_replicas_equal(u)
  assert any(np.any(np.asarray(leaf) != 0) for leaf in jax.tree.leaves(u))


def test_optax_step_count_conditions_are_not_refused():
  # conditionally_mask decides on the step count (the same everywhere): its branch is also named do_update.
  tx = optax.transforms.conditionally_mask(
      optax.chain(jaxcomp.topk(ratio=0.1, axis_name=AXIS), optax.sgd(0.1)), lambda count: count >= 1)
  outs = _run(tx, [worker_grads(params_tree(), seed=s) for s in range(2)])
  for p, _, u in outs:
    assert_replicas_equal(p)
    assert_replicas_equal(u)


def test_apply_if_finite_over_fewer_axes_than_the_transform_is_a_clear_error():
  from jax.sharding import AxisType
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((2, 4), ("dcn", "ici"), axis_types=(AxisType.Auto,) * 2)
  inner = optax.chain(jaxcomp.topk(0.1, axis_name="dcn", dense_axis_name="ici"), optax.sgd(0.1))
  params = {"w": jnp.zeros((64, 32))}

  def run(axes):
    tx = jaxcomp.apply_if_finite(inner, 3, axis_name=axes)

    def step(g):
      state = tx.init(params)  # per worker, inside the mesh (dense_axis_name)
      u, _ = tx.update({"w": g[0]}, state, params)
      return u["w"][None]

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(("dcn", "ici")), out_specs=P(("dcn", "ici")),
                                 check_vma=False))(jnp.ones((8, 64, 32)))

  with pytest.raises(ValueError, match=r"axis_name=\('dcn', 'ici'\)"):
    run("dcn")
  out = run(("dcn", "ici"))
  assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("name", ["fp4", "u8bit", "inceptionn", "sketchml", "onebit", "adaq", "terngrad",
                                  "topk", "sbc", "acpsgd", "powersgd", "natural", "qsgd", "signsgd", "signum",
                                  "efsignsgd"])
def test_rewritten_codecs_at_1e_6_inside_apply_if_finite_and_multisteps(name):
  # The codecs whose kernels the speed issue rewrote, as users hold them: gradients of 1e-6 per
  # entry, a NaN on one worker skipped on every worker, then a finite step that moves the parameters.
  # natural, qsgd, signsgd, signum, efsignsgd, u8bit, sketchml, terngrad: their payload carries the
  # NaN (a norm, a scale, a flag; natural only as one +-Inf entry), no check of the builder's own.
  scaled = lambda g: jax.tree.map(lambda x: x * 1e-6, g)
  inner = optax.chain(jaxcomp.METHODS[name](axis_name=AXIS), optax.sgd(0.1))
  tx = jaxcomp.apply_if_finite(inner, max_consecutive_errors=2, axis_name=AXIS)
  g0, g2 = scaled(worker_grads(params_tree(), seed=0)), scaled(worker_grads(params_tree(), seed=2))
  g1 = _nan_on_worker(scaled(worker_grads(params_tree(), seed=1)))
  (p0, s0, _), (p1, s1, u1), (p2, _, u2) = _run(tx, [g0, g1, g2])
  assert all(np.all(np.asarray(leaf) == 0.0) for leaf in jax.tree.leaves(u1))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p1, p0)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               s1.inner_state, s0.inner_state)
  assert_replicas_equal(p2)
  assert_replicas_equal(u2)
  moved = sum(float(np.abs(np.asarray(leaf)).sum()) for leaf in jax.tree.leaves(u2))
  assert np.isfinite(moved) and moved > 0, name  # something of the 1e-6 gradients was sent
  outs = _run(optax.MultiSteps(inner, 2), [g0, g2, g0])
  for p, _, u in outs:
    assert_replicas_equal(p)
    assert_replicas_equal(u)
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(u))


@pytest.mark.parametrize("position", [0, 63, 64, 127, 128, 255, 300, 383])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_step_flag_read_by_rows_finds_every_non_finite_entry(position, bad):
  """The builder's step flag (a bucket AND-reduced as rows of two half rows, which XLA fuses with
  the kernel that reads the bucket) is NaN for a NaN or Inf anywhere, in either half of any row,
  compiled as the update compiles it; 0 when every entry is finite."""
  from jaxcomp.core import builder

  flag = jax.jit(builder._nan_if_nonfinite)
  v = np.linspace(-1e-6, 1e-6, 3 * 128, dtype=np.float32)
  other = np.ones((5,), np.float32)  # a length that is not whole rows: reduced as it is
  assert float(flag([v, other])) == 0.0
  v[position] = bad
  assert np.isnan(float(flag([v, other])))
  assert np.isnan(float(flag([other, v])))
  other[4] = bad
  assert np.isnan(float(flag([np.zeros_like(v), other])))
