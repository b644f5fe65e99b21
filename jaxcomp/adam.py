"""1-bit Adam and 0/1 Adam: Adam whose variance freezes, so that what travels can be 1 bit.

1-bit Adam: exact Adam while the variance warms up, then a compressed momentum with the variance frozen.

Tang et al. (ICML 2021) observe that Adam's variance ``v`` stabilises early
in training; once it is frozen, Adam's update ``m / (sqrt(v) + eps)`` is
linear in the momentum, so the momentum can be compressed with error
feedback like an SGD gradient. The momentum is exchanged instead of the
gradient: each worker forms its local momentum ``b1 * m + (1 - b1) * g_w``
from the shared ``m`` and its own gradient, and a jaxcomp transformation
averages it over the workers. Before ``freeze_step`` that exchange is the
dense mean (``jaxcomp.configure(..., start_step=freeze_step)``: one compiled
program holds both), which is exactly Adam on the averaged gradient; ``v`` is
updated from the mean gradient recovered from the new momentum. From
``freeze_step`` on ``v`` is frozen and the momentum travels compressed (1 bit
by default, any jaxcomp codec), with the scatter exchange's two error
feedbacks (the worker's, the chunk owner's) as the paper's worker and
server compensation.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import CompressionTransformation, compressed_optimizer, configure, wire_bytes
from jaxcomp.transforms import _args


class ScaleByOneBitAdamState(NamedTuple):
  """``count``: finite steps so far (int32, for the bias corrections); ``mu``, ``nu``: float32 moments;
  ``exchange``: the state of the jaxcomp transformation that averages the momentum."""

  count: jax.Array
  mu: Any
  nu: Any
  exchange: Any


def _adam_args(learning_rate, b1, b2, eps, weight_decay):
  """Adam's settings checked (errors name the argument)."""
  if not callable(learning_rate):
    _args.positive("learning_rate", learning_rate)
  return (_args.unit_interval("b1", b1), _args.unit_interval("b2", b2), _args.positive("eps", eps),
          _args.positive("weight_decay", weight_decay, allow_zero=True))


def _compressor(codec: str, axis_name, exchange: str, seed: int, codec_kwargs: dict):
  """The jaxcomp transformation ``codec`` over ``axis_name`` that moves an optimizer's payload."""
  from jaxcomp import METHODS  # the registry imports the factories

  codec = _args.choice("codec", codec, tuple(m for m in METHODS if m != "none"))
  factory = METHODS[codec]
  if "seed" in inspect.signature(factory).parameters:
    codec_kwargs = {**codec_kwargs, "seed": seed}
  return factory(axis_name=axis_name, exchange=exchange, **codec_kwargs)


def scale_by_onebit_adam(exchange: CompressionTransformation, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8, freeze_step: int = 100,
                         local_momentum: bool = False) -> optax.GradientTransformation:
  """Adam's scaling with the momentum averaged by ``exchange`` and the variance frozen from ``freeze_step``.

  Args:
    exchange: a jaxcomp transformation with ``start_step=freeze_step`` (dense
      before: exact Adam), e.g. ``configure(onebit(axis_name=...), start_step=100)``.
    b1, b2, eps: Adam's.
    freeze_step: the step from which ``nu`` is frozen (the exchange's warm-up is
      decided by its own step count, so the two agree).
    local_momentum: after the freeze, each worker keeps its own momentum
      ``b1 * m_w + (1 - b1) * g_w`` and the exchange's error feedback
      accumulates it (DGC's momentum correction), instead of every worker
      restarting from the compressed mean (1-bit Adam). A sparse codec then
      delivers the whole momentum, once and late; restarting from a sparse
      mean would drop the unsent part from the momentum and deliver it only
      through repeated selections. ``mu`` is then per worker.

  A non-finite step (the exchange then outputs NaN on every worker) keeps
  ``mu``, ``nu`` and ``count`` and outputs NaN, so ``optax.apply_if_finite``
  skips it on every replica.
  """
  if not hasattr(exchange, "method"):
    raise TypeError(f"exchange must be a jaxcomp transformation, got exchange={exchange!r}")

  def init(params):
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    return ScaleByOneBitAdamState(jnp.zeros((), jnp.int32), zeros, zeros, exchange.init(zeros))

  def update(updates, state, params=None):
    del params
    local = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g.astype(jnp.float32), state.mu, updates)
    mu, ex_state = exchange.update(local, state.exchange)
    warm = state.exchange.count < freeze_step  # the exchange was dense at this step
    mu = jax.tree.map(lambda m: m.astype(jnp.float32), mu)

    def nu_of(v, m_new, m_old):
      g = (m_new - b1 * m_old) / (1.0 - b1)  # the mean gradient (exact while the exchange is dense)
      return jnp.where(warm, b2 * v + (1.0 - b2) * g * g, v)

    nu = jax.tree.map(nu_of, state.nu, mu, state.mu)
    # What the next step builds on: the shared mean (always during the warm-up, when it is exact).
    kept = jax.tree.map(lambda m, l: jnp.where(warm, m, l), mu, local) if local_momentum else mu
    t = state.count + 1
    bc1 = 1.0 - b1 ** t.astype(jnp.float32)
    bc2 = 1.0 - b2 ** jnp.minimum(t, freeze_step).astype(jnp.float32)
    out = jax.tree.map(lambda m, v, g: ((m / bc1) / (jnp.sqrt(v / bc2) + eps)).astype(g.dtype), mu, nu, updates)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(m)) for m in jax.tree.leaves(mu)] or [jnp.array(True)]))
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    new_state = ScaleByOneBitAdamState(jnp.where(finite, t, state.count), keep(kept, state.mu),
                                       keep(nu, state.nu), ex_state)
    return out, new_state

  return optax.GradientTransformation(init, update)


