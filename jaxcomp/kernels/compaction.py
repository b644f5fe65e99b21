"""Packed masks and their compaction: from a mask over a bucket to the positions it selects.

A mask over ``n`` entries travels through these kernels as ``ceil(n / 32)``
uint32 words (bit ``i % 32`` of word ``i // 32``): :func:`mask_words` packs
``|x| >= t`` in one fused pass, :func:`pack_mask` any bool mask. Counting is
a population count per word; positions come from :func:`compact`, a prefix
sum over the word counts (:func:`prefix_sum`), one small scatter and a
select-the-q-th-bit per output slot: nothing of size ``n`` is sorted,
scattered or written besides the words.

Per segment of a bucket (:class:`jaxcomp.core.layout.Segments`, segments aligned
to 32 entries so that no word straddles two): :func:`segment_count` and
:func:`segment_word_sum` count, :func:`cap_segments` keeps at most a given
number of set bits per segment (the first in index order, or circularly from
a random word, for methods whose count varies), :func:`compact_segments` does
that and the compaction from one prefix sum, and :func:`segment_of` maps a
position back to its segment. :func:`abs_bits` orders magnitudes as int32 bit
patterns, the form the threshold searches (:mod:`jaxcomp.kernels.selection`,
:mod:`jaxcomp.kernels.segtopk`) bisect on.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.core.layout import Segments

WORD = 32  # entries per packed mask word
INF_BITS = 0x7F800000  # the bit pattern of +inf: larger magnitude patterns are NaN


def _rows(x):
  """``x`` (1-D, length n) as rows of 32 entries, and the tail of ``n % 32`` entries."""
  n = x.shape[0]
  m = n // WORD * WORD
  return x[:m].reshape(-1, WORD), x[m:]


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
  shifts = jnp.arange(WORD, dtype=jnp.uint32)
  parts = [_pack((rows >= t) | (rows <= -t), shifts)] if rows.size else []
  if tail.size:
    parts.append(_pack((tail >= t) | (tail <= -t), shifts[:tail.size])[None])
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def pack_mask(mask: jax.Array) -> jax.Array:
  """Packs a 1-D bool ``mask`` into uint32 words, bit ``i % 32`` of word ``i // 32``."""
  rows, tail = _rows(mask)
  shifts = jnp.arange(WORD, dtype=jnp.uint32)
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
  idx, count = compact(rotated, nw * WORD, capacity)
  row = (idx // WORD + first_word) % nw
  return jnp.where(idx < nw * WORD, row * WORD + idx % WORD, 0), count


def popcount(words):
  return lax.population_count(words).astype(jnp.int32)


def _select_bit(word, q):
  """Position of the ``q``-th (0-based) set bit of each uint32 ``word``."""
  pos = jnp.zeros_like(q)
  for width in (16, 8, 4, 2, 1):
    low = popcount(word & jnp.uint32((1 << width) - 1))
    up = q >= low
    q = jnp.where(up, q - low, q)
    word = jnp.where(up, word >> width, word)
    pos = jnp.where(up, pos + width, pos)
  return pos


def prefix_sum(v: jax.Array, block: int = WORD) -> jax.Array:
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
  return row * WORD + _select_bit(words[row], slot - out[row])


def compact(words: jax.Array, n: int, capacity: int):
  """Positions of the first ``capacity`` set bits of ``words`` (see :func:`mask_words`).

  Returns ``(indices, count)``: int32 ``(capacity,)`` ascending positions with
  ``n`` in unused slots, and the number of used slots ``min(set bits, capacity)``.
  """
  pc = popcount(words)
  incl = prefix_sum(pc)
  excl = incl - pc
  idx = _bit_slots(words, excl, pc, capacity)
  total = incl[-1]
  slot = jnp.arange(capacity, dtype=jnp.int32)
  return jnp.where(slot < total, idx, n), jnp.minimum(total, capacity)



def abs_bits(x: jax.Array) -> jax.Array:
  """The int32 bit pattern of ``|x|`` (monotonic in ``|x|``); NaN counts as 0."""
  b = lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF
  return jnp.where(b > INF_BITS, 0, b)


# ----------------------------------------------------------------------------
# Segments of a bucket, word by word


def _per_word(segs: Segments) -> int:
  if segs.block % WORD:
    raise ValueError(f"segment selection needs segments aligned to {WORD} entries (a block that is a"
                     f" multiple of {WORD}), got block={segs.block}")
  return segs.block // WORD


def segment_words(values: jax.Array, segs: Segments) -> jax.Array:
  """(S,) per-segment values -> one per 32-entry word of the bucket, ``(length // 32,)``."""
  per = _per_word(segs)
  if segs.count == 1:
    return jnp.broadcast_to(values[0], (segs.length // WORD,))
  rows = values[segs.row_segment]
  return jnp.broadcast_to(rows[:, None], (rows.shape[0], per)).reshape(-1)


def run_sums(rows: jax.Array, lengths) -> jax.Array:
  """Sums of consecutive runs of ``lengths`` entries of an int32 vector: (len(lengths),).

  From a prefix sum read at the runs' ends: faster than a segment-sum scatter on XLA:CPU.
  ``lengths`` is static (numpy) or data (a :class:`~jaxcomp.core.tables.SegmentTable`'s, runs
  of length 0 included).
  """
  if np.size(lengths) == 1:
    return jnp.sum(rows, dtype=jnp.int32)[None]
  if isinstance(lengths, (np.ndarray, list, tuple)):
    ends = prefix_sum(rows)[np.cumsum(np.asarray(lengths, np.int64)) - 1]
  else:
    stop = prefix_sum(lengths)
    ends = jnp.where(stop > 0, prefix_sum(rows)[jnp.maximum(stop - 1, 0)], 0)
  return ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])


def _run_lengths(segs) -> object:
  """Each segment's rows of ``block`` entries: numpy for :class:`Segments`, data for a table."""
  if isinstance(segs, Segments):
    return np.asarray(segs.padded_sizes) // segs.block
  return segs.padded_sizes // segs.block


def segment_count(v: jax.Array, segs: Segments) -> jax.Array:
  """Per-segment sums of an int32 vector (a bool mask: counts) over the bucket: (S,).

  A bool mask is packed into words and their bits counted: XLA:CPU writes an
  int32 mask out in full before summing it (4 bytes per entry), the words in
  one fused pass (1 bit per entry).
  """
  v = jnp.asarray(v)
  if v.dtype == jnp.bool_ and segs.block % WORD == 0:
    return segment_word_sum(popcount(pack_mask(v)), segs)
  rows = jnp.sum(segs.rows(jnp.asarray(v, jnp.int32)), axis=1, dtype=jnp.int32)
  return run_sums(rows, _run_lengths(segs))


def segment_word_sum(v: jax.Array, segs: Segments) -> jax.Array:
  """Per-segment sums of a per-word int32 vector ``(length // 32,)``: (S,)."""
  per = _per_word(segs)
  rows = jnp.sum(v.reshape(-1, per), axis=1, dtype=jnp.int32)
  return run_sums(rows, _run_lengths(segs))


def segment_mask_words(x: jax.Array, thresholds: jax.Array, segs: Segments) -> jax.Array:
  """Packs ``|x| >= t_s`` (``t_s`` the threshold of the entry's segment) into uint32 words.

  As :func:`mask_words`, one fused pass; the bucket length is a multiple of 32.
  """
  t = segment_words(jnp.asarray(thresholds, jnp.float32), segs)[:, None]
  rows = x.reshape(-1, WORD)
  return _pack((rows >= t) | (rows <= -t), jnp.arange(WORD, dtype=jnp.uint32))


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
  pc = popcount(words)
  top = _select_bit(words, jnp.minimum(q, pc) - 1)  # the last kept bit, when 0 < q < pc
  partial = words & ((jnp.uint32(2) << top.astype(jnp.uint32)) - 1)
  return jnp.where(q >= pc, words, jnp.where(q <= 0, jnp.uint32(0), partial))


def _word_counts(words: jax.Array, segs: Segments):
  """One prefix sum over a bucket's mask words, read per segment.

  Returns ``(excl, first, nw, base, total)``: set bits before each word, each
  segment's first word and word count (numpy, or data for a table), the set bits
  before each segment and the set bits in it (int32 (S,)).
  """
  pc = popcount(words)
  incl = prefix_sum(pc)
  excl = incl - pc
  if isinstance(segs, Segments):
    first = np.asarray(segs.offsets, np.int64) // WORD
    nw = np.asarray(segs.padded_sizes, np.int64) // WORD
    base = excl[first]
    return excl, first, nw, base, incl[first + nw - 1] - base
  # a table: segments of no words (empty, or the padding of the longest bucket) count 0
  first, nw = segs.offsets // WORD, segs.padded_sizes // WORD
  last = words.shape[0] - 1
  base = jnp.where(first <= last, excl[jnp.minimum(first, last)], incl[last])
  total = jnp.where(nw > 0, incl[jnp.clip(first + nw - 1, 0, last)] - base, 0)
  return excl, first, nw, base, total


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
  q = jnp.clip(segment_words(caps, segs) - rank, 0, WORD)
  return keep_first_bits(words, q), jnp.minimum(total, caps)


class Counted(NamedTuple):
  """A bucket's mask words counted per segment, before any capacity (:func:`count_segments`)."""

  words: jax.Array
  excl: jax.Array  # set bits before each word
  base: jax.Array  # set bits before each segment (int32 (S,))
  total: jax.Array  # set bits in each segment (int32 (S,))
  start: jax.Array | None  # the first word of each segment's circular order, or None (index order)
  before: jax.Array | None  # set bits of each segment before its start word


def count_segments(words: jax.Array, segs: Segments, start_words: jax.Array | None = None) -> Counted:
  """The part of :func:`compact_segments` that no capacity changes: one prefix sum over the words.

  Selections of one mask at several capacities (a warm-up's stages) count it once and compact it
  at each with :func:`compact_counted`.
  """
  _per_word(segs)
  excl, first, nw, base, total = _word_counts(words, segs)
  if start_words is None:
    return Counted(words, excl, base, total, None, None)
  start = jnp.asarray(first, jnp.int32) + start_words.astype(jnp.int32) % jnp.asarray(nw, jnp.int32)
  return Counted(words, excl, base, total, start, excl[start] - base)


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
  return compact_counted(count_segments(words, segs, start_words), segs, caps, capacity)


def compact_counted(counted: Counted, segs: Segments, caps, capacity: int | None = None):
  """:func:`compact_segments` of a mask already counted (:func:`count_segments`)."""
  if capacity is None:
    capacity = int(np.sum(np.asarray(caps)))
  caps = jnp.asarray(caps, jnp.int32)
  words, excl, base, total = counted.words, counted.excl, counted.base, counted.total
  kept = jnp.minimum(total, caps)
  seg_out = exclusive_prefix(kept)  # the segment's first slot
  if counted.start is None:
    base_w, cap_w, out_w = segment_columns((base, caps, seg_out), segs)
    local = excl - base_w  # set bits before each word in its segment
    rank = local
    out = out_w + jnp.minimum(local, cap_w)  # slots before the word's: kept bits before it
  else:
    start, before = counted.start, counted.before
    after = total - before  # bits from the start word on: the first in circular order
    room = jnp.maximum(caps - after, 0)  # slots left for the words before the start word
    base_w, cap_w, out_w, start_w, before_w, after_w, room_w, early_w = segment_columns(
        (base, caps, seg_out, start, before, after, room, jnp.minimum(room, before)), segs)
    local = excl - base_w
    wrapped = jnp.arange(words.shape[0], dtype=jnp.int32) < start_w
    rank = jnp.where(wrapped, local + after_w, local - before_w)
    out = out_w + jnp.where(wrapped, jnp.minimum(local, room_w),
                            early_w + jnp.minimum(local - before_w, cap_w))
  keep = jnp.minimum(jnp.clip(cap_w - rank, 0, WORD), popcount(words))
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
