"""An alpha-beta model of data-parallel communication and step time.

Units: bytes, seconds, and bandwidths in **bytes per second** (use
:func:`gbit` to convert from Gb/s: ``gbit(10) == 1.25e9``). A message of ``m``
bytes over a link costs ``alpha + m / B`` (latency ``alpha``, bandwidth
``B``). With ``N`` workers:

============================  ============================================
ring all-reduce (n bytes)     ``2 (N-1)/N * n/B + 2 (N-1) alpha``
tree all-reduce               ``2 ceil(log2 N) * (n/B + alpha)`` (binomial
                              tree reduce, then broadcast, unpipelined)
ring all-gather (m per        ``(N-1) * (m/B + alpha)``
worker)
tree all-gather (recursive    ``(N-1) m/B + ceil(log2 N) alpha``
doubling)
ring reduce-scatter (n bytes) ``(N-1)/N * n/B + (N-1) alpha``
tree reduce-scatter           ``(N-1)/N * n/B + ceil(log2 N) alpha``
(recursive halving)
============================  ============================================

Two levels (:class:`Network` with ``per_node = g > 1`` and an ``intra``
link): ``M = N / g`` nodes, each with one link of bandwidth ``B`` to the
others, shared by its ``g`` workers. An all-reduce is a reduce-scatter inside
the node, ``g`` concurrent all-reduces of ``n/g`` bytes between nodes (together
``n`` bytes through each node's link: priced as one all-reduce of ``n`` over
``M``), and an all-gather inside the node. An all-gather is one inside the
node, one of ``g m`` bytes per node between nodes, and one inside the node of
the ``(M-1) m`` bytes each worker received.

Step time (:func:`step_time`): ``compute + compression + communication``
without overlap; with overlap (wait-free backprop, ideal tensor fusion) the
communication runs during backprop: ``forward + compression + max(backward,
communication)``, where backward is ``backward_fraction`` of compute (2/3 by
default: backward costs about twice the forward). Compression runs on the
compute device, so it never overlaps.
The bytes come from the compiled program (:func:`jaxcomp.collectives.hlo.runs`) or the bucket
layout (:func:`jaxcomp.traffic`), never from a table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Union

from jaxcomp.collectives import hlo

ALGORITHMS = ("ring", "tree")
KINDS = hlo.KINDS


def gbit(gbps: float) -> float:
  """Bandwidth in Gb/s (10^9 bits per second) -> bytes per second."""
  return float(gbps) * 1e9 / 8.0


def _check(workers: int, nbytes: float, bandwidth: float, latency: float) -> None:
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError(f"workers must be an int >= 1, got workers={workers!r}")
  if not nbytes >= 0:
    raise ValueError(f"nbytes must be >= 0, got nbytes={nbytes!r}")
  if not bandwidth > 0 or math.isinf(bandwidth):
    raise ValueError(f"bandwidth must be a finite number > 0 (bytes/s), got bandwidth={bandwidth!r}")
  if not latency >= 0:
    raise ValueError(f"latency must be >= 0 (seconds), got latency={latency!r}")


def _log2(n: int) -> int:
  return (n - 1).bit_length()  # ceil(log2 n), 0 for n = 1


def ring_allreduce(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
  """Ring all-reduce of ``nbytes`` (reduce-scatter + all-gather): seconds."""
  _check(workers, nbytes, bandwidth, latency)
  n = workers
  return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def tree_allreduce(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
  """Binomial-tree reduce then broadcast of ``nbytes``, unpipelined: seconds."""
  _check(workers, nbytes, bandwidth, latency)
  return 2 * _log2(workers) * (nbytes / bandwidth + latency)


def ring_allgather(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
  """Ring all-gather where each worker contributes ``nbytes``: seconds."""
  _check(workers, nbytes, bandwidth, latency)
  return (workers - 1) * (nbytes / bandwidth + latency)


def tree_allgather(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
  """Recursive-doubling all-gather, ``nbytes`` per worker: seconds."""
  _check(workers, nbytes, bandwidth, latency)
  return (workers - 1) * nbytes / bandwidth + _log2(workers) * latency


def ring_reduce_scatter(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
  """Ring reduce-scatter of an ``nbytes`` buffer (each worker ends with nbytes / N): seconds."""
  _check(workers, nbytes, bandwidth, latency)
  n = workers
  return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def tree_reduce_scatter(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
  """Recursive-halving reduce-scatter of an ``nbytes`` buffer: seconds."""
  _check(workers, nbytes, bandwidth, latency)
  n = workers
  return (n - 1) / n * nbytes / bandwidth + _log2(n) * latency


def alltoall(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
  """Pairwise all-to-all where each worker sends ``nbytes`` in all (nbytes / N to each): seconds."""
  _check(workers, nbytes, bandwidth, latency)
  n = workers
  return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def permute(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
  """Collective-permute: each worker sends ``nbytes`` to one peer: seconds."""
  _check(workers, nbytes, bandwidth, latency)
  return nbytes / bandwidth + latency if workers > 1 else 0.0


_FLAT = {
    ("ring", "all-reduce"): ring_allreduce, ("tree", "all-reduce"): tree_allreduce,
    ("ring", "all-gather"): ring_allgather, ("tree", "all-gather"): tree_allgather,
    ("ring", "reduce-scatter"): ring_reduce_scatter, ("tree", "reduce-scatter"): tree_reduce_scatter,
}


@dataclasses.dataclass(frozen=True)
class Link:
  """A link: ``bandwidth`` in bytes/s, ``latency`` (alpha) in seconds per message."""

  bandwidth: float
  latency: float = 0.0

  def __post_init__(self):
    _check(1, 0, self.bandwidth, self.latency)

  @classmethod
  def gbps(cls, gbps: float, latency: float = 0.0) -> Link:
    """A link of ``gbps`` Gb/s (converted to bytes/s) and ``latency`` seconds."""
    return cls(gbit(gbps), latency)


@dataclasses.dataclass(frozen=True)
class Network:
  """N workers on ``link`` (flat), or on nodes of ``per_node`` workers (two-level).

  Attributes:
    workers: N, the number of data-parallel workers.
    link: flat: each worker's link; two-level: each node's link to the other
      nodes (shared by the node's workers).
    per_node: workers per node (g); ``1`` is a flat network. Must divide N.
    intra: the links between the workers of a node (two-level only).
    algorithm: ``"ring"`` or ``"tree"`` (all-reduce, all-gather, reduce-scatter).
  """

  workers: int
  link: Link
  per_node: int = 1
  intra: Link | None = None
  algorithm: str = "ring"

  def __post_init__(self):
    if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
      raise ValueError(f"workers must be an int >= 1, got workers={self.workers!r}")
    if not isinstance(self.link, Link):
      raise TypeError(f"link must be a netsim.Link, got link={self.link!r}")
    g = self.per_node
    if isinstance(g, bool) or not isinstance(g, int) or g < 1 or self.workers % g:
      raise ValueError(f"per_node must be an int >= 1 dividing workers={self.workers}, got per_node={g!r}")
    if g > 1 and not isinstance(self.intra, Link):
      raise ValueError(f"a two-level network (per_node={g}) needs intra=netsim.Link(...)")
    if self.algorithm not in ALGORITHMS:
      raise ValueError(f"algorithm must be one of {ALGORITHMS}, got algorithm={self.algorithm!r}")

  @property
  def nodes(self) -> int:
    return self.workers // self.per_node

  def one_level(self, kind: str, nbytes: float, workers: int, link: Link) -> float:
    """Seconds for one collective of ``kind`` among ``workers`` on ``link``, with this network's algorithm.

    One level of a two-level collective (inside a node, or between nodes);
    0 for one worker. ``kind``: all-reduce, all-gather or reduce-scatter.
    """
    if workers == 1:
      return 0.0
    return _FLAT[(self.algorithm, kind)](nbytes, workers, link.bandwidth, link.latency)

  def allreduce(self, nbytes: float) -> float:
    """Seconds to all-reduce an ``nbytes`` buffer."""
    g, m = self.per_node, self.nodes
    if g == 1:
      return self.one_level("all-reduce", nbytes, m, self.link)
    return (self.one_level("reduce-scatter", nbytes, g, self.intra)
            + self.one_level("all-reduce", nbytes, m, self.link)
            + self.one_level("all-gather", nbytes / g, g, self.intra))

  def allgather(self, nbytes: float) -> float:
    """Seconds to all-gather ``nbytes`` from every worker."""
    g, m = self.per_node, self.nodes
    if g == 1:
      return self.one_level("all-gather", nbytes, m, self.link)
    return (self.one_level("all-gather", nbytes, g, self.intra)
            + self.one_level("all-gather", g * nbytes, m, self.link)
            + self.one_level("all-gather", (m - 1) * nbytes, g, self.intra))

  def reduce_scatter(self, nbytes: float) -> float:
    """Seconds to reduce-scatter an ``nbytes`` buffer."""
    g, m = self.per_node, self.nodes
    if g == 1:
      return self.one_level("reduce-scatter", nbytes, m, self.link)
    return (self.one_level("reduce-scatter", nbytes, g, self.intra)
            + self.one_level("reduce-scatter", nbytes, m, self.link))

  def collective(self, kind: str, nbytes: float) -> float:
    """Seconds for one collective of ``kind`` (an HLO name) moving ``nbytes`` per worker.

    ``nbytes`` is what :func:`jaxcomp.collective_bytes` reports: the buffer of
    an all-reduce, each worker's share of an all-gather, the input of a
    reduce-scatter. All-to-all and collective-permute are priced flat on
    ``link``.
    """
    if kind == "all-reduce":
      return self.allreduce(nbytes)
    if kind == "all-gather":
      return self.allgather(nbytes)
    if kind == "reduce-scatter":
      return self.reduce_scatter(nbytes)
    if kind == "all-to-all":
      if self.workers == 1:
        return 0.0
      return alltoall(nbytes, self.workers, self.link.bandwidth, self.link.latency)
    if kind == "collective-permute":
      return permute(nbytes, self.workers, self.link.bandwidth, self.link.latency)
    raise ValueError(f"kind must be one of {KINDS}, got kind={kind!r}")


def flat(workers: int, gbps: float, latency: float = 0.0, algorithm: str = "ring") -> Network:
  """A flat network of ``workers`` on links of ``gbps`` Gb/s and ``latency`` seconds."""
  return Network(workers, Link.gbps(gbps, latency), algorithm=algorithm)


def two_level(workers: int, per_node: int, gbps: float, intra_gbps: float, latency: float = 0.0,
              intra_latency: float = 0.0, algorithm: str = "ring") -> Network:
  """Nodes of ``per_node`` workers on fast ``intra_gbps`` links, joined by ``gbps`` links."""
  return Network(workers, Link.gbps(gbps, latency), per_node, Link.gbps(intra_gbps, intra_latency),
                 algorithm)


def hierarchical_time(slow: Traffic, dense_bytes: float, network: Network, chunked: bool = True) -> float:
  """Seconds of the two-level compressed exchange (:mod:`jaxcomp.exchanges.hierarchy`) on a two-level network.

  With ``g`` workers per node and ``m`` nodes:

  - ``chunked`` (the default): a reduce-scatter of the ``dense_bytes`` float32
    buckets inside the node, the slow collectives of each worker's chunk
    payload between nodes (``slow``: ``(kind, bytes)`` one worker hands to
    each; the node's ``g`` workers run theirs at once through the node's
    link, priced as one collective of ``g x bytes`` over ``m`` nodes), and an
    all-gather of the ``dense_bytes / g`` mean chunk inside the node.
  - not chunked (PowerSGD, ACP-SGD): an all-reduce of ``dense_bytes`` inside
    the node, then the same slow collectives of the whole payload, every
    worker of the node alike.
  """
  if network.per_node == 1 or network.intra is None:
    raise ValueError("hierarchical_time needs a two-level network (per_node > 1, intra=...)")
  g, m = network.per_node, network.nodes
  if chunked:
    inside = (network.one_level("reduce-scatter", dense_bytes, g, network.intra)
              + network.one_level("all-gather", dense_bytes / g, g, network.intra))
  else:
    inside = network.one_level("all-reduce", dense_bytes, g, network.intra)
  between = 0.0
  for kind, b in _entries(slow):
    if b <= 0:
      continue
    if kind not in ("all-reduce", "all-gather", "reduce-scatter"):
      raise ValueError(f"slow collectives must be all-reduce, all-gather or reduce-scatter, got {kind!r}")
    between += network.one_level(kind, g * b, m, network.link)
  return float(inside + between)


# ----------------------------------------------------------------------------
# Traffic of a compiled program

Traffic = Union[Mapping[str, float], Sequence[tuple[str, float]]]  # noqa: UP007


def _entries(traffic: Traffic) -> list[tuple[str, float]]:
  if isinstance(traffic, Mapping):
    return [(k, float(traffic[k])) for k in KINDS if traffic.get(k)]
  entries = [(str(k), float(b)) for k, b in traffic]
  for k, _ in entries:
    if k not in KINDS:
      raise ValueError(f"collective kind must be one of {KINDS}, got {k!r}")
  return entries


def communication_time(traffic: Traffic, network: Network, bucket_bytes: float | None = None) -> float:
  """Seconds the collectives of one step take on ``network``, one after another.

  Args:
    traffic: either a mapping kind -> bytes (``jaxcomp.collective_bytes``;
      each kind is priced as one collective) or a sequence of ``(kind,
      bytes)``, one per collective (:func:`jaxcomp.collectives.hlo.runs`).
    network: the :class:`Network`.
    bucket_bytes: if given, the bytes of each kind are fused into
      ``ceil(total / bucket_bytes)`` equal collectives (tensor fusion, as
      PyTorch DDP's 25 MB buckets), whatever the program's own split.
  """
  entries = _entries(traffic)
  if bucket_bytes is not None:
    if not bucket_bytes > 0:
      raise ValueError(f"bucket_bytes must be > 0, got bucket_bytes={bucket_bytes!r}")
    totals: dict = {}
    for k, b in entries:
      totals[k] = totals.get(k, 0.0) + b
    entries = []
    for k, b in totals.items():
      if b <= 0:
        continue
      parts = max(1, math.ceil(b / bucket_bytes))
      entries.extend([(k, b / parts)] * parts)
  return float(sum(network.collective(k, b) for k, b in entries if b > 0))


def compression_time(round_trip: float, decode: float = 0.0, workers: int = 1, gathered: bool = False,
                     scattered: bool = False) -> float:
  """Seconds of compression per step: encode + own decode, plus ``N - 1`` decodes when gathered.

  ``round_trip`` is the measured local compress -> decode (``axis_name=None``);
  a method that all-gathers decodes every other worker's payload too, each
  costing ``decode`` seconds. ``scattered`` (``transport="scatter"``): a
  worker decodes N payloads of 1/N of the bucket twice (its chunk from every
  worker, then every owner's chunk) and encodes 1/N of it again: about two
  more decodes of one payload, whatever N (a model, not a measurement).
  """
  if gathered and scattered:
    raise ValueError("gathered and scattered are two exchanges; pass one of them")
  extra = (workers - 1) * decode if gathered else 2 * decode if scattered else 0.0
  return float(round_trip + extra)


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A predicted step: its parts and ``total`` (seconds)."""

  compute: float
  compression: float
  communication: float
  overlap: bool
  total: float


def step_time(compute: float, compression: float, communication: float, overlap: bool = False,
              backward_fraction: float = 2.0 / 3.0) -> StepTime:
  """Step time from its parts (seconds).

  Without overlap: ``compute + compression + communication``. With overlap:
  ``forward + compression + max(backward, communication)``, ``backward =
  backward_fraction * compute``: communication hidden behind backprop as far
  as it lasts (an upper bound on what wait-free backprop achieves).
  """
  for name, v in (("compute", compute), ("compression", compression), ("communication", communication)):
    if not v >= 0:
      raise ValueError(f"{name} must be >= 0 seconds, got {name}={v!r}")
  if not 0.0 <= backward_fraction <= 1.0:
    raise ValueError(f"backward_fraction must be in [0, 1], got backward_fraction={backward_fraction!r}")
  if overlap:
    bwd = backward_fraction * compute
    total = (compute - bwd) + compression + max(bwd, communication)
  else:
    total = compute + compression + communication
  return StepTime(float(compute), float(compression), float(communication), bool(overlap), float(total))


def predict(traffic: Traffic, network: Network, compute: float, compression: float = 0.0,
            overlap: bool = False, bucket_bytes: float | None = None,
            backward_fraction: float = 2.0 / 3.0) -> StepTime:
  """:func:`step_time` with the communication of ``traffic`` on ``network``."""
  comm = communication_time(traffic, network, bucket_bytes)
  return step_time(compute, compression, comm, overlap, backward_fraction)


def speedup(method: StepTime, dense: StepTime) -> float:
  """Dense step time over the method's (> 1: the method is faster)."""
  return dense.total / method.total


__all__ = [
    "ALGORITHMS", "KINDS", "Link", "Network", "StepTime", "alltoall",
    "communication_time", "compression_time", "flat", "gbit", "hierarchical_time", "permute", "predict",
    "ring_allgather", "ring_allreduce", "ring_reduce_scatter", "speedup", "step_time",
    "tree_allgather", "tree_allreduce", "tree_reduce_scatter", "two_level",
]
