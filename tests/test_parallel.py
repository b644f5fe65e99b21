"""jaxcomp.data_parallel: the step helper on a 1-axis and a 2-axis mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jaxcomp

ROWS = 4  # rows per worker


def _loss(p, batch):
  x, y = batch
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _data(seed):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((8 * ROWS, 16)).astype(np.float32),
          rng.standard_normal((8 * ROWS, 4)).astype(np.float32))


PARAMS = {"w": jnp.zeros((16, 4)), "b": jnp.zeros((4,))}


def _mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:8])


@pytest.mark.parametrize("shape,names,kw", [
    ((8,), ("data",), {"axis_name": "data"}),
    ((2, 4), ("dcn", "ici"), {"axis_name": "dcn", "dense_axis_name": "ici"}),
])
def test_dense_step_is_sgd_on_the_mean_gradient(shape, names, kw):
  tx = optax.chain(jaxcomp.none(**kw), optax.sgd(0.1))
  dp = jaxcomp.data_parallel(_loss, tx, _mesh(shape, names))
  params, state = dp.init(PARAMS)
  ref = PARAMS
  for t in range(3):
    batch = _data(t)
    params, state, loss = dp.step(params, state, batch)
    # every worker's mean over its rows, averaged: the mean over all rows (equal rows per worker)
    ref_loss, g = jax.value_and_grad(_loss)(ref, batch)
    ref = jax.tree.map(lambda p, g: p - 0.1 * g, ref, g)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_compressed_state_is_per_worker():
  tx = optax.chain(jaxcomp.topk(0.1, axis_name="dcn", dense_axis_name="ici", min_size=1), optax.sgd(0.1))
  dp = jaxcomp.data_parallel(_loss, tx, _mesh((2, 4), ("dcn", "ici")))
  params, state = dp.init(PARAMS)
  residual = state[0].memory
  assert [np.shape(r)[0] for r in residual] == [8]  # one block per worker of the mesh
  for t in range(3):
    params, state, loss = dp.step(params, state, _data(t))
    assert np.isfinite(float(loss))
  assert any(np.any(np.asarray(r) != 0) for r in jax.tree.leaves(state[0].memory))  # error feedback kept


def test_bad_arguments_are_named():
  tx = optax.chain(jaxcomp.none(axis_name="data"), optax.sgd(0.1))
  with pytest.raises(TypeError, match="mesh must be"):
    jaxcomp.data_parallel(_loss, tx, "data")
  with pytest.raises(ValueError, match="axes must name"):
    jaxcomp.data_parallel(_loss, tx, _mesh((8,), ("data",)), axes=("model",))
  dp = jaxcomp.data_parallel(_loss, tx, _mesh((8,), ("data",)))
  params, state = dp.init(PARAMS)
  x, y = (np.concatenate([a, a])[:60] for a in _data(0))
  with pytest.raises(ValueError, match=r"rows of every leaf must divide evenly over the 8 workers.*60, 16"):
    dp.step(params, state, (x, y))  # 60 rows on 8 workers: named, not JAX's shard_map message


@pytest.mark.parametrize("diloco", [False, True])
def test_a_host_batch_on_a_default_mesh(diloco):
  """``jax.make_mesh``'s default axis types with a host (numpy) batch: the step places the rows itself."""
  inner = optax.chain(jaxcomp.topk(0.1, axis_name="data"), optax.sgd(0.1))
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=2, axis_name="data") if diloco else inner
  dp = jaxcomp.data_parallel(_loss, tx, jax.make_mesh((8,), ("data",), devices=jax.devices()[:8]))
  params, state = dp.init(PARAMS)
  for t in range(2):
    params, state, loss = dp.step(params, state, _data(t))
    assert np.isfinite(float(loss))
