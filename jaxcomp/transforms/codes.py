"""Value codes: SketchML's quantile buckets and INCEPTIONN's tagged variable-precision code."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import Codec, CodecExchange, Memory, Method, build, flat_route
from jaxcomp.transforms import _args


def field_bits(values: int) -> int:
  """The narrowest packable field width (1, 2, 4 or 8 bits) holding ``values`` codes."""
  for bits in (1, 2, 4, 8):
    if values <= 2 ** bits:
      return bits
  raise ValueError(f"at most 256 codes fit a packed field, got {values}")


# ----------------------------------------------------------------------------
# SketchML


def _below(key: jax.Array, n: int, shape=()) -> jax.Array:
  """Uniform ints in ``[0, n)`` (int32) from 32 random bits; the modulo bias is < n / 2**32.

  Compiles several times faster than ``jax.random.randint``.
  """
  return (jax.random.bits(key, shape, jnp.uint32) % jnp.uint32(n)).astype(jnp.int32)


def sample_positions(key: jax.Array, n: int, size: int) -> jax.Array:
  """``size`` uniform positions in ``[0, n)``, with replacement (int32)."""
  return _below(key, n, (size,))


@dataclasses.dataclass(frozen=True)
class SketchCodec(Codec):
  """Payload: ``q`` float32 bucket means and one packed bucket index per entry.

  ``q = min(buckets, n)``; indices take 1, 2, 4 or 8 bits (the narrowest that
  holds q codes), none when q = 1.
  """

  buckets: int
  sample_size: int

  def num_buckets(self, n: int) -> int:
    return min(self.buckets, n)

  def edges(self, x: jax.Array, key: jax.Array) -> jax.Array:
    """The q - 1 interior split points: order statistics ``j * m // q`` of the sorted sample."""
    n = x.shape[0]
    q = self.num_buckets(n)
    sample = x if n <= self.sample_size else x[sample_positions(key, n, self.sample_size)]
    ordered = jnp.sort(sample)
    return ordered[(np.arange(1, q) * ordered.shape[0]) // q]

  def encode(self, x, key):
    n = x.shape[0]
    q = self.num_buckets(n)
    idx = jnp.searchsorted(self.edges(x, key), x, side="right").astype(jnp.int32)
    sums = jax.ops.segment_sum(x, idx, q)
    counts = jax.ops.segment_sum(jnp.ones_like(x), idx, q)
    means = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)
    if q == 1:  # one bucket: the index carries nothing, send the mean alone
      return means, jnp.zeros((0,), jnp.uint8)
    return means, packing.pack(idx.astype(jnp.uint8), field_bits(q))

  def decode(self, payload, key, n):
    means, words = payload
    if self.num_buckets(n) == 1:
      return jnp.broadcast_to(means[0], (n,))
    idx = packing.unpack(words, field_bits(self.num_buckets(n)), n)
    return means[idx.astype(jnp.int32)]


