"""The worked example of docs/adding-a-method.md (examples/custom_codec.py) works as a method
of the library.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from custom_codec import int8  # noqa: E402


def _params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w": 1e-6 * jax.random.normal(k1, (64, 32)), "b": 1e-6 * jax.random.normal(k2, (2048,))}


def test_int8_bytes_and_error_feedback_locally():
  params = _params()
  tx = int8(min_size=0)
  assert jaxcomp.wire_bytes(tx, params) == 2048 + 4 + 2048 + 4  # int8 values and a scale per leaf
  state = tx.init(params)
  out, state = tx.update(params, state)
  residual = jaxcomp.memory_tree(tx, state, params)
  for k in params:  # what was sent plus what was kept is the gradient (error feedback conserves it)
    np.testing.assert_allclose(out[k] + residual[k], params[k], rtol=1e-6, atol=1e-13)
    assert float(jnp.max(jnp.abs(residual[k]))) <= float(jnp.max(jnp.abs(params[k]))) / 254 * 1.001


def test_int8_over_eight_devices():
  n = jax.device_count()
  tx = optax.chain(int8(axis_name="i", min_size=0), optax.sgd(1.0))
  params = _params()
  grads = jax.tree.map(lambda p: jnp.stack([p * (i + 1) for i in range(n)]), params)
  state = jaxcomp.per_worker(tx.init(params), n)
  out, _ = jax.pmap(tx.update, axis_name="i")(grads, state)
  for k in params:
    want = -params[k] * (n + 1) / 2  # sgd(1.0) of the mean gradient
    np.testing.assert_allclose(out[k][0], want, rtol=0, atol=float(jnp.max(jnp.abs(want))) / 100)
    np.testing.assert_array_equal(out[k][0], out[k][n - 1])  # identical on every worker
