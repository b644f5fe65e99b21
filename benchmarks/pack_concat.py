"""How a bucket is packed: one concatenation of its leaves against ``layout.concat_rows``'s tree.

XLA:CPU fuses a concatenation of at most 8 operands into the kernel that reads it; a bucket of
more leaves packed as one concatenation is written out in full first (a bucket-sized copy and a
pass). ``jaxcomp.core.layout.concat_rows`` joins them as a tree of at most 8 at a time. For each
method, the update with ``axis_name=None`` (jitted, state donated) is compiled with the bucket
packed each way: the seconds to lower and compile (the fastest of ``--reps``), the compiled
update's temporary bytes, its median milliseconds over ``--steps`` runs beside a jitted copy of
the same gradients (the two forms and the copy timed in turn, so the machine's drift falls on
all three), and whether both forms give the same outputs and state bit for bit. With ``--workers
N`` it times the N-worker ``jax.pmap`` step with its collectives (N CPU devices) in place of the
update, each worker its own gradients already on its device (the copy column: a pmap copy). Run it under the
benchmarks' caching malloc (it starts itself again under it on Linux, as ``python -m jaxcomp.bench
kernels`` does; ``--system-malloc`` opts out).

Usage: ``python benchmarks/pack_concat.py [--methods bf16,efsignsgd] [--models resnet50]
[--reps 1] [--steps 9] [--leaves N] [--workers N]``.
"""

import argparse
import contextlib
import os
import sys
import time

os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.core import layout  # noqa: E402

MODELS = ("resnet50", "bert-base")
FORMS = ("one", "tree")


@contextlib.contextmanager
def packed(form: str):
  """Buckets packed as one concatenation (``one``) or as the library packs them (``tree``)."""
  tree = layout.concat_rows
  if form == "one":
    layout.concat_rows = lambda parts: jnp.concatenate(list(parts))
  try:
    yield
  finally:
    layout.concat_rows = tree


def _compile(tx, grads, reps: int, workers: int):
  best, state = float("inf"), jax.eval_shape(tx.init, grads)
  for _ in range(reps):
    jax.clear_caches()
    t = time.perf_counter()
    if workers > 1:
      lead = lambda s: jax.ShapeDtypeStruct((workers,) + tuple(s.shape), s.dtype)
      step = jax.pmap(lambda g, s: tx.update(g, s), axis_name="data", donate_argnums=(1,),
                      devices=jax.devices()[:workers])
      compiled = step.lower(jax.tree.map(lead, grads), jax.tree.map(lead, state)).compile()
    else:
      compiled = jax.jit(tx.update, donate_argnums=(1,)).lower(grads, state).compile()
    best = min(best, time.perf_counter() - t)
  return compiled, best


def _ms(fn) -> float:
  t = time.perf_counter()
  jax.block_until_ready(fn())
  return 1e3 * (time.perf_counter() - t)


