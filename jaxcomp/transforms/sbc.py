"""Sparse Binary Compression: communication delay, binarized top-p, Golomb-coded positions."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import golomb, ops
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import Ctx, Exchange, Memory, Method, build, flat_route
from jaxcomp.transforms import _args
from jaxcomp.transforms.sparse import scatter_mean


def _bytes(x: jax.Array) -> jax.Array:
  """A scalar as its little-endian-in-memory uint8 bytes (a 1-byte scalar as one byte)."""
  if x.dtype.itemsize == 1:
    return x.astype(jnp.uint8)[None]
  return lax.bitcast_convert_type(x, jnp.uint8)


class SBCState(NamedTuple):
  """Per leaf group: the local update since the last sync and the residual, both ``(G, n)``.

  With ``delay=1`` nothing accumulates and ``accumulated`` is ``(G, 0)``.
  """

  accumulated: jax.Array
  residual: jax.Array


def binarize(a: jax.Array, k: int):
  """SBC's binarization of one flat vector: the side of the top-k with the larger mean.

  Takes the ``k`` largest entries of ``a`` that are > 0 and the ``k`` largest
  of ``-a`` that are > 0, with mean magnitudes ``mu+`` and ``mu-``; keeps the
  positive side when ``mu+ >= mu-``.

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


@dataclasses.dataclass(frozen=True)
class SBCExchange(Exchange):
  """Local steps, then a sync: binarize, Golomb-code, all-gather, decode, mean.

  The payload of one leaf is one uint8 buffer: its float32 value (4 bytes),
  the stream length (1, 2 or 4 bytes, the narrowest that holds the capacity)
  and the Golomb bit buffer, so that a group of leaves crosses the axis in one
  all-gather. The state (``extra``) is an :class:`SBCState`.
  """

  sparsity: float
  delay: int
  capacity: float | None
  carries_nonfinite = True  # a non-finite A sends a NaN value, and every decoded mean is NaN

  def sizes(self, n: int):
    """``(k, b, capacity_bits)`` of a leaf of n entries."""
    k = _args.count(self.sparsity, n)
    b = golomb.golomb_b_star(self.sparsity)
    worst = golomb.max_stream_bits(k, n, b)
    if self.capacity is None:
      return k, b, worst
    expected = k * golomb.expected_bits_per_position(self.sparsity, b)
    return k, b, max(1, min(worst, int(np.ceil(self.capacity * expected))))

  def _nbits_dtype(self, n: int):
    return _args.index_dtype(self.sizes(n)[2] + 1)

  def init(self, view, group, key):
    (n,) = view
    acc = n if self.delay > 1 else 0
    return SBCState(jnp.zeros((group, acc), jnp.float32), jnp.zeros((group, n), jnp.float32))

  def _encode(self, a):
    n = a.shape[-1]
    k, b, cap = self.sizes(n)
    finite = jnp.isfinite(a)
    value, pos, count = binarize(jnp.where(finite, a, 0.0), k)
    words, nbits, sent = golomb.encode_positions(pos, count, n, b, cap)
    pos = jnp.where(jnp.arange(k) < sent, pos, n)
    local = jnp.zeros((n,), jnp.float32).at[pos].set(value, mode="drop")
    flagged = jnp.where(jnp.all(finite), value, jnp.nan).astype(jnp.float32)
    header = [lax.bitcast_convert_type(flagged, jnp.uint8), _bytes(nbits.astype(self._nbits_dtype(n)))]
    return jnp.concatenate(header + [words]), local, flagged

  def _mean(self, gathered, n: int, num: int):
    k, b, _ = self.sizes(n)
    dtype = np.dtype(self._nbits_dtype(n))
    value = lax.bitcast_convert_type(gathered[:, :4], jnp.float32)
    nbits = gathered[:, 4:4 + dtype.itemsize]
    nbits = nbits[:, 0] if dtype.itemsize == 1 else lax.bitcast_convert_type(nbits, dtype)
    words = gathered[:, 4 + dtype.itemsize:]
    pos, _ = jax.vmap(lambda w, m: golomb.decode_positions(w, m, b, k, n))(words, nbits)
    mean = scatter_mean(jnp.broadcast_to(value[:, None], pos.shape), pos, n, num)
    return jnp.where(jnp.all(jnp.isfinite(value)), mean, jnp.nan)

  def _sync(self, X, state: SBCState, ctx: Ctx):
    n = X.shape[-1]
    acc = state.accumulated if self.delay > 1 else 0.0
    a = state.residual + (acc + X)
    payload, local, value = jax.vmap(self._encode)(a)
    if ctx.axis.name is None:
      mean = jnp.where(jnp.isfinite(value)[:, None], local, jnp.nan)
    else:
      gathered = jnp.swapaxes(ops.allgather(payload, ctx.axis), 0, 1)
      mean = jax.vmap(lambda p: self._mean(p, n, ctx.axis.size))(gathered)
    residual = jnp.where(jnp.isfinite(a), a - local, 0.0)
    return mean - acc, local, SBCState(jnp.zeros_like(state.accumulated), residual)

  def _local(self, X, state: SBCState):
    acc = state.accumulated + X
    acc = jnp.where(jnp.isfinite(acc), acc, 0.0)
    return X, jnp.zeros_like(X), SBCState(acc, state.residual)

  def __call__(self, X, extra, ctx: Ctx):
    if self.delay == 1:
      return self._sync(X, extra, ctx)
    return lax.cond(ctx.phase % self.delay == self.delay - 1,
                    lambda: self._sync(X, extra, ctx), lambda: self._local(X, extra))

  def wire_bytes(self, view, group):
    (n,) = view
    _, _, cap = self.sizes(n)
    return group * (4 + np.dtype(self._nbits_dtype(n)).itemsize + golomb.words_for(cap))


