"""benchmarks/first_steps.py: a pmap step's first calls by placement (the small tree, in this process)."""

import pytest
from harness import benchmark_script


@pytest.mark.parametrize("placement, recompiles", [("axis_name", False), ("one device", True)])
def test_the_second_call_compiles_again_only_for_inputs_placed_otherwise(placement, recompiles):
  got = benchmark_script("first_steps").child("topk", "small", placement, 2)
  (first_s, first_compiles), (_, second_compiles) = got["steps"]
  assert got["init"] >= 0 and first_s > 0 and first_compiles >= 1
  assert (second_compiles > 0) == recompiles, got


def test_an_unknown_model_is_refused():
  with pytest.raises(SystemExit):
    benchmark_script("first_steps").main(["--model", "vgg"])
