"""Exchanges written per leaf shape: :class:`GroupExchange` over stacks of same-view segments, and
:class:`FusedExchange`, one exchange for every group of a step at once (tensor fusion)."""

from __future__ import annotations

import abc
from typing import Any, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.core import layout
from jaxcomp.core.protocol import Exchange, Opened, StepContext

STACK_MAX = 1 << 16  # segments with more entries than this are not stacked, see groups()


def groups(segs: layout.Segments):
  """Segment indices of a bucket grouped by view, for exchanges of the group form.

  Segments of more than :data:`STACK_MAX` entries form a group of their own
  (stacking copies them); smaller ones of the same view share one batched kernel.
  """
  out: dict = {}
  for s, (n, view) in enumerate(zip(segs.sizes, segs.views)):
    out.setdefault((tuple(view), s if n > STACK_MAX else -1), []).append(s)
  return [(view, idx) for (view, _), idx in out.items()]


def _runs(idx, segs: layout.Segments):
  """Splits a group's segment indices into runs that lie back to back in the bucket: ``[(j, m)]``.

  Run ``(j, m)`` is group positions ``j .. j + m - 1``: one slice of the bucket.
  """
  runs = []
  for j, s in enumerate(idx):
    if runs:
      j0, m = runs[-1]
      prev = idx[j - 1]
      if s == prev + 1 and segs.offsets[s] == segs.offsets[prev] + segs.sizes[prev]:
        runs[-1] = (j0, m + 1)
        continue
    runs.append((j, 1))
  return runs


def stack_group(x, segs: layout.Segments, view, idx) -> jax.Array:
  """The group's segments of bucket ``x`` as ``(G, *view)``: one slice of the bucket per run of
  segments that lie back to back (:func:`_runs`), not one per segment."""
  n = segs.sizes[idx[0]]
  parts = []
  for j, m in _runs(idx, segs):
    start = segs.offsets[idx[j]]
    parts.append(lax.slice_in_dim(x, start, start + m * n).reshape((m,) + tuple(view)))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def join_groups(groups, stacked, segs: layout.Segments) -> jax.Array:
  """Inverse of :func:`stack_group` over all groups (each ``(G, ...)``, any trailing shape): one bucket
  vector, zero padded as :func:`layout.pack`, one piece per run of back-to-back segments."""
  where = {}
  for g, (_, idx) in enumerate(groups):
    for j, s in enumerate(idx):
      where[s] = (g, j)
  parts, s = [], 0
  while s < segs.count:
    g, j = where[s]
    m = 1
    while (s + m < segs.count and where[s + m] == (g, j + m)
           and segs.offsets[s + m] == segs.offsets[s + m - 1] + segs.sizes[s + m - 1]):
      m += 1
    whole = j == 0 and m == stacked[g].shape[0]
    run = (stacked[g] if whole else stacked[g][j:j + m]).reshape(-1)
    pad = segs.padded_sizes[s + m - 1] - segs.sizes[s + m - 1]
    parts.append((jnp.pad(run, (0, pad)) if pad else run).reshape(-1, layout.ROW))
    s += m
  return (parts[0] if len(parts) == 1 else jnp.concatenate(parts)).reshape(-1)



class GroupExchange(Exchange):
  """An exchange written per leaf shape: ``__call__`` over a stack of same-view segments.

  ``__call__(X, extra, ctx)`` gets ``X`` of shape ``(G, *view)`` and returns
  ``(mean, local, extra)`` of the same shape; ``init(view, group, key)`` makes
  its state and ``wire_bytes(view, group)`` gives its bytes. The bucket form
  runs it once per group of same-view segments (:func:`groups`). A
  :class:`FusedExchange` calls group exchanges directly.
  """

  def init(self, view: Tuple[int, ...], group: int, key: jax.Array) -> Any:
    """State for a group of ``group`` segments of shape ``view``."""
    del view, group, key
    return ()

  @abc.abstractmethod
  def __call__(self, X, extra, ctx: StepContext):
    """``(mean, local, extra)`` for the stack ``X``."""

  @abc.abstractmethod
  def wire_bytes(self, view: Tuple[int, ...], group: int) -> int:
    """Bytes one worker hands to collectives for a group."""

  def init_bucket(self, segs: layout.Segments, key: jax.Array) -> Any:
    return tuple(self.init(view, len(idx), jax.random.fold_in(key, g))
                 for g, (view, idx) in enumerate(groups(segs)))

  def bucket_wire_bytes(self, segs: layout.Segments, workers: int | None = None) -> int:
    return sum(self.wire_bytes(view, len(idx)) for view, idx in groups(segs))

  def exchange(self, x, segs: layout.Segments, extra, ctx: StepContext):
    mean, local, new_extra = [], [], []
    plan = groups(segs)
    for g, ((view, idx), ex_state) in enumerate(zip(plan, extra)):
      m, loc, ex_state = self(stack_group(x, segs, view, idx), ex_state,
                              ctx._replace(key=jax.random.fold_in(ctx.key, g)))
      mean.append(m)
      local.append(loc)
      new_extra.append(ex_state)
    return join_groups(plan, mean, segs), join_groups(plan, local, segs), tuple(new_extra)


class FusedExchange(abc.ABC):
  """Compresses and communicates all leaf groups of a step at once (tensor fusion).

  For methods whose collectives span buckets, e.g. ACP-SGD's one all-reduce
  for the factors of every layer. ``__call__(groups, xs, extras, ctx)`` gets
  the plan (one ``(exchange, view, leaf indices)`` per group, see
  :meth:`jaxcomp.core.method.Method.plan`; the exchanges are
  :class:`GroupExchange`), each group's stacked input ``(G, *view)`` and
  state (made by the group exchange's ``init``), and a ``ctx`` whose key is
  the step's; it returns one ``(mean, local, extra)`` per group.
  The groups' ``carries_nonfinite`` must stay true of the fused path.
  """

  def init_bucket(self, exchange: Exchange, segs: layout.Segments, key: jax.Array) -> tuple:
    """The state of one bucket's groups: a :class:`GroupExchange`'s ``init`` per group, else ``()``."""
    if isinstance(exchange, GroupExchange):
      return GroupExchange.init_bucket(exchange, segs, key)
    return tuple(() for _ in groups(segs))

  @abc.abstractmethod
  def __call__(self, groups, xs, extras, ctx: StepContext):
    """One ``(mean, local, extra)`` per group."""

  def open(self, groups, xs, extras, ctx: StepContext) -> Opened:
    """The call as an :class:`~jaxcomp.core.protocol.Opened` whose ``finish`` gives the list of
    ``(mean, local, extra)``; by default it runs whole, the means the witness."""
    out = self(groups, xs, extras, ctx)
    return Opened([m for m, _, _ in out], lambda poison: out)

  @abc.abstractmethod
  def wire_bytes(self, groups) -> int:
    """The nominal bytes per step."""
