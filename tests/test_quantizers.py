"""TernGrad, natural compression, Dettmers' 8-bit, SketchML and INCEPTIONN.

What is specific to each method: numpy versions of the deterministic codecs,
unbiasedness of the stochastic ones (with a tolerance derived from a variance
bound), the payload size at the defaults, argument checks, and pmap ==
shard_map with measured == nominal wire bytes for non-default settings (the
defaults are covered for every registered method by test_properties.py).
Every codec (the sign codecs too) runs on a bucket of several leaves with
padding, and keeps its per-leaf meaning there.
"""

import functools
import math
import struct

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
  pmap_wire_bytes,
  run_pmap,
  run_shard_map,
  worker_grads,
)
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jaxcomp
from jaxcomp.collectives import packing
from jaxcomp.core.layout import Segments, padded
from jaxcomp.transforms.inceptionn import InceptionnCodec, lsb_exponent, width_prefix
from jaxcomp.transforms.quantize import NaturalCodec, QSGDCodec, TernGradCodec
from jaxcomp.transforms.sign import OneBitCodec, ScaledSignCodec, SignCodec
from jaxcomp.transforms.sketchml import SketchCodec, sample_positions, sorted_rows
from jaxcomp.transforms.u8bit import U8bitCodec, dettmers_table

pytestmark = pytest.mark.usefixtures("every_leaf_module")  # small trees on purpose: compress every leaf

KEY = jax.random.PRNGKey(42)


def _segments(sizes, block):
  """A bucket holding leaves of ``sizes`` entries, each padded to a multiple of ``block``."""
  offsets = np.cumsum([0] + [padded(n, block) for n in sizes[:-1]])
  return Segments(tuple(int(o) for o in offsets), tuple(sizes), tuple((n,) for n in sizes), block)


def _bucket(segs, xs):
  """The leaves ``xs`` laid out in ``segs`` (zero padding)."""
  out = np.zeros(segs.length, np.float32)
  for o, x in zip(segs.offsets, xs):
    out[o:o + len(x)] = x
  return jnp.asarray(out)


@functools.cache
def _codec_fn(codec, sizes):
  """Jitted ``(bucket, key) -> (payload, decode(payload))`` for one codec and bucket of leaves."""
  segs = _segments(sizes, codec.block)

  def f(x, key):
    payload = codec.encode(x, key, segs)
    return payload, codec.decode(payload, key, segs)
  return jax.jit(f)


def _round_trip(codec, x, key=KEY):
  """One leaf in a bucket of its own: the payload and the leaf's decode (padding cut off)."""
  x = np.asarray(x, np.float32)
  n = x.shape[0]
  payload, dec = _codec_fn(codec, (n,))(_bucket(_segments((n,), codec.block), [x]), key)
  return jax.tree.map(np.asarray, payload), np.asarray(dec)[:n]


def _bucket_round_trip(codec, xs, key=KEY):
  """Several leaves in one bucket: the payload and each leaf's decode."""
  sizes = tuple(len(x) for x in xs)
  segs = _segments(sizes, codec.block)
  payload, dec = _codec_fn(codec, sizes)(_bucket(segs, xs), key)
  dec = np.asarray(dec)
  return jax.tree.map(np.asarray, payload), [dec[o:o + n] for o, n in zip(segs.offsets, sizes)]


@functools.cache
def _trials_fn(codec, sizes, trials):
  """``trials`` round trips of one bucket of leaves with independent keys: decodes ``(trials, length)``."""
  segs = _segments(sizes, codec.block)

  def f(x, key):
    keys = jax.random.split(key, trials)
    return jax.vmap(lambda k: codec.decode(codec.encode(x, k, segs), k, segs))(keys)
  return jax.jit(f)


def _trials(codec, x, trials, key=KEY):
  """Decodes of one leaf over ``trials`` keys, ``(trials, n)``."""
  x = np.asarray(x, np.float32)
  n = x.shape[0]
  draws = _trials_fn(codec, (n,), trials)(_bucket(_segments((n,), codec.block), [x]), key)
  return np.asarray(draws)[:, :n]


def _wide_values(n, seed=0, octaves=12.0):
  """Signed values spread over ~2*octaves binary orders, max |x| exactly 1, a few exact zeros."""
  rng = np.random.default_rng(seed)
  x = np.sign(rng.standard_normal(n)) * np.exp2(-rng.uniform(0, octaves, n))
  x[:3] = 0.0
  x[3] = 1.0
  x[4] = -0.75
  return x.astype(np.float32)


def _bernstein_tol(var, bound, trials, delta=1e-9):
  """|mean of `trials` iid draws - expectation| stays below this with probability >= 1 - delta.

  Bernstein's inequality for iid terms with variance <= ``var`` and
  ``|draw - expectation| <= bound``: solve ``trials t^2 = c (2 var + 2 bound t / 3)``
  with ``c = ln(2 / delta)``. Unlike a Gaussian 5-sigma rule this holds for the
  skewed Bernoulli draws of values that round up with a tiny probability.
  """
  c = math.log(2.0 / delta)
  b = 2.0 * c * bound / 3.0
  return (b + np.sqrt(b * b + 8.0 * trials * c * var)) / (2.0 * trials)


