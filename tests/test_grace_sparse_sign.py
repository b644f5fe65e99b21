"""GRACE's sparsifiers and sign methods: threshold, dgc, adaq, signum, onebit.

Each deterministic method is checked against a numpy version of its algorithm
over a few steps on 8 workers; the fixed-capacity payloads against their
overflow and empty cases; DGC's memory against its definition.
"""

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.layout import Segments
from jaxcomp.transforms import dgc as dgc_mod
from jaxcomp.transforms import threshold as thr_mod

N, AXIS = harness.N, harness.AXIS
STEPS = 3


@functools.cache
def pmapped(name):
  """The transforms of the numpy comparisons, shared with the pmap == shard_map test (one compile)."""
  return {
      "threshold": lambda: jaxcomp.threshold(v=0.5, capacity=1.0, axis_name=AXIS),
      "onebit": lambda: jaxcomp.onebit(axis_name=AXIS),
      "signum": lambda: jaxcomp.signum(momentum=0.9, axis_name=AXIS),
      "dgc": lambda: jaxcomp.dgc(ratio=0.05, momentum=0.9, warmup_steps=0, clip_norm=None, axis_name=AXIS),
      "adaq": lambda: jaxcomp.adaq(ratio=0.3, encoding="map", axis_name=AXIS),
      "adaq_indices": lambda: jaxcomp.adaq(ratio=0.3, encoding="indices", axis_name=AXIS),
  }[name]()


def small_params():
  """Leaves of at most 128 entries: each is its own threshold sample (exact selection)."""
  return {"w": jnp.zeros((10, 10), jnp.float32), "b": jnp.zeros((24,), jnp.float32)}


def step_grads(params, step):
  return jax.tree.map(np.asarray, harness.worker_grads(params, seed=100 + step))


def memory_trees(tx, state, params):
  """``state`` (stacked over workers) with its memory read as trees like ``params`` (see memory_tree)."""
  if not jax.tree.leaves(state.memory):
    return state
  read = jax.vmap(lambda m: jaxcomp.memory_tree(tx, state._replace(memory=m), params))
  return state._replace(memory=read(state.memory))


def run_steps(tx, params, steps=STEPS):
  """Runs ``tx`` under pmap; returns [(grads, out, state)] per step (numpy, memory as trees)."""
  state = harness.init_stacked(tx, params)
  trace = []
  for t in range(steps):
    g = step_grads(params, t)
    out, state = harness.run_pmap(tx, g, state)
    harness.assert_replicas_equal(out)
    state_np = jax.tree.map(np.asarray, memory_trees(tx, state, params))
    trace.append((g, jax.tree.map(np.asarray, out), state_np))
  return trace


def check_against(trace, reference):
  """``reference(g, mem) -> (mean, mem)`` applied leaf by leaf, compared with the trace.

  ``mem`` is the leaf's memory: an array, or a tuple of arrays for DGC (u, v).
  """
  names = list(trace[0][0])
  mem = {k: None for k in names}
  for g, out, state in trace:
    for k in names:
      mean, mem[k] = reference(g[k].astype(np.float32), mem[k])
      np.testing.assert_allclose(out[k][0], mean, rtol=1e-5, atol=1e-6, err_msg=k)
      got = state.memory
      got = tuple(m[k] for m in got) if isinstance(got, tuple) else (got[k],)
      want = mem[k] if isinstance(mem[k], tuple) else (mem[k],)
      for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=k)


# ----------------------------------------------------------------------------
# numpy references


def np_threshold(v):
  def ref(g, e):
    x = g + (0 if e is None else e)
    sent = np.where(np.abs(x) > v, x, 0.0)
    return sent.mean(0), x - sent
  return ref


def np_onebit(g, e):
  x = g + (0 if e is None else e)
  flat = x.reshape(N, -1)
  neg = flat < 0
  mean_neg = np.where(neg, flat, 0).sum(1) / np.maximum(neg.sum(1), 1)
  mean_pos = np.where(neg, 0, flat).sum(1) / np.maximum((~neg).sum(1), 1)
  dec = np.where(neg, mean_neg[:, None], mean_pos[:, None]).reshape(x.shape)
  return dec.mean(0), x - dec


