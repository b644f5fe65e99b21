"""Safe multi-device CPU set-up for tests, examples and benchmarks."""

from __future__ import annotations

import os


def cpu_devices(n: int = 8) -> list:
  """Makes JAX's CPU backend expose ``n`` devices, safely, and returns them.

  Call it right after ``import jax``, before any JAX operation. It sets
  ``PJRT_NPROC`` (the size of XLA's CPU thread pool) to at least ``2 * n``
  unless the environment already sets it: with the default pool of
  ``max(cores, devices)`` threads, ``n`` devices on a machine with fewer cores
  can deadlock inside an all-reduce (launches block on a per-device semaphore
  while holding the pool threads the collective needs), and the process aborts
  after 40 s with "Termination timeout for all reduce". Then it sets
  ``jax_num_cpu_devices``.

  Raises:
    ValueError: ``n`` is not a positive int.
    RuntimeError: the backend was already created with another device count.
  """
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"n must be a positive int, got n={n!r}")
  os.environ.setdefault("PJRT_NPROC", str(max(16, 2 * n)))
  import jax

  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    have = jax.devices("cpu")
    if len(have) != n:
      raise RuntimeError(
          f"jaxcomp.cpu_devices(n={n}) came too late: JAX's CPU backend already"
          f" exists with {len(have)} devices. Call it right after `import jax`,"
          " before any JAX operation.") from None
  devices = jax.devices("cpu")
  if len(devices) != n:
    raise RuntimeError(f"asked for n={n} CPU devices, JAX made {len(devices)}")
  return devices
