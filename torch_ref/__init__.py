"""PyTorch path over jax_fusedloss's Triton kernels, and plain-PyTorch reference formulas."""
from torch_ref.cross_entropy import cross_entropy, cross_entropy_reference

__all__ = ["cross_entropy", "cross_entropy_reference"]