def np_signum(beta):
  def ref(g, m):
    m = (1 - beta) * g + (0 if m is None else beta * m)
    return np.sign(np.where(m >= 0, 1, -1).sum(0)).astype(np.float32), m
  return ref


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


def np_adaq(ratio):
  def side(a):
    k = int(np.ceil(ratio * np.sum(a > 0) - 1e-3))
    if k == 0:
      return np.zeros(a.shape, bool)
    return (a >= np.sort(a)[::-1][k - 1]) & (a > 0)

  def ref(g, e):
    x = g + (0 if e is None else e)
    dec = np.zeros_like(x)
    for w in range(N):
      flat = x[w].ravel()
      plus, minus = side(np.where(flat > 0, flat, 0)), side(np.where(flat < 0, -flat, 0))
      d = np.zeros_like(flat)
      d[plus] = flat[plus].mean() if plus.any() else 0
      d[minus] = flat[minus].mean() if minus.any() else 0
      dec[w] = d.reshape(x.shape[1:])
    return dec.mean(0), x - dec
  return ref


# ----------------------------------------------------------------------------
# against numpy, 8 workers, 3 steps


def test_threshold_matches_numpy():
  check_against(run_steps(pmapped("threshold"), small_params()),
                np_threshold(0.5))


def test_onebit_matches_numpy():
  check_against(run_steps(pmapped("onebit"), small_params()), np_onebit)


def test_signum_matches_numpy():
  check_against(run_steps(pmapped("signum"), small_params()), np_signum(0.9))


