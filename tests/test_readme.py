"""The README's code runs as written: every python block, in order, as one reader's session (in a fresh
process: the Quickstart sets up its own 8 CPU devices)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_code_runs():
  text = (ROOT / "README.md").read_text()
  code = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))
  assert "jaxcomp.recipe(" in code and "jax.shard_map" in code and "jaxcomp.per_slice" in code
  code += "\nprint('diloco loss', float(loss))"
  env = {**os.environ, "PJRT_NPROC": "16"}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "bytes per worker per step; dense:" in out.stdout and "diloco loss" in out.stdout
