"""Threshold sparsification and adaptive quantization (GRACE's ``threshold`` and ``adaq``).

Both send a variable number of entries in a fixed-capacity sparse payload
(:mod:`jaxcomp.kernels.sparse`): what does not fit is not sent, and error
feedback keeps it for a later step. AdaQ's thresholds are sampled and adjusted
per segment (:mod:`jaxcomp.kernels.thresholds`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives import packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import policy
from jaxcomp.core.builder import build
from jaxcomp.core.layout import Segments
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, CodecExchange, Memory, flat_route
from jaxcomp.exchanges.scatter import ScatterCodec
from jaxcomp.kernels import compaction, rng
from jaxcomp.kernels.sparse import (
  segment_caps,
  select,
  sparse_decode,
  sparse_kept,
  sparse_mean,
  sparse_payload,
)
from jaxcomp.kernels.thresholds import passes, refine_thresholds, sampled_thresholds, segment_rms, target
from jaxcomp.transforms import _args

BLOCK = 128  # segments start at multiples of it: packed mask words never straddle two leaves


# ----------------------------------------------------------------------------
# threshold


V_RMS = 2.0  # the default threshold in units of each leaf's RMS: 4.55% of a Gaussian leaf




@dataclasses.dataclass(frozen=True)
class ThresholdCodec(Codec, ScatterCodec):
  """Entries with ``|x| > v`` (``relative``: ``|x| >= min(v * rms, max |x|)`` in the entry's leaf,
  nonzero): float32 values + narrow bucket positions in fixed slots + a count.

  Each leaf (segment) of n entries has ``max(1, ceil(capacity * n))`` slots;
  the bucket's payload holds the sum of them.
  """

  leaf_segments = False  # transport="scatter": one budget per chunk

  v: float
  capacity: float
  relative: bool = False
  block = BLOCK

  def mask(self, x, segs):
    """What passes: ``|x| > v``, or (``relative``) ``|x| >= min(v * rms, max |x|)`` of its leaf, ``x != 0``.

    The relative threshold is at most the leaf's largest ``|x|``, so every
    leaf can send: no entry of a leaf of ``n`` entries exceeds ``sqrt(n)``
    times its RMS (a scalar leaf is its own RMS).
    """
    a = jnp.abs(x)
    if not self.relative:
      return a > self.v
    top = segs.max(jnp.where(jnp.isfinite(a), a, 0.0))
    return passes(a, segs.spread(jnp.minimum(jnp.float32(self.v) * segment_rms(x, segs), top)))

  def encode(self, x, key, segs):
    idx, count = select(self.mask(x, segs), segs, segment_caps(self.capacity, segs), key)
    return sparse_payload(x, idx, count, segs.length)

  def decode(self, payload, key, segs):
    return sparse_decode(*payload, segs.length)

  def sent(self, x, payload, key, segs):
    return sparse_kept(x, payload, segs.length)

  def aggregate(self, gathered, key, segs, num):
    return sparse_mean(gathered, segs.length, num)


@_args.factory
def threshold(v: float | None = None, capacity: float = 0.1, *, axis_name: AxisName = None,
              error_feedback: bool = True, seed: int = 0, bucket_bytes: int | None = None,
              min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather",
              v_rms: float | None = None):
  """Threshold sparsification: send the entries above a threshold (a variable count).

  The threshold is relative by default: an entry is sent when ``|x| >= v_rms
  * rms`` of its leaf (the root mean square of the leaf's entries of ``e + g``,
  this step, on this worker), ``v_rms = 2.0`` unless given, or when it is
  the leaf's largest (so a leaf of ``n <= v_rms**2`` entries, whose entries
  never exceed ``sqrt(n)`` times its RMS, still sends). That sends the
  same fraction of a leaf whatever the gradients' scale: 4.55% of a standard
  normal leaf on one step (a little less per step once error feedback's
  residual settles; at ``v_rms=2.5`` the residual outgrows the threshold and
  the steady state sends far less). The output is
  scale-equivariant: the output for ``c * g`` is ``c`` times the output for
  ``g``, bit for bit at a power-of-two ``c``. Strom's and GRACE's absolute
  threshold is one argument away, ``threshold(v=0.01)``: then the fraction
  sent depends on the scale (at 0.01 nothing of gradients of 1e-4 per
  entry is sent, nearly all of gradients of 1).

  The count varies from step to step but a payload's shape cannot, so each
  leaf of n entries has ``cap = max(1, ceil(capacity * n))`` slots, and the
  payload of a bucket of leaves is the sum of their slots of float32 values
  and bucket positions (uint8 for a bucket of at most 256 entries, uint16 up
  to 65536, else int32) plus one int32 count. When more than ``cap`` entries
  of a leaf pass, the ones sent are the first ``cap`` in circular order from
  a random offset in the leaf (new each step, so no region starves) and the
  others stay in the residual: nothing is lost with error feedback (on by
  default). Payloads are all-gathered and every worker scatter-adds all of
  them into one dense mean. The RMS is computed locally and not sent: the
  wire bytes are the same for both forms.

  Sizing the capacity: the wire carries ``cap`` slots whether they are full
  or not (``capacity * (32 + index bits)`` bits per entry), so set it a little
  above the fraction of entries expected over the threshold in ``e + g``
  (e.g. from ``mean(|x| > v)`` on a few steps; the default 0.1 holds the
  default ``v_rms``'s few percent). With an absolute ``v`` too small for the
  gradients' scale every step overflows: then the method behaves like a
  random-window top-``cap`` and the residual grows; above about 0.5 (int32
  indices) or 0.67 (uint16) a dense fp32 mean is cheaper.

  Args:
    v: an absolute threshold, >= 0 (GRACE: 0.01); give ``v`` or ``v_rms``,
      not both. None (default): the relative threshold ``v_rms``.
    capacity: slots per leaf as a fraction of its size, in (0, 1] (default 0.1).
    axis_name: the data-parallel axis, or None for a local round trip.
    error_feedback: keep what was not sent in a residual (default True).
    seed: seeds the state's key (the random start offset).
    bucket_bytes: the bucket policy, see :func:`jaxcomp.build`.
    min_size: the bucket policy, see :func:`jaxcomp.build`; by default every leaf is compressed
      (``min_size=0``, :data:`jaxcomp.core.policy.EVERY_LEAF`).
    dense: the bucket policy, see :func:`jaxcomp.build`.
    dense_axis_name: a fast axis averaged densely before the compressed exchange (see
      :func:`jaxcomp.build` and :mod:`jaxcomp.exchanges.hierarchy`).
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`; with
      ``"scatter"`` the RMS is that of each chunk (:mod:`jaxcomp.exchanges.scatter`).
    v_rms: the threshold in units of each leaf's RMS, >= 0 (default 2.0 when
      ``v`` is not given; 0 sends every nonzero entry up to the capacity).

  References:
    Strom, *Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing*, Interspeech 2015; Xu et al., *GRACE: A Compressed
    Communication Framework for Distributed Machine Learning*, ICDCS 2021.
  """
  if v is not None and v_rms is not None:
    raise ValueError(f"threshold: give v (an absolute threshold) or v_rms (a multiple of each leaf's RMS),"
                     f" not both; got v={v!r}, v_rms={v_rms!r}")
  if v is None:
    codec_v, relative = _args.positive("v_rms", V_RMS if v_rms is None else v_rms, allow_zero=True), True
  else:
    codec_v, relative = _args.positive("v", v, allow_zero=True), False
  cap = _args.ratio("capacity", capacity)
  ef = _args.flag("error_feedback", error_feedback)
  codec = ThresholdCodec(codec_v, cap, relative)
  method = Method("threshold", flat_route(CodecExchange(codec)), Memory(enabled=ef),
                  min_size=policy.EVERY_LEAF)
  return build(method, axis_name, seed, bucket_bytes=bucket_bytes, min_size=min_size, dense=dense,
               dense_axis_name=dense_axis_name, transport=transport)


# ----------------------------------------------------------------------------
# adaq


def _positive(x):
  return jnp.where(x > 0, x, 0.0)


def _negative(x):
  return jnp.where(x < 0, -x, 0.0)


_ADAQ_REFINE = {"low": 0.8, "high": 1.25, "up": 1.25, "down": 0.9, "iterations": 20}  # GRACE's constants


@dataclasses.dataclass(frozen=True)
class AdaQCodec(Codec, ScatterCodec):
  """Top ``ratio`` of the positives and of the negatives of each leaf, sent as positions and two means.

  Per bucket: the two means of every segment (float32 (S, 2)) and the
  positions, either as one fixed-capacity buffer of bucket positions (the
  kept positives of all segments first, then the negatives) with two counts,
  or as a 2-bit code per bucket entry (0 none, 1 positive, 2 negative),
  whichever is smaller for the bucket.
  """

  leaf_segments = False  # transport="scatter": one budget per chunk

  ratio: float
  sample_ratio: float
  capacity: float
  encoding: str
  block = BLOCK

  def uses_map(self, segs) -> bool:
    """Whether the 2-bit map is the encoding for ``segs`` (or for one leaf of ``segs`` entries)."""
    if self.encoding != "auto":
      return self.encoding == "map"
    if isinstance(segs, Segments):
      n, slots = segs.length, int(segment_caps(self.capacity, segs).sum())
    else:
      n, slots = int(segs), _args.ratio_count(self.capacity, int(segs))
    index_bits = 8 * np.dtype(_args.index_dtype(n)).itemsize
    return 8 * packing.packed_size(n, 2) <= slots * index_bits + 32

  def _masks(self, x, key, segs):
    out = []
    # each side's magnitudes computed by each reader of x, never written out (refine_thresholds)
    for word, (side, mag) in enumerate((((x > 0), _positive), ((x < 0), _negative))):
      offsets = rng.word_ints(key, word, segs.sizes)
      thr = sampled_thresholds(x, segs, offsets, self.ratio, self.ratio, self.sample_ratio,
                               among_nonzero=True, magnitude=mag)
      k = target(self.ratio, compaction.segment_count(side, segs))
      thr, read = refine_thresholds(x, thr, k, segs, **_ADAQ_REFINE, magnitude=mag)
      out.append(passes(mag(read), segs.spread(thr)))
    return out

  def encode(self, x, key, segs):
    plus, minus = self._masks(x, key, segs)
    if self.uses_map(segs):
      sums = segs.sums(jnp.where(plus, x, 0.0), jnp.where(minus, x, 0.0))
      counts = jnp.stack([compaction.segment_count(plus, segs), compaction.segment_count(minus, segs)])
      means = (sums / jnp.maximum(counts, 1)).T
      code = plus.astype(jnp.uint8) + 2 * minus.astype(jnp.uint8)
      return means, packing.pack(code, 2)
    # Each leaf's slots go to its positives first, then to its negatives.
    n = segs.length
    caps = segment_caps(self.capacity, segs)
    cap = int(caps.sum())
    p_idx, p, kept = compaction.compact_segments(compaction.pack_mask(plus), segs, caps)
    m_idx, m, _ = compaction.compact_segments(compaction.pack_mask(minus), segs,
                                             jnp.asarray(caps, jnp.int32) - kept, cap)
    slot = jnp.arange(cap, dtype=jnp.int32)
    idx = jnp.where(slot < p, p_idx, m_idx[jnp.clip(slot - p, 0, cap - 1)])
    used = slot < p + m
    idx = jnp.where(used, idx, 0)
    seg = compaction.segment_of(idx, segs)
    vals = jnp.where(used, x[idx], 0.0)
    is_plus = slot < p

    def mean(side):
      total = jax.ops.segment_sum(jnp.where(side, vals, 0.0), seg, segs.count)
      num = jax.ops.segment_sum(side.astype(jnp.int32), seg, segs.count)
      return total / jnp.maximum(num, 1)

    means = jnp.stack([mean(is_plus & used), mean(~is_plus & used)], axis=1)
    return means, idx.astype(_args.index_dtype(n)), jnp.stack([p, p + m]).astype(jnp.int32)

  def _sparse(self, payload, segs):
    means, idx, counts = payload
    slot = jnp.arange(idx.shape[-1], dtype=jnp.int32)
    side = means[compaction.segment_of(idx, segs)]
    values = jnp.where(slot < counts[0], side[:, 0], side[:, 1])
    return values, idx, counts[1]

  def decode(self, payload, key, segs):
    n = segs.length
    if self.uses_map(segs):
      means, words = payload
      code = packing.unpack(words, 2, n)
      plus, minus = segs.spread(means[:, 0]), segs.spread(means[:, 1])
      return jnp.where(code == 1, plus, jnp.where(code == 2, minus, 0.0))
    return sparse_decode(*self._sparse(payload, segs), n)

  def aggregate(self, gathered, key, segs, num):
    if self.uses_map(segs):  # the base's loop: one worker's map decoded at a time
      return super().aggregate(gathered, key, segs, num)
    return sparse_mean(gathered, segs.length, num, lambda p: self._sparse(p, segs))


@_args.factory
def adaq(ratio: float = 0.3, *, axis_name: AxisName = None, sample_ratio: float = 0.01,
         capacity: float | None = None, encoding: str = "auto", error_feedback: bool = True,
         seed: int = 0, bucket_bytes: int | None = None, min_size: int | None = None, dense=None,
         dense_axis_name=None, transport: str = "gather"):
  """Adaptive quantization: the top ``ratio`` of the positives and of the negatives, two means.

  Each leaf's positive entries and (separately) its negative entries are
  thresholded so that about ``ratio`` of each side is kept: the threshold is
  the ``ceil(ratio * s+)``-th largest of the positives in a strided sample of
  ``max(ceil(sample_ratio * n), 128)`` entries (all of a leaf of at most
  16384 entries, see :func:`sample_size`), then scaled by x1.25 / x0.9 up
  to 20 times until the count is within 0.8-1.25 of ``ceil(ratio * n+)``
  (GRACE's constants). Each kept positive is sent as the mean of the leaf's
  kept positives, each kept negative as the mean of its kept negatives: the
  payload of a bucket is two float32 means per leaf plus the positions.
  Positions travel as whichever is smaller for the bucket (``encoding="auto"``):

  - ``"indices"``: one buffer of ``cap = ceil(capacity * n)`` slots per leaf
    of n entries (its positives first, then its negatives), summed over the
    bucket, of bucket positions in the narrowest integer dtype, and two int32
    counts; what does not fit stays in the residual. ``capacity`` defaults to
    ``min(1, 1.3 * ratio)``.
  - ``"map"``: a 2-bit code per bucket entry (none / positive / negative),
    packed 4 per byte, with no capacity limit: 2 bits per entry (padding
    between leaves included), which at GRACE's ratio 0.3 is smaller than any
    index list (GRACE sends int32 indices).

  Payloads are all-gathered, decoded and averaged; the quantization and
  selection error stays in the residual (error feedback on by default).

  Args:
    ratio: fraction of each sign's entries sent, in (0, 1] (GRACE: 0.3).
    axis_name: the data-parallel axis, or None.
    sample_ratio: sample size as a fraction of n, in (0, 1] (GRACE: 0.01).
    capacity: index slots per leaf as a fraction of n, in (0, 1]; None means
      ``min(1, 1.3 * ratio)``. Used by the index encoding only.
    encoding: "auto" (default), "indices" or "map".
    error_feedback: keep the error in a residual (default True).
    seed: seeds the key (sample offsets).
    bucket_bytes: the bucket policy, see :func:`jaxcomp.build`.
    min_size: the bucket policy, see :func:`jaxcomp.build`; by default every leaf is compressed
      (``min_size=0``, :data:`jaxcomp.core.policy.EVERY_LEAF`).
    dense: the bucket policy, see :func:`jaxcomp.build`.
    dense_axis_name: a fast axis averaged densely before the compressed exchange (see
      :func:`jaxcomp.build` and :mod:`jaxcomp.exchanges.hierarchy`).
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  References:
    Dryden, Moon, Jacobs & Van Essen, *Communication Quantization for
    Data-Parallel Training of Deep Neural Networks*, MLHPC 2016, Sec. III.
  """
  r = _args.ratio("ratio", ratio)
  sr = _args.ratio("sample_ratio", sample_ratio)
  cap = min(1.0, 1.3 * r) if capacity is None else _args.ratio("capacity", capacity)
  enc = _args.choice("encoding", encoding, ("auto", "indices", "map"))
  ef = _args.flag("error_feedback", error_feedback)
  codec = AdaQCodec(r, sr, cap, enc)
  method = Method("adaq", flat_route(CodecExchange(codec)), Memory(enabled=ef), min_size=policy.EVERY_LEAF)
  return build(method, axis_name, seed, bucket_bytes=bucket_bytes, min_size=min_size, dense=dense,
               dense_axis_name=dense_axis_name, transport=transport)
