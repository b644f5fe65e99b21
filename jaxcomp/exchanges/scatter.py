"""The scatter exchange: bytes per worker that do not grow with the number of workers.

``transport="gather"`` (every factory's default) all-gathers each worker's
payload: a worker receives N - 1 payloads, linear in N. ``transport="scatter"``
keeps the all-reduce structure, as DeepSpeed ZeRO++'s qgZ and torch_cgx do:

1. Each bucket is cut into N chunks of ``C`` entries (``C`` a multiple of
   :data:`jaxcomp.core.layout.ROW` and of the codec's block; the bucket is
   zero-padded to ``N * C``). Every worker encodes its N chunks and one
   ``all_to_all`` sends chunk j's payload to worker j, who decodes the N
   payloads of its chunk and averages them in float32 (the codec's own
   ``aggregate``: a mean, a majority vote).
2. Worker j adds its owner residual to that mean chunk, encodes it again, and
   one ``all_gather`` gives every worker the N compressed mean chunks, which
   everyone decodes alike: replicas stay bit-identical.

A majority vote (signSGD, Signum) reaches phase 2 as -1, 0 or +1 per entry;
the owner sends it in 2 bits (:class:`jaxcomp.transforms.sign.VoteCodec`,
exact), not as a sign that would turn a tie into +1.

Each worker hands ``(N + 1)`` chunk payloads to collectives and receives
about ``2 (N - 1) / N`` of one bucket's payload: flat in N.

Two error-feedback memories: the worker's residual of phase 1 (the method's
own memory, as with the gather) and the owner's residual of phase 2, the
exchange's state: a float32 vector as long as the bucket, nonzero only on the
worker's own chunk (so its size does not depend on N), always on: phase 2
compresses a mean, which no per-worker unbiasedness argument covers. Every
value of the gradient is either delivered or held in one of the two.

A chunk is cut where any chunk holds a leaf's boundary
(:func:`jaxcomp.core.layout.chunk_segments`: one static layout for every chunk, at
most 2 x leaves + 1 segments): a codec's per-leaf scale or norm applies per leaf
within each chunk, as in ZeRO++'s blockwise quantization, and never mixes
leaves (one scale over a whole chunk lost 1-bit and signSGD many points on
the suite's MNIST CNN: docs/recipes.md). A sparsifier
(``ScatterCodec.leaf_segments = False``) keeps one segment per chunk: it
selects ``ratio * C`` entries in each owner's region (its static capacity;
what is not selected stays in the worker's residual), and the owner selects
``ratio * C`` of its summed region again.

A selection (a :class:`ScatterCodec` with ``selects = True``: top-k, RedSync) hands back what the
owner did not select, as Ok-Topk and gTop-k return the reduced values left
out of the global top-k to the local residuals: an entry of the owner's
phase-2 decode that is 0 is not delivered, so every worker counts its own
phase-1 share of it as not sent (``local`` is 0 there) and keeps it in its
residual, to select again; the owner keeps only what a selected value lost
(a 16-bit value's rounding). Kept in the owner's residual instead, the
(N - 1) / N of the summed region that phase 2 cannot select grows behind
the workers' momentum (they count it as sent and move on to new entries):
top-k's recipe lost accuracy that way and RedSync's diverged on the suite's
regression (docs/recipes.md). DGC keeps what its owner did not select, which
served it better there.
Without a worker memory (``error_feedback=False``) what the owner does not
select is dropped, as what a worker does not select is.

Psum-ed methods (none, fp16, bf16, randomk with its shared positions) already
reduce with an all-reduce and keep it; PowerSGD, ACP-SGD (all-reduced
factors) and SBC (its sync schedule and Golomb stream) have no scatter form
and refuse ``transport="scatter"``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.collectives import ops, packing
from jaxcomp.core import layout
from jaxcomp.core.protocol import Codec, CodecExchange, Exchange

TRANSPORTS = ("gather", "scatter")


class ScatterCodec:
  """Mixin of a codec whose scatter form differs from the defaults below.

  A codec without it runs under ``transport="scatter"`` as a per-leaf codec:
  vmapped over chunks, each chunk cut at leaf boundaries, no selection, the
  owner sending with the codec itself.
  """

  selects: bool = False
  """A selection (a sparsifier): what a chunk's owner does not select goes back to the workers
  that sent it."""

  leaf_segments: bool = True
  """A chunk is cut at every leaf boundary (:func:`jaxcomp.core.layout.chunk_segments`), so a
  per-segment scale or norm never mixes leaves; False (the sparsifiers): one segment per chunk, one
  budget over it (per-leaf budgets within chunks lost accuracy on the suite, docs/recipes.md)."""

  vmappable: bool = True
  """``encode``/``decode`` may be vmapped over chunks; False: one chunk after another (``lax.map``)."""

  @property
  def owner_codec(self) -> Codec:
    """What a chunk owner sends of its reduced chunk (the codec itself by default)."""
    return self

  def prepare_stages(self, codecs, index, x, key, segs) -> Any:
    """Work of ``encode`` that the codecs of a schedule's stages (``codecs``, this one first, all of
    this type; ``index`` traced, the stage that runs) share, done once for chunk ``x``: DGC's
    thresholds (the running stage's ratio as data) and the mask they select, counted. None (the
    default): nothing shared."""
    del codecs, index, x, key, segs
    return None

  def encode_prepared(self, x, prepared, key, segs):
    """``encode(x, key, segs)`` given :meth:`prepare_stages`' result (None: encode from scratch)."""
    del prepared
    return self.encode(x, key, segs)


