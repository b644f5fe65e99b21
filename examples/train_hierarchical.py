"""Two-level training: dense inside a node, compressed between nodes, through jaxcomp.data_parallel.

A (2, 4) mesh of CPU devices, axes ("dcn", "ici"): the method compresses over
"dcn" only (``dense_axis_name="ici"``), the step comes from
``jaxcomp.data_parallel``::

    python examples/train_hierarchical.py --method topk --steps 200

``--launch`` runs it as 2 processes x 4 devices (the process boundary is the
slow axis) through ``jaxcomp.training.launch``; both print the same checksum as the
1-process run::

    python examples/train_hierarchical.py --launch --method topk --steps 100
"""

from __future__ import annotations

import os
import sys

import _common

NODES, PER_NODE = 2, 4


def launcher(argv) -> int:
  import jaxcomp.training.launch

  rest = [a for a in argv if a != "--launch"]
  results = jaxcomp.training.launch.launch([os.path.abspath(__file__), *rest], num_processes=NODES,
                                  local_devices=PER_NODE, timeout_s=600, stop_after_failure_s=30)
  sums = []
  for r in results:
    print(f"--- process {r.process_id} (exit {r.returncode}, {r.seconds:.0f} s)")
    print("\n".join(line for line in r.stdout.splitlines() if not line.startswith("[Gloo]")))
    if r.returncode != 0:
      print(r.stderr[-4000:], file=sys.stderr)
    sums += [line for line in r.stdout.splitlines() if line.startswith("param checksum")]
  ok = all(r.returncode == 0 for r in results) and len(set(sums)) == 1 and len(sums) == NODES
  print("all processes hold the same parameters" if ok else "processes DIFFER or failed: " + repr(sums))
  return 0 if ok else 1


def main(argv=None) -> dict:
  args, options = _common.parse(_common.parser(__doc__.splitlines()[0], steps=200), argv)

  import jaxcomp
  import jaxcomp.training.launch

  if os.environ.get(jaxcomp.training.launch.ENV_COORD):
    jaxcomp.training.launch.initialize()
  else:
    jaxcomp.cpu_devices(NODES * PER_NODE)

  import jax
  import numpy as np
  import optax

  from jaxcomp_bench import data, model

  mesh = jax.make_mesh((NODES, PER_NODE), ("dcn", "ici"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  ds = data.load(args.dataset)
  net = model.CNN()
  params = model.init_params(net, ds.image_shape, args.seed)
  compress = _common.compression(args.method, {**options, "dense_axis_name": "ici"}, axis_name="dcn")
  tx = optax.chain(compress, optax.sgd(args.lr, momentum=0.9))
  dp = jaxcomp.data_parallel(lambda p, b: model.loss_fn(p, net, b[0], b[1]), tx, mesh)
  params, state = dp.init(params)
  workers, local = NODES * PER_NODE, jax.local_device_count()
  first = jax.process_index() * local  # this process's rows of each global batch
  loss = None
  for x, y in data.worker_batches(ds, workers, args.batch, args.steps, args.seed):
    x = x.reshape((-1,) + x.shape[2:])[first * args.batch:(first + local) * args.batch]
    y = y.reshape(-1)[first * args.batch:(first + local) * args.batch]
    params, state, loss = dp.step(params, state, (x, y))
  final = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), params)
  acc, test_loss = model.evaluate(final, net, ds.x_test, ds.y_test)
  nbytes = jaxcomp.wire_bytes_by_axis(compress, final, PER_NODE)
  total, digest = _common.checksum(final)
  print(f"process {jax.process_index()}/{jax.process_count()}: method {args.method} {options or ''} over"
        f" 'dcn', dense over 'ici', {args.steps} steps")
  print(f"test accuracy {100 * acc:.2f}%  test loss {test_loss:.4f}  last loss"
        f" {float(np.asarray(loss.addressable_shards[0].data)):.4f}")
  print(f"bytes per worker per step: {nbytes['dcn']:,} over dcn (compressed), {nbytes['ici']:,} over ici")
  print(f"param checksum {total:.6f} sha256 {digest}", flush=True)
  return {"accuracy": acc, "checksum": total, "sha256": digest}


if __name__ == "__main__":
  if "--launch" in sys.argv[1:]:
    sys.exit(launcher(sys.argv[1:]))
  main(sys.argv[1:])
