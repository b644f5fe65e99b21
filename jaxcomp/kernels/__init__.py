"""Kernels that codecs share: selection, compaction and random numbers, on a flat bucket.

Nothing here knows about methods, memories or collectives; every function
works on arrays (a bucket's flat float32 vector and its static
:class:`jaxcomp.core.layout.Segments`) and compiles to a few fused XLA kernels:

- :mod:`jaxcomp.kernels.compaction`: masks packed into 32-bit words, prefix
  sums, per-segment counts and caps, and the compaction of a mask into
  positions with nothing of the bucket's size sorted or scattered;
- :mod:`jaxcomp.kernels.selection`: RedSync's sort-free top-k (threshold
  binary search, trimmed top-k), per segment of a bucket;
- :mod:`jaxcomp.kernels.segtopk`: the exact top-k of every segment by one
  vectorised bisection on the magnitudes' bit patterns;
- :mod:`jaxcomp.kernels.rng`: a counter-based uniform generator for
  stochastic rounding, fused into the rounding kernel.
"""
