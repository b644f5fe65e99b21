"""Gradient buckets: the leaves of a step laid out in flat float32 vectors with static segments.

The builder (:func:`jaxcomp.build`) never compresses leaf by leaf. It lays the
gradient leaves out in **reverse tree order** (the order backprop produces
them) in flat float32 buckets of at most ``bucket_bytes``, one kind of
exchange per bucket, and runs each exchange once per bucket. The leaf
boundaries inside a bucket are :class:`Segments`: offsets and sizes known at
trace time, so a layer-wise codec (a top-k per leaf, a norm per leaf) keeps
its per-leaf meaning in one fused kernel, through segment reductions over
rows of ``block`` entries.

Every segment starts at a multiple of :data:`ROW` (128) entries and is
zero-padded to one, for every exchange: a bucket is built from whole rows,
several times faster on XLA:CPU than from single entries. Padding is at
most 127 entries per leaf (ResNet-50: 984 of 25.6M entries; BERT-base:
none), and codecs that send every entry (the 16-bit casts, the dense mean)
send it too, counted in the wire bytes.

The error-feedback residual and every per-entry memory live in the same
layout (one float32 vector per bucket), whatever the parameters' dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BUCKET_BYTES = 25 * 2 ** 20  # torch DDP's default bucket (25 MiB)

ROW = 128  # every segment starts at a multiple of ROW entries and is zero-padded to one
FUSED_CONCAT = 8  # the most operands of a concatenation that XLA:CPU fuses into its consumer


def _prod(shape) -> int:
  return int(np.prod(shape, dtype=np.int64))


def padded(n: int, block: int) -> int:
  return -(-n // block) * block


def halves(rows: jax.Array, init: jax.Array, op: Callable) -> jax.Array:
  """``op``-reduction of each row of ``rows`` (r, c): (r,), as its two half rows in one variadic reduction.

  XLA:CPU hands a plain row reduction to a YNNPACK fusion, and writes out in
  full first any producer it cannot fuse into it (a compare, a select): a
  bucket-sized temporary and a pass. A variadic reduction stays one XLA loop
  fused with its producers (docs/benchmarks.md "Design measurements"). Odd rows are
  reduced plainly. The sum's order differs from a plain reduction's; a
  maximum is the same.
  """
  c = rows.shape[1]
  if c < 2 or c % 2:
    return lax.reduce(rows, init, op, (1,))
  h = c // 2
  a, b = lax.reduce((rows[:, :h], rows[:, h:]), (init, init),
                    lambda p, q: (op(p[0], q[0]), op(p[1], q[1])), (1,))
  return op(a, b)


class SegmentOps:
  """Segment reductions and spreads over a bucket, from its row tables.

  A subclass provides ``count``, ``length``, ``block`` and ``has_pads`` (static) and the
  tables ``row_segment`` (the segment of each row of ``block`` entries) and ``row_valid`` (the
  entries of each row that are not padding): numpy constants in :class:`Segments`, arrays
  (data of a loop over stacked buckets) in :class:`jaxcomp.core.tables.SegmentTable`.
  """

  def rows(self, v: jax.Array) -> jax.Array:
    return v.reshape(-1, self.block)

  def sum(self, v: jax.Array) -> jax.Array:
    """Per-segment sums of ``v`` (length ``length``): (S,).

    Each row is reduced as two half rows in one variadic reduction
    (:func:`halves`), which XLA:CPU fuses with the producer of ``v``.
    """
    if self.count == 1:
      return halves(v.reshape(1, -1), jnp.zeros((), v.dtype), lax.add)
    return jax.ops.segment_sum(halves(self.rows(v), jnp.zeros((), v.dtype), lax.add), self.row_segment,
                               self.count, indices_are_sorted=True)

  def sums(self, *values: jax.Array) -> jax.Array:
    """Per-segment sums of several vectors of one dtype, in one pass: (len(values), S).

    One variadic reduction along the rows (XLA fuses the producers of all the
    values into it); separate sums of values computed by compares or selects
    cost XLA:CPU a materialised bucket-sized vector and a pass each.
    """
    if len(values) == 1:
      return self.sum(values[0])[None]
    zero = jnp.zeros((), values[0].dtype)
    add = lambda a, b: tuple(p + q for p, q in zip(a, b))
    if self.count == 1:
      totals = lax.reduce(tuple(values), (zero,) * len(values), add, (0,))
      return jnp.stack(totals)[:, None]
    rows = lax.reduce(tuple(self.rows(v) for v in values), (zero,) * len(values), add, (1,))
    return jnp.stack([jax.ops.segment_sum(r, self.row_segment, self.count, indices_are_sorted=True)
                      for r in rows])

  def sum_max(self, s: jax.Array, m: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """Per-segment sums of ``s`` and maxima of ``m`` (float32) in one pass over the bucket: two (S,).

    One variadic row reduction, as :meth:`sums`. Alone it costs what the two
    reductions apart cost; TernGrad gains from it because the maximum then
    needs no second pass over the clipped bucket.
    """
    zero = jnp.zeros((), jnp.float32)
    both = lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1]))
    if self.count == 1:
      total, top = lax.reduce((s, m), (zero, jnp.float32(-jnp.inf)), both, (0,))
      return total[None], top[None]
    total, top = lax.reduce((self.rows(s), self.rows(m)), (zero, jnp.float32(-jnp.inf)), both, (1,))
    return (jax.ops.segment_sum(total, self.row_segment, self.count, indices_are_sorted=True),
            jax.ops.segment_max(top, self.row_segment, self.count, indices_are_sorted=True))

  def max(self, v: jax.Array) -> jax.Array:
    """Per-segment maxima of ``v``: (S,) (rows reduced as :meth:`sum`'s)."""
    low = jnp.array(-jnp.inf if jnp.issubdtype(v.dtype, jnp.floating) else jnp.iinfo(v.dtype).min, v.dtype)
    if self.count == 1:
      return halves(v.reshape(1, -1), low, lax.max)
    return jax.ops.segment_max(halves(self.rows(v), low, lax.max), self.row_segment, self.count,
                               indices_are_sorted=True)

  def max_abs(self, v: jax.Array) -> jax.Array:
    """Per-segment maxima of ``|v|`` (float32): (S,), NaN where a segment holds a NaN.

    An integer maximum of the bits of ``|v|`` (their order is that of the
    values, every NaN above Inf): XLA:CPU's vectorised float maximum can drop a
    NaN among equal values, so a codec whose scale is this maximum carries every
    NaN and Inf into its payload (:attr:`jaxcomp.core.protocol.Codec.carries_nonfinite`).
    """
    bits = lax.bitcast_convert_type(jnp.abs(v.astype(jnp.float32)), jnp.int32)
    return lax.bitcast_convert_type(self.max(bits), jnp.float32)

  def spread(self, values: jax.Array) -> jax.Array:
    """(S,) per-segment values -> (length,), each entry its segment's value."""
    if self.count == 1:
      return jnp.broadcast_to(values[0], (self.length,))
    rows = values[self.row_segment]
    return jnp.broadcast_to(rows[:, None], (rows.shape[0], self.block)).reshape(-1)

  def spread_all(self, *values: jax.Array) -> tuple:
    """:meth:`spread` of several (S,) vectors of one dtype with one gather."""
    if self.count == 1:
      return tuple(jnp.broadcast_to(v[0], (self.length,)) for v in values)
    rows = jnp.stack(values, axis=1)[jnp.asarray(self.row_segment)]
    shape = (rows.shape[0], self.block)
    return tuple(jnp.broadcast_to(rows[:, j, None], shape).reshape(-1) for j in range(len(values)))

  def valid(self) -> jax.Array:
    """bool (length,): True where an entry belongs to a leaf (not padding)."""
    if not self.has_pads:
      return jnp.ones((self.length,), bool)
    col = jax.lax.broadcasted_iota(jnp.int32, (self.length // self.block, self.block), 1)
    return (col < jnp.asarray(self.row_valid)[:, None]).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Segments(SegmentOps):
  """The leaves of one bucket: static offsets, sizes and views.

  Each segment starts at a multiple of ``block`` and is zero-padded to one;
  ``length`` is the bucket's length (a multiple of ``block``). Segment
  reductions work on rows of ``block`` entries: one reduction along the rows,
  then a small segment sum over rows (no ``n``-sized scatter).
  """

  offsets: Tuple[int, ...]
  sizes: Tuple[int, ...]
  views: Tuple[Tuple[int, ...], ...]
  block: int = 1

  @property
  def count(self) -> int:
    return len(self.sizes)

  @property
  def length(self) -> int:
    if not self.sizes:
      return 0
    return self.offsets[-1] + padded(self.sizes[-1], self.block)

  @property
  def padded_sizes(self) -> Tuple[int, ...]:
    return tuple(padded(n, self.block) for n in self.sizes)

  @property
  def pads(self) -> np.ndarray:
    """Padding entries of each segment (float32 (S,))."""
    return np.asarray([p - n for p, n in zip(self.padded_sizes, self.sizes)], np.float32)

  @property
  def has_pads(self) -> bool:
    return any(p != n for p, n in zip(self.padded_sizes, self.sizes))

  @functools.cached_property
  def row_segment(self) -> np.ndarray:
    """int32 (rows,): the segment of each row of ``block`` entries."""
    return np.repeat(np.arange(self.count, dtype=np.int32),
                     [p // self.block for p in self.padded_sizes])

  @functools.cached_property
  def row_valid(self) -> np.ndarray:
    """int32 (rows,): how many entries of each row are not padding."""
    out = []
    for n, p in zip(self.sizes, self.padded_sizes):
      r = np.full(p // self.block, self.block, np.int32)
      if n < p:
        r[-1] = n - (p // self.block - 1) * self.block
      out.append(r)
    return np.concatenate(out) if out else np.zeros((0,), np.int32)

  def segment(self, x: jax.Array, s: int) -> jax.Array:
    """The entries of segment ``s`` (without padding), on the last axis."""
    return jax.lax.slice_in_dim(x, self.offsets[s], self.offsets[s] + self.sizes[s], axis=-1)


@dataclasses.dataclass(frozen=True)
class Bucket:
  """One bucket: its exchange, the leaves it holds (tree-order indices) and their segments."""

  exchange: Any
  leaves: Tuple[int, ...]
  segments: Segments

  @property
  def length(self) -> int:
    return self.segments.length


def chunk_segments(segs: Segments, workers: int, block: int = 1, by_leaf: bool = True) -> Segments:
  """The segments of one chunk when the bucket ``segs`` is cut into ``workers`` equal chunks.

  A chunk is ``ceil(length / workers)`` entries, padded to a multiple of ROW,
  ``block`` and ``segs.block`` (the bucket is zero-padded to ``workers``
  chunks). Every chunk shares one static layout: with ``by_leaf`` it is cut
  wherever any chunk holds a leaf's boundary (at most 2 x leaves + 1 segments), so no
  segment of any chunk holds two leaves and a codec's per-segment scale or
  norm never mixes leaves of different magnitudes; without, one segment.
  """
  step = int(np.lcm.reduce([ROW, int(block), int(segs.block)]))
  c = padded(-(-segs.length // workers), step)
  cuts = {0, c}
  if by_leaf:
    cuts.add(segs.length % c)
    for o, p in zip(segs.offsets, segs.padded_sizes):
      cuts.update((o % c, (o + p) % c))
  points = sorted(cuts)
  sizes = tuple(b - a for a, b in zip(points[:-1], points[1:]))
  return Segments(tuple(points[:-1]), sizes, tuple((n,) for n in sizes), step)


def _block(exchange) -> int:
  """The exchange's segment alignment: a multiple of :data:`ROW` (the bucket's row width)."""
  block = int(exchange.block)
  return block if block % ROW == 0 else block * ROW // np.gcd(block, ROW)


def plan(shapes: Sequence[Tuple[int, ...]], route: Callable, dense_exchange: Any,
         bucket_bytes: int, min_size: int, dense: Sequence[bool] | None = None) -> Tuple[Bucket, ...]:
  """Lays leaves of ``shapes`` out in buckets.

  Leaves are taken in reverse tree order; empty leaves are skipped; a leaf of
  fewer than ``min_size`` entries, or one ``dense`` marks, goes to
  ``dense_exchange``. Leaves of the same exchange fill buckets of at most
  ``bucket_bytes`` (float32 entries, padding included) in that order; a leaf
  larger than a bucket gets one of its own.
  """
  order: dict = {}
  for i in reversed(range(len(shapes))):
    n = _prod(shapes[i])
    if n == 0:
      continue
    exchange, view = route(tuple(shapes[i]))
    if n < min_size or (dense is not None and dense[i]):
      exchange, view = dense_exchange, (n,)
    order.setdefault(exchange, []).append((i, n, tuple(view)))
  buckets = []
  for exchange, items in order.items():
    block = _block(exchange)
    current: list = []
    used = 0
    for i, n, view in items:
      size = 4 * padded(n, block)
      if current and used + size > bucket_bytes:
        buckets.append(_bucket(exchange, current, block))
        current, used = [], 0
      current.append((i, n, view))
      used += size
    if current:
      buckets.append(_bucket(exchange, current, block))
  return tuple(buckets)


def _bucket(exchange, items, block) -> Bucket:
  offsets, at = [], 0
  for _, n, _ in items:
    offsets.append(at)
    at += padded(n, block)
  segs = Segments(tuple(offsets), tuple(n for _, n, _ in items), tuple(v for _, _, v in items), block)
  return Bucket(exchange, tuple(i for i, _, _ in items), segs)


def concat_rows(parts: Sequence[jax.Array]) -> jax.Array:
  """``parts`` (each ``(rows, ROW)``) joined on their rows, :data:`FUSED_CONCAT` at a time (a tree).

  XLA:CPU writes a concatenation of more operands out in full before the kernel that reads it (a
  bucket-sized copy and a pass). Each level has a rank of its own: XLA's simplifier merges equal ones."""
  parts, depth, n = list(parts), 0, len(parts)
  while n > FUSED_CONCAT:
    n, depth = -(-n // FUSED_CONCAT), depth + 1
  parts = [p.reshape((-1,) + (1,) * depth + (ROW,)) for p in parts]
  while len(parts) > 1:
    depth -= 1
    parts = [(g[0] if len(g) == 1 else jnp.concatenate(g)).reshape((-1,) + (1,) * max(depth, 0) + (ROW,))
             for g in (parts[i:i + FUSED_CONCAT] for i in range(0, len(parts), FUSED_CONCAT))]
  return parts[0].reshape(-1, ROW)


def pack(buckets: Sequence[Bucket], leaves: Sequence[jax.Array], flat: Callable = lambda ex: False) -> list:
  """The leaves in their buckets: one float32 vector per bucket, padding zero.

  Rows of :data:`ROW` entries (each leaf padded to whole rows) joined by :func:`concat_rows`, fusible
  into the kernel that reads the bucket; a bucket whose exchange is ``flat`` in one concatenation, whose
  slices XLA's simplifier folds back into the leaves (:func:`unpack`'s, a by-segment encode's).
  """
  out = []
  for b in buckets:
    segs = b.segments
    if len(b.leaves) == 1 and not segs.has_pads:
      out.append(jnp.ravel(leaves[b.leaves[0]]).astype(jnp.float32))
      continue
    parts = []
    for s, i in enumerate(b.leaves):
      v = jnp.ravel(leaves[i]).astype(jnp.float32)
      pad = segs.padded_sizes[s] - segs.sizes[s]
      parts.append((jnp.pad(v, (0, pad)) if pad else v).reshape(-1, ROW))
    out.append((jnp.concatenate(parts) if flat(b.exchange) else concat_rows(parts)).reshape(-1))
  return out


def unpack(buckets: Sequence[Bucket], vectors: Sequence[jax.Array], like: Sequence[Any]) -> list:
  """Inverse of :func:`pack`: leaves shaped (and typed) like ``like``; empty leaves are zeros.

  Leading axes of the bucket vectors (a worker axis) are kept in front of each leaf's shape.
  """
  shapes = [tuple(np.shape(x)) for x in like]
  dtypes = [x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype for x in like]
  lead = tuple(np.shape(vectors[0])[:-1]) if len(vectors) else ()
  out: list = [jnp.zeros(lead + shape, dtype) for shape, dtype in zip(shapes, dtypes)]
  for b, v in zip(buckets, vectors):
    segs = b.segments
    rows = v.reshape(lead + (-1, ROW))  # slices of whole rows: XLA folds them into pack's rows
    for s, i in enumerate(b.leaves):
      start = segs.offsets[s] // ROW
      leaf = lax.slice_in_dim(rows, start, start + segs.padded_sizes[s] // ROW, axis=-2)
      leaf = leaf.reshape(lead + (-1,))
      if segs.padded_sizes[s] != segs.sizes[s]:
        leaf = lax.slice_in_dim(leaf, 0, segs.sizes[s], axis=-1)
      out[i] = leaf.reshape(lead + shapes[i]).astype(dtypes[i])
  return out


def payload_bytes(codec: Any, segs: Segments) -> int:
  """Bytes of ``codec.encode``'s payload for a float32 bucket laid out as ``segs``.

  Read from the shapes of the encode, traced once (``jax.eval_shape``) per codec and layout: the
  accounting (:func:`jaxcomp.wire_bytes`, :func:`jaxcomp.traffic`, :func:`jaxcomp.advise`,
  :func:`jaxcomp.auto_plan`) asks for the same buckets many times. A codec's payload shapes must
  therefore depend on its fields and the layout only, never on a module constant changed later.
  """
  if type(segs) is not Segments:  # segment tables as data (a loop's): traced every time
    return _traced_payload_bytes(codec, segs)
  try:  # the key holds the layout's fields, not ``segs`` and the tables it may have cached
    key = (codec, segs.offsets, segs.sizes, segs.views, segs.block, bool(jax.config.read("jax_enable_x64")))
    hash(key)
  except TypeError:  # a codec with an unhashable field: traced every time
    return _traced_payload_bytes(codec, segs)
  return _cached_payload_bytes(key)


@functools.lru_cache(maxsize=4096)
def _cached_payload_bytes(key) -> int:
  return _traced_payload_bytes(key[0], Segments(*key[1:5]))


def _traced_payload_bytes(codec: Any, segs: Segments) -> int:
  x = jax.ShapeDtypeStruct((segs.length,), jnp.float32)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  shapes = jax.eval_shape(lambda x, k: codec.encode(x, k, segs), x, key)
  return int(sum(np.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes)))
