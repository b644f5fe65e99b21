"""Sorting float32 rows on XLA: ``jnp.sort`` against the int32-key sort SketchML uses.

``jaxcomp.transforms.sketchml.sorted_rows`` sorts order-preserving int32 keys (the float bits
with a negative value's magnitude bits flipped) where ``jnp.sort`` sorts the floats through a
total-order comparator. Prints, one run: the milliseconds of both on one ``(rows, cols)``
array (jitted, median of ``--reps``), and of SketchML's split points (``SketchCodec.edges``,
one batched sort per bucket) over every bucket of the models' gradient shapes, with the float
sort and with the keys.

Usage: ``python benchmarks/sort_keys.py [--shape 4,4096] [--reps 50] [--models resnet50,bert]``
(``--models ''`` skips the models).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxcomp.core import layout  # noqa: E402
from jaxcomp.core.protocol import CodecExchange, flat_route  # noqa: E402
from jaxcomp.transforms import sketchml  # noqa: E402


def median_ms(fn, *args, reps: int) -> float:
  """Milliseconds of ``jax.jit(fn)(*args)``: the median of ``reps`` runs after one warm-up."""
  from jaxcomp_bench.common import run_times

  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  return 1e3 * float(np.median(run_times(lambda: fn(*args), reps)))


class FloatSortCodec(sketchml.SketchCodec):
  """SketchML's codec with its samples sorted by ``jnp.sort`` (the float comparator)."""

  @staticmethod
  def sort_samples(sample):
    return jnp.sort(sample, axis=1)


def model_edges_ms(shapes, reps: int) -> tuple:
  """Milliseconds of SketchML's split points over every bucket of ``shapes``: (float sort, keys)."""
  codecs = (FloatSortCodec(64, 16384), sketchml.SketchCodec(64, 16384))
  exchange = CodecExchange(codecs[1])
  buckets = layout.plan(shapes, flat_route(exchange), exchange, layout.BUCKET_BYTES, 1)
  key = jax.random.PRNGKey(1)
  totals = [0.0, 0.0]
  for i, b in enumerate(buckets):
    x = 1e-3 * jax.random.normal(jax.random.PRNGKey(i), (b.segments.length,))
    for j, codec in enumerate(codecs):
      totals[j] += median_ms(lambda x, c=codec, s=b.segments: c.edges(x, key, s), x, reps=reps)
  return tuple(totals)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shape", default="4,4096", help="rows,cols of the array sorted row by row")
  parser.add_argument("--reps", type=int, default=50, help="timed runs of the array's sorts (models: 5)")
  parser.add_argument("--models", default="resnet50,bert", help="gradient shapes for SketchML's split points")
  args = parser.parse_args(argv)
  shape = tuple(int(v) for v in args.shape.split(",") if v)
  models = [m for m in args.models.split(",") if m]
  if len(shape) != 2 or min(shape) < 1 or args.reps < 1 or set(models) - {"resnet50", "bert"}:
    raise SystemExit("--shape takes rows,cols (positive), --reps a positive integer, --models resnet50,bert")
  from jaxcomp_bench import shapes as model_shapes

  print(f"jax {jax.__version__} ({jax.default_backend()}); milliseconds, float sort against int32 keys")
  v = jax.random.normal(jax.random.PRNGKey(0), shape)
  a = median_ms(lambda v: jnp.sort(v, axis=1), v, reps=args.reps)
  b = median_ms(sketchml.sorted_rows, v, reps=args.reps)
  print(f"{'sort ' + 'x'.join(map(str, shape)):32s} {a:9.2f} {b:9.2f}")
  for name in models:
    shapes = model_shapes.resnet50_shapes() if name == "resnet50" else model_shapes.bert_base_shapes()
    a, b = model_edges_ms(shapes, reps=5)
    print(f"{'sketchml split points, ' + name:32s} {a:9.2f} {b:9.2f}", flush=True)


if __name__ == "__main__":
  main()
