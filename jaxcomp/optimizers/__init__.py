"""Complete optimizers that own their exchange: what travels is not the gradient.

- :mod:`jaxcomp.optimizers.onebit_adam`: 1-bit Adam (:func:`jaxcomp.onebit_adam`, the
  momentum compressed once the variance is frozen) and its scaling,
  :func:`jaxcomp.scale_by_onebit_adam`;
- :mod:`jaxcomp.optimizers.zero_one_adam`: 0/1 Adam (:func:`jaxcomp.zero_one_adam`,
  adaptive variance freezing, local steps and 1-bit syncs);
- :mod:`jaxcomp.optimizers.demo`: DeMo (:func:`jaxcomp.demo`, decoupled momentum whose
  fast DCT components alone travel; a sign step);
- :mod:`jaxcomp.optimizers.common`: what the Adams share (their settings' checks, the
  codec that moves their payload).

Each returns a :class:`jaxcomp.core.compression.CompressedOptimizer`: an optax
transformation with ``.compressor``, the jaxcomp transformation inside (for
:func:`jaxcomp.wire_bytes`). The codecs they use live in :mod:`jaxcomp.transforms`.
"""
