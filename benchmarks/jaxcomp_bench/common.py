"""What the benchmark subcommands share (each subcommand imports from here, never from another one).

- the run header every table starts with (:func:`header`);
- timing on this machine: a jitted copy (:func:`time_copy`) and a jitted
  update with its state donated (:func:`time_update`), for ``kernels`` and
  ``network``; the extra rows of those two tables (:data:`VARIANTS`);
- the network model's stated inputs: compute time per step on one V100
  (:data:`COMPUTE`) and the models' names (:data:`LABELS`), for ``network``,
  ``scale`` and ``twolevel``;
- the training tasks' loop and columns (``train``, the CNN, and ``lm``, the
  transformer): :data:`WORKERS`, :func:`timed_steps`, the predicted step
  times of :func:`predicted_times`, :func:`fmt_bytes` and the plot style of
  :func:`style`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Dict, List

from jaxcomp.planning import netsim

# ----------------------------------------------------------------------------
# The header of every table


def machine() -> str:
  """This machine in one line: OS, architecture, CPU cores and processor."""
  return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores"
          f" ({platform.processor() or 'cpu'})")


def header(command: str) -> str:
  """Two lines: date, machine, JAX (backend, devices), the allocator; the command that printed the table."""
  import jax

  from jaxcomp_bench import malloc

  now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
  return (f"date: {now}; machine: {machine()}; jax {jax.__version__}"
          f" ({jax.default_backend()}, {jax.device_count()} devices); {malloc.setting()}\ncommand: {command}")


# ----------------------------------------------------------------------------
# Timing (kernels, network)

# Extra rows of the kernels and network tables: options of the methods that they track too.
VARIANTS: dict[str, tuple[str, dict]] = {
    "topk[chunked]": ("topk", {"ratio": 0.01, "selection": "chunked"}),
}


def run_times(call: Callable[[], object], reps: int) -> List[float]:
  """Seconds of each of ``reps`` calls, each waited for (no warm-up)."""
  import jax

  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - t)
  return times


def _median_time(call: Callable[[], object], reps: int) -> float:
  return statistics.median(run_times(call, reps))


def time_copy(grads, reps: int) -> float:
  """Median seconds of a jitted copy of ``grads`` into fresh buffers."""
  import jax
  import jax.numpy as jnp

  copy = jax.jit(lambda g: jax.tree.map(jnp.copy, g))
  jax.block_until_ready(copy(grads))
  return _median_time(lambda: copy(grads), reps)


def time_update(tx, grads, reps: int) -> float:
  """Median seconds of ``jit(tx.update)`` with the state donated, after one warm-up call."""
  import jax
  import jax.numpy as jnp

  # Distinct buffers per leaf: a state whose fields share one buffer (the same
  # zeros twice) cannot be donated ("donate the same buffer twice").
  state = jax.tree.map(jnp.copy, tx.init(grads))
  step = jax.jit(tx.update, donate_argnums=(1,))
  out, state = step(grads, state)
  jax.block_until_ready((out, state))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    out, state = step(grads, state)
    jax.block_until_ready((out, state))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


# ----------------------------------------------------------------------------
# The network model's stated inputs (network, scale, twolevel)

# Compute time per step (forward + backward) on one V100, seconds, with where it comes from.
RESNET50_V100_S = 112 / 367
BERT_LARGE_V100_S = 32 / 46.78
COMPUTE: dict[str, tuple[float, str]] = {
    "resnet50": (RESNET50_V100_S,
                 ("112 images / 367 img/s: NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5,"
                  " 1x V100 16GB, FP32, batch 112 (README 'Training performance: NVIDIA DGX-1"
                  " 16GB', configs.yml)")),
    "bert-base": (BERT_LARGE_V100_S * 109_482_240 / 335_141_888,
                  ("estimate: BERT-large's 32 seqs / 46.78 seq/s (NVIDIA DeepLearningExamples,"
                   " TensorFlow BERT README, pre-training seq 128, 1x V100 32GB, FP32, batch 32)"
                   " x 109.5M / 335.1M parameters (compute per token ~ parameters)")),
}
LABELS = {"resnet50": "ResNet-50", "bert-base": "BERT-base"}


# ----------------------------------------------------------------------------
# The training tasks (train, lm)

WORKERS = 8  # data-parallel workers: jax.pmap over this many CPU devices
BLOCK_EVERY = 8  # timed_steps reads the clock every this many steps
NETWORK_GBPS = (1, 10, 100)  # predicted_times: link bandwidths, Gb/s
NETWORK_WORKERS = (8, 32)  # predicted_times: workers


@dataclasses.dataclass
class TimedRun:
  """What :func:`timed_steps` returns."""

  params: Any  # the per-worker parameters after the last step (on device)
  losses: List[float]  # every step's loss, the mean over workers
  block_ends: List[int]  # the step counts at which the clock was read
  seconds: float  # the whole loop
  step_seconds: float  # the median over blocks of seconds per step


def timed_steps(compiled, P, S, first, rest, steps: int, desc: str, progress: bool) -> TimedRun:
  """Runs the compiled pmapped step on ``first`` and then every batch of ``rest`` (``steps`` in all).

  The step returns ``(params, state, per-worker loss)``. The clock is read every
  :data:`BLOCK_EVERY` steps and at the end, after waiting for the step (which also bounds the
  dispatch queue: DESIGN.md, JAX facts); the step time is the median over those blocks.
  """
  import jax
  import numpy as np
  from tqdm.auto import tqdm

  bar = tqdm(total=steps, desc=desc, disable=not progress, mininterval=1.0, dynamic_ncols=True,
             file=sys.stderr)
  t_train = time.perf_counter()
  P, S, loss = compiled(P, S, *first)
  jax.block_until_ready(loss)
  pending, losses, blocks, ends = [loss], [], [], []
  t_block, done, last = time.perf_counter(), 1, 1
  for batch in rest:
    P, S, loss = compiled(P, S, *batch)
    pending.append(loss)
    done += 1
    if done % BLOCK_EVERY == 0 or done == steps:
      jax.block_until_ready(loss)
      now = time.perf_counter()
      blocks.append((now - t_block) / (done - last))
      ends.append(done)
      t_block, last = now, done
      losses.extend(float(v) for v in np.asarray(jax.device_get(pending)).mean(axis=1))
      pending = []
      bar.update(done - bar.n)
      bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
  if pending:  # a single step
    losses.extend(float(v) for v in np.asarray(jax.device_get(pending)).mean(axis=1))
  jax.block_until_ready(P)
  bar.close()
  seconds = time.perf_counter() - t_train
  return TimedRun(P, losses, ends, seconds, float(np.median(blocks)) if blocks else seconds / steps)


def predicted_times(r, dense, latency: float) -> Dict[str, float]:
  """Predicted step time (s) per "{workers}w@{Gb/s}G" on a flat ring network (:mod:`jaxcomp.planning.netsim`).

  ``r`` and ``dense`` are a training task's results (``step_seconds``, and
  ``traffic``: one ``(kind, bytes)`` per collective of the compiled step).
  compute = the dense step measured in this run; compression = how much
  longer this method's step took than dense's (>= 0); communication = the
  collectives of the method's compiled step, priced by the alpha-beta model,
  no overlap. Per-worker payloads do not depend on the worker count, so the
  8-worker program's traffic is priced at 32 workers as well.
  """
  out = {}
  compression = max(0.0, r.step_seconds - dense.step_seconds)
  for n in NETWORK_WORKERS:
    for gbps in NETWORK_GBPS:
      net = netsim.flat(n, gbps, latency=latency)
      out[f"{n}w@{gbps}G"] = float(netsim.predict(r.traffic, net, dense.step_seconds, compression).total)
  return out


def fmt_bytes(b: float) -> str:
  """``b`` with thousands separators, or "-" for a negative (unknown) count."""
  return f"{b:,.0f}" if b >= 0 else "-"


def style(i: int) -> Dict[str, Any]:
  """Colour, marker and line style of the ``i``-th method in the figures (the same in train and lm)."""
  import matplotlib.pyplot as plt

  colors = plt.get_cmap("tab20").colors
  return {"color": colors[i % len(colors)], "marker": "osD^v<>ph*X"[i % 11],
          "linestyle": ("-", "--", ":")[(i // len(colors)) % 3]}


def colours(names: List[str]) -> Dict[str, Any]:
  """One colour per name, none reused (``turbo`` sampled evenly), for figures of many methods."""
  import matplotlib.pyplot as plt
  import numpy as np

  return dict(zip(names, plt.get_cmap("turbo")(np.linspace(0.03, 0.97, max(len(names), 1))), strict=False))


def label_points(ax, points: List[tuple], log_x: bool = True, fontsize: int = 7) -> None:
  """Labels ``(text, x, y)`` points of ``ax``: one label per group of points that would print on top of
  each other (within 3% in x on a log axis, 2% of the y range), each moved up until it overlaps no
  earlier label. Call it after the axes' scales and limits are set."""
  if not points:
    return
  ys = [p[2] for p in points]
  tol = 0.02 * ((max(ys) - min(ys)) or 1.0)
  near = (lambda a, b: b < a * 1.03) if log_x else (lambda a, b: abs(b - a) < 0.03 * (abs(a) or 1.0))
  groups: list = []
  for text, x, y in sorted(points, key=lambda p: p[1]):
    for g in groups:
      if abs(g[2] - y) < tol and near(g[1], x):
        g[0].append(text)
        break
    else:
      groups.append(([text], x, y))
  from matplotlib.text import Text

  renderer = ax.figure.canvas.get_renderer()
  boxes: list = []
  for texts, x, y in groups:  # each label moved up until its text overlaps no earlier label's
    for k in range(12):
      note = ax.annotate(", ".join(texts), (x, y), xytext=(4, 3 + 9 * k), textcoords="offset points",
                         fontsize=fontsize, arrowprops={"arrowstyle": "-", "lw": 0.4} if k else None)
      note.update_positions(renderer)  # the text's place is set at draw time otherwise
      box = Text.get_window_extent(note, renderer)  # the text alone, not its leader line
      if k == 11 or not any(box.overlaps(b) for b in boxes):
        break
      note.remove()
    boxes.append(box)


def frontier(points: List[tuple], higher_is_better: bool = True) -> List[tuple]:
  """The ``(text, x, y)`` points no other beats on both a smaller x and a better y, by x."""
  out, best = [], None
  for p in sorted(points, key=lambda p: (p[1], -p[2] if higher_is_better else p[2])):
    if best is None or (p[2] > best if higher_is_better else p[2] < best):
      out.append(p)
      best = p[2]
  return out


def plain(doc: str) -> str:
  """A module docstring as a command's ``--help`` text: reST roles and literals as plain words."""
  doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
  return re.sub(r"``([^`]+)``", r"\1", doc)


def markdown_table(head: List[str], rows: List[List[Any]]) -> str:
  """A markdown table whose columns are padded to their widest cell."""
  widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]

  def line(cells):
    return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(head), sep] + [line(r) for r in rows])


def choose(spec: str, allowed, what: str) -> List[str]:
  """``spec``: "all" or a comma-separated list of ``allowed``; others exit naming ``--what``."""
  items = list(allowed) if spec == "all" else [x for x in spec.split(",") if x]
  bad = [x for x in items if x not in allowed]
  if bad:
    raise SystemExit(f"--{what} must be 'all' or a comma-separated list of {sorted(allowed)}; got {bad}")
  return items