def onebit_adam(learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, freeze_step: int = 100, axis_name: AxisName = None,
                codec: str = "onebit", exchange: str = "scatter", seed: int = 0,
                local_momentum: bool = False, **codec_kwargs):
  """1-bit Adam: a complete optax optimizer that owns its exchange.

  Exact Adam (on the dense mean gradient) for ``freeze_step`` steps, then the
  variance is frozen and the momentum is exchanged through ``codec`` with
  error feedback (module docstring). Weight decay is decoupled (AdamW's).

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps: Adam's (the paper's 0.9, 0.999, 1e-8).
    weight_decay: decoupled weight decay (0: Adam).
    freeze_step: steps of exact Adam before the variance is frozen (the paper
      warms up for 15-25% of training; DeepSpeed's ``freeze_step``).
    axis_name: the data-parallel axis.
    codec: the jaxcomp method that compresses the momentum (``"onebit"``:
      1 bit per entry and a scale per leaf, as the paper).
    exchange: ``"scatter"`` (default: the paper's worker and server error
      compensation, bytes flat in N) or ``"gather"``.
    seed: the compressor's seed.
    local_momentum: each worker keeps its own momentum after the freeze
      (:func:`scale_by_onebit_adam`; for sparse codecs), instead of the
      compressed mean (the paper).
    **codec_kwargs: settings of ``codec``'s factory.

  Returns:
    An optax ``GradientTransformation`` (``.compressor``: the jaxcomp
    transformation that moves the momentum, for :func:`jaxcomp.wire_bytes`).

  References:
    Tang et al., *1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed*, ICML 2021, Algorithm 1; DeepSpeed's
    ``OnebitAdam``.
  """
  b1, b2, eps, weight_decay = _adam_args(learning_rate, b1, b2, eps, weight_decay)
  freeze_step = _args.integer("freeze_step", freeze_step, 0, 2 ** 31 - 1)
  compressor = _compressor(codec, axis_name, exchange, seed, codec_kwargs)
  compressor = configure(compressor, start_step=freeze_step)
  decay = [optax.add_decayed_weights(weight_decay)] if weight_decay else []  # it needs params
  if not isinstance(local_momentum, bool):
    raise TypeError(f"local_momentum must be True or False, got local_momentum={local_momentum!r}")
  tx = optax.chain(scale_by_onebit_adam(compressor, b1, b2, eps, freeze_step, local_momentum), *decay,
                   optax.scale_by_learning_rate(learning_rate))
  return compressed_optimizer(tx, compressor)


# ----------------------------------------------------------------------------
# 0/1 Adam


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


