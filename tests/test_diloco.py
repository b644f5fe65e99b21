"""DiLoCo, Streaming DiLoCo and SparseLoCo (jaxcomp/training/diloco.py); low-bit codecs (fp4.py)."""

import pathlib
import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
  AXIS,
  N,
  digits,
  digits_accuracy,
  local_round_trip,
  pmap_scan,
  pmap_wire_bytes,
  worker_grads,
)

import jaxcomp
from jaxcomp.training.diloco import fragment_leaves, leaf_costs, sync_table
from jaxcomp.transforms.fp4 import E2M1, chunked_topk, fp4_exponent


def _tree():
  return {"a": jnp.zeros((6, 5)), "b": jnp.zeros((7,)), "c": jnp.zeros((3, 4)), "d": jnp.zeros((9,))}


def _grads(params, steps, seed=0, scale=1.0):
  g = worker_grads(jax.tree.map(lambda p: jnp.zeros((steps,) + p.shape), params), seed=seed)
  return jax.tree.map(lambda x: x * scale, g)


def test_sync_every_one_dense_outer_sgd_one_is_data_parallel_sgd_bit_for_bit():
  """H = 1, dense mean, outer sgd(1): each step is plain data-parallel SGD on the mean gradient (dyadic
  values: every operation is exact, so the two must agree bit for bit)."""
  params = jax.tree.map(lambda p: p + 0.25, _tree())
  grads = jax.tree.map(lambda g: jnp.round(g * 8) / 8, _grads(params, 3))
  tx = jaxcomp.diloco(optax.sgd(0.5), optax.sgd(1.0), sync_every=1, axis_name=AXIS)
  ps, _ = pmap_scan(tx, params, grads)
  expect = params
  for t in range(3):
    expect = jax.tree.map(lambda p, g: p - 0.5 * np.mean(g[:, t], axis=0), expect, grads)
    for got, want in zip(jax.tree.leaves(ps), jax.tree.leaves(expect)):
      np.testing.assert_array_equal(got[:, t], np.broadcast_to(want, got[:, t].shape))


@pytest.mark.parametrize("compressor,fragments", [("topk", 1), ("fp4", 2)])
def test_replicas_bit_identical_after_every_sync(compressor, fragments):
  """8 workers, different gradients, AdamW inside: after each sync every replica holds the anchor, bit for
  bit (parameters away from zero: Sterbenz), the anchor is the same on every worker at every step, and
  between syncs the replicas move apart. Streaming (P = 2, fp4) re-anchors one fragment at a time."""
  h, steps = 4, 9
  params = jax.tree.map(lambda p: p + 1.0 + 0.1 * jnp.arange(p.size).reshape(p.shape) / p.size, _tree())
  comp = jaxcomp.topk(0.3, axis_name=AXIS) if compressor == "topk" else jaxcomp.fp4(axis_name=AXIS)
  tx = jaxcomp.diloco(optax.adamw(1e-2), sync_every=h, compressor=comp, axis_name=AXIS, fragments=fragments)
  ps, states = pmap_scan(tx, params, _grads(params, steps, seed=1))
  table = sync_table(h, fragments)
  frags = fragment_leaves(leaf_costs(comp, jax.tree.leaves(params)), fragments)
  for i, (p, a) in enumerate(zip(jax.tree.leaves(ps), jax.tree.leaves(states.anchor))):
    frag = next(f for f, idx in enumerate(frags) if i in idx)
    np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape))  # the anchor: shared at every step
    for t in range(steps):
      if table[t % h] == frag:  # this leaf's sync: every replica on the anchor
        np.testing.assert_array_equal(p[:, t], a[:, t])
      else:
        assert not np.array_equal(p[:, t], np.broadcast_to(p[:1, t], p[:, t].shape)), (i, t)
  assert [table[t % h] for t in range(h)] == ([2, 1, 2, 0] if fragments == 2 else [1, 1, 1, 0])


