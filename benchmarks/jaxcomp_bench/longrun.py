"""``python -m jaxcomp.bench longrun``: thousands of steps of every method, checked as they go.

Each method trains a small least-squares model (a 32x16 matrix and a bias,
528 parameters) under ``jax.pmap`` over 8 CPU workers, for ``--steps``
steps inside one jitted ``lax.scan``. The step counter starts ``--steps // 2``
below the int32 maximum, so it saturates half way, and the state's ``phase``
(the wrapping counter behind ACP-SGD's alternation and SBC's sync period)
starts as far below 2^32, so it wraps half way. Per method it prints the
largest residual norm (the memory: residual or momentum, and residuals kept
by exchanges, as SBC's) and the loss over the run's quarters, and
checks: every value finite, the residual bounded (its norm in the last
quarter at most ``GROWTH`` times its peak in the first half), the counter
saturating at 2^31 - 1 and never decreasing, the phase advancing by one
(modulo 2^32) every step, the state's PRNG keys never
repeating and identical on every worker, and the replicas' parameters
bit-identical at the end. tests/test_long_runs.py runs a subset of methods.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jaxcomp_bench.common import plain

INT32_MAX = 2 ** 31 - 1
GROWTH = 2.0  # last-quarter residual norm <= GROWTH * first-half peak
SUBSET = ("acpsgd", "dgc", "efsignsgd", "powersgd", "qsgd", "randomk", "sbc", "topk")  # the CI subset


@dataclasses.dataclass
class LongRun:
  """What one method's long run did; ``problems`` is empty when every check held."""

  method: str
  steps: int
  workers: int
  max_residual_norm: float
  residual_norm_quarters: list[float]
  loss_quarters: list[float]
  final_count: int
  distinct_keys: int
  seconds: float
  problems: list[str]


def _problem():
  import jax
  import jax.numpy as jnp

  k = jax.random.PRNGKey(11)
  w_true = jax.random.normal(k, (32, 16)) / 4.0
  params = {"w": jnp.zeros((32, 16), jnp.float32), "b": jnp.zeros((16,), jnp.float32)}

  def loss(params, step, worker):
    kd = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(5), step), worker)
    kx, kn = jax.random.split(kd)
    x = jax.random.normal(kx, (16, 32))
    y = x @ w_true + 0.1 * jax.random.normal(kn, (16, 16))
    return jnp.mean(jnp.square(x @ params["w"] + params["b"] - y))

  return params, loss


