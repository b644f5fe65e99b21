"""Per-worker optimizer state for pmap and shard_map.

A compression state is per worker (each worker's residual differs). Under
``jax.pmap`` the state carries a leading axis of size N; under
``jax.shard_map`` the same stacked state travels sharded over the data axis
(``P(axis_name)``), and inside the step each worker sees a block of size 1 on
that axis: :func:`local` drops it, :func:`stacked` restores it.
"""

from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def per_worker(state: Any, workers: Union[int, Mesh], axis_name: Any = None) -> Any:
  """Stacks ``state`` once per worker on a new leading axis.

  Args:
    state: any pytree (``tx.init(params)``, or params).
    workers: N (for ``jax.pmap``) or a ``Mesh`` (for ``jax.shard_map``).
    axis_name: with a mesh, the mesh axis (or tuple of axes) of the data-parallel
      workers; the result is sharded over it.
  """
  if isinstance(workers, Mesh):
    if axis_name is None:
      raise ValueError("axis_name is required with a mesh: the data-parallel mesh axis")
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for a in names:
      if a not in workers.shape:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(workers.shape)}")
    n = 1
    for a in names:
      n *= workers.shape[a]
    sharding = NamedSharding(workers, P(axis_name))
    return jax.tree.map(
        lambda x: jax.device_put(jnp.broadcast_to(x, (n,) + jnp.shape(x)), sharding), state)
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError(f"workers must be a positive int or a Mesh, got workers={workers!r}")
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (workers,) + jnp.shape(x)), state)


def local(state: Any) -> Any:
  """Inside ``shard_map``: drops the size-1 worker axis of a per-worker block.

  Raises:
    ValueError: a leaf has no leading axis of size 1, e.g. a state that is not
      per worker (made without :func:`per_worker`, or passed with
      ``in_specs=P()``): the message says how to make it.
  """
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    shape = tuple(np.shape(x))
    if shape[:1] == (1,):
      continue
    where = f"jaxcomp.local got leaf {jax.tree_util.keystr(path)} of shape {shape}"
    if not shape:
      raise ValueError(
          "the state is not per worker: make it with jaxcomp.per_worker(tx.init(params), mesh, axis) and"
          f" pass it to shard_map with in_specs P(axis) ({where}, with no worker axis to drop;"
          " gradients too are stacked per worker and passed with P(axis))")
    raise ValueError(
        f"{where}, not a worker's block with a leading axis of size 1: make the state with"
        " jaxcomp.per_worker(tx.init(params), mesh, axis) and pass it to shard_map with in_specs"
        " P(axis), which splits its worker axis over the workers")
  return jax.tree.map(lambda x: x[0], state)


def stacked(state: Any) -> Any:
  """Inside ``shard_map``: adds the worker axis back before returning the state."""
  return jax.tree.map(lambda x: x[None], state)
