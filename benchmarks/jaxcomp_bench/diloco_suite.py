"""``python -m jaxcomp.bench diloco-suite``: DiLoCo's settings on the recipe suite's tasks, one held out.

``python -m jaxcomp.bench diloco-suite [--tasks digits,diabetes,...|all] [--codecs dense,topk,...]
[--outers avg,nesterov:0.7:0.9,...] [--sync-every 16] [--fragments 1] [--delay 0] [--alpha 0]
[--inner-lr 1] [--steps 1000] [--batch small] [--seed 0] [--out DIR] [--resume]
[--merge a.json,b.json [--only REGEX]]``

Every configuration (the product of the lists) trains each task of
:mod:`jaxcomp_bench.tasks` with :func:`jaxcomp.diloco` (8 workers under
``jax.pmap``, AdamW inside at the task's AdamW learning rate and
``jaxcomp.recipes.ADAMW``) beside data-parallel AdamW (``dp``: the dense mean
every step), at equal inner steps and batches. The score is the held-out
loss of the shared model (the anchor; dp: replica 0): test cross-entropy for
the classifiers (their accuracy is shown beside it), test mean squared error
for the regression, test loss for the language models, as its relative
change against dp. Target (:data:`TARGET`): within 2%.

- ``--codecs``: ``dense`` (the float32 mean), ``topk``, ``qsgd``, ``fp4`` (each at its factory's
  defaults, with its error feedback),
  ``sparseloco[:density=D][:decay=B][:bits=K][:chunk=C][:mean=workers|senders]``
  (:func:`jaxcomp.transforms.fp4.chunked_topk`, SparseLoCo's compressor).
- ``--inner-lr``: multiples of the task's AdamW learning rate for the inner AdamW (dp keeps 1).
- ``--outers``: ``avg`` (``optax.sgd(1)``: plain averaging), ``sgd:LR[:M]`` (heavy-ball momentum M),
  ``nesterov:LR:M`` (the paper's ``nesterov:0.7:0.9``).

The held-out rotation: for each task, the configuration with the smallest
worst gap on the other tasks, and its gap on the held-out one. ``--out DIR``
writes ``diloco_suite.json`` (appended as runs finish; ``--resume`` skips
what it holds) and ``diloco_suite.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import sys
import time
import traceback
from typing import Dict, List, Optional, Sequence

import numpy as np

from jaxcomp_bench.common import WORKERS, choose, header, markdown_table

AXIS = "data"
TARGET = 0.02
CODECS = ("dense", "topk", "qsgd", "fp4", "sparseloco")


@dataclasses.dataclass
class Run:
  task: str
  config: str  # "dp", or "codec/outer/H16/P1/d0/a0"
  steps: int
  batch: int
  seed: int = 0
  loss: float = float("nan")  # held-out loss of the shared model
  accuracy: float = float("nan")  # classifiers: test accuracy of the shared model
  replica_loss: float = float("nan")  # replica 0's own parameters
  bytes_per_step: float = -1.0  # one worker, averaged over a period
  seconds: float = float("nan")
  error: str = ""

  @property
  def key(self) -> tuple:
    return (self.task, self.config, self.steps, self.batch, self.seed)


def outer_optimizer(spec: str):
  """``avg``, ``sgd:LR[:M]`` or ``nesterov:LR:M`` as an optax optimizer."""
  import optax

  parts = spec.split(":")
  try:
    if parts == ["avg"]:
      return optax.sgd(1.0)
    if parts[0] == "sgd" and len(parts) in (2, 3):
      m = float(parts[2]) if len(parts) == 3 else 0.0
      return optax.sgd(float(parts[1]), momentum=m or None)
    if parts[0] == "nesterov" and len(parts) == 3:
      return optax.sgd(float(parts[1]), momentum=float(parts[2]), nesterov=True)
  except ValueError:
    pass
  raise SystemExit(f"--outers: each must be avg, sgd:LR[:M] or nesterov:LR:M, got {spec!r}")


def compressor(spec: str):
  """A codec spec of :data:`CODECS` (with ``sparseloco``'s settings) as a jaxcomp transformation."""
  import jaxcomp
  from jaxcomp.transforms.fp4 import chunked_topk

  name, *opts = spec.split(":")
  if name not in CODECS or (opts and name != "sparseloco"):
    raise SystemExit(f"--codecs: each must be one of {CODECS} (sparseloco[:density=D][:decay=B][:bits=K]"
                     f"[:chunk=C]), got {spec!r}")
  if name == "dense":
    return None
  if name != "sparseloco":
    return getattr(jaxcomp, name)(axis_name=AXIS)
  kw = {"density": 0.02, "bits": 2, "chunk": 4096, "decay": 0.95, "mean": "workers"}
  for o in opts:
    k, _, v = o.partition("=")
    if k not in kw:
      raise SystemExit(f"--codecs: sparseloco's settings are {sorted(kw)}, got {k!r} in {spec!r}")
    kw[k] = v if k == "mean" else type(kw[k])(float(v))
  return chunked_topk(axis_name=AXIS, **kw)


def config_name(codec: str, outer: str, h: int, p: int, delay: int, alpha: float, inner: float = 1.0) -> str:
  name = f"{codec}/{outer}/H{h}/P{p}/d{delay}/a{alpha:g}"
  return name if inner == 1.0 else f"{name}/i{inner:g}"


def optimizer(config: str, lr: float):
  """The optimizer of ``config`` (``dp`` or a :func:`config_name`), AdamW(lr) inside."""
  import optax

  import jaxcomp
  from jaxcomp.training.recipes import ADAMW

  if config == "dp":
    return optax.chain(jaxcomp.none(axis_name=AXIS), optax.adamw(lr, **ADAMW))
  codec, outer, h, p, d, a, *scale = config.split("/")
  inner = optax.adamw(lr * (float(scale[0][1:]) if scale else 1.0), **ADAMW)
  kw = {}
  if int(d[1:]) or float(a[1:]):
    kw = {"delay": int(d[1:]), "alpha": float(a[1:])}
  return jaxcomp.diloco(inner, outer_optimizer(outer), sync_every=int(h[1:]), compressor=compressor(codec),
                        axis_name=AXIS, fragments=int(p[1:]), **kw)


def _shared_model(P, S):
  """Replica 0's anchor (the shared model) if the state holds a DiLoCo state, else its parameters."""
  import jax

  from jaxcomp.training.diloco import DiLoCoState

  found = [x for x in jax.tree.leaves(S, is_leaf=lambda x: isinstance(x, DiLoCoState))
           if isinstance(x, DiLoCoState)]
  first = lambda t: jax.tree.map(lambda a: a[0], jax.device_get(t))  # noqa: E731
  return first(found[0].anchor if found else P), first(P)


def held_out(task, params, test) -> tuple:
  """(held-out loss, accuracy or nan) of ``params`` on ``task``'s test split."""
  import jax

  if task.kind == "classification":
    loss = float(jax.jit(task.loss)(params, *(np.asarray(a) for a in test)))
    return loss, float(task.metric(params, test))
  return float(task.metric(params, test)), float("nan")


def train(run: Run) -> Run:
  import jaxcomp
  from jaxcomp_bench.tasks import TASKS, fit

  t0 = time.perf_counter()
  try:
    task = TASKS[run.task]
    test = task.data()[1]
    params = task.init(run.seed)
    tx = optimizer(run.config, task.lr["adamw"])
    if run.config == "dp":
      run.bytes_per_step = float(jaxcomp.wire_bytes(tx, params, workers=WORKERS))
    else:
      h = int(run.config.split("/")[2][1:])
      run.bytes_per_step = sum(tx.bytes_at(t, params, workers=WORKERS) for t in range(h)) / h
    P, S, _, _ = fit(task, tx, params, run.steps, run.batch, run.seed)
    shared, replica = _shared_model(P, S)
    run.loss, run.accuracy = held_out(task, shared, test)
    run.replica_loss = held_out(task, replica, test)[0]
  except Exception as e:  # noqa: BLE001 -- one broken configuration must not stop the grid
    traceback.print_exc()
    run.error = f"{type(e).__name__}: {e}"
  run.seconds = time.perf_counter() - t0
  return run


def gap(run: Run, dp: Optional[Run]) -> float:
  """The held-out loss's relative change against dp (inf when either failed)."""
  if dp is None or run.error or dp.error or not (math.isfinite(run.loss) and math.isfinite(dp.loss)):
    return float("inf")
  return run.loss / dp.loss - 1.0


def _dp_of(by_key: Dict[tuple, Run], run: Run) -> Optional[Run]:
  return by_key.get((run.task, "dp", run.steps, run.batch, run.seed))


def table(runs: List[Run], held: Sequence[str] = ()) -> str:
  """A row per configuration, a column per task: dp's loss, then each gap (bold: over :data:`TARGET`)."""
  from jaxcomp_bench.tasks import TASKS

  by_key = {r.key: r for r in runs}
  cols = sorted({(r.task, r.steps, r.batch) for r in runs}, key=lambda c: (list(TASKS).index(c[0]), c[1:]))
  configs = list(dict.fromkeys(["dp"] + [r.config for r in runs]))
  rows = []
  for c in configs:
    row, worst, bytes_ = [f"`{c}`"], 0.0, ""
    for t, s, b in cols:
      r = by_key.get((t, c, s, b, runs[0].seed))
      if r is None:
        row.append("")
        continue
      bytes_ = bytes_ or f"{r.bytes_per_step:,.0f}"
      acc = f" ({100 * r.accuracy:.1f})" if math.isfinite(r.accuracy) else ""
      if c == "dp":
        row.append(f"{r.loss:.4f}{acc}")
        continue
      g = gap(r, _dp_of(by_key, r))
      worst = max(worst, g)
      text = "div" if g > 1.0 else f"{100 * g:+.1f}%{acc}"
      row.append(text if g <= TARGET + 1e-9 else f"**{text}**")
    rows.append(row + [("" if c == "dp" else ("div" if worst > 1 else f"{100 * worst:+.1f}%")), bytes_])
  head = (["config"] + [f"{t}{'*' if t in held else ''} {s} b{b}" for t, s, b in cols]
          + ["worst", "B/step (first task)"])
  return markdown_table(head, rows)


def rotation(runs: List[Run]) -> str:
  """Each task held out: the configuration best on the others (smallest worst gap), its held-out gap."""
  by_key = {r.key: r for r in runs}
  tasks = list(dict.fromkeys(r.task for r in runs))
  configs = [c for c in dict.fromkeys(r.config for r in runs) if c != "dp"]
  gaps = {(r.task, r.config): gap(r, _dp_of(by_key, r)) for r in runs if r.config != "dp"}
  if len(tasks) < 2 or not configs:
    return "(a rotation needs two tasks and a DiLoCo configuration)"
  rows = []
  for held in tasks:
    others = [t for t in tasks if t != held]
    score = {c: max(gaps.get((t, c), float("inf")) for t in others) for c in configs}
    best = min(configs, key=lambda c: (score[c], configs.index(c)))
    g = gaps.get((held, best), float("inf"))
    rows.append([held, f"`{best}`", f"{100 * score[best]:+.1f}%", f"{100 * g:+.1f}%",
                 "met" if g <= TARGET + 1e-9 else "missed"])
  return markdown_table(["held out", "best on the others", "its worst there", "on the held-out task",
                         f"within {100 * TARGET:g}%"], rows)


def main(argv: Optional[Sequence[str]] = None) -> List[Run]:
  import jaxcomp
  from jaxcomp_bench.tasks import TASKS

  p = argparse.ArgumentParser(prog="python -m jaxcomp.bench diloco-suite", description=__doc__.split("\n")[0])
  p.add_argument("--tasks", default="digits,diabetes,source,prose,mnist")
  p.add_argument("--codecs", default="dense")
  p.add_argument("--outers", default="avg,nesterov:0.7:0.9")
  p.add_argument("--sync-every", default="16")
  p.add_argument("--fragments", default="1")
  p.add_argument("--delay", default="0")
  p.add_argument("--alpha", default="0")
  p.add_argument("--inner-lr", default="1", help="multiples of the task's AdamW learning rate, inside")
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--batch", default="small", choices=("small", "large"))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  p.add_argument("--resume", action="store_true")
  p.add_argument("--merge", default="", help="comma-separated diloco_suite.json files: tables only")
  p.add_argument("--only", default="", help="with --merge: the configurations matching this regex (and dp)")
  args = p.parse_args(argv)
  command = "python -m jaxcomp.bench diloco-suite " + " ".join(argv if argv is not None else sys.argv[2:])
  if args.merge:
    runs = []
    for name in args.merge.split(","):
      with open(name) as f:
        runs += [Run(**r) for r in json.load(f)]
    runs = [r for r in {r.key: r for r in runs}.values()
            if r.config == "dp" or re.search(args.only, r.config)]
    print(table(runs) + "\n\n" + rotation(runs))
    return runs
  tasks = choose(args.tasks, list(TASKS), "tasks")
  codecs, outers = args.codecs.split(","), args.outers.split(",")
  for c in codecs:
    compressor(c)
  for o in outers:
    outer_optimizer(o)
  ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
  floats = lambda text: [float(x) for x in text.split(",")]  # noqa: E731
  grid = itertools.product(codecs, outers, ints(args.sync_every), ints(args.fragments), ints(args.delay),
                           floats(args.alpha), floats(args.inner_lr))
  configs = ["dp"] + [config_name(*g) for g in grid]
  todo = [Run(t, c, args.steps, TASKS[t].batches[0 if args.batch == "small" else 1], args.seed)
          for t in tasks for c in configs]
  jaxcomp.cpu_devices(WORKERS)
  path = os.path.join(args.out, "diloco_suite.json") if args.out else None
  done: List[Run] = []
  if path and args.resume and os.path.exists(path):
    with open(path) as f:
      done = [r for r in (Run(**r) for r in json.load(f)) if not r.error]
  have = {r.key for r in done}
  print(header(command.strip()))
  for i, run in enumerate([r for r in todo if r.key not in have]):
    train(run)
    done.append(run)
    print(f"[{i + 1}] {run.task} {run.config}: loss {run.loss:.4f} acc {run.accuracy:.4f} replica"
          f" {run.replica_loss:.4f} B/step {run.bytes_per_step:,.0f} {run.seconds:.1f}s {run.error[:80]}",
          flush=True)
    if path:
      os.makedirs(args.out, exist_ok=True)
      with open(path + ".tmp", "w") as f:
        json.dump([dataclasses.asdict(r) for r in done], f)
      os.replace(path + ".tmp", path)
  wanted = {r.key for r in todo}
  runs = [r for r in done if r.key in wanted]
  text = "\n\n".join([header(command.strip()), table(runs), rotation(runs)])
  print(text)
  if args.out:
    with open(os.path.join(args.out, "diloco_suite.md"), "w") as f:
      f.write(text + "\n")
  return runs
