"""SBC's binarization: per segment, the k largest entries of each sign and the side with the larger mean.

:func:`binarize` is the reference for one vector; :func:`sided_thresholds`
finds, for every segment of a bucket at once, the ``k``-th largest positive
entry and the ``k``-th largest magnitude of a negative one, exactly, on the
int32 bit patterns (:mod:`jaxcomp.transforms.sbc` then selects and averages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.core import layout
from jaxcomp.kernels import segtopk

SIGN = 0x7FFFFFFF  # the magnitude bits of a float32 pattern


def binarize(a: jax.Array, k: int):
  """SBC's binarization of one flat vector: the side of the top-k with the larger mean.

  Takes the ``k`` largest entries of ``a`` that are > 0 and the ``k`` largest
  of ``-a`` that are > 0, with mean magnitudes ``mu+`` and ``mu-``; keeps the
  positive side when ``mu+ >= mu-``. (One vector; :class:`SBCExchange` does
  every segment of a bucket at once.)

  Returns:
    ``(value, positions, count)``: the float32 value every selected entry is
    replaced by (``mu+`` or ``-mu-``), the int32 positions ``(k,)`` ascending
    with unused slots equal to ``n``, and their int32 count.
  """
  n = a.shape[-1]
  vp, ip = lax.top_k(a, k)
  vn, in_ = lax.top_k(-a, k)
  okp, okn = vp > 0, vn > 0
  cp = jnp.sum(okp, dtype=jnp.int32)
  cn = jnp.sum(okn, dtype=jnp.int32)
  mup = jnp.sum(jnp.where(okp, vp, 0.0)) / jnp.maximum(cp, 1)
  mun = jnp.sum(jnp.where(okn, vn, 0.0)) / jnp.maximum(cn, 1)
  plus = mup >= mun
  idx = jnp.where(plus, jnp.where(okp, ip, n), jnp.where(okn, in_, n))
  return jnp.where(plus, mup, -mun), jnp.sort(idx.astype(jnp.int32)), jnp.where(plus, cp, cn)


def _row_sum(per_row: jax.Array, segs: layout.Segments) -> jax.Array:
  """Per-segment sums of a per-row array (rows of ``segs.block`` entries, on the leading axis)."""
  if segs.count == 1:
    return jnp.sum(per_row, axis=0)[None]
  return jax.ops.segment_sum(per_row, segs.row_segment, segs.count, indices_are_sorted=True)


def _negative(bits):
  """The magnitudes' patterns of the entries < 0 (sign bit set), 0 elsewhere."""
  return jnp.where(bits < 0, bits & SIGN, 0)


def sided_thresholds(bits: jax.Array, segs: layout.Segments, k: np.ndarray):
  """Per segment, the bit patterns of the ``k``-th largest positive entry and ``k``-th largest negative one.

  ``bits``: the int32 bit pattern of a finite float32 bucket, whose order on
  entries > 0 is that of the values, and on entries < 0 (sign bit set) that
  of the magnitudes in the low 31 bits. Each side is the exact ``k``-th
  largest of its patterns (the other side's entries as 0). On XLA:CPU from a
  sampled bracket in a few passes over the bucket
  (:func:`jaxcomp.kernels.segtopk.kth_largest_bits`); elsewhere
  :func:`jaxcomp.kernels.segtopk.bisect_kth`'s search built bit by bit, both
  sides in each of its 31 passes (a pass there runs at memory speed).
  A side with fewer than ``k`` entries gets 0.

  The sampled search keeps the bucket it reads in memory (its passes are
  loops); the negative side's patterns are computed from ``bits`` by each of
  its passes (never written out). The positive side reads ``bits`` itself, not ``max(bits, 0)``: the ``k``-th
  largest of ``max(bits, 0)`` is ``max(., 0)`` of that of ``bits`` (a
  monotone map), and the search's counts at every candidate >= 1 are the
  same on both, so its result clamped at 0 is exact and the bucket is held
  once for that side, not twice.
  """
  if segtopk.sampled(segs):
    tp = jnp.maximum(segtopk.kth_largest_bits(bits, segs, k), 0)
    tn, _ = segtopk.kth_largest_bits(bits, segs, k, of=_negative)  # never written out
    return tp, tn
  rows_p, rows_n = segs.rows(jnp.maximum(bits, 0)), segs.rows(_negative(bits))
  k = jnp.asarray(k, jnp.int32)

  def body(i, t):
    tp, tn = t
    bit = jnp.left_shift(jnp.int32(1), 30 - i)
    cp, cn = tp | bit, tn | bit
    above_p = jnp.sum((rows_p >= cp[segs.row_segment][:, None]).astype(jnp.int32), axis=1)
    above_n = jnp.sum((rows_n >= cn[segs.row_segment][:, None]).astype(jnp.int32), axis=1)
    tp = jnp.where(_row_sum(above_p, segs) >= k, cp, tp)
    tn = jnp.where(_row_sum(above_n, segs) >= k, cn, tn)
    return tp, tn

  zero = jnp.zeros((segs.count,), jnp.int32) + (bits[0] & 0)  # typed like bits (shard_map's varying)
  return lax.fori_loop(0, 31, body, (zero, zero))
