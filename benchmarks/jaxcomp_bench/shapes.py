"""Gradient shapes of reference models, derived from their architectures.

Kernels are in JAX's layouts: a convolution is ``(H, W, in, out)`` (HWIO), a
dense layer ``(in, out)``. Only shapes are produced here, no arrays, so the
benchmarks can compile against them (``jax.ShapeDtypeStruct``) or fill them
with random data.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

Shape = tuple[int, ...]


def resnet50_shapes(num_classes: int = 1000) -> list[Shape]:
  """The 161 trainable tensors of ResNet-50 (v1.5, torchvision layout), in order.

  conv1 7x7/64 + BN; four stages of bottleneck blocks (3, 4, 6, 3 blocks,
  widths 64, 128, 256, 512, expansion 4), each block 1x1, 3x3, 1x1 convs
  without bias, each followed by a BN (scale and bias); the first block of a
  stage has a 1x1 projection conv + BN; then the fc layer (kernel and bias).
  53 convs + 53 x 2 BN vectors + 2 = 161 tensors, 25,557,032 values.
  """
  shapes: list[Shape] = []

  def conv_bn(k, cin, cout):
    shapes.extend([(k, k, cin, cout), (cout,), (cout,)])

  conv_bn(7, 3, 64)
  cin = 64
  for blocks, width in zip((3, 4, 6, 3), (64, 128, 256, 512)):
    for i in range(blocks):
      conv_bn(1, cin, width)
      conv_bn(3, width, width)
      conv_bn(1, width, 4 * width)
      if i == 0:
        conv_bn(1, cin, 4 * width)
      cin = 4 * width
  shapes.extend([(cin, num_classes), (num_classes,)])
  return shapes


def bert_shapes(layers: int, hidden: int, vocab: int = 30522, max_positions: int = 512,
                type_vocab: int = 2, intermediate: int | None = None, pooler: bool = True) -> list[Shape]:
  """The trainable tensors of a BERT encoder (embeddings, ``layers`` blocks, pooler).

  Embeddings: word, position and token-type tables and a LayerNorm. Each
  block: Q, K, V and attention-output dense layers (kernel + bias), a
  LayerNorm, the feed-forward up (hidden -> intermediate) and down layers,
  a LayerNorm. Pooler: one dense layer. No pre-training heads.
  """
  inter = 4 * hidden if intermediate is None else intermediate
  h = hidden
  shapes: list[Shape] = [(vocab, h), (max_positions, h), (type_vocab, h), (h,), (h,)]
  for _ in range(layers):
    for _ in range(4):  # query, key, value, attention output
      shapes.extend([(h, h), (h,)])
    shapes.extend([(h,), (h,)])
    shapes.extend([(h, inter), (inter,), (inter, h), (h,), (h,), (h,)])
  if pooler:
    shapes.extend([(h, h), (h,)])
  return shapes


def bert_base_shapes() -> list[Shape]:
  """BERT-base (12 layers, hidden 768, 12 heads, uncased vocab 30522): 199 tensors, 109,482,240 values."""
  return bert_shapes(12, 768)


def bert_large_shapes() -> list[Shape]:
  """BERT-large (24 layers, hidden 1024): 391 tensors, 335,141,888 values."""
  return bert_shapes(24, 1024)


def count(shapes: Sequence[Shape]) -> int:
  """Total number of values."""
  return int(sum(np.prod(s, dtype=np.int64) for s in shapes))


def abstract(shapes: Sequence[Shape], dtype=jnp.float32, lead: tuple[int, ...] = ()) -> list:
  """``jax.ShapeDtypeStruct`` leaves (a list pytree), with optional leading axes."""
  return [jax.ShapeDtypeStruct(tuple(lead) + tuple(s), dtype) for s in shapes]


def random(shapes: Sequence[Shape], seed: int = 0, dtype=jnp.float32) -> list:
  """Standard-normal float arrays of ``shapes`` (a list pytree)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes)]


LLAMA = {  # d_model, MLP width, K/V width, vocabulary, layers: the Llama 3 family's shapes
    "1b": (2048, 8192, 512, 128256, 16),
    "8b": (4096, 14336, 1024, 128256, 32),
    "70b": (8192, 28672, 1024, 128256, 80),
}


def llama_tree(size: str) -> dict:
  """The (unsharded) parameter shapes of a Llama-3-shaped model of ``size`` (:data:`LLAMA`), as tuples."""
  if size not in LLAMA:
    raise ValueError(f"size must be one of {sorted(LLAMA)}, got size={size!r}")
  d, ff, kv, vocab, layers = LLAMA[size]
  layer = {"wq": (d, d), "wk": (d, kv), "wv": (d, kv), "wo": (d, d), "w1": (d, ff), "w3": (d, ff),
           "w2": (ff, d), "attn_norm": (d,), "mlp_norm": (d,)}
  tree = {"embed": (vocab, d), "lm_head": (d, vocab), "norm": (d,)}
  tree.update({f"layer{i}": dict(layer) for i in range(layers)})
  return tree


def llama_shard(size: str, chips: int) -> dict:
  """One chip's shards of a Llama-3-shaped tree: each leaf's first axis split over ``chips``."""

  def shard(shape):
    return jax.ShapeDtypeStruct((-(-shape[0] // chips),) + shape[1:], jnp.float32)

  return jax.tree.map(shard, llama_tree(size), is_leaf=lambda x: isinstance(x, tuple))


def llama_params(size: str) -> int:
  """The parameter count of :func:`llama_tree` (8b: 8.03e9)."""
  shapes = jax.tree.leaves(llama_tree(size), is_leaf=lambda x: isinstance(x, tuple))
  return sum(int(np.prod(s)) for s in shapes)


def llama8b_shard(chips: int) -> dict:
  """One chip's shards of a Llama-3-8B-shaped tree (:func:`llama_shard`)."""
  return llama_shard("8b", chips)


MODELS = {"resnet50": resnet50_shapes, "bert-base": bert_base_shapes}
