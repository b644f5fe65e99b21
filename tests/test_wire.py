"""Wire format: bit packing, compact top-k positions, and bytes on the wire for every method.

The byte test covers all of ``jaxcomp.METHODS`` at once (measured HLO bytes of
the pmap step == ``jaxcomp.wire_bytes``), then checks the nominal bytes
against the formulas each method promises.
"""

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
  worker_grads,
)
from hypothesis import given
from hypothesis import strategies as st

import jaxcomp
from jaxcomp.collectives import packing
from jaxcomp.core import method as method_module
from jaxcomp.transforms import sparse

# ----------------------------------------------------------------------------- packing


SIZES = [1, 3, 7, 8, 9, 63, 64, 65, 255]  # few distinct shapes: each one compiles the eager ops


@given(bits=st.sampled_from([1, 2, 4, 8]), n=st.sampled_from(SIZES), batch=st.integers(0, 2),
       seed=st.integers(0, 2**31 - 1))
def test_pack_round_trip(bits, n, batch, seed):
  rng = np.random.default_rng(seed)
  shape = (batch, n) if batch else (n,)
  fields = rng.integers(0, 2**bits, size=shape, dtype=np.uint8)
  words = packing.pack(fields, bits)
  assert words.dtype == jnp.uint8
  assert words.shape[-1] == packing.packed_size(n, bits) == -(-n * bits // 8)
  np.testing.assert_array_equal(np.asarray(packing.unpack(words, bits, n)), fields)


@given(n=st.sampled_from(SIZES), seed=st.integers(0, 2**31 - 1))
def test_pack_signs_round_trip(n, seed):
  x = np.random.default_rng(seed).normal(size=n).astype(np.float32)
  x[::7] = 0.0  # zero counts as non-negative
  words = packing.pack_signs(x)
  assert words.shape == (-(-n // 8),)
  np.testing.assert_array_equal(np.asarray(packing.unpack_signs(words, n)), np.where(x >= 0, 1.0, -1.0))


@given(bits=st.sampled_from([1, 2, 4, 8]), n=st.sampled_from(SIZES), bad=st.sampled_from([None, "nan", "inf",
                                                                                         "-inf"]),
       seed=st.integers(0, 2**31 - 1))
def test_pack_checked_packs_as_pack_and_flags_any_nonfinite_entry(bits, n, bad, seed):
  """The flag of pack_checked is NaN exactly when x holds a NaN/Inf, also among equal values."""
  rng = np.random.default_rng(seed)
  fields = rng.integers(0, 2**bits, size=n, dtype=np.uint8)
  x = np.ones(n, np.float32)
  if bad is not None:
    x[rng.integers(n)] = float(bad)
  flag, words = jax.jit(packing.pack_checked, static_argnums=1)(fields, bits, x)
  np.testing.assert_array_equal(np.asarray(words), np.asarray(packing.pack(fields, bits)))
  assert flag.dtype == jnp.float32 and flag.shape == ()
  assert (float(flag) == 0.0) if bad is None else np.isnan(float(flag))


def test_pack_layout_is_lsb_first():
  np.testing.assert_array_equal(np.asarray(packing.pack(np.array([1, 0, 0, 0, 0, 0, 0, 1]), 1)), [0x81])
  np.testing.assert_array_equal(np.asarray(packing.pack(np.array([3, 0, 1, 2]), 2)), [0b10010011])
  np.testing.assert_array_equal(np.asarray(packing.pack(np.array([0xA, 0x5]), 4)), [0x5A])


@pytest.mark.parametrize("bits", [0, 3, 16, "4"])
def test_pack_rejects_other_widths(bits):
  with pytest.raises(ValueError, match="bits must be one of"):
    packing.pack(np.zeros(4, np.uint8), bits)


def test_unpack_rejects_non_uint8_words():
  with pytest.raises(TypeError, match="words must be uint8"):
    packing.unpack(np.zeros(4, np.int32), 2, 16)


# ----------------------------------------------------------------------------- bytes of every method


@pytest.mark.usefixtures("every_leaf")  # its trees are small on purpose: compress every leaf
@pytest.mark.slow
def test_every_method_sends_its_nominal_bytes():
  """All of METHODS at defaults: measured HLO bytes of the pmap step == wire_bytes."""
  params = params_tree()
  dense = jaxcomp.wire_bytes(jaxcomp.none(axis_name=AXIS), params)
  wrong = {}
  for name, factory in sorted(jaxcomp.METHODS.items()):
    tx = factory(axis_name=AXIS)
    measured = pmap_wire_bytes(jaxcomp.steady(tx), params)["total"]  # after any warm-up
    nominal = jaxcomp.wire_bytes(tx, params)
    # XLA:CPU promotes a bf16 all-reduce to f32 (GPU and TPU reduce bf16 natively),
    # so on CPU the bf16 program moves exactly twice the nominal bytes.
    expect = 2 * nominal if name == "bf16" and jax.default_backend() == "cpu" else nominal
    if measured != expect or (name != "none" and nominal >= dense):
      wrong[name] = {"measured": measured, "nominal": nominal, "dense": dense}
  assert not wrong, wrong


# ----------------------------------------------------------------------------- formulas

LEAF = 2**17  # > 65536: exercises the chunk16 positions of top-k
# Methods whose payloads lose NaN/Inf all-reduce a non-finite flag each step (jaxcomp.build).
FLAG = method_module.NONFINITE_FLAG_BYTES


def _nominal(factory, shape=(LEAF,), **kw):
  """Payload bytes of one leaf, without the non-finite flag."""
  tx = factory(axis_name=AXIS, **kw)
  nbytes = jaxcomp.wire_bytes(tx, {"w": jnp.zeros(shape, jnp.float32)})
  flag = FLAG if any(not b.exchange.carries_nonfinite for b in
                     tx.method.buckets([jnp.zeros(shape)])) else 0
  return nbytes - flag


def test_dense_and_half_precision_bytes():
  assert _nominal(jaxcomp.none) == 4 * LEAF
  assert _nominal(jaxcomp.fp16) == 2 * LEAF + 4  # + the leaf's int32 scale exponent (its own all-reduce)
  assert _nominal(jaxcomp.bf16) == 2 * LEAF


def test_signsgd_sends_one_bit_per_value():
  # + the bucket's non-finite flag, a float32 in the payload (no all-reduce of its own)
  assert _nominal(jaxcomp.signsgd) == LEAF // 8 + 4


def test_topk_bytes_at_one_percent():
  k = int(np.ceil(0.01 * LEAF))
  chunks = LEAF // 65536
  # values float32 + uint16 offsets + one int32 start per chunk of 65536
  assert _nominal(jaxcomp.topk, ratio=0.01) == k * (4 + 2) + 4 * chunks
  assert _nominal(jaxcomp.topk, ratio=0.01, positions="global") == k * (4 + 4)
  assert _nominal(jaxcomp.topk, ratio=0.01, values="bfloat16") == k * (2 + 2) + 4 * chunks
  assert _nominal(jaxcomp.topk, ratio=0.01, shape=(300,)) == 3 * (4 + 2)  # uint16 positions
  assert _nominal(jaxcomp.topk, ratio=0.01, shape=(200,)) == 2 * (4 + 1)  # uint8 positions
  b = sparse.default_block(0.01)
  kb = int(np.ceil(0.01 * b))
  assert (b, kb) == (1024, 11)
  assert _nominal(jaxcomp.topk, ratio=0.01, selection="chunked") == (LEAF // b) * kb * (4 + 2)
  assert _nominal(jaxcomp.topk, ratio=0.01, selection="chunked", block=256) == (LEAF // 256) * 3 * (4 + 1)


def test_powersgd_is_far_below_dense_for_matrices():
  shape, rank = (512, 256), 4
  assert _nominal(jaxcomp.powersgd, shape=shape, rank=rank) == (512 + 256) * rank * 4
  assert _nominal(jaxcomp.powersgd, shape=shape, rank=rank) * 40 < _nominal(jaxcomp.none, shape=shape)


def test_topk_options_send_their_nominal_bytes():
  params = {"big": jnp.zeros((LEAF,), jnp.float32), "small": jnp.zeros((40, 24), jnp.float32)}
  for kw in ({}, {"positions": "global"}, {"values": "float16"}, {"selection": "chunked"},
             {"selection": "chunked", "block": 200, "values": "bfloat16"}):
    tx = jaxcomp.topk(ratio=0.01, axis_name=AXIS, **kw)
    # Gathered payloads travel as one uint8 buffer: bf16 values are not promoted to f32 (XLA:CPU
    # promotes a bf16 all-gather).
    assert pmap_wire_bytes(tx, params)["total"] == jaxcomp.wire_bytes(tx, params), kw


# ----------------------------------------------------------------------------- compact positions


@given(n=st.sampled_from([1, 300, 65536, 65537, 200_000]), k=st.sampled_from([1, 7, 300]),
       seed=st.integers(0, 2**31 - 1))
def test_chunk16_round_trip(n, k, seed):
  k = min(k, n)
  pos = np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False)).astype(np.int32)
  offsets, starts = sparse.chunk16_encode(jnp.asarray(pos), n)
  assert offsets.dtype == jnp.uint16 and starts.dtype == jnp.int32
  assert starts.shape == (-(-n // 65536),)
  np.testing.assert_array_equal(np.asarray(sparse.chunk16_decode(offsets, starts)), pos)


def _local(tx, x):
  out, state = jax.jit(tx.update)({"w": x}, tx.init({"w": x}))
  return np.asarray(out["w"]), np.asarray(jaxcomp.memory_tree(tx, state, {"w": x})["w"])


def test_topk_position_codes_send_the_same_entries():
  x = jax.random.normal(jax.random.PRNGKey(0), (LEAF + 1000,))
  a, ra = _local(jaxcomp.topk(ratio=0.01), x)
  b, rb = _local(jaxcomp.topk(ratio=0.01, positions="global"), x)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(ra, rb)
  k = int(np.ceil(0.01 * x.size))
  np.testing.assert_array_equal(np.flatnonzero(a), np.sort(np.argsort(-np.abs(np.asarray(x)))[:k]))


@pytest.mark.parametrize("n, block", [(5000, 256), (4096, 1024), (100, 256)])
def test_chunked_topk_keeps_the_largest_of_each_block(n, block):
  ratio = 0.03
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(n), (n,)))
  out, resid = _local(jaxcomp.topk(ratio=ratio, selection="chunked", block=block), jnp.asarray(x))
  b = min(block, -(-n // 128) * 128)  # blocks cover the bucket: the leaf padded to rows of 128
  kb = int(np.ceil(ratio * b - 1e-9))
  expect = np.zeros_like(x)
  for start in range(0, n, b):
    blk = x[start:start + b]
    keep = np.argsort(-np.abs(blk))[:kb]
    expect[start + keep] = blk[keep]
  np.testing.assert_array_equal(out, expect)
  np.testing.assert_array_equal(out + resid, x)


def test_half_precision_values_keep_the_rounding_in_the_residual():
  x = jax.random.normal(jax.random.PRNGKey(3), (3000,))
  for values in ("float16", "bfloat16"):
    out, resid = _local(jaxcomp.topk(ratio=0.05, values=values), x)
    sent = np.flatnonzero(out)
    assert sent.size == 150
    np.testing.assert_array_equal(out[sent], np.asarray(x)[sent].astype(values).astype(np.float32))
    np.testing.assert_allclose(out + resid, np.asarray(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"selection": "chunked", "block": 100}, {"values": "bfloat16"}])
def test_topk_options_under_pmap_are_the_mean_of_the_workers_selections(kw):
  params = {"big": jnp.zeros((70_000,), jnp.float32), "small": jnp.zeros((40, 24), jnp.float32)}
  tx = jaxcomp.topk(ratio=0.02, axis_name=AXIS, **kw)
  local = jaxcomp.topk(ratio=0.02, **kw)
  grads = worker_grads(params)
  out, _ = run_pmap(tx, grads, init_stacked(tx, params))
  assert_replicas_equal(out)
  sent = [jax.jit(local.update)(jax.tree.map(lambda g, w=w: g[w], grads), local.init(params))[0]
          for w in range(N)]
  expect = jax.tree.map(lambda *s: np.mean(np.stack(s), axis=0), *sent)
  assert_trees_close(jax.tree.map(lambda o: o[0], out), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw, match", [
    ({"selection": "sorted"}, "selection must be one of"),
    ({"positions": "int16"}, "positions must be one of"),
    ({"values": "int8"}, "values must be one of"),
    ({"selection": "chunked", "block": 0}, "block must be"),
    ({"selection": "chunked", "block": 70_000}, "block must be"),
    ({"block": 256}, "block applies to selection='chunked'"),
])
def test_topk_bad_options_are_named(kw, match):
  with pytest.raises((ValueError, TypeError), match=match):
    jaxcomp.topk(**kw)


def test_payload_bytes_are_traced_once_per_codec_and_layout(monkeypatch):
  """The accounting asks for the same buckets many times (advise, auto_plan): each is traced once."""
  from jaxcomp.core import layout
  from jaxcomp.transforms.dense import CastCodec
  from jaxcomp.transforms.quantize import QSGDCodec

  traced = []
  real = layout._traced_payload_bytes
  monkeypatch.setattr(layout, "_traced_payload_bytes", lambda c, s: traced.append(c) or real(c, s))
  layout._cached_payload_bytes.cache_clear()
  segs = layout.Segments((0, 128), (100, 60), ((100,), (60,)), 128)
  codec = QSGDCodec(levels=7)
  first = layout.payload_bytes(codec, segs)
  assert layout.payload_bytes(QSGDCodec(levels=7), segs) == first and len(traced) == 1
  layout.payload_bytes(QSGDCodec(levels=127), segs)
  assert len(traced) == 2  # another codec: traced
  assert layout.payload_bytes(CastCodec("float16"), segs) == 2 * segs.length

  class Unhashable(CastCodec):
    __hash__ = None

  assert layout.payload_bytes(Unhashable("bfloat16"), segs) == 2 * segs.length
  assert layout.payload_bytes(Unhashable("bfloat16"), segs) == 2 * segs.length
  assert sum(isinstance(c, Unhashable) for c in traced) == 2  # no cache: traced each time
