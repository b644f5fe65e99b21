"""jaxcomp: compressed gradient communication as optax gradient transformations.

Every method is a factory returning an ``optax.GradientTransformation`` that
replaces ``lax.pmean(grads, axis_name)`` with the mean of what the workers
sent compressed, with error feedback in an explicit state.
"""

from jaxcomp.collectives.wire import collective_bytes, measure_wire_bytes
from jaxcomp.core import CompressState, CompressionTransformation, Method, build, wire_bytes
from jaxcomp.devices import cpu_devices
from jaxcomp.sharding import local, per_worker, stacked
from jaxcomp.transforms.dense import bf16, fp16, none
from jaxcomp.transforms.lowrank import powersgd
from jaxcomp.transforms.quantize import qsgd
from jaxcomp.transforms.sign import efsignsgd, signsgd
from jaxcomp.transforms.sparse import randomk, topk

# name -> factory, for the benchmark and the examples' --method flag.
METHODS = {
    "none": none, "fp16": fp16, "bf16": bf16, "topk": topk, "randomk": randomk,
    "qsgd": qsgd, "signsgd": signsgd, "efsignsgd": efsignsgd, "powersgd": powersgd,
}

__version__ = "0.1.0"

__all__ = [
    "CompressState", "CompressionTransformation", "Method", "METHODS", "bf16", "build",
    "collective_bytes", "cpu_devices", "efsignsgd", "fp16", "local", "measure_wire_bytes",
    "none", "per_worker", "powersgd", "qsgd", "randomk", "signsgd", "stacked", "topk",
    "wire_bytes",
]
