"""Which collectives of a compiled program read which of its inputs: a dataflow pass over HLO text.

:func:`collectives_reading` answers, for every collective instruction of a
compiled module (``jax.jit(f).lower(...).compile().as_text()``, pmap's as
well), whether its operands depend on chosen parameters of the entry
computation, following values through tuples, fusions, calls, conditionals
(each branch sees its own operand) and while loops (to a fixed point); a
collective in a branch picked, or a loop whose trip count is decided, from
those parameters reads them too (it cannot start before them). It is
how the tests prove Streaming DiLoCo's overlap (``jaxcomp.diloco(...,
delay=1)``): in a whole training step the sync's collective reads the
parameters and the state but not the batch, so it does not wait for the
forward and backward pass.

The pass is conservative where it cannot see structure: an instruction it
does not model reads all of its operands, a tuple it cannot split depends on
all of them, an operand it cannot name or a loop without a fixed point reads
everything, and XLA's scheduling edges (``control-predecessors``) count as
operands; so "independent" holds of the data flow, "dependent" may be an
over-approximation. It is a statement about data dependencies, not about the
schedule: whether a backend runs an independent collective beside other work
is its scheduler's choice.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Tuple

COLLECTIVES = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
                         r"|collective-broadcast|ragged-all-to-all)(-start)?$")
_LEAVES = ("parameter", "constant", "iota", "partition-id", "replica-id", "after-all",
           "rng-get-and-update-state")  # instructions with no operands
_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_NAME = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = ")


def _balanced(text: str, start: int) -> int:
  """The index just past the parenthesis closing the one at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] == "(":
      depth += 1
    elif text[i] == ")":
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced parentheses in HLO line: {text!r}")


def _instruction(line: str):
  """``(name, opcode, operand names, attributes, is_root, shape)`` of one instruction line, or None.

  A parameter's one "operand" is its index.
  """
  m = _NAME.match(line)
  if not m:
    return None
  pos = m.end()
  if line[pos] == "(":  # a tuple shape
    pos = _balanced(line, pos)
  else:
    pos = line.index(" ", pos)
  shape = line[m.end():pos]
  op = re.match(r"\s*([\w\-]+)\(", line[pos:])
  if not op:
    return None
  open_at = pos + op.end() - 1
  close = _balanced(line, open_at)
  inside = line[open_at + 1:close - 1]
  operands = [inside.strip()] if op.group(1) == "parameter" else re.findall(r"%([\w.\-]+)", inside)
  if op.group(1) not in _LEAVES and inside.strip() and not operands:
    operands = [None]  # operands this parser cannot name: read as depending on everything
  # scheduling edges XLA adds (async collectives, send/recv) order an instruction like its operands
  operands += re.findall(r"%([\w.\-]+)", _braces(line[close:], "control-predecessors"))
  return m.group(2), op.group(1), operands, line[close:], bool(m.group(1)), shape


def _braces(attrs: str, key: str) -> str:
  m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
  return m.group(1) if m else ""


def parse(hlo: str) -> Tuple[Dict[str, list], str]:
  """The module's computations (name -> instructions in order) and the entry computation's name."""
  comps, entry, name = {}, None, None
  for line in hlo.splitlines():
    head = _HEAD.match(line)
    if head and not line.startswith(" "):
      name = head.group(2)
      comps[name] = []
      if head.group(1):
        entry = name
    elif line.startswith("}"):
      name = None
    elif name is not None:
      inst = _instruction(line)
      if inst:
        comps[name].append(inst)
  if entry is None:
    raise ValueError("no ENTRY computation in this HLO text")
  return comps, entry


def _any(d) -> bool:
  return any(_any(x) for x in d) if isinstance(d, tuple) else bool(d)


def _join(a, b):
  if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
    return tuple(_join(x, y) for x, y in zip(a, b))
  return _any(a) or _any(b)


def _called(attrs: str, key: str) -> List[str]:
  m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", attrs)
  return re.findall(r"%?([\w.\-]+)", m.group(1).strip("{}")) if m else []


