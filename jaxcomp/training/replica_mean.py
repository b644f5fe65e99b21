"""A compressed mean over a stacked replica axis: the hook for trainers that hold their replicas stacked.

MaxText's DiLoCo trainer (``drjax``) keeps one copy of the model per replica
on a leading axis sharded over a mesh axis ("diloco") and averages the
replicas' pseudo-gradients with ``drjax.reduce_mean``. :func:`compressed_mean`
is the same reduction through any jaxcomp method, with its error feedback in
a state the caller carries::

    mean = jaxcomp.compressed_mean(jaxcomp.topk(0.01, axis_name="diloco"), mesh, param_specs)
    comp_state = mean.init(params)                          # a field of the trainer's state
    ...
    avg, comp_state = mean.update(model_delta, comp_state)  # was: drjax.reduce_mean(model_delta)

``model_delta``'s leaves have a leading axis of one entry per replica (the
mesh's ``axis_name`` size), the rest laid out as ``param_specs`` says over
the fast axes (fsdp, tensor: each device compresses its own shard, nothing
is gathered); ``avg`` is laid out as the parameters, the same bits on every
replica. It is :func:`jaxcomp.on_shards` over the compressor alone.
"""

from __future__ import annotations

from typing import Any

import optax
from jax.sharding import Mesh

from jaxcomp.core.compression import CompressedOptimizer, CompressionTransformation
from jaxcomp.training.own_step import on_shards


def compressed_mean(compressor: Any, mesh: Mesh, param_specs: Any = None) -> optax.GradientTransformation:
  """The mean over a stacked replica axis through ``compressor``, with its error-feedback state.

  Args:
    compressor: a jaxcomp method built with ``axis_name`` the mesh axis the replicas are stacked over
      (``jaxcomp.topk(0.01, axis_name="diloco")``, ``jaxcomp.fp4(axis_name="diloco")``; ``jaxcomp.none``
      for the dense float32 mean).
    mesh: the ``jax.sharding.Mesh`` (axis types Auto) holding that axis and the fast axes.
    param_specs: a pytree like the parameters of ``PartitionSpec`` over the fast axes (one replica's
      layout), or None for parameters replicated within a replica.

  Returns:
    An ``optax.GradientTransformation``: ``init(params)`` (one replica's parameters, unstacked) gives the
    state, one block per device; ``update(tree, state)`` takes ``tree`` with a leading replica axis and
    returns ``(mean, state)``, ``mean`` laid out as the parameters. Call both inside ``jax.jit`` (or a
    ``drjax.program``).

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> mesh = jax.make_mesh((1,), ("diloco",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> mean = jaxcomp.compressed_mean(jaxcomp.none(axis_name="diloco"), mesh)
    >>> state = mean.init({"w": jnp.zeros((4,))})
    >>> avg, state = mean.update({"w": jnp.ones((1, 4))}, state)
    >>> avg["w"].tolist()
    [1.0, 1.0, 1.0, 1.0]
  """
  if isinstance(compressor, CompressedOptimizer) or not isinstance(compressor, CompressionTransformation):
    raise TypeError("compressed_mean: compressor must be a jaxcomp method (a factory's result, e.g."
                    f" jaxcomp.topk(0.01, axis_name='diloco')), got {compressor!r}")
  if compressor.axis_name is None:
    raise ValueError("compressed_mean: build the compressor with axis_name= the mesh axis the replicas"
                     " are stacked over (e.g. axis_name='diloco'), got axis_name=None")
  tx = on_shards(compressor, mesh, param_specs, compressor.axis_name)
  return optax.GradientTransformation(tx.init, lambda tree, state, params=None: tx.update(tree, state))
