"""Exchange forms beyond one all-gather or psum per bucket: the scatter transport (bytes flat in the
number of workers) and the two-level hierarchy (dense inside a node, compressed between nodes)."""
