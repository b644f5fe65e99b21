"""Top-k selection without a sort: RedSync's threshold binary search and trimmed top-k.

Both search for a magnitude threshold ``t`` such that between ``k`` and a fixed
``capacity`` entries satisfy ``|x| >= t``, then compact those entries into a
buffer of that capacity (XLA needs static shapes). Every search step is one
pass over ``x`` that packs the mask ``|x| >= t`` into 32-bit words and counts
their bits; the compaction works on the words (a prefix sum over ``n / 32``
row counts, one small scatter and a select-the-q-th-bit per output slot), so
nothing of size ``n`` is sorted, scattered or written besides the words.

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
the one-segment case. :func:`cap_segments` keeps at most a given number of
set bits per segment (circularly from a random word, for threshold methods
whose count varies).

NaN entries are never selected; subnormal magnitudes count as 0 (XLA flushes
them). Ties are resolved towards lower indices, as ``lax.top_k`` and a stable
``argsort`` do.

References:
  Fang, Fu, Yang & Hsieh, *RedSync: Reducing Synchronization Traffic for
  Distributed Deep Learning*, arXiv:1808.04357 (trimmed top-k and threshold
  binary search selection; details recalled, not taken from its code).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.layout import Segments

_WORD = 32
_VALUE_STEPS = 40  # then bisect the float bit pattern: collapse within 31 more steps
_INF_BITS = 0x7F800000
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


def _rows(x):
  """``x`` (1-D, length n) as rows of 32 entries, and the tail of ``n % 32`` entries."""
  n = x.shape[0]
  m = n // _WORD * _WORD
  return x[:m].reshape(-1, _WORD), x[m:]


def _pack(bits, shifts):
  return jnp.sum(bits.astype(jnp.uint32) << shifts, axis=-1, dtype=jnp.uint32)


def mask_words(x: jax.Array, threshold: jax.Array) -> jax.Array:
  """Packs ``|x| >= threshold`` into uint32 words, bit ``i % 32`` of word ``i // 32``.

  One fused pass over ``x`` (1-D, length n); returns ``ceil(n / 32)`` words.
  Written with two compares and per-row shifts so that nothing of size n is
  loop-invariant (XLA would hoist it out of a search loop and write it out).
  """
  t = jnp.asarray(threshold, jnp.float32)
  rows, tail = _rows(x)
  shifts = jnp.arange(_WORD, dtype=jnp.uint32)
  parts = [_pack((rows >= t) | (rows <= -t), shifts)] if rows.size else []
  if tail.size:
    parts.append(_pack((tail >= t) | (tail <= -t), shifts[:tail.size])[None])
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def pack_mask(mask: jax.Array) -> jax.Array:
  """Packs a 1-D bool ``mask`` into uint32 words, bit ``i % 32`` of word ``i // 32``."""
  rows, tail = _rows(mask)
  shifts = jnp.arange(_WORD, dtype=jnp.uint32)
  parts = [_pack(rows, shifts)] if rows.size else []
  if tail.size:
    parts.append(_pack(tail, shifts[:tail.size])[None])
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def compact_from_word(words: jax.Array, capacity: int, first_word: jax.Array):
  """The first ``capacity`` set bits of ``words`` in circular order from word ``first_word``.

  Returns ``(indices, count)``: int32 ``(capacity,)`` positions (0 in unused
  slots) and ``min(set bits, capacity)``. Only the ``ceil(n / 32)`` words are
  rotated and scanned; nothing of size n is scattered.
  """
  nw = words.shape[0]
  first_word = first_word.astype(jnp.int32) % nw
  rotated = jnp.roll(words, -first_word)
  idx, count = compact(rotated, nw * _WORD, capacity)
  row = (idx // _WORD + first_word) % nw
  return jnp.where(idx < nw * _WORD, row * _WORD + idx % _WORD, 0), count


def _popcount(words):
  return lax.population_count(words).astype(jnp.int32)


def _select_bit(word, q):
  """Position of the ``q``-th (0-based) set bit of each uint32 ``word``."""
  pos = jnp.zeros_like(q)
  for width in (16, 8, 4, 2, 1):
    low = _popcount(word & jnp.uint32((1 << width) - 1))
    up = q >= low
    q = jnp.where(up, q - low, q)
    word = jnp.where(up, word >> width, word)
    pos = jnp.where(up, pos + width, pos)
  return pos


def prefix_sum(v: jax.Array, block: int = _WORD) -> jax.Array:
  """Inclusive prefix sums of an int32 vector, by small triangular integer matrix products.

  Rows of ``block`` entries are summed by a product with a triangular matrix,
  their totals recursively (rows of 256), up to 256 entries by one product.
  On XLA:CPU this compiles in about half the time of ``jnp.cumsum`` (a
  reduce-window, rewritten into a dozen kernels) and runs faster; it is
  exact (integer arithmetic). Other backends scan natively: ``jnp.cumsum``.
  """
  v = jnp.asarray(v, jnp.int32)
  n = v.shape[0]
  if jax.default_backend() != "cpu":
    return jnp.cumsum(v, dtype=jnp.int32)
  if n <= 256:
    return lax.dot(jnp.asarray(np.tril(np.ones((n, n), np.int32))), v)
  m = -(-n // block) * block
  rows = (jnp.pad(v, (0, m - n)) if m > n else v).reshape(-1, block)
  inner = lax.dot(rows, jnp.asarray(np.triu(np.ones((block, block), np.int32))))
  totals = inner[:, -1]
  out = inner + (prefix_sum(totals, 256) - totals)[:, None]
  return out.reshape(-1)[:n]


def exclusive_prefix(v: jax.Array) -> jax.Array:
  """Exclusive prefix sums of an int32 vector (e.g. per-segment counts)."""
  v = jnp.asarray(v, jnp.int32)
  return prefix_sum(v) - v


def _bit_slots(words: jax.Array, out: jax.Array, keep: jax.Array, capacity: int) -> jax.Array:
  """Slots ``out[w] .. out[w] + keep[w] - 1`` hold the positions of the first ``keep[w]`` set bits of word w.

  ``out`` must be nondecreasing over the words with ``keep > 0`` and their
  ranges contiguous from slot 0. Each slot finds its word from a prefix sum of
  +w / -w marks at the ranges' ends (no n-sized scatter, no max-scan), then
  its bit by :func:`_select_bit`. Slots past the last range hold garbage.
  """
  rows = jnp.arange(words.shape[0], dtype=jnp.int32)
  kept = keep > 0
  start = jnp.where(kept & (out < capacity), out, capacity)
  end = jnp.where(kept, jnp.minimum(out + keep, capacity), capacity)
  marks = jnp.zeros((capacity + 1,), jnp.int32).at[jnp.concatenate([start, end])].add(
      jnp.concatenate([rows, -rows]), mode="drop")
  row = prefix_sum(marks[:capacity])
  slot = jnp.arange(capacity, dtype=jnp.int32)
  return row * _WORD + _select_bit(words[row], slot - out[row])


def compact(words: jax.Array, n: int, capacity: int):
  """Positions of the first ``capacity`` set bits of ``words`` (see :func:`mask_words`).

  Returns ``(indices, count)``: int32 ``(capacity,)`` ascending positions with
  ``n`` in unused slots, and the number of used slots ``min(set bits, capacity)``.
  """
  pc = _popcount(words)
  incl = prefix_sum(pc)
  excl = incl - pc
  idx = _bit_slots(words, excl, pc, capacity)
  total = incl[-1]
  slot = jnp.arange(capacity, dtype=jnp.int32)
  return jnp.where(slot < total, idx, n), jnp.minimum(total, capacity)


def _abs_bits(x):
  """The bit pattern of ``|x|`` as int32 (monotonic in ``|x|``); NaN counts as 0."""
  b = lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF
  return jnp.where(b > _INF_BITS, 0, b)


# ----------------------------------------------------------------------------
# Segments of a bucket, word by word


def _per_word(segs: Segments) -> int:
  if segs.block % _WORD:
    raise ValueError(f"segment selection needs segments aligned to {_WORD} entries (a block that is a"
                     f" multiple of {_WORD}), got block={segs.block}")
  return segs.block // _WORD


def segment_words(values: jax.Array, segs: Segments) -> jax.Array:
  """(S,) per-segment values -> one per 32-entry word of the bucket, ``(length // 32,)``."""
  per = _per_word(segs)
  if segs.count == 1:
    return jnp.broadcast_to(values[0], (segs.length // _WORD,))
  rows = values[segs.row_segment]
  return jnp.broadcast_to(rows[:, None], (rows.shape[0], per)).reshape(-1)


def run_sums(rows: jax.Array, lengths) -> jax.Array:
  """Sums of consecutive runs of ``lengths`` (static) entries of an int32 vector: (len(lengths),).

  From a prefix sum read at the runs' ends: faster than a segment-sum scatter on XLA:CPU.
  """
  lengths = np.asarray(lengths, np.int64)
  if lengths.size == 1:
    return jnp.sum(rows, dtype=jnp.int32)[None]
  ends = prefix_sum(rows)[np.cumsum(lengths) - 1]
  return ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])


def segment_count(v: jax.Array, segs: Segments) -> jax.Array:
  """Per-segment sums of an int32 vector (a 0/1 mask: counts) over the bucket: (S,)."""
  rows = jnp.sum(segs.rows(jnp.asarray(v, jnp.int32)), axis=1, dtype=jnp.int32)
  return run_sums(rows, np.asarray(segs.padded_sizes) // segs.block)


def segment_word_sum(v: jax.Array, segs: Segments) -> jax.Array:
  """Per-segment sums of a per-word int32 vector ``(length // 32,)``: (S,)."""
  per = _per_word(segs)
  rows = jnp.sum(v.reshape(-1, per), axis=1, dtype=jnp.int32)
  return run_sums(rows, np.asarray(segs.padded_sizes) // segs.block)


def segment_mask_words(x: jax.Array, thresholds: jax.Array, segs: Segments) -> jax.Array:
  """Packs ``|x| >= t_s`` (``t_s`` the threshold of the entry's segment) into uint32 words.

  As :func:`mask_words`, one fused pass; the bucket length is a multiple of 32.
  """
  t = segment_words(jnp.asarray(thresholds, jnp.float32), segs)[:, None]
  rows = x.reshape(-1, _WORD)
  return _pack((rows >= t) | (rows <= -t), jnp.arange(_WORD, dtype=jnp.uint32))


def segment_columns(columns, segs: Segments) -> list:
  """Several (S,) int32 per-segment vectors spread to words (``length // 32`` each) by one gather."""
  per = _per_word(segs)
  table = jnp.stack([jnp.asarray(c, jnp.int32) for c in columns], axis=1)
  rows = table[0][None, :] if segs.count == 1 else table[segs.row_segment]
  if segs.count == 1:
    rows = jnp.broadcast_to(rows, (segs.length // segs.block, table.shape[1]))
  return [jnp.broadcast_to(rows[:, j:j + 1], (rows.shape[0], per)).reshape(-1) for j in range(table.shape[1])]


def keep_first_bits(words: jax.Array, q: jax.Array) -> jax.Array:
  """Keeps the first ``q`` set bits (in index order) of each word (``q`` per word, int32)."""
  pc = _popcount(words)
  top = _select_bit(words, jnp.minimum(q, pc) - 1)  # the last kept bit, when 0 < q < pc
  partial = words & ((jnp.uint32(2) << top.astype(jnp.uint32)) - 1)
  return jnp.where(q >= pc, words, jnp.where(q <= 0, jnp.uint32(0), partial))


def _word_counts(words: jax.Array, segs: Segments):
  """One prefix sum over a bucket's mask words, read per segment.

  Returns ``(excl, first, nw, base, total)``: set bits before each word, each
  segment's first word and word count (numpy), the set bits before each
  segment and the set bits in it (int32 (S,)).
  """
  pc = _popcount(words)
  incl = prefix_sum(pc)
  excl = incl - pc
  first = np.asarray(segs.offsets, np.int64) // _WORD
  nw = np.asarray(segs.padded_sizes, np.int64) // _WORD
  base = excl[first]
  return excl, first, nw, base, incl[first + nw - 1] - base


def cap_segments(words: jax.Array, segs: Segments, caps, start_words: jax.Array | None = None):
  """Keeps at most ``caps[s]`` set bits of each segment ``s`` of a bucket's mask words.

  The bits kept are the first in index order, or, with ``start_words``, the
  first in circular order from word ``start_words[s] % words(s)`` of the
  segment (a random start each step starves no region of a leaf). One prefix
  sum over the words, nothing of the bucket's size. Returns the words and the
  number of bits kept per segment (int32 (S,)).
  """
  _per_word(segs)
  caps = jnp.asarray(caps, jnp.int32)
  excl, first, nw, base, total = _word_counts(words, segs)
  rank = excl - segment_words(base, segs)
  if start_words is not None:
    start = jnp.asarray(first, jnp.int32) + start_words.astype(jnp.int32) % jnp.asarray(nw, jnp.int32)
    before = excl[start] - base
    wrapped = jnp.arange(words.shape[0], dtype=jnp.int32) < segment_words(start, segs)
    rank = rank - segment_words(before, segs) + jnp.where(wrapped, segment_words(total, segs), 0)
  q = jnp.clip(segment_words(caps, segs) - rank, 0, _WORD)
  return keep_first_bits(words, q), jnp.minimum(total, caps)


def compact_segments(words: jax.Array, segs: Segments, caps, capacity: int | None = None,
                     start_words: jax.Array | None = None):
  """:func:`cap_segments` then :func:`compact`, from one prefix sum over the words.

  Keeps at most ``caps[s]`` set bits of each segment (the first in index
  order, or in circular order from ``start_words`` as in :func:`cap_segments`)
  and returns their positions: ``(indices int32[capacity], count, kept)``,
  ascending bucket positions with ``segs.length`` in unused slots, the number
  of used slots and the bits kept per segment (int32 (S,)). ``capacity``
  (static) defaults to ``sum(caps)``, which must then be static.
  """
  _per_word(segs)
  if capacity is None:
    capacity = int(np.sum(np.asarray(caps)))
  caps = jnp.asarray(caps, jnp.int32)
  excl, first, nw, base, total = _word_counts(words, segs)
  kept = jnp.minimum(total, caps)
  seg_out = exclusive_prefix(kept)  # the segment's first slot
  if start_words is None:
    base_w, cap_w, out_w = segment_columns((base, caps, seg_out), segs)
    local = excl - base_w  # set bits before each word in its segment
    rank = local
    out = out_w + jnp.minimum(local, cap_w)  # slots before the word's: kept bits before it
  else:
    start = jnp.asarray(first, jnp.int32) + start_words.astype(jnp.int32) % jnp.asarray(nw, jnp.int32)
    before = excl[start] - base
    after = total - before  # bits from the start word on: the first in circular order
    room = jnp.maximum(caps - after, 0)  # slots left for the words before the start word
    base_w, cap_w, out_w, start_w, before_w, after_w, room_w, early_w = segment_columns(
        (base, caps, seg_out, start, before, after, room, jnp.minimum(room, before)), segs)
    local = excl - base_w
    wrapped = jnp.arange(words.shape[0], dtype=jnp.int32) < start_w
    rank = jnp.where(wrapped, local + after_w, local - before_w)
    out = out_w + jnp.where(wrapped, jnp.minimum(local, room_w),
                            early_w + jnp.minimum(local - before_w, cap_w))
  keep = jnp.minimum(jnp.clip(cap_w - rank, 0, _WORD), _popcount(words))
  idx = _bit_slots(words, out, keep, capacity)
  slot = jnp.arange(capacity, dtype=jnp.int32)
  count = jnp.sum(kept)
  return jnp.where(slot < count, idx, segs.length), count, kept


def segment_of(positions: jax.Array, segs: Segments) -> jax.Array:
  """The segment (int32) of each bucket position (positions past the bucket: the last segment)."""
  if segs.count == 1:
    return jnp.zeros(positions.shape, jnp.int32)
  row = jnp.minimum(positions.astype(jnp.int32) // segs.block, segs.length // segs.block - 1)
  return jnp.asarray(segs.row_segment)[row]


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
  top = segs.max(_abs_bits(x))
  hi0 = top + 1
  guess0 = _bits(first_guess)
  guess0 = jnp.where((guess0 > 0) & (guess0 < hi0), guess0, _bits(_float(top) * 0.5))
  guess0 = jnp.where(full, 0, guess0)

  def count(words):
    return segment_word_sum(_popcount(words), segs)

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
    hi_v = jnp.minimum(_float(jnp.minimum(hi, _INF_BITS)), _MAX_FINITE)
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
  top = _float(segs.max(_abs_bits(xs)))

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
  key = -_abs_bits(xs[jnp.minimum(idx, n - 1)])
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
  segs = Segments((0,), (n,), ((n,),), _WORD)
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
