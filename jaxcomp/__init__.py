"""jaxcomp: compressed gradient communication as optax gradient transformations.

Every method is a factory returning an ``optax.GradientTransformation`` that
replaces ``lax.pmean(grads, axis_name)`` with the mean of what the workers
sent compressed, with error feedback in an explicit state.
"""

from jaxcomp.collectives.wire import collective_bytes, measure_wire_bytes
from jaxcomp.core import (CompressState, CompressionTransformation, Method, build, configure, memory_tree, staged, steady,
                          wire_bytes, wire_bytes_by_axis)
from jaxcomp.collectives.wire import received_bytes
from jaxcomp.adam import onebit_adam, scale_by_onebit_adam, zero_one_adam
from jaxcomp.devices import cpu_devices
from jaxcomp.finite import apply_if_finite
from jaxcomp.scatter import EXCHANGES, traffic
from jaxcomp.memories import ef21, momentum_correction
from jaxcomp import checkpoint, recipes  # checkpoint imports orbax only when called
from jaxcomp.recipes import recipe, recipe_method
from jaxcomp.parallel import DataParallel, data_parallel
from jaxcomp.sharding import local, per_worker, stacked
from jaxcomp.warmup import ratio_warmup, warmup_stages
from jaxcomp.transforms.acpsgd import acpsgd
from jaxcomp.transforms.codes import inceptionn, sketchml
from jaxcomp.transforms.demo import demo
from jaxcomp.transforms.dense import bf16, fp16, none
from jaxcomp.transforms.dgc import dgc, warmup_schedule as dgc_warmup_schedule
from jaxcomp.transforms.lowrank import powersgd
from jaxcomp.transforms.quantize import natural, qsgd, terngrad, u8bit
from jaxcomp.transforms.redsync import redsync
from jaxcomp.transforms.sbc import sbc
from jaxcomp.transforms.sign import efsignsgd, onebit, signsgd, signum
from jaxcomp.transforms.sparse import randomk, topk
from jaxcomp.transforms.threshold import adaq, threshold

# name -> factory, for the benchmarks and the examples' --method flag.
METHODS = {
    # dense baselines
    "none": none, "fp16": fp16, "bf16": bf16,
    # sparsifiers
    "topk": topk, "randomk": randomk, "threshold": threshold, "dgc": dgc, "adaq": adaq,
    # quantizers
    "qsgd": qsgd, "terngrad": terngrad, "natural": natural, "u8bit": u8bit, "sketchml": sketchml,
    "inceptionn": inceptionn,
    # sign methods
    "signsgd": signsgd, "efsignsgd": efsignsgd, "signum": signum, "onebit": onebit,
    # low rank
    "powersgd": powersgd, "acpsgd": acpsgd,
    # systems
    "redsync": redsync, "sbc": sbc,
}

__version__ = "0.1.0"

__all__ = [
    "CompressState", "CompressionTransformation", "Method", "METHODS", "apply_if_finite", "build",
    "collective_bytes", "configure", "staged", "data_parallel", "DataParallel", "steady", "wire_bytes_by_axis", "ratio_warmup", "warmup_stages", "cpu_devices", "ef21", "momentum_correction", "recipe", "recipe_method", "recipes", "dgc_warmup_schedule", "local", "measure_wire_bytes", "memory_tree",
    "checkpoint", "per_worker", "stacked", "wire_bytes", "EXCHANGES", "traffic", "received_bytes",
    "onebit_adam", "scale_by_onebit_adam", "demo", "zero_one_adam",
] + sorted(METHODS)
