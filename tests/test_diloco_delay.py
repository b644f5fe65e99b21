"""Streaming DiLoCo's overlap: ``jaxcomp.diloco(..., delay=tau, alpha=a)``.

A fragment's pseudo-gradient is the parameters' at the start of its send step, its reduction runs in that
step without reading the step's gradients (proved on the compiled HLO of a whole training step), and its
outer result lands tau - 1 steps later, mixed with the local fragment by alpha.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import AXIS, N, pmap_scan, worker_grads

import jaxcomp
from jaxcomp.collectives import hlo_deps
from jaxcomp.training.diloco import fragment_leaves, leaf_costs, sync_table

H = 4


def _tree():
  return {"a": 1.0 + jnp.zeros((6, 5)), "b": jnp.full((7,), 2.0), "c": jnp.full((3, 4), -1.5),
          "d": jnp.full((9,), 0.75)}


def _grads(params, steps, seed=0):
  g = worker_grads(jax.tree.map(lambda p: jnp.zeros((steps,) + p.shape), params), seed=seed)
  return jax.tree.map(lambda x: 0.1 * x, g)


def _reference(params, grads, lr, outer, fragments, delay, alpha, steps, frags):
  """Streaming DiLoCo with the paper's update, in numpy over stacked workers (float64)."""
  leaves, treedef = jax.tree.flatten(params)
  gl = [np.asarray(g, np.float64) for g in treedef.flatten_up_to(grads)]
  p = [np.broadcast_to(np.asarray(x, np.float64), (N,) + x.shape).copy() for x in leaves]
  anchor = [np.asarray(x, np.float64) for x in leaves]
  outer_states = [outer.init([jnp.asarray(anchor[i], jnp.float32) for i in f]) for f in frags]
  send = sync_table(H, fragments, 1 if delay else 0)
  land = sync_table(H, fragments, delay)
  history = []
  for t in range(steps):
    q = send[t % H]
    if delay and q < fragments and t >= 1:  # the start-of-step parameters: before this step's update
      mean = [np.mean(anchor[i] - p[i], axis=0) for i in frags[q]]
      upd, outer_states[q] = outer.update([jnp.asarray(m, jnp.float32) for m in mean], outer_states[q])
      for i, s in zip(frags[q], upd):
        anchor[i] = anchor[i] + np.asarray(s, np.float64)
    local = [p[i] - lr * gl[i][:, t] for i in range(len(p))]
    if not delay and q < fragments:
      mean = [np.mean(anchor[i] - local[i], axis=0) for i in frags[q]]
      upd, outer_states[q] = outer.update([jnp.asarray(m, jnp.float32) for m in mean], outer_states[q])
      for i, s in zip(frags[q], upd):
        anchor[i] = anchor[i] + np.asarray(s, np.float64)
    r = land[t % H]
    if r < fragments and t >= delay:
      for i in frags[r]:
        local[i] = alpha * local[i] + (1 - alpha) * anchor[i]
    p = local
    history.append([x.copy() for x in p])
  return history


@pytest.mark.parametrize("fragments,delay,alpha", [(1, 1, 0.0), (2, 2, 0.5), (2, 1, 0.0), (1, 4, 0.5),
                                                   (2, 0, 0.5)])
def test_delay_and_alpha_follow_the_paper_update(fragments, delay, alpha):
  """8 workers, inner SGD, outer Nesterov, dense mean, H = 4: every step's parameters on every worker
  match a float64 reference of Streaming DiLoCo (send at the start of a step, land tau - 1 steps later as
  alpha * local + (1 - alpha) * anchor)."""
  params, steps, lr = _tree(), 3 * H + 2, 0.5
  grads = _grads(params, steps)
  outer = optax.sgd(0.8, momentum=0.5, nesterov=True)
  tx = jaxcomp.diloco(optax.sgd(lr), outer, sync_every=H, axis_name=AXIS, fragments=fragments,
                      delay=delay, alpha=alpha)
  got = pmap_scan(tx, params, grads)[0]
  frags = fragment_leaves(leaf_costs(tx.compressor, jax.tree.leaves(params)), fragments)
  want = _reference(params, grads, lr, outer, fragments, delay, alpha, steps, frags)
  for t in range(steps):
    for i, x in enumerate(jax.tree.leaves(got)):
      np.testing.assert_allclose(x[:, t], want[t][i], rtol=2e-6, atol=2e-6, err_msg=f"step {t}, leaf {i}")


