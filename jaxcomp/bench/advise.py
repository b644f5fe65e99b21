"""``python -m jaxcomp.bench advise``: every method ranked by its predicted step on a given network.

For a model (ResNet-50, BERT-base, one chip's shard of a Llama-3-8B-shaped
model, or any parameter tree through :func:`advise`) and a network (``workers``
on links of ``gbps`` each, ``latency_us`` per message), each method's row holds:

- **bytes**: what one worker sends per step, from the bucket layout and the
  codecs' payload shapes (``jaxcomp.traffic``, no compile; ACP-SGD's fused
  exchange: its nominal ``jaxcomp.wire_bytes`` as one all-reduce; SBC's bytes
  over its ``delay``);
- **communication**: the ring alpha-beta model of those collectives
  (:mod:`jaxcomp.bench.netsim`);
- **compression**: the encode + decode round trip measured by ``python -m
  jaxcomp.bench kernels --json PATH`` on a device (``kernels=``; default: the
  bundled table of one H200, ``data/kernels_h200.json``), the method's time
  beyond the dense update's, scaled by the number of values; a gathered
  method's decodes of the other workers' payloads are not in it;
- **compute**: stated per model (``--compute-ms`` overrides);
- **fidelity**: the share of the suite's runs (``python -m jaxcomp.bench
  suite``: five tasks, both horizons, batches and transports) in which the
  method's recipe met its target against dense, with SGD and with AdamW
  (``data/fidelity.json``, read from the tables of docs/recipes.md).

The step is ``compute + compression + communication`` (no overlap; ``--overlap``
hides communication behind backprop). DiLoCo rows send the dense float32
all-reduce once every ``H`` steps (``diloco H=16``, ``H=64``); their fidelity
is not in the suite and reads ``-``. It prints one ranked table per bandwidth
and draws one figure: suite pass rate against predicted step time, a panel
per bandwidth, every point labelled, the Pareto frontier drawn, dense float32
and bfloat16 marked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Any, Sequence

from jaxcomp.bench import netsim
from jaxcomp.bench.common import plain

DATA = os.path.join(os.path.dirname(__file__), "data")
MODELS = ("resnet50", "bert-base", "llama-1b", "llama-8b", "llama-70b")
DILOCO_H = (16, 64)
LLAMA_CHIPS = 256  # chips per slice that shard the Llama tree (``jaxcomp.bench.slices``)
LLAMA_TOKENS, LLAMA_FLOPS, LLAMA_MFU = 2048, 197e12, 0.4  # slices.Setting: tokens per chip, v5e bf16, MFU
CAPTION = ("Which method gives the fastest step on this network, and how often does its recipe hold"
           " accuracy? Up and left is better; the line is the Pareto frontier.")


@dataclasses.dataclass(frozen=True)
class Row:
  """One method's prediction: seconds per step and its parts, bytes per worker, suite pass rates."""

  method: str
  bytes: float
  communication: float
  compression: float
  step: float
  speedup: float  # dense float32 step / this step
  fidelity: dict  # optimizer -> (passed, runs); empty for DiLoCo


def _positive(name: str, v: float) -> float:
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
    raise ValueError(f"{name} must be a number > 0, got {name}={v!r}")
  return float(v)


def load_json(name_or_path: str) -> dict:
  path = name_or_path if os.path.sep in name_or_path else os.path.join(DATA, name_or_path)
  with open(path) as f:
    return json.load(f)


def per_value_seconds(kernels: dict) -> dict:
  """method -> seconds per gradient value beyond the dense update's, averaged over the table's cases."""
  by_case: dict = {}
  for r in kernels["cases"]:
    if "seconds" in r:
      by_case.setdefault(r["case"], {})[r["method"]] = (r["seconds"], r["values"])
  out: dict = {}
  for rows in by_case.values():
    base = rows.get("none", (0.0, 1))[0]
    for m, (s, n) in rows.items():
      out.setdefault(m, []).append(max(0.0, s - base) / n)
  return {m: sum(v) / len(v) for m, v in out.items()}


def unmeasured(kernels: str | dict = "kernels_h200.json") -> list[str]:
  """The methods of ``jaxcomp.METHODS`` the kernel table has no row for (left out of the ranking)."""
  from jaxcomp.registry import METHODS

  cost = per_value_seconds(load_json(kernels) if isinstance(kernels, str) else kernels)
  return [n for n in METHODS if n != "none" and n not in cost]


