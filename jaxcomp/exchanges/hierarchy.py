"""Two-level exchange: dense inside a node (fast axis), compressed between nodes (slow axis).

With ``dense_axis_name="ici"`` and ``axis_name="dcn"``, each bucket is
reduce-scattered densely over the F workers of the fast axis (worker f of a
node then holds chunk f of the bucket, already the node's mean), that chunk
is compressed and exchanged over the slow axis with the method's own
collective, and the decoded mean chunk is all-gathered back over the fast
axis. Error feedback keeps the residual of the chunk only: 1/F of the flat
memory per worker.

A chunk is compressed as one segment of ``C`` entries (``C`` a multiple of
:data:`jaxcomp.core.layout.ROW`; the bucket is zero-padded to ``F * C``): a
codec's per-segment settings (a scale, a top-k budget) apply per chunk, not
per leaf, as in ZeRO++'s blockwise quantization. Exchanges whose leaves'
shapes matter (PowerSGD's matrices) and fused methods (ACP-SGD) are not
chunked: they average the whole bucket over the fast axis and exchange it
over the slow one, every worker of a node alike.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.collectives import ops
from jaxcomp.collectives.axis import Axis
from jaxcomp.core import layout


def chunk_length(length: int, workers: int) -> int:
  """Entries per chunk when a bucket of ``length`` entries is cut into ``workers`` chunks."""
  return layout.padded(-(-length // workers), layout.ROW)


def chunked(buckets: Sequence[layout.Bucket], workers: int) -> Tuple[layout.Bucket, ...]:
  """The buckets each worker of a fast axis of ``workers`` holds: one chunk, one segment each."""
  out = []
  for b in buckets:
    c = chunk_length(b.length, workers)
    out.append(layout.Bucket(b.exchange, b.leaves, layout.Segments((0,), (c,), ((c,),), b.segments.block)))
  return tuple(out)


def reduce_scatter_mean(vectors: Sequence[jax.Array], chunks: Sequence[layout.Bucket], fast: Axis) -> list:
  """Each bucket's chunk ``fast.index``, averaged over the fast axis.

  An all-to-all (worker f receives every worker's chunk f), then a sum in
  worker order on each worker: a reduce-scatter with the same bytes whose
  sum does not depend on how the backend orders its reduction, so one
  process of 8 devices and 2 processes of 4 give bit-identical results.
  """
  out = []
  for v, b in zip(vectors, chunks):
    c = b.length
    rows = jnp.pad(v, (0, fast.size * c - v.shape[0])).reshape(fast.size, c)
    received = lax.all_to_all(rows, fast.name, 0, 0)  # row j: worker j's chunk fast.index
    total = received[0]
    for j in range(1, fast.size):
      total = total + received[j]
    out.append(total / fast.size)
  return out


def all_gather(chunks_: Sequence[jax.Array], full: Sequence[layout.Bucket], fast: Axis) -> list:
  """Every worker's chunk back in the whole bucket (one all-gather per bucket)."""
  return [ops.allgather_tiled(v, fast)[:b.length] for v, b in zip(chunks_, full)]


def chunk_of(vectors: Sequence[jax.Array | None], chunks: Sequence[layout.Bucket], fast: Axis) -> list:
  """This worker's chunk of each (replicated) bucket vector, e.g. the parameters."""
  out = []
  for v, b in zip(vectors, chunks):
    if v is None:
      out.append(None)
      continue
    c = b.length
    padded = jnp.pad(v, (0, fast.size * c - v.shape[0]))
    out.append(lax.dynamic_slice_in_dim(padded, fast.index * c, c))
  return out


def wire_bytes(buckets: Sequence[layout.Bucket], workers: int) -> int:
  """Bytes one worker hands to the fast axis per step: a float32 reduce-scatter and all-gather per bucket."""
  return int(sum(4 * (workers + 1) * chunk_length(b.length, workers) for b in buckets))
