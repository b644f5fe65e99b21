"""1-bit Adam: exact Adam during the warm-up, then a compressed momentum with the variance frozen."""

import harness
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
  run_pmap,
  run_shard_map,
  worker_grads,
)

import jaxcomp

PARAMS = {"w": jnp.zeros((64, 48)), "k": jnp.zeros((3, 3, 8, 16)), "b": jnp.zeros((48,))}
LR = 1e-2


def _run(tx, steps, run=run_pmap, state=None, seed0=0):
  state = init_stacked(tx, PARAMS) if state is None else state
  outs = []
  for t in range(steps):
    out, state = run(tx, worker_grads(PARAMS, seed=seed0 + t), state)
    assert_replicas_equal(out)
    outs.append(out)
  return outs, state


def test_warm_up_is_adam_on_the_mean_gradient_then_the_variance_freezes():
  tx = jaxcomp.onebit_adam(LR, freeze_step=3, axis_name=AXIS)
  outs, state = _run(tx, 5)
  adam = optax.adam(LR)
  s = adam.init(PARAMS)
  for t in range(3):  # exact Adam while the exchange is dense
    mean = jax.tree.map(lambda g: g.mean(0), worker_grads(PARAMS, seed=t))
    want, s = adam.update(mean, s)
    assert_trees_close(jax.tree.map(lambda o: o[0], outs[t]), want, rtol=2e-5, atol=1e-7)
  adam_state = state[0]
  _, mid = _run(tx, 3)
  for a, b in zip(jax.tree.leaves(adam_state.nu), jax.tree.leaves(mid[0].nu)):  # frozen from step 3
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(np.asarray(adam_state.count)[0]) == 5


def test_after_the_warm_up_the_momentum_travels_in_one_bit():
  tx = jaxcomp.onebit_adam(LR, freeze_step=2, axis_name=AXIS)
  outs_p, state_p = _run(tx, 4)
  outs_s, state_s = _run(tx, 4, run=run_shard_map)
  assert_trees_close(outs_p[-1], outs_s[-1], rtol=1e-6, atol=1e-7)
  big = {"w": jnp.zeros((1024, 512)), "b": jnp.zeros((512,))}
  dense = jaxcomp.wire_bytes(jaxcomp.none(axis_name=AXIS), big)
  assert dense / jaxcomp.wire_bytes(tx, big, workers=N) >= 16
  assert jaxcomp.wire_bytes(tx, big, step=0, workers=N) == dense + 4  # the warm-up: dense (and the flag)
  for leaf in jax.tree.leaves(outs_p[-1]):
    assert np.all(np.isfinite(np.asarray(leaf)))


