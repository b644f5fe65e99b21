"""Each core method against a plain numpy version of its algorithm, and the builder's contracts."""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
  AXIS,
  N,
  assert_replicas_equal,
  assert_trees_close,
  init_stacked,
  params_tree,
  run_pmap,
  run_shard_map,
  worker_grads,
)

import jaxcomp
from jaxcomp.core.layout import Segments
from jaxcomp.transforms import sparse
from jaxcomp.transforms.lowrank import PowerSGDExchange

pytestmark = pytest.mark.usefixtures("every_leaf_module")  # small trees on purpose: compress every leaf


def _np(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _run_steps(tx, params, steps, run=run_pmap):
  state = init_stacked(tx, params)
  outs = []
  for s in range(steps):
    out, state = run(tx, worker_grads(params, seed=s), state)
    assert_replicas_equal(out)
    outs.append(_np(out))
  return outs, state


def _reference(params, steps, per_worker_fn, init_mem=None):
  """Runs ``per_worker_fn(x_w, g_w, mem_w) -> (sent_w, mem_w)`` leaf by leaf and averages."""
  leaves, treedef = jax.tree.flatten(params)
  mem = [[np.zeros(leaf.shape) if init_mem is None else init_mem(leaf) for leaf in leaves] for _ in range(N)]
  outs = []
  for s in range(steps):
    grads = [np.asarray(g, np.float64) for g in jax.tree.leaves(worker_grads(params, seed=s))]
    out = []
    for i in range(len(leaves)):
      sent = []
      for w in range(N):
        sw, mem[w][i] = per_worker_fn(grads[i][w], mem[w][i])
        sent.append(sw)
      out.append(sent)
    outs.append(out)
  return outs, treedef


def test_none_is_the_dense_mean():
  params = params_tree()
  outs, _ = _run_steps(jaxcomp.none(axis_name=AXIS), params, 1)
  grads = _np(worker_grads(params, seed=0))
  assert_trees_close(jax.tree.map(lambda o: o[0], outs[0]), jax.tree.map(lambda g: g.mean(0), grads))


@pytest.mark.parametrize("name,dtype", [("fp16", np.float16), ("bf16", jnp.bfloat16)])
def test_half_precision_mean(name, dtype):
  params = params_tree()
  outs, _ = _run_steps(jaxcomp.METHODS[name](axis_name=AXIS), params, 1)
  grads = _np(worker_grads(params, seed=0))
  ref = jax.tree.map(lambda g: np.asarray((g / N).astype(dtype), np.float64).sum(0), grads)
  tol = 1e-2 if name == "bf16" else 2e-3
  assert_trees_close(jax.tree.map(lambda o: o[0], outs[0]), ref, rtol=tol, atol=tol)


def test_topk_matches_numpy_with_error_feedback():
  ratio = 0.05
  params = params_tree()
  outs, _ = _run_steps(jaxcomp.topk(ratio=ratio, axis_name=AXIS), params, 3)

  def topk_np(g, e):
    x = (e + g).ravel()
    k = max(1, int(np.ceil(ratio * x.size - 1e-9)))
    idx = np.argsort(-np.abs(x), kind="stable")[:k]
    sent = np.zeros_like(x)
    sent[idx] = x[idx]
    return sent.reshape(g.shape), (x - sent).reshape(g.shape)

  ref, treedef = _reference(params, 3, topk_np)
  for step in range(3):
    expect = treedef.unflatten([np.mean(s, axis=0) for s in ref[step]])
    assert_trees_close(jax.tree.map(lambda o: o[0], outs[step]), expect, rtol=1e-5, atol=1e-6)


def test_topk_of_a_long_leaf_matches_numpy_with_ties():
  """On a long leaf the segmented search finds the same set as numpy, ties to lower indices."""
  n = 65536 * 2 + 3
  x = np.array(jax.random.normal(jax.random.PRNGKey(5), (n,)), np.float32)
  x[1000:2400] = x[:200] = 4.5  # 1600 ties at the top, k = 1311: the lower indices go first
  tx = jaxcomp.topk(ratio=0.01)
  out, state = jax.jit(tx.update)({"w": jnp.asarray(x)}, tx.init({"w": jnp.zeros(n)}))
  k = int(np.ceil(0.01 * n))
  idx = np.argsort(-np.abs(x), kind="stable")[:k]
  sent = np.zeros_like(x)
  sent[idx] = x[idx]
  np.testing.assert_array_equal(np.asarray(out["w"]), sent)
  np.testing.assert_array_equal(np.asarray(jaxcomp.memory_tree(tx, state, {"w": x})["w"]), x - sent)


def test_signsgd_is_the_majority_vote():
  params = params_tree()
  outs, _ = _run_steps(jaxcomp.signsgd(axis_name=AXIS), params, 1)
  ref = jax.tree.map(lambda g: np.sign(np.where(g >= 0, 1, -1).sum(0)), _np(worker_grads(params, seed=0)))
  assert_trees_close(jax.tree.map(lambda o: o[0], outs[0]), ref, rtol=0, atol=0)


def test_efsignsgd_matches_numpy():
  lr = 0.1
  params = params_tree()
  outs, _ = _run_steps(jaxcomp.efsignsgd(lr=lr, axis_name=AXIS), params, 3)

  def ef_np(g, e):
    x = e + lr * g
    sent = np.mean(np.abs(x)) * np.where(x >= 0, 1.0, -1.0)
    return sent / lr, x - sent

  ref, treedef = _reference(params, 3, ef_np)
  for step in range(3):
    expect = treedef.unflatten([np.mean(s, axis=0) for s in ref[step]])
    assert_trees_close(jax.tree.map(lambda o: o[0], outs[step]), expect, rtol=1e-4, atol=1e-5)


def _gram_schmidt(p, eps=1e-8):
  p = p.copy()
  for i in range(p.shape[1]):
    for j in range(i):
      p[:, i] -= (p[:, j] @ p[:, i]) * p[:, j]
    p[:, i] /= np.linalg.norm(p[:, i]) + eps
  return p


def test_powersgd_matches_numpy_with_warm_start():
  rank = 2
  params = {"a": jnp.zeros((20, 12)), "b": jnp.zeros((20, 12)), "bias": jnp.zeros((12,)),
            "conv": jnp.zeros((3, 3, 2, 5))}
  tx = jaxcomp.powersgd(rank=rank, axis_name=AXIS)
  state0 = tx.init(params)
  bs = tx.method.buckets(params)
  (b,) = [b for b in bs if isinstance(b.exchange, PowerSGDExchange)]
  (q0,) = [np.asarray(q, np.float64) for q in b.exchange.warm_start(b.segments, state0.extra[bs.index(b)])]
  outs, _ = _run_steps(tx, params, 3)
  err = {k: np.zeros((N,) + v.shape) for k, v in params.items()}
  q = {"b": q0[0], "a": q0[1]}  # segments in reverse tree order
  for step in range(3):
    g = _np(worker_grads(params, seed=step))
    for name in ("bias", "conv"):  # 1-D, and a matrix too small to be worth compressing
      np.testing.assert_allclose(outs[step][name][0], g[name].mean(0), rtol=1e-5, atol=1e-6)
    for name in ("a", "b"):
      m = g[name] + err[name]
      p = _gram_schmidt(np.mean(m @ q[name], axis=0))
      q[name] = np.mean(np.swapaxes(m, 1, 2) @ p, axis=0)
      approx = p @ q[name].T
      err[name] = m - approx
      np.testing.assert_allclose(outs[step][name][0], approx, rtol=1e-4, atol=1e-5)


def test_powersgd_views_conv_kernels_with_output_channels_as_one_side():
  from jaxcomp.transforms.lowrank import matrix_view
  assert matrix_view((3, 3, 64, 128)) == (3 * 3 * 64, 128)
  tx = jaxcomp.powersgd(rank=4, axis_name=None)
  kernel = {"k": jnp.zeros((3, 3, 64, 128))}
  assert jaxcomp.wire_bytes(tx, kernel) == (3 * 3 * 64 + 128) * 4 * 4


def test_powersgd_start_step_is_dense_before():
  params = {"a": jnp.zeros((20, 12))}
  tx = jaxcomp.powersgd(rank=1, start_step=1, axis_name=AXIS)
  outs, _ = _run_steps(tx, params, 2)
  g0 = _np(worker_grads(params, seed=0))
  g1 = _np(worker_grads(params, seed=1))
  np.testing.assert_allclose(outs[0]["a"][0], g0["a"].mean(0), rtol=1e-5, atol=1e-6)
  assert np.linalg.matrix_rank(outs[1]["a"][0], tol=1e-4) == 1
  assert not np.allclose(outs[1]["a"][0], g1["a"].mean(0))


def test_randomk_shares_positions_and_sums_values():
  ratio = 0.1
  params = {"w": jnp.zeros((50, 10))}
  outs, _ = _run_steps(jaxcomp.randomk(ratio=ratio, axis_name=AXIS, error_feedback=False), params, 1)
  out = outs[0]["w"][0].ravel()
  g = _np(worker_grads(params, seed=0))["w"].reshape(N, -1)
  nz = np.flatnonzero(out)
  assert 0 < nz.size <= int(np.ceil(ratio * out.size))
  np.testing.assert_allclose(out[nz], g.mean(0)[nz], rtol=1e-5)
  c = int(np.ceil(500 / 50))
  assert np.all(np.diff(nz // c) > 0), "one position per stratum"


def _unbiased_check(tx, x, trials, bound):
  state = tx.init(x)
  keys = jax.random.split(jax.random.PRNGKey(42), trials)
  states = jax.vmap(lambda k: state._replace(key=k))(keys)
  outs = jax.jit(jax.vmap(tx.update, in_axes=(None, 0)))(x, states)[0]
  mean = np.asarray(outs, np.float64).mean(0)
  # 6 standard errors: a false failure has probability < 1e-8 per entry.
  np.testing.assert_array_less(np.abs(mean - np.asarray(x)), 6 * bound / np.sqrt(trials) + 1e-7)
  return mean


def test_qsgd_is_unbiased():
  levels = 4
  x = jax.random.normal(jax.random.PRNGKey(0), (300,))
  norm = float(jnp.linalg.norm(x))
  # Each entry rounds between two adjacent levels norm/s apart: variance <= (norm/s)^2 / 4.
  _unbiased_check(jaxcomp.qsgd(levels=levels), x, 4000, norm / levels / 2)


def test_randomk_scaled_is_unbiased():
  ratio = 0.1
  x = jax.random.normal(jax.random.PRNGKey(1), (300,))
  c = 10  # ceil(300 / ceil(0.1 * 300))
  # x_hat_i = c x_i with probability 1/c, else 0: variance x_i^2 (c - 1).
  tx = jaxcomp.randomk(ratio=ratio, unbiased=True, error_feedback=False)
  _unbiased_check(tx, x, 4000, np.abs(np.asarray(x)) * np.sqrt(c - 1))
  segs = Segments((0,), (300,), ((300,),))
  pos, lengths = sparse.random_positions(jax.random.PRNGKey(0), segs, ratio)
  assert pos.shape == (30,) and np.all(lengths == c)


@pytest.mark.parametrize("ratio,n", [(0.3, 100), (0.6, 100), (0.3, 7), (0.01, 1000), (0.5, 3)])
def test_randomk_sends_exactly_the_documented_count(ratio, n):
  """k = max(1, ceil(ratio * n)) distinct positions per leaf, one in each stratum (ratio 0.3 sent 25%)."""
  segs = Segments((0, 128), (n, 50), ((n,), (50,)), 1) if n <= 128 else Segments((0,), (n,), ((n,),))
  pos, lengths = sparse.random_positions(jax.random.PRNGKey(3), segs, ratio)
  pos = np.asarray(pos)
  k = int(np.ceil(ratio * n - 1e-9))
  first = pos[pos < n]
  assert first.size == k and np.unique(first).size == k
  assert lengths[:k].sum() == n and lengths.max() - lengths.min() <= 1 + (segs.count > 1) * 100
  tx = jaxcomp.randomk(ratio=ratio, error_feedback=False)
  g = {"w": jnp.arange(1.0, n + 1.0)}
  out, _ = jax.jit(tx.update)(g, tx.init(g))
  assert int(np.count_nonzero(np.asarray(out["w"]))) == k


def test_stochastic_workers_round_independently_but_agree_on_the_mean():
  params = {"w": jnp.zeros((64,))}
  tx = jaxcomp.qsgd(levels=2, axis_name=AXIS)
  same = jax.tree.map(lambda g: jnp.broadcast_to(g[:1], g.shape), worker_grads(params))
  state = init_stacked(tx, params)
  out, _ = run_pmap(tx, same, state)
  assert_replicas_equal(out)
  # Equal inputs, independent rounding: the mean of 8 roundings is not one rounding.
  local = jax.jit(jaxcomp.qsgd(levels=2).update)({"w": same["w"][0]}, tx.init(params))[0]["w"]
  assert not np.allclose(np.asarray(out["w"][0]), np.asarray(local))


# ----------------------------------------------------------------------------- composition


def test_chain_with_sgd_and_adam_under_pmap_and_shard_map():
  params = params_tree()
  grads = worker_grads(params)
  for opt in (optax.sgd(0.1, momentum=0.9), optax.adam(1e-3)):
    tx = optax.chain(jaxcomp.topk(ratio=0.1, axis_name=AXIS), opt)
    state = init_stacked(tx, params)
    up_p, st_p = run_pmap(tx, grads, state)
    up_s, st_s = run_shard_map(tx, grads, state)
    assert_replicas_equal(up_p)
    assert_trees_close(up_p, up_s, rtol=1e-6, atol=1e-7)
    comp = jaxcomp.topk(ratio=0.1, axis_name=AXIS)
    mean, _ = run_pmap(comp, grads, init_stacked(comp, params))
    expect, _ = jax.vmap(opt.update)(mean, jaxcomp.per_worker(opt.init(params), N))
    assert_trees_close(up_p, expect, rtol=1e-5, atol=1e-7)


def test_multisteps_accumulates_before_compressing():
  params = {"w": jnp.zeros((30,))}
  inner = jaxcomp.topk(ratio=0.2, axis_name=AXIS)
  tx = optax.MultiSteps(inner, every_k_schedule=2)
  state = init_stacked(tx, params)
  g0, g1 = worker_grads(params, seed=0), worker_grads(params, seed=1)
  out0, state = run_pmap(tx, g0, state)
  np.testing.assert_array_equal(np.asarray(out0["w"]), 0)
  out1, state = run_pmap(tx, g1, state)
  avg = jax.tree.map(lambda a, b: (a + b) / 2, g0, g1)
  expect, _ = run_pmap(inner, avg, init_stacked(inner, params))
  assert_trees_close(out1, expect, rtol=1e-5, atol=1e-6)


def test_multi_transform_compresses_some_leaves_only():
  params = params_tree()
  labels = {"conv": {"kernel": "dense"}, "dense": {"kernel": "compress", "bias": "dense"}, "scale": "dense"}
  tx = optax.multi_transform(
      {"compress": jaxcomp.topk(ratio=0.05, axis_name=AXIS), "dense": jaxcomp.none(axis_name=AXIS)}, labels)
  grads = worker_grads(params)
  out, _ = run_pmap(tx, grads, init_stacked(tx, params))
  assert_replicas_equal(out)
  g = _np(grads)
  np.testing.assert_allclose(out["conv"]["kernel"][0], g["conv"]["kernel"].mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["dense"]["bias"][0], g["dense"]["bias"].mean(0), rtol=1e-5, atol=1e-6)
  kept = np.count_nonzero(np.asarray(out["dense"]["kernel"][0]))
  assert 0 < kept <= N * int(np.ceil(0.05 * 40 * 24))


def test_state_is_a_plain_pytree():
  params = params_tree()
  tx = jaxcomp.powersgd(rank=2, axis_name=None)
  state = tx.init(params)
  assert isinstance(state, jaxcomp.CompressState)
  leaves, treedef = jax.tree.flatten(state)
  assert all(isinstance(x, jax.Array) for x in leaves)
  rebuilt = jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
  copied = jax.tree.map(lambda x: x.copy(), state)
  grads = jax.tree.map(lambda g: g[0], worker_grads(params, n=1))
  a = jax.jit(tx.update)(grads, state)
  b = jax.jit(tx.update)(grads, rebuilt)
  c = jax.jit(tx.update)(grads, copied)
  assert_trees_close(a, b, 0, 0)
  assert_trees_close(a, c, 0, 0)


def test_count_saturates_instead_of_overflowing():
  tx = jaxcomp.topk(ratio=0.5)
  params = {"w": jnp.ones((4,))}
  state = tx.init(params)._replace(count=jnp.asarray(np.iinfo(np.int32).max, jnp.int32))
  _, state = tx.update(params, state)
  assert int(state.count) == np.iinfo(np.int32).max


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("factory", [jaxcomp.topk, jaxcomp.randomk])
@pytest.mark.parametrize("ratio", [0, -0.1, 1.5, float("nan"), float("inf"), "0.1", True, None])
def test_ratio_outside_unit_interval_is_rejected(factory, ratio):
  with pytest.raises((ValueError, TypeError), match=r"ratio must be .*\(0, 1\]"):
    factory(ratio=ratio)


@pytest.mark.parametrize("rank", [0, -1, 1.5, "2"])
def test_rank_below_one_is_rejected(rank):
  with pytest.raises((ValueError, TypeError), match="rank must be"):
    jaxcomp.powersgd(rank=rank)


@pytest.mark.parametrize("kwargs,arg", [
    ({"levels": 0}, "levels"), ({"levels": 128}, "levels"),
    ({"error_feedback": "yes"}, "error_feedback"), ({"seed": "x"}, "seed"),
])
def test_qsgd_bad_arguments(kwargs, arg):
  with pytest.raises((ValueError, TypeError), match=arg):
    jaxcomp.qsgd(**kwargs)


@pytest.mark.parametrize("kwargs,arg", [
    ({"lr": 0}, "lr"), ({"lr": -1.0}, "lr"), ({"lr": float("nan")}, "lr"),
])
def test_efsignsgd_bad_lr(kwargs, arg):
  with pytest.raises(ValueError, match=arg):
    jaxcomp.efsignsgd(**kwargs)


def test_powersgd_bad_options():
  with pytest.raises(ValueError, match="min_compression_rate"):
    jaxcomp.powersgd(min_compression_rate=0.5)
  with pytest.raises(ValueError, match="start_step"):
    jaxcomp.powersgd(start_step=-1)


def test_unhashable_axis_name_is_rejected():
  with pytest.raises(TypeError, match="axis_name"):
    jaxcomp.topk(axis_name={"data": 1})


def test_gradient_tree_that_does_not_match_the_state():
  tx = jaxcomp.topk(ratio=0.5)
  state = tx.init({"w": jnp.zeros((4,))})
  with pytest.raises(ValueError, match="do not match the state"):
    tx.update({"w": jnp.zeros((4,)), "b": jnp.zeros((2,))}, state)
  with pytest.raises(ValueError, match="do not match the state"):
    tx.update({"w": jnp.zeros((500,))}, state)
  with pytest.raises(TypeError, match="state must be the CompressState"):
    tx.update({"w": jnp.zeros((4,))}, optax.EmptyState())


def test_nan_reaches_the_output_but_not_the_residual():
  """Documented behaviour: a NaN entry is sent (it is the largest), the residual drops it."""
  tx = jaxcomp.topk(ratio=0.25)
  g = {"w": jnp.array([1.0, jnp.nan, 3.0, -0.5, 2.0, 0.1, -4.0, 0.2])}
  out, state = tx.update(g, tx.init(g))
  assert np.isnan(np.asarray(out["w"])).any()
  res = np.asarray(jaxcomp.memory_tree(tx, state, g)["w"])
  assert np.all(np.isfinite(res))
  # Every finite value not sent stays in the residual.
  sent = np.nan_to_num(np.asarray(out["w"]), nan=0.0)
  finite = np.isfinite(np.asarray(g["w"]))
  np.testing.assert_allclose((sent + res)[finite], np.asarray(g["w"])[finite])


@pytest.mark.parametrize("name,bad,kw", [("topk", jnp.nan, {}), ("qsgd", jnp.nan, {}), ("topk", jnp.inf, {}),
                                         ("qsgd", -jnp.inf, {}), ("signsgd", jnp.nan, {}),
                                         ("u8bit", jnp.nan, {}), ("terngrad", jnp.nan, {"clip_sigma": None}),
                                         ("natural", -jnp.inf, {})])
def test_a_nan_among_equal_values_flags_the_step(name, bad, kw):
  """Regression: a NaN among equal magnitudes once passed the non-finite check (a max-reduction lost it).

  An Inf of either sign must flag the step too. Methods whose payload carries
  NaN/Inf (a scale, a norm, a flag: ``carries_nonfinite``) put it in the mean,
  identically on every worker; the others make every output NaN.
  """
  tx = jaxcomp.METHODS[name](axis_name=AXIS, **kw)
  params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros((100,))}  # XLA:CPU lost it in 4096 equal values
  grads = {"w": jnp.ones((N, 64, 64)).at[5, 1, 2].set(bad), "b": jnp.ones((N, 100))}
  out, _ = run_pmap(tx, grads, init_stacked(tx, params))
  carried = tx.method.carries_nonfinite(params)
  assert carried == (name != "topk")
  for leaf in jax.tree.leaves(out):
    a = np.asarray(leaf)
    np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape))  # NaN == NaN here
    assert np.all(np.isnan(a)) or carried
  assert not np.isfinite(np.asarray(out["w"])[0]).any() or name == "natural"
  assert not np.isfinite(np.asarray(out["w"])[0]).all()


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_sketchml_keeps_a_nonfinite_entry_in_its_own_leaf(bad):
  """Regression: with fewer bins than the split table's width (10 of 16, a 5-entry leaf), an entry
  of +Inf counted the table's unused columns and landed past its leaf's bins: lost in the last
  leaf, in another leaf's bin otherwise."""
  tx = jaxcomp.sketchml(buckets=10, min_size=1, axis_name=AXIS)
  params = {"a": jnp.zeros((3000,)), "b": jnp.zeros((5,)), "c": jnp.zeros((130,))}
  assert [b.leaves for b in tx.method.buckets(params)] == [(2, 1, 0)]  # one bucket, "c" first
  for name in params:
    grads = {k: jnp.full((N,) + p.shape, 1e-6) for k, p in params.items()}
    grads[name] = harness.set_at(grads[name], (5, 3), bad)
    out, _ = run_pmap(tx, grads, init_stacked(tx, params))
    for k, v in out.items():
      assert np.isfinite(np.asarray(v)).all() == (k != name), (name, k)


