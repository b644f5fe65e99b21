"""The one reader of compiled programs: every collective instruction of an HLO module's text.

``collectives(text)`` finds each all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute (an async ``-start`` counted once, its
``-done`` not at all) and reads its result shape and its replica groups in
every form XLA prints them:

- explicit lists: ``replica_groups={{0,1,2,3},{4,5,6,7}}`` (``{}``: every
  participant, read from the module's ``replica_count`` / ``num_partitions``);
- iota lists: ``replica_groups=[2,4]<=[8]`` or ``[4,2]<=[2,4]T(1,0)``: the
  ids ``0..n-1`` reshaped to the dims in ``<=[...]``, transposed by ``T(...)``,
  then read as ``[groups, size]``;
- mesh axes (jax 0.12's XLA): ``replica_groups=mesh['a'=2,'b'=4] {'b'}``, with
  an optional ``, device_ids=(...)`` after the mesh and sub-axes written
  ``'a':(pre)size``: the devices laid out on the mesh, the named axes moved
  last, then read as ``[groups, size]``.

A group's members are the ids XLA's collective-op group mode gives them
(replica ids, partition ids, or flattened ids with ``use_global_device_ids``);
where the mode is cross-replica-and-partition each listed group spans all
partitions too, so its size is the list's length times ``num_partitions``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Tuple

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
    "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5,
}

_SHAPE = r"\((?:[^()]|\([^()]*\))*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?"
_INSTR = re.compile(
    r"%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>" + _SHAPE + r")\s+"
    r"(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([0-9]+),([0-9]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(r"replica_groups=(maximal_)?mesh\[([^\]]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_HEADER_INT = r"\b{}=([0-9]+)"


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program.

  Attributes:
    kind: one of :data:`KINDS`.
    name: the instruction's name in the module.
    result_bytes: the bytes of each array of its result (of an async start:
      of the results alone, not the operands it carries).
    groups: the participants of each group, ``[groups, size]`` (int), or None
      where the instruction names no groups (collective-permute, whose
      ``source_target_pairs`` are pairs, not groups).
    op_name: the JAX operation it came from (the metadata's ``op_name``), or "".
    line: the instruction's text.
    repeat: how many times one run of the program runs it: the product of the
      known trip counts of the while loops around it (``lax.map`` over
      buckets), 1 outside loops.
  """

  kind: str
  name: str
  result_bytes: Tuple[float, ...]
  groups: Optional[np.ndarray]
  op_name: str
  line: str
  repeat: int = 1

  @property
  def group_size(self) -> int:
    """Participants per group (1 where the instruction names no groups)."""
    return 1 if self.groups is None else int(self.groups.shape[1])

  @property
  def sent_bytes(self) -> float:
    """Bytes one participant hands to it in one run of the program (all :attr:`repeat` runs of it):
    an all-reduce's buffer, an all-gather's result over the group size, a reduce-scatter's result
    times it; the others, their result."""
    return self.repeat * self.once_bytes

  @property
  def once_bytes(self) -> float:
    """:attr:`sent_bytes` of one run of the instruction."""
    nbytes = float(sum(self.result_bytes))
    if self.kind == "all-gather":
      return nbytes / self.group_size
    if self.kind == "reduce-scatter":
      return nbytes * self.group_size
    return nbytes


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"\}')
_CALLS = re.compile(r"\b(?:body|condition|calls|to_apply|branch_computations|true_computation"
                    r"|false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")


def repeats(text: str) -> dict:
  """How many times one run of the module runs each computation: ``{name: count}``.

  A while loop's body counts its known trip count (XLA's ``known_trip_count``,
  which ``lax.map`` and ``lax.scan`` loops carry) times its caller's count;
  every other called computation its caller's. A loop without a known trip
  count counts once. Empty for a text without an ENTRY computation.
  """
  calls: dict = {}
  entry, name = None, None
  for line in text.splitlines():
    head = _COMPUTATION.match(line)
    if head and not line.startswith(" "):
      name = head.group(1)
      calls.setdefault(name, [])
      entry = name if line.startswith("ENTRY") else entry
    elif line.startswith("}"):
      name = None
    elif name is not None:
      trip = _TRIP.search(line)
      for key_value in _CALLS.finditer(line):
        factor = int(trip.group(1)) if trip and key_value.group(0).startswith("body=") else 1
        for callee in re.findall(r"%?([\w.\-]+)", key_value.group(1).strip("{}")):
          calls[name].append((callee, factor))
  if entry is None:
    return {}
  count: dict = {}

  def visit(comp: str, times: int, depth: int = 0) -> None:
    count[comp] = count.get(comp, 0) + times
    if depth < 64:  # HLO computations do not recurse
      for callee, factor in calls.get(comp, []):
        visit(callee, times * factor, depth + 1)

  visit(entry, 1)
  return count


