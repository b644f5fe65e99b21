"""8 CPU devices for every test, set up safely before any JAX work.

``jaxcomp.cpu_devices`` sets PJRT_NPROC=16 before JAX creates its CPU client:
8 devices on a 2-core machine otherwise deadlock inside XLA's all-reduce.
"""

import os

os.environ.setdefault("PJRT_NPROC", "16")


import jaxcomp  # noqa: E402

jaxcomp.cpu_devices(8)

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")
