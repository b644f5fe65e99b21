"""``python -m jaxcomp.bench wire``: payload bits per element of every method, nominal and measured.

Compiles each method's pmap step over 8 CPU devices on a model-shaped tree
(a 1024x1024 matrix, a 3x3x64x64 conv kernel and a 1024 bias by default),
reads the bytes its collectives move from the HLO and prints them next to
``jaxcomp.wire_bytes`` as bits per gradient element.
"""

from __future__ import annotations

import argparse

from jaxcomp_bench.common import plain


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m jaxcomp.bench wire", description=plain(__doc__))
  ap.add_argument("--methods", default="all", help="comma-separated names, or 'all'")
  ap.add_argument("--workers", type=int, default=8)
  args = ap.parse_args(argv)

  import jaxcomp
  jaxcomp.cpu_devices(args.workers)
  import jax
  import jax.numpy as jnp

  names = sorted(jaxcomp.METHODS) if args.methods == "all" else args.methods.split(",")
  params = {"dense": jnp.zeros((1024, 1024)), "conv": jnp.zeros((3, 3, 64, 64)), "bias": jnp.zeros((1024,))}
  n = sum(x.size for x in jax.tree.leaves(params))
  grads = jax.tree.map(lambda x: jnp.ones((args.workers,) + x.shape, x.dtype), params)
  print(f"{n} gradient elements (1024x1024 + 3x3x64x64 + 1024), {args.workers} workers, backend"
        f" {jax.default_backend()}")
  print("| method | nominal bytes | measured bytes | bits/element | collectives |")
  print("|---|---:|---:|---:|---|")
  for name in names:
    tx = jaxcomp.METHODS[name](axis_name="data")
    state = jaxcomp.per_worker(tx.init(params), args.workers)
    step = jax.pmap(lambda g, s: tx.update(g, s), axis_name="data")
    got = jaxcomp.measure_wire_bytes(step, grads, state)
    nominal = jaxcomp.wire_bytes(tx, params)
    kinds = ", ".join(k for k in ("all-reduce", "all-gather") if got[k])
    print(f"| {name} | {nominal} | {got['total']} | {8 * nominal / n:.3f} | {kinds} |")
