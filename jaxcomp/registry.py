"""The registry of methods: name -> factory, for the benchmarks, the recipes and the ``--method`` flags."""

from jaxcomp.transforms.acpsgd import acpsgd
from jaxcomp.transforms.dense import bf16, fp16, none
from jaxcomp.transforms.dgc import dgc
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

METHODS = {
    # dense baselines
    "none": none, "fp16": fp16, "bf16": bf16,
    # sparsifiers
    "topk": topk, "randomk": randomk, "threshold": threshold, "dgc": dgc, "adaq": adaq,
    # quantizers
    "qsgd": qsgd, "terngrad": terngrad, "natural": natural, "u8bit": u8bit, "fp4": fp4, "sketchml": sketchml,
    "inceptionn": inceptionn,
    # sign methods
    "signsgd": signsgd, "efsignsgd": efsignsgd, "signum": signum, "onebit": onebit,
    # low rank
    "powersgd": powersgd, "acpsgd": acpsgd,
    # systems
    "redsync": redsync, "sbc": sbc,
}
