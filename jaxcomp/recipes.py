"""One optax chain per method: where dense training uses ``optax.sgd(lr, momentum=0.9)``.

``jaxcomp.recipe(name, learning_rate, axis_name=...)`` returns the whole
chain a method should use in that place: the method, its memory and warm-up,
and the outer optimizer. :data:`RECIPES` states each choice and why; the
README's recipe table is printed from it (``python -m jaxcomp.bench recipes``).

Three kinds of recipe:

- ``"outer"``: the method, then ``sgd(lr, momentum)``. For methods whose
  output is an unbiased or nearly lossless gradient estimate (the dense
  baselines, the quantizers, the low-rank methods): the outer momentum sees
  what dense training would.
- ``"inner"``: the method with :func:`jaxcomp.momentum_correction` (the
  momentum moves in front of the compressor, error feedback acts on it),
  then ``sgd(lr)`` without momentum. For biased methods with plain error
  feedback (sparsifiers, sign and 1-bit methods): an outer momentum would
  replay their delayed residuals, amplified by 1 / (1 - momentum).
- ``"ef21"``: the method with :func:`jaxcomp.ef21` (its output is a running
  gradient estimate, never an amplified residual), then ``sgd(lr, momentum)``.
- ``"own"``: methods that keep a momentum of their own (DGC's correction,
  Signum's local momentum) get ``sgd(lr)``; a sign output gets a scaled
  learning rate (its entries are +-1, not a gradient).
- ``"after"``: ``sgd(lr, momentum)`` first, then the method, which
  compresses the update (SBC's communication delay accumulates updates).

The choices were measured on the main job (``python -m jaxcomp.bench
--quick``, 100 steps) and on scikit-learn's digits (tests/test_recipes.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from jaxcomp.core import configure
from jaxcomp.memories import ef21, momentum_correction
from jaxcomp.transforms import _args


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a method is used in place of ``sgd(lr, momentum)``.

  Attributes:
    kind: ``"outer"``, ``"inner"``, ``"ef21"``, ``"own"`` or ``"after"`` (module docstring).
    lr_scale: the method's learning rate is ``lr_scale * learning_rate``.
    method_kwargs: settings the recipe passes to the factory (the caller's
      keyword arguments override them).
    masking: with ``kind="inner"``, DGC's momentum factor masking.
    why: one line for the README.
  """

  kind: str
  why: str
  lr_scale: float = 1.0
  method_kwargs: Any = ()
  masking: bool = False


RECIPES: dict[str, Recipe] = {
    "none": Recipe("outer", "dense mean"),
    "fp16": Recipe("outer", "16-bit rounding only"),
    "bf16": Recipe("outer", "16-bit rounding only"),
    "qsgd": Recipe("outer", "unbiased"),
    "terngrad": Recipe("outer", "unbiased given its clip"),
    "natural": Recipe("outer", "unbiased"),
    "u8bit": Recipe("outer", "8-bit table, small relative error"),
    "sketchml": Recipe("outer", "quantile buckets, small relative error"),
    "powersgd": Recipe("outer", "error feedback on a rank-4 estimate that keeps most of the energy"),
    "acpsgd": Recipe("outer", "as PowerSGD"),
    "topk": Recipe("inner", "1% of entries: momentum before the residual (DGC's correction)"),
    "randomk": Recipe("inner", "1% of entries at random: momentum before the residual"),
    "threshold": Recipe("ef21", "a sampled threshold sends an uneven amount: EF21's estimates, outer momentum"),
    "adaq": Recipe("inner", "sparse and quantized: momentum before the residual"),
    "inceptionn": Recipe("inner", "error feedback on a lossy code: momentum before the residual"),
    "onebit": Recipe("inner", "1 bit with error feedback: momentum before the residual"),
    "signsgd": Recipe("inner", "sign with error feedback (scale per leaf) and momentum before it",
                      method_kwargs=(("error_feedback", True),)),
    "efsignsgd": Recipe("outer", "its scaled memory holds the learning rate; outer momentum as dense"),
    "dgc": Recipe("own", "DGC's own momentum correction and masking; without its warm-up and clipping"
                  " (main job, 600 steps: 90.0% with them, 97.4% without, dense 97.5%)",
                  method_kwargs=(("clip_norm", None), ("warmup_steps", 0))),
    "redsync": Recipe("inner", "momentum before the residual, without DGC's masking"),
    "signum": Recipe("own", "local momentum, majority vote of signs: a +-1 step, lr scaled",
                     lr_scale=0.02),
    "sbc": Recipe("after", "compresses the optimizer's update, as in the paper: sgd(lr, momentum) first"),
}

OPTIMIZERS = ("sgd",)


def recipe(name: str, learning_rate: float | optax.Schedule, axis_name: Any = None, *,
           optimizer: str = "sgd", momentum: float = 0.9, **method_kwargs) -> optax.GradientTransformation:
  """The optax chain method ``name`` should use where dense training uses ``sgd(lr, momentum)``.

  Args:
    name: a method of :data:`jaxcomp.METHODS`.
    learning_rate: dense training's learning rate (a float or an optax schedule).
    axis_name: the data-parallel axis, as for the factories.
    optimizer: ``"sgd"`` (momentum SGD), the only one so far.
    momentum: dense training's momentum (0.9).
    **method_kwargs: the factory's settings (override the recipe's).

  Returns:
    The optax chain (``sgd`` after the method, or before it for ``"after"``
    recipes). For byte counts pass :func:`recipe_method`'s transform to
    :func:`jaxcomp.wire_bytes`.
  """
  name = _args.choice("name", name, tuple(RECIPES))
  _args.choice("optimizer", optimizer, OPTIMIZERS)
  m = _args.unit_interval("momentum", momentum)
  tx = recipe_method(name, axis_name, momentum=m, **method_kwargs)
  r = RECIPES[name]
  lr = learning_rate if r.lr_scale == 1.0 else _scaled(learning_rate, r.lr_scale)
  if r.kind in ("outer", "ef21", "after"):
    outer = optax.sgd(lr, momentum=m or None)
  else:
    outer = optax.sgd(lr)
  return optax.chain(outer, tx) if r.kind == "after" else optax.chain(tx, outer)


def recipe_method(name: str, axis_name: Any = None, *, momentum: float = 0.9, **method_kwargs):
  """The compression transform of :func:`recipe` alone (for :func:`jaxcomp.wire_bytes`)."""
  from jaxcomp import METHODS  # the registry imports this module

  name = _args.choice("name", name, tuple(RECIPES))
  r = RECIPES[name]
  kwargs = dict(r.method_kwargs)
  if name == "redsync" and r.kind == "own":
    kwargs["momentum"] = momentum
  kwargs.update(method_kwargs)
  tx = METHODS[name](axis_name=axis_name, **kwargs)
  if r.kind == "inner" and momentum > 0:
    tx = configure(tx, memory=momentum_correction(momentum, masking=r.masking))
  if r.kind == "ef21":
    tx = configure(tx, memory=ef21())
  return tx


def _scaled(learning_rate, scale):
  if callable(learning_rate):
    return lambda count: scale * learning_rate(count)
  return scale * learning_rate
