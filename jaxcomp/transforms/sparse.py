"""Sparsifiers: top-k (gathered values + narrow indices) and random-k (psum-ed values)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.collectives.axis import AxisName
from jaxcomp.core import Codec, CodecExchange, Memory, Method, build, flat_route
from jaxcomp.transforms import _args


def scatter_mean(values: jax.Array, indices: jax.Array, n: int, num: int) -> jax.Array:
  """Mean over the worker axis of sparse payloads, accumulated into one dense vector.

  ``values`` and ``indices`` are ``(N, k)``. One scatter-add per worker in a
  fixed order: no ``N x n`` array, and the same float result on every worker.
  """
  def body(w, acc):
    return acc.at[indices[w].astype(jnp.int32)].add(values[w], mode="drop")

  return lax.fori_loop(0, values.shape[0], body, jnp.zeros((n,), jnp.float32)) / num


@dataclasses.dataclass(frozen=True)
class TopKCodec(Codec):
  """The k largest |x|: float32 values + indices of the narrowest dtype for n."""

  ratio: float

  def encode(self, x, key):
    n = x.shape[0]
    _, idx = lax.top_k(jnp.abs(x), _args.count(self.ratio, n))
    return x[idx], idx.astype(_args.index_dtype(n))

  def decode(self, payload, key, n):
    values, idx = payload
    return jnp.zeros((n,), jnp.float32).at[idx.astype(jnp.int32)].set(values)

  def aggregate(self, gathered, key, n, num):
    values, idx = gathered
    return scatter_mean(values, idx, n, num)


def topk(ratio: float = 0.01, axis_name: AxisName = None, error_feedback: bool = True, seed: int = 0):
  """Top-k sparsification with error feedback (all-gather of values + indices).

  Each leaf keeps its ``k = max(1, ceil(ratio * n))`` entries of largest
  magnitude; the payload is k float32 values and k indices as uint8 (n <= 256),
  uint16 (n <= 65536) or int32. Workers all-gather payloads and each one
  scatter-adds all of them into one dense mean. What was not sent stays in the
  residual.

  Args:
    ratio: fraction of entries sent, in (0, 1]. GRACE's code defaults to 0.3,
      its paper evaluates 0.01 and 0.001; the default here is 0.01.
    axis_name: the data-parallel axis, or None for a local round trip.
    error_feedback: keep what was not sent in a residual (default True).
    seed: seeds the state's key (unused by top-k itself).

  References:
    Aji & Heafield, *Sparse Communication for Distributed Gradient Descent*,
    EMNLP 2017; Stich et al., *Sparsified SGD with Memory*, NeurIPS 2018.
  """
  r = _args.ratio("ratio", ratio)
  ef = _args.flag("error_feedback", error_feedback)
  return build(Method("topk", flat_route(CodecExchange(TopKCodec(r))), Memory(enabled=ef)), axis_name, seed)


def random_positions(key: jax.Array, n: int, ratio: float):
  """Random-k positions: one uniform position in each stratum of ``c = ceil(n / k)``.

  Returns ``(positions, c)``; ``positions`` has ``ceil(n / c)`` int32 entries,
  distinct, some possibly ``>= n`` in the last stratum (those send nothing).
  Every entry is chosen with probability exactly ``1 / c``, with no sort.
  """
  k = _args.count(ratio, n)
  c = -(-n // k)
  strata = -(-n // c)
  offsets = jax.random.randint(key, (strata,), 0, c, dtype=jnp.int32)
  return jnp.arange(strata, dtype=jnp.int32) * c + offsets, c


@dataclasses.dataclass(frozen=True)
class RandomKCodec(Codec):
  """Values at positions drawn from a key every worker shares: only values travel."""

  ratio: float
  unbiased: bool
  linear = True
  shared_key = True

  def encode(self, x, key):
    n = x.shape[0]
    pos, c = random_positions(key, n, self.ratio)
    values = jnp.where(pos < n, x[jnp.minimum(pos, n - 1)], 0.0)
    return values * c if self.unbiased else values

  def decode(self, payload, key, n):
    pos, _ = random_positions(key, n, self.ratio)
    return jnp.zeros((n,), jnp.float32).at[pos].set(payload, mode="drop")


def randomk(ratio: float = 0.01, axis_name: AxisName = None, error_feedback: bool = True,
            unbiased: bool = False, seed: int = 0):
  """Random-k sparsification; positions come from the shared key, values are psum-ed.

  Every worker draws the same positions from the state's key (split each
  step), so only the k float32 values cross the wire and they add linearly.
  Positions are stratified: one uniform position in each run of
  ``c = ceil(n / ceil(ratio * n))`` entries, so each entry is picked with
  probability ``1/c`` and no permutation or sort is needed.

  Args:
    ratio: fraction of entries sent, in (0, 1] (GRACE's default 0.3; 0.01 here).
    axis_name: the data-parallel axis, or None.
    error_feedback: keep unsent entries in the residual (default True).
    unbiased: scale the sent values by ``c`` so that the estimate is unbiased
      (use with ``error_feedback=False``).
    seed: seeds the shared key.

  References:
    Stich et al., *Sparsified SGD with Memory*, NeurIPS 2018; Wangni et al.,
    *Gradient Sparsification for Communication-Efficient Distributed
    Optimization*, NeurIPS 2018.
  """
  r = _args.ratio("ratio", ratio)
  ef = _args.flag("error_feedback", error_feedback)
  ub = _args.flag("unbiased", unbiased)
  codec = RandomKCodec(r, ub)
  return build(Method("randomk", flat_route(CodecExchange(codec)), Memory(enabled=ef)), axis_name, seed)
