"""Every method ranked by its predicted step on a network: the model behind :func:`jaxcomp.advise`
and :func:`jaxcomp.auto` (``python -m jaxcomp.bench advise`` prints and draws it).

For a parameter tree and a network (``workers`` on links of ``gbps`` each,
``latency_us`` per message), each method's :class:`Row` holds:

- **bytes**: what one worker sends per step, from the bucket layout and the
  codecs' payload shapes (``jaxcomp.traffic``, no compile; ACP-SGD's fused
  exchange: its nominal ``jaxcomp.wire_bytes`` as one all-reduce; SBC's bytes
  over its ``delay``);
- **communication**: the ring alpha-beta model of those collectives
  (:mod:`jaxcomp.planning.netsim`);
- **compression**: the encode + decode round trip measured by ``python -m
  jaxcomp.bench kernels --json PATH`` on a device (``kernels=``; default: the
  bundled table of one H200, ``data/kernels_h200.json``), the method's time
  beyond the dense update's, scaled by the number of values; a gathered
  method's decodes of the other workers' payloads are not in it;
- **fidelity**: the share of the suite's runs (``python -m jaxcomp.bench
  suite``: five tasks, both horizons, batches and transports) in which the
  method's recipe met its target against dense, with SGD and with AdamW
  (``data/fidelity.json``, read from the tables of docs/recipes.md).

The step is ``compute + compression + communication`` (no overlap;
``overlap=True`` hides communication behind backprop). DiLoCo rows send the
dense float32 all-reduce once every ``H`` steps; their fidelity is not in the
suite.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from jaxcomp.planning import netsim

DATA = os.path.join(os.path.dirname(__file__), "data")
DILOCO_H = (16, 64)


@dataclasses.dataclass(frozen=True)
class Row:
  """One method's prediction: seconds per step and its parts, bytes per worker, suite pass rates."""

  method: str
  bytes: float
  communication: float
  compression: float
  step: float
  speedup: float  # dense float32 step / this step
  fidelity: dict  # optimizer -> (passed, runs); empty for DiLoCo


def positive_number(name: str, v: float) -> float:
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
    raise ValueError(f"{name} must be a number > 0, got {name}={v!r}")
  return float(v)


def load_json(name_or_path: str) -> dict:
  path = name_or_path if os.path.sep in name_or_path else os.path.join(DATA, name_or_path)
  with open(path) as f:
    return json.load(f)


def per_value_seconds(kernels: dict) -> dict:
  """method -> seconds per gradient value beyond the dense update's, averaged over the table's cases."""
  by_case: dict = {}
  for r in kernels["cases"]:
    if "seconds" in r:
      by_case.setdefault(r["case"], {})[r["method"]] = (r["seconds"], r["values"])
  out: dict = {}
  for rows in by_case.values():
    base = rows.get("none", (0.0, 1))[0]
    for m, (s, n) in rows.items():
      out.setdefault(m, []).append(max(0.0, s - base) / n)
  return {m: sum(v) / len(v) for m, v in out.items()}


def unmeasured(kernels: str | dict = "kernels_h200.json") -> list[str]:
  """The methods of ``jaxcomp.METHODS`` the kernel table has no row for (left out of the ranking)."""
  from jaxcomp.registry import METHODS

  cost = per_value_seconds(load_json(kernels) if isinstance(kernels, str) else kernels)
  return [n for n in METHODS if n != "none" and n not in cost]


def method_traffic(name: str, params: Any, workers: int, optimizer: str = "sgd", **settings) -> list:
  """``(kind, bytes)`` per collective of a steady step of ``name``'s recipe (``jaxcomp.recipe_method``)
  for ``optimizer``, the configuration the suite measured (averaged over SBC's delay); ``settings``:
  build options of the recipe (``transport``, ``dense``)."""
  from jaxcomp.core.accounting import traffic, wire_bytes
  from jaxcomp.core.compression import method_of
  from jaxcomp.core.rebuild import steady
  from jaxcomp.training.recipes import recipe_method

  tx = steady(recipe_method(name, "data", optimizer=optimizer, **settings))
  method = method_of(tx, params)
  if method.fused is not None:
    return [("all-reduce", float(wire_bytes(tx, params, workers=workers)))]
  every = method.sync_every
  return [(k, b / every) for k, b in traffic(tx, params, workers=workers)]


def value_count(params: Any) -> int:
  import jax
  import numpy as np

  return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(params)))


