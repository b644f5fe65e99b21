"""The generic builder: buckets -> memory -> codec -> communicator -> memory.

A method is a :class:`Method`: a ``route`` that sends each gradient leaf to an
:class:`Exchange` (codec + communicator) under a view shape, and a memory
(error feedback). :func:`build` turns it into an ``optax.GradientTransformation``
whose state is a :class:`CompressState` of arrays only.

The leaves of a step are laid out in flat float32 buckets (:mod:`jaxcomp.layout`),
one exchange per bucket; the memory lives in the same layout. An exchange runs
once per bucket, so the compiled program grows with the number of buckets,
not with the number of leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp import finite, hierarchy, layout, scatter
from jaxcomp.collectives import ops, packing
from jaxcomp.collectives.axis import Axis, AxisName, axis_names as _names, check_axis_name, current_axis


class CompressState(NamedTuple):
  """State of every jaxcomp transform; a pytree of arrays.

  Attributes:
    count: int32 number of updates so far (saturates instead of overflowing).
    key: uint32[2] PRNG key, identical on every worker (split once per step).
    memory: the memory's state in the bucket layout: the error-feedback
      residual (one float32 vector per bucket), a momentum, or ``()``. Read it
      as a tree like the gradients with :func:`jaxcomp.memory_tree`.
    extra: one entry per bucket for exchanges that keep state (PowerSGD's
      warm-started Q), else ``()``.
    phase: uint32 number of updates modulo 2^32 (wraps instead of saturating),
      for periodic schedules: ACP-SGD's alternation, SBC's sync every ``delay``
      steps. A saturated ``count`` would freeze them.
  """

  count: jax.Array
  key: jax.Array
  memory: Any
  extra: Any
  phase: jax.Array


class Ctx(NamedTuple):
  """What an exchange sees besides its group: the axis, a shared key, the step."""

  axis: Axis
  key: jax.Array  # shared by all workers; fold in axis.index for independence
  count: jax.Array  # int32 step, saturating: for schedules and start steps
  phase: jax.Array  # uint32 step modulo 2^32: for periodic choices (phase % period)
  params: Any = None  # this bucket's parameters (float32), for exchanges with ``wants_params``


# ----------------------------------------------------------------------------
# Memory (error feedback)


class Memory:
  """Error feedback: ``x = beta * e + gamma * g``; ``e <- x - sent``; output / gamma.

  Non-finite values never enter the residual: where the input ``x`` is not
  finite the residual is reset to 0 (the NaN/Inf still reaches this step's
  output); where the local decode is not finite nothing usable was sent, so
  the whole finite ``x`` is kept.
  """

  uses_mean = False  # update() also takes ``mean=``, the decoded mean of every bucket (EF21)

  def __init__(self, beta: float = 1.0, gamma: float = 1.0, enabled: bool = True):
    self.beta, self.gamma, self.enabled = float(beta), float(gamma), bool(enabled)

  def init(self, params: Any) -> Any:
    if not self.enabled:
      return ()
    return jax.tree.map(jnp.zeros_like, params)

  def compensate(self, grads: Any, state: Any) -> Any:
    scaled = jax.tree.map(lambda g: self.gamma * g.astype(jnp.float32), grads)
    if not self.enabled:
      return scaled
    return jax.tree.map(lambda g, e: self.beta * e.astype(jnp.float32) + g, scaled, state)

  def update(self, x: Any, sent: Any, state: Any, buckets: Any = None) -> Any:
    """``buckets``: the step's :class:`jaxcomp.layout.Bucket` tuple (``b.exchange is DENSE`` marks a dense one)."""
    del buckets
    if not self.enabled:
      return ()

    def one(x, s, e):
      r = jnp.where(jnp.isfinite(s), x - s, x)
      return jnp.where(jnp.isfinite(x), r, 0.0).astype(e.dtype)

    return jax.tree.map(one, x, sent, state)

  def like_params(self, state: Any) -> Optional[Any]:
    """The part of the state in the bucket layout (checked against the gradients' buckets)."""
    return state if self.enabled else None

  def output(self, mean: Any, state: Any = None) -> Any:
    """The transform's output from the decoded mean (``state``: the memory before this step)."""
    if self.gamma == 1.0:
      return mean
    return jax.tree.map(lambda m: m / self.gamma, mean)


# ----------------------------------------------------------------------------
# Exchanges: how one bucket is compressed and communicated


STACK_MAX = 1 << 16  # segments with more entries than this are not stacked, see groups()


def groups(segs: layout.Segments):
  """Segment indices of a bucket grouped by view, for exchanges of the group form.

  Segments of more than :data:`STACK_MAX` entries form a group of their own
  (stacking copies them); smaller ones of the same view share one batched kernel.
  """
  out: dict = {}
  for s, (n, view) in enumerate(zip(segs.sizes, segs.views)):
    out.setdefault((tuple(view), s if n > STACK_MAX else -1), []).append(s)
  return [(view, idx) for (view, _), idx in out.items()]


class Exchange:
  """Compresses and communicates one bucket.

  The bucket form, which :func:`build` calls:
  ``exchange(x, segs, extra, ctx) -> (mean, local, extra)`` where ``x`` is the
  bucket (float32, ``segs.length``), ``mean`` the decoded mean over the axis
  (identical on every worker), ``local`` what this worker's memory counts as
  sent; ``init_bucket(segs, key)`` makes the exchange state and
  ``bucket_wire_bytes(segs)`` gives the nominal bytes one worker hands to
  collectives for the bucket.

  The group form, for exchanges written per view: ``__call__(X, extra, ctx)``
  over a stack ``X`` of same-view segments ``(G, *view)``, with ``init(view,
  group, key)`` and ``wire_bytes(view, group)``; the default bucket form runs
  it once per group of same-view segments.

  ``carries_nonfinite``: a NaN or Inf anywhere in any worker's bucket always
  makes ``mean`` non-finite (a float psum of the values does); :func:`build`
  then needs no flag collective to tell every worker about it.
  ``block``: segments start at multiples of it and are zero-padded to one
  (segment reductions work on rows of ``block`` entries).
  ``wants_params``: the exchange reads the bucket's parameters, ``ctx.params``
  (float32, laid out like ``x``; None when ``update`` got no ``params``).
  """

  carries_nonfinite: bool = False
  block: int = 1
  wants_params: bool = False

  def init(self, view: Tuple[int, ...], group: int, key: jax.Array) -> Any:
    del view, group, key
    return ()

  def __call__(self, X, extra, ctx: Ctx):
    raise NotImplementedError

  def wire_bytes(self, view: Tuple[int, ...], group: int) -> int:
    raise NotImplementedError

  def init_bucket(self, segs: layout.Segments, key: jax.Array) -> Any:
    return tuple(self.init(view, len(idx), jax.random.fold_in(key, g))
                 for g, (view, idx) in enumerate(groups(segs)))

  def bucket_wire_bytes(self, segs: layout.Segments) -> int:
    return sum(self.wire_bytes(view, len(idx)) for view, idx in groups(segs))

  def exchange(self, x, segs: layout.Segments, extra, ctx: Ctx):
    mean, local = [None] * segs.count, [None] * segs.count
    new_extra = []
    for g, ((view, idx), ex_state) in enumerate(zip(groups(segs), extra)):
      X = jnp.stack([segs.segment(x, s).reshape(view) for s in idx])
      m, loc, ex_state = self(X, ex_state, ctx._replace(key=jax.random.fold_in(ctx.key, g)))
      new_extra.append(ex_state)
      for j, s in enumerate(idx):
        mean[s], local[s] = m[j].reshape(-1), loc[j].reshape(-1)
    return _join(mean, segs), _join(local, segs), tuple(new_extra)


