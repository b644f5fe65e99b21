"""The builder's checks: its arguments, and each update's gradients and state against what init saw.

Every error names the argument, what was given and the fix (the brief's
rule: a clear error at construction or at trace time, never a silent wrong
answer).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives.axis import AxisName, axis_names, check_axis_name
from jaxcomp.core.compat import varying_axes
from jaxcomp.core.compression import Settings
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import CompressState
from jaxcomp.exchanges import scatter

SIGNATURES_KEPT = 64  # the trees one transformation remembers tx.init being called on (the latest kept)


def positive_int(name, value, low):
  """``value`` as an int >= ``low``, or None; else an error naming ``name``."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int >= {low} or None, got {name}={value!r}")
  if value < low:
    raise ValueError(f"{name} must be >= {low} or None, got {name}={value!r}")
  return int(value)


def settings(method: Method, axis_name: AxisName, seed: int, bucket_bytes, min_size, dense,
             dense_axis_name: AxisName, transport) -> Settings:
  """:func:`jaxcomp.build`'s arguments, checked, in one frozen object."""
  axis_name = check_axis_name(axis_name)
  dense_axis_name = check_axis_name(dense_axis_name, "dense_axis_name")
  if dense_axis_name is not None and axis_name is None:
    raise ValueError(f"dense_axis_name={dense_axis_name!r} needs axis_name (the slow axis the compressed"
                     " exchange runs over), got axis_name=None")
  if dense_axis_name is not None and set(axis_names(dense_axis_name)) & set(axis_names(axis_name)):
    raise ValueError(f"dense_axis_name={dense_axis_name!r} and axis_name={axis_name!r} must name"
                     " different mesh axes (the fast one and the slow one)")
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
    raise TypeError(f"seed must be an int, got seed={seed!r}")
  if not -2 ** 63 <= int(seed) < 2 ** 63:
    raise ValueError(f"seed must fit in int64, got seed={seed!r}")
  bucket_bytes = positive_int("bucket_bytes", bucket_bytes, 4)
  min_size = positive_int("min_size", min_size, 0)
  if dense is not None and not callable(dense):
    flags = jax.tree.leaves(dense)
    if not flags or not all(isinstance(f, (bool, np.bool_)) for f in flags):
      raise ValueError("dense must be None, a pytree of bools like the gradients (an optax-style"
                       f" mask) or a callable returning one, got dense={dense!r}")
  if transport is not None and not isinstance(transport, str):
    raise ValueError(f"transport must be one of {scatter.TRANSPORTS}, got transport={transport!r}")
  method = dataclasses.replace(
      method.with_transport(transport),
      bucket_bytes=method.bucket_bytes if bucket_bytes is None else bucket_bytes,
      min_size=method.min_size if min_size is None else min_size,
      dense=method.dense if dense is None else dense)
  return Settings(method, axis_name, dense_axis_name, int(seed))


def _is_variable(x) -> bool:
  """A Flax NNX Variable (``nnx.Param``...): a box around one array, not a level of the tree.

  ``nnx.Optimizer`` calls ``tx.init`` on the model's Variables and ``tx.update``
  on plain arrays; both name the same leaves. flax is looked up, not imported.
  """
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def unbox(tree):
  """``tree`` with every Flax NNX Variable replaced by what it holds (None stays None)."""
  if tree is None or not any(_is_variable(x) for x in jax.tree.leaves(tree, is_leaf=_is_variable)):
    return tree
  return jax.tree.map(lambda x: x.get_value() if _is_variable(x) else x, tree, is_leaf=_is_variable)


def signature(tree) -> tuple:
  """(key path, shape) of every leaf: what tx.init saw, checked by tx.update.

  Not the treedef: a dict and a FrozenDict with the same keys agree, and a
  Flax NNX Variable is the array it holds.
  """
  return tuple((jax.tree_util.keystr(p), tuple(np.shape(x[...] if _is_variable(x) else x)))
               for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0])


def remember(signatures: list, tree) -> bool:
  """Adds ``tree``'s signature to ``signatures``; True if it is new."""
  sig = signature(tree)
  if sig in signatures:
    return False
  signatures.append(sig)
  del signatures[:-SIGNATURES_KEPT]
  return True


def check_signature(got: tuple, seen: list) -> None:
  """Raises unless the gradients' leaves (paths and shapes) are those of a tree tx.init was called on."""
  if not seen or got in seen:
    return

  def common(want):
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))

  want = max(reversed(seen), key=common)  # the closest (the latest among equals)
  i = common(want)
  gp, gs = got[i] if i < len(got) else (None, None)
  wp, ws = want[i] if i < len(want) else (None, None)
  if gp is not None and gp == wp:
    what = f"leaf {gp} has shape {gs}, tx.init saw {ws}"
  elif gp is not None and gp not in {p for p, _ in want}:
    what = f"leaf {gp} (shape {gs}) is not in the tree tx.init saw" + (
        f", which has leaf {wp} (shape {ws}) there" if wp is not None else "")
  elif wp is not None and wp not in {p for p, _ in got}:
    what = f"the gradients lack leaf {wp} (shape {ws}) that tx.init saw"
  else:
    what = f"leaf {gp} (shape {gs}) stands where tx.init saw leaf {wp} (shape {ws})"
  raise ValueError(
      f"updates do not match the state: {what} ({len(got)} gradient leaves, {len(want)} in tx.init's"
      " tree). Pass gradients with the structure, key names and shapes of the parameters given to"
      " tx.init (or call tx.init on parameters like the gradients).")


