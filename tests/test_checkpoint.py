"""Checkpoint and resume: every method continues bit for bit in a fresh process.

For every method in ``jaxcomp.METHODS`` through its ``jaxcomp.recipe`` (under pmap, 8 workers) and one under
shard_map: train a tiny model ``FIRST_STEPS`` steps, save (params, optimizer
state) with :mod:`jaxcomp.training.checkpoint`, restore it in a new Python process,
train ``RESUMED_STEPS`` more steps there; the parameters equal, bit for bit,
those of the uninterrupted run in this process. One subprocess serves all
methods.
"""

import os
import signal
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.training import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
import ckpt_resume as cr

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ckpt_resume.py")
PHASE_TIMEOUT_S = 420


def _phase(mode: str, directory) -> None:
  """Runs one phase of the script in a new process, bounded, killed with its group on timeout."""
  # both phases inherit the suite's compile flags (tests/conftest.py)
  proc = subprocess.Popen([sys.executable, SCRIPT, mode, str(directory)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=PHASE_TIMEOUT_S)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  assert proc.returncode == 0, f"{mode} exited with {proc.returncode}:\n{out[-4000:]}"


def test_every_method_resumes_bitwise_in_a_fresh_process(tmp_path):
  _phase("first", tmp_path)  # FIRST_STEPS, save, then RESUMED_STEPS uninterrupted
  _phase("resume", tmp_path)  # a fresh process: restore, RESUMED_STEPS
  reference = dict(np.load(tmp_path / "reference.npz"))
  resumed = dict(np.load(tmp_path / "resumed.npz"))
  assert sorted(resumed) == sorted(reference)
  for k, x in reference.items():
    assert np.all(np.isfinite(x)), k
  differ = [k for k in reference if not np.array_equal(reference[k], resumed[k])]
  assert not differ, differ
  cases = cr.cases()
  assert {n for n, lay in cases if lay == "pmap" and "@" not in n} == set(jaxcomp.METHODS)
  assert ("qsgd@scatter", "pmap") in cases and ("zero_one_adam@adamw", "pmap") in cases
  assert ("powersgd", "shard_map") in cases
  assert len({k.split("[")[0] for k in reference}) == len(cases)


class _State(NamedTuple):
  count: jax.Array
  key: jax.Array
  nested: tuple


def test_round_trip_keeps_structure_dtypes_keys_and_shardings(tmp_path):
  mesh = cr.mesh()
  tree = {
      "state": _State(jnp.int32(7), jax.random.PRNGKey(3), (jnp.ones((3,), jnp.bfloat16), ())),
      "typed_key": jax.random.key(5),
      "sharded": jaxcomp.per_worker(jnp.arange(4.0), mesh, cr.AXIS),
      "host": np.arange(6, dtype=np.float16).reshape(2, 3),
      "empty": (jnp.zeros((0, 3)), jaxcomp.per_worker(jnp.zeros((2, 0)), mesh, cr.AXIS)),
  }
  checkpoint.save(str(tmp_path / "3"), tree)
  like = jax.tree.map(lambda x: x, tree)
  got = checkpoint.restore(str(tmp_path / "3"), like)
  assert isinstance(got["state"], _State)
  assert got["state"].key.dtype == jnp.uint32
  np.testing.assert_array_equal(jax.random.key_data(got["typed_key"]), jax.random.key_data(tree["typed_key"]))
  assert got["sharded"].sharding == tree["sharded"].sharding
  assert isinstance(got["host"], np.ndarray) and got["host"].dtype == np.float16
  assert got["empty"][0].shape == (0, 3) and got["empty"][1].shape == (8, 2, 0)
  assert got["empty"][1].sharding == tree["empty"][1].sharding
  for a, b in zip(jax.tree.leaves(tree["state"]), jax.tree.leaves(got["state"])):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert checkpoint.latest_step(str(tmp_path)) == 3


def test_errors_name_the_problem(tmp_path):
  tree = {"w": jnp.zeros((4, 2)), "count": jnp.int32(0)}
  checkpoint.save(str(tmp_path / "1"), tree)
  with pytest.raises(FileExistsError, match="overwrite=True"):
    checkpoint.save(str(tmp_path / "1"), tree)
  checkpoint.save(str(tmp_path / "1"), tree, overwrite=True)
  with pytest.raises(ValueError, match=r"leaf \['w'\] of like is float32\(4, 3\)"):
    checkpoint.restore(str(tmp_path / "1"), {"w": jnp.zeros((4, 3)), "count": jnp.int32(0)})
  with pytest.raises(ValueError, match="has 2 leaves, like has 1"):
    checkpoint.restore(str(tmp_path / "1"), {"w": jnp.zeros((4, 2))})
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    checkpoint.restore(str(tmp_path / "2"), tree)
  (tmp_path / "9.orbax-checkpoint-tmp-123").mkdir()  # a save cut short by a fault
  assert checkpoint.latest_step(str(tmp_path)) == 1
  assert checkpoint.latest_step(str(tmp_path / "missing")) is None
