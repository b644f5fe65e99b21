"""A compression method (:class:`Method`) and its bucket plan.

A method routes each gradient leaf to an :class:`jaxcomp.core.protocol.Exchange`
under a view shape and names its memory; :meth:`Method.buckets` lays the
leaves of a step out in flat float32 buckets (:mod:`jaxcomp.core.layout`), one
exchange per bucket. Everything here is static: shapes, not values.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence, Tuple

import jax
import numpy as np

from jaxcomp.core import layout, policy
from jaxcomp.core.groups import FusedExchange, groups
from jaxcomp.core.protocol import DENSE, Exchange, Memory
from jaxcomp.exchanges import scatter

NONFINITE_FLAG_BYTES = 4  # one float32 all-reduced per step, see jaxcomp.core.builder


@dataclasses.dataclass(frozen=True)
class Method:
  """A compression method: its name, how leaves are routed, its memory and its bucket policy.

  ``route``: ``shape -> (exchange, view)`` for each gradient leaf.
  ``fused``: when set, one :class:`FusedExchange` handles every group of a
  step instead of each bucket's exchange on its own.
  ``start_step``: steps before which every bucket travels dense (warm-up).
  ``chunkable``: under a fast axis the buckets may be cut into chunks
  (:mod:`jaxcomp.exchanges.hierarchy`); False for exchanges that read the leaves' shapes.
  ``stages``: ``(first step, route)`` of each later stage of a schedule (see
  :func:`jaxcomp.staged`); ``route`` is the first stage's. Every stage lays the
  leaves out alike, so the memory and the exchanges' state carry over.
  ``sync_every``: steps per communication (SBC's delay; for byte rates and the network model).
  ``bucket_bytes``, ``min_size``, ``dense``, ``transport``: see :func:`jaxcomp.build`.
  ``loop_buckets``: buckets whose codec can read its tables as data run as one loop
  (:mod:`jaxcomp.core.stacking`; :func:`jaxcomp.configure`).
  """

  name: str
  route: Callable[[Tuple[int, ...]], Tuple[Exchange, Tuple[int, ...]]]
  memory: Memory
  fused: FusedExchange | None = None
  start_step: int = 0
  stages: Tuple[Tuple[int, Callable], ...] = ()
  chunkable: bool = True
  sync_every: int = 1
  bucket_bytes: int = layout.BUCKET_BYTES
  min_size: int | None = None
  dense: Any = None
  transport: str = "gather"
  loop_buckets: bool = False

  def buckets(self, updates: Any, stage: int = 0) -> Tuple[layout.Bucket, ...]:
    """The bucket layout of a gradient tree (static: shapes and the dense mask only).

    ``stage``: whose exchanges the buckets hold (0, the first, or ``i`` for
    ``stages[i - 1]``); the layout itself is the same for every stage.
    """
    leaves = jax.tree.leaves(updates)
    flags = policy.dense_flags(self.dense, updates)
    min_size = policy.MIN_SIZE if self.min_size is None else self.min_size
    route = self.route if stage == 0 else self.stages[stage - 1][1]
    whole = policy.whole_sizes(updates)  # on shards (jaxcomp.on_shards): the whole leaves' sizes
    if whole is not None:  # the policy judges whole leaves: small ones marked dense, whatever the shard
      flags = [bool(f) or w < min_size for f, w in zip(flags or [False] * len(leaves), whole)]
      min_size = 0
    return _plan(route, self.bucket_bytes, tuple(tuple(np.shape(x)) for x in leaves),
                 None if flags is None else tuple(flags), min_size)

  def steady(self) -> "Method":
    """This method after its warm-up: the last stage alone, no dense start."""
    route = self.stages[-1][1] if self.stages else self.route
    return dataclasses.replace(self, route=route, stages=(), start_step=0)

  def stage_at(self, step: int) -> int | None:
    """The stage that runs at ``step`` (an int), or None during the dense warm-up."""
    if step < self.start_step:
      return None
    return sum(step >= first for first, _ in self.stages)

  @property
  def can_chunk(self) -> bool:
    """Whether the buckets can be cut into chunks (no fused exchange, no exchange that reads leaf shapes)."""
    return self.fused is None and self.chunkable

  def plan(self, leaves: Sequence[Any]):
    """The groups of the group form, over every bucket: ``(exchange, view, leaf indices)``."""
    out = []
    for b in self.buckets(list(leaves)):
      for view, idx in groups(b.segments):
        out.append((b.exchange, view, [b.leaves[s] for s in idx]))
    return out

  def carries_nonfinite(self, updates) -> bool:
    """True if every bucket's exchange, in every stage, carries NaN/Inf into the mean."""
    return all(b.exchange.carries_nonfinite for i in range(len(self.stages) + 1)
               for b in self.buckets(updates, i))

  def wire_bytes(self, params: Any, nonfinite_flag: bool = True, step: int | None = None,
                 workers: int | None = None) -> int:
    """Nominal bytes one worker hands to collectives per step for ``params``.

    ``nonfinite_flag``: count the float32 that tells every worker about a
    non-finite step (see :func:`jaxcomp.build`); it is sent only over an axis,
    and only when some bucket's exchange does not carry NaN/Inf by itself.
    ``step``: the bytes of the step ``step`` (its stage, or the dense
    warm-up); None, the last stage's (the steady state). ``workers``: the
    number of workers, needed by ``transport="scatter"`` (its chunks are 1/N).
    """
    stage = len(self.stages) if step is None else self.stage_at(step)
    buckets = self.buckets(params, stage or 0)
    flag = NONFINITE_FLAG_BYTES if nonfinite_flag and not self.carries_nonfinite(params) else 0
    if stage is None:  # the warm-up's one all-reduce of every bucket
      return 4 * sum(b.length for b in buckets) + flag
    if self.fused is not None:
      return self.fused.wire_bytes(self.plan(jax.tree.leaves(params))) + flag
    return sum(b.exchange.bucket_wire_bytes(b.segments, workers) for b in buckets) + flag

  def check_stages(self, updates, buckets) -> None:
    """Every stage must lay the leaves out alike (the memory and the state carry over)."""
    def shape(bs):
      return [(b.leaves, b.segments.offsets, b.segments.sizes, b.length, b.exchange is DENSE) for b in bs]

    for i, (first, _) in enumerate(self.stages, 1):
      if shape(self.buckets(updates, i)) != shape(buckets):
        raise ValueError(
            f"stages: the stage from step {first} lays the gradients out in other buckets than the"
            " first stage (a different bucket policy or block size); every stage must use the same"
            " method with the same bucket_bytes, min_size and dense")

  def with_transport(self, transport: str | None) -> "Method":
    """This method with the gathered exchanges in the form ``transport`` names ("gather" or "scatter")."""
    if transport is None or transport == self.transport:
      return self
    if transport not in scatter.TRANSPORTS:
      raise ValueError(f"transport must be one of {scatter.TRANSPORTS}, got transport={transport!r}")
    if transport == "gather":
      unwrap = lambda r: r.route if isinstance(r, scatter.ScatterRoute) else r  # noqa: E731
      return dataclasses.replace(self, route=unwrap(self.route), transport="gather",
                                 stages=tuple((f, unwrap(r)) for f, r in self.stages))
    if self.fused is not None:
      raise ValueError(f"transport='scatter' is not available for {self.name}: its fused exchange"
                       " all-reduces every layer's factors already; use transport='gather'")
    for route in [self.route] + [r for _, r in self.stages]:
      for shape in ((1 << 14,), (128, 128), (3, 3, 64, 64)):  # the exchanges of a typical model's leaves
        scatter.scatter_form(route(shape)[0], self.name)  # raises where there is no scatter form
    wrap = lambda r: scatter.ScatterRoute(r, self.name)  # noqa: E731
    return dataclasses.replace(self, route=wrap(self.route), transport="scatter",
                               stages=tuple((f, wrap(r)) for f, r in self.stages))


@functools.lru_cache(maxsize=256)
def _plan(route, bucket_bytes, shapes, flags, min_size):
  return layout.plan(shapes, route, DENSE, bucket_bytes, min_size, flags)
