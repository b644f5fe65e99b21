"""Two building blocks for a training step the user keeps: :func:`per_slice` and :func:`on_shards`.

A MaxText- or Levanter-style step is one ``jax.jit`` over a mesh whose fast
axes ("fsdp", "tensor", ...) GSPMD shards the model over, and whose slow axis
("dcn": slices, hosts, data centres) is where compression pays. The two
blocks put jaxcomp on the slow axis alone and leave the rest to GSPMD::

    grad_fn = jaxcomp.per_slice(jax.value_and_grad(loss_fn), mesh, "dcn")
    tx = jaxcomp.on_shards(optax.chain(jaxcomp.topk(axis_name="dcn"), optax.sgd(0.1)),
                           mesh, param_specs, "dcn")

    @jax.jit
    def train_step(params, opt_state, batch):
      loss, grads = grad_fn(params, batch)             # one gradient per slice, GSPMD inside
      updates, opt_state = tx.update(grads, opt_state, params)  # compressed mean over "dcn"
      return optax.apply_updates(params, updates), opt_state, loss.mean()

- :func:`per_slice` runs ``fn`` once per slice of the slow axis
  (``jax.vmap`` with ``spmd_axis_name``, as drjax does): inside, GSPMD splits
  the compute over every other axis (tensor parallelism stays real, activation
  constraints naming "data" or "tensor" hold), and nothing crosses the slow
  axis; every output gains a leading slice axis sharded over it (the gradients
  are not reduced over it).
- :func:`on_shards` runs an optax chain holding a jaxcomp transform over the
  slow axis on each device's shards (``shard_map``, manual over every axis):
  each device compresses its own shard of its slice's gradient, so the slow
  axis carries the payload of the device's shards and the state is the size
  of those shards.

Neither gathers a parameter: a weight sharded over "tensor" stays sharded in
the loss (GSPMD's choice) and in the update (the device's shard).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcomp.core import policy
from jaxcomp.core.checks import unbox
from jaxcomp.core.compat import use_mesh
from jaxcomp.core.compression import compressor
from jaxcomp.training import sharded
from jaxcomp.training.diloco import DiLoCoState
from jaxcomp.training.worker_state import local, stacked

AxisArg = Union[str, Sequence[str]]


def _slow_axes(mesh: Mesh, axis_name: AxisArg, what: str) -> tuple:
  if not isinstance(mesh, Mesh):
    raise TypeError(f"{what}: mesh must be a jax.sharding.Mesh, got mesh={mesh!r}")
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name or ())
  unknown = [a for a in names if a not in mesh.axis_names]
  if not names or unknown:
    raise ValueError(f"{what}: axis_name must name axes of the mesh {tuple(mesh.axis_names)},"
                     f" got axis_name={axis_name!r}")
  return names


def _slices(mesh: Mesh, names: tuple) -> int:
  n = 1
  for a in names:
    n *= mesh.shape[a]
  return n


def per_slice(fn: Callable, mesh: Mesh, axis_name: AxisArg, batch_argnums: Union[int, Sequence[int]] = 1,
              replica_argnums: Union[int, Sequence[int]] = ()) -> Callable:
  """``fn`` run once per slice of the slow axis ``axis_name``, GSPMD over every other mesh axis.

  Args:
    fn: e.g. ``jax.value_and_grad(loss_fn)`` (``has_aux`` too): its arguments
      are the parameters (as the user's GSPMD shardings place them) and a
      batch; it sees one slice's rows.
    mesh: the ``jax.sharding.Mesh`` (axis types Auto) the step runs on.
    axis_name: the slow mesh axis (or a tuple of them).
    batch_argnums: the positional arguments that are batches: each leaf's
      leading axis holds every slice's rows, slice by slice (the layout of a
      batch sharded over ``(axis_name, ...)``); the others are passed whole to
      every slice.
    replica_argnums: the positional arguments that hold one entry per slice on a leading axis (the
      parameters of replicas that differ between syncs, :func:`jaxcomp.diloco`): slice ``i`` gets
      entry ``i``.

  Returns:
    A function with ``fn``'s arguments whose every output has a leading axis
    of one entry per slice, sharded over ``axis_name``: the gradients of each
    slice's rows, not reduced over the slow axis. Call it inside ``jax.jit``.
  """
  names = _slow_axes(mesh, axis_name, "per_slice")
  given = ((batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums),
           (replica_argnums,) if isinstance(replica_argnums, int) else tuple(replica_argnums))
  n = _slices(mesh, names)
  spmd = names[0] if len(names) == 1 else names

  def run(*args):
    for what, nums in zip(("batch_argnums", "replica_argnums"), given):
      for i in nums:
        if not -len(args) <= i < len(args):
          raise ValueError(f"per_slice: {what} names argument {i}, but fn got {len(args)} arguments")
    argnums, replicas = (tuple(i % len(args) for i in nums) for nums in given)
    if set(argnums) & set(replicas):
      raise ValueError(f"per_slice: an argument cannot be both a batch and a replica: batch_argnums="
                       f"{batch_argnums!r}, replica_argnums={replica_argnums!r}")
    split = list(args)
    for i in argnums:
      split[i] = jax.tree_util.tree_map_with_path(lambda path, x, i=i: _split_rows(x, n, i, path), args[i])
    for i in replicas:
      for path, x in jax.tree_util.tree_flatten_with_path(args[i])[0]:
        if not getattr(x, "ndim", 0) or x.shape[0] != n:
          raise ValueError(f"per_slice: replica argument {i} leaf {jax.tree_util.keystr(path)} has shape"
                           f" {getattr(x, 'shape', ())}; it needs a leading axis of {n}, one entry per slice")
    in_axes = tuple(0 if i in argnums + replicas else None for i in range(len(args)))
    with use_mesh(mesh):
      return jax.vmap(fn, in_axes=in_axes, spmd_axis_name=spmd)(*split)

  return run


def _split_rows(x, n: int, i: int, path) -> jax.Array:
  rows = x.shape[0] if getattr(x, "ndim", 0) else None
  if rows is None or rows % n:
    raise ValueError(f"per_slice: batch argument {i} leaf {jax.tree_util.keystr(path)} has shape"
                     f" {getattr(x, 'shape', ())}; its leading axis (rows) must divide into {n} slices")
  return x.reshape((n, rows // n) + tuple(x.shape[1:]))


def on_shards(tx: optax.GradientTransformation, mesh: Mesh, param_specs: Any, axis_name: AxisArg
              ) -> optax.GradientTransformation:
  """``tx`` run on each device's shards, its jaxcomp transform averaging them over ``axis_name``.

  Args:
    tx: an optax transformation holding one jaxcomp transform built with
      ``axis_name`` (the slow axis; no ``dense_axis_name``). The rest of the
      chain runs on shards: elementwise transformations (sgd, momentum, adam,
      weight decay) are exact; one that reads the whole gradient
      (``clip_by_global_norm``) would see a shard, so apply it before.
    mesh: the mesh of :func:`per_slice`.
    param_specs: a pytree like the parameters of ``PartitionSpec`` (or
      ``NamedSharding``, or None for replicated), naming fast axes only;
      ``nnx.get_partition_spec``'s output as it is.
    axis_name: the slow axis, as given to :func:`per_slice`.

  Returns:
    An ``optax.GradientTransformation``. ``init(params)`` (jit-able) gives
    the state with one block per device (a leading axis over every mesh axis:
    error feedback differs between devices). ``update(grads, state, params)``
    takes the per-slice gradients of :func:`per_slice` (a leading slice axis)
    and returns updates laid out as the parameters, the same on every slice.

    With :func:`jaxcomp.diloco` in ``tx`` (replicas differ between syncs),
    ``update`` takes the parameters with a leading axis of one replica per
    slice (``per_slice``'s ``replica_argnums``) and returns one update each.
  """
  names = _slow_axes(mesh, axis_name, "on_shards")
  every = P(tuple(mesh.axis_names))
  n = _slices(mesh, names)
  slow = names[0] if len(names) == 1 else names

  specs_for = lambda params: _specs(param_specs, mesh, names, params)  # noqa: E731

  def init(params):
    params = unbox(params)  # nnx.Optimizer hands init the model's Variables
    specs = specs_for(params)
    _check_compressor(tx, mesh, names, specs, params)
    whole = _whole_sizes(params)

    def init_device(p):
      with policy.whole_leaves(whole):
        return stacked(tx.init(p))

    return jax.shard_map(init_device, mesh=mesh, in_specs=(specs,), out_specs=every, check_vma=False)(params)

  def update(grads, state, params=None):
    boxed = jax.tree.structure(grads)  # updates come back in the gradients' structure (Variables too)
    updates, state = _update(unbox(grads), state, unbox(params))
    return jax.tree.unflatten(boxed, jax.tree.leaves(updates)), state

  def _update(grads, state, params):
    specs, replicas = _layout(tx, mesh, grads, params, specs_for, slow, n)
    per_slice_specs = jax.tree.map(lambda s: P(slow, *s), specs, is_leaf=lambda s: isinstance(s, P))

    whole = _whole_sizes(grads, leading=1)

    def one_device(g, s, p):
      with policy.whole_leaves(whole):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), local(s),
                         jax.tree.map(lambda x: x[0], p) if replicas else p)
      return (jax.tree.map(lambda x: x[None], u) if replicas else u), stacked(s)

    # Replicas: one update per replica, laid out as the per-slice gradients. Otherwise the updates are
    # bit-identical on every slice (jaxcomp's mean), which JAX cannot prove of a per-device state:
    # hence check_vma=False.
    laid = per_slice_specs if replicas else specs
    args, in_specs = (grads, state), (per_slice_specs, every)
    if params is not None:
      args, in_specs = args + (params,), in_specs + (laid,)
    fn = one_device if params is not None else (lambda g, s: one_device(g, s, None))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(laid, every), check_vma=False)(*args)

  return optax.GradientTransformation(init, update)


def has_local_steps(tx: optax.GradientTransformation, mesh: Mesh, specs: Any, params: Any) -> bool:
  """Whether ``tx``'s state holds a :class:`jaxcomp.DiLoCoState`: replicas that differ between syncs.

  Read from the state's structure (``jax.eval_shape`` of ``tx.init`` inside the mesh), so an optimizer
  wrapped in any optax wrapper is found.
  """
  every = P(tuple(mesh.axis_names))
  shapes = jax.eval_shape(jax.shard_map(lambda p: stacked(tx.init(p)), mesh=mesh, in_specs=(specs,),
                                        out_specs=every), params)
  is_diloco = lambda x: isinstance(x, DiLoCoState)  # noqa: E731
  return any(is_diloco(x) for x in jax.tree.leaves(shapes, is_leaf=is_diloco))


def _specs(param_specs, mesh: Mesh, names: tuple, params):
  """``param_specs`` checked against ``params`` (None: every leaf replicated within its slice)."""
  given = unbox(param_specs)
  if given is None:
    given = jax.tree.map(lambda _: P(), params)
  specs = sharded.normalize(given, mesh, names)
  if jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, P)) != jax.tree.structure(params):
    raise ValueError("on_shards: param_specs must be a tree like the parameters (a PartitionSpec,"
                     f" NamedSharding or None per leaf); got {jax.tree.structure(param_specs)} for"
                     f" parameters {jax.tree.structure(params)}")
  return specs


def _layout(tx, mesh: Mesh, grads, params, specs_for: Callable, slow, n: int) -> tuple:
  """``(specs, replicas)`` of an ``on_shards`` update: one replica's specs, and whether ``tx`` keeps a
  replica per slice (DiLoCo), checked against the gradients' and parameters' layouts."""
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    if not getattr(g, "ndim", 0) or g.shape[0] != n:
      raise ValueError(
          f"on_shards: gradient leaf {jax.tree_util.keystr(path)} has shape {getattr(g, 'shape', ())};"
          f" update takes per-slice gradients with a leading axis of {n} (one per slice of"
          f" {slow!r}), as jaxcomp.per_slice returns them")
  stacked_params = params is not None and _leading(grads, params)
  # one replica's shapes (structure and shapes only: nothing is sliced)
  one = _shapes(grads if params is None or stacked_params else params,
                1 if params is None or stacked_params else 0)
  specs = specs_for(one)
  replicas = has_local_steps(tx, mesh, specs, one)
  if replicas and not stacked_params:
    raise ValueError("on_shards: tx keeps replicas that differ between syncs (jaxcomp.diloco): pass"
                     " update the parameters with a leading axis of one replica per slice of"
                     f" {slow!r}, laid out as the gradients (jaxcomp.per_slice(...,"
                     " replica_argnums=0) takes them so)")
  if stacked_params and not replicas:
    raise ValueError("on_shards: the parameters have a leading slice axis, but tx keeps one model"
                     " (no jaxcomp.diloco in it): pass the parameters as the param_specs lay them out")
  return specs, replicas


def _leading(grads, params) -> bool:
  """Whether ``params`` carry the gradients' leading slice axis (replicas) rather than one model."""
  return all(np.shape(p) == np.shape(g) for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads)))


def _shapes(tree, leading: int = 0):
  """Shape structs of ``tree``'s leaves past ``leading`` axes."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[leading:], x.dtype), tree)


def _whole_sizes(tree, leading: int = 0) -> dict:
  """keystr(path) -> entries of each whole leaf (past ``leading`` slice axes): what the leaf policy
  judges on shards, so a method compresses the same leaves sharded as replicated."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    n = 1
    for d in tuple(x.shape)[leading:]:
      n *= int(d)
    out[jax.tree_util.keystr(path)] = n
  return out


def _check_compressor(tx, mesh: Mesh, names: tuple, specs, params) -> None:
  """The jaxcomp transform of ``tx`` averages over the slow axis alone."""
  local_shapes = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(sharded.shard_shape(x.shape, s, mesh), x.dtype), params, specs,
      is_leaf=lambda s: isinstance(s, P))
  inner = compressor(tx, local_shapes)
  got = inner.axis_name if isinstance(inner.axis_name, tuple) else (inner.axis_name,)
  if tuple(got) != names or inner.dense_axis_name is not None:
    want = names[0] if len(names) == 1 else names
    raise ValueError(
        f"on_shards: tx's jaxcomp transform has axis_name={inner.axis_name!r},"
        f" dense_axis_name={inner.dense_axis_name!r}; build it with axis_name={want!r}"
        " (the slow axis) alone: the fast axes are summed by GSPMD inside per_slice")
