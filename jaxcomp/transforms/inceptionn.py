"""INCEPTIONN's lossy code: a 2-bit tag per value choosing 0, 8, 16 or 32 bits of a byte stream.

Gradients are mostly small, so most values need few bits for a fixed error.
With ``2**k`` the largest power of two <= ``2 * bound``, each value is rounded
to the grid ``q * 2**k`` (error <= ``bound``): tag 0 when ``q = 0`` (nothing
sent), tag 1 when ``q < 2**7`` (one byte: sign + 7 bits), tag 2 when
``q < 2**15`` (two bytes: sign + 15 bits), and tag 3 otherwise, Inf and NaN
included (the four bytes of the float32, exact). Tags are packed 4 per byte.
In the manner of the paper's scheme (large values uncompressed, the rest as
fixed point by exponent range, small ones dropped), with two choices of ours:
round-to-nearest instead of truncation, which halves the error for the same
widths, and a 16-bit range that extends past 1 instead of sending every
value >= 1 raw.

The bound is relative by default: ``bound = relative_bound * m`` per leaf and
step, ``m`` the leaf's largest finite ``|x|`` (on this worker), with
``relative_bound = 2**-10``: the grid step is ``m / 512``, so, whatever the
gradients' scale, values below ``m / 1024`` send 0 bits, below about ``m / 4``
8 bits, the others (up to ``m``) 16 bits, and none is sent raw except Inf and
NaN. The output for ``c * g`` is ``c`` times the output for ``g``: bit for bit
at a power-of-two ``c``, and at any other ``c`` but where a value sits within
float rounding of a rounding boundary. The step travels as the first 4 bytes
of each leaf's stream (float32, inside its capacity, so the wire bytes do not
change). The absolute bound of the paper and GRACE is one argument away,
``inceptionn(error_bound=2**-10)``: below ``2**-10`` -> 0 bits, below 0.249 ->
8 bits, below 64 -> 16 bits, which rounds every value of gradients of 1e-4 per
entry to 0 and overflows the stream at 1e3. How each bound trains and how
much of a Gaussian leaf fits the default capacity: docs/recipes.md.

Static shapes: XLA cannot send a variable number of bytes, so the sent
widths go into one byte stream of fixed capacity ``ceil(capacity * n)``
bytes per leaf (at least 1; with the relative bound at least the step's 4
bytes and the largest value's width: 6 bytes at the default), entries in
order, and the tags alone say where each value sits (no count needed).
Entries that would overrun the stream are sent as tag 0 and stay in the
error-feedback residual. The order starts at a position that changes every
step (drawn from a key shared by all workers, so no offset travels), so no
part of a leaf is starved when the stream is full. The wire therefore
carries exactly ``ceil(n / 4) + ceil(capacity * n)`` bytes per leaf (``n``
padded to a multiple of 128 for the tags), whatever the values: at the
default ``capacity=1.0`` 10 bits per element, 3.2x smaller than float32. A
capacity of ``c`` bytes per value never overflows while the mean width is
<= ``c``; ``capacity=2.0`` holds every value of the relative bound (18 bits
per element); ``capacity=4.0`` can never overflow but costs more than
float32. A variable-length protocol (the paper's NIC hardware) would send
only the used bytes; here the unused tail of the stream is zeros and still
crosses the wire.

Like SketchML's, the code works on a whole bucket with per-leaf meaning (the
stream's capacity and rotation per segment); payloads are all-gathered and
each worker decodes and averages them.
"""

from __future__ import annotations

import dataclasses
import math

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
from jaxcomp.kernels import compaction, rng
from jaxcomp.transforms import _args


def _tag_widths(words: jax.Array) -> jax.Array:
  """Total stream bytes of the 16 tags packed in each uint32 (2 bits each; tags 0-3 take 0, 1, 2, 4)."""
  low = words & jnp.uint32(0x55555555)
  high = (words >> 1) & jnp.uint32(0x55555555)
  count = lambda v: lax.population_count(v).astype(jnp.int32)
  return count(low) + 2 * count(high) + count(low & high)  # tag + (1 if tag is 3)


