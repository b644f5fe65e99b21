"""Bit packing of small unsigned fields (1, 2, 4 or 8 bits) into uint8 words.

Every method that sends signs, ternary values, small levels or tags packs them
here, so that what crosses a collective is ``ceil(n * bits / 8)`` bytes.
Packing works on the last axis; leading axes are batch axes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_ALLOWED_BITS = (1, 2, 4, 8)


def _check_bits(bits: int) -> int:
  if bits not in _ALLOWED_BITS:
    raise ValueError(f"bits must be one of {_ALLOWED_BITS}, got bits={bits!r}")
  return 8 // bits


def packed_size(n: int, bits: int) -> int:
  """Number of uint8 words that hold ``n`` fields of ``bits`` bits."""
  per = _check_bits(bits)
  return -(-n // per)


def pack(fields: jnp.ndarray, bits: int) -> jnp.ndarray:
  """Packs unsigned fields ``0 <= f < 2**bits`` along the last axis into uint8.

  The last axis of length n becomes ``packed_size(n, bits)``; the tail is
  zero-padded. Field i of a word sits at bit offset ``i * bits`` (LSB first).
  """
  _check_bits(bits)
  fields = jnp.asarray(fields).astype(jnp.uint8)
  if bits == 8:
    return fields
  # Fields occupy disjoint bits, so a sum is an OR; uint8 sum cannot overflow.
  return jnp.sum(_in_words(fields, bits), axis=-1, dtype=jnp.uint8)


def _in_words(a: jnp.ndarray, bits: int, fill=0, shift: bool = True) -> jnp.ndarray:
  """The last axis of ``a`` padded with ``fill`` and cut into words: ``(..., m, 8 // bits)``,
  each field shifted to its bit offset (``shift``)."""
  per = _check_bits(bits)
  pad = packed_size(a.shape[-1], bits) * per - a.shape[-1]
  if pad:
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)], constant_values=fill)
  a = a.reshape(a.shape[:-1] + (-1, per))
  return a << (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8) if shift else a


def pack_checked(fields: jnp.ndarray, bits: int, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """``(flag, pack(fields, bits))``; ``flag``, a float32 scalar, is 0.0 if ``x`` is all finite, else NaN.

  ``x`` is the float vector the fields were computed from (its length that of
  ``fields``, 1-D). The flag comes from the packing's own reduction: one
  variadic reduce over each word's fields and their ``isfinite``, so the check
  costs no pass of its own (a separate reduction over the bucket doubled
  signSGD's update, docs/benchmarks.md "Design measurements"; a codec's
  payload carries it, see :attr:`jaxcomp.core.protocol.Codec.carries_nonfinite`).
  """
  shifted = _in_words(jnp.asarray(fields).astype(jnp.uint8), bits)
  finite = _in_words(jnp.isfinite(x), bits, fill=True, shift=False)
  # Disjoint bits: the sum is an OR (as in :func:`pack`).
  words, ok = lax.reduce((shifted, finite), (jnp.uint8(0), True),
                         lambda a, b: (a[0] + b[0], a[1] & b[1]), (1,))
  return jnp.where(jnp.all(ok), 0.0, jnp.nan).astype(jnp.float32), words


def unpack(words: jnp.ndarray, bits: int, n: int) -> jnp.ndarray:
  """Inverse of :func:`pack`: uint8 words -> ``n`` uint8 fields on the last axis."""
  per = _check_bits(bits)
  words = jnp.asarray(words)
  if words.dtype != jnp.uint8:
    raise TypeError(f"words must be uint8, got dtype={words.dtype}")
  if bits == 8:
    return words[..., :n]
  shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
  mask = jnp.uint8((1 << bits) - 1)
  fields = (words[..., None] >> shifts) & mask
  fields = fields.reshape(words.shape[:-1] + (words.shape[-1] * per,))
  return fields[..., :n]


def pack_signs(x: jnp.ndarray) -> jnp.ndarray:
  """Packs ``x >= 0`` as one bit per element (1 = non-negative), 8 per byte."""
  return pack(x >= 0, 1)


def unpack_signs(words: jnp.ndarray, n: int, dtype=jnp.float32) -> jnp.ndarray:
  """Unpacks :func:`pack_signs` words to +1 / -1 values of ``dtype``."""
  bits = unpack(words, 1, n)
  return (2 * bits.astype(dtype) - 1).astype(dtype)


def to_bytes(payload) -> jnp.ndarray:
  """Every array of a payload pytree, bitcast to uint8 and concatenated: one buffer, one collective."""
  parts = []
  for a in jax.tree.leaves(payload):
    a = jnp.asarray(a)
    if a.dtype == jnp.bool_:
      raise TypeError("payload arrays must not be bool: pack them into uint8 words")
    flat = a.reshape(-1)
    if a.dtype.itemsize > 1:
      flat = lax.bitcast_convert_type(flat, jnp.uint8).reshape(-1)
    else:
      flat = lax.bitcast_convert_type(flat, jnp.uint8)
    parts.append(flat)
  if not parts:
    return jnp.zeros((0,), jnp.uint8)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def from_bytes(buffers: jnp.ndarray, like, row=None):
  """Inverse of :func:`to_bytes` over a leading axis: ``(N, bytes)`` -> the payload
  with leaves ``(N, ...)``; with ``row`` (may be traced), that row's payload alone,
  each field one dynamic slice of ``buffers``.
  """
  leaves, treedef = jax.tree.flatten(like)
  out, at = [], 0
  lead = buffers.shape[:-1] if row is None else ()
  for a in leaves:
    count = math.prod(a.shape)
    size = count * a.dtype.itemsize
    if row is None:
      chunk = buffers[..., at:at + size]
    else:
      chunk = lax.dynamic_slice(buffers, (row, at), (1, size)).reshape(size)
    at += size
    if a.dtype.itemsize > 1:
      chunk = lax.bitcast_convert_type(chunk.reshape(lead + (count, a.dtype.itemsize)), a.dtype)
    else:
      chunk = lax.bitcast_convert_type(chunk, a.dtype)
    out.append(chunk.reshape(lead + tuple(a.shape)))
  return treedef.unflatten(out)


@dataclasses.dataclass(frozen=True)
class Gathered:
  """Every worker's payload as it arrives: one row of :func:`to_bytes` bytes per worker.

  ``payload(w)`` cuts one worker's fields out of its row where they are read
  (inside a loop over workers); ``payloads()`` cuts every field of every
  worker at once (``(N, ...)`` leaves). A codec that decodes one worker at a
  time reads the collective's own buffer: XLA:CPU writes a field sliced
  before a loop out in full, a second copy of the gathered bytes (for a
  one-byte code over 8 workers, 2x a float32 bucket).
  """

  buffers: jnp.ndarray
  """uint8 ``(N, bytes)``, a row per worker."""
  like: Any
  """One worker's payload: its fields' shapes and dtypes (arrays or ``jax.ShapeDtypeStruct``)."""

  @classmethod
  def of(cls, payloads) -> "Gathered":
    """From payloads stacked along a leading worker axis (tests, local use)."""
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), payloads)
    return cls(jax.vmap(to_bytes)(payloads), like)

  @property
  def workers(self) -> int:
    return self.buffers.shape[0]

  def payload(self, w) -> Any:
    """Worker ``w``'s payload (``w`` may be traced)."""
    return from_bytes(self.buffers, self.like, w)

  def payloads(self) -> Any:
    """Every worker's payload, leaves ``(N, ...)``."""
    return from_bytes(self.buffers, self.like)
