"""Faults across processes: when one process of a jax.distributed job dies, the others leave.

Real 2-process jobs on 127.0.0.1 (``jaxcomp.training.launch.launch``, 1 CPU device per
process) train with top-k under shard_map (tests/scripts/fault_worker.py);
at step 5 one process fails. Three faults run at once (separate jobs):

- the coordinator's peer (process 1) is SIGKILLed: process 0's all-reduce
  blocks until the coordination service misses process 1's heartbeats
  (``initialize(heartbeat_timeout_s=10)``) and aborts it;
- the coordinator (process 0) calls ``os._exit(3)``: process 1's collective
  fails or its client loses the service, and it exits;
- process 1 hangs, alive (heartbeats go on): process 0's
  ``jaxcomp.training.launch.Watchdog(15)`` ends it with exit code 75.

Each survivor exits on its own, with a clear message, within 60 s of the
fault; every process of every job is gone afterwards.
"""

import concurrent.futures
import os
import re

import pytest

from jaxcomp.training import launch

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "fault_worker.py")
FAULT_STEP = 5
BOUND_S = 60.0
SCENARIOS = {  # name: (fault, victim, watchdog timeout (s))
    "peer_killed": ("kill", 1, 45.0),
    "coordinator_exits": ("exit", 0, 45.0),
    "peer_hangs": ("hang", 1, 15.0),
}
CLEAR_ERRORS = (
    "Terminating process because the JAX distributed service detected fatal errors",
    "training failed at step",
    "jaxcomp.training.launch.Watchdog: no progress",
)


def _job(name, tmp):
  fault, victim, watchdog_s = SCENARIOS[name]
  pid_dir = tmp / name
  pid_dir.mkdir()
  results = launch.launch(
      [SCRIPT, fault, str(victim), str(FAULT_STEP), str(watchdog_s), str(pid_dir)],
      num_processes=2, local_devices=1, timeout_s=240.0, stop_after_failure_s=BOUND_S + 5)
  return results, pid_dir


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("faults")
  with concurrent.futures.ThreadPoolExecutor(len(SCENARIOS)) as pool:
    futures = {name: pool.submit(_job, name, tmp) for name in SCENARIOS}
    return {name: f.result() for name, f in futures.items()}


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_survivor_exits_with_a_clear_error_within_the_bound(jobs, name):
  fault, victim, _ = SCENARIOS[name]
  results, pid_dir = jobs[name]
  logs = "\n".join(f"--- process {r.process_id} rc={r.returncode} after {r.seconds:.1f}s\n"
                   f"{r.stdout[-1500:]}\n{r.stderr[-3000:]}" for r in results)
  m = re.search(r"FAULT \w+ step (\d+) elapsed ([0-9.]+)", results[victim].stdout)
  assert m, logs
  assert int(m.group(1)) == FAULT_STEP, logs
  fault_at = float(m.group(2))
  survivor = results[1 - victim]
  assert f"step {FAULT_STEP - 1}" in survivor.stdout, logs  # it trained up to the fault
  assert survivor.returncode is not None, f"the survivor did not exit by itself\n{logs}"
  assert survivor.returncode != 0, logs
  assert survivor.seconds - fault_at < BOUND_S, logs
  assert any(e in survivor.stderr for e in CLEAR_ERRORS), logs
  if fault == "hang":
    assert survivor.returncode == 75 and "the last to finish was step" in survivor.stderr, logs
  else:
    assert "jaxcomp.training.launch.Watchdog" not in survivor.stderr, logs  # the heartbeat came first
  pids = [int(f.split(".")[0]) for f in os.listdir(pid_dir)]
  assert len(pids) == 2, logs
  assert not any(_alive(p) for p in pids), "a process of the job is still running"


def test_watchdog_rejects_a_bad_timeout():
  with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
    launch.Watchdog(timeout_s=0)
