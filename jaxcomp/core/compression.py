"""The transformation a jaxcomp factory returns, and finding it inside any optax wrapper.

A :class:`CompressionTransformation` is an ``optax.GradientTransformation``
that carries its :class:`Settings` (the :class:`jaxcomp.core.method.Method` and
the axes) as a declared field. :func:`method_of` and :func:`compressor` find
the one inside an ``optax.chain``, ``optax.MultiSteps``, a complete optimizer
(``jaxcomp.onebit_adam``) and any other optax wrapper.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import layout
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import CompressState


@dataclasses.dataclass(frozen=True)
class Settings:
  """What :func:`jaxcomp.build` fixed: the method (bucket policy and exchange form included) and the axes."""

  method: Method
  axis_name: AxisName = None
  dense_axis_name: AxisName = None
  seed: int = 0


class CompressionTransformation(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` that also carries its :class:`Settings`.

  ``settings`` is set at construction; ``method``, ``axis_name``,
  ``dense_axis_name``, ``transport`` and ``seed`` read it. ``signatures``:
  the gradient trees ``init`` saw (paths and shapes), which ``update``
  checks; kept here because the state holds arrays only.
  """

  settings: Settings
  signatures: list

  def __new__(cls, init, update, settings: Settings):
    self = super().__new__(cls, init, update)
    self.settings = settings
    self.signatures = []
    return self

  def __getnewargs__(self):  # copy and pickle pass the settings to __new__
    return (self.init, self.update, self.settings)

  @property
  def method(self) -> Method:
    return self.settings.method

  @property
  def axis_name(self) -> AxisName:
    return self.settings.axis_name

  @property
  def dense_axis_name(self) -> AxisName:
    return self.settings.dense_axis_name

  @property
  def transport(self) -> str:
    return self.settings.method.transport

  @property
  def seed(self) -> int:
    return self.settings.seed


class CompressedOptimizer(optax.GradientTransformationExtraArgs):
  """A complete optimizer that owns its exchange; ``.compressor`` is the jaxcomp transformation inside."""

  compressor: CompressionTransformation

  rounds = None
  """For optimizers whose steps differ (0/1 Adam): ``rounds(steps)`` lists what each step does."""

  bytes_at = None
  """For optimizers whose steps differ: ``bytes_at(step, params, workers)``, the bytes of ``step``."""

  def __new__(cls, init, update, compressor_: CompressionTransformation):
    self = super().__new__(cls, init, update)
    self.compressor = compressor_
    return self

  def __getnewargs__(self):
    return (self.init, self.update, self.compressor)


def compressed_optimizer(tx: optax.GradientTransformation, compressor_: Any) -> CompressedOptimizer:
  """``tx`` (e.g. an ``optax.chain``) labelled with the jaxcomp transformation that moves its payload."""
  return CompressedOptimizer(tx.init, tx.update, compressor_)


class _Recorders(threading.local):
  """Per thread: the lists collecting the jaxcomp transformations whose init runs (see compressor())."""

  def __init__(self):
    self.stack: list = []


_RECORDERS = _Recorders()


def record_init(tx: CompressionTransformation, params: Any) -> bool:
  """Inside :func:`compressor`'s search: note that ``tx.init`` ran on ``params`` and return True."""
  if not _RECORDERS.stack:
    return False
  if not any(t is tx for t, _ in _RECORDERS.stack[-1]):
    _RECORDERS.stack[-1].append((tx, params))  # optax.masked hands it only its leaves
  return True


@contextlib.contextmanager
def _recording():
  """Collects the jaxcomp transformations whose ``init`` runs inside the block in this thread."""
  found: list = []
  _RECORDERS.stack.append(found)
  try:
    yield found
  finally:
    _RECORDERS.stack.pop()