def zero_one_adam(learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                  local_step_scaler: int = 32678, local_step_clipper: int = 16, axis_name: AxisName = None,
                  codec: str = "onebit", exchange: str = "scatter", seed: int = 0, **codec_kwargs):
  """0/1 Adam: adaptive variance freezing and skipped rounds, a complete optax optimizer.

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
    axis_name, codec, exchange, seed, **codec_kwargs: the 1-bit exchange, as
      :func:`onebit_adam`.

  Returns:
    An optax ``GradientTransformation`` with ``.compressor``.

  References:
    Lu, Li, Zhang, Tang & He, *Maximizing Communication Efficiency for
    Large-scale Training via 0/1 Adam*, ICLR 2023, Algorithm 1; DeepSpeed's
    ``ZeroOneAdam``.
  """
  from jaxcomp.collectives import ops
  from jaxcomp.collectives.axis import current_axis

  b1, b2, eps, weight_decay = _adam_args(learning_rate, b1, b2, eps, weight_decay)
  var_freeze_step = _args.integer("var_freeze_step", var_freeze_step, 0, 2 ** 31 - 1)
  var_update_scaler = _args.integer("var_update_scaler", var_update_scaler, 1)
  local_step_scaler = _args.integer("local_step_scaler", local_step_scaler, 1)
  local_step_clipper = _args.integer("local_step_clipper", local_step_clipper, 1)
  compressor = _compressor(codec, axis_name, exchange, seed, codec_kwargs)
  i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731

  def init(params):
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    anchor = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    return ZeroOneAdamState(i32(0), zeros, zeros, i32(0), i32(1), i32(0), i32(1), i32(0),
                            jnp.zeros((), jnp.float32), anchor, compressor.init(zeros))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("zero_one_adam needs the parameters: call tx.update(grads, state, params)")
    axis = current_axis(axis_name)
    lr = jnp.asarray(learning_rate(state.count) if callable(learning_rate) else learning_rate, jnp.float32)
    g = jax.tree.map(lambda x: x.astype(jnp.float32), grads)
    p = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    step = state.count + 1
    frozen = state.count >= var_freeze_step
    var_step = ~frozen & (step % state.var_interval == 0)
    sync = frozen & (step % state.local_interval == 0)
    branch = jnp.where(frozen, jnp.where(sync, 3, 2), jnp.where(var_step, 0, 1))
    ex0 = state.exchange
    restart = state.count == var_freeze_step  # the exchange's error feedback restarts at the freeze
    ex0 = ex0._replace(memory=jax.tree.map(lambda a: jnp.where(restart, 0, a), ex0.memory),
                       extra=jax.tree.map(lambda a: jnp.where(restart, 0, a), ex0.extra))
    var_updates = state.var_updates + var_step.astype(jnp.int32)
    bc2 = 1.0 - b2 ** jnp.maximum(var_updates, 1).astype(jnp.float32)
    bc1 = jnp.where(frozen, 1.0, 1.0 - b1 ** step.astype(jnp.float32))
    anchor0 = jax.tree.map(lambda a, x: jnp.where(restart, x, a), state.anchor, p)

    def adam_step(mu, nu):
      decay = (lambda x: weight_decay * x) if weight_decay else (lambda x: 0.0)  # noqa: E731
      return jax.tree.map(lambda m, v, x: -lr * ((m / bc1) / (jnp.sqrt(v / bc2) + eps) + decay(x)), mu, nu, p)

    def averaged(mean, ex, nu_of):  # phase A: the mean gradient reached every worker
      mu = jax.tree.map(lambda m, x: b1 * m + (1.0 - b1) * x, state.mu, mean)
      nu = jax.tree.map(nu_of, state.nu, mean)
      return mu, nu, adam_step(mu, nu), state.anchor, state.lrs, ex

    def dense(ex):
      mean = jax.tree.map(lambda x: x / axis.size, ops.allreduce_sum(g, axis))
      return averaged(mean, ex, lambda v, x: b2 * v + (1.0 - b2) * x * x)

    def compressed(ex):
      mean, ex = compressor.update(g, ex)
      return averaged(mean, ex, lambda v, x: v)

    def local(ex):
      mu = jax.tree.map(lambda m, x: b1 * m + (1.0 - b1) * x, state.mu, g)
      return mu, state.nu, adam_step(mu, state.nu), anchor0, state.lrs + lr, ex

    def local_sync(ex):
      mu, nu, delta, anchor, lrs, _ = local(ex)
      scale = jax.tree.map(lambda v: jnp.sqrt(v / bc2) + eps, nu)
      moved = jax.tree.map(lambda x, d, a, s: (x + d - a) * s, p, delta, anchor, scale)  # -lr * sum(m)
      mean, ex = compressor.update(moved, ex)
      target = jax.tree.map(lambda a, u, s: a + u / s, anchor, mean, scale)
      mu = jax.tree.map(lambda u: -u / lrs, mean)
      delta = jax.tree.map(lambda t, x: t - x, target, p)
      return mu, nu, delta, target, jnp.zeros((), jnp.float32), ex

    branches = [lambda ex, f=f: ops.varying(f(ex), axis) for f in (dense, compressed, local, local_sync)]
    mu, nu, delta, anchor, lrs, ex = lax.switch(branch, branches, ex0)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(d)) for d in jax.tree.leaves(delta)]
                               or [jnp.array(True)]))
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    var_counter = jnp.where(var_step, state.var_counter + 1, state.var_counter)
    double = var_counter == var_update_scaler
    local_counter = jnp.where(frozen, state.local_counter + 1, state.local_counter)
    grow = local_counter == local_step_scaler
    new_state = ZeroOneAdamState(
        count=optax.safe_int32_increment(state.count), mu=keep(mu, state.mu), nu=keep(nu, state.nu),
        var_updates=jnp.where(finite, var_updates, state.var_updates),
        var_interval=jnp.where(double, state.var_interval * 2, state.var_interval),
        var_counter=jnp.where(double, 0, var_counter),
        local_interval=jnp.where(grow, jnp.minimum(state.local_interval * 2, local_step_clipper),
                                 state.local_interval),
        local_counter=jnp.where(grow, 0, local_counter),
        lrs=jnp.where(finite, lrs, state.lrs), anchor=keep(anchor, anchor0), exchange=ex)
    out = jax.tree.map(lambda d, x: jnp.where(finite, d, jnp.nan).astype(x.dtype), delta, grads)
    return out, new_state

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
