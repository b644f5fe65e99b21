"""Compile time against the number of buckets: segment tables as constants, as data, and mapped.

The question behind speed issue 41's first item: what makes a method's compile time grow with
its buckets? Each form compiles one program that runs a codec of the shape of EF-signSGD's
(each segment's mean ``|x|``, then ``sign(x)`` times it) on B buckets of one length, each bucket
with its own segment table (24 segments cut at random rows):

- ``constants``: one call per bucket, its table a constant of the program (jaxcomp's buckets
  today: static ``Segments``, so every bucket's kernels differ);
- ``int32 data``: one call per bucket, its table an int32 argument (every bucket's kernels
  identical);
- ``map + data``: one ``lax.map`` over the stacked buckets and tables (one loop body).

Prints the seconds to lower and compile each (one compile per form and B, the fastest of
``--reps``). The codec is a stand-in, not a jaxcomp method: it shows how compile time scales,
not what a method costs.

Usage: ``python benchmarks/compile_buckets.py [--buckets 1,8,16,32] [--length 1048576] [--reps 3]``.
"""

import argparse
import os
import time

os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

SEGMENTS = 24
ROW = 128


def table(length: int, seed: int) -> np.ndarray:
  """int32 (rows,): the segment of each row of 128 entries, 24 segments cut at random rows."""
  rows = length // ROW
  cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, rows), SEGMENTS - 1, replace=False))
  return np.repeat(np.arange(SEGMENTS, dtype=np.int32), np.diff(np.concatenate([[0], cuts, [rows]])))


def codec(x, seg):
  """``sign(x)`` times each segment's mean ``|x|``: two passes and two segment reductions."""
  r = x.reshape(-1, ROW)
  total = jax.ops.segment_sum(jnp.sum(jnp.abs(r), axis=1), seg, SEGMENTS)
  count = jax.ops.segment_sum(jnp.full((r.shape[0],), float(ROW)), seg, SEGMENTS)
  return (jnp.sign(r) * (total / count)[seg][:, None]).reshape(-1)


def forms(buckets: int, length: int) -> dict:
  """``{name: (function, arguments)}`` of the three forms for ``buckets`` buckets."""
  tables = [table(length, i) for i in range(buckets)]
  xs = [jnp.ones((length,), jnp.float32)] * buckets
  return {
      "constants": (lambda xs: [codec(x, jnp.asarray(t)) for x, t in zip(xs, tables)], (xs,)),
      "int32 data": (lambda xs, ts: [codec(x, t) for x, t in zip(xs, ts)],
                     (xs, [jnp.asarray(t) for t in tables])),
      "map + data": (lambda xs, ts: jax.lax.map(lambda a: codec(*a), (xs, ts)),
                     (jnp.stack(xs), jnp.asarray(np.stack(tables)))),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--buckets", default="1,8,16,32", help="comma-separated numbers of buckets")
  parser.add_argument("--length", type=int, default=1 << 20, help="entries per bucket (a multiple of 128)")
  parser.add_argument("--reps", type=int, default=3, help="compiles per form; the fastest is printed")
  args = parser.parse_args(argv)
  counts = [int(b) for b in args.buckets.split(",") if b]
  if not counts or min(counts) < 1 or args.length % ROW or args.length // ROW <= SEGMENTS or args.reps < 1:
    raise SystemExit("--buckets takes positive integers, --length a multiple of 128 above 3072,"
                     " --reps a positive integer")
  print(f"jax {jax.__version__} ({jax.default_backend()}); {args.length:,} float32 entries a bucket,"
        f" {SEGMENTS} segments; seconds to lower and compile, fastest of {args.reps}")
  print(f"{'buckets':>7} {'constants':>10} {'int32 data':>11} {'map + data':>11}")
  for b in counts:
    seconds = []
    for fn, arguments in forms(b, args.length).values():
      best = float("inf")
      for _ in range(args.reps):
        jax.clear_caches()  # compile anew each time: no cached lowering or executable
        t = time.perf_counter()
        jax.jit(fn).lower(*arguments).compile()
        best = min(best, time.perf_counter() - t)
      seconds.append(best)
    print(f"{b:7d} {seconds[0]:10.2f} {seconds[1]:11.2f} {seconds[2]:11.2f}", flush=True)


if __name__ == "__main__":
  main()
