"""Deep Gradient Compression: sampled-threshold sparsification with momentum correction."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives import ops
from jaxcomp.collectives.axis import AxisName, current_axis
from jaxcomp.core import Ctx, Exchange, Memory, Method, build, flat_route
from jaxcomp.transforms import _args
from jaxcomp.transforms.threshold import (
  key_int,
  passes,
  refine_threshold,
  sampled_threshold,
  select,
  sparse_bytes,
  sparse_decode,
  sparse_mean,
  target,
)

Schedule = Callable[[jax.Array], jax.Array]

WARMUP_START = 0.25  # DGC's first warm-up density (75% sparsity), divided by 4 per stage
CAPACITY_FACTOR = 1.3  # the adjusted count is within 1.3 k, the payload holds that many


def warmup_schedule(ratio: float, warmup_steps: int, stages: int = 4) -> Schedule:
  """DGC's exponential warm-up of sparsity: density ``0.25 ** (stage + 1)``, then ``ratio``.

  The first ``warmup_steps`` steps are split into ``stages`` equal stages; in
  stage i (0-based) the density is ``max(ratio, 0.25 ** (i + 1))``, and from
  ``warmup_steps`` on it is ``ratio``. With ``ratio=0.001`` and 4 stages this
  is DGC's 75%, 93.75%, 98.4375%, 99.6%, then 99.9% sparsity.
  """
  r = _args.ratio("ratio", ratio)
  w = _args.integer("warmup_steps", warmup_steps, 1)
  st = _args.integer("stages", stages, 1)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    stage = jnp.minimum(jnp.floor(step * st / w), st - 1)
    density = jnp.maximum(jnp.float32(WARMUP_START) ** (stage + 1), r)
    return jnp.where(step < w, density, jnp.float32(r))

  return schedule


class DGCState(NamedTuple):
  """DGC's memory: the corrected momentum ``u`` and the accumulation ``v`` (trees like params)."""

  momentum: Any
  accumulation: Any


class DGCMemory(Memory):
  """Momentum correction, factor masking and local clipping (DGC Sec. 3.2-3.3).

  ``compensate``: clip g (optional), ``u <- m u + g``, ``v <- v + u``; the
  codec sends part of v. ``update``: zero v and u where v was sent (the sent
  entries are the nonzero entries of the local decode, since an exact zero is
  never selected); v keeps exactly what was not sent. The memory interface
  does not hand the gradient to ``update``, so u is recovered there as
  ``v_new - v_old``: the same value up to one float32 rounding of v.
  """

  def __init__(self, momentum: float, clip_norm: float | None, axis_name: AxisName):
    super().__init__()
    self.momentum, self.clip_norm, self.axis_name = momentum, clip_norm, axis_name

  def init(self, params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return DGCState(momentum=zeros, accumulation=zeros)

  def _clip(self, grads):
    if self.clip_norm is None:
      return grads
    workers = current_axis(self.axis_name).size
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    limit = self.clip_norm / np.sqrt(workers)
    scale = jnp.where(jnp.isfinite(norm) & (norm > limit), limit / norm, 1.0)
    return jax.tree.map(lambda g: g * scale, grads)

  def compensate(self, grads, state):
    g = self._clip(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
    u = jax.tree.map(lambda u, g: self.momentum * u.astype(jnp.float32) + g, state.momentum, g)
    return jax.tree.map(lambda v, u: v.astype(jnp.float32) + u, state.accumulation, u)

  def update(self, x, sent, state):
    keep = jax.tree.map(lambda x, s: (s == 0) & jnp.isfinite(x), x, sent)
    u = jax.tree.map(lambda k, x, v, u: jnp.where(k, x - v.astype(jnp.float32), 0.0).astype(u.dtype),
                     keep, x, state.accumulation, state.momentum)
    v = jax.tree.map(lambda k, x, v: jnp.where(k, x, 0.0).astype(v.dtype), keep, x, state.accumulation)
    return DGCState(momentum=u, accumulation=v)

  def like_params(self, state):
    return state.momentum


def capacity(n: int, max_ratio: float) -> int:
  """Payload slots for a leaf of n entries: ``ceil(1.3 * max_ratio * n)``, at most n."""
  return _args.count(min(1.0, CAPACITY_FACTOR * max_ratio), n)


@dataclasses.dataclass(frozen=True)
class DGCExchange(Exchange):
  """Sampled threshold, adjusted to ``0.7-1.3 k``, fixed-capacity sparse payload, all-gather."""

  schedule: Schedule
  max_ratio: float
  sample_ratio: float

  def encode(self, x, key, ratio):
    n = x.shape[0]
    cap = capacity(n, self.max_ratio)
    a = jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)
    thr = sampled_threshold(a, key_int(key, 0, n), ratio, self.max_ratio, self.sample_ratio)
    k = jnp.maximum(target(ratio, n), 1.0)
    thr = refine_threshold(a, thr, k, low=0.7, high=1.3, up=1.3, down=0.7, iterations=10)
    idx, count = select(passes(a, thr), cap, key_int(key, 1, n))
    values = jnp.where(jnp.arange(cap) < count, x[idx], 0.0)
    return values, idx.astype(_args.index_dtype(n)), count

  def ratio(self, count):
    return jnp.clip(jnp.asarray(self.schedule(count), jnp.float32), 0.0, self.max_ratio)

  def __call__(self, X, extra, ctx: Ctx):
    group, n = X.shape
    ratio = self.ratio(ctx.count)
    keys = jax.random.split(jax.random.fold_in(ctx.key, ctx.axis.index), group)
    payload = jax.vmap(lambda x, k: self.encode(x, k, ratio))(X, keys)
    local = jax.vmap(lambda p: sparse_decode(*p, n))(payload)
    if ctx.axis.name is None:
      return local, local, extra
    gathered = ops.allgather(payload, ctx.axis)
    gathered = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), gathered)
    mean = jax.vmap(lambda p: sparse_mean(*p, n, ctx.axis.size))(gathered)
    return mean, local, extra

  def wire_bytes(self, view, group):
    (n,) = view
    return group * sparse_bytes(n, capacity(n, self.max_ratio))


