"""A sharded step (jaxcomp.data_parallel with param_specs) against the replicated one, on 8 CPU devices.

Mesh (dcn=2, fsdp=4): parameters sharded over fsdp, compressed over dcn. Per
method: the bytes the compiled step moves over dcn (collectives in groups of
2) against ``jaxcomp.wire_bytes`` of a device's shards, the per-device FLOPs
(``cost_analysis``) against plain data parallelism over all 8 devices, and
the optimizer state per device against the replicated run's.

    python benchmarks/sharded_step.py [--width 512]
"""

import argparse
import datetime

import jaxcomp

jaxcomp.cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROWS = 8  # per device


def model(width):
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": 0.05 * jax.random.normal(k[0], (256, width)), "b1": jnp.zeros((width,)),
            "w2": 0.05 * jax.random.normal(k[1], (width, width)), "b2": jnp.zeros((width,)),
            "w3": 0.05 * jax.random.normal(k[2], (width, 64)), "b3": jnp.zeros((64,))}
  specs = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P(),
           "w3": P("fsdp", None), "b3": P()}
  return params, specs


def loss(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  h = jnp.tanh(h @ p["w2"] + p["b2"])
  return jnp.mean((h @ p["w3"] + p["b3"] - y) ** 2)


def chain(name, axis):
  if name == "onebit_adam":
    return jaxcomp.onebit_adam(1e-3, axis_name=axis, freeze_step=1)
  return optax.chain(jaxcomp.METHODS[name](axis_name=axis), optax.sgd(0.1))


def measure(dp, params, mesh):
  params, state = dp.init(params)
  rng = np.random.default_rng(0)
  batch = (rng.standard_normal((8 * ROWS, 256)).astype(np.float32),
           rng.standard_normal((8 * ROWS, 64)).astype(np.float32))
  batch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(("dcn", "fsdp")))), batch)
  compiled = dp.lower(params, state, batch).compile()
  cost = compiled.cost_analysis()
  flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
  by_size = jaxcomp.collective_bytes(compiled.as_text())["by_group_size"]
  state_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
  return params, by_size, flops, state_bytes


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--width", type=int, default=512)
  ap.add_argument("--methods", default="none,topk,qsgd,signsgd,powersgd,onebit_adam")
  args = ap.parse_args(argv)
  mesh = jax.make_mesh((2, 4), ("dcn", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  params, specs = model(args.width)
  print(f"sharded step, {datetime.date.today()}, {jax.devices()[0].platform} x {jax.device_count()},"
        f" mesh dcn=2 x fsdp=4, {sum(x.size for x in jax.tree.leaves(params)):,} parameters")
  print("| method | dcn bytes (HLO) | wire_bytes of the shards | dense f32 shards | FLOPs/device vs plain DP"
        " | state/device vs replicated |")
  print("|---|---:|---:|---:|---:|---:|")
  for name in args.methods.split(","):
    plain = jaxcomp.data_parallel(loss, chain(name, ("dcn", "fsdp")), mesh)
    _, _, plain_flops, rep_state = measure(plain, params, mesh)
    sharded = jaxcomp.data_parallel(loss, chain(name, "dcn"), mesh, param_specs=specs)
    p, by_size, flops, state_bytes = measure(sharded, params, mesh)
    shard = {k: jax.ShapeDtypeStruct(p[k].addressable_shards[0].data.shape, jnp.float32) for k in p}
    nominal = jaxcomp.wire_bytes(chain(name, "dcn"), shard, workers=2)
    dense = 4 * sum(int(np.prod(s.shape)) for s in shard.values())
    print(f"| {name} | {by_size.get(2, 0):,.0f} | {nominal:,} | {dense:,} | {flops / plain_flops:.2f}x"
          f" | {state_bytes:,} / {rep_state:,} = {state_bytes / max(rep_state, 1):.2f} |")


if __name__ == "__main__":
  main()
