"""DeMo: the DCT top-k codec against numpy, the momentum's conservation, 8 workers, bytes, bad arguments."""

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
  AXIS,
  N,
  assert_replicas_equal,
  assert_trees_close,
  init_stacked,
  params_tree,
  pmap_wire_bytes,
  run_pmap,
  run_shard_map,
  worker_grads,
)

import jaxcomp
from jaxcomp.collectives import packing
from jaxcomp.core.layout import Segments
from jaxcomp.optimizers.demo import DCTTopKCodec, dct_matrix, demo

LR, DECAY, WD = 0.05, 0.9, 0.1
CHUNK, TOPK = 8, 3  # tiles of 64 entries (block 128 after row alignment), 3 coefficients each
# Shared so that each compiles once (pmap steps are cached per transform).
OPT = demo(LR, compression_decay=DECAY, compression_topk=TOPK, compression_chunk=CHUNK, weight_decay=WD,
           axis_name=AXIS)
LOCAL = demo(LR, compression_decay=DECAY, compression_topk=TOPK, compression_chunk=CHUNK, weight_decay=WD)


def _params(seed=7):
  leaves, treedef = jax.tree.flatten(params_tree())
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])


def _segs(tiles, chunk):
  n = tiles * chunk * chunk
  return Segments((0,), (n,), ((n,),), chunk * chunk)


def _np_decode(x, chunk, topk):
  """DeMo's fast components in numpy (float64): per tile D T D^T, the top-k |coefficients|, the inverse."""
  d = dct_matrix(chunk).astype(np.float64)
  tiles = np.asarray(x, np.float64).reshape(-1, chunk, chunk)
  coef = np.einsum("ij,tjk,lk->til", d, tiles, d).reshape(len(tiles), -1)
  keep = np.zeros_like(coef)
  for t, row in enumerate(coef):
    idx = np.argsort(-np.abs(row), kind="stable")[:topk]
    keep[t, idx] = row[idx]
  return np.einsum("ji,tjk,kl->til", d, keep.reshape(-1, chunk, chunk), d).reshape(-1)


# ----------------------------------------------------------------------------
# The codec


@pytest.mark.parametrize("n", [1, 3, 8, 64])
def test_dct_matrix_is_orthonormal(n):
  d = dct_matrix(n).astype(np.float64)
  np.testing.assert_allclose(d @ d.T, np.eye(n), atol=1e-6)
  np.testing.assert_allclose(d.T @ d, np.eye(n), atol=1e-6)


def test_dct_matrix_is_scipys_orthonormal_dct2():
  fft = pytest.importorskip("scipy.fft")
  np.testing.assert_allclose(dct_matrix(16), fft.dct(np.eye(16), type=2, norm="ortho", axis=0), atol=1e-6)


def test_full_topk_round_trip_is_identity():
  codec = DCTTopKCodec(CHUNK, CHUNK * CHUNK, "float32")
  segs = _segs(5, CHUNK)
  x = jax.random.normal(jax.random.PRNGKey(0), (segs.length,), jnp.float32)
  out = jax.jit(lambda x: codec.decode(codec.encode(x, None, segs), None, segs))(x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(x), atol=2e-5)


def test_codec_matches_numpy_and_aggregate_is_the_mean():
  codec = DCTTopKCodec(CHUNK, TOPK, "float32")
  segs = _segs(6, CHUNK)
  xs = jax.random.normal(jax.random.PRNGKey(1), (3, segs.length), jnp.float32)

  @jax.jit
  def run(xs):
    payloads = jax.vmap(lambda x: codec.encode(x, None, segs))(xs)
    decoded = jax.vmap(lambda p: codec.decode(p, None, segs))(payloads)
    return payloads, decoded, codec.aggregate(packing.Gathered.of(payloads), None, segs, 3)

  (values, idx), decoded, mean = run(xs)
  assert values.shape == idx.shape == (3, 6, TOPK) and idx.dtype == np.uint8
  want = np.stack([_np_decode(x, CHUNK, TOPK) for x in np.asarray(xs)])
  np.testing.assert_allclose(np.asarray(decoded), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(mean), want.mean(axis=0), rtol=1e-5, atol=1e-5)


def test_payload_dtypes():
  segs = _segs(2, 64)
  x = jax.ShapeDtypeStruct((segs.length,), jnp.float32)
  values, idx = jax.eval_shape(lambda x: DCTTopKCodec(64, 32).encode(x, None, segs), x)
  assert (values.shape, values.dtype, idx.dtype) == ((2, 32), jnp.bfloat16, jnp.uint16)


