"""``python -m jaxcomp.bench lm --diloco``: syncing every H steps against data parallelism on the lm task.

``python -m jaxcomp.bench lm --diloco [--steps 1000] [--sync-every 16] [--fragments 4] [--configs a,b]
[--delay 0] [--alpha 0] [--lr 3e-3] [--outer-lr 0.9] [--outer-momentum 0.3] [--seed 0] [--out DIR]
[--no-progress]``

The data, model, held-out loss and AdamW of :mod:`jaxcomp_bench.lm` (8
workers under ``jax.pmap``, 16 windows each per step), at equal inner steps:

- ``dp``: data-parallel AdamW, the dense float32 mean of the gradients every step;
- ``diloco``: :func:`jaxcomp.diloco`, AdamW inside, the dense mean of the pseudo-gradients every H steps,
  outer Nesterov SGD (lr 0.9, momentum 0.3: ``jaxcomp.diloco``'s default; the paper's is ``--outer-lr 0.7
  --outer-momentum 0.9``; ``--outer-momentum 0``: plain ``sgd(outer lr)``);
- ``diloco-topk``, ``diloco-qsgd``, ``diloco-fp4``: the same with the pseudo-gradients through
  ``jaxcomp.topk``, ``jaxcomp.qsgd`` or ``jaxcomp.fp4`` at their defaults;
- ``sparseloco``: :func:`jaxcomp.sparseloco` at its defaults (2% per chunk of 4096, 2-bit values,
  decaying error feedback, outer SGD lr 1);
- ``streaming-fp4``: Streaming DiLoCo, ``fragments=P`` with fp4 outer gradients.

``--delay`` and ``--alpha`` set :func:`jaxcomp.diloco`'s overlap and mixing for every configuration but
dp.

Reported per configuration: the held-out loss of the shared model (the
anchor; data parallel: replica 0) and of replica 0's own parameters, the
bytes one worker hands to collectives per step averaged over the run
(``tx.bytes_at``), the peak bytes of one sync, the ratio to data parallel,
and the step time :mod:`jaxcomp.planning.netsim` predicts for 8 workers on 1
and 10 Gb/s links (the step measured here as compute, plus the sync's
collectives, read from their compiled program, spread over the H steps).
Writes ``results.json``, ``results.md`` and ``loss_vs_bytes.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomp
from jaxcomp.collectives.hlo import runs as collective_runs
from jaxcomp.planning import netsim
from jaxcomp.training.diloco import fragment_leaves, leaf_costs
from jaxcomp.training.recipes import ADAMW
from jaxcomp_bench.common import WORKERS, colours, fmt_bytes, frontier, header, label_points, markdown_table
from jaxcomp_bench.transformer import (
  CONTEXT,
  EVAL_WINDOWS,
  Transformer,
  batches,
  held_out_loss,
  init_params,
  load,
  loss_fn,
  num_params,
)

AXIS = "data"
DEFAULT_STEPS = 1000
DEFAULT_LR = 3e-3  # the lm task's
DEFAULT_OUTER_LR = 0.9  # jaxcomp.diloco's default outer Nesterov SGD (lr 0.9, momentum 0.3)
DEFAULT_OUTER_MOMENTUM = 0.3
SYNC_EVERY = 16
FRAGMENTS = 4
PER_WORKER_BATCH = 16
LATENCY_US = 10.0
GBPS = (1, 10)
CONFIGS = ("dp", "diloco", "diloco-topk", "diloco-qsgd", "diloco-fp4", "sparseloco", "streaming-fp4")
# config: the bound on its held-out loss against dp (the targets)
TARGETS = {"diloco": 0.02, "diloco-topk": 0.03, "diloco-qsgd": 0.03, "diloco-fp4": 0.03, "sparseloco": 0.03,
           "streaming-fp4": 0.03}
SPARSE_FEWER = 500  # SparseLoCo: at least this many times fewer bytes per step than dp
STREAM_SLACK = 1.02  # streaming: its peak sync over DiLoCo's (same codec) at most 1/P, +2%: whole leaves


@dataclasses.dataclass
class Run:
  config: str
  what: str = ""
  steps: int = 0
  held_out_loss: float = float("nan")  # the shared model: the anchor (dp: replica 0)
  replica_loss: float = float("nan")  # replica 0's own parameters after the last step
  final_train_loss: float = float("nan")  # mean over workers of the last 10 steps
  mean_bytes: float = -1.0  # one worker's bytes per step, averaged over the run
  peak_bytes: int = -1  # one worker's bytes at its largest sync
  hlo_bytes: List[int] = dataclasses.field(default_factory=list)  # per fragment: the compiled sync's
  nominal_bytes: List[int] = dataclasses.field(default_factory=list)  # per fragment: jaxcomp.wire_bytes
  comm_seconds: Dict[str, float] = dataclasses.field(default_factory=dict)  # per step, spread over H
  predicted: Dict[str, float] = dataclasses.field(default_factory=dict)
  step_seconds: float = float("nan")  # the mean measured step (the first excluded)
  compile_seconds: float = float("nan")
  wall_seconds: float = float("nan")
  anchor_shared: bool = True  # the anchor bit-identical on every worker at the end
  # P = 1, after the last sync: the largest |replica - anchor| (0 where anchor - params was exact; SBC's
  # half ulp of anchor - params where a parameter crossed zero) and the share of entries bit-identical
  sync_deviation: float = float("nan")
  sync_exact_share: float = float("nan")
  curve: List[List[float]] = dataclasses.field(default_factory=list)  # (step, mean training loss)
  error: str = ""


class Setup(NamedTuple):
  """One configuration: its optimizer, the compressor a sync sends through, its fragments, a description."""

  tx: Any
  comp: Any
  fragments: int
  what: str


def optimizer(config: str, lr: float, sync_every: int, fragments: int, outer_lr: float,
              outer_momentum: float = DEFAULT_OUTER_MOMENTUM, delay: int = 0, alpha: float = 0.0) -> Setup:
  """The :class:`Setup` of ``config`` (one of :data:`CONFIGS`)."""
  inner = optax.adamw(lr, **ADAMW)
  if config == "dp":
    comp = jaxcomp.none(axis_name=AXIS)
    return Setup(optax.chain(comp, inner), comp, 1, "data-parallel AdamW, dense mean every step")
  if config == "sparseloco":
    tx = jaxcomp.sparseloco(inner, sync_every=sync_every, axis_name=AXIS, delay=delay, alpha=alpha)
    return Setup(tx, tx.compressor, 1, f"SparseLoCo, H={sync_every}: 2% of each chunk of 4096, 2-bit"
                 f" values, decaying error feedback, outer sgd(1), delay {delay}, alpha {alpha:g}")
  comps = {"diloco": None, "diloco-topk": jaxcomp.topk(axis_name=AXIS), "diloco-qsgd":
           jaxcomp.qsgd(axis_name=AXIS), "diloco-fp4": jaxcomp.fp4(axis_name=AXIS),
           "streaming-fp4": jaxcomp.fp4(axis_name=AXIS)}
  frag = fragments if config == "streaming-fp4" else 1
  outer = (optax.sgd(outer_lr, momentum=outer_momentum, nesterov=True) if outer_momentum
           else optax.sgd(outer_lr))
  tx = jaxcomp.diloco(inner, outer, sync_every=sync_every, compressor=comps[config], axis_name=AXIS,
                      fragments=frag, delay=delay, alpha=alpha)
  method = "dense" if comps[config] is None else config.split("-")[1]
  kind = f"Nesterov sgd({outer_lr:g}, {outer_momentum:g})" if outer_momentum else f"sgd({outer_lr:g})"
  what = f"DiLoCo, H={sync_every}, {method} pseudo-gradients, outer {kind}, delay {delay}, alpha {alpha:g}"
  if frag > 1:
    what = (f"Streaming DiLoCo, H={sync_every}, P={frag}, fp4 outer gradients, delay {delay},"
            f" alpha {alpha:g}, outer {kind}")
  return Setup(tx, tx.compressor, frag, what)


def sync_traffic(run: Run, setup: Setup, params, sync_every: int) -> List[list]:
  """Fills the bytes of ``run``; returns each fragment's collectives ``(kind, bytes)`` from its program.

  Each fragment's exchange (the compressor alone on float32 leaves shaped like the fragment's) is
  compiled under pmap: its collectives price the sync, and their bytes are checked against
  ``jaxcomp.wire_bytes``.
  """
  leaves = [jnp.zeros(np.shape(x), jnp.float32) for x in jax.tree.leaves(params)]
  traffic = []
  for idx in fragment_leaves(leaf_costs(setup.comp, leaves), setup.fragments):
    like = [leaves[i] for i in idx]
    comp = setup.comp
    hlo = jax.pmap(lambda g, s, comp=comp: comp.update(g, s)[0], axis_name=AXIS).lower(
        jaxcomp.per_worker(like, WORKERS), jaxcomp.per_worker(comp.init(like), WORKERS)).compile().as_text()
    run.hlo_bytes.append(int(jaxcomp.collective_bytes(hlo)["total"]))
    run.nominal_bytes.append(int(jaxcomp.wire_bytes(comp, like, workers=WORKERS)))
    traffic.append(collective_runs(hlo))
  if run.config == "dp":
    run.mean_bytes, run.peak_bytes = float(run.nominal_bytes[0]), run.nominal_bytes[0]
  else:
    per_step = [setup.tx.bytes_at(t, params, WORKERS) for t in range(run.steps)]
    run.mean_bytes = float(np.mean(per_step))
    run.peak_bytes = int(max(setup.tx.bytes_at(t, params, WORKERS) for t in range(sync_every)))
  return traffic


def _loop(compiled, P, S, data, steps: int, last_sync: int, progress: bool):
  """Runs the steps; returns (P, S, losses, mean step seconds, (params, anchor) after ``last_sync``)."""
  from tqdm.auto import tqdm

  bar = tqdm(total=steps, disable=not progress, mininterval=1.0, file=sys.stderr, dynamic_ncols=True)
  losses, pending, at_sync, t_start = [], [], None, None
  for t, (x, y) in enumerate(data):
    P, S, loss = compiled(P, S, x, y)
    pending.append(loss)
    if t == 0:
      jax.block_until_ready(loss)
      t_start = time.perf_counter()
    if t == last_sync:
      at_sync = jax.device_get((P, S.anchor if isinstance(S, jaxcomp.DiLoCoState) else P))
    if (t + 1) % 50 == 0 or t + 1 == steps:
      losses.extend(float(v) for v in np.asarray(jax.device_get(pending)).mean(axis=1))
      pending = []
      bar.update(t + 1 - bar.n)
  jax.block_until_ready(P)
  bar.close()
  seconds = (time.perf_counter() - t_start) / max(1, steps - 1)
  return P, S, losses, seconds, at_sync


def _same(tree) -> bool:
  return all(bool(np.all(a == a[:1])) for a in jax.tree.leaves(tree))


def train(config: str, steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR, sync_every: int = SYNC_EVERY,
          fragments: int = FRAGMENTS, outer_lr: float = DEFAULT_OUTER_LR, seed: int = 0,
          progress: bool = False, outer_momentum: float = DEFAULT_OUTER_MOMENTUM, delay: int = 0,
          alpha: float = 0.0) -> Run:
  """Trains the lm task's transformer with ``config`` (one of :data:`CONFIGS`) for ``steps`` inner steps."""
  if config not in CONFIGS:
    raise ValueError(f"config must be one of {CONFIGS}, got config={config!r}")
  run = Run(config, steps=steps)
  t0 = time.perf_counter()
  try:
    _train(run, lr, sync_every, fragments, (outer_lr, outer_momentum, delay, alpha), seed, progress)
  except Exception as e:  # noqa: BLE001 -- one broken configuration must not stop the others
    import traceback

    traceback.print_exc()
    run.error = f"{type(e).__name__}: {e}"
  run.wall_seconds = time.perf_counter() - t0
  return run


