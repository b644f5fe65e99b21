"""Deep Gradient Compression: sampled-threshold sparsification with momentum correction.

The defaults of :func:`dgc` are the paper's method with three of its four parts on:
momentum correction, momentum factor masking and a warm-up of the sparsity
(in steps, since an epoch's length is not known here). Local gradient
clipping is off by default (``clip_norm=None``): the paper clips at the
model's own global clipping threshold, a setting of the model, not of the
method, and any fixed absolute norm breaks scale-equivariance (gradients
of 1e-4 to 1e-7 per entry are never clipped by it, gradients of 1 always
are). With clipping off every part is scale-free: the output for ``c * g``
is ``c`` times the output for ``g`` (bit for bit at a power-of-two ``c``).
The paper's local clipping is one argument away: ``clip_norm=`` the global
threshold your model trains with (e.g. ``clip_norm=5.0``).

Per worker: with ``clip_norm``, the local gradient is clipped to global
norm ``clip_norm / sqrt(N)`` (the norm of the whole gradient, all leaves); the
momentum is corrected, ``u <- momentum * u + g`` and ``v <- v + u``; each
leaf's v is sparsified: the threshold is the ``ceil(ratio * s)``-th largest
``|v|`` of a strided sample of ``s = max(ceil(sample_ratio * n), 128)``
entries (a leaf of at most 16384 entries is its own sample, so its
selection is an exact top-k: the thresholds of a bucket's leaves are
adjusted together, and small leaves' few-entry samples would cost every
leaf extra counting passes), then scaled x1.3 / x0.7 up to 10 times until the count
is within 0.7-1.3 of ``k = max(1, ceil(ratio * n))`` (if it never is, the
threshold whose count was closest to k is used). The selected entries are
sent and zeroed in both v and u (momentum factor masking); everything else
stays. Leaves that travel dense (fewer than ``min_size`` entries, or
marked ``dense``) send all of v and keep their momentum u (no masking:
nothing is delayed there). The output is the mean of what the workers
sent: it already contains the momentum, so follow it with plain SGD
(``optax.sgd(lr)`` without momentum). Thresholds come from the finite
entries of v; a non-finite entry is reset to 0 in u and v (and the builder
turns that step's output into NaN, see :func:`jaxcomp.build`).

The payload is static: per leaf ``cap = ceil(1.3 * max_ratio * n)`` slots,
summed over the leaves of a bucket, of float32 values and bucket positions
(the narrowest integer dtype for the bucket) plus one int32 count per
bucket, all-gathered once per bucket. Entries past a leaf's ``cap`` (only
when the adjustments do not bring the count under 1.3 k; those sent are
the first in circular order from a random offset) stay in v and u. The
warm-up is a schedule of stages (:func:`jaxcomp.ratio_warmup`, built on
:func:`jaxcomp.staged`): each stage has the payload of its own density, so
the bytes shrink as the warm-up goes on; one compiled program holds every
stage (the thresholds estimated once, with the stage's ratio as data; the
selection, payload and all-gather switched on the stage), and ``u``, ``v``
carry over from stage to stage.
:func:`jaxcomp.wire_bytes` gives the bytes after the warm-up (``step=``
for a warm-up step's). A ratio schedule (a callable) is traced instead:
its payload is sized for ``max_ratio`` at every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import ops
from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import policy
from jaxcomp.core.builder import build
from jaxcomp.core.layout import Segments
from jaxcomp.core.memories import DGCMemory
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import Codec, Exchange, StepContext, flat_route
from jaxcomp.core.rebuild import staged
from jaxcomp.core.warmup import warmup_stages
from jaxcomp.exchanges.scatter import ScatterCodec, ScatterForm
from jaxcomp.kernels import rng
from jaxcomp.kernels.sparse import (
  count_selection,
  sent_mask,
  sparse_bytes,
  sparse_decode,
  sparse_kept,
  sparse_mean,
  sparse_payload,
  take,
  valid_indices,
)
from jaxcomp.kernels.thresholds import (
  passes,
  refine_thresholds,
  sample_bounds,
  sampled_thresholds,
  target,
)
from jaxcomp.transforms import _args
from jaxcomp.transforms.threshold import BLOCK

Schedule = Callable[[jax.Array], jax.Array]

WARMUP_START = 0.25  # DGC's first warm-up density (75% sparsity), divided by 4 per stage
CAPACITY_FACTOR = 1.3  # the adjusted count is within 1.3 k, the payload holds that many
WARMUP_STEPS = 1000  # the default warm-up, in steps (the paper's is 4 epochs)
CLIP_NORM = None  # the default: no local clipping (an absolute norm is not scale-free; see dgc())


def warmup_schedule(ratio: float, warmup_steps: int, stages: int = 4) -> Schedule:
  """DGC's exponential warm-up of sparsity: density ``0.25 ** (stage + 1)``, then ``ratio``.

  The first ``warmup_steps`` steps are split into ``stages`` equal stages; in
  stage i (0-based) the density is ``max(ratio, 0.25 ** (i + 1))``, and from
  ``warmup_steps`` on it is ``ratio``. With ``ratio=0.001`` and 4 stages this
  is DGC's 75%, 93.75%, 98.4375%, 99.6%, then 99.9% sparsity.
  """
  r = _args.ratio("ratio", ratio)
  w = _args.integer("warmup_steps", warmup_steps, 1)
  st = _args.integer("stages", stages, 1)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    stage = jnp.minimum(jnp.floor(step * st / w), st - 1)
    density = jnp.maximum(jnp.float32(WARMUP_START) ** (stage + 1), r)
    return jnp.where(step < w, density, jnp.float32(r))

  return schedule


def magnitude(x):
  """``|x|``, non-finite entries 0: what DGC's thresholds select from."""
  return jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)


