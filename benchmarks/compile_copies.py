"""What "one program per method for all its buckets" could save: a method's buckets against copies of one.

XLA:CPU compiles each distinct fusion as its own kernel and compiles identical fusions once. A
method's buckets differ in their length and segment layout, so each compiles its own kernels;
buckets of one length whose per-segment tables were data would compile the same kernels. This
script measures that ceiling on a real model's shapes, with the method's own exchange (no
collective: ``axis_name=None``), one program per column:

- ``one``: the method's largest bucket alone;
- ``model``: every bucket of that exchange as the model lays them out, each exchanged on its own
  (what ``jaxcomp.build`` compiles by default, less packing the leaves and cutting them out again);
- ``loop``: the same buckets through the exchange's ``exchange_many``, what ``jaxcomp.build``
  compiles with ``jaxcomp.configure(tx, loop_buckets=True)`` (a codec with a ``group_key``
  encodes buckets of similar lengths by one loop, :mod:`jaxcomp.core.stacking`);
- ``equal``: the model's buckets, each zero-padded at its end (the padding cut into segments of
  the exchange's block) to one length and one number of segments: the same
  shapes, their per-segment tables still constants of each bucket (``-`` for a method whose
  segments are matrices, as PowerSGD's);
- ``copies``: as many copies of the largest bucket (identical kernels: what tables as data would give);
- ``map``: one ``lax.map`` over the copies stacked (one loop body).

Prints the fastest of ``--reps`` compiles (lowering included) of each. A method whose exchanges
are fused across buckets (ACP-SGD) is refused.

Usage: ``python benchmarks/compile_copies.py [--methods topk,sbc] [--model resnet50] [--reps 2]
[--leaves N] [--bucket-bytes B]``.
"""

import argparse
import dataclasses
import os
import time

os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.collectives.axis import current_axis  # noqa: E402
from jaxcomp.core.layout import Segments  # noqa: E402
from jaxcomp.core.protocol import StepContext  # noqa: E402

MODELS = ("resnet50", "bert-base")


def buckets(name: str, leaves, bucket_bytes: int | None = None) -> list:
  """The buckets of ``name``'s steady method that share the exchange of its largest bucket."""
  kwargs = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
  method = jaxcomp.steady(jaxcomp.METHODS[name](axis_name=None, **kwargs)).settings.method
  if method.fused is not None:
    raise SystemExit(f"{name}: its exchanges are fused across buckets; choose another method")
  every = method.buckets(leaves)
  largest = max(every, key=lambda b: b.length)
  return [b for b in every if b.exchange == largest.exchange]


def equalized(group: list) -> list | None:
  """``group``'s buckets zero-padded at their ends to one length and one number of segments (the
  padding cut into segments of the exchange's block), or None when a bucket's segments are not flat."""
  if any(len(v) != 1 for b in group for v in b.segments.views):
    return None
  unit = group[0].segments.block  # every segment starts at a multiple of it
  count = max(b.segments.count for b in group) + 1
  length = max(b.length for b in group) + count * unit
  out = []
  for b in group:
    segs, need = b.segments, count - b.segments.count
    sizes = [unit] * (need - 1) + [length - segs.length - unit * (need - 1)]
    offsets = [segs.length + unit * i for i in range(need)]
    out.append(dataclasses.replace(b, segments=Segments(
        segs.offsets + tuple(offsets), segs.sizes + tuple(sizes), segs.views + tuple((n,) for n in sizes),
        segs.block)))
  return out


def _run(bucket, x, key):
  """The mean of one bucket through its exchange (local round trip, step 5)."""
  ex, segs = bucket.exchange, bucket.segments
  ctx = StepContext(current_axis(None), key, jnp.int32(5), jnp.uint32(5))
  mean, _, _ = ex.exchange(x, segs, ex.init_bucket(segs, key), ctx)
  return mean


