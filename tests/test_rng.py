"""Statistics of jaxcomp.kernels.rng, the counter hash behind stochastic rounding.

Fixed keys make every check deterministic; the bounds are what a true
uniform source passes with overwhelming probability, so a failure means a
broken generator, not bad luck. With M draws: a bin count of a 64-bin
histogram has sd sqrt(M p (1 - p)); the chi-square statistic (63 degrees of
freedom, mean 63, sd sqrt(126) = 11.2) stays below 63 + 6 sd = 130; a sample
mean has sd sqrt(1/12 / M), a correlation coefficient sd 1/sqrt(M): both are
checked at 6 sd.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.kernels import rng

M = 1 << 20
SIX_SD_CORR = 6 / np.sqrt(M)


def draw(key, shape=(M,)):
  return np.asarray(jax.jit(rng.uniform, static_argnums=1)(key, shape), np.float64)


def chi_square(u, bins=64):
  counts = np.bincount((u * bins).astype(np.int64), minlength=bins)
  expected = u.size / bins
  return float(np.sum((counts - expected) ** 2 / expected))


@pytest.mark.parametrize("seed", [0, 1, 2 ** 31 - 1])
def test_marginal_is_uniform_on_0_1(seed):
  u = draw(jax.random.PRNGKey(seed))
  assert u.min() >= 0.0 and u.max() < 1.0
  assert abs(u.mean() - 0.5) < 6 * np.sqrt(1 / 12 / M)
  assert abs(u.var() - 1 / 12) < 0.002  # sd of the sample variance: sqrt(1/180 / M) = 7e-5
  assert chi_square(u) < 130
  # The low bits are uniform too (natural compression compares 23 bits of the hash).
  low = np.asarray(rng.bits(jax.random.PRNGKey(seed), (M,))) & 0xFF
  assert chi_square(low / 256.0) < 130


def test_neighbours_and_streams_are_uncorrelated():
  key = jax.random.PRNGKey(7)
  u = draw(key)
  for lag in (1, 2, 64, 1024):
    assert abs(np.corrcoef(u[:-lag], u[lag:])[0, 1]) < SIX_SD_CORR, lag
  # Workers fold their index into the step key; groups and steps split it.
  others = [jax.random.fold_in(key, 1), jax.random.fold_in(key, 2), jax.random.split(key)[0]]
  for other in others:
    assert abs(np.corrcoef(u, draw(other))[0, 1]) < SIX_SD_CORR
  # Two adjacent seeds: pairs (u_i, v_i) fill the unit square evenly (8 x 8 cells).
  v = draw(jax.random.PRNGKey(8))
  cells = np.floor(u * 8) * 8 + np.floor(v * 8)
  assert chi_square(cells / 64.0) < 130


def test_no_two_entries_of_a_draw_share_a_hash_and_draws_are_deterministic():
  key = jax.random.PRNGKey(3)
  h = np.asarray(rng.bits(key, (1 << 16,)))
  assert np.unique(h).size == h.size
  np.testing.assert_array_equal(np.asarray(rng.bits(key, (256, 256))).ravel(), h)
  np.testing.assert_array_equal(np.asarray(rng.bits(jax.random.wrap_key_data(key), (1 << 16,))), h)
  batched = jax.vmap(lambda k: rng.uniform(k, (128,)))(jax.random.split(key, 4))
  assert batched.shape == (4, 128) and not np.array_equal(batched[0], batched[1])


def test_bad_key_or_shape_is_a_clear_error():
  with pytest.raises(ValueError, match="key must be one threefry key"):
    rng.uniform(jnp.zeros((3,), jnp.uint32), (4,))
  with pytest.raises(ValueError, match="shape must have fewer than 2"):
    rng.bits(jax.random.PRNGKey(0), (1 << 16, 1 << 16))


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 64, 4), (1, 30522, 4), (2, 1 << 16)])
def test_normal_is_jax_random_normal_bit_for_bit(shape):
  """Initial states drawn eagerly at a padded size and cut: the same bits as jax.random.normal."""
  key = jax.random.fold_in(jax.random.PRNGKey(3), 11)
  want = np.asarray(jax.random.normal(key, shape, jnp.float32))
  got = rng.normal(key, shape)
  assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == shape
  np.testing.assert_array_equal(got, want)
  traced = jax.jit(lambda k: rng.normal(k, shape))(key)  # under a trace: jax.random.normal itself
  np.testing.assert_array_equal(np.asarray(traced), want)
  typed = jax.random.wrap_key_data(key)
  np.testing.assert_array_equal(np.asarray(rng.normal(typed, shape)), want)


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_warm_start_factors_drawn_eagerly_equal_the_traced_draw(name):
  import jaxcomp

  params = {"a": jnp.zeros((3, 3, 8, 16)), "b": jnp.zeros((64, 32)), "c": jnp.zeros((64, 32)),
            "d": jnp.zeros((9,))}
  tx = jaxcomp.METHODS[name](axis_name=None, min_size=0)
  eager, traced = tx.init(params), jax.jit(tx.init)(params)
  assert jax.tree.leaves(eager.extra)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(traced)):
    assert isinstance(a, jax.Array) and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
