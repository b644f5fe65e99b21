"""The plugin protocol: the state, the step's context, and the three kinds of plugin.

A method is made of a :class:`Memory` (error feedback), and per bucket of gradients an :class:`Exchange`
that compresses and communicates it. Most exchanges are a :class:`Codec` (encode, decode) wrapped in a
:class:`CodecExchange`; the builder (:mod:`jaxcomp.core.builder`) runs, per step::

    x, carry = memory.compensate(grads, state.memory)     # error feedback in
    mean, local, extra = exchange.exchange(x, segs, extra, ctx)  # per bucket
    memory = memory.update(x, local, state.memory, MemoryStep(buckets, mean, carry))  # keep what was not sent
    out = memory.output(mean)

Every optional capability of a plugin is a class attribute declared here with its default; a plugin
overrides the ones it has. Which base to subclass, by the shape of the problem (``docs/adding-a-method.md``):

- a compressor of a flat vector whose payload is a fixed-shape pytree:
  :class:`Codec` (moved by :class:`CodecExchange`: a psum if ``linear``,
  else one all-gather of its packed bytes);
- an exchange that needs its own collectives or state per bucket (PowerSGD's
  two psums, DGC's adjusted thresholds, SBC's schedule): :class:`Exchange`;
- an exchange per leaf shape (a stack of same-view leaves): :class:`jaxcomp.core.groups.GroupExchange`;
- one exchange for every bucket of a step at once (ACP-SGD's fused
  all-reduce): :class:`jaxcomp.core.groups.FusedExchange` over group exchanges.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import ops, packing
from jaxcomp.collectives.axis import Axis
from jaxcomp.core import layout, stacking


class CompressState(NamedTuple):
  """State of every jaxcomp transform; a pytree of arrays.

  Attributes:
    count: int32 number of updates so far (saturates instead of overflowing).
    key: uint32[2] PRNG key, identical on every worker (split once per step).
    memory: the memory's state in the bucket layout: the error-feedback residual (one float32 vector
      per bucket), a momentum, or ``()``. Read it as a tree like the gradients with
      :func:`jaxcomp.memory_tree`.
    extra: one entry per bucket for exchanges that keep state (PowerSGD's warm-started Q), else ``()``.
    phase: uint32 number of updates modulo 2^32 (wraps instead of saturating), for periodic schedules:
      ACP-SGD's alternation, SBC's sync every ``delay`` steps. A saturated ``count`` would freeze them.
  """

  count: jax.Array
  key: jax.Array
  memory: Any
  extra: Any
  phase: jax.Array


class StepContext(NamedTuple):
  """What an exchange sees besides its bucket: the axis, a shared key, the step."""

  axis: Axis
  key: jax.Array  # shared by all workers; fold in axis.index for independence
  count: jax.Array  # int32 step, saturating: for schedules and start steps
  phase: jax.Array  # uint32 step modulo 2^32: for periodic choices (phase % period)
  params: Any = None  # this bucket's parameters (float32), for exchanges with ``wants_params``


# ----------------------------------------------------------------------------
# Memory (error feedback)


class MemoryStep(NamedTuple):
  """What :meth:`Memory.update` gets of the step besides ``x`` and what was sent.

  Attributes:
    buckets: the step's buckets (:class:`jaxcomp.core.layout.Bucket`; which travel dense).
    mean: the decoded mean of every bucket (identical on every worker; EF21 advances by it).
    carry: what ``compensate`` returned beside ``x`` (DGC's new momentum), or None.
    dense_step: a traced bool, True on a dense warm-up step (``configure(start_step=)``), when
      every entry was sent; None for a method without warm-up.
  """

  buckets: Any = None
  mean: Any = None
  carry: Any = None
  dense_step: Any = None


class Memory:
  """Error feedback: ``x = beta * e + gamma * g``; ``e <- x - sent``; output / gamma.

  The base class is plain error feedback (``enabled=False``: none); other memories (DGC's momentum
  correction, EF21, Signum's momentum) subclass it and override the steps they change. Non-finite
  values never enter the residual: where the input ``x`` is not finite the residual is reset to 0 (the
  NaN/Inf still reaches this step's output); where the local decode is not finite nothing usable was
  sent, so the whole finite ``x`` is kept.
  """

  def __init__(self, beta: float = 1.0, gamma: float = 1.0, enabled: bool = True):
    self.beta, self.gamma, self.enabled = float(beta), float(gamma), bool(enabled)

  def init(self, params: Any) -> Any:
    """The state for ``params`` (one float32 vector per bucket)."""
    if not self.enabled:
      return ()
    return jax.tree.map(jnp.zeros_like, params)

  def compensate(self, grads: Any, state: Any) -> Tuple[Any, Any]:
    """``(x, carry)``: what the exchanges compress (the gradients with the residual added back),
    and a value computed on the way in that ``update`` reads as ``step.carry`` (None here)."""
    scaled = jax.tree.map(lambda g: self.gamma * g.astype(jnp.float32), grads)
    if not self.enabled:
      return scaled, None
    return jax.tree.map(lambda g, e: self.beta * e.astype(jnp.float32) + g, scaled, state), None

  def update(self, x: Any, sent: Any, state: Any, step: Optional["MemoryStep"] = None) -> Any:
    """The new state from ``x`` and what was ``sent`` (``step``: the rest of the step)."""
    del step
    if not self.enabled:
      return ()

    def one(x, s, e):
      r = jnp.where(jnp.isfinite(s), x - s, x)
      return jnp.where(jnp.isfinite(x), r, 0.0).astype(e.dtype)

    return jax.tree.map(one, x, sent, state)

  def like_params(self, state: Any) -> Optional[Any]:
    """The part of the state in the bucket layout (checked against the gradients' buckets)."""
    return state if self.enabled else None

  def output(self, mean: Any, state: Any = None, new: Any = None) -> Any:
    """The transform's output from the decoded mean (``state``: the memory before this step,
    ``new``: after it; reading the new state, not the old, spares XLA a copy of the old)."""
    if self.gamma == 1.0:
      return mean
    return jax.tree.map(lambda m: m / self.gamma, mean)


def zero_after(v: jax.Array) -> jax.Array:
  """0.0 where ``v`` is finite, NaN-free, computed from ``v``: a data dependency that orders a write.

  A memory writes its new state in place of the old (the state is donated).
  XLA keeps a bucket-sized copy of the old state when it cannot prove that
  every reader of the old state (the encode, fused with ``compensate``) runs
  before the write: ``where(isfinite(x), x, zero_after(sent))`` writes the same
  values as ``where(isfinite(x), x, 0)``, after ``sent`` exists, and so after
  the encode (``tests/test_memory_copies.py`` checks the compiled updates).
  """
  return jnp.where(jnp.isfinite(v), 0.0 * jnp.abs(v), 0.0)


# ----------------------------------------------------------------------------
# Codecs


class Codec(abc.ABC):
  """Encode/decode of one bucket: a flat float32 vector with static segments.

  ``encode(x, key, segs) -> payload`` (a pytree of arrays of static shapes)
  and ``decode(payload, key, segs) -> x_hat`` (length ``segs.length``).
  Per-leaf quantities (a norm, a scale, a top-k) are per segment, computed by
  the segment reductions of :class:`jaxcomp.core.layout.Segments`; padding entries
  of ``x`` are zero and their decode is ignored.
  """

  linear: bool = False
  """``decode(sum of payloads) == sum of decodes``: the payload travels by psum.
  Otherwise it is packed into one byte buffer, all-gathered (one collective per
  bucket) and combined by :meth:`aggregate`."""

  shared_key: bool = False
  """The key is identical on every worker (random-k's positions); otherwise each
  worker folds in its index."""

  carries_nonfinite: bool = False
  """A NaN/Inf in any worker's input always reaches the decoded mean (a float psum does; so does a
  scale or norm computed by a sum or by :meth:`~jaxcomp.core.layout.Segments.max_abs`, or the flag of
  :func:`~jaxcomp.collectives.packing.pack_checked`): the builder then needs no flag collective."""

  block: int = 1
  """Segments start at multiples of ``block`` and are zero-padded to one."""

  by_segment: bool = False
  """``encode`` reads one segment's slice at a time: its bucket is packed flat (slices fold into leaves)."""

  @abc.abstractmethod
  def encode(self, x: jax.Array, key: jax.Array, segs: layout.Segments) -> Any:
    """The payload of ``x`` (a pytree of arrays of static shapes)."""

  @abc.abstractmethod
  def decode(self, payload: Any, key: jax.Array, segs: layout.Segments) -> jax.Array:
    """``x_hat`` (float32, ``segs.length``) from a payload."""

  def witness(self, payloads: Any) -> Any:
    """None, or a few floats of one payload or of every worker's (leaves ``(N, ...)``) that are
    non-finite whenever the decoded mean would be: the step's flag is read from them, not the mean."""
    return None

  def sent(self, x: jax.Array, payload: Any, key: jax.Array, segs: layout.Segments) -> jax.Array:
    """What this worker sent of ``x`` (float32, ``segs.length``), for its residual: the decode of ``payload``.

    A codec whose payload carries entries of ``x`` unchanged (top-k's float32
    values) overrides it with ``where(mask, x, 0)`` built from the positions
    alone (:func:`jaxcomp.kernels.sparse.kept`): a mask of one byte per entry that
    XLA fuses into the residual's update, where a decode writes out a
    bucket-sized float32 vector. The values are the decode's, bit for bit.
    """
    del x
    return self.decode(payload, key, segs)

  def aggregate(self, gathered: packing.Gathered, key: jax.Array, segs: layout.Segments,
                num: int) -> jax.Array:
    """Mean over the workers of the ``gathered`` payloads (:class:`~jaxcomp.collectives.packing.Gathered`).

    Decoded and accumulated one worker at a time, in worker order (the same float result on every
    worker): no ``N x n`` array of decoded payloads, and each worker's fields read from the gathered
    bytes inside the loop. The last worker's turn divides the sum, so the loop's result is the mean
    (no bucket-sized carry beside it); the carry starts as worker 0's decode (its type, shard_map's
    varying-ness included, the body's).
    """
    def decoded(w):
      return self.decode(gathered.payload(w), key, segs).astype(jnp.float32)

    def body(w, acc):
      acc = acc + decoded(w)
      return jnp.where(w == gathered.workers - 1, acc / num, acc)

    return decoded(0) / num if gathered.workers == 1 else lax.fori_loop(1, gathered.workers, body, decoded(0))


class DenseCodec(Codec):
  """The identity in float32: the dense mean, i.e. ``lax.pmean``."""

  linear = True
  carries_nonfinite = True

  def encode(self, x, key, segs):
    return x

  def decode(self, payload, key, segs):
    return payload


# ----------------------------------------------------------------------------
# Exchanges: how one bucket is compressed and communicated


class Opened(NamedTuple):
  """An exchange in two parts (:meth:`Exchange.open`): the builder's non-finite guard acts before the
  bucket-sized output is written. ``witness``: arrays identical on every worker, non-finite whenever
  the mean would be (read in place of the mean for the step's flag when the exchange
  ``carries_nonfinite``). ``finish(poison)``: ``(mean, local, extra)``; ``poison`` None (no guard) or
  the step's flag over every bucket, a float32 0 or NaN. ``poisons``: ``finish(NaN)``'s mean is NaN
  in every entry already (a low-rank method adds it to a small factor): the builder selects nothing."""

  witness: Any
  finish: Callable
  poisons: bool = False


class Exchange(abc.ABC):
  """Compresses and communicates one bucket (the bucket form, which the builder calls).

  ``exchange(x, segs, extra, ctx) -> (mean, local, extra)``: ``x`` is the bucket (float32,
  ``segs.length``), ``mean`` the decoded mean over the axis (identical on every worker), ``local``
  what this worker's memory counts as sent, ``extra`` the exchange's state for the bucket.
  """

  carries_nonfinite: bool = False
  """A NaN or Inf anywhere in any worker's bucket always makes ``mean`` non-finite (no flag collective)."""

  block: int = 1
  """Segments start at multiples of it and are zero-padded to one."""

  wants_params: bool = False
  """It reads the bucket's parameters, ``ctx.params`` (float32 like ``x``; None without ``params``)."""

  all_reduces: bool = False
  """Its payload travels by all-reduce only (for :func:`jaxcomp.traffic`)."""

  def init_bucket(self, segs: layout.Segments, key: jax.Array) -> Any:
    """The exchange's state for one bucket (``()``: none)."""
    del segs, key
    return ()

  @abc.abstractmethod
  def exchange(self, x: jax.Array, segs: layout.Segments, extra: Any, ctx: StepContext):
    """``(mean, local, extra)`` for the bucket ``x``."""

  @abc.abstractmethod
  def bucket_wire_bytes(self, segs: layout.Segments, workers: int | None = None) -> int:
    """Nominal bytes one worker hands to collectives for the bucket (``workers``: N, where it matters)."""

  def open(self, x: jax.Array, segs: layout.Segments, extra: Any, ctx: StepContext) -> Opened:
    """:meth:`exchange` as an :class:`Opened`; by default it runs whole, its mean the witness."""
    result = tuple(self.exchange(x, segs, extra, ctx))
    return Opened(result[0], lambda poison: result)

  def exchange_many(self, xs: list, segments: list, extras: list, ctxs: list) -> list:
    """``(mean, local, extra, x)`` of several buckets of this exchange (each with its own context):
    :meth:`exchange`'s, and the bucket as it was read (the same values; where buckets were stacked,
    a view of the stack, which the memory then reads so that the bucket is written out once)."""
    return [tuple(self.exchange(x, segs, e, ctx)) + (x,)
            for x, segs, e, ctx in zip(xs, segments, extras, ctxs)]

  def exchange_stages(self, stages, index, x: jax.Array, segs: layout.Segments, extra: Any,
                      ctx: StepContext):
    """``stages[index].exchange(...)``: the bucket's exchanges of a schedule's stages (this one first,
    all of this type; ``index`` traced), one ``lax.switch`` over them. An exchange whose stages
    share work (DGC's thresholds) overrides it to do that work once."""
    branches = [lambda x, e, ex=ex: ops.varying(ex.exchange(x, segs, e, ctx), ctx.axis) for ex in stages]
    return lax.switch(index, branches, x, extra)


@dataclasses.dataclass(frozen=True)
class CodecExchange(Exchange):
  """A codec over a whole bucket, moved by one psum or by one all-gather of its packed bytes."""

  codec: Codec

  @property
  def carries_nonfinite(self) -> bool:
    return self.codec.carries_nonfinite

  @property
  def block(self) -> int:
    return self.codec.block

  @property
  def all_reduces(self) -> bool:
    return self.codec.linear

  def exchange(self, x, segs, extra, ctx: StepContext):
    return self.witnessed(x, segs, extra, ctx)[:3]

  def open(self, x, segs, extra, ctx: StepContext) -> Opened:
    """Its witness the codec's (:meth:`Codec.witness`), else the mean."""
    mean, local, extra, witness = self.witnessed(x, segs, extra, ctx)
    return Opened(mean if witness is None else witness, lambda poison: (mean, local, extra))

  def witnessed(self, x, segs, extra, ctx: StepContext):
    """``(mean, local, extra, witness)``: :meth:`exchange`'s, and the codec's witness or None."""
    codec = self.codec
    enc_key, dec_key = self._keys(ctx)
    if codec.linear:
      num = ctx.axis.size
      scaled = x / num
      payload = codec.encode(scaled, enc_key, segs)
      local = codec.sent(scaled, payload, enc_key, segs) * num
      mean = codec.decode(ops.allreduce_sum(payload, ctx.axis), enc_key, segs)
      return mean, local, extra, None
    payload = codec.encode(x, enc_key, segs)
    local = codec.sent(x, payload, enc_key, segs)
    if ctx.axis.name is None:
      return local, local, extra, codec.witness(payload)
    gathered = ops.allgather_payload(payload, ctx.axis)
    return codec.aggregate(gathered, dec_key, segs, ctx.axis.size), local, extra, codec.witness(
        gathered.payloads())

  def exchange_many(self, xs, segments, extras, ctxs):
    """As :meth:`exchange` for each bucket; a group of a :class:`~jaxcomp.core.stacking.LoopCodec`'s
    buckets encoded by one loop."""
    codec, out = self.codec, [None] * len(xs)
    for idx in stacking.groups(codec, segments):
      if len(idx) == 1:
        i = idx[0]
        out[i] = tuple(self.exchange(xs[i], segments[i], extras[i], ctxs[i])) + (xs[i],)
        continue
      keys = [self._keys(ctxs[i]) for i in idx]
      done = stacking.exchange_stacked(codec, [xs[i] for i in idx], [segments[i] for i in idx],
                                       [k[0] for k in keys], [k[1] for k in keys], ctxs[idx[0]].axis)
      for i, (mean, local, read) in zip(idx, done):
        out[i] = (mean, local, extras[i], read)
    return out

  def _keys(self, ctx: StepContext):
    """The encode's key (this worker's unless ``shared_key``) and the decode's."""
    enc = ctx.key if self.codec.shared_key else jax.random.fold_in(ctx.key, ctx.axis.index)
    return enc, (enc if self.codec.shared_key else ctx.key)

  def bucket_wire_bytes(self, segs, workers=None):
    return layout.payload_bytes(self.codec, segs)


DENSE = CodecExchange(DenseCodec())
"""The dense float32 mean: the exchange of leaves that travel uncompressed."""


def flat_route(exchange: Exchange) -> Callable:
  """A route that sends every leaf, flattened to ``(n,)``, to ``exchange``."""

  def route(shape):
    return exchange, (int(np.prod(shape, dtype=np.int64)),)

  return route
