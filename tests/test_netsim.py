"""The alpha-beta network model pinned against hand-computed cases."""

import math

import jax
import jax.numpy as jnp
import pytest
from harness import AXIS, init_stacked, params_tree, worker_grads

import jaxcomp
from jaxcomp.collectives.hlo import runs as collective_runs
from jaxcomp.planning import netsim

MB = 1e6
B10 = 1.25e9  # 10 Gb/s in bytes/s
ALPHA = 1e-5


def test_gbit_converts_gigabits_to_bytes_per_second():
  assert netsim.gbit(10) == 1.25e9
  assert netsim.gbit(1) == 125e6
  assert netsim.Link.gbps(100, 2e-6) == netsim.Link(12.5e9, 2e-6)


def test_ring_allreduce():
  # 2 (N-1)/N * bytes/B + 2 (N-1) alpha
  assert netsim.ring_allreduce(100 * MB, 8, B10, ALPHA) == pytest.approx(2 * 7 / 8 * 0.08 + 14 * ALPHA)
  assert netsim.ring_allreduce(100 * MB, 64, B10, 0.0) == pytest.approx(2 * 63 / 64 * 0.08)
  assert netsim.ring_allreduce(100 * MB, 1, B10, ALPHA) == 0.0


def test_tree_allreduce():
  # 2 ceil(log2 N) (bytes/B + alpha): reduce up a binomial tree, broadcast down
  assert netsim.tree_allreduce(10 * MB, 8, B10, ALPHA) == pytest.approx(6 * (0.008 + ALPHA))
  assert netsim.tree_allreduce(10 * MB, 5, B10, ALPHA) == pytest.approx(6 * (0.008 + ALPHA))
  assert netsim.tree_allreduce(10 * MB, 2, B10, 0.0) == pytest.approx(2 * 0.008)


def test_allgather_ring_and_recursive_doubling():
  # each worker contributes m bytes: ring (N-1)(m/B + alpha); doubling (N-1) m/B + log2 N alpha
  assert netsim.ring_allgather(1 * MB, 32, B10, ALPHA) == pytest.approx(31 * (0.0008 + ALPHA))
  assert netsim.tree_allgather(1 * MB, 32, B10, ALPHA) == pytest.approx(31 * 0.0008 + 5 * ALPHA)


def test_reduce_scatter_ring_and_recursive_halving():
  assert netsim.ring_reduce_scatter(64 * MB, 8, B10, ALPHA) == pytest.approx(7 / 8 * 0.0512 + 7 * ALPHA)
  assert netsim.tree_reduce_scatter(64 * MB, 8, B10, ALPHA) == pytest.approx(7 / 8 * 0.0512 + 3 * ALPHA)


def test_allreduce_is_reduce_scatter_plus_allgather_on_a_ring():
  n, w = 48 * MB, 16
  rs = netsim.ring_reduce_scatter(n, w, B10, ALPHA)
  ag = netsim.ring_allgather(n / w, w, B10, ALPHA)
  assert netsim.ring_allreduce(n, w, B10, ALPHA) == pytest.approx(rs + ag)


def test_flat_network_uses_the_formulas():
  net = netsim.flat(8, 10, ALPHA)
  assert net.allreduce(100 * MB) == netsim.ring_allreduce(100 * MB, 8, B10, ALPHA)
  assert net.allgather(MB) == netsim.ring_allgather(MB, 8, B10, ALPHA)
  tree = netsim.flat(8, 10, ALPHA, algorithm="tree")
  assert tree.allreduce(100 * MB) == netsim.tree_allreduce(100 * MB, 8, B10, ALPHA)
  assert tree.collective("all-gather", MB) == netsim.tree_allgather(MB, 8, B10, ALPHA)


def test_two_level_allreduce_by_hand():
  # 16 workers = 4 nodes x 4; inside 100 Gb/s (12.5e9 B/s, alpha_i), between 10 Gb/s (alpha).
  n, ai = 80 * MB, 1e-6
  net = netsim.two_level(16, 4, 10, 100, ALPHA, ai)
  intra_rs = 3 / 4 * n / 12.5e9 + 3 * ai
  inter_ar = 2 * 3 / 4 * n / B10 + 6 * ALPHA  # 4 concurrent rings of n/4 share each node's link
  intra_ag = 3 * (n / 4 / 12.5e9 + ai)
  assert net.allreduce(n) == pytest.approx(intra_rs + inter_ar + intra_ag)