def sketchml(buckets: int = 64, sample_size: int = 16384, axis_name: AxisName = None,
             error_feedback: bool = False, seed: int = 0):
  """SketchML's quantile sketch: a bucket index per entry plus the bucket means.

  Each leaf is split into ``q = min(buckets, n)`` buckets of (about) equal
  counts by ``q - 1`` quantiles; every entry is sent as its bucket index and
  decoded as its bucket's mean, so the sum of each leaf is preserved (up to
  float rounding) while each entry moves by at most the spread of its bucket.

  Quantiles without a full sort: when ``n <= sample_size`` the leaf itself is
  sorted (exact quantiles); otherwise ``sample_size`` positions drawn uniformly
  with replacement (each worker with its own key) are sorted and the split
  points are their order statistics ``j * sample_size // q``. A random sample,
  not a strided one, so that periodic layouts (a flattened conv kernel) do not
  alias. With 16384 samples the rank of a split point has a standard
  deviation of at most 0.4% of n (``sqrt(p (1 - p) / 16384)``), a quarter of
  a bucket at q = 64. Buckets then take the exact means of their members (a
  segment sum over the leaf, no sort).

  Payload: ``4 q`` bytes of float32 means plus the indices packed in 1, 2, 4
  or 8 bits (8 for the default 64 buckets; 4 when ``buckets <= 16``): 8 bits
  per element plus 2048 bits per leaf at the defaults. Means and split points
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

  References:
    Jiang, Fu, Yang, Cui, *SketchML: Accelerating Distributed Machine Learning
    with Data Sketches*, SIGMOD 2018: quantile-bucket quantification of the
    gradient values.
  """
  q = _args.integer("buckets", buckets, 2, 256)
  size = _args.integer("sample_size", sample_size, q)
  ef = _args.flag("error_feedback", error_feedback)
  codec = SketchCodec(q, size)
  return build(Method("sketchml", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed)


# ----------------------------------------------------------------------------
# INCEPTIONN

_WIDTHS = (0, 1, 2, 4)  # bytes in the stream for tags 0, 1, 2, 3


def _cumsum(w: jax.Array, block: int = 64) -> jax.Array:
  """Inclusive prefix sum of small non-negative ints (the widths, <= 4).

  Within rows of ``block`` entries by a triangular matmul (exact: float32 holds
  sums <= 256), then across rows by ``jnp.cumsum``. On XLA CPU this runs about
  2x faster than ``jnp.cumsum`` (a reduce_window) and compiles about 5x faster
  than ``lax.associative_scan``.
  """
  n = w.shape[0]
  rows = -(-n // block)
  r = jnp.pad(w, (0, rows * block - n)).reshape(rows, block).astype(jnp.float32)
  tri = jnp.triu(jnp.ones((block, block), jnp.float32))
  within = jnp.dot(r, tri, precision=lax.Precision.HIGHEST).astype(jnp.int32)
  before = jnp.cumsum(within[:, -1]) - within[:, -1]
  return (within + before[:, None]).reshape(-1)[:n]


def lsb_exponent(error_bound: float) -> int:
  """k with ``2**k`` the largest power of two <= 2 * error_bound (the fixed-point step)."""
  return math.floor(math.log2(2.0 * error_bound))


@dataclasses.dataclass(frozen=True)
class InceptionnCodec(Codec):
  """Payload: 2-bit tags packed 4 per byte, and a byte stream of fixed capacity.

  Tag 0: nothing sent (decodes to 0); 1: one byte, sign + 7-bit magnitude;
  2: two bytes, sign + 15-bit magnitude, both in units of ``2**lsb``; 3: the
  four bytes of the float32. Entries are laid out in the stream in order,
  starting at a position that rotates every step (the shared key); entries
  that would overrun the capacity are sent with tag 0.
  """

  lsb: int
  capacity: float
  shared_key = True

  def stream_bytes(self, n: int) -> int:
    return max(1, math.ceil(self.capacity * n - 1e-9))

  def shift(self, key: jax.Array, n: int) -> jax.Array:
    return _below(key, n)

  def encode(self, x, key):
    n = x.shape[0]
    cap = self.stream_bytes(n)
    x = jnp.roll(x, -self.shift(key, n))
    b = lax.bitcast_convert_type(x, jnp.uint32)
    sign = b >> 31
    q = jnp.floor(jnp.abs(x) * 2.0 ** -self.lsb + 0.5)  # NaN and Inf compare False below
    tag = jnp.where(q < 1, 0, jnp.where(q < 2 ** 7, 1, jnp.where(q < 2 ** 15, 2, 3)))
    qi = jnp.where(tag < 3, q, 0.0).astype(jnp.uint32)
    word = jnp.where(tag == 1, (sign << 7) | qi,
                     jnp.where(tag == 2, (sign << 15) | qi, jnp.where(tag == 3, b, 0)))
    width = jnp.asarray(_WIDTHS, jnp.int32)[tag]
    end = _cumsum(width)
    fits = end <= cap  # a prefix of the sent entries, since end is non-decreasing
    tag = jnp.where(fits, tag, 0)
    width = jnp.where(fits, width, 0)
    start = end - width
    # Bytes not sent get distinct out-of-bounds positions, dropped by the scatter.
    unused = cap + 4 * jnp.arange(n, dtype=jnp.int32)
    pos = jnp.stack([jnp.where(j < width, start + j, unused + j) for j in range(4)], axis=1)
    byte = jnp.stack([(word >> (8 * j)) & 0xFF for j in range(4)], axis=1).astype(jnp.uint8)
    stream = jnp.zeros((cap,), jnp.uint8).at[pos.reshape(-1)].set(
        byte.reshape(-1), mode="drop", unique_indices=True)
    return packing.pack(tag.astype(jnp.uint8), 2), stream

  def decode(self, payload, key, n):
    tag_words, stream = payload
    tag = packing.unpack(tag_words, 2, n).astype(jnp.int32)
    width = jnp.asarray(_WIDTHS, jnp.int32)[tag]
    start = _cumsum(width) - width
    word = jnp.zeros((n,), jnp.uint32)
    for j in range(4):
      byte = jnp.take(stream, start + j, mode="clip").astype(jnp.uint32)
      word = word | jnp.where(j < width, byte << (8 * j), 0)
    fixed_sign = jnp.where(tag == 1, word >> 7, word >> 15) & 1
    magnitude = (word & jnp.where(tag == 1, 0x7F, 0x7FFF)).astype(jnp.float32) * 2.0 ** self.lsb
    fixed = jnp.where(fixed_sign == 1, -magnitude, magnitude)
    raw = lax.bitcast_convert_type(word, jnp.float32)
    x = jnp.where(tag == 3, raw, jnp.where(tag == 0, 0.0, fixed))
    return jnp.roll(x, self.shift(key, n))


def inceptionn(error_bound: float = 2.0 ** -10, capacity: float = 1.0, axis_name: AxisName = None,
               error_feedback: bool = True, seed: int = 0):
  """INCEPTIONN's lossy code: a 2-bit tag per value choosing 0, 8, 16 or 32 bits.

  Gradients are mostly small, so most values need few bits for a fixed
  absolute error. With ``2**k`` the largest power of two <= ``2 * error_bound``,
  each value is rounded to the grid ``q * 2**k`` (error <= ``error_bound``):
  tag 0 when ``q = 0`` (nothing sent), tag 1 when ``q < 2**7`` (one byte: sign
  + 7 bits), tag 2 when ``q < 2**15`` (two bytes: sign + 15 bits), and tag 3
  otherwise, Inf and NaN included (the four bytes of the float32, exact).
  Tags are packed 4 per byte. At the default bound ``2**-10`` that is: below
  ``2**-10`` -> 0 bits, below 0.249 -> 8 bits, below 64 -> 16 bits.
  This follows the paper's scheme (values of magnitude >= 1 uncompressed,
  the rest as truncated fixed point by exponent range, small ones dropped;
  recalled, not checked against its equations) with round-to-nearest instead
  of truncation, which halves the error for the same widths, and a 16-bit
  range that extends past 1 instead of sending every value >= 1 raw.

  Static shapes: XLA cannot send a variable number of bytes, so the sent
  widths go into one byte stream of fixed capacity ``ceil(capacity * n)``
  bytes per leaf, entries in order, and the tags alone say where each value
  sits (no count needed). Entries that would overrun the stream are sent as
  tag 0 and stay in the error-feedback residual. The order starts at a
  position that changes every step (drawn from a key shared by all workers,
  so no offset travels), so no part of a leaf is starved when the stream is
  full. The wire therefore carries exactly ``ceil(n / 4) + ceil(capacity * n)``
  bytes per leaf, whatever the values: at the default ``capacity=1.0``
  10 bits per element, 3.2x smaller than float32. The trade-off: a capacity of
  ``c`` bytes per value never overflows while the mean width is <= ``c``
  (e.g. values mostly below 0.249 at the default bound); ``capacity=2.0``
  holds every value below 64 (18 bits per element); ``capacity=4.0`` can
  never overflow but costs more than float32. A variable-length protocol
  (the paper's NIC hardware) would send only the used bytes; here the unused
  tail of the stream is zeros and still crosses the wire.

  Payloads are all-gathered (the code does not add); each worker decodes and
  averages them.

  Args:
    error_bound: the absolute error bound per value, in [2**-127, 2**14]. GRACE passes
      2e-10, but its code turns it into the binary exponent
      ``127 + int(log10(2e-10 / 2)) = 117``, i.e. a bound of ``2**-10`` (as
      recalled, also the paper's main setting); the default here is that
      bound, ``2**-10``. Read literally, 2e-10 would send nearly every value
      raw.
    capacity: stream bytes per value, in (0, 4] (default 1.0).
    axis_name: the data-parallel axis, or None for a local round trip.
    error_feedback: on by default: the dropped values below the bound and
      whatever did not fit in the stream are carried, so nothing is lost.
    seed: seeds the key (the per-step stream rotation).

  References:
    Li, Park, Alian, Yuan, Qu, Pan, Wang, Schwing, Esmaeilzadeh, Kim, *A
    Network-Centric Hardware/Algorithm Co-Design to Accelerate Distributed
    Training of Deep Neural Networks* (INCEPTIONN), MICRO 2018: the lossy
    compression algorithm for floating-point gradients.
  """
  eb = _args.positive("error_bound", error_bound)
  if not 2.0 ** -127 <= eb <= 2.0 ** 14:
    raise ValueError(f"error_bound must be in [2**-127, 2**14], got error_bound={error_bound!r}")
  lsb = lsb_exponent(eb)
  cap = _args.positive("capacity", capacity)
  if cap > 4.0:
    raise ValueError(f"capacity must be in (0, 4] bytes per value, got capacity={capacity!r}")
  ef = _args.flag("error_feedback", error_feedback)
  codec = InceptionnCodec(lsb, cap)
  return build(Method("inceptionn", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed)