def dgc(ratio: float | Schedule = 0.001, axis_name: AxisName = None, momentum: float = 0.9,
        sample_ratio: float = 0.01, warmup_steps: int = 0, max_ratio: float | None = None,
        clip_norm: float | None = None, seed: int = 0):
  """Deep Gradient Compression: momentum correction, factor masking, sampled-threshold top-k.

  Per worker and leaf: (optionally) the local gradient is clipped to global
  norm ``clip_norm / sqrt(N)``; the momentum is corrected,
  ``u <- momentum * u + g`` and ``v <- v + u``; v is sparsified: the
  threshold is the ``ceil(ratio * s)``-th largest ``|v|`` of a strided sample
  of ``s = max(ceil(sample_ratio * n), 128)`` entries (a leaf of at most 128
  entries is its own sample, so its selection is an exact top-k), then scaled
  x1.3 / x0.7 up to 10 times until the count is within 0.7-1.3 of
  ``k = max(1, ceil(ratio * n))`` (if it never is, the threshold whose count
  was closest to k is used). The selected entries are sent and zeroed in both
  v and u (momentum factor masking); everything else stays. The output is the
  mean of what the workers sent: it already contains the momentum, so follow
  it with plain SGD (``optax.sgd(lr)`` without momentum). Thresholds come
  from the finite entries of v; a non-finite entry is reset to 0 in u and v
  (and the builder turns that step's output into NaN, see ``core.build``).

  The payload is static: ``cap = ceil(1.3 * max_ratio * n)`` float32 values
  and narrow indices plus an int32 count, all-gathered. Entries past ``cap``
  (only when the adjustments do not bring the count under 1.3 k; those sent
  are the first in circular order from a random offset) stay in v and u. During a warm-up, the capacity holds the densest
  stage, so the payload is that large for the whole run; to shrink it after
  the warm-up, build a second ``dgc`` without warm-up: the state (``u``, ``v``)
  carries over unchanged.

  Args:
    ratio: density sent, in (0, 1] (DGC: 0.001; GRACE's code defaults to 0.3),
      or a schedule ``step -> ratio`` (e.g. an optax schedule; then
      ``max_ratio`` is required and the schedule is clipped to it).
    axis_name: the data-parallel axis, or None.
    momentum: the momentum m of the correction, in [0, 1) (DGC trains with
      0.9; GRACE's DgcMemory default is 0.3).
    sample_ratio: sample size as a fraction of n, in (0, 1] (DGC: 0.001-0.01;
      GRACE: 0.01).
    warmup_steps: with a float ratio, DGC's exponential warm-up of sparsity
      (75%, 93.75%, 98.4375%, 99.6%, then ``1 - ratio``) over this many steps
      (:func:`warmup_schedule`); 0 (default) disables it.
    max_ratio: the largest ratio a schedule produces, in (0, 1]; sizes the
      payload. Only with a schedule.
    clip_norm: local gradient clipping threshold (> 0) before the scaling by
      ``N ** -0.5``; None (default) disables clipping.
    seed: seeds the key (sample offsets).

  References:
    Lin, Han, Mao, Wang & Dally, *Deep Gradient Compression: Reducing the
    Communication Bandwidth for Distributed Training*, ICLR 2018, Sec. 3
    and Algorithm 1 (momentum correction, local clipping, momentum factor
    masking, warm-up training).
  """
  m = _args.unit_interval("momentum", momentum)
  sr = _args.ratio("sample_ratio", sample_ratio)
  w = _args.integer("warmup_steps", warmup_steps, 0, 2 ** 31 - 1)  # the step count is int32
  clip = None if clip_norm is None else _args.positive("clip_norm", clip_norm)
  if callable(ratio):
    if max_ratio is None:
      raise ValueError("max_ratio is required when ratio is a schedule: it sizes the payload"
                       " (the largest ratio the schedule returns), in (0, 1]")
    if w:
      raise ValueError(f"warmup_steps applies to a float ratio only; got warmup_steps={warmup_steps!r}"
                       " with a schedule (build the warm-up into the schedule)")
    schedule, top = ratio, _args.ratio("max_ratio", max_ratio)
  else:
    r = _args.ratio("ratio", ratio)
    if max_ratio is not None:
      raise ValueError(f"max_ratio is only used with a schedule ratio; got max_ratio={max_ratio!r}"
                       f" with ratio={r!r}")
    if w:
      schedule, top = warmup_schedule(r, w), max(r, WARMUP_START)
    else:
      schedule, top = (lambda step: jnp.float32(r)), r
  exchange = DGCExchange(schedule, top, sr)
  return build(Method("dgc", flat_route(exchange), DGCMemory(m, clip, axis_name)), axis_name, seed)
