"""``python -m jaxcomp.bench recipes``: every method's recipes (sgd and AdamW) as markdown tables.

docs/recipes.md holds this command's output.
"""

from __future__ import annotations

import argparse

from jaxcomp_bench.common import plain


def table(momentum: float = 0.9) -> str:
  from jaxcomp.training.recipes import RECIPES

  chains = {
      "outer": "chain(method, sgd(lr, momentum=m))",
      "inner": "chain(configure(method, memory=momentum_correction(m)), sgd(lr))",
      "ef21": "chain(configure(method, memory=ef21()), sgd(lr, momentum=m))",
      "own": "chain(method, sgd(lr))",
      "after": "method(optimizer=sgd(lr, momentum=m))",
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


def adamw_table() -> str:
  """Each method's ``recipe(name, lr, optimizer="adamw")``: where its codec sits, and why."""
  from jaxcomp.training.recipes import ADAMW_RECIPES, VAR_FLOOR

  chains = {
      "grad": "chain(method, adamw(lr))",
      "ef21": "chain(configure(method, memory=ef21()), adamw(lr))",
      "momentum": "onebit_adam(lr, codec=method)",
      "sign": "chain(method, add_decayed_weights(wd), scale_by_learning_rate(lr))",
      "after": "chain(adamw(lr), method)",
      "optimizer": "the optimizer itself",
  }
  rows = ["| method | AdamW recipe | lr | settings | warm-up | why |", "|---|---|---|---|---|---|"]
  for name, r in ADAMW_RECIPES.items():
    kwargs = list(r.method_kwargs)
    if r.kind == "momentum" or name in ("onebit_adam", "zero_one_adam"):
      kwargs.append(("var_floor", VAR_FLOOR))  # 1-bit Adam's and 0/1 Adam's frozen variance floor
    settings = ", ".join(f"{k}={v!r}" for k, v in kwargs) or "defaults"
    lr = "lr" if r.lr_scale == 1.0 else f"{r.lr_scale:g} x lr"
    if r.kind in ("momentum", "optimizer"):
      warm = f"exact Adam to step {r.start_step}, then variance frozen" if r.start_step else "-"
    else:
      warm = f"dense to step {r.start_step}" if r.start_step else "-"
    rows.append(f"| `{name}` | `{chains[r.kind]}` | {lr} | {settings} | {warm} | {r.why} |")
  return "\n".join(rows)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxcomp.bench recipes", description=plain(__doc__))
  parser.add_argument("--optimizer", default="both", choices=("sgd", "adamw", "both"))
  args = parser.parse_args(argv)
  if args.optimizer in ("sgd", "both"):
    print(table())
  if args.optimizer in ("adamw", "both"):
    print(("\n" if args.optimizer == "both" else "") + adamw_table())


if __name__ == "__main__":
  main()
