"""Benchmarks: ``python -m jaxcomp.bench [SUBCOMMAND] [options]``."""
