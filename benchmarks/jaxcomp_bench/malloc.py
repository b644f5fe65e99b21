"""The benchmarks' allocator setting on Linux: glibc malloc keeps the memory it frees.

XLA:CPU allocates each execution's temporaries in one block, far above glibc
malloc's largest mmap threshold (32 MiB), so by default every call of a
compiled step maps fresh pages and the kernel zeroes each one on first touch
(docs/benchmarks.md "Design measurements": fp16's update more than doubled). GPU and
TPU runtimes keep their memory in a caching allocator, and the speed issue's
first measurement ran both sides under jemalloc. :data:`CACHING` makes glibc
malloc do the same: one arena grown by ``brk``, never ``mmap`` for a block,
never trimmed, transparent huge pages. It must be in the environment when
the process starts, so ``python -m jaxcomp.bench kernels`` (and ``network``, which
times the updates the same way) starts itself again with it
(:func:`reexec_with_caching_malloc`) unless ``GLIBC_TUNABLES`` is already set (an
empty value keeps the system's setting) or ``--system-malloc`` is given. Every
table's header prints the setting it ran under.

The training benchmarks keep the system's allocator: 8 workers' threads share
one arena there, and the main job's compressed steps slowed against the dense one.

Its cost: one arena for every thread makes XLA's own compilation slower, so the
kernel table times compilation in a process of its own under :data:`PLAIN`; two
arenas compile as fast but fault again (the figures: docs/benchmarks.md "Design
measurements").
"""

from __future__ import annotations

import os
import platform
import sys

CACHING = ("glibc.malloc.hugetlb=1:glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0"
           ":glibc.malloc.trim_threshold=17179869184")
PLAIN = "glibc.malloc.hugetlb=1"  # the earlier tables' setting: where the kernel table times compilation
OPT_OUT = "--system-malloc"
SUBCOMMANDS = ("kernels", "network")  # the ones that time updates alone
GROW = 6  # grow_heap's block, in multiples of the gradients' bytes (a step's temporaries stay below it)


def setting() -> str:
  """The allocator setting this process runs under, for a table's header."""
  value = os.environ.get("GLIBC_TUNABLES")
  if value is None:
    return "system malloc (GLIBC_TUNABLES unset)"
  return f"GLIBC_TUNABLES={value!r}" + (" (the benchmarks' caching malloc)" if value == CACHING else "")


def reexec_with_caching_malloc(argv: list[str]) -> list[str]:
  """Starts ``python -m jaxcomp.bench argv`` again under :data:`CACHING` where it applies.

  Returns ``argv`` without ``--system-malloc`` when the process goes on as it is:
  a subcommand not in :data:`SUBCOMMANDS`, not Linux with glibc, ``GLIBC_TUNABLES``
  already in the environment (set by the user, or by this function before the
  new start), or the option given.
  """
  if OPT_OUT in argv:
    return [a for a in argv if a != OPT_OUT]
  if argv and argv[0] in SUBCOMMANDS:
    restart_under_caching(["-m", "jaxcomp.bench", *argv])
  return argv


def restart_under_caching(command: list[str]) -> None:
  """Starts ``python *command`` in place of this process under :data:`CACHING`.

  Returns (and the process goes on as it is) on a system other than Linux with
  glibc, or when ``GLIBC_TUNABLES`` is already in the environment (set by the
  user, or by this function before the new start).
  """
  if "GLIBC_TUNABLES" in os.environ:
    return
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return
  env = dict(os.environ, GLIBC_TUNABLES=CACHING)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *command], env)
  raise AssertionError("os.execve returned")  # pragma: no cover


def grow_heap(nbytes: int) -> None:
  """Under :data:`CACHING`, grows the heap by ``nbytes`` of touched pages before any timing.

  The heap grows by ``brk`` as the steps need it, and the first update that needs
  more pays for the new pages (the first rows of a table several times their
  time alone). One block touched and freed here
  stays in the heap for every later step. A no-op under any other setting.
  """
  if os.environ.get("GLIBC_TUNABLES") != CACHING or nbytes <= 0:
    return
  import numpy as np

  block = np.ones(nbytes // 8, np.float64)  # malloc'd from the heap (no mmap), every page touched
  del block
