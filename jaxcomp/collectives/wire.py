"""Wire accounting: the bytes that a compiled program's collectives move.

``collective_bytes`` reads an optimized HLO module (the text of
``jax.jit(f).lower(...).compile().as_text()``, or of a pmapped function) and
sums, per collective, the bytes that one participant contributes: the operand
of an all-reduce, all-gather, reduce-scatter, all-to-all or
collective-permute. Compiled HLO prints operands by name only, so operand
bytes are derived from the result shape and the replica-group size, both read
by :mod:`jaxcomp.collectives.hlo` (every replica-group form XLA prints).
"""

from __future__ import annotations

from typing import Any, Callable, Dict

from jaxcomp.collectives import hlo

_OPS = hlo.KINDS


def received_bytes(kind: str, nbytes: float, group: int) -> float:
  """Bytes one worker receives for a collective to which it hands ``nbytes``, run as a ring of ``group``.

  All-reduce: ``2 (g - 1) / g`` of its buffer (reduce-scatter, then
  all-gather); all-gather: the ``g - 1`` other contributions; all-to-all and
  reduce-scatter: ``(g - 1) / g`` of the operand; collective-permute: all of it.
  """
  if kind not in _OPS:
    raise ValueError(f"kind must be one of {_OPS}, got kind={kind!r}")
  g = int(group)
  if g <= 1:
    return 0.0
  if kind == "all-reduce":
    return 2.0 * (g - 1) / g * nbytes
  if kind == "all-gather":
    return float((g - 1) * nbytes)
  if kind in ("all-to-all", "reduce-scatter"):
    return (g - 1) / g * nbytes
  return float(nbytes)


def collective_bytes(hlo_text: str) -> Dict[str, Any]:
  """Bytes per participant moved by each kind of collective in ``hlo_text``.

  Returns a dict with one entry per collective kind (bytes), ``"total"`` and
  ``"count"`` (collectives run: an instruction in a loop of n trips counts n), ``"received"`` (the
  bytes each worker receives when every collective runs as a ring, see
  :func:`received_bytes`), and ``"by_group_size"``
  (bytes per replica-group size: on a mesh of two axes of different sizes,
  the bytes per axis). All-reduce: its buffer;
  all-gather: the result divided by the group size (what each worker sends);
  reduce-scatter: the result times the group size; the others: their result.
  ``-start`` / ``-done`` pairs are counted once.
  """
  out: Dict[str, Any] = {op: 0 for op in _OPS}
  by_group: Dict[int, float] = {}
  found = hlo.collectives(hlo_text)
  received = 0.0
  for c in found:
    nbytes, g = c.sent_bytes, c.group_size
    out[c.kind] += nbytes
    received += received_bytes(c.kind, nbytes, g)
    by_group[g] = by_group.get(g, 0) + nbytes
  count = sum(c.repeat for c in found)  # runs: a collective in a loop of n trips counts n
  out = {k: int(v) for k, v in out.items()}
  out["total"] = sum(out[op] for op in _OPS)
  out["count"] = count
  out["received"] = int(round(received))
  out["by_group_size"] = {g: int(v) for g, v in sorted(by_group.items())}
  return out


def measure_wire_bytes(fn: Callable, *args, **kwargs) -> Dict[str, Any]:
  """Compiles ``fn`` (a jitted or pmapped function) on ``args`` and measures its collectives.

  ``fn`` must have ``.lower`` (``jax.jit(...)``, ``jax.pmap(...)``).
  """
  if not hasattr(fn, "lower"):
    raise TypeError("fn must be jitted or pmapped (it needs .lower); got"
                    f" fn={fn!r}")
  return collective_bytes(fn.lower(*args, **kwargs).compile().as_text())
