"""Properties every registered method keeps, checked for all of ``jaxcomp.METHODS``.

pmap == shard_map (over two steps, so state matters), every worker ends with
the same update, the measured HLO wire bytes equal the method's nominal bytes,
error feedback conserves what was not sent, an unbound axis name is a clear
error, and a NaN never enters the residual.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
  AXIS,
  N,
  assert_replicas_equal,
  assert_trees_close,
  init_stacked,
  params_tree,
  pmap_wire_bytes,
  run_pmap,
  run_shard_map,
  worker_grads,
)

import jaxcomp
from jaxcomp.core.protocol import Memory

pytestmark = pytest.mark.usefixtures("every_leaf_module")  # small trees on purpose: compress every leaf

METHODS = sorted(jaxcomp.METHODS)


def _plain_residual(tx) -> bool:
  return type(tx.method.memory) is Memory and tx.method.memory.enabled


@pytest.mark.parametrize("name", METHODS)
def test_pmap_equals_shard_map_and_replicas_agree(name):
  tx = harness.method(name, axis_name=AXIS)
  params = params_tree()
  state_p = state_s = init_stacked(tx, params)
  for step in range(2):
    grads = worker_grads(params, seed=step)
    out_p, state_p = run_pmap(tx, grads, state_p)
    out_s, state_s = run_shard_map(tx, grads, state_s)
    assert_replicas_equal(out_p)
    assert_replicas_equal(out_s)
    assert_trees_close(out_p, out_s, rtol=1e-6, atol=1e-7)
    assert_trees_close(state_p, state_s, rtol=1e-6, atol=1e-7)
    for leaf in jax.tree.leaves(out_p):
      assert np.all(np.isfinite(np.asarray(leaf)))


@pytest.mark.parametrize("name", METHODS)
def test_measured_wire_bytes_equal_nominal(name):
  tx = harness.method(name, axis_name=AXIS)
  params = params_tree()
  # after any warm-up (DGC's): the last stage's program; a staged program holds every stage
  measured = pmap_wire_bytes(jaxcomp.steady(tx), params)
  nominal = jaxcomp.wire_bytes(tx, params)
  if name == "bf16" and jax.default_backend() == "cpu":
    # XLA:CPU promotes a bf16 all-reduce to f32 (GPU/TPU reduce bf16 natively).
    assert measured["total"] == 2 * nominal
  else:
    assert measured["total"] == nominal, measured
  dense = jaxcomp.wire_bytes(jaxcomp.none(axis_name=AXIS), params)
  if name != "none":
    assert nominal < dense


@pytest.mark.parametrize("name", METHODS)
def test_error_feedback_conserves_every_value(name):
  """Leaf by leaf: sent + new residual == old residual * beta + gamma * gradient."""
  tx = harness.method(name, axis_name=None)
  if not _plain_residual(tx):
    pytest.skip("no plain residual memory (tested in the method's own tests)")
  mem = tx.method.memory
  params = params_tree()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(3):
    grads = jax.tree.map(lambda g: g[0], worker_grads(params, seed=10 + step, n=1))
    out, new_state = update(grads, state)
    old, new = (jaxcomp.memory_tree(tx, st, params) for st in (state, new_state))
    for g, e, e2, o in zip(*(jax.tree.leaves(t) for t in (grads, old, new, out))):
      sent = mem.gamma * np.asarray(o, np.float64)
      np.testing.assert_allclose(sent + np.asarray(e2, np.float64),
                                 mem.beta * np.asarray(e, np.float64) + mem.gamma * np.asarray(g, np.float64),
                                 rtol=1e-5, atol=1e-5)
    state = new_state


@pytest.mark.parametrize("name", METHODS)
def test_state_is_float32_with_bf16_parameters(name):
  """Accumulating state (residuals, momenta, factors) is float32 whatever the parameters' dtype."""
  tx = harness.method(name, axis_name=None)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params_tree())
  state = tx.init(params)
  for leaf in jax.tree.leaves((state.memory, state.extra)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32, (name, leaf.dtype)
  out, _ = jax.jit(tx.update)(params, state)
  assert all(o.dtype == jnp.bfloat16 for o in jax.tree.leaves(out))


@pytest.mark.parametrize("name", METHODS)
def test_unbound_axis_name_is_a_clear_error(name):
  tx = harness.method(name, axis_name="not_an_axis")
  params = params_tree()
  with pytest.raises(ValueError, match="axis_name='not_an_axis' is not bound"):
    run_pmap(tx, worker_grads(params), init_stacked(tx, params))


@pytest.mark.parametrize("name", METHODS)
def test_nan_never_enters_the_state(name):
  """A NaN gradient on one worker: the state stays finite and the next step is finite."""
  tx = harness.method(name, axis_name=AXIS)
  params = params_tree()
  state = init_stacked(tx, params)
  grads = worker_grads(params, seed=3)
  grads["dense"]["kernel"] = harness.set_at(grads["dense"]["kernel"], (2, 0, 0), jnp.nan)
  stateless = not jax.tree.leaves((state.memory, state.extra))
  out, state = run_pmap(tx, grads, state)
  # Stateless methods whose payload carries NaN/Inf (the psums, a norm, a scale, a flag) give exactly
  # the exchanges' mean, non-finite; the others' step is skipped on every replica alike (all NaN).
  exact = stateless and tx.method.carries_nonfinite(params)
  assert exact == (name in ("none", "fp16", "bf16", "qsgd", "terngrad", "natural", "u8bit", "sketchml",
                            "signsgd"))
  for leaf in jax.tree.leaves(out):
    a = np.asarray(leaf)
    assert np.all(np.isnan(a)) or exact
    np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape))  # every replica alike
  assert not all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(out))
  for leaf in jax.tree.leaves(state):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert np.all(np.isfinite(np.asarray(leaf)))
  out, _ = run_pmap(tx, worker_grads(params, seed=4), state)
  for leaf in jax.tree.leaves(out):
    assert np.all(np.isfinite(np.asarray(leaf)))


@pytest.mark.parametrize("name", METHODS)
def test_integer_leaves_are_rejected(name):
  tx = harness.method(name, axis_name=None)
  params = {"w": jnp.zeros((4, 4)), "steps": jnp.zeros((3,), jnp.int32)}
  with pytest.raises(TypeError, match=r"updates: leaf \['steps'\] has dtype int32"):
    jax.eval_shape(tx.update, params, tx.init({"w": params["w"], "steps": jnp.zeros((3,))}))


def test_every_method_is_exported_and_documented():
  for name, factory in jaxcomp.METHODS.items():
    assert getattr(jaxcomp, name) is factory
    assert factory.__doc__ and "References" in factory.__doc__, name
    assert name in jaxcomp.__all__, name
  assert N == 8
