"""Counter-based uniform random numbers for stochastic rounding, fused by XLA.

``jax.random.uniform`` (threefry) costs about 9 memory copies of its output
on a 2-core CPU; stochastic rounding needs one uniform per gradient entry,
so it dominated QSGD, TernGrad and natural compression. :func:`uniform`
hashes each entry's index with the key instead: ``index * 0x9E3779B9 + k0``,
xor ``k1``, then two rounds of the ``lowbias32`` integer hash (C. Wellons,
"Prospecting for hash functions", 2018) with the key added between them;
the top 24 bits give the float. That is about ten integer operations per
entry, which XLA fuses into the rounding kernel (about one memory copy for
the draw and its use together on this machine,
``python -m jaxcomp.bench kernels``). :func:`below` draws ints in ``[0, n)``
from the same hash (SketchML's samples, INCEPTIONN's stream rotation), and
:func:`word_ints` a few ints from one key word (DGC's sample offsets, the
selections' start words).

For a fixed key the map from index to hash is a bijection of uint32 (each
step is invertible), so no two entries of one draw share a hash. The key
comes from ``jax.random`` (split and folded per worker, per leaf group and
per step), so streams of different workers and steps start from unrelated
words. The statistics that the codecs rely on (uniform marginals, no
correlation between neighbours, between workers or between steps) are
tested in ``tests/test_rng.py``; the codecs' own unbiasedness tests run on
top of it. Not for cryptography, and not a replacement for ``jax.random``
where streams must be reproducible across jaxcomp versions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_GOLDEN = 0x9E3779B9


def _words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two uint32 words of a raw (uint32[2]) or typed threefry key."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  if key.shape != (2,):
    raise ValueError(f"key must be one threefry key (uint32[2] or a typed key), got shape {key.shape}")
  key = key.astype(jnp.uint32)
  return key[0], key[1]


def _lowbias32(h: jax.Array) -> jax.Array:
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def bits(key: jax.Array, shape) -> jax.Array:
  """uint32 hash of each entry's row-major index under ``key``; ``shape`` below 2^32 entries."""
  shape = tuple(int(d) for d in shape)
  size = int(np.prod(shape, dtype=np.int64))
  if size >= 2 ** 32:
    raise ValueError(f"shape must have fewer than 2^32 entries, got {shape}")
  k0, k1 = _words(key)
  h = lax.iota(jnp.uint32, size).reshape(shape) * jnp.uint32(_GOLDEN) + k0
  h = _lowbias32(h ^ k1)
  return _lowbias32(h + k0)


def to_unit(h: jax.Array) -> jax.Array:
  """uint32 hashes -> float32 in ``[0, 1)`` from their top 24 bits (multiples of 2^-24)."""
  return (h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def uniform(key: jax.Array, shape) -> jax.Array:
  """float32 in ``[0, 1)`` per entry of ``shape``: :func:`to_unit` of :func:`bits`."""
  return to_unit(bits(key, shape))


def below(key: jax.Array, n, shape) -> jax.Array:
  """Uniform ints in ``[0, n)`` (int32): :func:`bits` modulo ``n``, with a modulo bias below ``n / 2**32``.

  ``n``: an int, or an array of them broadcasting against ``shape``.
  """
  return (bits(key, shape) % jnp.asarray(n, jnp.uint32)).astype(jnp.int32)


def word_ints(key: jax.Array, word: int, m) -> jax.Array:
  """One int32 in ``[0, m_s)`` per entry of ``m`` (a few: one per segment), from one word of ``key``.

  The word is spread by the golden-ratio multiply and the ``lowbias32`` hash of
  :func:`bits` rather than another threefry call, whose compile time dominates
  small kernels; the modulo bias is below ``m / 2**32``.
  """
  words = key if key.dtype == jnp.uint32 else jax.random.key_data(key)
  m = np.asarray(m, np.int64).reshape(-1)
  h = words.reshape(-1)[word] + jnp.uint32(_GOLDEN) * lax.iota(jnp.uint32, m.size)
  return (_lowbias32(h) % jnp.asarray(m, jnp.uint32)).astype(jnp.int32)


_MIN_DRAW = 1 << 16  # entries: a draw this size costs well under a millisecond, a compile far more


def normal(key: jax.Array, shape) -> np.ndarray | jax.Array:
  """``jax.random.normal(key, shape, float32)``, bit for bit, for initial states drawn eagerly.

  Eagerly each new shape compiles its own threefry and inverse-CDF program (a model's
  warm-start factors: one per view, seconds in all). Under partitionable threefry an
  entry's bits depend only on its flat index, so a draw is the prefix of any longer one
  with the same key: it is drawn at the next power of two, at least ``_MIN_DRAW`` entries
  (one program per size class), and cut on the host (a numpy array). Under a trace, or
  another PRNG setting, it is ``jax.random.normal`` itself.
  """
  shape = tuple(int(d) for d in shape)
  concrete = isinstance(key, np.ndarray) or (isinstance(key, jax.Array)
                                             and not isinstance(key, jax.core.Tracer))
  if not (concrete and jax.config.jax_threefry_partitionable
          and jax.config.jax_default_prng_impl == "threefry2x32"
          and not jnp.issubdtype(key.dtype, jax.dtypes.prng_key)):
    return jax.random.normal(key, shape, jnp.float32)
  n = int(np.prod(shape, dtype=np.int64))
  drawn = jax.random.normal(key, (max(1 << max(n - 1, 0).bit_length(), _MIN_DRAW),), jnp.float32)
  return np.asarray(drawn)[:n].reshape(shape)
