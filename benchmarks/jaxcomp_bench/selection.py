"""``python -m jaxcomp.bench selection``: RedSync's selection kernels against ``lax.top_k``.

Times, on one device, the selection of the ``k = ceil(ratio * n)`` largest
``|x|`` of a float32 vector of standard normal values:

- ``top_k``: ``lax.top_k(jnp.abs(x), k)``, what the plain top-k codec runs;
- ``trimmed``: :func:`jaxcomp.kernels.selection.trimmed_topk` (exact top-k);
- ``bsearch``: :func:`jaxcomp.kernels.selection.threshold_binary_search`
  from a cold start (between k and 2k entries);
- ``bsearch warm``: the same, started from the threshold found on another
  vector of the same distribution (as when the threshold is carried from the
  previous training step).

Each is jitted, run once to compile, then timed ``--repeats`` times (median,
blocking on the result). The speed ratios are ``top_k`` time over each
kernel's time, measured in the same run. Sizes: 2^24 and 25,557,032 (the
number of parameters of ResNet-50, as one flat vector); ``--quick`` uses 2^16
and 2^18.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence

os.environ.setdefault("PJRT_NPROC", "16")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.kernels import selection
from jaxcomp.transforms import _args

SIZES = (1 << 24, 25_557_032)
QUICK_SIZES = (1 << 16, 1 << 18)
RATIOS = (0.001, 0.01)


def _median_ms(fn: Callable, args: Sequence, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def run(sizes: Sequence[int], ratios: Sequence[float], repeats: int, seed: int = 0) -> list[dict]:
  """Times every kernel on every (size, ratio); returns one row per pair."""
  rows = []
  for n in sizes:
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.block_until_ready(jax.random.normal(kx, (n,), jnp.float32))
    y = jax.block_until_ready(jax.random.normal(ky, (n,), jnp.float32))
    for ratio in ratios:
      k = _args.ratio_count(ratio, n)
      top_k = jax.jit(lambda x, k=k: lax.top_k(jnp.abs(x), k)[1])
      trimmed = jax.jit(lambda x, k=k: selection.trimmed_topk(x, k).indices)
      bsearch = jax.jit(lambda x, t, k=k: selection.threshold_binary_search(x, k, threshold=t))
      cold = jnp.zeros((), jnp.float32)
      warm = bsearch(y, cold).threshold
      sel = bsearch(x, warm)
      row = {
          "n": n, "ratio": ratio, "k": k,
          "top_k": _median_ms(top_k, (x,), repeats),
          "trimmed": _median_ms(trimmed, (x,), repeats),
          "bsearch": _median_ms(lambda x, t, f=bsearch: f(x, t).indices, (x, cold), repeats),
          "bsearch_warm": _median_ms(lambda x, t, f=bsearch: f(x, t).indices, (x, warm), repeats),
          "warm_count": int(sel.count),
      }
      rows.append(row)
      _print_row(row)
  return rows


def _print_header() -> None:
  print(f"{'n':>11} {'ratio':>6} {'k':>7} | {'top_k ms':>9} | {'trimmed ms':>10} {'x':>6} |"
        f" {'bsearch ms':>10} {'x':>6} | {'warm ms':>8} {'x':>6} | {'warm count/k':>12}", flush=True)


def _print_row(r: dict) -> None:
  def ratio(key):
    return r["top_k"] / r[key]

  print(f"{r['n']:>11,} {r['ratio']:>6g} {r['k']:>7} | {r['top_k']:>9.1f} |"
        f" {r['trimmed']:>10.1f} {ratio('trimmed'):>5.1f}x | {r['bsearch']:>10.1f}"
        f" {ratio('bsearch'):>5.1f}x | {r['bsearch_warm']:>8.1f} {ratio('bsearch_warm'):>5.1f}x |"
        f" {r['warm_count'] / r['k']:>12.2f}", flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m jaxcomp.bench selection",
      description="RedSync selection (trimmed top-k, threshold binary search) vs lax.top_k.")
  parser.add_argument("--quick", action="store_true", help="small sizes (2^16, 2^18)")
  parser.add_argument("--sizes", type=int, nargs="+", help="vector lengths (default 2^24 and 25,557,032)")
  parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
  parser.add_argument("--repeats", type=int, default=5, help="timed runs per kernel (median)")
  args = parser.parse_args(argv)
  sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
  for r in args.ratios:
    _args.ratio("ratios", r)
  if args.repeats < 1:
    raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
  print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, {os.cpu_count()} cores,"
        f" median of {args.repeats} runs; x ~ N(0, 1) float32; ratio x = top_k ms / kernel ms")
  _print_header()
  run(sizes, args.ratios, args.repeats)


if __name__ == "__main__":
  main()
