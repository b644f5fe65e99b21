"""RedSync: residual gradient compression with fast, sort-free selection."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives import ops
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import DENSE, Ctx, Exchange, Memory, Method, build
from jaxcomp.transforms import _args
from jaxcomp.transforms.dgc import DGCMemory, DGCState
from jaxcomp.transforms.selection import threshold_binary_search, trimmed_topk
from jaxcomp.transforms.sparse import scatter_mean

SELECTIONS = ("binary_search", "trimmed")


class MomentumCorrection(DGCMemory):
  """DGC's momentum correction and factor masking, keeping what quantization lost.

  As :class:`jaxcomp.transforms.dgc.DGCMemory` (``u <- m u + g``,
  ``v <- v + u``, u zeroed where something was sent), except that the
  accumulation keeps ``v - sent`` rather than 0 at sent entries: with
  quantized values the difference to the sign's mean is not lost. Without
  quantization the two are the same (``v - v = 0``).
  """

  def update(self, x, sent, state):
    masked = super().update(x, sent, state)
    return DGCState(masked.momentum, Memory.update(self, x, sent, state.accumulation))


@dataclasses.dataclass(frozen=True)
class RedSyncExchange(Exchange):
  """Select (binary search or trimmed top-k), optionally quantize, all-gather, scatter-mean.

  Payload per leaf: ``capacity`` narrow indices and either ``capacity``
  float32 values or, quantized, two int32 counts and two float32 means
  (positives first, then negatives). The binary search's thresholds (one per
  leaf) are the exchange state.
  """

  ratio: float
  selection: str
  quantize: bool

  def capacity(self, n: int) -> int:
    k = _args.count(self.ratio, n)
    return min(n, 2 * k) if self.selection == "binary_search" else k

  def init(self, view, group, key):
    del view, key
    if self.selection == "binary_search":
      return jnp.zeros((group,), jnp.float32)
    return ()

  def encode(self, x, threshold):
    n = x.shape[0]
    k = _args.count(self.ratio, n)
    if self.selection == "binary_search":
      sel = threshold_binary_search(x, k, threshold=threshold)
    else:
      sel = trimmed_topk(x, k)
    cap = sel.indices.shape[0]
    valid = jnp.arange(cap) < sel.count
    idx = jnp.where(valid, sel.indices, 0)
    values = jnp.where(valid, x[idx], 0.0)
    itype = _args.index_dtype(n)
    if not self.quantize:
      return (values, idx.astype(itype)), sel.threshold
    pos, neg = valid & (values >= 0), valid & (values < 0)
    counts = jnp.stack([jnp.sum(pos), jnp.sum(neg)]).astype(jnp.int32)
    sums = jnp.stack([jnp.sum(jnp.where(pos, values, 0.0)), jnp.sum(jnp.where(neg, -values, 0.0))])
    means = sums / jnp.maximum(counts, 1).astype(jnp.float32)
    slot = jnp.where(pos, jnp.cumsum(pos) - 1, jnp.where(neg, counts[0] + jnp.cumsum(neg) - 1, cap))
    ordered = jnp.zeros((cap,), jnp.int32).at[slot].set(idx, mode="drop")
    return (ordered.astype(itype), counts, means), sel.threshold

  def values(self, payload):
    """The float32 values of a payload (quantized ones expanded from the means)."""
    if not self.quantize:
      return payload[0], payload[1]
    idx, counts, means = payload
    slot = jnp.arange(idx.shape[-1])
    values = jnp.where(slot < counts[0], means[0],
                       jnp.where(slot < counts[0] + counts[1], -means[1], 0.0))
    return values, idx

  def decode(self, payload, n):
    values, idx = self.values(payload)
    return jnp.zeros((n,), jnp.float32).at[idx.astype(jnp.int32)].add(values)

  def __call__(self, X, thresholds, ctx: Ctx):
    n = X.shape[1]
    if self.selection == "binary_search":
      payload, found = jax.vmap(self.encode)(X, thresholds)
      thresholds = jnp.where(jnp.isfinite(found), found, 0.0)
    else:
      payload, _ = jax.vmap(lambda x: self.encode(x, None))(X)
    local = jax.vmap(lambda p: self.decode(p, n))(payload)
    if ctx.axis.name is None:
      return local, local, thresholds
    gathered = ops.allgather(payload, ctx.axis)  # leaves (N, G, ...)
    gathered = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), gathered)
    values, idx = jax.vmap(jax.vmap(self.values))(gathered)
    mean = jax.vmap(lambda v, i: scatter_mean(v, i, n, ctx.axis.size))(values, idx)
    return mean, local, thresholds

  def wire_bytes(self, view, group):
    (n,) = view
    cap = self.capacity(n)
    index = np.dtype(_args.index_dtype(n)).itemsize
    per_leaf = cap * index + (16 if self.quantize else cap * 4)
    return group * per_leaf


def redsync(ratio: float = 0.001, selection: str = "binary_search", quantize: bool = False,
            min_size: int = 256, momentum: float | None = None, axis_name: AxisName = None,
            seed: int = 0):
  """RedSync: residual gradient sparsification with sort-free selection, all-gathered.

  Each leaf of at least ``min_size`` entries sends about ``k = ceil(ratio * n)``
  entries of its residual-compensated gradient, chosen with no sort of the
  leaf (:mod:`jaxcomp.transforms.selection`):

  - ``"binary_search"``: RedSync's threshold binary search, stopping once
    between k and 2k entries pass; the payload holds 2k slots (unused ones
    send zeros). The threshold found is kept in the state, one per leaf, and
    starts the next step's search, so a slowly moving gradient needs one pass.
  - ``"trimmed"``: RedSync's trimmed top-k, the exact top-k: the threshold
    ``mean|x| + r (max|x| - mean|x|)`` is lowered until k entries pass, then
    ``lax.top_k`` runs on the survivors only.

  With ``quantize=True`` the values are not sent: the selected positions go
  positives first, then negatives, with the two counts and the mean magnitude
  of each side (the decoded value is ``+mean+`` or ``-mean-``); the residual
  keeps the quantization error. Workers all-gather the payloads (indices of
  the narrowest integer type for n) and scatter-add all of them into one dense
  mean. Leaves smaller than ``min_size`` (biases, norms, scalars) go dense
  through one psum. What was not sent stays in the residual. With
  ``momentum``, DGC's momentum correction replaces the plain residual
  (``u <- m u + g``, ``v <- v + u``, v sparsified, u zeroed where sent): the
  output then already holds the momentum, so follow it with plain SGD.

  Args:
    ratio: fraction of each leaf to select, in (0, 1] (RedSync: about 0.001).
    selection: ``"binary_search"`` (default) or ``"trimmed"``.
    quantize: send positions and one mean per sign instead of values.
    min_size: leaves with fewer entries travel dense (>= 1; default 256).
    momentum: None (plain residual, default) or the DGC momentum in [0, 1).
    axis_name: the data-parallel axis, or None.
    seed: seeds the state's key (unused by the selection).

  References:
    Fang, Fu, Yang & Hsieh, *RedSync: Reducing Synchronization Traffic for
    Distributed Deep Learning*, arXiv:1808.04357 (trimmed top-k, threshold
    binary search, quantization, small layers dense; details recalled from
    the paper, not its code); Lin et al., *Deep Gradient Compression*, ICLR
    2018 (momentum correction and factor masking).
  """
  r = _args.ratio("ratio", ratio)
  sel = _args.choice("selection", selection, SELECTIONS)
  q = _args.flag("quantize", quantize)
  size = _args.integer("min_size", min_size, 1)
  if momentum is None:
    memory = Memory()
  else:
    memory = MomentumCorrection(_args.unit_interval("momentum", momentum), None, axis_name)
  sparse = RedSyncExchange(r, sel, q)

  def route(shape):
    n = int(np.prod(shape, dtype=np.int64))
    return (DENSE if n < size else sparse), (n,)

  return build(Method("redsync", route, memory), axis_name, seed)
