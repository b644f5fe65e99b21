"""The ``Example:`` sections of the main factories' docstrings run, and print what they show (issue 23)."""

import doctest
import inspect
import re

import pytest

import jaxcomp

# Each example is local (axis_name=None, one device), on a small tree, and prints
# something deterministic (wire bytes, a shape, signs): together a few seconds.
FACTORIES = ("topk", "qsgd", "powersgd", "signsgd", "dgc", "sbc", "acpsgd", "inceptionn")


@pytest.mark.parametrize("name", FACTORIES)
def test_docstring_example_runs(name):
  factory = getattr(jaxcomp, name)
  tests = doctest.DocTestFinder(recurse=False).find(factory, f"jaxcomp.{name}", globs={})
  examples = [e for t in tests for e in t.examples]
  assert examples, f"jaxcomp.{name}'s docstring has no example (an 'Example:' section of >>> lines)"
  report = []
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  for test in tests:
    runner.run(test, out=report.append)
  assert runner.failures == 0, "".join(report)


@pytest.mark.parametrize("name", sorted(jaxcomp.METHODS))
def test_every_parameter_is_named_in_the_args_section(name):
  """Each factory's ``Args:`` names every one of its parameters (alone or in a shared line)."""
  factory = jaxcomp.METHODS[name]
  doc = inspect.getdoc(factory) or ""
  section = re.search(r"^Args:\n(.*?)(?:\n\S|\Z)", doc, re.S | re.M)
  assert section, f"jaxcomp.{name}'s docstring has no Args: section"
  params = [p.name for p in inspect.signature(factory).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
  missing = [p for p in params if not re.search(rf"(?<![\w.]){p}\b", section.group(1))]
  assert not missing, f"jaxcomp.{name}'s Args: section does not name {missing}"
