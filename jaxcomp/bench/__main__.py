"""``python -m jaxcomp.bench [SUBCOMMAND] [options]``.

Without a subcommand: the training benchmark (every method on the same
budget). Each subcommand is a module ``jaxcomp.bench.<name>`` with
``main(argv)``.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "train": "jaxcomp.bench.train",        # the main job (default)
    "kernels": "jaxcomp.bench.kernels",    # compress+decode speed vs a memory copy
    "network": "jaxcomp.bench.network",    # alpha-beta network model table
    "selection": "jaxcomp.bench.selection",  # RedSync selection vs lax.top_k
    "wire": "jaxcomp.bench.wire",          # payload bits per element, nominal and measured
    "longrun": "jaxcomp.bench.longrun",    # thousands of steps: bounded residuals, keys, replicas
    "recipes": "jaxcomp.bench.recipes",    # each method's jaxcomp.recipe as a table
    "twolevel": "jaxcomp.bench.twolevel",  # flat vs two-level compression on 8 nodes x 8 devices
    "scale": "jaxcomp.bench.scale",        # gather vs scatter exchange at N = 8 ... 1024
    "lm": "jaxcomp.bench.lm",  # the transformer language model task
}


def main(argv=None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  name = "train"
  if argv and argv[0] in SUBCOMMANDS:
    name = argv.pop(0)
  elif argv and not argv[0].startswith("-"):
    raise SystemExit(f"unknown subcommand {argv[0]!r}; choose one of {sorted(SUBCOMMANDS)}")
  importlib.import_module(SUBCOMMANDS[name]).main(argv)


if __name__ == "__main__":
  main()
