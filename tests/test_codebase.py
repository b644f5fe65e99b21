"""The shape of the codebase (issue 23): no import circles, short functions, small modules,
declared plugins.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxcomp"
BENCH_ROOT = ROOT.parent / "benchmarks" / "jaxcomp_bench"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400  # the library's; the benchmarks' (jaxcomp_bench) 600
MAX_BENCH_MODULE_LINES = 600
MAX_TOP_LEVEL_MODULES = 10  # the rest in subpackages named for their layer
# Plugin capabilities (jaxcomp.core.protocol's bases, jaxcomp.exchanges.scatter's mixins,
# Method.sync_every) and the attributes of a jaxcomp transformation: never probed with getattr.
CAPABILITIES = {"linear", "shared_key", "carries_nonfinite", "block", "wants_params", "all_reduces",
                "vmappable", "scatter_codec", "owner_codec", "selects", "leaf_segments", "sync_every",
                "method", "dense_axis_name", "axis_name", "compressor", "by_segment"}
PLUGIN_BASES = ("Memory", "Codec", "Exchange")  # in jaxcomp.core.protocol


def _modules():
  out = {}
  for path in sorted(ROOT.rglob("*.py")) + sorted(BENCH_ROOT.rglob("*.py")):
    base = ROOT.parent if path.is_relative_to(ROOT) else BENCH_ROOT.parent
    parts = path.relative_to(base).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = (path, ast.parse(path.read_text(), str(path)))
  return out


MODULES = _modules()


def _imports(name, tree):
  """Every jaxcomp module ``name`` imports, at the top or inside a function."""
  package = name if MODULES[name][0].name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                        + ([base] if base else []))
      subs = {f"{base}.{a.name}" for a in node.names}
      out |= subs & set(MODULES)
      if not subs <= set(MODULES):  # a name defined in ``base`` itself (its __init__ for a package)
        out.add(base)
  return {m for m in out if m in MODULES and m != name}


def _cycle(graph):
  state = {}

  def visit(n, stack):
    state[n] = 1
    for m in sorted(graph[n]):
      if state.get(m) == 1:
        return stack[stack.index(m):] + [m]
      if m not in state:
        found = visit(m, stack + [m])
        if found:
          return found
    state[n] = 2
    return None

  for n in sorted(graph):
    if n not in state:
      found = visit(n, [n])
      if found:
        return found
  return None


def test_no_import_circles():
  graph = {name: _imports(name, tree) for name, (_, tree) in MODULES.items()}
  # a package imports its submodules by importing them; a submodule importing its package's
  # __init__ (``from jaxcomp import X``) is an edge to it as well
  assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_functions_short():
  long = []
  for name, (_, tree) in MODULES.items():
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = node.end_lineno - node.lineno + 1
        if n > MAX_FUNCTION_LINES:
          long.append(f"{name}.{node.name}: {n} lines")
  assert not long, long


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_small(name):
  path = MODULES[name][0]
  most = MAX_BENCH_MODULE_LINES if name.startswith("jaxcomp_bench") else MAX_MODULE_LINES
  assert len(path.read_text().splitlines()) <= most, path


LAB_NOTE = re.compile(r"20\d\d-\d\d-\d\d|\b\d\d?:\d\d\b|\bUTC\b|\b\d+(\.\d+)? ?(ms|us|µs)\b|"
                      r"\(measured|[Mm]easured:|recalled|in that run")


def test_docstrings_explain_not_report():
  """No dates, clock times, timings or hedges in the library's docstrings: figures live in
  docs/benchmarks.md with their date and command."""
  found = []
  for name, (_, tree) in MODULES.items():
    if not name.startswith("jaxcomp."):
      continue
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    for node in nodes:
      doc = ast.get_docstring(node) or ""
      found += [f"{name}.{getattr(node, 'name', '')}: {m.group(0)!r}" for m in LAB_NOTE.finditer(doc)]
  assert not found, found


def test_top_level_modules_few():
  """The library's top level holds few modules; the rest sit in subpackages named for their layer."""
  top = sorted(p.name for p in ROOT.glob("*.py"))
  assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_library_does_not_import_the_benchmarks():
  """What ships as jaxcomp is the library: only the ``python -m jaxcomp.bench`` entry starts jaxcomp_bench."""
  users = sorted(name for name, (_, tree) in MODULES.items()
                 if name.startswith("jaxcomp.") and name != "jaxcomp.bench"
                 and any(m.startswith("jaxcomp_bench") for m in _imports(name, tree)))
  assert not users, users


def test_no_capability_probes():
  """Plugin capabilities are declared on the base classes (jaxcomp.core.protocol), never probed."""
  probes = []
  for name, (_, tree) in MODULES.items():
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
          node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and \
          isinstance(node.args[1], ast.Constant) and node.args[1].value in CAPABILITIES:
        probes.append(f"{name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
  assert not probes, probes


def _declared(module: str, classes) -> set:
  """Class-level attributes (``name: type = default``) of ``classes`` in ``module``."""
  out = set()
  for node in MODULES[module][1].body:
    if isinstance(node, ast.ClassDef) and node.name in classes:
      out |= {a.target.id for a in node.body
              if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
  return out


def test_plugin_capabilities_few_and_read_elsewhere():
  """At most 8 capabilities on the plugin bases, each read outside jaxcomp.core.protocol; all of them,
  and the scatter mixins', listed in CAPABILITIES."""
  base = _declared("jaxcomp.core.protocol", PLUGIN_BASES)
  assert len(base) <= 8, sorted(base)
  scatter = _declared("jaxcomp.exchanges.scatter", ("ScatterCodec",)) | {"owner_codec", "scatter_codec"}
  assert base | scatter <= CAPABILITIES, (base | scatter) - CAPABILITIES
  for cap in base:
    readers = [name for name, (_, tree) in MODULES.items() if name != "jaxcomp.core.protocol" and any(
        isinstance(n, ast.Attribute) and n.attr == cap and isinstance(n.ctx, ast.Load)
        for n in ast.walk(tree))]
    assert readers, f"{cap} is read nowhere outside jaxcomp.core.protocol"


def test_private_names_stay_home():
  """No module imports another module's private name (a leading underscore)."""
  crossing = []
  for name, (_, tree) in MODULES.items():
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxcomp"):
        crossing += [f"{name}: from {node.module} import {a.name}" for a in node.names
                     if a.name.startswith("_") and not a.name.startswith("__")
                     and a.name != "_args"]
  assert not crossing, crossing


def test_ruff_clean():
  """Line length and import order (pyproject.toml's [tool.ruff]) hold across the project."""
  import shutil
  import subprocess
  import sys

  ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
  root = ROOT.parent
  out = subprocess.run([ruff, "check", "jaxcomp", "tests", "examples", "benchmarks"], cwd=root,
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
