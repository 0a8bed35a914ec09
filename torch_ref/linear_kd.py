"""Distillation from hidden states from PyTorch: `jax_fusedloss.linear_kd_loss` and
`linear_distill_loss` with torch matmuls on the walks of jax_fusedloss's LM-head skeleton, in
modes "fast" (dW summed in float32), "low_precision" (dW summed in the weight's dtype) and
"lean" (the forward keeps per-row statistics; the backward walks vocabulary blocks,
torch_ref.linear_cross_entropy.vocab_walk, sized by head_sizes as in JAX). Rows: the KD Triton
kernels, or float64 torch rows (torch_ref/_kd_rows64.py) for tail=True and for the lean
backward's blocks. "fast"/"low_precision" compute the gradient for a unit cotangent in the
forward (three matmuls a chunk); per-token cotangents (`reduction="none"`) and float16 walk
again in the backward with the cotangent folded into the row weights."""
from __future__ import annotations

import torch

from jax_fusedloss import _validate
from torch_ref import _checks, _kd_rows64
from torch_ref._checks import no_double_backward
from torch_ref._kd_rows64 import Form
from torch_ref.cross_entropy import check_ce_options
from torch_ref.kd import _check, _prepare, _rows, check_divergence, row_scales, token_weights
from torch_ref.linear_cross_entropy import (MODES, _accumulate, _logits, check_head, head_sizes,
                                            vocab_walk)


def _walk(h, w, b, rows, layout, chunk, form, grads, dw_dtype, want_stats=False):
    """(per-row loss, dH, dW, db, stats or None) over token chunks; rows = (ids, lp, y,
    row_scale)."""
    n = h.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if grads else None
    dw = torch.zeros(w.shape, dtype=dw_dtype, device=w.device) if grads else None
    db = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if grads and b is not None \
        else None
    stats = []
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        hc = h[start:stop]
        z = _logits(hc, w, b, layout).contiguous()
        loss[start:stop], g, st = _rows(z, *(r[start:stop].contiguous() for r in rows), form,
                                        grads, want_stats)
        stats.append(st)
        if grads:
            _accumulate(hc, w, g, layout, dh, dw, db, start)
        del z, g
    return loss, dh, dw, db, (torch.cat(stats) if want_stats else None)