def capacity(n: int, max_ratio: float) -> int:
  """Payload slots for a leaf of n entries: ``ceil(1.3 * max_ratio * n)``, at most n."""
  return _args.ratio_count(min(1.0, CAPACITY_FACTOR * max_ratio), n)


@dataclasses.dataclass(frozen=True)
class DGCExchange(Exchange, ScatterForm):
  """Sampled threshold per leaf, adjusted to ``0.7-1.3 k``; one fixed-capacity payload per bucket.

  Works on the whole bucket: the thresholds of all its leaves (segments) are
  estimated from one sort of their samples and adjusted by counting passes
  over the bucket, the mask is capped per segment and compacted once, and the
  payload (values, bucket positions, count) is all-gathered in one collective.
  """

  schedule: Schedule
  max_ratio: float
  sample_ratio: float
  block = BLOCK

  def caps(self, segs: Segments) -> np.ndarray:
    return np.asarray([capacity(n, self.max_ratio) for n in segs.sizes], np.int64)

  def ratio(self, count):
    return jnp.clip(jnp.asarray(self.schedule(count), jnp.float32), 0.0, self.max_ratio)

  def thresholds(self, x, key, ratio, segs: Segments, bounds=None):
    """``(|x|, per-segment thresholds)``: sampled, then adjusted to 0.7-1.3 k.

    ``bounds``: the sample ranks' upper bounds (:func:`sample_bounds`), as data; None: this
    exchange's (``max_ratio``).
    """
    thr = sampled_thresholds(x, segs, rng.word_ints(key, 0, segs.sizes), ratio,
                             self.max_ratio if bounds is None else bounds, self.sample_ratio,
                             magnitude=magnitude)
    k = jnp.maximum(target(ratio, np.asarray(segs.sizes, np.float32)), 1.0)
    thr, x = refine_thresholds(x, thr, k, segs, low=0.7, high=1.3, up=1.3, down=0.7, iterations=10,
                               magnitude=magnitude)
    return magnitude(x), thr

  def payload(self, x, a, thr, key, segs: Segments):
    """What the thresholds select, at most this exchange's capacity per segment."""
    return self.counted_payload(x, self.counted(a, thr, key, segs), segs)

  @staticmethod
  def counted(a, thr, key, segs: Segments):
    """The mask the thresholds select, counted (:func:`count_selection`): the same at every stage."""
    return count_selection(passes(a, segs.spread(thr)), segs, key, word=1)

  def counted_payload(self, x, counted, segs: Segments):
    """:meth:`payload` from the counted mask: its compaction at this exchange's capacity."""
    idx, count = take(counted, segs, self.caps(segs))
    return sparse_payload(x, idx, count, segs.length)

  def encode(self, x, key, ratio, segs: Segments):
    a, thr = self.thresholds(x, key, ratio, segs)
    return self.payload(x, a, thr, key, segs)

  def init_bucket(self, segs, key):
    return ()

  def exchange(self, x, segs, extra, ctx: StepContext):
    payload = self.encode(x, jax.random.fold_in(ctx.key, ctx.axis.index), self.ratio(ctx.count), segs)
    mean, mask = self._send(x, payload, segs, ctx)
    return mean, jnp.where(mask, x, 0.0), extra

  def _send(self, x, payload, segs, ctx: StepContext):
    """``(mean, mask)`` of a payload: all-gathered and averaged; what left this worker is ``x`` where the
    byte mask is set (a switch over stages hands the mask out, a float32 bucket fewer)."""
    n = segs.length
    mask = sent_mask(n, valid_indices(payload[1], payload[2], n))
    if ctx.axis.name is None:
      return jnp.where(mask, x, 0.0), mask
    return sparse_mean(ops.allgather_payload(payload, ctx.axis), n, ctx.axis.size), mask

  def stage_thresholds(self, stages, ratios, index, x, key, segs: Segments):
    """:meth:`thresholds` of ``stages[index]`` (this one first; ``ratios`` theirs), estimated once with
    the stage's ratio and sample bounds as data; None where the stages' sample ratios differ."""
    if any(ex.sample_ratio != self.sample_ratio for ex in stages):
      return None
    bounds = jnp.asarray(np.stack([sample_bounds(segs, ex.max_ratio, ex.sample_ratio) for ex in stages]))
    return self.thresholds(x, key, jnp.stack(ratios)[index], segs, bounds[index])

  def exchange_stages(self, stages, index, x, segs, extra, ctx: StepContext):
    """The exchange of ``stages[index]`` (DGC exchanges of a warm-up, this one first).

    The stages differ in their ratio and capacity only: the thresholds are
    estimated once with the stage's ratio as data and the mask they select is
    counted once; only its compaction, the payload and the all-gather (each
    stage's own capacity) are switched on the stage.
    """
    key = jax.random.fold_in(ctx.key, ctx.axis.index)
    shared = self.stage_thresholds(stages, [ex.ratio(ctx.count) for ex in stages], index, x, key, segs)
    if shared is None:
      return super().exchange_stages(stages, index, x, segs, extra, ctx)
    counted = self.counted(*shared, key, segs)

    def send(ex):
      return ops.varying(self._send(x, ex.counted_payload(x, counted, segs), segs, ctx), ctx.axis)

    mean, mask = lax.switch(index, [lambda ex=ex: send(ex) for ex in stages])
    return mean, jnp.where(mask, x, 0.0), extra

  def bucket_wire_bytes(self, segs, workers=None):
    return sparse_bytes(segs.length, int(self.caps(segs).sum()))

  def scatter_codec(self, ctx: StepContext | None) -> "DGCCodec":
    """This step's selection as a codec, for ``transport="scatter"`` (``ctx`` None: for sizes only)."""
    return DGCCodec(self, self.max_ratio if ctx is None else self.ratio(ctx.count))


