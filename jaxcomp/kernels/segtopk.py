"""Exact top-k of every segment of a bucket at once: one vectorised bisection, one compaction.

For a bucket with static segments (:class:`jaxcomp.layout.Segments`) and a
static ``k`` per segment, :func:`segmented_topk` returns the positions of the
``k_s`` entries of largest ``|x|`` of each segment ``s`` (ties to the lower
index, as ``lax.top_k`` and a stable argsort), ascending, ``sum(k_s)`` in all.

The threshold of every segment is found together: a bisection on the int32
bit pattern of ``|x|`` (monotonic for non-negative floats), each step one pass
over the bucket that counts, per row of ``block`` entries, the entries at or
above their segment's current guess, then sums rows into segments. After 31
steps each segment's threshold is its ``k``-th largest magnitude exactly. The
mask (above it, plus the first tied entries) is packed into 32-bit words and
compacted by :func:`jaxcomp.kernels.compaction.compact`: nothing of the
bucket's size is sorted or scattered.

References:
  Fang et al., *RedSync*, arXiv:1808.04357 (threshold search instead of a
  sort); Shi et al., *Understanding Top-k Sparsification*, 2019.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.kernels import compaction
from jaxcomp.layout import Segments


def kth_largest_bits(bits: jax.Array, segs: Segments, k: np.ndarray) -> jax.Array:
  """Per segment, the ``k_s``-th largest value of ``bits`` (int32 (S,)), by bisection."""
  k = jnp.asarray(k, jnp.int32)
  rows = segs.rows(bits)

  def count(t):
    per_row = jnp.sum((rows >= t[segs.row_segment][:, None]).astype(jnp.int32), axis=1)
    return jax.ops.segment_sum(per_row, segs.row_segment, segs.count, indices_are_sorted=True)

  hi0 = jax.ops.segment_max(jnp.max(rows, axis=1), segs.row_segment, segs.count,
                            indices_are_sorted=True) + 1
  lo0 = jnp.zeros_like(hi0)

  def body(_, lohi):
    lo, hi = lohi
    mid = lo + (hi - lo) // 2
    enough = count(mid) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo, _ = lax.fori_loop(0, 31, body, (lo0, hi0))
  return lo


def segmented_topk(x: jax.Array, segs: Segments, k: np.ndarray) -> jax.Array:
  """Ascending bucket positions of the ``k_s`` largest ``|x|`` of each segment: int32 ``(sum k,)``.

  ``segs.block`` must be a multiple of 32 (each packed word lies in one segment).
  Slots of a segment with fewer than ``k_s`` entries that are not NaN hold ``segs.length``.
  """
  if segs.block % 32:
    raise ValueError(f"segmented_topk needs segments aligned to 32 entries, got block={segs.block}")
  k = np.asarray(k, np.int64)
  bits = compaction.abs_bits(x)
  t = kth_largest_bits(bits, segs, k)
  t_entry = segs.spread(t)
  strict = compaction.pack_mask(bits > t_entry)
  ties = compaction.pack_mask(bits == t_entry) & ~strict
  above = segs.sum((bits > t_entry).astype(jnp.int32))
  # Of the entries tied at the threshold, the first ``k - above`` of each segment (ties to lower indices).
  kept, _ = compaction.cap_segments(ties, segs, jnp.asarray(k, jnp.int32) - above)
  words = strict | kept
  idx, _ = compaction.compact(words, segs.length, int(k.sum()))
  return idx
