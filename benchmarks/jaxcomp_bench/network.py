"""``python -m jaxcomp.bench network``: predicted step time of each method on an alpha-beta network.

For ResNet-50-shaped and BERT-base-shaped gradients (:mod:`jaxcomp_bench.shapes`),
N = 8, 32, 64 workers on 1, 10 and 100 Gb/s links, it prints each method's
predicted step time and speedup over the dense all-reduce
(:mod:`jaxcomp.planning.netsim`), without and with overlap of communication and
backprop. Every input is measured or stated:

- **bytes and collectives**: from the HLO of each method's compiled pmap step
  over 8 CPU devices on the model's shapes (``jax.ShapeDtypeStruct`` only, no
  data): one entry per collective instruction, all-reduce vs all-gather read
  from the program. Per-worker bytes do not depend on N for these methods, so
  the 8-device program stands for 32 and 64 too.
- **compression time**: measured here on the CPU: the local round trip
  (``axis_name=None``, jitted, state donated) minus the dense transform's
  (which only copies), and for gathered methods the cost of decoding one
  more worker's payload, measured by vmapping the step over 1 and 4
  simulated workers (ResNet-50 only, scaled by the number of values for
  BERT). By default these CPU times are scaled to the accelerator by the ratio
  of memory-copy times (``--compress scaled``: CPU copy of the same gradients,
  measured in the same run, vs ``2 x bytes / --device-gbs``, V100 HBM2's
  900 GB/s): an assumption that the kernels are memory-bound on both.
  ``--compress cpu`` uses the CPU times as they are; ``--compress zero``
  ignores compression.
- **compute time per step**: stated assumptions from published V100 numbers
  (``--compute-ms`` overrides), printed with the table.

At the end it prints both exchanges (``transport="gather"`` and ``"scatter"``) at
N = 8 ... 1024 against dense float32 and bfloat16 with these compression times
(:mod:`jaxcomp_bench.scale`), then the two-level table.

Measurements are cached in a JSON file (``--cache``; ``--remeasure`` to redo
them), keyed by model, method, settings and JAX version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

from jaxcomp.collectives.hlo import runs as collective_runs
from jaxcomp.planning import netsim
from jaxcomp_bench.common import COMPUTE, LABELS, VARIANTS, header, plain, time_copy, time_update

DEFAULT_METHODS = ("none", "fp16", "bf16", "powersgd", "acpsgd", "topk", "topk[chunked]", "randomk",
                   "signsgd", "qsgd", "dgc")
DEVICE_GBS = 900.0  # V100 HBM2 peak memory bandwidth, GB/s (NVIDIA V100 datasheet)
KIND_SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
              "collective-permute": "CP"}
COMPRESS_TEXT = {
    "scaled": "measured on this CPU as (update time - dense update time) / copy time, times the"
              " time of copying the model's float32 gradients at {gbs:g} GB/s (2 x bytes moved);"
              " '+decode/worker' likewise, added (N - 1) times for gathered methods",
    "cpu": "the CPU times as measured here (update time - dense update time, scaled to the dense"
           " copy time), plus (N - 1) x decode/worker for gathered methods",
    "zero": "ignored (0)",
}


# ----------------------------------------------------------------------------
# Measurements (each cached)


def _cache_key(*parts) -> str:
  import jax

  return "|".join([f"jax={jax.__version__}"] + [json.dumps(p, sort_keys=True, default=str) for p in parts])


class Cache:
  """A JSON dict on disk; ``get(key, fn)`` computes and stores missing entries."""

  def __init__(self, path: str | None, refresh: bool = False):
    self.path, self.refresh, self.hits = path, refresh, 0
    self.data: dict = {}
    if path and os.path.exists(path) and not refresh:
      try:
        with open(path) as f:
          self.data = json.load(f)
      except (OSError, ValueError):
        self.data = {}

  def get(self, key: str, fn):
    if key in self.data:
      self.hits += 1
      return self.data[key]
    value = fn()
    self.data[key] = value
    if self.path:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      tmp = self.path + ".tmp"
      with open(tmp, "w") as f:
        json.dump(self.data, f, indent=1)
      os.replace(tmp, self.path)
    return value


def split(shapes, whole: bool = True) -> list:
  """The model's leaves as programs to compile: all at once (default), or one per distinct shape.

  With buckets the whole model's program is what a user compiles and what
  sends the model's real payloads (leaves of several shapes share a bucket
  and a collective); ``--by-shape`` keeps the older per-shape programs.
  """
  if whole:
    return [list(shapes)]
  counts: dict = {}
  for s in shapes:
    counts[tuple(s)] = counts.get(tuple(s), 0) + 1
  return [[s] * m for s, m in counts.items()]


def _agreement(measured: int, whole_nominal: int, factory, kwargs: dict, parts) -> str:
  """The 'wire==nominal' cell: measured bytes against ``jaxcomp.wire_bytes``.

  Measured programs are one per distinct shape (``split``), so the measured
  total is compared with the nominal bytes of those same programs (each
  with its non-finite flag, or the flag once); ACP-SGD balances its two
  phases within each program, so per-shape programs send more than the
  whole model's one buffer. 'yes': equal to the whole model's nominal;
  'per shape (W whole)': equal to the per-shape programs' nominal.
  """
  import jaxcomp
  from jaxcomp_bench import shapes as shp

  if measured == whole_nominal:
    return "yes"
  if measured == 2 * whole_nominal:
    return "bf16->f32"
  tx = jaxcomp.steady(factory(axis_name="data", **kwargs))  # after any warm-up
  per_part = sum(int(jaxcomp.wire_bytes(tx, shp.abstract(p))) for p in parts)
  flags = _flag_bytes(tx, shp.abstract(parts[0])) * (len(parts) - 1)
  if measured in (per_part, per_part - flags):
    return f"per shape ({whole_nominal} whole)"
  return f"no ({whole_nominal})"


def _flag_bytes(tx, params) -> int:
  try:
    return int(tx.method.wire_bytes(params) - tx.method.wire_bytes(params, nonfinite_flag=False))
  except TypeError:  # a core without the non-finite flag
    return 0


def measure_traffic(factory, kwargs: dict, parts, workers: int = 8) -> dict:
  """Collectives of the compiled pmap steps over ``workers`` CPU devices, summed over ``parts``.

  Returns ``{"collectives": [(kind, bytes), ...], "totals": {kind: bytes, "total",
  "count"}, "nominal": jaxcomp.wire_bytes of the whole model}``. The per-step
  non-finite flag (one small all-reduce) is counted once, not once per part.
  """
  import jax

  import jaxcomp
  from jaxcomp_bench import shapes as shp

  tx = jaxcomp.steady(factory(axis_name="data", **kwargs))  # after any warm-up
  lead = lambda s: jax.ShapeDtypeStruct((workers,) + tuple(s.shape), s.dtype)
  step = jax.pmap(lambda g, s: tx.update(g, s), axis_name="data", devices=jax.devices()[:workers])
  entries, flag_seen = [], False
  for part in parts:
    params = shp.abstract(part)
    state = jax.eval_shape(tx.init, params)
    hlo = step.lower(shp.abstract(part, lead=(workers,)), jax.tree.map(lead, state)).compile().as_text()
    colls = collective_runs(hlo)
    flag = _flag_bytes(tx, params)
    if flag and flag_seen and ("all-reduce", flag) in colls:
      colls.remove(("all-reduce", flag))
    flag_seen = flag_seen or bool(flag)
    entries.extend(colls)
  totals = {k: sum(b for kind, b in entries if kind == k) for k in netsim.KINDS}
  totals["total"], totals["count"] = sum(b for _, b in entries), len(entries)
  whole = shp.abstract([s for part in parts for s in part])
  return {"collectives": entries, "totals": totals, "nominal": int(jaxcomp.wire_bytes(tx, whole))}


def measure_round_trip(factory, kwargs: dict, parts, reps: int) -> dict:
  """Median seconds of the local update and of a copy of the same gradients, summed over parts."""
  import jax

  from jaxcomp_bench import shapes as shp

  total, copy = 0.0, 0.0
  for i, part in enumerate(parts):
    grads = shp.random(part, seed=i)
    copy += time_copy(grads, reps)
    total += time_update(factory(axis_name=None, **kwargs), grads, reps)
    del grads
  jax.clear_caches()
  return {"seconds": total, "copy_seconds": copy}


def measure_decode(factory, kwargs: dict, parts, reps: int, workers: int = 4) -> float | None:
  """Seconds one worker spends decoding one more worker's payload (gathered methods).

  The step is vmapped over 1 and ``workers`` simulated workers with the axis
  bound by vmap: per worker ``t(W) / W = encode + W * decode``, summed over
  ``parts``. The invariant all-gather of :mod:`jaxcomp.collectives.ops` has no
  vmap rule, so the plain one stands in for it during the measurement
  (``ops.plain_gather``). None if the method cannot run under vmap.
  """
  import jax

  import jaxcomp
  from jaxcomp.collectives import ops

  try:
    with ops.plain_gather():
      tx = jaxcomp.steady(factory(axis_name="data", **kwargs))  # after any warm-up
      total = 0.0
      for i, part in enumerate(parts):
        total += _decode_seconds(tx, i, part, reps, workers)
      return total
  except Exception:  # noqa: BLE001 - reported as "not measured"
    return None
  finally:
    jax.clear_caches()


def _decode_seconds(tx, i: int, part, reps: int, workers: int) -> float:
  """:func:`measure_decode` of one part (``i``: the seed of its random gradients)."""
  import jax
  import jax.numpy as jnp

  import jaxcomp

  per_worker = {}
  for w in (1, workers):
    keys = jax.random.split(jax.random.PRNGKey(i), len(part))
    grads = [jax.random.normal(k, (w,) + tuple(s)) for k, s in zip(keys, part)]
    state = jax.tree.map(jnp.copy, jaxcomp.per_worker(tx.init([g[0] for g in grads]), w))
    step = jax.jit(jax.vmap(tx.update, axis_name="data"), donate_argnums=(1,))
    out, state = step(grads, state)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      out, state = step(grads, state)
      jax.block_until_ready((out, state))
      times.append(time.perf_counter() - t)
    per_worker[w] = statistics.median(times) / w
    del grads, state, out
  return (per_worker[workers] - per_worker[1]) / (workers - 1)


# ----------------------------------------------------------------------------
# The table


def _entries(methods: Sequence[str] | None):
  import jaxcomp

  names = list(DEFAULT_METHODS if methods is None else methods)
  if names == ["all"]:
    names = list(jaxcomp.METHODS) + list(VARIANTS)
  if "none" not in names:
    names.insert(0, "none")  # the baseline of every speedup
  out = []
  for n in names:
    if n in jaxcomp.METHODS:
      out.append((n, jaxcomp.METHODS[n], {}))
    elif n in VARIANTS and VARIANTS[n][0] in jaxcomp.METHODS:
      base, kw = VARIANTS[n]
      out.append((n, jaxcomp.METHODS[base], dict(kw)))
    elif methods is not None:
      raise SystemExit(f"unknown method {n!r}; choose from {sorted(jaxcomp.METHODS) + sorted(VARIANTS)}")
  return out


def _fmt_cell(step_s: float, speedup: float) -> str:
  return f"{step_s * 1e3:7.0f} {speedup:5.2f}x"


@dataclasses.dataclass(frozen=True)
class Summary:
  """What :func:`main` measured, for the tables printed after its own (:mod:`jaxcomp_bench.__main__`)."""

  models: tuple[str, ...]
  methods: tuple[str, ...]  # the rows' labels, in order
  latency_us: float
  compress: dict  # model -> label -> (round trip, decode per payload) seconds, as in the tables


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m jaxcomp.bench network", description=plain(__doc__),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="resnet50,bert-base", help="resnet50, bert-base")
  parser.add_argument("--methods", default=None,
                      help=f"comma-separated (default: {','.join(DEFAULT_METHODS)}, those present); 'all'")
  parser.add_argument("--workers", default="8,32,64", help="N values")
  parser.add_argument("--gbps", default="1,10,100", help="link bandwidths, Gb/s")
  parser.add_argument("--latency-us", type=float, default=10.0, help="alpha per message, microseconds")
  parser.add_argument("--algorithm", default="ring", choices=("ring", "tree"))
  parser.add_argument("--per-node", type=int, default=1,
                      help="workers per node (>1: two-level network, --gbps between nodes)")
  parser.add_argument("--intra-gbps", type=float, default=300.0, help="intra-node link Gb/s (two-level)")
  parser.add_argument("--bucket-mb", type=float, default=25.0,
                      help="fuse each collective kind into buckets of this many MB"
                           " (0: the program's own split)")
  parser.add_argument("--compute-ms", default=None,
                      help="override compute per step, e.g. resnet50=305,bert-base=223")
  parser.add_argument("--compress", default="scaled", choices=("scaled", "cpu", "zero"))
  parser.add_argument("--device-gbs", type=float, default=DEVICE_GBS,
                      help="accelerator memory bandwidth for --compress scaled (GB/s)")
  parser.add_argument("--reps", type=int, default=3, help="timed runs per measurement")
  parser.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "jaxcomp",
                                                      "network.json"))
  parser.add_argument("--remeasure", action="store_true", help="ignore cached measurements")
  parser.add_argument("--by-shape", action="store_true",
                      help="compile and time one program per distinct shape (default: the whole model)")
  parser.add_argument("--quick", action="store_true", help="ResNet-50 only, N=8,64, no decode measurement")
  return parser


def _compute(args) -> tuple[dict, dict]:
  """Compute seconds per step and where each comes from, per model (:data:`COMPUTE`, ``--compute-ms``)."""
  compute = {m: v[0] for m, v in COMPUTE.items()}
  sources = {m: v[1] for m, v in COMPUTE.items()}
  if args.compute_ms:
    for item in args.compute_ms.split(","):
      k, v = item.split("=")
      compute[k], sources[k] = float(v) / 1e3, "given by --compute-ms"
  return compute, sources


def _measure(models, entries, args, cache: Cache) -> dict[str, dict[str, dict]]:
  """model -> label -> {"traffic", "round_trip", "decode"}: each method's measurements (cached)."""
  import jax

  from jaxcomp_bench import shapes as shp

  measured: dict[str, dict[str, dict]] = {}
  for model in models:
    parts = split(shp.MODELS[model](), not args.by_shape)
    how = "by-shape" if args.by_shape else "whole"
    measured[model] = {}
    for label, factory, kw in entries:
      rec = {"traffic": cache.get(_cache_key("traffic", model, how, label, kw),
                                  lambda f=factory, k=kw, p=parts: measure_traffic(f, k, p))}
      if args.compress != "zero":
        rec["round_trip"] = cache.get(_cache_key("round_trip", model, how, label, kw, args.reps),
                                      lambda f=factory, k=kw, p=parts: measure_round_trip(f, k, p, args.reps))
        if rec["traffic"]["totals"]["all-gather"] > 0 and not args.quick:
          rec["decode"] = cache.get(_cache_key("decode", model, how, label, kw, args.reps),
                                    lambda f=factory, k=kw, p=parts: measure_decode(f, k, p, args.reps))
      measured[model][label] = rec
      print(f"# measured {model} {label}", file=sys.stderr, flush=True)
    jax.clear_caches()
  return measured


