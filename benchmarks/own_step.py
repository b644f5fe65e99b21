"""The user-owned step (per_slice + on_shards) beside data_parallel and plain optax, on 8 CPU devices.

Mesh (dcn=2, fsdp=2, tensor=2), a 2-block Megatron MLP of width D and hidden
width H (per block: x @ w_in split by columns over "tensor", rows over
"fsdp"; relu; @ w_out split by rows over "tensor"), batch over ("dcn",
"fsdp"). Per step, read from the compiled program: the bytes one device hands
to collectives over each mesh axis (``jaxcomp.collectives.hlo.bytes_by_axes``),
the FLOPs per device (``cost_analysis``), the temporaries
(``memory_analysis``), and jaxcomp's state per device; rows:

- ``plain``: plain optax SGD under GSPMD on the whole batch (dense reference);
- ``own <method>``: the user's jit step with per_slice + on_shards;
- ``dp <method>``: ``jaxcomp.data_parallel(..., param_specs=...)``.

    python benchmarks/own_step.py [--sizes 128x512,256x2048] [--methods none,topk]

Run it against another checkout (``PYTHONPATH=<checkout> python benchmarks/own_step.py --no-own``)
for a before/after table of ``data_parallel``.
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

from jaxcomp.collectives import hlo  # noqa: E402

ROWS = 64  # the global batch
BLOCKS = 2


def model(d, h):
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * BLOCKS)
  params, specs = {}, {}
  for b in range(BLOCKS):
    params[f"in{b}"] = jax.random.normal(keys[2 * b], (d, h)) / np.sqrt(d)
    params[f"out{b}"] = jax.random.normal(keys[2 * b + 1], (h, d)) / np.sqrt(h)
    specs[f"in{b}"], specs[f"out{b}"] = P("fsdp", "tensor"), P("tensor", "fsdp")
  return params, specs


def loss(p, batch):
  x, y = batch
  for b in range(BLOCKS):
    x = x + jax.nn.relu(x @ p[f"in{b}"]) @ p[f"out{b}"]
  return jnp.mean((x - y) ** 2)


def batch_for(mesh, d):
  rng = np.random.default_rng(0)
  xy = (rng.standard_normal((ROWS, d)).astype(np.float32), rng.standard_normal((ROWS, d)).astype(np.float32))
  return jax.device_put(xy, NamedSharding(mesh, P(("dcn", "fsdp"))))


def figures(compiled, mesh, state_bytes):
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  by_axes = hlo.bytes_by_axes(compiled.as_text(), mesh)
  over = {a: sum(b for axes, b in by_axes.items() if a in axes) for a in mesh.axis_names}
  return {"flops": float(cost["flops"]), "temp": compiled.memory_analysis().temp_size_in_bytes,
          "state": state_bytes, **over}


def plain(mesh, params, specs, batch):
  tx = optax.sgd(0.1)
  params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

  def step(p, s, b):
    g = jax.grad(loss)(p, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), batch).compile()
  return figures(compiled, mesh, 0)


def own(mesh, params, specs, batch, method):
  tx = jaxcomp.on_shards(optax.chain(jaxcomp.METHODS[method](axis_name="dcn"), optax.sgd(0.1)), mesh, specs,
                         "dcn")
  grad_fn = jaxcomp.per_slice(jax.value_and_grad(loss), mesh, "dcn")

  def step(p, s, b):
    value, g = grad_fn(p, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, value.mean()

  params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  state = jax.jit(tx.init)(params)
  per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
  return figures(jax.jit(step, donate_argnums=(0, 1)).lower(params, state, batch).compile(), mesh, per_device)


def data_parallel(mesh, params, specs, batch, method):
  tx = optax.chain(jaxcomp.METHODS[method](axis_name="dcn"), optax.sgd(0.1))
  dp = jaxcomp.data_parallel(loss, tx, mesh, axes=("dcn", "fsdp"), param_specs=specs)
  params, state = dp.init(params)
  per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
  return figures(dp.lower(params, state, batch).compile(), mesh, per_device)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default="128x512,256x2048", help="comma-separated DxH")
  p.add_argument("--methods", default="none,topk")
  p.add_argument("--no-own", action="store_true",
                 help="skip the per_slice + on_shards rows (an old checkout)")
  args = p.parse_args(argv)
  mesh = jax.make_mesh((2, 2, 2), ("dcn", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                       devices=jax.devices()[:8])
  print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, jax {jax.__version__},"
        f" jaxcomp at {jaxcomp.__file__}; mesh dcn=2 x fsdp=2 x tensor=2, batch {ROWS} over (dcn, fsdp),"
        f" {BLOCKS} Megatron MLP blocks; bytes per device per step over each axis")
  head = f"{'size':>9} {'row':<12} {'dcn B':>9} {'fsdp B':>10} {'tensor B':>10} {'MFLOP':>8} {'temp KB':>9}" \
         f" {'state KB':>9}"
  print(head)
  out = {}
  for size in args.sizes.split(","):
    d, h = (int(v) for v in size.split("x"))
    params, specs = model(d, h)
    batch = batch_for(mesh, d)
    rows = [("plain", lambda: plain(mesh, params, specs, batch))]
    for m in args.methods.split(","):
      if not args.no_own:
        rows.append((f"own {m}", lambda m=m: own(mesh, params, specs, batch, m)))
      rows.append((f"dp {m}", lambda m=m: data_parallel(mesh, params, specs, batch, m)))
    for name, fn in rows:
      f = out[(size, name)] = fn()
      print(f"{size:>9} {name:<12} {f['dcn']:>9,} {f['fsdp']:>10,} {f['tensor']:>10,}"
            f" {f['flops'] / 1e6:>8.1f} {f['temp'] / 1e3:>9.1f} {f['state'] / 1e3:>9.1f}")
  return out


if __name__ == "__main__":
  main()
