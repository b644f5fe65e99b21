"""`python -m jaxcomp.bench netcheck`: the network model's fit and its check against real collectives."""

import pytest

from jaxcomp.planning import netsim
from jaxcomp_bench import netcheck


def test_fit_recovers_alpha_and_bandwidth_of_the_ring_model():
  alpha, bw, n = 25e-6, 3e9, 8
  sizes = netcheck.SIZES
  times = [netsim.ring_allreduce(s, n, bw, alpha) for s in sizes]
  a, b = netcheck.fit(sizes, times, n)
  assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)


def test_both_settings_run_and_report_every_check(capsys):
  """8 CPU devices of this process and 2 processes over loopback (gloo): real collectives, timed."""
  out = netcheck.main(["--quick", "--reps", "1", "--methods", "none,topk"])
  text = capsys.readouterr().out
  for setting in ("devices", "processes"):
    rows = out[setting]
    assert [r[0].split()[0] for r in rows] == ["all-reduce"] * 3 + ["all-gather"] * 3 + ["none", "topk"]
    assert all(p > 0 and t > 0 for _, p, t in rows)
  assert text.count("within 30%:") == 2 and "gloo over 127.0.0.1: 2 workers" in text
