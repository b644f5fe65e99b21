"""One loop over a method's buckets (jaxcomp.core.stacking): tables as data, the bits of bucket by bucket."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import AXIS, N, init_stacked, own_step, pmap_wire_bytes, run_pmap, run_shard_map
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.core import stacking, tables
from jaxcomp.core.layout import Segments
from jaxcomp.kernels import segtopk
from jaxcomp.transforms import sparse


def _segments(sizes, block=128):
  offsets, at = [], 0
  for n in sizes:
    offsets.append(at)
    at += -(-n // block) * block
  return Segments(tuple(offsets), tuple(sizes), tuple((n,) for n in sizes), block)


def test_a_table_pads_a_bucket_with_empty_segments_and_one_over_its_padding():
  segs = _segments([300, 129, 5000])
  t = tables.padded_table(segs, segs.length + 1024, segs.count + 3)
  assert t.count == 6 and t.length == segs.length + 1024
  np.testing.assert_array_equal(t.sizes, [300, 129, 5000, 0, 0, 1024])
  np.testing.assert_array_equal(t.offsets[:3], segs.offsets)
  np.testing.assert_array_equal(t.row_segment[:segs.length // 128], segs.row_segment)
  assert set(t.row_segment[segs.length // 128:]) == {5}
  x = jnp.asarray(np.random.default_rng(0).standard_normal(t.length), jnp.float32)
  x = x.at[segs.length:].set(0.0)
  own = x[:segs.length]
  np.testing.assert_allclose(t.sum(x)[:3], segs.sum(own), rtol=1e-6)
  np.testing.assert_array_equal(t.max_abs(x)[:3], segs.max_abs(own))
  np.testing.assert_array_equal(t.valid()[:segs.length], segs.valid())
  with pytest.raises(ValueError, match="cannot hold"):
    tables.padded_table(segs, segs.length, segs.count)  # no room for the padding's segment


def test_stacked_plans_select_what_each_bucket_selects_alone():
  rng = np.random.default_rng(1)
  buckets = [_segments([5000, 100000, 17, 70000]), _segments([90000, 33, 9000]), _segments([120000])]
  ks = [np.asarray([max(1, -(-n // 100)) for n in s.sizes]) for s in buckets]
  plans = segtopk.group_plans(buckets, ks)
  length = plans[0].segs.length
  looped = jax.jit(lambda s, p: jax.lax.map(lambda a: segtopk.topk_positions(*a), (s, p)))
  alone = [jax.jit(lambda x, s=s, k=k: segtopk.segmented_topk(x, s, k)) for s, k in zip(buckets, ks)]
  for data in ("normal", "ties", "tiny", "nonfinite"):
    xs = []
    for s in buckets:
      x = rng.standard_normal(s.length).astype(np.float32)
      if data == "ties":
        x = np.round(x * 2) / 2
      elif data == "tiny":
        x *= 1e-7
      elif data == "nonfinite":
        x[::997], x[5] = np.nan, np.inf
      xs.append(jnp.asarray(x))
    out = looped(jnp.stack([jnp.pad(x, (0, length - x.shape[0])) for x in xs]), tables.stack(plans))
    for x, segs, k, o, f in zip(xs, buckets, ks, np.asarray(out), alone):
      np.testing.assert_array_equal(np.minimum(o[:int(k.sum())], segs.length), np.asarray(f(x)), err_msg=data)


def test_groups_take_buckets_of_one_key_within_the_slack():
  class Codec(stacking.LoopCodec):
    linear = False
    group_tables = encode_table = cut = None

    def group_key(self, segs):
      return None if segs.length < 1000 else "big"

  lengths = [12800, 6400, 128, 3200, 6528, 25600]
  segments = [_segments([n]) for n in lengths]
  got = stacking.groups(Codec(), segments)
  assert sorted(map(sorted, got)) == [[0, 5], [1, 4], [2], [3]]


def _tree():
  """Leaves large enough for top-k's chunk16 positions, in three 512 KiB buckets of different layouts."""
  shapes = [(300, 300), (257,), (70000,), (64, 64, 3), (256, 300), (40, 700)]
  return {f"w{i}": jnp.zeros(s, jnp.float32) for i, s in enumerate(shapes)}


def _grads(params, scale=1e-5):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(3), len(leaves))
  return treedef.unflatten([scale * jax.random.normal(k, (N,) + p.shape) for k, p in zip(keys, leaves)])


@pytest.mark.parametrize("options", [{}, {"values": "bfloat16"}, {"scope": "bucket"}])
def test_topk_in_one_loop_equals_bucket_by_bucket_under_pmap_and_shard_map(options):
  params = _tree()
  tx = jaxcomp.topk(0.01, axis_name=AXIS, bucket_bytes=2 ** 19, min_size=1, **options)
  looped = jaxcomp.configure(tx, loop_buckets=True)
  segments = [b.segments for b in tx.settings.method.buckets(params)]
  assert max(len(g) for g in stacking.groups(sparse.TopKCodec(0.01), segments)) == 3
  grads = _grads(params)

  def steps(tx, run):
    state = init_stacked(tx, params)
    out, state = run(tx, grads, state)
    return run(tx, jax.tree.map(lambda g: 0.5 * g, grads), state)

  alone = steps(tx, run_pmap)
  for run in (run_pmap, run_shard_map) if not options else (run_pmap,):
    for a, b in zip(jax.tree.leaves(steps(looped, run)), jax.tree.leaves(alone), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_loop_sends_each_buckets_own_bytes_and_is_configured_once():
  params = _tree()
  tx = jaxcomp.topk(0.01, axis_name=AXIS, bucket_bytes=2 ** 19, min_size=1)
  tx = jaxcomp.configure(tx, loop_buckets=True)
  text = jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS).lower(
      _grads(params), init_stacked(tx, params)).compile().as_text()
  assert '"known_trip_count":{"n":"3"}' in text  # three buckets' encode in one loop
  assert pmap_wire_bytes(tx, params)["total"] == jaxcomp.wire_bytes(tx, params)
  assert jaxcomp.steady(tx).settings.method.loop_buckets
  assert not jaxcomp.configure(tx, loop_buckets=False).settings.method.loop_buckets
  with pytest.raises(TypeError, match="loop_buckets"):
    jaxcomp.configure(tx, loop_buckets="yes")


