"""One loop over a method's buckets: a codec's encode compiled once for every bucket of a group.

Every bucket of a model has its own length and segment layout, and a codec built on static
:class:`~jaxcomp.core.layout.Segments` compiles kernels of its own for each: a method's compile
time grows with its number of buckets (docs/benchmarks.md, "One program per method"). A codec
that can read its per-segment sizes as data (a :class:`LoopCodec`) has the buckets of
one key and of similar lengths (:func:`groups`) zero-padded to the longest, stacked, and encoded
by one loop (:func:`exchange_stacked`), its tables as arrays
(:mod:`jaxcomp.core.tables`). Each bucket's payload is then cut to its own shapes, so the
collectives, the bytes on the wire and the decode are those of the bucket alone.
"""

from __future__ import annotations

import abc
from typing import Any, List, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.collectives import ops
from jaxcomp.collectives.axis import Axis
from jaxcomp.core import tables


class LoopCodec(abc.ABC):
  """A mixin for a :class:`~jaxcomp.core.protocol.Codec` whose buckets may be encoded by one loop.

  Buckets of one :meth:`group_key` (None: this bucket alone) run from :meth:`group_tables`
  through :meth:`encode_table` and :meth:`cut`; :meth:`sent_table` gives what each sent.
  """

  @abc.abstractmethod
  def group_key(self, segs) -> Any:
    """None, or a key: buckets of one key may share one loop."""

  @abc.abstractmethod
  def group_tables(self, segments: list) -> list:
    """Each bucket's tables for :meth:`encode_table`: pytrees of one structure and shape for the group."""

  @abc.abstractmethod
  def encode_table(self, x: jax.Array, key: jax.Array, table: Any) -> Any:
    """The payload of a bucket padded to the group's length (its entries past the bucket's end are
    zeros in a segment of their own), by its ``table``, at the group's shapes: its :meth:`cut`
    is the bucket's own ``encode``."""

  @abc.abstractmethod
  def cut(self, payload: Any, segs) -> Any:
    """A payload of :meth:`encode_table` at the bucket's own shapes."""

  def sent_table(self, x: jax.Array, payload: Any, key: jax.Array, segs) -> jax.Array:
    """The codec's ``sent`` from a payload of :meth:`encode_table` (by default its :meth:`cut`)."""
    return self.sent(x, self.cut(payload, segs), key, segs)


SLACK = 2
"""A bucket joins a group when the group's longest is at most ``SLACK`` times its length: the
padding costs each loop step at most that factor of the bucket's own work."""


def groups(codec: Any, segments: Sequence[Any]) -> List[List[int]]:
  """The buckets (indices into ``segments``) that run as one loop; a bucket alone runs as before.

  Buckets of one ``codec.group_key`` (a :class:`LoopCodec`'s) are taken longest first; each
  starts a group or joins the current one while the group's longest is at most :data:`SLACK`
  times its length.
  """
  if codec.linear or not isinstance(codec, LoopCodec):
    return [[i] for i in range(len(segments))]
  by_key: dict = {}
  out: List[List[int]] = []
  for i, segs in enumerate(segments):
    key = codec.group_key(segs)
    if key is None:
      out.append([i])
    else:
      by_key.setdefault(key, []).append(i)
  for members in by_key.values():
    members = sorted(members, key=lambda i: -segments[i].length)
    current: List[int] = []
    for i in members:
      if current and segments[current[0]].length > SLACK * segments[i].length:
        out.append(current)
        current = []
      current.append(i)
    out.append(current)
  return sorted(out)


def exchange_stacked(codec: Any, xs: Sequence[jax.Array], segments: Sequence[Any], enc_keys, dec_keys,
                     axis: Axis) -> list:
  """``(mean, local, x)`` of each bucket of a group: one loop (``lax.scan``) encodes them all.

  ``codec.group_tables`` gives each bucket's tables (one structure for the group, over its
  longest length); ``codec.encode_table`` encodes a zero-padded bucket into a payload at the
  group's shapes; ``codec.cut`` cuts it to the bucket's own. What each bucket sent
  (``codec.sent_table``), its collective and its decode (``codec.aggregate``) are then the
  bucket's own; ``x`` is the bucket read back from the stack, for the memory.
  """
  length = max(s.length for s in segments)
  stack = jnp.zeros((len(xs), length), jnp.float32)
  for b, x in enumerate(xs):  # each bucket written in place (XLA fuses its producer into the write)
    stack = lax.dynamic_update_slice(stack, x[None].astype(jnp.float32), (b, 0))
  table = tables.stack(codec.group_tables(list(segments)))

  def body(carry, a):  # the stack rides in the loop's state, unchanged: the buckets read back after
    i, key, t = a    # the loop are that buffer, with no copy made for them
    return carry, codec.encode_table(lax.dynamic_index_in_dim(carry, i, keepdims=False), key, t)

  stack, payloads = lax.scan(body, stack, (jnp.arange(len(xs)), jnp.stack(list(enc_keys)), table))
  out = []
  for b, segs in enumerate(segments):
    full = jax.tree.map(lambda v: v[b], payloads)
    payload = codec.cut(full, segs)
    x = stack[b, :segs.length]  # read from the stack: the bucket is written out once
    local = codec.sent_table(x, full, enc_keys[b], segs)
    if axis.name is None:
      out.append((local, local, x))
      continue
    gathered = ops.allgather_payload(payload, axis)
    out.append((codec.aggregate(gathered, dec_keys[b], segs, axis.size), local, x))
  return out
