"""A Flax ``TrainState`` with compressed gradients: change the optimizer line.

Plain data parallelism with Flax and optax averages the gradients itself;
with jaxcomp the optimizer does it, compressed::

    -tx = optax.sgd(0.05, momentum=0.9)
    +tx = optax.chain(jaxcomp.topk(ratio=0.01, axis_name="data"), optax.sgd(0.05, momentum=0.9))
     ...
     grads = jax.grad(loss_fn)(state.params, x, y)
    -grads = jax.lax.pmean(grads, "data")   # jaxcomp's transform now takes the mean
     state = state.apply_gradients(grads=grads)

Everything else (``TrainState.create``, ``apply_gradients``, the pmap step)
stays. The state is per worker (each worker's error-feedback residual is its
own), so the whole ``TrainState`` gets a leading worker axis with
``jaxcomp.per_worker``. Run both and compare::

    python examples/flax_trainstate.py --method dense --steps 200
    python examples/flax_trainstate.py --method topk --steps 200
"""

from __future__ import annotations

import sys

import _common

WORKERS = 8


def main(argv=None) -> dict:
  args, options = _common.parse(_common.parser(__doc__.splitlines()[0], steps=200), argv)

  import jax

  import jaxcomp

  jaxcomp.cpu_devices(WORKERS)

  import numpy as np
  import optax
  from flax.training import train_state
  from tqdm.auto import tqdm

  from jaxcomp_bench import data, model

  ds = data.load(args.dataset)
  net = model.CNN()
  params = model.init_params(net, ds.image_shape, args.seed)

  dense = args.method == "dense"
  if dense:
    tx = optax.sgd(args.lr, momentum=0.9)
  else:
    tx = optax.chain(_common.compression(args.method, options, axis_name="data"),
                     optax.sgd(args.lr, momentum=0.9))
  state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)

  def step(state, x, y):
    loss, grads = jax.value_and_grad(model.loss_fn)(state.params, net, x, y)
    if dense:
      grads = jax.lax.pmean(grads, "data")
    return state.apply_gradients(grads=grads), loss

  p_step = jax.pmap(step, axis_name="data", donate_argnums=0)
  state = jaxcomp.per_worker(state, WORKERS, axis_name="data")
  losses = []
  batches = data.worker_batches(ds, WORKERS, args.batch, args.steps, args.seed)
  with tqdm(total=args.steps, desc=args.method, disable=args.no_progress, mininterval=1.0) as bar:
    for i, (x, y) in enumerate(batches):
      state, loss = p_step(state, x, y)
      losses.append(loss)
      if (i + 1) % 8 == 0 or i + 1 == args.steps:
        bar.update(i + 1 - bar.n)

  final = jax.tree.map(lambda a: a[0], jax.device_get(state.params))
  acc, test_loss = model.evaluate(final, net, ds.x_test, ds.y_test)
  train_loss = float(np.mean(np.asarray(jax.device_get(losses[-10:]))))
  print(f"TrainState with {'plain optax SGD + lax.pmean' if dense else 'jaxcomp.' + args.method}"
        f" {options or ''}: {args.steps} steps, step counter {int(np.asarray(state.step)[0])}")
  print(f"test accuracy {100 * acc:.2f}%  test loss {test_loss:.4f}  final train loss {train_loss:.4f}")
  return {"accuracy": acc, "loss": train_loss}


if __name__ == "__main__":
  main(sys.argv[1:])
