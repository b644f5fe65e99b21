"""GRACE's compressors in eager PyTorch: compress + decompress of every gradient tensor, timed.

Written here from GRACE's algorithms (``grace_dl/torch/compressor`` of sands-lab/grace, read,
not copied): the same selection, rounding, payload dtypes and one-tensor-at-a-time loop, with
no collective and no memory object. ``benchmarks/peers.py`` runs this file in a process of its
own (PyTorch's defaults, the parent's allocator) and reads the JSON it prints:
``{"torch": version, "threads": n, "rows": {method: {"seconds": s, "copy_seconds": s}},
"ddp": {hook: s}}`` (``ddp`` with ``--ddp``: PyTorch DDP's own fp16 and PowerSGD comm hooks
beside its plain all-reduce, :func:`time_ddp`).

Usage: ``python benchmarks/grace_torch.py --model resnet50 --reps 5 --methods fp16,topk``.
"""

import argparse
import contextlib
import json
import os
import socket
import statistics
import time

import numpy as np
import torch


@torch.jit.script
def orthogonalize(m: torch.Tensor) -> None:
  """Gram-Schmidt on the columns of ``m``, in place (GRACE's PowerSGD, TorchScript as there)."""
  for i in range(m.shape[1]):
    col = m[:, i:i + 1]
    col /= torch.sqrt(torch.sum(col ** 2))
    if i + 1 < m.shape[1]:
      rest = m[:, i + 1:]
      rest -= torch.sum(col * rest, dim=0) * col


def grace_codecs():
  """``{name: codec(tensor, name, state) -> decompressed tensor}``, GRACE's algorithm for each."""

  def sparse_out(flat, idx, values):
    return torch.zeros(flat.numel(), dtype=values.dtype).scatter_(0, idx, values)

  def fp16(t, name, state):
    return t.half().float()

  def topk(t, name, state, ratio=0.01):
    flat = t.flatten()
    k = max(1, int(flat.numel() * ratio))
    _, idx = torch.topk(flat.abs(), k)
    return sparse_out(flat, idx, flat[idx]).view(t.shape)

  def randomk(t, name, state, ratio=0.01):
    flat = t.flatten()
    state["step"] = state.get("step", 0) + 1
    torch.manual_seed(sum(name.encode()) + state["step"])  # GRACE seeds from the name and the step
    idx = torch.randperm(flat.numel())[:max(1, int(flat.numel() * ratio))]
    return sparse_out(flat, idx, flat[idx]).view(t.shape)

  def dgc(t, name, state, ratio=0.01):
    flat = t.flatten()
    n = flat.numel()
    sample = flat[torch.empty(max(1, int(n * 0.01))).uniform_(0, n).long()]  # a 1% sample
    thr = torch.topk(sample.abs(), max(1, int(n * ratio * 0.01)))[0].min()
    mask = flat.abs() >= thr
    for _ in range(10):  # adjust the threshold until 0.7k-1.3k entries pass
      selected = mask.sum()
      if selected > 1.3 * n * ratio:
        thr = 1.3 * thr
      elif selected < 0.7 * n * ratio:
        thr = 0.7 * thr
      else:
        break
      mask = flat.abs() >= thr
    idx, = torch.where(mask)
    return sparse_out(flat, idx, flat[idx]).view(t.shape)

  def qsgd(t, name, state, levels=127):
    flat = t.flatten()
    norm = flat.norm()
    scaled = levels / norm * flat.abs()
    low = scaled.floor()
    level = low + (torch.empty_like(flat).uniform_() < scaled - low).float()
    codes = (level * flat.sign()).to(torch.int16).to(torch.int8)
    return (norm / levels * codes.float()).view(t.shape)

  def terngrad(t, name, state):
    flat = t.flatten()
    bound = 2.5 * torch.sqrt(torch.mean((flat - flat.mean()) ** 2)).item()
    clipped = torch.clamp(flat, -bound, bound)
    scalar = clipped.abs().max()
    keep = torch.empty_like(flat).uniform_(0, scalar.item()) < clipped.abs()
    codes = torch.where(keep, clipped.sign(), torch.zeros_like(flat)).to(torch.int8)
    return (codes.float() * scalar).view(t.shape)

  def signsgd(t, name, state):
    return (t >= 0).to(torch.uint8).float() * 2 - 1

  def signum(t, name, state, momentum=0.9):
    m = state.get(name)
    m = t if m is None else (1.0 - momentum) * t + momentum * m
    state[name] = m
    return (m >= 0).to(torch.uint8).float() * 2 - 1

  def efsignsgd(t, name, state):
    mean = t.abs().mean()
    return mean * ((t >= 0).to(torch.uint8).float() * 2 - 1)

  def onebit(t, name, state):
    flat = t.flatten()
    neg = flat < 0
    num0 = neg.sum().float()
    sum0, sum1 = flat[neg].sum(), flat[~neg].sum()
    mean0 = sum0 / num0 if num0 > 0 else sum0
    num1 = flat.numel() - num0
    mean1 = sum1 / num1 if num1 > 0 else sum1
    codes = neg.to(torch.uint8)
    return (codes * mean0 + (1 - codes) * mean1).view(t.shape)

  return {"fp16": fp16, "topk": topk, "randomk": randomk, "dgc": dgc, "qsgd": qsgd,
          "terngrad": terngrad, "signsgd": signsgd, "signum": signum, "efsignsgd": efsignsgd,
          "onebit": onebit, "powersgd": powersgd_codec()}


