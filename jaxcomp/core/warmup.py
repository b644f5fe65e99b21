"""Warm-up of the compression ratio: DGC's exponential schedule for any method with ``ratio=``.

Aggressive compression from the first step hurts while gradients are large
and change fast (Lin et al. 2018, Sec. 3.4). DGC's warm-up sends a density
of 25%, then 6.25%, 1.5625%, 0.390625%, each for a quarter of the warm-up,
then the target ratio. Here it is a schedule of stages
(:func:`jaxcomp.staged`): each stage its own static payload, so the bytes
shrink with the density, and one compiled program for all of them.
"""

from __future__ import annotations

import math
from typing import Callable, List, Tuple

from jaxcomp.core.rebuild import staged
from jaxcomp.transforms import _args

START = 0.25  # DGC's first warm-up density (75% sparsity), divided by 4 per stage


def warmup_stages(ratio: float, warmup_steps: int, stages: int = 4,
                  start: float = START) -> List[Tuple[int, float]]:
  """``(first step, density)`` of each stage of DGC's exponential warm-up.

  Stage ``i`` (0-based) of ``stages`` starts at step ``ceil(i * warmup_steps / stages)``
  with density ``max(ratio, start ** (i + 1))``; from ``warmup_steps`` on the
  density is ``ratio``. Stages whose density equals the previous one's are merged.
  """
  r = _args.ratio("ratio", ratio)
  w = _args.integer("warmup_steps", warmup_steps, 1)
  st = _args.integer("stages", stages, 1)
  s0 = _args.ratio("start", start)
  out: List[Tuple[int, float]] = []
  for first, density in [(math.ceil(i * w / st), max(r, s0 ** (i + 1))) for i in range(st)] + [(w, r)]:
    if out and out[-1][1] == density:
      continue
    if out and out[-1][0] == first:
      out[-1] = (first, density)
      continue
    out.append((first, density))
  return out


def ratio_warmup(factory: Callable, ratio: float, warmup_steps: int, *, stages: int = 4,
                 start: float = START, **kwargs):
  """``factory(ratio=..., **kwargs)`` through DGC's exponential warm-up of the density.

  ``jaxcomp.ratio_warmup(jaxcomp.topk, 0.01, 400, axis_name="data")``: top-k
  at 25%, 6.25%, 1.5625% (100 steps each), then 1% from step 300 on
  (:func:`warmup_stages`; a stage at or below ``ratio`` is the target).
  ``warmup_steps=0``: just ``factory(ratio=ratio, **kwargs)``.

  Args:
    factory: a jaxcomp factory with a ``ratio`` argument (topk, randomk,
      threshold, dgc, redsync, adaq, sbc).
    ratio: the density after the warm-up.
    warmup_steps: the warm-up's length in steps (DGC: 4 epochs).
    stages: how many warm-up stages (DGC: 4).
    start: the first stage's density (DGC: 0.25), raised to the power
      ``i + 1`` for stage ``i``.
    **kwargs: the factory's other settings (the same in every stage).

  Returns:
    A :func:`jaxcomp.staged` transformation; :func:`jaxcomp.wire_bytes` gives
    the bytes after the warm-up, ``step=`` a warm-up step's.

  References:
    Lin, Han, Mao, Wang & Dally, *Deep Gradient Compression*, ICLR 2018, Sec. 3.4.
  """
  w = _args.integer("warmup_steps", warmup_steps, 0, 2 ** 31 - 1)
  if w == 0:
    return factory(ratio=ratio, **kwargs)
  return staged([(first, factory(ratio=density, **kwargs))
                 for first, density in warmup_stages(ratio, w, stages, start)])
