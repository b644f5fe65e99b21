"""Clear errors for the usual mistakes, and the API taking what users pass (issue 22).

Trace-time checks are exercised with ``.lower()`` / ``jax.eval_shape``: nothing is compiled.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import AXIS, N, mesh
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxcomp

PARAMS = {"w": jnp.zeros((256, 10)), "b": jnp.zeros((10,))}


def _like(tree, **changes):
  return {**{k: jnp.ones(v.shape) for k, v in tree.items()}, **changes}


# ----------------------------------------------------------------------------
# 1. A gradient tree that does not match the one tx.init saw


def test_update_refuses_gradients_of_other_shapes_with_the_same_size():
  tx = jaxcomp.topk(0.5)
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=r"do not match the state: leaf \['w'\] has shape \(128, 20\),"
                                       r" tx.init saw \(256, 10\)"):
    tx.update(_like(PARAMS, w=jnp.ones((128, 20))), state)
  with pytest.raises(ValueError, match=r"leaf \['w'\] has shape \(128, 20\)"):  # traced: the same
    jax.jit(tx.update).lower(_like(PARAMS, w=jnp.ones((128, 20))), state)
  tx.update(_like(PARAMS), state)  # the tree init saw


def test_update_refuses_a_renamed_key():
  tx = jaxcomp.qsgd()
  state = tx.init({"a": jnp.zeros((4,)), "c": jnp.zeros((3,))})
  with pytest.raises(ValueError, match=r"leaf \['b'\] \(shape \(4,\)\) is not in the tree tx.init saw,"
                                       r" which has leaf \['a'\] \(shape \(4,\)\) there"):
    tx.update({"b": jnp.ones((4,)), "c": jnp.ones((3,))}, state)
  with pytest.raises(ValueError, match=r"lack leaf \['c'\]"):
    tx.update({"a": jnp.ones((4,))}, state)


def test_the_state_stays_arrays_only_and_init_anywhere_is_remembered():
  tx = jaxcomp.topk(0.5, axis_name=AXIS)
  state = tx.init(PARAMS)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
  assert jax.tree.structure(state) == jax.tree.structure(jaxcomp.topk(0.5).init(PARAMS))
  # tx.init unbatched, tx.update per worker under pmap: the per-worker shapes agree
  stacked = jaxcomp.per_worker(state, N)
  grads = jax.tree.map(lambda x: jnp.ones((N,) + x.shape), PARAMS)
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS)
  step.lower(grads, stacked)
  other = {"w": jnp.ones((N, 128, 20)), "b": grads["b"]}
  with pytest.raises(ValueError, match=r"leaf \['w'\] has shape \(128, 20\)"):
    step.lower(other, stacked)
  # tx.init under eval_shape, jit, vmap: remembered with the shapes it saw
  for wrap in (lambda f: lambda p: jax.eval_shape(f, p), jax.jit,
               lambda f: lambda p: jax.vmap(f)(jax.tree.map(lambda x: x[None], p))):
    t = jaxcomp.topk(0.5)
    wrap(t.init)(PARAMS)
    with pytest.raises(ValueError, match=r"has shape \(128, 20\)"):
      t.update(_like(PARAMS, w=jnp.ones((128, 20))), state)
    t.update(_like(PARAMS), state)
  # never initialised here (a restored state): not checked
  jaxcomp.topk(0.5).update(_like(PARAMS, w=jnp.ones((128, 20))), state)


def test_a_rebuilt_transformation_keeps_its_own_record():
  tx = jaxcomp.topk(0.5)
  tx.init(PARAMS)
  later = jaxcomp.configure(tx, start_step=3)
  small = {"v": jnp.ones((8,))}
  later.update(small, later.init(small))  # its own init, another tree
  with pytest.raises(ValueError, match=r"\['v'\]"):
    tx.update(small, later.init(small))


def test_init_inside_the_mesh_with_a_dense_axis():
  slow, fast = "dcn", "ici"
  m = jax.make_mesh((2, 4), (slow, fast), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
  tx = jaxcomp.topk(0.25, axis_name=slow, dense_axis_name=fast)
  params = {"w": jnp.zeros((32, 8))}
  init = jax.jit(jax.shard_map(lambda p: jaxcomp.stacked(tx.init(p)), mesh=m, in_specs=P(),
                               out_specs=P((slow, fast))))
  state = init(params)

  def step(g, s):
    u, s = tx.update(jaxcomp.local(g), jaxcomp.local(s))
    return jaxcomp.stacked(u), jaxcomp.stacked(s)

  f = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P((slow, fast)), P((slow, fast))),
                            out_specs=(P((slow, fast)), P((slow, fast))), check_vma=False))
  f.lower({"w": jnp.ones((8, 32, 8))}, state)
  with pytest.raises(ValueError, match=r"leaf \['w'\] has shape \(16, 16\), tx.init saw \(32, 8\)"):
    f.lower({"w": jnp.ones((8, 16, 16))}, state)


# ----------------------------------------------------------------------------
# 2. Per-worker state: a forgotten jaxcomp.local, a state that is not per worker


def _shard_step(tx, drop_state_axis=True, state_spec=P(AXIS)):
  def step(g, s):
    u, s = tx.update(jaxcomp.local(g), jaxcomp.local(s) if drop_state_axis else s)
    return jaxcomp.stacked(u), jaxcomp.stacked(s) if drop_state_axis else s

  return jax.jit(jax.shard_map(step, mesh=mesh(), in_specs=(P(AXIS), state_spec),
                               out_specs=(P(AXIS), P(AXIS))))


def test_a_forgotten_local_names_the_fix():
  tx = jaxcomp.topk(0.5, axis_name=AXIS)
  params = {"w": jnp.zeros((16,))}
  state = jaxcomp.per_worker(tx.init(params), mesh(), AXIS)
  grads = {"w": jnp.ones((N, 16))}
  with pytest.raises(ValueError, match=r"state has a leading worker axis of size 1: inside shard_map call"
                                       r" tx.update\(jaxcomp.local\(grads\), jaxcomp.local\(state\)\)"):
    _shard_step(tx, drop_state_axis=False).lower(grads, state)
  _shard_step(tx).lower(grads, state)


def test_a_state_that_is_not_per_worker_names_the_fix():
  tx = jaxcomp.topk(0.5, axis_name=AXIS)
  params = {"w": jnp.zeros((16,))}
  state = tx.init(params)
  fix = r"the state is not per worker: make it with jaxcomp.per_worker\(tx.init\(params\), mesh, axis\)"
  with pytest.raises(ValueError, match=fix):
    jaxcomp.local(state)
  with pytest.raises(ValueError, match=fix):  # replicated into shard_map (in_specs P())
    _shard_step(tx, state_spec=P()).lower({"w": jnp.ones((N, 16))}, state)
  with pytest.raises(ValueError, match=r"shape \(8,\), not a worker's block with a leading axis of size 1"):
    jaxcomp.local(jaxcomp.per_worker(state, N))  # stacked, but not split over the workers
  with pytest.raises(ValueError, match=r"leading worker axis of size 8: .*inside jax.pmap"):
    tx.update({"w": jnp.ones((16,))}, jaxcomp.per_worker(state, N))  # outside pmap


# ----------------------------------------------------------------------------
# 3. jaxcomp.checkpoint after `import jaxcomp`, without importing orbax


def test_checkpoint_is_an_attribute_and_orbax_is_not_imported():
  code = ("import sys, jaxcomp; jaxcomp.checkpoint.save; jaxcomp.checkpoint.restore;"
          " assert not any(m.split('.')[0] == 'orbax' for m in sys.modules), 'orbax imported'")
  env = {**os.environ, "PJRT_NPROC": "16"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]


# ----------------------------------------------------------------------------
# 4. recipe passes every factory and optimizer setting through


def test_recipe_passes_optimizer_settings_through():
  tx = jaxcomp.recipe("topk", 1e-3, optimizer="adamw", freeze_step=5)  # once "multiple values"
  assert tx.compressor.method.start_step == 5
  assert jaxcomp.recipe_method("topk", optimizer="adamw", freeze_step=5, ratio=0.2).method.start_step == 5
  assert jaxcomp.recipe("onebit_adam", 1e-3, optimizer="adamw", weight_decay=0.0).compressor is not None
  params = {"w": jnp.zeros((6,))}
  grads = [{"w": jnp.arange(6.0) - 2.5}, {"w": jnp.cos(jnp.arange(6.0))}]

  def run(tx):
    state, out = tx.init(params), []
    for g in grads:
      u, state = tx.update(g, state, params)
      out.append(u["w"])
    return np.asarray(out)

  np.testing.assert_allclose(run(jaxcomp.recipe("none", 0.1, optimizer="adamw", b1=0.5, weight_decay=0.0)),
                             run(optax.adamw(0.1, b1=0.5, weight_decay=0.0)), rtol=1e-6)
  np.testing.assert_allclose(run(jaxcomp.recipe("none", 0.1, momentum=0.8, nesterov=True)),
                             run(optax.sgd(0.1, momentum=0.8, nesterov=True)), rtol=1e-6)


@pytest.mark.parametrize("optimizer,name,kwarg,names", [
    ("sgd", "topk", "b1", r"topk takes .*ratio.*; optax.sgd takes accumulator_dtype, nesterov"),
    ("adamw", "topk", "foo", r"onebit_adam takes .*freeze_step.*; its codec 'topk' takes .*ratio"),
    ("adamw", "qsgd", "foo", r"qsgd takes .*levels.*; optax.adamw takes .*b1"),
    ("adamw", "signum", "b1", r"the sign step takes weight_decay"),
])
def test_recipe_refuses_an_unknown_setting_by_name(optimizer, name, kwarg, names):
  with pytest.raises(TypeError, match=rf"recipe\('{name}', optimizer='{optimizer}'\) got an unexpected"
                                      rf" keyword argument '{kwarg}'.*{names}"):
    jaxcomp.recipe(name, 0.1, optimizer=optimizer, **{kwarg: 1})


def test_recipe_docstring_names_both_optimizers():
  doc = jaxcomp.recipe.__doc__
  assert "the only one" not in doc and '"adamw"' in doc


# ----------------------------------------------------------------------------
# 5. Byte counts and steady() through any optax transformation holding one jaxcomp transform


def test_wire_bytes_traffic_and_steady_through_optax_wrappers():
  params = {"w": jnp.zeros((64, 16)), "b": jnp.zeros((16,))}
  inner = jaxcomp.topk(0.1, axis_name=AXIS)
  chain = optax.chain(inner, optax.sgd(0.1))
  want = jaxcomp.wire_bytes(inner, params)
  wrapped = [chain, optax.MultiSteps(chain, 2), optax.apply_if_finite(chain, 3),
             optax.inject_hyperparams(lambda lr: optax.chain(inner, optax.sgd(lr)))(lr=0.1),
             optax.masked(inner, {"w": True, "b": False})]
  for tx in wrapped[:4]:
    assert jaxcomp.wire_bytes(tx, params) == want
    assert jaxcomp.wire_bytes(tx, params) == want  # twice: no cached trace hides the transform
  assert jaxcomp.compressor(wrapped[4], params) is inner
  # optax.masked hands the transform only its leaves: counted on those
  assert jaxcomp.wire_bytes(wrapped[4], params) == jaxcomp.wire_bytes(inner, {"w": params["w"]})
  assert jaxcomp.traffic(wrapped[4], params, N) == jaxcomp.traffic(inner, {"w": params["w"]}, N)
  assert jaxcomp.traffic(chain, params, N) == jaxcomp.traffic(inner, params, N)
  warm = optax.chain(jaxcomp.configure(inner, start_step=4), optax.sgd(0.1))
  assert jaxcomp.steady(warm, params).method.start_step == 0
  with pytest.raises(TypeError, match=r"jaxcomp.steady\(tx, params\)"):
    jaxcomp.steady(warm)
  hier = jaxcomp.topk(0.1, axis_name="dcn", dense_axis_name="ici")
  two = optax.chain(jaxcomp.configure(hier, start_step=2), optax.sgd(0.1))  # its init needs the mesh: not run
  assert jaxcomp.wire_bytes_by_axis(two, params, 4) == jaxcomp.wire_bytes_by_axis(hier, params, 4)
  with pytest.raises(TypeError, match="tx holds no jaxcomp transformation"):
    jaxcomp.wire_bytes(optax.sgd(0.1), params)
  with pytest.raises(ValueError, match=r"2 jaxcomp transformations \(topk, qsgd\)"):
    jaxcomp.wire_bytes(optax.chain(jaxcomp.topk(0.1), jaxcomp.qsgd()), params)


def test_the_search_does_not_count_as_an_init():
  tx = jaxcomp.topk(0.1)
  small = {"v": jnp.zeros((8,))}
  state = tx.init(small)
  jaxcomp.wire_bytes(optax.chain(tx, optax.sgd(0.1)), PARAMS)  # traces tx.init on PARAMS
  with pytest.raises(ValueError, match="do not match the state"):
    tx.update(_like(PARAMS), state)
