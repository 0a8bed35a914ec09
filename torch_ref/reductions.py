"""Log-sum-exp, entropy and token log-probs from PyTorch over the same Triton kernels."""
from __future__ import annotations

import torch

from jax_fusedloss.kernels import reductions as k
from torch_ref import _checks, _launch
from torch_ref._checks import no_double_backward
from torch_ref._launch import run_plan


def _check_temperature(temperature) -> float:
    return _checks.check_float(temperature, "temperature", lo=0.0, lo_open=True)


def _plan(name, x, y, inv_temp, want_entropy):
    n, vocab = x.shape
    return getattr(k, name)(n, vocab, inv_temp=inv_temp, entropy=want_entropy,
                            has_label=y is not None, num_sms=_launch.num_sms(x))


def _fwd(x, y, inv_temp, want_entropy):
    """Per-row (lse, entropy or None, logp or None, lse_lo) of `[N, V]` logits: red_fwd_plan
    (lse_lo: the low part of the log-sum-exp, for the backward)."""
    labels = {} if y is None else dict(y=y)
    lse, ent, logp, lse_lo = run_plan(_plan("red_fwd_plan", x, y, inv_temp, want_entropy),
                                      x=x, **labels)
    return lse, ent if want_entropy else None, logp if y is not None else None, lse_lo


def _bwd(x, y, lse, lse_lo, ent, cot, inv_temp, want_entropy):
    labels = {} if y is None else dict(y=y)
    return run_plan(_plan("red_bwd_plan", x, y, inv_temp, want_entropy), x=x, lse=lse,
                    lse_lo=lse_lo, ent=ent if ent is not None else lse, cot=cot, **labels)[0]


class _Reductions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, inv_temp, want_entropy):
        vocab = logits.shape[-1]
        x = logits.reshape(-1, vocab).contiguous()
        y = None if labels is None else _checks.labels_to_int32(labels, None, vocab)
        lse, ent, logp, lse_lo = _fwd(x, y, inv_temp, want_entropy)
        ctx.inv_temp, ctx.want_entropy, ctx.shape = inv_temp, want_entropy, logits.shape
        ctx.has_label = y is not None
        ctx.save_for_backward(x, y, lse, lse_lo, ent)
        ctx.set_materialize_grads(False)
        lead = logits.shape[:-1]
        return tuple(None if o is None else o.reshape(lead) for o in (lse, ent, logp))

    @staticmethod
    def backward(ctx, g_lse, g_ent, g_logp):
        no_double_backward("logsumexp / entropy / token_logprobs")
        x, y, lse, lse_lo, ent = ctx.saved_tensors
        cot = torch.zeros(x.shape[0], 3, dtype=torch.float32, device=x.device)
        for i, g in enumerate((g_lse, g_ent, g_logp)):
            if g is not None:
                cot[:, i] = g.reshape(-1).float()
        grad = _bwd(x, y, lse, lse_lo, ent, cot, ctx.inv_temp, ctx.want_entropy)
        return grad.reshape(ctx.shape), None, None, None


def _apply(logits, labels, temperature, want_entropy):
    _checks.check_logits(logits)
    return _Reductions.apply(logits, labels, 1.0 / _check_temperature(temperature), want_entropy)


def logsumexp(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """`jax_fusedloss.logsumexp` from PyTorch, on the same Triton kernels (see its docs)."""
    return _apply(logits, None, temperature, False)[0]


def entropy(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """`jax_fusedloss.entropy` from PyTorch, on the same Triton kernels (see its docs)."""
    return _apply(logits, None, temperature, True)[1]


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                   return_entropy: bool = False, check_labels: bool = False):
    """`jax_fusedloss.token_logprobs` from PyTorch, on the same Triton kernels (see its docs;
    `check_labels=True` raises a ValueError naming the first label outside `[0, V)`)."""
    _checks.check_logits(logits)
    _checks.check_int_tensor(labels, "labels", logits.shape[:-1], "logits.shape[:-1]")
    _checks.check_same_device("labels", labels, logits, "logits")
    _checks.check_bool(return_entropy, "return_entropy")
    _checks.check_labels(labels, logits.shape[-1], None,
                         _checks.check_bool(check_labels, "check_labels"))
    _, ent, logp = _apply(logits, labels, temperature, return_entropy)
    return (logp, ent) if return_entropy else logp