def method_traffic(name: str, params: Any, workers: int, optimizer: str = "sgd", **settings) -> list:
  """``(kind, bytes)`` per collective of a steady step of ``name``'s recipe (``jaxcomp.recipe_method``)
  for ``optimizer``, the configuration the suite measured (averaged over SBC's delay); ``settings``:
  build options of the recipe (``transport``, ``dense``)."""
  from jaxcomp.accounting import traffic, wire_bytes
  from jaxcomp.rebuild import steady
  from jaxcomp.recipes import recipe_method
  from jaxcomp.transformation import method_of

  tx = steady(recipe_method(name, "data", optimizer=optimizer, **settings))
  method = method_of(tx, params)
  if method.fused is not None:
    return [("all-reduce", float(wire_bytes(tx, params, workers=workers)))]
  every = method.sync_every
  return [(k, b / every) for k, b in traffic(tx, params, workers=workers)]


def value_count(params: Any) -> int:
  import jax
  import numpy as np

  return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(params)))


def network(workers: int, gbps: float, latency_us: float = 10.0, per_node: int = 1,
            intra_gbps: float = 400.0) -> netsim.Network:
  """A flat ring of ``gbps`` links, or nodes of ``per_node`` workers on ``intra_gbps`` links (two levels)."""
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
    raise ValueError(f"workers must be an int >= 2, got workers={workers!r}")
  if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1 or workers % per_node:
    raise ValueError(f"per_node must be an int >= 1 that divides workers={workers},"
                     f" got per_node={per_node!r}")
  gbps = _positive("gbps", gbps)
  latency = _positive("latency_us", latency_us) * 1e-6 if latency_us else 0.0
  if per_node == 1:
    return netsim.flat(workers, gbps, latency)
  return netsim.two_level(workers, per_node, gbps, _positive("intra_gbps", intra_gbps), latency, latency)


def advise(params: Any, gbps: float, workers: int, compute_s: float, *, latency_us: float = 10.0,
           per_node: int = 1, intra_gbps: float = 400.0, overlap: bool = False, optimizer: str = "sgd",
           kernels: str | dict = "kernels_h200.json",
           fidelity: str | dict = "fidelity.json", methods: Sequence[str] | None = None,
           diloco: Sequence[int] = DILOCO_H) -> list[Row]:
  """Every method (and DiLoCo every ``H`` of ``diloco``) on ``params``, fastest predicted step first.

  ``params``: the gradient tree (arrays or ``jax.ShapeDtypeStruct``); ``gbps``:
  each worker's link in Gb/s (with ``per_node`` > 1: each node's link between nodes, its workers
  joined by ``intra_gbps`` links: a two-level network); ``workers``: N; ``compute_s``: forward and
  backward seconds per step; ``optimizer``: ``"sgd"`` or ``"adamw"``, whose recipes
  (``jaxcomp.recipe``) give the bytes and whose suite runs the fidelity; ``kernels``: a
  ``python -m jaxcomp.bench kernels --json`` file (or its dict) measured on the device that will
  train (the methods at the kernel benchmark's settings, not the recipes'); a method it has no
  row for is left out (:func:`unmeasured`), never priced at no cost.
  """
  from jaxcomp.registry import METHODS

  net = network(workers, gbps, latency_us, per_node, intra_gbps)
  compute_s = _positive("compute_s", compute_s)
  if optimizer not in ("sgd", "adamw"):
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got optimizer={optimizer!r}")
  names = list(METHODS) if methods is None else list(methods)
  for n in names:
    if n not in METHODS:
      raise ValueError(f"methods: unknown method {n!r}; choose from {sorted(METHODS)}")
  names = ["none"] + [n for n in names if n != "none"]  # dense float32, the reference, always ranked
  cost = per_value_seconds(load_json(kernels) if isinstance(kernels, str) else kernels)
  names = [n for n in names if n == "none" or n in cost]  # a method the table lacks is not priced at 0
  fid = (load_json(fidelity) if isinstance(fidelity, str) else fidelity)["methods"]
  nvalues = value_count(params)
  traffic = {n: method_traffic(n, params, workers, optimizer) for n in set(names) | {"none"}}
  dense_comm = netsim.communication_time(traffic["none"], net)
  parts = {n: (netsim.communication_time(traffic[n], net), cost.get(n, 0.0) * nvalues,
               sum(b for _, b in traffic[n]), _fid(fid, n, optimizer))
           for n in names}
  for h in diloco:
    parts[f"diloco H={h}"] = (dense_comm / h, 0.0, sum(b for _, b in traffic["none"]) / h, {})
  dense = netsim.step_time(compute_s, 0.0, dense_comm, overlap).total
  rows = []
  for name, (comm, comp, nbytes, f) in parts.items():
    step = netsim.step_time(compute_s, comp, comm, overlap).total
    rows.append(Row(name, nbytes, comm, comp, step, dense / step, f))
  return sorted(rows, key=lambda r: (r.step, r.method))


