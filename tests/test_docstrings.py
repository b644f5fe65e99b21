"""The ``Example:`` sections of the main factories' docstrings run, and print what they show (issue 23)."""

import doctest

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
