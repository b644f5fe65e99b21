"""Threshold sparsification and adaptive quantization: variable counts in fixed-capacity payloads.

XLA needs static shapes, so a selection whose size varies travels in a buffer
of fixed ``capacity`` plus an int32 count; slots past the count are ignored by
the receiver. What does not fit is simply not sent, and error feedback keeps it
for a later step. Selection never sorts the whole vector: a mask, a cumsum and
one scatter compact it (see DESIGN.md, "Selection on CPU"); thresholds that
must hit a target count are estimated by a top-k over a small strided sample
and then adjusted by a few passes of counting.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import Codec, CodecExchange, Memory, Method, build, flat_route
from jaxcomp.transforms import _args, selection
from jaxcomp.transforms.sparse import scatter_mean

MIN_SAMPLE = 128  # a leaf this small is its own sample: its threshold is exact


# ----------------------------------------------------------------------------
# Fixed-capacity sparse payloads: (values, narrow indices, count)


def compact(dest: jax.Array, capacity: int) -> jax.Array:
  """Positions ``i`` with ``0 <= dest[i] < capacity`` placed at slot ``dest[i]`` (int32).

  ``dest`` holds distinct slots for the selected entries and ``capacity`` (or
  more) for the others; unfilled slots hold 0.
  """
  n = dest.shape[0]
  return jnp.zeros((capacity,), jnp.int32).at[dest].set(jnp.arange(n, dtype=jnp.int32), mode="drop")


def exclusive_rank(mask: jax.Array):
  """For a bool mask: the number of selected entries before each position, and the total."""
  m = mask.astype(jnp.int32)
  inclusive = jnp.cumsum(m)
  return inclusive - m, inclusive[-1]


def select(mask: jax.Array, capacity: int, start: jax.Array):
  """Compacts ``mask`` into at most ``capacity`` positions, in circular order from ``start``.

  Returns ``(indices int32[capacity], count int32)``; unused slots hold 0.
  When more than ``capacity`` entries are selected, the ones sent are the
  first in circular order from the 32-entry word holding ``start`` (a random
  offset each step), so no region of the vector is starved when the capacity
  is too small. The mask is packed into bits and compacted word by word
  (:func:`jaxcomp.transforms.selection.compact_from_word`): no scatter of
  size n.
  """
  return selection.compact_from_word(selection.pack_mask(mask), capacity, start // 32)


def valid_indices(idx: jax.Array, count: jax.Array, n: int) -> jax.Array:
  """int32 indices with the slots past ``count`` set to ``n`` (dropped by scatters)."""
  slot = jnp.arange(idx.shape[-1], dtype=jnp.int32)
  return jnp.where(slot < jnp.expand_dims(count, -1), idx.astype(jnp.int32), n)


def sparse_decode(values: jax.Array, idx: jax.Array, count: jax.Array, n: int) -> jax.Array:
  """Dense ``(n,)`` vector of a fixed-capacity sparse payload."""
  return jnp.zeros((n,), jnp.float32).at[valid_indices(idx, count, n)].set(values, mode="drop")


def sparse_mean(values, idx, count, n: int, num: int) -> jax.Array:
  """Mean of ``(N, capacity)`` gathered sparse payloads, scatter-added into one vector."""
  return scatter_mean(values, valid_indices(idx, count, n), n, num)


def sparse_bytes(n: int, capacity: int) -> int:
  """Bytes of one payload: float32 values, narrow indices, an int32 count."""
  return capacity * (4 + np.dtype(_args.index_dtype(n)).itemsize) + 4


# ----------------------------------------------------------------------------
# Thresholds for a target count: sampled, then adjusted


def key_int(key: jax.Array, word: int, m) -> jax.Array:
  """An int32 in ``[0, m)`` from one word of ``key``, which is already a PRNG output.

  Keys reaching a codec come out of ``split`` / ``fold_in``, so their words
  are uniform; reading one avoids another threefry call (whose compile time
  dominates these small kernels). The modulo bias is below ``m / 2**32``.
  """
  words = key if key.dtype == jnp.uint32 else jax.random.key_data(key)
  return (words.reshape(-1)[word] % jnp.uint32(m)).astype(jnp.int32)


def sample_size(n: int, sample_ratio: float) -> int:
  return min(n, max(_args.count(sample_ratio, n), MIN_SAMPLE))


def target(ratio, m) -> jax.Array:
  """``ceil(ratio * m)`` in float32 (a target count; rounding noise is harmless)."""
  return jnp.ceil(jnp.asarray(ratio, jnp.float32) * jnp.asarray(m, jnp.float32) - 1e-3)


def sampled_threshold(a: jax.Array, offset: jax.Array, ratio, max_ratio: float, sample_ratio: float,
                      among_nonzero: bool = False) -> jax.Array:
  """Magnitude above which about ``ratio`` of ``a`` (>= 0) lies, from a strided sample.

  The sample is ``s = max(ceil(sample_ratio * n), MIN_SAMPLE)`` entries (all
  of ``a`` when n is smaller), one every ``n // s`` from ``offset % (n // s)``; the
  threshold is its ``ceil(ratio * s)``-th largest entry (of its nonzero
  entries with ``among_nonzero``). ``ratio`` may be traced, up to ``max_ratio``.
  When the sample holds no nonzero entry, the threshold is ``max(a)``.
  """
  n = a.shape[0]
  s = sample_size(n, sample_ratio)
  stride = n // s
  sample = a[offset % stride + stride * jnp.arange(s, dtype=jnp.int32)]
  ks_max = _args.count(max_ratio, s)
  vals, _ = lax.top_k(sample, ks_max)
  pool = jnp.sum(sample > 0) if among_nonzero else s
  ks = jnp.clip(target(ratio, pool).astype(jnp.int32), 1, ks_max)
  thr = vals[ks - 1]
  return jnp.where(thr > 0, thr, jnp.max(a))


def passes(a: jax.Array, thr) -> jax.Array:
  """What a threshold selects: ``a >= thr`` and ``a > 0`` (an exact zero is never sent)."""
  return (a >= thr) & (a > 0)


def refine_threshold(a: jax.Array, thr: jax.Array, k, low: float, high: float, up: float,
                     down: float, iterations: int) -> jax.Array:
  """Scales ``thr`` by ``up`` while more than ``high * k`` entries pass, by ``down`` while
  fewer than ``low * k`` pass, at most ``iterations`` times (DGC: 0.7, 1.3, x1.3, x0.7, 10).

  The steps are coarse (``up * down`` close to 1 can cycle around the band),
  so when the loop ends outside the band it returns the threshold tried whose
  count was closest to k, not the last one.
  """
  k = jnp.asarray(k, jnp.float32)

  def count(t):
    return jnp.sum(passes(a, t), dtype=jnp.int32).astype(jnp.float32)

  def cond(c):
    i, _, m, _, _ = c
    return (i < iterations) & ((m > high * k) | (m < low * k))

  def body(c):
    i, t, m, best, gap = c
    t = jnp.where(m > high * k, t * up, t * down)
    m = count(t)
    closer = jnp.abs(m - k) < gap
    return i + 1, t, m, jnp.where(closer, t, best), jnp.where(closer, jnp.abs(m - k), gap)

  m0 = count(thr)
  c = lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), thr, m0, thr, jnp.abs(m0 - k)))
  _, t, m, best, _ = c
  return jnp.where((m > high * k) | (m < low * k), best, t)


def loop_mean(decode, gathered, n: int, num: int) -> jax.Array:
  """Mean of the decoded ``(N, ...)`` gathered payloads, one decode at a time."""
  def body(w, acc):
    return acc + decode(jax.tree.map(lambda a: a[w], gathered))

  workers = jax.tree.leaves(gathered)[0].shape[0]
  return lax.fori_loop(0, workers, body, jnp.zeros((n,), jnp.float32)) / num


# ----------------------------------------------------------------------------
# threshold


@dataclasses.dataclass(frozen=True)
class ThresholdCodec(Codec):
  """Entries with ``|x| > v``: float32 values + narrow indices in ``capacity`` slots + a count."""

  v: float
  capacity: float

  def encode(self, x, key):
    n = x.shape[0]
    cap = _args.count(self.capacity, n)
    idx, count = select(jnp.abs(x) > self.v, cap, key_int(key, 0, n))
    values = jnp.where(jnp.arange(cap) < count, x[idx], 0.0)
    return values, idx.astype(_args.index_dtype(n)), count

  def decode(self, payload, key, n):
    return sparse_decode(*payload, n)

  def aggregate(self, gathered, key, n, num):
    return sparse_mean(*gathered, n, num)


def threshold(v: float = 0.01, capacity: float = 0.1, axis_name: AxisName = None,
              error_feedback: bool = True, seed: int = 0):
  """Threshold sparsification: send the entries with ``|x| > v`` (a variable count).

  The count varies from step to step but a payload's shape cannot, so each
  leaf of n entries sends a buffer of ``cap = max(1, ceil(capacity * n))``
  float32 values and indices (uint8 for n <= 256, uint16 for n <= 65536, else
  int32) plus an int32 count. When more than ``cap`` entries pass, the ones
  sent are the first ``cap`` in circular order from a random offset (new each
  step, so no region starves) and the others stay in the residual: nothing is
  lost with error feedback (on by default). Payloads are all-gathered and
  every worker scatter-adds all of them into one dense mean.

  Sizing the capacity: the wire carries ``cap`` slots whether they are full
  or not (``capacity * (32 + index bits)`` bits per entry), so set it a little
  above the fraction of entries expected over ``v`` in ``e + g`` (e.g. from
  ``mean(|x| > v)`` on a few steps). With ``v`` too small for the gradients'
  scale every step overflows: then the method behaves like a random-window
  top-``cap`` and the residual grows; above about 0.5 (int32 indices) or 0.67
  (uint16) a dense fp32 mean is cheaper.

  Args:
    v: the threshold, >= 0 (GRACE: 0.01).
    capacity: slots per leaf as a fraction of its size, in (0, 1] (default 0.1).
    axis_name: the data-parallel axis, or None for a local round trip.
    error_feedback: keep what was not sent in a residual (default True).
    seed: seeds the state's key (the random start offset).

  References:
    Strom, *Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing*, Interspeech 2015; Xu et al., *GRACE: A Compressed
    Communication Framework for Distributed Machine Learning*, ICDCS 2021.
  """
  v = _args.positive("v", v, allow_zero=True)
  cap = _args.ratio("capacity", capacity)
  ef = _args.flag("error_feedback", error_feedback)
  codec = ThresholdCodec(v, cap)
  return build(Method("threshold", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed)


# ----------------------------------------------------------------------------
# adaq


_ADAQ_REFINE = {"low": 0.8, "high": 1.25, "up": 1.25, "down": 0.9, "iterations": 20}  # GRACE's constants


@dataclasses.dataclass(frozen=True)
class AdaQCodec(Codec):
  """Top ``ratio`` of the positives and of the negatives, each sent as positions and one mean.

  Positions travel either as one fixed-capacity index buffer (positives
  first, then negatives) with two counts, or as a 2-bit code per entry
  (0 none, 1 positive, 2 negative), whichever is smaller for n.
  """

  ratio: float
  sample_ratio: float
  capacity: float
  encoding: str

  def uses_map(self, n: int) -> bool:
    if self.encoding != "auto":
      return self.encoding == "map"
    index_bits = 8 * np.dtype(_args.index_dtype(n)).itemsize
    return 8 * packing.packed_size(n, 2) <= _args.count(self.capacity, n) * index_bits + 32

  def _thresholds(self, x, key):
    n = x.shape[0]
    out = []
    for word, a in enumerate((jnp.where(x > 0, x, 0.0), jnp.where(x < 0, -x, 0.0))):
      thr = sampled_threshold(a, key_int(key, word, n), self.ratio, self.ratio, self.sample_ratio, among_nonzero=True)
      thr = refine_threshold(a, thr, target(self.ratio, jnp.sum(a > 0)), **_ADAQ_REFINE)
      out.append(passes(a, thr))
    return out

  def encode(self, x, key):
    n = x.shape[0]
    plus, minus = self._thresholds(x, key)
    if not self.uses_map(n):
      cap = _args.count(self.capacity, n)
      rank_p, total_p = exclusive_rank(plus)
      rank_m, total_m = exclusive_rank(minus)
      rank_m = rank_m + total_p
      plus, minus = plus & (rank_p < cap), minus & (rank_m < cap)
      idx = compact(jnp.where(plus, rank_p, jnp.where(minus, rank_m, cap)), cap)
      counts = jnp.stack([jnp.minimum(total_p, cap), jnp.minimum(total_p + total_m, cap)])
    means = jnp.stack([
        jnp.sum(jnp.where(plus, x, 0.0)) / jnp.maximum(jnp.sum(plus), 1),
        jnp.sum(jnp.where(minus, x, 0.0)) / jnp.maximum(jnp.sum(minus), 1)])
    if self.uses_map(n):
      code = plus.astype(jnp.uint8) + 2 * minus.astype(jnp.uint8)
      return means, packing.pack(code, 2)
    return means, idx.astype(_args.index_dtype(n)), counts

  def _sparse(self, payload, n):
    means, idx, counts = payload
    slot = jnp.arange(idx.shape[-1], dtype=jnp.int32)
    values = jnp.where(slot < counts[0], means[0], means[1])
    return values, idx, counts[1]

  def decode(self, payload, key, n):
    if self.uses_map(n):
      means, words = payload
      code = packing.unpack(words, 2, n)
      return jnp.where(code == 1, means[0], jnp.where(code == 2, means[1], 0.0))
    return sparse_decode(*self._sparse(payload, n), n)

  def aggregate(self, gathered, key, n, num):
    if self.uses_map(n):
      return loop_mean(lambda p: self.decode(p, key, n), gathered, n, num)
    return sparse_mean(*jax.vmap(lambda p: self._sparse(p, n))(gathered), n, num)


def adaq(ratio: float = 0.3, axis_name: AxisName = None, sample_ratio: float = 0.01,
         capacity: float | None = None, encoding: str = "auto", error_feedback: bool = True,
         seed: int = 0):
  """Adaptive quantization: the top ``ratio`` of the positives and of the negatives, two means.

  Each leaf's positive entries and (separately) its negative entries are
  thresholded so that about ``ratio`` of each side is kept: the threshold is
  the ``ceil(ratio * s+)``-th largest of the positives in a strided sample of
  ``max(ceil(sample_ratio * n), 128)`` entries, then scaled by x1.25 / x0.9 up
  to 20 times until the count is within 0.8-1.25 of ``ceil(ratio * n+)``
  (GRACE's constants). Each kept positive is sent as the mean of the kept
  positives, each kept negative as the mean of the kept negatives: the payload
  is two float32 means plus the positions. Positions travel as whichever is
  smaller for n (``encoding="auto"``):

  - ``"indices"``: one buffer of ``cap = ceil(capacity * n)`` narrow indices
    (positives then negatives) and two int32 counts; what does not fit stays
    in the residual. ``capacity`` defaults to ``min(1, 1.3 * ratio)``.
  - ``"map"``: a 2-bit code per entry (none / positive / negative), packed 4
    per byte, with no capacity limit: 2 bits per entry, which at GRACE's
    ratio 0.3 is smaller than any index list (GRACE sends int32 indices).

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
  return build(Method("adaq", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed)
