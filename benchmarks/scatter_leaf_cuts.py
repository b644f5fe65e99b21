"""What cutting the scatter exchange's chunks at leaf boundaries costs in bytes.

``transport="scatter"`` cuts every chunk wherever any chunk holds a leaf's boundary
(``jaxcomp.core.layout.chunk_segments``), so a codec with a per-segment scale or norm sends one per
leaf piece of each chunk instead of one per chunk. Prints, for ResNet-50's 161 and BERT-base's
199 gradient shapes (jaxcomp_bench.shapes), each scale codec's bytes per worker per step
(``jaxcomp.wire_bytes``) cut at leaves over one segment per chunk, at N = 8, 64, 1024.
``--time NAME ...``: instead, the compile time and step time of each named method's pmap update
on ResNet-50's gradients (1e-5 scale) with 8 CPU workers, one segment per chunk and cut at
leaves. Usage: ``python benchmarks/scatter_leaf_cuts.py [--time onebit qsgd]``.
"""

import os
import sys
import time

os.environ.setdefault("PJRT_NPROC", "16")

import jaxcomp  # noqa: E402
from jaxcomp.core import layout  # noqa: E402
from jaxcomp_bench import shapes  # noqa: E402

CODECS = ("onebit", "efsignsgd", "signsgd", "qsgd", "terngrad", "natural", "u8bit", "fp4")


def _one_segment(segs, workers, block=1, by_leaf=True):
  del by_leaf
  return cut(segs, workers, block, False)


cut = layout.chunk_segments


def main():
  for model, tree in (("resnet50", shapes.abstract(shapes.resnet50_shapes())),
                      ("bert-base", shapes.abstract(shapes.bert_base_shapes()))):
    for name in CODECS:
      row = []
      for n in (8, 64, 1024):
        tx = jaxcomp.METHODS[name](axis_name="d", transport="scatter", min_size=1)
        new = jaxcomp.wire_bytes(tx, tree, workers=n)
        layout.chunk_segments = _one_segment
        try:
          old = jaxcomp.wire_bytes(tx, tree, workers=n)
        finally:
          layout.chunk_segments = cut
        row.append(f"N={n}: {new:,} B ({new / old:.3f}x)")
      print(f"{model:9s} {name:9s} " + "  ".join(row), flush=True)


def timed(names, workers=8):
  import jax

  jaxcomp.cpu_devices(workers)
  params = {f"p{i:03d}": jax.numpy.zeros(s) for i, s in enumerate(shapes.resnet50_shapes())}
  grads = {k: 1e-5 * jax.random.normal(jax.random.PRNGKey(i), (workers,) + v.shape)
           for i, (k, v) in enumerate(params.items())}
  for name in names:
    for label, fn in (("one segment", _one_segment), ("cut at leaves", cut)):
      layout.chunk_segments = fn
      try:
        tx = jaxcomp.METHODS[name](axis_name="d", transport="scatter", min_size=1)
        state = jaxcomp.per_worker(tx.init(params), workers)
        start = time.perf_counter()
        step = jax.pmap(tx.update, axis_name="d").lower(grads, state).compile()
        compile_s = time.perf_counter() - start
      finally:
        layout.chunk_segments = cut
      out, state = step(grads, state)
      times = []
      for _ in range(3):
        start = time.perf_counter()
        out, state = step(grads, state)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
      print(f"{name:9s} {label:14s} compile {compile_s:6.2f} s  step {1000 * min(times):7.1f} ms"
            f" ({workers} workers on this machine)", flush=True)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--time"]:
    timed(sys.argv[2:])
  else:
    main()
