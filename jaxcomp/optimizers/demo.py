"""DeMo: decoupled momentum, whose fast DCT components alone are exchanged; a sign-SGD step.

Each worker keeps its momentum local and never averages it with the others':

1. ``m <- decay * m + g`` (the worker's own gradient);
2. the fast components of ``m``: every tile of ``chunk x chunk`` entries goes
   through an orthonormal 2-D DCT-II, and the ``topk`` coefficients of largest
   magnitude of each tile are kept, ``q``;
3. ``m <- m - IDCT(q)``: what was extracted leaves the momentum;
4. the workers all-gather their sparse coefficients (values and in-tile
   positions); each decodes the mean of everyone's fast components;
5. ``p <- p - lr * (sign(mean fast components) + weight_decay * p)``.

In jaxcomp's terms the momentum is the error-feedback memory with
``beta = decay`` (:class:`jaxcomp.core.protocol.Memory` computes ``x = decay * e + g``
and keeps ``e <- x - sent``), and steps 2-4 are one codec,
:class:`DCTTopKCodec`, moved by the generic builder (:func:`jaxcomp.build`);
:func:`demo` chains the sign, the decoupled weight decay and the learning
rate after it into a complete optimizer.

The optimizer is an ``optax`` chain of the compressor, ``optax.scale_by_sign``,
``optax.add_decayed_weights`` (``optax.identity`` when ``weight_decay`` is 0)
and ``optax.scale_by_learning_rate``: apply its updates with
``optax.apply_updates``, and pass ``params`` to ``update`` when
``weight_decay`` is nonzero. ``.compressor`` is the jaxcomp transformation
inside (:func:`jaxcomp.wire_bytes` and :func:`jaxcomp.memory_tree` read it;
its state is the chain state's first entry). A non-finite gradient on any
worker makes every update NaN on every worker and leaves the momentum
finite (see :func:`jaxcomp.build`).

Bytes: a tile of ``chunk**2`` entries sends ``topk`` values and ``topk``
positions: with the defaults (64 x 64 tiles, 32 bfloat16 values and uint16
positions) 128 bytes for 4096 entries, 128x fewer than float32. Small
leaves are padded to a whole tile; with ``min_size=0`` they are compressed
too, still fewer bytes than dense (a 64-entry bias: 128 bytes, against 512
for its 128-entry dense row). On a char-level transformer (vocab 93, width
64, context 64, 2 layers, MLP 256: 116,189 parameters in 38 leaves, 52
tiles), ``jaxcomp.wire_bytes(demo(1e-3, axis_name="data"), params)`` is
6,660 bytes (52 * 128 + the 4-byte non-finite flag) against 470,528 for
``jaxcomp.none(axis_name="data")``: 70.6x fewer (``tests/test_demo.py``
computes it). With the library's default ``min_size`` (1024) its 23 small
leaves would travel dense: 16,516 bytes, 28.5x.

Deviations from the reference implementation (github.com/bloc97/DeMo):

- Tiles are contiguous runs of ``chunk * chunk`` entries of the flattened
  bucket, each reshaped ``(chunk, chunk)``; jaxcomp's buckets are flat, so the
  reference's 2-D tiles of each parameter matrix (the largest divisor of each
  dimension up to ``chunk``, 1-D chunks for vectors) are not reproduced. Every
  leaf starts on a tile and is zero-padded to whole tiles; the padding's
  decode is discarded and never enters the momentum.
- The mean over workers is ``sum / N`` of the decoded fast components. The
  reference averages each coefficient over the workers that sent it
  (``scatter_reduce(..., "mean")``), so a coefficient one worker alone sent
  counts in full there and ``1 / N`` here.
- The momentum accumulates ``g``, not ``lr * g``: the learning rate applies
  after the sign (the same step for a constant learning rate; under a
  schedule the reference weighs older gradients by their step's rate).
- Positions travel as in-tile offsets in the narrowest unsigned dtype (uint8
  for tiles of <= 256 entries, uint16 up to 65536), values in
  ``value_dtype``; the reference sends int64 positions and values in the
  parameters' dtype.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp.collectives import ops
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core.builder import build
from jaxcomp.core.compression import CompressedOptimizer, compressed_optimizer
from jaxcomp.core.layout import Segments
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, CodecExchange, Memory, flat_route
from jaxcomp.exchanges.scatter import TRANSPORTS
from jaxcomp.transforms import _args

VALUE_DTYPES = ("float32", "bfloat16", "float16")


def dct_matrix(n: int) -> np.ndarray:
  """The orthonormal DCT-II matrix ``D`` (float32 ``(n, n)``): ``D @ v`` is v's DCT, ``D.T`` the inverse.

  ``D[k, j] = s_k cos(pi (2 j + 1) k / (2 n))`` with ``s_0 = sqrt(1 / n)``,
  ``s_k = sqrt(2 / n)`` otherwise (scipy's ``dct(..., norm="ortho")``).
  """
  k = np.arange(n, dtype=np.float64)[:, None]
  j = np.arange(n, dtype=np.float64)[None, :]
  d = np.sqrt(2.0 / n) * np.cos(np.pi * (2.0 * j + 1.0) * k / (2.0 * n))
  d[0] /= np.sqrt(2.0)
  return d.astype(np.float32)


_HIGHEST = lax.Precision.HIGHEST  # full float32 products (no TF32/bf16 passes on accelerators)


@dataclasses.dataclass(frozen=True)
class DCTTopKCodec(Codec):
  """The ``topk`` largest 2-D DCT coefficients of each tile of ``chunk * chunk`` entries.

  A bucket of ``segs.length`` entries (a multiple of the block, ``chunk *
  chunk``: every segment is padded to whole tiles) is cut into
  ``T = length / chunk**2`` tiles, each reshaped ``(chunk, chunk)`` and
  transformed as ``D @ tile @ D.T`` (:func:`dct_matrix`). Payload: the kept
  coefficients' values ``(T, topk)`` in ``value_dtype`` and their in-tile
  positions ``(T, topk)`` (uint8, uint16 or int32, the narrowest that holds
  ``chunk**2`` positions). Not linear in jaxcomp's sense (workers keep
  different positions, so payloads do not add under a psum): it travels by
  all-gather, and :meth:`aggregate` sums the workers' coefficients (the
  inverse DCT is linear) before one inverse transform.
  """

  chunk: int
  topk: int
  value_dtype: str = "bfloat16"

  @property
  def block(self) -> int:
    return self.chunk * self.chunk

  def _tiles(self, segs: Segments) -> int:
    return segs.length // self.block

  def coefficients(self, x: jax.Array) -> jax.Array:
    """The DCT of every tile of ``x`` (length a multiple of ``chunk**2``): float32 ``(T, chunk**2)``."""
    c = self.chunk
    d = jnp.asarray(dct_matrix(c))
    tiles = x.astype(jnp.float32).reshape(-1, c, c)
    out = jnp.einsum("ij,tjk,lk->til", d, tiles, d, precision=_HIGHEST)
    return out.reshape(-1, c * c)

  def inverse(self, coefficients: jax.Array) -> jax.Array:
    """Inverse of :meth:`coefficients`: ``(T, chunk**2)`` -> the flat vector of length ``T * chunk**2``."""
    c = self.chunk
    d = jnp.asarray(dct_matrix(c))
    tiles = coefficients.reshape(-1, c, c)
    return jnp.einsum("ji,tjk,kl->til", d, tiles, d, precision=_HIGHEST).reshape(-1)

  def encode(self, x, key, segs):
    coef = self.coefficients(x)
    _, idx = lax.top_k(jnp.abs(coef), self.topk)
    values = jnp.take_along_axis(coef, idx, axis=1)
    return values.astype(self.value_dtype), idx.astype(_args.index_dtype(self.block))

  def _scatter(self, acc, payload, add: bool):
    values, idx = payload
    rows = jnp.arange(acc.shape[0], dtype=jnp.int32)[:, None]
    at = acc.at[rows, idx.astype(jnp.int32)]
    v = values.astype(jnp.float32)
    return at.add(v) if add else at.set(v, unique_indices=True)

  def decode(self, payload, key, segs):
    zeros = jnp.zeros((self._tiles(segs), self.block), jnp.float32)
    return self.inverse(self._scatter(zeros, payload, add=False))

  def aggregate(self, gathered, key, segs, num):
    """The mean of the workers' decodes: their coefficients summed in worker order, one inverse DCT.

    One scatter-add per worker into a ``(T, chunk**2)`` accumulator, in a
    fixed order, so the float result is the same on every worker.
    """
    zeros = ops.like_vma(jnp.zeros((self._tiles(segs), self.block), jnp.float32), gathered.buffers)

    def body(w, acc):
      return self._scatter(acc, gathered.payload(w), add=True)

    total = lax.fori_loop(0, gathered.workers, body, zeros)
    return self.inverse(total / num)


def _learning_rate(value):
  if callable(value):
    return value
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
    raise ValueError(f"learning_rate must be a finite float > 0 or an optax schedule (a callable of the"
                     f" step), got learning_rate={value!r}")
  return float(value)


@_args.factory
def demo(learning_rate: float | optax.Schedule, compression_decay: float = 0.999, compression_topk: int = 32,
         compression_chunk: int = 64, weight_decay: float = 0.0, value_dtype: str = "bfloat16",
         *, axis_name: AxisName = None, seed: int = 0, bucket_bytes: int | None = None, min_size: int = 0,
         dense=None, transport: str = "gather") -> CompressedOptimizer:
  """DeMo: decoupled momentum; only its fast DCT components travel, and the step is their mean's sign.

  Each worker keeps a local momentum ``m <- decay * m + g``, takes the
  ``compression_topk`` largest orthonormal DCT-II coefficients of each tile of
  ``compression_chunk**2`` entries of it (its fast components), removes them
  from ``m``, and all-gathers them; every worker decodes the mean of all
  workers' fast components and steps
  ``p <- p - lr * (sign(mean) + weight_decay * p)`` (decoupled weight decay).
  See :mod:`jaxcomp.optimizers.demo` for the codec, the optimizer's chain,
  the bytes and the deviations from the reference implementation.

  Args:
    learning_rate: the step size, a float > 0 or an optax schedule.
    compression_decay: the momentum's decay in [0, 1) (reference: 0.999).
    compression_topk: coefficients kept per tile, in [1, compression_chunk**2]
      (reference: 32).
    compression_chunk: the tile side c >= 1; tiles hold c * c consecutive
      entries (reference: 64).
    weight_decay: decoupled weight decay >= 0 (needs ``params`` in ``update``).
    value_dtype: dtype of the coefficients on the wire: ``"bfloat16"``
      (default), ``"float32"`` or ``"float16"``; what the rounding loses stays
      in the momentum.
    axis_name: the data-parallel axis, or None for one worker.
    seed: seeds the compressor's key (DeMo itself draws nothing).
    bucket_bytes, min_size, dense: the bucket policy, see :func:`jaxcomp.build`;
      ``min_size`` defaults to 0 here (every leaf compressed, as the
      reference does; see Bytes in :mod:`jaxcomp.optimizers.demo`).
    transport: ``"gather"`` (all-gather the sparse coefficients, as the
      reference) or ``"scatter"`` (bytes per worker flat in the number of
      workers: each chunk's mean is compressed again by its owner), see
      :mod:`jaxcomp.exchanges.scatter`.

  Returns:
    A :class:`jaxcomp.core.compression.CompressedOptimizer`.

  References:
    Peng, Quesnelle & Kingma, *DeMo: Decoupled Momentum Optimization*, 2024
    (arXiv:2411.19870), Algorithm 1; reference implementation
    github.com/bloc97/DeMo.
  """
  lr = _learning_rate(learning_rate)
  decay = _args.unit_interval("compression_decay", compression_decay)
  chunk = _args.integer("compression_chunk", compression_chunk, 1)
  topk = _args.integer("compression_topk", compression_topk, 1, chunk * chunk)
  wd = _args.positive("weight_decay", weight_decay, allow_zero=True)
  vd = _args.choice("value_dtype", value_dtype, VALUE_DTYPES)
  ex = _args.choice("transport", transport, TRANSPORTS)
  codec = DCTTopKCodec(chunk, topk, vd)
  compressor = build(Method("demo", flat_route(CodecExchange(codec)), Memory(beta=decay)), axis_name, seed,
                     bucket_bytes=bucket_bytes, min_size=min_size, dense=dense, transport=ex)
  # identity without weight decay: optax's add_decayed_weights wants params even at 0 (same empty state)
  decay_tx = optax.add_decayed_weights(wd) if wd else optax.identity()
  tx = optax.chain(compressor, optax.scale_by_sign(), decay_tx, optax.scale_by_learning_rate(lr))
  return compressed_optimizer(tx, compressor)
