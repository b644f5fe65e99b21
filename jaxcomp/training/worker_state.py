"""Per-worker optimizer state for pmap and shard_map.

A compression state is per worker (each worker's residual differs). Under
``jax.pmap`` the state carries a leading axis of size N; under
``jax.shard_map`` the same stacked state travels sharded over the data axis
(``P(axis_name)``), and inside the step each worker sees a block of size 1 on
that axis: :func:`local` drops it, :func:`stacked` restores it.
"""

from __future__ import annotations

import functools
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def per_worker(state: Any, workers: Union[int, Mesh], axis_name: Any = None) -> Any:
  """Stacks ``state`` once per worker on a new leading axis.

  Each array is repeated from the host (a read-only numpy view: no N copies are
  written on one device) and placed slice by slice. With N and ``axis_name``
  (the step's ``jax.pmap(..., axis_name=...)``) the arrays come back placed as
  that pmap's outputs are, so that the step compiles once: ``jax.pmap``
  compiles a step again for inputs placed otherwise, and from its second call
  on it takes its own outputs. With N alone they come back as those host
  views (the step then compiles for them, and again for its outputs). Leaves
  that are not concrete arrays (tracers, Python scalars, typed PRNG keys) are
  broadcast by ``jnp.broadcast_to``.

  Args:
    state: any pytree (``tx.init(params)``, or params).
    workers: N (for ``jax.pmap``) or a ``Mesh`` (for ``jax.shard_map``).
    axis_name: with a mesh, the mesh axis (or tuple of axes) of the data-parallel
      workers; the result is sharded over it. With N, the axis name of the
      ``jax.pmap`` that takes the result (optional).
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
    return jax.tree.map(lambda x: jax.device_put(_repeat(x, n), sharding), state)
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError(f"workers must be a positive int or a Mesh, got workers={workers!r}")
  stacked = jax.tree.map(lambda x: _repeat(x, workers), state)
  leaves = jax.tree.leaves(stacked)
  if axis_name is None or not leaves or any(isinstance(x, jax.core.Tracer) for x in leaves):
    return stacked
  if workers > jax.local_device_count():
    raise ValueError(f"workers={workers} is more than the {jax.local_device_count()} local devices jax.pmap"
                     " maps over")
  sharding = _pmap_output_sharding(axis_name, workers)
  return jax.tree.map(lambda x: jax.device_put(x, sharding), stacked)


def _concrete(x) -> bool:
  return isinstance(x, np.ndarray) or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))


def _repeat(x, n: int):
  """``x`` repeated ``n`` times on a new leading axis: a numpy view where ``x`` is a concrete array."""
  if not _concrete(x) or jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jnp.broadcast_to(x, (n,) + jnp.shape(x))
  x = np.asarray(x)
  return np.broadcast_to(x, (n,) + x.shape)


@functools.lru_cache(maxsize=None)
def _pmap_output_sharding(axis_name, n: int):
  """Where ``jax.pmap(axis_name=axis_name)`` over ``n`` devices places its outputs (read from the identity
  on one float per device)."""
  return jax.pmap(lambda x: x, axis_name=axis_name)(np.zeros((n,), np.float32)).sharding


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
