"""jaxcomp: compressed gradient communication as optax gradient transformations.

Every method is a factory returning an ``optax.GradientTransformation`` that
replaces ``lax.pmean(grads, axis_name)`` with the mean of what the workers
sent compressed, with error feedback in an explicit state.
"""

from jaxcomp.collectives.wire import collective_bytes, measure_wire_bytes, received_bytes
from jaxcomp.core.accounting import traffic, wire_bytes, wire_bytes_by_axis
from jaxcomp.core.builder import build
from jaxcomp.core.compression import CompressionTransformation, compressor, memory_tree, method_of
from jaxcomp.core.memories import ef21, momentum_correction
from jaxcomp.core.method import Method
from jaxcomp.core.protocol import CompressState
from jaxcomp.core.rebuild import configure, staged, steady
from jaxcomp.core.warmup import ratio_warmup, warmup_stages
from jaxcomp.exchanges.scatter import TRANSPORTS
from jaxcomp.optimizers.demo import demo
from jaxcomp.optimizers.onebit_adam import onebit_adam, scale_by_onebit_adam
from jaxcomp.optimizers.zero_one_adam import zero_one_adam
from jaxcomp.planning.autoplan import Plan, auto, auto_plan
from jaxcomp.registry import METHODS
from jaxcomp.training import checkpoint, recipes  # checkpoint imports orbax only when called
from jaxcomp.training.devices import cpu_devices
from jaxcomp.training.diloco import DiLoCoState, diloco, sparseloco
from jaxcomp.training.finite import apply_if_finite
from jaxcomp.training.own_step import on_shards, per_slice
from jaxcomp.training.parallel import DataParallel, data_parallel
from jaxcomp.training.recipes import recipe, recipe_method
from jaxcomp.training.replica_mean import compressed_mean
from jaxcomp.training.worker_state import local, per_worker, stacked
from jaxcomp.transforms.acpsgd import acpsgd
from jaxcomp.transforms.dense import bf16, fp16, none
from jaxcomp.transforms.dgc import dgc
from jaxcomp.transforms.dgc import warmup_schedule as dgc_warmup_schedule
from jaxcomp.transforms.fp4 import fp4
from jaxcomp.transforms.inceptionn import inceptionn
from jaxcomp.transforms.lowrank import powersgd
from jaxcomp.transforms.quantize import natural, qsgd, terngrad
from jaxcomp.transforms.redsync import redsync
from jaxcomp.transforms.sbc import sbc
from jaxcomp.transforms.sign import efsignsgd, onebit, signsgd, signum
from jaxcomp.transforms.sketchml import sketchml
from jaxcomp.transforms.sparse import randomk, topk
from jaxcomp.transforms.threshold import adaq, threshold
from jaxcomp.transforms.u8bit import u8bit

__version__ = "0.1.0"


def advise(params, gbps, workers, compute_s, **kwargs):
  """Every method (and DiLoCo) ranked by its predicted step on a network, with its suite fidelity.

  See :func:`jaxcomp.planning.advise.advise` (``python -m jaxcomp.bench advise`` prints and draws it).
  """
  from jaxcomp.planning import advise as _advise

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
