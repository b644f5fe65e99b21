"""One process of a 2-process ``jax.distributed`` training job in which one process fails.

``python fault_worker.py FAULT VICTIM STEP WATCHDOG_S PID_DIR``, started by
``jaxcomp.training.launch.launch``. Every process trains a small model with top-k under
``jax.shard_map`` over the job's devices (one per process), behind a
``jaxcomp.training.launch.Watchdog(WATCHDOG_S)``, with a 10 s heartbeat timeout. At step
``STEP`` the process ``VICTIM``:

- ``kill``: SIGKILLs itself (a crash, an OOM kill);
- ``exit``: ``os._exit(3)`` (it leaves without a word);
- ``hang``: sleeps forever, alive (its heartbeats go on): a stuck peer.

It prints ``FAULT <what> step <k> elapsed <seconds since start>``; every other
process must leave on its own with a clear error (tests/test_faults.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time

START = time.monotonic()

from jaxcomp.training import launch

HEARTBEAT_TIMEOUT_S = 10
STEPS = 10_000


def main(fault: str, victim: int, fault_step: int, watchdog_s: float, pid_dir: str) -> None:
  launch.initialize(timeout_s=120, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxcomp

  me = jax.process_index()
  with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w") as f:
    f.write(str(me))
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  tx = optax.chain(jaxcomp.topk(ratio=0.1, axis_name="data"), optax.sgd(0.1))
  params = {"w": jnp.zeros((64,), jnp.float32)}

  def step(p, s, g):
    u, s = tx.update(jaxcomp.local(g), jaxcomp.local(s), p)
    return optax.apply_updates(p, u), jaxcomp.stacked(s)

  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                               out_specs=(P(), P("data")), check_vma=False))
  sharding = NamedSharding(mesh, P("data"))

  def per_process(x):
    return jax.make_array_from_process_local_data(sharding, np.asarray(x)[None])

  state = jax.tree.map(per_process, tx.init(params))
  rng = np.random.default_rng(me)
  dog = launch.Watchdog(timeout_s=watchdog_s)
  for i in range(STEPS):
    if me == victim and i == fault_step:
      print(f"FAULT {fault} step {i} elapsed {time.monotonic() - START:.2f}", flush=True)
      if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
      elif fault == "exit":
        os._exit(3)
      else:
        time.sleep(3600)
    grads = jax.tree.map(per_process, {"w": rng.standard_normal(64).astype(np.float32)})
    try:
      params, state = step(params, state, grads)
      jax.block_until_ready(params)
    except Exception as e:  # noqa: BLE001 - a collective that noticed the dead peer
      print(f"process {me}: training failed at step {i}: {type(e).__name__}: {e}",
            file=sys.stderr, flush=True)
      sys.exit(1)
    if i == 0:
      dog.start()  # after the first step's compilation
    dog.beat(i)
    print(f"step {i}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
