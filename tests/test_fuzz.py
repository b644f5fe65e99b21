"""Bad input, fuzzed: arguments of every factory, and odd gradients for every method.

Arguments: for every factory in ``jaxcomp.METHODS`` and every parameter of
its ``inspect.signature``, every value of a pool of bad ones (zero, negative,
NaN, Inf, huge, wrong types, unknown option strings, numpy and jax arrays),
then hypothesis draws more (any float, any int, short text). The factory
either rejects the value with a TypeError/ValueError whose message names the
parameter, or accepts it and the transform traces on a small model (a trace
error must name it too); NaN is never accepted. Unknown keyword arguments are
a TypeError naming them.

Gradients (one compiled pmap step per method, 8 workers, a tree with float32,
bfloat16, float16, scalar and empty leaves), the documented behaviour:

- finite input: finite output, identical on every worker, each leaf in its
  own dtype and shape (empty leaves stay empty);
- a NaN or Inf anywhere on one worker: the output is non-finite on every
  worker, identically (``optax.apply_if_finite`` skips the step on all
  replicas): all NaN, except for none/fp16/bf16 whose float psum puts the
  NaN/Inf where ``lax.pmean`` would; the state stays finite, a plain residual
  keeps every finite value of its input (nothing counts as sent), and the
  next step is finite again;
- all zeros: an all-zero output, except for the sign methods without a scale
  in ``ZERO_IS_POSITIVE`` (a sign bit of 0 counts as +1, so the output is +1);
- huge (1e30, and 1e38 near float32's max) and tiny (1e-30, 1e-40 subnormal)
  magnitudes: the output is finite or, where a method overflows inside, non-finite
  on every worker identically (a step to skip); the state stays finite. At
  1e30 only ``OVERFLOWS`` overflow; at 1e38 any method may.
"""

import functools
import inspect

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import N, init_stacked, run_pmap
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomp
from jaxcomp.core.protocol import Memory

pytestmark = pytest.mark.usefixtures("every_leaf_module")  # small trees on purpose: compress every leaf

NAMES = sorted(jaxcomp.METHODS)

BAD_VALUES = [
    0, -1, 0.0, -0.5, 1.5, 2, 2 ** 31, 2 ** 64, 1e30, -1e30, 1e-45, float("nan"), float("inf"),
    float("-inf"), True, False, None, "bogus", "", "NaN", [0.5], (1, 2), {}, 1 + 1j,
    np.float32("nan"), np.int64(-3), np.array([0.5]), jnp.asarray(0.5), jnp.int32(2), object(),
]
VALUES = st.one_of(
    st.sampled_from(BAD_VALUES), st.sampled_from(BAD_VALUES), st.sampled_from(BAD_VALUES),
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-2 ** 70, 2 ** 70), st.text(max_size=3))


def _is_nan(value) -> bool:
  try:
    return bool(np.isnan(value)) if np.ndim(value) == 0 else False
  except TypeError:
    return False


def _parameters(factory):
  return list(inspect.signature(factory).parameters)


_TRACED: dict = {}


def _traces(name: str, arg: str, value) -> None:
  """Builds and traces ``tx.update`` on a small model; memoized (tracing costs ~50 ms)."""
  memo = (name, arg, type(value).__name__, repr(value))
  if memo not in _TRACED:
    tx = jaxcomp.METHODS[name](**{arg: value})
    g = {"w": jnp.zeros((24, 16), jnp.float32), "b": jnp.zeros((16,), jnp.float32)}
    try:
      jax.eval_shape(tx.update, g, tx.init(g))
      _TRACED[memo] = None
    except Exception as e:  # noqa: BLE001 - judged below
      _TRACED[memo] = e
  if _TRACED[memo] is not None:
    raise _TRACED[memo]


