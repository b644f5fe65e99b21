"""Exchanges written per leaf shape: :class:`GroupExchange` over stacks of same-view segments, and
:class:`FusedExchange`, one exchange for every group of a step at once (tensor fusion)."""

from __future__ import annotations

import abc
from typing import Any, Tuple

import jax
import jax.numpy as jnp

from jaxcomp.core import layout
from jaxcomp.core.protocol import Exchange, StepContext

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


def join(parts, segs: layout.Segments) -> jax.Array:
  """Per-segment vectors -> one bucket vector with zero padding (rows, as :func:`layout.pack`)."""
  out = []
  for part, n, p in zip(parts, segs.sizes, segs.padded_sizes):
    part = part.astype(jnp.float32)
    out.append((jnp.pad(part, (0, p - n)) if p > n else part).reshape(-1, layout.ROW))
  return out[0].reshape(-1) if len(out) == 1 else jnp.concatenate(out).reshape(-1)


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
    mean, local = [None] * segs.count, [None] * segs.count
    new_extra = []
    for g, ((view, idx), ex_state) in enumerate(zip(groups(segs), extra)):
      X = jnp.stack([segs.segment(x, s).reshape(view) for s in idx])
      m, loc, ex_state = self(X, ex_state, ctx._replace(key=jax.random.fold_in(ctx.key, g)))
      new_extra.append(ex_state)
      for j, s in enumerate(idx):
        mean[s], local[s] = m[j].reshape(-1), loc[j].reshape(-1)
    return join(mean, segs), join(local, segs), tuple(new_extra)


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

  @abc.abstractmethod
  def wire_bytes(self, groups) -> int:
    """The nominal bytes per step."""
