"""Cross-entropy from PyTorch over the same Triton kernels."""
from __future__ import annotations

import torch

from jax_fusedloss.kernels import cross_entropy as k
from torch_ref import _checks, _launch, _weights
from torch_ref._checks import no_double_backward
from torch_ref._launch import run_plan


def _fwd(x, y, row_scale, ignore_index, smoothing, z_loss, softcap, write_grad):
    """Per-row (loss, lse, coef) and the unit-cotangent gradient (or None): ce_fwd_plan."""
    n, vocab = x.shape
    plan = k.ce_fwd_plan(n, vocab, ignore_index=ignore_index, smoothing=smoothing,
                         z_loss=z_loss, softcap=softcap, num_sms=_launch.num_sms(x),
                         write_grad=write_grad, itemsize=x.element_size())
    outs = run_plan(plan, x=x, y=y, row_scale=row_scale)
    return outs if write_grad else outs + (None,)


def _bwd(x, y, lse, coef, softcap):
    n, vocab = x.shape
    plan = k.ce_bwd_plan(n, vocab, softcap=softcap, num_sms=_launch.num_sms(x))
    return run_plan(plan, x=x, y=y, lse=lse, coef=coef)[0]


def scale_rows_(grad: torch.Tensor, cot: torch.Tensor) -> torch.Tensor:
    """grad[i] *= cot[i] in place through scale_rows_kernel (rows with cot == 1 untouched)."""
    n, vocab = grad.shape
    return run_plan(k.scale_rows_plan(n, vocab, grad.element_size()), grad=grad,
                    cot=cot.float().contiguous())[0]


def scaled_saved_grad(grad: torch.Tensor, g: torch.Tensor, per_row: bool) -> torch.Tensor:
    """The saved unit-cotangent gradient (in the logits' shape) times the cotangent g (a
    scalar, or one per row of the flattened logits), never changing `grad` itself, so that a
    second backward through a retained graph sees it unchanged.

    A scalar cotangent of exactly 1 (a plain loss.backward()) returns the saved tensor itself,
    no copy: autograd's AccumulateGrad then takes it over as `.grad` only when nothing else
    holds it (the graph was not retained and released it), and copies it otherwise. Any other
    cotangent rescales a copy."""
    if not per_row and float(g) == 1.0:  # one scalar read (a sync on CUDA)
        return grad
    flat = grad.reshape(-1, grad.shape[-1]).clone()
    cot = g.reshape(-1) if per_row else g.reshape(1).expand(flat.shape[0])
    return scale_rows_(flat, cot.float().contiguous()).view(grad.shape)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index, reduction, smoothing, z_loss, softcap,
                need_lse_grad, token_rows):
        vocab = logits.shape[-1]
        x = logits.reshape(-1, vocab).contiguous()
        y, w, denom, row_scale = token_rows
        write_grad = logits.requires_grad and not need_lse_grad
        loss, lse, coef, grad = _fwd(x, y, row_scale, ignore_index, smoothing, z_loss, softcap,
                                     write_grad)
        ctx.reduction, ctx.softcap = reduction, softcap
        ctx.shape = logits.shape
        if write_grad and x.dtype != torch.float16:
            ctx.save_for_backward(grad.view(logits.shape))  # returned as is: see backward
        elif write_grad:  # float16: x and the row statistics too, for cotangents other than 1
            ctx.save_for_backward(grad.view(logits.shape), x, y, lse, coef)
        else:
            ctx.save_for_backward(x, y, lse, coef)
        out = _weights.ce_reduce(loss, y, w, denom, ignore_index, reduction)
        return out.reshape(labels.shape) if reduction == "none" else out, lse.reshape(
            labels.shape)

    @staticmethod
    def backward(ctx, g_loss, g_lse):
        """The saved unit-cotangent gradient: rescaled for float32/bfloat16 logits; for float16
        returned as is when the cotangent is exactly 1 and otherwise recomputed from the saved
        logits with the cotangent folded into the row coefficients before rounding (a rescale
        would round twice and flush small fp16 entries before a loss scale could save them;
        the recompute costs one more read of the logits and write of the gradient)."""
        no_double_backward("cross_entropy")
        saved = ctx.saved_tensors
        if len(saved) == 1:
            return (scaled_saved_grad(saved[0], g_loss, ctx.reduction == "none"),) + (None,) * 8
        if len(saved) == 5:
            grad, *saved = saved
            if bool((g_loss == 1).all()):  # one read (a sync on CUDA)
                return (grad,) + (None,) * 8
        x, y, lse, coef = saved
        n = x.shape[0]
        cot = (g_loss.reshape(-1) if ctx.reduction == "none" else g_loss.expand(n)).float()
        coef = coef.clone()
        coef[:, :3] *= cot[:, None]  # (a, b, c); lse_lo (fields 3 and 4) stays exact
        if g_lse is not None:
            coef[:, 0] += g_lse.reshape(-1).float()
        grad = _bwd(x, y, lse, coef.contiguous(), ctx.softcap)
        return (grad.reshape(ctx.shape),) + (None,) * 8


check_ce_options = _checks.check_ce_options  # shared with distill_loss


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                  logit_softcap: float | None = None, return_lse: bool = False,
                  check_labels: bool = False, weights: torch.Tensor | None = None,
                  where: torch.Tensor | None = None, num_items=None):
    """`jax_fusedloss.cross_entropy` from PyTorch, on the same Triton kernels (see its docs).

    `weights` (float `[...]`, broadcast against `labels`), `where` (bool, False: ignored) and
    `num_items` (the denominator of "mean") as in JAX: a weight joins the per-row scale of the
    fused gradient and gets no gradient; "mean" divides by the counted tokens' weight sum (1
    where it is 0) unless `num_items` is given. `check_labels=True` raises a ValueError naming
    the first label outside `[0, V)` that is not `ignore_index` (one device-to-host read).

    Validated as the JAX API: shapes, dtypes, label_smoothing in [0, 1], z_loss >= 0,
    logit_softcap in (0, inf) or None, ignore_index in int32 (NaN options are rejected); labels
    of any integer width are range-checked before they are narrowed to int32. The gradient is
    first-order only (backward with create_graph=True raises)."""
    _checks.check_logits(logits)
    _checks.check_int_tensor(labels, "labels", logits.shape[:-1], "logits.shape[:-1]")
    _checks.check_same_device("labels", labels, logits, "logits")
    _checks.check_choice(reduction, "reduction", _checks.REDUCTIONS)
    smoothing, z_loss, logit_softcap = check_ce_options(label_smoothing, z_loss, logit_softcap)
    ignore_index = _checks.check_int(ignore_index, "ignore_index")
    num_items = _checks.check_num_items(num_items, reduction)
    _checks.check_labels(labels, logits.shape[-1], ignore_index,
                         _checks.check_bool(check_labels, "check_labels"))
    y = _checks.labels_to_int32(labels, ignore_index, logits.shape[-1])
    token_rows = _weights.ce_rows(y, labels.shape, ignore_index, reduction, weights, where,
                                  num_items, logits)
    if logits.numel() == 0:
        lead = labels.shape
        loss = (logits.new_zeros(lead, dtype=torch.float32) if reduction == "none"
                else logits.new_zeros((), dtype=torch.float32)) + 0.0 * logits.sum()
        return (loss, logits.new_zeros(lead, dtype=torch.float32)) if return_lse else loss
    loss, lse = _CrossEntropy.apply(logits, labels, ignore_index, reduction, smoothing, z_loss,
                                    logit_softcap, bool(return_lse and torch.is_grad_enabled()),
                                    token_rows)
    return (loss, lse) if return_lse else loss

