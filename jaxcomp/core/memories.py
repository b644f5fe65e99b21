"""Momentum-aware error feedback for every codec: momentum correction, EF21 and EF21-SGDM.

Plain error feedback (:class:`jaxcomp.core.protocol.Memory`) followed by
``optax.sgd(lr, momentum=0.9)`` replays stale residuals through the outer
momentum. The memories here move the momentum before the compressor, so the
outer optimizer runs without one (``optax.sgd(lr)``). Pick one with
:func:`jaxcomp.configure` (``memory=``) or through :func:`jaxcomp.recipe`.

- :func:`momentum_correction`: each worker keeps ``u <- m u + g`` and error
  feedback acts on it (``v <- v + u``, send ``C(v)``, ``v <- v - sent``):
  DGC's momentum correction (Lin et al. 2018, Sec. 3.2) for any codec. With
  ``masking=True`` u is also zeroed where something was sent (DGC's factor
  masking, meant for sparsifiers).
- :func:`ef21`: EF21 (Richtárik, Sokolov & Fatkhullin 2021). Each worker
  keeps its gradient estimate ``g_i`` and sends ``C(grad - g_i)``; ``g_i``
  advances by what it sent and every worker advances the shared estimate
  ``g`` by the decoded mean, which is the output. With ``momentum=eta`` it is
  EF21-SGDM (Fatkhullin, Tyurin & Richtárik 2023, Algorithm 2): the worker
  first averages ``v_i <- (1 - eta) v_i + eta grad`` and compresses
  ``v_i - g_i``.

State lives in the bucket layout in float32 like every memory; non-finite
values never enter it (a non-finite step keeps the previous state).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives.axis import AxisName, current_axis
from jaxcomp.core.protocol import DENSE, Memory, zero_after
from jaxcomp.transforms import _args


class DGCState(NamedTuple):
  """DGC's memory: the corrected momentum ``u`` and the accumulation ``v``.

  Each field is in the bucket layout (one float32 vector per bucket); read
  them as trees like the parameters with :func:`jaxcomp.memory_tree`.
  """

  momentum: Any
  accumulation: Any


def dense_buckets(buckets, count: int) -> list:
  """One bool per bucket: True where the bucket travels dense (every entry is sent)."""
  if buckets is None:
    return [False] * count
  return [b.exchange is DENSE for b in buckets]


class DGCMemory(Memory):
  """Momentum correction, factor masking and local clipping (DGC Sec. 3.2-3.3).

  ``compensate``: clip g (optional; the norm is that of the whole local
  gradient, every bucket), ``u <- m u + g``, ``v <- v + u``; the exchange
  sends part of v. ``update``: zero v and u where v was sent (the sent
  entries are the nonzero entries of the local decode, since an exact zero is
  never selected); v keeps exactly what was not sent. The new u is the one
  ``compensate`` computed (handed over as its carry, ``MemoryStep.carry``),
  written after v (:func:`jaxcomp.core.protocol.zero_after`), so that neither
  buffer is read after it is overwritten and XLA needs no copy of the old
  state. A non-finite u is reset to 0 (as is v where v + u is not finite).

  Buckets that travel dense (leaves below ``min_size``, or marked ``dense``)
  send every entry: there v is emptied but u is not masked, so those leaves
  get plain momentum SGD (``u <- m u + g`` sent whole) instead of losing
  their momentum every step.
  """

  def __init__(self, momentum: float, clip_norm: float | None, axis_name: AxisName):
    super().__init__()
    self.momentum, self.clip_norm, self.axis_name = momentum, clip_norm, axis_name

  def init(self, params):
    # Two sets of buffers: a state whose fields share one cannot be donated.
    return DGCState(momentum=jax.tree.map(jnp.zeros_like, params),
                    accumulation=jax.tree.map(jnp.zeros_like, params))

  def _clip(self, grads):
    if self.clip_norm is None:
      return grads
    workers = current_axis(self.axis_name).size
    # Over every bucket, dense ones included: the norm of the whole local gradient (padding is 0).
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    limit = self.clip_norm / np.sqrt(workers)
    scale = jnp.where(jnp.isfinite(norm) & (norm > limit), limit / norm, 1.0)
    return jax.tree.map(lambda g: g * scale, grads)

  def compensate(self, grads, state):
    g = self._clip(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
    u = jax.tree.map(lambda u, g: self.momentum * u.astype(jnp.float32) + g, state.momentum, g)
    return jax.tree.map(lambda v, u: v.astype(jnp.float32) + u, state.accumulation, u), u

  def _accumulation(self, xb, sb, vb, dense: bool, dense_step):
    """v after the step: empty where sent (all of a dense bucket), x elsewhere; 0 where x is not finite."""
    v_dense = Memory.update(self, (xb,), (sb,), (vb,))[0]
    if dense:
      return v_dense
    v = jnp.where((sb == 0) & jnp.isfinite(xb), xb, 0.0).astype(vb.dtype)
    return v if dense_step is None else jnp.where(dense_step, v_dense, v)

  def update(self, x, sent, state, step=None):
    us, vs = [], []
    dense_step = step.dense_step  # a warm-up step (configure(start_step=)) sends every entry
    for xb, sb, vb, ub, uc, dense in zip(x, sent, state.accumulation, state.momentum, step.carry,
                                         self.unmasked(step.buckets, len(x))):
      v = self._accumulation(xb, sb, vb, dense, dense_step)
      after = zero_after(v)  # u is written after v, which reads the old u through x
      u_dense = jnp.where(jnp.isfinite(uc), uc + after, 0.0).astype(ub.dtype)
      if dense:
        u = u_dense
      else:
        u = jnp.where((sb == 0) & jnp.isfinite(uc), uc + after, 0.0).astype(ub.dtype)
        if dense_step is not None:  # a warm-up step sends every entry: no masking, as a dense bucket
          u = jnp.where(dense_step, u_dense, u)
      us.append(u)
      vs.append(v)
    return DGCState(momentum=tuple(us), accumulation=tuple(vs))

  def unmasked(self, buckets, count: int) -> list:
    """One bool per bucket: True where u is not masked (the dense buckets)."""
    return dense_buckets(buckets, count)

  def like_params(self, state):
    return state.momentum


class MomentumCorrection(DGCMemory):
  """``u <- m u + g``, ``v <- v + u``; the exchange sends part of v; v keeps the rest.

  v keeps exactly ``v - sent`` (what a quantized value lost included).
  ``masking``: zero u where the local decode is nonzero, as DGC does (dense
  buckets keep their momentum); RedSync's ``momentum=`` uses it. Without
  masking u is never reset: the mean over workers of what is sent sums to
  the momentum SGD direction, delayed by the residual.
  """

  def __init__(self, momentum: float, masking: bool):
    super().__init__(momentum, None, None)
    self.masking = bool(masking)

  def unmasked(self, buckets, count: int) -> list:
    return super().unmasked(buckets, count) if self.masking else [True] * count

  def _accumulation(self, xb, sb, vb, dense: bool, dense_step):
    # v keeps v - sent everywhere (DGC keeps 0 at sent entries, dropping what quantized values lost).
    return Memory.update(self, (xb,), (sb,), (vb,))[0]


def momentum_correction(momentum: float = 0.9, masking: bool = False) -> MomentumCorrection:
  """Momentum before the compressor, error feedback on it; follow with ``optax.sgd(lr)``.

  Args:
    momentum: m in [0, 1) (0.9 as the outer momentum it replaces).
    masking: DGC's momentum factor masking (zero u where sent); for
      sparsifiers. Off by default: with a codec that sends most entries
      (quantizers, signs) masking would discard the momentum every step.

  References:
    Lin, Han, Mao, Wang & Dally, *Deep Gradient Compression*, ICLR 2018,
    Sec. 3.2 (momentum correction, factor masking).
  """
  m = _args.unit_interval("momentum", momentum)
  return MomentumCorrection(m, _args.flag("masking", masking))


class EF21State(NamedTuple):
  """EF21's memory, each field one float32 vector per bucket.

  Attributes:
    estimate: this worker's gradient estimate ``g_i`` (advanced by what it sent).
    shared: the shared estimate ``g`` (advanced by the decoded mean; identical
      on every worker), which is the output.
    momentum: EF21-SGDM's ``v_i``, or ``()`` for EF21.
  """

  estimate: Any
  shared: Any
  momentum: Any


class EF21(Memory):
  """EF21 / EF21-SGDM: send ``C(v_i - g_i)``, ``g_i += sent``, ``g += mean``, output ``g``.

  ``v_i`` is the one ``compensate`` computed (its carry), kept where the step
  is finite and written after what was sent exists; the output is read from
  the new ``g``: so no buffer of the old state is read after it is
  overwritten, and XLA keeps no copy of it.
  """

  def __init__(self, momentum: float | None):
    super().__init__()
    self.eta = momentum

  def init(self, params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731 - distinct buffers (donation)
    return EF21State(estimate=zeros(), shared=zeros(), momentum=() if self.eta is None else zeros())

  def _velocity(self, grads, state):
    g = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    if self.eta is None:
      return g
    e = self.eta
    return jax.tree.map(lambda v, g: (1.0 - e) * v + e * g, state.momentum, g)

  def compensate(self, grads, state):
    v = self._velocity(grads, state)
    return jax.tree.map(lambda v, est: v - est, v, state.estimate), v

  def update(self, x, sent, state, step=None):
    mean, carry = step.mean, step.carry  # carry: compensate's v_i (EF21-SGDM's new velocity)
    ok = [jnp.isfinite(xb) for xb in x]
    # g_i advances by exactly the local decode (0 on a non-finite step).
    estimate = tuple(jnp.where(k, est + s, est) for k, est, s in zip(ok, state.estimate, sent))
    shared = tuple(jnp.where(jnp.isfinite(m), g + m, g) for g, m in zip(state.shared, mean))
    momentum = ()
    if self.eta is not None:  # v_i as compensated, kept where finite, written after the encode read it
      momentum = tuple(jnp.where(k, vc, v + zero_after(s))
                       for k, vc, v, s in zip(ok, carry, state.momentum, sent))
    return EF21State(estimate, shared, momentum)

  def like_params(self, state):
    return state.estimate

  def output(self, mean, state=None, new=None):
    if new is None:
      return tuple(g + m for g, m in zip(state.shared, mean))
    # g + m, read from the new g (g + m where m is finite, g where it is not)
    return tuple(jnp.where(jnp.isfinite(m), g, g + m) for g, m in zip(new.shared, mean))


def ef21(momentum: float | None = None) -> EF21:
  """EF21 (``momentum=None``) or EF21-SGDM (``momentum=eta``); follow with ``optax.sgd(lr)``.

  Args:
    momentum: None for EF21; eta in (0, 1] for EF21-SGDM's
      ``v_i <- (1 - eta) v_i + eta grad`` (the paper's analysis takes eta
      small; 0.1 corresponds to a momentum of 0.9).

  References:
    Richtárik, Sokolov & Fatkhullin, *EF21: A New, Simpler, Theoretically
    Better, and Practically Faster Error Feedback*, NeurIPS 2021, Algorithm 1;
    Fatkhullin, Tyurin & Richtárik, *Momentum Provably Improves Error
    Feedback!*, NeurIPS 2023, Algorithm 2 (EF21-SGDM).
  """
  if momentum is None:
    return EF21(None)
  eta = _args.unit_interval("momentum", momentum, closed_right=True)
  if eta == 0.0:
    raise ValueError(f"momentum must be None (EF21) or in (0, 1] (EF21-SGDM), got momentum={momentum!r}")
  return EF21(eta)


__all__ = ["EF21", "EF21State", "MomentumCorrection", "ef21", "momentum_correction"]
