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
  (bisecting back if more than ``capacity`` do), then runs ``lax.top_k`` on
  the compacted survivors only: the exact top-k of ``x``.

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
from jax import lax

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


def _by_rows(v, reduce):
  """``reduce`` of a 1-D ``v``, first over rows of 32 entries, then over the row results.

  A one-shot reduction of a long vector becomes a tree of reduce-windows on
  XLA:CPU that writes an n-sized temporary; rows keep it one fused pass.
  """
  rows, tail = _rows(v)
  parts = [reduce(rows, axis=1)] if rows.size else []
  if tail.size:
    parts.append(reduce(tail, axis=0)[None])
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


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


def _keep_first(words, m):
  """Clears all but the first ``m`` set bits (in index order) of ``words``."""
  pc = _popcount(words)
  before = jnp.cumsum(pc) - pc
  q = jnp.clip(m - before, 0, _WORD)
  top = _select_bit(words, jnp.minimum(q, pc) - 1)  # the last kept bit, when 0 < q < pc
  partial = words & ((jnp.uint32(2) << top.astype(jnp.uint32)) - 1)
  return jnp.where(q >= pc, words, jnp.where(q <= 0, jnp.uint32(0), partial))


def compact(words: jax.Array, n: int, capacity: int):
  """Positions of the first ``capacity`` set bits of ``words`` (see :func:`mask_words`).

  Returns ``(indices, count)``: int32 ``(capacity,)`` ascending positions with
  ``n`` in unused slots, and the number of used slots ``min(set bits, capacity)``.
  """
  pc = _popcount(words)
  incl = jnp.cumsum(pc)
  excl = incl - pc
  rows = jnp.arange(words.shape[0], dtype=jnp.int32)
  start = jnp.zeros((capacity,), jnp.int32).at[jnp.where(pc > 0, excl, capacity)].max(rows, mode="drop")
  row = lax.cummax(start)
  slot = jnp.arange(capacity, dtype=jnp.int32)
  idx = row * _WORD + _select_bit(words[row], slot - excl[row])
  total = incl[-1]
  return jnp.where(slot < total, idx, n), jnp.minimum(total, capacity)


def _abs_bits(x):
  """The bit pattern of ``|x|`` as int32 (monotonic in ``|x|``); NaN counts as 0."""
  b = lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF
  return jnp.where(b > _INF_BITS, 0, b)


def _total(v, reduce):
  """``reduce`` of an integer vector by rows, kept apart from the final reduction."""
  return reduce(lax.optimization_barrier(_by_rows(v, reduce)))


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