def measure(name: str, grads, reps: int, steps: int, workers: int = 1) -> dict:
  """Both packings of ``name``'s update on ``grads``: compile s, temp MiB, update ms, copy ms, equality."""
  copy = jax.jit(lambda g: jax.tree.map(jnp.copy, g))
  axis, inputs = None, grads
  if workers > 1:
    axis, devices = "data", jax.devices()[:workers]
    copy = jax.pmap(lambda g: jax.tree.map(jnp.copy, g), devices=devices)
    rng = np.random.default_rng(1)
    inputs = jax.pmap(lambda g: g, devices=devices)(
        [g * (1 + rng.random((workers,) + g.shape, np.float32)) for g in grads])
  row, steps_of, results = {}, {}, {}
  for form in FORMS:
    with packed(form):
      tx = jaxcomp.steady(jaxcomp.METHODS[name](axis_name=axis))
      compiled, row[f"{form} compile s"] = _compile(tx, grads, reps, workers)
    row[f"{form} temp MiB"] = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
    state = jax.tree.map(jnp.copy, tx.init(grads))
    state = [jaxcomp.per_worker(state, workers, axis_name=axis) if axis else state]

    def step(compiled=compiled, state=state):
      out, state[0] = compiled(inputs, state[0])
      return out, state[0]

    results[form] = jax.device_get(step())
    steps_of[form] = step
  times, copies = {form: [] for form in FORMS}, []
  for _ in range(steps):  # the forms in turn, a copy before each: the machine's drift falls on all
    for form, step in steps_of.items():
      copies.append(_ms(lambda: copy(inputs)))
      times[form].append(_ms(step))
  for form in FORMS:
    row[f"{form} ms"] = float(np.median(times[form]))
  row["copy ms"] = float(np.median(copies))
  row["equal"] = all(np.array_equal(a, b, equal_nan=True) for a, b in
                     zip(jax.tree.leaves(results["one"]), jax.tree.leaves(results["tree"]), strict=True))
  return row


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--methods", default="bf16,efsignsgd", help="comma-separated methods")
  parser.add_argument("--models", default="resnet50", help="resnet50 and/or bert-base")
  parser.add_argument("--reps", type=int, default=1, help="compiles per form; the fastest is printed")
  parser.add_argument("--steps", type=int, default=9, help="timed updates per form (the median)")
  parser.add_argument("--leaves", type=int, default=None, help="only each model's first N gradients")
  parser.add_argument("--workers", type=int, default=1, help="time the N-worker pmap step (N CPU devices)")
  parser.add_argument("--system-malloc", action="store_true", help="do not restart under the caching malloc")
  args = parser.parse_args(argv)
  from jaxcomp_bench import malloc
  from jaxcomp_bench import shapes as shp

  names = [m for m in args.methods.split(",") if m]
  models = [m for m in args.models.split(",") if m]
  unknown = [m for m in names if m not in jaxcomp.METHODS]
  if not names or unknown or not models or any(m not in MODELS for m in models) or args.reps < 1 \
      or args.steps < 1 or (args.leaves or 1) < 1 or args.workers < 1:
    raise SystemExit(f"--methods takes names of jaxcomp.METHODS (unknown: {unknown}), --models some of"
                     f" {MODELS}, --reps, --steps, --leaves and --workers positive integers")
  if argv is None and not args.system_malloc:
    malloc.restart_under_caching(sys.argv)
  try:
    jaxcomp.cpu_devices(max(args.workers, 1))
  except RuntimeError:  # the backend exists already (a test's): enough devices will do
    if len(jax.devices()) < args.workers:
      raise
  what = f"the {args.workers}-worker pmap step" if args.workers > 1 else "axis_name=None update"
  print(f"jax {jax.__version__} ({jax.default_backend()}), {malloc.setting()}; {what}, state donated;"
        f" compile: fastest of {args.reps}, ms: median of {args.steps}")
  print(f"{'model':<10} {'method':<11} {'compile s':>9} {'tree':>6} {'ms':>8} {'tree':>8} {'copy ms':>8}"
        f" {'x copy':>7} {'tree':>6} {'temp MiB':>9} {'tree':>7} {'same':>5}")
  for model in models:
    grads = shp.random(shp.MODELS[model]()[:args.leaves])
    for name in names:
      r = measure(name, grads, args.reps, args.steps, args.workers)
      print(f"{model:<10} {name:<11} {r['one compile s']:>9.2f} {r['tree compile s']:>6.2f}"
            f" {r['one ms']:>8.1f} {r['tree ms']:>8.1f} {r['copy ms']:>8.1f}"
            f" {r['one ms'] / r['copy ms']:>7.2f} {r['tree ms'] / r['copy ms']:>6.2f}"
            f" {r['one temp MiB']:>9.1f} {r['tree temp MiB']:>7.1f} {str(r['equal']):>5}", flush=True)


if __name__ == "__main__":
  main()