def _tied_grads(params):
  """Half the workers +1, half -1 on even entries (a tied vote); all +1 or all -1 elsewhere."""
  def one(p):
    n = max(p.size, 1)
    sign = np.where(np.arange(N) < N // 2, 1.0, -1.0)[:, None]
    tied = np.arange(n)[None, :] % 2 == 0
    clear = np.where(np.arange(n) % 4 == 1, 1.0, -1.0)[None, :]
    g = np.where(tied, sign, clear) * (1.0 + np.arange(n)[None, :] % 3)
    return g.reshape((N,) + p.shape).astype(np.float32)
  return jax.tree.map(one, params)


@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_majority_vote_ties(name):
  """A tie gives 0 by default and +1 with ties="positive" (GRACE's sum >= 0 -> +1)."""
  params = small_params()
  g = _tied_grads(params)
  kwargs = {"momentum": 0.0} if name == "signum" else {}
  for ties in ("zero", "positive"):
    tx = jaxcomp.METHODS[name](axis_name=AXIS, ties=ties, **kwargs)
    out, _ = harness.run_pmap(tx, g, harness.init_stacked(tx, params))
    harness.assert_replicas_equal(out)
    for k in g:
      votes = np.where(g[k] >= 0, 1, -1).sum(0)
      want = np.sign(votes) if ties == "zero" else np.where(votes >= 0, 1.0, -1.0)
      assert (votes == 0).any() and (votes != 0).any()
      np.testing.assert_array_equal(out[k][0], want, err_msg=f"{k} {ties}")


def test_signsgd_error_feedback_stays_in_gradient_units():
  """The residual is x - mean|x| sign(x): a constant gradient 0.01 comes out as 0.01 every step."""
  params = small_params()
  tx = jaxcomp.signsgd(error_feedback=True)
  g = jax.tree.map(lambda p: jnp.full(p.shape, 0.01, jnp.float32), params)
  state = tx.init(params)
  for _ in range(4):
    out, state = harness.local_round_trip(tx, g, state)
    for k in g:
      np.testing.assert_allclose(out[k], 0.01, rtol=1e-6)
  # Conservation on random gradients: sent + new residual == old residual + gradient.
  state = tx.init(params)
  for t in range(3):
    grads = jax.tree.map(lambda a: a[0], step_grads(params, t))
    before = jaxcomp.memory_tree(tx, state, params)
    out, state = harness.local_round_trip(tx, grads, state)
    after = jaxcomp.memory_tree(tx, state, params)
    for k in grads:
      x = np.asarray(before[k]) + grads[k]
      np.testing.assert_allclose(np.asarray(out[k]) + np.asarray(after[k]), x, rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(np.asarray(out[k]), np.mean(np.abs(x)) * np.where(x >= 0, 1.0, -1.0),
                                 rtol=1e-6, atol=1e-7)
  # Over 8 workers: the vote times the workers' mean scale of each leaf, and one float32 scale per leaf.
  tx = jaxcomp.signsgd(error_feedback=True, axis_name=AXIS)
  grads = step_grads(params, 0)
  out, _ = harness.run_pmap(tx, grads, harness.init_stacked(tx, params))
  for k in grads:
    flat = grads[k].reshape(N, -1)
    scale = np.abs(flat).mean(1).mean()
    want = np.sign(np.where(flat >= 0, 1, -1).sum(0)) * scale
    np.testing.assert_allclose(out[k][0].reshape(-1), want, rtol=1e-5, atol=1e-7)
  # Each leaf padded to 128 entries (1 bit each), two float32 scales, the 4-byte non-finite flag.
  assert jaxcomp.wire_bytes(tx, params) == 2 * 128 // 8 + 2 * 4 + 4


def test_dgc_momentum_correction_and_masking_match_numpy():
  # Leaves of <= 128 entries are their own sample: the selection is the exact top-k.
  trace = run_steps(pmapped("dgc"), small_params())
  check_against(trace, np_dgc(0.05, 0.9))


@pytest.mark.parametrize("name", ["adaq", "adaq_indices"])
def test_adaq_matches_numpy(name):
  check_against(run_steps(pmapped(name), small_params()), np_adaq(0.3))


# ----------------------------------------------------------------------------
# fixed capacity: overflow, empty selection, counts


def _local_steps(tx, steps=2):
  """Local round trips on ``harness.params_tree()`` (one bucket); memories read as trees."""
  params = harness.params_tree()
  state = tx.init(params)
  for t in range(steps):
    g = jax.tree.map(lambda a: a[0], harness.worker_grads(params, seed=t))
    before = jaxcomp.memory_tree(tx, state, params)
    out, state = harness.local_round_trip(tx, g, state)
    yield g, before, out, state._replace(memory=jaxcomp.memory_tree(tx, state, params))


def _residual_steps(tx, steps=2):
  for g, e, out, state in _local_steps(tx, steps):
    yield jax.tree.map(lambda g, e: np.asarray(g) + np.asarray(e), g, e), out, state


def test_threshold_overflow_stays_in_residual():
  tx = jaxcomp.threshold(v=0.1, capacity=0.05)
  for x, out, state in _residual_steps(tx):
    for path, xi in jax.tree_util.tree_leaves_with_path(x):
      o = np.asarray(dict(jax.tree_util.tree_leaves_with_path(out))[path])
      e = np.asarray(dict(jax.tree_util.tree_leaves_with_path(state.memory))[path])
      np.testing.assert_array_equal(o + e, xi)  # nothing lost, exactly
      cap = max(1, int(np.ceil(0.05 * xi.size)))
      assert np.count_nonzero(o) == min(cap, np.count_nonzero(np.abs(xi) > 0.1))
      np.testing.assert_array_equal(o[o != 0], xi[o != 0])


def test_threshold_empty_selection():
  params = small_params()
  tx = jaxcomp.threshold(v=1e6, axis_name=AXIS)
  g = harness.worker_grads(params)
  out, state = harness.run_pmap(tx, g, harness.init_stacked(tx, params))
  for o in jax.tree.leaves(out):
    np.testing.assert_array_equal(o, 0.0)
  harness.assert_trees_close(memory_trees(tx, state, params).memory, g, rtol=0, atol=0)


def test_threshold_payload_count_within_capacity():
  codec = thr_mod.ThresholdCodec(0.0, 0.25)
  # Two leaves in one bucket (1000 and 300 entries, each padded to rows of 128): 250 + 75 slots.
  segs = Segments((0, 1024), (1000, 300), ((1000,), (300,)), codec.block)
  x = np.zeros(segs.length, np.float32)
  x[:1000] = np.random.default_rng(0).normal(size=1000)
  x[1024:1324] = np.random.default_rng(1).normal(size=300)
  values, idx, count = codec.encode(jnp.asarray(x), jax.random.PRNGKey(3), segs)
  assert values.shape == (325,) and idx.dtype == jnp.uint16 and int(count) == 325
  idx = np.asarray(idx)
  assert len(np.unique(idx)) == 325
  assert np.sum(idx < 1000) == 250 and np.sum((idx >= 1024) & (idx < 1324)) == 75  # per leaf, no padding
  np.testing.assert_array_equal(np.asarray(values), x[idx])


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


def np_refine(a, t, k, low=0.7, high=1.3, up=1.3, down=0.7, iterations=10):
  count = lambda t: np.sum((a >= t) & (a > 0))
  m = count(t)
  best = t
  for _ in range(iterations):
    if low * k <= m <= high * k:
      return t
    t = np.float32(t * (up if m > high * k else down))
    m = count(t)
    best = t if abs(m - k) < abs(count(best) - k) else best
  return t if low * k <= m <= high * k else best


def test_refine_threshold_matches_numpy():
  # |a| uniform on [0, 1): k = 200 of 4000 pass above 0.95. x1.3 from 0.73 and x0.7 from
  # 1.36 land in 0.7-1.3 k; 0.95 is already there; 0.5 cycles (x1.3 x0.7 = 0.91) for
  # 10 steps and the closest count seen wins.
  a = np.abs(np.random.default_rng(1).uniform(-1, 1, 4000)).astype(np.float32)
  refine = jax.jit(lambda t: thr_mod.refine_threshold(jnp.asarray(a), t, 200, 0.7, 1.3, 1.3, 0.7, 10))
  for start in (0.73, 1.36, 0.95, 0.5, 1e-3):
    got, want = float(refine(jnp.float32(start))), np_refine(a, np.float32(start), 200)
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=str(start))
  assert not 140 <= np.sum(a >= np_refine(a, np.float32(0.5), 200)) <= 260


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
  assert sorted(b.exchange is jaxcomp.core.DENSE for b in tx.method.buckets(params)) == [False, True]
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


def test_adaq_encoding_choice():
  codec = thr_mod.AdaQCodec(0.3, 0.01, 0.39, "auto")
  assert codec.uses_map(1000) and codec.uses_map(10**6)
  sparse = thr_mod.AdaQCodec(0.01, 0.01, 0.013, "auto")
  assert not sparse.uses_map(10**6)  # 0.013 * 32 bits < 2 bits per entry
  # A bucket decides for all its leaves: 2 bits per bucket entry against its slots' positions.
  segs = Segments((0, 1024), (1000, 1000), ((1000,), (1000,)), codec.block)
  assert codec.uses_map(segs) and not sparse.uses_map(segs)  # 512 bytes vs 26 uint16 positions


def test_adaq_indices_overflow_conserves():
  tx = jaxcomp.adaq(ratio=0.3, encoding="indices", capacity=0.1)
  for x, out, state in _residual_steps(tx):
    for xi, o, e in zip(*map(jax.tree.leaves, (x, out, state.memory))):
      np.testing.assert_allclose(np.asarray(o) + np.asarray(e), xi, rtol=1e-6, atol=1e-6)
      assert np.count_nonzero(o) <= max(1, int(np.ceil(0.1 * xi.size)))


# ----------------------------------------------------------------------------
# pmap == shard_map, wire bytes == nominal, defaults


METHODS = ["threshold", "dgc", "adaq", "adaq_indices", "signum", "onebit"]


@pytest.mark.parametrize("name", METHODS)
def test_pmap_equals_shard_map_and_wire_bytes(name):
  params = small_params()  # test_properties covers harness.params_tree()
  tx = pmapped(name)  # the defaults are covered by test_properties
  sp = sm = harness.init_stacked(tx, params)
  for t in range(2):
    g = harness.worker_grads(params, seed=t)
    out_p, sp = harness.run_pmap(tx, g, sp)
    out_s, sm = harness.run_shard_map(tx, g, sm)
    harness.assert_replicas_equal(out_p)
    harness.assert_trees_close(out_p, out_s, rtol=0, atol=0)
    harness.assert_trees_close(sp, sm, rtol=0, atol=0)
  assert harness.pmap_wire_bytes(tx, params)["total"] == jaxcomp.wire_bytes(tx, params)


def test_nominal_bytes_per_method():
  params = {"big": jnp.zeros((1000,), jnp.float32)}  # uint16 indices
  n = 1000
  want = {
      "threshold": 100 * (4 + 2) + 4,
      "dgc": dgc_mod.capacity(n, 0.001) * 6 + 4,  # after the default warm-up (its stages: step=)
      "adaq": 8 + 256,  # two means + 2 bits per entry, the leaf padded to 1024 entries (rows of 128)
      "signum": 128,  # 1 bit per entry, the leaf padded to 1024 entries (rows of 128)
      "onebit": 8 + 128,  # the 1000 entries padded to 1024 (segments of 128-entry rows)
  }
  for name, nbytes in want.items():
    assert jaxcomp.wire_bytes(jaxcomp.METHODS[name](), params) == nbytes, name
  assert jaxcomp.wire_bytes(jaxcomp.dgc(), params, step=0) == dgc_mod.capacity(n, 0.25) * 6 + 4


# ----------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize("call, exc, match", [
    (lambda: jaxcomp.threshold(v=-1.0), ValueError, "v must be"),
    (lambda: jaxcomp.threshold(v="x"), TypeError, "v must be"),
    (lambda: jaxcomp.threshold(capacity=0.0), ValueError, "capacity must be in"),
    (lambda: jaxcomp.threshold(capacity=1.5), ValueError, "capacity must be in"),
    (lambda: jaxcomp.dgc(ratio=0.0), ValueError, "ratio must be in"),
    (lambda: jaxcomp.dgc(momentum=1.0), ValueError, "momentum must be in"),
    (lambda: jaxcomp.dgc(sample_ratio=2.0), ValueError, "sample_ratio must be in"),
    (lambda: jaxcomp.dgc(warmup_steps=-1), ValueError, "warmup_steps must be"),
    (lambda: jaxcomp.dgc(clip_norm=0.0), ValueError, "clip_norm must be"),
    (lambda: jaxcomp.dgc(ratio=optax.constant_schedule(0.01)), ValueError, "max_ratio is required"),
    (lambda: jaxcomp.dgc(ratio=optax.constant_schedule(0.01), max_ratio=1.5), ValueError, "max_ratio must be"),
    (lambda: jaxcomp.dgc(ratio=optax.constant_schedule(0.01), max_ratio=0.1, warmup_steps=5), ValueError,
     "warmup_steps applies"),
    (lambda: jaxcomp.dgc(ratio=0.01, max_ratio=0.1), ValueError, "max_ratio is only used"),
    (lambda: jaxcomp.dgc_warmup_schedule(0.001, 0), ValueError, "warmup_steps must be"),
    (lambda: jaxcomp.signum(momentum=1.5), ValueError, "momentum must be in"),
    (lambda: jaxcomp.signum(momentum=True), TypeError, "momentum must be"),
    (lambda: jaxcomp.signum(ties="up"), ValueError, r"ties must be one of \('zero', 'positive'\)"),
    (lambda: jaxcomp.signsgd(ties=0), ValueError, "ties must be one of"),
    (lambda: jaxcomp.onebit(error_feedback="yes"), TypeError, "error_feedback must be"),
    (lambda: jaxcomp.adaq(ratio=0.0), ValueError, "ratio must be in"),
    (lambda: jaxcomp.adaq(capacity=2.0), ValueError, "capacity must be in"),
    (lambda: jaxcomp.adaq(encoding="bits"), ValueError, "encoding must be one of"),
])
def test_bad_arguments(call, exc, match):
  with pytest.raises(exc, match=match):
    call()