def _many(group, xs, key):
  """The means of ``group``'s buckets through their exchange's ``exchange_many`` (step 5)."""
  ex = group[0].exchange
  ctxs = [StepContext(current_axis(None), jax.random.fold_in(key, i), jnp.int32(5), jnp.uint32(5))
          for i in range(len(group))]
  extras = [ex.init_bucket(b.segments, c.key) for b, c in zip(group, ctxs)]
  return [r[0] for r in ex.exchange_many(list(xs), [b.segments for b in group], extras, ctxs)]


def forms(group: list) -> dict:
  """``{column: (function, arguments)}``: the programs of :func:`main` for the buckets ``group``."""
  big = max(group, key=lambda b: b.length)
  n = len(group)
  key = jax.random.PRNGKey(0)
  vec = lambda b: jax.ShapeDtypeStruct((b.length,), jnp.float32)
  fold = lambda k, i: jax.random.fold_in(k, i)
  each = lambda g: (lambda xs, k: [_run(b, x, fold(k, i)) for i, (b, x) in enumerate(zip(g, xs))],
                    ([vec(b) for b in g], key))
  equal = equalized(group)
  return {
      "one": (lambda x, k: _run(big, x, k), (vec(big), key)),
      "model": each(group),
      "loop": (lambda xs, k: _many(group, xs, k), ([vec(b) for b in group], key)),
      "equal": None if equal is None else each(equal),
      "copies": (lambda xs, k: [_run(big, x, fold(k, i)) for i, x in enumerate(xs)], ([vec(big)] * n, key)),
      "map": (lambda xs, k: jax.lax.map(lambda a: _run(big, *a), (xs, jax.random.split(k, n))),
              (jax.ShapeDtypeStruct((n, big.length), jnp.float32), key)),
  }


def seconds(fn, arguments, reps: int) -> float:
  best = float("inf")
  for _ in range(reps):
    jax.clear_caches()  # compile anew each time: no cached lowering or executable
    t = time.perf_counter()
    jax.jit(fn).lower(*arguments).compile()
    best = min(best, time.perf_counter() - t)
  return best


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--methods", default="topk,sbc,dgc,powersgd,qsgd", help="comma-separated methods")
  parser.add_argument("--model", default="resnet50", help="resnet50 or bert-base")
  parser.add_argument("--reps", type=int, default=2, help="compiles per program; the fastest is printed")
  parser.add_argument("--leaves", type=int, default=None, help="only the model's first N gradients")
  parser.add_argument("--bucket-bytes", type=int, default=None,
                      help="the methods' bucket_bytes (default 25 MiB)")
  args = parser.parse_args(argv)
  from jaxcomp_bench import shapes as shp

  names = [m for m in args.methods.split(",") if m]
  unknown = [m for m in names if m not in jaxcomp.METHODS]
  if not names or unknown or args.model not in MODELS or args.reps < 1 or (args.leaves or 1) < 1 \
      or (args.bucket_bytes or 1) < 1:
    raise SystemExit(f"--methods takes names of jaxcomp.METHODS (unknown: {unknown}), --model one of"
                     f" {MODELS}, --reps, --leaves and --bucket-bytes positive integers")
  leaves = shp.abstract(shp.MODELS[args.model]()[:args.leaves])
  print(f"jax {jax.__version__} ({jax.default_backend()}); {args.model}; seconds to lower and compile,"
        f" fastest of {args.reps}")
  print(f"{'method':<10} {'buckets':>7} {'one':>6} {'model':>7} {'loop':>7} {'equal':>7} {'copies':>7}"
        f" {'map':>6}")
  for name in names:
    group = buckets(name, leaves, args.bucket_bytes)
    row = [f"{seconds(*form, args.reps):.2f}" if form else "-" for form in forms(group).values()]
    print(f"{name:<10} {len(group):>7} {row[0]:>6} {row[1]:>7} {row[2]:>7} {row[3]:>7} {row[4]:>7}"
          f" {row[5]:>6}", flush=True)


if __name__ == "__main__":
  main()