class DGCCodec(Codec, ScatterCodec):
  """DGC's sampled-threshold selection at one step's ratio, in the codec form (the scatter exchange's)."""

  leaf_segments = False  # transport="scatter": one budget per chunk

  def __init__(self, exchange: DGCExchange, ratio):
    self.exchange, self.ratio, self.block = exchange, ratio, exchange.block

  def encode(self, x, key, segs):
    return self.exchange.encode(x, key, self.ratio, segs)

  def prepare_stages(self, codecs, index, x, key, segs):
    """The mask of the running stage's thresholds, estimated once (its ratio and sample bounds as data)
    and counted once, as :meth:`DGCExchange.exchange_stages` does; None where the stages' sample
    ratios differ."""
    shared = self.exchange.stage_thresholds([c.exchange for c in codecs], [c.ratio for c in codecs], index,
                                            x, key, segs)
    return None if shared is None else self.exchange.counted(*shared, key, segs)

  def encode_prepared(self, x, prepared, key, segs):
    if prepared is None:
      return self.encode(x, key, segs)
    return self.exchange.counted_payload(x, prepared, segs)

  def decode(self, payload, key, segs):
    return sparse_decode(*payload, segs.length)

  def sent(self, x, payload, key, segs):
    return sparse_kept(x, payload, segs.length)

  def aggregate(self, gathered, key, segs, num):
    return sparse_mean(gathered, segs.length, num)


