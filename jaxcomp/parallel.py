"""A data-parallel training step without shard_map plumbing: :func:`data_parallel`.

From a loss function, an optax chain holding a jaxcomp transform and a mesh,
it builds the per-worker optimizer state and the jitted step: the batch is
split over the data axes (every worker takes its rows), the parameters are
replicated, the state is per worker (error feedback differs between
workers), the buffers are donated. It works on a one-axis mesh
(``axis_name="data"``) and on a two-axis one (``axis_name="dcn",
dense_axis_name="ici"``), in one process or in several (the mesh then spans
every process's devices; each process passes the rows of its own devices).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.sharding import local, stacked


class DataParallel(NamedTuple):
  """``init(params) -> (params, opt_state)``; ``step(params, opt_state, batch) -> (params, opt_state, loss)``.

  ``params`` come back replicated over the mesh, ``opt_state`` with one
  block per worker; ``batch`` is a pytree of arrays whose leading axis is
  split over the data axes (in several processes: this process's rows,
  ``jax.process_count()`` times fewer); ``loss`` is the mean over workers.
  """

  init: Callable[[Any], tuple]
  step: Callable[[Any, Any, Any], tuple]
  axes: tuple


def data_parallel(loss_fn: Callable[..., jax.Array], tx: optax.GradientTransformation, mesh: Mesh,
                  axes: Sequence[str] | str | None = None, donate: bool = True) -> DataParallel:
  """The per-worker state and the jitted step of data-parallel training with ``tx``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` on one worker's rows.
    tx: an optax chain holding a jaxcomp transform whose ``axis_name`` (and
      ``dense_axis_name``) are axes of ``mesh``.
    mesh: a ``jax.sharding.Mesh`` (its axis types Auto).
    axes: the data axes (default: every axis of ``mesh``); the batch is
      split over them, in this order.
    donate: donate the parameters and the state to the step.

  Returns:
    A :class:`DataParallel` of ``init`` and ``step`` (both jitted).

  Example::

    mesh = jax.make_mesh((2, 4), ("dcn", "ici"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tx = optax.chain(jaxcomp.topk(0.01, axis_name="dcn", dense_axis_name="ici"), optax.sgd(0.1))
    dp = jaxcomp.data_parallel(loss_fn, tx, mesh)
    params, state = dp.init(params)
    params, state, loss = dp.step(params, state, batch)
  """
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got mesh={mesh!r}")
  if axes is None:
    axes = tuple(mesh.axis_names)
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  unknown = [a for a in axes if a not in mesh.axis_names]
  if not axes or unknown:
    raise ValueError(f"axes must name axes of the mesh {tuple(mesh.axis_names)}, got axes={axes!r}")
  spec = P(axes)

  def init_local(params):
    return stacked(tx.init(params))

  init_state = jax.jit(jax.shard_map(init_local, mesh=mesh, in_specs=P(), out_specs=spec))

  def step_local(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, local(opt_state), params)
    # The update is bit-identical on every worker (jaxcomp's guarantee), which JAX cannot
    # prove for a per-worker state: hence check_vma=False below.
    return optax.apply_updates(params, updates), stacked(opt_state), lax.pmean(loss, axes)

  step = jax.jit(jax.shard_map(step_local, mesh=mesh, in_specs=(P(), spec, spec), out_specs=(P(), spec, P()),
                               check_vma=False), donate_argnums=(0, 1) if donate else ())
  replicated = NamedSharding(mesh, P())
  rows = NamedSharding(mesh, spec)

  def init(params):
    # From host copies: the step donates its parameters, and the caller's arrays must survive it.
    params = jax.device_put(jax.tree.map(np.asarray, params), replicated)
    return params, init_state(params)

  def run(params, opt_state, batch):
    if jax.process_count() > 1:  # this process's rows -> one global batch
      batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(rows, x), batch)
    return step(params, opt_state, batch)

  return DataParallel(init, run, axes)
