"""SketchML's quantile buckets: each value sent as the packed index of its bucket, with the bucket means.

The codec works on a whole bucket with per-leaf meaning: the quantiles and
bucket means are per segment (:class:`jaxcomp.core.layout.Segments`), computed for
all segments at once; the indices of all leaves of a bucket are packed
together, each leaf's padded to a multiple of 128 entries (the segments' block).
Payloads are all-gathered (the code does not add); each worker decodes and
averages them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core.builder import build
from jaxcomp.core.layout import Segments
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, CodecExchange, Memory, flat_route
from jaxcomp.exchanges.scatter import ScatterCodec
from jaxcomp.kernels import rng
from jaxcomp.transforms import _args


def field_bits(values: int) -> int:
  """The narrowest packable field width (1, 2, 4 or 8 bits) holding ``values`` codes."""
  for bits in (1, 2, 4, 8):
    if values <= 2 ** bits:
      return bits
  raise ValueError(f"at most 256 codes fit a packed field, got {values}")




def sample_width(segs: Segments, sample_size: int) -> int:
  """Columns of a bucket's sample matrix: ``min(sample_size, largest segment)``."""
  return min(sample_size, max(segs.sizes))


def sample_positions(key: jax.Array, segs: Segments, sample_size: int) -> jax.Array:
  """Bucket positions of each segment's sample, ``(S, W)`` int32 (``W``: :func:`sample_width`).

  A segment of ``n <= sample_size`` entries is its own sample (row ``s``
  holds its positions, then repeats its first); a larger one gets
  ``sample_size`` positions drawn uniformly with replacement.
  """
  sample_size = min(int(sample_size), max(segs.sizes))  # any larger value means "whole segments"
  width = sample_width(segs, sample_size)
  n = np.asarray(segs.sizes, np.int64)[:, None]
  col = lax.broadcasted_iota(jnp.int32, (segs.count, width), 1)
  local = jnp.where(col < jnp.asarray(np.minimum(n, width), jnp.int32), col, 0)
  if np.any(n > sample_size):
    drawn = rng.below(key, n.astype(np.uint32), (segs.count, width))
    local = jnp.where(jnp.asarray(n > sample_size), drawn, local)
  return jnp.asarray(segs.offsets, jnp.int32)[:, None] + local


def sorted_rows(v: jax.Array) -> jax.Array:
  """Each float32 row of ``v`` in increasing order, NaN last (read back as NaN), ``-0.0`` as ``0.0``.

  ``jnp.sort(v, axis=1)``'s order, sorted as int32 keys: the float bits made
  order-preserving (a negative value's magnitude bits flipped), every NaN one
  NaN and ``-0.0`` zero first. XLA:CPU sorts a lone int32 operand with a plain
  comparison, and floats through a call of the total-order comparator per
  comparison, several times slower (and, where the CPU reads subnormals as
  zero, out of order among them: the keys keep their true order).
  """
  flip = jnp.int32(0x7FFFFFFF)
  bits = lax.bitcast_convert_type(v, jnp.int32)  # on bits: a float compare could flush subnormals
  bits = jnp.where((bits & flip) > 0x7F800000, 0x7FC00000, jnp.where(bits == -flip - 1, 0, bits))
  keys = lax.sort(jnp.where(bits < 0, bits ^ flip, bits), dimension=1)
  return lax.bitcast_convert_type(jnp.where(keys < 0, keys ^ flip, keys), jnp.float32)


_COARSE = 32  # SketchML's search: split points compared directly before the binary search (P / 32 a block)


