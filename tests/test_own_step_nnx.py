"""A MaxText-style Flax NNX model trained by the user's own step: nnx.Optimizer over jaxcomp.on_shards.

The model annotates its parameters with mesh axes (``nnx.with_partitioning``)
and constrains its activations over "data" and "tensor", as MaxText's layers
do; the mesh is (dcn, data, tensor) with the slow "dcn" axis named by no
constraint (MaxText's "diloco" axis plays that part). The step is
``jaxcomp.per_slice`` for the gradient and ``nnx.Optimizer`` holding
``jaxcomp.on_shards`` for the update. With ``jaxcomp.none`` it equals plain
optax AdamW under GSPMD; with top-k it trains and keeps every parameter
sharded as annotated.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp

VOCAB, WIDTH, HIDDEN, CONTEXT, ROWS = 64, 64, 256, 16, 16
LR = 3e-3


class Block(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    zeros = nnx.initializers.zeros_init()
    self.up = nnx.Linear(WIDTH, HIDDEN, kernel_init=nnx.with_partitioning(init, ("data", "tensor")),
                         bias_init=nnx.with_partitioning(zeros, ("tensor",)), rngs=rngs)
    self.down = nnx.Linear(HIDDEN, WIDTH, kernel_init=nnx.with_partitioning(init, ("tensor", "data")),
                           rngs=rngs)

  def __call__(self, x):
    h = jax.nn.gelu(self.up(self.norm(x)))
    h = jax.lax.with_sharding_constraint(h, P("data", None, "tensor"))  # batch, length, mlp
    return x + self.down(h)


class Model(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(0.02), ("tensor", "data")), rngs=rngs)
    self.blocks = nnx.List([Block(rngs) for _ in range(2)])

  def __call__(self, tokens):
    x = jax.lax.with_sharding_constraint(self.embed(tokens), P("data", None, None))
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(x)


def loss_fn(graphdef, params, batch):
  tokens, targets = batch
  logits = nnx.merge(graphdef, params)(tokens)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 2, 2), ("dcn", "data", "tensor"), axis_types=(AxisType.Auto,) * 3,
                       devices=jax.devices()[:8])


def _batch(t, mesh):
  r = np.random.default_rng(t)
  tokens = r.integers(0, VOCAB, (ROWS, CONTEXT)).astype(np.int32)
  targets = (3 * tokens + 1) % VOCAB  # a mapping the model can learn
  return jax.device_put((tokens, targets), NamedSharding(mesh, P(("dcn", "data"))))


def _own(mesh, method, steps):
  with jax.set_mesh(mesh):
    model = Model(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  specs = nnx.get_partition_spec(params)
  tx = jaxcomp.on_shards(optax.chain(method, optax.adamw(LR)), mesh, specs, "dcn")
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grad_fn = jaxcomp.per_slice(jax.value_and_grad(lambda p, b: loss_fn(graphdef, p, b)), mesh, "dcn")

  @nnx.jit
  def step(model, opt, batch):
    loss, grads = grad_fn(nnx.state(model, nnx.Param), batch)  # one gradient per slice
    opt.update(model, grads)
    return loss.mean()

  losses = []
  with jax.set_mesh(mesh):
    for t in range(steps):
      losses.append(float(step(model, opt, _batch(t, mesh))))
  return model, specs, losses


def _plain(mesh, steps):
  with jax.set_mesh(mesh):
    model = Model(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adamw(LR)
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, batch))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  with jax.set_mesh(mesh):
    for t in range(steps):
      params, state, loss = step(params, state, _batch(t, mesh))
      losses.append(float(loss))
  return params, losses


def test_none_equals_plain_adamw_under_gspmd(mesh):
  model, _, losses = _own(mesh, jaxcomp.none(axis_name="dcn"), 4)
  want, want_losses = _plain(mesh, 4)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  got = nnx.state(model, nnx.Param)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    # AdamW moves an entry by lr * g / (|g| + 1e-8): where |g| is near its eps (4.7e-9 on one entry
    # of the first step), the two sums' rounding of g moves the entry by up to a percent of lr.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-2 * LR)


def test_topk_trains_and_keeps_the_annotated_shardings(mesh):
  model, specs, losses = _own(mesh, jaxcomp.topk(ratio=0.05, axis_name="dcn"), 12)
  assert losses[-1] < losses[0] - 0.5, losses
  params = nnx.state(model, nnx.Param)
  for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(jaxcomp.core.checks.unbox(specs),
                                                                 is_leaf=lambda s: isinstance(s, P))):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (x.sharding, spec)