# ----------------------------------------------------------------------------
# One worker: the momentum is conserved, the step is -lr * (sign + wd * p)


@functools.lru_cache(maxsize=None)
def _local_step(opt):
  def step(g, s, p):
    sent, compressed = opt.compressor.update(g, s[0])  # the chain's first transform, on its own
    updates, s = opt.update(g, s, p)
    return updates, s, sent, compressed

  return jax.jit(step)


def test_momentum_is_conserved_and_step_is_sign():
  params = _params()
  grads = worker_grads(params, seed=3, n=2)
  state = LOCAL.init(params)
  for step in range(2):
    g = jax.tree.map(lambda a: a[step], grads)
    before = jaxcomp.memory_tree(LOCAL.compressor, state[0], params)
    updates, state, sent, compressed = _local_step(LOCAL)(g, state, params)
    after = jaxcomp.memory_tree(LOCAL.compressor, state[0], params)
    np.testing.assert_array_equal(np.asarray(compressed.memory[0]), np.asarray(state[0].memory[0]))
    for m0, m1, gi, s in zip(*(jax.tree.leaves(t) for t in (before, after, g, sent))):
      np.testing.assert_allclose(np.asarray(s) + np.asarray(m1), DECAY * np.asarray(m0) + np.asarray(gi),
                                 rtol=1e-5, atol=1e-6)
    for u, s, p in zip(*(jax.tree.leaves(t) for t in (updates, sent, params))):
      np.testing.assert_allclose(np.asarray(u), -LR * (np.sign(np.asarray(s)) + WD * np.asarray(p)),
                                 rtol=1e-6, atol=1e-7)
  # the fast components are a strict part of the momentum: something stays behind
  assert max(float(np.max(np.abs(m))) for m in jax.tree.leaves(after)) > 0.1


# ----------------------------------------------------------------------------
# 8 workers


@functools.lru_cache(maxsize=None)
def _pmap_step(opt):
  return jax.pmap(lambda g, s, p: opt.update(g, s, p), axis_name=AXIS)


def _stacked(tree):
  return jax.tree.map(lambda a: np.broadcast_to(a, (N,) + a.shape), tree)


def test_pmap_updates_are_sign_of_mean_fast_components():
  params = _params()
  state = init_stacked(OPT, params)
  local = jax.jit(jax.vmap(LOCAL.compressor.update))  # each worker's fast components, one at a time
  for step in range(2):
    grads = worker_grads(params, seed=10 + step)
    sent, expect_state = local(grads, state[0])
    updates, state = jax.device_get(_pmap_step(OPT)(grads, state, _stacked(params)))
    assert_replicas_equal(updates)
    for m, e in zip(jax.tree.leaves(state[0].memory), jax.tree.leaves(expect_state.memory)):
      np.testing.assert_allclose(np.asarray(m), np.asarray(e), rtol=1e-5, atol=1e-6)
    for u, s, p in zip(*(jax.tree.leaves(t) for t in (updates, sent, params))):
      mean = np.asarray(s, np.float64).mean(axis=0)
      want = -LR * (np.sign(mean) + WD * np.asarray(p))
      clear = np.abs(mean) > 1e-5 * np.max(np.abs(mean))  # float noise may flip a sign near 0
      assert clear.mean() > 0.95
      np.testing.assert_allclose(np.asarray(u[0])[clear], want[clear], rtol=1e-6, atol=1e-7)


def test_nonfinite_gradient_gives_nan_everywhere_and_finite_momentum():
  params = _params()
  state = init_stacked(OPT, params)
  grads = worker_grads(params, seed=20)
  state = jax.device_get(_pmap_step(OPT)(grads, state, _stacked(params)))[1]
  grads = worker_grads(params, seed=21)
  grads["dense"]["kernel"] = harness.set_at(grads["dense"]["kernel"], (3, 5, 7), jnp.nan)
  updates, new_state = jax.device_get(_pmap_step(OPT)(grads, state, _stacked(params)))
  for u in jax.tree.leaves(updates):
    assert np.all(np.isnan(np.asarray(u)))
  for m in jax.tree.leaves(new_state[0].memory):
    assert np.all(np.isfinite(np.asarray(m)))
  # the step counted nothing as sent: the momentum is decay * m + g wherever g is finite
  before = jaxcomp.memory_tree(OPT.compressor, jax.tree.map(lambda a: a[0], state[0]), params)
  after = jaxcomp.memory_tree(OPT.compressor, jax.tree.map(lambda a: a[0], new_state[0]), params)
  g0 = jax.tree.map(lambda a: a[0], grads)
  for m0, m1, g in zip(*(jax.tree.leaves(t) for t in (before, after, g0))):
    np.testing.assert_allclose(np.asarray(m1), DECAY * np.asarray(m0) + np.asarray(g), rtol=1e-5, atol=1e-6)