@dataclasses.dataclass(frozen=True)
class SketchCodec(Codec, ScatterCodec):
  """Payload: ``q`` float32 bucket means per segment and one packed bucket index per entry.

  ``q = min(buckets, n)`` for a segment of ``n`` entries; the means of all
  segments are concatenated. Indices take 1, 2, 4 or 8 bits (the narrowest
  that holds the largest q of the bucket), none when every q is 1.
  """

  buckets: int
  sample_size: int
  block = 128
  carries_nonfinite = True  # a NaN/Inf entry's own bin sum (a bin of its segment), so its mean, is too
  vmappable = False  # transport="scatter": one chunk after another (a batched sort and gather cost more)

  def num_buckets(self, segs: Segments) -> np.ndarray:
    """q of each segment (int64 (S,))."""
    return np.minimum(self.buckets, np.asarray(segs.sizes, np.int64))

  def _width(self, segs: Segments) -> int:
    """Columns of the split-point table: the smallest power of two >= the largest q (binary search)."""
    return 1 << int(np.max(self.num_buckets(segs)) - 1).bit_length()

  def edges(self, x: jax.Array, key: jax.Array, segs: Segments) -> jax.Array:
    """``(S, P)``: row ``s`` holds the q - 1 interior split points of segment ``s``, then NaN.

    The split points are the order statistics ``j * m // q`` of the sorted
    sample of ``m = min(n, sample_size)`` entries; one batched sort of all
    samples.
    """
    q = self.num_buckets(segs)
    m = np.minimum(np.asarray(segs.sizes, np.int64), min(self.sample_size, max(segs.sizes)))
    pos = sample_positions(key, segs, self.sample_size)
    col = lax.broadcasted_iota(jnp.int32, pos.shape, 1)
    sample = jnp.where(col < jnp.asarray(m, jnp.int32)[:, None], x[pos], jnp.inf)
    ordered = self.sort_samples(sample)
    j = np.arange(1, self._width(segs) + 1)[None, :]
    inside = j < q[:, None]
    rank = np.where(inside, (j * m[:, None]) // q[:, None], 0)
    split = jnp.take_along_axis(ordered, jnp.asarray(rank, jnp.int32), axis=1)
    # Unused columns hold NaN, which no entry is >= (a +inf there would count for an entry of +Inf
    # and send it past its segment's bins, lost or into another leaf's).
    return jnp.where(jnp.asarray(inside), split, jnp.nan)

  @staticmethod
  def sort_samples(sample: jax.Array) -> jax.Array:
    """The rows of ``sample`` (S, W) in increasing order: :func:`sorted_rows`."""
    return sorted_rows(sample)

  def _first(self, segs: Segments) -> np.ndarray:
    """Index of each segment's first mean in the payload (int64 (S,))."""
    q = self.num_buckets(segs)
    return np.cumsum(q) - q

  def _bits(self, segs: Segments) -> int:
    return field_bits(int(np.max(self.num_buckets(segs))))

  def encode(self, x, key, segs):
    p = self._width(segs)
    idx = jnp.zeros(x.shape, jnp.int32)
    if p > 1:
      # The number of split points <= x (searchsorted, side="right"). First a
      # count of the coarse split points (every (P / m)-th, m <= 32) below x,
      # compares with each row's values in one fused pass; then a branchless
      # binary search inside the block of P / m (log2(P / m) gathers). On a
      # 6.5M-entry bucket of 64 quantiles: 7-8 ms, against 32-36 ms for the
      # six-gather binary search (a gather per step costs XLA:CPU far more
      # than a compare).
      edges = self.edges(x, key, segs)
      m = min(p, _COARSE)
      width = p // m
      coarse = edges[:, np.arange(1, m) * width - 1]  # (S, m - 1)
      for c in segs.spread_all(*(coarse[:, j] for j in range(m - 1))):  # one small gather of rows
        idx = idx + jnp.where(c <= x, width, 0)
      table = edges.reshape(-1)
      row = segs.spread(jnp.arange(segs.count, dtype=jnp.int32) * p)
      step = width // 2
      while step:
        cand = idx + step
        idx = jnp.where(table[row + cand - 1] <= x, cand, idx)
        step //= 2
    first = self._first(segs)
    total = int(self.num_buckets(segs).sum())
    bins = segs.spread(jnp.asarray(first, jnp.int32)) + idx
    # Sums and counts as two scalar segment sums (XLA:CPU scatters a stacked (n, 2) operand
    # several times slower than two vectors); padding entries are not counted.
    sums = jax.ops.segment_sum(x, bins, total)
    counts = jax.ops.segment_sum(segs.valid().astype(jnp.float32), bins, total)
    means = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)
    if p == 1:  # one bucket per segment: the index carries nothing, send the means alone
      return means, jnp.zeros((0,), jnp.uint8)
    return means, packing.pack(idx.astype(jnp.uint8), self._bits(segs))

  def decode(self, payload, key, segs):
    means, words = payload
    bins = segs.spread(jnp.asarray(self._first(segs), jnp.int32))
    if self._width(segs) > 1:
      bins = bins + packing.unpack(words, self._bits(segs), segs.length).astype(jnp.int32)
    return means[bins]