def test_two_level_allgather_by_hand():
  m, ai = 2 * MB, 1e-6
  net = netsim.two_level(16, 4, 10, 100, ALPHA, ai)
  intra = 3 * (m / 12.5e9 + ai)
  inter = 3 * (4 * m / B10 + ALPHA)
  spread = 3 * (3 * m / 12.5e9 + ai)
  assert net.allgather(m) == pytest.approx(intra + inter + spread)


def test_two_level_one_node_has_no_slow_link():
  net = netsim.two_level(8, 8, 1, 100, ALPHA, 0.0)
  assert net.allreduce(100 * MB) == pytest.approx(netsim.ring_allreduce(100 * MB, 8, 12.5e9, 0.0))


def test_two_level_beats_flat_on_a_slow_link():
  flat = netsim.flat(64, 10, ALPHA)
  two = netsim.two_level(64, 8, 10, 300, ALPHA, 1e-6)
  assert two.allreduce(100 * MB) < flat.allreduce(100 * MB) * 1.01
  assert two.allgather(MB) < flat.allgather(MB)


def test_communication_time_of_totals_and_of_a_list():
  net = netsim.flat(8, 10, ALPHA)
  totals = {"all-reduce": 40 * MB, "all-gather": MB, "reduce-scatter": 0, "all-to-all": 0,
            "collective-permute": 0, "total": 41 * MB, "count": 3}
  expect = netsim.ring_allreduce(40 * MB, 8, B10, ALPHA) + netsim.ring_allgather(MB, 8, B10, ALPHA)
  assert netsim.communication_time(totals, net) == pytest.approx(expect)
  split = [("all-reduce", 20 * MB), ("all-reduce", 20 * MB), ("all-gather", MB)]
  assert netsim.communication_time(split, net) == pytest.approx(expect + 14 * ALPHA)


def test_buckets_fuse_each_kind():
  net = netsim.flat(8, 10, ALPHA)
  many = [("all-reduce", MB)] * 100
  fused = netsim.communication_time(many, net, bucket_bytes=25 * MB)
  assert fused == pytest.approx(4 * netsim.ring_allreduce(25 * MB, 8, B10, ALPHA))
  assert netsim.communication_time(many, net) == pytest.approx(100 * netsim.ring_allreduce(MB, 8, B10, ALPHA))


def test_step_time_with_and_without_overlap():
  s = netsim.step_time(0.3, 0.01, 0.5)
  assert s.total == pytest.approx(0.81)
  # forward 0.1 + compression + max(backward 0.2, communication)
  assert netsim.step_time(0.3, 0.01, 0.5, overlap=True).total == pytest.approx(0.61)
  assert netsim.step_time(0.3, 0.01, 0.1, overlap=True).total == pytest.approx(0.31)
  assert netsim.step_time(0.3, 0.0, 0.1, overlap=True, backward_fraction=0.5).total == pytest.approx(0.3)


def test_compression_time_adds_decodes_for_gathered_methods():
  assert netsim.compression_time(0.01, 0.002, 8, gathered=True) == pytest.approx(0.024)
  assert netsim.compression_time(0.01, 0.002, 8, gathered=False) == pytest.approx(0.01)


def test_predict_and_speedup():
  net = netsim.flat(8, 1, 0.0)
  dense = netsim.predict({"all-reduce": 100 * MB}, net, 0.3)
  sparse = netsim.predict({"all-gather": 1 * MB}, net, 0.3, compression=0.02)
  assert dense.total == pytest.approx(0.3 + 2 * 7 / 8 * 0.8)
  assert sparse.total == pytest.approx(0.3 + 0.02 + 7 * 0.008)
  assert netsim.speedup(sparse, dense) == pytest.approx(dense.total / sparse.total)


def test_collectives_read_from_compiled_programs():
  params = params_tree()
  for name, kind in (("none", "all-reduce"), ("topk", "all-gather")):
    tx = jaxcomp.METHODS[name](axis_name=AXIS)
    step = jax.pmap(lambda g, s, tx=tx: tx.update(g, s), axis_name=AXIS)
    hlo = step.lower(worker_grads(params), init_stacked(tx, params)).compile().as_text()
    colls = collective_runs(hlo)
    # beyond the 4-byte non-finite flag that gathered methods all-reduce
    assert {k for k, b in colls if b > 4} == {kind}
    assert sum(b for _, b in colls) == jaxcomp.collective_bytes(hlo)["total"]
    assert sum(b for _, b in colls) == jaxcomp.wire_bytes(tx, params)


