"""`jaxcomp.auto`: the fastest predicted recipe on a network, never slower than dense, leaves dense where
compressing them does not pay."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.planning import advise as adv

TREE = {"w1": jax.ShapeDtypeStruct((512, 256), jnp.float32), "b1": jax.ShapeDtypeStruct((256,), jnp.float32),
        "w2": jax.ShapeDtypeStruct((256, 1024), jnp.float32)}


@pytest.mark.parametrize("gbps", [0.1, 1.0, 10.0, 100.0, 400.0])
def test_never_slower_than_dense_nor_the_best_single_method(gbps):
  plan = jaxcomp.auto_plan(TREE, gbps, 8, 0.002)
  rows = jaxcomp.advise(TREE, gbps, 8, 0.002, diloco=())
  allowed = [r for r in rows if adv.pass_rate(r) is not None and adv.pass_rate(r) >= 0.9]
  assert plan.step <= plan.dense_step
  assert plan.speedup >= max(r.speedup for r in allowed) - 1e-9
  assert dict(plan.candidates)["none"] == pytest.approx(plan.dense_step)


def test_the_choice_flips_from_compressed_to_dense():
  slow = jaxcomp.auto_plan(TREE, 0.1, 8, 0.002)
  fast = jaxcomp.auto_plan(TREE, 1e7, 8, 0.002, latency_us=0)
  assert slow.method != "none" and slow.speedup > 2
  assert fast.method == "none" and fast.step == fast.dense_step


def test_a_leaf_that_does_not_pay_travels_dense():
  """PowerSGD's rank-4 factors of a square matrix are a tiny share of it, of a 16-column one a quarter:
  at a compression cost between the two savings the square matrix is compressed, the skinny one dense."""
  tree = {"square": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
          "skinny": jax.ShapeDtypeStruct((8192, 16), jnp.float32)}
  b = 10e9 / 8  # bytes/s at 10 Gb/s; a dense value's all-reduce costs 7/b on 8 workers, rank 4 of it:
  per_value = 6.0 / b  # square 0.05/b + compress, skinny 1.75/b + compress
  n = 10 ** 6
  kernels = {"cases": [{"method": "none", "case": "c", "seconds": 0.0, "values": n},
                       {"method": "powersgd", "case": "c", "seconds": per_value * n, "values": n}]}
  plan = jaxcomp.auto_plan(tree, 10.0, 8, 0.01, methods=["powersgd"], kernels=kernels, latency_us=0)
  assert plan.method == "powersgd" and plan.dense_leaves == ("['skinny']",)
  assert plan.step < dict(plan.candidates)["powersgd"] < plan.dense_step
  assert "1 leaves dense (['skinny'])" in str(plan)


def test_the_transform_trains_as_its_recipe(capsys):
  params = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
  tx = jaxcomp.auto(params, 0.1, "data", gbps=0.1, workers=8, compute_s=1e-4, methods=["powersgd"])
  assert "jaxcomp.auto on 8 workers at 0.1 Gb/s" in capsys.readouterr().out
  grads = jax.tree.map(lambda p: jnp.stack([jnp.full_like(p, 1e-4 * (i + 1)) for i in range(8)]), params)
  state = jax.pmap(tx.init, axis_name="data")(jaxcomp.per_worker(params, 8))
  upd, _ = jax.pmap(tx.update, axis_name="data")(grads, state, jaxcomp.per_worker(params, 8))
  for leaf in jax.tree.leaves(upd):
    assert np.all(np.isfinite(np.asarray(leaf)))
    np.testing.assert_allclose(np.asarray(leaf)[0], np.asarray(leaf)[7])  # replicas agree


def test_bad_arguments_name_themselves():
  with pytest.raises(ValueError, match="min_pass_rate"):
    jaxcomp.auto_plan(TREE, 1.0, 8, 0.01, min_pass_rate=2.0)
  with pytest.raises(ValueError, match="gbps"):
    jaxcomp.auto_plan(TREE, -1.0, 8, 0.01)
  assert isinstance(jaxcomp.auto_plan(TREE, 1.0, 8, 0.01).transform, optax.GradientTransformation)
