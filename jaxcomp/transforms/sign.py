"""Sign methods: signSGD and Signum (majority vote), EF-signSGD, 1-bit SGD (scaled signs, memory).

Every codec here works on a whole bucket: the sign bits of all its leaves are
packed together, and a per-leaf quantity (a scale, two means) is one float32
per segment, from the segment reductions of :class:`jaxcomp.core.layout.Segments`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.collectives import ops, packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core.builder import build
from jaxcomp.core.layout import ROW, Segments
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, CodecExchange, Memory, flat_route, zero_after
from jaxcomp.exchanges.scatter import ScatterCodec
from jaxcomp.transforms import _args

TIES = ("zero", "positive")


def majority_vote(gathered: packing.Gathered, n: int, ties: str = "zero") -> jnp.ndarray:
  """sign(sum over workers of +-1) from the gathered payloads, each ending in ``ceil(n/8)`` packed
  sign words (read inside the loop over workers).

  ``ties="zero"``: a tie gives 0; ``"positive"``: a tie gives +1 (GRACE's
  rule, ``sum >= 0 -> +1``), so the output is always +-1.
  """
  def body(w, acc):
    return acc + 2 * packing.unpack(gathered.payload(w)[-1], 1, n).astype(jnp.int32) - 1

  zeros = ops.like_vma(jnp.zeros((n,), jnp.int32), gathered.buffers)
  votes = lax.fori_loop(0, gathered.workers, body, zeros)
  if ties == "positive":
    return jnp.where(votes >= 0, 1.0, -1.0).astype(jnp.float32)
  return jnp.sign(votes).astype(jnp.float32)


def pack_by_segment(x: jax.Array, segs: Segments):
  """``pack_checked(x >= 0, 1, x)``, each segment's slice packed by itself, or None unless the segments
  lie back to back on whole rows of ``ROW`` entries (then the words and the flag are the same).

  Packed flat (``Codec.by_segment``), a bucket of leaves is a concatenation whose slices XLA folds back
  into the leaves: each leaf's signs are packed where it lies, and the bucket is never written out.
  """
  ends = [o + p for o, p in zip(segs.offsets, segs.padded_sizes)]
  back_to_back = list(segs.offsets) == [0] + ends[:-1] and ends[-1] == x.shape[0]
  if not back_to_back or any(e % ROW for e in ends):
    return None
  rows = x.reshape(-1, ROW)  # whole rows, as the bucket was packed: slices XLA folds into its leaves
  parts = [lax.slice_in_dim(rows, o // ROW, e // ROW).reshape(-1) for o, e in zip(segs.offsets, ends)]
  parts = [packing.pack_checked(v >= 0, 1, v) for v in parts]
  return sum((f for f, _ in parts[1:]), parts[0][0]), jnp.concatenate([w for _, w in parts])


def head_witness(heads: jax.Array) -> jax.Array:
  """A :meth:`~jaxcomp.core.protocol.Codec.witness` from scales that bound every decoded entry (or
  flags, 0 or NaN, added to it): ``2 * sum(|heads|)``, non-finite when a head is or the mean could
  overflow (no decoded entry exceeds its scale, so no mean of them exceeds their sum)."""
  return 2.0 * jnp.sum(jnp.abs(heads.astype(jnp.float32)))


def mean_abs(x: jax.Array, segs: Segments) -> jax.Array:
  """mean(|x|) of each segment (S,), over its true size (padding entries are zero)."""
  return segs.sum(jnp.abs(x)) / jnp.asarray(segs.sizes, jnp.float32)


@dataclasses.dataclass(frozen=True)
class SignCodec(Codec, ScatterCodec):
  """One bit per entry (1 for x >= 0), 8 per byte; combined by majority vote.

  ``scaled``: one float32 per segment too, ``mean|x|``; the local decode is
  ``mean|x| * sign(x)`` and the vote is scaled by the workers' mean of it.
  Unscaled: one float32 flag per bucket instead, 0.0 or NaN when ``x`` holds
  a NaN/Inf (:func:`jaxcomp.collectives.packing.pack_checked`), added to the decode.
  ``ties``: see :func:`majority_vote`. ``by_segment`` (unscaled): each segment's signs packed by
  themselves (:func:`pack_by_segment`), for a bucket that is the leaves themselves (no memory).
  """

  scaled: bool = False
  ties: str = "zero"
  by_segment: bool = False
  carries_nonfinite = True  # the scale is a sum of |x|; unscaled, the flag

  @property
  def block(self) -> int:
    return 128 if self.scaled else 1

  def encode(self, x, key, segs):
    if not self.scaled:
      packed = pack_by_segment(x, segs) if self.by_segment else None
      return packing.pack_checked(x >= 0, 1, x) if packed is None else packed
    return mean_abs(x, segs), packing.pack_signs(x)

  def witness(self, payloads):
    return head_witness(payloads[0])  # the scales bound the decode; unscaled, the flags are added to it

  def decode(self, payload, key, segs):
    if not self.scaled:
      flag, words = payload
      return packing.unpack_signs(words, segs.length) + flag
    scale, words = payload
    return segs.spread(scale) * packing.unpack_signs(words, segs.length)

  def aggregate(self, gathered, key, segs, num):
    vote = majority_vote(gathered, segs.length, self.ties)
    heads = gathered.payloads()[0]  # the flags or the scales: a few bytes a worker
    if not self.scaled:
      return vote + jnp.sum(heads)
    return vote * segs.spread(jnp.mean(heads, axis=0))

  @property
  def owner_codec(self) -> Codec:
    """What a chunk owner sends of its vote under ``transport="scatter"``: a tie's 0 needs a third value."""
    return VoteCodec(self.scaled) if self.ties == "zero" else self