class ScatterForm(abc.ABC):
  """Mixin of an exchange (not a :class:`~jaxcomp.core.protocol.CodecExchange`) that has a scatter form."""

  @abc.abstractmethod
  def scatter_codec(self, ctx) -> Codec:
    """The codec ``transport="scatter"`` runs in this exchange's place (``ctx`` None: for sizes only)."""


_PER_LEAF = ScatterCodec()


def _traits(codec: Codec) -> ScatterCodec:
  """The codec's scatter traits: itself with :class:`ScatterCodec`, else the per-leaf defaults."""
  return codec if isinstance(codec, ScatterCodec) else _PER_LEAF


def _owner(codec: Codec) -> Codec:
  return codec.owner_codec if isinstance(codec, ScatterCodec) else codec


def scatter_codec(exchange: Exchange, ctx) -> Codec | None:
  """The codec ``transport="scatter"`` runs in place of ``exchange``, or None where it has no scatter
  form (a psum-ed codec, PowerSGD's factors, SBC's schedule)."""
  if isinstance(exchange, ScatterForm):
    return exchange.scatter_codec(ctx)
  if isinstance(exchange, CodecExchange) and not exchange.codec.linear:
    return exchange.codec
  return None


def _encode(codec: Codec, x, prepared, key, segs):
  """``codec.encode``, given what a schedule's stages prepared (:meth:`ScatterCodec.encode_prepared`)."""
  if isinstance(codec, ScatterCodec):
    return codec.encode_prepared(x, prepared, key, segs)
  return codec.encode(x, key, segs)


def _batched(fn, codec, *args):
  """``fn`` over the leading axis of ``args``: vmapped, or ``lax.map`` for codecs that are not vmappable."""
  if _traits(codec).vmappable:
    return jax.vmap(fn)(*args)
  return lax.map(lambda a: fn(*a), args)


