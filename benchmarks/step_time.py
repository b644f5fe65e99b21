"""A whole training step per method on one device: compressed step time / dense step time, no network.

The transformer language model of ``python -m jaxcomp.bench lm`` (pydoc_data's
English prose), one jitted step = loss and gradient, the method's update with
``axis_name=None`` (bucket, compensate, encode, decode, residual), AdamW and
the parameter update, parameters and states donated. Every method at the
kernel benchmark's settings (``jaxcomp_bench.kernels.rows``). Prints the
median step in ms over ``--reps`` runs after ``--warmup`` untimed ones, its ratio to the dense
step (``none``) and the compile seconds. Runs on whatever backend JAX picks (a
GPU where there is one).

    python benchmarks/step_time.py [--width 512 --layers 8 --context 256 --batch 32] [--methods a,b]
"""

import argparse
import datetime
import re
import statistics
import time

import jax
import numpy as np
import optax

import jaxcomp
from jaxcomp_bench import kernels
from jaxcomp_bench import transformer as tf


def step_fn(model, tx):
  def step(params, state, x, y):
    loss, grads = jax.value_and_grad(tf.loss_fn)(params, model, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return jax.jit(step, donate_argnums=(0, 1))


_NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}


def kernels_of(compiled) -> tuple[int, int]:
  """(instructions that launch work, fusions) in the compiled program's entry computation."""
  text = compiled.as_text()
  ops = re.findall(r"^\s+(?:ROOT )?\S+ = \S+ ([a-z\-]+)\(", text[text.index("ENTRY"):], re.M)
  ops = [op for op in ops if op not in _NOT_KERNELS]
  return len(ops), ops.count("fusion")


def time_method(model, tx, params, batches, reps, warmup=5):
  params = jax.tree.map(lambda p: p.copy(), params)
  state = tx.init(params)
  t0 = time.perf_counter()
  step = step_fn(model, tx).lower(params, state, *batches[0]).compile()
  compile_s = time.perf_counter() - t0
  kernels = kernels_of(step)
  for _ in range(warmup):  # a GPU runtime's first runs (autotuning, command buffers) are slower
    params, state, loss = step(params, state, *batches[0])
    loss.block_until_ready()
  times = []
  for i in range(reps):
    t = time.perf_counter()
    params, state, loss = step(params, state, *batches[1 + i % (len(batches) - 1)])
    loss.block_until_ready()
    times.append(time.perf_counter() - t)
  return statistics.median(times), compile_s, kernels


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--context", type=int, default=128)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--warmup", type=int, default=5, help="untimed steps after compiling")
  p.add_argument("--methods", default=None, help="comma-separated (default: every method)")
  args = p.parse_args()
  corpus = tf.load()
  model = tf.Transformer(corpus.vocab_size, context=args.context, width=args.width,
                         mlp=4 * args.width, layers=args.layers)
  params = tf.init_params(model)
  rng = np.random.default_rng(0)
  batches = [tf.windows(corpus.train, rng.integers(0, len(corpus.train) - args.context - 1, args.batch),
                        args.context) for _ in range(4)]
  names = None if args.methods is None else [m for m in args.methods.split(",") if m]
  entries = [e for e in kernels.rows(names, variants=False) if e[0] != "none"]
  print(f"# {datetime.date.today()}, {jax.devices()[0].device_kind} ({jax.default_backend()}), jax"
        f" {jax.__version__}; transformer width {args.width}, {args.layers} layers, context {args.context},"
        f" batch {args.batch}: {tf.num_params(params):,} parameters in {len(jax.tree.leaves(params))} leaves")
  dense_s, dense_c, dense_k = time_method(model, optax.adamw(1e-3), params, batches, args.reps, args.warmup)
  print(f"{'method':<14} {'step ms':>8} {'/ dense':>8} {'compile s':>9} {'kernels (fusions)':>18}")
  print(f"{'none':<14} {dense_s * 1e3:8.2f} {1.0:8.2f} {dense_c:9.2f} {dense_k[0]:>9} ({dense_k[1]})",
        flush=True)
  for label, base, kw in entries:
    try:
      tx = optax.chain(jaxcomp.steady(jaxcomp.METHODS[base](axis_name=None, **kw)), optax.adamw(1e-3))
      s, c, k = time_method(model, tx, params, batches, args.reps, args.warmup)
    except Exception as e:  # noqa: BLE001 - a method that cannot run here is reported, not fatal
      print(f"{label:<14} failed: {type(e).__name__}: {str(e)[:90]}", flush=True)
      continue
    print(f"{label:<14} {s * 1e3:8.2f} {s / dense_s:8.2f} {c:9.2f} {k[0]:>9} ({k[1]})", flush=True)


if __name__ == "__main__":
  main()
