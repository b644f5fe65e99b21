"""Schedules of a method's settings: jaxcomp.staged and DGC's exponential warm-up for any ratio."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
  AXIS,
  assert_replicas_equal,
  init_stacked,
  pmap_wire_bytes,
  run_pmap,
  run_shard_map,
  worker_grads,
)

import jaxcomp

PARAMS = {"w": jnp.zeros((40, 64)), "b": jnp.zeros((24,))}  # one compressed leaf, one dense


def test_warmup_stages_follow_dgc_schedule():
  stages = jaxcomp.warmup_stages(0.001, 400)
  assert stages == [(0, 0.25), (100, 0.0625), (200, 0.015625), (300, 0.00390625), (400, 0.001)]
  sched = jaxcomp.dgc_warmup_schedule(0.001, 37)
  table = jaxcomp.warmup_stages(0.001, 37)
  for step in range(45):
    density = [d for first, d in table if first <= step][-1]
    assert float(sched(step)) == pytest.approx(density, rel=1e-6), step
  # stages at or below the target merge into it
  assert jaxcomp.warmup_stages(0.1, 40) == [(0, 0.25), (10, 0.1)]


def test_ratio_warmup_sends_each_stage_density_and_shrinks_its_payload():
  tx = jaxcomp.ratio_warmup(jaxcomp.topk, 0.01, 6, stages=3, axis_name=AXIS, min_size=100)
  assert [f for f, _ in tx.method.stages] == [2, 4, 6]
  nbytes = [jaxcomp.wire_bytes(tx, PARAMS, step=s) for s in range(8)]
  assert nbytes[0] == nbytes[1] > nbytes[2] == nbytes[3] > nbytes[4] == nbytes[5] > nbytes[6] == nbytes[7]
  assert nbytes[7] == jaxcomp.wire_bytes(tx, PARAMS) == jaxcomp.wire_bytes(
      jaxcomp.topk(0.01, axis_name=AXIS, min_size=100), PARAMS)
  # one program: every stage's collectives once, the non-finite flag shared
  flag = 4
  assert pmap_wire_bytes(tx, PARAMS)["total"] == flag + sum(
      jaxcomp.wire_bytes(tx, PARAMS, step=s) - flag for s in (0, 2, 4, 6))
  # the steady state alone: the last stage's program
  assert pmap_wire_bytes(jaxcomp.steady(tx), PARAMS)["total"] == nbytes[7]
  plain = jaxcomp.topk(0.01, axis_name=AXIS)
  assert jaxcomp.steady(plain) is plain
  state = init_stacked(tx, PARAMS)
  n = 40 * 64
  for step, density in enumerate([0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01]):
    g = worker_grads(PARAMS, seed=step)
    old = jaxcomp.memory_tree(tx, state, PARAMS)["w"]
    out, state = run_pmap(tx, g, state)
    assert_replicas_equal(out)
    new = jaxcomp.memory_tree(tx, state, PARAMS)["w"]
    sent = np.asarray(g["w"]) + np.asarray(old) - np.asarray(new)  # what each worker sent
    per_worker = np.count_nonzero(np.abs(sent) > 1e-6, axis=(1, 2))
    np.testing.assert_array_equal(per_worker, int(np.ceil(density * n)))
    # error feedback: the mean of what was sent is the output, nothing else is lost
    np.testing.assert_allclose(np.asarray(out["w"])[0], sent.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out["b"])[0], np.asarray(g["b"]).mean(0), rtol=1e-6)


def test_staged_composes_with_memory_and_dense_start_under_shard_map():
  stages = jaxcomp.staged([(0, jaxcomp.randomk(0.5, axis_name=AXIS, min_size=100)),
                           (3, jaxcomp.randomk(0.05, axis_name=AXIS, min_size=100))])
  tx = jaxcomp.configure(stages, memory=jaxcomp.momentum_correction(0.9), start_step=1)
  assert [jaxcomp.wire_bytes(tx, PARAMS, step=s) for s in range(4)][0] == 4 * (40 * 64 + 128) + 4
  sp = sm = init_stacked(tx, PARAMS)
  for step in range(4):
    g = worker_grads(PARAMS, seed=step)
    op, sp = run_pmap(tx, g, sp)
    om, sm = run_shard_map(tx, g, sm)
    assert_replicas_equal(op)
    for a, b in zip(jax.tree.leaves((op, sp)), jax.tree.leaves((om, sm))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if step == 0:  # the dense start: the mean of the momenta, nothing kept
      np.testing.assert_allclose(np.asarray(op["w"])[0], np.asarray(g["w"]).mean(0), rtol=1e-5, atol=1e-6)
    else:
      assert 0 < np.mean(np.asarray(op["w"])[0] != 0) < 1


@pytest.mark.parametrize("make", [
    lambda: jaxcomp.staged([(0, jaxcomp.randomk(0.5, axis_name=AXIS, min_size=100)),
                            (1, jaxcomp.randomk(0.05, axis_name=AXIS, min_size=100))]),
    lambda: jaxcomp.dgc(0.05, axis_name=AXIS, warmup_steps=2, min_size=100),  # stages share thresholds
], ids=["randomk", "dgc"])
def test_a_dense_start_past_a_stage_boundary_stays_dense(make):
  """Before ``start_step`` every step is dense, whichever stage the count has reached (the program
  once switched to a compressed stage at a step past a stage's first step but before the start)."""
  tx = jaxcomp.configure(make(), start_step=3)
  assert tx.method.stages and tx.method.stages[0][0] < 3
  sizes = [jaxcomp.wire_bytes(tx, PARAMS, step=s) for s in range(4)]
  assert sizes[0] == sizes[1] == sizes[2] > sizes[3], sizes
  state = init_stacked(tx, PARAMS)
  for step in range(4):
    g = worker_grads(PARAMS, seed=step)
    out, state = run_pmap(tx, g, state)
    dense = np.mean(np.asarray(out["w"])[0] != 0) == 1
    assert dense == (step < 3), step
    if step == 0:  # DGC's momentum enters from the second step on
      np.testing.assert_allclose(np.asarray(out["w"])[0], np.asarray(g["w"]).mean(0), rtol=1e-5, atol=1e-7)


def test_staged_names_bad_stages():
  t = jaxcomp.topk(0.1, axis_name=AXIS)
  with pytest.raises(ValueError, match="starting at 0"):
    jaxcomp.staged([(1, t)])
  with pytest.raises(ValueError, match="increasing"):
    jaxcomp.staged([(0, t), (5, t), (5, t)])
  with pytest.raises(ValueError, match="at least one"):
    jaxcomp.staged([])
  with pytest.raises(TypeError, match="not a jaxcomp transformation"):
    jaxcomp.staged([(0, t), (5, "topk")])
  with pytest.raises(ValueError, match="differs from the first"):
    jaxcomp.staged([(0, t), (5, jaxcomp.randomk(0.1, axis_name=AXIS))])
  with pytest.raises(ValueError, match="differs from the first"):
    jaxcomp.staged([(0, t), (5, jaxcomp.topk(0.1, axis_name="other"))])
  with pytest.raises(ValueError, match="start_step"):
    jaxcomp.staged([(0, t), (5, jaxcomp.configure(t, start_step=2))])
  rank = jaxcomp.staged([(0, jaxcomp.powersgd(rank=4)), (5, jaxcomp.powersgd(rank=2))])
  with pytest.raises(ValueError, match="state of another shape.*rank"):
    rank.init(PARAMS)
  with pytest.raises(ValueError, match="warmup_steps"):
    jaxcomp.ratio_warmup(jaxcomp.topk, 0.01, -1)
  with pytest.raises(ValueError, match="step must be"):
    jaxcomp.wire_bytes(t, PARAMS, step=-1)
