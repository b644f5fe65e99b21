"""``python -m jaxcomp.bench recipes``: the recipe of every method as a markdown table (for the README)."""

from __future__ import annotations

import argparse


def table(momentum: float = 0.9) -> str:
  from jaxcomp.recipes import RECIPES

  chains = {
      "outer": "chain(method, sgd(lr, momentum=m))",
      "inner": "chain(configure(method, memory=momentum_correction(m)), sgd(lr))",
      "ef21": "chain(configure(method, memory=ef21()), sgd(lr, momentum=m))",
      "own": "chain(method, sgd(lr))",
      "after": "chain(sgd(lr, momentum=m), method)",
  }
  rows = ["| method | recipe (m = %g) | lr | settings | warm-up | why |" % momentum,
          "|---|---|---|---|---|---|"]
  for name, r in RECIPES.items():
    settings = ", ".join(f"{k}={v!r}" for k, v in r.method_kwargs) or "defaults"
    lr = "lr" if r.lr_scale == 1.0 else f"{r.lr_scale:g} x lr"
    warm = [f"dense to step {r.start_step}"] if r.start_step else []
    warm += [f"ratio_warmup over {r.warmup_steps} steps"] if r.warmup_steps else []
    rows.append(f"| `{name}` | `{chains[r.kind]}` | {lr} | {settings} | {', '.join(warm) or '-'} | {r.why} |")
  return "\n".join(rows)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxcomp.bench recipes", description=__doc__)
  parser.parse_args(argv)
  print(table())


if __name__ == "__main__":
  main()
