"""benchmarks/staged_scatter.py: a schedule's stages under scatter, shared search against whole stages."""

import pytest
from harness import AXIS, benchmark_script, params_tree

import jaxcomp


def test_shared_stages_compile_fewer_fusions_and_the_whole_way_is_restored():
  mod = benchmark_script("staged_scatter")
  shared = mod.ScatterExchange.__dict__["exchange_stages"]
  stage = lambda r: jaxcomp.redsync(r, axis_name=AXIS, min_size=1, transport="scatter")
  got = mod.compare(lambda: jaxcomp.staged([(0, stage(0.25)), (2, stage(0.05))]), params_tree())
  assert got["whole"]["stages"] == got["shared"]["stages"] == 2
  assert got["shared"]["fusions"] < got["whole"]["fusions"]
  assert mod.ScatterExchange.__dict__["exchange_stages"] is shared


@pytest.mark.parametrize("argv", [["--methods", "topk"], ["--methods", ""], ["--tree", "vgg"]])
def test_bad_arguments_are_refused(argv):
  with pytest.raises(SystemExit):
    benchmark_script("staged_scatter").main(argv)
