"""Dettmers' 8-bit code (GRACE's ``u8bit``): a sign and one of 128 magnitudes per entry, a scale per leaf.

Like the quantizers of :mod:`jaxcomp.transforms.quantize`, the codec works on
a whole bucket: one scale per segment from the segment reductions of
:class:`jaxcomp.core.layout.Segments`, the codes of all leaves packed together.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives.axis import AxisName
from jaxcomp.core.builder import build
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, CodecExchange, Memory, flat_route
from jaxcomp.transforms import _args


def dettmers_table() -> np.ndarray:
  """The 128 magnitudes of the 8-bit code, increasing, in [0, 1] (float32).

  126 of them are GRACE's table: per decade ``[10**-k, 10**(1-k))``,
  k = 1..6, ``2**(6-k)`` linear bins in each of ``[10**-k, 4.5 * 10**-k)``
  and ``[4.5 * 10**-k, 10**(1-k))``, represented by their midpoints (64 values
  in the top decade, 2 in the lowest). The two ends are 0 and 1, so that zeros
  and the largest entry (the scale) round-trip exactly; GRACE has 1.5e-6 and
  0.9957 there.
  """
  mids = []
  for k in range(6, 0, -1):
    lo, split, hi = 10.0 ** -k, 4.5 * 10.0 ** -k, 10.0 ** (1 - k)
    bins = 2 ** (6 - k)
    for a, b in ((lo, split), (split, hi)):
      width = (b - a) / bins
      mids.extend(a + (i + 0.5) * width for i in range(bins))
  return np.asarray([0.0] + mids + [1.0], np.float32)


_TABLE = dettmers_table()
_BOUNDS = ((_TABLE[:-1].astype(np.float64) + _TABLE[1:]) / 2).astype(np.float32)
_BOUNDS_INF = np.append(_BOUNDS, np.float32(np.inf))
_CELL_SHIFT = 23 - 5  # cells of 1/32 of a binade: each holds at most one bound (checked below)


def _cells() -> np.ndarray:
  """For each cell of floats in [0, 1] (their bits >> :data:`_CELL_SHIFT`): how many bounds lie below it."""
  keys = np.arange((0x3F800000 >> _CELL_SHIFT) + 1, dtype=np.uint32)
  lo = (keys << _CELL_SHIFT).view(np.float32)
  hi = ((keys + 1) << _CELL_SHIFT).view(np.float32)
  start = np.searchsorted(_BOUNDS, lo, side="left")
  assert int((np.searchsorted(_BOUNDS, hi, side="left") - start).max()) <= 1
  return start.astype(np.uint8)


_CELLS = _cells()


@dataclasses.dataclass(frozen=True)
class U8bitCodec(Codec):
  """Payload: the float32 max |x| of each segment and one byte per entry: sign bit + 7-bit table index."""

  block = 128
  carries_nonfinite = True  # a NaN/Inf makes its segment's scale (a NaN-keeping max) non-finite

  def encode(self, x, key, segs):
    scale = segs.max_abs(x)
    r = jnp.abs(x) / segs.spread(jnp.where(scale > 0, scale, 1.0))
    # searchsorted(_BOUNDS, r, side="left") from the float bits of r: the top 5 mantissa
    # bits and the exponent pick a cell of :data:`_CELLS`, which holds at most one bound,
    # so one table look-up and one compare (two gathers, where a binary search takes seven).
    # NaN (a NaN entry, or an infinite scale) gets index 0 as before.
    cell = jnp.minimum(lax.bitcast_convert_type(r, jnp.uint32) >> _CELL_SHIFT, _CELLS.size - 1)
    start = jnp.asarray(_CELLS)[cell.astype(jnp.int32)].astype(jnp.int32)
    idx = start + (jnp.asarray(_BOUNDS_INF)[start] < r).astype(jnp.int32)
    idx = jnp.where(r <= 1.0, idx, 0)
    idx = idx.astype(jnp.uint8)
    code = jnp.where((x < 0) & (idx > 0), idx | jnp.uint8(0x80), idx)
    return scale, code

  def decode(self, payload, key, segs):
    scale, code = payload
    mag = jnp.asarray(_TABLE)[(code & 0x7F).astype(jnp.int32)] * segs.spread(scale)
    return jnp.where(code >= 0x80, -mag, mag)


@_args.factory
def u8bit(*, axis_name: AxisName = None, error_feedback: bool = False, seed: int = 0,
          bucket_bytes: int | None = None, min_size: int | None = None, dense=None, dense_axis_name=None,
          transport: str = "gather"):
  """Dettmers' 8-bit approximation: a 128-entry table per sign plus the max.

  Each leaf is scaled by its largest magnitude ``s = max|x|``; ``|x| / s`` is
  rounded to the nearest of 128 table values (:func:`dettmers_table`: 0,
  126 bin midpoints of a base-10 dynamic tree spanning 1e-6 to 1, and 1) and
  sent as one byte, sign bit + 7-bit index. Decoding is ``sign * table[i] * s``.
  Rounding to the nearest entry bounds the relative error by 5% for
  ``|x| >= 0.1 s``, 9% in the next decade, 15%, 25%, then 45% down to
  ``1e-6 s``; values below ``1.375e-6 s`` become 0. The code is
  deterministic and biased (mostly on tiny entries), so there is no error
  feedback by default.

  Payload: a float32 scale per leaf + one byte per entry (8 bits per element plus 32 per leaf),
  all-gathered (the scales are local); each worker decodes and averages.

  Args:
    axis_name: the data-parallel axis, or None for a local round trip.
    error_feedback: off by default (as in GRACE); on, the rounding error is
      carried in a residual.
    seed: seeds the state's key (the code itself uses no randomness).
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  References:
    Dettmers, *8-Bit Approximations for Parallelism in Deep Learning*, ICLR
    2016 (arXiv:1511.04561): the dynamic tree data type; the table is
    GRACE's (Xu et al., ICDCS 2021, ``u8bit`` compressor).
  """
  ef = _args.flag("error_feedback", error_feedback)
  return build(Method("u8bit", flat_route(CodecExchange(U8bitCodec())), Memory(enabled=ef)), axis_name, seed,
               bucket_bytes=bucket_bytes, min_size=min_size, dense=dense, dense_axis_name=dense_axis_name,
               transport=transport)
