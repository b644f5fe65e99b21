"""Top-k selection without a sort: RedSync's threshold binary search and trimmed top-k.

Both search for a magnitude threshold ``t`` such that between ``k`` and a fixed
``capacity`` entries satisfy ``|x| >= t``, then compact those entries into a
buffer of that capacity (XLA needs static shapes). Every search step is one
pass over ``x`` that packs the mask ``|x| >= t`` into 32-bit words and counts
their bits; the compaction works on the words (:mod:`jaxcomp.kernels.compaction`:
a prefix sum over ``n / 32`` row counts, one small scatter and a
select-the-q-th-bit per output slot), so nothing of size ``n`` is sorted,
scattered or written besides the words.

- :func:`threshold_binary_search` stops as soon as ``k <= count <= capacity``
  (``capacity = 2k`` by default) and returns those entries: no exact top-k.
  A threshold from the previous step (carried in an optimizer state) is the
  first guess, so a slowly changing gradient needs a single pass.
- :func:`trimmed_topk` lowers ``t = mean|x| + r * (max|x| - mean|x|)`` with
  ``r = 1 - step, 1 - 2 step, ...`` until at least ``k`` entries survive
  (bisecting back if more than ``capacity`` do), then sorts the compacted
  survivors only: the exact top-k of ``x``.

Both run on every segment of a bucket at once (:func:`segment_binary_search`,
:func:`segment_trimmed_topk`): each segment keeps its own ``k``, capacity and
threshold, all segments iterate together (a segment that has found its
threshold keeps it), counts are per-segment sums of the words' bit counts, and
one compaction of the bucket's words serves all. The one-vector functions are
the one-segment case.

NaN entries are never selected; subnormal magnitudes count as 0 (XLA flushes
them). Ties are resolved towards lower indices, as ``lax.top_k`` and a stable
``argsort`` do.

References:
  Fang, Fu, Yang & Hsieh, *RedSync: Reducing Synchronization Traffic for
  Distributed Deep Learning*, arXiv:1808.04357 (trimmed top-k and threshold
  binary search selection; written from the paper's description, not from its code).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.core.layout import Segments
from jaxcomp.kernels.compaction import (
  INF_BITS,
  WORD,
  abs_bits,
  cap_segments,
  compact,
  exclusive_prefix,
  popcount,
  segment_mask_words,
  segment_of,
  segment_word_sum,
  segment_words,
)

_VALUE_STEPS = 40  # then bisect the float bit pattern: collapse within 31 more steps
_MIN_NORMAL_BITS = 0x00800000
_MAX_FINITE = float(jnp.finfo(jnp.float32).max)


class Selection(NamedTuple):
  """The result of a selection over a vector of length n.

  Attributes:
    indices: int32 ``(capacity,)`` positions; unused slots hold ``n``.
      Ascending for :func:`threshold_binary_search`; by decreasing magnitude
      for :func:`trimmed_topk`.
    count: int32 number of used slots.
    threshold: float32 magnitude threshold of the search (every selected
      entry has ``|x| >= threshold`` unless ties at it were cut).
  """

  indices: jax.Array
  count: jax.Array
  threshold: jax.Array


def _bits(t):
  return lax.bitcast_convert_type(jnp.asarray(t, jnp.float32), jnp.int32)


def _float(b):
  return lax.bitcast_convert_type(b.astype(jnp.int32), jnp.float32)


def _unpadded(x: jax.Array, segs: Segments) -> jax.Array:
  """``x`` with NaN in the padding: NaN is never selected and counts as 0 in a maximum."""
  x = jnp.asarray(x, jnp.float32)
  return jnp.where(segs.valid(), x, jnp.nan) if segs.has_pads else x


def _segment_search(x, segs, k, capacity, first_guess, descend, full):
  """Per segment, ``t`` with ``k <= count(|x| >= t) <= capacity``; the words of the selection.

  All segments search together, each with its own bracket ``[lo, hi)`` on the
  float bit pattern, which keeps ``count(lo) > capacity`` (or ``lo = 0``) and
  ``count(hi) < k``. Until a guess overshoots, ``descend`` gives the next
  guess; then value midpoints; after ``_VALUE_STEPS`` steps, bit-pattern
  midpoints, which collapse the bracket to adjacent floats. Each step is one
  pass over the bucket for every segment still searching (a segment found
  keeps its guess, so each segment follows exactly the steps it would take
  alone). A collapsed bracket means ties at ``lo``: the segment's selection
  is every entry ``>= hi`` plus the first tied entries. ``full`` segments
  (capacity >= size) take every entry that is not NaN (``t = 0``).
  ``x`` holds NaN in the padding.
  """
  k = jnp.asarray(k, jnp.int32)
  capacity = jnp.asarray(capacity, jnp.int32)
  full = jnp.asarray(full)
  top = segs.max(abs_bits(x))
  hi0 = top + 1
  guess0 = _bits(first_guess)
  guess0 = jnp.where((guess0 > 0) & (guess0 < hi0), guess0, _bits(_float(top) * 0.5))
  guess0 = jnp.where(full, 0, guess0)

  def count(words):
    return segment_word_sum(popcount(words), segs)

  def evaluate(it, lo, hi, t):
    words = segment_mask_words(x, _float(t), segs)
    c = count(words)
    return it, jnp.where(c > capacity, t, lo), jnp.where(c < k, t, hi), t, c, words

  def searching(lo, hi, c):
    return ~full & ~((c >= k) & (c <= capacity)) & (hi - lo > 1)

  def cond(s):
    it, lo, hi, _, c, _ = s
    return jnp.any(searching(lo, hi, c)) & (it < _VALUE_STEPS + 34)

  def body(s):
    it, lo, hi, t, c, _ = s
    lo_v = _float(lo)
    hi_v = jnp.minimum(_float(jnp.minimum(hi, INF_BITS)), _MAX_FINITE)
    value_mid = _bits(lo_v + (hi_v - lo_v) * 0.5)
    value_mid = jnp.where(lo == 0, descend(it, value_mid, hi), value_mid)
    mid = jnp.where(it < _VALUE_STEPS, value_mid, lo + (hi - lo) // 2)
    t = jnp.where(searching(lo, hi, c), jnp.clip(mid, lo + 1, hi - 1), t)
    return evaluate(it + 1, lo, hi, t)

  zero = jnp.zeros((segs.count,), jnp.int32)
  _, lo, hi, t, c, words = lax.while_loop(cond, body, evaluate(jnp.zeros((), jnp.int32), zero, hi0, guess0))
  in_range = full | ((c >= k) & (c <= capacity))

  def with_ties(words):
    strict = segment_mask_words(x, _float(hi), segs)
    ties = segment_mask_words(x, _float(lo), segs) & ~strict
    kept, _ = cap_segments(ties, segs, capacity - count(strict))
    return jnp.where(segment_words(in_range, segs), words, strict | kept)

  words = lax.cond(jnp.all(in_range), lambda w: w, with_ties, words)
  found = jnp.where(in_range, t, lo)
  # XLA flushes subnormals to zero: a subnormal threshold acts as 0.
  return words, _float(jnp.where(found < _MIN_NORMAL_BITS, 0, found))


def _segment_counts(segs: Segments, k, capacity):
  """Static per-segment k, capacities (at most the sizes) and which segments take every entry."""
  sizes = np.asarray(segs.sizes, np.int64)
  k = np.broadcast_to(np.asarray(k, np.int64), sizes.shape)
  if np.any(k < 1) or np.any(k > sizes):
    raise ValueError(f"k must be in [1, segment size] for every segment, got k={k.tolist()} for"
                     f" sizes {sizes.tolist()}")
  capacity = 2 * k if capacity is None else np.broadcast_to(np.asarray(capacity, np.int64), sizes.shape)
  if np.any(capacity < k):
    raise ValueError(f"capacity must be >= k for every segment, got capacity={capacity.tolist()},"
                     f" k={k.tolist()}")
  capacity = np.minimum(capacity, sizes)
  return k, capacity, capacity >= sizes


def segment_binary_search(x: jax.Array, segs: Segments, k, capacity=None,
                          threshold: jax.Array | None = None) -> Selection:
  """:func:`threshold_binary_search` of every segment of a bucket at once.

  Args:
    x: the bucket, float32 ``(segs.length,)``; ``segs.block`` a multiple of 32.
    segs: its segments.
    k: the least number of entries wanted per segment (int or ``(S,)`` ints).
    capacity: the most entries per segment (default ``2 k``, at most the size).
    threshold: first guesses, float32 ``(S,)`` (the previous step's thresholds).

  Returns:
    A :class:`Selection`: ``indices`` int32 ``(sum of capacities,)``,
    ascending bucket positions with ``segs.length`` in unused slots; ``count``
    the used slots; ``threshold`` float32 ``(S,)``, the ones to carry.
  """
  k, capacity, full = _segment_counts(segs, k, capacity)
  first = jnp.zeros((segs.count,), jnp.float32) if threshold is None else jnp.asarray(threshold, jnp.float32)
  words, thr = _segment_search(_unpadded(x, segs), segs, k, capacity, first,
                               lambda it, mid, hi: mid, full)
  idx, used = compact(words, segs.length, int(capacity.sum()))
  return Selection(idx, used, thr)


def segment_search_stages(x: jax.Array, segs: Segments, ks, index, threshold: jax.Array | None = None):
  """The search of :func:`segment_binary_search` for one of several stages' ``ks``.

  ``ks``: each stage's k per segment (capacity ``2 k``, at most the size);
  ``index`` (traced) picks the stage, whose k, capacity and full segments
  are data, so the stages share one search. Returns ``(words, thresholds,
  capacities)``: the selection's words, float32 ``(S,)`` thresholds and each
  stage's total capacity (ints), for :func:`jaxcomp.kernels.compaction.compact`.
  """
  stages = [_segment_counts(segs, k, None) for k in ks]
  k, capacity, full = (jnp.asarray(np.stack(a))[index] for a in zip(*stages))
  first = jnp.zeros((segs.count,), jnp.float32) if threshold is None else jnp.asarray(threshold, jnp.float32)
  words, thr = _segment_search(_unpadded(x, segs), segs, k, capacity, first,
                               lambda it, mid, hi: mid, full)
  return words, thr, [int(c.sum()) for _, c, _ in stages]


def segment_trimmed_topk(x: jax.Array, segs: Segments, k, step: float = 0.1, capacity=None) -> Selection:
  """:func:`trimmed_topk` of every segment of a bucket at once: the exact top-``k_s`` of each.

  The survivors of every segment's trimmed search are compacted into one
  buffer (``sum of capacities``, default ``2 k``) and sorted once by
  (segment, decreasing magnitude), ties to lower positions.

  Returns:
    A :class:`Selection` of ``sum(k)`` slots: segment by segment, ``k_s``
    bucket positions in decreasing magnitude (``segs.length`` in slots left
    empty, only when fewer than ``k_s`` entries are not NaN).
  """
  if not 0.0 < step <= 1.0:
    raise ValueError(f"step must be in (0, 1], got step={step!r}")
  k, capacity, full = _segment_counts(segs, k, capacity)
  x = jnp.asarray(x, jnp.float32)
  xs = _unpadded(x, segs)
  mean = segs.sum(jnp.abs(x)) / jnp.asarray(segs.sizes, jnp.float32)
  mean = jnp.where(jnp.isfinite(mean), mean, 0.0)  # NaN/Inf entries: start from 0
  top = _float(segs.max(abs_bits(xs)))

  def trimmed(r):
    return jnp.maximum(mean + r * (top - mean), 0.0)

  def descend(it, mid, hi):
    t = trimmed(1.0 - step * (it + 2))
    return jnp.where(jnp.isfinite(t) & (_bits(t) < hi), _bits(t), mid)

  words, thr = _segment_search(xs, segs, k, capacity, trimmed(1.0 - step), descend, full)
  n = segs.length
  idx, _ = compact(words, n, int(capacity.sum()))
  valid = idx < n
  seg = jnp.where(valid, segment_of(idx, segs), segs.count)
  key = -abs_bits(xs[jnp.minimum(idx, n - 1)])
  seg, _, idx = lax.sort((seg, key, idx), num_keys=2, is_stable=True)
  per = jax.ops.segment_sum(valid.astype(jnp.int32), seg, segs.count + 1, indices_are_sorted=True)[:-1]
  start = exclusive_prefix(per)
  slot_seg = np.repeat(np.arange(segs.count, dtype=np.int32), k)
  slot_rank = np.arange(slot_seg.size, dtype=np.int32) - np.repeat(np.cumsum(k) - k, k).astype(np.int32)
  ok = slot_rank < per[slot_seg]
  out = jnp.where(ok, idx[jnp.minimum(start[slot_seg] + slot_rank, idx.shape[0] - 1)], n)
  return Selection(out, jnp.sum(jnp.minimum(per, jnp.asarray(k, jnp.int32))), thr)


# ----------------------------------------------------------------------------
# One vector


def _check(x, k, capacity):
  if x.ndim != 1:
    raise ValueError(f"x must be a 1-D vector (vmap for batches), got shape {x.shape}")
  n = x.shape[0]
  if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
    raise ValueError(f"k must be an int in [1, n={n}], got k={k!r}")
  if capacity is None:
    capacity = 2 * k
  if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < k:
    raise ValueError(f"capacity must be an int >= k={k}, got capacity={capacity!r}")
  return n, min(capacity, n)


def _one(x):
  """A vector as a bucket of one segment (padded to 32 entries)."""
  n = x.shape[0]
  segs = Segments((0,), (n,), ((n,),), WORD)
  x = jnp.asarray(x, jnp.float32)
  return (jnp.pad(x, (0, segs.length - n)) if segs.length > n else x), segs


def threshold_binary_search(x: jax.Array, k: int, capacity: int | None = None,
                            threshold: jax.Array | None = None) -> Selection:
  """RedSync's threshold binary search: between ``k`` and ``capacity`` largest ``|x|``.

  Bisects a threshold until ``k <= count(|x| >= t) <= capacity`` and returns
  the positions of those entries in ascending order. Every selected entry is
  at least as large in magnitude as every entry left out. When ties make the
  window unreachable (the count jumps past ``capacity`` between two adjacent
  floats) the result is every entry above the tie plus the first tied ones,
  ``capacity`` in all. Fewer than ``k`` only if fewer than ``k`` are not NaN.
  A bucket's segments all at once: :func:`segment_binary_search`.

  Args:
    x: a 1-D float vector (``jax.vmap`` this function for a batch).
    k: the least number of entries wanted, ``1 <= k <= n``.
    capacity: the most entries returned (the buffer size); default ``2 k``.
    threshold: a first guess, e.g. the ``threshold`` of the previous step's
      selection; ignored unless ``0 < threshold < max|x|``.

  Returns:
    A :class:`Selection`; its ``threshold`` is the one to carry to the next step.
  """
  n, capacity = _check(x, k, capacity)
  xb, segs = _one(x)
  first = None if threshold is None else jnp.reshape(jnp.asarray(threshold, jnp.float32), (1,))
  sel = segment_binary_search(xb, segs, k, capacity, first)
  return Selection(jnp.minimum(sel.indices, n), sel.count, sel.threshold[0])


def trimmed_topk(x: jax.Array, k: int, step: float = 0.1,
                 capacity: int | None = None) -> Selection:
  """RedSync's trimmed top-k: the exact ``k`` largest ``|x|``, sorting only survivors.

  The threshold ``mean|x| + r (max|x| - mean|x|)`` is lowered with
  ``r = 1 - step, 1 - 2 step, ...`` (below ``mean|x|`` down to 0 if needed)
  until at least ``k`` entries pass; if more than ``capacity`` pass, the last
  two thresholds are bisected. The survivors are compacted into a buffer of
  ``capacity`` entries and sorted there. Equal magnitudes go to the lower
  index, as in ``numpy.argsort(-|x|, kind="stable")``. A bucket's segments
  all at once: :func:`segment_trimmed_topk`.

  Args:
    x: a 1-D float vector (``jax.vmap`` this function for a batch).
    k: the number of entries, ``1 <= k <= n``.
    step: how much ``r`` is lowered per pass, in (0, 1].
    capacity: the survivor buffer (>= k); default ``2 k``.

  Returns:
    A :class:`Selection` of ``k`` slots in decreasing magnitude (``count`` < k
    only if fewer than k entries are not NaN).
  """
  n, capacity = _check(x, k, capacity)
  if not 0.0 < step <= 1.0:
    raise ValueError(f"step must be in (0, 1], got step={step!r}")
  xb, segs = _one(x)
  sel = segment_trimmed_topk(xb, segs, k, step, capacity)
  return Selection(jnp.minimum(sel.indices, n), sel.count, sel.threshold[0])
