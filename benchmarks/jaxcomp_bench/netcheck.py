"""``python -m jaxcomp.bench netcheck``: the network model's predictions against measured collectives.

:mod:`jaxcomp.planning.netsim` prices a step's collectives with the ring
alpha-beta model. Here the model meets the collectives this machine can run:

1. **Calibrate**: time ``psum`` (all-reduce) of float32 vectors from 4 KiB to
   64 MiB and fit the model's ``alpha`` (seconds per message) and ``B`` (bytes
   per second) by least squares to ``2 (N-1) alpha + 2 (N-1)/N n / B``.
2. **Check**: with those two numbers, predict and measure (a) ``all_gather`` at
   the same sizes and (b) each method's own collectives on ResNet-50's
   gradients (``jaxcomp.traffic`` of its recipe: one collective per bucket,
   the payload's size; run as one program of those collectives), and print
   the error of each prediction.

Two settings: ``devices`` (N CPU devices of this process: collectives are
copies between threads) and ``processes`` (2 processes of one device each,
``jax.distributed`` with gloo over 127.0.0.1: real sockets). Times are the
fastest of ``--reps`` runs after a warm-up; on a shared 2-core machine they
move between runs (the fastest run is the one least disturbed by other work),
so read errors as a band, not a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Sequence

from jaxcomp.planning import netsim
from jaxcomp_bench.common import plain, run_times

SIZES = tuple(4 * 2 ** k for k in range(10, 25, 2))  # 4 KiB .. 64 MiB (a 25 MiB bucket inside)
METHODS = ("none", "bf16", "signsgd", "topk", "dgc", "powersgd", "qsgd")


def fit(sizes: Sequence[float], seconds: Sequence[float], workers: int) -> tuple[float, float]:
  """(alpha seconds per message, bandwidth bytes/s) of the ring all-reduce model fitted to times.

  Least squares of the relative error, so the small sizes (latency) weigh as much as the large."""
  import numpy as np

  t = np.asarray(seconds, np.float64)
  x = np.asarray(sizes, np.float64) * 2 * (workers - 1) / workers
  a = np.stack([np.full_like(x, 2.0 * (workers - 1)), x], axis=1) / t[:, None]
  (alpha, inv_b), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
  return max(float(alpha), 0.0), 1.0 / max(float(inv_b), 1e-30)


def _timed(fn, args, reps: int) -> float:
  """The fastest of ``reps`` runs after a warm-up (the run least disturbed by other work)."""
  import jax

  jax.block_until_ready(fn(*args))
  return min(run_times(lambda: fn(*args), reps))


def time_collectives(collectives: Sequence[tuple[str, float]], reps: int) -> float:
  """Seconds of one program that runs these ``(kind, bytes)`` collectives over every device (pmap)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  n_local = jax.local_device_count()
  sizes = [max(1, int(b) // 4) for _, b in collectives]
  kinds = [k for k, _ in collectives]
  for k in kinds:
    if k not in ("all-reduce", "all-gather"):
      raise ValueError(f"netcheck times all-reduce and all-gather only, got {k!r}")

  def step(*xs):
    return [jax.lax.psum(x, "w") if k == "all-reduce" else jax.lax.all_gather(x, "w")
            for k, x in zip(kinds, xs)]

  args = [jnp.asarray(np.ones((n_local, s), np.float32)) for s in sizes]
  return _timed(jax.pmap(step, axis_name="w"), args, reps)


def measure(reps: int, methods: Sequence[str], quick: bool) -> dict:
  """Every measurement of one setting (this runtime's devices)."""
  import jax

  from jaxcomp.planning import advise as adv
  from jaxcomp_bench import shapes as shp

  sizes = SIZES[:3] if quick else SIZES
  out = {"workers": jax.device_count(), "sizes": list(sizes),
         "all-reduce": [time_collectives([("all-reduce", s)], reps) for s in sizes],
         "all-gather": [time_collectives([("all-gather", s / jax.device_count())], reps) for s in sizes],
         "methods": {}}
  tree = shp.abstract(shp.resnet50_shapes()[:12] if quick else shp.resnet50_shapes())
  for m in methods:
    colls = adv.method_traffic(m, tree, jax.device_count())
    out["methods"][m] = {"collectives": colls, "seconds": time_collectives(colls, reps)}
  return out


def report(m: dict, label: str) -> list[tuple[str, float, float]]:
  """Prints the fit and each check's predicted and measured ms; returns ``(check, predicted, measured)``."""
  n = m["workers"]
  alpha, bw = fit(m["sizes"], m["all-reduce"], n)
  net = netsim.flat(n, bw * 8 / 1e9, alpha)
  print(f"\n{label}: {n} workers; fitted alpha {alpha * 1e6:.1f} us per message, bandwidth"
        f" {bw / 1e9:.2f} GB/s ({bw * 8 / 1e9:.1f} Gb/s)")
  rows = []
  for kind in ("all-reduce", "all-gather"):
    for s, t in zip(m["sizes"], m[kind]):
      per = s if kind == "all-reduce" else s / n
      rows.append((f"{kind} {s / 2 ** 10:g} KiB", net.collective(kind, per), t))
  for name, rec in m["methods"].items():
    colls = [tuple(c) for c in rec["collectives"]]
    rows.append((f"{name} on ResNet-50 ({len(colls)} collectives)",
                 netsim.communication_time(colls, net), rec["seconds"]))
  print(f"{'check':<44} {'predicted ms':>12} {'measured ms':>12} {'error':>8}")
  for name, p, t in rows:
    print(f"{name:<44} {p * 1e3:12.3f} {t * 1e3:12.3f} {100 * (p - t) / t:+7.0f}%")
  errors = sorted(abs(p - t) / t for _, p, t in rows)
  print(f"within 30%: {sum(e <= 0.3 for e in errors)} of {len(errors)} checks; median |error|"
        f" {100 * statistics.median(errors):.0f}%, largest {100 * errors[-1]:.0f}%")
  return rows


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxcomp.bench netcheck", description=plain(__doc__),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--settings", default="devices,processes", help="devices, processes (comma-separated)")
  p.add_argument("--devices", type=int, default=8, help="CPU devices of the 'devices' setting")
  p.add_argument("--methods", default=",".join(METHODS))
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="3 sizes, ResNet-50's first 12 leaves")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  return p


