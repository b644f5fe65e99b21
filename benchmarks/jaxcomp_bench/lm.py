"""The transformer language-model task of the main job: a character model of Python's own documentation.

``python -m jaxcomp.bench lm [--methods a,b|all] [--steps 300] [--chain recipe|default|both] [--lr 3e-3]
[--seed 0] [--out DIR] [--no-progress]`` (also ``python -m jaxcomp.bench --task lm ...``);
``python -m jaxcomp.bench lm --diloco ...``: DiLoCo, SparseLoCo and Streaming DiLoCo against data
parallelism (:mod:`jaxcomp_bench.diloco_lm`).

The CNN task (:mod:`jaxcomp_bench.train`) has one large dense kernel; this
one has the leaf shapes of a transformer (embeddings, attention and MLP
kernels, LayerNorm scales) and is trained with AdamW, so every method is
also seen in front of an adaptive optimizer.

Data and model (:mod:`jaxcomp_bench.transformer`): the English prose of
``pydoc_data.topics`` as characters, 90% to train on and 10% held out; a
decoder-only transformer of two blocks.

Each method runs with ``jax.pmap`` over 8 CPU devices, ``batch`` windows per
worker, in one of two chains:

- ``"default"``: ``optax.chain(METHODS[name](axis_name="data"), optax.adamw(lr))``;
- ``"recipe"``: ``jaxcomp.recipe(name, lr, axis_name="data", optimizer="adamw")``,
  which also reaches the complete optimizers :data:`RECIPE_ONLY`.

The dense baseline (``none``) runs first in each chain. Reported per method:
the held-out loss and its change against dense, the bytes one worker hands
to collectives per step (from the compiled step's HLO, the steady state
after any warm-up), and ``jaxcomp.planning.netsim``'s predicted step time and
speed-up over dense for 8 workers on 1 and 10 Gb/s links. Writes
``results.json``, ``results.md`` and ``loss_vs_bytes.png`` to ``--out``.
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
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
import optax

import jaxcomp
from jaxcomp.collectives.hlo import runs as collective_runs
from jaxcomp_bench.common import (
  BLOCK_EVERY,
  WORKERS,
  fmt_bytes,
  header,
  markdown_table,
  predicted_times,
  style,
  timed_steps,
)
from jaxcomp_bench.transformer import (
  CONTEXT,
  EVAL_WINDOWS,
  HEADS,
  LAYERS,
  MLP,
  WIDTH,
  Transformer,
  batches,
  held_out_loss,
  init_params,
  load,
  loss_fn,
  num_params,
)
from jaxcomp_bench.transformer import held_out_starts as held_out_starts  # re-exported: lm.<name>
from jaxcomp_bench.transformer import train_starts as train_starts
from jaxcomp_bench.transformer import windows as windows

DEFAULT_STEPS = 300
DEFAULT_LR = 3e-3
PER_WORKER_BATCH = 16
CHAINS = ("recipe", "default")
# Complete optimizers that own their exchange: only through jaxcomp.recipe(name, ...).
RECIPE_ONLY = ("onebit_adam", "zero_one_adam", "demo")
LATENCY_US = 10.0  # the network model's alpha per message (train.py's default)
PREDICTED = ("8w@1G", "8w@10G")  # the table's columns: 8 workers on 1 and 10 Gb/s (predicted_times' keys)
WORSE = 0.02  # note: a held-out loss more than 2% above dense
DIVERGED = 1.5  # note: a held-out loss above 1.5 x dense's (or non-finite) is divergence


# ----------------------------------------------------------------------------
# Training


@dataclasses.dataclass
class Result:
  method: str
  chain: str
  lr: float = DEFAULT_LR
  steps: int = 0
  held_out_loss: float = float("nan")
  final_train_loss: float = float("nan")  # mean over workers of the last 10 steps
  wire_bytes: int = -1
  nominal_bytes: int = -1
  collectives: int = -1
  mean_bytes: float = -1.0  # with a warm-up: nominal bytes per step averaged over the run
  warmup_steps: int = 0  # the step from which the steady state (the wire_bytes above) runs
  step_seconds: float = float("nan")
  compile_seconds: float = float("nan")
  train_seconds: float = float("nan")
  replicas_equal: bool = True
  wall_seconds: float = float("nan")  # the whole train() call: build, compile, train, evaluate
  curve: List[Tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, mean training loss)
  error: str = ""
  traffic: List[Any] = dataclasses.field(default_factory=list)
  predicted: Dict[str, float] = dataclasses.field(default_factory=dict)


def valid_names(chain: str) -> Tuple[str, ...]:
  """The method names ``chain`` accepts: jaxcomp.METHODS, and with "recipe" also :data:`RECIPE_ONLY`."""
  return tuple(jaxcomp.METHODS) + (RECIPE_ONLY if chain == "recipe" else ())


def _check(name: str, chain: str, steps: int, lr: float, workers: int, batch: int) -> None:
  if chain not in CHAINS:
    raise ValueError(f"chain must be one of {CHAINS}, got chain={chain!r}")
  names = valid_names(chain)
  if name not in names:
    only = " (a complete optimizer: only with chain='recipe')" if name in RECIPE_ONLY else ""
    raise ValueError(f"name must be one of {sorted(names)} with chain={chain!r}, got name={name!r}{only}")
  for arg, value in (("steps", steps), ("workers", workers), ("batch", batch)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{arg} must be an int >= 1, got {arg}={value!r}")
  if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
    raise ValueError(f"lr must be a finite number > 0, got lr={lr!r}")


def _chain(name: str, chain: str, lr: float):
  """(the optax chain, the jaxcomp transformation whose bytes are counted)."""
  if chain == "default":
    comp = jaxcomp.METHODS[name](axis_name="data")
    return optax.chain(comp, optax.adamw(lr)), comp
  tx = jaxcomp.recipe(name, lr, axis_name="data", optimizer="adamw")
  comp = jaxcomp.recipe_method(name, axis_name="data", optimizer="adamw")
  return tx, comp


def train(name: str, steps: int = DEFAULT_STEPS, chain: str = "recipe", lr: float = DEFAULT_LR, seed: int = 0,
          workers: int = WORKERS, batch: int = PER_WORKER_BATCH, progress: bool = False) -> Result:
  """Trains the transformer with method ``name`` for ``steps`` steps on ``workers`` pmapped devices.

  Args:
    name: a method of ``jaxcomp.METHODS`` ("none": dense), or with ``chain="recipe"`` one of
      :data:`RECIPE_ONLY`.
    steps: training steps.
    chain: "recipe" (``jaxcomp.recipe(name, lr, optimizer="adamw")``) or "default"
      (``chain(METHODS[name](), adamw(lr))``).
    lr: AdamW's learning rate.
    seed: the parameters' initialisation and the training windows.
    workers: data-parallel workers (needs that many JAX devices: ``jaxcomp.cpu_devices``).
    batch: windows of :data:`CONTEXT` characters per worker per step.
    progress: a tqdm bar on stderr.

  Returns:
    A :class:`Result`. Invalid arguments raise ``ValueError``; a method that fails while it is
    built, compiled or trained is recorded in ``Result.error`` (the traceback goes to stderr).
  """
  _check(name, chain, steps, lr, workers, batch)
  if jax.device_count() < workers:
    raise ValueError(f"workers={workers} needs {workers} devices, JAX has {jax.device_count()}; call"
                     f" jaxcomp.cpu_devices({workers}) before any JAX work")
  res = Result(name, chain, lr=float(lr), steps=steps)
  t0 = time.perf_counter()
  try:
    _train(res, seed, workers, batch, progress)
  except Exception as e:  # noqa: BLE001 -- one broken method must not stop the others
    traceback.print_exc()
    res.error = f"{type(e).__name__}: {e}"
  res.wall_seconds = time.perf_counter() - t0
  return res


def _train(res: Result, seed: int, workers: int, batch: int, progress: bool) -> None:
  from jaxcomp.core.compression import CompressedOptimizer, compressor

  corpus = load()
  model = Transformer(corpus.vocab_size)
  params = init_params(model, seed)
  tx, comp = _chain(res.method, res.chain, res.lr)

  def step(p, s, x, y):
    loss, g = jax.value_and_grad(loss_fn)(p, model, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss  # the loss is not reduced: the collectives are the optimizer's

  P = jaxcomp.per_worker(params, workers)
  S = jaxcomp.per_worker(tx.init(params), workers)
  data = batches(corpus, res.steps, workers, batch, seed)
  x0, y0 = next(data)
  t0 = time.perf_counter()
  compiled = jax.pmap(step, axis_name="data", donate_argnums=(0, 1)).lower(P, S, x0, y0).compile()
  res.compile_seconds = time.perf_counter() - t0
  hlo = compiled.as_text()
  inner = compressor(comp)
  method = inner.method if isinstance(inner, jaxcomp.CompressionTransformation) else None
  # 0/1 Adam: dense, 1-bit and silent rounds in one program
  rounds = tx.bytes_at if isinstance(tx, CompressedOptimizer) else None
  if method is not None and (method.stages or method.start_step or rounds is not None):
    # The program holds every stage's collectives; the bytes and the network model are the steady
    # state's: the last stage compiled alone (as train.py does).
    steady = jaxcomp.steady(inner)
    hlo = jax.pmap(lambda g, s: steady.update(g, s)[0], axis_name="data").lower(
        P, jaxcomp.per_worker(steady.init(params), workers)).compile().as_text()
    if rounds is not None:
      res.mean_bytes = float(np.mean([rounds(t, params, workers) for t in range(res.steps)]))
    else:
      res.mean_bytes = float(np.mean([jaxcomp.wire_bytes(inner, params, step=t, workers=workers)
                                      for t in range(res.steps)]))
    res.warmup_steps = max([method.start_step] + [first for first, _ in method.stages])
  wire = jaxcomp.collective_bytes(hlo)
  res.wire_bytes, res.collectives = int(wire["total"]), int(wire["count"])
  res.traffic = [list(t) for t in collective_runs(hlo)]
  res.nominal_bytes = int(jaxcomp.wire_bytes(comp, params, workers=workers))

  run = timed_steps(compiled, P, S, (x0, y0), data, res.steps, f"{res.method:>12} {res.chain}", progress)
  P, losses = run.params, run.losses
  res.train_seconds, res.step_seconds = run.seconds, run.step_seconds
  res.curve = [(1, losses[0])] + [(end, float(np.mean(losses[start:end])))
                                   for start, end in zip([1] + run.block_ends, run.block_ends)]
  res.final_train_loss = float(np.mean(losses[-10:]))
  host = jax.device_get(P)
  res.replicas_equal = all(bool(np.all(a == a[:1])) for a in jax.tree.leaves(host))
  res.held_out_loss = held_out_loss(jax.tree.map(lambda a: a[0], host), model, corpus)


# ----------------------------------------------------------------------------
# Report


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m jaxcomp.bench lm",
      description="Train a small character transformer with every method and compare held-out loss,"
                  " bytes and predicted step time.",
      epilog="Two other modes take their own options: `lm --diloco [--help]` runs DiLoCo, SparseLoCo and"
             " Streaming DiLoCo against data parallelism; `lm --mesh dcn=2,fsdp=4 [--help]` trains a"
             " sharded model (FSDP or tensor axes, the recipe over dcn) against a replicated one.")
  p.add_argument("--methods", default="",
                 help="comma-separated names from jaxcomp.METHODS, or with the recipe chain also "
                      f"{', '.join(RECIPE_ONLY)}; 'all' or empty: every one ('none', the dense"
                      " baseline, always runs first)")
  p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})")
  p.add_argument("--chain", default="recipe", choices=CHAINS + ("both",),
                 help="recipe: jaxcomp.recipe(name, lr, optimizer='adamw') (default); default:"
                      " chain(METHODS[name](), adamw(lr)); both: each method in both")
  p.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR:g})")
  p.add_argument("--seed", type=int, default=0, help="initialisation and training windows (default 0)")
  p.add_argument("--out", default="bench_out_lm", help="output folder (default bench_out_lm/)")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")
  if not (math.isfinite(args.lr) and args.lr > 0):
    p.error(f"--lr must be > 0, got {args.lr}")
  return args


def runs(spec: str, chain: str) -> List[Tuple[str, str]]:
  """``(method, chain)`` in run order: per chain, "none" first, then the methods that chain accepts.

  ``spec``: comma-separated names, or "" / "all" for every method and :data:`RECIPE_ONLY`.
  """
  chains = CHAINS if chain == "both" else (chain,)
  everything = tuple(jaxcomp.METHODS) + RECIPE_ONLY
  if spec.strip() in ("", "all"):
    names, asked = list(everything), False
  else:
    names, asked = list(dict.fromkeys(m.strip() for m in spec.split(",") if m.strip())), True
  unknown = [m for m in names if m not in everything]
  if unknown:
    raise SystemExit(f"--methods: unknown {unknown}; choose from {sorted(everything)}")
  if asked and chain == "default" and any(m in RECIPE_ONLY for m in names):
    raise SystemExit(f"--methods: {[m for m in names if m in RECIPE_ONLY]} are complete optimizers,"
                     " reachable only through jaxcomp.recipe: use --chain recipe or both")
  out = []
  for c in chains:
    ok = valid_names(c)
    out += [(m, c) for m in ["none"] + [m for m in names if m != "none" and m in ok]]
  return out


def _dense(results: List[Result], chain: str) -> Optional[Result]:
  return next((r for r in results if r.method == "none" and r.chain == chain and not r.error), None)


def _note(r: Result, dense: Optional[Result]) -> str:
  if r.error:
    return "failed: " + r.error.splitlines()[-1][:80]
  notes = []
  if not math.isfinite(r.held_out_loss) or not math.isfinite(r.final_train_loss):
    notes.append("diverged (non-finite loss)")
  elif dense is not None and r is not dense:
    if r.held_out_loss > DIVERGED * dense.held_out_loss:
      notes.append(f"diverged (> {DIVERGED:g}x dense loss)")
    elif r.held_out_loss > (1 + WORSE) * dense.held_out_loss:
      notes.append(f"> {100 * WORSE:g}% above dense")
  if r.warmup_steps:
    notes.append(f"warm-up to step {r.warmup_steps}: {r.mean_bytes:,.0f} B/step over the run")
  elif r.mean_bytes >= 0:
    notes.append(f"dense, 1-bit and silent rounds: {r.mean_bytes:,.0f} B/step over the run")
  if not r.replicas_equal:
    notes.append("replicas differ")
  if r.nominal_bytes >= 0 and r.wire_bytes != r.nominal_bytes:
    notes.append(f"HLO bytes != nominal {r.nominal_bytes:,}")
  return "; ".join(notes)


def table(results: List[Result]) -> str:
  """The results as a markdown table; each method against the dense run of its chain."""
  head = ["method", "chain", "held-out loss", "vs dense (%)", "wire B/step", "vs dense bytes (x)"]
  for c in PREDICTED:
    head += [f"pred. {c} (ms)", f"speed-up {c}"]
  head.append("note")
  rows = []
  for r in results:
    dense = _dense(results, r.chain)
    if r.error:
      rows.append([r.method, r.chain] + ["-"] * (len(head) - 3) + [_note(r, dense)])
      continue
    vs = (f"{100 * (r.held_out_loss / dense.held_out_loss - 1):+.1f}"
          if dense and math.isfinite(r.held_out_loss) else "-")
    ratio = f"{dense.wire_bytes / r.wire_bytes:.1f}x" if dense and r.wire_bytes > 0 else "-"
    row = [r.method, r.chain, f"{r.held_out_loss:.4f}", vs, fmt_bytes(r.wire_bytes), ratio]
    for c in PREDICTED:
      t, t_dense = r.predicted.get(c), dense.predicted.get(c) if dense else None
      row += [f"{1e3 * t:.1f}" if t is not None else "-",
              f"{t_dense / t:.2f}x" if t is not None and t_dense is not None else "-"]
    rows.append(row + [_note(r, dense)])
  return markdown_table(head, rows)


def figure(results: List[Result], out: str, steps: int) -> str:
  """``loss_vs_bytes.png``: held-out loss against wire bytes per step, one marker per method and chain."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ok = [r for r in results if not r.error and r.wire_bytes > 0 and math.isfinite(r.held_out_loss)]
  order = list(dict.fromkeys(r.method for r in results))
  fig, ax = plt.subplots(figsize=(10, 6))
  for r in ok:  # a method's colour and marker (train.py's), filled for the recipe chain, hollow for default
    st = style(order.index(r.method))
    filled = r.chain == "recipe"
    ax.scatter(r.wire_bytes, r.held_out_loss, s=44, marker=st["marker"], zorder=3,
               facecolors=st["color"] if filled else "none", edgecolors=st["color"], linewidths=1.4,
               label=f"{r.method} ({r.chain})")
    ax.annotate(r.method, (r.wire_bytes, r.held_out_loss), xytext=(4, 3), textcoords="offset points",
                fontsize=6, color=st["color"])
  for c, ls in zip(CHAINS, ("--", ":"), strict=True):
    dense = _dense(results, c)
    if dense is not None and math.isfinite(dense.held_out_loss):
      ax.axhline((1 + WORSE) * dense.held_out_loss, color="gray", ls=ls, lw=0.8,
                 label=f"dense + {100 * WORSE:g}% ({c})")
  ax.set_xscale("log")
  ax.set_xlabel("bytes per worker per step (from the compiled step's HLO)")
  ax.set_ylabel("held-out loss (nats per character)")
  ax.set_title(f"Character transformer on pydoc topics, {WORKERS} workers, {steps} steps, AdamW")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
  fig.tight_layout()
  path = os.path.join(out, "loss_vs_bytes.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _train_all(plan: List[Tuple[str, str]], args) -> List[Result]:
  """Every ``(method, chain)`` of ``plan`` in turn, each printed as it ends."""
  results: List[Result] = []
  for name, chain in plan:
    r = train(name, args.steps, chain, args.lr, args.seed, WORKERS, PER_WORKER_BATCH,
              progress=not args.no_progress)
    results.append(r)
    if r.error:
      print(f"{name:>13} {chain:<7}: failed: {r.error.splitlines()[-1][:120]}", flush=True)
    else:
      print(f"{name:>13} {chain:<7}: held-out {r.held_out_loss:.4f}  train {r.final_train_loss:.4f}"
            f"  {r.wire_bytes:>9,} B/step  {1e3 * r.step_seconds:6.1f} ms/step  (compile"
            f" {r.compile_seconds:.1f} s, wall {r.wall_seconds:.0f} s)", flush=True)
  return results


def _predict_all(results: List[Result]) -> None:
  """Fills each result's ``predicted`` step times, against the dense run of its chain."""
  for r in results:
    dense = _dense(results, r.chain)
    if dense is not None and not r.error:
      try:
        r.predicted = predicted_times(r, dense, LATENCY_US * 1e-6)
      except Exception as e:  # noqa: BLE001 -- a model we do not own must not lose the run
        print(f"network model failed for {r.method}: {type(e).__name__}: {e}", file=sys.stderr)


def _notes() -> List[str]:
  """The lines under the table: what each column is."""
  return [
      "held-out loss: mean cross-entropy in nats per character over"
      f" {EVAL_WINDOWS} fixed windows of {CONTEXT} from the held-out 10%, replica 0's parameters;"
      " vs dense: its change against the dense run of the same chain.",
      "wire B/step: bytes one worker hands to collectives per step, read from the compiled step's HLO"
      " (after a warm-up: the last stage's, compiled alone); vs dense bytes: dense's bytes / these.",
      f"pred. 8w@BG: jaxcomp.planning.netsim's step time for 8 workers on a flat ring of B Gb/s links, alpha"
      f" {LATENCY_US:g} us: the dense step measured here (median over blocks of {BLOCK_EVERY} steps,"
      f" {WORKERS} workers sharing {os.cpu_count()} CPU cores) as compute, the method's extra step time"
      " over dense as compression, its compiled step's collectives as traffic, no overlap;"
      " speed-up: dense's predicted time / the method's.",
      f"note: flags a held-out loss more than {100 * WORSE:g}% above dense's, and divergence"
      f" (non-finite, or above {DIVERGED:g}x dense's).",
  ]


def _write(args, meta: dict, results: List[Result], text: str) -> None:
  """results.json, results.md (``text``) and the figure in ``args.out``; prints their paths."""
  os.makedirs(args.out, exist_ok=True)
  written = [os.path.join(args.out, f) for f in ("results.json", "results.md")]
  with open(written[0], "w") as f:
    json.dump({"meta": meta, "results": [dataclasses.asdict(r) for r in results]}, f, indent=1,
              allow_nan=True)
  with open(written[1], "w") as f:
    f.write(text)
  written.append(figure(results, args.out, args.steps))
  print(f"wrote {', '.join(written)}")


def main(argv: Optional[Sequence[str]] = None) -> List[Any]:
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--diloco" in argv:  # DiLoCo, SparseLoCo and Streaming DiLoCo against data parallelism
    from jaxcomp_bench import diloco_lm

    return diloco_lm.main([a for a in argv if a != "--diloco"])
  args = _parse(argv)
  plan = runs(args.methods, args.chain)
  jaxcomp.cpu_devices(WORKERS)

  corpus = load()
  params = init_params(Transformer(corpus.vocab_size), args.seed)
  n_params, n_leaves = num_params(params), len(jax.tree.leaves(params))
  cmd = "python -m jaxcomp.bench lm " + " ".join(argv)
  head = header(cmd.strip())
  facts = (f"data: pydoc_data.topics, {len(corpus.text):,} characters, vocabulary {corpus.vocab_size},"
           f" {len(corpus.train):,} train / {len(corpus.held_out):,} held out, context {CONTEXT};"
           f" model: transformer, {LAYERS} blocks, width {WIDTH}, {HEADS} heads, MLP {MLP},"
           f" {n_params:,} parameters in {n_leaves} leaves; {WORKERS} workers (jax.pmap) x"
           f" {PER_WORKER_BATCH} windows; {args.steps} steps; AdamW lr {args.lr:g}; seed {args.seed}")
  print(head)
  print(facts)
  print(f"runs ({len(plan)}): {', '.join(f'{m}/{c}' for m, c in plan)}", flush=True)

  t_all = time.perf_counter()
  results = _train_all(plan, args)
  total = time.perf_counter() - t_all
  _predict_all(results)
  md = table(results)
  print()
  print(md)
  notes = _notes()
  print("\n" + "\n".join(notes))
  print(f"\ntotal {total:.0f} s")

  meta = {
      "header": head, "command": cmd.strip(), "characters": len(corpus.text), "vocab": corpus.vocab_size,
      "train": len(corpus.train), "held_out": len(corpus.held_out), "context": CONTEXT,
      "eval_windows": EVAL_WINDOWS, "params": n_params, "leaves": n_leaves, "workers": WORKERS,
      "per_worker_batch": PER_WORKER_BATCH, "steps": args.steps, "lr": args.lr, "seed": args.seed,
      "chain": args.chain, "optimizer": "adamw", "jax": jax.__version__,
      "python": platform.python_version(), "cpus": os.cpu_count(), "total_seconds": total,
      "netsim": True, "latency_us": LATENCY_US,
  }
  _write(args, meta, results,
         f"{head}\n\n{facts}\n\n{md}\n\n" + "\n".join(notes) + f"\n\ntotal {total:.0f} s\n")
  return results


if __name__ == "__main__":
  main()
