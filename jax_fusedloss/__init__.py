"""jax_fusedloss: fused LLM losses for JAX on one set of Triton kernels.

The public functions load on first use, so `jax_fusedloss.kernels` (framework-free Triton
kernels and launch plans) imports without JAX: the PyTorch frontend `torch_ref` needs only
torch and triton.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "cross_entropy": "jax_fusedloss.cross_entropy",
    "distill_loss": "jax_fusedloss.distill",
    "kd_loss": "jax_fusedloss.kd",
    "linear_cross_entropy": "jax_fusedloss.linear_cross_entropy",
    "logsumexp": "jax_fusedloss.reductions",
    "entropy": "jax_fusedloss.reductions",
    "token_logprobs": "jax_fusedloss.reductions",
    "merge_partials": "jax_fusedloss.reductions",
}
__all__ = ["cross_entropy", "logsumexp", "entropy", "token_logprobs", "merge_partials", "kd_loss",
           "distill_loss", "linear_cross_entropy"]

if TYPE_CHECKING:
    from jax_fusedloss.cross_entropy import cross_entropy
    from jax_fusedloss.distill import distill_loss
    from jax_fusedloss.kd import kd_loss
    from jax_fusedloss.linear_cross_entropy import linear_cross_entropy
    from jax_fusedloss.reductions import entropy, logsumexp, merge_partials, token_logprobs


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jax_fusedloss' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
