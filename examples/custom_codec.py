"""A new codec in under 40 lines (docs/adding-a-method.md): int8 with one absmax scale per leaf."""

import dataclasses

import jax.numpy as jnp

import jaxcomp
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, CodecExchange, Memory, flat_route


@dataclasses.dataclass(frozen=True)
class Int8Codec(Codec):
  """Round to the nearest of 255 levels in [-max|x|, max|x|] per leaf: 1 byte an entry, 4 a leaf."""

  def encode(self, x, key, segs):
    scale = segs.max(jnp.abs(x)) / 127.0  # one float32 per segment (a leaf)
    q = jnp.round(x / jnp.maximum(segs.spread(scale), jnp.finfo(jnp.float32).tiny))
    return q.astype(jnp.int8), scale

  def decode(self, payload, key, segs):
    q, scale = payload
    return q.astype(jnp.float32) * segs.spread(scale)


def int8(error_feedback: bool = True, *, axis_name=None, **build_kwargs):
  """Int8 gradients with error feedback, as an optax transformation (``build_kwargs``: see jaxcomp.build)."""
  method = Method("int8", flat_route(CodecExchange(Int8Codec())), Memory(enabled=error_feedback))
  return jaxcomp.build(method, axis_name, **build_kwargs)