def compressor(tx: Any, params: Any = None) -> Any:
  """The jaxcomp transformation of ``tx``: itself, a complete optimizer's ``.compressor``, or the one inside.

  Complete optimizers that own their exchange (:func:`jaxcomp.onebit_adam`,
  :func:`jaxcomp.demo`) carry the jaxcomp transformation that moves their
  payload as ``.compressor``, so :func:`jaxcomp.wire_bytes` and the benches read it.
  Any other optax transformation (``optax.chain``, ``optax.MultiSteps``,
  ``optax.apply_if_finite``, ``optax.inject_hyperparams``, ...) is searched
  with ``params``: its ``init`` is traced (``jax.eval_shape``, nothing is
  computed) and the jaxcomp transformations whose ``init`` ran are the ones
  it holds; exactly one is expected.

  Without ``params`` a ``tx`` that is neither is returned unchanged.

  Raises:
    TypeError: ``params`` given and ``tx`` holds no jaxcomp transformation.
    ValueError: ``tx`` holds more than one.
  """
  return compressor_and_params(tx, params)[0]


def compressor_and_params(tx: Any, params: Any) -> tuple:
  """:func:`compressor`, and the parameters it sees: those of ``params`` it gets
  (``optax.masked``: its own).
  """
  if isinstance(tx, CompressionTransformation):
    return tx, params
  if isinstance(tx, CompressedOptimizer):
    return tx.compressor, params
  if params is None or not callable(getattr(tx, "init", None)):  # an optax transformation or MultiSteps
    return tx, params
  with _recording() as found:
    jax.eval_shape(lambda p: tx.init(p), params)  # a new function each time: no cached trace
  if not found:
    raise TypeError(f"tx holds no jaxcomp transformation (built by a jaxcomp factory): {tx!r}")
  if len(found) > 1:
    raise ValueError(
        f"tx holds {len(found)} jaxcomp transformations ({', '.join(t.method.name for t, _ in found)});"
        " pass the one to measure")
  inner, seen = found[0]
  return inner, jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), seen)


def transformation(tx: Any, params: Any = None, what: str = "tx") -> tuple:
  """``(jaxcomp transformation, its params)`` of ``tx``, or a TypeError naming the fix."""
  inner, params = compressor_and_params(tx, params)
  if isinstance(inner, CompressionTransformation):
    return inner, params
  if callable(getattr(tx, "init", None)) and params is None:
    raise TypeError(f"{what}: tx is not a jaxcomp transformation; for an optax transformation holding"
                    f" one (a chain...) pass the parameters, jaxcomp.{what}(tx, params), got {tx!r}")
  raise TypeError(f"tx must be a jaxcomp transformation (built by a jaxcomp factory), got {tx!r}")


def method_of(tx: Any, params: Any = None) -> Method:
  """The :class:`jaxcomp.core.method.Method` of ``tx`` (a jaxcomp transformation, a complete optimizer, or
  with ``params`` any optax transformation holding one, see :func:`compressor`)."""
  return transformation(tx, params, "method_of")[0].method


def memory_tree(tx: Any, state: CompressState, params: Any) -> Any:
  """The memory of ``state`` read as trees like ``params`` (float32), e.g. the residual.

  The state keeps the memory in the bucket layout; this cuts every bucket
  vector of it back into leaves (leaves no bucket holds, empty ones, are
  zeros). A memory with several fields (DGC's momentum and accumulation)
  gives the same structure with a tree in each field. A per-worker state
  (leading worker axis, :func:`jaxcomp.per_worker`) gives leaves with that
  axis in front.
  """
  buckets = method_of(tx).buckets(params)
  leaves, treedef = jax.tree.flatten(params)
  like = [jax.ShapeDtypeStruct(np.shape(x), jnp.float32) for x in leaves]

  def cut(vectors):
    return treedef.unflatten(layout.unpack(buckets, list(vectors), like))

  mem = state.memory
  if isinstance(mem, tuple) and hasattr(mem, "_fields"):
    return type(mem)(*(cut(f) for f in mem))
  if not jax.tree.leaves(mem):
    return mem
  return cut(mem)