def test_a_nan_step_is_skipped_and_keeps_the_moments():
  tx = jaxcomp.onebit_adam(LR, freeze_step=1, axis_name=AXIS)
  _, state = _run(tx, 2)
  grads = worker_grads(PARAMS, seed=7)
  grads["w"] = harness.set_at(grads["w"], (3, 1, 1), jnp.nan)
  out, after = run_pmap(tx, grads, state)
  for leaf in jax.tree.leaves(out):
    assert np.all(np.isnan(np.asarray(leaf)))
  for a, b in zip(jax.tree.leaves((after[0].mu, after[0].nu, after[0].count)),
                  jax.tree.leaves((state[0].mu, state[0].nu, state[0].count))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  out, _ = run_pmap(tx, worker_grads(PARAMS, seed=8), after)
  for leaf in jax.tree.leaves(out):
    assert np.all(np.isfinite(np.asarray(leaf)))


def test_local_momentum_stays_with_each_worker_and_error_feedback_delivers_all_of_it():
  b1, freeze = 0.9, 2
  tx = jaxcomp.onebit_adam(LR, b1=b1, freeze_step=freeze, axis_name=AXIS, codec="topk", transport="gather",
                           local_momentum=True, ratio=0.05, min_size=1)
  state = init_stacked(tx, PARAMS)
  # the mean over workers of every local momentum after the freeze
  owed = jax.tree.map(jnp.zeros_like, PARAMS)
  delivered = jax.tree.map(jnp.zeros_like, PARAMS)  # the exchanged means
  for t in range(6):
    grads = worker_grads(PARAMS, seed=t)
    local = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state[0].mu, grads)
    out, new = run_pmap(tx, grads, state)
    assert_replicas_equal(out)
    if t >= freeze:  # per worker: its own momentum, not the mean
      assert_trees_close(new[0].mu, local, rtol=1e-6, atol=1e-7)
      assert not np.allclose(np.asarray(new[0].mu["w"][0]), np.asarray(new[0].mu["w"][1]))
      # the exchanged mean, recovered from the update -lr * m / bc1 / (sqrt(nu / bc2) + eps)
      bc1, bc2 = 1 - b1 ** (t + 1), 1 - 0.999 ** freeze
      mean = jax.tree.map(lambda o, v: o[0] / -LR * (np.sqrt(v[0] / bc2) + 1e-8) * bc1, out, new[0].nu)
      owed = jax.tree.map(lambda a, l: a + l.mean(0), owed, local)
      delivered = jax.tree.map(lambda a, m: a + m, delivered, mean)
    else:  # the warm-up: every worker holds the exact mean momentum
      assert_trees_close(new[0].mu, jax.tree.map(lambda l: jnp.broadcast_to(l.mean(0), l.shape), local),
                         rtol=1e-5, atol=1e-6)
    state = new
  residual = jaxcomp.memory_tree(tx.compressor, state[0].exchange, PARAMS)
  assert_trees_close(jax.tree.map(lambda d, r: d + r.mean(0), delivered, residual), owed,
                     rtol=1e-4, atol=1e-5)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="codec must be one of"):
    jaxcomp.onebit_adam(LR, codec="twobit")
  with pytest.raises(ValueError, match="freeze_step must be"):
    jaxcomp.onebit_adam(LR, freeze_step=-1)
  with pytest.raises(ValueError, match="b2 must be in"):
    jaxcomp.onebit_adam(LR, b2=1.0)
  with pytest.raises(TypeError, match="local_momentum must be True or False"):
    jaxcomp.onebit_adam(LR, local_momentum="yes")
  with pytest.raises(ValueError, match=r"var_floor must be in \[0, 1\]"):
    jaxcomp.onebit_adam(LR, var_floor=2.0)
  with pytest.raises(ValueError, match=r"var_floor must be in \[0, 1\]"):
    jaxcomp.zero_one_adam(LR, var_floor=-0.1)
  with pytest.raises(ValueError, match="not available for powersgd"):
    jaxcomp.onebit_adam(LR, codec="powersgd", axis_name=AXIS)
  tx = jaxcomp.onebit_adam(LR, codec="powersgd", transport="gather", axis_name=AXIS)
  assert tx.compressor.transport == "gather"


@pytest.mark.parametrize("make", ["onebit_adam", "zero_one_adam"])
def test_var_floor_bounds_the_step_of_an_entry_that_never_saw_a_gradient(make):
  """A dead unit (gradient 0 through the warm-up, variance 0) gets its leaf's 1-bit scale afterwards:
  without a floor its step is that scale over eps; with one, at most ~1/sqrt(var_floor) of Adam's step."""
  dead = {"w": jnp.zeros((N, 64, 48)).at[:, :, 0].set(1.0), "k": jnp.zeros((N, 3, 3, 8, 16)),
          "b": jnp.zeros((N, 48))}
  grads_of = lambda t: jax.tree.map(lambda g, d: g * (d != 0), worker_grads(PARAMS, seed=t), dead)  # noqa: E731
  steps = {}
  for floor in (0.0, 0.01):
    kw = {"var_floor": floor}
    tx = (jaxcomp.onebit_adam(LR, freeze_step=3, axis_name=AXIS, **kw) if make == "onebit_adam"
          else _zero_one(var_freeze_step=3, **kw))
    grads_late = lambda t: grads_of(t) if t < 3 else worker_grads(PARAMS, seed=t)  # noqa: E731
    history = _train(tx, 5, grads_late)
    out = np.asarray(history[-1][0]["w"])[0]
    steps[floor] = np.abs(out[:, 1:]).max() / LR  # the entries that were dead through the warm-up
  assert steps[0.0] > 1e5, steps  # measured 9.5e6 x lr
  assert steps[0.01] <= 100, steps  # 1/sqrt(0.01) x the leaf's mean-variance step (a 48th of it live)