def _join(parts, segs: layout.Segments) -> jax.Array:
  """Per-segment vectors -> one bucket vector with zero padding (rows, as :func:`jaxcomp.layout.pack`)."""
  out = []
  for part, n, p in zip(parts, segs.sizes, segs.padded_sizes):
    part = part.astype(jnp.float32)
    out.append((jnp.pad(part, (0, p - n)) if p > n else part).reshape(-1, layout.ROW))
  return out[0].reshape(-1) if len(out) == 1 else jnp.concatenate(out).reshape(-1)


class Codec:
  """Encode/decode of one bucket: a flat float32 vector with static segments.

  ``encode(x, key, segs) -> payload`` (a pytree of arrays of static shapes)
  and ``decode(payload, key, segs) -> x_hat`` (length ``segs.length``).
  Per-leaf quantities (a norm, a scale, a top-k) are per segment, computed by
  the segment reductions of :class:`jaxcomp.layout.Segments`; padding entries
  of ``x`` are zero and their decode is ignored. ``linear`` codecs satisfy
  ``decode(sum of payloads) == sum of decodes`` and travel through psum; the
  others are packed into one byte buffer, all-gathered (one collective per
  bucket) and combined by ``aggregate`` (default: the mean of the decoded
  payloads). ``shared_key``: the key is identical on every worker (random-k
  positions); otherwise each worker folds in its index.
  """

  linear: bool = False
  shared_key: bool = False
  carries_nonfinite: bool = False
  block: int = 1

  def encode(self, x: jax.Array, key: jax.Array, segs: layout.Segments) -> Any:
    raise NotImplementedError

  def decode(self, payload: Any, key: jax.Array, segs: layout.Segments) -> jax.Array:
    raise NotImplementedError

  def aggregate(self, gathered: Any, key: jax.Array, segs: layout.Segments, num: int) -> jax.Array:
    """Mean over the leading (worker) axis of ``gathered`` payloads.

    Decoded and accumulated one worker at a time, in worker order (the same
    float result on every worker): no ``N x n`` array of decoded payloads.
    """
    workers = jax.tree.leaves(gathered)[0].shape[0]

    def decoded(w):
      payload = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, w, keepdims=False), gathered)
      return self.decode(payload, key, segs).astype(jnp.float32)

    # Starting from worker 0's decode keeps the carry's type (shard_map's
    # varying-ness included) that of the body's.
    total = lax.fori_loop(1, workers, lambda w, acc: acc + decoded(w), decoded(0))
    return total / num


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

  def init_bucket(self, segs, key):
    return ()

  def exchange(self, x, segs, extra, ctx: Ctx):
    codec = self.codec
    enc_key = ctx.key if codec.shared_key else jax.random.fold_in(ctx.key, ctx.axis.index)
    dec_key = enc_key if codec.shared_key else ctx.key
    if codec.linear:
      num = ctx.axis.size
      payload = codec.encode(x / num, enc_key, segs)
      local = codec.decode(payload, enc_key, segs) * num
      mean = codec.decode(ops.allreduce_sum(payload, ctx.axis), enc_key, segs)
      return mean, local, extra
    payload = codec.encode(x, enc_key, segs)
    local = codec.decode(payload, enc_key, segs)
    if ctx.axis.name is None:
      return local, local, extra
    gathered = packing.from_bytes(ops.allgather(packing.to_bytes(payload), ctx.axis), payload)
    return codec.aggregate(gathered, dec_key, segs, ctx.axis.size), local, extra

  def bucket_wire_bytes(self, segs):
    x = jax.ShapeDtypeStruct((segs.length,), jnp.float32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    shapes = jax.eval_shape(lambda x, k: self.codec.encode(x, k, segs), x, key)
    return int(sum(np.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes)))


class DenseCodec(Codec):
  """The identity in float32: the dense mean, i.e. ``lax.pmean``."""

  linear = True
  carries_nonfinite = True

  def encode(self, x, key, segs):
    return x

  def decode(self, payload, key, segs):
    return payload


DENSE = CodecExchange(DenseCodec())


class FusedExchange:
  """Compresses and communicates all leaf groups of a step at once (tensor fusion).

  For methods whose collectives span buckets, e.g. ACP-SGD's one all-reduce
  for the factors of every layer. ``__call__(groups, xs, extras, ctx)`` gets
  the plan (one ``(exchange, view, leaf indices)`` per group, see
  :meth:`Method.plan`), each group's stacked input ``(G, *view)`` and state
  (made by the group exchange's ``init``), and a ``ctx`` whose key is the
  step's; it returns one ``(mean, local, extra)`` per group.
  ``wire_bytes(groups)``: the nominal bytes per step. The groups'
  ``carries_nonfinite`` must stay true of the fused path.
  """

  def __call__(self, groups, xs, extras, ctx: Ctx):
    raise NotImplementedError

  def wire_bytes(self, groups) -> int:
    raise NotImplementedError


def flat_route(exchange: Exchange) -> Callable:
  """A route that sends every leaf, flattened to ``(n,)``, to ``exchange``."""

  def route(shape):
    return exchange, (int(np.prod(shape, dtype=np.int64)),)

  return route


# ----------------------------------------------------------------------------
# The method and the builder


