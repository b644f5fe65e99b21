"""ACP-SGD: alternate compressed PowerSGD, one fused all-reduce per step.

:func:`acpsgd` views each leaf of rank >= 2 as a matrix M (``lowrank.matrix_view``:
``(prod(shape[:-1]), shape[-1])``) with r = min(rank, rows, cols), and is
compressed when ``(rows + cols) * r * min_compression_rate < rows * cols``
(PowerSGD's rule); other leaves travel uncompressed. With the residual E:

- P-steps: ``Q <- orthogonalize(Q)`` (Q is the last all-reduced Q, the same
  on every worker: no communication), ``P = (M + E) Q``,
  ``E <- (M + E) - P Q^T`` with the local P, all-reduce-mean P, output
  ``P Q^T``; P is kept.
- Q-steps mirror it: ``P <- orthogonalize(P)``, ``Q = (M + E)^T P``,
  ``E <- (M + E) - P Q^T``, all-reduce-mean Q, output ``P Q^T``; Q is kept.

The power iteration is thus spread over steps (a warm start by
construction) and each step moves one factor per matrix. The factors of all
matrices and the uncompressed leaves are packed into one float32 buffer and
all-reduced by a single psum per step, or one per bucket of about
``bucket_bytes`` (tensor fusion, in leaf order). Which step is a P-step
comes from the state's ``phase`` (the step count modulo 2^32, which wraps
where ``count`` saturates), so a restored checkpoint continues the
alternation, and it never stops. A static buffer must fit both kinds of step: with
``balance_phases`` (default) some matrices start with a Q-step (the
algorithm per matrix is unchanged, shifted by one step), chosen so that
P-steps and Q-steps send nearly the same number of values; the buffer is
then about half of PowerSGD's two all-reduces. Without it every matrix
alternates together as in the paper, and the buffer holds
``max(sum of P sizes, sum of Q sizes)``. Initial P and Q come from ``seed``,
identical on every worker; ``state.extra`` holds, per bucket of the
builder, the ``(P, Q)`` of each group of same-view leaves
(:func:`jaxcomp.core.groups.groups`; ``()`` for a group of uncompressed leaves).

Orthogonalization adds no epsilon (:func:`jaxcomp.transforms.lowrank.orthogonalize`):
the output is proportional to the gradient at any scale. A factor column
that comes back all zero (the matrix and its residual were zero) keeps its
previous value, so the matrix is sent again once it is not zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxcomp.collectives.axis import AxisName
from jaxcomp.core.builder import build
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Memory
from jaxcomp.transforms import _args
from jaxcomp.transforms.acp_fusion import ACPFactors, ACPFusion
from jaxcomp.transforms.lowrank import (
  compression_rate,
  matrix_route,
)


@_args.factory
def acpsgd(rank: int = 4, *, axis_name: AxisName = None, bucket_bytes: int | None = None,
           min_compression_rate: float = 2.0, seed: int = 0, balance_phases: bool = True,
           min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather"):
  """ACP-SGD: PowerSGD's two factors sent on alternate steps, all layers in one all-reduce.

  Each compressed matrix sends its P factor on one step and its Q factor on
  the next (a power iteration spread over steps); the factors of all
  matrices and the uncompressed leaves travel in one psum per step (or per
  fusion bucket). The algorithm, the phases and the state are described in
  :mod:`jaxcomp.transforms.acpsgd`.

  Args:
    rank: r >= 1 (the paper uses PowerSGD's ranks; 4 here).
    axis_name: the data-parallel axis, or None.
    bucket_bytes: ACP-SGD's own fusion buckets: the factors (and dense
      leaves) of a step are packed into all-reduce buffers of about this many
      bytes (> 0, leaf granularity), one all-reduce each; None (default): one
      buffer. Unlike the other methods' ``bucket_bytes`` it does not size the
      builder's buckets of gradients (those keep :func:`jaxcomp.build`'s
      default): what ACP-SGD fuses is the factors, across those buckets.
    min_compression_rate: >= 1; compress a matrix only when PowerSGD's two
      factors are this many times smaller than it (default 2).
    seed: seeds the initial factors.
    balance_phases: give matrices phases that equalize the two kinds of step.
    min_size, dense: the leaf policy, see :func:`jaxcomp.build`: leaves of
      fewer than ``min_size`` entries, and those ``dense`` selects, travel
      uncompressed in the fused buffers.
    dense_axis_name: a fast axis averaged densely before the compressed exchange, see
      :func:`jaxcomp.build`.
    transport: ``"gather"`` only: its factors are all-reduced already; ``"scatter"`` raises.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxcomp
    >>> params = {"w": jnp.zeros((256, 64))}
    >>> tx = jaxcomp.acpsgd(rank=2)  # axis_name=None: one worker, a local round trip
    >>> jaxcomp.wire_bytes(tx, params)  # a step sends P (256 x 2) or Q (64 x 2), sized for the larger
    2048

  References:
    Zhang, Zhang, Shi, Chu & Li, *Evaluation and Optimization of Gradient
    Compression for Distributed Deep Learning*, ICDCS 2023, arXiv:2306.08881
    (ACP-SGD); Vogels, Karimireddy & Jaggi, *PowerSGD*, NeurIPS 2019.
  """
  r = _args.integer("rank", rank, 1)
  rate = compression_rate(min_compression_rate)
  if bucket_bytes is not None:
    bucket_bytes = _args.integer("bucket_bytes", bucket_bytes, 1)
  balance = _args.flag("balance_phases", balance_phases)
  fused = ACPFusion(bucket_bytes, balance)
  method = Method("acpsgd", matrix_route(ACPFactors(r), r, rate), Memory(), fused=fused)
  return build(method, axis_name, seed, min_size=min_size, dense=dense, dense_axis_name=dense_axis_name,
               transport=transport)


def phases(tx, params) -> Sequence[tuple[int, int]]:
  """``(leaf index, phase)`` of every compressed leaf of ``params`` (0: P at even steps)."""
  method = tx.method
  groups = method.plan(jax.tree.leaves(params))
  return sorted((it.leaf, it.phase) for b in method.fused.layout(groups) for it in b.lowrank)