def _processes(args) -> dict:
  from jaxcomp.training import launch

  argv = ["-m", "jaxcomp_bench.netcheck", "--child", "--methods", args.methods, "--reps", str(args.reps)]
  argv += ["--quick"] if args.quick else []
  results = launch.launch(argv, num_processes=2, local_devices=1, timeout_s=600)
  for r in results:
    if r.returncode != 0:
      raise SystemExit(f"netcheck: a process failed ({r.returncode}):\n{r.stderr[-2000:]}")
  return json.loads(results[0].stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
  args = _parser().parse_args(argv)
  methods = [m for m in args.methods.split(",") if m]
  if args.child:  # one process of the 'processes' setting
    from jaxcomp.training import launch

    launch.initialize()
    out = measure(args.reps, methods, args.quick)
    import jax

    if jax.process_index() == 0:
      print(json.dumps(out))
    return out
  from jaxcomp_bench.common import header

  settings = [s for s in args.settings.split(",") if s]
  for s in settings:
    if s not in ("devices", "processes"):
      raise SystemExit(f"--settings takes devices and/or processes, got {s!r}")
  import jaxcomp

  jaxcomp.cpu_devices(args.devices)
  print(header("python -m jaxcomp.bench netcheck " + " ".join(argv if argv is not None else sys.argv[1:])))
  results = {}
  if "devices" in settings:
    results["devices"] = report(measure(args.reps, methods, args.quick),
                                f"{args.devices} CPU devices in one process")
  if "processes" in settings:
    results["processes"] = report(_processes(args), "2 processes x 1 CPU device, gloo over 127.0.0.1")
  return results


if __name__ == "__main__":
  main()
