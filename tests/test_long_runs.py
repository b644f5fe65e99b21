"""Long runs: thousands of steps of a representative subset of methods (slow).

``jaxcomp_bench.longrun.run`` trains a 528-parameter model for 2000 steps in
one jitted ``lax.scan`` under ``jax.pmap`` over 8 workers, with the step
counter starting 1000 below the int32 maximum, and checks: updates and losses
finite at every step, the residual norm bounded (last quarter within 2x of the
first half's peak), the counter saturating at 2^31 - 1 without wrapping, the
state keys never repeating (2000 distinct) and identical on every worker, and
the replicas' parameters bit-identical at the end. All methods, 5000 steps:
``python -m jaxcomp.bench longrun``.
"""

import pytest

from jaxcomp_bench import longrun

pytestmark = pytest.mark.optimized  # thousands of steps: XLA's optimizations pay (tests/conftest.py)

STEPS = 2000


@pytest.mark.usefixtures("every_leaf")  # its trees are small on purpose: compress every leaf
@pytest.mark.slow
@pytest.mark.parametrize("name", longrun.SUBSET)
def test_long_run_keeps_its_promises(name):
  r = longrun.run(name, steps=STEPS, workers=8)
  print(f"{name}: max residual norm {r.max_residual_norm:.4g}, by quarter {r.residual_norm_quarters},"
        f" loss by quarter {r.loss_quarters}")
  assert not r.problems, r.problems
  assert r.final_count == longrun.INT32_MAX
  assert r.distinct_keys == STEPS
  assert r.loss_quarters[-1] < r.loss_quarters[0]  # it trains
  if name in ("acpsgd", "sbc"):
    # Periodic methods keep their period past the saturated count (the phase
    # wraps instead): the residual keeps shrinking. A frozen alternation made
    # ACP-SGD's grow again in the second half (0.24 -> 5.3).
    assert r.residual_norm_quarters[-1] < r.residual_norm_quarters[1]


def test_the_module_compiles_with_xla_optimizations():
  """``pytestmark`` above (tests/conftest.py): on inside this module, whatever the suite's setting."""
  import jax

  assert jax.config.values["jax_disable_most_optimizations"] is False