@dataclasses.dataclass(frozen=True)
class ScatterExchange(Exchange):
  """The scatter form of ``inner``: an exchange whose :func:`scatter_codec` is not None.

  State per bucket: the owner residual (float32, the bucket's length).
  ``bucket_wire_bytes(segs, workers)`` needs the number of workers.
  """

  inner: Exchange

  @property
  def block(self) -> int:
    return self.inner.block

  def codec(self, ctx) -> Codec:
    return scatter_codec(self.inner, ctx)

  def init_bucket(self, segs, key):
    del key
    return jnp.zeros((segs.length,), jnp.float32)

  def exchange(self, x, segs, owner, ctx):
    codec = self.codec(ctx)
    if ctx.axis.name is None:  # one worker: a local round trip, as the gather
      payload = codec.encode(x, ctx.key, segs)
      local = codec.sent(x, payload, ctx.key, segs)
      return local, local, owner
    return self._scatter(x, segs, owner, ctx, _Stages([codec], None))

  def exchange_stages(self, stages, index, x, segs, extra, ctx):
    """The scatter exchange of ``stages[index]``: the chunking, keys, owner residual and what the
    stages' codecs share (:meth:`ScatterCodec.prepare_stages`) once; only each stage's payloads and
    their collectives switched on the stage, in each phase."""
    codecs = [ex.codec(ctx) for ex in stages]
    if ctx.axis.name is None or len({type(c) for c in codecs}) > 1:
      return super().exchange_stages(stages, index, x, segs, extra, ctx)
    return self._scatter(x, segs, extra, ctx, _Stages(codecs, index))

  def _scatter(self, x, segs, owner, ctx, stages: "_Stages"):
    codec = stages.codecs[0]
    n, me, length = ctx.axis.size, ctx.axis.index, segs.length
    cs = layout.chunk_segments(segs, n, self.block, _traits(codec).leaf_segments)
    c = cs.length
    key1, key2 = jax.random.split(ctx.key)
    base = key1 if codec.shared_key else jax.random.fold_in(key1, me)
    keys = jax.vmap(lambda j: jax.random.fold_in(base, j))(jnp.arange(n))
    rows = jnp.pad(x, (0, n * c - length)).reshape(n, c)
    dec_key = jax.random.fold_in(key1, me)  # the encode key of chunk me where keys are shared

    def phase1(codec, prepared):
      """N chunk payloads, chunk j to worker j: ``(this worker's mean chunk, what it sent)``."""
      payload = _batched(lambda r, p, k: _encode(codec, r, p, k, cs), codec, rows, prepared, keys)
      local = _batched(lambda r, p, k: codec.sent(r, p, k, cs), codec, rows, payload, keys)
      like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), payload)
      received = packing.Gathered(ops.alltoall(_batched(packing.to_bytes, codec, payload), ctx.axis), like)
      mean = codec.aggregate(received, dec_key, cs, n).astype(jnp.float32)
      return mean, local.reshape(-1)[:length]

    prepared = _batched(lambda r, k: stages.prepare(r, k, cs), codec, rows, keys)
    mean, local = stages.run(phase1, ctx, prepared)
    # phase 2: the owner's mean chunk, compressed again with its residual, to everyone
    codec2 = _owner(codec)  # a vote's ties need a third value
    start = me * c
    mine = lax.dynamic_slice_in_dim(jnp.pad(owner, (0, n * c - length)), start, c)
    # entries of no leaf (segment and bucket padding) hold nothing: a codec may decode them nonzero
    inside = lax.dynamic_slice_in_dim(jnp.pad(segs.valid(), (0, n * c - length)), start, c)
    y = jnp.where(inside, mean, 0.0) + mine
    keys2 = jax.vmap(lambda j: jax.random.fold_in(key2, j))(jnp.arange(n))
    key_me = jax.random.fold_in(key2, me)

    def phase2(codec, prepared):
      """The owner's payload to everyone: every worker's decode of the N mean chunks ``(N, C)``."""
      codec2 = _owner(codec)
      payload2 = _encode(codec2, y, prepared, key_me, cs)
      gathered = packing.from_bytes(ops.allgather(packing.to_bytes(payload2), ctx.axis), payload2)
      return _batched(lambda p, k: codec2.decode(p, k, cs), codec2, gathered, keys2).astype(jnp.float32)

    chunks = stages.run(phase2, ctx, stages.owners().prepare(y, key_me, cs))
    out = chunks.reshape(-1)[:length]
    sent = lax.dynamic_index_in_dim(chunks, me, keepdims=False)  # what every worker applied of chunk me
    if _traits(codec2).selects:
      # A selection (a sparsifier): an entry the owner did not select goes back to the workers
      # that sent it (Ok-Topk, gTop-k): each keeps its own share in its residual and selects it
      # again; the owner keeps only what a selected entry's value lost (and its old residual).
      local = jnp.where(out != 0, local, 0.0)
      kept = jnp.where(inside, jnp.where(sent != 0, y - sent, mine), 0.0)
    else:
      kept = jnp.where(inside, y - sent, 0.0)
    owner = lax.dynamic_update_slice_in_dim(jnp.zeros((n * c,), jnp.float32), kept, start, 0)[:length]
    return out, local, owner

  def bucket_wire_bytes(self, segs, workers: int | None = None) -> int:
    """Bytes one worker hands to collectives: ``workers`` chunk payloads (all-to-all), one (all-gather)."""
    if workers is None:
      raise ValueError("transport='scatter' sends chunk payloads whose size depends on the number of"
                       " workers; pass workers=N (jaxcomp.wire_bytes(tx, params, workers=N))")
    first, second = chunk_payload_bytes(self, segs, workers)
    return workers * first + second


