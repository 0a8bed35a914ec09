"""jax_fusedloss: fused LLM losses for JAX on one set of Triton kernels."""
from jax_fusedloss.cross_entropy import cross_entropy
from jax_fusedloss.distill import distill_loss
from jax_fusedloss.kd import kd_loss
from jax_fusedloss.linear_cross_entropy import linear_cross_entropy
from jax_fusedloss.reductions import entropy, logsumexp, merge_partials, token_logprobs

__all__ = ["cross_entropy", "logsumexp", "entropy", "token_logprobs", "merge_partials", "kd_loss",
           "distill_loss", "linear_cross_entropy"]
__version__ = "0.1.0"
