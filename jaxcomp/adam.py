"""1-bit Adam: exact Adam while the variance warms up, then a compressed momentum with the variance frozen.

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
import optax

from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import CompressionTransformation, compressed_optimizer, configure
from jaxcomp.transforms import _args


class ScaleByOneBitAdamState(NamedTuple):
  """``count``: finite steps so far (int32, for the bias corrections); ``mu``, ``nu``: float32 moments;
  ``exchange``: the state of the jaxcomp transformation that averages the momentum."""

  count: jax.Array
  mu: Any
  nu: Any
  exchange: Any


def scale_by_onebit_adam(exchange: CompressionTransformation, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8, freeze_step: int = 100) -> optax.GradientTransformation:
  """Adam's scaling with the momentum averaged by ``exchange`` and the variance frozen from ``freeze_step``.

  Args:
    exchange: a jaxcomp transformation with ``start_step=freeze_step`` (dense
      before: exact Adam), e.g. ``configure(onebit(axis_name=...), start_step=100)``.
    b1, b2, eps: Adam's.
    freeze_step: the step from which ``nu`` is frozen (the exchange's warm-up is
      decided by its own step count, so the two agree).

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
    t = state.count + 1
    bc1 = 1.0 - b1 ** t.astype(jnp.float32)
    bc2 = 1.0 - b2 ** jnp.minimum(t, freeze_step).astype(jnp.float32)
    out = jax.tree.map(lambda m, v, g: ((m / bc1) / (jnp.sqrt(v / bc2) + eps)).astype(g.dtype), mu, nu, updates)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(m)) for m in jax.tree.leaves(mu)] or [jnp.array(True)]))
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    new_state = ScaleByOneBitAdamState(jnp.where(finite, t, state.count), keep(mu, state.mu),
                                       keep(nu, state.nu), ex_state)
    return out, new_state

  return optax.GradientTransformation(init, update)


def onebit_adam(learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, freeze_step: int = 100, axis_name: AxisName = None,
                codec: str = "onebit", exchange: str = "scatter", seed: int = 0, **codec_kwargs):
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
    **codec_kwargs: settings of ``codec``'s factory.

  Returns:
    An optax ``GradientTransformation`` (``.compressor``: the jaxcomp
    transformation that moves the momentum, for :func:`jaxcomp.wire_bytes`).

  References:
    Tang et al., *1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed*, ICML 2021, Algorithm 1; DeepSpeed's
    ``OnebitAdam``.
  """
  from jaxcomp import METHODS  # the registry imports the factories

  codec = _args.choice("codec", codec, tuple(m for m in METHODS if m != "none"))
  b1 = _args.unit_interval("b1", b1)
  b2 = _args.unit_interval("b2", b2)
  eps = _args.positive("eps", eps)
  weight_decay = _args.positive("weight_decay", weight_decay, allow_zero=True)
  freeze_step = _args.integer("freeze_step", freeze_step, 0, 2 ** 31 - 1)
  if not callable(learning_rate):
    _args.positive("learning_rate", learning_rate)
  factory = METHODS[codec]
  if "seed" in inspect.signature(factory).parameters:
    codec_kwargs["seed"] = seed
  compressor = factory(axis_name=axis_name, exchange=exchange, **codec_kwargs)
  compressor = configure(compressor, start_step=freeze_step)
  decay = [optax.add_decayed_weights(weight_decay)] if weight_decay else []  # it needs params
  tx = optax.chain(scale_by_onebit_adam(compressor, b1, b2, eps, freeze_step), *decay,
                   optax.scale_by_learning_rate(learning_rate))
  return compressed_optimizer(tx, compressor)
