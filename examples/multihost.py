"""The pmap training example across processes: 2 processes x 4 CPU devices on 127.0.0.1.

One command starts the whole job::

    python examples/multihost.py --launch --method topk --steps 100

``--launch`` starts 2 copies of this script through ``jaxcomp.training.launch.launch``
(a free port on 127.0.0.1, each copy told its process id, every copy killed
on timeout); each copy calls ``jaxcomp.training.launch.initialize()`` (4 CPU devices,
gloo collectives, ``jax.distributed.initialize``) and runs the same
``jax.pmap`` step as ``train_pmap.py`` over all 8 devices of the job: its own
4 workers take their rows of every global batch, and the compressed
collectives cross the process boundary. Without ``--launch`` the script is
the reference: 1 process x 8 devices, the same workers, data and keys::

    python examples/multihost.py --method topk --steps 100   # same checksum

Every process prints the final parameters' checksum (a float64 sum and a
sha256 of the bytes); the launcher prints them side by side.
"""

from __future__ import annotations

import os
import sys

import _common

PROCESSES, LOCAL_DEVICES = 2, 4


def launcher(argv) -> int:
  import signal

  import jaxcomp.training.launch

  # On SIGTERM, unwind through launch(), which kills every process it started.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  rest = [a for a in argv if a != "--launch"]
  results = jaxcomp.training.launch.launch([os.path.abspath(__file__), *rest], num_processes=PROCESSES,
                                  local_devices=LOCAL_DEVICES, timeout_s=600, stop_after_failure_s=30)
  sums = []
  for r in results:
    status = "killed at the timeout" if r.returncode is None else f"exit {r.returncode}"
    print(f"--- process {r.process_id} ({status}, {r.seconds:.0f} s)")
    print("\n".join(line for line in r.stdout.splitlines() if not line.startswith("[Gloo]")))
    if r.returncode != 0:
      print(r.stderr[-4000:], file=sys.stderr)
    sums += [line for line in r.stdout.splitlines() if line.startswith("param checksum")]
  ok = all(r.returncode == 0 for r in results)
  if ok:
    same = len(set(sums)) == 1 and len(sums) == PROCESSES
    print("all processes hold the same parameters" if same else "processes DIFFER: " + repr(sums))
    ok = same
  return 0 if ok else 1


def main(argv=None) -> dict:
  args, options = _common.parse(_common.parser(__doc__.splitlines()[0], steps=100), argv)

  import jaxcomp
  import jaxcomp.training.launch

  if os.environ.get(jaxcomp.training.launch.ENV_COORD):
    jaxcomp.training.launch.initialize()  # this process's CPU devices + jax.distributed, before JAX work
  else:
    jaxcomp.cpu_devices(PROCESSES * LOCAL_DEVICES)

  import jax
  import numpy as np
  import optax
  from tqdm.auto import tqdm

  from jaxcomp_bench import data, model

  workers, local = jax.device_count(), jax.local_device_count()
  first = jax.process_index() * local  # this process's workers: [first, first + local)
  ds = data.load(args.dataset)
  net = model.CNN()
  params = model.init_params(net, ds.image_shape, args.seed)
  compress = _common.compression(args.method, options, axis_name="data")
  tx = optax.chain(compress, optax.sgd(args.lr, momentum=0.9))

  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(model.loss_fn)(params, net, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  p_step = jax.pmap(step, axis_name="data", donate_argnums=(0, 1))
  # Place the per-worker copies the way pmap shards them: a multi-process pmap
  # reshards other inputs, and with donation that deletes the originals.
  place = jax.pmap(lambda tree: tree)
  P = place(jaxcomp.per_worker(params, local))
  S = place(jaxcomp.per_worker(tx.init(params), local))
  batches = data.worker_batches(ds, workers, args.batch, args.steps, args.seed)
  show = not args.no_progress and jax.process_index() == 0
  loss = None
  wire = None
  with tqdm(total=args.steps, desc=args.method, disable=not show, mininterval=1.0) as bar:
    for i, (x, y) in enumerate(batches):
      x, y = x[first:first + local], y[first:first + local]
      if wire is None:
        wire = jaxcomp.measure_wire_bytes(p_step, P, S, x, y)
      P, S, loss = p_step(P, S, x, y)
      if (i + 1) % 8 == 0 or i + 1 == args.steps:
        bar.update(i + 1 - bar.n)

  replicas = jax.tree.map(lambda a: np.concatenate([np.asarray(s.data) for s in a.addressable_shards]), P)
  for leaf in jax.tree.leaves(replicas):
    if not np.array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape)):
      raise SystemExit("replicas differ inside this process")
  final = jax.tree.map(lambda a: a[0], replicas)
  acc, test_loss = model.evaluate(final, net, ds.x_test, ds.y_test)
  local_loss = float(np.mean([np.asarray(s.data) for s in loss.addressable_shards]))
  total, digest = _common.checksum(final)
  print(f"process {jax.process_index()}/{jax.process_count()}: {local} of {workers} workers,"
        f" method {args.method} {options or ''}, {args.steps} steps")
  print(f"test accuracy {100 * acc:.2f}%  test loss {test_loss:.4f}  last-step loss of local workers"
        f" {local_loss:.4f}")
  print(f"wire bytes per worker per step: {wire['total']:,} measured")
  print(f"param checksum {total:.6f} sha256 {digest}", flush=True)
  return {"accuracy": acc, "checksum": total, "sha256": digest, "params": final}


if __name__ == "__main__":
  if "--launch" in sys.argv[1:]:
    sys.exit(launcher(sys.argv[1:]))
  main(sys.argv[1:])
