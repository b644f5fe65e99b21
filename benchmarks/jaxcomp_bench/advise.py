"""``python -m jaxcomp.bench advise``: every method ranked by its predicted step on a given network.

For a model (ResNet-50, BERT-base, one chip's shard of a Llama-3-shaped model)
and a network (``--workers`` on links of ``--gbps`` each, ``--latency-us`` per
message, or two levels with ``--per-node``), the rows of
:func:`jaxcomp.planning.advise.advise` (bytes, communication, compression,
fidelity: see that module) with the model's compute per step (stated per model;
``--compute-ms`` overrides). DiLoCo rows read ``-`` for fidelity (not in the
suite). It prints one ranked table per bandwidth and draws one figure: suite
pass rate against predicted step time, a panel per bandwidth, every point
labelled, the Pareto frontier drawn, dense float32 and bfloat16 marked.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Sequence

from jaxcomp.planning.advise import (
  Row,
  advise,
  load_json,
  pass_rate,
  positive_number,
  unmeasured,
  value_count,
)
from jaxcomp_bench.common import plain

MODELS = ("resnet50", "bert-base", "llama-1b", "llama-8b", "llama-70b")
LLAMA_CHIPS = 256  # chips per slice that shard the Llama tree (``jaxcomp_bench.slices``)
LLAMA_TOKENS, LLAMA_FLOPS, LLAMA_MFU = 2048, 197e12, 0.4  # slices.Setting: tokens per chip, v5e bf16, MFU
CAPTION = ("Which method gives the fastest step on this network, and how often does its recipe hold"
           " accuracy? Up and left is better; the line is the Pareto frontier.")


def frontier(rows: Sequence[Row]) -> list[Row]:
  """The rows no other row beats on both step time and pass rate (DiLoCo rows left out)."""
  from jaxcomp_bench.common import frontier as pareto

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
  from jaxcomp_bench import shapes as shp
  from jaxcomp_bench.common import COMPUTE

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
  from jaxcomp_bench.common import fmt_bytes, markdown_table

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

  from jaxcomp_bench.common import colours, label_points

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
  from jaxcomp_bench.common import header

  tree, compute, source = model_tree(args.model)
  if args.compute_ms is not None:
    compute, source = positive_number("--compute-ms", args.compute_ms) / 1e3, "given by --compute-ms"
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
