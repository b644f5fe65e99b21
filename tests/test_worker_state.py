"""jaxcomp.per_worker: the stacked state is placed so that the user's pmap step compiles once."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp

PARAMS = {"w": np.zeros((40, 24), np.float32), "b": np.zeros((24,), np.float32)}


def _compiles(fn):
  """How many compile events (XLA compiles and persistent-cache hits) ``fn()`` caused."""
  events = []

  def listen(event, duration, **kw):
    if event == "/jax/compilation_cache/compile_time_saved_sec" or event.endswith("backend_compile_duration"):
      events.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    fn()
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  return len(events)


@pytest.mark.parametrize("axis_name", ["data", None])
def test_the_step_compiles_once_when_per_worker_knows_the_pmap_axis(axis_name):
  tx = optax.chain(jaxcomp.topk(ratio=0.1, axis_name="data"), optax.sgd(0.1))

  @functools.partial(jax.pmap, axis_name="data")
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  P = jaxcomp.per_worker(PARAMS, 8, axis_name)
  S = jaxcomp.per_worker(tx.init(PARAMS), 8, axis_name)
  g = {k: 1e-5 * np.ones((8,) + v.shape, np.float32) for k, v in PARAMS.items()}
  out = {}
  first = _compiles(lambda: out.setdefault(1, step(P, S, g)))
  second = _compiles(lambda: out.setdefault(2, step(*out[1], g)))
  assert first >= 1
  # placed as the step's own outputs: the second step reuses the first one's program;
  # host arrays (no axis name) make pmap compile again for its outputs
  assert (second == 0) == (axis_name is not None), (axis_name, second)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(out[2]), jax.tree.leaves(step(*out[1], g))))


def test_the_stacked_arrays_hold_each_leaf_once_per_worker():
  state = {"x": jnp.arange(6.0).reshape(2, 3), "n": np.int32(3), "s": 1.5, "key": jax.random.key(0)}
  host = jaxcomp.per_worker(state, 4)
  assert isinstance(host["x"], np.ndarray) and host["x"].shape == (4, 2, 3)
  assert not host["x"].flags.writeable  # a view: the leaf is not copied 4 times
  np.testing.assert_array_equal(host["x"], np.broadcast_to(np.arange(6.0).reshape(2, 3), (4, 2, 3)))
  assert host["n"].dtype == np.int32 and host["n"].shape == (4,)
  assert host["s"].dtype == jnp.float32 and host["s"].weak_type  # a Python scalar stays weakly typed
  assert host["key"].shape == (4,) and jnp.issubdtype(host["key"].dtype, jax.dtypes.prng_key)
  placed = jaxcomp.per_worker(state, 4, axis_name="data")
  assert len(placed["x"].sharding.device_set) == 4
  np.testing.assert_array_equal(np.asarray(placed["x"]), host["x"])
  assert jaxcomp.per_worker({}, 4, axis_name="data") == {}
  with pytest.raises(ValueError, match="local devices"):
    jaxcomp.per_worker(state, 9, axis_name="data")
  with pytest.raises(ValueError, match="workers must be a positive int"):
    jaxcomp.per_worker(state, 0)


def test_inside_a_traced_function_it_broadcasts():
  out = jax.jit(lambda x: jaxcomp.per_worker({"x": x}, 3, axis_name="data"))(jnp.ones(2))
  assert out["x"].shape == (3, 2)
