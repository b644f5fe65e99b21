"""ACP-SGD's exchanges: :class:`ACPFactors` for each group of same-view matrices, and tensor fusion.

:class:`ACPFusion` (the :class:`~jaxcomp.core.groups.FusedExchange` of
:func:`jaxcomp.acpsgd`) packs the factors of every matrix of a step and the
uncompressed leaves into one float32 buffer (or one per bucket of about
``bucket_bytes``), all-reduced by one psum each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import ops
from jaxcomp.core.groups import FusedExchange, GroupExchange
from jaxcomp.core.protocol import DENSE, Opened, StepContext
from jaxcomp.kernels import rng
from jaxcomp.transforms.lowrank import (
  keep_nonzero_columns,
  orthogonalize_all,
  transposed_product,
)


@dataclasses.dataclass(frozen=True)
class ACPFactors(GroupExchange):
  """A group of same-view matrices compressed by ACP-SGD; its state is ``(P, Q)``.

  ``P`` is ``(G, a, r)``, ``Q`` is ``(G, b, r)``: the last all-reduced value of
  each factor, drawn from the seed at ``init`` (identical on every worker).
  On its own it runs one :class:`ACPFusion` over this group; inside
  :func:`acpsgd` all groups share the fusion's buffers.
  """

  rank: int
  carries_nonfinite = True  # a NaN/Inf in X reaches the psum-ed factor and the mean

  def init(self, view, group, key):
    a, b = view
    r = min(self.rank, a, b)
    kp, kq = jax.random.split(key)
    return jnp.asarray(rng.normal(kp, (group, a, r))), jnp.asarray(rng.normal(kq, (group, b, r)))

  def _alone(self, view, group):
    return ACPFusion(), [(self, tuple(view), list(range(group)))]

  def __call__(self, X, extra, ctx: StepContext):
    fusion, groups = self._alone(X.shape[1:], X.shape[0])
    return fusion(groups, [X], (extra,), ctx)[0]

  def wire_bytes(self, view, group):
    fusion, groups = self._alone(view, group)
    return fusion.wire_bytes(groups)


@dataclasses.dataclass(frozen=True)
class _Item:
  """One leaf in the fused buffer: group ``g``, position ``j`` in it, its sizes."""

  leaf: int
  g: int
  j: int
  dense: bool
  p: int  # a * r: the P factor (dense: n)
  q: int  # b * r: the Q factor (dense: n)
  phase: int = 0


@dataclasses.dataclass(frozen=True)
class _Bucket:
  dense: tuple[_Item, ...]
  lowrank: tuple[_Item, ...]
  length: int  # float32 entries, the same at both parities

  @property
  def dense_length(self) -> int:
    """Entries of the dense leaves, at the front of the buffer at either parity."""
    return sum(it.p for it in self.dense)


DENSE_ROLE = 2  # a run of dense leaves (roles 0 and 1: P and Q factors)


def _merge_runs(items):
  """``(g, role, i, size)`` in buffer order -> runs ``(g, role, i0, i1, start, size)`` of consecutive i."""
  runs, at = [], 0
  for g, role, i, size in items:
    last = runs[-1] if runs else None
    if last is not None and (last[0], last[1], last[3], last[5]) == (g, role, i, size):
      last[3] += 1
    else:
      runs.append([g, role, i, i + 1, at, size])
    at += size
  return [tuple(r) for r in runs]


def _rows(role, g, size):
  """Positions in group ``g`` sending P (role 0) and sending Q (role 1)."""
  rows = [np.array([j for j in range(size) if role[g, j] == f], np.int32) for f in (0, 1)]
  return rows[0], rows[1]


def _runs_of(rows):
  """Ascending static ``rows`` as runs ``(start, stop)`` of consecutive positions."""
  runs = []
  for r in rows.tolist():
    if runs and runs[-1][1] == r:
      runs[-1][1] = r + 1
    else:
      runs.append([r, r + 1])
  return runs


def _take(a, rows):
  """``a[rows]`` for static ascending ``rows``: slices of ``a`` (no gather)."""
  if rows.size == a.shape[0]:
    return a
  return _joined([a[i:j] for i, j in _runs_of(rows)])


def _put(a, rows, values):
  """``a.at[rows].set(values)`` for static ascending ``rows``: slices of both, concatenated (no scatter).

  Where ``rows`` are all of ``a``, the result is ``values`` in ``a``'s type (a select,
  which XLA folds away): a factor kept in the state stays varying over the workers.
  """
  if rows.size == a.shape[0]:
    return jnp.where(True, values, a)
  pieces, at, used = [], 0, 0
  for i, j in _runs_of(rows):
    if at < i:
      pieces.append(a[at:i])
    pieces.append(values[used:used + j - i])
    used += j - i
    at = j
  if at < a.shape[0]:
    pieces.append(a[at:])
  return _joined(pieces)


@dataclasses.dataclass(frozen=True)
class ACPFusion(FusedExchange):
  """Packs every group's active factor (and the dense leaves) into one psum per bucket.

  At step t a matrix of phase f sends ``P = (M + E) orth(Q)`` when
  ``(t + f)`` is even and ``Q = (M + E)^T orth(P)`` when odd. Buckets are
  filled in leaf order up to ``bucket_bytes`` (one bucket when None); inside
  a bucket, phases are chosen so that the factors sent at even and at odd
  steps have nearly the same total size (the buffer has one static length).
  A buffer holds the dense leaves first (the same at either parity, built and
  read outside the step's ``lax.cond``), then the factors by group, role and
  position (:meth:`_runs`), so each group's part is one slice, not one per leaf.
  """

  bucket_bytes: int | None = None
  balance: bool = True
  carries_nonfinite = True

  def layout(self, groups) -> list[_Bucket]:
    items = []
    for g, (ex, view, idx) in enumerate(groups):
      for j, leaf in enumerate(idx):
        if isinstance(ex, ACPFactors):
          a, b = view
          r = min(ex.rank, a, b)
          items.append(_Item(leaf, g, j, False, a * r, b * r))
        elif ex == DENSE:
          n = int(np.prod(view, dtype=np.int64))
          items.append(_Item(leaf, g, j, True, n, n))
        else:
          raise TypeError(f"ACPFusion fuses ACPFactors and DENSE groups only, got {ex!r}")
    items.sort(key=lambda it: it.leaf)
    chunks, current, size = [], [], 0
    for it in items:
      nbytes = 4 * (it.p if it.dense else (it.p + it.q) / 2)
      if current and self.bucket_bytes is not None and size + nbytes > self.bucket_bytes:
        chunks.append(current)
        current, size = [], 0
      current.append(it)
      size += nbytes
    if current:
      chunks.append(current)
    return [self._bucket(chunk) for chunk in chunks]

  def _bucket(self, items) -> _Bucket:
    dense = tuple(it for it in items if it.dense)
    lowrank = [it for it in items if not it.dense]
    phase = {}
    even = odd = 0
    order = sorted(lowrank, key=lambda it: -abs(it.p - it.q)) if self.balance else lowrank
    for it in order:
      f = 1 if self.balance and max(even + it.q, odd + it.p) < max(even + it.p, odd + it.q) else 0
      phase[it.leaf] = f
      even += it.q if f else it.p
      odd += it.p if f else it.q
    lowrank = tuple(dataclasses.replace(it, phase=phase[it.leaf]) for it in lowrank)
    return _Bucket(dense, lowrank, sum(it.p for it in dense) + max(even, odd))

  def wire_bytes(self, groups) -> int:
    return 4 * sum(b.length for b in self.layout(groups))

  @staticmethod
  def _roles(parity, buckets):
    """``(group, position) -> 0`` for the matrices sending P at ``parity``, 1 for Q."""
    return {(it.g, it.j): (parity + it.phase) % 2 for b in buckets for it in b.lowrank}

  def _runs(self, parity, buckets):
    """Per bucket, its buffer at ``parity`` as runs ``(g, role, i0, i1, start, size)``.

    Dense leaves come first, by group and position (role :data:`DENSE_ROLE`,
    rows ``i0:i1`` of the group); then the factors by group, role and
    position (role 0: P, role 1: Q; rows ``i0:i1`` of the group's matrices
    sending that factor, in :func:`_rows` order). A run is contiguous in the
    buffer and in its group's stack, so it is one slice on either side: no
    kernel per leaf.
    """
    role = self._roles(parity, buckets)
    rank, seen = {}, {}
    for g, j in sorted(role):
      rank[g, j] = seen.get((g, role[g, j]), 0)
      seen[g, role[g, j]] = rank[g, j] + 1
    out = []
    for b in buckets:
      items = sorted((it.g, DENSE_ROLE, it.j, it.p) for it in b.dense)
      items += sorted((it.g, role[it.g, it.j], rank[it.g, it.j], it.q if role[it.g, it.j] else it.p)
                      for it in b.lowrank)
      out.append(_merge_runs(items))
    return out

  def _send(self, parity, groups, xs, extras, buckets, num):
    """The factors at ``parity``: (locals, fixed factors, per bucket its factor runs' part of the buffer)."""
    role = self._roles(parity, buckets)
    locals_, fixed, sent = [], [], {}
    todo, fixed_rows = [], {}  # every factor to orthogonalize this step, in one batched chain
    for g, ((ex, _, idx), state) in enumerate(zip(groups, extras)):
      if isinstance(ex, ACPFactors):
        p_rows, q_rows = fixed_rows[g] = _rows(role, g, len(idx))
        todo += [_take(state[1], p_rows)] if p_rows.size else []
        todo += [_take(state[0], q_rows)] if q_rows.size else []
    done = iter(orthogonalize_all(todo))
    for g, ((ex, _, idx), X, state) in enumerate(zip(groups, xs, extras)):
      if not isinstance(ex, ACPFactors):
        continue
      P, Q = state
      local = X
      p_rows, q_rows = fixed_rows[g]
      if p_rows.size:
        Qo = next(done)
        Pl = jnp.einsum("gab,gbr->gar", _take(X, p_rows), Qo)
        local = _put(local, p_rows, jnp.einsum("gar,gbr->gab", Pl, Qo))
        Q = _put(Q, p_rows, Qo)
        sent[g, 0] = Pl.reshape(Pl.shape[0], -1) / num
      if q_rows.size:
        Po = next(done)
        Qt = transposed_product(_take(X, q_rows), Po)  # Q^T (G, r, cols): travels in this layout
        local = _put(local, q_rows, jnp.einsum("gar,grb->gab", Po, Qt))
        P = _put(P, q_rows, Po)
        sent[g, 1] = Qt.reshape(Qt.shape[0], -1) / num
      locals_.append(local)
      fixed.append((P, Q))
    parts = []
    for b, runs in zip(buckets, self._runs(parity, buckets)):
      pieces = [sent[g, f][i0:i1].reshape(-1) for g, f, i0, i1, _, _ in runs if f != DENSE_ROLE]
      used = sum(int(p.shape[0]) for p in pieces)
      pieces.append(jnp.zeros((b.length - b.dense_length - used,), jnp.float32))
      parts.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces))
    return locals_, fixed, parts

  def _receive(self, parity, groups, fixed, parts, buckets, poison=None):
    """Means and new states of the factor groups from their summed parts of the buffers at ``parity``
    (``poison``, 0 or NaN, added to the received factor that forms each mean; None: nothing added)."""
    add = (lambda f: f) if poison is None else (lambda f: f + poison)
    role = self._roles(parity, buckets)
    got = {}
    for b, runs, part in zip(buckets, self._runs(parity, buckets), parts):
      for g, f, i0, i1, start, size in runs:
        if f != DENSE_ROLE:
          at = start - b.dense_length
          got.setdefault((g, f), []).append((i0, part[at:at + (i1 - i0) * size].reshape(i1 - i0, -1)))
    means, states, k = [], [], 0
    for g, (ex, view, idx) in enumerate(groups):
      if not isinstance(ex, ACPFactors):
        continue
      a, b = view
      P, Q = fixed[k]
      k += 1
      mean = jnp.zeros((len(idx), a, b), jnp.float32)
      p_rows, q_rows = _rows(role, g, len(idx))
      if p_rows.size:
        Pm = _in_order(got[g, 0]).reshape(-1, a, P.shape[-1])
        mean = _put(mean, p_rows, jnp.einsum("gar,gbr->gab", add(Pm), _take(Q, p_rows)))
        # not a plain Pm: P keeps the state's (varying) type; a zero column keeps the last one
        P = _put(P, p_rows, keep_nonzero_columns(Pm, _take(P, p_rows)))
      if q_rows.size:
        Qmt = _in_order(got[g, 1]).reshape(-1, Q.shape[-1], b)
        mean = _put(mean, q_rows, jnp.einsum("gar,grb->gab", _take(P, q_rows), add(Qmt)))
        Q = _put(Q, q_rows, keep_nonzero_columns(jnp.swapaxes(Qmt, 1, 2), _take(Q, q_rows)))
      means.append(mean)
      states.append((P, Q))  # a non-finite factor means a non-finite mean: build() restores them
    return means, states

  def _dense_runs(self, buckets):
    """Per bucket, the runs of its dense leaves (the same at either parity)."""
    return [[r for r in runs if r[1] == DENSE_ROLE] for runs in self._runs(0, buckets)]

  def _dense_parts(self, xs, buckets, num):
    """Per bucket, the pieces of its buffer that hold the dense leaves (divided by ``num``)."""
    return [[xs[g].reshape(xs[g].shape[0], -1)[i0:i1].reshape(-1) / num for g, _, i0, i1, _, _ in runs]
            for runs in self._dense_runs(buckets)]

  def _dense_means(self, xs, buckets, buffers):
    """``group -> mean`` of every dense group, read from the summed buffers."""
    got = {}
    for runs, buf in zip(self._dense_runs(buckets), buffers):
      for g, _, i0, i1, start, size in runs:
        got.setdefault(g, []).append((i0, buf[start:start + (i1 - i0) * size].reshape(i1 - i0, -1)))
    return {g: _in_order(v).reshape(xs[g].shape) for g, v in got.items()}

  def __call__(self, groups, xs, extras, ctx: StepContext):
    return self.open(groups, xs, extras, ctx).finish(None)

  def open(self, groups, xs, extras, ctx: StepContext) -> Opened:
    """The fused all-reduce; ``finish(poison)`` forms the means with the poison added to the received
    factors and dense leaves (a NaN poison: every entry NaN, no select over the buckets). The
    witness is the all-reduced buffers, which hold every leaf's factor or values."""
    buckets = self.layout(groups)
    num = ctx.axis.size
    even = ctx.phase % 2 == 0  # phase wraps at 2^32 (even): the alternation never stops

    def send(parity):
      return lambda: self._send(parity, groups, xs, extras, buckets, num)

    # Only the factors depend on the parity: the dense leaves stay out of both branches.
    locals_, fixed, parts = lax.cond(even, send(0), send(1))
    buffers = [_joined(d + [f]) for d, f in zip(self._dense_parts(xs, buckets, num), parts)]
    buffers = ops.allreduce_sum(buffers, ctx.axis)
    parts = [buf[b.dense_length:] for b, buf in zip(buckets, buffers)]

    def finish(poison):
      def receive(parity):
        return lambda: self._receive(parity, groups, fixed, parts, buckets, poison)

      means, states = lax.cond(even, receive(0), receive(1))
      dense_means = self._dense_means(xs, buckets, buffers)
      out, k = [], 0
      for g, ((ex, _, _), X, old) in enumerate(zip(groups, xs, extras)):
        if isinstance(ex, ACPFactors):
          out.append((means[k], locals_[k], states[k]))
          k += 1
        else:
          out.append((dense_means[g] if poison is None else dense_means[g] + poison, X, old))
      return out

    return Opened(buffers, finish, poisons=True)


def _joined(parts):
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _in_order(pieces):
  """``(i0, rows)`` pieces of one stack (from any buckets, in any order) -> the stack's rows in order."""
  return _joined([rows for _, rows in sorted(pieces, key=lambda p: p[0])])