def _search(x, k, capacity, first_guess, descend):
  """Finds ``t`` with ``k <= count(|x| >= t) <= capacity`` and compacts those entries.

  The bracket ``[lo, hi)`` on the float bit pattern keeps ``count(lo) > capacity``
  (or ``lo = 0``) and ``count(hi) < k``. Until a guess overshoots, ``descend``
  gives the next guess; then value midpoints; after ``_VALUE_STEPS`` steps,
  bit-pattern midpoints, which collapse the bracket to adjacent floats. A collapsed bracket means ties
  at ``lo``: the result is every entry ``>= hi`` plus the first tied entries.
  """
  n = x.shape[0]
  top = _total(_abs_bits(x), jnp.max)
  hi0 = top + 1
  guess0 = _bits(first_guess)
  guess0 = jnp.where((guess0 > 0) & (guess0 < hi0), guess0, _bits(_float(top) * 0.5))

  def count(words):
    return jnp.sum(_popcount(words))

  def evaluate(it, lo, hi, t):
    words = mask_words(x, _float(t))
    c = count(words)
    return it, jnp.where(c > capacity, t, lo), jnp.where(c < k, t, hi), t, c, words

  def cond(s):
    it, lo, hi, _, c, _ = s
    found = (c >= k) & (c <= capacity)
    return ~found & (hi - lo > 1) & (it < _VALUE_STEPS + 34)

  def body(s):
    it, lo, hi, *_ = s
    lo_v = _float(lo)
    hi_v = jnp.minimum(_float(jnp.minimum(hi, _INF_BITS)), _MAX_FINITE)
    value_mid = _bits(lo_v + (hi_v - lo_v) * 0.5)
    value_mid = jnp.where(lo == 0, descend(it, value_mid, hi), value_mid)
    mid = jnp.where(it < _VALUE_STEPS, value_mid, lo + (hi - lo) // 2)
    return evaluate(it + 1, lo, hi, jnp.clip(mid, lo + 1, hi - 1))

  zero = jnp.zeros((), jnp.int32)
  _, lo, hi, t, c, words = lax.while_loop(cond, body, evaluate(zero, zero, hi0, guess0))

  def with_ties(_):
    strict = mask_words(x, _float(hi))
    ties = mask_words(x, _float(lo)) & ~strict
    return strict | _keep_first(ties, capacity - count(strict))

  in_range = (c >= k) & (c <= capacity)
  words = lax.cond(in_range, lambda _: words, with_ties, None)
  idx, used = compact(words, n, capacity)
  found = jnp.where(in_range, t, lo)
  # XLA flushes subnormals to zero: a subnormal threshold acts as 0.
  return Selection(idx, used, _float(jnp.where(found < _MIN_NORMAL_BITS, 0, found)))


def threshold_binary_search(x: jax.Array, k: int, capacity: int | None = None,
                            threshold: jax.Array | None = None) -> Selection:
  """RedSync's threshold binary search: between ``k`` and ``capacity`` largest ``|x|``.

  Bisects a threshold until ``k <= count(|x| >= t) <= capacity`` and returns
  the positions of those entries in ascending order. Every selected entry is
  at least as large in magnitude as every entry left out. When ties make the
  window unreachable (the count jumps past ``capacity`` between two adjacent
  floats) the result is every entry above the tie plus the first tied ones,
  ``capacity`` in all. Fewer than ``k`` only if fewer than ``k`` are not NaN.

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
  x = jnp.asarray(x, jnp.float32)
  if capacity >= n:
    idx, used = compact(mask_words(x, 0.0), n, n)
    return Selection(idx, used, jnp.zeros((), jnp.float32))
  first = jnp.zeros((), jnp.float32) if threshold is None else jnp.asarray(threshold, jnp.float32)
  return _search(x, k, capacity, first, lambda it, mid, hi: mid)


def trimmed_topk(x: jax.Array, k: int, step: float = 0.1,
                 capacity: int | None = None) -> Selection:
  """RedSync's trimmed top-k: the exact ``k`` largest ``|x|``, sorting only survivors.

  The threshold ``mean|x| + r (max|x| - mean|x|)`` is lowered with
  ``r = 1 - step, 1 - 2 step, ...`` (below ``mean|x|`` down to 0 if needed)
  until at least ``k`` entries pass; if more than ``capacity`` pass, the last
  two thresholds are bisected. The survivors are compacted into a buffer of
  ``capacity`` entries and ``lax.top_k`` picks the exact top-k there. Equal
  magnitudes go to the lower index, as in ``numpy.argsort(-|x|, kind="stable")``.

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
  x = jnp.asarray(x, jnp.float32)
  if capacity >= n:
    sel = Selection(*compact(mask_words(x, 0.0), n, n), jnp.zeros((), jnp.float32))
  else:
    mean = jnp.sum(jnp.abs(x)) / n
    mean = jnp.where(jnp.isfinite(mean), mean, 0.0)  # NaN/Inf entries: start from 0
    top = _float(_total(_abs_bits(x), jnp.max))

    def trimmed(r):
      return jnp.maximum(mean + r * (top - mean), 0.0)

    def descend(it, mid, hi):
      t = trimmed(1.0 - step * (it + 2))
      return jnp.where(jnp.isfinite(t) & (_bits(t) < hi), _bits(t), mid)

    sel = _search(x, k, capacity, trimmed(1.0 - step), descend)
  valid = sel.indices < n
  mag = jnp.where(valid, jnp.abs(x[jnp.minimum(sel.indices, n - 1)]), -1.0)
  mag = jnp.where(jnp.isnan(mag), -1.0, mag)
  _, pos = lax.top_k(mag, k)
  return Selection(sel.indices[pos], jnp.minimum(sel.count, k), sel.threshold)
