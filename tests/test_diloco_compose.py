"""DiLoCo composed: dense inside a node and DiLoCo between nodes, a fresh-process resume, optax wrappers.

The sharded path (``jaxcomp.data_parallel(param_specs=...)``) is not among them: its step keeps one copy
of the parameters per slow-axis group (``P()`` over the slow axis), while DiLoCo's replicas differ
between syncs (docs/diloco.md, Composition).
"""

import functools
import os
import signal
import subprocess
import sys

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import AXIS, N, pmap_scan, worker_grads
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxcomp

SLOW, FAST = "dcn", "ici"
AXES = (SLOW, FAST)
M, F = 2, 4
H = 3
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "diloco_resume.py")


def _params():
  return {"w": 1.0 + 0.01 * jnp.arange(40 * 24.0).reshape(40, 24) / 960, "b": jnp.full((24,), 1.5)}


@functools.lru_cache(maxsize=None)
def _two_level_run(steps):
  """DiLoCo over dcn (fp4), a dense mean over ici before AdamW: per device, the params after each step."""
  tx = jaxcomp.diloco(optax.chain(jaxcomp.none(axis_name=FAST), optax.adamw(1e-2)), sync_every=H,
                      compressor=jaxcomp.fp4(axis_name=SLOW, min_size=1), axis_name=SLOW)
  mesh = jax.make_mesh((M, F), AXES, axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:M * F])
  params = _params()
  grads = worker_grads(jax.tree.map(lambda p: jnp.zeros((steps,) + p.shape), params), seed=5)

  def run(p, s, g):
    def step(carry, g):
      p, s = carry
      u, s = tx.update(g, s, p)
      p = optax.apply_updates(p, u)
      return (p, s), (p, s.anchor)

    return jaxcomp.stacked(jax.lax.scan(step, (jaxcomp.local(p), jaxcomp.local(s)), jaxcomp.local(g))[1])

  f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P(AXES),) * 3, out_specs=P(AXES), check_vma=False))
  out = f(jaxcomp.per_worker(params, mesh, AXES), jaxcomp.per_worker(tx.init(params), mesh, AXES), grads)
  return jax.device_get(out)


def test_dense_inside_a_node_diloco_between_nodes():
  """Mesh 2 x 4 (dcn x ici), each device its own gradients: the 4 devices of a node hold the same bits at
  every step (the ici mean before AdamW); the two nodes differ between syncs and hold the shared anchor,
  bit for bit, after each (parameters away from zero)."""
  steps = 2 * H + 1
  ps, anchors = _two_level_run(steps)
  for p, a in zip(jax.tree.leaves(ps), jax.tree.leaves(anchors), strict=True):
    nodes = p.reshape((M, F) + p.shape[1:])
    np.testing.assert_array_equal(nodes, np.broadcast_to(nodes[:, :1], nodes.shape))  # within a node
    np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape))  # the anchor: shared
    for t in range(steps):
      if t % H == H - 1:
        np.testing.assert_array_equal(p[:, t], a[:, t])
      else:
        assert not np.array_equal(nodes[0, :, t], nodes[1, :, t]), t


