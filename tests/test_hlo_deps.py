"""jaxcomp.collectives.hlo_deps: which collectives of a compiled program read which entry parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from harness import AXIS, mesh
from jax.sharding import PartitionSpec as P

from jaxcomp.collectives import hlo_deps


def _reads(body, n_args=2):
  """Compiles ``body(x, y)`` under shard_map over 8 devices; which collectives read x (parameter 0)."""
  f = jax.jit(jax.shard_map(body, mesh=mesh(), in_specs=(P(AXIS),) * n_args, out_specs=P(AXIS)))
  hlo = f.lower(jnp.ones((8, 5)), jnp.full((8, 5), 2.0)).compile().as_text()
  x = [i for i, shape in hlo_deps.entry_parameters(hlo)][:1]
  return hlo_deps.collectives_reading(hlo, x)


def test_a_while_loop_keeps_its_carried_values_apart():
  """A loop carrying one value from x and one from y: the psum of the y part does not read x, the psum
  of the x part does (the fixed point follows each tuple element)."""
  def body(x, y):
    a, b = jax.lax.fori_loop(0, 3, lambda i, c: (c[0] * 1.5 + i, jnp.sin(c[1]) + i), (x, y))
    return jnp.stack([jax.lax.psum(jnp.sum(b), AXIS), jax.lax.pmax(jnp.sum(a * a), AXIS) * 3.0]) + a[0, :2]
  reads = _reads(body)
  assert sorted(reads.values()) == [False, True], reads


def test_conditional_branches_see_their_own_operands():
  """lax.cond whose collective branch reads y only; the other branch reads x: the psum does not read x;
  a branch index computed from x makes everything inside read x (the psum cannot start before x)."""
  def clean(x, y):
    return jax.lax.cond(jnp.sum(y) > 0, lambda: jax.lax.psum(jnp.sum(y * y), AXIS) + y[0, 0],
                        lambda: jnp.sum(x)).reshape(1)
  assert list(_reads(clean).values()) == [False]

  def dirty(x, y):
    return jax.lax.cond(jnp.sum(x) > 0, lambda: jax.lax.psum(jnp.sum(y * y), AXIS) + y[0, 0],
                        lambda: jnp.sum(y)).reshape(1)
  assert list(_reads(dirty).values()) == [True]


def test_unknown_operands_and_control_edges_read_as_dependent():
  """What the pass cannot name is dependent (operands printed without their %), and a scheduling edge
  (control-predecessors) orders a collective as an operand would."""
  hlo = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[2], b: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  %b = f32[2]{0} parameter(1)
  %x = f32[2]{0} add(a, b)
  ROOT %r = f32[2]{0} all-reduce(%x), replica_groups={}, to_apply=%sum
}
"""
  assert hlo_deps.collectives_reading(hlo, [0]) == {"r": True}
  clean = hlo.replace("add(a, b)", "add(%b, %b)")
  assert hlo_deps.collectives_reading(clean, [0]) == {"r": False}
  assert hlo_deps.collectives_reading(clean, [1]) == {"r": True}
  ordered = clean.replace("  ROOT %r", "  %y = f32[2]{0} negate(%a)\n  ROOT %r").replace(
      "to_apply=%sum", "to_apply=%sum, control-predecessors={%y}")
  assert hlo_deps.collectives_reading(ordered, [0]) == {"r": True}
