"""A data-parallel training step without shard_map plumbing: :func:`data_parallel`.

From a loss function, an optax chain holding a jaxcomp transform and a mesh,
it builds the per-worker optimizer state and the jitted step: the batch is
split over the data axes (every worker takes its rows), the parameters are
replicated, the state is per worker (error feedback differs between
workers), the buffers are donated. It works on a one-axis mesh
(``axis_name="data"``) and on a two-axis one (``axis_name="dcn",
dense_axis_name="ici"``), in one process or in several (the mesh then spans
every process's devices; each process passes the rows of its own devices).

With ``param_specs`` the parameters stay sharded over the fast axes they name
(FSDP, tensor axes) and jaxcomp compresses over its slow ``axis_name`` only: the
step is the user-owned one of :mod:`jaxcomp.training.own_step` (the loss per slice under
GSPMD, so a "tensor" axis splits compute and activations; the chain on each
device's shards).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.collectives.axis import axis_names
from jaxcomp.core.compression import compressor
from jaxcomp.training import sharded
from jaxcomp.training.own_step import has_local_steps, on_shards, per_slice
from jaxcomp.training.worker_state import local, stacked


class DataParallel(NamedTuple):
  """``init(params) -> (params, opt_state)``; ``step(params, opt_state, batch) -> (params, opt_state, loss)``.

  ``params`` come back replicated over the mesh (with ``param_specs``:
  sharded as they say; with an optimizer whose replicas differ between
  syncs, :func:`jaxcomp.diloco`, one copy per worker of its slow axis: a
  leading axis over it), ``opt_state`` with one block per worker (with
  ``param_specs``: per device, each the state of the device's shards);
  ``batch`` is a pytree of arrays whose leading axis is split over the data
  axes (in several processes: this process's rows, ``jax.process_count()``
  times fewer); ``loss`` is the mean over workers.
  """

  init: Callable[[Any], tuple]
  step: Callable[[Any, Any, Any], tuple]
  axes: tuple
  lower: Callable[[Any, Any, Any], Any]
  """``lower(params, opt_state, batch)``: the step's ``jax.stages.Lowered`` (``.compile().as_text()``
  for its HLO, ``.compile().cost_analysis()`` for its FLOPs)."""


def data_parallel(loss_fn: Callable[..., jax.Array], tx: optax.GradientTransformation, mesh: Mesh,
                  axes: Sequence[str] | str | None = None, donate: bool = True,
                  param_specs: Any = None) -> DataParallel:
  """The per-worker state and the jitted step of data-parallel training with ``tx``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` on one worker's rows.
    tx: an optax chain holding a jaxcomp transform whose ``axis_name`` (and
      ``dense_axis_name``) are axes of ``mesh``.
    mesh: a ``jax.sharding.Mesh`` (its axis types Auto).
    axes: the data axes (default: every axis of ``mesh``); the batch is
      split over them, in this order.
    donate: donate the parameters and the state to the step.
    param_specs: a pytree like the parameters of ``PartitionSpec`` (or
      ``NamedSharding``; ``nnx.get_partition_spec``'s output as it is) naming
      mesh axes other than the compressed one: each device keeps its shard of
      the parameters, of the optimizer state and of jaxcomp's state, and the
      compressed exchange moves shards. The batch is still split over every
      axis of ``axes``, which must include the compressed axis; the loss runs
      once per slice of that axis on all of the slice's rows, under GSPMD
      (:func:`jaxcomp.per_slice`; a sharding constraint inside it may not name
      the compressed axis). None: parameters replicated.

  With :func:`jaxcomp.diloco` (or sparseloco) in ``tx`` the replicas differ
  between syncs: the parameters are kept per worker of the axis DiLoCo syncs
  over (a leading axis of that size, each replica sharded as ``param_specs``
  say), the other data axes are averaged densely every step, and the inner
  optimizer must not communicate itself.

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
  if param_specs is not None:
    return _sharded(loss_fn, tx, mesh, axes, donate, param_specs)
  return _replicated(loss_fn, tx, mesh, axes, donate)


def check_batch(batch: Any, mesh: Mesh, axes: tuple) -> None:
  """A clear error where the batch's rows do not split evenly over the data axes' workers."""
  workers = int(np.prod([mesh.shape[a] for a in axes]))
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    rows = (np.shape(x)[0] if len(np.shape(x)) else 0) * jax.process_count()
    if rows == 0 or rows % workers:
      raise ValueError(f"batch: the rows of every leaf must divide evenly over the {workers} workers of"
                       f" axes {axes} (their leading axis is split); batch{jax.tree_util.keystr(path)}"
                       f" has shape {np.shape(x)}" + (f" in each of {jax.process_count()} processes"
                                                     if jax.process_count() > 1 else ""))


def place_rows(batch: Any, rows: NamedSharding) -> Any:
  """The batch as the step takes it: its rows split over the data axes (``rows``). One process: placed
  from whatever the caller holds (host arrays, or arrays on any mesh, explicit axes included); several:
  each process's rows become one global batch."""
  if jax.process_count() > 1:
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(rows, x), batch)
  return jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jax.device_put(x, rows), batch)


def _replicated(loss_fn, tx, mesh: Mesh, axes: tuple, donate: bool) -> DataParallel:
  """:func:`data_parallel` with the parameters replicated (or, for DiLoCo, one copy per slow worker)."""
  spec = P(axes)

  init_state = jax.jit(jax.shard_map(lambda p: stacked(tx.init(p)), mesh=mesh, in_specs=P(), out_specs=spec))

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

  delegate: dict = {}

  def init(params):
    if has_local_steps(tx, mesh, jax.tree.map(lambda _: P(), params), params):
      # Replicas that differ between syncs: the sharded step with every parameter whole keeps one
      # copy per worker over the slow axis.
      delegate["dp"] = _sharded_replicas(loss_fn, tx, mesh, axes, donate, jax.tree.map(lambda _: P(), params))
      return delegate["dp"].init(params)
    # From host copies: the step donates its parameters, and the caller's arrays must survive it.
    params = jax.device_put(jax.tree.map(np.asarray, params), replicated)
    return params, init_state(params)

  def run(params, opt_state, batch):
    check_batch(batch, mesh, axes)
    if "dp" in delegate:
      return delegate["dp"].step(params, opt_state, batch)
    return step(params, opt_state, place_rows(batch, rows))

  def lower(params, opt_state, batch):
    check_batch(batch, mesh, axes)
    if "dp" in delegate:
      return delegate["dp"].lower(params, opt_state, batch)
    return step.lower(params, opt_state, place_rows(batch, rows))

  return DataParallel(init, run, axes, lower)


def _sharded(loss_fn, tx, mesh: Mesh, axes: tuple, donate: bool, param_specs) -> DataParallel:
  """:func:`data_parallel` with parameters sharded as ``param_specs`` say: the user-owned step's blocks.

  The loss and its gradient per slice of the compressed axis under GSPMD (:func:`jaxcomp.per_slice`:
  a "tensor" axis splits compute and activations, no weight is gathered), then ``tx`` on each
  device's shards (:func:`jaxcomp.on_shards`). Replicas that differ between syncs (DiLoCo) keep the
  shard_map step of :func:`_sharded_replicas`.
  """
  found: dict = {}

  def init(params):
    inner = compressor(tx, params)
    slow = axis_names(inner.axis_name)
    specs = sharded.normalize(param_specs, mesh, slow)
    if has_local_steps(tx, mesh, specs, params):
      found["dp"] = _sharded_replicas(loss_fn, tx, mesh, axes, donate, param_specs)
      return found["dp"].init(params)
    missing = [a for a in slow if a not in axes]
    if missing:
      raise ValueError(f"axes={axes!r} must include the axis the jaxcomp transform compresses over"
                       f" ({missing}): each of its slices computes the gradient of its own rows")
    # Rows slice by slice (the compressed axis first): per_slice's split moves no row.
    found["rows"] = NamedSharding(mesh, P(tuple(slow) + tuple(a for a in axes if a not in slow)))
    on = on_shards(tx, mesh, specs, slow)
    grad_fn = per_slice(jax.value_and_grad(loss_fn), mesh, slow)

    def step(params, opt_state, batch):
      loss, grads = grad_fn(params, batch)
      updates, opt_state = on.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, jnp.mean(loss)

    found["step"] = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    # From host copies (the step donates its parameters), each process placing its own shards; then
    # through a program whose out_specs are the step's, so they carry the shardings the step returns
    # (P("fsdp") for P("fsdp", None)), as a checkpoint restored into init's output does.
    params = jax.device_put(jax.tree.map(np.asarray, params), sharded.shardings(specs, mesh))
    params = jax.jit(jax.shard_map(lambda p: p, mesh=mesh, in_specs=(specs,), out_specs=specs),
                     donate_argnums=0)(params)
    return params, jax.jit(on.init)(params)

  def run(params, opt_state, batch):
    check_batch(batch, mesh, axes)
    if "dp" in found:
      return found["dp"].step(params, opt_state, batch)
    if "step" not in found:
      raise ValueError("call init(params) before step: init checks param_specs against the parameters")
    return found["step"](params, opt_state, place_rows(batch, found["rows"]))

  def lower(params, opt_state, batch):
    check_batch(batch, mesh, axes)
    if "dp" in found:
      return found["dp"].lower(params, opt_state, batch)
    if "step" not in found:
      raise ValueError("call init(params) before lower: init checks param_specs against the parameters")
    return found["step"].lower(params, opt_state, place_rows(batch, found["rows"]))

  return DataParallel(init, run, axes, lower)


def _sharded_replicas(loss_fn, tx, mesh: Mesh, axes: tuple, donate: bool, param_specs) -> DataParallel:
  """:func:`data_parallel` with parameters sharded as ``param_specs`` say, in one shard_map over every
  axis (see :mod:`jaxcomp.training.sharded`): the step of replicas that differ between syncs (DiLoCo)."""
  every = P(tuple(mesh.axis_names))  # the states: one block per device
  rows = P(axes)
  found: dict = {}

  def specs_for(params):
    """The checked specs, and the fast data axes (``axes`` but the compressed ones)."""
    inner = compressor(tx, params)
    slow = axis_names(inner.axis_name)
    if inner.dense_axis_name is not None:
      raise ValueError("param_specs: the jaxcomp transform has dense_axis_name="
                       f"{inner.dense_axis_name!r}; with param_specs the fast axes are averaged by the"
                       " sharded step itself: build the transform with axis_name (the slow axis) alone")
    found["specs"] = sharded.normalize(param_specs, mesh, slow)
    found["slow"] = slow
    found["fast"] = tuple(a for a in axes if a not in slow)
    return found["specs"]

  def step_local(params, opt_state, batch):
    specs, replicas = found["specs"], found["replicas"]
    params = local(params) if replicas else params
    loss, grads = jax.value_and_grad(loss_fn)(sharded.gather(params, specs), batch)
    grads = sharded.reduce_scatter_mean(grads, specs, found["fast"], mesh)
    updates, opt_state = tx.update(grads, local(opt_state), params)
    params = optax.apply_updates(params, updates)
    return (stacked(params) if replicas else params), stacked(opt_state), lax.pmean(loss, axes)

  compiled: dict = {}

  def init(params):
    specs = specs_for(params)
    # Replicas that differ between syncs (jaxcomp.diloco): one copy of the parameters per worker of
    # the slow axis, a leading axis over it, each sharded over the fast axes as its spec says.
    replicas = found["replicas"] = has_local_steps(tx, mesh, specs, params)
    out = jax.tree.map(lambda s: P(found["slow"], *s), specs, is_leaf=lambda x: isinstance(x, P)) \
        if replicas else specs
    # From host copies (the step donates its parameters), each process placing its own shards.
    params = jax.device_put(jax.tree.map(np.asarray, params), sharded.shardings(specs, mesh))
    # The parameters pass through init's program: they come back with the shardings the step returns
    # (its spec P("fsdp") for P("fsdp", None)), as a checkpoint restored into init's output does.
    init_local = lambda p: ((stacked(p) if replicas else p), stacked(tx.init(p)))  # noqa: E731
    init_state = jax.jit(jax.shard_map(init_local, mesh=mesh, in_specs=(specs,), out_specs=(out, every)),
                         donate_argnums=0)
    compiled["step"] = jax.jit(
        jax.shard_map(step_local, mesh=mesh, in_specs=(out, every, rows), out_specs=(out, every, P()),
                      check_vma=False), donate_argnums=(0, 1) if donate else ())
    return init_state(params)

  def run(params, opt_state, batch):
    if "step" not in compiled:
      raise ValueError("call init(params) before step: init checks param_specs against the parameters")
    return compiled["step"](params, opt_state, place_rows(batch, NamedSharding(mesh, rows)))

  def lower(params, opt_state, batch):
    if "step" not in compiled:
      raise ValueError("call init(params) before lower: init checks param_specs against the parameters")
    return compiled["step"].lower(params, opt_state, place_rows(batch, NamedSharding(mesh, rows)))

  return DataParallel(init, run, axes, lower)
