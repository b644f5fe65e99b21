"""Each method's worst relative error of output(c g) against c output(g), at its defaults.

The metric and the run are tests/test_scale.py's (8 workers under pmap, 4 steps, error feedback,
warm starts and momenta taking part; the whole output per step): this prints the figures the test
bounds. Usage, from the repository root: ``python benchmarks/scale_equivariance.py [name,name]``
(names from jaxcomp.METHODS, or onebit_adam, zero_one_adam, demo, run with eps scaled along).
"""

import os
import pathlib
import sys

os.environ.setdefault("PJRT_NPROC", "16")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import conftest  # noqa: E402,F401  8 CPU devices, every leaf compressed (the tests' trees are small)
import test_scale as T  # noqa: E402

import jaxcomp  # noqa: E402

SCALES = (2.0 ** -27, 1e-7, 1e-4, 1e3)
ADAM = ("onebit_adam", "zero_one_adam", "demo")


def main(names):
  for name in names:
    if name in ADAM:
      base = T._outputs(T._adam_like(name, 1e-8), 1.0)
      errs = [T._worst(base, T._outputs(T._adam_like(name, 1e-8 * c), c), 1.0) for c in SCALES]
    else:
      tx = jaxcomp.METHODS[name](axis_name=T.AXIS)
      base = T._outputs(tx, 1.0)
      inv = name in T.INVARIANT
      errs = [T._worst(base, T._outputs(tx, c), 1.0 if inv else c) for c in SCALES]
    print(f"{name:14s} " + "  ".join(f"c={c:g}: {e:.2e}" for c, e in zip(SCALES, errs)), flush=True)


if __name__ == "__main__":
  main(sys.argv[1].split(",") if len(sys.argv) > 1 else sorted(jaxcomp.METHODS) + list(ADAM))