@dataclasses.dataclass(frozen=True)
class VoteCodec(Codec):
  """A vote in {-1, 0, +1} (times one float32 scale per segment), 2 bits per entry: exact on votes.

  The scatter exchange's second phase for the majority vote of :class:`SignCodec`.
  """

  scaled: bool = False

  @property
  def block(self) -> int:
    return 128 if self.scaled else 1

  def encode(self, x, key, segs):
    scale = segs.max_abs(x) if self.scaled else None
    unit = x / segs.spread(jnp.where(scale > 0, scale, 1.0)) if self.scaled else x
    fields = (jnp.clip(jnp.round(unit), -1, 1) + 1).astype(jnp.uint8)
    words = packing.pack(fields, 2)
    return (scale, words) if self.scaled else words

  def decode(self, payload, key, segs):
    scale, words = payload if self.scaled else (None, payload)
    vote = packing.unpack(words, 2, segs.length).astype(jnp.float32) - 1.0
    return segs.spread(scale) * vote if self.scaled else vote


@_args.factory
def signsgd(*, axis_name: AxisName = None, error_feedback: bool = False, seed: int = 0, ties: str = "zero",
            bucket_bytes: int | None = None, min_size: int | None = None, dense=None, dense_axis_name=None,
            transport: str = "gather"):
  """signSGD with majority vote: 1 bit per entry on the wire.

  Each worker sends the packed signs of its gradient (``x >= 0`` counts as +1);
  the output is ``sign(sum of the workers' +-1)``, in {-1, 0, +1} (0 on a tie,
  possible with an even number of workers; ``ties="positive"`` gives +1
  there, as GRACE does). The learning rate of the next transform sets the
  step size. Without error feedback signSGD is biased and may stall (GRACE
  saw it diverge). Besides the bits each worker sends one float32 per bucket,
  NaN if its gradient held a NaN/Inf there (then that bucket's output is NaN
  on every worker); it is computed in the packing's own pass.

  With ``error_feedback=True`` the signs are scaled so that the residual stays
  in gradient units: each worker also sends one float32 per leaf, the scale
  ``mean|x|`` of its compensated gradient ``x``, counts ``mean|x| * sign(x)``
  as sent (the residual is ``x - mean|x| * sign(x)``, EF-signSGD's scaled
  sign) and the output is the majority vote times the workers' mean scale of
  that leaf. (A residual ``x - sign(x)`` would subtract +-1 from a gradient:
  a constant gradient of 0.01 would come out as +1, -1, +1, ...)

  Args:
    axis_name: the data-parallel axis, or None.
    error_feedback: carry ``x - mean|x| * sign(x)`` (see above); default False.
    seed: seeds the state's key (unused).
    ties: what a tied vote gives: ``"zero"`` (default) or ``"positive"`` (+1).
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxcomp
    >>> params = {"w": jnp.zeros((256, 64))}
    >>> tx = jaxcomp.signsgd()  # axis_name=None: one worker, a local round trip
    >>> jaxcomp.wire_bytes(tx, params)  # one bit per entry, 4 bytes of non-finite flag
    2052
    >>> grads = {"w": jnp.full((256, 64), -0.5)}
    >>> updates, state = jax.jit(tx.update)(grads, tx.init(params))
    >>> print(updates["w"][0, :3])  # the sign of each entry
    [-1. -1. -1.]

  References:
    Bernstein et al., *signSGD: Compressed Optimisation for Non-Convex
    Problems*, ICML 2018; *signSGD with Majority Vote is Communication
    Efficient and Fault Tolerant*, ICLR 2019; Karimireddy et al., *Error
    Feedback Fixes SignSGD and other Gradient Compression Schemes*, ICML 2019
    (the scaled sign).
  """
  ef = _args.flag("error_feedback", error_feedback)
  ties = _args.choice("ties", ties, TIES)
  codec = SignCodec(scaled=ef, ties=ties, by_segment=not ef)  # without memory the bucket is the leaves
  return build(Method("signsgd", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed,
               bucket_bytes=bucket_bytes, min_size=min_size, dense=dense, dense_axis_name=dense_axis_name,
               transport=transport)


class ScaledSignCodec(Codec):
  """Packed signs plus one float32 scale, mean(|x|), per segment."""

  block = 128
  carries_nonfinite = True  # a NaN/Inf makes its segment's scale, and so its decode, non-finite

  def encode(self, x, key, segs):
    return mean_abs(x, segs), packing.pack_signs(x)

  def witness(self, payloads):
    return head_witness(payloads[0])  # |decode| = the scale

  def decode(self, payload, key, segs):
    scale, words = payload
    return segs.spread(scale) * packing.unpack_signs(words, segs.length)


@_args.factory
def efsignsgd(lr: float = 0.1, *, axis_name: AxisName = None, seed: int = 0, bucket_bytes: int | None = None,
              min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather"):
  """EF-signSGD: scaled signs with error feedback.

  Memory ``x = e + lr * g``; the payload is ``mean|x|`` of each leaf and the
  packed signs of x; ``e <- x - mean|x| * sign(x)``; the gathered, decoded
  mean is divided by ``lr`` so that the next transform sees gradient units.

  Args:
    lr: the learning rate the memory scales the gradient by (GRACE: 0.1); must
      be > 0.
    axis_name: the data-parallel axis, or None.
    seed: seeds the state's key (unused).
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  References:
    Karimireddy et al., *Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes*, ICML 2019, Algorithm 1.
  """
  g = _args.positive("lr", lr)
  return build(Method("efsignsgd", flat_route(CodecExchange(ScaledSignCodec())), Memory(gamma=g)),
               axis_name, seed, bucket_bytes=bucket_bytes, min_size=min_size, dense=dense,
               dense_axis_name=dense_axis_name, transport=transport)


class MomentumMemory(Memory):
  """Signum's memory: ``m <- beta * m + (1 - beta) * g`` is sent (as signs) and kept.

  Not a residual: what was sent does not change m. A non-finite entry of m is
  reset to 0.
  """

  def __init__(self, beta: float):
    super().__init__()
    self.momentum = beta

  def compensate(self, grads, state):
    b = self.momentum
    return jax.tree.map(lambda g, m: b * m.astype(jnp.float32) + (1.0 - b) * g.astype(jnp.float32),
                        grads, state), None

  def update(self, x, sent, state, step=None):
    # zero_after(sent): m is written after the encode has read the old m (no copy of it)
    return jax.tree.map(lambda x, s, m: jnp.where(jnp.isfinite(x), x, zero_after(s)).astype(m.dtype),
                        x, sent, state)


@_args.factory
def signum(momentum: float = 0.9, *, axis_name: AxisName = None, seed: int = 0, ties: str = "zero",
           bucket_bytes: int | None = None, min_size: int | None = None, dense=None, dense_axis_name=None,
           transport: str = "gather"):
  """Signum: signSGD with local momentum, 1 bit per entry, majority vote.

  Each worker keeps ``m <- momentum * m + (1 - momentum) * g`` and sends the
  packed signs of m (``m >= 0`` counts as +1); the output is the majority vote
  ``sign(sum of the workers' +-1)``, in {-1, 0, +1} (0 on a tie;
  ``ties="positive"`` gives +1 there, as GRACE does). There is no error
  feedback; the learning rate of the next transform sets the step size (use
  it without momentum). As signSGD's, the payload holds one float32 per
  bucket that makes the bucket's output NaN when a worker's momentum is not
  finite there (the step's check then makes all of it NaN).

  Args:
    momentum: beta in [0, 1) (Signum and GRACE: 0.9); 0 is signSGD.
    axis_name: the data-parallel axis, or None.
    seed: seeds the state's key (unused).
    ties: what a tied vote gives: ``"zero"`` (default) or ``"positive"`` (+1).
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  References:
    Bernstein, Wang, Azizzadenesheli & Anandkumar, *signSGD: Compressed
    Optimisation for Non-Convex Problems*, ICML 2018, Algorithm 3 (Signum);
    Bernstein et al., *signSGD with Majority Vote is Communication Efficient
    and Fault Tolerant*, ICLR 2019.
  """
  b = _args.unit_interval("momentum", momentum)
  ties = _args.choice("ties", ties, TIES)
  return build(Method("signum", flat_route(CodecExchange(SignCodec(ties=ties))), MomentumMemory(b)),
               axis_name, seed, bucket_bytes=bucket_bytes, min_size=min_size, dense=dense,
               dense_axis_name=dense_axis_name, transport=transport)


class OneBitCodec(Codec):
  """Packed signs plus two float32 per segment: the mean of its negatives and of its non-negatives.

  Payload: ``means`` (2, S), row 0 the negatives', row 1 the non-negatives', then the words.
  """

  block = 128
  carries_nonfinite = True  # a NaN/Inf makes its side's sum, so that mean and its decodes, non-finite

  def encode(self, x, key, segs):
    words = packing.pack_signs(x)
    # Padding entries are zeros: non-negative, adding nothing to the sums, not counted.
    # One pass for the three sums (Segments.sums).
    neg, pos, n_neg = segs.sums(jnp.minimum(x, 0.0), jnp.maximum(x, 0.0), (x < 0).astype(jnp.float32))
    n_pos = jnp.asarray(segs.sizes, jnp.float32) - n_neg
    means = jnp.stack([neg / jnp.maximum(n_neg, 1.0), pos / jnp.maximum(n_pos, 1.0)])
    return means, words

  def witness(self, payloads):
    return head_witness(payloads[0])  # |decode| = one of its segment's two means

  def decode(self, payload, key, segs):
    means, words = payload
    return jnp.where(packing.unpack(words, 1, segs.length) == 1, segs.spread(means[1]), segs.spread(means[0]))


@_args.factory
def onebit(*, axis_name: AxisName = None, error_feedback: bool = True, seed: int = 0,
           bucket_bytes: int | None = None, min_size: int | None = None, dense=None, dense_axis_name=None,
           transport: str = "gather"):
  """1-bit SGD: one sign bit per entry and two reconstruction values, with error feedback.

  Each leaf is quantized to 1 bit per entry (``x >= 0`` or not), packed 8 per
  byte (the bits of all leaves of a bucket together), and the two values that
  reconstruct it: the mean of its negative entries and the mean of its
  non-negative entries (float32 each; one pair per leaf, as in GRACE). The
  quantization error is carried to the next step (error feedback, on by
  default: 1-bit SGD depends on it). Payloads are all-gathered, decoded and
  averaged.

  Args:
    axis_name: the data-parallel axis, or None.
    error_feedback: carry the quantization error (default True).
    seed: seeds the state's key (unused).
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  References:
    Seide, Fu, Droppo, Li & Yu, *1-Bit Stochastic Gradient Descent and its
    Application to Data-Parallel Distributed Training of Speech DNNs*,
    Interspeech 2014, Sec. 2.
  """
  ef = _args.flag("error_feedback", error_feedback)
  return build(Method("onebit", flat_route(CodecExchange(OneBitCodec())), Memory(enabled=ef)), axis_name,
               seed, bucket_bytes=bucket_bytes, min_size=min_size, dense=dense,
               dense_axis_name=dense_axis_name, transport=transport)
