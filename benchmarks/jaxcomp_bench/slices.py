"""``python -m jaxcomp.bench slices``: a multi-slice step of a sharded 8B model, priced by the network model.

Past this machine: ``slices`` slices of ``chips`` chips each; inside a slice
the parameters are sharded over every chip (FSDP, ``jaxcomp.data_parallel``
with ``param_specs``), so each chip holds 1/``chips`` of every matrix; between
slices only the compressed exchange runs, each chip with the chips that hold
the same shard in the other slices. A host's link (``--gbps``) is shared by
its ``chips_per_host`` chips, which exchange at once: each gets that fraction of it.

The bytes are :func:`jaxcomp.traffic` of each method on one chip's shards of a
Llama-3-8B-shaped tree (no compile: the bucket layout and the codecs'
payload shapes); the time is :mod:`jaxcomp.planning.netsim`'s ring model of
those collectives among ``slices`` workers. Compute: ``6 x parameters x
tokens per chip`` FLOPs at ``peak x mfu``; compression is not priced (a few
passes over 31M entries per chip at HBM speed: about 1 ms) and nothing
overlaps (an upper bound on the communication's share).
"""

from __future__ import annotations

import argparse
import dataclasses

import optax

import jaxcomp
from jaxcomp.planning import netsim
from jaxcomp_bench.common import fmt_bytes, header, markdown_table
from jaxcomp_bench.shapes import llama8b_shard

METHODS = ("none", "bf16", "qsgd", "signsgd", "topk", "dgc", "powersgd", "sbc", "onebit_adam")
DILOCO_H = (16, 64)  # DiLoCo rows: the dense float32 exchange once every H steps
ACROSS_REGIONS_S = 30e-3  # latency per message between regions (an assumption: tens of ms of round trip)


@dataclasses.dataclass(frozen=True)
class Setting:
  slices: int = 4
  chips: int = 256  # per slice
  chips_per_host: int = 4
  tokens_per_chip: int = 2048  # per step
  peak_flops: float = 197e12  # bf16 per chip (TPU v5e)
  mfu: float = 0.4
  latency_s: float = 10e-6


def transform(name: str):
  if name == "onebit_adam":
    return jaxcomp.onebit_adam(1e-4, axis_name="dcn")
  if name == "sbc":
    return jaxcomp.sbc(axis_name="dcn", delay=4, optimizer=optax.sgd(0.1))
  return jaxcomp.METHODS[name](axis_name="dcn")


def _traffic(s: Setting, shard) -> list:
  """``(label, collectives, sync every)`` of each method and DiLoCo row."""
  out = []
  for name in METHODS:
    tx = transform(name)
    every = jaxcomp.method_of(tx, shard).sync_every
    out.append((name, jaxcomp.traffic(tx, shard, workers=s.slices), every))
  out += [(f"diloco H={h}", out[0][1], h) for h in DILOCO_H]
  return out


def rows(s: Setting, gbps: tuple) -> list:
  shard = llama8b_shard(s.chips)
  params = 8.03e9
  compute = 6 * params * s.tokens_per_chip / (s.peak_flops * s.mfu)
  out, dense = [], {}
  for name, traffic, every in _traffic(s, shard):
    nbytes = sum(b for _, b in traffic) / every
    row = [name, fmt_bytes(nbytes)]
    for g in gbps:
      net = netsim.flat(s.slices, g / s.chips_per_host, s.latency_s)
      comm = netsim.communication_time(traffic, net) / every
      step = compute + comm
      dense.setdefault(g, step)
      row += [f"{comm:.3f}", f"{step:.3f}", f"{dense[g] / step:.2f}x"]
    out.append(row)
  return out


def table(s: Setting, gbps: tuple) -> str:
  head = ["method", "bytes/chip/step over dcn"]
  for g in gbps:
    head += [f"comm s ({g:g} Gb/s/host)", "step s", "vs dense f32"]
  return markdown_table(head, rows(s, gbps))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m jaxcomp.bench slices", description=__doc__.splitlines()[0])
  ap.add_argument("--gbps", default="1,10,25,100", help="per-host bandwidth between slices, Gb/s")
  for f in dataclasses.fields(Setting):
    ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
  ap.add_argument("--regions", action="store_true",
                  help="also the table across regions (30 ms per message, assumed)")
  args = ap.parse_args(argv)
  s = Setting(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Setting)})
  gbps = tuple(float(g) for g in args.gbps.split(","))
  print(header("python -m jaxcomp.bench slices"))
  print(f"Llama-3-8B shapes (8.03e9 parameters), {s.slices} slices x {s.chips} chips, FSDP inside a slice"
        f" ({s.chips_per_host} chips per host share its link), {s.tokens_per_chip} tokens per chip per step,"
        f" compute at {s.peak_flops:.3g} FLOP/s x {s.mfu} MFU, {s.latency_s * 1e6:g} us latency, ring"
        " collectives, no overlap, compression not priced; DiLoCo H: the dense exchange every H steps"
        " (its inner steps' loss not priced).\n")
  print(table(s, gbps))
  if args.regions:
    print(f"\nacross regions: {ACROSS_REGIONS_S * 1e3:g} ms per message (assumed)\n")
    print(table(dataclasses.replace(s, latency_s=ACROSS_REGIONS_S), gbps))
