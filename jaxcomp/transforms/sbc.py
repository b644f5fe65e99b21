"""Sparse Binary Compression: communication delay, binarized top-p, Golomb-coded positions.

Placement of :func:`sbc`:

- ``delay > 1`` (communication delay): SBC compresses each worker's local
  parameter update, the optimizer's output, so it wraps the optimizer:
  ``jaxcomp.sbc(delay=4, axis_name="data", optimizer=optax.sgd(lr, momentum=0.9))``
  is a complete optimizer, used in place of ``optax.sgd(...)`` (alone or as
  the last element of an ``optax.chain``: gradient transforms such as
  clipping go before it, nothing after it). Every step it runs
  ``optimizer`` on the gradients and SBC on the optimizer's updates (it is
  ``optax.chain(optimizer, <SBC>)``), and its output is the parameter
  update to apply unchanged (``optax.apply_updates``). Without
  ``optimizer`` a ``ValueError`` is raised at construction: placed before an
  optimizer, the order of the other methods, a sync step's output (the step
  to the shared anchor, below) would be scaled by it and the replicas would
  drift apart.
- ``delay=1`` (a sync every step): plain sparse binary compression of its
  input, placed like the other methods, before the optimizer:
  ``optax.chain(jaxcomp.sbc(axis_name="data"), optax.sgd(lr))``; or with
  ``optimizer=``, which compresses the optimizer's update instead.

Steps are grouped in periods of ``delay``: on the first ``delay - 1`` steps
of a period the update passes through unchanged (each worker moves
locally). On the last step of the period (every step when ``delay=1``) each
worker forms ``A = residual + (params - anchor) + update``, where
``anchor`` holds the parameters at the last sync (the same on every
worker) and ``params - anchor`` is thus how far the worker moved locally
(0 with ``delay=1``), and, per leaf of n entries with
``k = ceil(sparsity * n)``, takes the k largest positive entries of A and
the k largest of -A, with mean magnitudes mu+ and mu-; it sends the side
with the larger mean as one float32 value (mu+ or -mu-) and its positions.
The positions of all leaves of a bucket travel as one stream of gaps
Golomb-coded with ``b* = 1 + floor(log2(ln(phi - 1) / ln(1 - sparsity)))``
(:mod:`jaxcomp.collectives.golomb`) in a fixed-size bit buffer plus the
stream length. Payloads are all-gathered (one all-gather per bucket) and
decoded in XLA. What was not sent, ``A - sent``, stays in the residual.

The output of a sync step with ``delay=1`` is the mean of what the workers
sent. With ``delay > 1`` the new sync point is ``anchor' = anchor + mean``
(float32, computed from values every worker shares: the same bits
everywhere) and the output is ``anchor' - params``, so that
``params + output`` lands on ``anchor'``: the replicas meet at every sync.
Exactly, on every worker, for float32 parameters whenever
``anchor' - params`` is exact in float32 (by Sterbenz's lemma, whenever
``params`` and ``anchor'`` have the same sign and are within a factor 2 of
each other: every parameter whose local moves of a period are small
against it); otherwise (a parameter crossing zero in the period) within
half an ulp of ``anchor' - params``. The anchor is kept in the state, so
such rounding is never carried to the next period: replicas meet again at
every sync, whatever the length of the run (summing the local updates
instead left float rounding that grew with it). This needs the
parameters: call ``tx.update(grads, state, params)`` (``optax.chain``
passes them on; they must be identical on every worker at the first
step). The first step takes them as the anchor.

:func:`jaxcomp.wire_bytes` gives the bytes of one sync step; the average
per step is that divided by ``delay``. A period is counted from the state's
``phase`` (the step count modulo 2^32, which keeps counting where ``count``
saturates), so the first sync is at step ``delay - 1`` (0-based). SBC's
state is a :class:`jaxcomp.CompressState` with one :class:`SBCState` per
bucket in ``extra``: the anchor (only when ``delay > 1``) and the
residual, in the bucket's layout. With ``optimizer`` the state is
``optax.chain``'s tuple ``(optimizer's state, SBC's state)`` and the
result carries the SBC transformation alone as ``.compressor`` (as
:func:`jaxcomp.onebit_adam` does): :func:`jaxcomp.wire_bytes` and
:func:`jaxcomp.steady` read it from the result; pass it to
:func:`jaxcomp.memory_tree` with ``state[1]``. Leaves that travel dense
(``min_size``, ``dense``) are averaged every step, local steps included.
Non-finite values: on a sync step a worker whose A holds a NaN or Inf
sends a NaN value, so every worker's output is NaN and :func:`jaxcomp.build`
skips the step on all replicas together (state kept as it was, the
anchor and residual included; the period then lasts until the next sync).
A local step communicates nothing: a non-finite update makes only that
worker's output NaN.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp.collectives import golomb, ops, packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import layout, policy
from jaxcomp.core.builder import build
from jaxcomp.core.compression import compressed_optimizer
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Exchange, Memory, StepContext, flat_route
from jaxcomp.kernels import binarize, compaction
from jaxcomp.kernels.sparse import scatter_mean, zeros_after
from jaxcomp.transforms import _args


class SBCState(NamedTuple):
  """Per bucket: the shared anchor, the residual and whether the anchor is set.

  ``anchor``: the parameters every worker holds after the last sync (float32,
  the bucket's layout; ``(0,)`` with ``delay=1``), the same bits on every
  worker. ``residual``: what this worker has not sent yet. ``anchored``:
  False until the first step with ``delay > 1`` takes the parameters as the
  anchor.
  """

  anchor: jax.Array
  residual: jax.Array
  anchored: jax.Array


@dataclasses.dataclass(frozen=True)
class SBCExchange(Exchange):
  """Local steps, then a sync: binarize every segment, Golomb-code, all-gather, decode, mean.

  A sync works on the whole bucket: per segment (leaf) the top-k of each
  side, the side's mean and the choice between them are found together for
  all segments (a bisection on the float bit patterns, see
  :func:`jaxcomp.kernels.binarize.sided_thresholds`), and the positions of the whole bucket travel as ONE
  Golomb stream (the gaps between consecutive selected positions of the
  bucket; the decoder knows the segment of a position from the static
  layout). The payload, one uint8 buffer and one all-gather per bucket: a
  float32 value per segment (``mu+`` or ``-mu-``), the stream length (1, 2
  or 4 bytes, the narrowest that holds the capacity) and the bit buffer.
  The state (``extra``) of a bucket is an :class:`SBCState`.
  """

  sparsity: float
  delay: int
  capacity: float | None
  carries_nonfinite = True  # a non-finite A sends a NaN value, and every decoded mean is NaN
  block = 128  # rows for the per-segment counts; 4 mask words, so no word straddles two segments

  @property
  def wants_params(self) -> bool:
    return self.delay > 1

  def sizes(self, segs: layout.Segments):
    """``(k, b, capacity_bits)`` of a bucket: ``k`` per segment (numpy), the stream's ``b`` and capacity."""
    k = np.asarray([_args.ratio_count(self.sparsity, n) for n in segs.sizes], np.int64)
    b = golomb.golomb_b_star(self.sparsity)
    worst = golomb.max_stream_bits(int(k.sum()), segs.length, b)
    if self.capacity is None:
      return k, b, worst
    expected = int(k.sum()) * golomb.expected_bits_per_position(self.sparsity, b)
    return k, b, max(1, min(worst, int(np.ceil(self.capacity * expected))))

  def _nbits_dtype(self, segs):
    return _args.index_dtype(self.sizes(segs)[2] + 1)

  def init_bucket(self, segs, key):
    del key
    n = segs.length
    return SBCState(jnp.zeros((n if self.delay > 1 else 0,), jnp.float32), jnp.zeros((n,), jnp.float32),
                    jnp.zeros((), jnp.bool_))

  def bucket_wire_bytes(self, segs, workers=None):
    _, _, cap = self.sizes(segs)
    return 4 * segs.count + np.dtype(self._nbits_dtype(segs)).itemsize + golomb.words_for(cap)

  def _encode(self, bits, finite, segs):
    """This worker's payload, the positions it sends (``n`` in unused slots) and the value of each.

    ``bits``: the int32 bit patterns of the bucket with its non-finite entries set to 0;
    ``finite``: whether none was.
    """
    kk, b, cap = self.sizes(segs)
    n, total = segs.length, int(kk.sum())
    k = jnp.asarray(kk, jnp.int32)
    a = lax.bitcast_convert_type(bits, jnp.float32)
    tp, tn = binarize.sided_thresholds(bits, segs, kk)
    tp, tn = jnp.maximum(tp, 1), jnp.maximum(tn, 1)  # a side with fewer than k entries: all of them
    # a negative entry's pattern is INT32_MIN + its magnitude pattern: each side's masks are plain compares
    tp_e, tn_e = segs.spread(tp), segs.spread(tn + jnp.int32(-2 ** 31))
    above_p, tie_p = bits > tp_e, bits == tp_e
    above_n, tie_n = (bits < 0) & (bits > tn_e), bits == tn_e

    # Per segment, for each side: entries above the threshold, entries at it, the sum above it
    # (one variadic row reduction per dtype: Segments.sums).
    counts = segs.sums(*(v.astype(jnp.int32) for v in (above_p, tie_p, above_n, tie_n))).T
    sums = segs.sums(jnp.where(above_p, a, 0.0), jnp.where(above_n, -a, 0.0)).T

    def side(strict, at, summed, t):
      count = jnp.minimum(k, strict + at)
      tied = count - strict  # entries equal to the threshold that make up the k
      return (summed + tied * lax.bitcast_convert_type(t, jnp.float32)) / jnp.maximum(count, 1), tied

    mup, tied_p = side(counts[:, 0], counts[:, 1], sums[:, 0], tp)
    mun, tied_n = side(counts[:, 2], counts[:, 3], sums[:, 1], tn)
    plus = mup >= mun
    value = jnp.where(plus, mup, -mun)
    plus_e = segs.spread(plus)
    strict = compaction.pack_mask(jnp.where(plus_e, above_p, above_n))
    ties = compaction.pack_mask(jnp.where(plus_e, tie_p, tie_n))
    # of the entries tied at the threshold, the first of each segment (in index order) make up the k
    kept, _ = compaction.cap_segments(ties, segs, jnp.where(plus, tied_p, tied_n))
    words = strict | kept
    pos, count = compaction.compact(words, n, total)
    stream, nbits, sent = golomb.encode_positions(pos, count, n, b, cap)
    pos = jnp.where(jnp.arange(total) < sent, pos, n)
    flagged = jnp.where(finite, value, jnp.nan).astype(jnp.float32)
    payload = (flagged, nbits.astype(self._nbits_dtype(segs)), stream)
    return payload, pos, value[compaction.segment_of(pos, segs)]

  def _mean(self, gathered: packing.Gathered, segs, num: int):
    kk, b, _ = self.sizes(segs)
    n, total = segs.length, int(kk.sum())

    def sparse(w):
      value, nbits, stream = gathered.payload(w)
      pos, _ = golomb.decode_positions(stream, nbits, b, total, n)
      return value[compaction.segment_of(pos, segs)], pos

    mean = scatter_mean(sparse, gathered, n, num)
    values = gathered.payloads()[0]  # one float32 per segment and worker
    return jnp.where(jnp.all(jnp.isfinite(values)), mean, jnp.nan)

  def _exchange_sent(self, bits, finite, segs, ctx: StepContext):
    """Every worker sends its binarized bucket (``bits``, as :meth:`_encode`): the mean of what was sent,
    and what this worker sent, dense and as positions with their values."""
    payload, pos, values = self._encode(bits, finite, segs)
    local = zeros_after(segs.length, values).at[pos].set(values, mode="drop")
    if ctx.axis.name is None:
      return jnp.where(jnp.all(jnp.isfinite(payload[0])), local, jnp.nan), local, pos, values
    gathered = ops.allgather_payload(payload, ctx.axis)
    return self._mean(gathered, segs, ctx.axis.size), local, pos, values

  def _sync(self, x, segs, state: SBCState, ctx: StepContext, params, anchor):
    if params is None:  # delay=1: every worker is at the last sync point
      a = state.residual + x
    else:
      a = state.residual + ((params - anchor) + x)
    finite = jnp.isfinite(a)
    # a count per segment (Segments.sum fuses with the sum): jnp.all over the bucket would write the mask out
    all_finite = jnp.all(segs.sum((~finite).astype(jnp.int32)) == 0)
    # the one bucket-sized vector the sync writes besides its outputs: int32, as the threshold search reads it
    bits = jnp.where(finite, lax.bitcast_convert_type(a, jnp.int32), 0)
    mean, local, pos, values = self._exchange_sent(bits, all_finite, segs, ctx)
    # what was not sent: a - local (0 where a is not finite), written only at the positions sent
    rest = lax.bitcast_convert_type(lax.bitcast_convert_type(bits[pos], jnp.float32) - values, jnp.int32)
    residual = lax.bitcast_convert_type(bits.at[pos].set(rest, mode="drop"), jnp.float32)
    if params is None:
      return mean, local, SBCState(state.anchor, residual, state.anchored)
    target = anchor + mean  # the next sync point, the same bits on every worker
    return target - params, local, SBCState(target, residual, jnp.ones((), jnp.bool_))

  def exchange(self, x, segs, extra, ctx: StepContext):
    if self.delay == 1:
      return self._sync(x, segs, extra, ctx, None, None)
    params = ctx.params
    if params is None:
      raise ValueError(
          f"sbc with delay={self.delay} needs the parameters: call tx.update(updates, state, params)"
          " (optax.chain passes them on); the output of a sync step is computed from them so that"
          " every worker ends the sync at the same parameters.")
    anchor = jnp.where(extra.anchored, extra.anchor, params)

    def local_step():
      return x, jnp.zeros_like(x), SBCState(anchor, extra.residual, jnp.ones((), jnp.bool_))

    return lax.cond(ctx.phase % self.delay == self.delay - 1,
                    lambda: self._sync(x, segs, extra, ctx, params, anchor), local_step)


def _delay_needs_optimizer(delay: int) -> str:
  """The construction error of ``sbc(delay > 1)`` without ``optimizer``: why, and the fix."""
  return (
      f"sbc with delay={delay} must wrap the local optimizer: use jaxcomp.sbc(delay={delay},"
      " optimizer=optax.sgd(0.1)) (your optimizer, your other arguments) in place of the optimizer,"
      " with nothing after it. With a communication delay SBC accumulates each worker's local updates"
      " (the optimizer's output) and, at a sync, outputs the step that lands every replica on the new"
      f" shared anchor: an optimizer after it, as in optax.chain(jaxcomp.sbc(delay={delay}),"
      " optax.sgd(0.1)), would scale that step and the replicas would drift apart."
      f" optax.chain(optax.sgd(lr), jaxcomp.sbc(delay={delay})) is now written"
      f" jaxcomp.sbc(delay={delay}, optimizer=optax.sgd(lr)); delay=1 needs no optimizer.")


def _check_optimizer(optimizer, delay: int) -> None:
  """sbc's ``optimizer``: required with ``delay > 1``; an optax transformation where given."""
  if optimizer is None and delay > 1:
    raise ValueError(_delay_needs_optimizer(delay))
  if optimizer is not None and not (callable(getattr(optimizer, "init", None))
                                    and callable(getattr(optimizer, "update", None))):
    raise TypeError("optimizer must be an optax GradientTransformation, e.g. optax.sgd(0.1),"
                    f" got {optimizer!r}")


@_args.factory
def sbc(sparsity: float = 0.01, delay: int = 1, *, axis_name: AxisName = None,
        capacity: float | None = None, seed: int = 0, bucket_bytes: int | None = None,
        min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather",
        optimizer: optax.GradientTransformation | None = None):
  """Sparse Binary Compression: communication delay + binarized top-p + Golomb positions.

  With ``delay > 1`` it wraps the local optimizer (``optimizer=``): the
  result is a complete optimizer, used in place of ``optax.sgd(...)`` with
  nothing after it. With ``delay=1`` it goes before the optimizer like the
  other methods. Placement, the sync schedule, the anchor at which the
  replicas meet at every sync, the state and non-finite steps are described
  in :mod:`jaxcomp.transforms.sbc`.

  Args:
    sparsity: p, the fraction of each leaf's entries per side, in (0, 1]
      (default 0.01).
    delay: local steps per communication, an int >= 1 (the paper trades it
      against sparsity; 1 syncs every step). ``delay > 1`` needs ``optimizer``.
    axis_name: the data-parallel axis, or None for a local round trip.
    capacity: the bit buffer of a bucket as a multiple of the expected stream
      length ``K * expected_bits_per_position(sparsity)`` (K: the sum of the
      leaves' k); positions whose codes do not fit (the last ones of the
      bucket) are not sent and stay in the residual. None (default) sizes it
      at ``golomb.max_stream_bits``, which no set of K positions exceeds
      (about 4-6% above the expected length at p = 0.001-0.01).
    seed: seeds the state's key (SBC itself draws nothing).
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`; by default every leaf is compressed (``min_size=0``), see
      :data:`jaxcomp.core.policy.EVERY_LEAF`.
    transport: ``"gather"`` only: its sync schedule and Golomb stream have no
      scatter form; ``"scatter"`` raises.
    optimizer: the local optimizer SBC wraps (an optax
      ``GradientTransformation``, e.g. ``optax.sgd(lr, momentum=0.9)``):
      required with ``delay > 1``; optional with ``delay=1``. With it the
      result is a complete optimizer (its input: the gradients); without it,
      SBC alone (its input: what it compresses).

  Returns:
    Without ``optimizer``: the jaxcomp transformation. With it: an optax
    ``GradientTransformationExtraArgs``, ``optax.chain(optimizer, <SBC>)``,
    with ``.compressor``, the SBC transformation.

  Raises:
    ValueError: ``delay > 1`` without ``optimizer`` (the message shows the
      fix), or a bad argument.

  Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import jaxcomp
    >>> params = {"w": jnp.zeros((256, 64))}
    >>> tx = jaxcomp.sbc(sparsity=0.01, delay=4, optimizer=optax.sgd(0.1))  # axis_name=None: one worker
    >>> jaxcomp.wire_bytes(tx, params)  # a sync step: a float32 value, a length, Golomb-coded positions
    182

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
    raise ValueError(
        f"sparsity must be >= 1e-9 (Golomb-coded positions need b <= 30), got sparsity={sparsity!r}")
  if capacity is not None:
    capacity = _args.positive("capacity", capacity)
  _check_optimizer(optimizer, d)
  method = Method("sbc", flat_route(SBCExchange(p, d, capacity)), Memory(enabled=False),
                  sync_every=d, min_size=policy.EVERY_LEAF)
  tx = build(method, axis_name, seed, bucket_bytes, min_size, dense, dense_axis_name=dense_axis_name,
             transport=transport)
  if optimizer is None:
    return tx
  return compressed_optimizer(optax.chain(optimizer, tx), tx)
