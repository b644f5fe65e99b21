"""Sign methods: signSGD with majority vote, and EF-signSGD (scaled signs, memory)."""

from __future__ import annotations

import dataclasses

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