class _LinearKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, lp, y, row_scale, layout, sizes, mode, reduction,
                form):
        h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        dw_dtype = torch.float32 if mode == "fast" else weight.dtype
        # as jax_fusedloss._lm_head.fuses_grad: per-token cotangents, float16 and "lean"
        # recompute in the backward
        grads = (reduction != "none" and mode != "lean" and hidden.dtype != torch.float16
                 and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
        lean = mode == "lean"
        loss, dh, dw, db, stats = _walk(h, weight, bias, (ids, lp, y, row_scale), layout,
                                        sizes[0], form, grads, dw_dtype, want_stats=lean)
        ctx.args = (layout, sizes, form, dw_dtype, reduction, hidden.shape, grads,
                    None if bias is None else bias.dtype, mode)
        if grads:
            ctx.save_for_backward(dh, dw.to(weight.dtype), db)
        else:
            ctx.save_for_backward(h, weight, bias, ids, lp, y, row_scale, stats)
        return loss if reduction == "none" else loss.sum()

    @staticmethod
    def backward(ctx, g):
        no_double_backward("linear_kd_loss / linear_distill_loss")
        layout, sizes, form, dw_dtype, reduction, shape, grads, b_dtype, mode = ctx.args
        if grads:
            dh, dw, db = ctx.saved_tensors
            s = g.float()
            dh, dw, db = ((dh.float() * s).to(dh.dtype), (dw.float() * s).to(dw.dtype),
                          None if db is None else db * s)
        else:
            h, w, b, ids, lp, y, row_scale, stats = ctx.saved_tensors
            cot = (g.reshape(-1) if reduction == "none" else g.reshape(1).expand(h.shape[0]))
            cot = cot.float()[:, None]
            if mode == "lean":  # the vocabulary walk, the cotangent folded into the row weights
                st = stats.clone()
                st[:, 3:5] *= cot.to(st.dtype)
                vocab = w.shape[1] if layout == "dv" else w.shape[0]

                def block_grad(z, sl, c0, c1):
                    return _kd_rows64.block_grad(z, c0, ids[sl], lp[sl], y[sl], st[sl], form,
                                                 vocab)

                dh, dw, db = vocab_walk(h, w, b, layout, sizes[1], (True,) * 3, block_grad)
                dh = dh.to(h.dtype)
            else:
                _, dh, dw, db, _ = _walk(h, w, b, (ids, lp, y, (row_scale * cot).contiguous()),
                                         layout, sizes[0], form, True, dw_dtype)
                dw = dw.to(w.dtype)
        return (dh.reshape(shape), dw, None if db is None else db.to(b_dtype)) \
            + (None,) * 9


def _run(hidden, weight, labels, teacher_ids, teacher_logprobs, mask, *, alpha, bias,
         weight_layout, temperature, ignore_index, ce, normalize, reduction, num_items,
         temperature_squared, tail, divergence, beta, weights, where, mode, chunk_size):
    vocab = check_head(hidden, weight, bias, weight_layout)
    lead = hidden.shape[:-1]
    _validate.check_teacher_shapes(tuple(lead) + (vocab,), tuple(teacher_ids.shape),
                                   tuple(teacher_logprobs.shape),
                                   None if mask is None else tuple(mask.shape))
    t = _check(temperature, normalize, reduction, num_items)
    tail, divergence, beta = check_divergence(tail, divergence, beta, normalize)
    _checks.check_choice(mode, "mode", MODES)
    ce_options = check_ce_options(*ce)
    dev = hidden.device
    n = hidden.numel() // hidden.shape[-1]
    w, keep = token_weights(weights, where, lead, hidden)
    if labels is not None:
        _checks.check_int_tensor(labels, "labels", lead, "hidden.shape[:-1]")
        y = _checks.labels_to_int32(labels, ignore_index, vocab)
        if keep is not None:
            y = torch.where(keep, y, torch.full_like(y, ignore_index))
        active = y != ignore_index
    else:
        y, active = torch.zeros(n, dtype=torch.int32, device=dev), keep
    fake = torch.empty(tuple(lead) + (vocab,), device="meta")  # shape only
    ids, lp, has_entry = _prepare(fake, teacher_ids.to(dev), teacher_logprobs, mask, active)
    distill = labels is not None
    kd_w = 1.0 if not distill else (1.0 - alpha) * _validate.check_temperature_squared(
        t, temperature_squared)
    row_scale = row_scales(((alpha, active) if distill else (0.0, None), (kd_w, has_entry)), w,
                           reduction, num_items)
    if n == 0:  # zeros, with zero gradients
        zero = (hidden.sum() + weight.sum()).float() * 0.0
        zero = torch.where(torch.isfinite(zero), zero, 0.0).abs()
        return hidden.new_zeros(lead, dtype=torch.float32) + zero if reduction == "none" \
            else zero
    sizes = head_sizes(n, vocab, hidden.dtype, mode, chunk_size)
    form = Form(t, normalize, distill, ignore_index if distill else -1,
                *(ce_options if distill else (0.0, 0.0, None)), tail=tail,
                divergence=divergence, beta=beta)
    loss = _LinearKD.apply(hidden, weight, bias, ids, lp, y.contiguous(), row_scale,
                           weight_layout, sizes, mode, reduction, form)
    return loss.reshape(lead) if reduction == "none" else loss


def linear_kd_loss(hidden, weight, teacher_ids, teacher_logprobs, mask=None, *, bias=None,
                   weight_layout="dv", temperature=1.0, normalize="full", reduction="mean",
                   num_items=None, tail=False, divergence="kl", beta=0.5, weights=None,
                   where=None, mode="fast", chunk_size=None) -> torch.Tensor:
    """`jax_fusedloss.linear_kd_loss` from PyTorch (see its docs; every option but
    `implementation` and `vocab_axis`): the KD Triton kernels on torch matmuls' chunks of
    logits (tail=True: float64 torch rows), modes "fast", "low_precision" and "lean"."""
    return _run(hidden, weight, None, teacher_ids, teacher_logprobs, mask, alpha=None,
                bias=bias, weight_layout=weight_layout, temperature=temperature,
                ignore_index=-100, ce=(0.0, 0.0, None), normalize=normalize,
                reduction=reduction, num_items=num_items, temperature_squared=False, tail=tail,
                divergence=divergence, beta=beta, weights=weights, where=where, mode=mode,
                chunk_size=chunk_size)


def linear_distill_loss(hidden, weight, labels, teacher_ids, teacher_logprobs, mask=None, *,
                        alpha, bias=None, weight_layout="dv", temperature=1.0,
                        ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=None,
                        normalize="full", reduction="mean", num_items=None,
                        temperature_squared=False, tail=False, divergence="kl", beta=0.5,
                        weights=None, where=None, mode="fast",
                        chunk_size=None) -> torch.Tensor:
    """`jax_fusedloss.linear_distill_loss` from PyTorch (see its docs; every option but
    `implementation` and `vocab_axis`): as `linear_kd_loss`, with the label cross-entropy."""
    alpha = _checks.check_float(alpha, "alpha", lo=0.0, hi=1.0)
    return _run(hidden, weight, labels, teacher_ids, teacher_logprobs, mask, alpha=alpha,
                bias=bias, weight_layout=weight_layout, temperature=temperature,
                ignore_index=_checks.check_int(ignore_index, "ignore_index"),
                ce=(label_smoothing, z_loss, logit_softcap), normalize=normalize,
                reduction=reduction, num_items=num_items,
                temperature_squared=temperature_squared, tail=tail, divergence=divergence,
                beta=beta, weights=weights, where=where, mode=mode, chunk_size=chunk_size)