def _assert_unbiased(draws, expected, var, bound):
  """Elementwise Bernstein bound, plus the sum over elements (CLT, |z| < 6)."""
  draws = np.asarray(draws, np.float64)
  trials = draws.shape[0]
  mean = draws.mean(axis=0)
  tol = _bernstein_tol(var, bound, trials) + 1e-6 * np.abs(expected)
  bad = np.abs(mean - expected) > tol
  assert not bad.any(), (np.flatnonzero(bad), mean[bad], expected[bad], tol[bad])
  z = (mean - expected).sum() / math.sqrt(max(var.sum() / trials, 1e-300))
  assert abs(z) < 6.0, z


# ----------------------------------------------------------------------------
# Payload size at the defaults (bits per element + per-leaf constant)


@pytest.mark.parametrize("name,factory,expected", [
    ("terngrad", lambda: jaxcomp.terngrad(), 4096 // 4 + 4),       # 2 bits + f32 scale
    ("natural", lambda: jaxcomp.natural(), 4096 + 1),              # 8 bits + u8 top exponent
    ("u8bit", lambda: jaxcomp.u8bit(), 4096 + 4),                  # 8 bits + f32 scale
    ("sketchml", lambda: jaxcomp.sketchml(), 4096 + 64 * 4),       # 8 bits + 64 f32 means
    ("inceptionn", lambda: jaxcomp.inceptionn(), 4096 // 4 + 4096),  # 2-bit tags + 1 B/value stream
    ("natural4", lambda: jaxcomp.natural(bits=4), 4096 // 2 + 1),
    ("natural2", lambda: jaxcomp.natural(bits=2), 4096 // 4 + 1),
    ("sketchml16", lambda: jaxcomp.sketchml(buckets=16), 4096 // 2 + 16 * 4),
    ("sketchml4", lambda: jaxcomp.sketchml(buckets=4), 4096 // 4 + 4 * 4),
    ("sketchml2", lambda: jaxcomp.sketchml(buckets=2), 4096 // 8 + 2 * 4),
    ("inceptionn2", lambda: jaxcomp.inceptionn(capacity=2.0), 4096 // 4 + 8192),
])
def test_nominal_payload_bytes(name, factory, expected):
  assert jaxcomp.wire_bytes(factory(), {"w": jnp.zeros((64, 64))}) == expected


def test_small_leaves_pay_for_what_they_hold():
  # SketchML never sends more means than entries; INCEPTIONN (absolute bound) a stream byte per leaf.
  # Both leaves share a bucket: each is padded to 128 entries, the indices (4 bits:
  # up to 10 means) and tags (2 bits) of the 256 entries are packed together.
  params = {"one": jnp.zeros(()), "ten": jnp.zeros((10,))}
  assert jaxcomp.wire_bytes(jaxcomp.sketchml(), params) == (1 + 10) * 4 + 256 // 2
  absolute = jaxcomp.inceptionn(error_bound=2.0 ** -10, capacity=0.01)
  assert jaxcomp.wire_bytes(absolute, params) == 256 // 4 + (1 + 1)
  # The relative bound's streams hold its float32 step and room for the largest value (2 bytes).
  assert jaxcomp.wire_bytes(jaxcomp.inceptionn(capacity=0.01), params) == 256 // 4 + (6 + 6)
  # A leaf alone: one mean and no index.
  assert jaxcomp.wire_bytes(jaxcomp.sketchml(), {"one": jnp.zeros(())}) == 4


# ----------------------------------------------------------------------------
# pmap == shard_map and measured == nominal wire bytes, non-default settings

VARIANTS = {
    "terngrad_noclip_ef": lambda ax: jaxcomp.terngrad(clip_sigma=None, error_feedback=True, axis_name=ax),
    "natural_4bit": lambda ax: jaxcomp.natural(bits=4, axis_name=ax),
    "sketchml_sampled": lambda ax: jaxcomp.sketchml(buckets=16, sample_size=128, axis_name=ax),
    "inceptionn_tight": lambda ax: jaxcomp.inceptionn(error_bound=2 ** -4, capacity=0.25, axis_name=ax),
}


def _small_params():
  return {"kernel": jnp.zeros((40, 24)), "bias": jnp.zeros((24,))}  # two leaf groups: quick to compile


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_pmap_equals_shard_map_and_wire_is_nominal(name):
  tx = VARIANTS[name](AXIS)
  params = _small_params()
  state_p = state_s = init_stacked(tx, params)
  for step in range(2):
    grads = worker_grads(params, seed=step)
    out_p, state_p = run_pmap(tx, grads, state_p)
    out_s, state_s = run_shard_map(tx, grads, state_s)
    assert_replicas_equal(out_p)
    assert_replicas_equal(out_s)
    assert_trees_close(out_p, out_s, rtol=1e-6, atol=1e-7)
    assert_trees_close(state_p, state_s, rtol=1e-6, atol=1e-7)
  measured = pmap_wire_bytes(tx, params)
  assert measured["total"] == jaxcomp.wire_bytes(tx, params), measured


@pytest.mark.parametrize("name", ["u8bit", "sketchml"])
def test_pmap_mean_is_the_mean_of_numpy_decodes(name):
  """The communicator: all-gather, decode each worker's payload, average."""
  tx = jaxcomp.METHODS[name](axis_name=AXIS)
  params = _small_params()
  grads = worker_grads(params, seed=1)
  out, _ = run_pmap(tx, grads, init_stacked(tx, params))
  def decode(x):
    return _u8bit_reference(x)[-1] if name == "u8bit" else _sketch_reference(x, 64)[-1]

  for g, o in zip(jax.tree.leaves(grads), jax.tree.leaves(out)):
    g = np.asarray(g).reshape(N, -1)
    expected = np.mean([decode(g[w]) for w in range(N)], axis=0)
    np.testing.assert_allclose(np.asarray(o[0]).reshape(-1), expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# TernGrad


def _terngrad_clip_reference(x, c=2.5):
  x = np.asarray(x, np.float64)
  bound = c * np.sqrt(np.mean(x * x))
  return np.clip(x, -bound, bound)


def test_terngrad_clips_scales_and_ternarizes():
  x = np.random.default_rng(0).standard_normal(512).astype(np.float32)
  x[7], x[8] = 40.0, -25.0  # far beyond 2.5 sigma
  (scale, words), dec = _round_trip(TernGradCodec(2.5), x)
  clipped = _terngrad_clip_reference(x)
  np.testing.assert_allclose(scale, np.abs(clipped).max(), rtol=1e-6)
  assert words.dtype == np.uint8 and words.shape == (128,)
  q = np.asarray(packing.unpack(jnp.asarray(words), 2, 512)).astype(np.int64) - 1
  assert set(np.unique(q)) <= {-1, 0, 1}
  np.testing.assert_array_equal(dec, (q * scale).astype(np.float32))
  assert np.all((q == 0) | (q == np.sign(x)))
  assert dec[7] in (0.0, scale) and dec[8] in (0.0, -scale)


def test_terngrad_without_clipping_keeps_the_max():
  x = np.array([3.0, -1.0, 0.0, 0.5], np.float32)
  (scale, _), dec = _round_trip(TernGradCodec(None), x)
  assert scale == 3.0 and dec[0] == 3.0 and dec[2] == 0.0
  # A single entry is never clipped to zero (sigma is the root mean square).
  (_, _), dec = _round_trip(TernGradCodec(2.5), np.array([0.3], np.float32))
  np.testing.assert_array_equal(dec, [np.float32(0.3)])


def test_terngrad_is_unbiased_given_the_clipping():
  """Decoded value: s*sign(x) w.p. |x|/s, else 0: variance |x|(s-|x|), deviation <= s."""
  x = np.random.default_rng(1).standard_normal(256).astype(np.float32)
  x[0] = 9.0
  trials = 4000
  draws = _trials(TernGradCodec(2.5), x, trials)
  clipped = _terngrad_clip_reference(x)
  s = np.abs(clipped).max()
  a = np.abs(clipped)
  _assert_unbiased(draws, clipped, a * (s - a), np.full_like(a, s))


def test_terngrad_transform_is_unbiased_over_steps():
  """Through the whole transform: a fresh key every step, so the mean over steps is x."""
  tx = jaxcomp.terngrad(clip_sigma=None, axis_name=None)
  g = {"w": jnp.asarray(np.random.default_rng(2).uniform(-1, 1, 64), jnp.float32)}
  steps = 3000

  def body(state, _):
    out, state = tx.update(g, state)
    return state, out["w"]

  _, outs = jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(tx.init(g))
  x = np.asarray(g["w"], np.float64)
  s, a = np.abs(x).max(), np.abs(x)
  _assert_unbiased(outs, x, a * (s - a), np.full_like(a, s))


# ----------------------------------------------------------------------------
# Natural compression


def _natural_levels(bits):
  return 2 ** (bits - 1) - 1


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_natural_is_unbiased(bits):
  """In range, |x| in [l, 2l) becomes l or 2l: variance (a-l)(2l-a) <= a^2/8, deviation <= l <= a.

  Below the lowest level L (bits 4 and 2), |x| becomes 0 or L: variance a(L-a), deviation <= L.
  ``max|x| = 1`` exactly, so the top exponent is that of 1 and L = 2**(1 - levels).
  """
  x = _wide_values(256, seed=bits)
  trials = 4000
  draws = _trials(NaturalCodec(bits), x, trials)
  a = np.abs(x).astype(np.float64)
  low = 2.0 ** (1 - _natural_levels(bits))
  var = np.where(a >= low, a * a / 8, a * (low - a))
  _assert_unbiased(draws, x.astype(np.float64), var, np.where(a >= low, a, low))
  # Support: 0 or a signed power of two bracketing |x| (or the lowest level below it).
  for d in draws[:50]:
    nz = d != 0
    assert np.all(np.sign(d[nz]) == np.sign(x[nz]))
    m, _ = np.frexp(np.abs(d[nz]))
    assert np.all(m == 0.5)
    lo = np.exp2(np.floor(np.log2(a[nz])))
    assert np.all((np.abs(d[nz]) == lo) | (np.abs(d[nz]) == 2 * lo) | (np.abs(d[nz]) == low))


def test_natural_round_trips_zero_and_powers_of_two():
  x = np.array([0.0, -0.0, 1.0, -0.5, 2.0 ** -40, 2.0 ** 20, -(2.0 ** 64), 0.0], np.float32)
  (top, words), dec = _round_trip(NaturalCodec(8), x)
  assert top.dtype == np.uint8 and top.shape == (1,) and top[0] == 127 + 64
  assert words.shape == (128,) and words.dtype == np.uint8  # 8 entries padded to 128
  np.testing.assert_array_equal(dec, x)
  assert words[0] == 0 and words[7] == 0 and not words[8:].any()  # zero is the all-zero field


def test_natural_all_zero_leaf():
  (top, words), dec = _round_trip(NaturalCodec(8), np.zeros(16, np.float32))
  assert top == 0 and not words.any() and not dec.any()


@given(hnp.arrays(np.float32, 64, elements=st.floats(2.0 ** -60, 2.0 ** 60, width=32)),
       hnp.arrays(np.bool_, 64), st.integers(0, 2 ** 31 - 1))
def test_natural_rounds_to_a_neighbouring_power_of_two(mag, neg, seed):
  """Within 120 octaves of the max (all levels in range at 8 bits): the two bracketing powers."""
  x = np.where(neg, -mag, mag).astype(np.float32)
  _, dec = _round_trip(NaturalCodec(8), x, jax.random.PRNGKey(seed))
  lo = np.exp2(np.floor(np.log2(np.abs(x).astype(np.float64))))
  assert np.all(np.sign(dec) == np.sign(x))
  assert np.all((np.abs(dec) == lo) | (np.abs(dec) == 2 * lo))


# ----------------------------------------------------------------------------
# Dettmers' 8-bit code


def test_dettmers_table():
  t = dettmers_table().astype(np.float64)
  assert t.shape == (128,) and t[0] == 0.0 and t[-1] == 1.0 and np.all(np.diff(t) > 0)
  # Per decade 10^-k: 2 * 2^(6-k) bin midpoints (64 in [0.1, 1), 2 in [1e-6, 1e-5)).
  for k in range(1, 7):
    inside = (t >= 10.0 ** -k) & (t < 10.0 ** (1 - k))
    assert inside[1:-1].sum() == 2 ** (7 - k), k
  # Entries of GRACE's table, derived from the rule: midpoints of the halves
  # [10^-k, 4.5*10^-k) and [4.5*10^-k, 10^(1-k)).
  for v in (2.75e-6, 7.25e-6, 1.875e-5, 1.4375e-4, 1.21875e-3, 4.84375e-3, 1.109375e-2,
            0.10546875, 0.45859375, 0.99140625):
    assert np.min(np.abs(t - v)) <= 1e-7 * v, v


def _u8bit_reference(x):
  """Nearest table entry by brute force (argmin of distances), sign bit, decode."""
  x = np.asarray(x, np.float32)
  table = dettmers_table()
  scale = np.float32(np.abs(x).max())
  r = np.abs(x) / (scale if scale > 0 else np.float32(1))
  idx = np.argmin(np.abs(r[:, None].astype(np.float64) - table[None, :]), axis=1)
  code = np.where((x < 0) & (idx > 0), idx | 0x80, idx).astype(np.uint8)
  dec = np.where(x < 0, -1, 1) * (table[idx] * scale)
  return scale, code, r, dec.astype(np.float32)


def _check_u8bit(x):
  (scale, code), dec = _round_trip(U8bitCodec(), x)
  ref_scale, ref_code, r, ref_dec = _u8bit_reference(x)
  assert scale.shape == (1,) and scale[0] == ref_scale and code.dtype == np.uint8
  assert code.shape == (padded(len(x), 128),) and not code[len(x):].any()
  code = code[:len(x)]
  differ = code != ref_code
  if differ.any():  # only a value on a midpoint (to float32 rounding) may go either way
    table = dettmers_table().astype(np.float64)
    i = (code[differ] & 0x7F).astype(int)
    j = (ref_code[differ] & 0x7F).astype(int)
    assert np.all(np.abs(i - j) == 1)
    mid = (table[np.minimum(i, j)] + table[np.maximum(i, j)]) / 2
    np.testing.assert_allclose(r[differ], mid, rtol=2e-7)
  np.testing.assert_array_equal(dec[~differ], ref_dec[~differ])


def test_u8bit_cell_lookup_is_searchsorted_of_the_bounds():
  """The encode's index (a cell table and one compare) is searchsorted(bounds, r, "left") exactly:
  on every bound, its float neighbours, 0, 1, the cell edges and random r in [0, 1]."""
  from jaxcomp.transforms.u8bit import _BOUNDS
  b = _BOUNDS
  edges = (np.arange(0, (0x3F800000 >> 18) + 1, dtype=np.uint32) << 18).view(np.float32)
  r = np.concatenate([b, np.nextafter(b, np.float32(0)), np.nextafter(b, np.float32(2)), edges,
                      np.float32([0.0, 1.0, 1e-30, 1e-7]),
                      np.random.default_rng(0).random(4096).astype(np.float32) ** 8]).astype(np.float32)
  r = r[r <= 1.0]
  x = np.concatenate([np.float32([1.0]), r])  # scale max|x| = 1: r is x
  (_, code), _ = _round_trip(U8bitCodec(), x)
  np.testing.assert_array_equal(code[:len(x)] & 0x7F, np.searchsorted(b, x, side="left"))


def test_u8bit_matches_numpy():
  rng = np.random.default_rng(3)
  x = (rng.standard_normal(1000) * np.exp(2 * rng.standard_normal(1000))).astype(np.float32)
  x[:4] = 0.0
  _check_u8bit(x)
  _, dec = _round_trip(U8bitCodec(), x)
  assert np.all(dec[:4] == 0) and np.abs(dec).max() == np.abs(x).max()  # zero and the max are exact


@given(hnp.arrays(np.float32, 64, elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)
                  .filter(lambda v: v == 0 or abs(v) > 1e-20)))
def test_u8bit_matches_numpy_property(x):
  _check_u8bit(x)


# ----------------------------------------------------------------------------
# SketchML


def _sketch_reference(x, q, positions=None):
  """Buckets from order statistics of the (sampled) sorted values; exact bucket means."""
  x = np.asarray(x, np.float32)
  q = min(q, x.shape[0])
  sample = x if positions is None else x[np.asarray(positions)]
  s = np.sort(sample)
  edges = s[(np.arange(1, q) * len(s)) // q]
  idx = np.searchsorted(edges, x, side="right")
  counts = np.bincount(idx, minlength=q)
  sums = np.bincount(idx, weights=x.astype(np.float64), minlength=q)
  means = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
  return idx, means, means[idx]


def _check_sketch(x, buckets, sample_size=16384, key=KEY):
  n = x.shape[0]
  codec = SketchCodec(buckets, sample_size)
  (means, words), dec = _round_trip(codec, x, key)
  q = min(buckets, n)
  bits = next(b for b in (1, 2, 4, 8) if q <= 2 ** b)
  assert means.shape == (q,) and means.dtype == np.float32
  assert words.shape == (packing.packed_size(padded(n, 128), bits),) and words.dtype == np.uint8
  positions = None
  if n > sample_size:
    positions = np.asarray(sample_positions(key, _segments((n,), 128), sample_size))[0]
  ref_idx, ref_means, _ = _sketch_reference(x, buckets, positions)
  idx = np.asarray(packing.unpack(jnp.asarray(words), bits, n))
  np.testing.assert_array_equal(idx, ref_idx)
  np.testing.assert_allclose(means, ref_means, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(dec, means[idx])
  return idx, dec


@pytest.mark.parametrize("buckets", [64, 16, 4, 2])
def test_sketchml_matches_numpy_exact_quantiles(buckets):
  x = np.random.default_rng(4).standard_normal(300).astype(np.float32)
  idx, dec = _check_sketch(x, buckets)
  counts = np.bincount(idx, minlength=buckets)
  assert counts.max() - counts.min() <= 1  # equal-count buckets from exact quantiles
  np.testing.assert_allclose(dec.sum(), x.sum(), rtol=1e-4, atol=1e-4)  # the sum is kept


def test_sketchml_matches_numpy_sampled_quantiles():
  x = np.random.default_rng(5).standard_normal(20000).astype(np.float32)
  idx, dec = _check_sketch(x, 64, sample_size=4096)
  # 64 samples per bucket: each bucket's share of the leaf varies by ~1/8 (relative).
  counts = np.bincount(idx, minlength=64) / (20000 / 64)
  assert counts.min() > 0.4 and counts.max() < 1.8, counts
  np.testing.assert_allclose(dec.sum(), x.sum(), rtol=1e-4, atol=1e-3)


def test_sketchml_fewer_entries_than_buckets_is_exact():
  x = np.array([0.5, -2.0, 0.5, 3.0, 1e-3, 0.0, -7.0], np.float32)
  _, dec = _check_sketch(x, 64)
  np.testing.assert_array_equal(dec, x)


@given(hnp.arrays(np.float32, 64, elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False)),
       st.sampled_from([4, 16, 64]))
def test_sketchml_matches_numpy_property(x, buckets):
  _check_sketch(x, buckets)


# ----------------------------------------------------------------------------
# INCEPTIONN


def _inceptionn_reference(x, lsb, cap, shift):
  """Byte by byte: tag and bytes per value in rotated order; stop at the first that does not fit."""
  x = np.roll(np.asarray(x, np.float32), -shift)
  tags, stream, full = [], bytearray(), False
  for v in x.tolist():
    a = abs(v)
    q = math.floor(a * 2.0 ** -lsb + 0.5) if math.isfinite(a) else None
    sign = 1 if math.copysign(1.0, v) < 0 else 0
    if q is None or q >= 2 ** 15:
      tag, data = 3, struct.pack("<f", v)
    elif q >= 2 ** 7:
      tag, data = 2, ((sign << 15) | q).to_bytes(2, "little")
    elif q >= 1:
      tag, data = 1, bytes([(sign << 7) | q])
    else:
      tag, data = 0, b""
    if data and (full or len(stream) + len(data) > cap):
      full = True
      tag, data = 0, b""
    tags.append(tag)
    stream += data
  stream += bytes(cap - len(stream))
  dec = []
  pos = 0
  for t in tags:
    w = (0, 1, 2, 4)[t]
    chunk = bytes(stream[pos:pos + w])
    pos += w
    if t == 0:
      dec.append(0.0)
    elif t == 3:
      dec.append(struct.unpack("<f", chunk)[0])
    else:
      word = int.from_bytes(chunk, "little")
      top = 8 * w - 1
      mag = (word & ((1 << top) - 1)) * 2.0 ** lsb
      dec.append(-mag if word >> top else mag)
  dec = np.roll(np.asarray(dec, np.float32), shift)
  return np.asarray(tags), np.frombuffer(bytes(stream), np.uint8), dec


def _check_inceptionn(x, error_bound, capacity, key=KEY):
  n = x.shape[0]
  codec = InceptionnCodec(lsb_exponent(error_bound), capacity)
  (tag_words, stream), dec = _round_trip(codec, x, key)
  cap = max(1, math.ceil(capacity * n - 1e-9))
  assert tag_words.shape == (packing.packed_size(padded(n, 128), 2),) and stream.shape == (cap,)
  shift = int(codec.shift(key, _segments((n,), 128))[0])
  ref_tags, ref_stream, ref_dec = _inceptionn_reference(x, codec.lsb, cap, shift)
  tags = np.asarray(packing.unpack(jnp.asarray(tag_words), 2, n))  # in the leaf's own order
  np.testing.assert_array_equal(tags, np.roll(ref_tags, shift))
  np.testing.assert_array_equal(stream, ref_stream)
  np.testing.assert_array_equal(dec, ref_dec)
  return tags, dec


@pytest.mark.parametrize("n,seed", [(16, 0), (128, 1), (16 * 700, 2)])
def test_inceptionn_width_prefix_is_the_cumsum_of_the_widths(n, seed):
  """The stream positions from population counts of the packed tags equal a cumsum of 0/1/2/4 bytes."""
  tags = np.random.default_rng(seed).integers(0, 4, n).astype(np.uint8)
  tags[: n // 4] = 3  # a run of raw floats: sums past one word's 64
  got = np.asarray(jax.jit(width_prefix)(packing.pack(jnp.asarray(tags), 2)))
  np.testing.assert_array_equal(got, np.cumsum(np.array([0, 1, 2, 4])[tags]))


def test_inceptionn_matches_numpy_with_overflow():
  x = np.random.default_rng(6).standard_normal(400).astype(np.float32) * 0.3
  x[10:20] = [1e-5, -1e-4, 2e-3, -0.2, 0.26, -10.0, 70.0, -1e9, np.inf, np.nan]
  tags, dec = _check_inceptionn(x, 2.0 ** -10, 1.0)
  # The 16-bit values alone need more than n bytes: the stream is full, and
  # values that would have been sent were not.
  assert np.array([0, 1, 2, 4])[tags].sum() > 400 - 4
  assert np.any((np.abs(x) >= 2.0 ** -10) & (dec == 0))


def test_inceptionn_widths_and_error_bound_without_overflow():
  x = np.array([0.0, 9e-4, 1e-3, -0.2, 0.26, -50.0, 70.0, np.inf, -np.inf, np.nan] * 3, np.float32)
  tags, dec = _check_inceptionn(x, 2.0 ** -10, 4.0)
  np.testing.assert_array_equal(tags[:10], [0, 0, 1, 1, 2, 2, 3, 3, 3, 3])
  finite = np.isfinite(x)
  assert np.all(np.abs(dec[finite] - x[finite]) <= 2.0 ** -10)
  np.testing.assert_array_equal(dec[~finite][:2], x[~finite][:2])
  assert np.isnan(dec[9])


@given(hnp.arrays(np.float32, 64, elements=st.floats(-1e5, 1e5, width=32)),
       st.sampled_from([3e-3, 2e-7]), st.integers(0, 2 ** 31 - 1))
def test_inceptionn_error_bound_property(x, error_bound, seed):
  """With room for every value, every entry is within error_bound (the grid step halves it)."""
  _, dec = _check_inceptionn(x, error_bound, 4.0, jax.random.PRNGKey(seed))
  assert np.all(np.abs(dec.astype(np.float64) - x) <= error_bound)


@pytest.mark.parametrize("kwargs,most", [
    ({"error_bound": 2.0 ** -10}, 64),  # absolute bound: 16-bit values, 64 fit per step
    ({}, 124),  # relative bound (default): the 4-byte step, then at most 124 8-bit values
])
def test_inceptionn_overflow_stays_in_the_residual_and_rotates(kwargs, most):
  """Stream for a quarter of the values: nothing is lost and no position starves."""
  tx = jaxcomp.inceptionn(capacity=0.5, axis_name=None, **kwargs)
  g = {"w": jnp.ones((256,), jnp.float32)}
  steps = 40

  def body(state, _):
    out, state = tx.update(g, state)
    return state, out["w"]

  state, outs = jax.jit(lambda s: jax.lax.scan(body, s, None, length=steps))(tx.init(g))
  outs = np.asarray(outs, np.float64)
  assert np.all((outs != 0).any(axis=0))  # every position was sent at some step
  assert np.all((outs != 0).sum(axis=1) <= most)
  residual = jaxcomp.memory_tree(tx, state, g)["w"]
  np.testing.assert_allclose(outs.sum(0) + np.asarray(residual), steps, rtol=1e-6)


# ----------------------------------------------------------------------------
# Buckets: several leaves, one payload, per-leaf meaning


def _leaves():
  """Leaves of a bucket: sizes that need padding, one sign only, all zeros, scales 1e3 apart."""
  rng = np.random.default_rng(9)
  return [
      np.array([-0.7], np.float32),
      -np.abs(rng.standard_normal(10)).astype(np.float32),
      rng.standard_normal(300).astype(np.float32),
      np.zeros(128, np.float32),
      (1e3 * rng.standard_normal(257)).astype(np.float32),
  ]


def _scaled_sign_reference(x):
  return np.float32(np.abs(x).mean()) * np.where(x >= 0, 1.0, -1.0)


def _onebit_reference(x):
  neg = x < 0
  lo = x[neg].sum(dtype=np.float64) / max(neg.sum(), 1)
  hi = x[~neg].sum(dtype=np.float64) / max((~neg).sum(), 1)
  return np.where(neg, lo, hi)


@pytest.mark.parametrize("codec,reference", [
    (U8bitCodec(), lambda x: _u8bit_reference(x)[-1]),
    (SketchCodec(16, 16384), lambda x: _sketch_reference(x, 16)[-1]),
    (OneBitCodec(), _onebit_reference),
    (ScaledSignCodec(), _scaled_sign_reference),
    (SignCodec(scaled=True), _scaled_sign_reference),
    (SignCodec(), lambda x: np.where(x >= 0, 1.0, -1.0)),
], ids=["u8bit", "sketchml", "onebit", "efsignsgd", "signsgd_ef", "signsgd"])
def test_deterministic_codecs_decode_each_leaf_of_a_bucket_as_alone(codec, reference):
  """Padding entries count in no mean, no max, no quantile: each leaf decodes as its numpy reference."""
  xs = _leaves()
  _, decs = _bucket_round_trip(codec, xs)
  for s, (x, dec) in enumerate(zip(xs, decs)):
    np.testing.assert_allclose(dec, reference(x), rtol=1e-5, atol=1e-6, err_msg=str(s))


def test_codec_payload_has_one_scale_per_leaf():
  xs = _leaves()
  norms = np.array([np.linalg.norm(x.astype(np.float64)) for x in xs])
  maxima = np.array([np.abs(x).max() for x in xs])
  (norm, words), _ = _bucket_round_trip(QSGDCodec(7), xs)
  np.testing.assert_allclose(norm, norms, rtol=1e-6)
  assert words.shape == (sum(padded(len(x), 128) for x in xs) // 2,)  # 4 bits per entry
  (scale, _), _ = _bucket_round_trip(TernGradCodec(None), xs)
  np.testing.assert_array_equal(scale, maxima.astype(np.float32))
  (scale, _), _ = _bucket_round_trip(TernGradCodec(2.5), xs)
  np.testing.assert_allclose(scale, [np.abs(_terngrad_clip_reference(x)).max() for x in xs], rtol=1e-6)
  (scale, _), _ = _bucket_round_trip(U8bitCodec(), xs)
  np.testing.assert_array_equal(scale, maxima.astype(np.float32))
  (top, _), decs = _bucket_round_trip(NaturalCodec(2), xs)
  # 2 bits: 0 or +-2**top, top that of the leaf's largest rounded magnitude.
  for t, x, dec in zip(top, xs, decs):
    assert np.all((dec == 0) | (np.abs(dec) == (2.0 ** (int(t) - 127) if t else 0))), (t, x[:3], dec[:3])
    if x.any():
      assert np.exp2(int(t) - 127) in (np.exp2(np.floor(np.log2(np.abs(x).max()))),
                                       np.exp2(np.floor(np.log2(np.abs(x).max())) + 1))
  assert top[3] == 0  # the all-zero leaf
  (means, _), _ = _bucket_round_trip(OneBitCodec(), xs)
  assert means.shape == (2, 5)
  np.testing.assert_allclose(means[1], [0.0, 0.0, xs[2][xs[2] >= 0].mean(), 0.0, xs[4][xs[4] >= 0].mean()],
                             rtol=1e-6)


_SPECIAL = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, -1.0]


@given(hnp.arrays(np.float32, (3, 40), elements=st.one_of(st.floats(width=32), st.sampled_from(_SPECIAL))))
def test_sorted_rows_sorts_every_float_and_reads_back_its_bits(x):
  """SketchML's split points come from this int32-key sort: numpy's order (jnp.sort's, but for
  subnormals, which XLA:CPU's float comparator may take for zero), NaN of either sign last and
  read back as NaN, -0.0 as 0.0, every other value's bits unchanged."""
  got, want = np.asarray(sorted_rows(jnp.asarray(x))), np.sort(x, axis=1)
  assert np.array_equal(np.isnan(got), np.isnan(want))
  finite = ~np.isnan(want)
  np.testing.assert_array_equal(got[finite].view(np.int32), (want[finite] + np.float32(0)).view(np.int32))
  assert not np.any(np.signbit(got[np.isnan(got)]))


def test_sketchml_sampled_quantiles_per_leaf_of_a_bucket():
  """Leaves larger than the sample draw their own sample; the smaller ones are exact."""
  xs = _leaves()
  codec = SketchCodec(16, 128)
  (means, words), decs = _bucket_round_trip(codec, xs)
  segs = _segments(tuple(len(x) for x in xs), 128)
  positions = np.asarray(sample_positions(KEY, segs, 128))
  q = [min(16, len(x)) for x in xs]
  assert means.shape == (sum(q),) and words.shape == (segs.length // 2,)
  first = np.cumsum(q) - q
  for s, (x, dec) in enumerate(zip(xs, decs)):
    pos = positions[s] - segs.offsets[s] if len(x) > 128 else None
    assert pos is None or (pos.min() >= 0 and pos.max() < len(x))
    _, ref_means, ref_dec = _sketch_reference(x, 16, pos)
    np.testing.assert_allclose(means[first[s]:first[s] + q[s]], ref_means, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dec, ref_dec, rtol=1e-5, atol=1e-6)
  # Different leaves draw different positions.
  assert not np.array_equal(positions[2] - segs.offsets[2], positions[4] - segs.offsets[4])


def test_inceptionn_streams_and_rotations_per_leaf_of_a_bucket():
  xs = [x * 1e-3 for x in _leaves()]  # mostly 1- and 2-byte values
  xs[4][:5] = [np.inf, -np.nan, 70.0, -1e9, 0.0]
  codec = InceptionnCodec(lsb_exponent(2.0 ** -10), 1.0)
  (tag_words, stream), decs = _bucket_round_trip(codec, xs)
  segs = _segments(tuple(len(x) for x in xs), 128)
  shifts = np.asarray(codec.shift(KEY, segs))
  caps = [codec.stream_bytes(len(x)) for x in xs]
  assert stream.shape == (sum(caps),) and tag_words.shape == (segs.length // 4,)
  tags = np.asarray(packing.unpack(jnp.asarray(tag_words), 2, segs.length))
  at = 0
  for s, (x, dec) in enumerate(zip(xs, decs)):
    ref_tags, ref_stream, ref_dec = _inceptionn_reference(x, codec.lsb, caps[s], int(shifts[s]))
    o = segs.offsets[s]
    np.testing.assert_array_equal(tags[o:o + len(x)], np.roll(ref_tags, int(shifts[s])), err_msg=str(s))
    assert not tags[o + len(x):o + padded(len(x), 128)].any()
    np.testing.assert_array_equal(stream[at:at + caps[s]], ref_stream, err_msg=str(s))
    np.testing.assert_array_equal(dec, ref_dec, err_msg=str(s))
    at += caps[s]
  assert len(set(shifts[1:].tolist())) > 1


@pytest.mark.parametrize("codec", [QSGDCodec(2), TernGradCodec(None), NaturalCodec(4)],
                         ids=["qsgd", "terngrad", "natural"])
def test_stochastic_codecs_are_unbiased_on_every_leaf_of_a_bucket(codec):
  """Unbiased per leaf, the leaves' scales 1e3 apart; variances from each leaf's own scale."""
  xs = [x for x in _leaves() if x.any()]
  sizes = tuple(len(x) for x in xs)
  segs = _segments(sizes, codec.block)
  trials = 3000
  draws = np.asarray(_trials_fn(codec, sizes, trials)(_bucket(segs, xs), KEY))
  for s, x in enumerate(xs):
    d = draws[:, segs.offsets[s]:segs.offsets[s] + sizes[s]]
    a = np.abs(x).astype(np.float64)
    if isinstance(codec, QSGDCodec):
      step = np.linalg.norm(x.astype(np.float64)) / codec.levels  # rounds between multiples of step
      var, bound = np.full_like(a, step * step / 4), np.full_like(a, step)
    elif isinstance(codec, TernGradCodec):
      m = a.max()
      var, bound = a * (m - a), np.full_like(a, m)
    else:
      top = np.exp2(np.floor(np.log2(a.max())) + 1)
      low = top * 2.0 ** (1 - codec.levels)
      # The top exponent is that of max|x| or one more (when the max rounds up),
      # so the lowest level is low or low / 2: take the larger bound of both.
      var = np.where(a >= low, a * a / 8, np.maximum(a * a / 8, a * (low - a)))
      bound = np.maximum(a, low)
    _assert_unbiased(d, x.astype(np.float64), var, bound)


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "signum", "onebit", "qsgd", "terngrad", "natural",
                                  "u8bit", "sketchml", "inceptionn"])
def test_factories_take_the_bucket_policy(name):
  params = {"a": jnp.zeros((300,)), "b": jnp.zeros((40, 24)), "c": jnp.zeros((10,))}
  dense = {"a": False, "b": True, "c": False}
  assert [len(b.leaves) for b in jaxcomp.METHODS[name]().method.buckets(params)] == [3]
  tx = jaxcomp.METHODS[name](bucket_bytes=2048, min_size=64, dense=dense)
  assert (tx.method.bucket_bytes, tx.method.min_size, tx.method.dense) == (2048, 64, dense)
  # "c" small and "b" dense travel dense, in two buckets ("b" alone fills more than one); "a" compressed.
  buckets = tx.method.buckets(params)
  assert sorted(b.leaves for b in buckets) == [(0,), (1,), (2,)]
  assert [b.exchange is jaxcomp.core.protocol.DENSE for b in buckets] == [True, True, False]
  out, _ = jax.jit(tx.update)(params, tx.init(params))
  assert jax.tree.map(jnp.shape, out) == jax.tree.map(jnp.shape, params)


# ----------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize("factory,kwargs,error,match", [
    (jaxcomp.terngrad, {"clip_sigma": 0.0}, ValueError, "clip_sigma"),
    (jaxcomp.terngrad, {"clip_sigma": -2.5}, ValueError, "clip_sigma"),
    (jaxcomp.terngrad, {"clip_sigma": "2.5"}, TypeError, "clip_sigma"),
    (jaxcomp.terngrad, {"error_feedback": "yes"}, TypeError, "error_feedback"),
    (jaxcomp.natural, {"bits": 3}, ValueError, r"bits must be one of \(2, 4, 8\)"),
    (jaxcomp.natural, {"bits": True}, ValueError, "bits"),
    (jaxcomp.natural, {"seed": "0"}, TypeError, "seed"),
    (jaxcomp.u8bit, {"error_feedback": 1}, TypeError, "error_feedback"),
    (jaxcomp.sketchml, {"buckets": 1}, ValueError, r"buckets must be in \[2, 256\]"),
    (jaxcomp.sketchml, {"buckets": 257}, ValueError, "buckets"),
    (jaxcomp.sketchml, {"buckets": 8.0}, TypeError, "buckets"),
    (jaxcomp.sketchml, {"sample_size": 10}, ValueError, "sample_size must be >= 64"),
    (jaxcomp.inceptionn, {"error_bound": 0.0}, ValueError, "error_bound"),
    (jaxcomp.inceptionn, {"error_bound": float("nan")}, ValueError, "error_bound"),
    (jaxcomp.inceptionn, {"error_bound": 1e6}, ValueError, "error_bound"),
    (jaxcomp.inceptionn, {"error_bound": 1e-40}, ValueError, "error_bound"),
    (jaxcomp.inceptionn, {"error_bound": "tiny"}, TypeError, "error_bound"),
    (jaxcomp.inceptionn, {"capacity": 0}, ValueError, "capacity"),
    (jaxcomp.inceptionn, {"capacity": 4.5}, ValueError, r"capacity must be in \(0, 4\]"),
    (jaxcomp.inceptionn, {"capacity": None}, TypeError, "capacity"),
])
def test_bad_arguments(factory, kwargs, error, match):
  with pytest.raises(error, match=match):
    factory(**kwargs)