def _zero_one(**kw):
  kw = {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 3, "local_step_clipper": 4, **kw}
  return jaxcomp.zero_one_adam(LR, axis_name=AXIS, **kw)


def _train(tx, steps, grads_of=lambda t: worker_grads(PARAMS, seed=t)):
  step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=AXIS)
  params = jaxcomp.per_worker(PARAMS, N)
  state = jaxcomp.per_worker(tx.init(PARAMS), N)
  history = []
  for t in range(steps):
    out, new = step(grads_of(t), state, params)
    if all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(out)):  # as optax.apply_if_finite
      params = optax.apply_updates(params, out)
    history.append((out, state, new, params))
    state = new
  return history


def test_zero_one_adam_variance_schedule_local_steps_and_syncs():
  history = _train(_zero_one(), 13)
  adam = optax.adam(LR)
  s = adam.init(PARAMS)
  for t in range(2):  # steps 1, 2: the variance interval is 1, every step dense: exact Adam
    want, s = adam.update(jax.tree.map(lambda g: g.mean(0), worker_grads(PARAMS, seed=t)), s)
    assert_trees_close(jax.tree.map(lambda o: o[0], history[t][0]), want, rtol=2e-5, atol=1e-7)
  var_steps = [t + 1 for t, (_, old, new, _) in enumerate(history)
               if not np.array_equal(np.asarray(old.nu["w"]), np.asarray(new.nu["w"]))]
  assert var_steps == [1, 2, 4, 6], var_steps  # interval 1 twice, then 2 (then frozen from step 7)
  # local steps from step 7: interval 1 for 3 steps (every step syncs), then 2 (steps 10, 12 sync)
  for t in range(6, 13):
    params = history[t][3]
    agree = all(np.allclose(np.asarray(x), np.asarray(x)[:1], rtol=0, atol=1e-6)
                for x in jax.tree.leaves(params))
    assert agree == ((t + 1) in (7, 8, 9, 10, 12)), (t + 1, agree)
  for _, _, new, params in history:
    for leaf in jax.tree.leaves((new.mu, new.nu, params)):
      assert np.all(np.isfinite(np.asarray(leaf)))
  assert int(np.asarray(history[-1][2].local_interval)[0]) == 4  # doubled after steps 9 and 12 (clipped at 4)


def test_zero_one_adam_sends_one_bit_and_skips_a_nan_step():
  tx = _zero_one(var_freeze_step=1000)
  big = {"w": jnp.zeros((1024, 512)), "b": jnp.zeros((512,))}
  assert jaxcomp.wire_bytes(jaxcomp.none(axis_name=AXIS), big) / jaxcomp.wire_bytes(tx, big, workers=N) >= 16

  def grads_of(t):
    g = worker_grads(PARAMS, seed=t)
    return {**g, "w": harness.set_at(g["w"], (2, 0, 0), jnp.nan)} if t == 3 else g

  history = _train(tx, 5, grads_of)
  out, old, new, _ = history[3]
  for leaf in jax.tree.leaves(out):
    assert np.all(np.isnan(np.asarray(leaf)))
  for a, b in zip(jax.tree.leaves((new.mu, new.nu)), jax.tree.leaves((old.mu, old.nu))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for leaf in jax.tree.leaves(history[4][0]):
    assert np.all(np.isfinite(np.asarray(leaf)))
  with pytest.raises(ValueError, match="local_step_clipper must be"):
    jaxcomp.zero_one_adam(LR, local_step_clipper=0)
