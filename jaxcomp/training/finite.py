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
trace time (:func:`check_guarded`).
"""

from __future__ import annotations

import os
import sys
import threading

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp.collectives.axis import AxisName, check_axis_name, current_axis
from jaxcomp.collectives.axis import axis_names as _names
from jaxcomp.transforms import _args


@_args.factory
def apply_if_finite(inner: optax.GradientTransformation, max_consecutive_errors: int,
                    *, axis_name: AxisName) -> optax.GradientTransformationExtraArgs:
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
    axis_name: the axis (or tuple of axes) the decision is agreed over:
      every axis the jaxcomp transforms inside communicate over (their
      ``axis_name``, and ``dense_axis_name`` on a two-level mesh, e.g.
      ``("dcn", "ici")``); a transform inside that communicates over an axis
      not named here is an error at trace time. None: this worker alone
      (optax's behaviour), for an ``inner`` that does not communicate.

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
      _AGREED.stack.append(set(_names(axis_name)))
      try:
        return inner.update(updates, state.inner_state, params, **extra_args)
      finally:
        _AGREED.stack.pop()

    def reject(_):
      return jax.tree.map(jnp.zeros_like, updates), state.inner_state

    try:
      new_updates, inner_state = lax.cond(ok | (count > limit), accept, reject, None)
    except TypeError as e:
      if "branches must have equal output types" not in str(e):
        raise
      raise TypeError(
          "jaxcomp.apply_if_finite under jax.shard_map with check_vma=True: the skipped step's zero"
          " updates are typed varying over the mesh axes, the exchanged mean invariant. Use"
          " check_vma=False (the per-worker state needs it anyway; jaxcomp makes the update"
          " bit-identical on every worker, tested)") from e
    return new_updates, optax.ApplyIfFiniteState(
        notfinite_count=count, last_finite=ok,
        total_notfinite=jnp.where(ok, state.total_notfinite,
                                  optax.safe_int32_increment(state.total_notfinite)),
        inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _Agreed(threading.local):
  """Per thread: the axes each enclosing :func:`apply_if_finite` agreed its skip decision over."""

  def __init__(self):
    self.stack: list = []


_AGREED = _Agreed()


_OPTAX_FILE = os.path.join("optax", "transforms", "_conditionality.py")


def _under_optax_apply_if_finite(frame) -> bool:
  """True if a caller is optax.apply_if_finite's update (a closure over ``max_consecutive_errors``).

  Not ``do_update`` alone: optax's ``conditionally_mask`` and
  ``conditionally_transform`` have branch functions of that name too, but
  decide on the step count, the same on every worker.
  """
  while frame is not None:
    code = frame.f_code
    if code.co_filename.endswith(_OPTAX_FILE) and "max_consecutive_errors" in code.co_freevars:
      return True
    frame = frame.f_back
  return False


def check_guarded(axis_name: AxisName, dense_axis_name: AxisName = None) -> None:
  """Raises at trace time where a skip decided per worker would leave other workers in a collective.

  Called by every jaxcomp transform's ``update`` that communicates: under
  ``optax.apply_if_finite`` (which decides per worker), or under a
  :func:`apply_if_finite` that agreed over fewer axes than the transform
  communicates over (a two-level mesh guarded over the slow axis alone).
  """
  names = set(_names(axis_name)) | set(_names(dense_axis_name))
  if not names:
    return
  if _under_optax_apply_if_finite(sys._getframe(1)):
    raise ValueError(
        f"optax.apply_if_finite wraps a jaxcomp transform that communicates over"
        f" axis_name={axis_name!r}: optax decides on each worker alone, so a NaN on one worker"
        " skips the collective there while the other workers wait for it (a hang). Use"
        " jaxcomp.apply_if_finite(inner, max_consecutive_errors,"
        f" axis_name={tuple(sorted(names, key=str))!r}),"
        " which agrees on the skip across the axes, or put optax.apply_if_finite after the jaxcomp"
        " transform, around the optimizer: optax.chain(jaxcomp.topk(...),"
        " optax.apply_if_finite(optax.sgd(...), 5)).")
  for agreed in _AGREED.stack:
    if not names <= agreed:
      raise ValueError(
          f"jaxcomp.apply_if_finite agreed on the skip over {sorted(agreed, key=str)!r}, but a jaxcomp"
          f" transform inside it communicates over {sorted(names, key=str)!r}: a worker that skips"
          " would leave the others waiting in that collective. Pass every axis the transforms use,"
          f" e.g. jaxcomp.apply_if_finite(inner, n, axis_name={tuple(sorted(names, key=str))!r}).")