class _Flow:
  def __init__(self, comps):
    self.comps, self.memo, self.hits = comps, {}, {}

  def run(self, comp: str, params):
    key = (comp, repr(params))
    if key not in self.memo:
      self.memo[key] = True  # a recursion guard (HLO computations do not recurse): conservative
      self.memo[key] = self._eval(comp, params)
    return self.memo[key]

  def _eval(self, comp: str, params):
    """The dependence of ``comp``'s root; ``params``: a tuple (one per parameter) or one bool for all."""
    deps, root = {}, None
    for name, op, operands, attrs, is_root, _ in self.comps.get(comp, []):
      if op == "parameter":
        k = int(operands[0])
        d = params if isinstance(params, bool) else params[k] if k < len(params) else True
        deps[name] = d
        root = d if is_root else root
        continue
      ins = [deps.get(o, True) for o in operands]  # a name not seen: read as dependent
      if op == "tuple":
        d = tuple(ins)
      elif op == "get-tuple-element":
        i = int(re.search(r"index=(\d+)", attrs).group(1))
        d = ins[0][i] if isinstance(ins[0], tuple) and i < len(ins[0]) else _any(ins[0])
      elif op == "conditional":
        branches = _called(attrs, "branch_computations") or (
            _called(attrs, "true_computation") + _called(attrs, "false_computation"))
        control = _any(ins[0])  # a branch picked from the sources: everything in it waits for them
        d = None
        for k, b in enumerate(branches):
          r = self.run(b, (True,) if control else (ins[k + 1],) if k + 1 < len(ins) else ())
          d = r if d is None else _join(d, r)
        if control or d is None:
          d = _any(ins)
      elif op == "while":
        body, cond = _called(attrs, "body"), _called(attrs, "condition")
        d = ins[0] if ins else False
        for _ in range(256):
          nd = _join(d, self.run(body[0], (d,)))
          if nd == d:
            break
          d = nd
        else:  # no fixed point reached: everything the loop carries reads everything
          d = self.run(body[0], (True,)) or True
        if _any(self.run(cond[0], (d,))):  # a trip count from the sources: the body waits for them
          self.run(body[0], (True,))
          d = True
      elif op in ("fusion", "call"):
        d = self.run((_called(attrs, "calls") or _called(attrs, "to_apply"))[0], tuple(ins))
      elif op == "async-start" and _called(attrs, "calls"):  # ((operands), result, context)
        d = (tuple(ins), self.run(_called(attrs, "calls")[0], tuple(ins)), _any(ins))
      else:
        d = any(_any(x) for x in ins)
        for c in _called(attrs, "called_computations") + _called(attrs, "to_apply"):
          self.run(c, d)  # e.g. a custom call's computations: each parameter reads all operands
        if COLLECTIVES.match(op):
          self.hits[name] = self.hits.get(name, False) or d
      deps[name] = d
      if is_root:
        root = d
    return root if root is not None else False


def collectives_reading(hlo: str, sources: Iterable[int]) -> Dict[str, bool]:
  """Every collective of the compiled module ``hlo``: does it read the entry parameters ``sources``?

  Args:
    hlo: a compiled module's text (``.compile().as_text()``).
    sources: indices of the entry computation's parameters (``parameter(i)``).

  Returns:
    ``{instruction name: bool}`` for each collective instruction (``all-reduce``, ``all-gather``,
    ``reduce-scatter``, ``all-to-all``, ``collective-permute``, their ``-start`` forms) reached from
    the entry computation: True where one of its operands depends on a parameter in ``sources``.
  """
  comps, entry = parse(hlo)
  flow = _Flow(comps)
  wanted = set(sources)
  n = 1 + max([-1] + [int(i[2][0]) for i in comps[entry] if i[1] == "parameter"])
  flow.run(entry, tuple(i in wanted for i in range(n)))
  return dict(flow.hits)


def entry_parameters(hlo: str) -> List[Tuple[int, str]]:
  """The entry computation's parameters as ``(index, shape text)``, in index order."""
  comps, entry = parse(hlo)
  return sorted((int(i[2][0]), i[5]) for i in comps[entry] if i[1] == "parameter")


