"""Training with jaxcomp: data parallelism over meshes and processes, sharded models, the user's own
step, non-finite steps, checkpoints, recipes, and DiLoCo."""
