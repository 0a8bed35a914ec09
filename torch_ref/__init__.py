"""The PyTorch frontend of jax_fusedloss: the same Triton kernels and options from
`torch.autograd.Function` classes. (The tests' naive reference formulas live in
tests/reference/.)"""
from torch_ref.cross_entropy import cross_entropy
from torch_ref.kd import distill_loss, kd_loss
from torch_ref.linear_cross_entropy import linear_cross_entropy
from torch_ref.linear_kd import linear_distill_loss, linear_kd_loss
from torch_ref.linear_token_logprobs import linear_token_logprobs
from torch_ref.reductions import entropy, logsumexp, token_logprobs

__all__ = ["cross_entropy", "logsumexp", "entropy", "token_logprobs", "kd_loss", "distill_loss",
           "linear_cross_entropy", "linear_token_logprobs", "linear_kd_loss",
           "linear_distill_loss"]