def _phase(mode, directory):
  # both phases inherit the suite's compile flags (tests/conftest.py)
  proc = subprocess.Popen([sys.executable, SCRIPT, mode, str(directory)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=420)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  assert proc.returncode == 0, f"{mode} exited with {proc.returncode}:\n{out[-4000:]}"


@pytest.mark.slow
def test_resume_mid_period_in_a_fresh_process_is_bitwise(tmp_path):
  """DiLoCo (top-k), Streaming DiLoCo (P = 2, fp4; and with delay 2: saved between a fragment's send and
  its landing) and SparseLoCo under pmap, DiLoCo under shard_map, 8 workers, H = 4: saved after 3 steps
  (mid-period), restored in a new process, 3 more steps (a sync of every fragment among them) give the
  uninterrupted run's parameters bit for bit."""
  _phase("first", tmp_path)
  _phase("resume", tmp_path)
  reference, resumed = dict(np.load(tmp_path / "reference.npz")), dict(np.load(tmp_path / "resumed.npz"))
  assert sorted(resumed) == sorted(reference) and len({k.split("[")[0] for k in reference}) == 5
  for k, x in reference.items():
    assert np.all(np.isfinite(x)), k
  assert not [k for k in reference if not np.array_equal(reference[k], resumed[k])]


def test_multisteps_and_apply_if_finite_wrap_diloco():
  """optax.MultiSteps(diloco, k): k micro-batches make one inner step, so DiLoCo's H counts the outer
  steps (its sync after k * H micro-steps, every replica on the anchor); jaxcomp.apply_if_finite(diloco)
  skips, on every worker, a step whose gradient is NaN on one, and the run goes on (optax's is refused)."""
  params = {"w": 1.0 + jnp.zeros((16, 8)), "b": jnp.full((8,), 2.0)}
  grads = worker_grads(jax.tree.map(lambda p: jnp.zeros((8,) + p.shape), params), seed=6)
  tx = jaxcomp.diloco(optax.adamw(1e-2), sync_every=2, axis_name=AXIS)
  multi = optax.MultiSteps(tx, every_k_schedule=2)
  ps = pmap_scan(multi, params, grads)[0]
  for p in jax.tree.leaves(ps):
    for t in range(8):
      same = np.array_equal(p[:, t], np.broadcast_to(p[:1, t], p[:, t].shape))
      # 0: no inner step yet; 3 and 7 end inner steps 1 and 3 (syncs); 4 holds 3's parameters
      assert same == (t in (0, 3, 4, 7)), t
  np.testing.assert_array_equal(ps["w"][:, 0], np.broadcast_to(1.0, (N, 16, 8)))
  with pytest.raises(ValueError, match="jaxcomp.apply_if_finite"):  # optax's would hang: caught
    pmap_scan(optax.apply_if_finite(tx, 3), params, grads)
  finite = jaxcomp.apply_if_finite(tx, 3, axis_name=AXIS)
  bad = jax.tree.map(lambda g: harness.set_at(g, (2, 1), jnp.nan), grads)  # one worker's gradient at step 1
  got = pmap_scan(finite, params, bad)[0]
  for p in jax.tree.leaves(got):
    np.testing.assert_array_equal(p[:, 1], p[:, 0])  # the NaN step: skipped
    assert np.all(np.isfinite(p))
    np.testing.assert_array_equal(p[:, 2], np.broadcast_to(p[:1, 2], p[:, 2].shape))  # the sync after


@pytest.mark.parametrize("sharded", [False, True])
def test_data_parallel_keeps_a_replica_per_slow_worker(sharded):
  """data_parallel with DiLoCo over "dcn" on a 2 x 4 mesh (parameters whole, or sharded over "fsdp"):
  one replica per dcn worker, each the DiLoCo replica of a pmap over 2 workers whose gradient is the
  mean over that worker's 4 devices' rows (to float32 reduction order)."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((2, 4), ("dcn", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((16, 8)) * 0.1, jnp.float32), "b": jnp.zeros((8,))}
  xs = jnp.asarray(rng.standard_normal((5, 32, 16)), jnp.float32)
  ys = jnp.asarray(rng.standard_normal((5, 32, 8)), jnp.float32)

  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  def make_tx():  # top-k of a shard is not top-k of the leaf: sharded, the dense mean
    compressor = None if sharded else jaxcomp.topk(0.5, axis_name="dcn")
    return jaxcomp.diloco(optax.adamw(1e-2), sync_every=2, axis_name="dcn", compressor=compressor)

  specs = {"w": P(None, "fsdp"), "b": P()} if sharded else None
  dp = jaxcomp.data_parallel(loss_fn, make_tx(), mesh, param_specs=specs)
  p, s = dp.init(params)
  assert jax.tree.leaves(p)[0].shape[0] == 2
  tx = make_tx()

  def ref_step(p, s, batch):
    u, s = tx.update(jax.grad(loss_fn)(p, batch), s, p)
    return optax.apply_updates(p, u), s

  ref = jax.pmap(ref_step, axis_name="dcn", devices=jax.devices()[:2])
  rp, rs = jaxcomp.per_worker(params, 2), jaxcomp.per_worker(tx.init(params), 2)
  for t in range(5):
    p, s, _ = dp.step(p, s, (xs[t], ys[t]))
    rp, rs = ref(rp, rs, (xs[t].reshape(2, 16, 16), ys[t].reshape(2, 16, 8)))
    for got, want in zip(jax.tree.leaves(p), jax.tree.leaves(rp)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
  w = np.asarray(p["w"])
  assert not np.array_equal(w[0], w[1])  # step 5 is local: the replicas differ
