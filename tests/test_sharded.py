"""data_parallel(param_specs=...): parameters sharded over a fast axis, compressed over the slow one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import plain_gspmd
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp

ROWS = 4  # rows per device
SPECS = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P()}


def _params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w1": 0.1 * jax.random.normal(k1, (64, 256)), "b1": jnp.zeros((256,)),
          "w2": 0.1 * jax.random.normal(k2, (256, 32)), "b2": jnp.zeros((32,))}


def _loss(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def _data(seed):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((8 * ROWS, 64)).astype(np.float32),
          rng.standard_normal((8 * ROWS, 32)).astype(np.float32))


def _mesh():
  return jax.make_mesh((2, 4), ("dcn", "fsdp"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])


def _run(tx, mesh, steps, param_specs=None):
  dp = jaxcomp.data_parallel(_loss, tx, mesh, param_specs=param_specs)
  params, state = dp.init(_params())
  losses = []
  for t in range(steps):
    params, state, loss = dp.step(params, state, _data(t))
    losses.append(float(loss))
  return dp, params, state, losses


def test_dense_sharded_equals_replicated_and_stays_sharded():
  mesh = _mesh()
  want = _run(optax.chain(jaxcomp.none(axis_name=("dcn", "fsdp")), optax.sgd(0.1)), mesh, 5)
  got = _run(optax.chain(jaxcomp.none(axis_name="dcn"), optax.sgd(0.1, momentum=0.0)), mesh, 5, SPECS)
  np.testing.assert_allclose(got[3], want[3], rtol=1e-5)
  for k, spec in SPECS.items():
    np.testing.assert_allclose(np.asarray(got[1][k]), np.asarray(want[1][k]), rtol=1e-5, atol=1e-6)
    assert got[1][k].sharding.is_equivalent_to(NamedSharding(mesh, spec), got[1][k].ndim), k


def test_sharded_specs_from_named_shardings_and_errors():
  mesh = _mesh()
  shard = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  tx = optax.chain(jaxcomp.topk(0.1, axis_name="dcn"), optax.sgd(0.1))
  _, params, _, losses = _run(tx, mesh, 3, shard)
  assert np.isfinite(losses).all()
  assert params["w1"].sharding.is_equivalent_to(shard["w1"], 2)
  with pytest.raises(ValueError, match="param_specs: .* the axis the jaxcomp transform compresses over"):
    jaxcomp.data_parallel(_loss, tx, mesh, param_specs={**SPECS, "b2": P("dcn")}).init(_params())
  with pytest.raises(ValueError, match="param_specs: .* not axes of the mesh"):
    jaxcomp.data_parallel(_loss, tx, mesh, param_specs={**SPECS, "b2": P("tensor")}).init(_params())
  hier = optax.chain(jaxcomp.topk(0.1, axis_name="dcn", dense_axis_name="fsdp"), optax.sgd(0.1))
  with pytest.raises(ValueError, match="dense_axis_name"):
    jaxcomp.data_parallel(_loss, hier, mesh, param_specs=SPECS).init(_params())


@pytest.mark.parametrize("method", ["topk", "qsgd"])
def test_slow_axis_carries_the_shards_payload_and_state_is_a_shard(method):
  mesh = _mesh()
  comp = jaxcomp.METHODS[method](axis_name="dcn")
  dp, params, state, _ = _run(optax.chain(comp, optax.sgd(0.1)), mesh, 2, SPECS)
  hlo = dp_hlo(dp, params, state)
  shard = {k: jax.ShapeDtypeStruct(params[k].addressable_shards[0].data.shape, jnp.float32) for k in SPECS}
  by_size = jaxcomp.collective_bytes(hlo)["by_group_size"]
  # over dcn (groups of 2): the compressed shards and nothing dense but the loss's mean (one float32)
  assert by_size.get(2, 0) == jaxcomp.wire_bytes(comp, shard) + 4
  # jaxcomp's state per device: that of the device's shards, 1/4 of a replicated run's
  rep = jaxcomp.data_parallel(_loss, optax.chain(jaxcomp.METHODS[method](axis_name=("dcn", "fsdp")),
                                                 optax.sgd(0.1)), mesh)
  _, rep_state = rep.init(_params())

  def per_device(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree[0].memory))

  assert per_device(state) * 4 <= per_device(rep_state) * 1.05


def dp_hlo(dp, params, state):
  """The compiled step's HLO text."""
  batch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(_mesh(), P(("dcn", "fsdp")))), _data(9))
  return dp.lower(params, state, batch).compile().as_text()


