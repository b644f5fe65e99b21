"""The factories' one signature: ``method(<hyperparameters>, *, axis_name=None, <build options>)``."""

import inspect

import pytest

import jaxcomp

BUILD = ("axis_name", "seed", "bucket_bytes", "min_size", "dense", "dense_axis_name", "transport")
FACTORIES = sorted(jaxcomp.METHODS) + ["onebit_adam", "zero_one_adam", "demo", "diloco", "sparseloco",
                                       "apply_if_finite"]


def _factory(name):
  return jaxcomp.METHODS[name] if name in jaxcomp.METHODS else getattr(jaxcomp, name)


@pytest.mark.parametrize("name", FACTORIES)
def test_axis_name_and_build_options_are_keyword_only(name):
  params = inspect.signature(_factory(name)).parameters
  assert "axis_name" in params
  for p in params.values():
    if p.name in BUILD:
      assert p.kind == p.KEYWORD_ONLY, (name, p.name)


def test_a_positional_axis_name_and_a_renamed_keyword_name_the_fix():
  with pytest.raises(TypeError, match=r"topk\(\) takes 1 positional arguments \(ratio\).*axis_name='data'"):
    jaxcomp.topk(0.01, "data")
  with pytest.raises(TypeError, match=r"dgc\(\) takes transport= in place of exchange="):
    jaxcomp.dgc(0.01, axis_name="data", exchange="scatter")
  assert jaxcomp.topk(0.01, axis_name="data", transport="scatter").transport == "scatter"