def powersgd_codec(rank: int = 4):
  """GRACE's PowerSGD: per matrix, a warm-started Q orthogonalized column by column; vectors as they are."""

  def codec(t, name, state):
    if t.dim() == 1:
      return t
    matrix = t.view(t.shape[0], -1)
    if name not in state:
      state[name] = torch.randn(matrix.shape[1], rank)
    q = state[name]
    orthogonalize(q)
    p = matrix @ q
    orthogonalize(p)
    q = matrix.t() @ p
    state[name] = q
    return (p @ q.t()).view(t.shape)

  return codec


# ----------------------------------------------------------------------------
# timing


def time_codec(codec, tensors, reps: int) -> float:
  """Median seconds of compress + decompress of every tensor, after one warm-up round."""
  state: dict = {}
  names = [f"g{i}" for i in range(len(tensors))]
  with torch.no_grad():
    for t, n in zip(tensors, names):  # warm-up (PowerSGD's Q, Signum's momentum)
      codec(t, n, state)
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      for t, n in zip(tensors, names):
        codec(t, n, state)
      times.append(time.perf_counter() - start)
  return statistics.median(times)


def time_copy(tensors, reps: int) -> float:
  """Median seconds of ``clone`` of every tensor."""
  times = []
  for _ in range(reps + 1):
    start = time.perf_counter()
    _ = [t.clone() for t in tensors]
    times.append(time.perf_counter() - start)
  return statistics.median(times[1:])


def gradients(model: str) -> list:
  """The kernel benchmark's gradients of ``model`` (``jaxcomp_bench.shapes.random``) in PyTorch's layout.

  Flax's kernels are (kh, kw, in, out) and (in, out); PyTorch's (out, in, kh, kw) and (out, in),
  the layout GRACE's PowerSGD reads as an (out, rest) matrix. The other codecs flatten.
  """
  from jaxcomp_bench import shapes

  def torch_layout(a):
    return np.ascontiguousarray(a.transpose(3, 2, 0, 1) if a.ndim == 4 else a.T if a.ndim == 2 else a)

  return [np.array(torch_layout(np.asarray(g))) for g in shapes.random(shapes.MODELS[model]())]  # writable


DDP_HOOKS = ("plain", "fp16", "powersgd")
BUCKET_MB = 1024  # one DDP bucket: powerSGD_hook deadlocks under gloo with several (its chained futures)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _Params(torch.nn.Module):
  """Parameters of the gradients' shapes; the loss ``sum(p * g)`` gives each the gradient ``g``."""

  def __init__(self, tensors):
    super().__init__()
    self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(t)) for t in tensors])

  def forward(self, grads):
    return sum((p * g).sum() for p, g in zip(self.params, grads))


def _ddp_model(tensors, hook: str):
  """A DDP model (:class:`_Params`) with the comm hook ``hook``; call it on the gradients for the loss."""
  from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
  from torch.nn.parallel import DistributedDataParallel

  model = DistributedDataParallel(_Params(tensors), bucket_cap_mb=BUCKET_MB)
  if hook == "fp16":
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
  elif hook == "powersgd":  # rank 4, error feedback and warm start (the defaults), from the third step
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                        start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
  return model


@contextlib.contextmanager
def process_group():
  """A one-process gloo group on this machine, for DDP (destroyed on exit)."""
  import torch.distributed as dist

  os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
  os.environ.setdefault("MASTER_PORT", str(_free_port()))
  dist.init_process_group("gloo", rank=0, world_size=1)
  try:
    yield
  finally:
    dist.destroy_process_group()


def time_ddp(tensors, reps: int) -> dict:
  """Median seconds of a backward step through PyTorch DDP (gloo, one process) under each hook.

  The loss is ``sum(p * g)`` (:class:`_Params`), so backward hands each parameter
  the benchmark's gradient ``g``; DDP copies the gradients into its buckets and all-reduces each
  (``plain``) or runs ``fp16_compress_hook`` or ``powerSGD_hook`` on it. Gradients
  are zeroed between steps, outside the timing.
  """
  out = {}
  with process_group():
    for hook in DDP_HOOKS:
      model = _ddp_model(tensors, hook)
      times = []
      for _ in range(reps + 3):  # 3 warm-up steps: PowerSGD compresses from the third
        model.zero_grad(set_to_none=False)
        start = time.perf_counter()
        model(tensors).backward()  # DDP's forward prepares its reducer; backward runs the hooks
        times.append(time.perf_counter() - start)
      out[hook] = statistics.median(times[3:])
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=("resnet50", "bert-base"), default="resnet50")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--methods", required=True)
  parser.add_argument("--ddp", action="store_true", help="also time PyTorch DDP's comm hooks (time_ddp)")
  args = parser.parse_args(argv)
  codecs = grace_codecs()
  arrays = gradients(args.model)
  from jaxcomp_bench import malloc

  malloc.grow_heap(malloc.GROW * 4 * sum(a.size for a in arrays))
  tensors = [torch.from_numpy(a) for a in arrays]
  rows = {}
  for name in args.methods.split(","):
    rows[name] = {"seconds": time_codec(codecs[name], tensors, args.reps),
                  "copy_seconds": time_copy(tensors, args.reps)}
  ddp = time_ddp(tensors, args.reps) if args.ddp else {}
  print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows,
                    "ddp": ddp}))


if __name__ == "__main__":
  main()