def _flops(dp, params, state):
  batch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(_mesh(), P(("dcn", "fsdp")))), _data(9))
  cost = dp.lower(params, state, batch).compile().cost_analysis()
  return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def test_compute_is_split_over_every_device():
  """Per-device FLOPs of the sharded step within 1.3x of plain data parallelism over all 8 devices."""
  mesh = _mesh()
  plain = _run(optax.chain(jaxcomp.none(axis_name=("dcn", "fsdp")), optax.sgd(0.1)), mesh, 1)
  fsdp = _run(optax.chain(jaxcomp.none(axis_name="dcn"), optax.sgd(0.1)), mesh, 1, SPECS)
  assert _flops(*fsdp[:3]) <= 1.3 * _flops(*plain[:3])


def test_flax_nnx_partition_specs_work_as_they_are():
  nnx = pytest.importorskip("flax.nnx")
  init = nnx.initializers.lecun_normal()

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(64, 256, kernel_init=nnx.with_partitioning(init, (None, "fsdp")), rngs=rngs)
      self.l2 = nnx.Linear(256, 32, kernel_init=nnx.with_partitioning(init, ("fsdp", None)), rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.l1(x)))

  mesh = _mesh()
  with jax.set_mesh(mesh):  # flax creates annotated variables sharded on the mesh in context
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
  specs = nnx.get_partition_spec(params)

  def loss(p, batch):
    x, y = batch
    return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

  tx = optax.chain(jaxcomp.topk(0.1, axis_name="dcn"), optax.sgd(0.1))
  dp = jaxcomp.data_parallel(loss, tx, mesh, param_specs=specs)
  p, s = dp.init(params)
  for t in range(3):
    p, s, value = dp.step(p, s, _data(t))
  assert np.isfinite(float(value))
  kernel = jax.tree.leaves(p["l1"]["kernel"])[0]
  assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp")), 2)


def test_checkpoint_restores_sharded_params_and_per_device_states_bitwise(tmp_path):
  """3 steps, save, 3 more == restore into a fresh data_parallel's init output, the same 3 steps."""
  mesh = _mesh()
  tx = optax.chain(jaxcomp.topk(0.1, axis_name="dcn"), optax.sgd(0.1, momentum=0.9))  # 2 states per shard
  dp = jaxcomp.data_parallel(_loss, tx, mesh, param_specs=SPECS)
  carry = dp.init(_params())
  for t in range(3):
    *carry, _ = dp.step(*carry, _data(t))
  jaxcomp.checkpoint.save(str(tmp_path / "3"), tuple(carry))
  saved = [x.sharding for x in jax.tree.leaves(carry)]  # before the steps donate the arrays
  for t in range(3, 6):
    *carry, _ = dp.step(*carry, _data(t))

  fresh = jaxcomp.data_parallel(_loss, tx, _mesh(), param_specs=SPECS)
  restored = jaxcomp.checkpoint.restore(str(tmp_path / "3"), fresh.init(_params()))
  leaves = jax.tree.leaves(restored)
  assert [x.sharding for x in leaves] == saved
  assert {x.sharding.spec for x in jax.tree.leaves(restored[1])} == {P(("dcn", "fsdp"))}  # per device
  for t in range(3, 6):
    *restored, _ = fresh.step(*restored, _data(t))
  want, got = jax.tree.leaves(carry), jax.tree.leaves(restored)
  assert len(got) == len(want) == len(leaves) > len(SPECS)
  for a, b in zip(want, got, strict=True):
    assert b.sharding == a.sharding
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


@pytest.mark.parametrize("axes", [("dcn", "fsdp"), ("dcn", "fsdp", "tensor")])
def test_sharded_update_is_dense_whichever_axes_split_the_batch(axes):
  """Batch split the MaxText way (over dcn and fsdp, not tensor): every leaf, tensor-sharded ones too,
  gets the dense update (it got 2x on leaves sharded over "tensor" when "tensor" split no batch)."""
  mesh = jax.make_mesh((2, 2, 2), ("dcn", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                       devices=jax.devices()[:8])
  specs = {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp"), "b2": P()}
  rows = 4 * int(np.prod([mesh.shape[a] for a in axes]))
  batches = [tuple(a[:rows] for a in _data(t)) for t in range(3)]
  want = plain_gspmd(_loss, _params(), specs, mesh, batches)
  dp = jaxcomp.data_parallel(_loss, optax.chain(jaxcomp.none(axis_name="dcn"), optax.sgd(0.1)), mesh,
                             axes=axes, param_specs=specs)
  params, state = dp.init(_params())
  for batch in batches:
    params, state, _ = dp.step(params, state, batch)
  start = _params()
  for k in specs:
    moved = np.asarray(params[k]) - np.asarray(start[k])
    want_moved = np.asarray(want[k]) - np.asarray(start[k])
    np.testing.assert_allclose(moved, want_moved, rtol=1e-4, atol=1e-4 * np.abs(want_moved).max(), err_msg=k)