def test_replicas_land_on_the_anchor_bit_for_bit_tau_minus_one_steps_after_the_send():
  """alpha = 0, delay = 3: the workers differ before the landing and hold the state's anchor bit for bit
  right after it (the same bits on every worker); the anchor moved at the send, two steps earlier."""
  params, steps = _tree(), 2 * H + 3
  tx = jaxcomp.diloco(optax.adamw(1e-2), sync_every=H, axis_name=AXIS, delay=3,
                      compressor=jaxcomp.topk(0.25, axis_name=AXIS, min_size=1))
  ps, states = pmap_scan(tx, params, _grads(params, steps, seed=3))
  anchors = states.anchor
  for p, a in zip(jax.tree.leaves(ps), jax.tree.leaves(anchors), strict=True):
    np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape))  # shared by every worker
    for t in range(steps):
      if t >= 3 and t % H == 2:  # sent in step t - 2 (t - 2 = 0 mod H, not step 0), landed in step t
        np.testing.assert_array_equal(p[:, t], a[:, t])
        assert not np.array_equal(a[:, t - 3], a[:, t - 2])  # the anchor moves at the send
        np.testing.assert_array_equal(a[:, t - 2], a[:, t])  # and not again until the next send
      elif t:
        assert not np.array_equal(p[0, t], p[1, t]), t


def test_bytes_at_counts_the_send_steps():
  params = _tree()
  comp = jaxcomp.fp4(axis_name=AXIS, min_size=1)
  tx = jaxcomp.diloco(optax.adamw(1e-3), sync_every=H, compressor=comp, axis_name=AXIS, fragments=2,
                      delay=2)
  plain = jaxcomp.diloco(optax.adamw(1e-3), sync_every=H, compressor=comp, axis_name=AXIS, fragments=2)
  got = [tx.bytes_at(t, params) for t in range(3 * H)]
  want = [plain.bytes_at(t - 1, params) if t else 0 for t in range(3 * H)]  # one step later, none at 0
  assert got == want and sum(got) > 0


def test_errors_name_delay_and_alpha():
  inner = optax.sgd(0.1)
  for bad in (-1, H + 1):
    with pytest.raises(ValueError, match=rf"delay must be in \[0, {H}\], got delay={bad}"):
      jaxcomp.diloco(inner, sync_every=H, delay=bad)
  with pytest.raises(TypeError, match="delay must be an int"):
    jaxcomp.diloco(inner, sync_every=H, delay=1.5)
  for bad in (-0.1, 1.0, float("nan")):
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\)"):
      jaxcomp.diloco(inner, sync_every=H, alpha=bad)


def _loss(p, x, y):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def _step_hlo(tx, params):
  """The compiled HLO of a whole training step under pmap and the entry parameters holding the batch."""
  def step(p, s, x, y):
    g = jax.grad(_loss)(p, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  P, S = jaxcomp.per_worker(params, N), jaxcomp.per_worker(tx.init(params), N)
  x, y = jnp.ones((N, 7, 13)), jnp.ones((N, 7, 3))
  hlo = jax.pmap(step, axis_name=AXIS).lower(P, S, x, y).compile().as_text()
  batch = [i for i, shape in hlo_deps.entry_parameters(hlo) if re.match(r"f32\[(1,)?7,(13|3)\]", shape)]
  assert len(batch) == 2, hlo_deps.entry_parameters(hlo)
  return hlo, batch


@pytest.mark.parametrize("fragments,delay,codec", [(1, 1, "topk"), (4, 2, "fp4")])
def test_the_sync_collective_does_not_read_the_steps_gradient(fragments, delay, codec):
  """The compiled program of forward, backward, tx.update and the parameter update: with delay >= 1 no
  collective's operands depend on the batch (so on the gradient); with delay 0 (the pseudo-gradient after
  the step's inner update) the same check finds the dependency."""
  params = {"w1": 0.1 * jnp.ones((13, 32)), "b1": jnp.zeros((32,)), "w2": 0.1 * jnp.ones((32, 3)),
            "b2": jnp.zeros((3,))}
  for tau in (delay, 0):
    tx = jaxcomp.diloco(optax.adamw(1e-3), sync_every=8, axis_name=AXIS, fragments=fragments, delay=tau,
                        compressor=getattr(jaxcomp, codec)(axis_name=AXIS, min_size=1))
    hlo, batch = _step_hlo(tx, params)
    reads = hlo_deps.collectives_reading(hlo, batch)
    assert reads, "a sync must communicate"
    if tau:
      assert not any(reads.values()), reads
    else:
      assert all(reads.values()), reads
