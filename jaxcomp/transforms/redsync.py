"""RedSync: residual gradient compression with fast, sort-free selection."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import ops, packing
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core.builder import build
from jaxcomp.core.layout import Segments
from jaxcomp.core.memories import MomentumCorrection
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, Exchange, Memory, StepContext, flat_route
from jaxcomp.exchanges.scatter import ScatterCodec, ScatterForm
from jaxcomp.kernels import compaction, selection
from jaxcomp.kernels.sparse import scatter_mean, sent_mask, zeros_after
from jaxcomp.transforms import _args
from jaxcomp.transforms.threshold import BLOCK

SELECTIONS = ("binary_search", "trimmed")
MIN_SIZE = 256  # RedSync's default: smaller leaves travel dense


@dataclasses.dataclass(frozen=True)
class RedSyncExchange(Exchange, ScatterForm):
  """Select per leaf (binary search or trimmed top-k), optionally quantize; one all-gather per bucket.

  Works on the whole bucket: every segment (leaf) searches its own threshold
  at once (:func:`jaxcomp.kernels.selection.segment_binary_search`,
  :func:`~jaxcomp.kernels.selection.segment_trimmed_topk`), the selection
  is compacted once into the bucket's slots (the sum of the leaves'), and
  the payload is packed into one buffer. Payload per bucket: the slots' bucket
  positions (narrowest integer dtype for the bucket) and either their
  float32 values or, quantized, two int32 counts (positives of all leaves
  first, then negatives) and two float32 mean magnitudes per leaf. The binary
  search's thresholds (one float32 per leaf of the bucket) are the exchange
  state.
  """

  ratio: float
  selection: str
  quantize: bool
  block = BLOCK

  def ks(self, segs: Segments) -> np.ndarray:
    return np.asarray([_args.ratio_count(self.ratio, n) for n in segs.sizes], np.int64)

  def caps(self, segs: Segments) -> np.ndarray:
    """Slots per leaf: ``min(n, 2k)`` for the binary search, ``k`` for the exact top-k."""
    k = self.ks(segs)
    if self.selection == "binary_search":
      return np.minimum(np.asarray(segs.sizes, np.int64), 2 * k)
    return k

  def init_bucket(self, segs, key):
    if self.selection == "binary_search":
      return jnp.zeros((segs.count,), jnp.float32)
    return ()

  def encode(self, x, segs, thresholds):
    if self.selection == "binary_search":
      sel = selection.segment_binary_search(x, segs, self.ks(segs), threshold=thresholds)
    else:
      sel = selection.segment_trimmed_topk(x, segs, self.ks(segs))
    return self.payload(x, sel.indices, segs), sel.threshold

  def payload(self, x, indices, segs):
    """The payload of the selected bucket positions (``segs.length`` in unused slots)."""
    n = segs.length
    valid = indices < n
    idx = jnp.where(valid, indices, 0)
    values = jnp.where(valid, x[idx], 0.0)
    itype = _args.index_dtype(n)
    if not self.quantize:
      return values, idx.astype(itype)
    cap = idx.shape[0]
    pos, neg = valid & (values >= 0), valid & (values < 0)
    seg = compaction.segment_of(idx, segs)

    def side(mask, v):
      total = jax.ops.segment_sum(jnp.where(mask, v, 0.0), seg, segs.count)
      return total / jnp.maximum(jax.ops.segment_sum(mask.astype(jnp.int32), seg, segs.count), 1)

    means = jnp.stack([side(pos, values), side(neg, -values)], axis=1)
    counts = jnp.stack([jnp.sum(pos), jnp.sum(neg)]).astype(jnp.int32)
    p_rank = compaction.prefix_sum(pos.astype(jnp.int32))
    n_rank = compaction.prefix_sum(neg.astype(jnp.int32))
    slot = jnp.where(pos, p_rank - 1, jnp.where(neg, counts[0] + n_rank - 1, cap))
    ordered = jnp.zeros((cap,), jnp.int32).at[slot].set(idx, mode="drop")
    return ordered.astype(itype), counts, means

  def values(self, payload, segs):
    """The float32 values and positions of a payload (quantized ones expanded from the means)."""
    if not self.quantize:
      return payload[0], payload[1]
    idx, counts, means = payload
    slot = jnp.arange(idx.shape[-1])
    m = means[compaction.segment_of(idx, segs)]
    values = jnp.where(slot < counts[0], m[:, 0], jnp.where(slot < counts[0] + counts[1], -m[:, 1], 0.0))
    return values, idx

  def decode(self, payload, segs):
    values, idx = self.values(payload, segs)
    return zeros_after(segs.length, values).at[idx.astype(jnp.int32)].add(values)

  def scatter_codec(self, ctx: StepContext | None) -> "RedSyncCodec":
    """The selection as a codec, for ``transport="scatter"`` (a fresh binary search per chunk)."""
    del ctx
    return RedSyncCodec(self)

  def exchange(self, x, segs, thresholds, ctx: StepContext):
    payload, found = self.encode(x, segs, thresholds if self.selection == "binary_search" else None)
    return self._send(payload, segs, ctx) + (self._carried(found, thresholds),)

  def _carried(self, found, thresholds):
    """The thresholds the state carries (the binary search's found ones, finite)."""
    return jnp.where(jnp.isfinite(found), found, 0.0) if self.selection == "binary_search" else thresholds

  def _send(self, payload, segs, ctx: StepContext):
    """``(mean, local)`` of a payload: all-gathered and averaged; ``local`` its decode."""
    local = self.decode(payload, segs)
    if ctx.axis.name is None:
      return local, local
    gathered = ops.allgather_payload(payload, ctx.axis)
    return self.mean(gathered, segs, ctx.axis.size), local

  def exchange_stages(self, stages, index, x, segs, thresholds, ctx: StepContext):
    """The exchange of ``stages[index]`` (RedSync exchanges of a ratio warm-up, this one first).

    With the binary search, the stages differ in k and capacity only: one
    search with the stage's k and capacity as data; the compaction, payload
    and all-gather (each stage's own capacity) are switched on the stage.
    """
    if any((ex.selection, ex.quantize) != ("binary_search", self.quantize) for ex in stages):
      return super().exchange_stages(stages, index, x, segs, thresholds, ctx)
    words, found, caps = selection.segment_search_stages(x, segs, [ex.ks(segs) for ex in stages], index,
                                                         thresholds)

    n = segs.length

    def send(cap):
      idx, _ = compaction.compact(words, n, cap)
      mean, local = self._send(self.payload(x, idx, segs), segs, ctx)
      if self.quantize:  # what was sent is the side means, not x's values
        return ops.varying((mean, local), ctx.axis)
      # the mean and a byte mask of what was sent: a float32 bucket fewer out of the switch
      return ops.varying((mean, sent_mask(n, idx)), ctx.axis)

    mean, local = lax.switch(index, [lambda cap=cap: send(cap) for cap in caps])
    if not self.quantize:  # the decode of x's own values at distinct positions: x + 0.0 there, +0.0 elsewhere
      local = jnp.where(local, x + 0.0, 0.0)
    return mean, local, self._carried(found, thresholds)

  def mean(self, gathered: packing.Gathered, segs: Segments, num: int) -> jax.Array:
    """The mean of the gathered payloads, each decoded where the loop over workers reads it."""
    return scatter_mean(lambda w: self.values(gathered.payload(w), segs), gathered, segs.length, num)

  def bucket_wire_bytes(self, segs, workers=None):
    cap = int(self.caps(segs).sum())
    index = np.dtype(_args.index_dtype(segs.length)).itemsize
    return cap * index + (8 + 8 * segs.count if self.quantize else cap * 4)


@_args.factory
def redsync(ratio: float = 0.001, selection: str = "binary_search", quantize: bool = False,
            *, min_size: int | None = MIN_SIZE, momentum: float | None = None, axis_name: AxisName = None,
            seed: int = 0, bucket_bytes: int | None = None, dense=None, dense_axis_name=None,
            transport: str = "gather"):
  """RedSync: residual gradient sparsification with sort-free selection, all-gathered.

  Each leaf of at least ``min_size`` entries sends about ``k = ceil(ratio * n)``
  entries of its residual-compensated gradient, chosen with no sort of the
  leaf (:mod:`jaxcomp.kernels.selection`), all leaves of a bucket at once:

  - ``"binary_search"``: RedSync's threshold binary search, stopping once
    between k and 2k entries pass; the payload holds 2k slots per leaf
    (unused ones send zeros). The threshold found is kept in the state, one
    per leaf, and starts the next step's search, so a slowly moving gradient
    needs one pass.
  - ``"trimmed"``: RedSync's trimmed top-k, the exact top-k: the threshold
    ``mean|x| + r (max|x| - mean|x|)`` is lowered until k entries pass, then
    only the survivors are sorted.

  With ``quantize=True`` the values are not sent: the selected positions go
  positives first, then negatives, with the two counts and the mean magnitude
  of each side of each leaf (the decoded value is ``+mean+`` or ``-mean-``);
  the residual keeps the quantization error. Workers all-gather one payload
  per bucket (bucket positions of the narrowest integer type for the bucket)
  and scatter-add all of them into one dense mean. Leaves smaller than
  ``min_size`` (biases, norms, scalars) go dense through one psum. What was
  not sent stays in the residual. With ``momentum``, DGC's momentum
  correction replaces the plain residual (``u <- m u + g``, ``v <- v + u``,
  v sparsified, u zeroed where sent; dense leaves keep their momentum): the
  output then already holds the momentum, so follow it with plain SGD.

  Args:
    ratio: fraction of each leaf to select, in (0, 1] (RedSync: about 0.001).
    selection: ``"binary_search"`` (default) or ``"trimmed"``.
    quantize: send positions and one mean per sign instead of values.
    min_size: leaves with fewer entries travel dense (>= 1; default 256,
      RedSync's small-layer rule; None: the library's default); the bucket
      policy, see :func:`jaxcomp.build`.
    momentum: None (plain residual, default) or the DGC momentum in [0, 1).
    axis_name: the data-parallel axis, or None.
    seed: seeds the state's key (unused by the selection).
    bucket_bytes: the bucket policy, see :func:`jaxcomp.build`.
    dense: the bucket policy, see :func:`jaxcomp.build`.
    dense_axis_name: a fast axis averaged densely before the compressed exchange (see
      :func:`jaxcomp.build` and :mod:`jaxcomp.exchanges.hierarchy`).
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  References:
    Fang, Fu, Yang & Hsieh, *RedSync: Reducing Synchronization Traffic for
    Distributed Deep Learning*, arXiv:1808.04357 (trimmed top-k, threshold
    binary search, quantization, small layers dense; written from the paper's
    description, not from its code); Lin et al., *Deep Gradient Compression*, ICLR
    2018 (momentum correction and factor masking).
  """
  r = _args.ratio("ratio", ratio)
  sel = _args.choice("selection", selection, SELECTIONS)
  q = _args.flag("quantize", quantize)
  size = None if min_size is None else _args.integer("min_size", min_size, 1)
  if momentum is None:
    memory = Memory()
  else:
    memory = MomentumCorrection(_args.unit_interval("momentum", momentum), masking=True)
  method = Method("redsync", flat_route(RedSyncExchange(r, sel, q)), memory)
  return build(method, axis_name, seed, bucket_bytes=bucket_bytes, min_size=size, dense=dense,
               dense_axis_name=dense_axis_name, transport=transport)


class RedSyncCodec(Codec, ScatterCodec):
  """RedSync's selection in the codec form (the scatter exchange's): no carried thresholds."""

  leaf_segments = False  # transport="scatter": one budget per chunk
  selects = True  # transport="scatter": what the chunk owner does not select goes back to the workers

  vmappable = False  # a search per chunk, one after another

  def __init__(self, exchange: RedSyncExchange):
    self.exchange, self.block = exchange, exchange.block

  def encode(self, x, key, segs):
    return self.exchange.encode(x, segs, None)[0]

  def prepare_stages(self, codecs, index, x, key, segs):
    """One binary search for the running stage (its k and capacity as data), as
    :meth:`RedSyncExchange.exchange_stages` does; None for the trimmed top-k or mixed settings."""
    exchanges = [c.exchange for c in codecs]
    if any((ex.selection, ex.quantize) != ("binary_search", self.exchange.quantize) for ex in exchanges):
      return None
    return selection.segment_search_stages(x, segs, [ex.ks(segs) for ex in exchanges], index)[0]

  def encode_prepared(self, x, prepared, key, segs):
    if prepared is None:
      return self.encode(x, key, segs)
    idx, _ = compaction.compact(prepared, segs.length, int(self.exchange.caps(segs).sum()))
    return self.exchange.payload(x, idx, segs)

  def decode(self, payload, key, segs):
    return self.exchange.decode(payload, segs)

  def aggregate(self, gathered, key, segs, num):
    return self.exchange.mean(gathered, segs, num)
