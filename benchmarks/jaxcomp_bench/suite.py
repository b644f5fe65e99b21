"""``python -m jaxcomp.bench suite``: every recipe on a suite of five real tasks, held-out rotations.

``python -m jaxcomp.bench suite [--tasks digits,mnist,...|all] [--methods a,b|all]
[--optimizer sgd|adamw|both] [--steps 300,1000] [--batch small,large] [--transport gather,scatter]
(scatter: SGD only)
[--seed 0] [--out DIR] [--quick]``

Each run trains one method through ``jaxcomp.recipe(name, lr, axis_name="data",
optimizer=..., total_steps=steps)`` at its defaults on one task
(:mod:`jaxcomp_bench.tasks`) with ``jax.pmap`` over 8 CPU devices, at one
horizon, per-worker batch and transport, and compares the test metric with the
dense baseline's (``none``) of the same configuration: points of accuracy for
classification, the relative change of the test loss for regression and the
language models. Targets (:data:`TARGETS`): classification within 1 point
(random-k 2); losses within 3% at 300 steps, 2% at 1000.

Also per run: the bytes one worker sends per step in the steady state
(``jaxcomp.wire_bytes``) and the same recipe's bytes with every leaf compressed
(``min_size=1``): the leaf policy may not send more than 1.15x that.

The held-out rotation (``--rotate``): for each task, the recipe's pass rate on
the other four beside its pass rate on the held-out one; a recipe chosen on four
tasks that fails on the fifth shows here. ``--out DIR`` writes ``suite.json``
(one record per run, appended as runs finish, so a long suite can be resumed
with ``--resume``) and ``suite.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from jaxcomp_bench.common import WORKERS, choose, header, markdown_table

TRANSPORTS = ("gather", "scatter")
HORIZONS = (300, 1000)
EVERY_LEAF_LIMIT = 1.15
DIVERGED = 1.0  # a loss more than doubled (or not finite) shows as "div"
CLEAR_EVERY = 50  # runs between clearing JAX's caches


def target(kind: str, method: str, steps: int) -> float:
  """The allowed shortfall: accuracy points (classification) or relative loss (regression, lm)."""
  if kind == "classification":
    return 0.02 if method == "randomk" else 0.01
  return 0.03 if steps < 1000 else 0.02


@dataclasses.dataclass
class Run:
  task: str
  method: str
  optimizer: str
  steps: int
  batch: int
  transport: str = "gather"
  seed: int = 0
  metric: float = float("nan")
  train_loss: float = float("nan")  # mean of the last 10% of steps, over workers
  bytes: int = -1  # steady state, per worker per step
  every_leaf_bytes: int = -1  # the same recipe with min_size=0 (-1: the method has no leaf policy)
  replica_spread: float = float("nan")  # the largest difference of a parameter between two workers at the end
  seconds: float = float("nan")
  compile_seconds: float = float("nan")
  error: str = ""

  @property
  def key(self) -> tuple:
    return (self.task, self.method, self.optimizer, self.steps, self.batch, self.transport, self.seed)


def _recipe(name, task, optimizer, steps, transport, **kw):
  import jaxcomp

  if transport != "gather":
    kw["transport"] = transport
  return jaxcomp.recipe(name, task.lr[optimizer], axis_name="data", optimizer=optimizer,
                        total_steps=steps, **kw)


def _every_leaf_bytes(name, task, optimizer, steps, transport, params) -> int:
  import inspect

  import jaxcomp

  factory = jaxcomp.METHODS.get(name)
  if factory is None or "min_size" not in inspect.signature(factory).parameters:
    return -1
  return int(jaxcomp.wire_bytes(_recipe(name, task, optimizer, steps, transport, min_size=1), params,
                                workers=WORKERS))


def train(run: Run, chunk: int = 100) -> Run:
  """Trains ``run``'s configuration and fills in its metric, bytes and times (errors in ``run.error``)."""
  import jax

  import jaxcomp
  from jaxcomp_bench.tasks import TASKS, fit

  t0 = time.perf_counter()
  try:
    task = TASKS[run.task]
    test_split = task.data()[1]
    params = task.init(run.seed)
    tx = _recipe(run.method, task, run.optimizer, run.steps, run.transport)
    run.bytes = int(jaxcomp.wire_bytes(tx, params, workers=WORKERS))
    run.every_leaf_bytes = _every_leaf_bytes(run.method, task, run.optimizer, run.steps, run.transport,
                                             params)
    P, _, losses, run.compile_seconds = fit(task, tx, params, run.steps, run.batch, run.seed, chunk)
    run.train_loss = float(np.mean(losses[:, -max(1, run.steps // 10):]))
    host = jax.device_get(P)
    run.replica_spread = max(float(np.max(np.abs(a - a[:1]), initial=0.0)) for a in jax.tree.leaves(host))
    run.metric = float(task.metric(jax.tree.map(lambda a: a[0], host), test_split))
  except Exception as e:  # noqa: BLE001 -- one broken configuration must not stop the suite
    traceback.print_exc()
    run.error = f"{type(e).__name__}: {e}"
  run.seconds = time.perf_counter() - t0
  return run


# ----------------------------------------------------------------------------
# Scores


def shortfall(run: Run, dense: Run, kind: str) -> float:
  """How far ``run`` is behind ``dense``: accuracy points lost, or the relative rise of the loss."""
  if not math.isfinite(run.metric) or run.error:
    return float("inf")
  if kind == "classification":
    return dense.metric - run.metric
  return run.metric / dense.metric - 1.0


def passes(run: Run, dense: Run, kind: str) -> bool:
  return shortfall(run, dense, kind) <= target(kind, run.method, run.steps) + 1e-9


def _dense_of(runs: Dict[tuple, Run], run: Run) -> Optional[Run]:
  k = list(run.key)
  k[1], k[5] = "none", "gather"  # dense is the same with either transport (it all-reduces)
  return runs.get(tuple(k))


def _cell(run: Run, dense: Optional[Run], kind: str) -> str:
  if run.error:
    return "n/a" if "transport" in run.error else "error"
  if dense is None or run.method == "none":
    return f"{100 * run.metric:.1f}" if kind == "classification" else f"{run.metric:.4f}"
  s = shortfall(run, dense, kind)
  if s == float("inf") or (kind != "classification" and s > DIVERGED):
    text = "div"
  else:
    text = f"{-100 * s:+.1f}" if kind == "classification" else f"{100 * s:+.1f}%"
  return text if passes(run, dense, kind) else f"**{text}**"


def table(runs: List[Run], held_out: Sequence[str] = ()) -> str:
  """One table per optimizer: a row per method, a column per task x horizon x batch x transport.

  Cells: dense's metric (accuracy %, or the test loss), then each method's shortfall against it
  (accuracy points, or the loss's relative change); bold where it misses :func:`target`; ``n/a``: the
  method has no such transport. Tasks in ``held_out`` are starred.
  """
  from jaxcomp_bench.tasks import TASKS

  by_key = {r.key: r for r in runs}
  out = []
  for opt in [o for o in ("sgd", "adamw") if any(r.optimizer == o for r in runs)]:
    mine = [r for r in runs if r.optimizer == opt]
    cols = sorted({(r.task, r.steps, r.batch, r.transport) for r in mine},
                  key=lambda c: (list(TASKS).index(c[0]), c[1], c[2], c[3]))
    methods = list(dict.fromkeys(["none"] + [r.method for r in mine]))
    head = [f"{opt}"] + [f"{t}{'*' if t in held_out else ''} {s} b{b}{' sc' if tr == 'scatter' else ''}"
                         for t, s, b, tr in cols]
    rows = []
    for m in methods:
      row = [f"`{m}`"]
      for t, s, b, tr in cols:
        r = by_key.get((t, m, opt, s, b, tr, mine[0].seed))
        row.append("" if r is None else _cell(r, _dense_of(by_key, r), TASKS[t].kind))
      if any(row[1:]):
        rows.append(row)
    out.append(markdown_table(head, rows))
  return "\n\n".join(out)


def bytes_table(runs: List[Run]) -> str:
  """Bytes one worker sends per step (steady state), per method and optimizer, task and transport.

  They do not depend on the horizon or the batch; beside each, its ratio to the same recipe with
  every leaf compressed where that differs (at most :data:`EVERY_LEAF_LIMIT`).
  """
  from jaxcomp_bench.tasks import TASKS

  cols = sorted({(r.task, r.transport) for r in runs}, key=lambda c: (list(TASKS).index(c[0]), c[1]))
  rows = []
  for m, o in dict.fromkeys((r.method, r.optimizer) for r in runs):
    row = [f"`{m}`", o]
    for t, tr in cols:
      r = next((r for r in runs if (r.method, r.optimizer, r.task, r.transport) == (m, o, t, tr)
                and r.bytes >= 0), None)
      cell = "" if r is None else f"{r.bytes:,}"
      if r is not None and r.every_leaf_bytes > 0 and r.bytes != r.every_leaf_bytes:
        cell += f" ({r.bytes / r.every_leaf_bytes:.2f}x)"
      row.append(cell)
    if any(row[2:]):
      rows.append(row)
  head = ["method", "opt"] + [f"{t}{' sc' if tr == 'scatter' else ''}" for t, tr in cols]
  return markdown_table(head, rows)


def summary(runs: List[Run]) -> Dict[str, Any]:
  """Pass counts per task, and the bytes check (at most 1.15x every leaf compressed)."""
  from jaxcomp_bench.tasks import TASKS

  by_key = {r.key: r for r in runs}
  out: Dict[str, Any] = {}
  fails, over = [], []
  for r in runs:
    if r.method == "none" or "transport" in r.error:
      continue
    dense = _dense_of(by_key, r)
    if dense is None:
      continue
    ok = passes(r, dense, TASKS[r.task].kind)
    t = out.setdefault(r.task, [0, 0])
    t[0] += ok
    t[1] += 1
    if not ok:
      fails.append(f"{r.method}/{r.optimizer}/{r.task}/{r.steps}/b{r.batch}/{r.transport}")
    if r.every_leaf_bytes > 0 and r.bytes > EVERY_LEAF_LIMIT * r.every_leaf_bytes:
      over.append(f"{r.method}/{r.optimizer}/{r.task}: {r.bytes / r.every_leaf_bytes:.2f}x")
  return {"passed": out, "failed": fails, "over_bytes": over}


def rotations(runs: List[Run]) -> str:
  """Each task held out in turn: pass rate on the other tasks beside the held-out task's."""
  from jaxcomp_bench.tasks import TASKS

  s = summary(runs)["passed"]
  rows = []
  for held in [t for t in TASKS if t in s]:
    tuned = [s[t] for t in s if t != held]
    a, b = sum(x[0] for x in tuned), sum(x[1] for x in tuned)
    rows.append([held, f"{a}/{b} ({100 * a / max(b, 1):.0f}%)",
                 f"{s[held][0]}/{s[held][1]} ({100 * s[held][0] / max(s[held][1], 1):.0f}%)"])
  return markdown_table(["held out", "passing on the other tasks", "passing on the held-out task"], rows)


# ----------------------------------------------------------------------------
# Command line


def plan(tasks, methods, optimizers, horizons, batches, transports, seed) -> List[Run]:
  """Every configuration, dense first in each (so each run has its baseline when it finishes)."""
  import jaxcomp
  from jaxcomp.training.recipes import ADAMW_RECIPES
  from jaxcomp_bench.tasks import TASKS

  out = []
  for t in tasks:
    task = TASKS[t]
    for o in [o for o in optimizers if o in task.optimizers]:
      names = [m for m in methods if m in (jaxcomp.METHODS if o == "sgd" else ADAMW_RECIPES)]
      for s in horizons:
        for b in batches:
          size = task.batches[0 if b == "small" else 1]
          for tr in [tr for tr in transports if o == "sgd" or tr == "gather"]:
            for m in ["none"] + [m for m in names if m != "none"]:
              if m == "none" and tr != "gather":
                continue
              out.append(Run(t, m, o, s, size, tr, seed))
  return out


def main(argv: Optional[Sequence[str]] = None) -> List[Run]:
  import jax

  import jaxcomp
  from jaxcomp.training.recipes import ADAMW_RECIPES
  from jaxcomp_bench.tasks import TASKS

  p = argparse.ArgumentParser(prog="python -m jaxcomp.bench suite", description=__doc__.split("\n")[0])
  p.add_argument("--tasks", default="all")
  p.add_argument("--methods", default="all")
  p.add_argument("--optimizer", default="both", choices=("sgd", "adamw", "both"))
  p.add_argument("--steps", default="300,1000", help="horizons, comma-separated")
  p.add_argument("--batch", default="small,large")
  p.add_argument("--transport", default="gather,scatter")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  p.add_argument("--resume", action="store_true", help="skip the runs already in --out's suite.json")
  p.add_argument("--quick", action="store_true", help="digits only, 100 steps, small batch, gather")
  p.add_argument("--shard", default="0/1", help="I/N: run every N-th configuration from the I-th"
                 " (processes side by side, each with its own --out)")
  p.add_argument("--merge", default="",
                 help="comma-separated suite.json files: print their table, train nothing")
  args = p.parse_args(argv)
  if args.quick:
    args.tasks, args.steps, args.batch, args.transport = "digits", "100", "small", "gather"
  names = list(dict.fromkeys(list(jaxcomp.METHODS) + list(ADAMW_RECIPES)))
  tasks = choose(args.tasks, list(TASKS), "tasks")
  methods = choose(args.methods, names, "methods")
  optimizers = ["sgd", "adamw"] if args.optimizer == "both" else [args.optimizer]
  horizons = [int(s) for s in args.steps.split(",")]
  batches = choose(args.batch, ["small", "large"], "batch")
  transports = choose(args.transport, list(TRANSPORTS), "transport")
  todo = plan(tasks, methods, optimizers, horizons, batches, transports, args.seed)
  try:
    shard, shards = (int(x) for x in args.shard.split("/"))
    assert 0 <= shard < shards
  except (ValueError, AssertionError):
    raise SystemExit(f"--shard must be I/N with 0 <= I < N, got {args.shard!r}") from None
  command = "python -m jaxcomp.bench suite " + " ".join(argv if argv is not None else sys.argv[2:])
  if args.merge:
    runs = []
    for name in args.merge.split(","):
      with open(name) as f:
        runs += [Run(**r) for r in json.load(f)]
    runs = list({r.key: r for r in runs}.values())
    print("\n\n".join([table(runs), rotations(runs), bytes_table(runs), json.dumps(summary(runs), indent=1)]))
    return runs
  todo = todo[shard::shards]
  jaxcomp.cpu_devices(WORKERS)
  done: List[Run] = []
  path = os.path.join(args.out, "suite.json") if args.out else None
  if path and args.resume and os.path.exists(path):
    with open(path) as f:
      done = [Run(**r) for r in json.load(f)]
  have = {r.key for r in done if not r.error}
  done = [r for r in done if not r.error]
  print(header(command.strip()))
  for i, run in enumerate([r for r in todo if r.key not in have]):
    if i and i % CLEAR_EVERY == 0:  # hundreds of programs in one process exhaust LLVM's mapped memory
      jax.clear_caches()
      gc.collect()
    train(run)
    done.append(run)
    print(f"[{i + 1}] {run.task} {run.method} {run.optimizer} {run.steps} b{run.batch} {run.transport}:"
          f" {run.metric:.4f} bytes {run.bytes} (every leaf {run.every_leaf_bytes}) {run.seconds:.1f}s"
          f" {run.error[:80]}", flush=True)
    if path:  # written whole after every run, then renamed: a killed suite leaves a readable file
      os.makedirs(args.out, exist_ok=True)
      with open(path + ".tmp", "w") as f:
        json.dump([dataclasses.asdict(r) for r in done], f)
      os.replace(path + ".tmp", path)
  wanted = {r.key for r in todo}
  runs = [r for r in done if r.key in wanted]
  text = "\n\n".join([header(command.strip()), table(runs), rotations(runs), bytes_table(runs),
                      json.dumps(summary(runs), indent=1)])
  print(text)
  if args.out:
    with open(os.path.join(args.out, "suite.md"), "w") as f:
      f.write(text + "\n")
  return runs
