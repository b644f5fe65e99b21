"""transport="scatter": an all-to-all of 1/N chunks, a reduce per chunk, an all-gather of the
re-compressed chunks.

Replicas bit-identical, pmap == shard_map, every value either delivered or in
one of the two residuals (the worker's, the chunk owner's), NaN handling,
resume bitwise, and the bytes each worker receives, measured from the
compiled program at N = 2, 4, 8, flat in N.
"""

import inspect

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
from jaxcomp.core import layout
from jaxcomp.core.protocol import Exchange, Memory
from jaxcomp.exchanges.scatter import ScatterCodec, ScatterExchange
from jaxcomp.training import checkpoint

pytestmark = pytest.mark.usefixtures("every_leaf_module")  # small trees on purpose: compress every leaf

NO_SCATTER = ("powersgd", "acpsgd", "sbc")  # all-reduced factors; SBC's sync schedule and Golomb stream
PSUMMED = ("none", "fp16", "bf16", "randomk")  # already one all-reduce: unchanged
VOTES = ("signsgd", "signum")  # the output is a majority vote, not the mean of the sent signs
SCATTERED = sorted(set(jaxcomp.METHODS) - set(NO_SCATTER) - set(PSUMMED))


def _scatter(name, **kw):
  factory = jaxcomp.METHODS[name]
  if "error_feedback" in inspect.signature(factory).parameters:
    kw.setdefault("error_feedback", True)  # both residuals, for the conservation check
  return factory(axis_name=AXIS, transport="scatter", **kw)


def _vectors(tx, tree, worker):
  """Worker ``worker``'s entries of a stacked tree, in the bucket layout (float64)."""
  buckets = tx.method.buckets(params_tree())
  leaves = [np.asarray(x)[worker] for x in jax.tree.leaves(tree)]
  return [np.asarray(v, np.float64) for v in layout.pack(buckets, leaves)]


