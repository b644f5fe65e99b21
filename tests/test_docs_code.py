"""Every python block of docs/ runs as written: each page's blocks in order, as one reader's session, in
a fresh process (each page sets up its own 8 CPU devices). README.md: tests/test_readme.py."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted(p.name for p in (ROOT / "docs").glob("*.md") if "```python" in p.read_text())


def test_the_pages_with_code_are_these():
  assert PAGES == ["adding-a-method.md", "diloco.md", "exchanges.md", "optimizers.md", "own-step.md",
                   "recipes.md", "two-level.md", "usage.md"]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_code_runs(page):
  code = "\n".join(re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), flags=re.S))
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PJRT_NPROC": "16"},
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
