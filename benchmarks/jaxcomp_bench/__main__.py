"""``python -m jaxcomp.bench [SUBCOMMAND] [options]``.

Without a subcommand: the training benchmark (every method on the same
budget; ``--task lm`` runs the transformer task instead). Each subcommand is a
module ``jaxcomp_bench.<name>`` with ``main(argv)``; no subcommand module
imports another (what they share is in :mod:`jaxcomp_bench.common`). Output
that combines several subcommands is composed here: ``network`` prints its
tables, then ``scale``'s and ``twolevel``'s for the same models, methods and
latency.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {  # name: (module, what it does)
    "train": ("jaxcomp_bench.train", "the main job (default)"),
    "kernels": ("jaxcomp_bench.kernels", "compress+decode speed vs a memory copy"),
    "network": ("jaxcomp_bench.network", "alpha-beta network model table"),
    "selection": ("jaxcomp_bench.selection", "RedSync selection vs lax.top_k"),
    "wire": ("jaxcomp_bench.wire", "payload bits per element, nominal and measured"),
    "longrun": ("jaxcomp_bench.longrun", "thousands of steps: bounded residuals, keys, replicas"),
    "recipes": ("jaxcomp_bench.recipes", "each method's jaxcomp.recipe as a table"),
    "twolevel": ("jaxcomp_bench.twolevel", "flat vs two-level compression on 8 nodes x 8 devices"),
    "scale": ("jaxcomp_bench.scale", "gather vs scatter exchange at N = 8 ... 1024"),
    "lm": ("jaxcomp_bench.lm", "the transformer language model task"),
    "slices": ("jaxcomp_bench.slices", "a sharded 8B model across slices, priced by the network model"),
    "advise": ("jaxcomp_bench.advise", "every method ranked by predicted step on a network, with fidelity"),
    "netcheck": ("jaxcomp_bench.netcheck", "the network model against measured collectives"),
    "suite": ("jaxcomp_bench.suite", "every recipe on five real tasks, horizons, batches, transports"),
    "diloco-suite": ("jaxcomp_bench.diloco_suite", "DiLoCo's settings on the suite's tasks, one held out"),
}


def run_train(argv: list[str]):
  """``train``: the CNN benchmark, or with ``--task lm`` the transformer task on the other arguments."""
  from jaxcomp_bench import train

  p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  p.add_argument("--task", default="cnn", choices=train.TASKS)
  known, rest = p.parse_known_args(argv)
  if known.task == "lm":
    from jaxcomp_bench import lm

    return lm.main(rest)
  return train.main(argv)


def run_network(argv: list[str]) -> None:
  """``network``: its tables, then both exchanges at scale and the two-level table with its inputs."""
  from jaxcomp_bench import network, scale, twolevel

  run = network.main(argv)
  print(f"\nBoth exchanges at scale (python -m jaxcomp.bench scale), N = {scale.WORKERS}, with the"
        " compression times above (gather: N - 1 decodes per step; scatter: two):")
  print(scale.table(run.models, [m for m in scale.METHODS if m in run.methods], latency_us=run.latency_us,
                    compress=run.compress))
  print("\nTwo levels (python -m jaxcomp.bench twolevel):\n")
  print(twolevel.table(run.models, latency_us=run.latency_us))


def run_lm(argv: list[str]) -> None:
  """``lm``: the transformer task; with ``--mesh``, a sharded model against a replicated one."""
  if any(a == "--mesh" or a.startswith("--mesh=") for a in argv):
    from jaxcomp_bench import lm_sharded

    return lm_sharded.main(argv)
  from jaxcomp_bench import lm

  return lm.main(argv)


# subcommands whose output is composed here
COMPOSED = {"train": run_train, "network": run_network, "lm": run_lm}


def usage() -> str:
  """``python -m jaxcomp.bench --help``: the subcommands, one line each."""
  width = max(len(n) for n in SUBCOMMANDS)
  rows = "\n".join(f"  {n:<{width}}  {what}" for n, (_, what) in SUBCOMMANDS.items())
  return ("usage: python -m jaxcomp.bench [SUBCOMMAND] [options]\n\n"
          "Without a subcommand: the main job (train). Subcommands:\n"
          f"{rows}\n\n`python -m jaxcomp.bench SUBCOMMAND --help` lists a subcommand's options"
          " (`lm --help` includes --diloco and --mesh).")


def main(argv=None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("-h", "--help"):
    print(usage())
    return
  name = "train"
  if argv and argv[0] in SUBCOMMANDS:
    name = argv.pop(0)
  elif argv and not argv[0].startswith("-"):
    raise SystemExit(f"unknown subcommand {argv[0]!r}; choose one of {sorted(SUBCOMMANDS)}")
  if name in COMPOSED:
    COMPOSED[name](argv)
  else:
    importlib.import_module(SUBCOMMANDS[name][0]).main(argv)


if __name__ == "__main__":
  from jaxcomp_bench import malloc

  main(malloc.reexec_with_caching_malloc(sys.argv[1:]))
