"""Parameters sharded over fast mesh axes while jaxcomp compresses over the slow one.

With ``jaxcomp.data_parallel(..., param_specs=...)`` every device holds its
shard of each parameter (FSDP or tensor axes, as a ``PartitionSpec`` per
leaf says) and its rows of the batch (split over every data axis). A step,
inside one ``shard_map`` over every mesh axis:

1. :func:`gather`: each leaf all-gathered over the axes its spec names
   (dense, fast axes), so the loss sees whole parameters;
2. the loss and its gradient on the device's rows (compute split over every
   device, as plain data parallelism);
3. :func:`reduce_scatter_mean`: each gradient leaf summed over the fast data
   axes and scattered back to the device's shard (a reduce-scatter over the
   spec's axes, an all-reduce over the fast axes it does not name), divided
   by their size: the fast axes' mean of the shard (a spec axis that splits
   no batch held equal copies: divided by its size too);
4. the optax chain on shards: the jaxcomp transform averages the shard over
   its slow ``axis_name`` (compressed), the optimizer's state and jaxcomp's
   state are those of the shard (1/fsdp of a replicated run's per device).

Nothing dense crosses the slow axis but the loss's mean (one float32).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def _is_spec(x) -> bool:
  return x is None or isinstance(x, (P, NamedSharding))


def spec_axes(spec: P) -> tuple:
  """Every mesh axis ``spec`` names, in order."""
  out = []
  for entry in spec:
    if entry is None:
      continue
    out += list(entry) if isinstance(entry, tuple) else [entry]
  return tuple(out)


def normalize(param_specs: Any, mesh: Mesh, compressed: Sequence[str]) -> Any:
  """``param_specs`` as a tree of ``PartitionSpec`` (``NamedSharding``'s spec, ``None`` -> ``P()``), checked.

  Raises a ValueError naming ``param_specs`` when a spec names an axis that
  is not in ``mesh`` or one the jaxcomp transform compresses over.
  """
  def one(s):
    spec = P() if s is None else (s.spec if isinstance(s, NamedSharding) else s)
    unknown = [a for a in spec_axes(spec) if a not in mesh.axis_names]
    if unknown:
      raise ValueError(f"param_specs: {spec} names {unknown}, not axes of the mesh {tuple(mesh.axis_names)}")
    slow = [a for a in spec_axes(spec) if a in compressed]
    if slow:
      raise ValueError(
          f"param_specs: {spec} shards over {slow}, the axis the jaxcomp transform compresses over"
          f" (axis_name={tuple(compressed)}); shard parameters over the other (fast) axes only")
    return spec

  return jax.tree.map(one, param_specs, is_leaf=_is_spec)


def gather(params: Any, specs: Any) -> Any:
  """Each shard all-gathered over the axes its spec names: the whole parameter on every device."""
  def one(x, spec):
    for dim, entry in enumerate(spec):
      if entry is not None:
        x = lax.all_gather(x, entry, axis=dim, tiled=True)
    return x

  return jax.tree.map(one, params, specs)


def reduce_scatter_mean(grads: Any, specs: Any, fast: Sequence[str], mesh: Mesh) -> Any:
  """The mean over the ``fast`` data axes of each whole gradient, cut to the device's shard."""
  size = 1
  for a in fast:
    size *= mesh.shape[a]

  def one(g, spec):
    for dim, entry in enumerate(spec):
      if entry is not None:
        g = lax.psum_scatter(g, entry, scatter_dimension=dim, tiled=True)
    rest = tuple(a for a in fast if a not in spec_axes(spec))
    if rest:
      g = lax.psum(g, rest)
    # Axes the spec shards over but the batch does not split (a "tensor" axis beside data axes
    # ("dcn", "fsdp")) hold the same gradient on each of their devices: the reduce-scatter summed
    # that many copies.
    copies = 1
    for a in spec_axes(spec):
      copies *= 1 if a in fast else mesh.shape[a]
    return g / (size * copies) if size * copies > 1 else g

  return jax.tree.map(one, grads, specs)


def shardings(specs: Any, mesh: Mesh) -> Any:
  """A ``NamedSharding`` per leaf of ``specs``."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def shard_shape(shape: tuple, spec: P, mesh: Mesh) -> tuple:
  """The shape of one device's shard of an array of ``shape`` laid out as ``spec`` over ``mesh``."""
  out = list(shape)
  for dim, entry in enumerate(spec):
    for a in (entry if isinstance(entry, tuple) else (entry,)) if entry is not None else ():
      if out[dim] % mesh.shape[a]:
        raise ValueError(f"param_specs: {spec} splits a dimension of {out[dim]} entries (shape"
                         f" {tuple(shape)}) over {a!r} of size {mesh.shape[a]}, which does not divide it")
      out[dim] //= mesh.shape[a]
  return tuple(out)
