"""The leaf policy: which gradient leaves travel dense in float32 instead of compressed.

The leaf policy: leaves of fewer than ``min_size`` entries, and leaves a
``dense`` mask selects, travel dense in float32 (fused into dense buckets, one
psum each). The default ``min_size`` is :data:`MIN_SIZE` (1024 entries), except
for the selecting sparsifiers (top-k, threshold, DGC, AdaQ) and SBC, which compress every
leaf (:data:`EVERY_LEAF`):
their payload is 0.1-1% of the entries, and small leaves sent dense would
dominate it (ResNet-50's 107 BN and bias vectors, 53k values, are as large as
DGC's whole 0.1% payload). :func:`jaxcomp.build` warns once at ``init`` when
most of a step's bytes would travel dense under the policy.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any, Iterator

import jax
import numpy as np

from jaxcomp.core.layout import ROW, padded

MIN_SIZE = 1024  # entries; smaller leaves travel dense (the default; see README "Buckets")
EVERY_LEAF = 0  # the sparsifiers' and SBC's default min_size: every leaf compressed
_WHOLE = contextvars.ContextVar("jaxcomp_whole_leaves", default=None)


def _prod(shape) -> int:
  return int(np.prod(shape, dtype=np.int64))


def dense_flags(mask: Any, updates: Any) -> list | None:
  """An optax-style mask (a pytree of bools, or a callable of the updates) -> one bool per leaf."""
  if mask is None:
    return None
  tree = mask(updates) if callable(mask) else mask
  n = len(jax.tree.leaves(updates))
  if isinstance(tree, (bool, np.bool_)):
    return [bool(tree)] * n
  flags = jax.tree.leaves(tree)
  if len(flags) != n or not all(isinstance(f, (bool, np.bool_)) for f in flags):
    raise ValueError(
        f"dense must be a pytree of bools with one entry per gradient leaf ({n}), or a callable"
        f" returning one; got {len(flags)} entries: {tree!r}")
  return [bool(f) for f in flags]


DENSE_SHARE_WARNING = 0.5  # init warns when the policy's dense leaves carry more than this share of the bytes


@contextlib.contextmanager
def whole_leaves(sizes: dict) -> Iterator[None]:
  """Within the block (at trace time), the leaf policy judges each leaf by ``sizes[keystr(path)]``,
  the entries of the whole leaf, not by the shard a device holds (:func:`jaxcomp.on_shards`)."""
  token = _WHOLE.set(dict(sizes))
  try:
    yield
  finally:
    _WHOLE.reset(token)


def whole_sizes(updates: Any) -> tuple | None:
  """Entries of each whole leaf of ``updates`` inside :func:`whole_leaves`; None outside it."""
  whole = _WHOLE.get()
  if whole is None:
    return None
  return tuple(whole.get(jax.tree_util.keystr(p), _prod(np.shape(x)))
               for p, x in jax.tree_util.tree_flatten_with_path(updates)[0])


def dense_share(method: Any, updates: Any, dense_exchange: Any) -> tuple:
  """The bytes and leaves the policy sends dense that ``method`` would compress, and the step's bytes.

  Only leaves that travel dense because they are smaller than ``min_size``
  count (not those a ``dense`` mask selects, nor methods whose own exchange
  is the dense mean). Returns ``(dense_bytes, dense_leaves, total_bytes)``,
  ``total_bytes`` one worker's nominal bytes per step (8 workers for the
  scatter exchange, whose bytes depend on the number).
  """
  leaves = jax.tree.leaves(updates)
  flags = dense_flags(method.dense, updates)
  min_size = MIN_SIZE if method.min_size is None else method.min_size
  dense_bytes, count = 0, 0
  for i, leaf in enumerate(leaves):
    shape = tuple(np.shape(leaf))
    n = _prod(shape)
    if n == 0 or n >= min_size or (flags is not None and flags[i]):
      continue
    exchange, _ = method.route(shape)
    if exchange is dense_exchange:
      continue  # the method itself sends this leaf as the dense mean
    dense_bytes += 4 * padded(n, ROW)
    count += 1
  if not count:
    return 0, 0, 0
  return dense_bytes, count, method.wire_bytes(updates, nonfinite_flag=False, workers=8)


def warn_if_mostly_dense(method: Any, updates: Any, dense_exchange: Any, stacklevel: int = 3) -> None:
  """Warns when leaves under ``min_size`` make up most of the bytes ``method`` sends per step."""
  dense_bytes, count, total = dense_share(method, updates, dense_exchange)
  if count and dense_bytes > DENSE_SHARE_WARNING * total:
    min_size = MIN_SIZE if method.min_size is None else method.min_size
    warnings.warn(
        f"jaxcomp.{method.name}: {count} gradient leaves of fewer than min_size={min_size} entries travel"
        f" dense in float32: {dense_bytes:,} of the {total:,} bytes one worker sends per step"
        f" ({100.0 * dense_bytes / total:.0f}%), so the method compresses little of this model."
        f" Pass min_size=0 to compress every leaf (or a smaller min_size), or mark leaves dense"
        f" with dense=... to choose which travel dense.", UserWarning, stacklevel=stacklevel)
