"""0/1 Adam: adaptive variance freezing and skipped rounds; what travels is 1 bit, or nothing.

Until ``var_freeze_step`` the variance is updated only at steps that are
multiples of an interval which doubles every ``var_update_scaler``
updates; those steps average the gradient densely (exact Adam), the
others exchange it through the 1-bit ``codec`` (with its error feedback)
and leave ``nu`` frozen, so Adam's update stays linear in what was sent.
After ``var_freeze_step`` the workers take local Adam steps with their own
gradient and the frozen ``nu``, and synchronise every ``local_interval``
steps (doubling every ``local_step_scaler`` steps, at most
``local_step_clipper``): the displacement since the last sync, in
momentum units (times ``sqrt(nu) + eps``), goes through the 1-bit exchange
(its error feedback restarted at the freeze); every worker moves to
``anchor + mean / (sqrt(nu) + eps)`` and restarts its momentum from the
mean. Rounds in between send nothing.

Between syncs the replicas differ (each took its own local steps); every
sync brings them to the same ``anchor`` (kept in the state, so no drift
accumulates): exactly where ``target - params`` is exact in float32, and
within half an ulp of that move where a parameter crossed zero or moved
more than half its size (as :func:`jaxcomp.sbc` with ``delay > 1``). A
non-finite step outputs NaN and keeps the moments (during local steps on
that worker only); the schedules advance on every worker alike.

Each step is one of four phases (:func:`zero_one_rounds` lists them; one
compiled program holds all four, chosen by ``lax.switch``): "dense" (a
variance update on the dense mean gradient), "onebit" (the gradient in 1
bit, ``nu`` frozen), "local" (a local step, no communication) and "sync"
(a local step, then the displacement in 1 bit and the re-anchoring).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp.collectives import ops
from jaxcomp.collectives.axis import AxisName, current_axis
from jaxcomp.core.accounting import wire_bytes
from jaxcomp.core.compression import compressed_optimizer
from jaxcomp.optimizers.common import adam_args, codec_compressor, frozen_denominator
from jaxcomp.transforms import _args


class ZeroOneAdamState(NamedTuple):
  """State of :func:`zero_one_adam` (arrays only).

  ``count``: every step so far (int32; it drives the schedules, so all workers
  agree on what each step does); ``mu``, ``nu``: float32 moments;
  ``var_updates``: updates of ``nu`` so far (its bias correction);
  ``var_interval``, ``var_counter``: the variance schedule; ``local_interval``,
  ``local_counter``: the local-step schedule; ``lrs``: the learning rates
  summed since the last sync; ``anchor``: the parameters at the last sync
  (float32); ``exchange``: the state of the 1-bit exchange.
  """

  count: jax.Array
  mu: Any
  nu: Any
  var_updates: jax.Array
  var_interval: jax.Array
  var_counter: jax.Array
  local_interval: jax.Array
  local_counter: jax.Array
  lrs: jax.Array
  anchor: Any
  exchange: Any


class _Settings(NamedTuple):
  """:func:`zero_one_adam`'s settings, checked."""

  learning_rate: Any
  b1: float
  b2: float
  eps: float
  weight_decay: float
  var_freeze_step: int
  var_update_scaler: int
  local_step_scaler: int
  local_step_clipper: int
  axis_name: AxisName
  var_floor: float