def _residual_norm(state):
  """The norm of the memory (residual, momentum) and of residuals kept by exchanges (SBC)."""
  import jax
  import jax.numpy as jnp

  from jaxcomp.transforms.sbc import SBCState

  has = lambda e: isinstance(e, SBCState)  # noqa: E731
  kept = [e.residual for e in jax.tree.leaves(state.extra, is_leaf=has) if has(e)]
  leaves = [x for x in jax.tree.leaves((state.memory, kept)) if jnp.issubdtype(x.dtype, jnp.floating)]
  if not leaves:
    return jnp.zeros((), jnp.float32)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def run(name: str, steps: int = 2000, workers: int = 8, lr: float = 0.02, saturate: bool = True) -> LongRun:
  """Runs ``steps`` steps of method ``name`` and checks the long-run promises.

  ``saturate``: start the step counter ``steps // 2`` below the int32 maximum
  (else at 0), so that the second half of the run has a saturated counter.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import jaxcomp

  params, loss = _problem()
  tx = optax.chain(jaxcomp.METHODS[name](axis_name="data"), optax.sgd(lr))
  state = tx.init(params)
  start = INT32_MAX - steps // 2 if saturate else 0
  phase0 = 2 ** 32 - steps // 2 if saturate else 0
  state = (state[0]._replace(count=jnp.int32(start), phase=jnp.uint32(phase0)),) + tuple(state[1:])

  def train(params, state):
    worker = jax.lax.axis_index("data")

    def body(carry, t):
      params, state = carry
      value, grads = jax.value_and_grad(loss)(params, t, worker)
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates)]))
      stats = (value, _residual_norm(state[0]), state[0].key, state[0].count, state[0].phase, finite)
      return (params, state), stats

    return jax.lax.scan(body, (params, state), jnp.arange(steps, dtype=jnp.int32))

  t0 = time.perf_counter()
  (params_w, _), (losses, norms, keys, counts, phases, finite) = jax.pmap(train, axis_name="data")(
      jaxcomp.per_worker(params, workers), jaxcomp.per_worker(state, workers))
  jax.block_until_ready(params_w)
  seconds = time.perf_counter() - t0
  losses, norms, keys, counts, phases, finite = map(np.asarray, (losses, norms, keys, counts, phases, finite))

  problems = []
  if not finite.all():
    problems.append(f"non-finite updates at steps {np.flatnonzero(~finite.all(0))[:5].tolist()}")
  if not np.isfinite(norms).all() or not np.isfinite(losses).all():
    problems.append("non-finite residual norm or loss")
  q = steps // 4
  peak_first_half = norms[:, : 2 * q].max()
  last_quarter = norms[:, 3 * q:].max()
  if last_quarter > GROWTH * peak_first_half + 1e-6:
    problems.append(f"residual grows: last quarter {last_quarter:.4g} > {GROWTH} x first-half peak"
                    f" {peak_first_half:.4g}")
  final = INT32_MAX if saturate else steps
  decreasing = (np.diff(counts.astype(np.int64), axis=1) < 0).any()
  if counts.min() < start or decreasing or counts[:, -1].min() != final:
    problems.append(f"counter: min {counts.min()}, last {counts[:, -1].tolist()}, expected {final}")
  expected_phase = (phase0 + 1 + np.arange(steps, dtype=np.int64)) % 2 ** 32
  if not (phases.astype(np.int64) == expected_phase).all():
    problems.append(f"phase: last {phases[:, -1].tolist()}, expected {int(expected_phase[-1])}")
  if not (keys == keys[:1]).all():
    problems.append("state keys differ across workers")
  distinct = len({tuple(k) for k in keys[0].tolist()})
  if distinct != steps:
    problems.append(f"state keys repeat: {distinct} distinct in {steps} steps")
  for path, leaf in jax.tree_util.tree_leaves_with_path(params_w):
    a = np.asarray(leaf)
    if not (a == a[:1]).all():
      problems.append(f"replicas drifted: params{jax.tree_util.keystr(path)} differ across workers")
  quarters = lambda x: [float(x[:, i * q:(i + 1) * q].max()) for i in range(4)]
  return LongRun(name, steps, workers, float(norms.max()), quarters(norms),
                 [float(losses[:, i * q:(i + 1) * q].mean()) for i in range(4)], int(counts[0, -1]),
                 distinct, seconds, problems)


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(prog="python -m jaxcomp.bench longrun", description=plain(__doc__))
  ap.add_argument("--methods", default="all",
                  help="comma-separated names, 'all', or 'subset' (the CI subset)")
  ap.add_argument("--steps", type=int, default=5000)
  ap.add_argument("--workers", type=int, default=8)
  ap.add_argument("--no-saturate", action="store_true", help="start the step counter at 0")
  args = ap.parse_args(argv)
  if args.steps < 8 or args.steps % 4:
    raise SystemExit(f"--steps must be a multiple of 4, >= 8; got --steps={args.steps}")

  import jaxcomp
  jaxcomp.cpu_devices(args.workers)

  if args.methods == "all":
    names = sorted(jaxcomp.METHODS)
  elif args.methods == "subset":
    names = list(SUBSET)
  else:
    names = args.methods.split(",")
  counter = ("starting at 0" if args.no_saturate else
             f"saturating at 2^31 - 1 after step {args.steps - args.steps // 2 - 1}")
  print(f"{args.steps} steps x {args.workers} workers, 528 parameters, step counter {counter}")
  print("| method | max residual norm | residual norm by quarter | loss by quarter | distinct keys"
        " | seconds (compile + run) | checks |")
  print("|---|---:|---|---|---:|---:|---|")
  results: dict[str, LongRun] = {}
  for name in names:
    r = run(name, args.steps, args.workers, saturate=not args.no_saturate)
    results[name] = r
    fmt = lambda xs: " / ".join(f"{x:.3g}" for x in xs)
    print(f"| {name} | {r.max_residual_norm:.4g} | {fmt(r.residual_norm_quarters)} | {fmt(r.loss_quarters)}"
          f" | {r.distinct_keys} | {r.seconds:.1f} | {'; '.join(r.problems) or 'ok'} |", flush=True)
  worst = max(results.values(), key=lambda r: r.max_residual_norm)
  print(f"largest residual norm: {worst.max_residual_norm:.4g} ({worst.method})")
  failed = [n for n, r in results.items() if r.problems]
  if failed:
    raise SystemExit(f"long-run checks failed for {failed}")
