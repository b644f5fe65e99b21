"""The recipe tables: for each method, how it is used in place of ``sgd(lr, momentum)`` (:data:`RECIPES`)
and in place of ``optax.adamw(lr)`` (:data:`ADAMW_RECIPES`); :func:`jaxcomp.recipe` builds them."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a method is used in place of ``sgd(lr, momentum)``.

  Attributes:
    kind: ``"outer"``, ``"inner"``, ``"ef21"``, ``"own"`` or ``"after"`` (module docstring).
    lr_scale: the method's learning rate is ``lr_scale * learning_rate``.
    method_kwargs: settings the recipe passes to the factory (the caller's
      keyword arguments override them).
    masking: with ``kind="inner"``, DGC's momentum factor masking.
    start_step: steps of dense exchange first (:func:`jaxcomp.configure`).
    warmup_steps: DGC's exponential warm-up of the ratio over this many
      steps (:func:`jaxcomp.ratio_warmup`; methods with ``ratio=``).
    why: the reason, in words, for the recipe table (docs/recipes.md holds the figures).
  """

  kind: str
  why: str
  lr_scale: float = 1.0
  method_kwargs: Any = ()
  masking: bool = False
  start_step: int = 0
  warmup_steps: int = 0


RECIPES: dict[str, Recipe] = {
    "none": Recipe("outer", "dense mean"),
    "fp16": Recipe("outer", "16-bit rounding only"),
    "bf16": Recipe("outer", "16-bit rounding only"),
    "qsgd": Recipe("outer", "unbiased"),
    "terngrad": Recipe("outer", "unbiased given its clip"),
    "natural": Recipe("outer", "unbiased"),
    "u8bit": Recipe("outer", "8-bit table, small relative error"),
    "fp4": Recipe("outer", "4-bit floats with error feedback: the rounding error is sent later"),
    "sketchml": Recipe("outer", "quantile buckets, small relative error"),
    "powersgd": Recipe("outer", "error feedback on a rank-4 estimate that keeps most of the energy"),
    "acpsgd": Recipe("outer", "as PowerSGD"),
    "topk": Recipe("inner", "1% of entries: momentum before the residual (DGC's correction)"),
    "randomk": Recipe("outer", "a quarter of the entries at random, scaled to an unbiased estimate without"
                      " error feedback, outer momentum as dense; dense for the first steps (1% or 10%, and"
                      " error feedback at any share, lost 3-64 points on the suite's digits or diverged on"
                      " its regression)",
                      method_kwargs=(("ratio", 0.25), ("unbiased", True), ("error_feedback", False)),
                      start_step=25),
    "threshold": Recipe("ef21", "a sampled threshold sends an uneven amount: EF21's estimates, outer"
                        " momentum (the momentum before the residual does better on the suite's regression"
                        " but lost 3.3-4.7 points on its digits with the scatter exchange)"),
    "adaq": Recipe("inner", "sparse and quantized: momentum before the residual"),
    "inceptionn": Recipe("inner", "error feedback on a lossy code: momentum before the residual"),
    "onebit": Recipe("inner", "1 bit with error feedback: momentum before the residual"),
    "signsgd": Recipe("inner", "sign with error feedback (scale per leaf) and momentum before it",
                      method_kwargs=(("error_feedback", True),)),
    "efsignsgd": Recipe("outer", "its scaled memory holds the learning rate; outer momentum as dense, a"
                        " smaller lr: between the best for short runs (1 x) and for long ones (0.5 x)",
                        lr_scale=0.7),
    "dgc": Recipe("own", "DGC's own momentum correction and masking; dense steps first instead of its"
                  " ratio warm-up, and no clipping (both cost accuracy); 40 dense steps of 600, which"
                  " the scatter exchange and short runs need (10 lost 1.7-2.8 points on the suite's"
                  " digits with it)",
                  method_kwargs=(("clip_norm", None), ("warmup_steps", 0)),
                  start_step=40),
    "redsync": Recipe("inner", "momentum before the residual, without DGC's masking; DGC's ratio warm-up,"
                      " which a short run needs", warmup_steps=40),
    "signum": Recipe("own", "local momentum, majority vote of signs: a +-1 step, lr scaled",
                     lr_scale=0.02),
    "sbc": Recipe("after", "compresses the optimizer's update, as in the paper: wraps sgd(lr, momentum)"
                  " (sbc(optimizer=...)); the paper's regime: sparse on both sides, a sync every few steps,"
                  " every leaf compressed",
                  method_kwargs=(("delay", 4), ("min_size", 1))),
}