@_args.factory
def zero_one_adam(learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999,
                  eps: float = 1e-8, weight_decay: float = 0.0, var_freeze_step: int = 100000,
                  var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                  *, axis_name: AxisName = None, codec: str = "onebit", transport: str = "scatter",
                  seed: int = 0, var_floor: float = 0.0,
                  **codec_kwargs):
  """0/1 Adam: adaptive variance freezing and skipped rounds, a complete optax optimizer.

  Variance updates on a doubling interval (dense rounds) with 1-bit rounds
  in between until ``var_freeze_step``, then local steps with 1-bit syncs on
  a doubling interval (:mod:`jaxcomp.optimizers.zero_one_adam`). ``.rounds(steps)``
  lists what each step does, ``.bytes_at(step, params)`` what it sends.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps: Adam's.
    weight_decay: decoupled weight decay (``update`` needs ``params``; it
      always does, for the anchor).
    var_freeze_step: the step from which the variance is frozen for good and
      local steps begin (DeepSpeed's default 100000).
    var_update_scaler: variance updates per interval before it doubles (16).
    local_step_scaler: steps before the local interval doubles (32678).
    local_step_clipper: the largest local interval (16).
    axis_name, codec, transport, seed, **codec_kwargs: the 1-bit exchange, as
      :func:`jaxcomp.onebit_adam`.
    var_floor: on every step that is not a dense variance update, each
      entry's variance is at least this fraction of its leaf's mean (0: the
      paper), as :func:`jaxcomp.onebit_adam`'s: a 1-bit momentum or
      gradient hands an entry that never saw a gradient its leaf's scale.

  Returns:
    An optax ``GradientTransformation`` with ``.compressor``.

  References:
    Lu, Li, Zhang, Tang & He, *Maximizing Communication Efficiency for
    Large-scale Training via 0/1 Adam*, ICLR 2023, Algorithm 1; DeepSpeed's
    ``ZeroOneAdam``.
  """
  b1, b2, eps, weight_decay = adam_args(learning_rate, b1, b2, eps, weight_decay)
  var_freeze_step = _args.integer("var_freeze_step", var_freeze_step, 0, 2 ** 31 - 1)
  var_update_scaler = _args.integer("var_update_scaler", var_update_scaler, 1)
  local_step_scaler = _args.integer("local_step_scaler", local_step_scaler, 1)
  local_step_clipper = _args.integer("local_step_clipper", local_step_clipper, 1)
  var_floor = _args.unit_interval("var_floor", var_floor, closed_right=True)
  compressor = codec_compressor(codec, axis_name, transport, seed, codec_kwargs)
  settings = _Settings(learning_rate, b1, b2, eps, weight_decay, var_freeze_step, var_update_scaler,
                       local_step_scaler, local_step_clipper, axis_name, var_floor)

  def init(params):
    return _init(compressor, params)

  def update(grads, state, params=None):
    return _update(settings, compressor, grads, state, params)

  opt = compressed_optimizer(optax.GradientTransformation(init, update), compressor)
  opt.rounds = lambda steps: zero_one_rounds(steps, var_freeze_step, var_update_scaler, local_step_scaler,
                                             local_step_clipper)

  def bytes_at(step, params, workers=None):
    kind = opt.rounds(step + 1)[step]
    if kind == "dense":
      return 4 * sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))
    return 0 if kind == "local" else wire_bytes(compressor, params, workers=workers)

  opt.bytes_at = bytes_at  # bytes one worker hands to collectives at ``step`` (0-based)
  return opt


def _i32(v):
  return jnp.asarray(v, jnp.int32)


def _init(compressor, params) -> ZeroOneAdamState:
  """The state before the first step: zero moments, both schedules at interval 1, ``params`` as anchor."""
  zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
  anchor = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
  return ZeroOneAdamState(_i32(0), zeros, zeros, _i32(0), _i32(1), _i32(0), _i32(1), _i32(0),
                          jnp.zeros((), jnp.float32), anchor, compressor.init(zeros))


def _update(s: _Settings, compressor, grads, state: ZeroOneAdamState, params):
  """One step: the phase the schedules pick (``lax.switch``), the schedules advanced, NaN if non-finite."""
  if params is None:
    raise ValueError("zero_one_adam needs the parameters: call tx.update(grads, state, params)")
  axis = current_axis(s.axis_name)
  lr = s.learning_rate(state.count) if callable(s.learning_rate) else s.learning_rate
  lr = jnp.asarray(lr, jnp.float32)
  g = jax.tree.map(lambda x: x.astype(jnp.float32), grads)
  p = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  step = state.count + 1
  frozen = state.count >= s.var_freeze_step
  var_step = ~frozen & (step % state.var_interval == 0)
  sync = frozen & (step % state.local_interval == 0)
  branch = jnp.where(frozen, jnp.where(sync, 3, 2), jnp.where(var_step, 0, 1))
  ex0 = state.exchange
  restart = state.count == s.var_freeze_step  # the exchange's error feedback restarts at the freeze
  ex0 = ex0._replace(memory=jax.tree.map(lambda a: jnp.where(restart, 0, a), ex0.memory),
                     extra=jax.tree.map(lambda a: jnp.where(restart, 0, a), ex0.extra))
  var_updates = state.var_updates + var_step.astype(jnp.int32)
  bc2 = 1.0 - s.b2 ** jnp.maximum(var_updates, 1).astype(jnp.float32)
  bc1 = jnp.where(frozen, 1.0, 1.0 - s.b1 ** step.astype(jnp.float32))
  anchor0 = jax.tree.map(lambda a, x: jnp.where(restart, x, a), state.anchor, p)
  branches = _phases(s, compressor, state, axis, lr, g, p, bc1, bc2, anchor0)
  mu, nu, delta, anchor, lrs, ex = lax.switch(branch, branches, ex0)
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(d)) for d in jax.tree.leaves(delta)]
                             or [jnp.array(True)]))
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
  var_counter = jnp.where(var_step, state.var_counter + 1, state.var_counter)
  double = var_counter == s.var_update_scaler
  local_counter = jnp.where(frozen, state.local_counter + 1, state.local_counter)
  grow = local_counter == s.local_step_scaler
  new_state = ZeroOneAdamState(
      count=optax.safe_int32_increment(state.count), mu=keep(mu, state.mu), nu=keep(nu, state.nu),
      var_updates=jnp.where(finite, var_updates, state.var_updates),
      var_interval=jnp.where(double, state.var_interval * 2, state.var_interval),
      var_counter=jnp.where(double, 0, var_counter),
      local_interval=jnp.where(grow, jnp.minimum(state.local_interval * 2, s.local_step_clipper),
                               state.local_interval),
      local_counter=jnp.where(grow, 0, local_counter),
      lrs=jnp.where(finite, lrs, state.lrs), anchor=keep(anchor, anchor0), exchange=ex)
  out = jax.tree.map(lambda d, x: jnp.where(finite, d, jnp.nan).astype(x.dtype), delta, grads)
  return out, new_state


