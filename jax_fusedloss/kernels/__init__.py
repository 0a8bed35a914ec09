"""Framework-free Triton kernels (import triton only) and their launch heuristics."""
