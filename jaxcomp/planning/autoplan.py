"""``jaxcomp.auto``: the recipe whose predicted step is fastest on a given network, never slower than dense.

:func:`auto_plan` prices, with :func:`jaxcomp.advise`'s model (bytes from the
bucket layout, the ring alpha-beta network, kernel times measured on a device),
every method's recipe as it is, each with the leaves it does not pay to
compress sent dense (the ``dense=`` build option), and with
``transport="scatter"`` where the method gathers; and dense float32. It keeps
the fastest, so its predicted step is never slower than dense's and never
slower than the best single method's. A leaf travels dense when its float32
all-reduce costs less than its compressed payload's collective plus its share
of the compression time (each leaf priced alone, by its shape). Only recipes
that met their target in at least ``min_pass_rate`` (0.9) of the suite's runs
for ``optimizer`` are candidates. :func:`auto` returns the chosen recipe's optax
transformation (``jaxcomp.recipe``) and prints the plan.

The prediction's limits are :func:`jaxcomp.advise`'s: compression times from one
device's kernel table at the kernel benchmark's settings, a gathered or
scattered method's decodes of the other workers' payloads not priced, and a
flat network of equal links.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`auto_plan` chose and why: the method, its settings, the predicted steps (seconds)."""

  method: str  # "none": dense float32 was fastest
  settings: dict  # the recipe's extra build options: ``transport``, ``dense`` (a bool per leaf)
  dense_leaves: tuple  # paths of the leaves sent dense by the plan's mask
  step: float
  dense_step: float
  network: str
  candidates: tuple  # (label, predicted step seconds), fastest first
  transform: Any = dataclasses.field(repr=False, compare=False, default=None)

  @property
  def speedup(self) -> float:
    return self.dense_step / self.step

  def __str__(self) -> str:
    head = (f"jaxcomp.auto on {self.network}: {self.method!r}"
            + (f" with transport={self.settings['transport']!r}" if "transport" in self.settings else "")
            + (f", {len(self.dense_leaves)} leaves dense ({', '.join(self.dense_leaves[:4])}"
               f"{', ...' if len(self.dense_leaves) > 4 else ''})" if self.dense_leaves else "")
            + f": predicted step {self.step * 1e3:.2f} ms, {self.speedup:.2f}x dense float32's"
            f" {self.dense_step * 1e3:.2f} ms")
    rows = "\n".join(f"  {label:<34} {s * 1e3:10.2f} ms" for label, s in self.candidates[:8])
    return f"{head}\ncandidates, fastest first:\n{rows}"


def _leaf_costs(name: str, optimizer: str, settings: dict, leaves: Sequence[Any], net, per_value: float,
                workers: int) -> list[bool]:
  """For each leaf: True where its dense all-reduce costs less than compressing it (priced alone)."""
  import jax

  from jaxcomp.planning import advise as adv
  from jaxcomp.planning import netsim

  @functools.lru_cache(maxsize=None)
  def dense_wins(shape: tuple) -> bool:
    one = {"x": jax.ShapeDtypeStruct(shape, "float32")}
    try:
      comp = netsim.communication_time(adv.method_traffic(name, one, workers, optimizer, **settings), net)
    except ValueError:  # no bucket of this shape to price alone: keep the method's own choice
      return False
    n = 1
    for d in shape:
      n *= d
    dense = netsim.communication_time([("all-reduce", 4.0 * n)], net)
    return dense <= comp + per_value * n

  return [dense_wins(tuple(x.shape)) for x in leaves]


def _candidates(names: Sequence[str], optimizer: str):
  """(label, method, settings) of every recipe to price: as it is, and with the scatter transport."""
  import inspect

  from jaxcomp.registry import METHODS

  for n in names:
    yield n, n, {}
    if n != "none" and "transport" in inspect.signature(METHODS[n]).parameters:
      yield f"{n} transport=scatter", n, {"transport": "scatter"}


