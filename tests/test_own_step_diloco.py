"""Sharded DiLoCo in the user's own jit step: a replica per slice of "dcn", each sharded over fsdp and tensor.

``jaxcomp.per_slice(..., replica_argnums=0)`` computes each replica's gradient on its slice's rows under
GSPMD (tensor parallelism real), ``jaxcomp.on_shards(jaxcomp.diloco(...))`` runs DiLoCo on each
device's shards with the parameters stacked one replica per slice. Checked against DiLoCo under pmap over
2 workers whose gradient is their slice's, and in the compiled program (no weight crosses "tensor",
only syncs cross "dcn").
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.collectives import hlo

D, HID, ROWS, H = 32, 64, 32, 3
SPECS = {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp"), "b2": P()}
STACKED = {k: P("dcn", *s) for k, s in SPECS.items()}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 2, 2), ("dcn", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                       devices=jax.devices()[:8])


def _params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w1": jax.random.normal(k1, (D, HID)) / 4, "b1": jnp.full((HID,), 0.1),
          "w2": jax.random.normal(k2, (HID, D)) / 8, "b2": jnp.full((D,), -0.1)}


def _plain_loss(p, batch):
  x, y = batch
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def _loss(p, batch):  # with an activation constraint over the fast axes, as MaxText's layers
  x, y = batch
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  h = jax.lax.with_sharding_constraint(h, P("fsdp", "tensor"))
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def _batches(steps):
  r = np.random.default_rng(0)
  x = r.standard_normal((steps, ROWS, D)).astype(np.float32)
  return x, np.tanh(x[..., ::-1]) + 0.1 * r.standard_normal((steps, ROWS, D)).astype(np.float32)


def _tx(compressor, axis_name="dcn"):
  return jaxcomp.diloco(optax.adamw(1e-2), optax.sgd(0.9, momentum=0.3, nesterov=True), sync_every=H,
                        compressor=compressor, axis_name=axis_name)


def _sharded_run(mesh, diloco, steps):
  tx = jaxcomp.on_shards(diloco, mesh, SPECS, "dcn")
  grad_fn = jaxcomp.per_slice(jax.value_and_grad(_loss), mesh, "dcn", batch_argnums=1, replica_argnums=0)

  @jax.jit
  def step(params, state, batch):
    loss, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss.mean()

  one = jax.device_put(_params(), {k: NamedSharding(mesh, s) for k, s in SPECS.items()})
  state = jax.jit(tx.init)(one)
  params = jax.device_put(jaxcomp.per_worker(_params(), 2),
                          {k: NamedSharding(mesh, s) for k, s in STACKED.items()})
  x, y = _batches(steps)
  rows = NamedSharding(mesh, P(("dcn", "fsdp")))
  out = []
  for t in range(steps):
    params, state, _ = step(params, state, jax.device_put((x[t], y[t]), rows))
    out.append(jax.device_get(params))
  return out, step, params, state, (x[0], y[0])


def test_each_replica_equals_pmap_diloco_on_its_slices_rows(mesh):
  """Dense pseudo-gradient mean, 2 * H + 1 steps (two syncs): every replica after every step equals the
  replica of DiLoCo under pmap over 2 workers whose gradient is that of their slice's rows (float32
  reduction order); after each sync the two replicas hold the anchor (to diloco's half ulp)."""
  steps = 2 * H + 1
  got, _, params, _, _ = _sharded_run(mesh, _tx(jaxcomp.none(axis_name="dcn")), steps)
  x, y = _batches(steps)
  half = ROWS // 2
  ref = jaxcomp.per_worker(_params(), 2)
  tx = _tx(jaxcomp.none(axis_name="data"), "data")
  state = jaxcomp.per_worker(tx.init(_params()), 2)
  stepper = jax.pmap(lambda p, s, xb, yb: _ref_step(tx, p, s, xb, yb), axis_name="data",
                     devices=jax.devices()[:2])
  for t in range(steps):
    xb = x[t].reshape(2, half, D)
    yb = y[t].reshape(2, half, D)
    ref, state = stepper(ref, state, xb, yb)
    for k in SPECS:
      np.testing.assert_allclose(got[t][k], np.asarray(ref[k]), rtol=2e-5, atol=2e-6, err_msg=f"{k} {t}")
    gap = max(float(np.abs(got[t][k][0] - got[t][k][1]).max()) for k in SPECS)
    # after a sync: the anchor, to the half ulp of a parameter crossing zero (jaxcomp.diloco's bound)
    assert (gap <= 1e-6) == (t % H == H - 1), (t, gap)
  for k, s in STACKED.items():
    assert params[k].sharding.is_equivalent_to(NamedSharding(mesh, s), params[k].ndim), k


def _ref_step(tx, p, s, xb, yb):
  g = jax.grad(_plain_loss)(p, (xb, yb))
  u, s = tx.update(g, s, p)
  return optax.apply_updates(p, u), s


def test_compiled_step_keeps_tensor_parallelism_and_compresses_over_dcn(mesh):
  """Top-k pseudo-gradients: what crosses "dcn" is the sync's top-k payload of each device's shards (no
  more than 1.2x its wire_bytes), nothing gathers the weights over "tensor"; the run trains."""
  topk = jaxcomp.topk(0.1, axis_name="dcn", min_size=1)
  got, step, params, state, batch = _sharded_run(mesh, _tx(topk), 2 * H)
  text = step.lower(params, state, jax.device_put(batch, NamedSharding(mesh, P(("dcn", "fsdp"))))
                    ).compile().as_text()
  by_axes = hlo.bytes_by_axes(text, mesh)
  weights = 4 * sum(int(np.prod(v.shape)) for v in _params().values())
  assert by_axes.get(("tensor",), 0) < 0.25 * weights, by_axes
  over_dcn = sum(b for axes, b in by_axes.items() if "dcn" in axes)
  assert 0 < over_dcn < 0.5 * weights, by_axes
  for t in (H - 1, 2 * H - 1):
    for k in SPECS:
      np.testing.assert_allclose(got[t][k][0], got[t][k][1], rtol=0, atol=1e-6)


def test_unstacked_parameters_are_refused(mesh):
  tx = jaxcomp.on_shards(_tx(jaxcomp.none(axis_name="dcn")), mesh, SPECS, "dcn")
  one = jax.device_put(_params(), {k: NamedSharding(mesh, s) for k, s in SPECS.items()})
  state = jax.jit(tx.init)(one)
  grads = jax.tree.map(lambda p: jnp.zeros((2,) + p.shape), _params())
  with pytest.raises(ValueError, match="leading axis of one replica per slice"):
    jax.jit(tx.update)(grads, state, one)
  with pytest.raises(ValueError, match="replica argument 0 leaf .* needs a leading axis of 2"):
    x, y = _batches(1)
    jaxcomp.per_slice(jax.grad(_loss), mesh, "dcn", replica_argnums=0)(one, (x[0], y[0]))