def network(workers: int, gbps: float, latency_us: float = 10.0, per_node: int = 1,
            intra_gbps: float = 400.0) -> netsim.Network:
  """A flat ring of ``gbps`` links, or nodes of ``per_node`` workers on ``intra_gbps`` links (two levels)."""
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
    raise ValueError(f"workers must be an int >= 2, got workers={workers!r}")
  if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1 or workers % per_node:
    raise ValueError(f"per_node must be an int >= 1 that divides workers={workers},"
                     f" got per_node={per_node!r}")
  gbps = positive_number("gbps", gbps)
  latency = positive_number("latency_us", latency_us) * 1e-6 if latency_us else 0.0
  if per_node == 1:
    return netsim.flat(workers, gbps, latency)
  intra = positive_number("intra_gbps", intra_gbps)
  return netsim.two_level(workers, per_node, gbps, intra, latency, latency)


def advise(params: Any, gbps: float, workers: int, compute_s: float, *, latency_us: float = 10.0,
           per_node: int = 1, intra_gbps: float = 400.0, overlap: bool = False, optimizer: str = "sgd",
           kernels: str | dict = "kernels_h200.json",
           fidelity: str | dict = "fidelity.json", methods: Sequence[str] | None = None,
           diloco: Sequence[int] = DILOCO_H) -> list[Row]:
  """Every method (and DiLoCo every ``H`` of ``diloco``) on ``params``, fastest predicted step first.

  ``params``: the gradient tree (arrays or ``jax.ShapeDtypeStruct``); ``gbps``:
  each worker's link in Gb/s (with ``per_node`` > 1: each node's link between nodes, its workers
  joined by ``intra_gbps`` links: a two-level network); ``workers``: N; ``compute_s``: forward and
  backward seconds per step; ``optimizer``: ``"sgd"`` or ``"adamw"``, whose recipes
  (``jaxcomp.recipe``) give the bytes and whose suite runs the fidelity; ``kernels``: a
  ``python -m jaxcomp.bench kernels --json`` file (or its dict) measured on the device that will
  train (the methods at the kernel benchmark's settings, not the recipes'); a method it has no
  row for is left out (:func:`unmeasured`), never priced at no cost.
  """
  from jaxcomp.registry import METHODS

  net = network(workers, gbps, latency_us, per_node, intra_gbps)
  compute_s = positive_number("compute_s", compute_s)
  if optimizer not in ("sgd", "adamw"):
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got optimizer={optimizer!r}")
  names = list(METHODS) if methods is None else list(methods)
  for n in names:
    if n not in METHODS:
      raise ValueError(f"methods: unknown method {n!r}; choose from {sorted(METHODS)}")
  names = ["none"] + [n for n in names if n != "none"]  # dense float32, the reference, always ranked
  cost = per_value_seconds(load_json(kernels) if isinstance(kernels, str) else kernels)
  names = [n for n in names if n == "none" or n in cost]  # a method the table lacks is not priced at 0
  fid = (load_json(fidelity) if isinstance(fidelity, str) else fidelity)["methods"]
  nvalues = value_count(params)
  traffic = {n: method_traffic(n, params, workers, optimizer) for n in set(names) | {"none"}}
  dense_comm = netsim.communication_time(traffic["none"], net)
  parts = {n: (netsim.communication_time(traffic[n], net), cost.get(n, 0.0) * nvalues,
               sum(b for _, b in traffic[n]), _fid(fid, n, optimizer))
           for n in names}
  for h in diloco:
    parts[f"diloco H={h}"] = (dense_comm / h, 0.0, sum(b for _, b in traffic["none"]) / h, {})
  dense = netsim.step_time(compute_s, 0.0, dense_comm, overlap).total
  rows = []
  for name, (comm, comp, nbytes, f) in parts.items():
    step = netsim.step_time(compute_s, comp, comm, overlap).total
    rows.append(Row(name, nbytes, comm, comp, step, dense / step, f))
  return sorted(rows, key=lambda r: (r.step, r.method))


def _fid(fid: dict, name: str, optimizer: str) -> dict:
  return {o: tuple(v) for o, v in fid.get(name, {}).items() if o == optimizer}


def pass_rate(row: Row) -> float | None:
  """Share of the suite's runs (both optimizers) in which the method met its target; None for DiLoCo.

  Dense float32 (``none``) is the suite's reference: 1."""
  if row.method == "none":
    return 1.0
  runs = sum(v[1] for v in row.fidelity.values())
  return None if not runs else sum(v[0] for v in row.fidelity.values()) / runs
