"""The README's Quickstart runs as written (in a fresh process: it sets up its own 8 CPU devices)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_code_runs():
  text = (ROOT / "README.md").read_text()
  section = text[text.index("## Quickstart"):text.index("\n## ", text.index("## Quickstart") + 1)]
  code = "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))
  assert "jaxcomp.recipe(" in code and "jax.shard_map" in code
  env = {**os.environ, "PJRT_NPROC": "16"}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "bytes per worker per step; dense:" in out.stdout
