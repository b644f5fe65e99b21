"""Per-segment thresholds for a target count: sampled, then adjusted, every segment of a bucket at once.

A threshold that must select about ``ratio`` of a segment is estimated from a
small strided sample of it (the k-th largest of every sample found at once by
:func:`jaxcomp.kernels.segtopk.bisect_kth`, no sort) and then adjusted by a few
counting passes over the bucket (:func:`refine_thresholds`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.core.layout import Segments
from jaxcomp.kernels import compaction, segtopk
from jaxcomp.transforms import _args

MIN_SAMPLE = 128  # the smallest sample
EXACT_MAX = 16384  # a leaf this small is its own sample: its threshold is exact, see sample_size


def sample_size(n: int, sample_ratio: float) -> int:
  """``max(ceil(sample_ratio * n), 128)`` entries, or all ``n`` for a leaf of at most 16384.

  Small leaves are their own sample: a bucket's thresholds are adjusted together, one counting
  pass over the whole bucket per step until every leaf is within its band, and the few-entry
  samples of small leaves (1% of 16384 is 164 entries, about 2 above the threshold at ratio 0.01)
  miss the band most often. Their exact thresholds cost little (the samples are searched
  together, not sorted) and need no adjustment.
  """
  if n <= EXACT_MAX:
    return n
  return min(n, max(_args.ratio_count(sample_ratio, n), MIN_SAMPLE))


def target(ratio, m) -> jax.Array:
  """``ceil(ratio * m)`` in float32 (a target count; rounding noise is harmless)."""
  return jnp.ceil(jnp.asarray(ratio, jnp.float32) * jnp.asarray(m, jnp.float32) - 1e-3)


def sampled_thresholds(a: jax.Array, segs: Segments, offsets: jax.Array, ratio, max_ratio,
                       sample_ratio: float, among_nonzero: bool = False, magnitude=None) -> jax.Array:
  """Per segment, the magnitude above which about ``ratio`` of ``a`` (>= 0) lies, from a sample.

  The sample of a segment of n entries is ``s = max(ceil(sample_ratio * n),
  128)`` entries (all of it up to 16384 entries, see :func:`sample_size`),
  one every ``n // s`` from ``offsets[s] % (n // s)``; the threshold is its ``ceil(ratio * s)``-th
  largest entry (of its nonzero entries with ``among_nonzero``), at most the
  ``ceil(max_ratio * s)``-th. ``ratio`` may be traced; ``max_ratio`` is a float,
  or an int32 (S,) array of those bounds (:func:`sample_bounds`). When the sample holds
  no nonzero entry, the threshold is the segment's ``max(a)``. ``magnitude``: None (``a`` holds
  the magnitudes, >= 0), or a function of ``a`` that gives them (each reader of ``a`` then
  computes them as it reads, see :func:`refine_thresholds`). The k-th
  largest of every sample is found exactly and at once by
  :func:`jaxcomp.kernels.segtopk.bisect_kth` on the float bit pattern (31
  counting passes over the samples, no sort).
  Returns float32 (S,).
  """
  sizes = np.asarray(segs.sizes, np.int64)
  s = np.asarray([sample_size(n, sample_ratio) for n in segs.sizes], np.int64)
  stride = sizes // s
  # Each sample padded to rows of 128 (padding reads -1: never counted), laid out by numpy
  # (literals, nothing for XLA to fold); only the shift of each segment is traced.
  rows = -(-s // MIN_SAMPLE)
  seg_np = np.repeat(np.arange(segs.count, dtype=np.int32), rows * MIN_SAMPLE)
  j = np.arange(seg_np.size) - np.repeat(np.cumsum(rows) - rows, rows * MIN_SAMPLE) * MIN_SAMPLE
  used = j < s[seg_np]
  base = (np.asarray(segs.offsets, np.int64)[seg_np] + stride[seg_np] * np.minimum(j, s[seg_np] - 1))
  shift = offsets.astype(jnp.int32) % jnp.asarray(stride, jnp.int32)
  pos = jnp.asarray(base.astype(np.int32)) + (shift[jnp.asarray(seg_np)] if segs.count > 1 else shift[0])
  mag = (lambda v: v) if magnitude is None else magnitude
  sample = jnp.where(jnp.asarray(used), mag(a[pos]), -1.0)
  bits = lax.bitcast_convert_type(sample, jnp.int32)
  # the samples as segments of their own: each starts on a row of MIN_SAMPLE entries
  starts = (np.cumsum(rows) - rows) * MIN_SAMPLE
  sample_segs = Segments(tuple(int(o) for o in starts), tuple(int(m) for m in s),
                         tuple((int(m),) for m in s), MIN_SAMPLE)
  ks_max = sample_bounds(segs, max_ratio, sample_ratio) if np.ndim(max_ratio) == 0 else max_ratio
  if among_nonzero:  # the nonzero entries of each sample
    pool = compaction.run_sums(jnp.sum(bits.reshape(-1, MIN_SAMPLE) >= 1, axis=1, dtype=jnp.int32), rows)
  else:
    pool = jnp.asarray(s, jnp.int32)
  ks = jnp.clip(target(ratio, pool).astype(jnp.int32), 1, jnp.asarray(ks_max))
  # the ks-th largest entry of each sample, exactly (padding reads -1: never counted)
  top = segs.max(mag(a))
  lo = segtopk.bisect_kth(bits, sample_segs, ks)
  thr = lax.bitcast_convert_type(lo, jnp.float32)
  return jnp.where(thr > 0, thr, top)


def sample_bounds(segs: Segments, max_ratio: float, sample_ratio: float) -> np.ndarray:
  """int32 (S,): the largest rank :func:`sampled_thresholds` takes in each segment's sample."""
  return np.asarray([_args.ratio_count(max_ratio, sample_size(n, sample_ratio)) for n in segs.sizes],
                    np.int32)