@_args.factory
def sketchml(buckets: int = 64, sample_size: int = 16384, *, axis_name: AxisName = None,
             error_feedback: bool = False, seed: int = 0, bucket_bytes: int | None = None,
             min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather"):
  """SketchML's quantile sketch: a bucket index per entry plus the bucket means.

  Each leaf is split into ``q = min(buckets, n)`` buckets of (about) equal
  counts by ``q - 1`` quantiles; every entry is sent as its bucket index and
  decoded as its bucket's mean, so the sum of each leaf is preserved (up to
  float rounding) while each entry moves by at most the spread of its bucket.

  Quantiles without a full sort: when ``n <= sample_size`` the leaf itself is
  sorted (exact quantiles); otherwise ``sample_size`` positions drawn uniformly
  with replacement (each worker with its own key) are sorted and the split
  points are their order statistics ``j * sample_size // q``; the samples of
  all leaves of a bucket are sorted in one batched sort. A random sample,
  not a strided one, so that periodic layouts (a flattened conv kernel) do not
  alias. With 16384 samples the rank of a split point has a standard
  deviation of at most 0.4% of n (``sqrt(p (1 - p) / 16384)``), a quarter of
  a bucket at q = 64. Buckets then take the exact means of their members (a
  segment sum over the bucket, no sort).

  Payload: ``4 q`` bytes of float32 means per leaf plus the indices packed in
  1, 2, 4 or 8 bits (8 for the default 64 buckets; 4 when ``buckets <= 16``;
  one width for all leaves of a bucket): 8 bits per element plus 2048 bits
  per leaf at the defaults. Means and split points
  are local, so payloads are all-gathered; each worker decodes and averages.
  GRACE computes exact (interpolated) quantiles and sends uint8 indices.
  SketchML further compresses the bucket indices with a MinMaxSketch and
  delta-codes the keys of sparse gradients; neither is done here (dense
  gradients have no keys, and a hashed sketch of the indices is lossy).

  Args:
    buckets: number of quantile buckets q in [2, 256] (GRACE: 64).
    sample_size: entries sampled to place the split points, >= buckets.
    axis_name: the data-parallel axis, or None for a local round trip.
    error_feedback: off by default (as in GRACE); on, each entry's distance
      to its bucket mean is carried in a residual.
    seed: seeds the key (used for the sample).
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  References:
    Jiang, Fu, Yang, Cui, *SketchML: Accelerating Distributed Machine Learning
    with Data Sketches*, SIGMOD 2018: quantile-bucket quantification of the
    gradient values.
  """
  q = _args.integer("buckets", buckets, 2, 256)
  size = _args.integer("sample_size", sample_size, q)
  ef = _args.flag("error_feedback", error_feedback)
  codec = SketchCodec(q, size)
  return build(Method("sketchml", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed,
               bucket_bytes=bucket_bytes, min_size=min_size, dense=dense, dense_axis_name=dense_axis_name,
               transport=transport)
