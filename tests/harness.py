"""Shared machinery for the property tests: run a transform under pmap and shard_map.

Every test module imports from here instead of writing its own loops, so that
all methods are held to the same properties.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.core import policy

N = 8
AXIS = "data"

# tests/conftest.py may switch XLA:CPU to its older loop emitter, which compiles faster but forms
# other fusions; a test that reads fusions or buffers compiles with the emitter users get.
USER_FUSIONS = ({"xla_cpu_use_fusion_emitters": True}
                if "xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "") else None)


def compile_as_users(lowered):
  """``lowered.compile()`` with the fusions users' programs get (see ``USER_FUSIONS``)."""
  return lowered.compile(USER_FUSIONS)


def params_tree():
  """A small model-shaped tree: a dense layer, a conv kernel, a bias, a scalar."""
  return {
      "conv": {"kernel": jnp.zeros((3, 3, 4, 8), jnp.float32)},
      "dense": {"kernel": jnp.zeros((40, 24), jnp.float32), "bias": jnp.zeros((24,), jnp.float32)},
      "scale": jnp.zeros((), jnp.float32),
  }


def worker_grads(params, seed: int = 0, n: int = N):
  """Different random gradients per worker, stacked on a leading axis of size n.

  Host (numpy) arrays, drawn by numpy: no program is compiled for them, and ``jax.pmap`` places
  each worker's slice on its device without compiling a slicing program per shape.
  """
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  return treedef.unflatten(
      [rng.standard_normal((n,) + tuple(leaf.shape), np.float32) for leaf in leaves])


def set_at(x, index, value):
  """A numpy copy of ``x`` with ``x[index] = value`` (a NaN planted in a test gradient; nothing compiled)."""
  y = np.array(x)
  y[index] = value
  return y


def host(tree):
  """``tree``'s jax arrays as numpy arrays (typed PRNG keys left as they are).

  A step fed host arrays places each worker's slice directly; fed an array that lives on one
  device, ``jax.pmap`` first compiles a program that slices it, once per shape and dtype.
  """
  def get(x):
    if isinstance(x, jax.Array) and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return np.asarray(x)
    return x

  return jax.tree.map(get, tree)


def method(name: str, **kwargs):
  """``jaxcomp.METHODS[name](**kwargs)``, one object per name, arguments and leaf policy.

  Tests that build the same transformation share it, and with it the programs traced and compiled
  for it (``_pmap_step`` and ``_shard_step`` are keyed on it, ``jax.jit(tx.update)`` on its update):
  a module that checks several properties of every method compiles each method's step once. The
  leaf policy (``policy.MIN_SIZE``, read when a step is traced) is part of the key.
  """
  return _method(name, policy.MIN_SIZE, tuple(sorted(kwargs.items())))


@functools.lru_cache(maxsize=None)
def _method(name, min_size, kwargs):
  del min_size  # a key only
  return jaxcomp.METHODS[name](**dict(kwargs))


def mesh(n: int = N):
  return jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


@functools.lru_cache(maxsize=None)
def _pmap_step(tx):
  return jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS)


@functools.lru_cache(maxsize=None)
def _shard_step(tx, n):
  def step(g, s):
    out, s = tx.update(jaxcomp.local(g), jaxcomp.local(s))
    return jaxcomp.stacked(out), jaxcomp.stacked(s)

  return jax.jit(jax.shard_map(step, mesh=mesh(n), in_specs=(P(AXIS), P(AXIS)),
                               out_specs=(P(AXIS), P(AXIS))))


def run_pmap(tx, grads, state):
  """One step under ``jax.pmap``; grads and state carry the worker axis.

  Results come back as host arrays, like ``init_stacked``'s, so that a second
  step reuses the compiled program instead of compiling for device-sharded inputs.
  """
  return jax.device_get(_pmap_step(tx)(host(grads), host(state)))


def run_shard_map(tx, grads, state):
  """One step under ``jax.jit(jax.shard_map)`` over a 1-D mesh; same layout as pmap."""
  n = jax.tree.leaves(grads)[0].shape[0]
  return jax.device_get(_shard_step(tx, n)(host(grads), host(state)))


def init_stacked(tx, params, n: int = N):
  return jaxcomp.per_worker(tx.init(params), n)


def assert_replicas_equal(updates):
  """Every worker holds bit-identical updates."""
  for leaf in jax.tree.leaves(updates):
    a = np.asarray(leaf)
    np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape))


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