OPTIMIZERS = ("sgd", "adamw")


@dataclasses.dataclass(frozen=True)
class AdamWRecipe:
  """How a method is used in place of ``optax.adamw(lr)``.

  Attributes:
    kind: where the codec sits:
      ``"grad"``: the gradient, then ``adamw`` (unbiased or nearly lossless codecs);
      ``"ef21"``: the gradient with :func:`jaxcomp.ef21` (EF21: each worker sends the
      compressed change of its gradient estimate, Adam sees the running estimate,
      never a delayed residual that its per-coordinate scaling would amplify);
      ``"momentum"``: the momentum, with the variance frozen after a warm-up of
      exact Adam (:func:`jaxcomp.onebit_adam` with this codec);
      ``"sign"``: a sign method's own momentum and vote, scaled by the learning
      rate (a Lion/DeMo-style sign step), with decoupled weight decay;
      ``"after"``: ``adamw`` first, then the method compresses the update (SBC);
      ``"optimizer"``: a complete optimizer (``onebit_adam``, ``demo``).
    why: the reason, in words, for the recipe table (docs/recipes.md holds the figures).
    lr_scale: the learning rate is ``lr_scale * learning_rate``.
    method_kwargs: settings passed to the factory (the caller's override them).
    start_step: steps of dense exchange first; for ``"momentum"``, the freeze step.
  """

  kind: str
  why: str
  lr_scale: float = 1.0
  method_kwargs: Any = ()
  start_step: int = 0