def passes(a: jax.Array, thr) -> jax.Array:
  """What a threshold selects: ``a >= thr`` and ``a > 0`` (an exact zero is never sent)."""
  return (a >= thr) & (a > 0)


def refine_thresholds(a: jax.Array, thr: jax.Array, k, segs: Segments, low: float, high: float,
                      up: float, down: float, iterations: int, magnitude=None):
  """Per segment, scales ``thr`` by ``up`` while more than ``high * k`` entries pass, by ``down``
  while fewer than ``low * k`` pass, at most ``iterations`` times (DGC: 0.7, 1.3, x1.3, x0.7, 10).

  The steps are coarse (``up * down`` close to 1 can cycle around the band),
  so when the loop ends outside the band a segment gets the threshold tried
  whose count was closest to k, not the last one. All segments iterate
  together, one counting pass over the bucket per step; a segment inside its
  band keeps its threshold, so each follows exactly the steps it would alone.

  ``magnitude``: None (``a`` holds the magnitudes, >= 0; returns the thresholds), or a function
  of ``a`` that gives them (``a`` is then the bucket itself; returns ``(thresholds, a)``, the
  bucket read back after the loop). Each counting pass then computes the magnitudes as it reads
  the bucket: the bucket rides in the loop's state behind an optimization barrier, so that XLA
  does not hoist them out of the loop and write them out in full. Read the returned bucket
  after the loop, not ``a``: magnitudes of ``a`` computed both before and after the loop would
  be one value to XLA, written out for its two readers.
  """
  k = jnp.broadcast_to(jnp.asarray(k, jnp.float32), (segs.count,))
  mag = (lambda v: v) if magnitude is None else magnitude

  def count(t, v):
    return compaction.segment_count(passes(mag(v), segs.spread(t)), segs).astype(jnp.float32)

  def outside(m):
    return (m > high * k) | (m < low * k)

  def cond(c):
    i, _, m, _, _, _ = c
    return (i < iterations) & jnp.any(outside(m))

  def body(c):
    i, t, m, best, gap, v = c
    v = lax.optimization_barrier(v)
    moving = outside(m)
    t = jnp.where(moving, jnp.where(m > high * k, t * up, t * down), t)
    m = count(t, v)
    closer = moving & (jnp.abs(m - k) < gap)
    return i + 1, t, m, jnp.where(closer, t, best), jnp.where(closer, jnp.abs(m - k), gap), v

  v = lax.optimization_barrier(a)  # the first count's magnitudes: not those a reader before it shares
  m0 = count(thr, v)
  c = lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), thr, m0, thr, jnp.abs(m0 - k), v))
  _, t, m, best, _, v = c
  out = jnp.where(outside(m), best, t)
  return out if magnitude is None else (out, v)


def refine_threshold(a: jax.Array, thr: jax.Array, k, low: float, high: float, up: float,
                     down: float, iterations: int) -> jax.Array:
  """:func:`refine_thresholds` of one vector ``a`` (a scalar threshold)."""
  n = a.shape[0]
  segs = Segments((0,), (n,), ((n,),))
  return refine_thresholds(a, jnp.reshape(thr, (1,)), k, segs, low, high, up, down, iterations)[0]


def segment_rms(x: jax.Array, segs: Segments) -> jax.Array:
  """Per segment, the root mean square of the finite entries of ``x`` over its ``n`` entries (float32 (S,)).

  From float32 squares: exact under power-of-two scaling of ``x`` (bit for
  bit) while the squares stay normal floats, i.e. for entries between about
  1e-19 and 1e19 in magnitude. Non-finite entries count as 0 (the builder
  turns such a step's output into NaN anyway).
  """
  sq = jnp.where(jnp.isfinite(x), x * x, 0.0)
  return jnp.sqrt(segs.sum(sq) / jnp.asarray(segs.sizes, jnp.float32))

