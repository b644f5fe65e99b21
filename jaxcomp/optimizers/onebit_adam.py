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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp.collectives.axis import AxisName
from jaxcomp.core.compression import CompressionTransformation, compressed_optimizer
from jaxcomp.core.rebuild import configure
from jaxcomp.optimizers.common import adam_args, codec_compressor, frozen_denominator
from jaxcomp.transforms import _args


class ScaleByOneBitAdamState(NamedTuple):
  """``count``: finite steps so far (int32, for the bias corrections); ``mu``, ``nu``: float32 moments;
  ``exchange``: the state of the jaxcomp transformation that averages the momentum."""

  count: jax.Array
  mu: Any
  nu: Any
  exchange: Any


def scale_by_onebit_adam(compressor: CompressionTransformation, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8, freeze_step: int = 100,
                         local_momentum: bool = False,
                         var_floor: float = 0.0) -> optax.GradientTransformation:
  """Adam's scaling with the momentum averaged by ``compressor`` and the variance frozen from ``freeze_step``.

  Args:
    compressor: a jaxcomp transformation with ``start_step=freeze_step`` (dense
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
    var_floor: after the freeze, each entry's variance is at least this
      fraction of its leaf's mean variance (:func:`frozen_denominator`). An
      entry that never saw a gradient (a dead ReLU's weights) has a frozen
      variance near 0, while a 1-bit or random codec hands it a momentum of
      its leaf's scale: without a floor its step is that scale over ``eps``.
      A fraction of the leaf's own mean keeps the update scale-equivariant.

  A non-finite step (the exchange then outputs NaN on every worker) keeps
  ``mu``, ``nu`` and ``count`` and outputs NaN, so ``optax.apply_if_finite``
  skips it on every replica.
  """
  if not isinstance(compressor, CompressionTransformation):
    raise TypeError(f"compressor must be a jaxcomp transformation, got compressor={compressor!r}")

  def init(params):
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    return ScaleByOneBitAdamState(jnp.zeros((), jnp.int32), zeros, zeros, compressor.init(zeros))

  def update(updates, state, params=None):
    del params
    local = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g.astype(jnp.float32), state.mu, updates)
    mu, ex_state = compressor.update(local, state.exchange)
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
    denominator = lambda v: jnp.where(warm, jnp.sqrt(v / bc2) + eps,  # noqa: E731
                                      frozen_denominator(v, bc2, eps, var_floor))
    out = jax.tree.map(lambda m, v, g: ((m / bc1) / denominator(v)).astype(g.dtype), mu, nu, updates)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(m)) for m in jax.tree.leaves(mu)] or [jnp.array(True)]))
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    new_state = ScaleByOneBitAdamState(jnp.where(finite, t, state.count), keep(kept, state.mu),
                                       keep(nu, state.nu), ex_state)
    return out, new_state

  return optax.GradientTransformation(init, update)


@_args.factory
def onebit_adam(learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, freeze_step: int = 100, *, axis_name: AxisName = None,
                codec: str = "onebit", transport: str = "scatter", seed: int = 0,
                local_momentum: bool = False, var_floor: float = 0.0, **codec_kwargs):
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
    transport: ``"scatter"`` (default: the paper's worker and server error
      compensation, bytes flat in N) or ``"gather"``.
    seed: the compressor's seed.
    local_momentum: each worker keeps its own momentum after the freeze
      (:func:`scale_by_onebit_adam`; for sparse codecs), instead of the
      compressed mean (the paper).
    var_floor: after the freeze, each entry's variance is at least this
      fraction of its leaf's mean variance (0: the paper; see
      :func:`scale_by_onebit_adam`).
    **codec_kwargs: settings of ``codec``'s factory.

  Returns:
    An optax ``GradientTransformation`` (``.compressor``: the jaxcomp
    transformation that moves the momentum, for :func:`jaxcomp.wire_bytes`).

  References:
    Tang et al., *1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed*, ICML 2021, Algorithm 1; DeepSpeed's
    ``OnebitAdam``.
  """
  b1, b2, eps, weight_decay = adam_args(learning_rate, b1, b2, eps, weight_decay)
  freeze_step = _args.integer("freeze_step", freeze_step, 0, 2 ** 31 - 1)
  compressor = codec_compressor(codec, axis_name, transport, seed, codec_kwargs)
  compressor = configure(compressor, start_step=freeze_step)
  decay = [optax.add_decayed_weights(weight_decay)] if weight_decay else []  # it needs params
  if not isinstance(local_momentum, bool):
    raise TypeError(f"local_momentum must be True or False, got local_momentum={local_momentum!r}")
  var_floor = _args.unit_interval("var_floor", var_floor, closed_right=True)
  tx = optax.chain(scale_by_onebit_adam(compressor, b1, b2, eps, freeze_step, local_momentum, var_floor),
                   *decay,
                   optax.scale_by_learning_rate(learning_rate))
  return compressed_optimizer(tx, compressor)