def check_count(state) -> None:
  """A per-worker state (leading worker axis) reaching tx.update outside pmap, or without jaxcomp.local."""
  shape = tuple(np.shape(state.count))
  if shape == ():
    return
  if shape == (1,):
    raise ValueError(
        "state has a leading worker axis of size 1: inside shard_map call"
        " tx.update(jaxcomp.local(grads), jaxcomp.local(state)) and return jaxcomp.stacked(state)"
        " (its count has shape (1,), a scalar in the state tx.init made)")
  if len(shape) == 1:
    raise ValueError(
        f"state has a leading worker axis of size {shape[0]}: a per-worker state (jaxcomp.per_worker)"
        " goes through tx.update inside jax.pmap, or inside jax.shard_map with in_specs P(axis) and"
        " jaxcomp.local(state); outside them use tx.init(params)'s state as it is (its count has shape"
        f" {shape}, a scalar in the state tx.init made)")
  raise ValueError(f"state.count must be a scalar int32 (a state from tx.init), got shape {shape}")


def check_leaves(leaves, paths):
  """Floating-point gradients only."""
  for leaf, path in zip(leaves, paths):
    if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
      raise TypeError(
          f"updates: leaf {jax.tree_util.keystr(path)} has dtype {leaf.dtype};"
          " jaxcomp compresses floating-point gradients only (float32, bfloat16,"
          " float16). Mask integer leaves out with optax.masked or"
          " optax.multi_transform.")


def update_inputs(updates: Any, state: Any, signatures: list, axis_name: Any = None):
  """The checks of ``tx.update``'s arguments; returns the gradient leaves and their treedef."""
  if not isinstance(state, CompressState):
    raise TypeError(f"state must be the CompressState from tx.init, got {type(state).__name__}")
  check_count(state)
  check_signature(signature(updates), signatures)
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
  leaves = [leaf for _, leaf in paths_leaves]
  check_leaves(leaves, [p for p, _ in paths_leaves])
  check_not_reduced(paths_leaves, state, axis_name)
  return leaves, treedef


def check_not_reduced(paths_leaves, state, axis_name) -> None:
  """Under ``shard_map(check_vma=True)``: no gradient leaf typed invariant over the compressed axis.

  There the per-worker state is typed varying over it; a gradient that is not was summed over it
  already (JAX sums the gradient of a parameter passed with ``in_specs=P()`` over the manual axes),
  and averaging those sums would scale every update by the number of workers, silently.
  """
  names = set(axis_names(axis_name) if axis_name is not None else ())
  if not names or not any(names & varying_axes(x) for x in jax.tree.leaves(state.memory) + [state.count]):
    return
  for path, leaf in paths_leaves:
    missing = names - varying_axes(leaf)
    if missing:
      raise ValueError(
          f"updates: leaf {jax.tree_util.keystr(path)} is the same on every worker of {sorted(missing)}"
          " (typed invariant under shard_map(check_vma=True)): it was summed over that axis before"
          " tx.update, as JAX does for the gradient of a parameter passed with in_specs=P(), and"
          " jaxcomp's mean of those sums would scale the update by the number of workers. Pass"
          " check_vma=False to jax.shard_map, or compute per-worker gradients with jaxcomp.per_slice.")


def check_state(method: Method, state, buckets, treedef):
  """The state's memory and exchange state must have the gradients' bucket layout."""
  like = method.memory.like_params(state.memory)
  if like is not None:
    got = [tuple(np.shape(v)) for v in jax.tree.leaves(like)]
    want = [(b.length,) for b in buckets]
    if got != want:
      raise ValueError(
          "updates do not match the state: the gradients' buckets hold"
          f" {[w[0] for w in want]} entries, the state's {[g[0] if g else 0 for g in got]}"
          f" (gradient tree {treedef}). Call tx.init on parameters with the same structure"
          " and shapes as the gradients.")
  if len(buckets) != len(state.extra):
    raise ValueError(
        f"updates do not match the state: {len(buckets)} buckets now,"
        f" {len(state.extra)} when tx.init was called.")


def check_stage_state(method: Method, extra, others) -> None:
  """Every stage's exchange state must be alike (``others``: one per later stage)."""
  for (first, _), other in zip(method.stages, others):
    if jax.tree.structure(other) != jax.tree.structure(extra) or \
        [np.shape(a) for a in jax.tree.leaves(other)] != [np.shape(a) for a in jax.tree.leaves(extra)]:
      raise ValueError(
          f"stages: the stage from step {first} keeps exchange state of another shape than the"
          f" first stage ({method.name}'s state depends on the setting the stages change, e.g."
          " PowerSGD's Q on the rank); schedule a setting that leaves the state alike")
