"""Sparsifiers: top-k (gathered values + compact positions) and random-k (psum-ed values).

Top-k has two selections and two position codes:

- ``selection="exact"`` (default): the ``k = ceil(ratio * n)`` entries of
  largest magnitude of each leaf, ties to the lower index as ``lax.top_k``
  (every leaf of a bucket at once: :mod:`jaxcomp.kernels.segtopk`, each leaf's
  k-th largest magnitude bracketed by a sample and found exactly, nothing sorted).
- ``selection="chunked"``: the ``ceil(ratio * b)`` largest of every block of
  ``b`` consecutive entries. About the same number of entries, not the same
  set; several times faster on CPU (no global top-k), and each position is an
  offset inside its block (uint8 for ``b <= 256``, else uint16).
- positions of the exact selection: ``"chunk16"`` (default) sends each
  position as a uint16 offset inside its chunk of 65536 entries plus one int32
  start per chunk (2 bytes per entry instead of 4 once ``n > 65536``);
  ``"global"`` sends the position itself in the narrowest dtype that holds
  ``n`` (uint8, uint16 or int32).
- values in float32 (default), float16 or bfloat16; with error feedback the
  rounding error of a 16-bit value stays in the residual.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import policy
from jaxcomp.core.builder import build
from jaxcomp.core.layout import Segments
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, CodecExchange, Memory, flat_route
from jaxcomp.core.stacking import LoopCodec
from jaxcomp.exchanges.scatter import ScatterCodec
from jaxcomp.kernels import segtopk
from jaxcomp.kernels.sparse import kept, scatter_mean, zeros_after
from jaxcomp.transforms import _args

CHUNK = 65536  # entries per chunk of the "chunk16" position code
SELECTIONS = ("exact", "chunked")
SCOPES = ("layer", "bucket")
POSITIONS = ("chunk16", "global")
VALUE_DTYPES = ("float32", "float16", "bfloat16")




# ----------------------------------------------------------------------------
# Position codes


def chunk16_encode(positions: jax.Array, n: int):
  """Ascending int32 positions -> (uint16 offsets in chunks of 65536, int32 chunk starts).

  ``starts[c]`` is the number of positions below ``c * 65536``, so the entries
  of chunk ``c`` are ``starts[c] .. starts[c + 1] - 1``.
  """
  chunks = -(-n // CHUNK)
  starts = jnp.searchsorted(positions >> 16, jnp.arange(chunks, dtype=positions.dtype), side="left")
  return (positions & (CHUNK - 1)).astype(jnp.uint16), starts.astype(jnp.int32)


def chunk16_decode(offsets: jax.Array, starts: jax.Array) -> jax.Array:
  """Inverse of :func:`chunk16_encode`: int32 positions."""
  slot = jnp.arange(offsets.shape[-1], dtype=jnp.int32)
  chunk = jnp.searchsorted(starts, slot, side="right").astype(jnp.int32) - 1
  return chunk * CHUNK + offsets.astype(jnp.int32)


def default_block(ratio: float) -> int:
  """Block length of the chunked selection: the smallest power of two >= 256 and >= 8 / ratio.

  At least 8 entries are kept per block, so ``ceil(ratio * b) / b`` exceeds
  ``ratio`` by less than 1/8 (ratio 0.01: blocks of 1024, 11 kept, 1.07%),
  capped at 65536 so that offsets fit in uint16.
  """
  need = max(256, math.ceil(8.0 / ratio - 1e-9))
  return min(CHUNK, 1 << (need - 1).bit_length())


def _offset_dtype(block: int):
  return np.uint8 if block <= 256 else np.uint16


# ----------------------------------------------------------------------------
# Top-k


@dataclasses.dataclass(frozen=True)
class TopKCodec(Codec, ScatterCodec, LoopCodec):
  """The k largest |x| of each leaf (``scope="layer"``) or of the bucket: values + positions."""

  leaf_segments = False  # transport="scatter": one budget per chunk

  ratio: float
  positions: str = "chunk16"
  values: str = "float32"
  scope: str = "layer"
  block = 128
  selects = True  # transport="scatter": what the chunk owner does not select goes back to the workers

  def _segments(self, segs: Segments) -> Segments:
    if self.scope == "layer":
      return segs
    return Segments((0,), (segs.length,), ((segs.length,),), segs.block)

  def _k(self, segs: Segments) -> np.ndarray:
    if self.scope == "layer":
      return np.asarray([_args.ratio_count(self.ratio, n) for n in segs.sizes], np.int64)
    return np.asarray([_args.ratio_count(self.ratio, sum(segs.sizes))], np.int64)

  def _chunked(self, n: int) -> bool:
    return self.positions == "chunk16" and n > CHUNK

  def encode(self, x, key, segs):
    n = segs.length
    idx = segtopk.segmented_topk(x, self._segments(segs), self._k(segs))
    values = x[jnp.minimum(idx, n - 1)].astype(self.values)
    if not self._chunked(n):
      return values, idx.astype(_args.index_dtype(n))
    return (values,) + chunk16_encode(idx, n)

  def group_key(self, segs):
    """Buckets of chunk16 positions share one loop (as do their samples' forms)."""
    return segtopk.sampled(self._segments(segs)) if self._chunked(segs.length) else None

  def group_tables(self, segments):
    plans = segtopk.group_plans([self._segments(s) for s in segments], [self._k(s) for s in segments])
    return [(p, np.int32(s.length)) for p, s in zip(plans, segments)]

  def encode_table(self, x, key, table):
    plan, n = table
    idx = segtopk.topk_positions(x, plan)
    idx = jnp.where(idx >= n, n, idx)  # unused slots hold the bucket's own length, as encode's
    values = x[jnp.minimum(idx, n - 1)].astype(self.values)
    return (values,) + chunk16_encode(idx, x.shape[0]) + (idx,)  # the positions too, for sent_table

  def cut(self, payload, segs):
    k = int(self._k(segs).sum())
    return payload[0][:k], payload[1][:k], payload[2][:-(-segs.length // CHUNK)]

  def sent_table(self, x, payload, key, segs):
    if self.values != "float32":
      return super().sent_table(x, payload, key, segs)
    return kept(x, payload[3][:int(self._k(segs).sum())])  # no decode of the positions

  def _positions(self, payload, n):
    if not self._chunked(n):
      return payload[1].astype(jnp.int32)
    return chunk16_decode(payload[1], payload[2])

  def decode(self, payload, key, segs):
    n = segs.length
    pos = self._positions(payload, n)
    return zeros_after(n, payload[0]).at[pos].set(
        payload[0].astype(jnp.float32), mode="drop", unique_indices=True)

  def sent(self, x, payload, key, segs):
    if self.values != "float32":  # the values were rounded: what was sent is their decode
      return self.decode(payload, key, segs)
    return kept(x, self._positions(payload, segs.length))

  def aggregate(self, gathered, key, segs, num):
    n = segs.length

    def sparse(w):
      payload = gathered.payload(w)
      return payload[0], self._positions(payload, n)

    return scatter_mean(sparse, gathered, n, num)


@dataclasses.dataclass(frozen=True)
class ChunkedTopKCodec(Codec, ScatterCodec):
  """The ``ceil(ratio * b)`` largest |x| of each block of ``b``: values + in-block offsets."""

  leaf_segments = False  # transport="scatter": one budget per chunk

  ratio: float
  chunk: int
  values: str = "float32"
  selects = True  # transport="scatter": what the chunk owner does not select goes back to the workers

  def _layout(self, n: int):
    b = min(self.chunk, n)
    return b, -(-n // b), _args.ratio_count(self.ratio, b)

  def encode(self, x, key, segs):
    n = x.shape[0]
    b, rows, kb = self._layout(n)
    if rows * b != n:
      x = jnp.pad(x, (0, rows * b - n))
    xr = x.reshape(rows, b)
    _, off = lax.top_k(jnp.abs(xr), kb)
    vals = jnp.take_along_axis(xr, off, axis=1)
    return vals.reshape(-1).astype(self.values), off.reshape(-1).astype(_offset_dtype(b))

  def _positions(self, off, n):
    b, rows, kb = self._layout(n)
    base = jnp.repeat(jnp.arange(rows, dtype=jnp.int32) * b, kb)
    return base + off.astype(jnp.int32)

  def decode(self, payload, key, segs):
    n = segs.length
    vals, off = payload
    pos = self._positions(off, n)
    return zeros_after(n, vals).at[pos].set(vals.astype(jnp.float32), mode="drop", unique_indices=True)

  def sent(self, x, payload, key, segs):
    if self.values != "float32":  # the values were rounded: what was sent is their decode
      return self.decode(payload, key, segs)
    return kept(x, self._positions(payload[1], segs.length))

  def aggregate(self, gathered, key, segs, num):
    n = segs.length

    def sparse(w):
      vals, off = gathered.payload(w)
      return vals, self._positions(off, n)

    return scatter_mean(sparse, gathered, n, num)


@_args.factory
def topk(ratio: float = 0.01, *, axis_name: AxisName = None, error_feedback: bool = True, seed: int = 0,
         selection: str = "exact", positions: str = "chunk16", values: str = "float32",
         block: int | None = None, scope: str = "layer", bucket_bytes: int | None = None,
         min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather"):
  """Top-k sparsification with error feedback (all-gather of values + positions).

  Each leaf (flattened, n entries) keeps its entries of largest magnitude;
  workers all-gather the payloads and each one scatter-adds all of them into
  one dense mean. What was not sent stays in the residual.

  With the defaults the set sent is exactly the ``k = max(1, ceil(ratio * n))``
  largest ``|x|`` of each leaf, and the payload is k float32 values plus k
  positions coded ``chunk16`` (k uint16 offsets and ``ceil(n / 65536)`` int32
  chunk starts; leaves of at most 65536 entries send plain uint8/uint16
  positions): ``6k + 4 ceil(n / 65536)`` bytes for a large leaf.

  Args:
    ratio: fraction of entries sent, in (0, 1]. GRACE's code defaults to 0.3,
      its paper evaluates 0.01 and 0.001; the default here is 0.01.
    axis_name: the data-parallel axis, or None for a local round trip.
    error_feedback: keep what was not sent in a residual (default True).
    seed: seeds the state's key (unused by top-k itself).
    selection: ``"exact"`` (default): the k largest of the leaf.
      ``"chunked"``: the ``ceil(ratio * b)`` largest of each block of ``b``
      consecutive entries; faster (no global top-k), a slightly different set
      and up to 1/8 more entries with the default block.
    positions: for the exact selection, ``"chunk16"`` (default) or
      ``"global"`` (each position in the narrowest dtype holding n: uint8,
      uint16, int32). The chunked selection always sends in-block offsets
      (uint8 for b <= 256, else uint16).
    values: dtype of the values on the wire: ``"float32"`` (default),
      ``"float16"`` (values beyond 65504 become inf, which error feedback does
      not absorb) or ``"bfloat16"``.
    block: block length b for ``selection="chunked"``, in [1, 65536];
      default :func:`default_block` (ratio 0.01: 1024).
    scope: for the exact selection, ``"layer"`` (default, as GRACE): the k
      largest of each leaf, found for all leaves of a bucket by one segmented
      search; ``"bucket"``: the ``ceil(ratio * m)`` largest of the whole
      bucket of m entries (one selection over fused layers, as in bucketed
      top-k systems), positions relative to the bucket.
    bucket_bytes, min_size, dense, dense_axis_name: see :func:`jaxcomp.build`; by default every
      leaf is compressed (``min_size=0``), see :data:`jaxcomp.core.policy.EVERY_LEAF`.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxcomp
    >>> params = {"w": jnp.zeros((256, 64))}
    >>> tx = jaxcomp.topk(ratio=0.01)  # axis_name=None: one worker, a local round trip
    >>> jaxcomp.wire_bytes(tx, params)  # k = 164 float32 values and 164 uint16 positions
    984

  References:
    Aji & Heafield, *Sparse Communication for Distributed Gradient Descent*,
    EMNLP 2017; Stich et al., *Sparsified SGD with Memory*, NeurIPS 2018;
    Shi et al., *Understanding Top-k Sparsification in Distributed Deep
    Learning*, 2019 (chunk-wise selection).
  """
  r = _args.ratio("ratio", ratio)
  ef = _args.flag("error_feedback", error_feedback)
  sel = _args.choice("selection", selection, SELECTIONS)
  pos = _args.choice("positions", positions, POSITIONS)
  val = _args.choice("values", values, VALUE_DTYPES)
  if block is not None and sel != "chunked":
    raise ValueError(f"block applies to selection='chunked' only, got block={block!r} with"
                     f" selection={sel!r}")
  sc = _args.choice("scope", scope, SCOPES)
  if sel == "chunked":
    if sc != "layer":
      raise ValueError(f"scope applies to selection='exact' only, got scope={sc!r} with selection='chunked'")
    b = default_block(r) if block is None else _args.integer("block", block, 1, CHUNK)
    codec = ChunkedTopKCodec(r, b, val)
  else:
    codec = TopKCodec(r, pos, val, sc)
  method = Method("topk", flat_route(CodecExchange(codec)), Memory(enabled=ef), min_size=policy.EVERY_LEAF)
  return build(method, axis_name, seed, bucket_bytes, min_size, dense, dense_axis_name=dense_axis_name,
               transport=transport)


# ----------------------------------------------------------------------------
# Random-k


def random_positions(key: jax.Array, segs: Segments, ratio: float):
  """Random-k positions in a bucket: exactly ``k_s = max(1, ceil(ratio * n_s))`` per segment.

  Segment ``s`` is cut into ``k_s`` strata ``[floor(j n_s / k_s), floor((j + 1) n_s / k_s))``
  (lengths differ by at most one) and one uniform position is drawn in each.
  Returns ``(positions, lengths)``: int32 bucket positions ``(sum k,)``,
  distinct and ascending, and each stratum's length (an entry of a stratum
  of length c is picked with probability 1/c), with no permutation or sort.
  """
  starts, lengths = _strata(segs, ratio)
  u = jax.random.randint(key, (starts.shape[0],), 0, np.iinfo(np.int32).max, dtype=jnp.int32)
  return jnp.asarray(starts) + u % jnp.asarray(lengths), lengths


def _strata(segs: Segments, ratio: float):
  starts, lengths = [], []
  for off, n in zip(segs.offsets, segs.sizes):
    k = _args.ratio_count(ratio, n)
    edges = (np.arange(k + 1, dtype=np.int64) * n) // k
    starts.append(off + edges[:-1])
    lengths.append(np.diff(edges))
  return (np.concatenate(starts).astype(np.int32), np.concatenate(lengths).astype(np.int32))


@dataclasses.dataclass(frozen=True)
class RandomKCodec(Codec):
  """Values at positions drawn from a key every worker shares: only values travel."""

  ratio: float
  unbiased: bool
  linear = True
  shared_key = True

  def encode(self, x, key, segs):
    pos, lengths = random_positions(key, segs, self.ratio)
    values = x[pos]
    return values * jnp.asarray(lengths, jnp.float32) if self.unbiased else values

  def decode(self, payload, key, segs):
    pos, _ = random_positions(key, segs, self.ratio)
    return zeros_after(segs.length, payload).at[pos].set(payload, unique_indices=True)

  def sent(self, x, payload, key, segs):
    if self.unbiased:  # the values were scaled: what was sent is their decode
      return self.decode(payload, key, segs)
    return kept(x, random_positions(key, segs, self.ratio)[0])


@_args.factory
def randomk(ratio: float = 0.01, *, axis_name: AxisName = None, error_feedback: bool = True,
            unbiased: bool = False, seed: int = 0, bucket_bytes: int | None = None,
            min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather"):
  """Random-k sparsification; positions come from the shared key, values are psum-ed.

  Every worker draws the same positions from the state's key (split each
  step), so only the values cross the wire and they add linearly. Each leaf
  sends exactly ``k = max(1, ceil(ratio * n))`` values: it is cut into k
  strata of ``floor(n / k)`` or ``ceil(n / k)`` entries and one uniform
  position is drawn in each, so an entry of a stratum of length c is picked
  with probability ``1/c`` and no permutation or sort is needed.

  Args:
    ratio: fraction of entries sent, in (0, 1] (GRACE's default 0.3; 0.01 here).
    axis_name: the data-parallel axis, or None.
    error_feedback: keep unsent entries in the residual (default True).
    unbiased: scale each sent value by its stratum's length ``c`` so that the
      estimate is unbiased (use with ``error_feedback=False``).
    seed: seeds the shared key.
    bucket_bytes, min_size, dense, dense_axis_name: the bucket policy and the fast axis, see
      :func:`jaxcomp.build`. Unlike the other sparsifiers, random-k keeps small leaves dense by
      default (1024 entries): compressed, a bias of 10 entries sends one random entry a step,
      and its momentum-corrected residual grows until the step lands (the digits MLP diverged,
      docs/recipes.md); dense they add little to its bytes on ResNet-50's shapes.
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  References:
    Stich et al., *Sparsified SGD with Memory*, NeurIPS 2018; Wangni et al.,
    *Gradient Sparsification for Communication-Efficient Distributed
    Optimization*, NeurIPS 2018.
  """
  r = _args.ratio("ratio", ratio)
  ef = _args.flag("error_feedback", error_feedback)
  ub = _args.flag("unbiased", unbiased)
  codec = RandomKCodec(r, ub)
  return build(Method("randomk", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed,
               bucket_bytes, min_size, dense, dense_axis_name=dense_axis_name, transport=transport)
