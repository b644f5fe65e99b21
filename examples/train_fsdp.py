"""A transformer LM with sharded parameters (FSDP and tensor axes), compressed over the slow axis only.

A small decoder-only transformer in Flax NNX (2 blocks, width 64, 4 heads,
context 64) learns the character text of Python's own documentation
(``pydoc_data.topics``, :mod:`jaxcomp_bench.transformer`'s data) on a mesh of
8 CPU devices, (dcn=2, fsdp=2, tensor=2):

- its kernels are annotated with ``nnx.with_partitioning`` over "fsdp" and
  "tensor" (in-projections ("fsdp", "tensor"), out-projections ("tensor",
  "fsdp"), the token embedding ("fsdp", None)); LayerNorms stay replicated;
- ``jaxcomp.data_parallel(loss, tx, mesh, param_specs=nnx.get_partition_spec(params))``
  keeps each device's shard of the parameters, of AdamW's moments and of
  jaxcomp's residual; a step all-gathers the parameters over the fast axes,
  computes the loss on the device's rows (the batch is split over all three
  axes), reduce-scatters the gradient back to the shards (dense, fast axes)
  and averages the shards over "dcn" through the jaxcomp method (compressed);
- ``tx = optax.chain(jaxcomp.<method>(axis_name="dcn"), optax.adamw(lr))``:
  the method in front of AdamW (``python -m jaxcomp.bench lm --chain
  default``), compressed from the first step, for every method, and the step
  holds one exchange whose bytes are exactly ``jaxcomp.wire_bytes``.
  ``--recipe``: ``jaxcomp.recipe(method, lr, axis_name="dcn",
  optimizer="adamw")`` instead, which learns better but runs most methods on
  Adam's momentum after 50-100 steps of dense exchange (topk: 100), so a
  short run is mostly dense and the step holds both exchanges.

It prints the training loss every ``--log-every`` steps, the held-out loss,
the bytes one device hands to collectives per step (read from the compiled
step's HLO, per mesh axis) against ``jaxcomp.wire_bytes`` of its shards and
their dense size, and checks that the parameters are still sharded as their
specs say. ``--replicated``: the same model and data with replicated
parameters and the method over all 8 devices, for comparison::

    python examples/train_fsdp.py --method topk --steps 200
    python examples/train_fsdp.py --method topk --ratio 0.05
    python examples/train_fsdp.py --method none --replicated
"""

from __future__ import annotations

import argparse
import sys

import _common

AXES, SHAPE = ("dcn", "fsdp", "tensor"), (2, 2, 2)
CONTEXT, WIDTH, HEADS, MLP, LAYERS = 64, 64, 4, 256, 2


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      epilog="Any other --option value is passed to the method's factory, e.g. --ratio 0.05.")
  p.add_argument("--method", default="topk", help="a name in jaxcomp.METHODS (default topk)")
  p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
  p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
  p.add_argument("--batch", type=int, default=8,
                 help="windows of 64 characters per device per step (default 8)")
  p.add_argument("--seed", type=int, default=0, help="init and data-order seed (default 0)")
  p.add_argument("--log-every", type=int, default=20,
                 help="print the training loss every N steps (default 20)")
  p.add_argument("--replicated", action="store_true",
                 help="parameters replicated, the method over all 8 devices (the unsharded baseline)")
  p.add_argument("--recipe", action="store_true",
                 help="jaxcomp.recipe(method, lr, axis_name, optimizer='adamw') for chain(method, adamw)")
  p.add_argument("--no-progress", action="store_true", help="no training-loss lines")
  return p