@dataclasses.dataclass(frozen=True)
class Method:
  """A compression method: its name, how leaves are routed, its memory and its bucket policy.

  ``fused``: when set, one :class:`FusedExchange` handles every group of a
  step instead of each bucket's exchange on its own.
  ``start_step``: steps before which every bucket travels dense (warm-up).
  ``chunkable``: under a fast axis the buckets may be cut into chunks
  (:mod:`jaxcomp.hierarchy`); False for exchanges that read the leaves' shapes.
  ``stages``: ``(first step, route)`` of each later stage of a schedule (see
  :func:`staged`); ``route`` is the first stage's. Every stage lays the
  leaves out alike, so the memory and the exchanges' state carry over.
  ``bucket_bytes``, ``min_size``, ``dense``, ``exchange``: see :func:`build`.
  """

  name: str
  route: Callable[[Tuple[int, ...]], Tuple[Exchange, Tuple[int, ...]]]
  memory: Memory
  fused: FusedExchange | None = None
  start_step: int = 0
  stages: Tuple[Tuple[int, Callable], ...] = ()
  chunkable: bool = True
  bucket_bytes: int = layout.BUCKET_BYTES
  min_size: int | None = None
  dense: Any = None
  exchange: str = "gather"

  def buckets(self, updates: Any, stage: int = 0) -> Tuple[layout.Bucket, ...]:
    """The bucket layout of a gradient tree (static: shapes and the dense mask only).

    ``stage``: whose exchanges the buckets hold (0, the first, or ``i`` for
    ``stages[i - 1]``); the layout itself is the same for every stage.
    """
    leaves = jax.tree.leaves(updates)
    flags = layout.dense_flags(self.dense, updates)
    min_size = layout.MIN_SIZE if self.min_size is None else self.min_size
    route = self.route if stage == 0 else self.stages[stage - 1][1]
    return _plan(route, self.bucket_bytes, tuple(tuple(np.shape(x)) for x in leaves),
                 None if flags is None else tuple(flags), min_size)

  def steady(self) -> "Method":
    """This method after its warm-up: the last stage alone, no dense start."""
    route = self.stages[-1][1] if self.stages else self.route
    return dataclasses.replace(self, route=route, stages=(), start_step=0)

  def stage_at(self, step: int) -> int | None:
    """The stage that runs at ``step`` (an int), or None during the dense warm-up."""
    if step < self.start_step:
      return None
    return sum(step >= first for first, _ in self.stages)

  def plan(self, leaves: Sequence[Any]):
    """The groups of the group form, over every bucket: ``(exchange, view, leaf indices)``."""
    out = []
    for b in self.buckets(list(leaves)):
      for view, idx in groups(b.segments):
        out.append((b.exchange, view, [b.leaves[s] for s in idx]))
    return out

  def wire_bytes(self, params: Any, nonfinite_flag: bool = True, step: int | None = None,
                 workers: int | None = None) -> int:
    """Nominal bytes one worker hands to collectives per step for ``params``.

    ``nonfinite_flag``: count the float32 that tells every worker about a
    non-finite step (see :func:`build`); it is sent only over an axis, and
    only when some bucket's exchange does not carry NaN/Inf by itself.
    ``step``: the bytes of the step ``step`` (its stage, or the dense
    warm-up); None, the last stage's (the steady state). ``workers``: the
    number of workers, needed by ``exchange="scatter"`` (its chunks are 1/N).
    """
    stage = len(self.stages) if step is None else self.stage_at(step)
    buckets = self.buckets(params, stage or 0)
    flag = nonfinite_flag and not _carries_nonfinite(self, params)
    if stage is None:  # the warm-up's one all-reduce of every bucket
      return 4 * sum(b.length for b in buckets) + (NONFINITE_FLAG_BYTES if flag else 0)
    if self.fused is not None:
      payload = self.fused.wire_bytes(self.plan(jax.tree.leaves(params)))
    else:
      payload = sum(bucket_wire_bytes(b.exchange, b.segments, workers) for b in buckets)
    return payload + (NONFINITE_FLAG_BYTES if flag else 0)


def bucket_wire_bytes(exchange, segs, workers: int | None) -> int:
  """An exchange's bytes for one bucket (``workers`` for those that need it: the scatter exchange)."""
  if getattr(exchange, "needs_workers", False):
    return exchange.bucket_wire_bytes(segs, workers)
  return exchange.bucket_wire_bytes(segs)


def _with_exchange(method: Method, exchange: str | None) -> Method:
  """``method`` with the gathered exchanges in the form ``exchange`` names ("gather" or "scatter")."""
  if exchange is None or exchange == method.exchange:
    return method
  if exchange not in scatter.EXCHANGES:
    raise ValueError(f"exchange must be one of {scatter.EXCHANGES}, got exchange={exchange!r}")
  if exchange == "gather":
    unwrap = lambda r: r.route if isinstance(r, scatter.ScatterRoute) else r  # noqa: E731
    return dataclasses.replace(method, route=unwrap(method.route), exchange="gather",
                               stages=tuple((f, unwrap(r)) for f, r in method.stages))
  if method.fused is not None:
    raise ValueError(f"exchange='scatter' is not available for {method.name}: its fused exchange"
                     " all-reduces every layer's factors already; use exchange='gather'")
  for route in [method.route] + [r for _, r in method.stages]:
    for shape in ((1 << 14,), (128, 128), (3, 3, 64, 64)):  # the exchanges of a typical model's leaves
      scatter.scatter_form(route(shape)[0], method.name)  # raises where there is no scatter form
  wrap = lambda r: scatter.ScatterRoute(r, method.name)  # noqa: E731
  return dataclasses.replace(method, route=wrap(method.route), exchange="scatter",
                             stages=tuple((f, wrap(r)) for f, r in method.stages))


def _carries_nonfinite(method: Method, updates) -> bool:
  """True if every bucket's exchange, in every stage, carries NaN/Inf into the mean."""
  return all(b.exchange.carries_nonfinite for i in range(len(method.stages) + 1)
             for b in method.buckets(updates, i))


def _check_stages(method: Method, updates, buckets) -> None:
  """Every stage must lay the leaves out alike (the memory and the state carry over)."""
  def shape(bs):
    return [(b.leaves, b.segments.offsets, b.segments.sizes, b.length, b.exchange is DENSE) for b in bs]

  for i, (first, _) in enumerate(method.stages, 1):
    if shape(method.buckets(updates, i)) != shape(buckets):
      raise ValueError(
          f"stages: the stage from step {first} lays the gradients out in other buckets than the"
          " first stage (a different bucket policy or block size); every stage must use the same"
          " method with the same bucket_bytes, min_size and dense")


def _chunkable(method: Method) -> bool:
  """Whether the buckets can be cut into chunks (no fused exchange, no exchange that reads leaf shapes)."""
  return method.fused is None and method.chunkable


@functools.lru_cache(maxsize=256)
def _plan(route, bucket_bytes, shapes, flags, min_size):
  return layout.plan(shapes, route, DENSE, bucket_bytes, min_size, flags)


