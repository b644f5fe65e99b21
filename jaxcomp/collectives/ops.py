"""The two collectives every communicator is built from, over a resolved :class:`Axis`.

``allreduce_sum`` sums payloads that add linearly (psum); ``allgather``
stacks every worker's payload on a new leading axis. Under ``jax.shard_map``
with ``check_vma=True`` a plain ``all_gather`` result is "varying", so a mean
computed from it could not be returned with ``out_specs=P()``; the gather
here is the invariant one when this JAX has it, so the decoded mean is typed
as what it is: the same on every worker.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from jaxcomp.collectives.axis import Axis

try:  # JAX >= 0.6: Varying -> Invariant gather; not yet exported from jax.lax.
  from jax._src.lax.parallel import all_gather_invariant as _gather_invariant
except ImportError:  # pragma: no cover - older or newer JAX without it
  _gather_invariant = None


def allreduce_sum(tree: Any, axis: Axis) -> Any:
  """Sum over the axis; identity when ``axis.name is None``."""
  if axis.name is None:
    return tree
  return lax.psum(tree, axis.name)


def allgather(tree: Any, axis: Axis) -> Any:
  """Every worker's leaves stacked on a new leading axis of size ``axis.size``."""
  if axis.name is None:
    return jax.tree.map(lambda x: x[None], tree)
  if _gather_invariant is not None:
    return _gather_invariant(tree, axis.name)
  return lax.all_gather(tree, axis.name)
