"""Seconds of a pmap training step's first calls, by how ``jaxcomp.per_worker`` placed its inputs.

The Quickstart's form: ``optax.chain(method, optax.sgd(0.1))`` in a ``jax.pmap(..., axis_name="data")``
step over 8 CPU devices, its parameters and state from ``jaxcomp.per_worker``, the step fed its own
outputs from the second call on. ``jax.pmap`` compiles a step once per placement of its inputs, so
the placement decides whether the second call compiles the step again:

- ``axis_name``: ``per_worker(tree, 8, axis_name="data")``, placed as the step's outputs are;
- ``host``: ``per_worker(tree, 8)``, host (numpy) views;
- ``one device``: the tree stacked on the first device by ``jnp.broadcast_to`` (the placement
  ``per_worker(tree, 8)`` returned before it returned host views).

Each placement runs in a fresh process. Printed per placement: the seconds ``tx.init`` and
``per_worker`` took together, and each of the first ``--steps`` calls' seconds (blocked on) with
the XLA compiles it caused.

Usage: ``python benchmarks/first_steps.py [--method topk] [--model resnet50|bert-base|small] [--steps 3]``.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEMENTS = ("axis_name", "host", "one device")


def _shapes(model: str) -> list:
  if model == "small":
    return [(40, 24), (24,)]
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  from jaxcomp_bench import shapes

  return shapes.resnet50_shapes() if model == "resnet50" else shapes.bert_base_shapes()


def child(method: str, model: str, placement: str, steps: int) -> dict:
  """Runs the steps in this process; returns ``{"init": s, "steps": [[s, compiles], ...]}``."""
  import jaxcomp

  jaxcomp.cpu_devices(8)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  compiles = [0]

  def count(event, duration, **kw):
    if event.endswith("backend_compile_duration"):
      compiles[0] += 1

  jax.monitoring.register_event_duration_secs_listener(count)
  params = {f"p{i:03d}": np.zeros(s, np.float32) for i, s in enumerate(_shapes(model))}
  tx = optax.chain(jaxcomp.METHODS[method](axis_name="data"), optax.sgd(0.1))

  @functools.partial(jax.pmap, axis_name="data")
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def stack(tree):
    if placement == "one device":
      return jax.tree.map(lambda x: jnp.broadcast_to(x, (8,) + jnp.shape(x)), tree)
    return jaxcomp.per_worker(tree, 8, axis_name="data" if placement == "axis_name" else None)

  start = time.perf_counter()
  P, S = stack(params), stack(tx.init(params))
  jax.block_until_ready((P, S))
  out = {"init": time.perf_counter() - start, "steps": []}
  rng = np.random.default_rng(0)
  grads = {k: 1e-4 * rng.standard_normal((8,) + v.shape, np.float32) for k, v in params.items()}
  try:
    for _ in range(steps):
      before, start = compiles[0], time.perf_counter()
      P, S = jax.block_until_ready(step(P, S, grads))
      out["steps"].append([time.perf_counter() - start, compiles[0] - before])
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--method", default="topk", help="a name from jaxcomp.METHODS (default topk)")
  parser.add_argument("--model", default="resnet50", choices=("resnet50", "bert-base", "small"),
                      help="the gradients' shapes (default resnet50: its 161 leaves)")
  parser.add_argument("--steps", type=int, default=3, help="calls of the step to time (default 3)")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    print(json.dumps(child(args.method, args.model, args.child, args.steps)))
    return
  import jax

  print(f"jax {jax.__version__}; {args.method} on {args.model}, 8-worker pmap; s (XLA compiles)")
  steps = "".join(f"{f'step {i + 1}':>16}" for i in range(args.steps))
  print(f"{'placement':<12}{'init s':>14}{steps}")
  env = dict(os.environ, PJRT_NPROC="16", PYTHONPATH=os.pathsep.join(
      [ROOT, os.path.join(ROOT, "benchmarks"), os.environ.get("PYTHONPATH", "")]))
  for placement in PLACEMENTS:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", placement, "--method",
                           args.method, "--model", args.model, "--steps", str(args.steps)],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
      raise SystemExit(f"{placement}: the child failed:\n{proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{placement:<12}{got['init']:>14.2f}"
          + "".join(f"{f'{s:.2f} ({c})':>16}" for s, c in got["steps"]), flush=True)


if __name__ == "__main__":
  main()