def width_prefix(tag_words: jax.Array) -> jax.Array:
  """Inclusive prefix sums of the entries' stream widths (int32 (n,)), from their packed 2-bit tags.

  ``tag_words`` is ``packing.pack(tag, 2)`` of ``n`` tags, ``n`` a multiple
  of 16. Each 4 bytes hold 16 tags (one uint32, tag i at bits 2i): a
  prefix sum over their totals (``n / 16`` entries), plus each entry's sum
  over the tags of its word up to itself, by population counts of the word
  masked to those tags. No ``n``-sized prefix sum (on XLA:CPU several times
  slower than this, as :func:`compaction.prefix_sum` of the widths).
  """
  if tag_words.shape[-1] % 4:
    raise ValueError(f"width_prefix: the tags of a multiple of 16 entries (tag_words a multiple of 4"
                     f" bytes), got {tag_words.shape[-1]} bytes")
  words = lax.bitcast_convert_type(tag_words.reshape(-1, 4), jnp.uint32)
  totals = _tag_widths(words)
  before = compaction.prefix_sum(totals) - totals
  upto = jnp.uint32(0xFFFFFFFF) >> (30 - 2 * jnp.arange(16, dtype=jnp.uint32))  # tags 0..i of a word
  return (before[:, None] + _tag_widths(words[:, None] & upto[None, :])).reshape(-1)


def _low_bytes(width: jax.Array) -> jax.Array:
  """uint32 masks of the low ``width`` bytes (``width`` 0, 1, 2 or 4)."""
  return jnp.where(width >= 4, jnp.uint32(0xFFFFFFFF), (jnp.uint32(1) << (8 * width).astype(jnp.uint32)) - 1)


def lsb_exponent(error_bound: float) -> int:
  """k with ``2**k`` the largest power of two <= 2 * error_bound (the fixed-point step)."""
  return math.floor(math.log2(2.0 * error_bound))


CHUNK = 2 ** 22  # entries the encoder writes per step of its loop (a multiple of 128)


