"""The workers' side of a gathered exchange: 8 payloads of one bucket decoded and averaged.

For each codec that travels by all-gather, times ``codec.aggregate`` on 8 workers' payloads of
one bucket (``jax.jit`` of the aggregate alone, min and median of ``--reps``) in two forms:
``in loop``, the library's (each worker's fields read from the gathered bytes inside the loop,
``jaxcomp.collectives.packing.Gathered``), and ``cut first``, every field cut out of the
gathered bytes before the loop (the form before 2026-11-26), with the ratio and the compiled
temporaries of each (the aggregate's output is not counted). Both forms give the same mean,
bit for bit (checked, printed).

Usage: ``python benchmarks/aggregate.py [--n 6512640] [--methods qsgd,fp4] [--reps 21]``
(the default n is the length of ResNet-50's largest bucket).
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.collectives import packing  # noqa: E402

METHODS = "qsgd,natural,u8bit,terngrad,fp4,sketchml,inceptionn,signsgd,efsignsgd"
WORKERS = 8


def _time(f, arg, reps):
  jax.block_until_ready(f(arg))
  runs = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(arg))
    runs.append(time.perf_counter() - t)
  return min(runs) * 1e3, statistics.median(runs) * 1e3


class CutFirst:
  """The old form of :class:`packing.Gathered`: every field of every worker cut out of the gathered
  bytes before the loop, then indexed in it (what ``codec.aggregate`` reads is otherwise the same)."""

  def __init__(self, gathered):
    self.buffers, self.workers, self.tree = gathered.buffers, gathered.workers, gathered.payloads()

  def payload(self, w):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, w, keepdims=False), self.tree)

  def payloads(self):
    return self.tree


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--n", type=int, default=6512640, help="bucket length (default 6,512,640)")
  parser.add_argument("--methods", default=METHODS, help=f"comma-separated (default {METHODS})")
  parser.add_argument("--reps", type=int, default=21, help="timed runs (default 21)")
  args = parser.parse_args()
  key = jax.random.PRNGKey(0)
  print(f"{'method':<11} {'in loop ms':>16} {'cut first ms':>16} {'speed-up':>8}"
        f" {'temp MiB':>15} {'same':>5}")
  for name in args.methods.split(","):
    tx = jaxcomp.METHODS[name](axis_name=None, min_size=0)
    bucket = tx.method.buckets({"w": jnp.zeros((args.n,), jnp.float32)})[0]
    codec, segs = bucket.exchange.codec, bucket.segments
    xs = jax.random.normal(key, (WORKERS, segs.length)) * 1e-3
    payloads = jax.jit(jax.vmap(lambda x: codec.encode(x, key, segs)))(xs)
    buffers = jax.jit(jax.vmap(packing.to_bytes))(payloads)
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), payloads)
    forms = [jax.jit(lambda b: codec.aggregate(packing.Gathered(b, like), key, segs, WORKERS)),
             jax.jit(lambda b: codec.aggregate(CutFirst(packing.Gathered(b, like)), key, segs, WORKERS))]
    (new_min, new_med), (old_min, old_med) = (_time(f, buffers, args.reps) for f in forms)
    temps = [f.lower(buffers).compile().memory_analysis().temp_size_in_bytes / 2 ** 20 for f in forms]
    same = bool(jnp.array_equal(forms[0](buffers), forms[1](buffers), equal_nan=True))
    print(f"{name:<11} {new_min:7.2f} {new_med:8.2f} {old_min:7.2f} {old_med:8.2f} {old_min / new_min:8.2f}"
          f" {temps[0]:7.1f} {temps[1]:7.1f} {str(same):>5}", flush=True)


if __name__ == "__main__":
  main()
