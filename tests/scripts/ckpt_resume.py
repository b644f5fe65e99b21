"""Checkpoint/resume for every method: train, save mid-run, restore in a fresh process, continue.

``python tests/scripts/ckpt_resume.py first DIR``: trains every case
``FIRST_STEPS`` steps, saves (params, optimizer state) to ``DIR/ckpt``, then
continues ``RESUMED_STEPS`` steps without interruption and writes the
parameters to ``DIR/reference.npz``.
``python tests/scripts/ckpt_resume.py resume DIR`` (a fresh process): restores
``DIR/ckpt`` into freshly initialized templates, runs the same
``RESUMED_STEPS`` steps and writes ``DIR/resumed.npz``. tests/test_checkpoint.py
compares the two bit for bit. Both share a persistent compilation cache in
``DIR/jax_cache``, so the second process loads the executables instead of
compiling them again (the programs are the same; only time is saved).
"""

from __future__ import annotations

import functools
import os
import sys

os.environ.setdefault("PJRT_NPROC", "16")

import jax

import jaxcomp

jaxcomp.cpu_devices(8)

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxcomp.training import checkpoint

N = 8
AXIS = "data"
FIRST_STEPS = 3
RESUMED_STEPS = 3
SHARD_MAP_METHOD = "powersgd"


def params0():
  """A tiny model: a (32, 16) matrix (PowerSGD compresses it), a bias, a scalar."""
  return {"w": jnp.zeros((32, 16), jnp.float32), "b": jnp.zeros((16,), jnp.float32),
          "s": jnp.zeros((), jnp.float32)}


# The complete AdamW optimizers, their phases moved early so that the checkpoint (after step 3) lands
# inside them: 1-bit Adam frozen from step 2; 0/1 Adam's variance frozen from step 2, local steps after.
ADAMW_CASES = {"onebit_adam": {"freeze_step": 2},
               "zero_one_adam": {"var_freeze_step": 2, "local_step_scaler": 2},
               "demo": {}}


def optimizer(name: str):
  # Each method through its recipe: its memory (momentum correction, EF21, ...) and the outer sgd.
  method, _, exchange = name.partition("@")
  if exchange == "adamw":
    return jaxcomp.recipe(method, 1e-2, axis_name=AXIS, optimizer="adamw", **ADAMW_CASES[method])
  return jaxcomp.recipe(method, 0.05, axis_name=AXIS, **({"transport": exchange} if exchange else {}))


def _loss(params, step, worker):
  """Least squares on data drawn from (step, worker): gradients depend on params."""
  k = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(7), step), worker)
  kx, ky = jax.random.split(k)
  x = jax.random.normal(kx, (8, 32))
  y = jax.random.normal(ky, (8, 16))
  pred = x @ params["w"] + params["b"] + params["s"]
  return jnp.mean(jnp.square(pred - y))


def _step_body(tx, params, state, step, worker):
  grads = jax.grad(_loss)(params, step, worker)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


@functools.cache
def pmap_step(name: str):
  tx = optimizer(name)

  def step(params, state, t):
    return _step_body(tx, params, state, t, jax.lax.axis_index(AXIS))

  return jax.pmap(step, axis_name=AXIS, in_axes=(0, 0, None))


def mesh():
  return jax.make_mesh((N,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


@functools.cache
def shard_map_step(name: str):
  tx = optimizer(name)

  def step(params, state, t):
    p, s = _step_body(tx, jaxcomp.local(params), jaxcomp.local(state), t, jax.lax.axis_index(AXIS))
    return jaxcomp.stacked(p), jaxcomp.stacked(s)

  return jax.jit(jax.shard_map(step, mesh=mesh(), in_specs=(P(AXIS), P(AXIS), P()),
                               out_specs=(P(AXIS), P(AXIS)), check_vma=False))


def init(name: str, layout: str):
  """Per-worker (params, optimizer state): stacked for pmap, sharded for shard_map."""
  params, tx = params0(), optimizer(name)
  workers = N if layout == "pmap" else mesh()
  axis = None if layout == "pmap" else AXIS
  return (jaxcomp.per_worker(params, workers, axis), jaxcomp.per_worker(tx.init(params), workers, axis))


def run(name: str, layout: str, carry, first: int, steps: int):
  step = pmap_step(name) if layout == "pmap" else shard_map_step(name)
  params, state = carry
  for t in range(first, first + steps):
    params, state = step(params, state, jnp.int32(t))
    if layout == "pmap":  # host arrays in, as at the first step: pmap then compiles once
      params, state = jax.device_get((params, state))
  return params, state


SCATTER_METHODS = ("qsgd", "topk", "dgc")  # "name@scatter": through transport="scatter" (two residuals)


def cases():
  """(name, layout) for every method under pmap, a few with transport="scatter", and one under shard_map."""
  return ([(name, "pmap") for name in sorted(jaxcomp.METHODS)]
          + [(f"{m}@scatter", "pmap") for m in SCATTER_METHODS]
          + [(f"{m}@adamw", "pmap") for m in ADAMW_CASES] + [(SHARD_MAP_METHOD, "shard_map")])


def key(name: str, layout: str) -> str:
  return f"{layout}:{name}"


def flat(params) -> dict:
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}


def _save_params(carries, path: str) -> None:
  out = {}
  for name, layout in cases():
    params, _ = carries[key(name, layout)]
    out.update({f"{key(name, layout)}{p}": x for p, x in flat(params).items()})
  np.savez(path, **out)


def first(directory: str) -> None:
  carries = {key(n, lay): run(n, lay, init(n, lay), 0, FIRST_STEPS) for n, lay in cases()}
  checkpoint.save(os.path.join(directory, "ckpt"), carries)
  carries = {key(n, lay): run(n, lay, carries[key(n, lay)], FIRST_STEPS, RESUMED_STEPS)
             for n, lay in cases()}
  _save_params(carries, os.path.join(directory, "reference.npz"))


def resume(directory: str) -> None:
  like = {key(n, lay): init(n, lay) for n, lay in cases()}
  restored = checkpoint.restore(os.path.join(directory, "ckpt"), like)
  carries = {key(n, lay): run(n, lay, restored[key(n, lay)], FIRST_STEPS, RESUMED_STEPS)
             for n, lay in cases()}
  _save_params(carries, os.path.join(directory, "resumed.npz"))


if __name__ == "__main__":
  mode, directory = sys.argv[1], sys.argv[2]
  jax.config.update("jax_compilation_cache_dir", os.path.join(directory, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  {"first": first, "resume": resume}[mode](directory)
  print(f"{mode}: {len(cases())} cases", flush=True)
