"""jax_fusedloss: fused LLM losses for JAX on one set of Triton kernels."""
from jax_fusedloss.cross_entropy import cross_entropy

__all__ = ["cross_entropy"]
__version__ = "0.1.0"