@_args.factory
def dgc(ratio: float | Schedule = 0.001, *, axis_name: AxisName = None, momentum: float = 0.9,
        sample_ratio: float = 0.01, warmup_steps: int | None = None, max_ratio: float | None = None,
        clip_norm: float | None = CLIP_NORM, seed: int = 0, bucket_bytes: int | None = None,
        min_size: int | None = None, dense=None, dense_axis_name=None, transport: str = "gather"):
  """Deep Gradient Compression: momentum correction, factor masking, local clipping, warm-up.

  The paper's method with three of its four parts on (local clipping is off
  by default, see ``clip_norm``); the algorithm, its payload and its warm-up
  are described in :mod:`jaxcomp.transforms.dgc`. The output already holds
  the momentum: follow it with plain SGD (``optax.sgd(lr)``).

  Args:
    ratio: density sent, in (0, 1] (DGC: 0.001; GRACE's code defaults to 0.3),
      or a schedule ``step -> ratio`` (e.g. an optax schedule; then
      ``max_ratio`` is required and the schedule is clipped to it).
    axis_name: the data-parallel axis, or None.
    momentum: the momentum m of the correction, in [0, 1) (DGC trains with
      0.9, GRACE's DGC memory default is 0.9 too).
    sample_ratio: sample size as a fraction of n, in (0, 1] (DGC: 0.001-0.01;
      GRACE: 0.01).
    warmup_steps: with a float ratio, DGC's exponential warm-up of sparsity
      (75%, 93.75%, 98.4375%, 99.6%, then ``1 - ratio``) over this many steps
      (:func:`jaxcomp.warmup_stages`, four equal stages). None (default) means
      1000 steps with a float ratio (the paper warms up over 4 epochs: set 4
      epochs' worth of steps when you know them) and none with a schedule;
      0 disables it. Under ``transport="gather"`` the first stage's step
      receives every worker's payload (1.3 x 25% of the entries, values and
      positions): its temporaries grow with the number of workers, several
      times the gradient's size on 8; ``transport="scatter"`` keeps them flat in
      it (figures: ``benchmarks/warmup_memory.py``).
    max_ratio: the largest ratio a schedule produces, in (0, 1]; sizes the
      payload. Only with a schedule.
    clip_norm: local gradient clipping threshold (> 0, an absolute global
      norm) before the scaling by ``N ** -0.5``: set the global clipping
      threshold your model trains with (DGC, Sec. 3.3). None (default): no
      local clipping, so that the method is scale-free (an absolute default
      would clip every step at one gradient scale and never at another).
    seed: seeds the key (sample offsets).
    bucket_bytes: the bucket policy, see :func:`jaxcomp.build`.
    min_size: the bucket policy, see :func:`jaxcomp.build`; by default every leaf is compressed
      (``min_size=0``, :data:`jaxcomp.core.policy.EVERY_LEAF`).
    dense: the bucket policy, see :func:`jaxcomp.build`.
    dense_axis_name: a fast axis averaged densely before the compressed exchange (see
      :func:`jaxcomp.build` and :mod:`jaxcomp.exchanges.hierarchy`).
    transport: ``"gather"`` (all-gather the payloads) or ``"scatter"`` (bytes per
      worker flat in the number of workers), see :mod:`jaxcomp.exchanges.scatter`.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxcomp
    >>> params = {"w": jnp.zeros((256, 64))}
    >>> tx = jaxcomp.dgc(ratio=0.01)  # axis_name=None: one worker, a local round trip
    >>> jaxcomp.wire_bytes(tx, params)  # after the warm-up: 213 slots of values and uint16 positions
    1282

  References:
    Lin, Han, Mao, Wang & Dally, *Deep Gradient Compression: Reducing the
    Communication Bandwidth for Distributed Training*, ICLR 2018, Sec. 3
    and Algorithm 1 (momentum correction, local clipping, momentum factor
    masking, warm-up training).
  """
  m = _args.unit_interval("momentum", momentum)
  sr = _args.ratio("sample_ratio", sample_ratio)
  if warmup_steps is None:
    warmup_steps = 0 if callable(ratio) else WARMUP_STEPS
  w = _args.integer("warmup_steps", warmup_steps, 0, 2 ** 31 - 1)  # the step count is int32
  clip = None if clip_norm is None else _args.positive("clip_norm", clip_norm)
  schedule, top, fixed = _ratio_schedule(ratio, max_ratio, warmup_steps, w)
  if fixed is not None and w:  # DGC's exponential warm-up: stages of dgc at fixed densities
    return staged([(first, dgc(d, axis_name=axis_name, momentum=m, sample_ratio=sr, warmup_steps=0,
                                   max_ratio=None, clip_norm=clip, seed=seed, bucket_bytes=bucket_bytes,
                                   min_size=min_size, dense=dense, dense_axis_name=dense_axis_name,
                                   transport=transport))
                   for first, d in warmup_stages(fixed, w, start=WARMUP_START)])
  method = Method("dgc", flat_route(DGCExchange(schedule, top, sr)), DGCMemory(m, clip, axis_name),
                  min_size=policy.EVERY_LEAF)
  return build(method, axis_name, seed, bucket_bytes=bucket_bytes, min_size=min_size, dense=dense,
               dense_axis_name=dense_axis_name, transport=transport)


def _ratio_schedule(ratio, max_ratio, warmup_steps, w: int):
  """dgc's ``ratio`` and ``max_ratio``, checked: ``(schedule, its largest value, float ratio or None)``."""
  if callable(ratio):
    if max_ratio is None:
      raise ValueError("max_ratio is required when ratio is a schedule: it sizes the payload"
                       " (the largest ratio the schedule returns), in (0, 1]")
    schedule, top = ratio, _args.ratio("max_ratio", max_ratio)
    if w:
      raise ValueError(f"warmup_steps applies to a float ratio only; got warmup_steps={warmup_steps!r}"
                       " with a schedule (build the warm-up into the schedule)")
    return schedule, top, None
  r = _args.ratio("ratio", ratio)
  if max_ratio is not None:
    raise ValueError(f"max_ratio is only used with a schedule ratio; got max_ratio={max_ratio!r}"
                     f" with ratio={r!r}")
  return (lambda step: jnp.float32(r)), r, r