def collectives(text: str) -> List[Collective]:
  """Every collective instruction of an HLO module's text (or of some of its lines), in order,
  each with how many times one run of the module runs it (:func:`repeats`)."""
  header = _module_header(text)
  counts = repeats(text)
  out, comp = [], None
  for line in text.splitlines():
    head = _COMPUTATION.match(line)
    if head and not line.startswith(" "):
      comp = head.group(1)
    m = _INSTR.search(line)
    if not m:
      continue
    kind = m.group("kind")
    sizes = array_bytes(m.group("shape"))
    if m.group("start") and kind in ("all-gather", "collective-permute") and len(sizes) > 1:
      sizes = sizes[len(sizes) // 2:]  # (operands..., results...)
    groups = None if kind == "collective-permute" else replica_groups(line, header)
    op = _OP_NAME.search(line)
    out.append(Collective(kind, m.group("name"), tuple(sizes), groups, op.group(1) if op else "", line,
                          max(1, counts.get(comp, 1)) if counts else 1))
  return out


def runs(text: str) -> List[Tuple[str, int]]:
  """One ``(kind, bytes per worker)`` entry per run of a collective instruction of an HLO module
  (one per trip of a loop around it): the traffic :mod:`jaxcomp.planning.netsim` prices."""
  return [(c.kind, int(c.once_bytes)) for c in collectives(text) for _ in range(c.repeat)]


def array_bytes(shape: str) -> List[float]:
  """The bytes of each array in an HLO shape (``f32[8,4]{1,0}`` or a tuple of them)."""
  out = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in DTYPE_BYTES:
      out.append(int(np.prod([int(d) for d in dims.split(",") if d])) * DTYPE_BYTES[dtype])
  return out


def replica_groups(line: str, header: Optional[dict] = None) -> np.ndarray:
  """The replica groups of one collective instruction, ``[groups, size]``, in any printed form.

  ``header``: the module's ``replica_count`` and ``num_partitions`` (from
  :func:`collectives`); without it, an empty or missing group list counts as
  one group of one.
  """
  header = header or {}
  m = _MESH.search(line)
  if m:
    return _mesh_groups(line, m)
  m = _IOTA.search(line)
  if m:
    ids = _iota(m.group(3), m.group(4))
    return ids.reshape(int(m.group(1)), int(m.group(2)))
  m = _LIST.search(line)
  lists = [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))] if m else []
  lists = [g for g in lists if g]
  has_channel = "channel_id=" in line
  global_ids = re.search(r"use_global_device_ids=(true|false)", line)
  replicas, partitions = header.get("replica_count", 1), header.get("num_partitions", 1)
  if not lists:  # every participant of the mode
    everyone = partitions if (has_channel and global_ids is None) else replicas
    if has_channel and global_ids is not None and global_ids.group(1) == "false":
      everyone = replicas * partitions
    return np.arange(max(everyone, 1)).reshape(1, -1)
  if len({len(g) for g in lists}) != 1:
    raise ValueError(f"replica groups of different sizes in: {line.strip()[:200]}")
  groups = np.array(lists, dtype=np.int64)
  if has_channel and global_ids is not None and global_ids.group(1) == "false" and partitions > 1:
    # cross-replica-and-partition: each replica group spans every partition (flattened ids)
    groups = (groups[:, :, None] * partitions + np.arange(partitions)).reshape(len(lists), -1)
  return groups


