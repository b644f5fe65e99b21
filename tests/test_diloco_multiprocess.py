"""DiLoCo across processes: 2 processes x 4 CPU devices with jax.distributed == 1 process x 8 devices.

One ``jaxcomp.training.launch.launch`` job runs this file as a script in 2 processes; each trains a small
model with DiLoCo (top-k pseudo-gradients, Nesterov outer step) and with Streaming DiLoCo (P = 2, fp4) under
``jax.pmap`` over the job's 8 devices, H = 3, for 7 steps (two syncs of each fragment, then a local
step), and saves its replicas; the test process runs the same on its 8 devices and compares bit for
bit (the syncs all-gather the payloads, combined in worker order on every worker alike).
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

WORKERS, PROCESSES = 8, 2
STEPS, H = 7, 3
CONFIGS = ("diloco", "streaming")


def _problem():
  shapes = {"dense": (40, 24), "bias": (24,), "conv": (3, 3, 4, 8)}
  rng = np.random.default_rng(0)
  params = {k: 1.0 + 0.1 * rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
  targets = {k: rng.standard_normal((WORKERS,) + s).astype(np.float32) for k, s in shapes.items()}
  return params, targets


def _optimizer(config: str):
  if config == "diloco":
    comp = jaxcomp.topk(0.2, axis_name="data", min_size=1)
    return jaxcomp.diloco(optax.adamw(0.01), sync_every=H, compressor=comp, axis_name="data")
  comp = jaxcomp.fp4(axis_name="data", min_size=1)
  return jaxcomp.diloco(optax.adamw(0.01), sync_every=H, compressor=comp, axis_name="data", fragments=2)


def _train(config: str, targets_local, local: int):
  """STEPS steps under pmap over all devices; this process's replicas."""
  params, _ = _problem()
  tx = _optimizer(config)

  def step(p, s, t):
    g = jax.tree.map(lambda p, t: p - t + 0.1 * jnp.sin(3.0 * p), p, t)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p_step = jax.pmap(step, axis_name="data", devices=jax.devices()[:WORKERS])
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
  for config in CONFIGS:
    np.savez(os.path.join(out_dir, f"{config}_p{pid}.npz"), **_train(config, mine, local))
  print(f"process {pid} done", flush=True)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  import jaxcomp.training.launch

  out = tmp_path_factory.mktemp("diloco_multiprocess")
  results = jaxcomp.training.launch.launch([os.path.abspath(__file__), str(out)], num_processes=PROCESSES,
                                  local_devices=WORKERS // PROCESSES, timeout_s=600, stop_after_failure_s=20)
  for r in results:
    assert r.returncode == 0, (f"process {r.process_id}: returncode {r.returncode}\n{r.stdout[-2000:]}\n"
                               f"{r.stderr[-4000:]}")
  return out


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_two_processes_of_four_equal_one_of_eight(launched, config):
  _, targets = _problem()
  reference = _train(config, targets, WORKERS)
  per_process = [dict(np.load(launched / f"{config}_p{i}.npz")) for i in range(PROCESSES)]
  apart = [k for k, r in reference.items() if not np.array_equal(r, np.broadcast_to(r[:1], r.shape))]
  assert apart  # after the last step some leaves are between their syncs: the replicas differ there
  for k, ref in reference.items():
    got = np.concatenate([p[k] for p in per_process])
    assert got.shape == ref.shape == (WORKERS,) + ref.shape[1:]
    np.testing.assert_array_equal(got, ref, err_msg=f"{config}/{k}: 2 processes x 4 devices != 1 x 8")


if __name__ == "__main__":
  _worker(sys.argv[1])
