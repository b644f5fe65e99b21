"""The builder: a :class:`jaxcomp.core.method.Method` made an optax transformation.

The data path of one step (:func:`_update`), as GRACE's
``compensate -> compress -> memory.update -> send_receive``::

    bucket      the gradient leaves laid out in flat float32 buckets
    compensate  memory.compensate: the residual added back
    exchange    each bucket's exchange: encode, collective, decode
    guard       a non-finite step: NaN on every worker, nothing counted as sent
    remember    memory.update: what was not sent stays in the memory
    output      memory.output, cut back into leaves

Under a fast axis (``dense_axis_name``) each worker compresses its chunk of
every bucket after a dense reduce-scatter and all-gathers the mean chunks
(:mod:`jaxcomp.exchanges.hierarchy`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp.collectives import ops
from jaxcomp.collectives.axis import Axis, AxisName, axis_names, current_axis
from jaxcomp.core import checks, layout, policy
from jaxcomp.core.compression import CompressionTransformation, Settings, record_init
from jaxcomp.core.groups import groups, join_groups, stack_group
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import DENSE, CodecExchange, CompressState, MemoryStep, Opened, StepContext
from jaxcomp.exchanges import hierarchy
from jaxcomp.training import finite


def build(method: Method, axis_name: AxisName = None, seed: int = 0, bucket_bytes: int | None = None,
          min_size: int | None = None, dense: Any = None,
          dense_axis_name: AxisName = None, transport: str | None = None) -> CompressionTransformation:
  """Assembles ``method`` into an optax transformation communicating over ``axis_name``.

  Args:
    method: routes, exchanges and memory.
    axis_name: the pmap / shard_map axis (or tuple of axes) to average over;
      ``None`` runs a local compress -> decode round trip.
    seed: seeds the PRNG key in the state (identical on every worker).
    bucket_bytes: the largest bucket, in float32 bytes (default 25 MiB, as
      torch DDP); a leaf larger than that gets a bucket of its own.
    min_size: leaves of fewer entries travel dense in float32 (default: the
      method's); 0 or 1 compresses every leaf.
    dense: leaves kept dense whatever their size: an optax-style mask, a
      pytree of bools like the gradients or a callable returning one.
    dense_axis_name: a fast axis (inside a node) averaged densely before the
      compressed exchange over ``axis_name`` (between nodes); call ``tx.init``
      inside the mesh too: each worker's state holds its chunk of every bucket.
    transport: ``"gather"`` (all-gather every worker's payload) or
      ``"scatter"`` (bytes flat in N, :mod:`jaxcomp.exchanges.scatter`); None keeps the method's.

  Returns:
    A :class:`jaxcomp.core.compression.CompressionTransformation`; its
    ``update`` returns the mean over the axis of what the workers sent,
    identical on every worker.

  Non-finite steps: if any worker's compensated gradient holds a NaN or Inf,
  the output is non-finite on every worker alike (so ``apply_if_finite``
  skips it on all replicas), the residual keeps every finite value and the
  exchanges' state is left as it was. Methods with state, and methods whose
  exchanges do not carry NaN/Inf into the mean themselves
  (``carries_nonfinite``), make every entry of the output NaN; the latter
  cost one float32 all-reduce per step for it, counted by
  :func:`jaxcomp.wire_bytes`, and a check over the buckets. Stateless
  methods whose exchanges carry it return exactly their mean, non-finite
  where the payload put it (a leaf's NaN norm, a bucket's NaN flag, one
  +-Inf entry for natural compression).
  """
  settings = checks.settings(method, axis_name, seed, bucket_bytes, min_size, dense, dense_axis_name,
                             transport)
  tx = CompressionTransformation(lambda params: _init(tx, params),
                                 lambda updates, state, params=None: _update(tx, updates, state, params),
                                 settings)
  return tx


# ----------------------------------------------------------------------------
# init


def _init(tx: CompressionTransformation, params) -> CompressState:
  s = tx.settings
  method = s.method
  if record_init(tx, params):  # jaxcomp.compressor(): only which transformation, on which leaves
    return _state(jax.random.PRNGKey(s.seed), (), ())
  _check_fast_axis_bound(s)
  buckets = _work_buckets(s, params)
  if method.stages:
    method.check_stages(params, method.buckets(params))
  key = _worker_key(s)
  extra = _init_extra(method, buckets, key)
  if method.stages:
    checks.check_stage_state(method, extra, [_init_extra(method, _work_buckets(s, params, j), key)
                                             for j in range(1, len(method.stages) + 1)])
  if checks.remember(tx.signatures, params):
    policy.warn_if_mostly_dense(method, params, DENSE, stacklevel=4)  # once per tree this tx sees
  zeros = tuple(jnp.zeros((b.length,), jnp.float32) for b in buckets)
  return _state(key, method.memory.init(zeros), extra)


def _state(key, memory, extra, count=None, phase=None) -> CompressState:
  return CompressState(count=jnp.zeros((), jnp.int32) if count is None else count, key=key, memory=memory,
                       extra=extra, phase=jnp.zeros((), jnp.uint32) if phase is None else phase)


def _check_fast_axis_bound(s: Settings) -> None:
  if s.dense_axis_name is None:
    return
  try:
    current_axis(s.dense_axis_name)
  except ValueError:
    raise ValueError(
        f"with dense_axis_name={s.dense_axis_name!r}, call tx.init inside the mesh (jax.shard_map"
        " over both axes, or jaxcomp.data_parallel): each worker's state holds its chunk of every"
        " bucket, whose size depends on the fast axis") from None


def _chunked(s: Settings) -> bool:
  """Each worker compresses its chunk of every bucket (a fast axis, a method that can be chunked)."""
  return s.dense_axis_name is not None and s.method.can_chunk


def _work_buckets(s: Settings, tree, stage: int = 0):
  """The buckets this worker compresses: whole, or its chunk of each under a fast axis."""
  full = s.method.buckets(tree, stage)
  if not _chunked(s):
    return full
  return hierarchy.chunked(full, current_axis(s.dense_axis_name).size)


def _worker_key(s: Settings):
  key = jax.random.PRNGKey(s.seed)
  if _chunked(s):  # each worker of a node its own chunk
    key = jax.random.fold_in(key, current_axis(s.dense_axis_name).index)
  return key


def _init_extra(method: Method, buckets, key) -> tuple:
  """Each bucket's exchange state (a fused method's groups: the group form's)."""
  def init(b, k):
    if method.fused is not None:
      return method.fused.init_bucket(b.exchange, b.segments, k)
    return b.exchange.init_bucket(b.segments, k)

  return tuple(init(b, jax.random.fold_in(key, i)) for i, b in enumerate(buckets))


# ----------------------------------------------------------------------------
# update


def _update(tx: CompressionTransformation, updates, state, params=None):
  s = tx.settings
  method = s.method
  finite.check_guarded(s.axis_name, s.dense_axis_name)
  leaves, treedef = checks.update_inputs(updates, state, tx.signatures, s.axis_name)
  full = method.buckets(updates)
  if method.stages:
    method.check_stages(updates, full)
  buckets = _work_buckets(s, updates)
  checks.check_state(method, state, buckets, treedef)
  axis = current_axis(s.axis_name)
  fast = None if s.dense_axis_name is None else current_axis(s.dense_axis_name)
  chunks = fast is not None and buckets is not full
  key, step_key = jax.random.split(state.key)
  ctx = StepContext(axis, step_key, state.count, state.phase)

  grads, bucket_params = _bucket(full, buckets, leaves, treedef, params, fast, chunks)
  x, carry = method.memory.compensate(tuple(grads), state.memory)
  opened, x = _exchange_or_warm_up(method, lambda i: _work_buckets(s, updates, i), x,
                                    state.extra, ctx, bucket_params)
  # chunks: a NaN lands in one worker's chunk, so the flag goes over both axes
  flag_axis = Axis(axis_names(s.axis_name) + axis_names(s.dense_axis_name), 0, axis.index) \
      if chunks else axis
  mean, sent, extra = _guard_nonfinite(method.carries_nonfinite(updates), x, opened, state, flag_axis,
                                        chunks)
  sent = [jnp.where(b.segments.valid(), v, 0.0) if b.segments.has_pads else v
           for b, v in zip(buckets, sent)]
  memory = _remember(method, x, sent, mean, state.memory, buckets, ctx, carry)
  out = method.memory.output(tuple(mean), state.memory, memory)
  if chunks:  # every worker's mean chunk, back in whole buckets (fast axis)
    out = hierarchy.all_gather(out, full, fast)
  out = layout.unpack(full, out, leaves)
  new_state = _state(key, memory, tuple(extra), optax.safe_int32_increment(state.count),
                     state.phase + jnp.uint32(1))
  return treedef.unflatten(out), new_state


def _bucket(full, buckets, leaves, treedef, params, fast, chunks):
  """The gradients (and the parameters exchanges want) in buckets; under a fast axis its dense mean."""
  grads = layout.pack(full, leaves, _flat)
  bucket_params = _bucket_params(full, treedef, params)
  if chunks:  # the node's mean of this worker's chunk (dense, fast axis)
    grads = hierarchy.reduce_scatter_mean(grads, buckets, fast)
    bucket_params = hierarchy.chunk_of(bucket_params, buckets, fast)
  elif fast is not None:  # not chunkable: the node's mean of every bucket
    grads = [g / fast.size for g in ops.allreduce_sum(tuple(grads), fast)]
  return grads, bucket_params


def _flat(exchange) -> bool:
  """Packed flat: the dense exchange's buckets (slices cancel against the unpack's), a by-segment codec's."""
  return exchange is DENSE or (isinstance(exchange, CodecExchange) and exchange.codec.by_segment)


def _bucket_params(buckets, treedef, params):
  """The parameters of the buckets whose exchange ``wants_params`` (float32 vectors), else None."""
  wanted = [b.exchange.wants_params for b in buckets]
  if params is None or not any(wanted):
    return [None] * len(buckets)
  leaves = treedef.flatten_up_to(params)
  return [layout.pack([b], leaves)[0] if w else None for b, w in zip(buckets, wanted)]


def _remember(method: Method, x, sent, mean, memory, buckets, ctx: StepContext, carry=None):
  """The memory's new state: what was not sent."""
  dense_step = ctx.count < method.start_step if method.start_step > 0 else None
  step = MemoryStep(buckets=buckets, mean=tuple(mean), carry=carry, dense_step=dense_step)
  return method.memory.update(tuple(x), tuple(sent), memory, step)


def _exchange_or_warm_up(method: Method, layout_of, x, extras, ctx: StepContext, params):
  """The exchanges of the step's stage, or before ``method.start_step`` the dense mean (all sent):
  ``(opened, x)``, each :class:`Opened` finishing to lists ``(means, locals, extras)`` of its buckets.

  One compiled program holds every stage: ``lax.switch`` on the step count (each bucket's
  stages switched by its exchange, :func:`_shared_stages`); a switch runs whole (no poison).
  """
  def dense(x, extras):
    mean = ops.allreduce_sum(tuple(x), ctx.axis)  # one all-reduce for every bucket
    return [m / ctx.axis.size for m in mean], list(x), list(extras)

  def stage(i):
    buckets = layout_of(i)

    def compressed(x, extras):
      return _finish(_exchange_all(method, buckets, list(x), extras, ctx, params)[0], None)

    return compressed

  shared = _shared_stages(method, layout_of, ctx, params)
  if not shared and not method.stages and method.start_step == 0:  # one stage: x as its exchanges read it
    return _exchange_all(method, layout_of(0), list(x), extras, ctx, params)
  stages = [shared] if shared else [stage(i) for i in range(len(method.stages) + 1)]
  branches = ([dense] if method.start_step > 0 else []) + stages
  if len(branches) == 1:
    return [_done(*branches[0](x, extras))], x
  branches = [lambda x, e, f=f: ops.varying(f(x, e), ctx.axis) for f in branches]
  index = 0 if shared else _stage_index(method, ctx.count)
  if method.start_step > 0:  # dense before start_step, whichever stage the count is in
    index = jnp.where(ctx.count < method.start_step, 0, 1 + index)
  return [_done(*lax.switch(index, branches, tuple(x), tuple(extras)))], x


def _done(mean, sent, extra) -> Opened:
  """Buckets whose exchanges ran whole: their means the witness, no poison."""
  mean, sent, extra = list(mean), list(sent), list(extra)
  return Opened(mean, lambda poison: (mean, sent, extra))


def _finish(opened, poison):
  """Every bucket's ``(means, locals, extras)`` from the :class:`Opened` of :func:`_exchange_all`."""
  parts = [o.finish(poison) for o in opened]
  return tuple([v for part in parts for v in part[k]] for k in range(3))


def _stage_index(method: Method, count) -> jax.Array:
  """The stage that runs at ``count`` (int32; 0: the first)."""
  return sum((count >= s).astype(jnp.int32) for s, _ in method.stages) + jnp.int32(0)


def _shared_stages(method: Method, layout_of, ctx: StepContext, params):
  """Every stage of a schedule in one call per bucket (:meth:`Exchange.exchange_stages`, which can do
  the stages' common work once), or None: no stages, a fused method, or a bucket whose stages
  have exchanges of different types (then the builder switches whole stages)."""
  if not method.stages or method.fused is not None:
    return None
  per_bucket = list(zip(*[layout_of(i) for i in range(len(method.stages) + 1)]))
  if any(len({type(s.exchange) for s in b}) > 1 for b in per_bucket):
    return None
  index = _stage_index(method, ctx.count)

  def run(x, extras):
    results = [b[0].exchange.exchange_stages([s.exchange for s in b], index, xb, b[0].segments, e,
                                              ctx._replace(key=jax.random.fold_in(ctx.key, i), params=p))
               for i, (b, xb, e, p) in enumerate(zip(per_bucket, x, extras, params))]
    return tuple(list(r) for r in zip(*results)) if results else ([], [], [])

  return run


def _exchange_all(method: Method, buckets, x, extras, ctx: StepContext, params):
  """Each bucket's exchange (or the method's fused exchange), opened: ``(opened, x)``, x as the
  exchanges read it (:meth:`jaxcomp.core.protocol.Exchange.exchange_many`)."""
  if method.fused is None:
    ctxs = [ctx._replace(key=jax.random.fold_in(ctx.key, i), params=p) for i, p in enumerate(params)]
    if not method.loop_buckets:
      opened = [b.exchange.open(xb, b.segments, e, c) for b, xb, e, c in zip(buckets, x, extras, ctxs)]
      return [Opened(o.witness, lambda p, o=o: tuple([v] for v in o.finish(p)), o.poisons)
              for o in opened], x
    results: list = [None] * len(buckets)
    by_exchange: dict = {}
    for i, b in enumerate(buckets):
      by_exchange.setdefault(b.exchange, []).append(i)
    for exchange, idx in by_exchange.items():  # one call per exchange: its buckets may share one loop
      done = exchange.exchange_many([x[i] for i in idx], [buckets[i].segments for i in idx],
                                    [extras[i] for i in idx], [ctxs[i] for i in idx])
      for i, r in zip(idx, done):
        results[i] = r
    return [_done([r[0]], [r[1]], [r[2]]) for r in results], [r[3] for r in results]
  return [_exchange_fused(method, buckets, x, extras, ctx)], x


def _exchange_fused(method: Method, buckets, x, extras, ctx: StepContext):
  """Every group of every bucket through the method's fused exchange, then back into buckets."""
  plan, xs, states, where = [], [], [], []
  for i, (b, xb) in enumerate(zip(buckets, x)):
    for g, (view, idx) in enumerate(groups(b.segments)):
      plan.append((b.exchange, view, [b.leaves[s] for s in idx]))
      xs.append(stack_group(xb, b.segments, view, idx))
      states.append(extras[i][g])
      where.append(i)
  fused = method.fused.open(plan, xs, tuple(states), ctx)

  def finish(poison):
    mean, sent, new_extra = ([[] for _ in buckets] for _ in range(3))
    for i, (m, loc, e) in zip(where, fused.finish(poison)):
      mean[i].append(m)
      sent[i].append(loc)
      new_extra[i].append(e)
    return ([join_groups(groups(b.segments), m, b.segments) for m, b in zip(mean, buckets)],
            [join_groups(groups(b.segments), loc, b.segments) for loc, b in zip(sent, buckets)],
            [tuple(e) for e in new_extra])

  return Opened(fused.witness, finish, fused.poisons)


def _nan_if_nonfinite(vectors) -> jax.Array:
  """0.0 if every entry of ``vectors`` is finite, else NaN.

  An AND-reduction of ``isfinite``, a bucket's rows first (:func:`_finite_rows`). Not a max of
  magnitudes: XLA:CPU's vectorised max-reduction can drop a NaN that sits among equal values, and
  the step would pass as finite.
  """
  ok = jnp.ones((), jnp.bool_)
  for v in vectors:
    if v.size:
      ok = ok & jnp.all(_finite_rows(v))
  return jnp.where(ok, 0.0, jnp.nan).astype(jnp.float32)


def _finite_rows(v: jax.Array) -> jax.Array:
  """``isfinite(v)``, AND-reduced over each row of :data:`layout.ROW` entries where ``v`` is a bucket.

  Each row reduced as its two half rows (:func:`layout.halves`): XLA:CPU fuses that reduction with
  the kernel that reads ``v``, where a plain reduction first writes out a mask of ``v``'s length.
  """
  if v.ndim != 1 or v.size % layout.ROW:
    return jnp.isfinite(v)
  return layout.halves(jnp.isfinite(v).reshape(-1, layout.ROW), jnp.ones((), jnp.bool_), lax.bitwise_and)


def _guard_nonfinite(carried, x, opened, state, axis, chunks=False):
  """A non-finite step: NaN output on every worker, nothing counted as sent, exchange state kept.

  ``carried``: every exchange of every stage carries NaN/Inf into the mean.
  ``chunks``: each worker holds a chunk (a fast axis): its mean shows only its
  chunk's NaN, so the flag goes over ``axis`` (both axes) whenever there is state.
  Codecs lose NaNs (a sign bit, an unsampled position), so each worker's
  ``sum(x * 0)``-like flag (0 or NaN) is all-reduced as one float32 where needed.
  ``opened``: the exchanges in two parts (:class:`Opened`): the flag is read from their
  witnesses (small where a low-rank factor is one) and handed to them as a poison, so
  an exchange that poisons its own output needs no select over it.
  """
  stateless = not jax.tree.leaves((state.memory, state.extra))
  if not x or (carried and stateless):  # exactly the exchanges' mean (lax.pmean; chunks: all-gathered)
    return _finish(opened, None)
  if carried and not chunks:  # the exchanges put any NaN/Inf into the mean
    flag = _nan_if_nonfinite(jax.tree.leaves([o.witness for o in opened]))
  else:
    flag = ops.allreduce_sum(_nan_if_nonfinite(x), axis)
  bad = jnp.isnan(flag)
  mean, sent, extra = [], [], []
  for o in opened:
    m, loc, e = o.finish(flag)  # 0.0 or NaN
    mean += m if o.poisons else [jnp.where(bad, jnp.nan, v) for v in m]
    sent += loc
    extra += e
  sent = [jnp.where(bad, 0.0, v) for v in sent]
  extra = [jax.tree.map(lambda new, old: jnp.where(bad, old, new), e, e0)
           for e, e0 in zip(extra, state.extra)]
  return mean, sent, extra
