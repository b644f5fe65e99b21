"""PowerSGD: rank-r power iteration with warm start, over two psums."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.collectives import ops
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import DENSE, Ctx, Exchange, Memory, Method, build
from jaxcomp.transforms import _args


def orthogonalize(p: jax.Array, eps: float = 1e-8) -> jax.Array:
  """Gram-Schmidt on the columns of ``p`` (..., a, r); a zero column stays zero."""
  cols = []
  for i in range(p.shape[-1]):
    col = p[..., i]
    for q in cols:
      col = col - jnp.sum(q * col, axis=-1, keepdims=True) * q
    col = col / (jnp.linalg.norm(col, axis=-1, keepdims=True) + eps)
    cols.append(col)
  return jnp.stack(cols, axis=-1)


def matrix_view(shape) -> tuple:
  """How a leaf is seen as a matrix: ``(prod(shape[:-1]), shape[-1])``.

  A Dense kernel (in, out) stays as it is; a conv kernel HWIO becomes
  ``(H*W*I, O)``, the output channels forming one side (GRACE used (H, W*I*O)).
  """
  a = 1
  for d in shape[:-1]:
    a *= int(d)
  return a, int(shape[-1])


@dataclasses.dataclass(frozen=True)
class PowerSGDExchange(Exchange):
  """P = M Q -> psum -> orthogonalize -> Q = M^T P -> psum -> M_hat = P Q^T."""

  rank: int
  start_step: int = 0
  eps: float = 1e-8

  def init(self, view, group, key):
    a, b = view
    return jax.random.normal(key, (group, b, min(self.rank, a, b)), jnp.float32)

  def _compressed(self, X, Q, ctx: Ctx):
    num = ctx.axis.size
    P = ops.allreduce_sum(jnp.einsum("gab,gbr->gar", X, Q), ctx.axis) / num
    P = orthogonalize(P, self.eps)
    Qn = ops.allreduce_sum(jnp.einsum("gab,gar->gbr", X, P), ctx.axis) / num
    M = jnp.einsum("gar,gbr->gab", P, Qn)
    Qn = jnp.where(jnp.all(jnp.isfinite(Qn)), Qn, Q)  # a NaN step must not poison the warm start
    return M, M, Qn

  def _dense(self, X, Q, ctx: Ctx):
    M = ops.allreduce_sum(X, ctx.axis) / ctx.axis.size
    return M, X, Q

  def __call__(self, X, Q, ctx: Ctx):
    if self.start_step <= 0:
      return self._compressed(X, Q, ctx)
    return lax.cond(ctx.count < self.start_step, lambda X, Q: self._dense(X, Q, ctx),
                    lambda X, Q: self._compressed(X, Q, ctx), X, Q)

  def wire_bytes(self, view, group):
    a, b = view
    return group * (a + b) * min(self.rank, a, b) * 4


def powersgd(rank: int = 4, axis_name: AxisName = None, min_compression_rate: float = 2.0,
             start_step: int = 0, error_feedback: bool = True, seed: int = 0):
  """PowerSGD: rank-``rank`` approximation of each matrix by one warm-started power step.

  Each leaf of rank >= 2 is viewed as a matrix M (:func:`matrix_view`) with
  r = min(rank, rows, cols). It is compressed only when
  ``(rows + cols) * r * min_compression_rate < rows * cols``; 1-D leaves and
  small matrices travel dense in float32. For a compressed M (plus the
  residual): P = M Q, allreduce-mean P, orthogonalize P (Gram-Schmidt),
  Q = M^T P, allreduce-mean Q, output P Q^T. Q is kept for the next step (warm
  start), initialized from ``seed`` identically on every worker. The residual
  is M - P Q^T. Before ``start_step`` every leaf goes dense (note: the compiled
  program then holds both paths, and its HLO lists the collectives of both).
  Same-shape matrices are batched into one kernel.

  Args:
    rank: r >= 1 (GRACE default 1; 4 in benchmarks and here).
    axis_name: the data-parallel axis, or None.
    min_compression_rate: >= 1; PyTorch's hook default 2.
    start_step: steps of dense allreduce before compression starts (>= 0).
    error_feedback: keep M - P Q^T in the residual (default True).
    seed: seeds the initial Q.

  References:
    Vogels, Karimireddy & Jaggi, *PowerSGD: Practical Low-Rank Gradient
    Compression for Distributed Optimization*, NeurIPS 2019, Algorithm 1.
  """
  r = _args.integer("rank", rank, 1)
  rate = _args.positive("min_compression_rate", min_compression_rate)
  if rate < 1:
    raise ValueError(f"min_compression_rate must be >= 1, got min_compression_rate={min_compression_rate!r}")
  start = _args.integer("start_step", start_step, 0, 2 ** 31 - 1)  # the step count is int32
  ef = _args.flag("error_feedback", error_feedback)
  lowrank = PowerSGDExchange(r, start)

  def route(shape):
    n = 1
    for d in shape:
      n *= int(d)
    if len(shape) >= 2:
      a, b = matrix_view(shape)
      if (a + b) * min(r, a, b) * rate < a * b:
        return lowrank, (a, b)
    return DENSE, (n,)

  return build(Method("powersgd", route, Memory(enabled=ef)), axis_name, seed)
