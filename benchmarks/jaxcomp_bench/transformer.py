"""The language-model task's data and model (:mod:`jaxcomp_bench.lm` trains it with every method).

Data: the English prose of ``pydoc_data.topics`` (the text behind
``help("topic")``, shipped with CPython), its values joined in sorted-key
order with newlines; a character vocabulary (the sorted set of its
characters); the first 90% of the text for training, the last 10% held out.
Training windows of :data:`CONTEXT` characters are drawn per step and per
worker from ``numpy.random.default_rng([seed, step])``, so step ``t``'s
batches depend on the seed and ``t`` alone. The held-out loss is the mean
cross-entropy (nats per character) over :data:`EVAL_WINDOWS` fixed windows
spread evenly over the held-out text, with replica 0's parameters after
training.

Model (:class:`Transformer`): token and learned position embeddings, two
pre-LayerNorm blocks (causal self-attention with 4 heads of width 64, an MLP
64 -> 256 -> 64 with GELU), a final LayerNorm and a projection to the
vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

CONTEXT = 64
WIDTH = 64
HEADS = 4
MLP = 256
LAYERS = 2
TRAIN_FRACTION = 0.9
EVAL_WINDOWS = 128


# ----------------------------------------------------------------------------
# Data


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The text, its character vocabulary and the two splits as int32 token ids."""

  text: str
  vocab: str
  train: np.ndarray
  held_out: np.ndarray

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def encode(self, s: str) -> np.ndarray:
    index = {c: i for i, c in enumerate(self.vocab)}
    return np.asarray([index[c] for c in s], np.int32)

  def decode(self, ids) -> str:
    return "".join(self.vocab[int(i)] for i in np.asarray(ids).reshape(-1))


@functools.lru_cache(maxsize=None)
def load() -> Corpus:
  """``pydoc_data.topics`` as a :class:`Corpus`: the first 90% to train on, the last 10% held out."""
  from pydoc_data.topics import topics

  text = "\n".join(topics[k] for k in sorted(topics))
  vocab = "".join(sorted(set(text)))
  table = np.zeros(max(map(ord, vocab)) + 1, np.int32)
  table[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)
  ids = table[np.frombuffer(text.encode("utf-32-le"), np.uint32)]
  cut = int(TRAIN_FRACTION * len(ids))
  train, held = ids[:cut], ids[cut:]
  train.flags.writeable = False
  held.flags.writeable = False
  return Corpus(text, vocab, train, held)


def windows(tokens: np.ndarray, starts: np.ndarray, context: int = CONTEXT) -> Tuple[np.ndarray, np.ndarray]:
  """Inputs ``tokens[s:s + context]`` and targets ``tokens[s + 1:s + context + 1]`` for each start ``s``."""
  starts = np.asarray(starts)
  if starts.size and (starts.min() < 0 or starts.max() > len(tokens) - context - 1):
    raise ValueError(f"starts must be in [0, {len(tokens) - context - 1}] for {len(tokens)} tokens and"
                     f" context {context}, got [{starts.min()}, {starts.max()}]")
  idx = starts[..., None] + np.arange(context + 1)
  seq = tokens[idx]
  return seq[..., :-1], seq[..., 1:]


def train_starts(n: int, step: int, workers: int, batch: int, seed: int,
                 context: int = CONTEXT) -> np.ndarray:
  """(workers, batch) window starts of training step ``step``: ``default_rng([seed, step])``, uniform."""
  return np.random.default_rng([seed, step]).integers(0, n - context, size=(workers, batch))


def held_out_starts(n: int, count: int = EVAL_WINDOWS, context: int = CONTEXT) -> np.ndarray:
  """``count`` fixed window starts spread evenly over ``n`` held-out tokens (no seed)."""
  return np.linspace(0, n - context - 1, count).astype(np.int64)


def batches(corpus: Corpus, steps: int, workers: int, batch: int, seed: int):
  """Yields ``steps`` training batches (x, y), each (workers, batch, CONTEXT) int32."""
  for t in range(steps):
    yield windows(corpus.train, train_starts(len(corpus.train), t, workers, batch, seed))


# ----------------------------------------------------------------------------
# Model


_small = nn.initializers.normal(0.02)  # GPT-2's: the initial logits are near 0, the loss near log(vocab)


class Block(nn.Module):
  """Pre-LayerNorm: x + attention(LN(x)), then x + MLP(LN(x))."""

  width: int = WIDTH
  heads: int = HEADS
  mlp: int = MLP

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    h = nn.LayerNorm(name="ln_attention")(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.width,
                                            deterministic=True, name="attention")(h, mask=mask)
    h = nn.LayerNorm(name="ln_mlp")(x)
    h = nn.gelu(nn.Dense(self.mlp, name="mlp_in")(h))
    return x + nn.Dense(self.width, name="mlp_out")(h)


class Transformer(nn.Module):
  """Decoder-only: embeddings, ``layers`` causal blocks, LayerNorm, logits (..., T, vocab_size)."""

  vocab_size: int
  context: int = CONTEXT
  width: int = WIDTH
  heads: int = HEADS
  mlp: int = MLP
  layers: int = LAYERS

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    length = tokens.shape[-1]
    if length > self.context:
      raise ValueError(f"tokens must have at most context={self.context} positions, got {length}")
    x = nn.Embed(self.vocab_size, self.width, embedding_init=_small, name="tokens")(tokens)
    x = x + nn.Embed(self.context, self.width, embedding_init=_small, name="positions")(jnp.arange(length))
    mask = nn.make_causal_mask(tokens)
    for i in range(self.layers):
      x = Block(self.width, self.heads, self.mlp, name=f"block{i}")(x, mask)
    x = nn.LayerNorm(name="ln_final")(x)
    return nn.Dense(self.vocab_size, kernel_init=_small, name="logits")(x)


@functools.partial(jax.jit, static_argnums=0)
def _init(model: Transformer, key: jax.Array) -> Any:
  return model.init(key, jnp.zeros((1, model.context), jnp.int32))["params"]


def init_params(model: Transformer, seed: int = 0) -> Any:
  """The model's parameters (jitted once per model: eager init is slow)."""
  return _init(model, jax.random.PRNGKey(seed))


def loss_fn(params: Any, model: Transformer, x: jax.Array, y: jax.Array) -> jax.Array:
  """Mean next-character cross-entropy in nats."""
  logits = model.apply({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


_eval_loss = jax.jit(loss_fn, static_argnums=1)


def held_out_loss(params: Any, model, corpus: Corpus) -> float:
  """Mean cross-entropy (nats per character) over the :data:`EVAL_WINDOWS` fixed held-out windows."""
  x, y = windows(corpus.held_out, held_out_starts(len(corpus.held_out)))
  return float(_eval_loss(params, model, x, y))


def num_params(params: Any) -> int:
  return int(sum(p.size for p in jax.tree.leaves(params)))
