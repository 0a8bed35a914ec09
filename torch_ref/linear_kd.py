"""Distillation from hidden states from PyTorch: `jax_fusedloss.linear_kd_loss` and
`linear_distill_loss` over the same KD Triton kernels, with torch matmuls: the token walk of
jax_fusedloss's LM-head skeleton, in modes "fast" (dW summed in float32) and "low_precision"
(dW summed in the weight's dtype). The gradient for a unit cotangent is computed in the forward
(three matmuls a chunk); per-token cotangents (`reduction="none"`) walk again in the backward
with the cotangent folded into the row weights. Not here (JAX only): mode="lean", tail=True
and divergence="jsd"."""
from __future__ import annotations

import torch

from jax_fusedloss import _validate
from jax_fusedloss.kernels.linear_ce import chunk_rows
from torch_ref import _checks
from torch_ref._checks import no_double_backward
from torch_ref.cross_entropy import check_ce_options
from torch_ref.kd import _check, _denominator, _prepare, _rows
from torch_ref.linear_cross_entropy import _accumulate, _logits, check_head

MODES = ("fast", "low_precision")


def _walk(h, w, b, rows, layout, chunk, options, grads, dw_dtype):
    """(per-row loss, dH, dW, db) over token chunks; rows = (ids, lp, y, row_scale)."""
    n = h.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if grads else None
    dw = torch.zeros(w.shape, dtype=dw_dtype, device=w.device) if grads else None
    db = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if grads and b is not None \
        else None
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        hc = h[start:stop]
        z = _logits(hc, w, b, layout).contiguous()
        loss[start:stop], g = _rows(z, *(r[start:stop].contiguous() for r in rows),
                                    *options[:4], grads, *options[4])
        if grads:
            _accumulate(hc, w, g, layout, dh, dw, db, start)
    return loss, dh, dw, db


class _LinearKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, lp, y, row_scale, layout, chunk, mode, reduction,
                options):
        h = hidden.reshape(-1, hidden.shape[-1])
        dw_dtype = torch.float32 if mode == "fast" else weight.dtype
        grads = reduction != "none" and (hidden.requires_grad or weight.requires_grad or (
            bias is not None and bias.requires_grad)) and torch.is_grad_enabled()
        loss, dh, dw, db = _walk(h, weight, bias, (ids, lp, y, row_scale), layout, chunk,
                                 options, grads, dw_dtype)
        ctx.args = (layout, chunk, options, dw_dtype, reduction, hidden.shape, grads,
                    None if bias is None else bias.dtype)
        if grads:
            ctx.save_for_backward(dh, dw.to(weight.dtype), db)
        else:
            ctx.save_for_backward(h, weight, bias, ids, lp, y, row_scale)
        return loss if reduction == "none" else loss.sum()

    @staticmethod
    def backward(ctx, g):
        no_double_backward("linear_kd_loss / linear_distill_loss")
        layout, chunk, options, dw_dtype, reduction, shape, grads, b_dtype = ctx.args
        if grads:
            dh, dw, db = ctx.saved_tensors
            s = g.float()
            out = ((dh.float() * s).to(dh.dtype), (dw.float() * s).to(dw.dtype),
                   None if db is None else db * s)
        else:
            h, w, b, ids, lp, y, row_scale = ctx.saved_tensors
            cot = (g.reshape(-1) if reduction == "none" else g.reshape(1).expand(h.shape[0]))
            scaled = (row_scale * cot.float()[:, None]).contiguous()
            _, dh, dw, db = _walk(h, w, b, (ids, lp, y, scaled), layout, chunk, options, True,
                                  dw_dtype)
            out = (dh, dw.to(w.dtype), db)
        dh, dw, db = out
        return (dh.reshape(shape), dw, None if db is None else db.to(b_dtype)) \
            + (None,) * 9


def _token_weights(weights, where, lead, device):
    """(float32 [N] weights or None, bool [N] where or None), as jax_fusedloss's."""
    w = None if weights is None else weights.expand(lead).reshape(-1).float()
    keep = None if where is None else where.expand(lead).reshape(-1)
    if keep is not None:
        w = torch.where(keep, torch.ones((), device=device) if w is None else w,
                        torch.zeros((), device=device))
    return w, keep


def _column(coef, counted, w, n, reduction, num_items, device):
    base = torch.ones(n, device=device) if w is None else w
    col = coef * base
    if reduction == "mean":
        total = torch.where(counted, base, torch.zeros((), device=device)).sum()
        if w is not None and num_items is None:
            col = col / torch.where(total == 0, torch.ones((), device=device), total)
        else:
            col = col / _denominator(counted.sum() if w is None else total, num_items)
    return col


