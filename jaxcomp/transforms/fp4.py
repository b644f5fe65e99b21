"""Low-bit value codes: a 4-bit float (E2M1) codec, and SparseLoCo's chunked top-k with 2-bit values.

- :func:`fp4`: every entry as a 4-bit float, E2M1 (sign, 2 exponent bits, 1
  mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), with one power-of-two
  scale per block of 32 entries (an 8-bit exponent, as the OCP Microscaling
  MXFP4 format) or per leaf. Streaming DiLoCo sends its outer gradients in
  4-bit floats; the codec is a method like the others.
- :func:`chunked_topk`: the ``ceil(density * chunk)`` largest ``|x|`` of every
  chunk of the bucket, their values in 2 bits (sign and one magnitude bit:
  each chunk sends the mean magnitude of its smaller and of its larger
  half), in 4-bit floats, or in float32, with error feedback that decays
  (``e <- decay * e + x``): the compressor of :func:`jaxcomp.sparseloco`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import policy
from jaxcomp.core.builder import build
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, CodecExchange, Memory, flat_route
from jaxcomp.exchanges.scatter import ScatterCodec
from jaxcomp.kernels.sparse import scatter_mean, zeros_after
from jaxcomp.transforms import _args
from jaxcomp.transforms.dense import pow2

E2M1 = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
"""The eight magnitudes of an E2M1 4-bit float (code 0..7; bit 3 is the sign)."""

_MIDS = (E2M1[1:] + E2M1[:-1]) / 2
FP4_BLOCKS = (32, 64, 128, None)
VALUE_BITS = (2, 4, 32)


def fp4_exponent(top: jax.Array) -> jax.Array:
  """The int32 exponent ``e`` of the smallest power of two with ``top / 2**e <= 6`` (clipped to [-126, 126]).

  ``top`` >= 0 float32 (a block's largest magnitude). Read from the bits:
  ``top = 2**(b - 127) * (1 + m)``; ``top / 2**(b - 129) = 4 (1 + m) <= 6``
  when ``m <= 1/2``, else ``e = b - 128``. Every entry then lies in [-6, 6]
  after scaling: nothing is clipped, and the scaling is exact.
  """
  bits = lax.bitcast_convert_type(top, jnp.int32)
  b, m = bits >> 23, bits & 0x7FFFFF
  e = jnp.where(m <= 0x400000, b - 129, b - 128)
  return jnp.clip(e, -126, 126)


def fp4_encode(x: jax.Array, e: jax.Array) -> jax.Array:
  """4-bit codes (uint8 in [0, 15]) of ``x / 2**e`` rounded to the nearest E2M1 value (``e`` like ``x``)."""
  y = x * pow2(-e)
  idx = jnp.zeros(x.shape, jnp.uint8)
  for mid in _MIDS:  # seven compares: the index of the nearest magnitude (ties round down)
    idx = idx + (jnp.abs(y) > mid).astype(jnp.uint8)
  return jnp.where((y < 0) & (idx > 0), idx | jnp.uint8(8), idx)


def fp4_decode(code: jax.Array, e: jax.Array) -> jax.Array:
  """float32 values of 4-bit codes at scale ``2**e`` (``e`` spread like ``code``)."""
  mag = jnp.asarray(E2M1)[(code & 7).astype(jnp.int32)] * pow2(e)
  return jnp.where(code >= 8, -mag, mag)


def _finite_abs(x):
  return jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)


@dataclasses.dataclass(frozen=True)
class FP4Codec(Codec):
  """Payload: one uint8 biased exponent per block (or per segment) and 4 bits per entry, two to a byte."""

  scale_block: int | None = 32
  block = 128

  def _exponents(self, x, segs):
    if self.scale_block is None:
      return fp4_exponent(segs.max(_finite_abs(x)))
    return fp4_exponent(jnp.max(_finite_abs(x).reshape(-1, self.scale_block), axis=1))

  def _spread(self, e, segs):
    if self.scale_block is None:
      return segs.spread(e)
    return jnp.repeat(e, self.scale_block)  # a static repeat: a broadcast (total_repeat_length would scatter)

  def encode(self, x, key, segs):
    e = self._exponents(x, segs)
    code = fp4_encode(x, self._spread(e, segs))  # NaN/Inf: the build's flag makes the mean NaN
    return (e + 127).astype(jnp.uint8), packing.pack(code, 4)

  def decode(self, payload, key, segs):
    e, words = payload
    code = packing.unpack(words, 4, segs.length)
    return fp4_decode(code, self._spread(e.astype(jnp.int32) - 127, segs))


@_args.factory
def fp4(*, axis_name: AxisName = None, block: int | None = 32, error_feedback: bool = True, seed: int = 0,
        bucket_bytes: int | None = None, min_size: int | None = None, dense=None, dense_axis_name=None,
        transport: str = "gather"):
  """4-bit floats (E2M1) with a power-of-two scale per block, error feedback, float32 accumulation.

  Each block of ``block`` consecutive entries of a bucket (blocks never
  straddle two leaves: each leaf starts at a multiple of 128 entries) gets
  the scale ``2**e``, ``e`` the smallest exponent with ``max|x| / 2**e <= 6``
  (:func:`fp4_exponent`), sent as one uint8; every entry is sent as the
  nearest E2M1 value of ``x / 2**e`` (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4,
  6), a sign bit and 3 bits of magnitude, two entries to a byte. Nothing is
  clipped; the error of an entry is at most ``2**e`` (half the gap between
  4 and 6), and at most a fifth of its magnitude for entries ``|x| >= 2**e``.
  ``block=None`` uses one scale per leaf. Payloads are all-gathered (the scales differ between
  workers) and each worker decodes and sums them in float32, in worker
  order. With error feedback (default) the rounding error stays in the
  residual. Scale-equivariant bit for bit under power-of-two scaling.

  Payload: ``n / 2`` bytes for n entries (leaves padded to 128) plus one byte
  per block: 4.25 bits an entry with the default block of 32.

  Args:
    axis_name: the data-parallel axis, or None for a local round trip.
    block: entries per scale, 32 (default, as MXFP4), 64 or 128; None: one scale per leaf.
    error_feedback: keep the rounding error in a residual (default True).
    seed: seeds the state's key (the code uses no randomness).
    bucket_bytes, min_size, dense, dense_axis_name: see :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"``, see :mod:`jaxcomp.exchanges.scatter`.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxcomp
    >>> tx = jaxcomp.fp4()  # axis_name=None: one worker, a local round trip
    >>> jaxcomp.wire_bytes(tx, {"w": jnp.zeros((256, 64))})  # 8192 bytes of codes, 512 scales
    8704

  References:
    Liu et al., *Streaming DiLoCo with overlapping communication*, 2025
    (arXiv:2501.18512): outer gradients in 4-bit floats (E3M0 and E2M1);
    Rouhani et al., *Microscaling Data Formats for Deep Learning*, 2023
    (arXiv:2310.10537): E2M1 elements with a shared 8-bit exponent per 32.
  """
  if block not in FP4_BLOCKS or isinstance(block, bool):
    raise ValueError(f"block must be one of {FP4_BLOCKS}, got block={block!r}")
  ef = _args.flag("error_feedback", error_feedback)
  method = Method("fp4", flat_route(CodecExchange(FP4Codec(block))), Memory(enabled=ef))
  return build(method, axis_name, seed, bucket_bytes, min_size, dense, dense_axis_name=dense_axis_name,
               transport=transport)


# ----------------------------------------------------------------------------
# Chunked top-k with low-bit values (SparseLoCo)


def two_level(v: jax.Array):
  """Per row of ``v``: 2-bit codes and the two magnitudes (float32 (rows, 2)) they stand for.

  Within a row, entries above the mean magnitude form the upper half, the
  others the lower one; each half is sent as its mean magnitude (one step
  of Lloyd's algorithm from the split at the mean), with its sign. Code:
  bit 0 the half, bit 1 the sign.
  """
  a = jnp.abs(v)
  hi = a > jnp.mean(a, axis=1, keepdims=True)
  n_hi = jnp.sum(hi, axis=1)
  n_lo = v.shape[1] - n_hi
  m_hi = jnp.sum(jnp.where(hi, a, 0.0), axis=1) / jnp.maximum(n_hi, 1)
  m_lo = jnp.sum(jnp.where(hi, 0.0, a), axis=1) / jnp.maximum(n_lo, 1)
  code = hi.astype(jnp.uint8) | ((v < 0).astype(jnp.uint8) << 1)
  return code, jnp.stack([m_lo, m_hi], axis=1)


@dataclasses.dataclass(frozen=True)
class ChunkedLowBitTopKCodec(Codec, ScatterCodec):
  """The ``ceil(density * chunk)`` largest |x| of each chunk: in-chunk offsets and low-bit values."""

  leaf_segments = False  # transport="scatter": one budget per chunk

  density: float
  chunk: int
  bits: int = 2
  per_entry: bool = False  # the mean of each entry over the workers that sent it (SparseLoCo's)
  selects = True

  def _layout(self, n: int):
    b = min(self.chunk, n)
    return b, -(-n // b), _args.ratio_count(self.density, b)

  def _values(self, v):
    if self.bits == 32:
      return (v.reshape(-1),)
    if self.bits == 4:
      e = fp4_exponent(jnp.max(jnp.abs(v), axis=1))
      code = fp4_encode(v, e[:, None])
      return (e + 127).astype(jnp.uint8), packing.pack(code.reshape(-1), 4)
    code, levels = two_level(v)
    return levels, packing.pack(code.reshape(-1), 2)

  def _unvalues(self, vals, rows, kb):
    if self.bits == 32:
      return vals[0]
    code = packing.unpack(vals[-1], self.bits, rows * kb).reshape(rows, kb)
    if self.bits == 4:
      return fp4_decode(code, vals[0].astype(jnp.int32)[:, None] - 127).reshape(-1)
    mag = jnp.take_along_axis(vals[0], (code & 1).astype(jnp.int32), axis=1)
    return jnp.where(code >= 2, -mag, mag).reshape(-1)

  def encode(self, x, key, segs):
    n = x.shape[0]
    b, rows, kb = self._layout(n)
    xr = jnp.pad(x, (0, rows * b - n)).reshape(rows, b)
    _, off = lax.top_k(jnp.abs(xr), kb)
    vals = self._values(jnp.take_along_axis(xr, off, axis=1))
    return (off.reshape(-1).astype(np.uint8 if b <= 256 else np.uint16),) + vals

  def _dense(self, payload, n):
    b, rows, kb = self._layout(n)
    base = jnp.repeat(jnp.arange(rows, dtype=jnp.int32) * b, kb)
    pos = base + payload[0].astype(jnp.int32)
    return pos, self._unvalues(payload[1:], rows, kb)

  def decode(self, payload, key, segs):
    pos, vals = self._dense(payload, segs.length)
    return zeros_after(segs.length, vals).at[pos].set(vals, mode="drop", unique_indices=True)

  def aggregate(self, gathered, key, segs, num):
    def sparse(w):
      pos, vals = self._dense(gathered.payload(w), segs.length)
      return vals, pos

    return scatter_mean(sparse, gathered, segs.length, num, self.per_entry)


MEANS = ("workers", "senders")


def chunked_topk(density: float = 0.02, bits: int = 2, chunk: int = 4096, decay: float = 0.95,
                 axis_name: AxisName = None, seed: int = 0, bucket_bytes: int | None = None,
                 min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather",
                 mean: str = "workers"):
  """Top-k per chunk with low-bit values and decaying error feedback (SparseLoCo's compressor).

  Each bucket is cut into chunks of ``chunk`` consecutive entries; each
  chunk sends its ``k = ceil(density * chunk)`` entries of largest
  magnitude as in-chunk offsets (uint8 for chunks of at most 256 entries,
  else uint16) and values in ``bits`` bits: 2 (a sign and a bit choosing
  between the chunk's two magnitudes, the mean of its selected entries
  below and above their mean magnitude, two float32 per chunk; see
  :func:`two_level`), 4 (E2M1 with one 8-bit power-of-two scale per chunk,
  as :func:`fp4`) or 32 (float32). The residual decays:
  ``x = decay * e + g``, ``e <- x - sent`` (SparseLoCo's accumulator, which
  stands in for outer momentum); ``decay=1`` is plain error feedback.
  Payloads are all-gathered and each worker decodes and averages them in
  float32, in worker order: ``mean="workers"`` divides each entry's sum by
  the number of workers (the mean of the decoded vectors), ``"senders"``
  by the number of workers that sent that entry (SparseLoCo's reference
  code: an entry one worker of eight selected moves by its full value).

  Args:
    density: fraction of each chunk sent, in (0, 1] (SparseLoCo: 1-3%).
    bits: bits of a value on the wire, one of (2, 4, 32).
    chunk: entries per chunk, in [1, 65536] (SparseLoCo's chunks of 64 x 64 hold 4096).
    decay: the residual's decay beta, in [0, 1] (SparseLoCo: 0.95).
    axis_name, seed, bucket_bytes, min_size, dense, dense_axis_name: see :func:`jaxcomp.build`;
      every leaf is compressed by default.
    transport: ``"gather"`` or ``"scatter"``, see :mod:`jaxcomp.exchanges.scatter`.
    mean: ``"workers"`` or ``"senders"``, the divisor of each entry's sum (above).

  References:
    Sarfi, Thérien, Lidin, Belilovsky, *Communication Efficient LLM
    Pre-training with SparseLoCo*, 2025 (arXiv:2508.15706), Algorithm 1.
  """
  r = _args.ratio("density", density)
  if isinstance(bits, bool) or bits not in VALUE_BITS:
    raise ValueError(f"bits must be one of {VALUE_BITS}, got bits={bits!r}")
  b = _args.integer("chunk", chunk, 1, 65536)
  beta = _args.unit_interval("decay", decay, closed_right=True)
  per_entry = _args.choice("mean", mean, MEANS) == "senders"
  codec = ChunkedLowBitTopKCodec(r, b, int(bits), per_entry)
  method = Method("chunked_topk", flat_route(CodecExchange(codec)), Memory(beta=beta),
                  min_size=policy.EVERY_LEAF)
  return build(method, axis_name, seed, bucket_bytes, min_size, dense, dense_axis_name=dense_axis_name,
               transport=transport)
