"""benchmarks/loop_buckets.py: both forms of an update, compiled, timed and compared (a small run)."""

import pytest
from harness import benchmark_script


def test_a_row_per_model_and_method_with_a_loop_and_the_same_bits(capsys):
  mod = benchmark_script("loop_buckets")
  mod.main(["--methods", "topk", "--models", "resnet50", "--leaves", "60", "--bucket-bytes", str(2 ** 20),
            "--reps", "1", "--steps", "2"])
  row = capsys.readouterr().out.splitlines()[-1].split()
  assert row[:2] == ["resnet50", "topk"] and int(row[2]) > int(row[3]) >= 1  # several buckets, a loop
  assert all(float(v) > 0 for v in row[4:13]) and row[13] == "True"


@pytest.mark.parametrize("argv", [["--methods", "bogus"], ["--models", "gpt2"], ["--steps", "0"]])
def test_bad_arguments_are_refused(argv):
  with pytest.raises(SystemExit):
    benchmark_script("loop_buckets").main(argv)