def pmap_wire_bytes(tx, params, n: int = N):
  """Bytes measured from the compiled pmap step's HLO."""
  grads = worker_grads(params, n=n)
  state = init_stacked(tx, params, n)
  return jaxcomp.measure_wire_bytes(_pmap_step(tx), grads, state)


def local_round_trip(tx, grads, state):
  """``axis_name=None`` update, jitted (one worker, no collective)."""
  return jax.jit(tx.update)(grads, state)


# ----------------------------------------------------------------------------
# A real task: scikit-learn's digits, a small MLP, 8 workers with data shards.


def digits(n: int = N):
  """((x, y) sharded on a leading worker axis of n, (x_test, y_test)); 360 digits held out."""
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  perm = np.random.default_rng(0).permutation(len(x))
  test, train = perm[:360], perm[360:]
  train = train[:len(train) // n * n]
  return (x[train].reshape(n, -1, 64), y[train].reshape(n, -1)), (x[test], y[test])


def mlp_init(hidden: int):
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w1": jax.random.normal(k1, (64, hidden)) / 8.0, "b1": jnp.zeros((hidden,)),
          "w2": jax.random.normal(k2, (hidden, 10)) / np.sqrt(hidden), "b2": jnp.zeros((10,))}


def mlp_logits(p, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def mlp_loss(p, x, y):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(mlp_logits(p, x)), y[:, None], axis=1))


def digits_accuracy(tx, digits_data, steps: int, hidden: int = 64, batch: int = 16,
                    replica_atol: float = 0.0):
  """Held-out accuracy of the digits MLP trained by ``tx`` on 8 workers under pmap (one ``lax.scan``).

  The replicas must agree to ``replica_atol`` (0: bit-identical; SBC lands within ulps of its anchor).
  """
  import optax

  (xs, ys), (x_test, y_test) = digits_data

  def run(params, state, x, y):
    def step(carry, i):
      params, state = carry
      j = (i * batch) % (x.shape[0] - batch)
      xb, yb = jax.lax.dynamic_slice_in_dim(x, j, batch), jax.lax.dynamic_slice_in_dim(y, j, batch)
      updates, state = tx.update(jax.grad(mlp_loss)(params, xb, yb), state, params)
      return (optax.apply_updates(params, updates), state), None

    return jax.lax.scan(step, (params, state), jnp.arange(steps))[0][0]

  params = mlp_init(hidden)
  out = jax.pmap(run, axis_name=AXIS)(jaxcomp.per_worker(params, N), jaxcomp.per_worker(tx.init(params), N),
                                      xs, ys)
  for leaf in jax.tree.leaves(out):
    a = np.asarray(leaf)
    np.testing.assert_allclose(a, np.broadcast_to(a[:1], a.shape), rtol=0, atol=replica_atol)
  p = jax.tree.map(lambda a: a[0], out)
  return float(np.mean(np.argmax(np.asarray(mlp_logits(p, x_test)), -1) == y_test))


def powersgd_initial_qs(tx, params):
  """PowerSGD's initial Q ``(cols, r)`` of every compressed leaf (by leaf index), read
  from ``tx.init``'s state.
  """
  from jaxcomp.transforms.lowrank import PowerSGDExchange, _view_groups

  qs = {}
  for b, extra in zip(tx.method.buckets(params), tx.init(params).extra):
    if isinstance(b.exchange, PowerSGDExchange):
      for (_, idx), Q in zip(_view_groups(b.segments), b.exchange.warm_start(b.segments, extra)):
        for j, s in enumerate(idx):
          qs[b.leaves[s]] = np.asarray(Q[j], np.float64)
  return qs


# ----------------------------------------------------------------------------
# Numpy comparisons of the sparse and sign methods (tests/test_dgc.py, test_sign.py, test_threshold.py)


def small_params():
  """Leaves of at most 128 entries: each is its own threshold sample (exact selection)."""
  return {"w": jnp.zeros((10, 10), jnp.float32), "b": jnp.zeros((24,), jnp.float32)}


def step_grads(params, step):
  return jax.tree.map(np.asarray, worker_grads(params, seed=100 + step))


def memory_trees(tx, state, params):
  """``state`` (stacked over workers) with its memory read as trees like ``params`` (see memory_tree)."""
  if not jax.tree.leaves(state.memory):
    return state
  read = jax.vmap(lambda m: jaxcomp.memory_tree(tx, state._replace(memory=m), params))
  return state._replace(memory=read(state.memory))


