"""The generic builder: policy -> memory -> codec -> communicator -> memory.

A method is a :class:`Method`: a ``route`` that sends each gradient leaf to an
:class:`Exchange` (codec + communicator) under a view shape, and a memory
(error feedback). :func:`build` turns it into an ``optax.GradientTransformation``
whose state is a :class:`CompressState` of arrays only.

Leaves that share an exchange and a view shape are stacked into one group and
compressed by one batched (vmapped) kernel, so the compiled program grows with
the number of distinct shapes, not with the number of leaves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp.collectives import ops
from jaxcomp.collectives.axis import Axis, AxisName, check_axis_name, current_axis


class CompressState(NamedTuple):
  """State of every jaxcomp transform; a pytree of arrays.

  Attributes:
    count: int32 number of updates so far (saturates instead of overflowing).
    key: uint32[2] PRNG key, identical on every worker (split once per step).
    memory: the memory's state: the error-feedback residual (a pytree like the
      gradients), a momentum, or ``()``.
    extra: one entry per leaf group for exchanges that keep state (PowerSGD's
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


# ----------------------------------------------------------------------------
# Memory (error feedback)


class Memory:
  """Error feedback: ``x = beta * e + gamma * g``; ``e <- x - sent``; output / gamma.

  Non-finite values never enter the residual: where the input ``x`` is not
  finite the residual is reset to 0 (the NaN/Inf still reaches this step's
  output); where the local decode is not finite nothing usable was sent, so
  the whole finite ``x`` is kept.
  """

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

  def update(self, x: Any, sent: Any, state: Any) -> Any:
    if not self.enabled:
      return ()

    def one(x, s, e):
      r = jnp.where(jnp.isfinite(s), x - s, x)
      return jnp.where(jnp.isfinite(x), r, 0.0).astype(e.dtype)

    return jax.tree.map(one, x, sent, state)

  def like_params(self, state: Any) -> Optional[Any]:
    """The part of the state shaped like the gradients (checked against them)."""
    return state if self.enabled else None

  def output(self, mean: Any) -> Any:
    if self.gamma == 1.0:
      return mean
    return jax.tree.map(lambda m: m / self.gamma, mean)


# ----------------------------------------------------------------------------
# Exchanges: how a group of same-view leaves is compressed and communicated


class Exchange:
  """Compresses and communicates a stacked group ``X`` of shape ``(G, *view)``.

  Subclasses implement ``__call__(X, extra, ctx) -> (mean, local, extra)``:
  ``mean`` is the decoded mean over the axis (identical on every worker),
  ``local`` what this worker's memory counts as sent, and ``wire_bytes``, the
  nominal bytes one worker hands to collectives for the group.
  ``carries_nonfinite``: a NaN or Inf anywhere in any worker's ``X`` always
  makes ``mean`` non-finite (a float psum of the values does); :func:`build`
  then needs no flag collective to tell every worker about it.
  """

  carries_nonfinite: bool = False

  def init(self, view: Tuple[int, ...], group: int, key: jax.Array) -> Any:
    del view, group, key
    return ()

  def __call__(self, X, extra, ctx: Ctx):
    raise NotImplementedError

  def wire_bytes(self, view: Tuple[int, ...], group: int) -> int:
    raise NotImplementedError


class Codec:
  """Encode/decode of one flat float32 vector of length n (static).

  ``encode(x, key) -> payload`` (a pytree of arrays of static shapes) and
  ``decode(payload, key, n) -> x_hat``. ``linear`` codecs satisfy
  ``decode(sum of payloads) == sum of decodes`` and travel through psum;
  the others are all-gathered and combined by ``aggregate`` (default: the
  mean of the decoded payloads). ``shared_key``: the key is identical on every
  worker (random-k positions); otherwise each worker folds in its index.
  """

  linear: bool = False
  shared_key: bool = False
  carries_nonfinite: bool = False

  def encode(self, x: jax.Array, key: jax.Array) -> Any:
    raise NotImplementedError

  def decode(self, payload: Any, key: jax.Array, n: int) -> jax.Array:
    raise NotImplementedError

  def aggregate(self, gathered: Any, key: jax.Array, n: int, num: int) -> jax.Array:
    """Mean over the leading (worker) axis of ``gathered`` payloads.

    Decoded and accumulated one worker at a time, in worker order (the same
    float result on every worker): no ``N x n`` array of decoded payloads.
    """
    workers = jax.tree.leaves(gathered)[0].shape[0]

    def decoded(w):
      payload = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, w, keepdims=False), gathered)
      return self.decode(payload, key, n).astype(jnp.float32)

    # Starting from worker 0's decode keeps the carry's type (shard_map's
    # varying-ness included) that of the body's.
    total = lax.fori_loop(1, workers, lambda w, acc: acc + decoded(w), decoded(0))
    return total / num


