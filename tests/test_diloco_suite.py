"""``python -m jaxcomp.bench diloco-suite``: DiLoCo's settings on the suite's tasks against data parallel."""

import json
import math

import pytest

from jaxcomp_bench import diloco_suite


def test_cli_end_to_end(tmp_path):
  """digits, 48 steps, H = 8: dp and two DiLoCo configurations train; the table shows their gaps, the
  rotation its rows; bytes per step are dp's over H for the dense mean."""
  out = str(tmp_path / "ds")
  runs = diloco_suite.main(["--tasks", "digits", "--steps", "48", "--sync-every", "8", "--codecs",
                            "dense,sparseloco:density=0.1:mean=senders", "--outers", "avg", "--out", out])
  assert len(runs) == 3 and not [r.error for r in runs if r.error]
  by = {(r.task, r.config): r for r in runs}
  dp, dense = by[("digits", "dp")], by[("digits", "dense/avg/H8/P1/d0/a0")]
  assert all(math.isfinite(r.loss) for r in runs) and 0 < dp.accuracy <= 1
  assert dense.bytes_per_step == pytest.approx(dp.bytes_per_step / 8)
  with open(f"{out}/diloco_suite.json") as f:
    assert len(json.load(f)) == 3
  text = open(f"{out}/diloco_suite.md").read()
  assert "`sparseloco:density=0.1:mean=senders/avg/H8/P1/d0/a0`" in text and "| digits " in text


def test_bad_specs_name_the_flag():
  with pytest.raises(SystemExit, match="--outers"):
    diloco_suite.outer_optimizer("nesterov:0.7")
  with pytest.raises(SystemExit, match="--codecs"):
    diloco_suite.compressor("topk:density=0.1")
  with pytest.raises(SystemExit, match="sparseloco's settings"):
    diloco_suite.compressor("sparseloco:rate=0.1")
