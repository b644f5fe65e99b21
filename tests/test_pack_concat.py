"""benchmarks/pack_concat.py: a bucket packed as one concatenation and as a tree, compiled, timed and
compared (a small run)."""

import pytest
from harness import benchmark_script


def test_a_row_per_method_with_both_packings_and_the_same_bits(capsys):
  mod = benchmark_script("pack_concat")
  mod.main(["--methods", "bf16", "--models", "resnet50", "--leaves", "40", "--steps", "2"])
  row = capsys.readouterr().out.splitlines()[-1].split()
  assert row[:2] == ["resnet50", "bf16"]
  assert all(float(v) > 0 for v in row[2:10]) and row[11] == "True"


def test_the_pmap_step_of_two_workers(capsys):
  benchmark_script("pack_concat").main(["--methods", "efsignsgd", "--leaves", "30", "--steps", "1",
                                        "--workers", "2"])
  out = capsys.readouterr().out.splitlines()
  assert "the 2-worker pmap step" in out[0] and out[-1].split()[-1] == "True"


@pytest.mark.parametrize("argv", [["--methods", "bogus"], ["--models", "gpt2"], ["--steps", "0"],
                                  ["--workers", "0"]])
def test_bad_arguments_are_refused(argv):
  with pytest.raises(SystemExit):
    benchmark_script("pack_concat").main(argv)
