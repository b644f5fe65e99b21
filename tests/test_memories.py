"""Momentum-aware memories (momentum correction, EF21, EF21-SGDM), the warm-up, and jaxcomp.configure."""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import AXIS, N, assert_replicas_equal, init_stacked, params_tree, run_pmap, worker_grads

import jaxcomp

M = 0.9


def _topk(**kw):
  return jaxcomp.topk(ratio=0.1, axis_name=AXIS, **kw)


def _mem(tx, state, params):
  return jaxcomp.memory_tree(tx, state, params)


def test_momentum_correction_accumulates_momentum_and_keeps_what_was_not_sent():
  """u <- m u + g; v <- v + u; v keeps exactly v - sent (top-k sends exact values); replicas agree."""
  params = params_tree()
  tx = jaxcomp.configure(_topk(), memory=jaxcomp.momentum_correction(M))
  state = init_stacked(tx, params)
  u = jax.tree.map(lambda p: np.zeros((N,) + p.shape, np.float32), params)
  v = jax.tree.map(lambda p: np.zeros((N,) + p.shape, np.float32), params)
  for step in range(3):
    g = worker_grads(params, seed=step)
    out, state = run_pmap(tx, g, state)
    assert_replicas_equal(out)
    mem = _mem(tx, state, params)
    u = jax.tree.map(lambda u, g: np.float32(M) * u + np.asarray(g), u, g)
    x = jax.tree.map(lambda v, u: v + u, v, u)
    np.testing.assert_allclose(jax.tree.leaves(mem.momentum)[1], jax.tree.leaves(u)[1], rtol=1e-6, atol=1e-6)
    for xl, vl in zip(jax.tree.leaves(x), jax.tree.leaves(mem.accumulation)):
      kept = np.asarray(vl)
      sent = kept == 0  # top-k sends exact values: their residual is exactly 0
      # up to one float32 rounding: the memory recovers u as x - v (DGCMemory)
      np.testing.assert_allclose(kept[~sent], np.asarray(xl)[~sent], rtol=1e-6, atol=1e-6)
      if kept[0].size > 10:  # a scalar leaf is always sent
        assert 0 < sent.mean() < 1
    v = jax.tree.map(np.asarray, mem.accumulation)


def test_masking_zeroes_the_momentum_where_sent():
  params = {"w": jnp.zeros((40, 24))}
  tx = jaxcomp.configure(_topk(), memory=jaxcomp.momentum_correction(M, masking=True))
  state = init_stacked(tx, params)
  _, state = run_pmap(tx, worker_grads(params), state)
  mem = _mem(tx, state, params)
  u, v = np.asarray(mem.momentum["w"]), np.asarray(mem.accumulation["w"])
  np.testing.assert_array_equal(u[v == 0], 0.0)
  assert np.all(u[v != 0] != 0)


@pytest.mark.parametrize("eta", [None, 0.2])
def test_ef21_estimates_advance_by_what_was_sent(eta):
  """g_i += local decode (exactly, float32), shared g += decoded mean, identical everywhere; output == g."""
  params = params_tree()
  tx = jaxcomp.configure(_topk(), memory=jaxcomp.ef21(eta))
  state = init_stacked(tx, params)
  est = jax.tree.map(lambda p: np.zeros((N,) + p.shape, np.float32), params)
  vel = jax.tree.map(lambda p: np.zeros((N,) + p.shape, np.float32), params)
  shared = jax.tree.map(lambda p: np.zeros(p.shape, np.float32), params)
  for step in range(4):
    g = jax.tree.map(np.asarray, worker_grads(params, seed=step))
    out, state = run_pmap(tx, g, state)
    assert_replicas_equal(out)
    mem = _mem(tx, state, params)
    if eta is not None:
      vel = jax.tree.map(lambda v, g: np.float32(1 - eta) * v + np.float32(eta) * g, vel, g)
    target = g if eta is None else vel
    for t, e_old, e_new in zip(jax.tree.leaves(target), jax.tree.leaves(est), jax.tree.leaves(mem.estimate)):
      e_new = np.asarray(e_new)
      sent = e_new - e_old
      moved = sent != 0
      # what moved, moved to the target exactly (top-k sends exact values of target - estimate)
      np.testing.assert_allclose(e_new[moved], t[moved], rtol=1e-6, atol=1e-6)
      np.testing.assert_array_equal(e_new[~moved], e_old[~moved])
    sh = jax.tree.map(lambda a: np.asarray(a), mem.shared)
    for leaf in jax.tree.leaves(sh):
      np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))  # the same on every worker
    for o, s in zip(jax.tree.leaves(out), jax.tree.leaves(sh)):
      np.testing.assert_array_equal(np.asarray(o)[0], s[0])
    # the shared estimate is the mean of the workers' estimates (up to float32 rounding)
    for s, e in zip(jax.tree.leaves(sh), jax.tree.leaves(mem.estimate)):
      np.testing.assert_allclose(s[0], np.asarray(e).mean(0), rtol=1e-5, atol=1e-5)
    est = jax.tree.map(np.asarray, mem.estimate)
    shared = sh
  del shared


