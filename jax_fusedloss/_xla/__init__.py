"""Pure-JAX chunked twins of the Triton kernels (CPU/TPU fallback and a second oracle)."""
