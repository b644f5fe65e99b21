"""The user's own jit step: jaxcomp.per_slice + jaxcomp.on_shards on a (dcn, fsdp, tensor) mesh.

A 2-layer Megatron MLP (first weight split by columns over "tensor", second by
rows) under GSPMD, the batch over ("dcn", "fsdp"); jaxcomp compresses over
"dcn" alone. Checked against plain optax under GSPMD, and in the compiled
program: the bytes over "dcn" are jaxcomp.wire_bytes of each device's shards,
no weight is gathered over "tensor", the state is the size of the shards.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import own_step, plain_gspmd
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.collectives import hlo
from jaxcomp.training import sharded

D, H, ROWS = 128, 512, 64
SPECS = {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp"), "b2": P()}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 2, 2), ("dcn", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                       devices=jax.devices()[:8])


def _params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w1": jax.random.normal(k1, (D, H)) / 8, "b1": jnp.zeros(H),
          "w2": jax.random.normal(k2, (H, D)) / 16, "b2": jnp.zeros(D)}


def _loss(p, batch):
  x, y = batch
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  # An activation constraint as MaxText's layers write them: fast axes only (naming the slow axis
  # inside per_slice is an error; the slow axis gets a mesh axis of its own, see docs/own-step.md)
  h = jax.lax.with_sharding_constraint(h, P("fsdp", "tensor"))
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def _batch(t, mesh):
  r = np.random.default_rng(t)
  xy = (r.standard_normal((ROWS, D)).astype(np.float32), r.standard_normal((ROWS, D)).astype(np.float32))
  return jax.device_put(xy, NamedSharding(mesh, P(("dcn", "fsdp"))))


def _sharded_params(mesh):
  return jax.device_put(_params(), jax.tree.map(lambda s: NamedSharding(mesh, s), SPECS))


def _own_step(mesh, method, lr=0.1):
  return own_step(_loss, optax.chain(method, optax.sgd(lr)), mesh, SPECS)


def test_none_equals_plain_optax_under_gspmd_over_10_steps(mesh):
  want = plain_gspmd(_loss, _params(), SPECS, mesh, [_batch(t, mesh) for t in range(10)])
  tx, step = _own_step(mesh, jaxcomp.none(axis_name="dcn"))
  params = _sharded_params(mesh)
  state = jax.jit(tx.init)(params)
  for t in range(10):
    params, state, loss = step(params, state, _batch(t, mesh))
  start = _params()
  for k, spec in SPECS.items():
    moved, want_moved = np.asarray(params[k] - start[k]), np.asarray(want[k] - start[k])
    np.testing.assert_allclose(moved, want_moved, rtol=1e-5, atol=1e-5 * np.abs(want_moved).max(), err_msg=k)
    assert params[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), params[k].ndim), k
  assert np.isfinite(float(loss))


@pytest.mark.parametrize("name", ["topk", "qsgd"])
def test_slow_axis_carries_the_shards_payload_and_nothing_gathers_over_tensor(mesh, name):
  method = jaxcomp.METHODS[name](axis_name="dcn")
  tx, step = _own_step(mesh, method)
  params = _sharded_params(mesh)
  state = jax.jit(tx.init)(params)
  text = step.lower(params, state, _batch(0, mesh)).compile().as_text()
  by_axes = hlo.bytes_by_axes(text, mesh)
  shards = {k: jax.ShapeDtypeStruct(sharded.shard_shape(v.shape, SPECS[k], mesh), jnp.float32)
            for k, v in _params().items()}
  nominal = jaxcomp.wire_bytes(method, shards)
  over_dcn = sum(b for axes, b in by_axes.items() if "dcn" in axes)
  assert nominal <= over_dcn <= 1.2 * nominal, (by_axes, nominal)
  assert by_axes.get(("dcn",), 0) == over_dcn  # nothing spans dcn and a fast axis
  # Tensor parallelism stays real: what crosses "tensor" is activations, not the weights
  weights = 4 * sum(int(np.prod(v.shape)) for v in _params().values())
  assert by_axes.get(("tensor",), 0) < 0.05 * weights, by_axes
  # State: one block per device, the size of the device's shards (float32), not of the whole tree
  per_device = sum(x.nbytes for x in jax.tree.leaves(state)) / 8
  shard_bytes = 4 * sum(int(np.prod(s.shape)) for s in shards.values())
  assert per_device <= 1.25 * shard_bytes, (per_device, shard_bytes)


def test_the_step_trains_with_topk(mesh):
  tx, step = _own_step(mesh, jaxcomp.topk(ratio=0.05, axis_name="dcn"))
  params = _sharded_params(mesh)
  state = jax.jit(tx.init)(params)
  batch = _batch(0, mesh)  # one batch, fitted
  losses = []
  for _ in range(30):
    params, state, loss = step(params, state, batch)
    losses.append(float(loss))
  assert losses[-1] < 0.9 * losses[0], losses


def test_errors_name_the_argument(mesh):
  with pytest.raises(ValueError, match="per_slice: axis_name must name axes"):
    jaxcomp.per_slice(lambda p, b: 0.0, mesh, "slices")
  with pytest.raises(ValueError, match="on_shards: axis_name must name axes"):
    jaxcomp.on_shards(optax.sgd(0.1), mesh, SPECS, "slices")
  tx = jaxcomp.on_shards(optax.chain(jaxcomp.none(axis_name="dcn"), optax.sgd(0.1)), mesh,
                         {**SPECS, "b2": P("dcn")}, "dcn")
  with pytest.raises(ValueError, match="param_specs.*compresses over"):
    tx.init(_sharded_params(mesh))
  tx = jaxcomp.on_shards(optax.chain(jaxcomp.none(axis_name="fsdp"), optax.sgd(0.1)), mesh, SPECS, "dcn")
  with pytest.raises(ValueError, match="on_shards: tx's jaxcomp transform has axis_name='fsdp'"):
    tx.init(_sharded_params(mesh))
  tx, _ = _own_step(mesh, jaxcomp.none(axis_name="dcn"))
  params = _sharded_params(mesh)
  state = tx.init(params)
  with pytest.raises(ValueError, match="per-slice gradients with a leading axis of 2"):
    tx.update(params, state, params)  # gradients without the slice axis
  grad_fn = jaxcomp.per_slice(jax.grad(_loss), mesh, "dcn")
  with pytest.raises(ValueError, match="must divide into 2 slices"):
    jax.jit(grad_fn)(params, (jnp.ones((3, D)), jnp.ones((3, D))))


def test_the_documented_step_runs_as_written():
  """docs/own-step.md's first code block, run as it is."""
  import pathlib
  import re

  text = (pathlib.Path(__file__).parent.parent / "docs" / "own-step.md").read_text()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  scope: dict = {}
  exec(compile(code, "docs/own-step.md", "exec"), scope)
  assert np.isfinite(float(scope["loss"]))
  assert scope["params"]["w_in"].sharding.spec == P("fsdp", "tensor")