def _problem(name: str, arg: str, value):
  """None if ``value`` is rejected with an error naming ``arg``, or accepted (never NaN) and traceable."""
  try:
    jaxcomp.METHODS[name](**{arg: value})
  except (TypeError, ValueError) as e:
    return None if arg in str(e) else f"{name}({arg}={value!r}) raised an error not naming {arg!r}: {e!r}"
  except Exception as e:  # noqa: BLE001
    return f"{name}({arg}={value!r}) raised {type(e).__name__}, not a TypeError/ValueError: {e}"
  if arg != "axis_name" and _is_nan(value):
    return f"{name} accepted {arg}={value!r}"
  try:
    _traces(name, arg, value)
  except (TypeError, ValueError) as e:
    return None if arg in str(e) else f"{name}({arg}={value!r}) was accepted, then failed to trace: {e!r}"
  except Exception as e:  # noqa: BLE001
    return f"{name}({arg}={value!r}) was accepted, then tracing raised {type(e).__name__}: {e}"
  return None


@pytest.mark.parametrize("name", NAMES)
def test_every_bad_value_of_every_argument(name):
  problems = [_problem(name, arg, v) for arg in _parameters(jaxcomp.METHODS[name]) for v in BAD_VALUES]
  problems = [p for p in problems if p]
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=20)
@given(data=st.data())
def test_fuzzed_arguments_are_named_or_harmless(name, data):
  arg = data.draw(st.sampled_from(_parameters(jaxcomp.METHODS[name])), label="argument")
  problem = _problem(name, arg, data.draw(VALUES, label="value"))
  assert problem is None, problem


@pytest.mark.parametrize("name", NAMES)
def test_unknown_options_are_named(name):
  factory = jaxcomp.METHODS[name]
  with pytest.raises(TypeError, match="bogus_option"):
    factory(bogus_option=1)
  for arg in _parameters(factory):
    with pytest.raises(TypeError, match=f"{arg}x"):
      factory(**{f"{arg}x": 1})  # a typo


# ---------------------------------------------------------------------------
# Odd gradients

ZERO_IS_POSITIVE = {"signsgd", "signum"}
# Non-finite output (a step to skip) from finite input at 1e30: QSGD squares it for its norm
# (fp16 holds it: each leaf travels scaled by a shared power of two). Near float32's maximum
# (1e38) any method may overflow, most do: they sum, average or round up.
OVERFLOWS = {"qsgd": {"huge"}}
MAY_OVERFLOW = {"max"}


def _tree():
  """Three dtypes of the same size (one leaf group: one kernel to compile), a scalar, an empty leaf."""
  return {"w": jnp.zeros((32, 16), jnp.float32), "h": jnp.zeros((512,), jnp.bfloat16),
          "f": jnp.zeros((16, 32), jnp.float16), "s": jnp.zeros((), jnp.float32),
          "e": jnp.zeros((0, 3), jnp.float32)}


def _grads(scale: float, fp16_scale: float, seed: int = 0):
  """Standard normal values, clipped to [-3, 3], times the scale (so 1e38 stays finite)."""
  out = {}
  for i, (k, v) in enumerate(sorted(_tree().items())):
    x = np.clip(np.random.default_rng(seed + i).standard_normal((N,) + v.shape), -3, 3)
    out[k] = jnp.asarray(x * (fp16_scale if k == "f" else scale), v.dtype)
  return out


CASES = {  # name: (scale of float32/bfloat16 leaves, scale of the float16 leaf)
    "normal": (1.0, 1.0), "zeros": (0.0, 0.0), "huge": (1e30, 1e4), "max": (1e38, 2e4),
    "tiny": (1e-30, 1e-7), "subnormal": (1e-40, 1e-7),
}


def _floats(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def _assert_state_finite(state, what):
  for x in _floats(state):
    assert np.all(np.isfinite(x)), f"non-finite state after {what}"


def _carries_nonfinite(tx) -> bool:
  """The dense float psums (none, fp16, bf16): NaN/Inf stay where lax.pmean puts them."""
  return all(b.exchange.carries_nonfinite for b in tx.method.buckets(_tree()))


def _assert_replicas_agree(out, what):
  for k, v in out.items():
    a = np.asarray(v, np.float64)
    np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape),
                                  err_msg=f"{what}: replicas differ in {k}")


