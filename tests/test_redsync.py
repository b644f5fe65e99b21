"""RedSync: sort-free selection kernels and the method built on them.

The generic properties (pmap == shard_map, replicas, wire bytes, NaN) come
from test_properties.py; here: trimmed top-k is the exact top-k, the binary
search returns k..capacity entries that dominate the rest, the payload
variants (quantized, trimmed, momentum) keep their contracts.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
  AXIS,
  assert_replicas_equal,
  init_stacked,
  params_tree,
  pmap_wire_bytes,
  run_pmap,
  worker_grads,
)
from hypothesis import given
from hypothesis import strategies as st

import jaxcomp
from jaxcomp.core.layout import Segments
from jaxcomp.kernels import compaction, selection
from jaxcomp.transforms import _args
from jaxcomp.transforms.redsync import MomentumCorrection

SIZES = (37, 1000)  # a tail shorter than one 32-bit word; several words and a tail
RATIOS = (0.01, 0.3)
BATCH = 4


@functools.cache
def _trimmed(k):
  return jax.jit(jax.vmap(lambda x: selection.trimmed_topk(x, k)))


@functools.cache
def _bsearch(k):
  return jax.jit(jax.vmap(lambda x, t: selection.threshold_binary_search(x, k, threshold=t)))


def _data(kind, n, seed):
  rng = np.random.default_rng(seed)
  if kind == "normal":
    x = rng.standard_normal((BATCH, n))
  elif kind == "ties":  # few distinct magnitudes: the k-th value is tied many times
    x = rng.integers(-3, 4, (BATCH, n))
  elif kind == "heavy":  # magnitudes over many decades
    x = rng.standard_cauchy((BATCH, n)) ** 3
  elif kind == "constant":
    x = np.full((BATCH, n), -0.5)
  else:  # zeros with a few spikes
    x = np.zeros((BATCH, n))
    x[:, rng.integers(0, n, 3)] = rng.standard_normal(3)
  return x.astype(np.float32)


KINDS = st.sampled_from(["normal", "ties", "heavy", "constant", "sparse"])


@given(n=st.sampled_from(SIZES), ratio=st.sampled_from(RATIOS), kind=KINDS, seed=st.integers(0, 2**16))
def test_trimmed_topk_is_the_exact_topk(n, ratio, kind, seed):
  x = _data(kind, n, seed)
  k = _args.ratio_count(ratio, n)
  sel = _trimmed(k)(jnp.asarray(x))
  for row, idx, count in zip(x, np.asarray(sel.indices), np.asarray(sel.count)):
    # lax.top_k's order: decreasing magnitude, lower index first among equals.
    np.testing.assert_array_equal(idx, np.argsort(-np.abs(row), kind="stable")[:k])
    assert count == k


@given(n=st.sampled_from(SIZES), ratio=st.sampled_from(RATIOS), kind=KINDS, seed=st.integers(0, 2**16),
       warm=st.sampled_from([0.0, 0.5, 3.0, 1e30]))
def test_binary_search_returns_k_to_capacity_dominant_entries(n, ratio, kind, seed, warm):
  x = _data(kind, n, seed)
  k = _args.ratio_count(ratio, n)
  cap = min(2 * k, n)
  sel = _bsearch(k)(jnp.asarray(x), jnp.full((BATCH,), warm, jnp.float32))
  for row, idx, count, thr in zip(x, np.asarray(sel.indices), np.asarray(sel.count),
                                  np.asarray(sel.threshold)):
    assert idx.shape == (cap,)
    assert k <= count <= cap
    chosen = idx[:count]
    np.testing.assert_array_equal(idx[count:], n)
    assert np.all(np.diff(chosen) > 0)
    mag = np.abs(row)
    left = np.setdiff1d(np.arange(n), chosen)
    if left.size:
      assert mag[chosen].min() >= mag[left].max()
    assert np.all(mag[chosen] >= thr)


def test_binary_search_with_the_carried_threshold_finds_the_same_kind_of_set():
  x = _data("normal", 1000, 1)
  k = _args.ratio_count(0.01, 1000)
  first = _bsearch(k)(jnp.asarray(x), jnp.zeros((BATCH,), jnp.float32))
  again = _bsearch(k)(jnp.asarray(x), first.threshold)
  np.testing.assert_array_equal(np.asarray(again.threshold), np.asarray(first.threshold))
  np.testing.assert_array_equal(np.asarray(again.indices), np.asarray(first.indices))


def test_nan_entries_are_never_selected():
  x = _data("normal", 1000, 2)
  x[:, ::3] = np.nan
  k = _args.ratio_count(0.3, 1000)
  for sel in (_trimmed(k)(jnp.asarray(x)), _bsearch(k)(jnp.asarray(x), jnp.zeros((BATCH,)))):
    for row, idx, count in zip(x, np.asarray(sel.indices), np.asarray(sel.count)):
      assert np.all(np.isfinite(row[idx[:count]]))
      assert count >= k


def test_mask_words_and_compact_match_numpy():
  x = _data("normal", 1000, 3)[0]
  words = jax.jit(compaction.mask_words)(jnp.asarray(x), 1.5)
  assert words.shape == (32,) and words.dtype == jnp.uint32
  ref = np.nonzero(np.abs(x) >= 1.5)[0]
  idx, count = jax.jit(compaction.compact, static_argnums=(1, 2))(words, 1000, 200)
  assert int(count) == min(ref.size, 200)
  np.testing.assert_array_equal(np.asarray(idx)[:ref.size], ref[:200])
  np.testing.assert_array_equal(np.asarray(idx)[ref.size:], 1000)


@given(n=st.sampled_from([1, 31, 32, 33, 1000, 4099]), density=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
       capacity=st.sampled_from([1, 7, 64]), first=st.integers(0, 200), seed=st.integers(0, 3))
def test_circular_compaction_matches_numpy(n, density, capacity, first, seed):
  """threshold / DGC compaction: the first set bits in circular order from a word boundary."""
  mask = np.random.default_rng(seed).random(n) < density
  words = compaction.pack_mask(jnp.asarray(mask))
  np.testing.assert_array_equal(np.asarray(words),
                                np.asarray(compaction.mask_words(jnp.asarray(mask, jnp.float32), 0.5)))
  idx, count = jax.jit(compaction.compact_from_word, static_argnums=1)(words, capacity, jnp.int32(first))
  w0 = first % words.shape[0] * 32
  order = np.concatenate([np.arange(w0, n), np.arange(0, w0)])
  ref = order[mask[order]][:capacity]
  assert int(count) == ref.size
  np.testing.assert_array_equal(np.asarray(idx)[:ref.size], ref)
  np.testing.assert_array_equal(np.asarray(idx)[ref.size:], 0)


def test_selection_arguments_are_checked():
  x = jnp.zeros((10,))
  with pytest.raises(ValueError, match="k must be an int in"):
    selection.trimmed_topk(x, 0)
  with pytest.raises(ValueError, match="capacity must be an int >= k"):
    selection.threshold_binary_search(x, 4, capacity=3)
  with pytest.raises(ValueError, match="step must be in"):
    selection.trimmed_topk(x, 2, step=0.0)
  with pytest.raises(ValueError, match="x must be a 1-D vector"):
    selection.trimmed_topk(jnp.zeros((2, 5)), 2)


# ----------------------------------------------------------------------------
# The method


def _memory(tx, state, params):
  """The residual of a state stacked over workers, as trees like ``params``."""
  return jax.vmap(lambda m: jaxcomp.memory_tree(tx, state._replace(memory=m), params))(state.memory)


def _sent(tx, params, grads, state, new_state):
  """What each worker sent, x - new residual, computed in float32 as the memory does."""
  return jax.tree.map(lambda g, e, e2: (np.asarray(e) + np.asarray(g)) - np.asarray(e2),
                      grads, _memory(tx, state, params), _memory(tx, new_state, params))


@pytest.mark.parametrize("kwargs", [
    {"selection": "trimmed", "ratio": 0.01},
    {"selection": "binary_search", "quantize": True, "ratio": 0.05},
])
def test_variants_send_what_they_count_and_keep_the_rest(kwargs):
  tx = jaxcomp.redsync(axis_name=AXIS, **kwargs)
  params = params_tree()
  state = jax.device_get(init_stacked(tx, params))  # host state: one compiled step for both calls
  for step in range(2):
    grads = worker_grads(params, seed=20 + step)
    out, new_state = jax.device_get(run_pmap(tx, grads, state))
    assert_replicas_equal(out)
    sent = _sent(tx, params, grads, state, new_state)
    for s, o in zip(jax.tree.leaves(sent), jax.tree.leaves(out)):
      np.testing.assert_allclose(np.asarray(o[0]), s.mean(axis=0), rtol=1e-5, atol=1e-6)
    kernel = sent["dense"]["kernel"].reshape(sent["dense"]["kernel"].shape[0], -1)  # sparse
    k = _args.ratio_count(kwargs["ratio"], kernel.shape[1])
    for w in range(kernel.shape[0]):
      values = kernel[w][kernel[w] != 0]
      if kwargs["selection"] == "trimmed":
        assert values.size == k
      else:
        assert k <= values.size <= 2 * k
      if kwargs.get("quantize"):
        assert len(np.unique(values[values > 0])) <= 1 and len(np.unique(values[values < 0])) <= 1
    np.testing.assert_array_equal(sent["dense"]["bias"], np.asarray(grads["dense"]["bias"]))  # dense
    state = new_state
  if kwargs.get("quantize"):
    measured = pmap_wire_bytes(tx, params)
    assert measured["total"] == jaxcomp.wire_bytes(tx, params)


def test_trimmed_payload_matches_numpy_topk_mean():
  tx = jaxcomp.redsync(ratio=0.01, selection="trimmed", axis_name=AXIS)
  params = params_tree()
  grads = worker_grads(params, seed=7)
  out, _ = run_pmap(tx, grads, init_stacked(tx, params))
  g = np.asarray(grads["conv"]["kernel"], np.float64).reshape(grads["conv"]["kernel"].shape[0], -1)
  k = _args.ratio_count(0.01, g.shape[1])
  ref = np.zeros_like(g)
  for w in range(g.shape[0]):
    top = np.argsort(-np.abs(g[w]), kind="stable")[:k]
    ref[w, top] = g[w, top]
  np.testing.assert_allclose(np.asarray(out["conv"]["kernel"][0]).reshape(-1), ref.mean(axis=0),
                             rtol=1e-6, atol=1e-7)


def test_binary_search_thresholds_are_carried_in_the_state():
  tx = jaxcomp.redsync(ratio=0.01, axis_name=None)
  params = params_tree()
  state = tx.init(params)
  thresholds = [np.asarray(e) for e in state.extra if len(e)]
  assert all(np.all(t == 0) for t in thresholds)
  grads = jax.tree.map(lambda g: g[0], worker_grads(params, seed=5, n=1))
  _, state = jax.jit(tx.update)(grads, state)
  thresholds = [np.asarray(e) for e in state.extra if len(e)]
  assert thresholds and all(np.all(t > 0) & np.all(np.isfinite(t)) for t in thresholds)


def test_small_leaves_go_dense():
  tx = jaxcomp.redsync(min_size=10_000, axis_name=AXIS)
  params = params_tree()
  grads = worker_grads(params, seed=8)
  out, _ = run_pmap(tx, grads, init_stacked(tx, params))
  for g, o in zip(jax.tree.leaves(grads), jax.tree.leaves(out)):
    np.testing.assert_allclose(np.asarray(o[0]), np.asarray(g).mean(axis=0), rtol=1e-5, atol=1e-6)


def test_momentum_correction_masks_sent_entries_and_keeps_the_rest():
  tx = jaxcomp.redsync(ratio=0.05, momentum=0.9, quantize=True, axis_name=None)
  assert isinstance(tx.method.memory, MomentumCorrection)
  params = {"w": jnp.zeros((40, 24))}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(3):
    g = jax.random.normal(jax.random.PRNGKey(step), (40, 24))
    out, new = update({"w": g}, state)
    old_mem, new_mem = jaxcomp.memory_tree(tx, state, params), jaxcomp.memory_tree(tx, new, params)
    u_old, v_old = np.asarray(old_mem.momentum["w"]), np.asarray(old_mem.accumulation["w"])
    x = v_old + 0.9 * u_old + np.asarray(g)
    sent = np.asarray(out["w"]) != 0
    assert 0 < sent.sum() <= 2 * _args.ratio_count(0.05, 960)
    np.testing.assert_allclose(np.asarray(new_mem.accumulation["w"]) + np.asarray(out["w"]), x,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_mem.momentum["w"])[sent], 0.0)
    np.testing.assert_allclose(np.asarray(new_mem.momentum["w"])[~sent], (x - v_old)[~sent],
                               rtol=1e-5, atol=1e-6)
    state = new


def test_dense_leaves_keep_their_momentum():
  """Issue 13.1: leaves below min_size travel dense and keep their momentum (no factor masking).

  A constant gradient of 1 on a 24-entry bias gives 1, 1.9, 2.71 (u <- 0.9 u + 1); masking every
  entry as sent gave 1.0 every step.
  """
  tx = jaxcomp.redsync(ratio=0.05, momentum=0.9, axis_name=None)
  params = {"w": jnp.zeros((40, 24)), "b": jnp.zeros((24,))}
  state = tx.init(params)
  update = jax.jit(tx.update)
  bias = []
  for step in range(3):
    out, state = update({"w": jax.random.normal(jax.random.PRNGKey(step), (40, 24)), "b": jnp.ones((24,))},
                        state)
    bias.append(np.asarray(out["b"]))
    mem = jaxcomp.memory_tree(tx, state, params)
    np.testing.assert_allclose(np.asarray(mem.momentum["b"]), [1.0, 1.9, 2.71][step], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(mem.accumulation["b"]), 0.0)
    sent = np.asarray(out["w"]) != 0
    assert sent.any() and not np.any(np.asarray(mem.momentum["w"])[sent])  # sparse leaves still mask
  np.testing.assert_allclose(np.stack(bias)[:, 0], [1.0, 1.9, 2.71], rtol=1e-6)


def test_min_size_is_the_bucket_policy():
  tx = jaxcomp.redsync(axis_name=None)
  assert tx.method.min_size == 256
  params = {"w": jnp.zeros((40, 24)), "b": jnp.zeros((300,))}
  dense = [b.exchange is jaxcomp.core.protocol.DENSE for b in tx.method.buckets(params)]
  assert dense == [False]  # both leaves compressed, in one bucket
  masked = jaxcomp.redsync(axis_name=None, dense={"w": False, "b": True})
  dense_ex = jaxcomp.core.protocol.DENSE
  assert sorted(b.exchange is dense_ex for b in masked.method.buckets(params)) == [False, True]
  assert jaxcomp.redsync(min_size=None).method.min_size is None  # the library's default


# ----------------------------------------------------------------------------
# Segments: every leaf of a bucket at once, the same selection as leaf by leaf


def _bucket(sizes, seed, kind="normal"):
  segs = Segments(tuple(int(o) for o in np.cumsum([0] + [-(-n // 128) * 128 for n in sizes[:-1]])),
                  tuple(sizes), tuple((n,) for n in sizes), 128)
  x = np.zeros(segs.length, np.float32)
  for s, n in enumerate(sizes):
    x[segs.offsets[s]:segs.offsets[s] + n] = _data(kind, n, seed + s)[0]
  return x, segs


_search_alone = jax.jit(lambda leaf, k, t: selection.threshold_binary_search(leaf, k, threshold=t),
                        static_argnums=1)


@pytest.mark.parametrize("kind", ["normal", "ties", "sparse"])
def test_segment_search_matches_each_leaf_alone(kind):
  sizes = (1000, 37, 300, 4099)
  x, segs = _bucket(sizes, 5, kind)
  k = np.array([_args.ratio_count(0.01, n) for n in sizes])
  guess = jnp.asarray([0.0, 0.5, 3.0, 1e30], jnp.float32)
  both = jax.jit(lambda x, t: (selection.segment_binary_search(x, segs, k, threshold=t),
                               selection.segment_trimmed_topk(x, segs, k)))
  bs, tr = both(jnp.asarray(x), guess)
  bs_idx, tr_idx = np.asarray(bs.indices), np.asarray(tr.indices)
  caps = np.minimum(2 * k, sizes)
  assert bs_idx.shape == (caps.sum(),) and tr_idx.shape == (k.sum(),)
  for s, n in enumerate(sizes):
    o = segs.offsets[s]
    leaf = x[o:o + n]
    alone = _search_alone(jnp.asarray(leaf), int(k[s]), guess[s])
    mine = bs_idx[(bs_idx >= o) & (bs_idx < o + n)] - o
    np.testing.assert_array_equal(mine, np.asarray(alone.indices)[:int(alone.count)], err_msg=str(s))
    assert float(bs.threshold[s]) == float(alone.threshold)
    top = tr_idx[k[:s].sum():k[:s + 1].sum()] - o
    np.testing.assert_array_equal(top, np.argsort(-np.abs(leaf), kind="stable")[:k[s]], err_msg=str(s))
  assert int(bs.count) == np.sum((bs_idx < segs.length)) and int(tr.count) == k.sum()


@pytest.mark.parametrize("n", [1, 32, 256, 257, 1000, 70001])
def test_prefix_sums_match_numpy(n):
  v = np.random.default_rng(n).integers(-40, 40, n).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(jax.jit(compaction.prefix_sum)(jnp.asarray(v))), np.cumsum(v))
  lengths = np.array([n // 3, n - 2 * (n // 3), n // 3]) if n >= 3 else np.array([n])
  sums = jax.jit(lambda v: compaction.run_sums(v, lengths))(jnp.asarray(v))
  np.testing.assert_array_equal(np.asarray(sums), [c.sum() for c in np.split(v, np.cumsum(lengths)[:-1])])


@functools.lru_cache(maxsize=None)
def _cap_programs():
  """Compiled once for every hypothesis example: cap_segments + compact, and compact_segments."""
  sizes, caps = (1000, 37, 4099), np.array([7, 64, 100])
  _, segs = _bucket(sizes, 0)

  @jax.jit
  def two_steps(w, f):
    words, kept = compaction.cap_segments(w, segs, caps, f)
    return (*compaction.compact(words, segs.length, int(caps.sum())), kept)

  one_step = jax.jit(lambda w, f: compaction.compact_segments(w, segs, caps, start_words=f))
  return sizes, caps, segs, two_steps, one_step


@given(first=st.lists(st.integers(0, 200), min_size=3, max_size=3), density=st.sampled_from([0.01, 0.3, 1.0]),
       seed=st.integers(0, 3))
def test_cap_segments_matches_numpy(first, density, seed):
  """At most caps[s] bits per segment, the first in circular order from a word of the segment.

  cap_segments + compact, and compact_segments (one prefix sum), against numpy.
  """
  sizes, caps, segs, two_steps, one_step = _cap_programs()
  rng = np.random.default_rng(seed)
  mask = np.zeros(segs.length, bool)
  for s, n in enumerate(sizes):
    mask[segs.offsets[s]:segs.offsets[s] + n] = rng.random(n) < density
  words = compaction.pack_mask(jnp.asarray(mask))
  idx, count, kept = two_steps(words, jnp.asarray(first, jnp.int32))
  one = one_step(words, jnp.asarray(first, jnp.int32))
  for a, b in zip(one, (idx, count, kept)):  # the fused form: the same positions, counts, kept bits
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  idx = np.asarray(idx)[:int(count)]
  for s, n in enumerate(sizes):
    o, p = segs.offsets[s], segs.padded_sizes[s]
    w0 = first[s] % (p // 32) * 32
    order = o + np.concatenate([np.arange(w0, p), np.arange(0, w0)])
    ref = np.sort(order[mask[order]][:caps[s]])
    np.testing.assert_array_equal(idx[(idx >= o) & (idx < o + p)], ref)
    assert int(kept[s]) == ref.size


@pytest.mark.parametrize("kwargs, match", [
    ({"selection": "sort"}, r"selection must be one of \('binary_search', 'trimmed'\)"),
    ({"ratio": 0.0}, "ratio must be in"),
    ({"min_size": 0}, "min_size must be >= 1"),
    ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
    ({"quantize": "yes"}, "quantize must be True or False"),
])
def test_bad_arguments_name_themselves(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    jaxcomp.redsync(**kwargs)