def _train(run: Run, lr, sync_every, fragments, outer, seed, progress) -> None:
  corpus = load()
  model = Transformer(corpus.vocab_size)
  params = init_params(model, seed)
  setup = optimizer(run.config, lr, sync_every, fragments, *outer)
  run.what, tx = setup.what, setup.tx
  traffic = sync_traffic(run, setup, params, sync_every)
  for gbps in GBPS:
    net = netsim.flat(WORKERS, gbps, latency=LATENCY_US * 1e-6)
    per_sync = sum(netsim.communication_time(t, net) for t in traffic)  # one period's, all fragments
    run.comm_seconds[f"{gbps}G"] = per_sync / (1 if run.config == "dp" else sync_every)

  def step(p, s, x, y):
    loss, g = jax.value_and_grad(loss_fn)(p, model, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  P = jaxcomp.per_worker(params, WORKERS)
  S = jaxcomp.per_worker(tx.init(params), WORKERS)
  data = batches(corpus, run.steps, WORKERS, PER_WORKER_BATCH, seed)
  x0, y0 = next(data)
  t0 = time.perf_counter()
  compiled = jax.pmap(step, axis_name=AXIS, donate_argnums=(0, 1)).lower(P, S, x0, y0).compile()
  run.compile_seconds = time.perf_counter() - t0
  last_sync = (run.steps // sync_every) * sync_every - 1 if setup.fragments == 1 else -1

  def all_batches():
    yield x0, y0
    yield from data

  P, S, losses, run.step_seconds, at_sync = _loop(compiled, P, S, all_batches(), run.steps, last_sync,
                                                  progress)
  run.curve = [[i + 1, float(np.mean(losses[max(0, i - 49):i + 1]))] for i in range(49, len(losses), 50)]
  run.final_train_loss = float(np.mean(losses[-10:]))
  host = jax.device_get(P)
  shared = jax.device_get(S.anchor) if isinstance(S, jaxcomp.DiLoCoState) else host
  run.anchor_shared = _same(shared)
  if run.config == "dp":
    at_sync = (host, jax.tree.map(lambda a: a[:1], host))  # every replica against replica 0
  if at_sync is not None:  # P = 1: every replica on the (shared) anchor after the last sync
    gaps = [np.abs(np.asarray(p, np.float32) - a).ravel() for p, a in
            zip(jax.tree.leaves(at_sync[0]), jax.tree.leaves(at_sync[1]), strict=True)]
    run.sync_deviation = float(max(g.max() for g in gaps))
    run.sync_exact_share = float(np.mean(np.concatenate(gaps) == 0))
  first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
  run.replica_loss = held_out_loss(first(host), model, corpus)
  run.held_out_loss = held_out_loss(jax.tree.map(lambda a, p: a.astype(p.dtype), first(shared), params),
                                    model, corpus)
  for gbps in GBPS:
    run.predicted[f"{gbps}G"] = run.step_seconds + run.comm_seconds[f"{gbps}G"]


# ----------------------------------------------------------------------------
# Report


def table(runs: List[Run]) -> str:
  """The runs as a markdown table, each against ``dp``."""
  dp = next((r for r in runs if r.config == "dp" and not r.error), None)
  head = ["config", "held-out loss", "vs dp (%)", "replica 0 loss", "B/step (mean)", "vs dp bytes (x)",
          "peak B/sync"] + [f"pred. 8w@{g}G (ms)" for g in GBPS] + ["note"]
  rows = []
  for r in runs:
    if r.error:
      rows.append([r.config] + ["-"] * (len(head) - 2) + ["failed: " + r.error.splitlines()[-1][:80]])
      continue
    vs = f"{100 * (r.held_out_loss / dp.held_out_loss - 1):+.1f}" if dp else "-"
    ratio = f"{dp.mean_bytes / r.mean_bytes:,.0f}x" if dp and r.mean_bytes > 0 else "-"
    notes = []
    if r.hlo_bytes != r.nominal_bytes:
      notes.append(f"HLO bytes {r.hlo_bytes} != nominal {r.nominal_bytes}")
    if not r.anchor_shared:
      notes.append("anchor differs between workers")
    if r.config != "dp" and math.isfinite(r.sync_deviation):
      notes.append(f"last sync: {100 * r.sync_exact_share:.2f}% of entries on the anchor bit for bit, the"
                   f" rest within {r.sync_deviation:.1e}")
    elif r.config == "dp" and r.sync_deviation > 0:
      notes.append("replicas differ")
    if not math.isfinite(r.held_out_loss):
      notes.append("diverged")
    rows.append([r.config, f"{r.held_out_loss:.4f}", vs, f"{r.replica_loss:.4f}", fmt_bytes(r.mean_bytes),
                 ratio, fmt_bytes(r.peak_bytes)] + [f"{1e3 * r.predicted[f'{g}G']:.1f}" for g in GBPS]
                + ["; ".join(notes)])
  return markdown_table(head, rows)


def targets(runs: List[Run], fragments: int = FRAGMENTS) -> List[str]:
  """The issue's targets, each ``met`` or ``missed`` with the numbers."""
  by = {r.config: r for r in runs if not r.error}
  dp = by.get("dp")
  if dp is None:
    return []
  out = []
  for config, bound in TARGETS.items():
    r = by.get(config)
    if r is None:
      continue
    gap = r.held_out_loss / dp.held_out_loss - 1
    checks = [(gap <= bound, f"held-out loss {100 * gap:+.1f}% vs dp (target within {100 * bound:g}%)")]
    if config == "sparseloco":
      fewer = dp.mean_bytes / r.mean_bytes
      checks.append((fewer >= SPARSE_FEWER,
                     f"{fewer:,.0f}x fewer bytes per step (target >= {SPARSE_FEWER}x)"))
    if config == "streaming-fp4" and "diloco-fp4" in by:
      share = r.peak_bytes / by["diloco-fp4"].peak_bytes
      checks.append((share <= STREAM_SLACK / fragments, f"peak bytes per sync {share:.3f} of DiLoCo's with"
                     f" the same fp4 codec (target 1/{fragments}, met up to {STREAM_SLACK:g}/{fragments}:"
                     " fragments are whole leaves)"))
    for ok, text in checks:
      out.append(f"- {config}: {'met' if ok else 'MISSED'}: {text}")
  return out


def figure(runs: List[Run], out: str, steps: int) -> str:
  """``loss_vs_bytes.png``: held-out loss against bytes per step (log), every configuration labelled."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ok = [r for r in runs if not r.error and r.mean_bytes > 0 and math.isfinite(r.held_out_loss)]
  colour = colours([r.config for r in ok])
  fig, ax = plt.subplots(figsize=(9, 5.5))
  for r in ok:
    ax.scatter(r.mean_bytes, r.held_out_loss, s=50, color=colour[r.config], edgecolor="black",
               linewidth=0.5, zorder=3)
  f = frontier([(r.config, r.mean_bytes, r.held_out_loss) for r in ok], higher_is_better=False)
  ax.plot([p[1] for p in f], [p[2] for p in f], color="black", lw=1, zorder=2, label="frontier")
  dp = next((r for r in ok if r.config == "dp"), None)
  if dp is not None:
    for frac, ls in ((0.02, "--"), (0.03, ":")):
      ax.axhline((1 + frac) * dp.held_out_loss, color="gray", ls=ls, lw=0.8, label=f"dp + {100 * frac:g}%")
  ax.set_xscale("log")
  ax.set_xlabel("bytes one worker sends per step, averaged over the run (log scale)")
  ax.set_ylabel("held-out loss of the shared model\n(nats per character)")
  ax.set_title(f"Character transformer, {WORKERS} workers, {steps} inner steps, AdamW inside.\n"
               "How many bytes can syncing every H steps save, and what does it cost in loss?"
               " (down and left is better)", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8, loc="upper right")
  fig.tight_layout()
  label_points(ax, [(r.config, r.mean_bytes, r.held_out_loss) for r in ok])
  path = os.path.join(out, "loss_vs_bytes.png")
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)
  return path


def replot(out: str) -> str:
  """Redraws ``loss_vs_bytes.png`` from ``out/results.json`` (no training)."""
  with open(os.path.join(out, "results.json")) as f:
    saved = json.load(f)
  fields = {f.name for f in dataclasses.fields(Run)}
  return figure([Run(**{k: v for k, v in r.items() if k in fields}) for r in saved["runs"]], out,
                saved["meta"]["steps"])


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m jaxcomp.bench lm --diloco",
      description="DiLoCo, its compressed variants, SparseLoCo and Streaming DiLoCo against data-parallel"
                  " AdamW on the lm task, at equal inner steps.")
  p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"inner steps (default {DEFAULT_STEPS})")
  p.add_argument("--sync-every", type=int, default=SYNC_EVERY, help=f"H (default {SYNC_EVERY})")
  p.add_argument("--fragments", type=int, default=FRAGMENTS, help=f"streaming's P (default {FRAGMENTS})")
  p.add_argument("--delay", type=int, default=0, help="every DiLoCo configuration's overlap tau (default 0)")
  p.add_argument("--alpha", type=float, default=0.0,
                 help="every DiLoCo configuration's share of the local fragment kept at a sync (default 0)")
  p.add_argument("--configs", default="all", help=f"comma-separated from {', '.join(CONFIGS)}; 'all'"
                 " (default); dp always runs first")
  p.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW's lr (default {DEFAULT_LR:g})")
  p.add_argument("--outer-lr", type=float, default=DEFAULT_OUTER_LR,
                 help=f"DiLoCo's outer Nesterov lr (default {DEFAULT_OUTER_LR:g})")
  p.add_argument("--outer-momentum", type=float, default=DEFAULT_OUTER_MOMENTUM,
                 help=f"DiLoCo's outer Nesterov momentum (default {DEFAULT_OUTER_MOMENTUM:g}); 0: plain"
                 " sgd(outer lr), no momentum")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="bench_out_diloco", help="output folder (default bench_out_diloco/)")
  p.add_argument("--replot", action="store_true", help="only redraw the figure from OUT/results.json")
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  names = CONFIGS if args.configs.strip() == "all" else [c.strip() for c in args.configs.split(",")]
  unknown = [c for c in names if c not in CONFIGS]
  if unknown:
    p.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
  args.configs = ["dp"] + [c for c in dict.fromkeys(names) if c != "dp"]
  for name in ("steps", "sync_every", "fragments"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  return args


def main(argv: Optional[Sequence[str]] = None) -> List[Run]:
  args = _parse(argv)
  if args.replot:
    print(f"wrote {replot(args.out)}")
    return []
  jaxcomp.cpu_devices(WORKERS)
  corpus = load()
  params = init_params(Transformer(corpus.vocab_size), args.seed)
  cmd = "python -m jaxcomp.bench lm --diloco " + " ".join(sys.argv[1:] if argv is None else argv)
  head = header(cmd.strip())
  facts = (f"data: pydoc_data.topics, context {CONTEXT}; model: the lm task's transformer,"
           f" {num_params(params):,} parameters in {len(jax.tree.leaves(params))} leaves; {WORKERS} workers"
           f" (jax.pmap) x {PER_WORKER_BATCH} windows; {args.steps} inner steps; AdamW lr {args.lr:g},"
           f" weight decay {ADAMW['weight_decay']:g}; H = {args.sync_every}; streaming P = {args.fragments},"
           f" delay {args.delay}, alpha {args.alpha:g};"
           f" seed {args.seed}")
  print(head, facts, sep="\n", flush=True)
  t_all = time.perf_counter()
  runs = []
  for config in args.configs:
    r = train(config, args.steps, args.lr, args.sync_every, args.fragments, args.outer_lr, args.seed,
              progress=not args.no_progress, outer_momentum=args.outer_momentum, delay=args.delay,
              alpha=args.alpha)
    runs.append(r)
    print(f"{config:>14}: held-out {r.held_out_loss:.4f} (replica 0 {r.replica_loss:.4f})"
          f"  {r.mean_bytes:,.0f} B/step  {1e3 * r.step_seconds:.1f} ms/step  wall {r.wall_seconds:.0f} s"
          + (f"  failed: {r.error}" if r.error else ""), flush=True)
  total = time.perf_counter() - t_all
  md, goals, notes = table(runs), targets(runs, args.fragments), _notes(args)
  text = "\n".join([head, "", facts, "", md, "", *notes, "", "targets:", *goals, "", f"total {total:.0f} s"])
  print("\n" + text.split("\n", 3)[3])
  os.makedirs(args.out, exist_ok=True)
  meta = {"header": head, "command": cmd.strip(), "steps": args.steps, "sync_every": args.sync_every,
          "fragments": args.fragments, "delay": args.delay, "alpha": args.alpha, "lr": args.lr,
          "outer_lr": args.outer_lr,
          "outer_momentum": args.outer_momentum, "seed": args.seed,
          "workers": WORKERS, "per_worker_batch": PER_WORKER_BATCH, "latency_us": LATENCY_US,
          "jax": jax.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
          "total_seconds": total, "targets": goals}
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"meta": meta, "runs": [dataclasses.asdict(r) for r in runs]}, f, indent=1, allow_nan=True)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(text + "\n")
  path = figure(runs, args.out, args.steps)
  print(f"wrote {args.out}/results.json, {args.out}/results.md, {path}")
  return runs


def _notes(args) -> List[str]:
  return [
      f"held-out loss: mean cross-entropy (nats per character) over {EVAL_WINDOWS} fixed held-out windows,"
      " of the shared model: the anchor after the last step (the last sync's; dp: replica 0); replica 0"
      " loss: replica 0's own parameters after the last step.",
      "B/step (mean): bytes one worker hands to collectives per step, averaged over the run (tx.bytes_at:"
      " 0 on local steps, the fragment's jaxcomp.wire_bytes on a sync, checked against the compiled"
      " sync's HLO); peak B/sync: the largest sync's.",
      f"pred. 8w@BG: the mean step measured here ({WORKERS} workers sharing {os.cpu_count()} CPU cores) as"
      f" compute, plus jaxcomp.planning.netsim's time for each sync's compiled collectives on a flat"
      f" ring of 8 workers, B Gb/s links, alpha {LATENCY_US:g} us, spread over the"
      f" H = {args.sync_every} steps"
      " (no overlap).",
  ]