@dataclasses.dataclass(frozen=True)
class CodecExchange(Exchange):
  """A codec over the flat view ``(n,)``, moved by psum or by all-gather."""

  codec: Codec

  @property
  def carries_nonfinite(self) -> bool:
    return self.codec.carries_nonfinite

  def _keys(self, ctx: Ctx, group: int):
    key = ctx.key if self.codec.shared_key else jax.random.fold_in(ctx.key, ctx.axis.index)
    return jax.random.split(key, group), jax.random.split(ctx.key, group)

  def __call__(self, X, extra, ctx: Ctx):
    group, n = X.shape
    enc_keys, shared_keys = self._keys(ctx, group)
    dec_keys = enc_keys if self.codec.shared_key else shared_keys
    encode = jax.vmap(self.codec.encode)
    decode = jax.vmap(lambda p, k: self.codec.decode(p, k, n))
    if self.codec.linear:
      num = ctx.axis.size
      payload = encode(X / num, enc_keys)
      local = decode(payload, enc_keys) * num
      mean = decode(ops.allreduce_sum(payload, ctx.axis), enc_keys)
      return mean, local, extra
    payload = encode(X, enc_keys)
    local = decode(payload, enc_keys)
    if ctx.axis.name is None:
      return local, local, extra
    gathered = ops.allgather(payload, ctx.axis)  # leaves (N, G, ...)
    gathered = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), gathered)
    mean = jax.vmap(lambda p, k: self.codec.aggregate(p, k, n, ctx.axis.size))(
        gathered, dec_keys)
    return mean, local, extra

  def wire_bytes(self, view, group):
    (n,) = view
    x = jax.ShapeDtypeStruct((group, n), jnp.float32)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.PRNGKey(0), group))
    shapes = jax.eval_shape(jax.vmap(self.codec.encode), x, keys)
    return int(sum(np.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes)))


class DenseCodec(Codec):
  """The identity in float32: the dense mean, i.e. ``lax.pmean``."""

  linear = True
  carries_nonfinite = True

  def encode(self, x, key):
    return x

  def decode(self, payload, key, n):
    return payload


DENSE = CodecExchange(DenseCodec())


