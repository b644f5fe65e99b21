"""QSGD: stochastic rounding of |x| / ||x|| to s levels, levels packed narrow."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxcomp.collectives import packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import Codec, CodecExchange, Memory, Method, build, flat_route
from jaxcomp.transforms import _args


def level_bits(levels: int) -> int:
  """Bits of one field holding a signed level in [-s, s] (offset by s): 2, 4 or 8."""
  span = 2 * levels + 1
  for bits in (2, 4, 8):
    if span <= 2 ** bits:
      return bits
  raise ValueError(f"levels must be <= 127, got levels={levels}")


@dataclasses.dataclass(frozen=True)
class QSGDCodec(Codec):
  """Payload: the float32 norm and n signed levels packed in 2, 4 or 8 bits each."""

  levels: int

  def encode(self, x, key):
    s = self.levels
    norm = jnp.linalg.norm(x)
    safe = jnp.where(norm > 0, norm, 1.0)
    scaled = jnp.abs(x) / safe * s
    level = jnp.floor(scaled + jax.random.uniform(key, x.shape, jnp.float32))
    level = jnp.clip(level, 0, s)  # u < 1 and scaled <= s, the clip only guards rounding
    q = jnp.sign(x) * level + s    # in [0, 2s]
    return norm, packing.pack(q.astype(jnp.uint8), level_bits(s))

  def decode(self, payload, key, n):
    norm, words = payload
    s = self.levels
    q = packing.unpack(words, level_bits(s), n).astype(jnp.float32) - s
    return norm / s * q


def qsgd(levels: int = 127, axis_name: AxisName = None, error_feedback: bool = False, seed: int = 0):
  """QSGD: unbiased stochastic quantization to ``levels`` levels per sign.

  Each entry becomes ``sign(x) * l`` with ``l = floor(s |x| / ||x||_2 + u)``,
  ``u ~ U[0, 1)``, so ``E[norm / s * l] = |x|``. The payload is the float32
  norm plus one field per entry packed in 2 bits (s = 1), 4 bits (s <= 7) or
  8 bits (s <= 127). Norms differ between workers, so payloads are
  all-gathered and each worker decodes and averages them. Each worker rounds
  with its own key (the shared key folded with its index).

  Args:
    levels: s in [1, 127]; GRACE's default 127 (its benchmarks use 64).
    axis_name: the data-parallel axis, or None.
    error_feedback: off by default (QSGD is unbiased); on, the rounding error
      is carried.
    seed: seeds the key.

  References:
    Alistarh et al., *QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding*, NeurIPS 2017, Sec. 3.1.
  """
  s = _args.integer("levels", levels, 1, 127)
  ef = _args.flag("error_feedback", error_feedback)
  return build(Method("qsgd", flat_route(CodecExchange(QSGDCodec(s))), Memory(enabled=ef)), axis_name, seed)
