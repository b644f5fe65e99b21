"""Sparse Binary Compression: a numpy reference of the sync, delay, capacity, and training on digits."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
  AXIS,
  N,
  assert_replicas_equal,
  assert_trees_close,
  init_stacked,
  local_round_trip,
  params_tree,
  pmap_wire_bytes,
  run_pmap,
  run_shard_map,
  worker_grads,
)

import jaxcomp
from jaxcomp.collectives import golomb
from jaxcomp.transforms.sbc import SBCState

SPARSITY = 0.05
# Shared so that each compiles once (the harness caches compiled steps per transform).
TX = {delay: jaxcomp.sbc(sparsity=SPARSITY, delay=delay, axis_name=AXIS) for delay in (1, 2)}


def _reference_sent(a, p):
  """SBC's binarization in numpy: the top-k side (k = ceil(p n)) with the larger mean, as a dense vector."""
  k = max(1, math.ceil(p * a.size - 1e-9))
  sides = []
  for sign in (1.0, -1.0):
    order = np.argsort(-sign * a, kind="stable")[:k]
    order = order[sign * a[order] > 0]
    mu = float(np.mean(sign * a[order])) if order.size else 0.0
    sides.append((mu, sign, order))
  (mup, _, ip), (mun, _, in_) = sides
  sent = np.zeros_like(a)
  if mup >= mun:
    sent[ip] = mup
  else:
    sent[in_] = -mun
  return sent


def _leaf_states(tx, params, state):
  """Per leaf: the (N, n) accumulated update and residual held in ``state.extra``."""
  leaves = jax.tree.leaves(params)
  acc, res = [None] * len(leaves), [None] * len(leaves)
  for (_, _, idx), ex in zip(tx.method.plan(leaves), state.extra):
    for j, i in enumerate(idx):
      res[i] = np.asarray(ex.residual)[:, j]
      acc[i] = np.asarray(ex.accumulated)[:, j] if ex.accumulated.shape[-1] else np.zeros_like(res[i])
  return acc, res