@pytest.mark.parametrize("call, match", [
    (lambda: netsim.ring_allreduce(1.0, 0, 1.0), "workers"),
    (lambda: netsim.ring_allreduce(1.0, 8, 0.0), "bandwidth"),
    (lambda: netsim.ring_allreduce(-1.0, 8, 1.0), "nbytes"),
    (lambda: netsim.ring_allreduce(1.0, 8, 1.0, -1.0), "latency"),
    (lambda: netsim.Network(8, netsim.Link(1.0), per_node=3, intra=netsim.Link(1.0)), "per_node"),
    (lambda: netsim.Network(8, netsim.Link(1.0), per_node=4), "intra"),
    (lambda: netsim.flat(8, 1, algorithm="star"), "algorithm"),
    (lambda: netsim.flat(8, 1).collective("broadcast", 1.0), "kind"),
    (lambda: netsim.communication_time([("bcast", 1.0)], netsim.flat(8, 1)), "kind"),
    (lambda: netsim.communication_time({"all-reduce": 1.0}, netsim.flat(8, 1), bucket_bytes=0),
     "bucket_bytes"),
    (lambda: netsim.step_time(-1.0, 0.0, 0.0), "compute"),
    (lambda: netsim.step_time(1.0, 0.0, 0.0, backward_fraction=2.0), "backward_fraction"),
])
def test_bad_arguments_are_named(call, match):
  with pytest.raises((ValueError, TypeError), match=match):
    call()


def test_no_time_for_one_worker():
  net = netsim.flat(1, 1, ALPHA)
  for kind in netsim.KINDS:
    assert net.collective(kind, 100 * MB) == 0.0
  assert math.isclose(netsim.predict({"all-reduce": 100 * MB}, net, 0.3).total, 0.3)


def test_hierarchical_time_by_hand():
  # 2 nodes x 2 workers: 1e9 B/s between nodes, 1e10 B/s inside, alpha 1 us on both
  net = netsim.two_level(4, 2, 8.0, 80.0, latency=1e-6, intra_latency=1e-6)
  rs = 0.5 * 1000 / 1e10 + 1e-6            # reduce-scatter of the 1000 dense bytes inside the node
  ag = 1 * 500 / 1e10 + 1e-6               # all-gather of the 500-byte mean chunks inside the node
  slow = 1 * (2 * 100) / 1e9 + 1e-6        # both workers' 100-byte chunk payloads through the node's link
  got = netsim.hierarchical_time([("all-gather", 100)], 1000, net)
  assert got == pytest.approx(rs + ag + slow)
  # not chunked: a dense all-reduce inside, then every worker's whole payload between nodes
  ar = 2 * 0.5 * 1000 / 1e10 + 2e-6
  slow_ar = 2 * 0.5 * (2 * 300) / 1e9 + 2e-6
  got = netsim.hierarchical_time([("all-reduce", 300)], 1000, net, chunked=False)
  assert got == pytest.approx(ar + slow_ar)
  with pytest.raises(ValueError, match="two-level"):
    netsim.hierarchical_time([("all-gather", 100)], 1000, netsim.flat(4, 10.0))
  with pytest.raises(ValueError, match="slow collectives"):
    netsim.hierarchical_time([("all-to-all", 100)], 1000, net)


def test_twolevel_bench_traffic_matches_the_bytes_by_axis():
  from jaxcomp_bench import twolevel

  params = {"w": jnp.zeros((512, 256)), "b": jnp.zeros((256,))}
  for name in ("topk", "qsgd", "powersgd", "none"):
    tx = jaxcomp.METHODS[name](axis_name="dcn", dense_axis_name="ici")
    flat, slow, dense, chunked = twolevel.traffic(tx, params, 8)
    by_axis = jaxcomp.wire_bytes_by_axis(tx, params, 8)
    flag = by_axis["both"] if chunked else jaxcomp.wire_bytes(tx, params) - sum(b for _, b in flat)
    assert sum(b for _, b in slow) + (0 if chunked else flag) == by_axis["dcn"]
    assert chunked == (name != "powersgd")
    assert dense == 4 * (512 * 256 + 256)
  assert "`topk`" in twolevel.table(models=("resnet50",), methods=("topk",), gbps=(10.0,))
