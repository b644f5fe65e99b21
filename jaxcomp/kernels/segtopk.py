"""Exact top-k of every segment of a bucket at once: one vectorised bisection, one compaction.

For a bucket with static segments (:class:`jaxcomp.core.layout.Segments`) and a
static ``k`` per segment, :func:`segmented_topk` returns the positions of the
``k_s`` entries of largest ``|x|`` of each segment ``s`` (ties to the lower
index, as ``lax.top_k`` and a stable argsort), ascending, ``sum(k_s)`` in all.

The threshold of every segment is its ``k``-th largest magnitude, exactly,
on the int32 bit pattern of ``|x|`` (monotonic for non-negative floats), found
in a few passes over the bucket (:func:`kth_largest_bits`), as Floyd and
Rivest's selection and DGC's sampled threshold: a stratified sample of each
segment (one entry in :data:`SAMPLE_STRIDE`; a segment of at most
:data:`SAMPLE_ALL` entries is its own sample) brackets the ``k``-th largest
between two sample ranks ``k m / n -+ (4 sqrt(k m / n) + 4)``; one pass counts
the entries above and inside the bracket, one more packs the bracket's
entries (about ``8 sqrt(k n / m)``) into words and compacts them, and a
bisection over those few finds the exact value. Where a bracket misses (a
sample that misrepresents its segment, a band of ties larger than its slots:
rare, and checked), the whole bucket falls back to the 31-pass bisection
(one pass over the bucket per bit). The mask (above the threshold, plus the
first tied entries) is packed into 32-bit words and compacted by
:func:`jaxcomp.kernels.compaction.compact`: nothing of the bucket's size is
sorted or scattered.

References:
  Fang et al., *RedSync*, arXiv:1808.04357 (threshold search instead of a
  sort); Shi et al., *Understanding Top-k Sparsification*, 2019; Floyd &
  Rivest, *Expected time bounds for selection*, CACM 1975 (a sample's ranks
  bracket the k-th); Lin et al., *Deep Gradient Compression*, ICLR 2018
  (a sampled threshold).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.core import layout, tables
from jaxcomp.core.layout import Segments
from jaxcomp.kernels import compaction

SAMPLE_STRIDE = 32  # a sampled segment: one entry of every SAMPLE_STRIDE (a stratified sample)
SAMPLE_ALL = 8192  # a segment of at most this many entries is its own sample


def bisect_kth(bits: jax.Array, segs: Segments, k) -> jax.Array:
  """Per segment, the ``k_s``-th largest value of ``bits`` (int32 (S,)): 31 bisection passes."""
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


@dataclasses.dataclass(frozen=True)
class Plan:
  """How :func:`topk_positions` finds the ``k_s`` largest of every segment of a bucket.

  ``segs``: the bucket's segments; ``k``: int (S,). ``sample``: the sample's own segments
  (sizes m_s, padded to rows; None: the bucket is bisected), each segment's stratum length
  ``stride`` (1: the segment is its own sample) and the sample ranks of its bracket's ends
  ``rank_hi`` (>= 1) and ``rank_lo`` (<= m_s). Static: ``capacity``, the most bracket entries
  the bucket compacts, and ``total``, the output's slots (at least ``sum(k)``). Numpy constants
  for one bucket (:func:`plan`), or data of a loop over stacked buckets (:func:`group_plans`).
  """

  segs: Any
  k: Any
  sample: Any = None
  stride: Any = None
  rank_hi: Any = None
  rank_lo: Any = None
  capacity: int = 1
  total: int = 0


jax.tree_util.register_dataclass(Plan, data_fields=["segs", "k", "sample", "stride", "rank_hi", "rank_lo"],
                                 meta_fields=["capacity", "total"])


def _sample_sizes(n: np.ndarray, k: np.ndarray):
  """Per segment: sample size m, stratum length, bracket ranks and band slots (empty or k = 0: none)."""
  own = n <= SAMPLE_ALL
  m = np.where(own, n, -(-n // SAMPLE_STRIDE))
  stride = np.where(m > 0, n // np.maximum(m, 1), 1)
  r = k * m / np.maximum(n, 1)
  delta = np.where(own, 0, np.ceil(4 * np.sqrt(r) + 4)).astype(np.int64)
  rank_hi = np.maximum(1, np.floor(r).astype(np.int64) - delta)
  rank_lo = np.minimum(m, np.ceil(r).astype(np.int64) + delta)
  slots = np.where(own | (k == 0), 0, 2 * (rank_lo - rank_hi + 2) * stride)
  return m, stride, rank_hi, rank_lo, slots


@functools.lru_cache(maxsize=256)
def _static_plan(segs: Segments, k: tuple) -> Plan:
  k = np.asarray(k, np.int64)
  if not sampled(segs):
    return Plan(segs, k, total=int(k.sum()))
  m, stride, rank_hi, rank_lo, slots = _sample_sizes(np.asarray(segs.sizes, np.int64), k)
  offsets = np.concatenate([[0], np.cumsum(-(-m // layout.ROW) * layout.ROW)[:-1]])
  sample = Segments(tuple(int(o) for o in offsets), tuple(int(v) for v in m),
                    tuple((int(v),) for v in m), layout.ROW)
  return Plan(segs, k, sample, stride, rank_hi, rank_lo, max(int(slots.sum()), 1), int(k.sum()))


def plan(segs: Segments, k) -> Plan:
  """The static plan of one bucket (``k``: the count of each segment)."""
  return _static_plan(segs, tuple(int(v) for v in np.broadcast_to(np.asarray(k, np.int64), (segs.count,))))


def group_plans(segments: Sequence[Segments], ks: Sequence) -> list:
  """Plans of one structure for buckets run by one loop: their tables padded to one shape
  (:func:`jaxcomp.core.tables.group_tables`; the padding's segments get ``k = 0``), the sample
  of each as long as the longest, ``capacity`` and ``total`` the largest. The buckets must
  agree on :func:`sampled`."""
  segs = tables.group_tables(segments)
  count, out = segs[0].count, []
  ks = [np.concatenate([np.asarray(k, np.int64), np.zeros(count - len(k), np.int64)]) for k in ks]
  if not sampled(segments[0]):
    return [Plan(t, k.astype(np.int32), total=max(int(k.sum()) for k in ks)) for t, k in zip(segs, ks)]
  sizes = [np.asarray(t.sizes, np.int64) * (np.arange(count) < s.count) for t, s in zip(segs, segments)]
  parts = [_sample_sizes(n, k) for n, k in zip(sizes, ks)]
  padded = [-(-p[0] // layout.ROW) * layout.ROW for p in parts]
  length = max(int(q.sum()) for q in padded)
  capacity = max(max(int(p[4].sum()), 1) for p in parts)
  total = max(int(k.sum()) for k in ks)
  for t, k, (m, stride, hi, lo, _), q in zip(segs, ks, parts, padded):
    q = q.copy()
    q[-1] += length - q.sum()  # the last (padding) segment's rows fill the sample to its length
    offsets = np.concatenate([[0], np.cumsum(q)[:-1]])
    sample = tables.table(offsets, m, q, length, layout.ROW, True)
    i32 = lambda v: np.asarray(v, np.int32)
    out.append(Plan(t, i32(k), sample, i32(stride), i32(hi), i32(lo), capacity, total))
  return out


def _identity(v):
  return v


def _sample(src: jax.Array, p: Plan, of=_identity) -> jax.Array:
  """One entry of each stratum of each segment (a hashed offset in it) of ``of(src)``; -1 in the sample's
  padding."""
  sp, segs = p.sample, p.segs
  local = jnp.arange(sp.length, dtype=jnp.int32) - sp.spread(jnp.asarray(sp.offsets, jnp.int32))
  stride = sp.spread(jnp.asarray(p.stride, jnp.int32))
  jitter = ((local.astype(jnp.uint32) * jnp.uint32(2654435761)) >> 16).astype(jnp.int32) % stride
  pos = sp.spread(jnp.asarray(segs.offsets, jnp.int32)) + local * stride + jitter
  valid = local < sp.spread(jnp.asarray(sp.sizes, jnp.int32))
  return jnp.where(valid, of(src[jnp.clip(pos, 0, segs.length - 1)]), -1)


def _band_kth(src, words, p: Plan, t_lo, t_hi, need, of=_identity):
  """Per segment, the ``need_s``-th largest of the entries of ``of(src)`` in ``[t_lo, t_hi]``.

  ``words``: the packed mask of those entries (segments with ``t_lo < t_hi`` only).
  """
  segs = p.segs
  wide = t_lo < t_hi
  idx, _ = compaction.compact(words, segs.length, p.capacity)
  vals = jnp.where(idx < segs.length, of(src[jnp.minimum(idx, segs.length - 1)]), -1)
  seg = compaction.segment_of(idx, segs)

  def count(t):
    # A sorted segment sum of the compacted entries (empty slots hold -1, below every t): 4x faster on
    # XLA:CPU than a prefix sum over them and differences at each segment's bounds.
    return jax.ops.segment_sum((vals >= t[seg]).astype(jnp.int32), seg, segs.count, indices_are_sorted=True)

  def body(lohi):
    lo, hi = lohi
    mid = lo + (hi - lo) // 2
    enough = count(mid) >= need
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo, _ = lax.while_loop(lambda lohi: jnp.any(lohi[1] - lohi[0] > 1), body, (t_lo, t_hi + 1))
  return jnp.where(wide, lo, t_hi)


def _bisect_missed(src: jax.Array, segs: Segments, k, missed, found, of=_identity):
  """``(found, src)``, but for the ``missed`` segments the ``k_s``-th largest of ``of(src)`` by bisection.

  One pass over the bucket per step, and no step at all when nothing was
  missed (the loop's condition is false from the start). ``src`` rides in the
  loop's state behind an optimization barrier and each pass computes ``of(src)``
  as it reads it: XLA would otherwise hoist ``of(src)`` out of the loop and write
  it out in full. The ``src`` returned is the one read back after the loop.
  """
  k = jnp.asarray(k, jnp.int32)
  lo0 = jnp.where(missed, 0, found)
  hi0 = jnp.where(missed, jnp.int32(2 ** 31 - 1), found + 1)

  def body(c):
    lo, hi, src = c
    src = lax.optimization_barrier(src)
    rows = segs.rows(of(src))
    mid = lo + (hi - lo) // 2
    words = compaction.pack_mask((rows >= mid[segs.row_segment][:, None]).reshape(-1))
    enough = compaction.segment_word_sum(compaction.popcount(words), segs) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid), src

  lo, _, src = lax.while_loop(lambda c: jnp.any(c[1] - c[0] > 1), body, (lo0, hi0, src))
  return lo, src


def sampled(segs: Segments) -> bool:
  """Whether :func:`kth_largest_bits` brackets from a sample (else it bisects over the bucket).

  On XLA:CPU a pass over a bucket costs about a copy of it, so the sampled
  bracket (a few passes) beats the bisection (31 passes). On an accelerator
  a pass runs at memory speed and the bracket's small kernels cost more than
  the passes they save, so there it bisects (both measured in
  docs/benchmarks.md "Design measurements"). Small buckets (at most
  :data:`SAMPLE_ALL` entries) bisect too.
  """
  return jax.default_backend() == "cpu" and segs.block % compaction.WORD == 0 and segs.length > SAMPLE_ALL


def kth_largest_bits(bits: jax.Array, segs: Segments, k: np.ndarray, of=None):
  """Per segment, the ``k_s``-th largest value of ``bits`` (int32 (S,), non-negative), exactly.

  A sample brackets it, a pass counts the bracket, a bisection over its
  compacted entries finds it (module docstring); a segment whose bracket
  misses is bisected over the bucket (31 passes, only when one misses).
  ``of``: an elementwise function of ``bits`` that gives the values searched, computed by each
  reader and never written out; the result is then ``(kth, bits read back after the search)``
  (see :func:`_kth`).
  """
  return _kth(bits, plan(segs, k), of)


def _kth(src: jax.Array, p: Plan, of=None):
  """:func:`kth_largest_bits` by a plan; a segment with ``k = 0`` (padding) is never missed.

  ``of``: None (``src`` holds the non-negative int32 values searched), or an elementwise function
  of ``src`` that gives them; each reader then computes them as it reads (none writes them out),
  and the result is ``(kth, src)``, ``src`` as read back after the search: read that one after it
  (values computed from the ``src`` passed in would be one value to XLA with the search's own
  readers, written out in full for all of them).
  """
  segs, k = p.segs, jnp.asarray(p.k, jnp.int32)
  if p.sample is None:
    kth = bisect_kth(src if of is None else of(src), segs, k)
    return kth if of is None else (kth, src)
  fn = _identity if of is None else of
  sample = _sample(src, p, fn)
  t_hi, t_lo = jax.vmap(lambda r: bisect_kth(sample, p.sample, r))(jnp.stack([jnp.asarray(p.rank_hi),
                                                                           jnp.asarray(p.rank_lo)]))
  none = k == 0
  t_lo = jnp.where(none, t_hi, t_lo)
  # Packed masks (a word per 32 entries) rather than int32 per entry: nothing of the bucket's size is written.
  values = fn(src)
  above_words = compaction.pack_mask(values > segs.spread(t_hi))
  reach_words = compaction.pack_mask(values >= segs.spread(t_lo))
  above = compaction.segment_word_sum(compaction.popcount(above_words), segs)
  reach = compaction.segment_word_sum(compaction.popcount(reach_words), segs)
  inside = reach - above
  # A segment's band is compacted whole when it and the bands before it fit in the slots.
  held = jnp.where(t_lo < t_hi, inside, 0)
  captured = compaction.prefix_sum(held) <= p.capacity
  ok = ((above < k) & (reach >= k) & ((t_lo == t_hi) | captured)) | none
  band = jnp.where(compaction.segment_words(held > 0, segs), reach_words & ~above_words, jnp.uint32(0))
  found = _band_kth(src, band, p, t_lo, t_hi, k - above, fn)
  kth, src = _bisect_missed(src, segs, k, ~ok, found, fn)
  return kth if of is None else (kth, src)


def segmented_topk(x: jax.Array, segs: Segments, k: np.ndarray) -> jax.Array:
  """Ascending bucket positions of the ``k_s`` largest ``|x|`` of each segment: int32 ``(sum k,)``.

  ``segs.block`` must be a multiple of 32 (each packed word lies in one segment).
  Slots of a segment with fewer than ``k_s`` entries that are not NaN hold ``segs.length``.
  """
  if segs.block % 32:
    raise ValueError(f"segmented_topk needs segments aligned to 32 entries, got block={segs.block}")
  return topk_positions(x, plan(segs, k))


def topk_positions(x: jax.Array, p: Plan) -> jax.Array:
  """:func:`segmented_topk` by a plan: int32 ``(p.total,)``, ``p.segs.length`` in unused slots."""
  segs = p.segs
  k = jnp.asarray(p.k, jnp.int32)
  kth, x = _kth(x, p, compaction.abs_bits)  # |x|'s bits computed by each reader, never written out
  bits = compaction.abs_bits(x)
  t = jnp.where(k == 0, jnp.int32(2 ** 31 - 1), kth)  # k = 0: nothing selected
  t_entry = segs.spread(t)
  strict = compaction.pack_mask(bits > t_entry)
  ties = compaction.pack_mask(bits == t_entry) & ~strict
  above = compaction.segment_word_sum(compaction.popcount(strict), segs)
  # Of the entries tied at the threshold, the first ``k - above`` of each segment (ties to lower indices).
  kept, _ = compaction.cap_segments(ties, segs, k - above)
  words = strict | kept
  idx, _ = compaction.compact(words, segs.length, p.total)
  return idx
