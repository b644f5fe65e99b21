"""One optax chain per method: where dense training uses ``optax.sgd(lr, momentum=0.9)`` or ``adamw(lr)``.

``jaxcomp.recipe(name, learning_rate, axis_name=...)`` returns the whole
chain a method should use in that place: the method, its memory and warm-up,
and the outer optimizer. :data:`RECIPES` states each choice and why; the
recipe tables of docs/recipes.md are printed from it (``python -m jaxcomp.bench
recipes``), and the figures behind each choice are there too.
``optimizer="adamw"`` gives the recipe for ``optax.adamw``'s place instead
(:data:`ADAMW_RECIPES`, kinds described by :class:`AdamWRecipe`). Every
setting of the method's factory and of the optimizer passes through
``recipe``'s keyword arguments and overrides the recipe's.

The kinds of SGD recipe:

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
  Signum's local momentum, set to ``recipe``'s ``momentum``) get ``sgd(lr)``; a sign output gets a scaled
  learning rate (its entries are +-1, not a gradient).
- ``"after"``: ``sgd(lr, momentum)`` first, then the method, which
  compresses the update (SBC's communication delay accumulates updates).

Every recipe compresses every leaf (:func:`every_leaf`), and
``recipe(..., total_steps=T)`` scales its warm-ups to the run
(:func:`warmup_steps`). The choices were measured on the main job
(``python -m jaxcomp.bench``), on scikit-learn's digits
(tests/test_recipes.py) and on the suite of five tasks
(``python -m jaxcomp.bench suite``); docs/recipes.md has the figures, and which
methods need runs longer than 300 steps.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import optax

from jaxcomp.core.compression import compressed_optimizer
from jaxcomp.core.memories import ef21, momentum_correction
from jaxcomp.core.rebuild import configure
from jaxcomp.core.warmup import ratio_warmup
from jaxcomp.optimizers.demo import demo
from jaxcomp.optimizers.onebit_adam import onebit_adam
from jaxcomp.optimizers.zero_one_adam import zero_one_adam
from jaxcomp.registry import METHODS
from jaxcomp.training.recipe_table import ADAMW_RECIPES, OPTIMIZERS, RECIPES
from jaxcomp.transforms import _args

# The run length each table's warm-ups are stated for: recipe(..., total_steps=T) scales them by T / this.
REFERENCE_STEPS = {"sgd": 600, "adamw": 300}

# 1-bit Adam's and 0/1 Adam's frozen variance is at least this fraction of its leaf's mean: on the
# suite's MNIST CNN (dead ReLUs: variance 0, a 1-bit momentum of the leaf's scale) every recipe on
# the momentum diverged to 10% without it (0.01: 94.6-95.2% against dense 94.4%; 0.001: 94.4-95.1%).
VAR_FLOOR = 0.01
ADAMW = {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 1e-4}  # optax.adamw's defaults


def recipe(name: str, learning_rate: float | optax.Schedule, axis_name: Any = None, *,
           optimizer: str = "sgd", momentum: float | None = None, total_steps: int | None = None,
           **kwargs) -> optax.GradientTransformation:
  """The optax chain method ``name`` should use where dense training uses ``sgd(lr, momentum)`` (or adamw).

  Args:
    name: a method of :data:`jaxcomp.METHODS` (with ``optimizer="adamw"``
      also ``"onebit_adam"``, ``"zero_one_adam"``, ``"demo"``: see
      :data:`ADAMW_RECIPES`).
    learning_rate: dense training's learning rate (a float or an optax schedule).
    axis_name: the data-parallel axis, as for the factories.
    optimizer: ``"sgd"`` (momentum SGD, :data:`RECIPES`) or ``"adamw"``
      (``optax.adamw``'s defaults with weight decay 1e-4, :data:`ADAMW_RECIPES`).
    momentum: with ``"sgd"``, dense training's momentum (default 0.9): the
      outer ``sgd``'s, the momentum correction's, or the method's own
      momentum (DGC, Signum). With ``"adamw"`` (whose momentum is ``b1``),
      the method's own ``momentum=`` setting, if it has one.
    total_steps: the run's length in steps, if known: every warm-up of the
      recipe (dense steps first, a ratio warm-up, 1-bit Adam's freeze step)
      becomes the same fraction of this run as it is of :data:`REFERENCE_STEPS`
      (:func:`warmup_steps`). None: the warm-ups' steps as the tables state.
    **kwargs: settings of the method's factory and of the optimizer (the
      caller's override the recipe's): with ``"sgd"``, ``optax.sgd``'s
      ``nesterov`` and ``accumulator_dtype``; with ``"adamw"``,
      ``optax.adamw``'s (``b1``, ``b2``, ``eps``, ``weight_decay``, ...), or
      for recipes on the momentum :func:`jaxcomp.onebit_adam`'s
      (``freeze_step``, ``transport``, ...), or the complete optimizer's.

  Returns:
    The optax chain (``sgd`` after the method; for ``"after"`` recipes the
    method wrapping ``sgd``, whose update it compresses, with
    ``.compressor``); with ``"adamw"`` a complete optimizer with
    ``.compressor``. :func:`jaxcomp.wire_bytes` counts any of them.

  Raises:
    TypeError: a keyword argument that neither the factory nor the optimizer
      takes (the message names both).
  """

  _args.choice("optimizer", optimizer, OPTIMIZERS)
  if optimizer == "adamw":
    return _adamw_recipe(name, learning_rate, axis_name, momentum, total_steps, **kwargs)
  name = _args.choice("name", name, tuple(RECIPES))
  m = _args.unit_interval("momentum", 0.9 if momentum is None else momentum)
  r = _scaled_recipe(RECIPES[name], "sgd", total_steps)  # checks total_steps for every kind
  method_kw, sgd_kw = _split(name, "sgd", kwargs, (name, _takes(METHODS[name], "axis_name", "optimizer")),
                             ("optax.sgd", _takes(optax.sgd, "learning_rate", "momentum")))
  lr = learning_rate if r.lr_scale == 1.0 else _scaled(learning_rate, r.lr_scale)
  outer = optax.sgd(lr, momentum=(m or None) if r.kind in ("outer", "ef21", "after") else None, **sgd_kw)
  if r.kind == "after":  # the method wraps the optimizer and compresses its update (SBC's delay)
    return METHODS[name](axis_name=axis_name, optimizer=outer,
                         **{**every_leaf(METHODS[name]), **dict(r.method_kwargs), **method_kw})
  return optax.chain(recipe_method(name, axis_name, momentum=m, total_steps=total_steps, **method_kw), outer)


def recipe_method(name: str, axis_name: Any = None, *, optimizer: str = "sgd", momentum: float | None = None,
                  total_steps: int | None = None, **kwargs):
  """The compression transform of :func:`recipe` alone; the same arguments (the optimizer's are unused)."""

  _args.choice("optimizer", optimizer, OPTIMIZERS)
  if optimizer == "adamw":
    return _adamw_recipe(name, 1e-3, axis_name, momentum, total_steps, **kwargs).compressor
  name = _args.choice("name", name, tuple(RECIPES))
  momentum = _args.unit_interval("momentum", 0.9 if momentum is None else momentum)
  r = _scaled_recipe(RECIPES[name], "sgd", total_steps)
  factory = METHODS[name]
  method_kw, _ = _split(name, "sgd", kwargs, (name, _takes(factory, "axis_name", "optimizer")),
                        ("optax.sgd", _takes(optax.sgd, "learning_rate", "momentum")))
  kwargs = {**every_leaf(factory), **dict(r.method_kwargs)}
  if r.kind == "own" and "momentum" in inspect.signature(factory).parameters:
    kwargs["momentum"] = momentum  # the method's own momentum stands for sgd's
  kwargs.update(method_kw)
  if r.warmup_steps:
    ratio = kwargs.pop("ratio", inspect.signature(factory).parameters["ratio"].default)
    tx = ratio_warmup(factory, ratio, r.warmup_steps, axis_name=axis_name, **kwargs)
  elif r.kind == "after":  # it wraps the optimizer (recipe()); here only its compression transform
    tx = factory(axis_name=axis_name, optimizer=optax.identity(), **kwargs).compressor
  else:
    tx = factory(axis_name=axis_name, **kwargs)
  if r.kind == "inner" and momentum > 0:
    tx = configure(tx, memory=momentum_correction(momentum, masking=r.masking))
  if r.kind == "ef21":
    tx = configure(tx, memory=ef21())
  if r.start_step:
    tx = configure(tx, start_step=r.start_step)
  return tx


def every_leaf(factory) -> dict:
  """The recipes' leaf policy: every leaf compressed (``min_size=1``) where ``factory`` has a policy.

  A leaf kept dense costs its whole float32 size: on a model of small leaves a few of them
  outweigh a 1% or 1-bit payload (on the suite's digits MLP, several times what compressing every
  leaf sends), and no task of the suite needed them dense (docs/recipes.md).
  """
  return {"min_size": 1} if "min_size" in inspect.signature(factory).parameters else {}


def warmup_steps(steps: int, optimizer: str, total_steps: int | None) -> int:
  """A recipe's warm-up of ``steps`` (stated for :data:`REFERENCE_STEPS`) in a run of ``total_steps``.

  The same fraction of the run, rounded, at least 1 step where the recipe has a warm-up; None: ``steps``.
  """
  if total_steps is None or not steps:
    return steps
  return max(1, round(steps * total_steps / REFERENCE_STEPS[optimizer]))


def _scaled_recipe(r, optimizer, total_steps):
  """``r`` with its warm-ups for a run of ``total_steps`` (:func:`warmup_steps`)."""
  if total_steps is None:
    return r
  total_steps = _args.integer("total_steps", total_steps, 1)
  fields = ("start_step", "warmup_steps") if optimizer == "sgd" else ("start_step",)
  changes = {f: warmup_steps(getattr(r, f), optimizer, total_steps) for f in fields}
  kw = dict(r.method_kwargs)
  if "var_freeze_step" in kw:  # 0/1 Adam's own warm-up
    kw["var_freeze_step"] = warmup_steps(kw["var_freeze_step"], optimizer, total_steps)
    changes["method_kwargs"] = tuple(kw.items())
  return dataclasses.replace(r, **changes)


def _takes(fn, *exclude) -> frozenset | None:
  """The keyword arguments ``fn`` takes, less ``exclude`` (set by the recipe); None: any (``**kwargs``)."""
  params = inspect.signature(fn).parameters.values()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    return None
  return frozenset(p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                        inspect.Parameter.KEYWORD_ONLY)) - set(exclude)


def _split(name, optimizer, kwargs, *takers) -> list:
  """``kwargs`` as one dict per ``(label, names it takes)`` (the first that takes a name gets it).

  Raises TypeError naming a keyword argument none of them takes.
  """
  out = [{} for _ in takers]
  for key, value in kwargs.items():
    for (_, names), got in zip(takers, out):
      if names is None or key in names:
        got[key] = value
        break
    else:
      takes = "; ".join(f"{label} takes {', '.join(sorted(names))}" for label, names in takers)
      raise TypeError(f"recipe({name!r}, optimizer={optimizer!r}) got an unexpected keyword argument {key!r}:"
                      f" neither the method nor the optimizer takes it ({takes})"
                      + ("; AdamW's momentum is b1" if key == "momentum" and optimizer == "adamw" else ""))
  return out


def _scaled(learning_rate, scale):
  if callable(learning_rate):
    return lambda count: scale * learning_rate(count)
  return scale * learning_rate


def _adamw_recipe(name, learning_rate, axis_name, momentum=None, total_steps=None, **kwargs):
  """:func:`recipe` with ``optimizer="adamw"``: a complete optimizer with ``.compressor``."""

  name = _args.choice("name", name, tuple(ADAMW_RECIPES))
  r = _scaled_recipe(ADAMW_RECIPES[name], "adamw", total_steps)
  lr = learning_rate if r.lr_scale == 1.0 else _scaled(learning_rate, r.lr_scale)
  if momentum is not None:  # adamw's momentum is b1: this is the method's own setting
    kwargs = {"momentum": momentum, **kwargs}
  wd = {"weight_decay": ADAMW["weight_decay"]}
  if r.kind in ("optimizer", "momentum"):  # a complete optimizer, or 1-bit Adam on the momentum
    opt = {"zero_one_adam": zero_one_adam, "demo": demo}.get(name, onebit_adam)
    fixed = ("learning_rate", "axis_name") + (("codec",) if r.kind == "momentum" else ())
    takers = [(opt.__name__, frozenset(inspect.signature(opt).parameters) - {"codec_kwargs", *fixed})]
    defaults = dict(wd)
    if opt is onebit_adam:
      defaults["freeze_step"] = r.start_step
    if opt in (onebit_adam, zero_one_adam):
      defaults["var_floor"] = VAR_FLOOR
    if r.kind == "momentum":
      defaults["transport"] = "gather"
    if r.kind == "momentum":
      defaults.update(every_leaf(METHODS[name]))
    settings = {**defaults, **dict(r.method_kwargs), **kwargs}
    if _takes(opt) is None:  # onebit_adam, zero_one_adam: **codec_kwargs go to the codec's factory
      codec = name if r.kind == "momentum" else settings.get("codec", "onebit")
      takers.append((f"its codec {codec!r}", _takes(METHODS[codec], "axis_name", "transport", "seed")
                     if codec in METHODS else None))
    parts = _split(name, "adamw", settings, *takers)
    extra = {"codec": name} if r.kind == "momentum" else {}
    return opt(lr, axis_name=axis_name, **extra, **{k: v for part in parts for k, v in part.items()})
  factory = METHODS[name]
  optimizer = {"sign": ("the sign step", frozenset({"weight_decay"}))}.get(
      r.kind, ("optax.adamw", _takes(optax.adamw, "learning_rate")))
  method_kw, opt_kw = _split(name, "adamw", kwargs, (name, _takes(factory, "axis_name", "optimizer")),
                             optimizer)
  tx = factory(axis_name=axis_name, **{**every_leaf(factory), **dict(r.method_kwargs), **method_kw})
  if r.kind == "ef21":
    tx = configure(tx, memory=ef21())
  if r.start_step:
    tx = configure(tx, start_step=r.start_step)
  if r.kind == "sign":
    chain = optax.chain(tx, optax.add_decayed_weights({**wd, **opt_kw}["weight_decay"]),
                        optax.scale_by_learning_rate(lr))
  elif r.kind == "after":
    chain = optax.chain(optax.adamw(lr, **{**ADAMW, **opt_kw}), tx)
  else:
    chain = optax.chain(tx, optax.adamw(lr, **{**ADAMW, **opt_kw}))
  return compressed_optimizer(chain, tx)
