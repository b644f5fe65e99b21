"""The core: the plugin protocol, a method's bucket plan, the builder that makes it an optax
transformation, its checks, its byte accounting, and transformations rebuilt from others."""
