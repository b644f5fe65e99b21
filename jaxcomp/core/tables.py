"""Segment tables as data: buckets of different layouts run by one loop over their stack.

A bucket's :class:`~jaxcomp.core.layout.Segments` are static: every kernel built on them holds
its offsets and sizes as constants, so each bucket of a model compiles kernels of its own. A
:class:`SegmentTable` holds the same tables as arrays, all of one shape for a group of buckets
(:func:`group_tables`): each bucket zero-padded to the group's longest and its segments
followed by empty ones and one last segment over its padding, so that one loop over the
stacked buckets runs every bucket's codec with the same kernels
(:func:`jaxcomp.core.stacking.exchange_stacked`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from jaxcomp.core.layout import SegmentOps, Segments


@dataclasses.dataclass(frozen=True)
class SegmentTable(SegmentOps):
  """:class:`~jaxcomp.core.layout.Segments` whose per-segment and per-row tables are arrays.

  ``count``, ``length``, ``block`` and ``has_pads`` are static (one value for a group of
  buckets); ``offsets``, ``sizes`` and ``padded_sizes`` (int32 (count,)), ``row_segment`` and
  ``row_valid`` (int32 (length // block,)) are the pytree's leaves.
  """

  offsets: jax.Array
  sizes: jax.Array
  padded_sizes: jax.Array
  row_segment: jax.Array
  row_valid: jax.Array
  count: int
  length: int
  block: int
  has_pads: bool

  @property
  def pads(self) -> jax.Array:
    return (self.padded_sizes - self.sizes).astype(np.float32)


jax.tree_util.register_dataclass(
    SegmentTable, data_fields=["offsets", "sizes", "padded_sizes", "row_segment", "row_valid"],
    meta_fields=["count", "length", "block", "has_pads"])


def table(offsets, sizes, padded_sizes, length: int, block: int, has_pads: bool) -> SegmentTable:
  """A table (numpy leaves) of segments at ``offsets`` of ``sizes`` entries, each taking
  ``padded_sizes`` (multiples of ``block``, together ``length``)."""
  padded_sizes = np.asarray(padded_sizes, np.int32)
  sizes = np.asarray(sizes, np.int32)
  rows = padded_sizes // block
  if int(rows.sum()) * block != length:
    raise ValueError(f"segments of {int(padded_sizes.sum())} entries in a table of {length}")
  row_valid = np.full(int(rows.sum()), block, np.int32)
  ends = np.cumsum(rows)
  for s in np.nonzero(sizes < padded_sizes)[0]:  # rows past a segment's entries: its padding
    first = ends[s] - rows[s]
    valid = np.clip(int(sizes[s]) - block * np.arange(rows[s]), 0, block)
    row_valid[first:ends[s]] = valid
  return SegmentTable(np.asarray(offsets, np.int32), sizes, padded_sizes,
                      np.repeat(np.arange(len(sizes), dtype=np.int32), rows), row_valid, len(sizes), length,
                      block, has_pads)


def padded_table(segs: Segments, length: int, count: int, has_pads: bool | None = None) -> SegmentTable:
  """``segs`` as a table of ``count`` segments over ``length`` entries (numpy leaves).

  The bucket's own segments come first, then empty ones at its end, then one segment over the
  entries from its end to ``length`` (empty when the bucket is that long): ``count`` must be at
  least ``segs.count + 1``.
  """
  if count < segs.count + 1 or length < segs.length or length % segs.block:
    raise ValueError(f"a table of {count} segments over {length} entries cannot hold {segs.count}"
                     f" segments over {segs.length} (block {segs.block})")
  empty = count - segs.count - 1
  rest = length - segs.length
  return table(list(segs.offsets) + [segs.length] * (empty + 1), list(segs.sizes) + [0] * empty + [rest],
               list(segs.padded_sizes) + [0] * empty + [rest], length, segs.block,
               segs.has_pads if has_pads is None else has_pads)


def group_tables(segments: Sequence[Segments]) -> list:
  """Tables of one shape for ``segments`` (one block): the longest length, one more segment than
  the most any holds."""
  length = max(s.length for s in segments)
  count = max(s.count for s in segments) + 1
  has_pads = any(s.has_pads for s in segments)
  return [padded_table(s, length, count, has_pads) for s in segments]


def stack(trees: Sequence) -> object:
  """Pytrees of one structure (static fields equal) stacked leaf by leaf on a new first axis."""
  return jax.tree.map(lambda *leaves: np.stack([np.asarray(v) for v in leaves]), *trees)
