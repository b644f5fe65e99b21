"""The two collectives every communicator is built from, over a resolved :class:`Axis`.

``allreduce_sum`` sums payloads that add linearly (psum); ``allgather``
stacks every worker's payload on a new leading axis. Under ``jax.shard_map``
with ``check_vma=True`` a plain ``all_gather`` result is "varying", so a mean
computed from it could not be returned with ``out_specs=P()``; the gather
here is the invariant one when this JAX has it, so the decoded mean is typed
as what it is: the same on every worker.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
from jax import lax

from jaxcomp.collectives import packing
from jaxcomp.collectives.axis import Axis
from jaxcomp.core.compat import gather_invariant as _gather_invariant

_PLAIN_GATHER = contextvars.ContextVar("jaxcomp_plain_gather", default=False)


@contextlib.contextmanager
def plain_gather() -> Iterator[None]:
  """Within the block, :func:`allgather` and :func:`allgather_tiled` trace the plain ``lax.all_gather``.

  For measurements that run an exchange under ``jax.vmap`` with a named axis
  (``python -m jaxcomp.bench network`` times the decoding of gathered payloads
  that way): the invariant all-gather has no vmap rule. Value-wise the two
  gathers agree; only the typing under ``shard_map(check_vma=True)`` differs,
  so a step traced here may not return the decoded mean with
  ``out_specs=P()``. It is a trace-time setting: what matters is where a
  function is traced (compiled), not where it is called. Outside the block
  (the library's normal use) nothing changes.
  """
  token = _PLAIN_GATHER.set(True)
  try:
    yield
  finally:
    _PLAIN_GATHER.reset(token)


def _invariant_gather():
  """The invariant all-gather, or None where this JAX lacks it or inside :func:`plain_gather`."""
  return None if _PLAIN_GATHER.get() else _gather_invariant


def allreduce_sum(tree: Any, axis: Axis) -> Any:
  """Sum over the axis; identity when ``axis.name is None``."""
  if axis.name is None:
    return tree
  return lax.psum(tree, axis.name)


def allgather(tree: Any, axis: Axis) -> Any:
  """Every worker's leaves stacked on a new leading axis of size ``axis.size``."""
  if axis.name is None:
    return jax.tree.map(lambda x: x[None], tree)
  gather = _invariant_gather()
  if gather is not None:
    return gather(tree, axis.name)
  return lax.all_gather(tree, axis.name)


def allgather_payload(payload: Any, axis: Axis) -> packing.Gathered:
  """Every worker's payload: its arrays packed into one byte buffer (:func:`packing.to_bytes`), one
  all-gather, read back one worker at a time through :class:`packing.Gathered`."""
  return packing.Gathered(allgather(packing.to_bytes(payload), axis), payload)


def allgather_tiled(x: jax.Array, axis: Axis) -> jax.Array:
  """Every worker's ``x`` concatenated on axis 0 (typed invariant where this JAX can)."""
  if axis.name is None:
    return x
  gather = _invariant_gather()
  if gather is not None:
    return gather(x, axis.name, axis=0, tiled=True)
  return lax.all_gather(x, axis.name, axis=0, tiled=True)


def varying(tree: Any, axis: Axis) -> Any:
  """``tree`` typed as varying over the axis (under ``shard_map`` with ``check_vma``; a no-op value-wise).

  The branches of a ``lax.switch`` must agree on it: a dense warm-up's psum is
  invariant where a compressed exchange's mean may be varying.
  """
  if axis.name is None:
    return tree
  names = axis.name if isinstance(axis.name, tuple) else (axis.name,)
  return jax.tree.map(lambda x: _varying_over(x, names), tree)


def _varying_over(x, names):
  """``x`` typed as varying over ``names`` too (a no-op where this JAX types no varying axes)."""
  have = _varying_axes(x)
  if have is None:  # no varying-axes typing here (pmap, or an older JAX)
    return x
  missing = tuple(n for n in names if n not in have)
  if not missing:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, missing, to="varying")
  return lax.pvary(x, missing)  # pragma: no cover - JAX before pcast


def _varying_axes(x):
  """The axes ``x`` varies over (``vma`` before JAX 0.10, ``manual_axis_type.varying`` since), or None."""
  if not hasattr(jax, "typeof"):  # pragma: no cover - JAX before typeof
    return None
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):
    return aval.manual_axis_type.varying
  return getattr(aval, "vma", None)


def alltoall(tree: Any, axis: Axis) -> Any:
  """Row ``j`` of every leaf (leading axis ``axis.size``) to worker ``j``.

  Row ``w`` of the result came from worker ``w``.
  """
  if axis.name is None:
    return tree
  return jax.tree.map(lambda x: lax.all_to_all(x, axis.name, 0, 0), tree)


def like_vma(x: jax.Array, like: jax.Array) -> jax.Array:
  """``x`` typed as varying over the axes ``like`` varies over (a loop carry that starts as zeros).

  Under ``shard_map`` a ``fori_loop`` whose body adds values received from an
  all-to-all (varying) to a carry made by ``jnp.zeros`` (invariant) fails to
  type; value-wise a no-op.
  """
  want = _varying_axes(like)
  return _varying_over(x, tuple(want)) if want else x
