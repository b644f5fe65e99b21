"""Byte accounting from the bucket layout: :func:`wire_bytes`, :func:`wire_bytes_by_axis`, :func:`traffic`.

Nominal figures, computed without compiling; tests check them against the
collectives of the compiled program (:mod:`jaxcomp.collectives.wire`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.core.checks import positive_int
from jaxcomp.core.compression import CompressionTransformation, compressor_and_params, transformation
from jaxcomp.core.method import NONFINITE_FLAG_BYTES
from jaxcomp.exchanges import hierarchy
from jaxcomp.exchanges.scatter import ScatterExchange, chunk_payload_bytes


def wire_bytes(tx: Any, params: Any, step: int | None = None, workers: int | None = None) -> int:
  """Nominal payload bytes one worker sends per step with ``tx`` for ``params``.

  For psum-ed payloads this is the all-reduce buffer; for gathered payloads,
  what one worker contributes to the all-gather. Compare with
  :func:`jaxcomp.collectives.wire.measure_wire_bytes` on the compiled step
  (a program with a warm-up or stages holds every stage's collectives).
  ``step``: the bytes at that step (a warm-up or an earlier stage); None,
  the steady state (the last stage). ``workers``: the number of workers N,
  needed with ``transport="scatter"``, whose worker hands N chunk payloads to
  an all-to-all and one to an all-gather (each about 1/N of the bucket's).
  A complete optimizer (``onebit_adam``, ``demo``) counts its ``.compressor``; any other optax
  transformation (a chain...) the one jaxcomp transformation it holds (:func:`compressor`).
  """
  tx, params = transformation(tx, params, "wire_bytes")
  method = tx.method
  if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0):
    raise ValueError(f"step must be an int >= 0 or None, got step={step!r}")
  workers = positive_int("workers", workers, 1)
  return method.wire_bytes(params, nonfinite_flag=tx.axis_name is not None, step=step, workers=workers)


def wire_bytes_by_axis(tx: Any, params: Any, dense_axis_size: int, step: int | None = None,
                       workers: int | None = None) -> dict:
  """Nominal bytes one worker hands to each axis per step, for a transform with ``dense_axis_name``.

  Returns ``{axis_name: compressed bytes over the slow axis, dense_axis_name:
  float32 bytes over the fast axis, "both": the non-finite flag, all-reduced
  over both axes (0 if none)}``. Under a fast axis of ``dense_axis_size``
  workers each bucket is reduce-scattered and all-gathered in float32 there
  (:mod:`jaxcomp.exchanges.hierarchy`) and only the compressed chunks cross the slow
  axis; methods that are not chunked (PowerSGD, ACP-SGD) all-reduce every
  bucket over the fast axis and exchange it whole over the slow one.
  ``workers``: the slow axis's size, needed with ``transport="scatter"``.
  ``tx`` may be any optax transformation holding one (see :func:`compressor`).
  """
  inner, params = compressor_and_params(tx, params)
  if not isinstance(inner, CompressionTransformation) or inner.dense_axis_name is None:
    raise TypeError(f"tx must be a jaxcomp transformation built with dense_axis_name=..., got {tx!r}")
  tx, method, fast_name = inner, inner.method, inner.dense_axis_name
  f = positive_int("dense_axis_size", dense_axis_size, 1)
  stage = len(method.stages) if step is None else method.stage_at(step)
  full = method.buckets(params, stage or 0)
  flag = NONFINITE_FLAG_BYTES if not method.carries_nonfinite(params) else 0
  if not method.can_chunk:
    return {tx.axis_name: method.wire_bytes(params, step=step, workers=workers),
            fast_name: 4 * sum(b.length for b in full),
            "both": 0}
  chunks = hierarchy.chunked(full, f)

  def state():
    zeros = tuple(jnp.zeros((b.length,), jnp.float32) for b in chunks)
    return method.memory.init(zeros), tuple(b.exchange.init_bucket(b.segments, jax.random.PRNGKey(0))
                                            for b in chunks)

  stateful = bool(jax.tree.leaves(jax.eval_shape(state)))
  if stage is None:
    slow = 4 * sum(b.length for b in chunks)
  else:
    slow = sum(b.exchange.bucket_wire_bytes(b.segments, workers) for b in chunks)
  return {tx.axis_name: slow, fast_name: hierarchy.wire_bytes(full, f),
          "both": NONFINITE_FLAG_BYTES if (stateful or flag) else 0}



def traffic(tx: Any, params: Any, workers: int) -> list:
  """The collectives of ``tx``'s steady step over ``workers`` workers: one
  ``(kind, bytes handed)`` per bucket.

  From the bucket layout alone (no compile, any N): a scattered bucket is an
  all-to-all of ``workers`` chunk payloads and an all-gather of one; a psum-ed
  one (dense, fp16, random-k, PowerSGD's factors) an all-reduce; the others
  an all-gather of the bucket's payload; plus the non-finite flag's 4-byte
  all-reduce where the method needs it. Per kind, the bytes equal those of
  the compiled program (``jaxcomp.collective_bytes``; XLA may merge
  collectives of one kind). Fused methods (ACP-SGD) are not covered: measure
  their compiled program. ``tx`` may be any optax transformation holding one
  jaxcomp transformation (an ``optax.chain``...; see :func:`jaxcomp.compressor`).
  """
  tx, params = transformation(tx, params, "traffic")
  method = tx.method
  if method.fused is not None:
    raise ValueError(f"traffic: {method.name}'s fused exchange is not laid out per bucket; measure its"
                     " compiled program (jaxcomp.collective_bytes)")
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError(f"workers must be an int >= 1, got workers={workers!r}")
  steady = method.steady()
  out = []
  for b in steady.buckets(params):
    ex = b.exchange
    if isinstance(ex, ScatterExchange):
      first, second = chunk_payload_bytes(ex, b.segments, workers)
      out += [("all-to-all", workers * first), ("all-gather", second)]
    elif ex.all_reduces:
      out.append(("all-reduce", ex.bucket_wire_bytes(b.segments)))
    else:
      out.append(("all-gather", ex.bucket_wire_bytes(b.segments)))
  if not steady.carries_nonfinite(params):
    out.append(("all-reduce", NONFINITE_FLAG_BYTES))
  return out