def _iota(dims: str, perm: Optional[str]) -> np.ndarray:
  shape = [int(d) for d in dims.split(",")]
  ids = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
  return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _mesh_groups(line: str, m: re.Match) -> np.ndarray:
  """Groups of the ``mesh[...] {...}`` form: the mesh's device ids with the grouped axes moved last."""
  rest = line[m.end():]
  if m.group(1):  # maximal_mesh[device_id=N]: one device
    return np.array([[int(re.search(r"[0-9]+", m.group(2)).group())]], dtype=np.int64)
  names, sizes = [], []
  for item in m.group(2).split(","):
    name, size = item.rsplit("=", 1)
    names.append(_unquote(name))
    sizes.append(int(size))
  devices = np.arange(int(np.prod(sizes)), dtype=np.int64)
  if rest.startswith(", device_ids=("):
    body, rest = _balanced(rest[len(", device_ids="):])
    # a tile assignment: "[dims]<=[reshape]T(perm)", "[reshape]T(perm)" (jax 0.10's XLA), or the ids
    iota = re.fullmatch(r"\[([0-9,]+)\](?:<=\[([0-9,]+)\])?(?:T\(([0-9,]+)\))?", body.strip())
    if iota:
      devices = _iota(iota.group(2) or iota.group(1), iota.group(3))
    else:
      devices = np.array(re.findall(r"[0-9]+", body), np.int64)
    if devices.size != int(np.prod(sizes)):
      raise ValueError(f"mesh {m.group(0)} with device_ids=({body}): {devices.size} ids for"
                       f" {int(np.prod(sizes))} devices")
  devices = devices.reshape(sizes)
  axes = re.match(r"\s*\{([^}]*)\}", rest)
  if axes is None:
    raise ValueError(f"a mesh replica group without its axes in: {line.strip()[:200]}")
  by_dim: dict = {}
  for ref in filter(None, (a.strip() for a in _split_axes(axes.group(1)))):
    sub = re.fullmatch(r"(.*):\(([0-9]+)\)([0-9]+)", ref)
    name = _unquote(sub.group(1) if sub else ref)
    if name not in names:
      raise ValueError(f"mesh axis {name!r} is not one of {names} in: {line.strip()[:200]}")
    by_dim.setdefault(names.index(name), []).append((int(sub.group(2)), int(sub.group(3))) if sub else None)
  dims, grouped = [], []
  for d, size in enumerate(sizes):
    refs = by_dim.get(d)
    if not refs:
      dims.append(size)
    elif refs == [None]:
      grouped.append(len(dims))
      dims.append(size)
    else:
      grouped += _split_dim(size, refs, dims)
  ids = devices.reshape(dims).transpose([i for i in range(len(dims)) if i not in grouped] + grouped)
  size = int(np.prod([dims[i] for i in grouped])) if grouped else 1
  return ids.reshape(-1, size)


def _split_dim(size: int, refs: list, dims: list) -> list:
  """Appends one mesh dim split into its sub-axes ``(pre, size)`` to ``dims``; returns the grouped
  indices (in the order the sub-axes were named)."""
  if any(r is None for r in refs):
    raise ValueError(f"a whole mesh axis and its sub-axes in one group: {refs}")
  order = sorted(range(len(refs)), key=lambda i: refs[i][0])
  index, prefix = {}, 1
  for i in order:
    pre, sub = refs[i]
    if pre != prefix:
      dims.append(pre // prefix)
      prefix = pre
    index[i] = len(dims)
    dims.append(sub)
    prefix *= sub
  if prefix != size:
    dims.append(size // prefix)
  return [index[i] for i in range(len(refs))]


def _split_axes(text: str) -> list:
  """Axis refs split at commas outside quotes and parentheses."""
  out, depth, quote, cur = [], 0, None, ""
  for ch in text:
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch == "(":
      depth += 1
    elif ch == ")":
      depth -= 1
    elif ch == "," and depth == 0:
      out.append(cur)
      cur = ""
      continue
    cur += ch
  return out + [cur]


def _balanced(text: str) -> Tuple[str, str]:
  """``(inside, rest)`` of a text that starts with a parenthesis."""
  depth = 0
  for i, ch in enumerate(text):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return text[1:i], text[i + 1:]
  raise ValueError(f"unbalanced parentheses in: {text[:200]}")


def _unquote(name: str) -> str:
  name = name.strip()
  return name[1:-1] if len(name) > 1 and name[0] == name[-1] and name[0] in "'\"" else name


def _module_header(text: str) -> dict:
  line = next((ln for ln in text.splitlines() if ln.startswith("HloModule")), "")
  out = {}
  for key in ("replica_count", "num_partitions"):
    m = re.search(_HEADER_INT.format(key), line)
    if m:
      out[key] = int(m.group(1))
  return out


def bytes_by_axes(text: str, mesh) -> dict:
  """Bytes one device hands to collectives, summed per tuple of the mesh axes their groups span.

  ``mesh``: the ``jax.sharding.Mesh`` the program was compiled for (its
  device ids in the program are positions in ``mesh.devices``, flattened).
  A group spans an axis where its members' coordinates on it differ; a
  collective-permute counts under the axes its whole mesh spans.
  """
  shape, out = mesh.devices.shape, {}
  for c in collectives(text):
    group = np.arange(mesh.devices.size) if c.groups is None else c.groups[0]
    coords = np.array(np.unravel_index(group, shape))
    axes = tuple(a for a, col in zip(mesh.axis_names, coords) if len(set(col.tolist())) > 1)
    out[axes] = out.get(axes, 0) + int(c.sent_bytes)
  return out