def run_steps(tx, params, steps=3):
  """Runs ``tx`` under pmap; returns [(grads, out, state)] per step (numpy, memory as trees)."""
  state = init_stacked(tx, params)
  trace = []
  for t in range(steps):
    g = step_grads(params, t)
    out, state = run_pmap(tx, g, state)
    assert_replicas_equal(out)
    state_np = jax.tree.map(np.asarray, memory_trees(tx, state, params))
    trace.append((g, jax.tree.map(np.asarray, out), state_np))
  return trace


def check_against(trace, reference):
  """``reference(g, mem) -> (mean, mem)`` applied leaf by leaf, compared with the trace.

  ``mem`` is the leaf's memory: an array, or a tuple of arrays for DGC (u, v).
  """
  names = list(trace[0][0])
  mem = {k: None for k in names}
  for g, out, state in trace:
    for k in names:
      mean, mem[k] = reference(g[k].astype(np.float32), mem[k])
      np.testing.assert_allclose(out[k][0], mean, rtol=1e-5, atol=1e-6, err_msg=k)
      got = state.memory
      got = tuple(m[k] for m in got) if isinstance(got, tuple) else (got[k],)
      want = mem[k] if isinstance(mem[k], tuple) else (mem[k],)
      for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=k)


def check_pmap_equals_shard_map(tx, params):
  """Two steps under pmap and shard_map: identical outputs and states; measured bytes == wire_bytes."""
  sp = sm = init_stacked(tx, params)
  for t in range(2):
    g = worker_grads(params, seed=t)
    out_p, sp = run_pmap(tx, g, sp)
    out_s, sm = run_shard_map(tx, g, sm)
    assert_replicas_equal(out_p)
    assert_trees_close(out_p, out_s, rtol=0, atol=0)
    assert_trees_close(sp, sm, rtol=0, atol=0)
  assert pmap_wire_bytes(tx, params)["total"] == jaxcomp.wire_bytes(tx, params)


@functools.lru_cache(maxsize=None)
def _scan_step(tx, n: int):
  def run(params, state, grads):
    def step(carry, g):
      params, state = carry
      u, state = tx.update(g, state, params)
      params = optax.apply_updates(params, u)
      return (params, state), (params, state)

    return jax.lax.scan(step, (params, state), grads)[1]

  return jax.pmap(run, axis_name=AXIS, devices=jax.devices()[:n])


def pmap_scan(tx, params, grads, n: int = N):
  """``tx`` over ``n`` workers under pmap, one compiled ``lax.scan`` over the steps.

  grads: leaves (n, steps, ...). Returns (params, state) after each step, leaves (n, steps, ...).
  """
  start = host((jaxcomp.per_worker(params, n), jaxcomp.per_worker(tx.init(params), n), grads))
  out = _scan_step(tx, n)(*start)
  return jax.device_get(out)


def plain_gspmd(loss_fn, params, specs, mesh, batches, lr: float = 0.1):
  """The dense reference of a sharded step: plain optax SGD on each whole batch under GSPMD, the
  parameters placed as ``specs`` say (a bare ``PartitionSpec`` in the loss resolves on ``mesh``)."""
  from jax.sharding import NamedSharding

  tx = optax.sgd(lr)
  params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
  state = tx.init(params)

  @jax.jit
  def step(p, s, batch):
    u, s = tx.update(jax.grad(loss_fn)(p, batch), s, p)
    return optax.apply_updates(p, u), s

  with jax.set_mesh(mesh):
    for batch in batches:
      params, state = step(params, state, batch)
  return params


def own_step(loss_fn, chain, mesh, specs, axis: str = "dcn"):
  """The user-owned step of docs/own-step.md: ``(on_shards(chain), jitted step)``, the step
  ``(params, state, batch) -> (params, state, mean loss)`` through per_slice and on_shards."""
  tx = jaxcomp.on_shards(chain, mesh, specs, axis)
  grad_fn = jaxcomp.per_slice(jax.value_and_grad(loss_fn), mesh, axis)

  @jax.jit
  def step(params, state, batch):
    loss, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss.mean()

  return tx, step


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def benchmark_script(name: str):
  """The module of ``benchmarks/<name>.py`` (a standalone script, not a package), imported."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, name + ".py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod
