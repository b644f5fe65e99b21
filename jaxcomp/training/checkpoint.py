"""Save and restore training state (params, optimizer state) with orbax.

The jaxcomp state is a pytree of arrays: per-worker residuals stacked on a
leading axis (``jax.pmap``) or sharded over the data axis (``jax.shard_map``),
uint32 PRNG keys, int32 counters and NamedTuples. :func:`save` writes any such
tree; :func:`restore` reads it back into the structure, dtypes and shardings
of a template (``like``), so a fresh process can continue bit for bit::

  ckpt = "/ckpt"
  step = jaxcomp.checkpoint.latest_step(ckpt)
  if step is not None:
    params, state = jaxcomp.checkpoint.restore(f"{ckpt}/{step}", (params, state))
  ...
  jaxcomp.checkpoint.save(f"{ckpt}/{step}", (params, state))

orbax writes into a temporary directory and renames it when complete, so a
process killed while saving leaves no partial checkpoint under ``path``
(:func:`latest_step` skips it). In a ``jax.distributed`` job every process
must call :func:`save` and :func:`restore`; keep per-worker state in global
``jax.Array``s (shard_map's ``per_worker(..., mesh, axis)``) so that each
process writes its own shards: numpy leaves are written once, by process 0,
and must be the same on every process. (Tested in one process under pmap
and shard_map, with ``data_parallel(param_specs=...)``'s sharded parameters
and per-device states, and in a 2-process job:
tests/test_sharded_multiprocess.py.)
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["latest_step", "restore", "save"]

FORMAT = 1


def _checkpointer():
  import orbax.checkpoint as ocp

  return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_pmap_sharded(x) -> bool:
  return isinstance(getattr(x, "sharding", None), getattr(jax.sharding, "PmapSharding", ()))


def _is_single_device(x) -> bool:
  return isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.SingleDeviceSharding)


def _to_saveable(x):
  if _is_key(x):
    x = jax.random.key_data(x)
  if isinstance(x, jax.Array) and not _is_pmap_sharded(x):
    return x
  return np.asarray(x)


def _describe(x) -> dict:
  return {"shape": list(np.shape(x)), "dtype": str(x.dtype) if hasattr(x, "dtype") else type(x).__name__}


def save(path: str, pytree: Any, overwrite: bool = False) -> None:
  """Writes ``pytree`` (arrays, numpy arrays, scalars) to the directory ``path``.

  Args:
    path: a directory that does not exist yet (unless ``overwrite``).
    pytree: e.g. ``(params, opt_state)``; per-worker (stacked or sharded)
      leaves are saved whole, typed PRNG keys as their uint32 data.
    overwrite: replace an existing checkpoint at ``path``.

  Raises:
    FileExistsError: ``path`` exists and ``overwrite`` is False.
  """
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"path={path!r} exists; pass overwrite=True to replace it")
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(pytree)
  data = [_to_saveable(x) for _, x in paths_leaves]
  meta = {
      "format": FORMAT,
      "treedef": str(treedef),
      "paths": [jax.tree_util.keystr(p) for p, _ in paths_leaves],
      "leaves": [_describe(x) for x in data],
  }
  # orbax refuses empty arrays (a method's (G, 0) state): their shape is in meta.
  leaves = {f"{i:05d}": x for i, x in enumerate(data) if np.size(x)}
  leaves["format"] = np.int32(FORMAT)
  ocp, ckptr = _checkpointer()
  ckptr.save(path, ocp.args.Composite(leaves=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)),
             force=overwrite)


def _read_plan(x):
  """(what orbax reads the leaf into, how the result is placed) for a template leaf ``x``."""
  data = jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x
  shape = tuple(np.shape(data))
  dtype = data.dtype if hasattr(data, "dtype") else np.asarray(data).dtype
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.Sharding) and not _is_pmap_sharded(x) and not isinstance(
      sharding, jax.sharding.SingleDeviceSharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), lambda y: y
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    dev = next(iter(sharding.device_set))
    # Uncommitted on the default device, like a fresh jnp array: pmap may place it.
    place = (lambda y: jnp.asarray(y)) if dev == jax.devices()[0] else (lambda y: jax.device_put(y, dev))
  elif sharding is not None:
    place = lambda y: jax.device_put(y, sharding)
  elif isinstance(x, jax.ShapeDtypeStruct):
    place = jnp.asarray
  else:
    place = lambda y: y
  return np.zeros(shape, dtype), place


def _empty(target):
  zeros = np.zeros(target.shape, target.dtype)
  sharding = getattr(target, "sharding", None)
  return zeros if sharding is None else jax.device_put(zeros, sharding)


def restore(path: str, like: Any) -> Any:
  """Reads the checkpoint at ``path`` into the structure of ``like``.

  Args:
    path: a directory written by :func:`save`.
    like: a pytree with the structure, shapes and dtypes of the saved one
      (e.g. ``(params, opt_state)`` freshly initialized, or
      ``jax.ShapeDtypeStruct`` leaves). Each leaf comes back like its
      template: a ``jax.Array`` with the template's sharding (pmap's stacked
      layout, a shard_map ``NamedSharding``), a numpy array for a numpy
      template, a typed PRNG key for a typed key.

  Raises:
    FileNotFoundError: nothing at ``path``.
    ValueError: the checkpoint's leaves differ from ``like``'s in number,
      shape or dtype (the message names the first differing leaf).
  """
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no checkpoint at path={path!r}")
  ocp, ckptr = _checkpointer()
  meta = ckptr.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  names = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
  if len(paths_leaves) != len(meta["leaves"]):
    raise ValueError(
        f"the checkpoint at {path!r} has {len(meta['leaves'])} leaves, like has {len(paths_leaves)}:"
        f" saved {meta['treedef']}, like is {treedef}")
  targets, places = {}, []
  for i, ((_, x), name, saved) in enumerate(zip(paths_leaves, names, meta["leaves"])):
    target, place = _read_plan(x)
    want = {"shape": list(target.shape), "dtype": str(target.dtype)}
    if want != saved:
      raise ValueError(
          f"leaf {name} of like is {want['dtype']}{tuple(want['shape'])}, the checkpoint holds"
          f" {saved['dtype']}{tuple(saved['shape'])} at {meta['paths'][i]}")
    if target.size:
      targets[f"{i:05d}"] = target
    places.append((place, target))
  targets["format"] = np.zeros((), np.int32)
  got = ckptr.restore(path, ocp.args.Composite(leaves=ocp.args.StandardRestore(targets)))["leaves"]
  out = []
  for i, ((_, x), (place, target)) in enumerate(zip(paths_leaves, places)):
    y = place(got[f"{i:05d}"] if target.size else _empty(target))
    if _is_key(x):
      y = jax.random.wrap_key_data(y, impl=jax.random.key_impl(x))
    out.append(y)
  return treedef.unflatten(out)


def latest_step(directory: str) -> int | None:
  """The largest integer name among the complete checkpoints in ``directory``, or None.

  Use with ``save(f"{directory}/{step}", ...)``: a save interrupted by a fault
  left only a temporary directory, which is not counted.
  """
  if not os.path.isdir(directory):
    return None
  steps = [int(d) for d in os.listdir(directory)
           if d.isdigit() and os.path.isfile(os.path.join(directory, d, "_CHECKPOINT_METADATA"))]
  return max(steps, default=None)