def test_gradients_summed_by_check_vma_are_refused(mesh):
  """shard_map manual over the slow axis with check_vma=True: JAX sums the gradient of a parameter passed
  with P() over it, and jaxcomp's mean of the sums would be N times the update: a clear error instead
  (with check_vma=False the same step runs)."""
  params = {"w": jnp.ones((16, 8)) / 16}
  tx = optax.chain(jaxcomp.topk(ratio=0.25, axis_name="dcn"), optax.sgd(0.1))

  def step(p, s, x):
    g = jax.grad(lambda w: jnp.mean((x @ w["w"]) ** 2))(p)
    u, s = tx.update(g, jaxcomp.local(s), p)
    return optax.apply_updates(p, u), jaxcomp.stacked(s)

  state = jaxcomp.per_worker(tx.init(params), mesh, "dcn")
  x = jnp.ones((4, 16))
  for check_vma in (True, False):
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("dcn"), P("dcn")), out_specs=(P(), P("dcn")),
                              axis_names={"dcn"}, check_vma=check_vma))
    if check_vma:
      with pytest.raises(ValueError, match=r"same on every worker of \['dcn'\].*check_vma=False"):
        f(params, state, x)
    else:
      assert np.isfinite(np.asarray(f(params, state, x)[0]["w"])).all()


def test_the_leaf_policy_judges_whole_leaves_not_shards(mesh):
  """min_size=300: b1 (512 entries, 256 per shard over "tensor") is compressed as in a replicated run,
  b2 (128, replicated) travels dense; the bytes over dcn are those of that policy on the shards."""
  method = jaxcomp.qsgd(axis_name="dcn", min_size=300)
  tx, step = _own_step(mesh, method)
  params = _sharded_params(mesh)
  state = jax.jit(tx.init)(params)
  text = step.lower(params, state, _batch(0, mesh)).compile().as_text()
  over_dcn = hlo.bytes_by_axes(text, mesh)[("dcn",)] - 4  # less the loss's mean
  shards = {k: jax.ShapeDtypeStruct(sharded.shard_shape(v.shape, SPECS[k], mesh), jnp.float32)
            for k, v in _params().items()}
  whole_policy = jaxcomp.qsgd(axis_name="dcn", min_size=0, dense={"w1": False, "b1": False, "w2": False,
                                                                  "b2": True})
  shard_policy = jaxcomp.qsgd(axis_name="dcn", min_size=300)  # b1's shard (256) would travel dense
  assert over_dcn == jaxcomp.wire_bytes(whole_policy, shards) != jaxcomp.wire_bytes(shard_policy, shards)
