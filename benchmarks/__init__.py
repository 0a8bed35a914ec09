"""GPU benchmark suite: python -m benchmarks.run --out DIR (see benchmarks/README.md)."""