def _compression(rec: dict, none_rt: dict | None, nvalues: int, args) -> tuple[float, float]:
  """(compression, decode per payload) seconds of one method, from its measurements (``--compress``)."""
  comp, dec = 0.0, 0.0
  if args.compress != "zero":
    rt = rec["round_trip"]
    base_s = none_rt["seconds"] if none_rt else 0.0
    base_copy = none_rt["copy_seconds"] if none_rt else rt["copy_seconds"]
    over = max(0.0, rt["seconds"] / rt["copy_seconds"] - base_s / base_copy)  # in copies
    scale = (2 * 4 * nvalues / (args.device_gbs * 1e9)) if args.compress == "scaled" else rt["copy_seconds"]
    comp = over * scale
    d = rec.get("decode")
    if d is not None:
      dec = max(0.0, d) / rt["copy_seconds"] * scale if args.compress == "scaled" else max(0.0, d)
  return comp, dec


def _inputs_table(model: str, entries, measured: dict[str, dict], args) -> dict:
  """Prints each method's inputs on ``model``.

  Returns label -> (collectives, compression seconds, decode seconds per payload, gathered, totals).
  """
  from jaxcomp_bench import shapes as shp

  shapes = shp.MODELS[model]()
  nvalues = shp.count(shapes)
  dense = measured.get("none")
  none_rt = dense["round_trip"] if dense and "round_trip" in dense else None
  print(f"compression: {COMPRESS_TEXT[args.compress].format(gbs=args.device_gbs)}")
  print(f"{'method':<14} {'settings':<22} {'MB/step':>9} {'collectives':<22} {'wire==nominal':>13}"
        f" {'CPU x copy':>10} {'compress ms':>11} {'+decode/worker ms':>17}")
  inputs = {}
  for label, factory, kw in entries:
    rec = measured[label]
    tr = rec["traffic"]
    tot = tr["totals"]
    kinds = "+".join(KIND_SHORT[k] for k in netsim.KINDS if tot.get(k))
    comp, dec = _compression(rec, none_rt, nvalues, args)
    gathered = tot["all-gather"] > 0
    inputs[label] = (tr["collectives"], comp, dec, gathered, tot)
    eq = _agreement(tot["total"], tr["nominal"], factory, kw, split(shapes, not args.by_shape))
    unmeasured = rec.get("decode") is None and args.compress != "zero"
    dec_txt = "n/a" if not gathered else ("not measured" if unmeasured else f"{dec * 1e3:.2f}")
    settings = ",".join(f"{k}={v}" for k, v in kw.items())
    kinds = f"{kinds} x{tot['count']}"
    rt = rec.get("round_trip")
    cpu = f"{rt['seconds'] / rt['copy_seconds']:.2f}" if rt is not None else "-"
    print(f"{label:<14} {settings:<22} {tot['total'] / 1e6:9.3f} {kinds:<22} {eq:>13}"
          f" {cpu:>10} {comp * 1e3:11.2f} {dec_txt:>17}")
  return inputs


