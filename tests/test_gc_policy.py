"""The suite's cycle-collector policy (tests/conftest.py, ``_fewer_garbage_collections``)."""

import gc


def test_the_import_time_objects_are_frozen_and_collections_are_rarer():
  assert gc.isenabled()  # cycles are still collected, only less often
  assert gc.get_freeze_count() > 10_000  # JAX's and the libraries' objects, never walked again
  assert gc.get_threshold() == (20_000, 20, 20)


def test_a_cycle_is_still_collected():
  class Node:
    pass

  a, b = Node(), Node()
  a.other, b.other = b, a
  del a, b
  assert gc.collect() >= 2