def test_empty_and_scalar_leaves():
  tx = jaxcomp.topk(ratio=0.5)
  g = {"empty": jnp.zeros((0, 3)), "s": jnp.asarray(2.0), "w": jnp.arange(4.0)}
  out, _ = jax.jit(tx.update)(g, tx.init(g))
  assert out["empty"].shape == (0, 3)
  assert float(out["s"]) == 2.0


def test_bf16_leaves_keep_their_dtype():
  tx = jaxcomp.topk(ratio=0.5)
  g = {"w": jnp.arange(8.0, dtype=jnp.bfloat16)}
  out, state = jax.jit(tx.update)(g, tx.init(g))
  # The output keeps the parameters' dtype; the residual is float32 whatever it is.
  assert out["w"].dtype == jnp.bfloat16
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(state.memory))


# ----------------------------------------------------------------------------- helpers


def test_cpu_devices_helper():
  assert len(jaxcomp.cpu_devices(8)) == 8
  with pytest.raises(RuntimeError, match="came too late"):
    jaxcomp.cpu_devices(4)
  with pytest.raises(ValueError, match="n must be a positive int"):
    jaxcomp.cpu_devices(0)


def test_collective_bytes_parser():
  hlo = "\n".join([
      "  %a = f32[100]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add",
      "  %b = u8[4,25]{1,0} all-gather(%y), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}",
      "  %c = (f16[10]{0}, s32[3]{0}) all-reduce(%p, %q), replica_groups=[2,4]<=[8], to_apply=%add",
      "  %d = f32[8]{0} reduce-scatter(%z), replica_groups={{0,1,2,3}}, dimensions={0}",
      "  %e = f32[8]{0} collective-permute(%z), source_target_pairs={{0,1}}",
      "  %f = (u8[5]{0}, u8[20]{0}) all-gather-start(%w), replica_groups={{0,1,2,3}}, dimensions={0}",
      "  %g = u8[20]{0} all-gather-done(%f)",
      "  %h = f32[100]{0} add(%a, %a)",
  ])
  got = jaxcomp.collective_bytes(hlo)
  assert got["all-reduce"] == 400 + 20 + 12
  assert got["all-gather"] == 25 + 5
  assert got["reduce-scatter"] == 128
  assert got["collective-permute"] == 32
  assert got["count"] == 6
  assert got["total"] == 400 + 32 + 30 + 128 + 32
  assert got["by_group_size"] == {1: 32, 4: 400 + 30 + 128 + 32}  # [2,4]<=[8]: groups of 4


def test_per_worker_state_for_a_mesh():
  from harness import mesh
  from jax.sharding import PartitionSpec as P
  m = mesh()
  tx = jaxcomp.topk(ratio=0.1, axis_name=AXIS)
  st = jaxcomp.per_worker(tx.init(params_tree()), m, AXIS)
  (leaf,) = st.memory  # one bucket
  assert leaf.shape[0] == N and leaf.sharding.spec == P(AXIS)
  with pytest.raises(ValueError, match="axis_name"):
    jaxcomp.per_worker(tx.init(params_tree()), m, "model")
