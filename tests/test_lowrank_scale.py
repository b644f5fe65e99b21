"""PowerSGD and ACP-SGD at any gradient scale (issue 22).

Against PyTorch's ``powerSGD_hook`` written in numpy (its epsilon 0, the
warm-start Q orthogonalized before it multiplies) at gradient scales 1 to
1e-7; outputs proportional to the gradient at scales 2^-27 to 1e4; a matrix
that is all zero for a step gives zeros (no NaN) and is sent again later;
a gradient of lower rank than the factors is projected, never overshot.
4 workers under ``jax.pmap``, several steps, so that the warm start and the
error feedback both matter.
"""

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import AXIS, init_stacked, run_pmap, worker_grads

import jaxcomp
from jaxcomp.transforms.lowrank import matrix_view

W = 4  # workers
STEPS = 4
SCALES = (2.0 ** -27, 1e-7, 1e-4, 1e3, 1e4)


def tree():
  """A dense layer, a conv kernel (HWIO, viewed as (72, 16)) and a bias; both matrices
  compressed up to rank 4.
  """
  return {"bias": jnp.zeros((16,), jnp.float32), "conv": jnp.zeros((3, 3, 8, 16), jnp.float32),
          "w": jnp.zeros((64, 32), jnp.float32)}


@functools.lru_cache(maxsize=None)
def transform(name: str, rank: int = 4):
  """One transform per (method, rank), so that run_pmap compiles its step once for the module."""
  return getattr(jaxcomp, name)(rank=rank, axis_name=AXIS)


def _grads(step, scale=1.0, zero=()):
  """Every worker's float32 gradients at ``step``, times ``scale``; the leaves in ``zero`` all zero."""
  g = worker_grads(tree(), seed=100 + step, n=W)
  return {k: np.zeros(v.shape, np.float32) if k in zero
             else (np.float32(scale) * np.asarray(v)).astype(np.float32)
          for k, v in g.items()}


def _run(tx, grads_per_step):
  """Worker 0's outputs (float64 leaves, in tree order) at each step."""
  state = init_stacked(tx, tree(), W)
  outs = []
  for g in grads_per_step:
    out, state = run_pmap(tx, g, state)
    outs.append([np.asarray(leaf[0], np.float64) for leaf in jax.tree.leaves(out)])
  return outs


def _rel(got, want):
  """max |got - want| / max |want| (0 when both are zero)."""
  scale = np.max(np.abs(want))
  err = np.max(np.abs(got - want))
  return err / scale if scale > 0 else err


# ----------------------------------------------------------------------------
# PyTorch's powerSGD_hook, in numpy (float64), on jaxcomp's matrix view.


def _torch_orthogonalize(m):
  """torch's ``_orthogonalize`` with its default epsilon 0: Gram-Schmidt up to rank 2, QR above."""
  m = m.copy()
  r = m.shape[1]
  if r > 2:
    return np.linalg.qr(m)[0]
  for i in range(r):
    m[:, i] /= np.linalg.norm(m[:, i])
    if i + 1 < r:
      m[:, i + 1:] -= (m[:, i] @ m[:, i + 1:]) * m[:, i:i + 1]
  return m


def _initial_qs(tx):
  """The initial Q ``(cols, r)`` of every compressed leaf (by leaf index), read from jaxcomp's state."""
  return harness.powersgd_initial_qs(tx, tree())


def torch_powersgd(q0, grads_per_step):
  """The mean each step, as ``powerSGD_hook`` computes it (error feedback and warm start on).

  Per compressed matrix M (this worker's gradient plus its error): Q <-
  orth(Q); P = M Q, summed over workers (not divided: it is orthogonalized
  next); P <- orth(P); Q = mean over workers of M^T P; output P Q^T; error
  M - P Q^T; Q is kept. Uncompressed leaves are the plain mean (torch also
  keeps their local-minus-mean in its error; its mean over workers is zero,
  so the next mean is the same).
  """
  leaves = jax.tree.leaves(tree())
  q = dict(q0)
  err = [0.0] * len(leaves)
  outs = []
  for grads in grads_per_step:
    out = []
    for i, (g, leaf) in enumerate(zip(jax.tree.leaves(grads), leaves)):
      g = np.asarray(g, np.float64)
      if i not in q:
        out.append(g.mean(axis=0))
        continue
      M = g.reshape((W,) + matrix_view(leaf.shape)) + err[i]
      Qo = _torch_orthogonalize(q[i])
      P = _torch_orthogonalize(np.sum(M @ Qo, axis=0))
      q[i] = np.mean(np.swapaxes(M, 1, 2) @ P, axis=0)
      approx = P @ q[i].T
      err[i] = M - approx
      out.append(approx.reshape(leaf.shape))
    outs.append(out)
  return outs