def sbc(sparsity: float = 0.01, delay: int = 1, axis_name: AxisName = None,
        capacity: float | None = None, seed: int = 0):
  """Sparse Binary Compression: communication delay + binarized top-p + Golomb positions.

  Place it after the optimizer: its input is each worker's local parameter
  update, e.g. ``optax.chain(optax.sgd(lr), jaxcomp.sbc(axis_name="data"))``.
  Steps are grouped in periods of ``delay``: on the first ``delay - 1`` steps
  of a period the update passes through unchanged (each worker moves locally)
  and is added to the accumulated local update ``dW``. On the last step of the
  period (every step when ``delay=1``) each worker forms
  ``A = residual + dW + update`` and, per leaf of n entries with
  ``k = ceil(sparsity * n)``, takes the k largest positive entries of A and
  the k largest of -A, with mean magnitudes mu+ and mu-; it sends the side
  with the larger mean as one float32 value (mu+ or -mu-) and its positions,
  as gaps Golomb-coded with ``b* = 1 + floor(log2(ln(phi - 1) /
  ln(1 - sparsity)))`` (:mod:`jaxcomp.collectives.golomb`) in a fixed-size
  bit buffer plus the stream length. Payloads are all-gathered and decoded in
  XLA; the output is ``mean_sent - dW``, so every worker ends at the last
  sync point plus the mean of what the workers sent (bit-identical replicas
  with ``delay=1``; up to float rounding of the local accumulation
  otherwise). What was not sent, ``A - sent``, stays in the residual; ``dW``
  restarts from 0.

  :func:`jaxcomp.wire_bytes` gives the bytes of one sync step; the average
  per step is that divided by ``delay``. A period is counted from the state's
  ``phase`` (the step count modulo 2^32, which keeps counting where ``count``
  saturates), so the first sync is at step ``delay - 1`` (0-based). The state
  holds the accumulated update (only when ``delay > 1``) and the residual in
  ``state.extra`` (one :class:`SBCState` per group of same-size leaves,
  stacked ``(G, n)``).
  Non-finite values: on a sync step a worker whose A holds a NaN or Inf
  sends a NaN value, so every worker's output is NaN and :func:`jaxcomp.build`
  skips the step on all replicas together (state kept as it was, the
  accumulated update and residual included; the next sync is one period
  later). A local step communicates nothing: a non-finite update makes only
  that worker's output NaN, and its accumulated update ignores the step.

  Args:
    sparsity: p, the fraction of each leaf's entries per side, in (0, 1]
      (default 0.01).
    delay: local steps per communication, an int >= 1 (the paper trades it
      against sparsity; 1 syncs every step).
    axis_name: the data-parallel axis, or None for a local round trip.
    capacity: the bit buffer of a leaf as a multiple of the expected stream
      length ``k * expected_bits_per_position(sparsity)``; positions whose
      codes do not fit are not sent and stay in the residual. None (default)
      sizes it at ``golomb.max_stream_bits``, which no set of k positions
      exceeds (about 4-6% above the expected length at p = 0.001-0.01).
    seed: seeds the state's key (SBC itself draws nothing).

  References:
    Sattler, Wiedemann, Müller & Samek, *Sparse Binary Compression: Towards
    Distributed Deep Learning with minimal Communication*, IJCNN 2019
    (arXiv:1805.08768): communication delay, the binarization and the
    Golomb position code. The binarization and the code follow
    ALGORITHMS.md, which recalls them from the paper; the unary-first bit
    layout is ours (the same bits as interleaved codewords, decodable in
    parallel).
  """
  p = _args.ratio("sparsity", sparsity)
  d = _args.integer("delay", delay, 1, 2 ** 31 - 1)  # the step count is int32
  if golomb.golomb_b_star(p) > 30:
    raise ValueError(f"sparsity must be >= 1e-9 (Golomb-coded positions need b <= 30), got sparsity={sparsity!r}")
  if capacity is not None:
    capacity = _args.positive("capacity", capacity)
  exchange = SBCExchange(p, d, capacity)
  return build(Method("sbc", flat_route(exchange), Memory(enabled=False)), axis_name, seed)
