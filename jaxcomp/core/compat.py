"""The one place where jaxcomp meets differences between the JAX versions it supports.

Tested on jax 0.10 (Python 3.11) and jax 0.12 (Python 3.12); the rest of the
package imports what differs from here, never checks a version itself.

- ``use_mesh(mesh)``: the mesh in context for sharding annotations, inside ``jax.jit`` too.
- ``varying_axes(x)``: the manual axes ``x`` is typed varying over (``check_vma=True``).
- ``gather_invariant(x, axis_name)``: the all-gather whose result is typed
  invariant over ``axis_name`` (the same on every worker), so a mean decoded
  from it can leave ``shard_map(check_vma=True)`` with ``out_specs=P()``.
  ``lax.all_gather(..., to="invarying")`` where JAX has it (0.8 and newer;
  jax 0.12 removed the older private ``all_gather_invariant``), else that
  private function, else None (the plain gather is used).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

from jax import lax


def _gather_invariant() -> Optional[Callable]:
  if "to" in inspect.signature(lax.all_gather).parameters:
    return functools.partial(lax.all_gather, to="invarying")
  try:  # pragma: no cover - JAX before all_gather(to=)
    from jax._src.lax.parallel import all_gather_invariant
  except ImportError:  # pragma: no cover
    return None
  return all_gather_invariant


gather_invariant = _gather_invariant()


def use_mesh(mesh):
  """A context, valid inside ``jax.jit``, in which sharding annotations that name axes (a bare
  ``PartitionSpec``, ``vmap``'s ``spmd_axis_name``) resolve on ``mesh``: its abstract mesh
  (``jax.sharding.use_abstract_mesh``; ``jax.set_mesh`` may not be entered under a trace). Nothing
  when that mesh is already in context."""
  import contextlib

  import jax

  abstract = mesh.abstract_mesh
  if jax.sharding.get_abstract_mesh() == abstract:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(abstract)


def varying_axes(x) -> frozenset:
  """The manual mesh axes over which ``x`` is typed varying (under ``shard_map(check_vma=True)``;
  empty elsewhere, or where this JAX does not track it): ``jax.typeof(x).mat.varying``."""
  import jax

  try:
    aval = jax.typeof(x)
  except TypeError:  # not a JAX value
    return frozenset()
  mat = getattr(aval, "mat", None)
  return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())