class FusedExchange:
  """Compresses and communicates all leaf groups of a step at once (tensor fusion).

  For methods whose collectives span groups, e.g. ACP-SGD's one all-reduce
  for the factors of every layer. ``__call__(groups, xs, extras, ctx)`` gets
  the plan (one ``(exchange, view, leaf indices)`` per group), each group's
  stacked input ``(G, *view)`` and state (made by the group exchange's
  ``init``), and a ``ctx`` whose key is the step's; it returns one
  ``(mean, local, extra)`` per group. ``wire_bytes(groups)``: the nominal bytes
  per step. The groups' ``carries_nonfinite`` must stay true of the fused path.
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


STACK_MAX = 1 << 16  # leaves with more entries than this are not stacked, see Method.plan


@dataclasses.dataclass(frozen=True)
class Method:
  """A compression method: its name, how leaves are routed, and its memory.

  ``fused``: when set, one :class:`FusedExchange` handles every group of a
  step instead of each group's exchange on its own.
  """

  name: str
  route: Callable[[Tuple[int, ...]], Tuple[Exchange, Tuple[int, ...]]]
  memory: Memory
  fused: FusedExchange | None = None

  def plan(self, leaves: Sequence[Any]):
    """Groups leaf indices by (exchange, view); empty leaves are skipped.

    Leaves of more than :data:`STACK_MAX` entries form a group of their own:
    stacking copies them (several times the kernel's own cost on CPU), while
    one kernel per large leaf costs little to compile. Smaller leaves of the
    same view share one batched kernel, so the program grows with distinct
    small shapes, not with leaves.
    """
    groups: dict = {}
    for i, leaf in enumerate(leaves):
      size = int(np.prod(leaf.shape, dtype=np.int64))
      if size == 0:
        continue
      exchange, view = self.route(tuple(leaf.shape))
      groups.setdefault((exchange, tuple(view), i if size > STACK_MAX else -1), []).append(i)
    return [(ex, view, idx) for (ex, view, _), idx in groups.items()]

  def wire_bytes(self, params: Any, nonfinite_flag: bool = True) -> int:
    """Nominal bytes one worker hands to collectives per step for ``params``.

    ``nonfinite_flag``: count the float32 that tells every worker about a
    non-finite step (see :func:`build`); it is sent only over an axis, and
    only when some leaf group's exchange does not carry NaN/Inf by itself.
    """
    plan = self.plan(jax.tree.leaves(params))
    flag = nonfinite_flag and any(not ex.carries_nonfinite for ex, _, _ in plan)
    if self.fused is not None:
      payload = self.fused.wire_bytes(plan)
    else:
      payload = sum(ex.wire_bytes(view, len(idx)) for ex, view, idx in plan)
    return payload + (NONFINITE_FLAG_BYTES if flag else 0)


class CompressionTransformation(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` that also carries its :class:`Method`."""

  method: Method


def _check_leaves(leaves, paths):
  for leaf, path in zip(leaves, paths):
    if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
      raise TypeError(
          f"updates: leaf {jax.tree_util.keystr(path)} has dtype {leaf.dtype};"
          " jaxcomp compresses floating-point gradients only (float32, bfloat16,"
          " float16). Mask integer leaves out with optax.masked or"
          " optax.multi_transform.")


NONFINITE_FLAG_BYTES = 4  # one float32 all-reduced per step, see build()


def _nan_if_nonfinite(leaves) -> jax.Array:
  """0.0 if every entry of ``leaves`` is finite, else NaN: a sum of ``x * 0``, which cannot overflow."""
  total = jnp.zeros((), jnp.float32)
  for leaf in leaves:
    if leaf.size:
      total = total + jnp.sum(leaf.astype(jnp.float32) * 0.0)
  return total


def build(method: Method, axis_name: AxisName = None, seed: int = 0) -> CompressionTransformation:
  """Assembles ``method`` into an optax transformation communicating over ``axis_name``.

  Args:
    method: routes, exchanges and memory.
    axis_name: the pmap / shard_map axis (or tuple of axes) to average over;
      ``None`` runs a local compress -> decode round trip.
    seed: seeds the PRNG key in the state (identical on every worker).

  Returns:
    A :class:`CompressionTransformation`; its ``update`` returns the mean over
    the axis of what the workers sent, identical on every worker.

  Non-finite steps: if any worker's gradient (after error-feedback
  compensation) holds a NaN or Inf, every entry of the output is NaN on every
  worker, so that a guard such as ``optax.apply_if_finite`` skips the step on
  all replicas together. Such a step counts nothing as sent: the residual
  keeps every finite value of its input (non-finite entries are reset to 0)
  and the exchanges' state (PowerSGD's Q) is left as it was; the next step
  is finite again. Codecs lose NaNs (a sign bit, an unsampled position), so
  each worker's ``sum(x * 0)`` (0, or NaN; it cannot overflow) is
  all-reduced as one float32: 4 bytes, counted by :func:`wire_bytes`, and one
  pass over the gradients. A flag inside the payloads would need every
  exchange to carry it and still cost bytes (packed sign payloads have no
  spare bit). Exchanges that carry NaN/Inf into the mean themselves
  (``carries_nonfinite``: the float psums, SBC's NaN header) need no flag;
  with no state to protect either (none, fp16 and bf16 without error
  feedback) the output is left exactly as ``lax.pmean`` gives it, NaN/Inf
  where the mean has them, at no cost.
  """
  axis_name = check_axis_name(axis_name)
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
    raise TypeError(f"seed must be an int, got seed={seed!r}")
  if not -2 ** 63 <= int(seed) < 2 ** 63:
    raise ValueError(f"seed must fit in int64, got seed={seed!r}")

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    key = jax.random.PRNGKey(seed)
    extra = tuple(
        ex.init(view, len(idx), jax.random.fold_in(key, g))
        for g, (ex, view, idx) in enumerate(method.plan(leaves)))
    return CompressState(
        count=jnp.zeros((), jnp.int32), key=key,
        memory=method.memory.init(params), extra=extra, phase=jnp.zeros((), jnp.uint32))

  def update_fn(updates, state, params=None):
    del params
    if not isinstance(state, CompressState):
      raise TypeError(f"state must be the CompressState from tx.init, got {type(state).__name__}")
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    paths = [p for p, _ in paths_leaves]
    leaves = [leaf for _, leaf in paths_leaves]
    _check_leaves(leaves, paths)
    like = method.memory.like_params(state.memory)
    if like is not None:
      mem_def = jax.tree.structure(like)
      if mem_def != treedef:
        raise ValueError(
            "updates do not match the state: the gradient tree is"
            f" {treedef}, the state was initialized for {mem_def}. Call tx.init"
            " on parameters with the same structure as the gradients.")
      for (path, g), e in zip(paths_leaves, jax.tree.leaves(like)):
        if g.shape != e.shape:
          raise ValueError(
              f"updates: leaf {jax.tree_util.keystr(path)} has shape {g.shape}"
              f" but the state holds {e.shape}; the gradients do not match the"
              " parameters given to tx.init.")
    plan = method.plan(leaves)
    if len(plan) != len(state.extra):
      raise ValueError(
          f"updates do not match the state: {len(plan)} leaf groups now,"
          f" {len(state.extra)} when tx.init was called.")

    axis = current_axis(axis_name)
    key, step_key = jax.random.split(state.key)
    x = jax.tree.leaves(method.memory.compensate(updates, state.memory))
    mean = list(x)
    local = list(x)
    extra = []
    xs = [jnp.stack([x[i].reshape(view) for i in idx]) for _, view, idx in plan]
    if method.fused is not None:
      fused = method.fused(plan, xs, tuple(state.extra), Ctx(axis, step_key, state.count, state.phase))
    for g, ((ex, view, idx), ex_state) in enumerate(zip(plan, state.extra)):
      if method.fused is not None:
        m, loc, ex_state = fused[g]
      else:
        m, loc, ex_state = ex(xs[g], ex_state, Ctx(axis, jax.random.fold_in(step_key, g), state.count, state.phase))
      extra.append(ex_state)
      for j, i in enumerate(idx):
        mean[i] = m[j].reshape(leaves[i].shape)
        local[i] = loc[j].reshape(leaves[i].shape)
    out = jax.tree.leaves(method.memory.output(treedef.unflatten(mean)))
    out = [o.astype(leaf.dtype) for o, leaf in zip(out, leaves)]
    carried = all(ex.carries_nonfinite for ex, _, _ in plan)
    stateless = not jax.tree.leaves((state.memory, state.extra))
    if plan and not (carried and stateless):  # else: exactly the exchanges' mean (lax.pmean)
      if carried:  # the exchanges put any NaN/Inf into ``out``
        bad = jnp.isnan(_nan_if_nonfinite(out))
      else:
        bad = jnp.isnan(ops.allreduce_sum(_nan_if_nonfinite(x), axis))
      out = [jnp.where(bad, jnp.nan, o).astype(o.dtype) for o in out]
      local = [jnp.where(bad, 0.0, s) for s in local]
      extra = [jax.tree.map(lambda new, old: jnp.where(bad, old, new), e, e0)
               for e, e0 in zip(extra, state.extra)]
    out = treedef.unflatten(out)
    memory = method.memory.update(
        treedef.unflatten(x), treedef.unflatten(local), state.memory)
    new_state = CompressState(
        count=optax.safe_int32_increment(state.count), key=key,
        memory=memory, extra=tuple(extra), phase=state.phase + jnp.uint32(1))
    return out, new_state

  tx = CompressionTransformation(init_fn, update_fn)
  tx.method = method
  tx.axis_name = axis_name
  return tx


def wire_bytes(tx: Any, params: Any) -> int:
  """Nominal payload bytes one worker sends per step with ``tx`` for ``params``.

  For psum-ed payloads this is the all-reduce buffer; for gathered payloads,
  what one worker contributes to the all-gather. Compare with
  :func:`jaxcomp.collectives.wire.measure_wire_bytes` on the compiled step.
  """
  method = getattr(tx, "method", None)
  if not isinstance(method, Method):
    raise TypeError(f"tx must be a jaxcomp transformation (built by a jaxcomp factory), got {tx!r}")
  return method.wire_bytes(params, nonfinite_flag=getattr(tx, "axis_name", None) is not None)
