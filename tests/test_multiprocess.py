"""Across processes: 2 processes x 2 CPU devices with jax.distributed == 1 process x 4 devices.

One ``jaxcomp.training.launch.launch`` job (a free port on 127.0.0.1, a timeout, every
process killed at the end) runs this file as a script in 2 processes; each
trains a small model for a few steps with topk, powersgd and signsgd (each
before ``sgd``) and with the complete optimizers onebit_adam, zero_one_adam
and demo (past their warm-ups: 1-bit momentum, local steps and syncs, DCT
top-k) under ``jax.pmap`` over the job's 4 devices and saves its replicas. The test
process runs the same training on 4 of its 8 devices and compares.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp

METHODS = ("topk", "powersgd", "signsgd", "onebit_adam", "zero_one_adam", "demo")
WORKERS, PROCESSES = 4, 2
STEPS = 6
# gloo's float all-reduce adds in another order than XLA's in-process one, so
# methods that psum floats agree to rounding; gathered payloads (top-k values,
# sign bits) are combined identically and agree bit for bit.
# The Adam optimizers' warm-ups average the gradient densely (a float psum) too.
FLOAT_PSUM = ("powersgd", "onebit_adam", "zero_one_adam")
# After local steps, a sync moves each replica by ``anchor - params``: a parameter that crossed
# zero (local moves here reach 0.5) lands within half an ulp of that move from the shared
# anchor (jaxcomp.zero_one_adam's docstring), in one process as in two: 1e-6 bounds it.
LANDS_ON_ANCHOR = ("zero_one_adam",)
TIMEOUT_S = 600  # generous: the shared CI machine can be slow; a hang still ends


def _problem():
  """Initial parameters and each worker's target, shaped like a small model."""
  shapes = {"conv": (3, 3, 4, 8), "dense": (40, 24), "bias": (24,), "scale": ()}
  rng = np.random.default_rng(0)
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
  targets = {k: rng.standard_normal((WORKERS,) + s).astype(np.float32) for k, s in shapes.items()}
  return params, targets


def _optimizer(method: str):
  """``chain(method, sgd)``, or one of the complete Adam optimizers set to leave its warm-up in STEPS."""
  if method == "onebit_adam":  # exact Adam for 2 steps, then the 1-bit momentum over the scatter exchange
    return jaxcomp.onebit_adam(0.01, freeze_step=2, axis_name="data", min_size=1)
  if method == "zero_one_adam":  # steps: dense, dense, 1-bit, sync, local, sync (adam.zero_one_rounds)
    return jaxcomp.zero_one_adam(0.01, var_freeze_step=3, var_update_scaler=2, local_step_scaler=1,
                                 local_step_clipper=2, axis_name="data", min_size=1)
  if method == "demo":
    return jaxcomp.demo(0.01, compression_topk=4, compression_chunk=8, axis_name="data")
  # min_size=1: every leaf compressed, whatever default the two sides run with.
  return optax.chain(jaxcomp.METHODS[method](axis_name="data", min_size=1), optax.sgd(0.1, momentum=0.9))


def _train(method: str, targets_local, local: int):
  """STEPS steps of ``method``'s optimizer under pmap over all devices; this process's replicas."""
  params, _ = _problem()
  tx = _optimizer(method)

  def step(p, s, t):
    g = jax.tree.map(lambda p, t: p - t + 0.1 * jnp.sin(3.0 * p), p, t)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  devices = jax.devices()[:WORKERS]
  p_step = jax.pmap(step, axis_name="data", devices=devices)
  P = jaxcomp.per_worker(params, local)
  S = jaxcomp.per_worker(tx.init(params), local)
  for _ in range(STEPS):
    P, S = p_step(P, S, targets_local)
  return jax.tree.map(lambda a: np.concatenate([np.asarray(s.data) for s in a.addressable_shards]), P)


def _worker(out_dir: str) -> None:
  import jaxcomp.training.launch

  jaxcomp.training.launch.initialize()
  assert jax.device_count() == WORKERS, jax.devices()
  pid, local = jax.process_index(), jax.local_device_count()
  _, targets = _problem()
  mine = jax.tree.map(lambda t: t[pid * local:(pid + 1) * local], targets)
  for method in METHODS:
    replicas = _train(method, mine, local)
    np.savez(os.path.join(out_dir, f"{method}_p{pid}.npz"),
             **{k: v for k, v in replicas.items()})
  print(f"process {pid} done", flush=True)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  import jaxcomp.training.launch

  out = tmp_path_factory.mktemp("multiprocess")
  results = jaxcomp.training.launch.launch([os.path.abspath(__file__), str(out)], num_processes=PROCESSES,
                                  local_devices=WORKERS // PROCESSES, timeout_s=TIMEOUT_S,
                                  stop_after_failure_s=20)
  for r in results:
    assert r.returncode == 0, (
        f"process {r.process_id}: returncode {r.returncode} (None: killed at the timeout)\n"
        f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
  return out


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_two_processes_equal_one(launched, method):
  _, targets = _problem()
  reference = _train(method, targets, WORKERS)  # 1 process, 4 of the 8 test devices
  per_process = [dict(np.load(launched / f"{method}_p{i}.npz")) for i in range(PROCESSES)]
  for k, ref in reference.items():
    got = np.concatenate([p[k] for p in per_process])  # (4, ...): every replica of the job
    for where, replicas in (("1 process", ref), ("2 processes", got)):
      first = np.broadcast_to(replicas[:1], replicas.shape)
      if method in LANDS_ON_ANCHOR:
        np.testing.assert_allclose(replicas, first, rtol=0, atol=1e-6, err_msg=f"{method}/{k}, {where}")
      else:
        np.testing.assert_array_equal(replicas, first, err_msg=f"{method}/{k}: replicas differ, {where}")
    msg = f"{method}/{k}: 2 processes x 2 devices != 1 process x 4"
    if method in FLOAT_PSUM:
      np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=msg)
    else:
      np.testing.assert_array_equal(got, ref, err_msg=msg)


if __name__ == "__main__":
  _worker(sys.argv[1])