def test_replicas_within_half_ulp_where_a_parameter_crosses_zero():
  """Parameters at zero: a sync lands each replica within half an ulp of ``anchor - params`` (plus the
  sum's rounding) of the anchor, and never further however many periods run (the anchor is the model)."""
  h, steps = 2, 8
  params = _tree()
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=h, axis_name=AXIS)
  ps, states = pmap_scan(tx, params, _grads(params, steps, seed=2))
  for p, a in zip(jax.tree.leaves(ps), jax.tree.leaves(states.anchor)):
    for t in range(h - 1, steps, h):
      before = p[:, t - 1]
      bound = 0.5 * np.spacing(np.abs(a[:, t] - before)) + 0.5 * np.spacing(np.abs(a[:, t]))
      assert np.all(np.abs(p[:, t] - a[:, t]) <= bound), t


def test_pseudo_gradient_error_feedback_conserves_what_was_not_sent():
  """One worker, top-k: at each sync ``sent + new residual == pseudo-gradient + old residual`` (float32
  rounding), with ``sent`` read off the anchor's step (outer sgd(1): ``anchor' = anchor - mean``)."""
  params = {"w": jnp.ones((10, 10)), "b": jnp.ones((12,))}
  comp = jaxcomp.topk(0.1)
  tx = jaxcomp.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, compressor=comp)
  state = tx.init(params)
  step = jax.jit(tx.update)
  residual = jax.tree.map(jnp.zeros_like, params)
  for t in range(6):
    g = jax.tree.map(lambda p, k=t: jax.random.normal(jax.random.PRNGKey(k), p.shape), params)
    u, new = step(g, state, params)
    if t % 2 == 1:
      delta = jax.tree.map(lambda a, p, du: a - (p + du), state.anchor, params, jax.tree.map(
          lambda x: -0.1 * x, g))
      frag = jax.tree.leaves(params)
      sent = [a - b for a, b in zip(jax.tree.leaves(state.anchor), jax.tree.leaves(new.anchor))]
      res = jaxcomp.memory_tree(comp, new.compressor[0], frag)
      old = jax.tree.leaves(residual)
      for s, r, d, o in zip(sent, res, jax.tree.leaves(delta), old):
        np.testing.assert_allclose(s + r, d + o, rtol=0, atol=2e-6)
        assert np.count_nonzero(s) == int(np.ceil(0.1 * s.size))
      residual = jax.tree.unflatten(jax.tree.structure(params), res)
    else:
      np.testing.assert_array_equal(jax.tree.leaves(new.anchor)[0], jax.tree.leaves(state.anchor)[0])
    params, state = optax.apply_updates(params, u), new


def test_fragments_are_balanced_strided_for_equal_leaves_and_sync_at_their_offsets():
  """P = 3, H = 6: leaves dealt largest first to the lightest fragment (equal leaves: i % P, the strided
  pattern); fragment p moves its anchor only after the steps t with (t + 1) % 6 == 2p; bytes_at gives 0
  on local steps and the fragment's bytes on its sync."""
  assert fragment_leaves([5] * 7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
  sizes = [64, 4096, 64, 4096, 16384, 16384, 6592, 4096, 6592]  # a transformer's mix: about a third each
  frags = fragment_leaves(sizes, 3)
  assert sorted(i for f in frags for i in f) == list(range(9))
  assert max(sum(sizes[i] for i in f) for f in frags) <= sum(sizes) / 3 + max(sizes)
  assert [sum(sizes[i] for i in f) for f in frags] == [20480, 20480, 17408]  # 16384 + 4096 | ... | the rest
  params = {k: jnp.ones((128 * n,)) for k, n in zip("abcde", (4, 5, 6, 7, 8))}  # whole rows: bytes ~ size
  costs = leaf_costs(jaxcomp.none(), jax.tree.leaves(params))
  assert costs == [512 * n for n in (4, 5, 6, 7, 8)]
  assert fragment_leaves(costs, 3) == [[4], [0, 3], [1, 2]]  # 8 | 7 + 4 | 6 + 5
  assert fragment_leaves(leaf_costs(jaxcomp.none(), [jnp.ones((n,)) for n in (4, 5, 6, 7, 8)]), 3) == [
      [0, 3], [1, 4], [2]]  # leaves padded to one row of 128 cost the same: strided
  tx = jaxcomp.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=6, fragments=3)
  state = tx.init(params)
  step = jax.jit(tx.update)
  moved_at = {i: [] for i in range(5)}
  for t in range(12):
    g = jax.tree.map(lambda p: jnp.full(p.shape, 1.0), params)
    u, new = step(g, state, params)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(state.anchor), jax.tree.leaves(new.anchor))):
      if not np.array_equal(a, b):
        moved_at[i].append(t)
    params, state = optax.apply_updates(params, u), new
  assert moved_at == {0: [1, 7], 1: [3, 9], 2: [3, 9], 3: [1, 7], 4: [5, 11]}
  leaves = jax.tree.leaves(params)
  dense = [jaxcomp.wire_bytes(jaxcomp.none(), [leaves[i] for i in idx]) for idx in fragment_leaves(costs, 3)]
  assert [tx.bytes_at(t, params) for t in range(6)] == [0, dense[1], 0, dense[2], 0, dense[0]]
  assert sum(dense) == jaxcomp.wire_bytes(tx, params)  # a period sends a full sync's bytes, in thirds


