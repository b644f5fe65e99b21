"""What 1-bit Adam and 0/1 Adam share: Adam's settings, the codec of their payload, the variance floor."""

from __future__ import annotations

import inspect

import jax.numpy as jnp

from jaxcomp.registry import METHODS
from jaxcomp.transforms import _args


def adam_args(learning_rate, b1, b2, eps, weight_decay):
  """Adam's settings checked (errors name the argument)."""
  if not callable(learning_rate):
    _args.positive("learning_rate", learning_rate)
  return (_args.unit_interval("b1", b1), _args.unit_interval("b2", b2), _args.positive("eps", eps),
          _args.positive("weight_decay", weight_decay, allow_zero=True))


def codec_compressor(codec: str, axis_name, transport: str, seed: int, codec_kwargs: dict):
  """The jaxcomp transformation ``codec`` over ``axis_name`` that moves an optimizer's payload."""
  codec = _args.choice("codec", codec, tuple(m for m in METHODS if m != "none"))
  factory = METHODS[codec]
  if "seed" in inspect.signature(factory).parameters:
    codec_kwargs = {**codec_kwargs, "seed": seed}
  return factory(axis_name=axis_name, transport=transport, **codec_kwargs)


def frozen_denominator(v, bc2, eps: float, var_floor: float):
  """Adam's ``sqrt(v / bc2) + eps`` with ``v`` at least ``var_floor`` times its leaf's mean (0: none)."""
  if var_floor:
    v = jnp.maximum(v, var_floor * jnp.mean(v))
  return jnp.sqrt(v / bc2) + eps