def _price(name, settings, params, workers, optimizer, net, compute_s, cost, overlap):
  import jax

  from jaxcomp.planning import advise as adv
  from jaxcomp.planning import netsim

  traffic = adv.method_traffic(name, params, workers, optimizer, **settings)
  comm = netsim.communication_time(traffic, net)
  values = adv.value_count(params)
  if "dense" in settings:  # the leaves sent dense are not compressed
    mask = jax.tree_util.tree_leaves(settings["dense"])
    values -= sum(adv.value_count(x) for x, m in zip(jax.tree_util.tree_leaves(params), mask) if m)
  return netsim.step_time(compute_s, cost.get(name, 0.0) * values, comm, overlap).total


def auto_plan(params: Any, gbps: float, workers: int, compute_s: float, *, optimizer: str = "sgd",
              latency_us: float = 10.0, per_node: int = 1, intra_gbps: float = 400.0,
              overlap: bool = False, methods: Sequence[str] | None = None,
              min_pass_rate: float = 0.9, kernels: str | dict = "kernels_h200.json",
              learning_rate: float = 0.1, axis_name: Any = "data", **recipe_kwargs) -> Plan:
  """The :class:`Plan` of :func:`auto`; ``plan.transform`` is the chosen recipe."""
  import jax

  from jaxcomp.planning import advise as adv
  from jaxcomp.training.recipes import recipe

  rows = adv.advise(params, gbps, workers, compute_s, latency_us=latency_us, per_node=per_node,
                    intra_gbps=intra_gbps, overlap=overlap,
                    optimizer=optimizer, kernels=kernels, methods=methods, diloco=())
  if not 0.0 <= min_pass_rate <= 1.0:
    raise ValueError(f"min_pass_rate must be in [0, 1], got min_pass_rate={min_pass_rate!r}")
  names = [r.method for r in rows if adv.pass_rate(r) is not None and adv.pass_rate(r) >= min_pass_rate]
  cost = adv.per_value_seconds(adv.load_json(kernels) if isinstance(kernels, str) else kernels)
  net = adv.network(workers, gbps, latency_us, per_node, intra_gbps)
  flat_net = adv.network(workers, gbps, 0.0, per_node, intra_gbps)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  priced = []
  for label, name, settings in _candidates(names, optimizer):
    variants = [(label, dict(settings))]
    if name != "none":
      mask = _leaf_costs(name, optimizer, settings, leaves, flat_net, cost.get(name, 0.0), workers)
      if any(mask) and not all(mask):
        variants.append((f"{label} +dense leaves", {**settings, "dense": treedef.unflatten(mask)}))
    for lab, st in variants:
      try:
        priced.append((_price(name, st, params, workers, optimizer, net, compute_s, cost, overlap),
                       lab, name, st))
      except (ValueError, TypeError):  # a build this method does not take (a transport, a mask)
        continue
  priced.sort(key=lambda p: (p[0], p[1]))
  step, _, name, settings = priced[0]
  dense_step = next(p[0] for p in priced if p[1] == "none")
  mask = jax.tree_util.tree_leaves(settings["dense"]) if "dense" in settings else []
  tx = recipe(name, learning_rate, axis_name, optimizer=optimizer, **settings, **recipe_kwargs)
  return Plan(name, settings, tuple(p for p, m in zip(paths, mask) if m), step, dense_step,
              f"{workers} workers at {gbps:g} Gb/s" + (f" between nodes of {per_node} ({intra_gbps:g} Gb/s"
                                                         " inside)" if per_node > 1 else "")
              + f", {latency_us:g} us per message",
              tuple((p[1], p[0]) for p in priced), tx)


def auto(params: Any, learning_rate: float, axis_name: Any, *, gbps: float, workers: int, compute_s: float,
         verbose: bool = True, **kwargs):
  """The recipe (``jaxcomp.recipe``) with the fastest predicted step on this network, never slower than
  dense; prints the plan (``verbose``). ``kwargs``: :func:`auto_plan`'s (``optimizer``, ``latency_us``,
  ``methods``, ``min_pass_rate``, ``kernels``...) and the recipe's."""
  plan = auto_plan(params, gbps, workers, compute_s, learning_rate=learning_rate, axis_name=axis_name,
                   **kwargs)
  if verbose:
    print(plan)
  return plan.transform