class CompressionTransformation(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` that also carries its :class:`Method`."""

  method: Method


class _Recorders(threading.local):
  """Per thread: the lists collecting the jaxcomp transformations whose init runs (see compressor())."""

  def __init__(self):
    self.stack: list = []


_RECORDERS = _Recorders()


@contextlib.contextmanager
def _recording():
  """Collects the jaxcomp transformations whose ``init`` runs inside the block in this thread."""
  found: list = []
  _RECORDERS.stack.append(found)
  try:
    yield found
  finally:
    _RECORDERS.stack.pop()


def _signature(tree) -> tuple:
  """(key path, shape) of every leaf: what tx.init saw, checked by tx.update.

  Not the treedef: a dict and a FrozenDict with the same keys agree.
  """
  return tuple((jax.tree_util.keystr(p), tuple(np.shape(x)))
               for p, x in jax.tree_util.tree_flatten_with_path(tree)[0])


SIGNATURES_KEPT = 64  # the trees one transformation remembers tx.init being called on (the latest kept)


def _check_signature(got: tuple, seen: list) -> None:
  """Raises unless the gradients' leaves (paths and shapes) are those of a tree tx.init was called on."""
  if not seen or got in seen:
    return

  def common(want):
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))

  want = max(reversed(seen), key=common)  # the closest (the latest among equals)
  i = common(want)
  gp, gs = got[i] if i < len(got) else (None, None)
  wp, ws = want[i] if i < len(want) else (None, None)
  if gp is not None and gp == wp:
    what = f"leaf {gp} has shape {gs}, tx.init saw {ws}"
  elif gp is not None and gp not in {p for p, _ in want}:
    what = f"leaf {gp} (shape {gs}) is not in the tree tx.init saw" + (
        f", which has leaf {wp} (shape {ws}) there" if wp is not None else "")
  elif wp is not None and wp not in {p for p, _ in got}:
    what = f"the gradients lack leaf {wp} (shape {ws}) that tx.init saw"
  else:
    what = f"leaf {gp} (shape {gs}) stands where tx.init saw leaf {wp} (shape {ws})"
  raise ValueError(
      f"updates do not match the state: {what} ({len(got)} gradient leaves, {len(want)} in tx.init's"
      " tree). Pass gradients with the structure, key names and shapes of the parameters given to"
      " tx.init (or call tx.init on parameters like the gradients).")


def _check_count(state) -> None:
  """A per-worker state (leading worker axis) reaching tx.update outside pmap, or without jaxcomp.local."""
  shape = tuple(np.shape(state.count))
  if shape == ():
    return
  if shape == (1,):
    raise ValueError(
        "state has a leading worker axis of size 1: inside shard_map call"
        " tx.update(jaxcomp.local(grads), jaxcomp.local(state)) and return jaxcomp.stacked(state)"
        " (its count has shape (1,), a scalar in the state tx.init made)")
  if len(shape) == 1:
    raise ValueError(
        f"state has a leading worker axis of size {shape[0]}: a per-worker state (jaxcomp.per_worker)"
        " goes through tx.update inside jax.pmap, or inside jax.shard_map with in_specs P(axis) and"
        " jaxcomp.local(state); outside them use tx.init(params)'s state as it is (its count has shape"
        f" {shape}, a scalar in the state tx.init made)")
  raise ValueError(f"state.count must be a scalar int32 (a state from tx.init), got shape {shape}")


def _check_leaves(leaves, paths):
  for leaf, path in zip(leaves, paths):
    if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
      raise TypeError(
          f"updates: leaf {jax.tree_util.keystr(path)} has dtype {leaf.dtype};"
          " jaxcomp compresses floating-point gradients only (float32, bfloat16,"
          " float16). Mask integer leaves out with optax.masked or"
          " optax.multi_transform.")


NONFINITE_FLAG_BYTES = 4  # one float32 all-reduced per step, see build()


def _nan_if_nonfinite(vectors) -> jax.Array:
  """0.0 if every entry of ``vectors`` is finite, else NaN.

  An AND-reduction of ``isfinite`` (it fuses into the kernel that produces
  ``vectors``). Not a max of magnitudes: XLA:CPU's vectorised max-reduction
  can drop a NaN that sits among equal values, and the step would pass as finite.
  """
  ok = jnp.ones((), jnp.bool_)
  for v in vectors:
    if v.size:
      ok = ok & jnp.all(jnp.isfinite(v))
  return jnp.where(ok, 0.0, jnp.nan).astype(jnp.float32)


def _exchange_all(method: Method, buckets, x, extras, ctx: Ctx, params):
  """Each bucket's exchange (or the method's fused exchange): lists of mean, local, extra."""
  if method.fused is None:
    results = [b.exchange.exchange(xb, b.segments, e, ctx._replace(key=jax.random.fold_in(ctx.key, i),
                                                                   params=p))
               for i, (b, xb, e, p) in enumerate(zip(buckets, x, extras, params))]
    return [list(r) for r in zip(*results)] if results else ([], [], [])
  plan, xs, states, where = [], [], [], []
  for i, (b, xb) in enumerate(zip(buckets, x)):
    for g, (view, idx) in enumerate(groups(b.segments)):
      plan.append((b.exchange, view, [b.leaves[s] for s in idx]))
      xs.append(jnp.stack([b.segments.segment(xb, s).reshape(view) for s in idx]))
      states.append(extras[i][g])
      where.append((i, idx))
  fused = method.fused(plan, xs, tuple(states), ctx)
  mean = [[None] * b.segments.count for b in buckets]
  local = [[None] * b.segments.count for b in buckets]
  new_extra = [[] for _ in buckets]
  for (i, idx), (m, loc, e) in zip(where, fused):
    new_extra[i].append(e)
    for j, s in enumerate(idx):
      mean[i][s], local[i][s] = m[j].reshape(-1), loc[j].reshape(-1)
  return ([_join(m, b.segments) for m, b in zip(mean, buckets)],
          [_join(loc, b.segments) for loc, b in zip(local, buckets)],
          [tuple(e) for e in new_extra])


def _bucket_params(buckets, treedef, params):
  """The parameters of the buckets whose exchange ``wants_params`` (float32 vectors), else None."""
  wanted = [bool(getattr(b.exchange, "wants_params", False)) for b in buckets]
  if params is None or not any(wanted):
    return [None] * len(buckets)
  leaves = treedef.flatten_up_to(params)
  return [layout.pack([b], leaves)[0] if w else None for b, w in zip(buckets, wanted)]


def _check_state(method: Method, state, buckets, treedef):
  like = method.memory.like_params(state.memory)
  if like is not None:
    got = [tuple(np.shape(v)) for v in jax.tree.leaves(like)]
    want = [(b.length,) for b in buckets]
    if got != want:
      raise ValueError(
          "updates do not match the state: the gradients' buckets hold"
          f" {[w[0] for w in want]} entries, the state's {[g[0] if g else 0 for g in got]}"
          f" (gradient tree {treedef}). Call tx.init on parameters with the same structure"
          " and shapes as the gradients.")
  if len(buckets) != len(state.extra):
    raise ValueError(
        f"updates do not match the state: {len(buckets)} buckets now,"
        f" {len(state.extra)} when tx.init was called.")


def _positive_int(name, value, low):
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int >= {low} or None, got {name}={value!r}")
  if value < low:
    raise ValueError(f"{name} must be >= {low} or None, got {name}={value!r}")
  return int(value)


def build(method: Method, axis_name: AxisName = None, seed: int = 0, bucket_bytes: int | None = None,
          min_size: int | None = None, dense: Any = None,
          dense_axis_name: AxisName = None, exchange: str | None = None) -> CompressionTransformation:
  """Assembles ``method`` into an optax transformation communicating over ``axis_name``.

  Args:
    method: routes, exchanges and memory.
    axis_name: the pmap / shard_map axis (or tuple of axes) to average over;
      ``None`` runs a local compress -> decode round trip.
    seed: seeds the PRNG key in the state (identical on every worker).
    bucket_bytes: the largest bucket, in float32 bytes (default 25 MiB, as
      torch DDP); a leaf larger than that gets a bucket of its own.
    min_size: leaves of fewer entries travel dense in float32 (default
      :data:`jaxcomp.layout.MIN_SIZE`, 1024); 0 or 1 compresses every leaf.
    dense: leaves kept dense whatever their size: an optax-style mask, a
      pytree of bools like the gradients or a callable returning one.
    dense_axis_name: a fast axis (inside a node) averaged densely before the
      compressed exchange over ``axis_name`` (between nodes), see
      :mod:`jaxcomp.hierarchy`; None (default): compress over ``axis_name`` alone.
      With it, call ``tx.init`` inside the mesh too: each worker's state
      holds its chunk of every bucket.
    exchange: how gathered payloads travel: ``"gather"`` (an all-gather of
      every worker's payload; bytes received grow with N) or ``"scatter"``
      (an all-to-all of 1/N chunks, a float32 reduce per chunk, an all-gather
      of the re-compressed chunks; bytes flat in N), see
      :mod:`jaxcomp.scatter`. None keeps the method's (``"gather"``).

  Returns:
    A :class:`CompressionTransformation`; its ``update`` returns the mean over
    the axis of what the workers sent, identical on every worker.

  The data path of ``update``: the gradient leaves are laid out in buckets
  (:func:`jaxcomp.layout.pack`), the memory compensates them, each bucket's
  exchange encodes, communicates and decodes it, the memory keeps what was
  not sent, and the mean is cut back into leaves of the gradients' dtypes.

  Non-finite steps: if any worker's gradient (after error-feedback
  compensation) holds a NaN or Inf, every entry of the output is NaN on every
  worker, so that a guard such as ``optax.apply_if_finite`` skips the step on
  all replicas together. Such a step counts nothing as sent: the residual
  keeps every finite value of its input (non-finite entries are reset to 0)
  and the exchanges' state (PowerSGD's Q) is left as it was; the next step
  is finite again. Codecs lose NaNs (a sign bit, an unsampled position), so
  each worker's ``sum(x * 0)`` (0, or NaN; it cannot overflow) is
  all-reduced as one float32: 4 bytes, counted by :func:`wire_bytes`, and one
  pass over the gradients. Exchanges that carry NaN/Inf into the mean
  themselves (``carries_nonfinite``: the float psums, SBC's NaN header) need
  no flag; with no state to protect either (none, fp16 and bf16 without error
  feedback) the output is left exactly as ``lax.pmean`` gives it.
  """
  axis_name = check_axis_name(axis_name)
  dense_axis_name = check_axis_name(dense_axis_name, "dense_axis_name")
  if dense_axis_name is not None and axis_name is None:
    raise ValueError(f"dense_axis_name={dense_axis_name!r} needs axis_name (the slow axis the compressed"
                     " exchange runs over), got axis_name=None")
  if dense_axis_name is not None and set(_names(dense_axis_name)) & set(_names(axis_name)):
    raise ValueError(f"dense_axis_name={dense_axis_name!r} and axis_name={axis_name!r} must name different"
                     " mesh axes (the fast one and the slow one)")
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
    raise TypeError(f"seed must be an int, got seed={seed!r}")
  if not -2 ** 63 <= int(seed) < 2 ** 63:
    raise ValueError(f"seed must fit in int64, got seed={seed!r}")
  bucket_bytes = _positive_int("bucket_bytes", bucket_bytes, 4)
  min_size = _positive_int("min_size", min_size, 0)
  if dense is not None and not callable(dense):
    flags = jax.tree.leaves(dense)
    if not flags or not all(isinstance(f, (bool, np.bool_)) for f in flags):
      raise ValueError("dense must be None, a pytree of bools like the gradients (an optax-style"
                       f" mask) or a callable returning one, got dense={dense!r}")
  if exchange is not None and not isinstance(exchange, str):
    raise ValueError(f"exchange must be one of {scatter.EXCHANGES}, got exchange={exchange!r}")
  method = _with_exchange(method, exchange)
  method = dataclasses.replace(
      method, bucket_bytes=method.bucket_bytes if bucket_bytes is None else bucket_bytes,
      min_size=method.min_size if min_size is None else min_size,
      dense=method.dense if dense is None else dense)

  def work_buckets(tree, stage=0):
    """The buckets this worker compresses: whole, or its chunk of each under a fast axis."""
    full = method.buckets(tree, stage)
    if dense_axis_name is None or not _chunkable(method):
      return full
    return hierarchy.chunked(full, current_axis(dense_axis_name).size)

  seen: list = []  # _signature of each tree init was called on (kept here: the state is arrays only)

  def init_fn(params):
    if _RECORDERS.stack:  # compressor(): which jaxcomp transformations a chain holds, on which leaves
      if not any(t is tx for t, _ in _RECORDERS.stack[-1]):
        _RECORDERS.stack[-1].append((tx, params))  # optax.masked hands it only its leaves
      return CompressState(count=jnp.zeros((), jnp.int32), key=jax.random.PRNGKey(seed), memory=(),
                           extra=(), phase=jnp.zeros((), jnp.uint32))
    key = jax.random.PRNGKey(seed)
    if dense_axis_name is not None:
      try:
        current_axis(dense_axis_name)
      except ValueError:
        raise ValueError(
            f"with dense_axis_name={dense_axis_name!r}, call tx.init inside the mesh (jax.shard_map"
            " over both axes, or jaxcomp.data_parallel): each worker's state holds its chunk of every"
            " bucket, whose size depends on the fast axis") from None
    buckets = work_buckets(params)
    if method.stages:
      _check_stages(method, params, method.buckets(params))
    if dense_axis_name is not None and _chunkable(method):  # each worker of a node its own chunk
      key = jax.random.fold_in(key, current_axis(dense_axis_name).index)
    zeros = tuple(jnp.zeros((b.length,), jnp.float32) for b in buckets)
    # A fused method calls its groups in the group form: their state is the group form's.
    init = (lambda b, k: Exchange.init_bucket(b.exchange, b.segments, k)) if method.fused is not None \
        else (lambda b, k: b.exchange.init_bucket(b.segments, k))
    extra = tuple(init(b, jax.random.fold_in(key, i)) for i, b in enumerate(buckets))
    if method.stages:
      for j, (first, _) in enumerate(method.stages, 1):
        other = tuple(init(b, jax.random.fold_in(key, i)) for i, b in enumerate(work_buckets(params, j)))
        if jax.tree.structure(other) != jax.tree.structure(extra) or \
            [np.shape(a) for a in jax.tree.leaves(other)] != [np.shape(a) for a in jax.tree.leaves(extra)]:
          raise ValueError(
              f"stages: the stage from step {first} keeps exchange state of another shape than the"
              f" first stage ({method.name}'s state depends on the setting the stages change, e.g."
              " PowerSGD's Q on the rank); schedule a setting that leaves the state alike")
    signature = _signature(params)
    if signature not in seen:
      seen.append(signature)
      layout.warn_if_mostly_dense(method, params, DENSE)  # once per tree this tx sees
      del seen[:-SIGNATURES_KEPT]
    return CompressState(
        count=jnp.zeros((), jnp.int32), key=key,
        memory=method.memory.init(zeros), extra=extra, phase=jnp.zeros((), jnp.uint32))

  def update_fn(updates, state, params=None):
    finite.check_guarded(axis_name, dense_axis_name)
    if not isinstance(state, CompressState):
      raise TypeError(f"state must be the CompressState from tx.init, got {type(state).__name__}")
    _check_count(state)
    _check_signature(_signature(updates), seen)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    leaves = [leaf for _, leaf in paths_leaves]
    _check_leaves(leaves, [p for p, _ in paths_leaves])
    full = method.buckets(updates)
    if method.stages:
      _check_stages(method, updates, full)
    buckets = work_buckets(updates)
    _check_state(method, state, buckets, treedef)
    axis = current_axis(axis_name)
    fast = None if dense_axis_name is None else current_axis(dense_axis_name)
    chunks = fast is not None and buckets is not full
    key, step_key = jax.random.split(state.key)
    ctx = Ctx(axis, step_key, state.count, state.phase)

    grads = layout.pack(full, leaves)                                 # bucket
    bucket_params = _bucket_params(full, treedef, params)
    if chunks:  # the node's mean of this worker's chunk (dense, fast axis)
      grads = hierarchy.reduce_scatter_mean(grads, buckets, fast)
      bucket_params = hierarchy.chunk_of(bucket_params, buckets, fast)
    elif fast is not None:  # not chunkable: the node's mean of every bucket
      grads = [g / fast.size for g in ops.allreduce_sum(tuple(grads), fast)]
    x = method.memory.compensate(tuple(grads), state.memory)          # compensate
    # encode, collective, decode (dense during the warm-up: one program, both paths)
    mean, local, extra = _exchange_or_warm_up(method, lambda i: work_buckets(updates, i), x, state.extra,
                                              ctx, bucket_params)
    local = [jnp.where(b.segments.valid(), s, 0.0) if b.segments.has_pads else s
             for b, s in zip(buckets, local)]
    # chunks: a NaN lands in one worker's chunk, so the flag goes over both axes
    flag_axis = Axis(_names(axis_name) + _names(dense_axis_name), 0, axis.index) if chunks else axis
    mean, local, extra = _guard_nonfinite(_carries_nonfinite(method, updates), x, mean, local, extra,
                                          state, flag_axis, chunks)
    extra_args = {"mean": tuple(mean)} if method.memory.uses_mean else {}
    if getattr(method.memory, "masks", False) and method.start_step > 0:
      extra_args["dense_step"] = ctx.count < method.start_step
    memory = method.memory.update(tuple(x), tuple(local), state.memory, buckets, **extra_args)  # residual
    out = method.memory.output(tuple(mean), state.memory)
    if chunks:  # every worker's mean chunk, back in whole buckets (fast axis)
      out = hierarchy.all_gather(out, full, fast)
    out = layout.unpack(full, out, leaves)
    new_state = CompressState(
        count=optax.safe_int32_increment(state.count), key=key,
        memory=memory, extra=tuple(extra), phase=state.phase + jnp.uint32(1))
    return treedef.unflatten(out), new_state

  tx = CompressionTransformation(init_fn, update_fn)
  tx.method = method
  tx.axis_name = axis_name
  tx.dense_axis_name = dense_axis_name
  tx.exchange = method.exchange
  tx.seed = int(seed)
  return tx


def _exchange_or_warm_up(method: Method, layout_of, x, extras, ctx: Ctx, params):
  """The exchanges of the step's stage, or before ``method.start_step`` the dense mean (all sent).

  One compiled program holds every stage: ``lax.switch`` on the step count.
  """
  def dense(x, extras):
    mean = ops.allreduce_sum(tuple(x), ctx.axis)  # one all-reduce for every bucket
    return [m / ctx.axis.size for m in mean], list(x), list(extras)

  def stage(i):
    buckets = layout_of(i)

    def compressed(x, extras):
      mean, local, extra = _exchange_all(method, buckets, list(x), extras, ctx, params)
      return list(mean), list(local), list(extra)

    return compressed

  branches = ([dense] if method.start_step > 0 else []) + \
      [stage(i) for i in range(len(method.stages) + 1)]
  if len(branches) == 1:
    return branches[0](x, extras)
  branches = [lambda x, e, f=f: ops.varying(f(x, e), ctx.axis) for f in branches]
  firsts = ([method.start_step] if method.start_step > 0 else []) + [s for s, _ in method.stages]
  index = sum((ctx.count >= s).astype(jnp.int32) for s in firsts)
  return lax.switch(index, branches, tuple(x), tuple(extras))


def configure(tx: Any, *, memory: Memory | None = None, start_step: int | None = None,
              dense_axis_name: AxisName = None, exchange: str | None = None):
  """``tx`` rebuilt with another memory or a warm-up; every other setting kept.

  Args:
    tx: a jaxcomp transformation (from a factory).
    memory: replaces plain error feedback, e.g.
      :func:`jaxcomp.momentum_correction` or :func:`jaxcomp.ef21`; for
      methods whose memory is plain error feedback (on or off). Methods with
      a memory of their own (DGC, Signum, EF-signSGD, SBC, RedSync's momentum)
      refuse it.
    start_step: steps of dense exchange before compression starts (torch's
      ``start_powerSGD_iter``); the program holds both paths, compiled once.
    dense_axis_name: a fast axis averaged densely first (see :func:`build`);
      None keeps the transformation's.
    exchange: ``"gather"`` or ``"scatter"`` (see :func:`build`); None keeps
      the transformation's.

  Returns:
    A new transformation; its state has the new memory's layout (call ``init`` again).
  """
  method = getattr(tx, "method", None)
  if not isinstance(method, Method):
    raise TypeError(f"tx must be a jaxcomp transformation (built by a jaxcomp factory), got {tx!r}")
  if memory is not None:
    if not isinstance(memory, Memory):
      raise TypeError(f"memory must be a jaxcomp memory (jaxcomp.momentum_correction(), jaxcomp.ef21(),"
                      f" ...), got memory={memory!r}")
    current = method.memory
    if type(current) is not Memory or current.beta != 1.0 or current.gamma != 1.0:
      raise ValueError(
          f"memory= replaces plain error feedback, but {method.name} keeps a memory of its own"
          f" ({type(current).__name__}); use the method's own options instead")
    method = dataclasses.replace(method, memory=memory)
  if start_step is not None:
    if isinstance(start_step, bool) or not isinstance(start_step, (int, np.integer)) \
        or not 0 <= start_step < 2 ** 31:
      raise ValueError(f"start_step must be an int in [0, 2**31), got start_step={start_step!r}")
    method = dataclasses.replace(method, start_step=int(start_step))
  if dense_axis_name is None:
    dense_axis_name = getattr(tx, "dense_axis_name", None)
  return build(method, tx.axis_name, tx.seed, dense_axis_name=dense_axis_name, exchange=exchange)


def staged(stages: Sequence[Tuple[int, Any]]) -> CompressionTransformation:
  """One transformation that runs ``tx_i`` from step ``s_i`` on: a schedule of a method's settings.

  ``jaxcomp.staged([(0, topk(0.25, axis_name="data")), (100, topk(0.01, axis_name="data"))])``
  sends 25% of the entries for 100 steps, then 1%. Each stage's payload has
  its own static size (the bytes shrink with the ratio, unlike a traced
  ratio that sizes the payload for its largest value), and one compiled
  program holds every stage (``lax.switch`` on the step count). The memory
  and the exchanges' state carry over from stage to stage. DGC's
  exponential warm-up is one case (:func:`jaxcomp.ratio_warmup`); a dense
  start is :func:`configure`'s ``start_step`` (it composes with this).

  Args:
    stages: ``(first step, tx)`` pairs, the first at step 0, first steps
      increasing; every ``tx`` from the same factory with the same
      ``axis_name``, memory and bucket policy (only settings that leave the
      state's shapes alike may change: a ratio, not PowerSGD's rank).

  Returns:
    A transformation like the first stage's; :func:`wire_bytes` gives the
    last stage's bytes (``step=`` for another step's).
  """
  try:
    pairs = [(first, tx) for first, tx in stages]
  except (TypeError, ValueError):
    raise TypeError(f"stages must be a sequence of (first step, tx) pairs, got stages={stages!r}") from None
  if not pairs:
    raise ValueError("stages must hold at least one (first step, tx) pair, got none")
  firsts = [f for f, _ in pairs]
  if any(isinstance(f, bool) or not isinstance(f, (int, np.integer)) for f in firsts) or firsts[0] != 0 \
      or any(b <= a for a, b in zip(firsts, firsts[1:])) or firsts[-1] >= 2 ** 31:
    raise ValueError(f"stages: the first steps must be ints starting at 0 and increasing (below 2**31),"
                     f" got {firsts}")
  methods = []
  for f, tx in pairs:
    m = getattr(tx, "method", None)
    if not isinstance(m, Method):
      raise TypeError(f"stages: the stage from step {f} is not a jaxcomp transformation: {tx!r}")
    if m.fused is not None or m.stages or m.start_step:
      raise ValueError(f"stages: the stage from step {f} ({m.name}) is fused, staged or has a start_step;"
                       " stage plain transformations (add a dense start with configure(start_step=))")
    methods.append(m)
  head, tx0 = methods[0], pairs[0][1]
  for (f, tx), m in zip(pairs[1:], methods[1:]):
    same = (m.name == head.name and tx.axis_name == tx0.axis_name
            and getattr(tx, "dense_axis_name", None) == getattr(tx0, "dense_axis_name", None)
            and type(m.memory) is type(head.memory) and vars(m.memory) == vars(head.memory)
            and (m.bucket_bytes, m.min_size, m.exchange) == (head.bucket_bytes, head.min_size, head.exchange))
    if not same:
      raise ValueError(
          f"stages: the stage from step {f} ({m.name}) differs from the first ({head.name}) in the"
          " method, axis_name, memory, exchange or bucket policy; only the method's other settings"
          " may change")
  method = dataclasses.replace(head, stages=tuple((f, m.route) for f, m in zip(firsts[1:], methods[1:])))
  return build(method, tx0.axis_name, tx0.seed, dense_axis_name=getattr(tx0, "dense_axis_name", None))


def _guard_nonfinite(carried, x, mean, local, extra, state, axis, chunks=False):
  """A non-finite step: NaN output on every worker, nothing counted as sent, exchange state kept.

  ``carried``: every exchange of every stage carries NaN/Inf into the mean.
  ``chunks``: each worker holds a chunk (a fast axis): its mean shows only its
  chunk's NaN, so the flag goes over ``axis`` (both axes) whenever there is state.
  """
  stateless = not jax.tree.leaves((state.memory, state.extra))
  if not x or (carried and stateless):  # exactly the exchanges' mean (lax.pmean; chunks: all-gathered)
    return mean, local, extra
  if carried and not chunks:  # the exchanges put any NaN/Inf into the mean
    bad = jnp.isnan(_nan_if_nonfinite(mean))
  else:
    bad = jnp.isnan(ops.allreduce_sum(_nan_if_nonfinite(x), axis))
  mean = [jnp.where(bad, jnp.nan, m) for m in mean]
  local = [jnp.where(bad, 0.0, s) for s in local]
  extra = [jax.tree.map(lambda new, old: jnp.where(bad, old, new), e, e0)
           for e, e0 in zip(extra, state.extra)]
  return mean, local, extra


class CompressedOptimizer(optax.GradientTransformationExtraArgs):
  """A complete optimizer that owns its exchange; ``.compressor`` is the jaxcomp transformation inside."""

  compressor: Any


def compressed_optimizer(tx: optax.GradientTransformation, compressor_: Any) -> CompressedOptimizer:
  """``tx`` (e.g. an ``optax.chain``) labelled with the jaxcomp transformation that moves its payload."""
  out = CompressedOptimizer(tx.init, tx.update)
  out.compressor = compressor_
  return out


def compressor(tx: Any, params: Any = None) -> Any:
  """The jaxcomp transformation of ``tx``: itself, a complete optimizer's ``.compressor``, or the one inside.

  Complete optimizers that own their exchange (:func:`jaxcomp.onebit_adam`,
  :func:`jaxcomp.demo`) carry the jaxcomp transformation that moves their
  payload as ``.compressor``, so :func:`wire_bytes` and the benches read it.
  Any other optax transformation (``optax.chain``, ``optax.MultiSteps``,
  ``optax.apply_if_finite``, ``optax.inject_hyperparams``, ...) is searched
  with ``params``: its ``init`` is traced (``jax.eval_shape``, nothing is
  computed) and the jaxcomp transformations whose ``init`` ran are the ones
  it holds; exactly one is expected.

  Without ``params`` a ``tx`` that is neither is returned unchanged.

  Raises:
    TypeError: ``params`` given and ``tx`` holds no jaxcomp transformation.
    ValueError: ``tx`` holds more than one.
  """
  return _compressor_and_params(tx, params)[0]


def _compressor_and_params(tx: Any, params: Any) -> tuple:
  """:func:`compressor`, and the parameters it sees: those of ``params`` it gets (``optax.masked``: its own)."""
  if isinstance(getattr(tx, "method", None), Method):
    return tx, params
  inner = getattr(tx, "compressor", None)
  if isinstance(getattr(inner, "method", None), Method):
    return inner, params
  if params is None or not callable(getattr(tx, "init", None)):
    return tx, params
  with _recording() as found:
    jax.eval_shape(lambda p: tx.init(p), params)  # a new function each time: no cached trace
  if not found:
    raise TypeError(f"tx holds no jaxcomp transformation (built by a jaxcomp factory): {tx!r}")
  if len(found) > 1:
    raise ValueError(
        f"tx holds {len(found)} jaxcomp transformations ({', '.join(t.method.name for t, _ in found)});"
        " pass the one to measure")
  inner, seen = found[0]
  return inner, jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), seen)


def wire_bytes(tx: Any, params: Any, step: int | None = None, workers: int | None = None) -> int:
  """Nominal payload bytes one worker sends per step with ``tx`` for ``params``.

  For psum-ed payloads this is the all-reduce buffer; for gathered payloads,
  what one worker contributes to the all-gather. Compare with
  :func:`jaxcomp.collectives.wire.measure_wire_bytes` on the compiled step
  (a program with a warm-up or stages holds every stage's collectives).
  ``step``: the bytes at that step (a warm-up or an earlier stage); None,
  the steady state (the last stage). ``workers``: the number of workers N,
  needed with ``exchange="scatter"``, whose worker hands N chunk payloads to
  an all-to-all and one to an all-gather (each about 1/N of the bucket's).
  A complete optimizer (``onebit_adam``, ``demo``) counts its ``.compressor``; any other optax
  transformation (a chain...) the one jaxcomp transformation it holds (:func:`compressor`).
  """
  tx, params = _compressor_and_params(tx, params)
  method = getattr(tx, "method", None)
  if not isinstance(method, Method):
    raise TypeError(f"tx must be a jaxcomp transformation (built by a jaxcomp factory), got {tx!r}")
  if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0):
    raise ValueError(f"step must be an int >= 0 or None, got step={step!r}")
  workers = _positive_int("workers", workers, 1)
  return method.wire_bytes(params, nonfinite_flag=getattr(tx, "axis_name", None) is not None, step=step,
                           workers=workers)


def steady(tx: Any, params: Any = None) -> CompressionTransformation:
  """``tx`` after its warm-up: its last stage alone, without a dense start.

  For measuring the steady state (its compiled program holds one stage's
  collectives, where ``tx``'s holds every stage's); ``tx`` itself is returned
  when it has no warm-up. The state is alike, so one carries over to the other.

  ``tx`` may also be a complete optimizer (its ``.compressor``) or any optax
  transformation holding one jaxcomp transformation (an ``optax.chain``...):
  then pass ``params`` to find it (see :func:`compressor`), and the result is
  the steady jaxcomp transformation alone, not the chain.
  """
  inner = compressor(tx, params)
  method = getattr(inner, "method", None)
  if not isinstance(method, Method):
    if callable(getattr(tx, "init", None)):
      raise TypeError(f"steady: tx is not a jaxcomp transformation; for an optax transformation holding"
                      f" one (a chain...) pass the parameters, jaxcomp.steady(tx, params), got {tx!r}")
    raise TypeError(f"tx must be a jaxcomp transformation (built by a jaxcomp factory), got {tx!r}")
  tx = inner
  if not method.stages and not method.start_step:
    return tx
  return build(method.steady(), tx.axis_name, tx.seed, dense_axis_name=getattr(tx, "dense_axis_name", None))


def wire_bytes_by_axis(tx: Any, params: Any, dense_axis_size: int, step: int | None = None,
                       workers: int | None = None) -> dict:
  """Nominal bytes one worker hands to each axis per step, for a transform with ``dense_axis_name``.

  Returns ``{axis_name: compressed bytes over the slow axis, dense_axis_name:
  float32 bytes over the fast axis, "both": the non-finite flag, all-reduced
  over both axes (0 if none)}``. Under a fast axis of ``dense_axis_size``
  workers each bucket is reduce-scattered and all-gathered in float32 there
  (:mod:`jaxcomp.hierarchy`) and only the compressed chunks cross the slow
  axis; methods that are not chunked (PowerSGD, ACP-SGD) all-reduce every
  bucket over the fast axis and exchange it whole over the slow one.
  ``workers``: the slow axis's size, needed with ``exchange="scatter"``.
  ``tx`` may be any optax transformation holding one (see :func:`compressor`).
  """
  tx, params = _compressor_and_params(tx, params)
  method = getattr(tx, "method", None)
  fast_name = getattr(tx, "dense_axis_name", None)
  if not isinstance(method, Method) or fast_name is None:
    raise TypeError(f"tx must be a jaxcomp transformation built with dense_axis_name=..., got {tx!r}")
  f = _positive_int("dense_axis_size", dense_axis_size, 1)
  stage = len(method.stages) if step is None else method.stage_at(step)
  full = method.buckets(params, stage or 0)
  flag = NONFINITE_FLAG_BYTES if not _carries_nonfinite(method, params) else 0
  if not _chunkable(method):
    return {tx.axis_name: method.wire_bytes(params, step=step, workers=workers),
            fast_name: 4 * sum(b.length for b in full),
            "both": 0}
  chunks = hierarchy.chunked(full, f)
  def state():
    zeros = tuple(jnp.zeros((b.length,), jnp.float32) for b in chunks)
    return method.memory.init(zeros), tuple(b.exchange.init_bucket(b.segments, jax.random.PRNGKey(0))
                                            for b in chunks)

  stateful = bool(jax.tree.leaves(jax.eval_shape(state)))
  if stage is None:
    slow = 4 * sum(b.length for b in chunks)
  else:
    slow = sum(bucket_wire_bytes(b.exchange, b.segments, workers) for b in chunks)
  return {tx.axis_name: slow, fast_name: hierarchy.wire_bytes(full, f),
          "both": NONFINITE_FLAG_BYTES if (stateful or flag) else 0}


def memory_tree(tx: Any, state: CompressState, params: Any) -> Any:
  """The memory of ``state`` read as trees like ``params`` (float32), e.g. the residual.

  The state keeps the memory in the bucket layout; this cuts every bucket
  vector of it back into leaves (leaves no bucket holds, empty ones, are
  zeros). A memory with several fields (DGC's momentum and accumulation)
  gives the same structure with a tree in each field. A per-worker state
  (leading worker axis, :func:`jaxcomp.per_worker`) gives leaves with that
  axis in front.
  """
  method = tx.method
  buckets = method.buckets(params)
  leaves, treedef = jax.tree.flatten(params)
  like = [jax.ShapeDtypeStruct(np.shape(x), jnp.float32) for x in leaves]

  def cut(vectors):
    return treedef.unflatten(layout.unpack(buckets, list(vectors), like))

  mem = state.memory
  if isinstance(mem, tuple) and hasattr(mem, "_fields"):
    return type(mem)(*(cut(f) for f in mem))
  if not jax.tree.leaves(mem):
    return mem
  return cut(mem)
