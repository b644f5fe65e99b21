"""The data-parallel axis a transform communicates over."""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AxisName = Union[Hashable, Sequence[Hashable], None]


class Axis(NamedTuple):
  """Where a transform runs: the bound axis name (or None), its size, our index."""

  name: AxisName
  size: int
  index: jax.Array  # int32 scalar, traced


def axis_names(axis_name: AxisName) -> tuple:
  """The names of ``axis_name`` as a tuple: ``()`` for None, one name, or the tuple itself."""
  if axis_name is None:
    return ()
  return tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)


def check_axis_name(axis_name: AxisName, arg: str = "axis_name") -> AxisName:
  """Validates ``axis_name`` at construction: None, a hashable, or a tuple of them
  (``arg``: its argument's name).
  """
  if axis_name is None:
    return None
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if any(isinstance(a, (int, np.integer)) for a in names):  # bool too
    raise TypeError(
        f"{arg} must be None, a name such as 'data', or a tuple of names, not an int"
        f" (JAX reads an int in a collective as a positional array axis); got {arg}={axis_name!r}")
  try:
    hash(axis_name)
  except TypeError as e:
    raise TypeError(
        f"{arg} must be None, a hashable mesh/pmap axis name, or a tuple of"
        f" them; got {arg}={axis_name!r}") from e
  return axis_name


def current_axis(axis_name: AxisName) -> Axis:
  """Resolves ``axis_name`` at trace time, with a clear error when it is unbound."""
  if axis_name is None:
    return Axis(None, 1, jnp.zeros((), jnp.int32))
  try:
    size = lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"axis_name={axis_name!r} is not bound here: call tx.update inside"
        f" jax.pmap(..., axis_name={axis_name!r}) or jax.shard_map over a mesh"
        " with that axis, or build the transform with axis_name=None for a"
        " local compress/decode round trip.") from e
  return Axis(axis_name, int(size), lax.axis_index(axis_name).astype(jnp.int32))
