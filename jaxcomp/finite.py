"""Skipping non-finite steps together: ``jaxcomp.apply_if_finite``.

``optax.apply_if_finite(inner, n)`` tests each worker's own gradient and runs
``inner`` inside a ``lax.cond`` on that worker's answer. Around a chain that
holds a jaxcomp transform, a NaN on one worker sends that worker down the
skip branch while the others enter the exchange's collective and wait for it
forever (XLA:CPU aborts after 40 s, "only 7 of 8 arrived"; a GPU hangs).
:func:`apply_if_finite` agrees on the decision across the axis first (one
float32 all-reduce), so every worker takes the same branch.

Where optax's own wrapper may go: *after* the jaxcomp transform
(``optax.chain(jaxcomp.topk(...), optax.apply_if_finite(optax.sgd(...), 5))``):
a jaxcomp transform's output is NaN on every worker as soon as one worker's
input is not finite, so the inner decision is the same everywhere. Placed
around a jaxcomp transform that communicates, it raises a clear error at
trace time (:func:`check_not_under_optax_apply_if_finite`).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp.collectives.axis import AxisName, check_axis_name, current_axis
from jaxcomp.transforms import _args


def apply_if_finite(inner: optax.GradientTransformation, max_consecutive_errors: int,
                    axis_name: AxisName) -> optax.GradientTransformationExtraArgs:
  """``optax.apply_if_finite`` whose skip decision is agreed across ``axis_name``.

  A step is skipped on every worker when the gradient of any worker holds a
  NaN or Inf (the updates are zeros and ``inner``'s state is kept), and
  accepted on every worker after more than ``max_consecutive_errors``
  consecutive non-finite steps, as optax's wrapper does on one worker. The
  decision costs one float32 all-reduce over ``axis_name`` per step (4
  bytes), before any collective of ``inner``; a skipped step runs none of
  ``inner``'s collectives.

  Args:
    inner: the transformation to guard, typically the whole chain
      (``optax.chain(jaxcomp.topk(..., axis_name="data"), optax.sgd(0.1))``).
    max_consecutive_errors: consecutive non-finite steps skipped before a
      non-finite step is accepted (>= 0).
    axis_name: the data-parallel axis the decision is agreed over (the
      jaxcomp transforms' ``axis_name``); None: this worker alone (optax's
      behaviour).

  Returns:
    A transformation whose state is ``optax.ApplyIfFiniteState`` (the counts
    are the same on every worker).

  References:
    optax.apply_if_finite (the single-worker wrapper this extends).
  """
  axis_name = check_axis_name(axis_name)
  limit = _args.integer("max_consecutive_errors", max_consecutive_errors, 0)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return optax.ApplyIfFiniteState(
        notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True, jnp.bool_),
        total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    ok = jnp.ones((), jnp.bool_)
    for leaf in jax.tree.leaves(updates):
      ok = ok & jnp.all(jnp.isfinite(leaf))
    axis = current_axis(axis_name)
    if axis.name is not None:  # the number of workers with a non-finite gradient
      ok = lax.psum(jnp.where(ok, 0.0, 1.0).astype(jnp.float32), axis.name) == 0.0
    count = jnp.where(ok, jnp.zeros([], jnp.int32), optax.safe_int32_increment(state.notfinite_count))

    def accept(_):
      return inner.update(updates, state.inner_state, params, **extra_args)

    def reject(_):
      return jax.tree.map(jnp.zeros_like, updates), state.inner_state

    new_updates, inner_state = lax.cond(ok | (count > limit), accept, reject, None)
    return new_updates, optax.ApplyIfFiniteState(
        notfinite_count=count, last_finite=ok,
        total_notfinite=jnp.where(ok, state.total_notfinite, optax.safe_int32_increment(state.total_notfinite)),
        inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_OPTAX_GUARD = os.path.join("optax", "transforms", "_conditionality.py")


def check_not_under_optax_apply_if_finite(axis_name: AxisName) -> None:
  """Raises at trace time when ``optax.apply_if_finite`` wraps a transform that communicates.

  optax's wrapper decides per worker, so a non-finite gradient on one worker
  would skip the collective there while the others wait for it (a hang).
  Read from the Python stack of the trace: optax's branch function
  ``do_update`` is a caller of this transform's ``update``.
  """
  if axis_name is None:
    return
  frame = sys._getframe(1)
  while frame is not None:
    code = frame.f_code
    if code.co_name == "do_update" and code.co_filename.endswith(_OPTAX_GUARD):
      raise ValueError(
          f"optax.apply_if_finite wraps a jaxcomp transform that communicates over"
          f" axis_name={axis_name!r}: optax decides on each worker alone, so a NaN on one worker"
          " skips the collective there while the other workers wait for it (a hang). Use"
          f" jaxcomp.apply_if_finite(inner, max_consecutive_errors, axis_name={axis_name!r}), which"
          " agrees on the skip across the axis, or put optax.apply_if_finite after the jaxcomp"
          " transform, around the optimizer: optax.chain(jaxcomp.topk(...),"
          " optax.apply_if_finite(optax.sgd(...), 5)).")
    frame = frame.f_back
