"""Golomb position coding: round trip, bit layout, capacity, and the paper's bits per position."""

import functools
import math

import jax
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from jaxcomp.collectives import golomb

N_SMALL = 300
K_SMALL = 40


@functools.cache
def _codec(n, b, k, cap):
  enc = jax.jit(lambda pos, c: golomb.encode_positions(pos, c, n, b, cap))
  dec = jax.jit(lambda w, nb: golomb.decode_positions(w, nb, b, k, n))
  return enc, dec


def _reference_bits(positions, b):
  """The stream in numpy: every unary quotient (q ones, one zero), then every b-bit remainder."""
  gaps = np.diff(np.concatenate([[-1], positions])) - 1
  unary, rem = [], []
  for g in gaps:
    unary += [1] * int(g >> b) + [0]
    rem += [(int(g) >> (b - 1 - t)) & 1 for t in range(b)]
  return unary + rem


def _padded(positions, k, n):
  out = np.full((k,), n, np.int32)
  out[:len(positions)] = positions
  return out


def _sets(n, k):
  return st.sets(st.integers(0, n - 1), max_size=k).map(lambda s: np.array(sorted(s), np.int32))


@pytest.mark.parametrize("b", [0, 1, 3, 6])
@given(positions=_sets(N_SMALL, K_SMALL))
@example(positions=np.zeros((0,), np.int32))
@example(positions=np.array([0], np.int32))
@example(positions=np.array([N_SMALL - 1], np.int32))
@example(positions=np.array([0, N_SMALL - 1], np.int32))
@example(positions=np.arange(K_SMALL, dtype=np.int32))
@example(positions=np.arange(N_SMALL - K_SMALL, N_SMALL, dtype=np.int32))
@example(positions=np.concatenate([np.arange(K_SMALL - 1), [N_SMALL - 1]]).astype(np.int32))
def test_round_trip_and_layout(b, positions):
  cap = golomb.max_stream_bits(K_SMALL, N_SMALL, b)
  enc, dec = _codec(N_SMALL, b, K_SMALL, cap)
  count = len(positions)
  words, nbits, sent = enc(_padded(positions, K_SMALL, N_SMALL), count)
  ref = _reference_bits(positions, b)
  assert int(sent) == count
  assert int(nbits) == len(ref) <= cap
  bits = np.unpackbits(np.asarray(words), bitorder="little")
  np.testing.assert_array_equal(bits[:len(ref)], ref)
  assert not bits[len(ref):].any()
  out, got = dec(words, nbits)
  assert int(got) == count
  np.testing.assert_array_equal(np.asarray(out), _padded(positions, K_SMALL, N_SMALL))


def test_worst_case_set_fills_the_capacity_exactly():
  b = 3
  cap = golomb.max_stream_bits(K_SMALL, N_SMALL, b)
  positions = np.concatenate([np.arange(K_SMALL - 1), [N_SMALL - 1]]).astype(np.int32)
  _, nbits, sent = _codec(N_SMALL, b, K_SMALL, cap)[0](positions, K_SMALL)
  assert int(nbits) == cap and int(sent) == K_SMALL


@given(positions=_sets(N_SMALL, K_SMALL), cap=st.sampled_from([1, 37, 120]))
@example(positions=np.arange(K_SMALL, dtype=np.int32), cap=1)
def test_what_does_not_fit_is_a_dropped_suffix(positions, cap):
  b = 3
  enc, dec = _codec(N_SMALL, b, K_SMALL, cap)
  words, nbits, sent = enc(_padded(positions, K_SMALL, N_SMALL), len(positions))
  lengths = [len(_reference_bits(positions[:m], b)) for m in range(len(positions) + 1)]
  fit = max(m for m, length in enumerate(lengths) if length <= cap)
  assert int(sent) == fit and int(nbits) == lengths[fit]
  assert np.asarray(words).shape == (golomb.words_for(cap),)
  out, got = dec(words, nbits)
  assert int(got) == fit
  np.testing.assert_array_equal(np.asarray(out), _padded(positions[:fit], K_SMALL, N_SMALL))


def test_b_star_and_expected_bits():
  phi = (1 + math.sqrt(5)) / 2
  for p in (0.3, 0.05, 0.01, 0.001, 1e-4):
    b = golomb.golomb_b_star(p)
    assert b == 1 + math.floor(math.log2(math.log(phi - 1) / math.log(1 - p)))
    assert golomb.expected_bits_per_position(p) == pytest.approx(b + 1 / (1 - (1 - p) ** 2 ** b))
  assert golomb.golomb_b_star(0.01) == 6 and golomb.golomb_b_star(0.001) == 9
  assert golomb.golomb_b_star(0.9) == 0 and golomb.golomb_b_star(1.0) == 0
  for bad in (0.0, -0.1, 1.5, float("nan"), "0.1", True):
    with pytest.raises(ValueError, match="p must be a float in"):
      golomb.golomb_b_star(bad)
  with pytest.raises(ValueError, match="b must be an int in"):
    golomb.encode_positions(np.zeros((2,), np.int32), 0, 10, -1, 16)


@pytest.mark.parametrize("p", [0.001, 0.01])
def test_bits_per_position_match_the_paper(p):
  """Uniformly random positions (a random k-subset of n = 2^20): measured vs b* + 1/(1-(1-p)^2^b*)."""
  n = 1 << 20
  k = math.ceil(p * n)
  b = golomb.golomb_b_star(p)
  positions = np.sort(np.random.default_rng(0).choice(n, k, replace=False)).astype(np.int32)
  cap = golomb.max_stream_bits(k, n, b)
  words, nbits, sent = jax.jit(lambda x: golomb.encode_positions(x, k, n, b, cap))(positions)
  assert int(sent) == k
  measured = int(nbits) / k
  paper = golomb.expected_bits_per_position(p)
  print(f"\nGolomb p={p}: b*={b}, measured {measured:.4f} bits/position over {k} positions"
        f" (n=2^20), paper {paper:.4f}, ratio {measured / paper:.4f}")
  assert abs(measured / paper - 1) < 0.05
  out, got = jax.jit(lambda w, m: golomb.decode_positions(w, m, b, k, n))(words, nbits)
  assert int(got) == k
  np.testing.assert_array_equal(np.asarray(out), positions)
