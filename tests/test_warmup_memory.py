"""benchmarks/warmup_memory.py: the temporaries of DGC's and RedSync's warm-ups, stage by stage and as one
switch."""

import pytest
from harness import benchmark_script


def test_the_first_stage_sets_the_warm_ups_temporaries():
  names = ["dense", "dgc 0.25 alone, gather", "dgc (default warm-up, gather)", "dgc 0.001 alone, gather"]
  got = benchmark_script("warmup_memory").rows((512, 1024), names=names)
  bucket = 4 * 512 * 1024
  first, whole = got["dgc 0.25 alone, gather"], got["dgc (default warm-up, gather)"]
  # every worker's payload of the 25% stage (1.3x capacity, values and positions) arrives at each worker
  assert first > 4 * got["dense"] and first > got["dgc 0.001 alone, gather"]
  assert first <= whole <= first + 1.5 * bucket  # the switch adds the mean and a byte mask, no more


def test_every_configuration_builds():
  made = benchmark_script("warmup_memory").configurations()
  assert len(made) == 11 and all(callable(f) for f in made.values())
  assert made["redsync's recipe after its warm-up"]().method.stages == ()


@pytest.mark.parametrize("argv", [["--shape", "4096,x"], ["--shape", "0,4"], ["--workers", "9"]])
def test_bad_arguments_are_refused(argv):
  with pytest.raises(SystemExit):
    benchmark_script("warmup_memory").main(argv)