@pytest.mark.parametrize("memory", [jaxcomp.momentum_correction(M), jaxcomp.ef21(), jaxcomp.ef21(0.1)],
                         ids=["momentum", "ef21", "ef21-sgdm"])
def test_a_non_finite_step_leaves_the_memory_as_it_was(memory):
  params = {"w": jnp.zeros((40, 24))}
  tx = jaxcomp.configure(_topk(), memory=memory)
  state = init_stacked(tx, params)
  _, state = run_pmap(tx, worker_grads(params), state)
  bad = worker_grads(params, seed=1)
  bad["w"] = harness.set_at(bad["w"], (3, 0, 0), jnp.nan)
  out, new = run_pmap(tx, bad, state)
  assert np.all(np.isnan(np.asarray(out["w"])))
  for a, b in zip(jax.tree.leaves(new.memory), jax.tree.leaves(state.memory)):
    assert np.all(np.isfinite(np.asarray(a)))
  # nothing was sent: the estimates stay (the velocity may advance)
  if isinstance(memory, jaxcomp.core.memories.EF21):
    for field in ("estimate", "shared"):
      for a, b in zip(jax.tree.leaves(getattr(new.memory, field)),
                      jax.tree.leaves(getattr(state.memory, field))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_warm_up_is_dense_before_start_step_then_compresses():
  params = {"w": jnp.zeros((40, 24))}
  tx = jaxcomp.configure(_topk(), start_step=2)
  state = init_stacked(tx, params)
  for step in range(3):
    g = worker_grads(params, seed=step)
    out, state = run_pmap(tx, g, state)
    o = np.asarray(out["w"])[0]
    if step < 2:
      np.testing.assert_allclose(o, np.asarray(g["w"]).mean(0), rtol=1e-6, atol=1e-6)
      np.testing.assert_array_equal(np.asarray(jaxcomp.memory_tree(tx, state, params)["w"]), 0.0)
    else:
      assert 0 < np.mean(o != 0) < 0.9


def test_configure_keeps_the_other_settings_and_names_bad_arguments():
  tx = jaxcomp.topk(ratio=0.05, axis_name=AXIS, seed=7, bucket_bytes=4096, min_size=1)
  new = jaxcomp.configure(tx, memory=jaxcomp.ef21(), start_step=3)
  assert new.axis_name == AXIS and new.seed == 7
  assert new.method.bucket_bytes == 4096 and new.method.min_size == 1 and new.method.start_step == 3
  with pytest.raises(ValueError, match="memory= replaces plain error feedback.*dgc"):
    jaxcomp.configure(jaxcomp.dgc(), memory=jaxcomp.ef21())
  with pytest.raises(TypeError, match="memory must be"):
    jaxcomp.configure(tx, memory="ef21")
  with pytest.raises(ValueError, match="start_step"):
    jaxcomp.configure(tx, start_step=-1)
  with pytest.raises(ValueError, match="momentum"):
    jaxcomp.momentum_correction(1.0)
  with pytest.raises(ValueError, match="momentum"):
    jaxcomp.ef21(0.0)
  with pytest.raises(ValueError, match="name"):
    jaxcomp.recipe("nope", 0.1)
