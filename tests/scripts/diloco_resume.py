"""Checkpoint/resume of DiLoCo mid-period in a fresh process (tests/test_diloco_compose.py).

``python tests/scripts/diloco_resume.py first|resume DIR``: the phases of
``ckpt_resume.py`` (its tiny model, its pmap and shard_map steps, its
save/restore), with DiLoCo configurations in place of the methods: H = 4, so
the checkpoint after 3 steps falls mid-period and the 3 resumed steps hold a
sync (Streaming P = 2: one sync of each fragment; with ``delay=2`` a fragment
sent before the checkpoint lands after it).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckpt_resume as cr  # noqa: E402  (sets PJRT_NPROC and the 8 CPU devices first)
import jax  # noqa: E402
import optax  # noqa: E402

import jaxcomp  # noqa: E402

AXIS = cr.AXIS
H = 4


def optimizer(name: str):
  """DiLoCo (top-k, Nesterov outer), Streaming DiLoCo (P = 2, fp4; also with delay 2, alpha 0.5) or
  SparseLoCo, AdamW inside."""
  inner = optax.adamw(1e-2)
  if name == "diloco":
    return jaxcomp.diloco(inner, sync_every=H, compressor=jaxcomp.topk(0.2, axis_name=AXIS, min_size=1),
                          axis_name=AXIS)
  if name == "streaming":
    return jaxcomp.diloco(inner, sync_every=H, compressor=jaxcomp.fp4(axis_name=AXIS, min_size=1),
                          axis_name=AXIS, fragments=2)
  if name == "streaming-delay":  # a fragment sent in step 2 lands in step 3, after the checkpoint
    return jaxcomp.diloco(inner, sync_every=H, compressor=jaxcomp.fp4(axis_name=AXIS, min_size=1),
                          axis_name=AXIS, fragments=2, delay=2, alpha=0.5)
  return jaxcomp.sparseloco(inner, sync_every=H, axis_name=AXIS, density=0.1, chunk=64)


def cases():
  return [("diloco", "pmap"), ("streaming", "pmap"), ("streaming-delay", "pmap"), ("sparseloco", "pmap"),
          ("diloco", "shard_map")]


cr.optimizer = optimizer  # ckpt_resume's steps and templates build their optimizer through these
cr.cases = cases

if __name__ == "__main__":
  mode, directory = sys.argv[1], sys.argv[2]
  jax.config.update("jax_compilation_cache_dir", os.path.join(directory, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  {"first": cr.first, "resume": cr.resume}[mode](directory)
  print(f"{mode}: {len(cases())} cases", flush=True)
