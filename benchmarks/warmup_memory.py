"""Temporaries of DGC's and RedSync's warm-ups: the compiled 8-worker step of each stage alone, of the
whole warm-up and of its scatter form, against the dense step's.

DGC's default warm-up sends 25%, 6.25%, 1.56%, 0.39% and then 0.1% of the entries (five stages, one
``lax.switch``). Under ``transport="gather"`` every worker receives every worker's payload: at 25%
density with 1.3x capacity and 8 workers that buffer alone is several times the gradient. This
prints, for one 4096 x 4096 leaf (or ``--shape``), the temporary bytes of the compiled pmap step
(state donated, ``jaxcomp_bench.kernels.step_memory``) of each configuration and their ratio to the
dense step's. RedSync's recipe warms up the same way (25% first), and its capacity is twice its k.

Usage: ``python benchmarks/warmup_memory.py [--shape 4096,4096] [--workers 8]``.
"""

import argparse


def configurations() -> dict:
  """``{name: () -> transformation}``: the dense step, DGC's and RedSync's warm-ups and their stages."""
  import jaxcomp

  out = {"dense": lambda: jaxcomp.none(axis_name="data"),
         "dgc (default warm-up, gather)": lambda: jaxcomp.dgc(axis_name="data"),
         "dgc (default warm-up, scatter)": lambda: jaxcomp.dgc(axis_name="data", transport="scatter")}
  for ratio in (0.25, 0.0625, 0.015625, 0.00390625, 0.001):
    out[f"dgc {ratio:g} alone, gather"] = lambda r=ratio: jaxcomp.dgc(r, axis_name="data", warmup_steps=0)
  recipe = lambda: jaxcomp.recipe_method("redsync", axis_name="data")
  out["redsync's recipe (warm-up, gather)"] = recipe
  out["redsync's recipe after its warm-up"] = lambda: jaxcomp.steady(recipe())
  out["redsync 0.25 alone, gather"] = lambda: jaxcomp.redsync(0.25, axis_name="data")
  return out


def rows(shape, workers: int = 8, names=None) -> dict:
  """``{name: temporary bytes}`` of the compiled ``workers``-worker step on one leaf of ``shape``, for
  ``names`` of :func:`configurations` (None: all of them)."""
  from jaxcomp_bench.kernels import step_memory

  made = configurations()
  return {name: step_memory(made[name](), [tuple(shape)], workers)["temp"] for name in names or made}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", default="4096,4096", help="the leaf's shape, comma-separated")
  parser.add_argument("--workers", type=int, default=8)
  args = parser.parse_args(argv)
  try:
    shape = tuple(int(d) for d in args.shape.split(","))
  except ValueError:
    parser.error(f"--shape takes positive integers separated by commas, got {args.shape!r}")
  if not shape or min(shape) < 1 or not 2 <= args.workers <= 8:
    parser.error(f"--shape takes positive integers and --workers 2 to 8, got {args.shape!r}, {args.workers}")
  import jaxcomp

  jaxcomp.cpu_devices(8)
  got = rows(shape, args.workers)
  dense = got.pop("dense")
  print(f"one {args.shape} leaf, {args.workers} workers; dense step: {dense / 2**20:.1f} MiB")
  print(f"{'configuration':36s} {'temp MiB':>9s} {'x dense':>8s}")
  for name, temp in got.items():
    print(f"{name:36s} {temp / 2**20:9.1f} {temp / dense:8.2f}", flush=True)


if __name__ == "__main__":
  main()