def transformer(vocab: int, rngs):
  """The model (its classes built here, once JAX's devices are set up)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  init, zeros = nnx.initializers.normal(0.02), nnx.initializers.zeros_init()

  def linear(n_in, n_out, kernel_axes, bias_axes):
    return nnx.Linear(n_in, n_out, kernel_init=nnx.with_partitioning(init, kernel_axes),
                      bias_init=nnx.with_partitioning(zeros, bias_axes), rngs=rngs)

  class Block(nnx.Module):
    """Pre-LayerNorm: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self):
      self.ln_attention = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.qkv = linear(WIDTH, 3 * WIDTH, ("fsdp", "tensor"), ("tensor",))
      self.attention_out = linear(WIDTH, WIDTH, ("tensor", "fsdp"), ("fsdp",))
      self.ln_mlp = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.mlp_in = linear(WIDTH, MLP, ("fsdp", "tensor"), ("tensor",))
      self.mlp_out = linear(MLP, WIDTH, ("tensor", "fsdp"), ("fsdp",))

    def __call__(self, x):
      b, t, _ = x.shape
      qkv = self.qkv(self.ln_attention(x)).reshape(b, t, 3, HEADS, WIDTH // HEADS)
      h = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
      x = x + self.attention_out(h.reshape(b, t, WIDTH))
      return x + self.mlp_out(nnx.gelu(self.mlp_in(self.ln_mlp(x))))

  class Transformer(nnx.Module):
    """Token and position embeddings, LAYERS causal blocks, LayerNorm, logits (..., T, vocab)."""

    def __init__(self):
      self.tokens = nnx.Embed(vocab, WIDTH, embedding_init=nnx.with_partitioning(init, ("fsdp", None)),
                              rngs=rngs)
      self.positions = nnx.Embed(CONTEXT, WIDTH, embedding_init=nnx.with_partitioning(init, (None, "tensor")),
                                 rngs=rngs)
      self.blocks = nnx.List([Block() for _ in range(LAYERS)])
      self.ln_final = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.logits = linear(WIDTH, vocab, ("fsdp", "tensor"), ("tensor",))

    def __call__(self, tokens):
      x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[-1]))
      for block in self.blocks:
        x = block(x)
      return self.logits(self.ln_final(x))

  return Transformer()


def check_sharded(params, specs, mesh) -> None:
  """Raises unless every parameter is laid out over ``mesh`` as its spec says."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  wanted = jax.tree.leaves(specs, is_leaf=lambda s: s is None or isinstance(s, P))
  for (path, x), spec in zip(flat, wanted, strict=True):
    want = NamedSharding(mesh, spec or P())
    if not x.sharding.is_equivalent_to(want, x.ndim):
      raise AssertionError(f"{jax.tree_util.keystr(path)}: sharded as {x.sharding},"
                           f" its spec says {want.spec}")


def _report_bytes(args, tx, params, dp, state, batch, mesh) -> dict:
  """The step's collective bytes per axis (HLO) against jaxcomp.wire_bytes of a device's shards and dense."""
  import jax
  import jax.numpy as jnp

  import jaxcomp
  from jaxcomp.collectives import hlo

  by_axes = hlo.bytes_by_axes(dp.lower(params, state, batch).compile().as_text(), mesh)
  compressed_over = AXES if args.replicated else ("dcn",)
  shard = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.addressable_shards[0].data.shape, jnp.float32),
                       params)
  nominal = jaxcomp.wire_bytes(tx, shard)  # a recipe's: after its warm-up
  dense = jaxcomp.wire_bytes(jaxcomp.none(axis_name=compressed_over), shard)
  measured = by_axes.get(compressed_over, 0)
  what = "each device's whole parameters" if args.replicated else "each device's shards"
  print(f"bytes per device per step over {'+'.join(compressed_over)} ({args.method}): {measured:,} measured"
        " in the HLO (with the loss's mean, 4)"
        f"{' (both stages of the recipe)' if args.recipe else ''}, jaxcomp.wire_bytes of {what}"
        f" {nominal:,}, dense {dense:,}"
        f" ({dense / max(nominal, 1):.1f}x fewer)")
  fast = ", ".join(f"{'+'.join(a) or 'none'} {b:,}" for a, b in by_axes.items() if a != compressed_over)
  print(f"  other collectives (dense, fast axes): {fast or 'none'}")
  return {"measured_bytes": measured, "wire_bytes": nominal, "dense_bytes": dense,
          "bytes_by_axes": by_axes}


def _optimizer(args, options):
  """``chain(METHODS[method](axis_name), adamw(lr))``, or with ``--recipe`` the method's AdamW recipe."""
  import optax

  import jaxcomp

  axis_name = AXES if args.replicated else "dcn"
  if not args.recipe:
    return optax.chain(_common.compression(args.method, options, axis_name), optax.adamw(args.lr))
  try:
    return jaxcomp.recipe(args.method, args.lr, axis_name=axis_name, optimizer="adamw", **options)
  except (TypeError, ValueError) as e:
    raise SystemExit(f"--recipe --method {args.method}: {e}") from None