def _prediction_tables(model: str, entries, inputs: dict, cols, compute: float, args) -> None:
  """Prints each method's predicted step time and speed-up over dense at every (N, Gb/s) of ``cols``."""
  alpha = args.latency_us * 1e-6
  bucket = args.bucket_mb * 1e6 if args.bucket_mb > 0 else None
  for overlap in (False, True):
    print(f"\n{LABELS.get(model, model)}, {'with' if overlap else 'without'} overlap:"
          " predicted step ms and speedup over dense (none)")
    print(f"{'method':<14} " + " ".join(f"{f'N={n} {b:g}Gb/s':>14}" for n, b in cols))
    for label, _, _ in entries:
      colls, comp, dec, gathered, _ = inputs[label]
      cells = []
      for n, b in cols:
        if args.per_node > 1:
          net = netsim.two_level(n, args.per_node, b, args.intra_gbps, alpha, alpha, args.algorithm)
        else:
          net = netsim.flat(n, b, alpha, args.algorithm)
        c = netsim.compression_time(comp, dec, n, gathered)
        st = netsim.predict(colls, net, compute, c, overlap, bucket)
        dcolls, dcomp, ddec, dg, _ = inputs.get("none", (colls, 0.0, 0.0, False, None))
        dst = netsim.predict(dcolls, net, compute, netsim.compression_time(dcomp, ddec, n, dg),
                             overlap, bucket)
        cells.append(_fmt_cell(st.total, netsim.speedup(st, dst)))
      print(f"{label:<14} " + " ".join(cells))


