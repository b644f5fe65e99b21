"""Transformations rebuilt from others: :func:`configure`, :func:`staged`, :func:`steady`."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Tuple

import numpy as np

from jaxcomp.collectives.axis import AxisName
from jaxcomp.core.builder import build
from jaxcomp.core.compression import CompressionTransformation, transformation
from jaxcomp.core.protocol import Memory


def configure(tx: Any, *, memory: Memory | None = None, start_step: int | None = None,
              dense_axis_name: AxisName = None, transport: str | None = None,
              loop_buckets: bool | None = None):
  """``tx`` rebuilt with another memory or a warm-up; every other setting kept.

  Args:
    tx: a jaxcomp transformation (from a factory).
    memory: replaces plain error feedback, e.g.
      :func:`jaxcomp.momentum_correction` or :func:`jaxcomp.ef21`; for
      methods whose memory is plain error feedback (on or off). Methods with
      a memory of their own (DGC, Signum, EF-signSGD, SBC, RedSync's momentum)
      refuse it.
    start_step: steps of dense exchange before compression starts (torch's
      ``start_powerSGD_iter``); the program holds both paths, compiled once.
    dense_axis_name: a fast axis averaged densely first (see :func:`build`);
      None keeps the transformation's.
    transport: ``"gather"`` or ``"scatter"`` (see :func:`build`); None keeps
      the transformation's.
    loop_buckets: True encodes the buckets of similar lengths by one loop over their stack, for
      codecs that can (top-k's exact selection with chunk16 positions; others bucket by
      bucket): compile time stops growing with their number, at the cost of the padding's
      work and the stack's write every step, and of the buckets' encodes no longer running
      side by side (docs/benchmarks.md, "One loop over the buckets").
      The same outputs, state and bytes, bit for bit. None keeps the transformation's.

  Returns:
    A new transformation; its state has the new memory's layout (call ``init`` again).
  """
  if not isinstance(tx, CompressionTransformation):
    raise TypeError(f"tx must be a jaxcomp transformation (built by a jaxcomp factory), got {tx!r}")
  method = tx.method
  if memory is not None:
    if not isinstance(memory, Memory):
      raise TypeError(f"memory must be a jaxcomp memory (jaxcomp.momentum_correction(), jaxcomp.ef21(),"
                      f" ...), got memory={memory!r}")
    current = method.memory
    if type(current) is not Memory or current.beta != 1.0 or current.gamma != 1.0:
      raise ValueError(
          f"memory= replaces plain error feedback, but {method.name} keeps a memory of its own"
          f" ({type(current).__name__}); use the method's own options instead")
    method = dataclasses.replace(method, memory=memory)
  if start_step is not None:
    if isinstance(start_step, bool) or not isinstance(start_step, (int, np.integer)) \
        or not 0 <= start_step < 2 ** 31:
      raise ValueError(f"start_step must be an int in [0, 2**31), got start_step={start_step!r}")
    method = dataclasses.replace(method, start_step=int(start_step))
  if loop_buckets is not None:
    if not isinstance(loop_buckets, (bool, np.bool_)):
      raise TypeError(f"loop_buckets must be True or False, got loop_buckets={loop_buckets!r}")
    method = dataclasses.replace(method, loop_buckets=bool(loop_buckets))
  if dense_axis_name is None:
    dense_axis_name = tx.dense_axis_name
  return build(method, tx.axis_name, tx.seed, dense_axis_name=dense_axis_name, transport=transport)


def staged(stages: Sequence[Tuple[int, Any]]) -> CompressionTransformation:
  """One transformation that runs ``tx_i`` from step ``s_i`` on: a schedule of a method's settings.

  ``jaxcomp.staged([(0, topk(0.25, axis_name="data")), (100, topk(0.01, axis_name="data"))])``
  sends 25% of the entries for 100 steps, then 1%. Each stage's payload has
  its own static size (the bytes shrink with the ratio, unlike a traced
  ratio that sizes the payload for its largest value), and one compiled
  program holds every stage (``lax.switch`` on the step count). The memory
  and the exchanges' state carry over from stage to stage. DGC's
  exponential warm-up is one case (:func:`jaxcomp.ratio_warmup`); a dense
  start is :func:`configure`'s ``start_step`` (it composes with this).

  Args:
    stages: ``(first step, tx)`` pairs, the first at step 0, first steps
      increasing; every ``tx`` from the same factory with the same
      ``axis_name``, memory and bucket policy (only settings that leave the
      state's shapes alike may change: a ratio, not PowerSGD's rank).

  Returns:
    A transformation like the first stage's; :func:`wire_bytes` gives the
    last stage's bytes (``step=`` for another step's).
  """
  try:
    pairs = [(first, tx) for first, tx in stages]
  except (TypeError, ValueError):
    raise TypeError(f"stages must be a sequence of (first step, tx) pairs, got stages={stages!r}") from None
  if not pairs:
    raise ValueError("stages must hold at least one (first step, tx) pair, got none")
  firsts = [f for f, _ in pairs]
  if any(isinstance(f, bool) or not isinstance(f, (int, np.integer)) for f in firsts) or firsts[0] != 0 \
      or any(b <= a for a, b in zip(firsts, firsts[1:])) or firsts[-1] >= 2 ** 31:
    raise ValueError(f"stages: the first steps must be ints starting at 0 and increasing (below 2**31),"
                     f" got {firsts}")
  methods = []
  for f, tx in pairs:
    if not isinstance(tx, CompressionTransformation):
      raise TypeError(f"stages: the stage from step {f} is not a jaxcomp transformation: {tx!r}")
    m = tx.method
    if m.fused is not None or m.stages or m.start_step:
      raise ValueError(f"stages: the stage from step {f} ({m.name}) is fused, staged or has a start_step;"
                       " stage plain transformations (add a dense start with configure(start_step=))")
    methods.append(m)
  head, tx0 = methods[0], pairs[0][1]
  for (f, tx), m in zip(pairs[1:], methods[1:]):
    same = (m.name == head.name and tx.axis_name == tx0.axis_name
            and tx.dense_axis_name == tx0.dense_axis_name
            and type(m.memory) is type(head.memory) and vars(m.memory) == vars(head.memory)
            and (m.bucket_bytes, m.min_size, m.transport)
            == (head.bucket_bytes, head.min_size, head.transport))
    if not same:
      raise ValueError(
          f"stages: the stage from step {f} ({m.name}) differs from the first ({head.name}) in the"
          " method, axis_name, memory, transport or bucket policy; only the method's other settings"
          " may change")
  method = dataclasses.replace(head, stages=tuple((f, m.route) for f, m in zip(firsts[1:], methods[1:])))
  return build(method, tx0.axis_name, tx0.seed, dense_axis_name=tx0.dense_axis_name)


def steady(tx: Any, params: Any = None) -> CompressionTransformation:
  """``tx`` after its warm-up: its last stage alone, without a dense start.

  For measuring the steady state (its compiled program holds one stage's
  collectives, where ``tx``'s holds every stage's); ``tx`` itself is returned
  when it has no warm-up. The state is alike, so one carries over to the other.

  ``tx`` may also be a complete optimizer (its ``.compressor``) or any optax
  transformation holding one jaxcomp transformation (an ``optax.chain``...):
  then pass ``params`` to find it (see :func:`compressor`), and the result is
  the steady jaxcomp transformation alone, not the chain.
  """
  tx = transformation(tx, params, "steady")[0]
  method = tx.method
  if not method.stages and not method.start_step:
    return tx
  return build(method.steady(), tx.axis_name, tx.seed, dense_axis_name=tx.dense_axis_name)