ADAMW_RECIPES: dict[str, AdamWRecipe] = {
    # Chosen on the --task lm job (python -m jaxcomp.bench lm) and on digits (tests/test_recipes.py);
    # the held-out losses of each recipe and of the alternatives measured are in docs/recipes.md.
    "none": AdamWRecipe("grad", "dense mean"),
    "fp16": AdamWRecipe("grad", "16-bit rounding only"),
    "bf16": AdamWRecipe("grad", "16-bit rounding only"),
    "qsgd": AdamWRecipe("grad", "unbiased, small variance at 8 bits"),
    "natural": AdamWRecipe("grad", "unbiased, small variance"),
    "u8bit": AdamWRecipe("grad", "8-bit table, small relative error"),
    "fp4": AdamWRecipe("grad", "4-bit floats (a fifth of each entry at most) with error feedback into Adam"),
    "sketchml": AdamWRecipe("grad", "quantile buckets, small relative error"),
    "terngrad": AdamWRecipe("grad", "unbiased ternary into Adam, clipped tighter than its default: a smaller"
                            " scale, less variance for Adam's second moment to absorb (better than its own"
                            " clip, a tighter one, EF21 or the momentum)",
                            method_kwargs=(("clip_sigma", 1.5),)),
    "powersgd": AdamWRecipe("grad", "error feedback on a higher-rank estimate into Adam; this model's"
                            " layers are narrow, so even this rank sends fewer bytes than dense (lower ranks,"
                            " EF21 and the momentum lose accuracy)",
                            method_kwargs=(("rank", 16),)),
    "acpsgd": AdamWRecipe("grad", "as PowerSGD, at the same rank (lower ranks and the momentum lose"
                          " accuracy; a dense warm-up helps short runs only)",
                          method_kwargs=(("rank", 16),)),
    "topk": AdamWRecipe("momentum", "a larger share of the momentum with error feedback, variance frozen"
                        " after a warm-up of exact Adam (a smaller share, or compressing Adam's update, loses"
                        " accuracy)",
                        method_kwargs=(("ratio", 0.05),), start_step=100),
    "randomk": AdamWRecipe("momentum", "a large share of the momentum at random (a random entry waits only"
                           " a few steps), variance frozen after a warm-up (smaller shares, EF21 and Adam's"
                           " update lose accuracy)",
                           method_kwargs=(("ratio", 0.25),), start_step=100),
    "threshold": AdamWRecipe("momentum", "the momentum's entries above a multiple of their leaf's RMS (any"
                             " scale), variance frozen after a warm-up (other multiples, absolute thresholds,"
                             " EF21 and Adam's update do worse)", method_kwargs=(("v_rms", 1.5),),
                             start_step=100),
    "adaq": AdamWRecipe("momentum", "sparse and quantized momentum, variance frozen after a short warm-up"
                        " (EF21 does worse)",
                        start_step=60),
    "inceptionn": AdamWRecipe("grad", "lossy code, nearly unbiased, into Adam (better than an absolute bound,"
                              " EF21 or the momentum)"),
    "dgc": AdamWRecipe("momentum", "a larger share of Adam's momentum (DGC's own momentum off: Adam's is"
                       " the one), variance frozen after a warm-up (its own ratio and Adam's update lose"
                       " accuracy)",
                       method_kwargs=(("clip_norm", None), ("warmup_steps", 0), ("momentum", 0.0),
                                      ("ratio", 0.05)), start_step=100),
    "redsync": AdamWRecipe("momentum", "a small share of the momentum, variance frozen after a warm-up (EF21"
                           " did worse on digits)", method_kwargs=(("ratio", 0.01),), start_step=100),
    "sbc": AdamWRecipe("momentum", "Adam's momentum through SBC without delay (a delay needs the"
                       " parameters), a larger share per side, variance frozen after a warm-up (its own share"
                       " loses accuracy; compressing the update does worse on digits)",
                       method_kwargs=(("delay", 1), ("min_size", 1), ("sparsity", 0.05)),
                       start_step=100),
    "onebit": AdamWRecipe("momentum", "1-bit Adam: the momentum in 1 bit after a warm-up of exact Adam",
                          start_step=50),
    "signsgd": AdamWRecipe("grad", "majority vote of the gradient's signs into Adam at a larger lr: Adam's"
                           " update of +-1 votes is small where the votes disagree (other lrs, error feedback"
                           " and the momentum do worse)", lr_scale=2.0),
    "efsignsgd": AdamWRecipe("momentum", "the momentum's scaled signs, error feedback (1-bit Adam)",
                             start_step=50),
    "signum": AdamWRecipe("sign", "its local momentum's majority vote as a sign step (Lion-like) at a smaller"
                          " lr than Adam's (a larger one does worse on the lm task, a smaller one on digits)",
                          lr_scale=0.7),
    "onebit_adam": AdamWRecipe("optimizer", "1-bit Adam itself: exact Adam for a warm-up, then 1 bit",
                               start_step=50),
    "zero_one_adam": AdamWRecipe("optimizer", "0/1 Adam itself: a variance update every step of the"
                                 " warm-up (its 1-bit gradient steps lose accuracy), then at most one local"
                                 " step between 1-bit syncs (more local steps do worse)",
                                 method_kwargs=(("var_freeze_step", 100), ("var_update_scaler", 128),
                                                ("local_step_scaler", 50), ("local_step_clipper", 2))),
    "demo": AdamWRecipe("optimizer", "DeMo itself: local momentum, its DCT top-k fast components exchanged,"
                        " a sign step; a shorter momentum decay than its default (better than the default or"
                        " a smaller lr)", method_kwargs=(("compression_decay", 0.99),)),
}
