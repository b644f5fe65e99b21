"""jaxcomp.recipe with AdamW on a real task: an MLP on scikit-learn's digits, every method, 8 workers."""

import harness
import optax
import pytest
from harness import AXIS

import jaxcomp

HIDDEN, STEPS, BATCH = 64, 200, 16


@pytest.fixture(scope="module")
def digits():
  return harness.digits()


def _accuracy(tx, digits):
  return harness.digits_accuracy(tx, digits, STEPS, HIDDEN, BATCH, replica_atol=1e-5)  # SBC: within ulps


# Every SGD recipe's accuracy against dense SGD on this task, and its replicas' agreement, is checked
# by tests/test_suite.py (the suite's digits runs: within 1 point, 2 for random-k, both transports).


ADAMW_LR = 3e-3


@pytest.fixture(scope="module")
def dense_adamw_accuracy(digits):
  return _accuracy(jaxcomp.recipe("none", ADAMW_LR, axis_name=AXIS, optimizer="adamw"), digits)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(jaxcomp.recipes.ADAMW_RECIPES) - {"none"}))
def test_every_adamw_recipe_lands_within_2_points_of_dense_adamw(name, digits, dense_adamw_accuracy):
  tx = jaxcomp.recipe(name, ADAMW_LR, axis_name=AXIS, optimizer="adamw")
  acc = _accuracy(tx, digits)
  print(f"{name}: {100 * acc:.1f}% (dense AdamW {100 * dense_adamw_accuracy:.1f}%)")
  assert acc >= dense_adamw_accuracy - 0.02


def test_recipes_cover_every_method_and_say_why():
  assert set(jaxcomp.recipes.RECIPES) == set(jaxcomp.METHODS)
  for name, r in jaxcomp.recipes.RECIPES.items():
    assert r.kind in ("outer", "inner", "ef21", "own", "after") and r.why, name
  chain = jaxcomp.recipe("topk", 0.1, axis_name=AXIS)
  assert isinstance(chain, optax.GradientTransformation)
  tx = jaxcomp.recipe_method("topk", axis_name=AXIS)
  assert isinstance(tx.method.memory, jaxcomp.core.memories.MomentumCorrection)
  with pytest.raises(ValueError, match="optimizer"):
    jaxcomp.recipe("topk", 0.1, optimizer="adam")
  assert set(jaxcomp.METHODS) <= set(jaxcomp.recipes.ADAMW_RECIPES)
  for name, r in jaxcomp.recipes.ADAMW_RECIPES.items():
    assert r.kind in ("grad", "ef21", "momentum", "sign", "after", "optimizer") and r.why, name
  opt = jaxcomp.recipe("topk", 3e-3, axis_name=AXIS, optimizer="adamw")
  assert jaxcomp.recipe_method("inceptionn", axis_name=AXIS, optimizer="adamw").method.name == "inceptionn"
  # 1-bit Adam's freeze
  assert opt.compressor.method.name == "topk" and opt.compressor.method.start_step == 100
