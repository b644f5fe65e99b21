"""Quantizers: QSGD, TernGrad and natural compression (Dettmers' 8-bit code: :mod:`jaxcomp.transforms.u8bit`).

Every codec here works on a whole bucket: the fields of all its leaves are
packed together, each per-leaf quantity (a norm, a scale, a top exponent) is
one value per segment from the segment reductions of
:class:`jaxcomp.core.layout.Segments`, and the stochastic rounding draws one
uniform per bucket entry from the bucket's key (:mod:`jaxcomp.kernels.rng`). Each
leaf's fields are padded to a multiple of 128 entries (the segments' block).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.collectives import packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core.builder import build
from jaxcomp.core.layout import Segments
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, CodecExchange, Memory, flat_route
from jaxcomp.kernels import rng
from jaxcomp.transforms import _args
from jaxcomp.transforms.dense import pow2


def level_bits(levels: int) -> int:
  """Bits of one field holding a signed level in [-s, s] (offset by s): 2, 4 or 8."""
  span = 2 * levels + 1
  for bits in (2, 4, 8):
    if span <= 2 ** bits:
      return bits
  raise ValueError(f"levels must be <= 127, got levels={levels}")


@dataclasses.dataclass(frozen=True)
class QSGDCodec(Codec):
  """Payload: one float32 norm per segment and a signed level per entry, packed in 2, 4 or 8 bits."""

  levels: int
  block = 128
  carries_nonfinite = True  # a NaN/Inf makes its segment's norm, and so every decoded entry, non-finite

  def encode(self, x, key, segs):
    s = self.levels
    norm = jnp.sqrt(segs.sum(x * x))
    safe = segs.spread(jnp.where(norm > 0, norm, 1.0))
    scaled = jnp.abs(x) / safe * s
    level = jnp.floor(scaled + rng.uniform(key, x.shape))
    level = jnp.clip(level, 0, s)  # u < 1 and scaled <= s, the clip only guards rounding
    q = jnp.sign(x) * level + s    # in [0, 2s]
    return norm, packing.pack(q.astype(jnp.uint8), level_bits(s))

  def decode(self, payload, key, segs):
    norm, words = payload
    s = self.levels
    q = packing.unpack(words, level_bits(s), segs.length).astype(jnp.float32) - s
    return segs.spread(norm / s) * q


@_args.factory
def qsgd(levels: int = 127, *, axis_name: AxisName = None, error_feedback: bool = False, seed: int = 0,
         bucket_bytes: int | None = None, min_size: int | None = None, dense=None, dense_axis_name=None,
         transport: str = "gather"):
  """QSGD: unbiased stochastic quantization to ``levels`` levels per sign.

  Each entry becomes ``sign(x) * l`` with ``l = floor(s |x| / ||x||_2 + u)``,
  ``u ~ U[0, 1)``, so ``E[norm / s * l] = |x|``; ``||x||_2`` is the norm of
  the leaf. The payload is one float32 norm per leaf plus one field per entry
  packed in 2 bits (s = 1), 4 bits (s <= 7) or 8 bits (s <= 127), the fields
  of all leaves of a bucket packed together. Norms differ between workers, so payloads are
  all-gathered and each worker decodes and averages them. Each worker rounds
  with its own key (the shared key folded with its index); the
  uniforms come from :mod:`jaxcomp.kernels.rng`, a counter hash fused into the kernel.

  Args:
    levels: s in [1, 127]; GRACE's default 127 (its benchmarks use 64).
    axis_name: the data-parallel axis, or None.
    error_feedback: off by default (QSGD is unbiased); on, the rounding error
      is carried.
    seed: seeds the key.
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxcomp
    >>> params = {"w": jnp.zeros((256, 64))}
    >>> tx = jaxcomp.qsgd(levels=7)  # axis_name=None: one worker, a local round trip
    >>> jaxcomp.wire_bytes(tx, params)  # a float32 norm and 4 bits per entry
    8196

  References:
    Alistarh et al., *QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding*, NeurIPS 2017, Sec. 3.1.
  """
  s = _args.integer("levels", levels, 1, 127)
  ef = _args.flag("error_feedback", error_feedback)
  return build(Method("qsgd", flat_route(CodecExchange(QSGDCodec(s))), Memory(enabled=ef)), axis_name, seed,
               bucket_bytes=bucket_bytes, min_size=min_size, dense=dense, dense_axis_name=dense_axis_name,
               transport=transport)


# ----------------------------------------------------------------------------
# TernGrad


@dataclasses.dataclass(frozen=True)
class TernGradCodec(Codec):
  """Payload: one float32 scale per segment and a ternary value in {-1, 0, 1} per entry, 2 bits each."""

  clip_sigma: float | None
  block = 128
  carries_nonfinite = True  # NaN/Inf: its segment's scale (a sum of squares, a NaN-keeping max) is too

  def clip(self, x: jax.Array, segs: Segments):
    """``(x, scale)``: each segment of x clipped to +-clip_sigma * sigma (sigma: the segment's root mean
    square) and its largest clipped magnitude, from one pass over the bucket (``max |clip(x)| =
    min(max |x|, bound)``)."""
    if self.clip_sigma is None:
      return x, segs.max_abs(x)
    squares, top = segs.sum_max(jnp.square(x), jnp.abs(x))
    bound = self.clip_sigma * jnp.sqrt(squares / jnp.asarray(segs.sizes, jnp.float32))
    spread = segs.spread(bound)
    return jnp.clip(x, -spread, spread), jnp.minimum(top, bound)

  def encode(self, x, key, segs):
    x, scale = self.clip(x, segs)
    u = rng.uniform(key, x.shape)
    keep = u * segs.spread(scale) < jnp.abs(x)
    q = jnp.where(keep, jnp.sign(x), 0.0) + 1.0  # {-1, 0, 1} -> {0, 1, 2}
    return scale, packing.pack(q.astype(jnp.uint8), 2)

  def decode(self, payload, key, segs):
    scale, words = payload
    return segs.spread(scale) * (packing.unpack(words, 2, segs.length).astype(jnp.float32) - 1.0)


@_args.factory
def terngrad(clip_sigma: float | None = 2.5, *, axis_name: AxisName = None,
             error_feedback: bool = False, seed: int = 0, bucket_bytes: int | None = None,
             min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather"):
  """TernGrad: stochastic ternary gradients with a per-leaf scale.

  Each leaf is clipped to ``[-c sigma, c sigma]``; with ``s = max|clipped x|``
  every entry becomes ``s * sign(x) * b``, ``b ~ Bernoulli(|x| / s)``, so the
  decoded value is unbiased for the clipped ``x`` (clipping itself is the
  method's only bias). The payload is one float32 scale per leaf plus one
  ternary field per entry packed 2 bits each (4 per byte, the fields of all
  leaves of a bucket together): 2 bits per element plus 32 bits per leaf.
  Scales are local, so payloads are all-gathered and every worker decodes and
  averages all of them (TernGrad's optional scale sharing, a max-allreduce of
  the scales first, is not done).
  Each worker draws its Bernoulli variables with its own key
  (:mod:`jaxcomp.kernels.rng`).

  ``sigma`` is measured around zero (the root mean square of the leaf); the
  paper's standard deviation is the same for zero-mean gradients, and this
  choice never clips a single-element or constant leaf to zero.

  Args:
    clip_sigma: c, the clipping threshold in units of sigma (paper and GRACE:
      2.5); must be > 0, or None for no clipping.
    axis_name: the data-parallel axis, or None for a local round trip.
    error_feedback: off by default (the code is unbiased given the clipping);
      on, the quantization and clipping error is carried in a residual.
    seed: seeds the key.
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  References:
    Wen et al., *TernGrad: Ternary Gradients to Reduce Communication in
    Distributed Deep Learning*, NeurIPS 2017: stochastic ternarization with
    a per-layer scaler, and gradient clipping at c = 2.5 sigma.
  """
  c = None if clip_sigma is None else _args.positive("clip_sigma", clip_sigma)
  ef = _args.flag("error_feedback", error_feedback)
  codec = TernGradCodec(c)
  return build(Method("terngrad", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed,
               bucket_bytes=bucket_bytes, min_size=min_size, dense=dense, dense_axis_name=dense_axis_name,
               transport=transport)


# ----------------------------------------------------------------------------
# Natural compression

_MANTISSA = 0x7FFFFF
_NATURAL_BITS = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class NaturalCodec(Codec):
  """Payload: the top biased exponent of each segment (uint8 (S,)) and one sign + exponent field per entry.

  A field of ``bits`` bits holds the sign in its high bit and a code ``c`` in
  ``[0, 2**(bits - 1) - 1]``: ``c = 0`` is zero, ``c >= 1`` is
  ``2**(top - c + 1 - 127)``, ``top`` that of the entry's segment.
  """

  bits: int
  block = 128
  carries_nonfinite = True  # NaN/Inf: exponent 255, an integer max, top = 255: the entry decodes to +-Inf

  @property
  def levels(self) -> int:
    return 2 ** (self.bits - 1) - 1

  @staticmethod
  def rounded(x, key):
    """``(h, sign, e, m, e1)``: each entry's draw, sign, biased exponent, mantissa, and its exponent
    rounded up with probability ``m / 2**23`` (``e1``; 0 for zero, 255 for NaN/Inf)."""
    # One draw per entry: entries at or above the lowest level use its top 23
    # bits to round the mantissa, those below use it as a uniform; never both.
    h = rng.bits(key, x.shape)
    b = lax.bitcast_convert_type(x, jnp.uint32)
    sign, e, m = b >> 31, ((b >> 23) & 0xFF).astype(jnp.int32), b & _MANTISSA
    # |x| = 2**(e-127) * (1 + m / 2**23) rounds up to 2**(e-126) with probability m / 2**23.
    up = m > (h >> 9)
    return h, sign, e, m, jnp.where(e == 0, 0, jnp.where(e < 255, e + up.astype(jnp.int32), 255))

  def encode(self, x, key, segs):
    # The maxima draw again from the key through a barrier (the same bits): XLA fuses the rounding into
    # the reduction and again into the packing, and writes no int32 exponent per entry between them.
    top = segs.max(self.rounded(x, lax.optimization_barrier(key))[-1])
    h, sign, e, m, e1 = self.rounded(x, key)
    top_e = segs.spread(top)
    low = jnp.maximum(top_e - self.levels + 1, 1)
    # Below the lowest level: 0 or 2**(low-127), up with probability |x| / 2**(low-127).
    d = e - low
    frac = (1.0 + m.astype(jnp.float32) * 2.0 ** -23) * pow2(jnp.clip(d, -126, 0))
    p = jnp.where(d >= -126, frac, 0.0)
    under_up = rng.to_unit(h) < p
    e2 = jnp.where(e >= low, e1, jnp.where((e >= 1) & under_up, low, 0))
    code = jnp.where(e2 == 0, 0, top_e + 1 - e2)
    field = jnp.where(code > 0, code.astype(jnp.uint32) | (sign << (self.bits - 1)), 0)
    return top.astype(jnp.uint8), packing.pack(field.astype(jnp.uint8), self.bits)

  def decode(self, payload, key, segs):
    top, words = payload
    f = packing.unpack(words, self.bits, segs.length).astype(jnp.uint32)
    code = (f & self.levels).astype(jnp.int32)
    sign = f >> (self.bits - 1)
    e = segs.spread(top.astype(jnp.int32)) + 1 - code
    valid = (code > 0) & (e >= 1)
    word = (sign << 31) | (jnp.clip(e, 0, 255).astype(jnp.uint32) << 23)
    return jnp.where(valid, lax.bitcast_convert_type(word, jnp.float32), 0.0)


@_args.factory
def natural(bits: int = 8, *, axis_name: AxisName = None, error_feedback: bool = False, seed: int = 0,
            bucket_bytes: int | None = None, min_size: int | None = None, dense=None, dense_axis_name=None,
            transport: str = "gather"):
  """Natural compression: unbiased stochastic rounding to powers of two.

  ``|x|`` in ``[2**k, 2**(k+1))`` becomes ``2**k`` or ``2**(k+1)``, up with
  probability ``|x| / 2**k - 1``, so ``E[C(x)] = x`` and
  ``E[(C(x) - x)**2] <= x**2 / 8`` (the paper's Theorem). The rounding is done
  on the float32 bits: round up when the 23-bit mantissa exceeds 23 random bits.

  Wire format: per leaf one uint8 ``top``, the largest rounded biased exponent
  of the leaf, then one field per entry of ``bits`` bits (sign + exponent
  code), packed (the fields of all leaves of a bucket together).
  With the default 8 bits the code has 127 levels, ``2**(top-127)`` down to
  ``2**(top-253)``: 8 bits per element plus 8 bits per leaf. The exponent is
  stored relative to ``top`` rather than clipped to a fixed range as GRACE
  does, so no value is clipped at the top; a value below the lowest level
  (more than 126 binary orders below the largest: in practice never with
  8 bits) is rounded without bias to 0 or to the lowest level. ``bits=4``
  (7 levels) and ``bits=2`` (1 level: ``0`` or ``+-2**top``) trade variance
  for width, like the paper's natural dithering with a power-of-two norm;
  they stay unbiased.
  Zero is sent as zero. Denormals (which XLA CPU flushes) are sent as zero;
  Inf and NaN decode to +-Inf, and a finite ``|x| >= 2**127`` may round up to Inf.

  Payloads are all-gathered (exponent codes do not add); each worker decodes
  and averages them. Each worker draws its rounding with its own key.

  Args:
    bits: field width, 8 (default, the paper's sign + exponent byte), 4 or 2.
    axis_name: the data-parallel axis, or None for a local round trip.
    error_feedback: off by default (the code is unbiased).
    seed: seeds the key.
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  References:
    Horvath, Ho, Horvath, Sahu, Canini, Richtarik, *Natural Compression for
    Distributed Deep Learning*, 2019 (arXiv:1905.10988): the natural
    compression operator C_nat (variance factor 1/8) and natural dithering.
  """
  if isinstance(bits, bool) or bits not in _NATURAL_BITS:
    raise ValueError(f"bits must be one of {_NATURAL_BITS}, got bits={bits!r}")
  ef = _args.flag("error_feedback", error_feedback)
  codec = NaturalCodec(int(bits))
  return build(Method("natural", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed,
               bucket_bytes=bucket_bytes, min_size=min_size, dense=dense, dense_axis_name=dense_axis_name,
               transport=transport)
