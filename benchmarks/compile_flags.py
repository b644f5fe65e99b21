"""Compile seconds of the tests' programs under XLA's defaults and under the tests' settings.

The test suite's time is mostly XLA compiling about a thousand small programs
(``tests/conftest.py``). This script compiles the 8-worker pmap step of six methods over the
tests' tree (``tests/harness.params_tree``, every leaf compressed) in a fresh process for each
setting and prints the seconds each took to compile (lowering excluded):

- ``defaults``: XLA's own settings;
- ``disable_most_optimizations``: ``JAX_DISABLE_MOST_OPTIMIZATIONS=1`` (LLVM's expensive passes off);
- ``+ older emitter``: also ``--xla_cpu_use_fusion_emitters=false`` (jaxlib 0.10 only: jaxlib 0.12
  refuses the flag, and the row says so).

Usage: ``python benchmarks/compile_flags.py [--methods topk,dgc,sbc,qsgd,powersgd,inceptionn]``.
"""

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {
    "defaults": {},
    "disable_most_optimizations": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},
    "+ older emitter": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
                        "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"},
}


def child(methods: list[str]) -> None:
  """Compiles each method's step in this process and prints ``name seconds`` lines."""
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  import jaxcomp

  jaxcomp.cpu_devices(8)
  import harness
  import jax

  import jaxcomp.core.policy

  jaxcomp.core.policy.MIN_SIZE = 1  # the property tests' policy: every leaf compressed
  for name in methods:
    tx = jaxcomp.METHODS[name](axis_name=harness.AXIS)
    params = harness.params_tree()
    lowered = jax.pmap(lambda g, s: tx.update(g, s), axis_name=harness.AXIS).lower(
        harness.worker_grads(params), harness.init_stacked(tx, params))
    start = time.perf_counter()
    lowered.compile()
    print(name, f"{time.perf_counter() - start:.2f}", flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--methods", default="topk,dgc,sbc,qsgd,powersgd,inceptionn")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  methods = args.methods.split(",")
  if args.child:
    return child(methods)
  import jax

  print(f"jax {jax.__version__}; compile s of the 8-worker pmap step over the tests' tree, a process each")
  print(f"{'setting':<28}" + "".join(f"{m:>11}" for m in methods) + f"{'total':>9}")
  for label, extra in SETTINGS.items():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_DISABLE_MOST_OPTIMIZATIONS", "XLA_FLAGS")}
    env.update(extra, PJRT_NPROC="16")
    out = subprocess.run([sys.executable, __file__, "--child", "--methods", args.methods], env=env,
                         capture_output=True, text=True)
    seconds = dict(line.split() for line in out.stdout.splitlines() if line.count(" ") == 1)
    if out.returncode or len(seconds) != len(methods):
      print(f"{label:<28} refused by this jaxlib: {(out.stderr.strip().splitlines() or ['?'])[-1][:80]}")
      continue
    total = sum(float(s) for s in seconds.values())
    print(f"{label:<28}" + "".join(f"{seconds[m]:>11}" for m in methods) + f"{total:9.2f}")


if __name__ == "__main__":
  main()
