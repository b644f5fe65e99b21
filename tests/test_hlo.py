"""The reader of compiled programs (jaxcomp.collectives.hlo) on real HLO text from every JAX version tested.

tests/fixtures/hlo/ holds the compiled text of four small programs as jax
0.10 (explicit group lists), jax 0.11 (from a GPU machine's JAX, compiled for
its CPU) and jax 0.12 (both: mesh-axes groups) printed them
(``make_fixtures.py`` there writes them from the running JAX); each must read
as the same collectives with the same groups and bytes, whatever form the
groups were printed in. The last test compiles the
programs with the JAX running the tests and reads them the same way.
"""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.collectives import hlo

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hlo"
ALL = [list(range(8))]
ON_A = [[0, 4], [1, 5], [2, 6], [3, 7]]  # mesh (a=2, b=4), devices in order
ON_B = [[0, 1, 2, 3], [4, 5, 6, 7]]

# program -> sorted (kind, bytes one participant sends, groups) of its collectives
EXPECTED = {
    "pmap": [("all-gather", 16, ALL), ("all-reduce", 16, ALL)],
    "shard_map": sorted([
        ("all-reduce", 128, ON_A), ("all-reduce", 128, ON_B), ("all-reduce", 128, ALL),
        ("all-gather", 128, ON_B), ("reduce-scatter", 32 * 4, ON_B), ("all-to-all", 128, ON_B),
        ("all-gather", 128, ON_A)]),
    # x @ x.T with x sharded (a, b): the columns gathered over b, the partial products summed over b
    "gspmd": [("all-gather", 16 * 64 * 4 // 2, [[0, 4], [1, 5], [2, 6], [3, 7]]),
              ("all-reduce", 32 * 64 * 4, ON_B)],
}


def _read(text):
  return sorted((c.kind, c.sent_bytes, c.groups.tolist()) for c in hlo.collectives(text))


def _fixtures(program):
  found = sorted(FIXTURES.glob(f"*-{program}.txt"))
  assert {p.name.split("-")[0] for p in found} >= {"jax0.10.2", "jax0.12.0.1"}, found
  return found


@pytest.mark.parametrize("program", sorted(EXPECTED))
def test_fixtures_of_every_version_read_the_same(program):
  for path in _fixtures(program):
    assert _read(path.read_text()) == sorted(EXPECTED[program]), path.name


def test_topk_fixtures_carry_its_wire_bytes():
  """The top-k step's compiled collectives carry exactly jaxcomp.wire_bytes, in both versions' text."""
  tx = jaxcomp.topk(ratio=0.01, axis_name="d")
  params = {"w": jnp.zeros((96, 64)), "b": jnp.zeros((64,))}
  for path in _fixtures("topk"):
    got = jaxcomp.collective_bytes(path.read_text())
    assert got["total"] == jaxcomp.wire_bytes(tx, params), path.name
    assert set(got["by_group_size"]) == {8}, path.name


def test_the_three_forms_of_one_group_list_agree():
  """Explicit lists, iota and mesh axes name the same groups (mesh a=2, b=4; groups over b, a, both)."""
  def line(groups):
    return (f"  %x = f32[8]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups},"
            " use_global_device_ids=true")

  cases = [("{{0,1,2,3},{4,5,6,7}}", "[2,4]<=[8]", "mesh['a'=2,'b'=4] {'b'}", ON_B),
           ("{{0,4},{1,5},{2,6},{3,7}}", "[4,2]<=[2,4]T(1,0)", "mesh['a'=2,'b'=4] {'a'}", ON_A),
           ("{{0,1,2,3,4,5,6,7}}", "[1,8]<=[8]", "mesh['a'=2,'b'=4] {'a','b'}", ALL)]
  for *forms, want in cases:
    for form in forms:
      (c,) = hlo.collectives(line(form))
      assert c.groups.tolist() == want, form
      assert c.group_size == len(want[0])


def test_mesh_forms_sub_axes_device_ids_and_names():
  r = hlo.replica_groups
  # a sub-axis: a:(1)2 is the major factor 2 of a=8 (XLA: [8] -> [1,2,4], aggregate the 2)
  assert r("replica_groups=mesh['a'=8] {'a':(1)2}").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert r("replica_groups=mesh['a'=8] {'a':(4)2}").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert r("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}").tolist() == [
      [0, 1, 4, 5], [2, 3, 6, 7]]
  # unquoted names (XLA's own printer) and a mesh beside other axes
  assert r("replica_groups=mesh[dcn=2,fsdp=2,tensor=2] {dcn}").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert r("replica_groups=mesh[dcn=2,fsdp=2,tensor=2] {tensor,dcn}").tolist() == [
      [0, 1, 4, 5], [2, 3, 6, 7]]
  # devices laid out in another order
  got = r("replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]<=[2,2]T(1,0)) {'b'}")
  assert got.tolist() == [[0, 2], [1, 3]]
  # jax 0.10's XLA, in a GSPMD step under vmap's spmd_axis_name (examples/train_fsdp.py's mesh)
  got = r("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'},"
          " dimensions={0}, use_global_device_ids=true")
  assert got.tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
  got = r("replica_groups=mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'a'}")
  assert got.tolist() == [[3, 1], [2, 0]]
  assert r("replica_groups=maximal_mesh[device_id=3] {}").tolist() == [[3]]
  with pytest.raises(ValueError, match="mesh axis 'c'"):
    r("replica_groups=mesh['a'=2,'b'=4] {'c'}")


def test_group_modes_and_empty_lists():
  """An empty list is every participant of the instruction's mode; cross-replica-and-partition spans
  the partitions too (XLA's collective-op group modes)."""
  head = "HloModule m, replica_count=2, num_partitions=4\n"
  def group(attrs, groups):
    (c,) = hlo.collectives(head + f"  %x = f32[8]{{0}} all-reduce(%p), {attrs}replica_groups={groups}, to=%a")
    return c.groups.tolist()

  assert group("", "{}") == [[0, 1]]  # cross-replica: the replicas
  assert group("channel_id=1, ", "{}") == [[0, 1, 2, 3]]  # cross-partition: the partitions
  assert group("channel_id=1, use_global_device_ids=false, ", "{}") == [list(range(8))]
  assert group("channel_id=1, use_global_device_ids=false, ", "{{0},{1}}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert group("channel_id=1, use_global_device_ids=true, ", "{{0,5},{1,4}}") == [[0, 5], [1, 4]]


def test_async_pairs_count_once_and_shapes_with_memory_spaces():
  text = "\n".join([
      "  %s = (f32[4]{0}, f32[32]{0}) all-gather-start(%w), channel_id=1, replica_groups=mesh['d'=8] {'d'},"
      " dimensions={0}, use_global_device_ids=true",
      "  %d = f32[32]{0} all-gather-done(%s)",
      "  %r = f32[6]{0:S(1)} all-reduce-start(%v), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add",
      "  %e = f32[6]{0:S(1)} all-reduce-done(%r)",
      "  %t = (f32[2]{0:S(1)}, f32[2]{0}) all-to-all(%a, %b), channel_id=3, replica_groups={{0,1}}",
  ])
  found = hlo.collectives(text)
  assert [(c.kind, c.sent_bytes, c.group_size) for c in found] == [
      ("all-gather", 16, 8), ("all-reduce", 24, 8), ("all-to-all", 16, 2)]


def test_this_jax_compiles_what_the_fixtures_hold():
  """The programs compiled now (the JAX running the tests) read as the fixtures do."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  texts = module.programs()
  for program, want in EXPECTED.items():
    assert _read(texts[program]) == sorted(want), program
  tx = jaxcomp.topk(ratio=0.01, axis_name="d")
  params = {"w": jnp.zeros((96, 64)), "b": jnp.zeros((64,))}
  assert jaxcomp.collective_bytes(texts["topk"])["total"] == jaxcomp.wire_bytes(tx, params)
  assert np.array_equal(hlo.collectives(texts["pmap"])[0].groups, np.arange(8)[None])


def test_a_collective_inside_a_loop_counts_each_trip():
  """A psum in a ``lax.map`` of 5 trips moves its buffer 5 times: the bytes and the count say so."""
  import jax
  from jax import lax


  step = jax.pmap(lambda x: lax.map(lambda r: lax.psum(r, "i"), x), axis_name="i", devices=jax.devices()[:8])
  text = step.lower(jnp.ones((8, 5, 100), jnp.float32)).compile().as_text()
  (c,) = hlo.collectives(text)
  assert (c.kind, c.repeat, c.once_bytes, c.sent_bytes) == ("all-reduce", 5, 400, 2000)
  wire = jaxcomp.collective_bytes(text)
  assert (wire["total"], wire["count"]) == (2000, 5)
  assert hlo.runs(text) == [("all-reduce", 400)] * 5
  # a line alone (no module around it) counts once
  assert hlo.collectives(c.line)[0].repeat == 1
