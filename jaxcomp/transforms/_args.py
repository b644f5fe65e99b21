"""Argument checks shared by the factories: errors name the argument and the allowed values."""

from __future__ import annotations

import functools
import inspect
import math
import numbers

import numpy as np


def ratio(name: str, value) -> float:
  """A float in (0, 1]."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a float in (0, 1], got {name}={value!r}")
  value = float(value)
  if not (0.0 < value <= 1.0):  # also rejects NaN
    raise ValueError(f"{name} must be in (0, 1], got {name}={value!r}")
  return value


def integer(name: str, value, low: int, high: int | None = None) -> int:
  """An int in [low, high]."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int >= {low}, got {name}={value!r}")
  value = int(value)
  if value < low or (high is not None and value > high):
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{name} must be {allowed}, got {name}={value!r}")
  return value


def positive(name: str, value, allow_zero: bool = False) -> float:
  """A finite float > 0 (or >= 0)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a finite number, got {name}={value!r}")
  value = float(value)
  ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
  if not ok:
    raise ValueError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0, got {name}={value!r}")
  return value


def unit_interval(name: str, value, closed_right: bool = False) -> float:
  """A float in [0, 1) (or [0, 1])."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a float in [0, 1), got {name}={value!r}")
  value = float(value)
  ok = 0.0 <= value < 1.0 or (closed_right and value == 1.0)
  if not ok:
    raise ValueError(f"{name} must be in [0, {'1]' if closed_right else '1)'}, got {name}={value!r}")
  return value


def flag(name: str, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be True or False, got {name}={value!r}")
  return bool(value)


def choice(name: str, value, allowed) -> str:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {tuple(allowed)}, got {name}={value!r}")
  return value


def ratio_count(ratio_value: float, n: int) -> int:
  """k = max(1, ceil(ratio * n)), robust to float noise (0.01 * 100 -> 1)."""
  return max(1, min(n, int(math.ceil(ratio_value * n - 1e-9))))


def index_dtype(n: int):
  """The narrowest unsigned integer dtype that holds positions 0..n-1 (int32 past 2^16)."""
  if n <= 256:
    return np.uint8
  if n <= 65536:
    return np.uint16
  return np.int32


RENAMED = {"exchange": "transport"}  # keywords the factories no longer take -> their replacement


def factory(f):
  """A public factory: a keyword it no longer takes (:data:`RENAMED`) is an error that names its
  replacement, not Python's bare "unexpected keyword argument"."""
  takes = inspect.signature(f).parameters
  positional = [n for n, p in takes.items() if p.kind == p.POSITIONAL_OR_KEYWORD]

  @functools.wraps(f)
  def wrapper(*args, **kwargs):
    if len(args) > len(positional):
      names = ", ".join(positional)
      raise TypeError(f"{f.__name__}() takes {len(positional)} positional arguments ({names}),"
                      f" got {len(args)}: axis_name and the build options are keywords,"
                      f" {f.__name__}(..., axis_name='data')")
    for old, new in RENAMED.items():
      if old in kwargs and old not in takes:
        raise TypeError(f"{f.__name__}() takes {new}= in place of {old}= (renamed; see CHANGELOG.md)")
    return f(*args, **kwargs)

  return wrapper
