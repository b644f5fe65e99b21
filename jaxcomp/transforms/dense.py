"""Dense baselines: the plain mean, and casts to 16-bit floats before the allreduce."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxcomp.collectives.axis import AxisName
from jaxcomp.transforms import _args
from jaxcomp.core import DENSE, Codec, CodecExchange, Memory, Method, build, flat_route


def none(axis_name: AxisName = None, bucket_bytes: int | None = None, dense_axis_name: AxisName = None,
         exchange: str = "gather"):
  """No compression: the mean over ``axis_name`` in float32 (``lax.pmean``).

  The baseline every method is compared with: 4 bytes per element on the wire.

  Args:
    axis_name, bucket_bytes, dense_axis_name: see :func:`jaxcomp.build`.
    exchange: ``"gather"`` or ``"scatter"``: the same all-reduce (its bytes are flat in N already).

  References:
    Xu et al., *GRACE: A Compressed Communication Framework for Distributed
    Machine Learning*, ICDCS 2021 (the "none" compressor, Sec. 3).
  """
  return build(Method("none", flat_route(DENSE), Memory(enabled=False)), axis_name, bucket_bytes=bucket_bytes,
               dense_axis_name=dense_axis_name, exchange=exchange)


@dataclasses.dataclass(frozen=True)
class CastCodec(Codec):
  """Cast to a 16-bit float, psum in it, cast back (payload = the cast values)."""

  dtype: str
  linear = True
  carries_nonfinite = True  # NaN/Inf survive the cast and the psum

  def encode(self, x, key, segs):
    return x.astype(self.dtype)

  def decode(self, payload, key, segs):
    return payload.astype(jnp.float32)


def _cast(name: str, dtype: str, axis_name: AxisName, error_feedback: bool, bucket_bytes, min_size, dense,
          dense_axis_name=None, exchange: str = "gather"):
  ef = _args.flag("error_feedback", error_feedback)
  return build(Method(name, flat_route(CodecExchange(CastCodec(dtype))), Memory(enabled=ef)), axis_name,
               bucket_bytes=bucket_bytes, min_size=min_size, dense=dense, dense_axis_name=dense_axis_name,
               exchange=exchange)


def fp16(axis_name: AxisName = None, error_feedback: bool = False, bucket_bytes: int | None = None,
         min_size: int | None = None, dense=None, dense_axis_name=None, exchange: str = "gather"):
  """Half-precision allreduce: 2 bytes per element.

  Each worker divides by the number of workers before the cast, so the psum in
  float16 overflows only where the mean itself exceeds 65504 (then it is Inf,
  as a cast would be). With ``error_feedback`` the rounding error is carried.
    exchange: ``"gather"`` or ``"scatter"``: the same all-reduce (its bytes are flat in N already).

  References:
    Micikevicius et al., *Mixed Precision Training*, ICLR 2018; GRACE (Xu et
    al., 2021) lists it as the simplest quantizer.
  """
  return _cast("fp16", "float16", axis_name, error_feedback, bucket_bytes, min_size, dense,
               dense_axis_name, exchange)


def bf16(axis_name: AxisName = None, error_feedback: bool = False, bucket_bytes: int | None = None,
         min_size: int | None = None, dense=None, dense_axis_name=None, exchange: str = "gather"):
  """bfloat16 allreduce: 2 bytes per element, float32's range, 8 mantissa bits.
    exchange: ``"gather"`` or ``"scatter"``: the same all-reduce (its bytes are flat in N already).

  References:
    Kalamkar et al., *A Study of BFLOAT16 for Deep Learning Training*, 2019.
  """
  return _cast("bf16", "bfloat16", axis_name, error_feedback, bucket_bytes, min_size, dense,
               dense_axis_name, exchange)
