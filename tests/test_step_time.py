"""benchmarks/step_time.py: a whole training step per method against the dense step (a small run)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_time_prints_each_method_against_dense():
  env = dict(os.environ, PJRT_NPROC="16")
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--width", "32",
                        "--layers", "1", "--context", "16", "--batch", "2", "--reps", "2", "--warmup", "1",
                        "--methods", "topk,fp16"], capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()
          if line and not line.startswith(("#", "method"))}
  assert set(rows) == {"none", "topk", "fp16"}, out.stdout
  assert float(rows["none"][1]) == 1.0
  for name in ("none", "topk", "fp16"):  # the kernel column: launching instructions (fusions) of the program
    kernels, fusions = int(rows[name][3]), int(rows[name][4].strip("()"))
    assert 0 < fusions <= kernels
  for name in ("topk", "fp16"):
    ms, ratio, compile_s = map(float, rows[name][:3])
    assert ms > 0 and compile_s > 0
    dense = float(rows["none"][0])
    # Both times and the ratio are printed to 2 decimals: the ratio of the printed times may
    # differ from the printed ratio by their rounding (a step of 1 ms: up to 1%).
    slack = (ms / dense) * (0.005 / ms + 0.005 / dense) + 0.005
    assert abs(ratio - ms / dense) <= slack + 1e-9
