"""What cutting the scatter exchange's chunks at leaf boundaries costs in bytes.

``transport="scatter"`` cuts every chunk wherever any chunk holds a leaf's boundary
(``jaxcomp.layout.chunk_segments``), so a codec with a per-segment scale or norm sends one per
leaf piece of each chunk instead of one per chunk. Prints, for ResNet-50's 161 and BERT-base's
199 gradient shapes (jaxcomp.bench.shapes), each scale codec's bytes per worker per step
(``jaxcomp.wire_bytes``) cut at leaves over one segment per chunk, at N = 8, 64, 1024.
Usage: ``python benchmarks/scatter_leaf_cuts_bytes.py``.
"""

import os

os.environ.setdefault("PJRT_NPROC", "16")

import jaxcomp  # noqa: E402
from jaxcomp import layout  # noqa: E402
from jaxcomp.bench import shapes  # noqa: E402

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


if __name__ == "__main__":
  main()