@dataclasses.dataclass(frozen=True)
class _Stages:
  """The codecs of a schedule's stages in one scatter exchange (one codec and ``index`` None: no schedule)."""

  codecs: list
  index: Any

  def prepare(self, x, key, segs):
    head = self.codecs[0]
    if self.index is None or not isinstance(head, ScatterCodec):
      return None
    return head.prepare_stages(self.codecs, self.index, x, key, segs)

  def owners(self) -> "_Stages":
    return _Stages([_owner(c) for c in self.codecs], self.index)

  def run(self, phase, ctx, prepared):
    """``phase(codec, prepared)`` of the running stage's codec: a ``lax.switch`` over the stages."""
    if self.index is None:
      return phase(self.codecs[0], prepared)
    branches = [lambda p, c=c: ops.varying(phase(c, p), ctx.axis) for c in self.codecs]
    return lax.switch(self.index, branches, prepared)


def chunk_payload_bytes(ex: ScatterExchange, segs: layout.Segments, workers: int) -> tuple:
  """Bytes of one chunk's payload in phase 1 and in phase 2 (the owner's, of its reduced chunk)."""
  codec = scatter_codec(ex.inner, None)
  return _payload_bytes(codec, segs, workers, ex.block), \
      _payload_bytes(_owner(codec), segs, workers, ex.block)


def _payload_bytes(codec, segs: layout.Segments, workers: int, block: int) -> int:
  chunk = layout.chunk_segments(segs, workers, block, _traits(codec).leaf_segments)
  return layout.payload_bytes(codec, chunk)


@dataclasses.dataclass(frozen=True)
class ScatterRoute:
  """A method's route with every gathered exchange replaced by its scatter form."""

  route: Any
  name: str

  def __call__(self, shape):
    exchange, view = self.route(shape)
    return scatter_form(exchange, self.name), view


def scatter_form(exchange, name: str):
  """The exchange that ``transport="scatter"`` runs in place of ``exchange``."""
  if isinstance(exchange, ScatterExchange):
    return exchange
  if isinstance(exchange, CodecExchange) and exchange.codec.linear:
    return exchange  # psums stay all-reduces
  if scatter_codec(exchange, None) is not None:
    return ScatterExchange(exchange)
  raise ValueError(
      f"transport='scatter' is not available for {name}: its exchange ({type(exchange).__name__}) has no"
      " scatter form (PowerSGD's and ACP-SGD's factors are all-reduced already; SBC keeps its sync"
      " schedule and Golomb stream); use transport='gather'")