def test_measured_bytes_equal_nominal():
  params = params_tree()
  measured = pmap_wire_bytes(OPT.compressor, params)["total"]
  nominal = jaxcomp.wire_bytes(OPT, params)
  # 4 leaves padded to 128-entry blocks: 3 + 8 + 1 + 1 blocks of 2 tiles, 3 coefficients each
  # (bfloat16 value + uint8 position), plus the 4-byte non-finite flag
  assert nominal == 13 * 2 * TOPK * 3 + 4
  assert measured == nominal


def test_shard_map_matches_pmap():
  """Under shard_map (vma-checked) the gathered coefficients' sum types and gives pmap's mean."""
  params = params_tree()
  grads = worker_grads(params, seed=40)
  state = init_stacked(OPT.compressor, params)
  a, _ = run_shard_map(OPT.compressor, grads, state)
  b, _ = run_pmap(OPT.compressor, grads, state)
  assert_replicas_equal(a)
  assert_trees_close(a, b, rtol=1e-6, atol=1e-7)


def test_scatter_exchange_runs_with_replicas_equal():
  opt = demo(LR, compression_decay=DECAY, compression_topk=TOPK, compression_chunk=CHUNK, axis_name=AXIS,
             transport="scatter")
  params = params_tree()
  state = init_stacked(opt, params)
  for step in range(2):
    updates, state = run_pmap(opt, worker_grads(params, seed=30 + step), state)
    assert_replicas_equal(updates)
    for u in jax.tree.leaves(updates):
      assert np.all(np.isin(u, np.float32([-LR, 0.0, LR])))  # -lr * sign: finite, three values
  assert max(float(np.max(np.abs(u))) for u in jax.tree.leaves(updates)) == pytest.approx(LR)


# ----------------------------------------------------------------------------
# Bytes on a small transformer, and the arguments


def transformer(vocab=93, width=64, context=64, layers=2, hidden=256):
  """A char-level LM's parameters (zeros): embeddings, pre-LN blocks, a head."""
  z = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
  ln = lambda: {"scale": z(width), "bias": z(width)}  # noqa: E731
  p = {"embed": z(vocab, width), "pos": z(context, width), "ln_f": ln(),
       "head": {"kernel": z(width, vocab), "bias": z(vocab)}}
  for i in range(layers):
    p[f"layer{i}"] = {"ln1": ln(), "ln2": ln(),
                      **{n: {"kernel": z(width, width), "bias": z(width)} for n in "qkvo"},
                      "mlp_in": {"kernel": z(width, hidden), "bias": z(hidden)},
                      "mlp_out": {"kernel": z(hidden, width), "bias": z(width)}}
  return p


def test_default_payload_is_over_50x_smaller_than_dense_on_a_transformer():
  params = transformer()
  assert sum(x.size for x in jax.tree.leaves(params)) == 116189
  ours = jaxcomp.wire_bytes(demo(1e-3, axis_name=AXIS), params)
  dense = jaxcomp.wire_bytes(jaxcomp.none(axis_name=AXIS), params)
  assert ours == 52 * 32 * (2 + 2) + 4  # 52 tiles of 64 x 64, 32 bfloat16 values + uint16 positions
  assert dense / ours >= 50, (dense, ours)


@pytest.mark.parametrize("kwargs, name", [
    ({"learning_rate": 0.0}, "learning_rate"),
    ({"learning_rate": "fast"}, "learning_rate"),
    ({"compression_decay": 1.0}, "compression_decay"),
    ({"compression_decay": -0.1}, "compression_decay"),
    ({"compression_chunk": 0}, "compression_chunk"),
    ({"compression_chunk": 2.5}, "compression_chunk"),
    ({"compression_topk": 0}, "compression_topk"),
    ({"compression_chunk": 4, "compression_topk": 17}, "compression_topk"),
    ({"weight_decay": -1.0}, "weight_decay"),
    ({"value_dtype": "int8"}, "value_dtype"),
    ({"transport": "ring"}, "transport"),
    ({"min_size": -1}, "min_size"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
  kwargs = {"learning_rate": 0.1, **kwargs}
  with pytest.raises((ValueError, TypeError), match=name):
    demo(**kwargs)


def test_schedule_learning_rate_is_accepted():
  opt = demo(lambda count: 0.1 / (1 + count), compression_chunk=CHUNK, compression_topk=TOPK)
  assert jaxcomp.compressor(opt) is opt.compressor