def _fid(fid: dict, name: str, optimizer: str) -> dict:
  return {o: tuple(v) for o, v in fid.get(name, {}).items() if o == optimizer}


def pass_rate(row: Row) -> float | None:
  """Share of the suite's runs (both optimizers) in which the method met its target; None for DiLoCo.

  Dense float32 (``none``) is the suite's reference: 1."""
  if row.method == "none":
    return 1.0
  runs = sum(v[1] for v in row.fidelity.values())
  return None if not runs else sum(v[0] for v in row.fidelity.values()) / runs


def frontier(rows: Sequence[Row]) -> list[Row]:
  """The rows no other row beats on both step time and pass rate (DiLoCo rows left out)."""
  from jaxcomp.bench.common import frontier as pareto

  return [p[0] for p in pareto([(r, r.step, pass_rate(r)) for r in rows if pass_rate(r) is not None])]


def fidelity_from_recipes(markdown: str) -> dict:
  """``{method: {optimizer: [passed, runs]}}`` from docs/recipes.md's suite tables (bold = missed)."""
  out: dict = {}
  for opt in ("sgd", "adamw"):
    m = re.search(rf"^\| {opt} +\|.*\n\|[-| ]+\|\n((?:\|.*\|\n)+)", markdown, re.M)
    if m is None:
      raise ValueError(f"no '| {opt} |' suite table in the markdown")
    for line in m.group(1).splitlines():
      cells = [c.strip() for c in line.strip("|").split("|")]
      name = cells[0].strip("`")
      if name == "none":
        continue
      runs = [c for c in cells[1:] if c and c != "n/a"]
      out.setdefault(name, {})[opt] = [sum(not c.startswith("**") for c in runs), len(runs)]
  return out


def model_tree(model: str, chips: int = LLAMA_CHIPS) -> tuple[Any, float, str]:
  """(gradient tree, compute seconds per step, where that figure comes from) of a named model."""
  from jaxcomp.bench import shapes as shp
  from jaxcomp.bench.common import COMPUTE

  if model.startswith("llama-"):
    size = model.split("-", 1)[1]
    n = shp.llama_params(size)
    return (shp.llama_shard(size, chips), 6 * n * LLAMA_TOKENS / (LLAMA_FLOPS * LLAMA_MFU),
            f"6 x {n:.3g} parameters x {LLAMA_TOKENS} tokens per chip at {LLAMA_FLOPS / 1e12:g} TFLOP/s x"
            f" {LLAMA_MFU} MFU (one chip's shard of {chips})")
  if model not in shp.MODELS:
    raise ValueError(f"model must be one of {MODELS}, got model={model!r}")
  return shp.abstract(shp.MODELS[model]()), COMPUTE[model][0], COMPUTE[model][1]


def _fid_text(row: Row) -> str:
  if row.method == "none":
    return "the reference"
  if not row.fidelity:
    return "-"
  return " ".join(f"{o} {p}/{n}" for o, (p, n) in sorted(row.fidelity.items(), reverse=True))


def table(rows: Sequence[Row]) -> str:
  from jaxcomp.bench.common import fmt_bytes, markdown_table

  on = {r.method for r in frontier(rows)}
  body = [[i + 1, f"`{r.method}`" + (" *" if r.method in on else ""), fmt_bytes(r.bytes),
           f"{r.communication * 1e3:.2f}", f"{r.compression * 1e3:.2f}", f"{r.step * 1e3:.1f}",
           f"{r.speedup:.2f}x", _fid_text(r)] for i, r in enumerate(rows)]
  return markdown_table(["rank", "method (* frontier)", "bytes/worker/step", "comm ms", "compress ms",
                         "step ms", "vs dense f32", "suite runs within target"], body)


def _name(r: Row) -> str:
  return {"none": "dense f32", "bf16": "dense bf16"}.get(r.method, r.method)


