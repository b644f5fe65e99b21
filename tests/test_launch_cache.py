"""Across processes with JAX's persistent compilation cache on: a program run again from the cache.

One ``jaxcomp.training.launch.launch`` job runs this file as a script in 2 processes of 2 CPU
devices, with a fresh cache directory. Each runs a ``psum`` and an ``all_gather`` over the axis
that crosses the processes, drops JAX's in-memory caches and runs them again, so process 0 (the
one that writes the cache) loads them from the cache. On jaxlib ``CACHE_HANGS_FROM`` and later a
program loaded from the cache blocks in that collective (measured: 0.12.1), so
``jaxcomp.training.launch.initialize`` turns the cache off there, with a warning; before, the
cache stays on and serves the second run.
"""

from __future__ import annotations

import os
from importlib.metadata import version

import numpy as np

from jaxcomp.training import launch

TIMEOUT_S = 120  # each process runs 4 small programs; a hang still ends


def _worker() -> None:
  import jax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  launch.initialize()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices).reshape(2, 2), ("dcn", "ici"))
  rows = np.arange(4, dtype=np.float32).reshape(2, 2) + 10 * jax.process_index()
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(("dcn", "ici"))), rows)
  spec = P(("dcn", "ici"))

  def run():
    f = jax.jit(jax.shard_map(lambda v: (jax.lax.psum(v, "dcn"), jax.lax.all_gather(v, "dcn", tiled=True)),
                              mesh=mesh, in_specs=spec, out_specs=(spec, P("ici")), check_vma=False))
    total, gathered = f(x)
    return [np.asarray(s.data) for a in (total, gathered) for s in a.addressable_shards]

  first = run()
  jax.clear_caches()
  again = run()  # process 0 wrote the programs to the cache: it loads them now, where the cache is on
  for a, b in zip(first, again, strict=True):
    np.testing.assert_array_equal(a, b)
  on = jax.config.jax_enable_compilation_cache
  print("sum", float(sum(np.sum(a) for a in first[:2])), "cache_on", on, flush=True)


def test_a_program_from_the_cache_runs_across_processes(tmp_path):
  cache = tmp_path / "cache"
  cache.mkdir()
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  results = launch.launch([os.path.abspath(__file__)], num_processes=2, local_devices=2,
                          timeout_s=TIMEOUT_S, env=env, stop_after_failure_s=20)
  hangs = tuple(int(p) for p in version("jaxlib").split(".") if p.isdigit()) >= launch.CACHE_HANGS_FROM
  for r in results:
    assert r.returncode == 0, f"process {r.process_id}: {r.returncode}\n{r.stdout[-999:]}\n{r.stderr[-3000:]}"
    # each process's two psum shards: rows (0, 1) + (10, 11) and (2, 3) + (12, 13)
    line = [w for w in r.stdout.splitlines() if w.startswith("sum ")][-1].split()
    assert float(line[1]) == 52.0, line
    assert line[3] == str(not hangs), (line, r.stderr[-2000:])
    assert ("persistent compilation cache" in r.stderr) == hangs, r.stderr[-2000:]
  if not hangs:
    assert any(name.startswith("jit_") for name in os.listdir(cache)), "the cache served nothing"


if __name__ == "__main__":
  _worker()
