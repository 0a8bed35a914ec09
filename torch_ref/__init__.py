"""PyTorch path over jax_fusedloss's Triton kernels, and plain-PyTorch reference formulas."""
from torch_ref.cross_entropy import cross_entropy, cross_entropy_reference
from torch_ref.kd import distill_loss, distill_loss_reference, kd_loss, kd_loss_reference
from torch_ref.linear_cross_entropy import linear_cross_entropy
from torch_ref.reductions import entropy, logsumexp, reductions_reference, token_logprobs

__all__ = ["cross_entropy", "cross_entropy_reference", "logsumexp", "entropy", "token_logprobs",
           "reductions_reference", "kd_loss", "kd_loss_reference", "distill_loss",
           "distill_loss_reference", "linear_cross_entropy"]
