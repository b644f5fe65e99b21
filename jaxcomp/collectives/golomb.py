"""Golomb coding of sorted positions into a fixed-capacity bit buffer, in XLA.

Positions ``p_0 < p_1 < ...`` travel as gaps ``g_i = p_i - p_{i-1} - 1``
(``p_{-1} = -1``), each split by the Golomb-Rice parameter ``b`` into a
quotient ``q = g >> b`` sent in unary (``q`` ones and a terminating zero) and
a remainder ``g mod 2^b`` sent in ``b`` bits. For positions drawn with
probability ``p`` the gaps are geometric and the expected length per position
is ``b + 1 / (1 - (1 - p)^(2^b))``, minimized near
``b* = 1 + floor(log2(ln(phi - 1) / ln(1 - p)))`` (Sattler et al. 2018).

Layout: all unary quotients first, then all remainders (b bits each, most
significant bit first); the bits are those of the interleaved codewords,
reordered so that both directions are data-parallel: the encoder places every
codeword by an exclusive cumulative sum of the codeword lengths, and the
decoder finds the terminators as the zeros of the stream (the c-th zero ends
the unary section exactly when ``its position + 1 + c * b == nbits``). Both
run in O(capacity_bits + max_count * b) with static shapes, no host round
trip and no loop over positions. Bits are packed LSB first into uint8 words
(:func:`jaxcomp.collectives.packing.pack`); bits at and after ``nbits`` are 0.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from jaxcomp.collectives import packing

_PHI = (1.0 + math.sqrt(5.0)) / 2.0


def _check_p(p: float) -> float:
  if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0.0 < float(p) <= 1.0):
    raise ValueError(f"p must be a float in (0, 1], got p={p!r}")
  return float(p)


def golomb_b_star(p: float) -> int:
  """The paper's Golomb-Rice parameter ``b* = 1 + floor(log2(ln(phi-1) / ln(1-p)))``, at least 0."""
  p = _check_p(p)
  if p >= 1.0:
    return 0
  ratio = math.log(_PHI - 1.0) / math.log1p(-p)
  return max(0, 1 + math.floor(math.log2(ratio)))


def expected_bits_per_position(p: float, b: int | None = None) -> float:
  """Expected code length per position for density ``p``: ``b + 1 / (1 - (1-p)^(2^b))``.

  ``b`` defaults to :func:`golomb_b_star` of ``p``.
  """
  p = _check_p(p)
  b = golomb_b_star(p) if b is None else int(b)
  return b + 1.0 / (1.0 - (1.0 - p) ** (2 ** b))


def max_stream_bits(count: int, n: int, b: int) -> int:
  """The longest stream ``count`` distinct positions in ``[0, n)`` can take.

  The gaps sum to at most ``n - count``, so the quotients sum to at most
  ``(n - count) >> b``: ``count * (b + 1) + ((n - count) >> b)`` bits.
  """
  count = min(int(count), int(n))
  return count * (int(b) + 1) + ((int(n) - count) >> int(b))


