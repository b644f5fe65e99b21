"""A schedule's stages under ``transport="scatter"``: shared selection search against whole stages.

``ScatterExchange.exchange_stages`` runs the chunking, the keys, the owner residual and what the
stages' codecs share (DGC's sampled thresholds, RedSync's binary search: ``prepare_stages``) once,
and switches on the stage only for each phase's payloads and collectives. Before, ``lax.switch``
ran each stage's whole scatter exchange. Prints, one run, for each configuration: the 8-worker
``jax.pmap`` step's fusions, lowering and compile seconds, both ways (the whole-stages way is the
base ``Exchange.exchange_stages``, patched in for the run), on the digits MLP of the suite.

Usage: ``python benchmarks/staged_scatter.py [--methods dgc,redsync] [--tree digits|resnet50]``
(dgc: its default warm-up, five stages; redsync: its recipe's warm-up, five stages; resnet50's shapes compile
for minutes.)
"""

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))

import jaxcomp  # noqa: E402

jaxcomp.cpu_devices(8)

import jax  # noqa: E402

from jaxcomp.core.protocol import Exchange  # noqa: E402
from jaxcomp.exchanges.scatter import ScatterExchange  # noqa: E402

CONFIGS = {
    "dgc": lambda: jaxcomp.dgc(axis_name="data", transport="scatter"),
    "redsync": lambda: jaxcomp.recipe_method("redsync", axis_name="data", transport="scatter"),
}


def tree(name: str):
  from jaxcomp_bench import shapes
  from jaxcomp_bench.tasks import TASKS

  if name == "digits":
    return TASKS["digits"].init(0)
  return shapes.abstract(shapes.resnet50_shapes())


def measure(tx, params) -> dict:
  """Fusions, lowering and compile seconds of the 8-worker pmap step of ``tx`` on ``params``."""
  state = jax.eval_shape(tx.init, params)
  lead = lambda s: jax.ShapeDtypeStruct((8,) + tuple(s.shape), s.dtype)
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name="data")
  t = time.perf_counter()
  lowered = step.lower(jax.tree.map(lead, params), jax.tree.map(lead, state))
  lower_s = time.perf_counter() - t
  t = time.perf_counter()
  text = lowered.compile().as_text()
  compile_s = time.perf_counter() - t
  fusions = len(re.findall(r"^\s*\S+ = \S+ fusion\(", text, re.M))
  return {"stages": len(tx.method.stages) + 1, "fusions": fusions, "lower": lower_s, "compile": compile_s}


def compare(make, params) -> dict:
  """``measure`` of ``make()`` both ways: ``{"whole": ..., "shared": ...}`` (the shared way restored)."""
  shared_way = ScatterExchange.__dict__["exchange_stages"]
  out = {}
  for way in ("whole", "shared"):
    ScatterExchange.exchange_stages = Exchange.exchange_stages if way == "whole" else shared_way
    try:
      out[way] = measure(make(), params)
    finally:
      ScatterExchange.exchange_stages = shared_way
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--methods", default="dgc,redsync", help="comma-separated: dgc, redsync")
  parser.add_argument("--tree", default="digits", choices=("digits", "resnet50"))
  args = parser.parse_args(argv)
  names = [n for n in args.methods.split(",") if n]
  unknown = sorted(set(names) - set(CONFIGS))
  if unknown or not names:
    parser.error(f"--methods takes some of {sorted(CONFIGS)}, got {args.methods!r}")
  params = tree(args.tree)
  print(f"{'method':<9} {'stages':>6} {'way':<7} {'fusions':>7} {'lower s':>8} {'compile s':>9}")
  for name in names:
    for way, r in compare(CONFIGS[name], params).items():
      print(f"{name:<9} {r['stages']:>6} {way:<7} {r['fusions']:>7} {r['lower']:>8.2f} {r['compile']:>9.2f}",
            flush=True)


if __name__ == "__main__":
  main()
