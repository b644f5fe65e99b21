"""Bytes per worker per step of each sparsifier at its defaults against every leaf compressed.

ResNet-50's 161 gradient shapes (jaxcomp_bench.shapes), jaxcomp.wire_bytes (nominal == measured
from the compiled HLO, tests/test_properties.py). Usage: ``python benchmarks/leaf_policy_bytes.py``.
"""

import os

os.environ.setdefault("PJRT_NPROC", "16")

import jaxcomp  # noqa: E402
from jaxcomp_bench import shapes  # noqa: E402

SPARSE = ("topk", "randomk", "threshold", "dgc", "adaq", "redsync", "sbc")


def main():
  tree = shapes.abstract(shapes.resnet50_shapes())
  dense = jaxcomp.wire_bytes(jaxcomp.none(axis_name="d"), tree)
  for name in SPARSE:
    factory = jaxcomp.METHODS[name]
    default = jaxcomp.wire_bytes(factory(axis_name="d"), tree)
    every = jaxcomp.wire_bytes(factory(axis_name="d", min_size=1), tree)  # 0 or 1: every leaf
    print(f"{name:10s} defaults {default:>11,d} B  every leaf {every:>11,d} B  ratio {default / every:.3f}"
          f"  ({dense / default:.0f}x fewer than dense)")


if __name__ == "__main__":
  main()