def figure(panels: Sequence[tuple[str, Sequence[Row]]], path: str, title: str) -> None:
  """Pass rate against predicted step, one panel per (label, rows); every point labelled."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from jaxcomp.bench.common import colours, label_points

  names = sorted({r.method for _, rows in panels for r in rows if pass_rate(r) is not None})
  colour = colours(names)
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 6.0), squeeze=False)
  for ax, (label, rows) in zip(axes[0], panels):
    shown = [r for r in rows if pass_rate(r) is not None]
    for r in shown:
      dense = r.method in ("none", "bf16")
      ax.scatter(r.step * 1e3, 100 * pass_rate(r), s=160 if dense else 40, color=colour[r.method],
                 marker="*" if dense else "o", edgecolor="black", linewidth=0.5, zorder=3)
    f = frontier(rows)
    ax.plot([r.step * 1e3 for r in f], [100 * pass_rate(r) for r in f], color="black", lw=1, zorder=2)
    ax.set_xscale("log")
    ax.set_xlabel("predicted step time (ms, log scale)")
    ax.set_ylabel("suite runs within target (%)")
    ax.set_ylim(top=106)
    ax.set_title(label)
    ax.grid(alpha=0.3)
  fig.suptitle(f"{title}\n{CAPTION}", fontsize=10)
  fig.tight_layout()
  for ax, (_, rows) in zip(axes[0], panels):
    label_points(ax, [(_name(r), r.step * 1e3, 100 * pass_rate(r)) for r in rows if pass_rate(r) is not None])
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxcomp.bench advise", description=plain(__doc__),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="resnet50", choices=MODELS)
  p.add_argument("--gbps", default="1,10,100", help="each worker's link, Gb/s, comma-separated")
  p.add_argument("--workers", type=int, default=8, help="N (llama-*: the number of slices)")
  p.add_argument("--latency-us", type=float, default=10.0)
  p.add_argument("--per-node", type=int, default=1,
                 help="workers per node (> 1: two levels, --gbps between nodes)")
  p.add_argument("--intra-gbps", type=float, default=400.0, help="the links inside a node (with --per-node)")
  p.add_argument("--overlap", action="store_true", help="communication hidden behind backprop")
  p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"),
                 help="the recipes (bytes) and suite runs (fidelity) of this optimizer")
  p.add_argument("--compute-ms", type=float, default=None, help="override the model's compute per step")
  p.add_argument("--kernels", default="kernels_h200.json",
                 help="a `python -m jaxcomp.bench kernels --json` file from the training device")
  p.add_argument("--methods", default=None, help="comma-separated (default: every method)")
  p.add_argument("--out", default=".", help="folder for advise_<model>.png")
  return p


def main(argv=None) -> list:
  args = _parser().parse_args(argv)
  from jaxcomp.bench.common import header

  tree, compute, source = model_tree(args.model)
  if args.compute_ms is not None:
    compute, source = _positive("--compute-ms", args.compute_ms) / 1e3, "given by --compute-ms"
  gbps = [float(g) for g in args.gbps.split(",") if g]
  methods = None if args.methods is None else [m for m in args.methods.split(",") if m]
  command = "python -m jaxcomp.bench advise " + " ".join(argv if argv is not None else sys.argv[1:])
  print(header(command.strip()))
  kern = load_json(args.kernels)
  print(f"model {args.model}: {value_count(tree):,} values per worker; compute {compute * 1e3:.0f} ms/step"
        f" ({source}); {args.workers} workers, ring collectives, {args.latency_us:g} us per message,"
        f" {'overlap with backprop' if args.overlap else 'no overlap'};"
        f" compression from: {kern.get('source', args.kernels)} (encode + decode; a gathered method's"
        " decodes of the other workers' payloads not counted); fidelity from: the suite (data/fidelity.json)")
  panels = []
  for g in gbps:
    rows = advise(tree, g, args.workers, compute, latency_us=args.latency_us, per_node=args.per_node,
                  intra_gbps=args.intra_gbps, overlap=args.overlap,
                  optimizer=args.optimizer, kernels=kern, methods=methods)
    print(f"\n{args.model} at {g:g} Gb/s per worker:\n{table(rows)}", flush=True)
    panels.append((f"{args.model}, {args.workers} workers at {g:g} Gb/s", rows))
  left = [n for n in unmeasured(kern) if methods is None or n in methods]
  if left:
    print(f"\nnot ranked (no row in the kernel table): {', '.join(left)}")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"advise_{args.model}.png")
  device = kern.get("device", args.kernels)
  figure(panels, path, f"jaxcomp advise: {args.model}; compression measured on {device};"
         f" fidelity: the suite's runs of the {args.optimizer} recipes")
  print(f"\nfigure: {path}")
  return panels