@pytest.mark.parametrize("delay", [1, 2])
def test_sync_matches_numpy_reference_and_replicas_agree(delay):
  """Over two periods: local steps pass through, each sync ends every worker at S + mean(sent)."""
  tx = TX[delay]
  params0 = params_tree()
  state = init_stacked(tx, params0)
  params = [np.ones((N,) + x.shape, np.float32) for x in jax.tree.leaves(params0)]
  sync_point = [x[0].copy() for x in params]
  rng = np.random.default_rng(delay)
  for step in range(2 * delay):
    updates = jax.tree.map(lambda x: rng.normal(0, 0.1, (N,) + x.shape).astype(np.float32), params0)
    acc, res = _leaf_states(tx, params0, state)
    out, state = run_pmap(tx, updates, state)
    acc2, res2 = _leaf_states(tx, params0, state)
    sync = step % delay == delay - 1
    for i, (u, o) in enumerate(zip(jax.tree.leaves(updates), jax.tree.leaves(out))):
      u = np.asarray(u).reshape(N, -1)
      o = np.asarray(o).reshape(N, -1)
      params[i] = params[i] + o.reshape(params[i].shape)
      if not sync:
        np.testing.assert_array_equal(o, u)
        np.testing.assert_array_equal(acc2[i], acc[i] + u)
        np.testing.assert_array_equal(res2[i], res[i])
        continue
      a = res[i] + (acc[i] + u)
      sent = np.stack([_reference_sent(a[w], SPARSITY) for w in range(N)])
      mean = sent.astype(np.float64).mean(0)
      np.testing.assert_allclose(o, mean - acc[i], rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(res2[i], a - sent, rtol=1e-6, atol=1e-7)
      assert not acc2[i].any() and (delay > 1 or state.extra[0].accumulated.shape[-1] == 0)
      after = params[i].reshape(N, -1)
      if delay == 1:
        assert_replicas_equal(after)
      else:
        np.testing.assert_allclose(after, np.broadcast_to(after[:1], after.shape), rtol=0, atol=2e-6)
      np.testing.assert_allclose(after, np.broadcast_to(sync_point[i].reshape(1, -1) + mean, after.shape),
                                 rtol=1e-6, atol=2e-6)
      sync_point[i] = params[i][0].copy()


def test_delay_pmap_equals_shard_map_and_wire_bytes():
  tx = TX[2]
  params = params_tree()
  state_p = state_s = init_stacked(tx, params)
  for step in range(3):
    grads = worker_grads(params, seed=20 + step)
    out_p, state_p = run_pmap(tx, grads, state_p)
    out_s, state_s = run_shard_map(tx, grads, state_s)
    assert_trees_close(out_p, out_s, rtol=1e-6, atol=1e-7)
    assert_trees_close(state_p, state_s, rtol=1e-6, atol=1e-7)
  measured = pmap_wire_bytes(tx, params)
  nominal = jaxcomp.wire_bytes(tx, params)
  assert measured["total"] == nominal and measured["count"] == 4, measured
  b = golomb.golomb_b_star(SPARSITY)
  caps = [golomb.max_stream_bits(math.ceil(SPARSITY * n - 1e-9), n, b) for n in (288, 24, 960, 1)]
  assert caps == [92, 11, 297, 5]  # the stream length travels in 1 byte, 2 bytes for the 960 leaf
  assert nominal == sum(4 + (1 if c < 256 else 2) + golomb.words_for(c) for c in caps)


def test_capacity_overflow_keeps_the_rest_in_the_residual():
  """A buffer half the expected size: fewer positions are sent, nothing is lost."""
  tx = jaxcomp.sbc(sparsity=0.05, capacity=0.5)
  full = jaxcomp.sbc(sparsity=0.05)
  params = {"w": jnp.zeros((4000,), jnp.float32)}
  grads = {"w": jax.random.normal(jax.random.PRNGKey(1), (4000,))}
  out, state = local_round_trip(tx, grads, tx.init(params))
  out_full, _ = local_round_trip(full, grads, full.init(params))
  sent = np.count_nonzero(np.asarray(out["w"]))
  assert 0 < sent < np.count_nonzero(np.asarray(out_full["w"])) == 200
  residual = np.asarray(state.extra[0].residual[0])
  np.testing.assert_allclose(np.asarray(out["w"]) + residual, np.asarray(grads["w"]), rtol=1e-6, atol=1e-7)
  assert jaxcomp.wire_bytes(tx, params) < jaxcomp.wire_bytes(full, params)


def test_non_finite_update_skips_the_step_without_touching_the_state():
  """A NaN on one worker: on a local step only that worker's output is NaN; on a sync step everyone's."""
  tx = TX[2]
  params = params_tree()
  state = init_stacked(tx, params)
  for step in range(4):
    grads = worker_grads(params, seed=30 + step)
    if step < 2:
      grads["dense"]["kernel"] = grads["dense"]["kernel"].at[2, 0, 0].set(jnp.nan)
    out, new_state = run_pmap(tx, grads, state)
    nan = np.stack([np.isnan(np.asarray(x).reshape(N, -1)).all(1) for x in jax.tree.leaves(out)], 1)
    if step < 2:
      expected = np.arange(N) == 2 if step == 0 else np.ones(N, bool)
      np.testing.assert_array_equal(nan, np.broadcast_to(expected[:, None], nan.shape))
      bad = expected
      for old, new in zip(jax.tree.leaves(state.extra), jax.tree.leaves(new_state.extra)):
        np.testing.assert_array_equal(np.asarray(new)[bad], np.asarray(old)[bad])
    else:
      assert not nan.any()
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(new_state.extra))
    state = new_state