@dataclasses.dataclass(frozen=True)
class InceptionnCodec(Codec):
  """Payload: 2-bit tags packed 4 per byte, and a byte stream of fixed capacity per segment.

  Tag 0: nothing sent (decodes to 0); 1: one byte, sign + 7-bit magnitude;
  2: two bytes, sign + 15-bit magnitude, both in units of ``2**lsb``; 3: the
  four bytes of the float32. Each segment has its own stream (the streams of
  a bucket are concatenated); its entries are laid out in it in order,
  starting at a position that rotates every step (the shared key); entries
  that would overrun the capacity are sent with tag 0.

  ``relative``: the unit is ``step = 2**lsb * m`` per segment, ``m`` the
  segment's largest finite ``|x|`` (``step`` clipped to [2**-126, 2**125]:
  normal floats); the first 4 bytes of each segment's stream hold ``step``
  (float32) and the values follow. The stream then has room for them and
  for the largest value (6 bytes at least at the default bound).
  """

  lsb: int
  capacity: float
  relative: bool = False
  shared_key = True
  block = 128

  @property
  def header(self) -> int:
    """Bytes at the head of each segment's stream before its values (``relative``: the float32 step)."""
    return 4 if self.relative else 0

  def stream_bytes(self, n: int) -> int:
    return max(self.min_stream, math.ceil(self.capacity * n - 1e-9))

  @property
  def min_stream(self) -> int:
    """The smallest stream: 1 byte, or (``relative``) the step and the width of the largest value."""
    if not self.relative:
      return 1
    q = 2 ** -self.lsb  # the largest value's q
    return self.header + (1 if q < 2 ** 7 else 2 if q < 2 ** 15 else 4)

  def _firsts(self, segs: Segments) -> np.ndarray:
    """Where each segment's stream starts in the bucket's (int64 (S,))."""
    caps = self._streams(segs)
    return np.cumsum(caps) - caps

  def steps(self, x: jax.Array, segs: Segments) -> jax.Array:
    """The grid step of each segment (float32 (S,)) under :attr:`relative`: ``2**lsb`` times its largest
    finite ``|x|``, clipped to normal floats whose reciprocal is normal too."""
    top = segs.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0))
    return jnp.clip(top * 2.0 ** self.lsb, 2.0 ** -126, 2.0 ** 125)

  def _header_positions(self, segs: Segments) -> jax.Array:
    """Stream positions of each segment's 4 step bytes (int32 (S, 4), little-endian)."""
    return jnp.asarray(self._firsts(segs)[:, None] + np.arange(4)[None, :], jnp.int32)

  def _streams(self, segs: Segments) -> np.ndarray:
    return np.asarray([self.stream_bytes(n) for n in segs.sizes], np.int64)

  def shift(self, key: jax.Array, segs: Segments) -> jax.Array:
    """The entry of each segment that goes first in its stream (int32 (S,))."""
    return rng.below(key, np.asarray(segs.sizes, np.uint32), (segs.count,))

  def _layout(self, tag_words: jax.Array, key: jax.Array, segs: Segments, inv=None) -> tuple:
    """What places every entry in the streams, compact: ``(words, before, rows)``.

    ``words``: the packed tags as uint32 (16 entries each); ``before``: the
    stream bytes of the words before each (int32, :func:`width_prefix`'s
    word totals); ``rows``: per row of ``block`` entries (one row if a single
    segment), its segment's lift, first rotated entry, total and stream end
    (int32), see :meth:`_ends`; with ``inv`` (float32 (S,)) also its row table.
    Entry ``i``'s prefix is ``before[i // 16]`` plus the widths of the tags
    of its word up to itself: :meth:`_chunk_ends` rebuilds any range of
    entries from these, so no ``n``-sized integer array need exist at once.
    """
    words = lax.bitcast_convert_type(tag_words.reshape(-1, 4), jnp.uint32)
    totals = _tag_widths(words)
    before = compaction.prefix_sum(totals) - totals

    def cum(i):  # the inclusive prefix sums of entries i (int32), as width_prefix's
      i = jnp.asarray(i, jnp.int32)
      return before[i // 16] + _tag_widths(words[i // 16] & (jnp.uint32(0xFFFFFFFF) >> (30 - 2 * (i % 16))
                                                             .astype(jnp.uint32)))

    # Each segment's total and what the segments before it hold (padding entries have width 0).
    ends = np.asarray(segs.offsets, np.int64) + np.asarray(segs.padded_sizes, np.int64)
    seg_before = jnp.concatenate([jnp.zeros((1,), jnp.int32), cum(ends[:-1] - 1)])
    total = cum(ends - 1) - seg_before
    shift = self.shift(key, segs)
    offsets = jnp.asarray(segs.offsets, jnp.int32)
    skipped = jnp.where(shift > 0, cum(offsets + jnp.maximum(shift, 1) - 1) - seg_before, 0)
    first = jnp.asarray(self._firsts(segs), jnp.int32)
    table = jnp.stack([first + self.header - seg_before - skipped, offsets + shift, total,
                       first + jnp.asarray(self._streams(segs), jnp.int32)], axis=1)
    rows = lambda t: t if segs.count == 1 else t[jnp.asarray(segs.row_segment)]
    # One barrier with this payload's prefix sums: the rotation's mask then depends on the payload as
    # XLA sees it, so it is not hoisted out of the aggregate's loop over workers as an n-sized array.
    before, table = lax.optimization_barrier((before, rows(table)))
    return words, before, table, None if inv is None else rows(inv[:, None])

  @staticmethod
  def _spread_rows(table: jax.Array, lo, size: int, block: int) -> tuple:
    """Entries ``lo .. lo + size - 1``'s values of a row table (one column each)."""
    if table.shape[0] == 1:
      return tuple(jnp.broadcast_to(table[0, j], (size,)) for j in range(table.shape[1]))
    t = lax.dynamic_slice_in_dim(table, lo // block, size // block)
    shape = (size // block, block)
    return tuple(jnp.broadcast_to(t[:, j, None], shape).reshape(-1) for j in range(t.shape[1]))

  def _chunk_ends(self, layout: tuple, lo, size: int, block: int):
    """:meth:`_ends` of entries ``lo .. lo + size - 1`` (``lo`` and ``size`` multiples of ``block``)."""
    words, before, table, _ = layout
    w = lax.dynamic_slice_in_dim(words, lo // 16, size // 16)
    upto = jnp.uint32(0xFFFFFFFF) >> (30 - 2 * jnp.arange(16, dtype=jnp.uint32))  # tags 0..i of a word
    cum = (lax.dynamic_slice_in_dim(before, lo // 16, size // 16)[:, None]
           + _tag_widths(w[:, None] & upto[None, :])).reshape(-1)
    lift, wrap_below, wrap, last = self._spread_rows(table, lo, size, block)
    return cum + lift + jnp.where(lo + lax.iota(jnp.int32, size) < wrap_below, wrap, 0), last

  def _ends(self, tag_words: jax.Array, key: jax.Array, segs: Segments):
    """Where each entry's bytes end in the bucket's streams, and where its segment's stream ends.

    Within a segment the entries go in rotated order (from its shift to its
    end, then its start): the end is the inclusive prefix sum of the widths in
    that order, plus where the segment's stream starts. ``tag_words``: the
    entries' packed tags.
    """
    return self._chunk_ends(self._layout(tag_words, key, segs), 0, segs.length, segs.block)

  def _quantise(self, x: jax.Array, inv) -> tuple:
    """``(tag, q)`` of each value: ``q`` its rounded multiple of the step (``inv``: 1 / step per entry)."""
    if self.relative:  # |x| in steps (times a reciprocal: exact under power-of-two scaling of x)
      q = jnp.floor(jnp.abs(x) * inv + 0.5)  # NaN and Inf compare False below
    else:
      q = jnp.floor(jnp.abs(x) * 2.0 ** -self.lsb + 0.5)
    return jnp.where(q < 1, 0, jnp.where(q < 2 ** 7, 1, jnp.where(q < 2 ** 15, 2, 3))), q

  def _encode_chunk(self, x, layout, lo, size: int, block: int, carry):
    """Entries ``lo .. lo + size - 1`` into the stream and the sent tags (``carry``)."""
    stream, sent = carry
    xc = lax.dynamic_slice_in_dim(x, lo, size)
    b = lax.bitcast_convert_type(xc, jnp.uint32)
    sign = b >> 31
    inv = None if layout[3] is None else self._spread_rows(layout[3], lo, size, block)[0]
    tag, q = self._quantise(xc, inv)
    qi = jnp.where(tag < 3, q, 0.0).astype(jnp.uint32)
    word = jnp.where(tag == 1, (sign << 7) | qi,
                     jnp.where(tag == 2, (sign << 15) | qi, jnp.where(tag == 3, b, 0)))
    end, last = self._chunk_ends(layout, lo, size, block)
    fits = end <= last  # a prefix of each segment in rotated order
    tag = jnp.where(fits, tag, 0)
    width = jnp.where(tag == 3, 4, tag)
    word = jnp.where(width > 0, word & _low_bytes(width), 0)
    # Each entry's bytes go into the uint32 words of the stream as two word-aligned parts (the word
    # its first byte is in, and the next), added: no two entries share a byte, so the sum is the
    # bytes themselves. An entry not sent adds zeros to word 0.
    start = end - width
    at, lane = start // 4, (8 * (start % 4)).astype(jnp.uint32)
    at = jnp.where(width > 0, at, 0)
    stream = stream.at[at].add(word << lane, mode="promise_in_bounds")
    stream = stream.at[at + 1].add(jnp.where(lane > 0, word >> (32 - lane), 0), mode="promise_in_bounds")
    return stream, lax.dynamic_update_slice_in_dim(sent, packing.pack(tag.astype(jnp.uint8), 2), lo // 4, 0)

  def encode(self, x, key, segs):
    """The payload, written ``CHUNK`` entries at a time: each entry's code, stream position and scatter
    indices exist for one chunk only, recomputed there from ``x`` and :meth:`_layout`."""
    inv = None
    if self.relative:
      step = self.steps(x, segs)
      inv = 1.0 / step
    spread = None if inv is None else segs.spread_all(inv)[0]
    layout = self._layout(packing.pack(self._quantise(x, spread)[0], 2), key, segs, inv)
    total = int(self._streams(segs).sum())
    carry = jnp.zeros((total // 4 + 2,), jnp.uint32), jnp.zeros((segs.length // 4,), jnp.uint8)
    size = min(CHUNK, segs.length)
    chunks, tail = divmod(segs.length, size)
    body = lambda i, c: self._encode_chunk(x, layout, i * size, size, segs.block, c)
    carry = body(0, carry) if chunks == 1 else lax.fori_loop(0, chunks, body, carry)
    if tail:
      carry = self._encode_chunk(x, layout, chunks * size, tail, segs.block, carry)
    stream, sent = lax.bitcast_convert_type(carry[0], jnp.uint8).reshape(-1)[:total], carry[1]
    if self.relative:  # each segment's step, where its values do not go
      word = lax.bitcast_convert_type(step, jnp.uint32)[:, None] >> (8 * jnp.arange(4, dtype=jnp.uint32))
      stream = stream.at[self._header_positions(segs)].set((word & 0xFF).astype(jnp.uint8))
    return sent, stream

  def decode(self, payload, key, segs):
    tag_words, stream = payload
    tag = packing.unpack(tag_words, 2, segs.length).astype(jnp.int32)
    width = jnp.where(tag == 3, 4, tag)
    start = self._ends(tag_words, key, segs)[0] - width
    words = lax.bitcast_convert_type(jnp.pad(stream, (0, 8 - stream.shape[0] % 4)).reshape(-1, 4), jnp.uint32)
    at, lane = start // 4, (8 * (start % 4)).astype(jnp.uint32)
    word = jnp.take(words, at, mode="clip") >> lane
    word = word | jnp.where(lane > 0, jnp.take(words, at + 1, mode="clip") << (32 - lane), 0)
    word = word & _low_bytes(width)
    fixed_sign = jnp.where(tag == 1, word >> 7, word >> 15) & 1
    magnitude = (word & jnp.where(tag == 1, 0x7F, 0x7FFF)).astype(jnp.float32)
    if self.relative:  # q steps
      head = stream[self._header_positions(segs)].astype(jnp.uint32) << (8 * jnp.arange(4, dtype=jnp.uint32))
      step = lax.bitcast_convert_type(jnp.sum(head, axis=1, dtype=jnp.uint32), jnp.float32)
      magnitude = magnitude * segs.spread_all(step)[0]
    else:
      magnitude = magnitude * 2.0 ** self.lsb
    fixed = jnp.where(fixed_sign == 1, -magnitude, magnitude)
    raw = lax.bitcast_convert_type(word, jnp.float32)
    return jnp.where(tag == 3, raw, jnp.where(tag == 0, 0.0, fixed))


RELATIVE_BOUND = 2.0 ** -10  # inceptionn's default: the error bound as a fraction of each leaf's largest |x|


@_args.factory
def inceptionn(error_bound: float | None = None, capacity: float = 1.0, *, axis_name: AxisName = None,
               error_feedback: bool = True, seed: int = 0, bucket_bytes: int | None = None,
               min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather",
               relative_bound: float | None = None):
  """INCEPTIONN's lossy code: a 2-bit tag per value choosing 0, 8, 16 or 32 bits.

  Each value is rounded to a grid and sent in 0, 8, 16 or 32 bits, into a
  byte stream of fixed capacity per leaf; the bound is relative to each
  leaf's largest value by default (scale-equivariant). The code, the
  relative bound, the stream and its capacity are described in
  :mod:`jaxcomp.transforms.inceptionn`.

  Args:
    error_bound: an absolute error bound per value, in [2**-127, 2**14]; give
      ``error_bound`` or ``relative_bound``, not both. None (default): the
      relative bound. GRACE passes 2e-10, but its code turns it into the
      binary exponent ``127 + int(log10(2e-10 / 2)) = 117``, i.e. a bound of
      ``2**-10``. Read literally, 2e-10 would send nearly every value raw.
    capacity: stream bytes per value, in (0, 4] (default 1.0).
    axis_name: the data-parallel axis, or None for a local round trip.
    error_feedback: on by default: the dropped values below the bound and
      whatever did not fit in the stream are carried, so nothing is lost.
    seed: seeds the key (the per-step stream rotation).
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter` (the
      relative bound is then per chunk).
    relative_bound: the error bound as a fraction of each leaf's largest
      ``|x|``, in [2**-23, 0.5] (default ``2**-10`` when ``error_bound`` is
      not given). Steps below 2**-126 or above 2**125 are clipped there
      (leaves whose largest value is below about 1e-36).

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxcomp
    >>> params = {"w": jnp.zeros((256, 64))}
    >>> tx = jaxcomp.inceptionn()  # axis_name=None: one worker, a local round trip
    >>> jaxcomp.wire_bytes(tx, params)  # 2-bit tags and a stream of 1 byte per value
    20480

  References:
    Li, Park, Alian, Yuan, Qu, Pan, Wang, Schwing, Esmaeilzadeh, Kim, *A
    Network-Centric Hardware/Algorithm Co-Design to Accelerate Distributed
    Training of Deep Neural Networks* (INCEPTIONN), MICRO 2018: the lossy
    compression algorithm for floating-point gradients.
  """
  lsb, relative = _grid(error_bound, relative_bound)
  cap = _args.positive("capacity", capacity)
  if cap > 4.0:
    raise ValueError(f"capacity must be in (0, 4] bytes per value, got capacity={capacity!r}")
  ef = _args.flag("error_feedback", error_feedback)
  codec = InceptionnCodec(lsb, cap, relative)
  return build(Method("inceptionn", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed,
               bucket_bytes=bucket_bytes, min_size=min_size, dense=dense, dense_axis_name=dense_axis_name,
               transport=transport)


def _grid(error_bound, relative_bound) -> tuple:
  """inceptionn's bound, checked: ``(lsb, relative)``, the grid step's exponent and whether it is relative."""
  if error_bound is not None and relative_bound is not None:
    raise ValueError(f"inceptionn: give error_bound (absolute) or relative_bound (a fraction of each leaf's"
                     f" largest value), not both; got error_bound={error_bound!r},"
                     f" relative_bound={relative_bound!r}")
  if error_bound is None:
    rb = _args.positive("relative_bound", RELATIVE_BOUND if relative_bound is None else relative_bound)
    if not 2.0 ** -23 <= rb <= 0.5:
      raise ValueError(f"relative_bound must be in [2**-23, 0.5], got relative_bound={relative_bound!r}")
    return lsb_exponent(rb), True
  eb = _args.positive("error_bound", error_bound)
  if not 2.0 ** -127 <= eb <= 2.0 ** 14:
    raise ValueError(f"error_bound must be in [2**-127, 2**14], got error_bound={error_bound!r}")
  return lsb_exponent(eb), False
