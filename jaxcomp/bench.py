"""``python -m jaxcomp.bench [SUBCOMMAND] [options]``: the main job and the benchmarks' command line.

The benchmarks are not part of the library: they live in the ``jaxcomp_bench``
package (``benchmarks/jaxcomp_bench/``, installed beside ``jaxcomp`` by
``pip install -e .``); this module only starts them. Without a subcommand it
runs the main job (every method trained on real MNIST digits over 8 CPU devices);
``--help`` lists the subcommands.
"""

if __name__ == "__main__":
  import sys

  from jaxcomp_bench import __main__ as cli
  from jaxcomp_bench import malloc

  cli.main(malloc.reexec_with_caching_malloc(sys.argv[1:]))
