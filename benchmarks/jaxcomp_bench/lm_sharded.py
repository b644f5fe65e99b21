"""``python -m jaxcomp.bench lm --mesh dcn=2,fsdp=4``: the LM task, a sharded model against a replicated one.

The character transformer of :mod:`jaxcomp_bench.transformer`, trained with
each method's AdamW recipe by :func:`jaxcomp.data_parallel` twice on the same
mesh and data: sharded (``param_specs``: each parameter's largest axis that
the fsdp size divides is split over it; the recipe over ``dcn`` only) and
replicated (the recipe over every axis). Per method: both held-out losses,
the bytes the compiled sharded step moves over ``dcn`` against
``jaxcomp.wire_bytes`` of a device's shards, and per device the optimizer
state and the FLOPs (``cost_analysis``) against the replicated run's.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp_bench.common import header, markdown_table
from jaxcomp_bench.transformer import Transformer, batches, held_out_loss, init_params, load, loss_fn

METHODS = "none,topk,qsgd,signsgd,powersgd,onebit_adam"
ROWS = 8  # windows per device per step


def mesh_of(spec: str):
  """``"dcn=2,fsdp=4"`` -> a mesh of those axes (Auto) over the first devices."""
  names, sizes = zip(*[(k, int(v)) for k, v in (part.split("=") for part in spec.split(","))])
  n = int(np.prod(sizes))
  if n > jax.device_count():
    raise SystemExit(f"--mesh {spec} needs {n} devices, JAX has {jax.device_count()}")
  return jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes), devices=jax.devices()[:n])


def specs_for(params, size: int, axis: str):
  """Each leaf's largest axis that ``size`` divides split over ``axis``; the others replicated."""
  def one(x):
    dims = [d for d in np.argsort(np.shape(x))[::-1] if np.shape(x)[d] % size == 0]
    spec = [None] * np.ndim(x)
    if dims:
      spec[dims[0]] = axis
    return P(*spec)

  return jax.tree.map(one, params)


def _run(model, corpus, tx, mesh, steps, seed, specs=None):
  dp = jaxcomp.data_parallel(lambda p, b: loss_fn(p, model, *b), tx, mesh, param_specs=specs)
  params, state = dp.init(init_params(model, seed))
  rows = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  lowered = None
  for x, y in batches(corpus, steps, mesh.size, ROWS, seed):
    batch = (x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]))
    if lowered is None:
      lowered = dp.lower(params, state, jax.device_put(batch, rows)).compile()
    params, state, _ = dp.step(params, state, batch)
  cost = lowered.cost_analysis()
  flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
  state_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
  loss = held_out_loss(jax.tree.map(np.asarray, params), model, corpus)
  return params, loss, lowered.as_text(), flops, state_bytes


def row(name, model, corpus, mesh, args):
  slow, fast = mesh.axis_names[0], mesh.axis_names[1:]
  tx = jaxcomp.recipe(name, args.lr, axis_name=slow, optimizer="adamw")
  specs = specs_for(init_params(model, args.seed), mesh.shape[fast[0]], fast[0])
  params, loss, hlo, flops, state = _run(model, corpus, tx, mesh, args.steps, args.seed, specs)
  rep_tx = jaxcomp.recipe(name, args.lr, axis_name=tuple(mesh.axis_names), optimizer="adamw")
  _, rep_loss, _, rep_flops, rep_state = _run(model, corpus, rep_tx, mesh, args.steps, args.seed)
  shard = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.addressable_shards[0].data.shape, jnp.float32),
                       params)
  nominal = jaxcomp.wire_bytes(tx, shard, workers=mesh.shape[slow])
  measured = jaxcomp.collective_bytes(hlo)["by_group_size"].get(mesh.shape[slow], 0)
  return [name, f"{loss:.4f}", f"{rep_loss:.4f}", f"{100 * (loss / rep_loss - 1):+.2f}%",
          f"{measured:,.0f}", f"{nominal:,}", f"{state / rep_state:.2f}", f"{flops / rep_flops:.2f}"]


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m jaxcomp.bench lm --mesh ...",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--mesh", default="dcn=2,fsdp=4",
                  help="the slow (compressed) axis first, then the fsdp axis")
  ap.add_argument("--methods", default=METHODS)
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  jaxcomp.cpu_devices(int(np.prod([int(part.split("=")[1]) for part in args.mesh.split(",")])))
  mesh = mesh_of(args.mesh)
  corpus = load()
  model = Transformer(corpus.vocab_size)
  print(header(f"python -m jaxcomp.bench lm --mesh {args.mesh} --steps {args.steps}"))
  head = ["method (AdamW recipe)", "held-out sharded", "replicated", "diff",
          f"{mesh.axis_names[0]} bytes (HLO, every stage)", "wire_bytes of shards (steady)",
          "state/device vs replicated", "FLOPs/device vs replicated"]
  print(markdown_table(head, [row(m, model, corpus, mesh, args) for m in args.methods.split(",")]))
