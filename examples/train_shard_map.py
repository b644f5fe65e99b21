"""Compressed data parallelism on one axis of a 2-D mesh, model parallelism on the other.

``jax.shard_map`` over a 4 x 2 mesh ("data", "model") of 8 CPU devices:

- "model": the CNN's hidden layer is split Megatron-style over the 2 model
  devices: ``Dense_0``'s kernel by columns (P(None, "model")) and its bias,
  ``Dense_1``'s kernel by rows (P("model", None)); each device computes half
  of the hidden units and a partial sum of the logits, which one
  ``psum`` over "model" completes. The convolutions and ``Dense_1``'s bias are
  replicated over "model"; the convolutions' gradients, computed on each
  model device from its half of the hidden units, are summed over "model".
  So the model axis does real work, and its two collectives travel dense and
  uncompressed.
- "data": 4 workers, each with its own 16 examples; the gradients (of every
  device's own parameter block) are averaged over "data" only, compressed by
  ``jaxcomp.<method>(axis_name="data")``.

The compression state is per device: a device's residual belongs to the
gradient block it holds, which differs across "data" (different examples)
and, for the split layer, across "model" (different blocks). So it is built
by ``tx.init`` on one device's block of the parameters and stacked with
``jaxcomp.per_worker(state, mesh, ("data", "model"))``: a leading axis of 8
sharded over both mesh axes. (With ``per_worker(state, mesh, "data")`` alone
the residual of the split layer would wrongly be one value across "model".)

``check_vma=False``: the compressed mean is identical on every "data" worker
by construction (every worker decodes the same gathered payloads), which
shard_map's type system cannot see through an all-gather::

    python examples/train_shard_map.py --method topk --ratio 0.01 --steps 300
"""

from __future__ import annotations

import sys

import _common

DATA, MODEL = 4, 2


def main(argv=None) -> dict:
  args, options = _common.parse(_common.parser(__doc__.splitlines()[0], steps=300), argv)

  import jax

  import jaxcomp

  jaxcomp.cpu_devices(DATA * MODEL)  # before any JAX work

  import flax.linen as nn
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  from tqdm.auto import tqdm

  from jaxcomp_bench import data, model

  ds = data.load(args.dataset)
  net = model.CNN()
  params = model.init_params(net, ds.image_shape, args.seed)
  hidden = params["Dense_0"]["kernel"].shape[1]
  if hidden % MODEL:
    raise SystemExit(f"the hidden width {hidden} must divide by the model axis {MODEL}")

  mesh = jax.make_mesh((DATA, MODEL), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  rep = P()
  param_specs = {
      "Conv_0": {"kernel": rep, "bias": rep}, "Conv_1": {"kernel": rep, "bias": rep},
      "Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
      "Dense_1": {"kernel": P("model", None), "bias": rep},
  }
  # Replicated over "model" but computed from one device's half of the hidden
  # units: these gradients are partial sums until a psum over "model".
  partial_over_model = {
      "Conv_0": {"kernel": True, "bias": True}, "Conv_1": {"kernel": True, "bias": True},
      "Dense_0": {"kernel": False, "bias": False}, "Dense_1": {"kernel": False, "bias": False},
  }
  block = hidden // MODEL
  one_block = {  # the shapes one device holds
      **{k: params[k] for k in ("Conv_0", "Conv_1")},
      "Dense_0": {"kernel": params["Dense_0"]["kernel"][:, :block],
                  "bias": params["Dense_0"]["bias"][:block]},
      "Dense_1": {"kernel": params["Dense_1"]["kernel"][:block], "bias": params["Dense_1"]["bias"]},
  }

  compress = _common.compression(args.method, options, axis_name="data")
  tx = optax.chain(compress, optax.sgd(args.lr, momentum=0.9))

  def partial_logits(p, x):
    """This device's share of the logits: its half of the hidden units times its rows of Dense_1."""
    h = x
    for name in ("Conv_0", "Conv_1"):
      h = nn.relu(nn.Conv(p[name]["kernel"].shape[-1], (3, 3)).apply({"params": p[name]}, h))
      h = nn.avg_pool(h, (2, 2), strides=(2, 2))
    h = h.reshape(h.shape[0], -1)
    h = nn.relu(h @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return h @ p["Dense_1"]["kernel"]

  def step(p, s, x, y):
    part, pullback = jax.vjp(lambda q: partial_logits(q, x), p)
    logits = lax.psum(part, "model") + p["Dense_1"]["bias"]
    loss, dlogits = jax.value_and_grad(
        lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean())(logits)
    (grads,) = pullback(dlogits)
    grads["Dense_1"]["bias"] = dlogits.sum(0)  # after the psum: already whole
    grads = jax.tree.map(lambda g, r: lax.psum(g, "model") if r else g, grads, partial_over_model)
    updates, s = tx.update(grads, jaxcomp.local(s), p)  # compressed mean over "data" only
    return optax.apply_updates(p, updates), jaxcomp.stacked(s), loss[None]

  state_spec = P(("data", "model"))
  p_step = jax.jit(
      jax.shard_map(step, mesh=mesh, in_specs=(param_specs, state_spec, P("data"), P("data")),
                    out_specs=(param_specs, state_spec, P("data")), check_vma=False),
      donate_argnums=(0, 1))

  put = lambda tree, specs: jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)  # noqa: E731
  Pm = put(params, param_specs)
  S = jaxcomp.per_worker(tx.init(one_block), mesh, ("data", "model"))

  batches = data.worker_batches(ds, DATA, args.batch, args.steps, args.seed)
  flat = lambda xb, yb: (xb.reshape((-1,) + xb.shape[2:]), yb.reshape(-1))  # noqa: E731
  x, y = flat(*next(batches))
  wire = jaxcomp.measure_wire_bytes(p_step, Pm, S, x, y)
  nominal = jaxcomp.wire_bytes(compress, one_block, workers=DATA)

  losses = []
  with tqdm(total=args.steps, desc=args.method, disable=args.no_progress, mininterval=1.0) as bar:
    for i in range(args.steps):
      if i:
        x, y = flat(*next(batches))
      Pm, S, loss = p_step(Pm, S, x, y)
      losses.append(loss)
      if (i + 1) % 8 == 0 or i + 1 == args.steps:
        bar.set_postfix(loss=f"{float(jnp.mean(loss)):.4f}", refresh=False)
        bar.update(i + 1 - bar.n)

  final = jax.device_get(Pm)
  acc, test_loss = model.evaluate(final, net, ds.x_test, ds.y_test)
  train_loss = float(np.mean(np.asarray(jax.device_get(losses[-10:]))))
  total, digest = _common.checksum(final)
  print(f"method {args.method} {options or ''}: mesh data={DATA} x model={MODEL},"
        f" {args.steps} steps x {args.batch} examples per data worker")
  print(f"test accuracy {100 * acc:.2f}%  test loss {test_loss:.4f}  final train loss {train_loss:.4f}")
  print(f"wire bytes per device per step: {wire['total']:,} measured in all ({wire['count']} collectives,"
        f" with the dense model-axis psums); compression over 'data': {nominal:,} nominal")
  print(f"param checksum {total:.6f} sha256 {digest}")
  return {"accuracy": acc, "loss": train_loss, "wire_bytes": wire["total"], "checksum": total,
          "params": final}


if __name__ == "__main__":
  main(sys.argv[1:])
