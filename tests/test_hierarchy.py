"""Two-level exchange (dense_axis_name): dense over the fast axis, compressed over the slow
one, on a (2, 4) mesh.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.core import layout
from jaxcomp.exchanges import hierarchy

SLOW, FAST = "dcn", "ici"
AXES = (SLOW, FAST)
M, F = 2, 4
PARAMS = {"w": jnp.zeros((40, 64)), "k": jnp.zeros((3, 3, 8, 16)), "b": jnp.zeros((24,))}


def mesh():
  return jax.make_mesh((M, F), AXES, axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:M * F])


def grads(seed):
  leaves, treedef = jax.tree.flatten(PARAMS)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(k, (M * F,) + x.shape) for k, x in zip(keys, leaves)])


@functools.lru_cache(maxsize=None)
def programs(tx):
  """The per-worker init and the compiled step of ``tx`` on the (2, 4) mesh."""
  init = jax.jit(jax.shard_map(lambda p: jaxcomp.stacked(tx.init(p)), mesh=mesh(), in_specs=P(),
                               out_specs=P(AXES)))

  def step(g, s, p):
    u, s = tx.update(jaxcomp.local(g), jaxcomp.local(s), p)
    return jaxcomp.stacked(u), jaxcomp.stacked(s)

  state = init(PARAMS)
  f = jax.jit(jax.shard_map(step, mesh=mesh(), in_specs=(P(AXES), P(AXES), P()), out_specs=(P(AXES), P(AXES)),
                            check_vma=False))
  compiled = f.lower(grads(0), state, PARAMS).compile()
  return state, compiled


def run(tx, steps, state=None):
  state0, compiled = programs(tx)
  state = state0 if state is None else state
  outs = []
  for t in range(steps):
    out, state = compiled(grads(t), state, PARAMS)
    outs.append(out)
  return outs, state


def test_none_is_the_dense_mean_over_both_axes():
  tx = jaxcomp.none(axis_name=SLOW, dense_axis_name=FAST)
  (out,), _ = run(tx, 1)
  for o, g in zip(jax.tree.leaves(out), jax.tree.leaves(grads(0))):
    np.testing.assert_allclose(np.asarray(o), np.broadcast_to(np.asarray(g).mean(0), o.shape), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("name", sorted(jaxcomp.METHODS))
def test_every_method_replicas_chunked_memory_and_slow_axis_bytes(name):
  tx = jaxcomp.METHODS[name](axis_name=SLOW, dense_axis_name=FAST)
  assert tx.dense_axis_name == FAST
  outs, state = run(tx, 2)
  for leaf in jax.tree.leaves(outs[-1]):  # bit-identical on all 8 workers of the mesh
    a = np.asarray(leaf)
    np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape))
  full = tx.method.buckets(PARAMS)
  chunked = tx.method.chunkable and tx.method.fused is None
  memory = jax.tree.leaves(state.memory)
  if memory:  # the memory of a chunk only: 1/F of each bucket (whole buckets when not chunked)
    want = [hierarchy.chunk_length(b.length, F) if chunked else b.length for b in full]
    assert [np.shape(v)[-1] for v in memory[:len(want)]] == want
  measured = jaxcomp.collective_bytes(programs(tx)[1].as_text())["by_group_size"]
  nominal = jaxcomp.wire_bytes_by_axis(tx, PARAMS, F)
  if not tx.method.stages and name != "bf16":  # XLA:CPU all-reduces bf16 in f32 (README)
    assert measured.get(M, 0) == nominal[SLOW], (measured, nominal)  # only this crosses the slow axis
  assert measured.get(F, 0) == nominal[FAST], (measured, nominal)
  assert measured.get(M * F, 0) == nominal["both"], (measured, nominal)
  dense = jaxcomp.wire_bytes_by_axis(jaxcomp.none(axis_name=SLOW, dense_axis_name=FAST), PARAMS, F)[SLOW]
  if name not in ("none", "bf16"):
    assert nominal[SLOW] < dense


@pytest.mark.parametrize("name", ["qsgd", "topk"])
def test_the_scatter_exchange_runs_over_the_slow_axis(name):
  tx = jaxcomp.METHODS[name](axis_name=SLOW, dense_axis_name=FAST, transport="scatter")
  outs, state = run(tx, 2)
  for leaf in jax.tree.leaves(outs[-1]):  # bit-identical on all 8 workers of the mesh
    a = np.asarray(leaf)
    np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape))
  for owner in jax.tree.leaves(state.extra):  # the owner residual of the worker's fast-axis chunk
    assert owner.shape[-1] in [hierarchy.chunk_length(b.length, F) for b in tx.method.buckets(PARAMS)]
  measured = jaxcomp.collective_bytes(programs(tx)[1].as_text())
  nominal = jaxcomp.wire_bytes_by_axis(tx, PARAMS, F, workers=M)
  assert measured["by_group_size"].get(M, 0) == nominal[SLOW] and measured["all-to-all"] > 0, (
      measured, nominal)


def test_error_feedback_conserves_every_value_of_the_chunk():
  tx = jaxcomp.topk(0.05, axis_name=SLOW, dense_axis_name=FAST, min_size=1)
  (b_full,) = [b for b in tx.method.buckets(PARAMS)]
  (chunk,) = hierarchy.chunked([b_full], F)
  c = chunk.length
  state0, _ = programs(tx)
  outs, state1 = run(tx, 1)
  leaves = jax.tree.leaves(PARAMS)

  def packed(tree_stacked, worker):
    vec = layout.pack([b_full], [np.asarray(x)[worker] for x in jax.tree.leaves(tree_stacked)])[0]
    return np.pad(np.asarray(vec), (0, F * c - b_full.length))

  g = grads(0)
  node_mean = [np.mean([packed(g, d * F + f) for f in range(F)], axis=0) for d in range(M)]
  out = packed(outs[0], 0)
  res0, res1 = np.asarray(state0.memory[0]), np.asarray(state1.memory[0])
  for f in range(F):
    sent = [node_mean[d][f * c:(f + 1) * c] + res0[d * F + f] - res1[d * F + f] for d in range(M)]
    np.testing.assert_allclose(out[f * c:(f + 1) * c], np.mean(sent, axis=0), rtol=1e-5, atol=1e-6)
    for d in range(M):  # each worker sent a top-k of its chunk: the rest is kept exactly
      assert 0 < np.count_nonzero(np.abs(sent[d]) > 1e-7) <= int(np.ceil(0.05 * c))
  del leaves


def test_resume_from_a_saved_state_is_bitwise():
  tx = jaxcomp.onebit(axis_name=SLOW, dense_axis_name=FAST)
  outs, _ = run(tx, 3)
  _, mid = run(tx, 2)
  saved = jax.tree.map(np.asarray, jax.device_get(mid))
  _, compiled = programs(tx)
  out, _ = compiled(grads(2), jax.tree.map(jnp.asarray, saved), PARAMS)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(outs[-1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_axes_are_named():
  for factory in jaxcomp.METHODS.values():
    assert "dense_axis_name" in inspect.signature(factory).parameters
  with pytest.raises(ValueError, match="needs axis_name"):
    jaxcomp.topk(dense_axis_name=FAST)
  with pytest.raises(ValueError, match="different"):
    jaxcomp.topk(axis_name=FAST, dense_axis_name=FAST)
  with pytest.raises(ValueError, match="call tx.init inside the mesh"):
    jaxcomp.topk(axis_name=SLOW, dense_axis_name=FAST).init(PARAMS)
  with pytest.raises(TypeError, match="dense_axis_name"):
    jaxcomp.wire_bytes_by_axis(jaxcomp.topk(axis_name=SLOW), PARAMS, F)
