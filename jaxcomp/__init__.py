"""jaxcomp: compressed gradient communication as optax gradient transformations.

Every method is a factory returning an ``optax.GradientTransformation`` that
replaces ``lax.pmean(grads, axis_name)`` with the mean of what the workers
sent compressed, with error feedback in an explicit state.
"""

from jaxcomp import checkpoint, recipes  # checkpoint imports orbax only when called
from jaxcomp.accounting import traffic, wire_bytes, wire_bytes_by_axis
from jaxcomp.autoplan import Plan, auto, auto_plan
from jaxcomp.builder import build
from jaxcomp.collectives.wire import collective_bytes, measure_wire_bytes, received_bytes
from jaxcomp.devices import cpu_devices
from jaxcomp.diloco import DiLoCoState, diloco, sparseloco
from jaxcomp.finite import apply_if_finite
from jaxcomp.memories import ef21, momentum_correction
from jaxcomp.method import Method
from jaxcomp.optimizers.demo import demo
from jaxcomp.optimizers.onebit_adam import onebit_adam, scale_by_onebit_adam
from jaxcomp.optimizers.zero_one_adam import zero_one_adam
from jaxcomp.own_step import on_shards, per_slice
from jaxcomp.parallel import DataParallel, data_parallel
from jaxcomp.protocol import CompressState
from jaxcomp.rebuild import configure, staged, steady
from jaxcomp.recipes import recipe, recipe_method
from jaxcomp.registry import METHODS
from jaxcomp.replica_mean import compressed_mean
from jaxcomp.scatter import TRANSPORTS
from jaxcomp.sharding import local, per_worker, stacked
from jaxcomp.transformation import CompressionTransformation, compressor, memory_tree, method_of
from jaxcomp.transforms.acpsgd import acpsgd
from jaxcomp.transforms.dense import bf16, fp16, none
from jaxcomp.transforms.dgc import dgc
from jaxcomp.transforms.dgc import warmup_schedule as dgc_warmup_schedule
from jaxcomp.transforms.fp4 import fp4
from jaxcomp.transforms.inceptionn import inceptionn
from jaxcomp.transforms.lowrank import powersgd
from jaxcomp.transforms.quantize import natural, qsgd, terngrad, u8bit
from jaxcomp.transforms.redsync import redsync
from jaxcomp.transforms.sbc import sbc
from jaxcomp.transforms.sign import efsignsgd, onebit, signsgd, signum
from jaxcomp.transforms.sketchml import sketchml
from jaxcomp.transforms.sparse import randomk, topk
from jaxcomp.transforms.threshold import adaq, threshold
from jaxcomp.warmup import ratio_warmup, warmup_stages

__version__ = "0.1.0"


def advise(params, gbps, workers, compute_s, **kwargs):
  """Every method (and DiLoCo) ranked by its predicted step on a network, with its suite fidelity.

  See :func:`jaxcomp.bench.advise.advise` (``python -m jaxcomp.bench advise`` prints and draws it).
  """
  from jaxcomp.bench import advise as _advise

  return _advise.advise(params, gbps, workers, compute_s, **kwargs)


__all__ = [
    "advise",
    "auto",
    "auto_plan",
    "Plan",
    # the methods (jaxcomp.METHODS), each a factory of an optax transformation
    "acpsgd",
    "adaq",
    "bf16",
    "dgc",
    "efsignsgd",
    "fp16",
    "fp4",
    "inceptionn",
    "natural",
    "none",
    "onebit",
    "powersgd",
    "qsgd",
    "randomk",
    "redsync",
    "sbc",
    "signsgd",
    "signum",
    "sketchml",
    "terngrad",
    "threshold",
    "topk",
    "u8bit",
    # choosing and configuring a method
    "METHODS",
    "configure",
    "dgc_warmup_schedule",
    "ef21",
    "momentum_correction",
    "ratio_warmup",
    "recipe",
    "recipe_method",
    "recipes",
    "staged",
    "steady",
    "warmup_stages",
    # complete optimizers
    "demo",
    "diloco",
    "onebit_adam",
    "scale_by_onebit_adam",
    "sparseloco",
    "zero_one_adam",
    # training
    "DataParallel",
    "apply_if_finite",
    "checkpoint",
    "cpu_devices",
    "data_parallel",
    "on_shards",
    "compressed_mean",
    "per_slice",
    "local",
    "per_worker",
    "stacked",
    # bytes
    "TRANSPORTS",
    "collective_bytes",
    "measure_wire_bytes",
    "received_bytes",
    "traffic",
    "wire_bytes",
    "wire_bytes_by_axis",
    # building a method (docs/adding-a-method.md)
    "CompressState",
    "CompressionTransformation",
    "DiLoCoState",
    "Method",
    "build",
    "compressor",
    "memory_tree",
    "method_of",
]
