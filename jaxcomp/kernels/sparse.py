"""Fixed-capacity sparse payloads: ``(values, narrow bucket positions, count)``.

XLA needs static shapes, so a selection whose size varies travels in a buffer
of fixed capacity plus an int32 count; slots past the count are ignored by
the receiver. Positions are bucket positions; capacities are per segment.
A selection never sorts the bucket: the mask is packed into 32-bit words,
capped per segment and compacted word by word (:mod:`jaxcomp.kernels.compaction`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import ops, packing
from jaxcomp.core.layout import Segments
from jaxcomp.core.protocol import zero_after
from jaxcomp.kernels import compaction, rng
from jaxcomp.transforms import _args


def segment_caps(ratio: float, segs: Segments) -> np.ndarray:
  """Slots per segment, ``max(1, ceil(ratio * n))`` (int64 (S,))."""
  return np.asarray([_args.ratio_count(ratio, n) for n in segs.sizes], np.int64)


def select(mask: jax.Array, segs: Segments, caps, key: jax.Array, word: int = 0):
  """Compacts a bucket ``mask`` with at most ``caps[s]`` entries per segment.

  Returns ``(positions int32[sum(caps)], count int32)``, ascending bucket
  positions (``segs.length`` in unused slots). When more than ``caps[s]``
  entries of a segment are selected, the ones kept are the first in circular
  order from a random 32-entry word of the segment (new each step), so no
  region of a leaf is starved when its capacity is too small.
  """
  return take(count_selection(mask, segs, key, word), segs, caps)


def count_selection(mask: jax.Array, segs: Segments, key: jax.Array, word: int = 0) -> compaction.Counted:
  """What :func:`select` does before any capacity: the mask packed and counted, each segment's random
  start word drawn. A mask selected at several capacities (a warm-up's stages) is counted once."""
  start = rng.word_ints(key, word, np.asarray(segs.padded_sizes, np.int64) // 32)
  return compaction.count_segments(compaction.pack_mask(mask), segs, start)


def take(counted: compaction.Counted, segs: Segments, caps):
  """:func:`select`'s ``(positions, count)`` at ``caps`` from a counted mask (:func:`count_selection`)."""
  idx, count, _ = compaction.compact_counted(counted, segs, caps)
  return idx, count


def sparse_payload(x: jax.Array, idx: jax.Array, count: jax.Array, n: int):
  """(values float32, positions in the narrowest dtype for n, count int32); unused slots hold 0."""
  used = jnp.arange(idx.shape[0]) < count
  idx = jnp.where(used, idx, 0)
  return jnp.where(used, x[idx], 0.0), idx.astype(_args.index_dtype(n)), count.astype(jnp.int32)


def valid_indices(idx: jax.Array, count: jax.Array, n: int) -> jax.Array:
  """int32 indices with the slots past ``count`` set to ``n`` (dropped by scatters)."""
  slot = jnp.arange(idx.shape[-1], dtype=jnp.int32)
  return jnp.where(slot < jnp.expand_dims(count, -1), idx.astype(jnp.int32), n)


def zeros_after(n: int, dep: jax.Array) -> jax.Array:
  """float32 zeros ``(n,)`` computed from one entry of ``dep``: XLA writes them only once ``dep`` exists.

  A decode scatters a payload into a bucket of zeros. Constant zeros are
  shared by every decode of the same length and copied for each scatter, and
  XLA's schedulers place those operand-free copies at the start of the
  step, so every bucket's zeros were live through the whole step (two
  bucket-sized buffers per bucket of a sparse method). Zeros made from
  ``dep`` (:func:`~jaxcomp.core.protocol.zero_after`: +0.0 from any value)
  are written where they are used.
  """
  if dep.size == 0:  # nothing to wait for
    return jnp.zeros((n,), jnp.float32)
  first = dep.reshape(-1)[:1].astype(jnp.float32)
  return jnp.broadcast_to(zero_after(first), (n,))


def kept(x: jax.Array, positions: jax.Array) -> jax.Array:
  """``x`` at ``positions`` (those ``>= n`` dropped), +0.0 elsewhere: the decode of a payload of
  ``x``'s own values at distinct positions, bit for bit, from a bool mask instead of a scatter of the values.

  The mask (a byte per entry, made after ``positions`` as :func:`zeros_after` makes its zeros)
  and the select fuse into the residual's update: no decoded bucket of float32 is written.
  """
  return jnp.where(sent_mask(x.shape[0], positions), x, 0.0)


def sent_mask(n: int, positions: jax.Array) -> jax.Array:
  """bool ``(n,)``: True at ``positions`` (those ``>= n`` dropped), made after them (:func:`kept`'s mask)."""
  zero = zeros_after(1, positions) if positions.size else jnp.zeros((1,), jnp.float32)
  return jnp.broadcast_to(zero != 0.0, (n,)).at[positions].set(True, mode="drop")


def sparse_kept(x: jax.Array, payload, n: int) -> jax.Array:
  """:func:`sparse_decode` of a :func:`sparse_payload` of ``x``, by :func:`kept` (what the worker sent)."""
  _, idx, count = payload
  return kept(x, valid_indices(idx, count, n))


def sparse_decode(values: jax.Array, idx: jax.Array, count: jax.Array, n: int) -> jax.Array:
  """Dense ``(n,)`` vector of a fixed-capacity sparse payload."""
  idx = valid_indices(idx, count, n)
  return zeros_after(n, values).at[idx].set(values, mode="drop")


def scatter_mean(sparse: Callable[[jax.Array], tuple], gathered: packing.Gathered, n: int,
                 num: int, per_entry: bool = False) -> jax.Array:
  """Mean over the workers of ``gathered`` sparse payloads, accumulated into one dense vector.

  ``sparse(w)`` gives worker ``w``'s ``(values, indices)``, ``(k,)`` each
  (indices ``>= n`` are dropped), read inside the loop (from
  :meth:`Gathered.payload <jaxcomp.collectives.packing.Gathered.payload>`:
  no ``(N, k)`` decoded arrays). One scatter-add per worker in a fixed
  order: no ``N x n`` array, and the same float result on every worker.
  ``per_entry``: each entry's sum over the workers that sent it divided by
  their number (SparseLoCo's reference mean) instead of by ``num``.
  """
  def body(w, carry):
    acc, senders = carry
    values, indices = sparse(w)
    idx = indices.astype(jnp.int32)
    acc = acc.at[idx].add(values.astype(jnp.float32), mode="drop")
    if per_entry:
      senders = senders.at[idx].add(1.0, mode="drop")
    return acc, senders

  zeros = ops.like_vma(zeros_after(n, jax.tree.leaves(gathered.buffers)[0]), gathered.buffers)
  total, senders = lax.fori_loop(0, gathered.workers, body, (zeros, zeros if per_entry else zeros[:0]))
  return total / jnp.maximum(senders, 1.0) if per_entry else total / num


def sparse_mean(gathered: packing.Gathered, n: int, num: int, sparse=lambda p: p) -> jax.Array:
  """Mean of gathered fixed-capacity sparse payloads (``sparse(payload)`` gives
  ``(values, idx, count)``), scatter-added into one vector one worker at a time."""
  def values_indices(w):
    values, idx, count = sparse(gathered.payload(w))
    return values, valid_indices(idx, count, n)

  return scatter_mean(values_indices, gathered, n, num)


def sparse_bytes(n: int, capacity: int) -> int:
  """Bytes of one payload: float32 values, narrow indices, an int32 count."""
  return capacity * (4 + np.dtype(_args.index_dtype(n)).itemsize) + 4

