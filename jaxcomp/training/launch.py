"""Multi-process runs on one machine: ``jax.distributed`` over 127.0.0.1.

:func:`launch` starts ``num_processes`` copies of a Python command, each told
its process id, the process count, its CPU device count and a free
coordinator port through the environment; inside, :func:`initialize` reads
them. Every child runs in its own process group and is killed on timeout or
when the launcher exits, so no run leaves processes behind.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Dict, List, Optional, Sequence

ENV_COORD = "JAXCOMP_COORDINATOR"
ENV_NPROC = "JAXCOMP_NUM_PROCESSES"
ENV_PID = "JAXCOMP_PROCESS_ID"
ENV_NDEV = "JAXCOMP_LOCAL_DEVICES"
# From this jaxlib on (measured on 0.12.1; 0.10.2 and 0.12.0.1 are fine), an XLA:CPU program
# whose collectives cross processes blocks forever in its first such collective when it was
# loaded from the persistent compilation cache; compiled afresh it runs.
CACHE_HANGS_FROM = (0, 12, 1)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def initialize(local_devices: Optional[int] = None, timeout_s: int = 60,
               heartbeat_timeout_s: int = 20) -> None:
  """Inside a launched process: set up CPU devices and ``jax.distributed``.

  Reads the coordinator, process count and id from the environment that
  :func:`launch` set. ``timeout_s`` bounds the initialization.
  ``heartbeat_timeout_s`` bounds how long a process waits for a dead peer:
  a collective with a process that died blocks (gloo does not notice), until
  the coordination service misses the peer's heartbeats for this long and
  aborts every survivor with "Terminating process because the JAX
  distributed service detected fatal errors" (JAX's default is 100 s). A
  peer that hangs but lives keeps beating: use :class:`Watchdog` for that.

  On jaxlib ``CACHE_HANGS_FROM`` and later it turns JAX's persistent
  compilation cache off, with a warning: there, a program loaded from it
  blocks in its first collective across processes.
  """
  import jax

  missing = [v for v in (ENV_COORD, ENV_NPROC, ENV_PID) if v not in os.environ]
  if missing:
    raise RuntimeError(f"initialize() runs inside jaxcomp.training.launch.launch(); {missing} not set")
  n = local_devices or int(os.environ.get(ENV_NDEV, "1"))
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"local_devices must be a positive int, got local_devices={n!r}")
  # Not cpu_devices(n): it lists the devices, which creates the backend, and
  # jax.distributed.initialize must come before that.
  os.environ.setdefault("PJRT_NPROC", str(max(16, 2 * n)))
  jax.config.update("jax_num_cpu_devices", n)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=os.environ[ENV_COORD],
      num_processes=int(os.environ[ENV_NPROC]),
      process_id=int(os.environ[ENV_PID]),
      initialization_timeout=timeout_s,
      heartbeat_timeout_seconds=heartbeat_timeout_s,
  )
  if jax.local_device_count() != n:
    raise RuntimeError(f"asked for {n} local CPU devices, JAX made {jax.local_device_count()}")
  _guard_compilation_cache(jax)


def _jaxlib_version() -> tuple:
  from importlib.metadata import version

  return tuple(int(p) for p in version("jaxlib").split(".") if p.isdigit())


def _guard_compilation_cache(jax) -> None:
  """Turns JAX's persistent compilation cache off where loading from it hangs (``CACHE_HANGS_FROM``)."""
  if _jaxlib_version() < CACHE_HANGS_FROM:
    return
  if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
    return
  jax.config.update("jax_enable_compilation_cache", False)
  warnings.warn(
      f"jaxcomp.training.launch.initialize: the persistent compilation cache "
      f"({jax.config.jax_compilation_cache_dir}) is now off in this process: on jaxlib "
      f"{'.'.join(map(str, _jaxlib_version()))} a multi-process CPU program loaded from it blocks forever "
      f"in its first collective across processes. Set jax_enable_compilation_cache=True after "
      f"initialize() to use it anyway.", RuntimeWarning, stacklevel=3)