def _run(hidden, weight, labels, teacher_ids, teacher_logprobs, mask, *, alpha, bias,
         weight_layout, temperature, ignore_index, ce, normalize, reduction, num_items,
         temperature_squared, tail, divergence, weights, where, mode, chunk_size):
    vocab = check_head(hidden, weight, bias, weight_layout)
    lead = hidden.shape[:-1]
    _validate.check_teacher_shapes(tuple(lead) + (vocab,), tuple(teacher_ids.shape),
                                   tuple(teacher_logprobs.shape),
                                   None if mask is None else tuple(mask.shape))
    t = _check(temperature, normalize, reduction, num_items)
    _checks.check_choice(mode, "mode", MODES)
    if tail or divergence != "kl":
        raise NotImplementedError("torch_ref's linear distillation runs neither tail=True nor "
                                  "divergence=\"jsd\": use jax_fusedloss")
    ce_options = check_ce_options(*ce)
    dev = hidden.device
    n = hidden.numel() // hidden.shape[-1]
    w, keep = _token_weights(weights, where, lead, dev)
    if labels is not None:
        y = _checks.labels_to_int32(labels, ignore_index, vocab)
        if keep is not None:
            y = torch.where(keep, y, torch.full_like(y, ignore_index))
        active = y != ignore_index
    else:
        y, active = torch.zeros(n, dtype=torch.int32, device=dev), keep
    fake = torch.empty(tuple(lead) + (vocab,), device="meta")  # shape only
    ids, lp, has_entry = _prepare(fake, teacher_ids.to(dev), teacher_logprobs, mask, active)
    kd_w = 1.0 if labels is None else (1.0 - alpha) * (t * t if temperature_squared else 1.0)
    ce_col = (torch.zeros(n, device=dev) if labels is None
              else _column(alpha, active, w, n, reduction, num_items, dev))
    row_scale = torch.stack([ce_col, _column(kd_w, has_entry, w, n, reduction, num_items, dev)],
                            1).contiguous()
    chunk = chunk_size or chunk_rows(n, vocab, hidden.element_size(), mode)
    options = (t, normalize, labels is not None, ignore_index if labels is not None else -1,
               ce_options if labels is not None else (0.0, 0.0, None))
    loss = _LinearKD.apply(hidden, weight, bias, ids, lp, y, row_scale, weight_layout,
                           int(chunk), mode, reduction, options)
    return loss.reshape(lead) if reduction == "none" else loss


def linear_kd_loss(hidden, weight, teacher_ids, teacher_logprobs, mask=None, *, bias=None,
                   weight_layout="dv", temperature=1.0, normalize="full", reduction="mean",
                   num_items=None, tail=False, divergence="kl", weights=None, where=None,
                   mode="fast", chunk_size=None) -> torch.Tensor:
    """`jax_fusedloss.linear_kd_loss` from PyTorch (modes "fast" and "low_precision"; no
    tail): the KD Triton kernels on torch matmuls' chunks of logits."""
    return _run(hidden, weight, None, teacher_ids, teacher_logprobs, mask, alpha=None,
                bias=bias, weight_layout=weight_layout, temperature=temperature,
                ignore_index=-100, ce=(0.0, 0.0, None), normalize=normalize,
                reduction=reduction, num_items=num_items, temperature_squared=False, tail=tail,
                divergence=divergence, weights=weights, where=where, mode=mode,
                chunk_size=chunk_size)


def linear_distill_loss(hidden, weight, labels, teacher_ids, teacher_logprobs, mask=None, *,
                        alpha, bias=None, weight_layout="dv", temperature=1.0,
                        ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=None,
                        normalize="full", reduction="mean", num_items=None,
                        temperature_squared=False, tail=False, divergence="kl", weights=None,
                        where=None, mode="fast", chunk_size=None) -> torch.Tensor:
    """`jax_fusedloss.linear_distill_loss` from PyTorch (modes "fast" and "low_precision"; no
    tail): the distillation Triton kernels on torch matmuls' chunks of logits."""
    alpha = _checks.check_float(alpha, "alpha", lo=0.0, hi=1.0)
    return _run(hidden, weight, labels, teacher_ids, teacher_logprobs, mask, alpha=alpha,
                bias=bias, weight_layout=weight_layout, temperature=temperature,
                ignore_index=_checks.check_int(ignore_index, "ignore_index"),
                ce=(label_smoothing, z_loss, logit_softcap), normalize=normalize,
                reduction=reduction, num_items=num_items,
                temperature_squared=temperature_squared, tail=tail, divergence=divergence,
                weights=weights, where=where, mode=mode, chunk_size=chunk_size)
