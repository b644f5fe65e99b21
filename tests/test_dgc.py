"""jaxcomp.transforms.dgc: Deep Gradient Compression (momentum correction, masking, warm-up, clipping).

DGC is checked against a numpy version of its algorithm over a few steps on
8 workers, its memory against its definition, its payload against its
capacity and its warm-up stages; the nominal bytes of GRACE's sparsifiers
and sign methods.
"""

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import check_against, memory_trees, run_steps, small_params, step_grads

import jaxcomp
from jaxcomp.transforms import dgc as dgc_mod

N, AXIS = harness.N, harness.AXIS


@functools.cache
def pmapped(name):
  """The transforms of the numpy comparisons, shared with the pmap == shard_map test (one compile)."""
  return {
      "dgc": lambda: jaxcomp.dgc(ratio=0.05, momentum=0.9, warmup_steps=0, clip_norm=None, axis_name=AXIS),
  }[name]()


# ----------------------------------------------------------------------------
# numpy references


def np_dgc(ratio, beta):
  def ref(g, mem):
    u, v = (np.zeros_like(g), np.zeros_like(g)) if mem is None else mem
    u = beta * u + g
    v = v + u
    flat = v.reshape(N, -1)
    k = int(np.ceil(ratio * flat.shape[1] - 1e-9))
    top = np.argsort(-np.abs(flat), axis=1)[:, :k]
    mask = np.zeros(flat.shape, bool)
    np.put_along_axis(mask, top, True, axis=1)
    mask = mask.reshape(v.shape)
    sent = np.where(mask, v, 0.0)
    return sent.mean(0), (np.where(mask, 0.0, u), np.where(mask, 0.0, v))
  return ref


# ----------------------------------------------------------------------------
# against numpy, 8 workers, 3 steps


def test_dgc_momentum_correction_and_masking_match_numpy():
  # Leaves of <= 128 entries are their own sample: the selection is the exact top-k.
  trace = run_steps(pmapped("dgc"), small_params())
  check_against(trace, np_dgc(0.05, 0.9))


# ----------------------------------------------------------------------------
# conservation, capacity, warm-up, clipping, defaults


def _local_steps(tx, steps=2):
  """Local round trips on ``harness.params_tree()`` (one bucket); memories read as trees."""
  params = harness.params_tree()
  state = tx.init(params)
  for t in range(steps):
    g = jax.tree.map(lambda a: a[0], harness.worker_grads(params, seed=t))
    before = jaxcomp.memory_tree(tx, state, params)
    out, state = harness.local_round_trip(tx, g, state)
    yield g, before, out, state._replace(memory=jaxcomp.memory_tree(tx, state, params))


def test_dgc_conservation_and_capacity():
  ratio, beta = 0.01, 0.9
  tx = jaxcomp.dgc(ratio=ratio, momentum=beta, warmup_steps=0, clip_norm=None)
  for g, before, out, state in _local_steps(tx, steps=3):
    for gi, o, u, v, uo, vo in zip(*map(jax.tree.leaves, (
        g, out, state.memory.momentum, state.memory.accumulation, before.momentum, before.accumulation))):
      gi, o, u, v, uo, vo = map(np.asarray, (gi, o, u, v, uo, vo))
      u_t = beta * uo + np.asarray(gi)
      v_t = vo + u_t
      sent = o != 0
      np.testing.assert_allclose(o + v, v_t, rtol=1e-6, atol=1e-7)  # v keeps what was not sent
      np.testing.assert_allclose(u, np.where(sent, 0.0, u_t), rtol=1e-5, atol=1e-6)
      assert not np.any(v[sent]) and not np.any(u[sent])
      assert 1 <= np.count_nonzero(o) <= dgc_mod.capacity(o.size, ratio)