def _assert_poisoned(tx, out, what):
  """Non-finite on every worker, identically: all NaN, or NaN/Inf where pmean puts it."""
  _assert_replicas_agree(out, what)
  a = [np.asarray(v, np.float64) for v in out.values()]
  assert not all(np.isfinite(x).all() for x in a), f"{what}: the output is finite"
  if not _carries_nonfinite(tx):
    for k, x in zip(out, a):
      assert np.all(np.isnan(x)), f"{what}: leaf {k} is not all NaN"


def _assert_finite_and_shaped(out, what):
  tree = _tree()
  for k, v in out.items():
    assert v.dtype == tree[k].dtype and v.shape == (N,) + tree[k].shape, (what, k, v.dtype, v.shape)
    a = np.asarray(v, np.float64)
    assert np.all(np.isfinite(a)), f"{what}: leaf {k} is not finite"
    np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape), err_msg=f"{what}: replicas differ")


def _residual_keeps_its_input(tx, grads, state0, state1):
  """A skipped step: e_new == beta * e + gamma * g where finite, 0 elsewhere (in the leaf's dtype)."""
  mem = tx.method.memory
  if type(mem) is not Memory or not mem.enabled:
    return
  old, new = (jaxcomp.memory_tree(tx, st, _tree()) for st in (state0, state1))
  for g, e0, e1 in zip(*(jax.tree.leaves(t) for t in (grads, old, new))):
    terms = mem.beta * np.asarray(e0, np.float64), mem.gamma * np.asarray(g, np.float64)
    x = terms[0] + terms[1]
    finite = np.isfinite(x)
    want = np.where(finite, x, 0.0)
    # float32 rounding of the sum, then of the state's dtype
    tol = 4 * 2.0 ** -24 * np.where(finite, np.abs(terms[0]) + np.abs(terms[1]), 0.0)
    tol = tol + 2 * float(jnp.finfo(e1.dtype).eps) * np.abs(want) + 1e-30
    err = np.abs(np.asarray(e1, np.float64) - want)
    assert np.all(err <= tol), f"residual lost part of its input: max error {err.max()}"


@pytest.mark.parametrize("name", NAMES)
def test_odd_gradients_have_the_documented_behaviour(name):
  tx = jaxcomp.METHODS[name](axis_name="data")
  state0 = init_stacked(tx, _tree())
  step = functools.partial(run_pmap, tx)

  # Finite steps first, so that the residual is not zero.
  out, state = step(_grads(1.0, 1.0), state0)
  _assert_finite_and_shaped(out, "normal")
  overflowed = set()
  for case, (scale, fp16_scale) in CASES.items():
    out, s1 = step(_grads(scale, fp16_scale, seed=1), state)
    _assert_state_finite(s1, case)
    if all(np.isfinite(np.asarray(v, np.float32)).all() for v in out.values()):
      _assert_finite_and_shaped(out, case)
    else:
      overflowed.add(case)  # inside the method: a step to skip, on every worker
      _assert_replicas_agree(out, case)
  assert overflowed - MAY_OVERFLOW == OVERFLOWS.get(name, set()), (
      f"{name}: overflowed at {sorted(overflowed)}")
  out, _ = step(_grads(0.0, 0.0), state0)  # zeros from a fresh state (no residual to send)
  for v in out.values():
    np.testing.assert_array_equal(np.asarray(v, np.float32), 1.0 if name in ZERO_IS_POSITIVE else 0.0)

  # One non-finite entry on one worker: NaN, +Inf, -Inf, in each dtype.
  for leaf, worker, bad in (("w", 2, np.nan), ("h", 5, np.inf), ("f", 0, -np.inf), ("s", 7, np.nan)):
    g = _grads(1.0, 1.0, seed=2)
    g[leaf] = harness.set_at(g[leaf], ((worker,) + (0,) * (g[leaf].ndim - 1)), bad)
    out, s1 = step(g, state)
    what = f"{bad} in {leaf} on worker {worker}"
    _assert_poisoned(tx, out, what)
    _assert_state_finite(s1, what)
    _residual_keeps_its_input(tx, g, state, s1)
    out, _ = step(_grads(1.0, 1.0, seed=3), s1)
    _assert_finite_and_shaped(out, f"the step after {what}")
