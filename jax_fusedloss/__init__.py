"""jax_fusedloss: fused LLM losses for JAX on one set of Triton kernels.

Without JAX installed, `jax_fusedloss.kernels` (framework-free Triton kernels and launch plans)
still imports, so the PyTorch frontend `torch_ref` needs only torch and triton; the JAX API
below is then absent.
"""
__version__ = "0.1.0"

__all__ = ["cross_entropy", "logsumexp", "entropy", "token_logprobs", "merge_partials", "kd_loss",
           "distill_loss", "linear_cross_entropy", "linear_token_logprobs", "linear_kd_loss",
           "linear_distill_loss"]

try:
    import jax  # noqa: F401
except ImportError:  # a torch-only install: kernels and torch_ref work without the JAX API
    __all__ = []
else:
    from jax_fusedloss.cross_entropy import cross_entropy
    from jax_fusedloss.distill import distill_loss
    from jax_fusedloss.kd import kd_loss
    from jax_fusedloss.linear_cross_entropy import linear_cross_entropy
    from jax_fusedloss.linear_token_logprobs import linear_token_logprobs
    from jax_fusedloss.linear_kd import linear_distill_loss, linear_kd_loss
    from jax_fusedloss.reductions import entropy, logsumexp, merge_partials, token_logprobs