def words_for(capacity_bits: int) -> int:
  """Number of uint8 words of a buffer of ``capacity_bits`` bits."""
  return max(1, -(-int(capacity_bits) // 8))


def _check_b(b) -> int:
  if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 30:
    raise ValueError(f"b must be an int in [0, 30], got b={b!r}")
  return b


def encode_positions(positions: jax.Array, count: jax.Array, n: int, b: int,
                     capacity_bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Golomb-codes the first ``count`` entries of ``positions`` (ascending, in ``[0, n)``).

  Args:
    positions: int array ``(K,)``; entries at and after ``count`` are ignored.
    count: int scalar, ``0 <= count <= K``.
    n: the length of the vector the positions index (static).
    b: the Golomb-Rice parameter (static), e.g. :func:`golomb_b_star`.
    capacity_bits: the static size of the bit buffer.

  Returns:
    ``(words, nbits, sent)``: ``words`` uint8 ``(words_for(capacity_bits),)``,
    ``nbits`` the int32 stream length, ``sent`` the int32 number of positions
    coded: the longest prefix of the positions whose codes fit in
    ``capacity_bits`` (all of them when ``capacity_bits >= max_stream_bits``).
  """
  del n
  b = _check_b(b)
  if isinstance(capacity_bits, bool) or not isinstance(capacity_bits, int) or capacity_bits < 1:
    raise ValueError(f"capacity_bits must be an int >= 1, got capacity_bits={capacity_bits!r}")
  pos = jnp.asarray(positions).astype(jnp.int32)
  k = pos.shape[-1]
  i = jnp.arange(k, dtype=jnp.int32)
  valid = i < count
  prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), pos[:-1]])
  gap = jnp.where(valid, pos - prev - 1, 0)
  q = gap >> b
  r = gap & ((1 << b) - 1)
  unary_end = jnp.cumsum(jnp.where(valid, q + 1, 0))
  fits = valid & (unary_end + (i + 1) * b <= capacity_bits)
  sent = jnp.sum(fits, dtype=jnp.int32)
  u = jnp.max(jnp.where(fits, unary_end, 0), initial=0)
  nbits = u + sent * b
  j = jnp.arange(capacity_bits, dtype=jnp.int32)
  term = jnp.zeros((capacity_bits,), jnp.bool_).at[jnp.where(fits, unary_end - 1, capacity_bits)].set(
      True, mode="drop")
  bits = (j < u) & ~term
  if b:
    t = jnp.maximum(j - u, 0)
    rem = r[jnp.minimum(t // b, k - 1)]
    rem_bit = (rem >> (b - 1 - t % b)) & 1
    bits = bits | ((j >= u) & (j < nbits) & (rem_bit == 1))
  return packing.pack(bits, 1), nbits.astype(jnp.int32), sent


def decode_positions(words: jax.Array, nbits: jax.Array, b: int, max_count: int,
                     n: int) -> tuple[jax.Array, jax.Array]:
  """Inverse of :func:`encode_positions`.

  Args:
    words: the uint8 buffer.
    nbits: the stream length in bits (any integer dtype).
    b: the Golomb-Rice parameter used to encode (static).
    max_count: the static number of position slots to return.
    n: the length of the indexed vector; unused slots hold ``n``.

  Returns:
    ``(positions, count)``: int32 ``(max_count,)`` ascending, the first
    ``count`` valid and the rest equal to ``n`` (so that a scatter with
    ``mode="drop"`` ignores them), and the int32 count.
  """
  b = _check_b(b)
  words = jnp.asarray(words)
  cap = words.shape[-1] * 8
  bits = packing.unpack(words, 1, cap)
  nbits = jnp.asarray(nbits).astype(jnp.int32)
  j = jnp.arange(cap, dtype=jnp.int32)
  zero = bits == 0
  rank = jnp.cumsum(zero, dtype=jnp.int32)
  term = zero & (rank <= max_count) & (j + 1 + jnp.minimum(rank, max_count + 1) * b <= nbits)
  count = jnp.sum(term, dtype=jnp.int32)
  ends = jnp.full((max_count,), -1, jnp.int32).at[jnp.where(term, rank - 1, max_count)].set(
      j, mode="drop")
  i = jnp.arange(max_count, dtype=jnp.int32)
  prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), ends[:-1]])
  q = ends - prev - 1
  gap = q << b
  if b:
    u = jnp.max(jnp.where(term, j + 1, 0), initial=0)
    t = jnp.arange(b, dtype=jnp.int32)
    at = jnp.clip(u + i[:, None] * b + t[None, :], 0, cap - 1)
    rbits = bits[at].astype(jnp.int32)
    gap = gap | jnp.sum(rbits << (b - 1 - t)[None, :], axis=1, dtype=jnp.int32)
  pos = jnp.cumsum(gap + 1, dtype=jnp.int32) - 1
  return jnp.where(i < count, pos, n), count
