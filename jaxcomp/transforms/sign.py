"""Sign methods: signSGD and Signum (majority vote), EF-signSGD, 1-bit SGD (scaled signs, memory)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.collectives import packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import Codec, CodecExchange, Memory, Method, build, flat_route
from jaxcomp.transforms import _args


def majority_vote(words: jnp.ndarray, n: int) -> jnp.ndarray:
  """sign(sum over workers of +-1) from ``(N, ceil(n/8))`` packed sign words; ties give 0."""
  def body(w, acc):
    return acc + 2 * packing.unpack(words[w], 1, n).astype(jnp.int32) - 1

  votes = lax.fori_loop(0, words.shape[0], body, jnp.zeros((n,), jnp.int32))
  return jnp.sign(votes).astype(jnp.float32)


class SignCodec(Codec):
  """One bit per entry (1 for x >= 0), 8 per byte; combined by majority vote."""

  def encode(self, x, key):
    return packing.pack_signs(x)

  def decode(self, payload, key, n):
    return packing.unpack_signs(payload, n)

  def aggregate(self, gathered, key, n, num):
    return majority_vote(gathered, n)


def signsgd(axis_name: AxisName = None, error_feedback: bool = False, seed: int = 0):
  """signSGD with majority vote: 1 bit per entry on the wire, no scale.

  Each worker sends the packed signs of its gradient (``x >= 0`` counts as +1);
  the output is ``sign(sum of the workers' +-1)``, in {-1, 0, +1} (0 on a tie,
  possible with an even number of workers). The learning rate of the next
  transform sets the step size. Without error feedback signSGD is biased and
  may stall (GRACE saw it diverge); ``error_feedback=True`` carries
  ``x - sign(x)``.

  References:
    Bernstein et al., *signSGD: Compressed Optimisation for Non-Convex
    Problems*, ICML 2018; *signSGD with Majority Vote is Communication
    Efficient and Fault Tolerant*, ICLR 2019.
  """
  ef = _args.flag("error_feedback", error_feedback)
  return build(Method("signsgd", flat_route(CodecExchange(SignCodec())), Memory(enabled=ef)), axis_name, seed)


class ScaledSignCodec(Codec):
  """Packed signs plus one float32 scale, mean(|x|), per leaf."""

  def encode(self, x, key):
    return jnp.mean(jnp.abs(x)), packing.pack_signs(x)

  def decode(self, payload, key, n):
    scale, words = payload
    return scale * packing.unpack_signs(words, n)


def efsignsgd(lr: float = 0.1, axis_name: AxisName = None, seed: int = 0):
  """EF-signSGD: scaled signs with error feedback.

  Memory ``x = e + lr * g``; the payload is ``mean|x|`` and the packed signs
  of x; ``e <- x - mean|x| * sign(x)``; the gathered, decoded mean is divided
  by ``lr`` so that the next transform sees gradient units.

  Args:
    lr: the learning rate the memory scales the gradient by (GRACE: 0.1); must
      be > 0.

  References:
    Karimireddy et al., *Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes*, ICML 2019, Algorithm 1.
  """
  g = _args.positive("lr", lr)
  return build(Method("efsignsgd", flat_route(CodecExchange(ScaledSignCodec())), Memory(gamma=g)),
               axis_name, seed)


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
                        grads, state)

  def update(self, x, sent, state):
    return jax.tree.map(lambda x, m: jnp.where(jnp.isfinite(x), x, 0.0).astype(m.dtype), x, state)


def signum(momentum: float = 0.9, axis_name: AxisName = None, seed: int = 0):
  """Signum: signSGD with local momentum, 1 bit per entry, majority vote.

  Each worker keeps ``m <- momentum * m + (1 - momentum) * g`` and sends the
  packed signs of m (``m >= 0`` counts as +1); the output is the majority vote
  ``sign(sum of the workers' +-1)``, in {-1, 0, +1} (0 on a tie). There is no
  error feedback; the learning rate of the next transform sets the step size
  (use it without momentum).

  Args:
    momentum: beta in [0, 1) (Signum and GRACE: 0.9); 0 is signSGD.
    axis_name: the data-parallel axis, or None.
    seed: seeds the state's key (unused).

  References:
    Bernstein, Wang, Azizzadenesheli & Anandkumar, *signSGD: Compressed
    Optimisation for Non-Convex Problems*, ICML 2018, Algorithm 3 (Signum);
    Bernstein et al., *signSGD with Majority Vote is Communication Efficient
    and Fault Tolerant*, ICLR 2019.
  """
  b = _args.unit_interval("momentum", momentum)
  return build(Method("signum", flat_route(CodecExchange(SignCodec())), MomentumMemory(b)), axis_name, seed)


class OneBitCodec(Codec):
  """Packed signs plus two float32: the mean of the negatives and of the non-negatives."""

  def encode(self, x, key):
    # Counts from the packed bits and sums of min/max(x, 0): reductions that
    # XLA:CPU vectorizes (a masked sum or a count of compares it does not).
    words = packing.pack_signs(x)
    n_pos = jnp.sum(lax.population_count(words).astype(jnp.int32))
    n_neg = x.shape[0] - n_pos
    means = jnp.stack([
        jnp.sum(jnp.minimum(x, 0.0)) / jnp.maximum(n_neg, 1),
        jnp.sum(jnp.maximum(x, 0.0)) / jnp.maximum(n_pos, 1)])
    return means, words

  def decode(self, payload, key, n):
    means, words = payload
    return jnp.where(packing.unpack(words, 1, n) == 1, means[1], means[0])


def onebit(axis_name: AxisName = None, error_feedback: bool = True, seed: int = 0):
  """1-bit SGD: one sign bit per entry and two reconstruction values, with error feedback.

  Each leaf is quantized to 1 bit per entry (``x >= 0`` or not), packed 8 per
  byte, and the two values that reconstruct it: the mean of its negative
  entries and the mean of its non-negative entries (float32 each; one pair
  per leaf, as in GRACE). The quantization error is carried to the next step
  (error feedback, on by default: 1-bit SGD depends on it). Payloads are
  all-gathered, decoded and averaged.

  Args:
    axis_name: the data-parallel axis, or None.
    error_feedback: carry the quantization error (default True).
    seed: seeds the state's key (unused).

  References:
    Seide, Fu, Droppo, Li & Yu, *1-Bit Stochastic Gradient Descent and its
    Application to Data-Parallel Distributed Training of Speech DNNs*,
    Interspeech 2014, Sec. 2.
  """
  ef = _args.flag("error_feedback", error_feedback)
  return build(Method("onebit", flat_route(CodecExchange(OneBitCodec())), Memory(enabled=ef)), axis_name, seed)