def test_dgc_warmup_schedule():
  sched = jaxcomp.dgc_warmup_schedule(0.001, 400)
  got = [float(sched(s)) for s in (0, 99, 100, 199, 200, 300, 399, 400, 10**6)]
  want = [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  sparsity = [1 - float(sched(s)) for s in (0, 100, 200, 300, 400)]
  np.testing.assert_allclose(sparsity, [0.75, 0.9375, 0.984375, 0.99609375, 0.999], rtol=1e-6)
  assert float(jaxcomp.dgc_warmup_schedule(0.1, 40)(30)) == pytest.approx(0.1)  # never below ratio


def test_dgc_schedule_sizes_payload_and_is_followed():
  params = harness.params_tree()
  warm = jaxcomp.dgc(ratio=0.001, warmup_steps=4, axis_name=AXIS)
  plain = jaxcomp.dgc(ratio=0.001, warmup_steps=0, axis_name=AXIS)
  n_big = 40 * 24
  assert dgc_mod.capacity(n_big, 0.25) == int(np.ceil(1.3 * 0.25 * n_big))
  # The warm-up's stages each have their own payload: the densest first, then the target's.
  assert jaxcomp.wire_bytes(warm, params, step=0) > jaxcomp.wire_bytes(warm, params, step=3) \
      > jaxcomp.wire_bytes(warm, params) == jaxcomp.wire_bytes(plain, params)
  sched = optax.linear_schedule(0.2, 0.01, 3)
  tx = jaxcomp.dgc(ratio=sched, max_ratio=0.2)
  state = tx.init(params)
  counts = []
  for t in range(4):
    g = jax.tree.map(lambda a: a[0], harness.worker_grads(params, seed=t))
    out, state = harness.local_round_trip(tx, g, state)
    o = np.asarray(out["dense"]["kernel"])
    counts.append(np.count_nonzero(o))
    k = np.ceil(float(sched(t)) * o.size)
    assert 0.5 * k <= counts[-1] <= min(2 * k, dgc_mod.capacity(o.size, 0.2))
  assert counts[0] > 5 * counts[-1]


def test_dgc_local_clipping():
  params = small_params()
  clip = 0.5
  tx = jaxcomp.dgc(ratio=0.01, clip_norm=clip, warmup_steps=0, axis_name=AXIS)
  g = step_grads(params, 0)
  _, state = harness.run_pmap(tx, g, harness.init_stacked(tx, params))
  norm = np.sqrt(sum(np.sum(np.square(a.reshape(N, -1)), axis=1) for a in jax.tree.leaves(g)))
  scale = np.minimum(1.0, clip / np.sqrt(N) / norm)
  momentum = memory_trees(tx, state, params).memory.momentum
  for k in g:
    u = np.asarray(momentum[k])
    want = g[k] * scale.reshape((N,) + (1,) * (g[k].ndim - 1))
    np.testing.assert_allclose(u, np.where(u == 0, 0.0, want), rtol=1e-5, atol=1e-7)
    assert np.count_nonzero(u) >= u.size - N * int(np.ceil(0.01 * u[0].size)) * 2


def test_dgc_dense_leaves_keep_their_momentum():
  """Issue 13.1: a leaf below min_size travels dense, all of it sent: plain momentum, no masking.

  With a constant gradient of 1 the dense bias comes out as 1, 1.9, 2.71 (u <- 0.9 u + 1), not 1
  every step (momentum zeroed by factor masking); the compressed kernel still masks.
  """
  params = {"w": jnp.zeros((40, 24), jnp.float32), "b": jnp.zeros((24,), jnp.float32)}
  tx = jaxcomp.dgc(ratio=0.01, momentum=0.9, warmup_steps=0, clip_norm=None, min_size=100)
  assert sorted(b.exchange is jaxcomp.core.protocol.DENSE for b in tx.method.buckets(params)) == [False, True]
  state = tx.init(params)
  got = []
  for t in range(3):
    g = {"w": jax.random.normal(jax.random.PRNGKey(t), (40, 24)), "b": jnp.ones((24,), jnp.float32)}
    out, state = harness.local_round_trip(tx, g, state)
    got.append(np.asarray(out["b"]))
    mem = jaxcomp.memory_tree(tx, state, params)
    np.testing.assert_array_equal(np.asarray(mem.accumulation["b"]), 0.0)  # everything was sent
    sent = np.asarray(out["w"]) != 0
    assert sent.any() and not np.any(np.asarray(mem.momentum["w"])[sent])  # masked where sent
  np.testing.assert_allclose(np.stack(got), np.broadcast_to(np.array([1.0, 1.9, 2.71])[:, None], (3, 24)),
                             rtol=1e-6)


def test_dgc_defaults_are_the_papers_method():
  """Issue 13.5: the sparsity warm-up is on by default (in steps). Local clipping is off by default
  (issue 22: an absolute norm is not scale-free; the paper clips at the model's own threshold)."""
  tx = jaxcomp.dgc()
  assert tx.method.memory.clip_norm is dgc_mod.CLIP_NORM is None
  assert tx.method.memory.momentum == 0.9
  params = {"w": jnp.zeros((1000,), jnp.float32)}
  steps = dgc_mod.WARMUP_STEPS
  # The warm-up is a schedule of stages, each with the payload of its own density.
  got = []
  for t in (0, steps // 4, steps - 1, steps):
    (bucket,) = tx.method.buckets(params, tx.method.stage_at(t))
    got.append(bucket.exchange.max_ratio)
    assert float(bucket.exchange.ratio(jnp.int32(t))) == pytest.approx(bucket.exchange.max_ratio)
  np.testing.assert_allclose(got, [0.25, 0.0625, 0.00390625, 0.001], rtol=1e-6)
  assert [f for f, _ in tx.method.stages] == [steps // 4, steps // 2, 3 * steps // 4, steps]
  # With a schedule the warm-up is off by default (build it into the schedule).
  sched = jaxcomp.dgc(ratio=optax.constant_schedule(0.01), max_ratio=0.01)
  (bucket,) = sched.method.buckets(params)
  assert bucket.exchange.max_ratio == 0.01


# ----------------------------------------------------------------------------
# pmap == shard_map, wire bytes == nominal


METHODS = ["dgc"]


@pytest.mark.parametrize("name", METHODS)
def test_pmap_equals_shard_map_and_wire_bytes(name):
  params = small_params()  # test_properties covers harness.params_tree()
  tx = pmapped(name)  # the defaults are covered by test_properties
  harness.check_pmap_equals_shard_map(tx, params)


@pytest.mark.usefixtures("every_leaf")  # its trees are small on purpose: compress every leaf
def test_nominal_bytes_per_method():
  params = {"big": jnp.zeros((1000,), jnp.float32)}  # uint16 indices
  n = 1000
  want = {
      "threshold": 100 * (4 + 2) + 4,
      "dgc": dgc_mod.capacity(n, 0.001) * 6 + 4,  # after the default warm-up (its stages: step=)
      "adaq": 8 + 256,  # two means + 2 bits per entry, the leaf padded to 1024 entries (rows of 128)
      "signum": 128 + 4,  # 1 bit per entry (the leaf padded to 1024 entries), the non-finite flag
      "onebit": 8 + 128,  # the 1000 entries padded to 1024 (segments of 128-entry rows)
  }
  for name, nbytes in want.items():
    assert jaxcomp.wire_bytes(jaxcomp.METHODS[name](), params) == nbytes, name
  assert jaxcomp.wire_bytes(jaxcomp.dgc(), params, step=0) == dgc_mod.capacity(n, 0.25) * 6 + 4


# ----------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize("call, exc, match", [
    (lambda: jaxcomp.dgc(ratio=0.0), ValueError, "ratio must be in"),
    (lambda: jaxcomp.dgc(momentum=1.0), ValueError, "momentum must be in"),
    (lambda: jaxcomp.dgc(sample_ratio=2.0), ValueError, "sample_ratio must be in"),
    (lambda: jaxcomp.dgc(warmup_steps=-1), ValueError, "warmup_steps must be"),
    (lambda: jaxcomp.dgc(clip_norm=0.0), ValueError, "clip_norm must be"),
    (lambda: jaxcomp.dgc(ratio=optax.constant_schedule(0.01)), ValueError, "max_ratio is required"),
    (lambda: jaxcomp.dgc(ratio=optax.constant_schedule(0.01), max_ratio=1.5), ValueError,
     "max_ratio must be"),
    (lambda: jaxcomp.dgc(ratio=optax.constant_schedule(0.01), max_ratio=0.1, warmup_steps=5), ValueError,
     "warmup_steps applies"),
    (lambda: jaxcomp.dgc(ratio=0.01, max_ratio=0.1), ValueError, "max_ratio is only used"),
    (lambda: jaxcomp.dgc_warmup_schedule(0.001, 0), ValueError, "warmup_steps must be"),
])
def test_bad_arguments(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
