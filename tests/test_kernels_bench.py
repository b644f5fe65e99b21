"""``python -m jaxcomp.bench kernels``: one small run prints each figure beside its target."""

import os
import platform
import subprocess
import sys

import pytest

from jaxcomp_bench import malloc


def _run(*args):
  env = dict(os.environ, PJRT_NPROC="16")
  return subprocess.run([sys.executable, "-m", "jaxcomp.bench", "kernels", *args], capture_output=True,
                        text=True, env=env, timeout=600)


def test_kernels_quick_prints_a_row_per_method_with_its_targets():
  out = _run("--quick", "--models", "resnet50", "--methods", "fp4", "--reps", "1", "--no-memory")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "first 40 ResNet-50 gradients" in out.stdout and "BERT" not in out.stdout
  row = next(line.split() for line in out.stdout.splitlines() if line.startswith("fp4 "))
  ms, copy_ms, ratio = map(float, row[1:4])
  assert ms > 0 and copy_ms > 0
  # The times are printed to 0.1 ms, the ratio to 0.01: the times behind the printed ones lie
  # within 0.05 ms of them, so the ratio lies between the ratios of those bounds.
  low = (ms - 0.05) / (copy_ms + 0.05)
  high = (ms + 0.05) / (copy_ms - 0.05) if copy_ms > 0.05 else float("inf")
  assert low - 0.005 - 1e-9 <= ratio <= high + 0.005 + 1e-9, (ms, copy_ms, ratio)
  assert row[4:6] == ["<=", "10"] and row[6] in ("yes", "no")
  first = out.stdout.splitlines()[0]
  if "GLIBC_TUNABLES" not in os.environ and platform.libc_ver()[0] == "glibc":  # started again under it
    assert f"GLIBC_TUNABLES={malloc.CACHING!r} (the benchmarks' caching malloc)" in first, first


def test_caching_malloc_is_left_out_when_asked_or_already_set(monkeypatch):
  argv = ["kernels", "--system-malloc", "--quick"]
  assert malloc.reexec_with_caching_malloc(argv) == ["kernels", "--quick"]
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  assert malloc.reexec_with_caching_malloc(["--quick"]) == ["--quick"]  # the main job keeps the system's
  assert malloc.reexec_with_caching_malloc(["lm", "--steps", "2"]) == ["lm", "--steps", "2"]
  monkeypatch.setenv("GLIBC_TUNABLES", "")  # the user's (empty) setting is kept: no new start
  assert malloc.reexec_with_caching_malloc(["kernels"]) == ["kernels"]
  assert malloc.setting() == "GLIBC_TUNABLES=''"
  monkeypatch.delenv("GLIBC_TUNABLES")
  assert malloc.setting() == "system malloc (GLIBC_TUNABLES unset)"


@pytest.mark.parametrize("models", ["", "resnet", "bert,gpt2"])
def test_kernels_refuses_unknown_models(models):
  from jaxcomp_bench import kernels

  with pytest.raises(SystemExit, match="--models takes resnet50 and/or bert"):
    kernels.main(["--models", models, "--no-memory"])


def test_the_command_exits_with_the_refusal():
  out = _run("--models", "resnet", "--no-memory")
  assert out.returncode != 0 and "--models takes resnet50 and/or bert" in out.stderr


def test_grow_heap_only_under_the_caching_malloc(monkeypatch):
  calls = []
  monkeypatch.setattr("numpy.ones", lambda *a, **k: calls.append(a))
  monkeypatch.setenv("GLIBC_TUNABLES", malloc.PLAIN)
  malloc.grow_heap(1 << 20)
  assert calls == []
  monkeypatch.setenv("GLIBC_TUNABLES", malloc.CACHING)
  malloc.grow_heap(0)
  assert calls == []
  malloc.grow_heap(1 << 20)
  assert calls == [((1 << 20) // 8, __import__("numpy").float64)]