def main(argv=None) -> dict:
  args, options = _common.parse(parser(), argv)

  import jax

  import jaxcomp

  jaxcomp.cpu_devices(8)  # before any JAX work

  import optax
  from flax import nnx
  from jax.sharding import AxisType

  from jaxcomp_bench import transformer as data

  corpus = data.load()
  vocab = -(-corpus.vocab_size // 8) * 8  # padded: the embedding and logits divide over fsdp and tensor
  mesh = jax.make_mesh(SHAPE, AXES, axis_types=(AxisType.Auto,) * 3, devices=jax.devices()[:8])
  with jax.set_mesh(mesh):  # flax creates annotated parameters sharded on the mesh in context
    graphdef, params = nnx.split(transformer(vocab, nnx.Rngs(args.seed)), nnx.Param)
  specs = nnx.get_partition_spec(params)
  tx = _optimizer(args, options)

  def loss_fn(p, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphdef, p)(x), y).mean()

  held_x, held_y = data.windows(corpus.held_out, data.held_out_starts(len(corpus.held_out)))
  held_out = jax.jit(lambda p: loss_fn(p, (held_x, held_y)))
  initial = float(held_out(jax.device_get(params)))

  def batch(t):
    x, y = data.windows(corpus.train, data.train_starts(len(corpus.train), t, 8, args.batch, args.seed))
    return x.reshape(-1, CONTEXT), y.reshape(-1, CONTEXT)  # split over (dcn, fsdp, tensor) in that order

  dp = jaxcomp.data_parallel(loss_fn, tx, mesh, param_specs=None if args.replicated else specs)
  p, s = dp.init(params)
  wire = _report_bytes(args, tx, p, dp, s, batch(0), mesh)
  losses = []
  for t in range(args.steps):
    p, s, loss = dp.step(p, s, batch(t))
    losses.append(float(loss))
    if not args.no_progress and args.log_every > 0 and ((t + 1) % args.log_every == 0 or t == 0):
      print(f"step {t + 1:4d}  train loss {losses[-1]:.4f}")
  if not args.replicated:
    check_sharded(p, specs, mesh)
  final = float(held_out(jax.device_get(p)))
  layout = ("replicated, compressed over all 8" if args.replicated
            else "sharded over fsdp x tensor, compressed over dcn")
  print(f"method {args.method}{' (recipe)' if args.recipe else ''} {options or ''}:"
        f" mesh dcn=2 x fsdp=2 x tensor=2, parameters {layout};"
        f" {args.steps} steps x {args.batch} windows per device")
  print(f"held-out loss {initial:.4f} -> {final:.4f} nats/char;"
        f" train loss {losses[0]:.4f} -> {losses[-1]:.4f}")
  if not args.replicated:
    print("parameters still sharded as their specs say")
  total, digest = _common.checksum(jax.device_get(p))
  print(f"param checksum {total:.6f} sha256 {digest}")
  return {"losses": losses, "initial_held_out": initial, "held_out": final, **wire,
          "sharded": not args.replicated, "params": p, "specs": specs, "mesh": mesh}


if __name__ == "__main__":
  main(sys.argv[1:])
