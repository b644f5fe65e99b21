"""A small Flax CNN for the digit benchmarks, and its loss and accuracy.

Two 3x3 convolutions (16 and 32 channels, each followed by ReLU and 2x2
average pooling), a 64-unit hidden layer and 10 logits: about 105k parameters
on 28x28 MNIST, small enough to train on 8 CPU devices sharing 2 cores, and
varied enough in leaf shapes (conv kernels, a large dense kernel, biases) to
exercise every method's routing.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class CNN(nn.Module):
  """conv(16) -> pool -> conv(32) -> pool -> dense(64) -> dense(num_classes)."""

  features: Sequence[int] = (16, 32)
  hidden: int = 64
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for f in self.features:
      x = nn.Conv(f, (3, 3))(x)
      x = nn.relu(x)
      if min(x.shape[-3:-1]) >= 2:
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[:-3] + (-1,))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)


def init_params(model: nn.Module, image_shape: Tuple[int, ...], seed: int = 0) -> Any:
  """The model's parameters for images of ``image_shape`` (H, W, C)."""
  x = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
  return jax.jit(model.init)(jax.random.PRNGKey(seed), x)["params"]  # jitted: eager init is slow


def loss_fn(params: Any, model: nn.Module, x: jax.Array, y: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of ``model`` on the batch (x, y)."""
  logits = model.apply({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(params: Any, model: nn.Module, x: jax.Array, y: jax.Array) -> jax.Array:
  """Fraction of (x, y) classified correctly."""
  logits = model.apply({"params": params}, x)
  return jnp.mean(jnp.argmax(logits, -1) == y)


@functools.partial(jax.jit, static_argnums=1)
def _sums(params, model, x, y):
  logits = model.apply({"params": params}, x)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()
  return jnp.sum(jnp.argmax(logits, -1) == y), loss


def evaluate(params: Any, model: nn.Module, x, y, batch_size: int = 1000) -> Tuple[float, float]:
  """(accuracy, mean loss) over the whole set, on the default device, in batches."""
  correct, total = 0.0, 0.0
  for i in range(0, len(y), batch_size):
    c, s = _sums(params, model, x[i:i + batch_size], y[i:i + batch_size])
    correct += float(c)
    total += float(s)
  return correct / len(y), total / len(y)


def num_params(params: Any) -> int:
  return int(sum(p.size for p in jax.tree.leaves(params)))
