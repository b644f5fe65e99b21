"""Flax NNX users train through nnx.Optimizer: every jaxcomp transformation and optimizer runs there.

``nnx.Optimizer(model, tx, wrt=nnx.Param)`` calls ``tx.init`` on the model's
Param Variables and ``tx.update`` on plain gradient arrays. Each
transformation must run 3 steps there and equal the same ``tx`` driven by
hand on the arrays of ``nnx.split``; the wrong-tree errors stay for real
mistakes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxcomp


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(40, 32, rngs=rngs)
    self.l2 = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.tanh(self.l1(x)))


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _data(t):
  r = np.random.default_rng(t)
  return (jnp.asarray(r.standard_normal((16, 40)), jnp.float32),
          jnp.asarray(r.standard_normal((16, 4)), jnp.float32))


OPTIMIZERS = {
    "onebit_adam": lambda: jaxcomp.onebit_adam(1e-3, freeze_step=1),
    "zero_one_adam": lambda: jaxcomp.zero_one_adam(1e-3, var_freeze_step=1, local_step_clipper=2),
    "zero_one_adam_var_floor": lambda: jaxcomp.zero_one_adam(1e-3, var_freeze_step=1, var_floor=0.01),
    # what users start from: 1-bit Adam's recipe, its freeze at step 1 of 3 and its variance floor
    "recipe_onebit_adamw": lambda: jaxcomp.recipe("onebit", 1e-3, optimizer="adamw", total_steps=3),
    "demo": lambda: jaxcomp.demo(1e-3, compression_topk=4, compression_chunk=16),
    "diloco": lambda: jaxcomp.diloco(optax.adamw(1e-3), sync_every=2),
    "diloco_delay": lambda: jaxcomp.diloco(optax.adamw(1e-3), sync_every=2, delay=1, alpha=0.5),
    "sparseloco": lambda: jaxcomp.sparseloco(optax.adamw(1e-3), sync_every=2, chunk=64),
    "apply_if_finite": lambda: jaxcomp.apply_if_finite(
        optax.chain(jaxcomp.topk(ratio=0.1), optax.sgd(0.1)), 3, axis_name=None),
}


def _tx(name):
  if name in OPTIMIZERS:
    return OPTIMIZERS[name]()
  return optax.chain(jaxcomp.METHODS[name](), optax.sgd(0.1, momentum=0.9))


@pytest.mark.parametrize("name", sorted(jaxcomp.METHODS) + sorted(OPTIMIZERS))
def test_nnx_optimizer_equals_the_same_tx_by_hand(name):
  model = MLP(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  params = start = nnx.to_pure_dict(params)

  tx = _tx(name)
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  hand_tx = _tx(name)
  state = hand_tx.init(params)
  merged = lambda p: nnx.merge(graphdef, nnx.State(p))  # noqa: E731

  def hand_step(p, s, x, y):
    grads = jax.grad(lambda q: _loss(merged(q), x, y))(p)
    u, s = hand_tx.update(grads, s, p)
    return optax.apply_updates(p, u), s

  @nnx.jit  # the user's step and the same tx by hand side by side: one program to compile, not two
  def both_steps(model, opt, p, s, x, y):
    grads = nnx.grad(_loss)(model, x, y)
    opt.update(model, grads)
    return hand_step(p, s, x, y)

  for t in range(3):
    params, state = both_steps(model, opt, params, state, *_data(t))

  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  moved = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(start))]
  assert max(moved) > 0, "the model did not move"


def test_a_real_wrong_tree_still_raises():
  """A Variable wrapper is not a mistake; gradients of another model are."""
  tx = optax.chain(jaxcomp.topk(ratio=0.1), optax.sgd(0.1))
  opt = nnx.Optimizer(MLP(nnx.Rngs(0)), tx, wrt=nnx.Param)

  class Other(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(40, 32, rngs=rngs)
      self.head = nnx.Linear(32, 4, rngs=rngs)

  other = Other(nnx.Rngs(0))
  grads = jax.tree.map(jnp.zeros_like, nnx.state(other, nnx.Param))
  with pytest.raises(ValueError, match="updates do not match the state"):
    opt.update(other, grads)