def _phases(s: _Settings, compressor, state: ZeroOneAdamState, axis, lr, g, p, bc1, bc2, anchor0) -> list:
  """The four phases of a step, for ``lax.switch``: dense, 1-bit, local, local + sync.

  Each maps the exchange's state to ``(mu, nu, delta, anchor, lrs, exchange state)``
  (``delta``: the update to the parameters), varying over ``axis``.
  """
  b1, b2, eps, weight_decay = s.b1, s.b2, s.eps, s.weight_decay

  def adam_step(mu, nu, floor=s.var_floor):
    decay = (lambda x: weight_decay * x) if weight_decay else (lambda x: 0.0)  # noqa: E731
    return jax.tree.map(lambda m, v, x: -lr * ((m / bc1) / frozen_denominator(v, bc2, eps, floor) + decay(x)),
                        mu, nu, p)

  def averaged(mean, ex, nu_of, floor):  # phase A: the mean gradient reached every worker
    mu = jax.tree.map(lambda m, x: b1 * m + (1.0 - b1) * x, state.mu, mean)
    nu = jax.tree.map(nu_of, state.nu, mean)
    return mu, nu, adam_step(mu, nu, floor), state.anchor, state.lrs, ex

  def dense(ex):  # exact Adam: no floor
    mean = jax.tree.map(lambda x: x / axis.size, ops.allreduce_sum(g, axis))
    return averaged(mean, ex, lambda v, x: b2 * v + (1.0 - b2) * x * x, 0.0)

  def compressed(ex):
    mean, ex = compressor.update(g, ex)
    return averaged(mean, ex, lambda v, x: v, s.var_floor)

  def local(ex):
    mu = jax.tree.map(lambda m, x: b1 * m + (1.0 - b1) * x, state.mu, g)
    return mu, state.nu, adam_step(mu, state.nu), anchor0, state.lrs + lr, ex

  def local_sync(ex):
    mu, nu, delta, anchor, lrs, _ = local(ex)
    scale = jax.tree.map(lambda v: frozen_denominator(v, bc2, eps, s.var_floor), nu)
    moved = jax.tree.map(lambda x, d, a, s: (x + d - a) * s, p, delta, anchor, scale)  # -lr * sum(m)
    mean, ex = compressor.update(moved, ex)
    target = jax.tree.map(lambda a, u, s: a + u / s, anchor, mean, scale)
    mu = jax.tree.map(lambda u: -u / lrs, mean)
    delta = jax.tree.map(lambda t, x: t - x, target, p)
    return mu, nu, delta, target, jnp.zeros((), jnp.float32), ex

  return [lambda ex, f=f: ops.varying(f(ex), axis) for f in (dense, compressed, local, local_sync)]


def zero_one_rounds(steps: int, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
                    local_step_clipper: int) -> list:
  """What each of the first ``steps`` steps of :func:`zero_one_adam` does: "dense" (a variance update),
  "onebit" (the gradient in 1 bit), "local" (no communication) or "sync" (the displacement in 1 bit)."""
  out, var_interval, var_counter, local_interval, local_counter = [], 1, 0, 1, 0
  for count in range(steps):
    step = count + 1
    if count < var_freeze_step:
      var_step = step % var_interval == 0
      out.append("dense" if var_step else "onebit")
      if var_step:
        var_counter += 1
        if var_counter == var_update_scaler:
          var_counter, var_interval = 0, var_interval * 2
    else:
      out.append("sync" if step % local_interval == 0 else "local")
      local_counter += 1
      if local_counter == local_step_scaler:
        local_counter, local_interval = 0, min(local_interval * 2, local_step_clipper)
  return out
