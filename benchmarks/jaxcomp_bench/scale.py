"""``python -m jaxcomp.bench scale``: both exchanges at N = 8 ... 1024 against dense float32 and bfloat16.

For ResNet-50 and BERT-base gradient shapes, each method's collectives per
step at N workers come from its bucket layout (:func:`jaxcomp.traffic`,
equal per kind to the compiled program's bytes, see ``tests/test_scatter.py``):
with ``transport="gather"`` every worker hands one payload to an all-gather
and receives N - 1; with ``transport="scatter"`` it hands N chunk payloads to
an all-to-all and one to an all-gather, and receives about two payloads.
Priced by :mod:`jaxcomp.planning.netsim` (flat ring network, alpha per message,
collectives of one kind fused into 25 MB buckets) with the compute times of
``python -m jaxcomp.bench network``. Alone, this table prices compute +
communication; ``python -m jaxcomp.bench network`` prints it again with each
method's measured compression time (gather: N - 1 decodes; scatter: two).
Then the bytes each worker receives, measured from the compiled pmap steps of
the main job's CNN at N = 2, 4, 8 (``--no-measure`` skips them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from jaxcomp.planning import netsim
from jaxcomp_bench.common import COMPUTE, LABELS, header, plain

WORKERS = (8, 64, 256, 1024)
GBPS = (1.0, 10.0)
METHODS = ("qsgd", "signsgd", "topk", "dgc", "onebit", "terngrad")
BUCKET_MB = 25.0


def rows(model: str, methods: Sequence[str] = METHODS, workers: Sequence[int] = WORKERS,
         gbps: Sequence[float] = GBPS, latency_us: float = 10.0,
         compress: Mapping[str, tuple[float, float]] | None = None) -> list[dict]:
  """One dict per (method, exchange): ``label``, ``ratio`` (dense f32 bytes / handed bytes at N=8), ``cells``.

  ``cells[(n, gbps)] = (step seconds, speed-up over dense float32, over dense bfloat16)``.
  ``compress``: method -> (round trip, decode per payload) seconds (None: no compression time).
  """
  import jaxcomp
  from jaxcomp.core.accounting import traffic
  from jaxcomp_bench import shapes

  params = shapes.abstract(shapes.MODELS[model]())
  compute = COMPUTE[model][0]
  alpha = latency_us * 1e-6
  compress = compress or {}

  def price(tx, label, transport):
    rt, dec = compress.get(label, (0.0, 0.0))
    out = {}
    for n in workers:
      colls = traffic(tx, params, n)
      gathered = transport == "gather" and any(k == "all-gather" for k, _ in colls)
      comp = netsim.compression_time(rt, dec, n, gathered=gathered, scattered=transport == "scatter")
      for b in gbps:
        out[(n, b)] = netsim.predict(colls, netsim.flat(n, b, alpha), compute, comp,
                                     bucket_bytes=BUCKET_MB * 1e6).total
    return out, sum(nb for _, nb in traffic(tx, params, 8))

  dense, dense_bytes = price(jaxcomp.none(axis_name="data"), "none", "gather")
  half, _ = price(jaxcomp.bf16(axis_name="data"), "bf16", "gather")
  out = []
  entries = [("none", "gather", jaxcomp.none(axis_name="data")),
             ("bf16", "gather", jaxcomp.bf16(axis_name="data"))]
  for m in methods:
    for ex in ("gather", "scatter"):
      entries.append((m, ex, jaxcomp.METHODS[m](axis_name="data", transport=ex)))
  for m, ex, tx in entries:
    t, nbytes = price(tx, m, ex)
    out.append({"label": f"{m} {ex}" if m not in ("none", "bf16") else f"{m} (dense)", "method": m,
                "transport": ex, "ratio": dense_bytes / nbytes,
                "cells": {k: (v, dense[k] / v, half[k] / v) for k, v in t.items()}})
  return out


def check(table_rows: list[dict]) -> list[str]:
  """The issue's targets, per method: its best exchange at least as fast as dense f32 everywhere.

  And faster than dense bf16 everywhere where its nominal ratio is at least 4.
  """
  notes = []
  for m in sorted({r["method"] for r in table_rows} - {"none", "bf16"}):
    mine = [r for r in table_rows if r["method"] == m]
    keys = mine[0]["cells"].keys()
    best = {k: max(mine, key=lambda r: r["cells"][k][1])["cells"][k] for k in keys}
    ratio = max(r["ratio"] for r in mine)
    slow = [k for k, v in best.items() if v[1] < 1.0]
    behind_bf16 = [k for k, v in best.items() if v[2] <= 1.0] if ratio >= 4 else []
    ok = not slow and not behind_bf16
    what = "meets" if ok else "misses"
    notes.append(f"{m}: best exchange {what} the target (nominal ratio {ratio:.1f}x"
                 + (f"; slower than dense f32 at {slow}" if slow else "")
                 + (f"; not faster than bf16 at {behind_bf16}" if behind_bf16 else "") + ")")
  return notes


def table(models: Sequence[str] = ("resnet50", "bert-base"), methods: Sequence[str] = METHODS,
          workers: Sequence[int] = WORKERS, gbps: Sequence[float] = GBPS, latency_us: float = 10.0,
          compress: Mapping[str, Mapping[str, tuple[float, float]]] | None = None) -> str:
  """The printed tables, one per model (``compress``: model -> method -> seconds, see :func:`rows`)."""
  lines = []
  cols = [(n, b) for n in workers for b in gbps]
  for model in models:
    rs = rows(model, methods, workers, gbps, latency_us, (compress or {}).get(model))
    lines.append(f"\n{LABELS.get(model, model)}: predicted step ms, speed-up over dense float32 /"
                 " over dense bfloat16" + ("" if compress else " (compute + communication only)"))
    lines.append(f"{'method':<18} {'ratio':>6} " + " ".join(f"{f'N={n} {b:g}Gb/s':>20}" for n, b in cols))
    for r in rs:
      cells = " ".join(f"{r['cells'][k][0] * 1e3:7.0f} {r['cells'][k][1]:5.2f}x {r['cells'][k][2]:4.2f}x"
                       for k in cols)
      lines.append(f"{r['label']:<18} {r['ratio']:5.1f}x {cells}")
    lines.extend("  " + n for n in check(rs))
  return "\n".join(lines)


def measured(methods: Sequence[str] = ("qsgd", "signsgd", "topk"), workers: Sequence[int] = (2, 4, 8)) -> str:
  """Bytes each worker receives per step, from the compiled pmap step of the main job's CNN at N = workers.

  Every collective priced as a ring (:func:`jaxcomp.received_bytes`); the
  program holds the whole update (the method only, no model).
  """
  import jax
  import jax.numpy as jnp

  import jaxcomp
  from jaxcomp_bench import model

  params = model.init_params(model.CNN(), (28, 28, 1))
  lines = [f"\nMeasured from the compiled program (main job CNN, {model.num_params(params):,} parameters):"
           " bytes each worker receives per step (ring collectives)",
           f"{'method':<18} " + " ".join(f"{f'N={n}':>10}" for n in workers)
           + f" {f'N={workers[-1]}/N={workers[-2]}':>12} {'scatter/gather':>15}"]

  def received(tx, n):
    lead = lambda a: jnp.broadcast_to(a, (n,) + jnp.shape(a))  # noqa: E731
    step = jax.pmap(lambda g, s: tx.update(g, s), axis_name="data", devices=jax.devices()[:n])
    hlo = step.lower(jax.tree.map(lead, params), jax.tree.map(lead, tx.init(params))).compile().as_text()
    return jaxcomp.collective_bytes(hlo)["received"]

  for m in ["none"] + list(methods):
    got = {}
    for ex in (("gather",) if m == "none" else ("gather", "scatter")):
      tx = jaxcomp.steady(jaxcomp.METHODS[m](axis_name="data", transport=ex))
      got[ex] = [received(tx, n) for n in workers]
    for ex, r in got.items():
      vs = f"{r[-1] / got['gather'][-1]:.2f}" if ex == "scatter" else "-"
      lines.append(f"{f'{m} {ex}':<18} " + " ".join(f"{b:>10,}" for b in r) + f" {r[-1] / r[-2]:>12.2f}"
                   + f" {vs:>15}")
  jax.clear_caches()
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxcomp.bench scale", description=plain(__doc__),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="resnet50,bert-base")
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--workers", default=",".join(map(str, WORKERS)))
  parser.add_argument("--gbps", default=",".join(f"{b:g}" for b in GBPS))
  parser.add_argument("--latency-us", type=float, default=10.0)
  parser.add_argument("--no-measure", action="store_true", help="skip the compiled programs at N = 2, 4, 8")
  args = parser.parse_args(argv)
  import jaxcomp

  jaxcomp.cpu_devices(8)  # before any JAX work (the measured programs run on 8 CPU devices)

  command = "python -m jaxcomp.bench scale " + " ".join(argv if argv is not None else sys.argv[1:])
  print(header(command.strip()))
  print(table([m for m in args.models.split(",") if m], [m for m in args.methods.split(",") if m],
              [int(n) for n in args.workers.split(",")], [float(b) for b in args.gbps.split(",")],
              args.latency_us))
  if not args.no_measure:
    print(measured())


if __name__ == "__main__":
  main()
