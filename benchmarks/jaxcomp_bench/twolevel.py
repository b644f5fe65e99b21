"""``python -m jaxcomp.bench twolevel``: flat against two-level compression on nodes x devices.

For ResNet-50- and BERT-base-shaped gradients on 8 nodes x 8 devices
(NVLink-class links inside a node, 10/25/100 Gb/s between nodes), the
communication time per step of: the dense all-reduce (hierarchical, as NCCL
runs it), the method compressing over all 64 workers (flat), and the method
with ``dense_axis_name`` (:mod:`jaxcomp.exchanges.hierarchy`: dense inside the node,
the method's chunk payload between nodes), priced by :mod:`jaxcomp.planning.netsim`
(:meth:`Network.collective` and :func:`netsim.hierarchical_time`) from each
method's nominal bytes per bucket (``bucket_wire_bytes``, which equal the
compiled programs' bytes: README, network table). The step speed-up adds
the compute time of :mod:`jaxcomp_bench.network` (V100, no overlap) and
leaves compression time out (it is the same kernel on a chunk 1/8 the size).
"""

from __future__ import annotations

import argparse

from jaxcomp.planning import netsim
from jaxcomp_bench.common import COMPUTE, LABELS, plain

DEFAULT_METHODS = ("none", "fp16", "powersgd", "acpsgd", "topk", "signsgd", "qsgd", "dgc")
NODES, PER_NODE = 8, 8
INTRA_GBPS = 2400.0  # NVLink-class: 300 GB/s per GPU (V100 NVLink 2.0 aggregate)
GBPS = (10.0, 25.0, 100.0)
LATENCY_US = 10.0


def _kind(exchange) -> str:
  return "all-reduce" if exchange.all_reduces else "all-gather"


def traffic(tx, params, per_node: int):
  """(flat traffic, slow traffic of the two-level exchange, dense bytes, chunked) of ``tx`` on ``params``."""
  import jaxcomp
  from jaxcomp.exchanges import hierarchy

  method = jaxcomp.steady(tx).method
  full = method.buckets(params)
  dense = sum(4 * b.length for b in full)
  if method.fused is not None:
    flat = [("all-reduce", method.wire_bytes(params, nonfinite_flag=False))]
    return flat, flat, dense, False
  flat = [(_kind(b.exchange), b.exchange.bucket_wire_bytes(b.segments)) for b in full]
  if not method.chunkable:
    return flat, flat, dense, False
  chunks = hierarchy.chunked(full, per_node)
  slow = [(_kind(b.exchange), b.exchange.bucket_wire_bytes(b.segments)) for b in chunks]
  return flat, slow, dense, True


def table(models=("resnet50", "bert-base"), methods=DEFAULT_METHODS, gbps=GBPS, nodes=NODES,
          per_node=PER_NODE, intra_gbps=INTRA_GBPS, latency_us=LATENCY_US) -> str:
  import jaxcomp
  from jaxcomp_bench import shapes as shp

  lines = []
  for model in models:
    params = shp.abstract(shp.MODELS[model]())
    compute = COMPUTE[model][0]
    head = ["method"] + [f"{g:g}G: {c}" for g in gbps for c in ("dense", "flat", "2-level", "x dense")]
    lines += [f"{LABELS[model]}, {nodes} nodes x {per_node} devices, {intra_gbps:g} Gb/s inside a"
              f" node, alpha {latency_us:g} us; communication ms per step (dense: hierarchical all-reduce;"
              " flat: the method over all workers; 2-level: dense_axis_name), x dense: predicted step"
              f" speed-up of 2-level over dense ({1e3 * compute:.0f} ms compute, no overlap)", "",
              "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    nets = {g: netsim.two_level(nodes * per_node, per_node, g, intra_gbps, latency_us * 1e-6,
                                latency_us * 1e-6) for g in gbps}
    dense_tx = jaxcomp.none(axis_name="data")
    dense_flat, _, _, _ = traffic(dense_tx, params, per_node)
    for name in methods:
      flat, slow, dense_bytes, chunked = traffic(jaxcomp.METHODS[name](axis_name="data"), params, per_node)
      row = [f"`{name}`"]
      for g in gbps:
        net = nets[g]
        t_dense = netsim.communication_time(dense_flat, net)
        t_flat = netsim.communication_time(flat, net)
        t_two = netsim.hierarchical_time(slow, dense_bytes, net, chunked)
        row += [f"{1e3 * t_dense:.1f}", f"{1e3 * t_flat:.1f}", f"{1e3 * t_two:.1f}",
                f"{(compute + t_dense) / (compute + t_two):.2f}"]
      lines.append("| " + " | ".join(row) + " |")
    lines.append("")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxcomp.bench twolevel", description=plain(__doc__),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="resnet50,bert-base")
  parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
  parser.add_argument("--gbps", default=",".join(f"{g:g}" for g in GBPS), help="between nodes, Gb/s")
  parser.add_argument("--nodes", type=int, default=NODES)
  parser.add_argument("--per-node", type=int, default=PER_NODE)
  parser.add_argument("--intra-gbps", type=float, default=INTRA_GBPS)
  parser.add_argument("--latency-us", type=float, default=LATENCY_US)
  args = parser.parse_args(argv)
  print(table(tuple(m for m in args.models.split(",") if m), tuple(m for m in args.methods.split(",") if m),
              tuple(float(g) for g in args.gbps.split(",")), args.nodes, args.per_node, args.intra_gbps,
              args.latency_us))


if __name__ == "__main__":
  main()
