"""``benchmarks/grace_torch.py``: the GRACE compressors the peer benchmark times keep GRACE's algorithms.

Needs PyTorch (not a dependency of jaxcomp): skipped where it is not installed.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def grace_torch():
  path = Path(__file__).resolve().parents[1] / "benchmarks" / "grace_torch.py"
  spec = importlib.util.spec_from_file_location("grace_torch", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules["grace_torch"] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def codecs(grace_torch):
  return grace_torch.grace_codecs()


def _tensor(n=4096, seed=0):
  return torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32))


def test_sparsifiers_send_the_entries_they_select(codecs):
  t = _tensor()
  k = int(t.numel() * 0.01)
  top = codecs["topk"](t, "g", {})
  assert int((top != 0).sum()) == k
  assert torch.equal(top[top != 0], t[top != 0])
  assert float(t[top != 0].abs().min()) >= float(t[top == 0].abs().max())
  rand = codecs["randomk"](t, "g", {})
  assert int((rand != 0).sum()) == k and torch.equal(rand[rand != 0], t[rand != 0])
  dgc = codecs["dgc"](t, "g", {})
  assert torch.equal(dgc[dgc != 0], t[dgc != 0])
  assert float(t[dgc != 0].abs().min()) >= float(t[dgc == 0].abs().max())


def test_quantizers_and_signs_decode_as_grace(codecs):
  t = _tensor()
  assert torch.equal(codecs["fp16"](t, "g", {}), t.half().float())
  assert torch.equal(codecs["signsgd"](t, "g", {}), torch.where(t >= 0, 1.0, -1.0))
  assert torch.allclose(codecs["efsignsgd"](t, "g", {}), t.abs().mean() * torch.where(t >= 0, 1.0, -1.0))
  one = codecs["onebit"](t, "g", {})
  assert torch.allclose(one[t < 0], t[t < 0].mean().expand(int((t < 0).sum())))
  assert torch.allclose(one[t >= 0], t[t >= 0].mean().expand(int((t >= 0).sum())))
  q = codecs["qsgd"](t, "g", {})
  unit = float(t.norm()) / 127
  assert torch.allclose(q / unit, torch.round(q / unit), atol=1e-3)
  assert float((q - t).abs().max()) <= unit * 1.001
  tern = codecs["terngrad"](t, "g", {})
  assert len(set(np.round(np.abs(tern.numpy()), 6)) - {0.0}) == 1
  state: dict = {}
  codecs["signum"](t, "g", state)
  m = codecs["signum"](-t, "g", state)  # momentum 0.9: 0.1 (-t) + 0.9 t keeps t's sign
  assert torch.equal(m, torch.where(t >= 0, 1.0, -1.0))


def test_powersgd_recovers_a_rank_four_matrix(codecs):
  rng = np.random.default_rng(1)  # rank 4 = the factors' rank: one power step spans it exactly
  m = torch.from_numpy((rng.standard_normal((64, 4)) @ rng.standard_normal((4, 96))).astype(np.float32))
  out = codecs["powersgd"](m, "g", {})
  assert torch.allclose(out, m, atol=1e-4)
  v = _tensor(16)
  assert torch.equal(codecs["powersgd"](v, "v", {}), v)  # vectors travel as they are


def test_ddp_hooks_hand_back_the_gradients(grace_torch):
  tensors = [_tensor(64 * 32).view(64, 32), _tensor(64, seed=1)]
  times = grace_torch.time_ddp(tensors, reps=1)
  assert set(times) == set(grace_torch.DDP_HOOKS) and all(t > 0 for t in times.values())
  with grace_torch.process_group():
    grads = {}
    for hook in grace_torch.DDP_HOOKS:  # one process: the mean is the gradient, as each hook sends it
      model = grace_torch._ddp_model(tensors, hook)
      for _ in range(3):  # PowerSGD compresses from the third step
        model.zero_grad(set_to_none=False)
        model(tensors).backward()
      grads[hook] = [p.grad.clone() for p in model.module.params]
  assert all(torch.equal(g, t) for g, t in zip(grads["plain"], tensors))
  assert all(torch.equal(g, t.half().float()) for g, t in zip(grads["fp16"], tensors))
  assert not torch.equal(grads["powersgd"][0], tensors[0])  # the 64x32 matrix: its rank-4 approximation
  assert torch.equal(grads["powersgd"][1], tensors[1])  # a vector travels as it is