@pytest.mark.parametrize("rank", [2, 4])  # torch orthogonalizes by Gram-Schmidt at rank 2, by QR at 4
def test_powersgd_matches_torch_hook_at_small_scales(rank):
  tx = transform("powersgd", rank)
  q0 = _initial_qs(tx)
  assert sorted(q0) == [1, 2]  # conv and w compressed, the bias dense
  assert {q.shape[1] for q in q0.values()} == {rank}
  for scale in (1.0, 1e-4, 1e-7):
    grads = [_grads(step, scale) for step in range(STEPS)]
    got = _run(tx, grads)
    want = torch_powersgd(q0, grads)
    for step in range(STEPS):
      for g, w in zip(got[step], want[step]):
        assert np.all(np.isfinite(g))
        assert _rel(g, w) <= 1e-4, (scale, step, _rel(g, w))


# ----------------------------------------------------------------------------
# Scale equivariance, zero matrices.


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_outputs_are_proportional_to_the_gradient_at_any_scale(name):
  tx = transform(name)
  steps = STEPS + 1
  # Step 0: the conv kernel is zero on every worker (and its residual is still zero); step 2: w is
  # zero on every worker (its residual is not).
  zero = {0: ("conv",), 2: ("w",)}
  base = _run(tx, [_grads(step, 1.0, zero.get(step, ())) for step in range(steps)])
  mean = [[np.asarray(x, np.float64).mean(0) for x in jax.tree.leaves(_grads(step))] for step in range(steps)]
  np.testing.assert_array_equal(base[0][1], 0.0)
  for step in range(1, steps):  # the zero step did not stop the conv kernel from being sent
    assert np.linalg.norm(base[step][1]) > 0.05 * np.linalg.norm(mean[step][1]), step
  for c in SCALES:
    got = _run(tx, [_grads(step, c, zero.get(step, ())) for step in range(steps)])
    np.testing.assert_array_equal(got[0][1], 0.0)
    for step in range(steps):
      for leaf, (g, b) in enumerate(zip(got[step], base[step])):
        assert np.all(np.isfinite(g)), (c, step, leaf)
        assert _rel(g, c * b) <= 1e-5, (c, step, leaf, _rel(g, c * b))


# ----------------------------------------------------------------------------
# Gradients of lower rank than the factors.


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_gradient_of_lower_rank_is_projected_not_overshot(name):
  """Every worker sends the same rank-1 matrices (the factors' later columns are then rounding noise).

  Each step's output must be an orthogonal projection of the matrix plus
  residual X (PowerSGD: onto P's columns, ACP-SGD: onto P's or Q's): no
  larger than X, and orthogonal to what stays behind. PowerSGD's P then
  spans X's columns, so it gives X itself. A one-pass Gram-Schmidt without a
  floor normalized that noise into columns that were not orthogonal: the
  output overshot X by up to 3 times.
  """
  tx = transform(name)
  rng = np.random.default_rng(7)
  grads = []
  for step in range(STEPS):
    g = {}
    for k, leaf in tree().items():
      if leaf.ndim < 2:
        g[k] = np.broadcast_to(rng.normal(size=leaf.shape), (W,) + leaf.shape).astype(np.float32)
        continue
      a, b = matrix_view(leaf.shape)
      m = (rng.normal(size=(a, 1)) @ rng.normal(size=(1, b))).astype(np.float32)
      g[k] = np.broadcast_to(m.reshape(leaf.shape), (W,) + leaf.shape).copy()
    grads.append(g)
  outs = _run(tx, grads)
  residual = [0.0, 0.0, 0.0]
  for step in range(STEPS):
    for leaf, (g, out) in enumerate(zip(jax.tree.leaves(grads[step]), outs[step])):
      if leaf == 0:  # the bias: dense
        continue
      x = np.asarray(g[0], np.float64) + residual[leaf]
      n2 = np.sum(x * x)
      assert np.sum(out * out) <= n2 * (1 + 1e-4), (step, leaf)
      assert abs(np.sum((x - out) * out)) <= 1e-4 * n2, (step, leaf)
      if name == "powersgd":
        assert _rel(out, x) <= 1e-4, (step, leaf, _rel(out, x))
      residual[leaf] = x - out