def test_one_loop_under_a_warm_up_and_over_a_fast_axis_equals_bucket_by_bucket():
  params = _tree()
  tx = jaxcomp.topk(0.01, axis_name=AXIS, bucket_bytes=2 ** 19, min_size=1)
  tx = jaxcomp.configure(tx, start_step=1)
  grads = _grads(params)

  def steps(tx):  # a dense step, then a compressed one
    out, state = run_pmap(tx, grads, init_stacked(tx, params))
    return run_pmap(tx, grads, state)

  looped = steps(jaxcomp.configure(tx, loop_buckets=True))
  for a, b in zip(jax.tree.leaves(looped), jax.tree.leaves(steps(tx)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # dense over "ici" (4), top-k over "dcn" (2): each worker's chunks of two buckets, one loop
  mesh = jax.make_mesh((2, 4), ("dcn", "ici"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
  big = {"a": jnp.zeros((600, 500)), "b": jnp.zeros((700, 400))}
  g = {k: 1e-5 * jax.random.normal(jax.random.PRNGKey(i), (8,) + v.shape)
       for i, (k, v) in enumerate(big.items())}

  def two_level(tx):
    spec = P(("dcn", "ici"))
    init = jax.shard_map(lambda p: jaxcomp.stacked(tx.init(p)), mesh=mesh, in_specs=P(), out_specs=spec)

    def step(g, s):
      u, s = tx.update(jaxcomp.local(g), jaxcomp.local(s))
      return jaxcomp.stacked(u), jaxcomp.stacked(s)

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
                                check_vma=False))
    out, state = run(g, jax.jit(init)(big))
    return jax.device_get(run(g, state))

  tx = jaxcomp.topk(0.01, axis_name="dcn", dense_axis_name="ici", bucket_bytes=2 ** 20)
  looped = jaxcomp.configure(tx, loop_buckets=True)
  for a, b in zip(jax.tree.leaves(two_level(looped)), jax.tree.leaves(two_level(tx)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_loop_in_the_users_own_gspmd_step_equals_bucket_by_bucket():
  """jaxcomp.on_shards over "dcn" on a (dcn, fsdp, tensor) mesh: each device's shards (two of
  131072 entries, a bucket each) in one loop, the same parameters as bucket by bucket."""
  mesh = jax.make_mesh((2, 2, 2), ("dcn", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                       devices=jax.devices()[:8])
  specs = {"w1": P("fsdp", "tensor"), "w2": P("tensor", "fsdp")}
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params = {"w1": jax.random.normal(k1, (512, 1024)) / 16, "w2": jax.random.normal(k2, (1024, 512)) / 32}
  r = np.random.default_rng(0)
  batch = jax.device_put((r.standard_normal((32, 512)).astype(np.float32),
                          r.standard_normal((32, 512)).astype(np.float32)),
                         NamedSharding(mesh, P(("dcn", "fsdp"))))

  def loss(p, b):
    h = jax.lax.with_sharding_constraint(jax.nn.relu(b[0] @ p["w1"]), P("fsdp", "tensor"))
    return jnp.mean((h @ p["w2"] - b[1]) ** 2)

  def train(tx):
    tx, step = own_step(loss, optax.chain(tx, optax.sgd(0.1)), mesh, specs)
    p = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    state = jax.jit(tx.init)(p)
    for _ in range(2):
      p, state, _ = step(p, state, batch)
    return jax.device_get(p)

  tx = jaxcomp.topk(0.01, axis_name="dcn", bucket_bytes=2 ** 19)
  shards = [b.segments for b in tx.settings.method.buckets([jnp.zeros((256, 512)), jnp.zeros((512, 256))])]
  assert stacking.groups(sparse.TopKCodec(0.01), shards) == [[0, 1]]  # the two shards' buckets: one loop
  for a, b in zip(jax.tree.leaves(train(jaxcomp.configure(tx, loop_buckets=True))),
                  jax.tree.leaves(train(tx)), strict=True):
    np.testing.assert_array_equal(a, b)


def test_one_loop_inside_nnx_optimizer_equals_bucket_by_bucket():
  from flax import nnx

  class Wide(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(256, 512, use_bias=False, rngs=rngs)
      self.b = nnx.Linear(512, 256, use_bias=False, rngs=rngs)

    def __call__(self, x):
      return self.b(jax.nn.relu(self.a(x)))

  r = np.random.default_rng(0)
  x, y = (jnp.asarray(r.standard_normal((16, 256)), jnp.float32) for _ in range(2))

  def train(tx):
    model = Wide(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.chain(tx, optax.sgd(0.1)), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
      opt.update(model, nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model))

    for _ in range(2):
      step(model, opt)
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

  tx = jaxcomp.topk(0.01, bucket_bytes=2 ** 19)  # two kernels of 131072 entries: a bucket each, one loop
  looped = train(jaxcomp.configure(tx, loop_buckets=True))
  for a, b in zip(jax.tree.leaves(looped), jax.tree.leaves(train(tx)), strict=True):
    np.testing.assert_array_equal(a, b)
