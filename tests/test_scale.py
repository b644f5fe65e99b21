"""Scale: every method's output on ``c * g`` is ``c *`` its output on ``g`` (signs: the same output).

Real gradients are small (1e-4..1e-7 per entry late in training), so nothing in
a method's defaults may set a scale: no epsilon added to a norm of gradient
size, no absolute threshold, clip or error bound, no float16 flush to zero.
Each method runs at its defaults on 8 workers under pmap for several steps
(error feedback, warm starts, momenta, alternations all take part) at every
scale ``c`` with the same keys; power-of-two scales from 2**-27 (7e-9) to
2**14 (16384) must agree to float rounding (1e-6 relative), other scales
(1e-7, 1e-4, 1e3) to 1e-2 (a 16-bit cast rounds each value to 8 or 11
significant bits; a stochastic rounding may flip near a tie).
The Adam-type optimizers run with ``eps`` scaled along (Adam's own epsilon
is a scale by design); past their warm-ups their output is invariant.
"""

import functools

import jax
import numpy as np
import pytest
from harness import AXIS, N, init_stacked, params_tree, worker_grads

import jaxcomp

STEPS = 4
POW2 = (2.0 ** -27, 2.0 ** -14, 2.0 ** 14)
OTHER = (1e-7, 1e-4, 1e3)
INVARIANT = {"signsgd", "signum"}  # a majority vote of signs: the output is +-1 at any scale
# Its output is a power of two per entry, which c times a power of two is not unless c is one;
# at other scales it is another draw of the same unbiased rounding (checked at powers of two only).
# fp4: each block's scale is a power of two (an 8-bit exponent, as MXFP4), so scaling by a power of two
# shifts the exponents and leaves every 4-bit code alone; at other scales the codes round differently.
POW2_ONLY = {"natural", "fp4"}


@functools.lru_cache(maxsize=None)
def _step(tx):
  return jax.pmap(lambda g, s, p: tx.update(g, s, p), axis_name=AXIS)


def _outputs(tx, scale):
  """The outputs of STEPS steps on gradients ``scale * g`` (float64 host arrays)."""
  params = params_tree()
  state = init_stacked(tx, params)
  params8 = jaxcomp.per_worker(params, N)
  outs = []
  for step in range(STEPS):
    grads = jax.tree.map(lambda g: (np.float32(scale) * g).astype(np.float32),
                         worker_grads(params, seed=step))
    upd, state = jax.device_get(_step(tx)(grads, state, params8))
    outs.append([np.asarray(u, np.float64) for u in jax.tree.leaves(upd)])
  return outs


def _worst(base, scaled, c):
  """The largest error of ``scaled`` against ``c * base`` relative to ``c * base``, over steps.

  Each step's output is taken whole (every leaf), so a leaf whose mean
  cancels to near zero does not dominate; an output that vanishes gives 1.
  """
  worst = 0.0
  for b_step, s_step in zip(base, scaled):
    want = np.concatenate([c * b.ravel() for b in b_step])
    got = np.concatenate([s.ravel() for s in s_step])
    norm = np.linalg.norm(want)
    err = np.linalg.norm(got - want)
    worst = max(worst, err / norm if norm > 0 else (0.0 if err == 0 else np.inf))
  return worst


def _check(tx, invariant, pow2_only=False):
  base = _outputs(tx, 1.0)
  assert any(np.any(u != 0) for step in base[1:] for u in step), "the method sent nothing at scale 1"
  for c in POW2 + (() if pow2_only else OTHER):
    scaled = _outputs(tx, c)
    worst = _worst(base, scaled, 1.0 if invariant else c)
    tol = 1e-6 if c in POW2 else 1e-2
    assert worst <= tol, f"scale {c:g}: worst relative error {worst:.3g} (tolerance {tol:g})"


@pytest.mark.usefixtures("every_leaf")  # its trees are small on purpose: compress every leaf
@pytest.mark.parametrize("name", sorted(jaxcomp.METHODS))
def test_every_method_is_scale_equivariant(name):
  _check(jaxcomp.METHODS[name](axis_name=AXIS), name in INVARIANT, name in POW2_ONLY)


def _adam_like(name, eps, var_floor=0.0):
  if name == "onebit_adam":
    return jaxcomp.onebit_adam(1e-3, eps=eps, freeze_step=2, axis_name=AXIS, var_floor=var_floor)
  if name == "zero_one_adam":
    return jaxcomp.zero_one_adam(1e-3, eps=eps, var_freeze_step=2, var_update_scaler=1, axis_name=AXIS,
                                 var_floor=var_floor)
  return jaxcomp.demo(1e-3, axis_name=AXIS, compression_chunk=8, compression_topk=4)


def _flipped(base, scaled):
  """The largest fraction of output entries that differ, over steps (for sign outputs)."""
  return max(float(np.mean(np.concatenate([(s != b).ravel() for b, s in zip(b_step, s_step)])))
             for b_step, s_step in zip(base, scaled))


@pytest.mark.parametrize("name, var_floor", [("onebit_adam", 0.0), ("onebit_adam", 0.01),
                                             ("zero_one_adam", 0.0), ("zero_one_adam", 0.01), ("demo", 0.0)])
def test_adam_type_optimizers_are_scale_invariant(name, var_floor):
  """Past the warm-up the update is invariant when Adam's eps scales with the gradient (the
  variance floor is a fraction of each leaf's own mean, so it scales too).

  DeMo steps by the sign of a mean of bf16 coefficients: at scales other than
  powers of two a coefficient near a tie may round to the other sign, so
  there at most 1% of its entries may differ.
  """
  base = _outputs(_adam_like(name, 1e-8, var_floor), 1.0)
  for c in POW2 + OTHER:
    scaled = _outputs(_adam_like(name, 1e-8 * c, var_floor), c)
    if name == "demo" and c not in POW2:
      assert _flipped(base, scaled) <= 1e-2, f"demo at scale {c:g}: {_flipped(base, scaled):.3g} flipped"
      continue
    worst = _worst(base, scaled, 1.0)
    tol = 1e-6 if c in POW2 else 1e-2
    assert worst <= tol, f"{name} at scale {c:g}: worst relative error {worst:.3g} (tolerance {tol:g})"


@pytest.mark.usefixtures("every_leaf")  # its trees are small on purpose: compress every leaf
def test_sign_outputs_do_not_depend_on_scale_at_all():
  """The invariant set is exact: signsgd's output at 1e-7 is its output at 1 (no rounding involved)."""
  tx = jaxcomp.signsgd(axis_name=AXIS)
  a, b = _outputs(tx, 1.0), _outputs(tx, 1e-7)
  for sa, sb in zip(a, b):
    for x, y in zip(sa, sb):
      np.testing.assert_array_equal(x, y)