@pytest.mark.usefixtures("every_leaf")  # its trees are small on purpose: compress every leaf
def test_fp4_round_trip_bound_grid_and_wire_bytes():
  """E2M1 with a power-of-two scale per 32: grid values return exactly, the error is at most 2**e
  (a fifth of |x| where |x| >= 2**e), and wire_bytes is n/2 + n/32 (measured from the compiled step)."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(1024) * np.repeat(2.0 ** rng.integers(-20, 20, 32), 32)).astype(np.float32)
  x[:8] = E2M1 * 2.0 ** -3  # an exact grid block: max 6/8, scale 2**-3
  tx = jaxcomp.fp4(error_feedback=False)
  out, _ = local_round_trip(tx, {"x": x}, tx.init({"x": x}))
  out = np.asarray(out["x"])
  np.testing.assert_array_equal(out[:8], x[:8])
  e = np.asarray(fp4_exponent(jnp.max(jnp.abs(x.reshape(-1, 32)), axis=1)))
  unit = np.repeat(2.0 ** e, 32)
  assert np.all(np.abs(out - x) <= unit)
  big = np.abs(x) >= unit
  assert np.all(np.abs(out - x)[big] <= np.abs(x)[big] / 5)
  assert np.all(np.sign(out) * np.sign(x) >= 0)
  params = {"w": jnp.zeros((40, 24)), "b": jnp.zeros((24,))}
  txd = jaxcomp.fp4(axis_name=AXIS)
  n = 1024 + 128  # each leaf padded to a multiple of 128
  assert jaxcomp.wire_bytes(txd, params) == n // 2 + n // 32 + 4  # + the non-finite flag
  assert pmap_wire_bytes(txd, params)["total"] == jaxcomp.wire_bytes(txd, params)


def test_fp4_mean_of_decodes_and_error_feedback():
  """Under pmap the output is the mean of each worker's local decode; with error feedback the residual is
  what the decode missed (decode + residual == gradient)."""
  params = {"w": jnp.zeros((40, 24))}
  grads = worker_grads(params, seed=3)
  tx = jaxcomp.fp4(axis_name=AXIS)
  state = jaxcomp.per_worker(tx.init(params), N)
  out, new = jax.pmap(tx.update, axis_name=AXIS)(grads, state)
  local = jaxcomp.fp4()
  decodes = [local_round_trip(local, jax.tree.map(lambda g, w=w: g[w], grads), local.init(params))
             for w in range(N)]
  mean = np.mean([np.asarray(d[0]["w"]) for d in decodes], axis=0)
  np.testing.assert_allclose(np.asarray(out["w"][0]), mean, rtol=0, atol=1e-6)
  for w in range(N):
    res = jaxcomp.memory_tree(local, decodes[w][1], params)["w"]
    np.testing.assert_allclose(np.asarray(decodes[w][0]["w"]) + res, grads["w"][w], rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 4])
def test_chunked_topk_low_bit_values_and_decaying_residual(bits):
  """k per chunk, signs kept, 2-bit: at most two magnitudes per chunk; the residual follows
  ``x = decay * e + g``, ``e <- x - sent``; wire bytes are offsets + values + per-chunk scales."""
  params = {"w": jnp.zeros((1024,))}
  tx = chunked_topk(density=0.05, bits=bits, chunk=256, decay=0.5)
  state = tx.init(params)
  e = np.zeros(1024, np.float32)
  for t in range(2):
    g = np.asarray(jax.random.normal(jax.random.PRNGKey(t), (1024,)))
    out, state = local_round_trip(tx, {"w": g}, state)
    sent = np.asarray(out["w"])
    x = 0.5 * e + g
    e = np.asarray(jaxcomp.memory_tree(tx, state, params)["w"])
    np.testing.assert_allclose(sent + e, x, rtol=0, atol=1e-6)
    for c in range(4):
      chunk_sent, chunk_x = sent[c * 256:(c + 1) * 256], x[c * 256:(c + 1) * 256]
      nz = np.flatnonzero(chunk_sent)
      assert len(nz) == 13
      assert set(nz) == set(np.argsort(-np.abs(chunk_x))[:13])
      assert np.all(np.sign(chunk_sent[nz]) == np.sign(chunk_x[nz]))
      if bits == 2:
        assert len(np.unique(np.abs(chunk_sent[nz]))) <= 2
  values = {2: 4 * 2 * 4 + 4 * 13 // 4, 4: 4 + 4 * 13 // 2}[bits]  # per-chunk scales + packed codes
  assert jaxcomp.wire_bytes(tx, params) == 4 * 13 + values


@pytest.mark.parametrize("mean", ["workers", "senders"])
def test_chunked_topk_mean_over_workers_or_over_the_senders_of_each_entry(mean):
  """8 workers, float32 values: each entry of the mean is the sum of what the workers sent there divided
  by 8 ("workers") or by the number of workers that sent it ("senders", SparseLoCo's reference); entries
  nobody sent are 0."""
  params = {"w": jnp.zeros((512,))}
  tx = chunked_topk(density=0.05, bits=32, chunk=128, decay=1.0, axis_name=AXIS, mean=mean)
  grads = worker_grads(params, seed=4)
  state = jaxcomp.per_worker(tx.init(params), N)
  out, state = jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS)(grads, state)
  g = np.asarray(grads["w"])
  sent = np.zeros_like(g)
  for w in range(N):
    for c in range(4):
      top = c * 128 + np.argsort(-np.abs(g[w, c * 128:(c + 1) * 128]))[:7]
      sent[w, top] = g[w, top]
  senders = np.count_nonzero(sent, axis=0)
  want = sent.sum(0) / (np.maximum(senders, 1) if mean == "senders" else N)
  assert np.any(senders > 1) and np.any(senders == 1)
  for w in range(N):
    np.testing.assert_allclose(out["w"][w], want, rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match=r"mean must be one of \('workers', 'senders'\), got mean='all'"):
    chunked_topk(axis_name=AXIS, mean="all")


def test_sparseloco_diloco_and_streaming_train_the_digits_mlp_close_to_dense_data_parallel():
  """8 workers, 320 inner AdamW steps, H = 8: DiLoCo (dense), SparseLoCo (5% per chunk of 256, 2 bits) and
  Streaming DiLoCo (P = 4, fp4) reach the held-out accuracy of data-parallel AdamW within 3 points (0.975
  here; the workers without any sync reach 0.936). Replicas are checked equal after the last step (a sync)
  except for streaming, whose last step syncs one fragment."""
  data = digits()
  dense = digits_accuracy(optax.chain(jaxcomp.none(axis_name=AXIS), optax.adamw(3e-3)), data, 320)
  dil = digits_accuracy(jaxcomp.diloco(optax.adamw(3e-3), sync_every=8, axis_name=AXIS), data, 320,
                        replica_atol=1e-6)
  sparse = digits_accuracy(jaxcomp.sparseloco(optax.adamw(3e-3), sync_every=8, axis_name=AXIS,
                                              density=0.05, chunk=256), data, 320, replica_atol=1e-6)
  streaming = jaxcomp.diloco(optax.adamw(3e-3), sync_every=8, axis_name=AXIS, fragments=4,
                             compressor=jaxcomp.fp4(axis_name=AXIS))
  stream = digits_accuracy(streaming, data, 320, replica_atol=1.0)
  assert dense > 0.9, dense
  for acc in (dil, sparse, stream):
    assert acc >= dense - 0.03, (dil, sparse, stream, dense)


def test_checkpoint_mid_period_resumes_bitwise(tmp_path):
  """The state is arrays only: save (params, state) mid-period with jaxcomp.checkpoint, restore into a
  fresh init, and the run continues bit for bit (inner Adam, outer Nesterov, top-k residual)."""
  params = {"w": jnp.ones((10, 10)), "b": jnp.ones((12,))}
  tx = jaxcomp.diloco(optax.adam(1e-2), sync_every=4, compressor=jaxcomp.topk(0.2))
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(tx.init(params)))
  step = jax.jit(tx.update)

  def run(params, state, ts):
    for t in ts:
      g = jax.tree.map(lambda p, k=t: jax.random.normal(jax.random.PRNGKey(k), p.shape), params)
      u, state = step(g, state, params)
      params = optax.apply_updates(params, u)
    return params, state

  mid = run(params, tx.init(params), range(6))  # 6 steps: a sync at step 3, mid-period now
  jaxcomp.checkpoint.save(str(tmp_path / "ckpt"), mid)
  restored = jaxcomp.checkpoint.restore(str(tmp_path / "ckpt"), (params, tx.init(params)))
  want = run(*mid, range(6, 12))
  got = run(*restored, range(6, 12))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("call,error,match", [
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=0), ValueError, r"sync_every must be >= 1"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=4, fragments=0), ValueError,
     r"fragments must be in \[1, 4\]"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=4, fragments=5), ValueError,
     r"fragments must be in \[1, 4\]"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), compressor=jaxcomp.topk(axis_name="dcn"), axis_name="data"),
     ValueError, r"compressor must be built with diloco's axis_name='data'"),
    (lambda: jaxcomp.diloco(optax.sgd(0.1), compressor=optax.sgd(0.1)), TypeError,
     r"compressor must be a jaxcomp"),
    (lambda: jaxcomp.sparseloco(optax.sgd(0.1), density=0.0), ValueError, r"density must be in \(0, 1\]"),
    (lambda: jaxcomp.sparseloco(optax.sgd(0.1), density=1.5), ValueError, r"density must be in \(0, 1\]"),
    (lambda: jaxcomp.sparseloco(optax.sgd(0.1), bits=3), ValueError, r"bits must be one of \(2, 4, 32\)"),
    (lambda: jaxcomp.sparseloco(optax.sgd(0.1), decay=1.5), ValueError, r"decay must be in \[0, 1\]"),
    (lambda: jaxcomp.fp4(block=16), ValueError, r"block must be one of \(32, 64, 128, None\)"),
])
def test_errors_name_the_argument_and_the_allowed_values(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_update_needs_params_and_fragments_at_most_the_leaves():
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=4, fragments=3)
  with pytest.raises(ValueError, match=r"fragments must be at most the number of parameter leaves \(2\)"):
    tx.init({"a": jnp.zeros(3), "b": jnp.zeros(4)})
  tx = jaxcomp.diloco(optax.sgd(0.1))
  params = {"a": jnp.zeros(3)}
  with pytest.raises(ValueError, match="diloco needs the parameters"):
    tx.update(params, tx.init(params))


def test_docs_example_runs():
  """The usage block of docs/diloco.md, as written."""
  text = (pathlib.Path(__file__).parents[1] / "docs" / "diloco.md").read_text()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  exec(compile(code, "docs/diloco.md", "exec"), {})


@pytest.mark.parametrize("delay,alpha", [(0, 0.0), (1, 0.5)])
def test_shard_map_equals_pmap(delay, alpha):
  """The same run under jax.jit(jax.shard_map) over a 1-D mesh (JAX's default check_vma) gives pmap's
  parameters bit for bit, with and without the overlap."""
  from harness import mesh
  from jax.sharding import PartitionSpec as P

  params = jax.tree.map(lambda p: p + 1.0, _tree())
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=2, compressor=jaxcomp.topk(0.3, axis_name=AXIS),
                      axis_name=AXIS, delay=delay, alpha=alpha)
  grads = _grads(params, 4, seed=4)
  want, _ = pmap_scan(tx, params, grads)

  def run(params, state, grads):
    def step(carry, g):
      params, state = carry
      u, state = tx.update(g, state, params)
      params = optax.apply_updates(params, u)
      return (params, state), params

    out = jax.lax.scan(step, (jaxcomp.local(params), jaxcomp.local(state)), jaxcomp.local(grads))[1]
    return jaxcomp.stacked(out)

  m = mesh()
  f = jax.jit(jax.shard_map(run, mesh=m, in_specs=(P(AXIS), P(AXIS), P(AXIS)), out_specs=P(AXIS),
                            check_vma=False))
  got = f(jaxcomp.per_worker(params, m, AXIS), jaxcomp.per_worker(tx.init(params), m, AXIS), grads)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(jax.device_get(got)), strict=True):
    np.testing.assert_array_equal(a, b)


def test_non_finite_sync_keeps_the_anchor_and_outer_state():
  """A NaN gradient on one of 8 workers: its parameters turn NaN, the sync's mean is NaN on every worker,
  so the anchor and outer state stay as they were (finite, shared) and the finite replicas land back on
  the old anchor; the NaN replica stays NaN (an added update cannot repair it: jaxcomp.apply_if_finite
  around diloco skips such a step, tests/test_diloco_compose.py)."""
  params = jax.tree.map(lambda p: p + 1.0, _tree())
  grads = jax.tree.map(lambda g: harness.set_at(g, (3, 0), jnp.nan), _grads(params, 4, seed=7))
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=2, axis_name=AXIS)
  ps, states = pmap_scan(tx, params, grads)
  for p, a, p0 in zip(jax.tree.leaves(ps), jax.tree.leaves(states.anchor), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.broadcast_to(p0, a.shape))  # both syncs skipped
    assert np.isnan(p[3]).all()
    finite = np.delete(p[:, 1], 3, axis=0)
    np.testing.assert_array_equal(finite, np.broadcast_to(p0, finite.shape))  # back on the old anchor
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(states.outer))


_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def _computations(hlo: str) -> dict:
  """Each computation of an HLO module's text: name -> body."""
  out, name, body = {}, None, []
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      name, body = head.group(1), []
    elif line.startswith("}") and name is not None:
      out[name] = "\n".join(body)
      name = None
    elif name is not None:
      body.append(line)
  return out


def _reachable(comps: dict, root: str) -> set:
  seen, todo = set(), [root]
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    todo.extend(re.findall(r"%([\w.\-]+)", " ".join(re.findall(
        r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}]*)\}?", comps[c]))))
  return seen


@pytest.mark.parametrize("fragments", [1, 2])
def test_local_steps_run_no_collective(fragments):
  """The compiled update: every collective sits in a sync branch of the step's switch; the local branch
  (the last) and the code outside the switch reach none."""
  params = _tree()
  tx = jaxcomp.diloco(optax.adamw(1e-3), sync_every=4, axis_name=AXIS, fragments=fragments,
                      compressor=jaxcomp.topk(0.1, axis_name=AXIS))
  state = jaxcomp.per_worker(tx.init(params), N)
  step = jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=AXIS)
  hlo = step.lower(jaxcomp.per_worker(params, N), state, jaxcomp.per_worker(params, N)).compile().as_text()
  comps = _computations(hlo)
  entry = next(name for name in comps if re.search(rf"^ENTRY %?{re.escape(name)} ", hlo, re.M))
  switches = re.findall(r"conditional\(.*branch_computations=\{([^}]*)\}", hlo)
  assert switches, "the step count should pick a branch of a switch"
  branches = [re.findall(r"%([\w.\-]+)", s) for s in switches]
  with_collectives = {c for c in comps if _COLLECTIVE.search(comps[c])}
  assert with_collectives, "a sync must communicate"
  # the send switch: the one whose branches reach collectives (the landing switch's reach none)
  main = [b for b in branches if any(_reachable(comps, c) & with_collectives for c in b)]
  assert len(main) == 1 and len(main[0]) == fragments + 1, main
  main = main[0]
  local = _reachable(comps, main[-1])
  assert not local & with_collectives, "the local branch reaches a collective"
  syncs = set().union(*(_reachable(comps, b) for b in main[:-1]))
  outside = _reachable(comps, entry) - syncs - local
  # computations reached from the entry other than through the switch's sync branches
  entry_only = {c for c in outside if c not in syncs}
  assert not entry_only & with_collectives, "a collective runs outside the sync branches"