def test_bad_arguments_name_the_argument():
  for kwargs, match in [({"sparsity": 0.0}, "sparsity must be in"), ({"sparsity": 2}, "sparsity must be in"),
                        ({"delay": 0}, "delay must be"), ({"delay": 1.5}, "delay must be an int"),
                        ({"capacity": -1.0}, "capacity must be finite and > 0"),
                        ({"capacity": "big"}, "capacity must be a finite number"),
                        ({"axis_name": ["a", []]}, "axis_name must be")]:
    with pytest.raises((TypeError, ValueError), match=match):
      jaxcomp.sbc(**kwargs)
  assert isinstance(jaxcomp.sbc().init(params_tree()).extra[0], SBCState)


# ----------------------------------------------------------------------------
# Training on real data: sklearn's digits, a tiny MLP, 8 workers with data shards.

HIDDEN = 32
STEPS = 300
LR = 0.5


def _digits():
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  perm = np.random.default_rng(0).permutation(len(x))
  test, train = perm[:360], perm[360:]
  train = train[:len(train) // N * N]
  return (x[train].reshape(N, -1, 64), y[train].reshape(N, -1)), (x[test], y[test])


def _mlp_init():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w1": jax.random.normal(k1, (64, HIDDEN)) / 8.0, "b1": jnp.zeros((HIDDEN,)),
          "w2": jax.random.normal(k2, (HIDDEN, 10)) / math.sqrt(HIDDEN), "b2": jnp.zeros((10,))}


def _logits(p, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _loss(p, x, y):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(_logits(p, x)), y[:, None], axis=1))


def _train(tx, shards):
  """STEPS full-shard gradient steps on every worker, in one pmapped scan; returns per-worker params."""

  def run(params, state, x, y):
    def step(carry, _):
      params, state = carry
      updates, state = tx.update(jax.grad(_loss)(params, x, y), state, params)
      return (optax.apply_updates(params, updates), state), None

    return jax.lax.scan(step, (params, state), None, length=STEPS)[0][0]

  params = _mlp_init()
  return jax.pmap(run, axis_name=AXIS)(jaxcomp.per_worker(params, N), jaxcomp.per_worker(tx.init(params), N),
                                       *shards)


@pytest.mark.slow
def test_digits_training_reaches_dense_accuracy_with_over_100x_fewer_bits():
  shards, (x_test, y_test) = _digits()
  sparsity, delay = 0.01, 4

  def accuracy(stacked):
    p = jax.tree.map(lambda a: a[0], stacked)
    return float(np.mean(np.argmax(np.asarray(_logits(p, x_test)), -1) == y_test))

  dense = _train(optax.chain(jaxcomp.none(axis_name=AXIS), optax.sgd(LR, momentum=0.9)), shards)
  sbc_tx = jaxcomp.sbc(sparsity=sparsity, delay=delay, axis_name=AXIS)
  compressed = _train(optax.chain(optax.sgd(LR, momentum=0.9), sbc_tx), shards)
  for leaf in jax.tree.leaves(compressed):  # replicas agree up to the rounding of the local accumulation
    a = np.asarray(leaf)
    np.testing.assert_allclose(a, np.broadcast_to(a[:1], a.shape), rtol=0, atol=1e-4)
  params = _mlp_init()
  dense_bits = 32 * sum(x.size for x in jax.tree.leaves(params)) * STEPS
  sbc_bits = 8 * jaxcomp.wire_bytes(sbc_tx, params) * (STEPS // delay)
  acc_dense, acc_sbc = accuracy(dense), accuracy(compressed)
  print(f"\ndigits MLP 64-{HIDDEN}-10, {N} workers, {STEPS} steps: dense test accuracy {acc_dense:.4f},"
        f" SBC(sparsity={sparsity}, delay={delay}) {acc_sbc:.4f}; bits sent per worker: dense {dense_bits},"
        f" SBC {sbc_bits}, ratio {dense_bits / sbc_bits:.1f}x")
  assert acc_sbc >= acc_dense - 0.03
  assert dense_bits > 100 * sbc_bits
