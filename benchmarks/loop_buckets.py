"""What ``jaxcomp.configure(tx, loop_buckets=True)`` buys and costs: compile seconds against step time.

For each method and model, the update with ``axis_name=None`` (jitted, state donated) bucket by
bucket (the default) and with its buckets of similar lengths encoded by one loop
(:mod:`jaxcomp.core.stacking`): seconds to lower and compile (the fastest of ``--reps``
compiles) and the compiled update's temporary bytes; the update's median milliseconds over
``--steps`` runs and a jitted copy of the same gradients' (the forms and the copy timed in
turn, so the machine's drift falls on all three); the number of buckets and of loops; and
whether both forms give the same outputs and state bit for bit.

Usage: ``python benchmarks/loop_buckets.py [--methods topk] [--models resnet50,bert-base]
[--reps 2] [--steps 7] [--leaves N] [--bucket-bytes B]``.
"""

import argparse
import os
import time

os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.core import stacking  # noqa: E402

MODELS = ("resnet50", "bert-base")


def _compile(tx, grads, reps: int):
  best, state = float("inf"), jax.eval_shape(tx.init, grads)
  for _ in range(reps):
    jax.clear_caches()
    t = time.perf_counter()
    compiled = jax.jit(tx.update, donate_argnums=(1,)).lower(grads, state).compile()
    best = min(best, time.perf_counter() - t)
  return compiled, best


def _median_ms(fn, steps: int) -> float:
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return 1e3 * float(np.median(times))


def measure(name: str, grads, reps: int, steps: int, bucket_bytes: int | None = None) -> dict:
  """Both forms of ``name``'s update on ``grads``: compile s, update ms, copy ms, loops, equality."""
  kwargs = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
  plain = jaxcomp.METHODS[name](axis_name=None, **kwargs)
  forms = {"buckets": plain, "loop": jaxcomp.configure(plain, loop_buckets=True)}
  method = plain.settings.method
  buckets = method.buckets(grads)
  loops = 0
  for ex in {b.exchange for b in buckets}:
    codec = getattr(ex, "codec", None)
    if codec is not None and not codec.linear:
      own = [b.segments for b in buckets if b.exchange == ex]
      loops += sum(len(g) > 1 for g in stacking.groups(codec, own))
  copy = jax.jit(lambda g: jax.tree.map(lambda v: v * 1.0, g))
  row = {"buckets": len(buckets), "loops": loops}
  steps_of, results, times = {}, {}, {form: [] for form in forms}
  for form, tx in forms.items():
    compiled, row[f"{form} compile s"] = _compile(tx, grads, reps)
    row[f"{form} temp MiB"] = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
    state = [tx.init(grads)]

    def step(compiled=compiled, state=state):
      out, state[0] = compiled(grads, state[0])
      return out

    results[form] = jax.device_get((step(), state[0]))
    steps_of[form] = step
  copies = []
  for _ in range(steps):  # the forms in turn, a copy before each: the machine's drift falls on all
    for form, step in steps_of.items():
      copies.append(_median_ms(lambda: copy(grads), 1))
      times[form].append(_median_ms(step, 1))
  for form in forms:
    row[f"{form} ms"] = float(np.median(times[form]))
  row["copy ms"] = float(np.median(copies))
  same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(results["buckets"]),
                                                   jax.tree.leaves(results["loop"]), strict=True))
  row["equal"] = same
  return row


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--methods", default="topk", help="comma-separated methods")
  parser.add_argument("--models", default="resnet50,bert-base", help="resnet50 and/or bert-base")
  parser.add_argument("--reps", type=int, default=2, help="compiles per form; the fastest is printed")
  parser.add_argument("--steps", type=int, default=7, help="timed updates per form (the median)")
  parser.add_argument("--leaves", type=int, default=None, help="only each model's first N gradients")
  parser.add_argument("--bucket-bytes", type=int, default=None,
                      help="the methods' bucket_bytes (default 25 MiB)")
  args = parser.parse_args(argv)
  from jaxcomp_bench import shapes as shp

  names = [m for m in args.methods.split(",") if m]
  models = [m for m in args.models.split(",") if m]
  unknown = [m for m in names if m not in jaxcomp.METHODS]
  if not names or unknown or not models or any(m not in MODELS for m in models) or args.reps < 1 \
      or args.steps < 1 or (args.leaves or 1) < 1 or (args.bucket_bytes or 1) < 1:
    raise SystemExit(f"--methods takes names of jaxcomp.METHODS (unknown: {unknown}), --models some of"
                     f" {MODELS}, --reps, --steps, --leaves and --bucket-bytes positive integers")
  print(f"jax {jax.__version__} ({jax.default_backend()}); axis_name=None update, state donated;"
        f" compile: fastest of {args.reps}, ms: median of {args.steps}")
  print(f"{'model':<10} {'method':<8} {'buckets':>7} {'loops':>5} {'compile s':>10} {'loop':>6}"
        f" {'ms':>8} {'loop':>8} {'copy ms':>8} {'x copy':>7} {'loop':>6} {'temp MiB':>9} {'loop':>6}"
        f" {'same':>5}")
  for model in models:
    grads = shp.random(shp.MODELS[model]()[:args.leaves])
    for name in names:
      r = measure(name, grads, args.reps, args.steps, args.bucket_bytes)
      print(f"{model:<10} {name:<8} {r['buckets']:>7} {r['loops']:>5} {r['buckets compile s']:>10.2f}"
            f" {r['loop compile s']:>6.2f} {r['buckets ms']:>8.1f} {r['loop ms']:>8.1f}"
            f" {r['copy ms']:>8.1f} {r['buckets ms'] / r['copy ms']:>7.2f}"
            f" {r['loop ms'] / r['copy ms']:>6.2f} {r['buckets temp MiB']:>9.1f} {r['loop temp MiB']:>6.1f}"
            f" {str(r['equal']):>5}", flush=True)


if __name__ == "__main__":
  main()
