"""jaxcomp's update against GRACE's compressors in eager PyTorch, on the same gradients, in one run.

For each of the speed issue's eleven methods, on ResNet-50's (or BERT-base's) gradient shapes
(the kernel benchmark's gradients, ``jaxcomp_bench.shapes.random``):

- ``grace ms``: GRACE's compress + decompress of every gradient tensor, one tensor at a time,
  in eager PyTorch (``benchmarks/grace_torch.py``, run first in a process of its own with
  PyTorch's defaults);
- ``jaxcomp ms``: jaxcomp's whole update with ``axis_name=None`` (bucket, compensate, encode,
  decode, residual; ``jit``, state donated), the kernel benchmark's timing and settings;
- each beside a copy of the same tensors in its own framework (``clone`` / ``jnp.copy``), and
  ``speed`` = grace ms / jaxcomp ms (above 1: jaxcomp is faster).

jaxcomp's update does more than GRACE's pair where the method keeps state per entry (top-k,
DGC, EF-signSGD, 1-bit SGD and PowerSGD a residual, DGC and Signum a momentum; GRACE's memory
is a separate object, not timed), so the comparison favours GRACE. Both processes run under the
same allocator: the benchmarks' caching malloc (``jaxcomp_bench.malloc``) unless
``GLIBC_TUNABLES`` is set, each with the heap grown before timing.

Usage: ``python benchmarks/peers.py [--model resnet50|bert-base] [--reps 5] [--methods fp16,topk]``.
Needs PyTorch (``pip install torch``; not a dependency of jaxcomp).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("PJRT_NPROC", "16")

METHODS = "fp16,topk,randomk,dgc,qsgd,terngrad,signsgd,signum,efsignsgd,onebit,powersgd"


def grace_rows(model: str, methods: list, reps: int) -> dict:
  """``benchmarks/grace_torch.py --ddp`` in a child process: its JSON (GRACE's rows, DDP's hooks)."""
  script = Path(__file__).with_name("grace_torch.py")
  out = subprocess.run([sys.executable, str(script), "--model", model, "--reps", str(reps), "--ddp",
                        "--methods", ",".join(methods)], capture_output=True, text=True, check=False)
  if out.returncode != 0:
    raise SystemExit(f"{script.name} failed:\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=("resnet50", "bert-base"), default="resnet50")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--methods", default=METHODS)
  args = parser.parse_args(argv)
  try:
    import torch  # noqa: F401 - checked here, used by grace_torch.py
  except ImportError:
    raise SystemExit("benchmarks/peers.py needs PyTorch: pip install torch") from None
  from jaxcomp_bench import malloc

  malloc.restart_under_caching(sys.argv)  # this script again, under the benchmarks' caching malloc
  import jax

  import jaxcomp
  from jaxcomp_bench import common, kernels, shapes

  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  unknown = [m for m in methods if m not in METHODS.split(",")]
  if unknown:
    raise SystemExit(f"--methods: no GRACE codec for {unknown}; choose from {METHODS}")
  print(common.header("python benchmarks/peers.py " + " ".join(sys.argv[1:] if argv is None else argv)))
  grace = grace_rows(args.model, methods, args.reps)
  grads = shapes.random(shapes.MODELS[args.model]())
  malloc.grow_heap(malloc.GROW * 4 * sum(int(g.size) for g in grads))
  print(f"GRACE side: torch {grace['torch']}, {grace['threads']} threads, its own process; jaxcomp side:"
        f" jax {jax.__version__}")
  print(f"{args.model}: {len(grads)} gradients, {sum(int(g.size) for g in grads):,} float32 values;"
        f" median of {args.reps}")
  print(f"{'method':<10} {'settings':<12} {'grace ms':>9} {'copy ms':>8} {'x copy':>7}"
        f" {'jaxcomp ms':>10} {'copy ms':>8} {'x copy':>7} {'speed':>6}")
  ours: dict = {}
  for name in methods:
    kwargs = kernels.method_kwargs(name, jaxcomp.METHODS[name])
    tx = jaxcomp.steady(jaxcomp.METHODS[name](axis_name=None, **kwargs))
    copy_s = common.time_copy(grads, args.reps)
    ours_s = common.time_update(tx, grads, args.reps)
    ours[name] = ours_s
    g = grace["rows"][name]
    text = ",".join(f"{k}={v}" for k, v in kwargs.items())
    print(f"{name:<10} {text:<12} {g['seconds'] * 1e3:9.1f} {g['copy_seconds'] * 1e3:8.1f}"
          f" {g['seconds'] / g['copy_seconds']:7.2f} {ours_s * 1e3:10.1f} {copy_s * 1e3:8.1f}"
          f" {ours_s / copy_s:7.2f} {g['seconds'] / ours_s:6.2f}", flush=True)
  _print_ddp(grace["ddp"], ours)


def _print_ddp(ddp: dict, ours: dict) -> None:
  """PyTorch DDP's own comm hooks: a backward step under each, and what each adds to the plain one."""
  plain = ddp["plain"]
  parts = [f"plain all-reduce {plain * 1e3:.1f} ms"]
  for hook, label in (("fp16", "fp16_compress_hook"), ("powersgd", "powerSGD_hook rank 4")):
    parts.append(f"{label} {ddp[hook] * 1e3:.1f} ms ({(ddp[hook] - plain) * 1e3:+.1f} over plain;"
                 f" jaxcomp's {hook} update {ours[hook] * 1e3:.1f} ms)" if hook in ours else
                 f"{label} {ddp[hook] * 1e3:.1f} ms ({(ddp[hook] - plain) * 1e3:+.1f} over plain)")
  print("PyTorch DDP (gloo, one process), a backward step of loss sum(p * g) under each comm hook: "
        + "; ".join(parts))


if __name__ == "__main__":
  main()