@pytest.mark.parametrize("name", SCATTERED)
def test_replicas_pmap_shard_map_and_both_residuals(name):
  tx = _scatter(name)
  assert any(isinstance(b.exchange, ScatterExchange) for b in tx.method.buckets(params_tree()))
  params = params_tree()
  state_p = state_s = state0 = init_stacked(tx, params)
  total_out = total_in = None
  for step in range(2):
    grads = worker_grads(params, seed=step)
    out_p, state_p = run_pmap(tx, grads, state_p)
    out_s, state_s = run_shard_map(tx, grads, state_s)
    assert_replicas_equal(out_p)
    assert_trees_close(out_p, out_s, rtol=1e-6, atol=1e-7)
    assert_trees_close(state_p, state_s, rtol=1e-6, atol=1e-7)
    for leaf in jax.tree.leaves((out_p, state_p.extra)):
      assert np.all(np.isfinite(np.asarray(leaf)))
    out = _vectors(tx, out_p, 0)
    mean_in = [np.mean(w, axis=0) for w in zip(*(_vectors(tx, grads, w) for w in range(N)))]
    total_out = out if total_out is None else [a + b for a, b in zip(total_out, out)]
    total_in = mean_in if total_in is None else [a + b for a, b in zip(total_in, mean_in)]
  for owner in jax.tree.leaves(state_p.extra):  # float32, the bucket's length, each worker its own chunk
    assert owner.dtype == jnp.float32
  memory = tx.method.memory
  if type(memory) is not Memory or not memory.enabled or memory.gamma != 1.0 or name in VOTES:
    return  # momentum memories (DGC, Signum, RedSync), scaled ones and votes: not a mean of what was sent
  # sum of outputs + mean worker residual + every owner's residual == mean of the gradients
  for i, b in enumerate(tx.method.buckets(params)):
    residual = np.mean([np.asarray(state_p.memory[i][w], np.float64) for w in range(N)], axis=0)
    owners = np.zeros_like(residual)
    if isinstance(b.exchange, ScatterExchange):
      owners = np.sum(np.asarray(state_p.extra[i], np.float64), axis=0)
      start = np.asarray(state0.extra[i])
      assert not np.any(start)
      # a selection hands what the owner did not select back to the workers (exact float32 values:
      # the owners keep nothing); any other codec's owner keeps what phase 2 did not send
      codec = b.exchange.codec(None)
      selects = isinstance(codec, ScatterCodec) and codec.selects
      assert np.any(owners) != selects, "the owners keep what phase 2 did not send"
    np.testing.assert_allclose(total_out[i] + residual + owners, total_in[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qsgd", "signsgd", "topk"])
def test_received_bytes_are_flat_in_the_number_of_workers(name):
  params = {"conv": jnp.zeros((3, 3, 16, 32)), "w": jnp.zeros((256, 64)), "b": jnp.zeros((64,))}
  measured = {n: pmap_wire_bytes(_scatter(name), params, n) for n in (2, 4, 8)}
  received = {n: m["received"] for n, m in measured.items()}
  gather = jaxcomp.METHODS[name](axis_name=AXIS)
  gathered = pmap_wire_bytes(gather, params, 8)
  assert received[8] <= 1.3 * received[4] and received[4] <= 1.6 * received[2], received
  assert received[8] <= 0.5 * gathered["received"], (received, gathered)
  for tx, m, n in ((_scatter(name), measured[8], 8), (_scatter(name), measured[4], 4), (gather, gathered, 8)):
    assert m["total"] == jaxcomp.wire_bytes(tx, params, workers=n), m  # handed: N + 1 chunk payloads
    by_kind = {}
    for kind, nbytes in jaxcomp.traffic(tx, params, n):  # the layout's collectives, per kind, as compiled
      by_kind[kind] = by_kind.get(kind, 0) + nbytes
    assert by_kind == {k: m[k] for k in by_kind} and sum(by_kind.values()) == m["total"], (by_kind, m)
  assert measured[8]["all-to-all"] > 0 and gathered["all-to-all"] == 0


@pytest.mark.parametrize("name", ["qsgd", "topk"])
def test_a_nan_skips_the_step_and_keeps_both_residuals(name):
  tx = _scatter(name)
  params = params_tree()
  state = init_stacked(tx, params)
  _, state = run_pmap(tx, worker_grads(params, seed=0), state)
  grads = worker_grads(params, seed=1)
  grads["dense"]["kernel"] = harness.set_at(grads["dense"]["kernel"], (3, 2, 1), jnp.nan)
  out, after = run_pmap(tx, grads, state)
  for leaf in jax.tree.leaves(out):
    assert np.all(np.isnan(np.asarray(leaf)))
  # the owners' kept as they were
  for a, b in zip(jax.tree.leaves(after.extra), jax.tree.leaves(state.extra)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for leaf in jax.tree.leaves(after.memory):
    assert np.all(np.isfinite(np.asarray(leaf)))
  out, _ = run_pmap(tx, worker_grads(params, seed=2), after)
  for leaf in jax.tree.leaves(out):
    assert np.all(np.isfinite(np.asarray(leaf)))


def test_resume_from_a_checkpoint_is_bitwise(tmp_path):
  tx = _scatter("qsgd")
  params = params_tree()
  state = init_stacked(tx, params)
  for step in range(2):
    _, state = run_pmap(tx, worker_grads(params, seed=step), state)
  checkpoint.save(str(tmp_path / "ckpt"), state)
  restored = checkpoint.restore(str(tmp_path / "ckpt"), state)
  for saved in (state, restored):
    out, _ = run_pmap(tx, worker_grads(params, seed=2), saved)
    if saved is state:
      reference = out
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_arguments_are_named():
  for factory in jaxcomp.METHODS.values():
    assert inspect.signature(factory).parameters["transport"].default == "gather"
  with pytest.raises(ValueError, match=r"transport must be one of \('gather', 'scatter'\)"):
    jaxcomp.qsgd(axis_name=AXIS, transport="ring")
  for name in NO_SCATTER:
    with pytest.raises(ValueError, match=f"not available for {name}.*transport='gather'"):
      jaxcomp.METHODS[name](axis_name=AXIS, transport="scatter")
  tx = jaxcomp.topk(axis_name=AXIS, transport="scatter")
  with pytest.raises(ValueError, match="workers=N"):
    jaxcomp.wire_bytes(tx, params_tree())
  with pytest.raises(ValueError, match="workers must be >= 1"):
    jaxcomp.wire_bytes(tx, params_tree(), workers=0)
  assert jaxcomp.configure(tx, transport="gather").transport == "gather"
  assert jaxcomp.configure(jaxcomp.topk(axis_name=AXIS), transport="scatter").transport == "scatter"
  with pytest.raises(ValueError, match="transport"):
    jaxcomp.staged([(0, tx), (10, jaxcomp.topk(axis_name=AXIS))])


@pytest.mark.parametrize("name", ["dgc", "redsync"])
def test_stages_share_their_selection_search_under_scatter(name, monkeypatch):
  """The stages of a schedule (DGC's warm-up, a ratio schedule of RedSync) estimate their thresholds
  once per phase, the running stage's ratio as data, as the gather does, and switch only on the
  payloads: a second stage adds a few reductions to one stage's 27 (whole stages switched: 26 more), and
  the staged exchange steps through the stages bit for bit as whole stages switched do."""
  params = params_tree()
  kw = {"warmup_steps": 0} if name == "dgc" else {}
  make = lambda: jaxcomp.staged([(0, _scatter(name, ratio=0.25, **kw)),
                                 (2, _scatter(name, ratio=0.05, **kw))])

  def reductions(tx):
    step = jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS)
    return step.lower(jaxcomp.per_worker(params, N), init_stacked(tx, params)).as_text().count(
        "stablehlo.reduce")

  one = reductions(_scatter(name, ratio=0.05, **kw))
  assert reductions(make()) - one < one / 4  # the second stage adds its payload's, not a search's

  def steps(tx):
    state, outs = init_stacked(tx, params), []
    for step in range(4):
      out, state = run_pmap(tx, worker_grads(params, seed=step), state)
      outs.append(out)
    return outs, state

  shared = steps(make())
  monkeypatch.setattr(ScatterExchange, "exchange_stages", Exchange.exchange_stages)
  whole = steps(make())
  for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(whole), strict=True):
    np.testing.assert_array_equal(a, b)


def test_psummed_methods_keep_their_all_reduce():
  params = params_tree()
  for name in PSUMMED:
    kw = {} if name == "none" else {"min_size": 1}
    gather = jaxcomp.METHODS[name](axis_name=AXIS, **kw)
    scatter = jaxcomp.METHODS[name](axis_name=AXIS, transport="scatter", **kw)
    assert jaxcomp.wire_bytes(scatter, params, workers=N) == jaxcomp.wire_bytes(gather, params)


@pytest.mark.parametrize("sizes, workers",
                         [((3000, 200, 7, 1), 8), ((128, 4096, 33), 3), ((50,), 8), ((9000,), 2)])
def test_chunk_segments_never_hold_two_leaves(sizes, workers):
  """Every chunk shares one layout, cut at every leaf boundary any chunk holds (by_leaf)."""
  offsets, at = [], 0
  for n in sizes:
    offsets.append(at)
    at += layout.padded(n, layout.ROW)
  segs = layout.Segments(tuple(offsets), tuple(sizes), tuple((n,) for n in sizes), layout.ROW)
  cs = layout.chunk_segments(segs, workers)
  c = cs.length
  assert c * workers >= segs.length and c % layout.ROW == 0 and cs.offsets[0] == 0
  assert sum(cs.sizes) == c and len(cs.sizes) <= 2 * len(sizes) + 1
  owner = np.full(c * workers, -1)  # the leaf of every entry of the padded bucket (-1: padding)
  for i, (o, n) in enumerate(zip(offsets, sizes)):
    owner[o:o + layout.padded(n, layout.ROW)] = i
  for j in range(workers):
    for o, n in zip(cs.offsets, cs.sizes):
      assert len(set(owner[j * c + o:j * c + o + n])) == 1, (j, o, n)
  one = layout.chunk_segments(segs, workers, by_leaf=False)
  assert one.sizes == (c,) and one.length == c


@pytest.mark.parametrize("name", ["onebit", "efsignsgd", "terngrad"])
def test_a_scale_never_mixes_leaves_of_a_chunk(name):
  """A 1e-6 leaf beside a 1.0 leaf in one chunk keeps its own scale (it took the chunk's: 1e5 too large)."""
  params = {"a": jnp.zeros((4000,)), "b": jnp.zeros((200,))}
  tx = _scatter(name, min_size=1)
  g = {"a": jnp.ones((N, 4000)), "b": 1e-6 * jnp.ones((N, 200))}
  out, _ = run_pmap(tx, g, init_stacked(tx, params))
  b = np.abs(np.asarray(out["b"])[0])
  assert b.max() <= 1e-5, b.max()
  assert b.max() > 0
