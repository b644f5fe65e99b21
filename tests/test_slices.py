"""python -m jaxcomp.bench slices: the multi-slice prediction's bytes and times are consistent."""

import math

import jax
import numpy as np

from jaxcomp.planning import netsim
from jaxcomp_bench import slices


def test_dense_bytes_are_the_shards_and_compression_never_slows_the_model():
  s = slices.Setting()
  shard = slices.llama8b_shard(s.chips)
  entries = sum(math.prod(x.shape) for x in jax.tree.leaves(shard))
  assert 31e6 < entries < 32e6  # 8.03e9 / 256 per chip
  table = {r[0]: r for r in slices.rows(s, (25.0,))}
  dense = float(table["none"][1].replace(",", ""))
  np.testing.assert_allclose(dense, 4 * entries, rtol=1e-3)  # float32, bucket padding aside
  # the dense all-reduce priced by hand: 2 (N-1)/N n / B + 2 (N-1) alpha, B = 25 Gb/s / 4 chips
  want = netsim.ring_allreduce(dense, s.slices, netsim.gbit(25.0 / s.chips_per_host), s.latency_s)
  assert abs(float(table["none"][2]) - want) < 2e-3
  for name, row in table.items():
    assert float(row[4].rstrip("x")) >= 1.0, name
  assert float(table["topk"][1].replace(",", "")) < dense / 50
  for h in slices.DILOCO_H:  # DiLoCo: the dense exchange once every H steps
    assert float(table[f"diloco H={h}"][1].replace(",", "")) == np.round(dense / h)
    np.testing.assert_allclose(float(table[f"diloco H={h}"][2]), float(table["none"][2]) / h, atol=2e-3)