class Watchdog:
  """Exits the process with a clear error when training stops making progress.

  A collective whose peer process died or hangs blocks forever; a daemon
  thread sees that no :meth:`beat` came for ``timeout_s`` seconds, writes
  which step was the last to finish to stderr and ends the process with
  ``exit_code`` (75, EX_TEMPFAIL: restart from the last checkpoint)::

    with jaxcomp.training.launch.Watchdog(timeout_s=120) as dog:
      for step in range(start, steps):
        params, state = train_step(params, state, batch)
        jax.block_until_ready(params)  # a beat means the step really finished
        dog.beat(step)

  Choose ``timeout_s`` above the slowest step, the first one (compilation)
  included, or start the watchdog after it.
  """

  def __init__(self, timeout_s: float, exit_code: int = 75):
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
      raise ValueError(f"timeout_s must be a number > 0, got timeout_s={timeout_s!r}")
    self.timeout_s, self.exit_code = float(timeout_s), int(exit_code)
    self.step: Optional[int] = None
    self._last = time.monotonic()
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def beat(self, step: Optional[int] = None) -> None:
    """Records progress (``step`` finished)."""
    self.step, self._last = step, time.monotonic()

  def start(self) -> "Watchdog":
    self._last = time.monotonic()
    self._thread = threading.Thread(target=self._watch, name="jaxcomp-watchdog", daemon=True)
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def __enter__(self) -> "Watchdog":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def _watch(self) -> None:
    while not self._stop.wait(min(1.0, self.timeout_s / 4)):
      idle = time.monotonic() - self._last
      if idle > self.timeout_s:
        last = "no step" if self.step is None else f"step {self.step}"
        os.write(2, (
            f"jaxcomp.training.launch.Watchdog: no progress for {idle:.0f} s (timeout_s={self.timeout_s:g});"
            f" the last to finish was {last}. A peer process probably died or hangs inside a"
            f" collective. Exiting with code {self.exit_code}; restart from the last checkpoint.\n"
        ).encode())
        os._exit(self.exit_code)


@dataclasses.dataclass
class Result:
  """What one launched process did."""

  process_id: int
  returncode: Optional[int]  # None: killed at the timeout
  stdout: str
  stderr: str
  seconds: float


def launch(argv: Sequence[str], num_processes: int = 2, local_devices: int = 1,
           timeout_s: float = 300.0, env: Optional[Dict[str, str]] = None,
           stop_after_failure_s: Optional[float] = None) -> List[Result]:
  """Runs ``python argv...`` as ``num_processes`` processes of one ``jax.distributed`` job.

  Returns each process's result once all have exited or ``timeout_s`` has
  passed (the rest are then killed, with their whole process group, and get
  ``returncode=None``). Output goes to temporary files, not pipes, so a
  chatty process never blocks on a full pipe.

  Args:
    argv: the Python command line (a script or ``-m module``, then its arguments).
    num_processes: processes to start, >= 1.
    local_devices: CPU devices per process, >= 1.
    timeout_s: wall-clock bound for the whole job.
    env: the environment to start from (default: this process's).
    stop_after_failure_s: if set, once a process exits with an error the others
      get this many seconds to exit and are then killed (``returncode=None``).
  """
  if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes must be an int >= 1, got num_processes={num_processes!r}")
  if isinstance(local_devices, bool) or not isinstance(local_devices, int) or local_devices < 1:
    raise ValueError(f"local_devices must be an int >= 1, got local_devices={local_devices!r}")
  port = free_port()
  base = dict(os.environ if env is None else env)
  base.setdefault("PJRT_NPROC", str(max(16, 2 * local_devices)))
  procs: List[subprocess.Popen] = []
  files = []
  start = time.monotonic()
  try:
    for i in range(num_processes):
      penv = dict(base, **{ENV_COORD: f"127.0.0.1:{port}", ENV_NPROC: str(num_processes),
                           ENV_PID: str(i), ENV_NDEV: str(local_devices)})
      out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
      files.append((out, err))
      procs.append(subprocess.Popen(
          [sys.executable, *argv], env=penv, stdout=out, stderr=err, text=True,
          start_new_session=True))
    ended: List[Optional[float]] = [None] * num_processes
    killed = [False] * num_processes
    deadline = start + timeout_s
    while any(t is None for t in ended):
      now = time.monotonic()
      for i, p in enumerate(procs):
        if ended[i] is None and p.poll() is not None:
          ended[i] = now - start
          if p.returncode != 0 and stop_after_failure_s is not None:
            deadline = min(deadline, now + stop_after_failure_s)
      if now > deadline:
        for i, p in enumerate(procs):
          if ended[i] is None:
            _kill(p)
            killed[i] = True
            ended[i] = time.monotonic() - start
        break
      time.sleep(0.05)
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, files, strict=True)):
      out.seek(0)
      err.seek(0)
      results.append(Result(i, None if killed[i] else p.returncode, out.read(), err.read(), ended[i]))
    return results
  finally:
    for p in procs:
      if p.poll() is None:
        _kill(p)
    for out, err in files:
      out.close()
      err.close()


def _kill(p: subprocess.Popen) -> None:
  try:
    os.killpg(p.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  try:
    p.wait(timeout=10)
  except subprocess.TimeoutExpired:
    pass
