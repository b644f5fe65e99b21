"""jaxcomp.core.compression: the built transformation carries its settings; method_of finds it in wrappers."""

import copy

import jax.numpy as jnp
import optax
import pytest

import jaxcomp

PARAMS = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}


def test_settings_are_declared_and_survive_copies():
  tx = jaxcomp.topk(0.1, axis_name="data", transport="scatter", seed=3)
  for t in (tx, copy.copy(tx), copy.deepcopy(tx)):
    assert isinstance(t, jaxcomp.CompressionTransformation)
    assert (t.method.name, t.axis_name, t.transport, t.seed) == ("topk", "data", "scatter", 3)
  opt = copy.deepcopy(jaxcomp.onebit_adam(1e-3, axis_name="data"))
  assert jaxcomp.method_of(opt).name == "onebit"


def test_method_of_sees_through_optax_wrappers():
  tx = jaxcomp.qsgd(axis_name="data")
  for wrapped in (optax.chain(tx, optax.sgd(0.1)), optax.MultiSteps(optax.chain(tx, optax.sgd(0.1)), 2),
                  optax.masked(tx, {"w": True, "b": False})):
    assert jaxcomp.method_of(wrapped, PARAMS) is tx.method
    assert jaxcomp.compressor(wrapped, PARAMS) is tx
  with pytest.raises(TypeError, match=r"jaxcomp.method_of\(tx, params\)"):
    jaxcomp.method_of(optax.chain(tx, optax.sgd(0.1)))
  with pytest.raises(TypeError, match="tx holds no jaxcomp transformation"):
    jaxcomp.method_of(optax.sgd(0.1), PARAMS)