def main(argv=None) -> Summary:
  """Prints the network tables; ``python -m jaxcomp.bench network`` then prints scale's and twolevel's."""
  args = _parser().parse_args(argv)

  import jaxcomp
  from jaxcomp_bench import shapes as shp

  jaxcomp.cpu_devices(8)
  models = [m for m in args.models.split(",") if m]
  for m in models:
    if m not in shp.MODELS:
      raise SystemExit(f"unknown model {m!r}; choose from {sorted(shp.MODELS)}")
  workers = [int(w) for w in args.workers.split(",")]
  gbps = [float(b) for b in args.gbps.split(",")]
  if args.quick:
    models, workers = ["resnet50"], [8, 64]
  compute, sources = _compute(args)
  entries = _entries(None if args.methods is None else [m for m in args.methods.split(",") if m])
  cache = Cache(args.cache, args.remeasure)

  command = "python -m jaxcomp.bench network " + " ".join(argv if argv is not None else sys.argv[1:])
  print(header(command.strip()))
  print(f"model: alpha-beta, {args.algorithm} collectives, alpha = {args.latency_us:g} us per message,"
        + (f" {args.per_node} workers per node on {args.intra_gbps:g} Gb/s links, --gbps between nodes,"
           if args.per_node > 1 else " flat network (each worker one link of the given bandwidth),")
        + (f" each collective kind fused into {args.bucket_mb:g} MB buckets;" if args.bucket_mb > 0 else
           " collectives as compiled;")
        + " step = compute + compression + communication (no overlap) or forward + compression +"
        " max(backward, communication) (overlap; backward = 2/3 of compute).")

  measured = _measure(models, entries, args, cache)
  compress: dict[str, dict] = {}  # model -> method -> (round trip, decode) seconds, for the scale table
  for model in models:
    shapes = shp.MODELS[model]()
    nvalues = shp.count(shapes)
    print(f"\n=== {LABELS.get(model, model)}: {len(shapes)} gradients, {nvalues:,} values"
          f" ({4 * nvalues / 1e6:.1f} MB in float32); compute {compute[model] * 1e3:.0f} ms/step"
          f" ({sources[model]}) ===")
    inputs = _inputs_table(model, entries, measured[model], args)
    compress[model] = {label: (comp, dec) for label, (_, comp, dec, _, _) in inputs.items()}
    _prediction_tables(model, entries, inputs, [(n, b) for n in workers for b in gbps], compute[model], args)
  if cache.hits:
    print(f"\n({cache.hits} measurements read from the cache {args.cache}; --remeasure to redo them)")
  return Summary(tuple(models), tuple(label for label, _, _ in entries), args.latency_us, compress)
