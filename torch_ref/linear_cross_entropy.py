"""Fused linear cross-entropy from PyTorch: the walks and memory modes of jax_fusedloss's
LM-head skeleton (jax_fusedloss/_lm_head.py) with torch matmuls and the same CE kernels; each
chunk's logits gradient is written in place over the chunk's logits."""
from __future__ import annotations

import torch

from jax_fusedloss import _validate
from jax_fusedloss.kernels import cross_entropy as _ce_plans
from jax_fusedloss.kernels.linear_ce import budget_rows, chunk_rows, vocab_block
from torch_ref import _checks, _launch, _weights
from torch_ref._checks import no_double_backward

# The chunk's logits gradient overwrites the chunk's logits (as in jax_fusedloss); False only
# to compare.
_IN_PLACE = True


MODES = ("fast", "lean", "low_precision")


def default_chunk_size(n: int, vocab: int, dtype: torch.dtype, mode: str = "fast") -> int:
    """Tokens per chunk: see jax_fusedloss.linear_cross_entropy.default_chunk_size and
    kernels/linear_ce.py."""
    return chunk_rows(n, vocab, torch.empty((), dtype=dtype).element_size(), mode)


def head_sizes(n: int, vocab: int, dtype: torch.dtype, mode: str,
               chunk_size: int | None) -> tuple[int, int]:
    """(tokens per chunk of the token walk, `block_chunk`: the lean backward's blocks hold
    `block_chunk * V` logits) for every torch_ref linear frontend, the rule of
    jax_fusedloss._lm_head.head_options: `chunk_size` for both when given, else the default
    chunk and the 128 MiB budget (`kernels.linear_ce.budget_rows`)."""
    if chunk_size is None:
        return (default_chunk_size(n, vocab, dtype, mode),
                budget_rows(vocab, torch.empty((), dtype=dtype).element_size()))
    chunk = min(_checks.check_int(chunk_size, "chunk_size", lo=1), max(n, 1))
    return chunk, chunk


def _chunk_fwd(z, y, row_scale, o, write_grad):
    """ce_fwd_plan over one chunk's logits z: (loss, lse, coef, grad or None); grad is z itself
    (overwritten) when in place."""
    n, vocab = z.shape
    plan = _ce_plans.ce_fwd_plan(n, vocab, ignore_index=o[0], smoothing=o[1], z_loss=o[2],
                                 softcap=o[3], num_sms=_launch.num_sms(z), write_grad=write_grad,
                                 itemsize=z.element_size(), in_place=_IN_PLACE)
    outs = _launch.run_plan(plan, x=z, y=y, row_scale=row_scale)
    return outs if write_grad else outs + (None,)


def _chunk_bwd(z, y, lse, coef, softcap):
    n, vocab = z.shape
    plan = _ce_plans.ce_bwd_plan(n, vocab, softcap=softcap, num_sms=_launch.num_sms(z),
                                 in_place=_IN_PLACE)
    return _launch.run_plan(plan, x=z, y=y, lse=lse, coef=coef)[0]


def _logits(h, w, b, layout):
    z = h @ w if layout == "dv" else h @ w.t()  # .t() is a view: no transposed copy
    return z if b is None else z.add_(b.to(z.dtype))  # in place: no second [C, V] buffer


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in float32 (a bf16/fp16 GEMM with a float32 output on
    CUDA, else float32 operands)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return a.float() @ b.float()


def _accumulate(h, w, g, layout, dh, dw, db, start):
    """dH rows of this chunk, and dW (float32, or W's dtype: "low_precision"), db (float32) +=
    this chunk's contributions."""
    if dh is not None:
        dh[start:start + h.shape[0]] = g @ (w.t() if layout == "dv" else w)
    if dw is not None:
        a, b = (h.t(), g) if layout == "dv" else (g.t(), h)
        if dw.dtype == torch.float32:
            dw.add_(_mm_f32(a, b))
        else:  # one GEMM with beta = 1 on CUDA: float32 arithmetic, rounded into dW's dtype
            dw.addmm_(a, b)
    if db is not None:
        db.add_(g.float().sum(0))


def vocab_walk(h, w, b, layout, chunk, needs, block_grad):
    """The lean backward (jax_fusedloss._lm_head._vocab_walk): blocks of vocabulary columns
    over all tokens (or row chunks of them), dW's block written once, dH summed in float32;
    the budget's columns (JAX moves them to whole waves of its own block GEMMs on a GPU with
    TMA; torch.mm has no such waves to fill).
    `block_grad(z, rows, c0, c1)` is the logits gradient of the tokens `rows` (a slice) at
    the columns `[c0, c1)` from their logits z."""
    n = h.shape[0]
    vocab = w.shape[1] if layout == "dv" else w.shape[0]
    cols, rows = vocab_block(n, vocab, chunk)
    f32 = dict(dtype=torch.float32, device=h.device)
    dh = torch.zeros(h.shape, **f32) if needs[0] else None
    dw = torch.empty_like(w) if needs[1] else None
    db = torch.empty(vocab, **f32) if b is not None and needs[2] else None
    for c0 in range(0, vocab, cols):
        c1 = min(c0 + cols, vocab)
        wb = w[:, c0:c1] if layout == "dv" else w[c0:c1]
        bb = None if b is None else b[c0:c1]
        dwb = torch.zeros(wb.shape, **f32) if dw is not None else None
        dbb = torch.zeros(c1 - c0, **f32) if db is not None else None
        for r0 in range(0, n, rows):
            hc = h[r0:r0 + rows]
            sl = slice(r0, r0 + hc.shape[0])
            z = _logits(hc, wb, bb, layout).contiguous()
            g = block_grad(z, sl, c0, c1)
            if dh is not None:
                dh[sl] += _mm_f32(g, wb.t() if layout == "dv" else wb)
            if dwb is not None:
                dwb += _mm_f32(hc.t(), g) if layout == "dv" else _mm_f32(g.t(), hc)
            if dbb is not None:
                dbb += g.float().sum(0)
            del z, g
        if dw is not None:
            (dw[:, c0:c1] if layout == "dv" else dw[c0:c1]).copy_(dwb)
        if db is not None:
            db[c0:c1] = dbb
    return dh, dw, db


def check_head(hidden, weight, bias, weight_layout: str) -> int:
    """`hidden` `[..., D]`, `weight` (`[D, V]` or `[V, D]`, hidden's dtype) and optional `bias`
    `[V]` of a hidden-state op, as jax_fusedloss._lm_head.check_head; returns V."""
    _checks.check_logits(hidden, "hidden")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    vocab = _validate.check_linear_weight(tuple(hidden.shape), tuple(weight.shape),
                                          weight_layout)
    _validate.check_same_dtype("weight", weight.dtype, "hidden", hidden.dtype)
    if bias is not None:
        _checks.check_logits(bias, "bias")
        _validate.check_shape_equal("bias", tuple(bias.shape), "(V,)", (vocab,))
    return vocab


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, layout, chunk, ignore_index, reduction,
                smoothing, z_loss, softcap, return_lse, mode, block_chunk, token_rows):
        dim = hidden.shape[-1]
        vocab = weight.shape[1] if layout == "dv" else weight.shape[0]
        h = hidden.reshape(-1, dim).contiguous()
        y, w, denom, row_scale = token_rows
        n = h.shape[0]
        needs = ctx.needs_input_grad
        # as in jax_fusedloss._lm_head.fuses_grad: per-token cotangents, float16 (a gradient for
        # a unit cotangent would flush what a loss scale saves) and "lean" recompute
        recompute = (reduction == "none" or return_lse or mode == "lean"
                     or hidden.dtype == torch.float16)
        write_grad = any(needs[:3]) and not recompute
        f32 = dict(dtype=torch.float32, device=h.device)
        loss_rows, lse, coef = (torch.empty(n, **f32), torch.empty(n, **f32),
                                torch.empty(n, _ce_plans.COEF_FIELDS.value, **f32))
        dh = torch.empty_like(h) if write_grad and needs[0] else None
        dw_dtype = torch.float32 if mode == "fast" else weight.dtype
        dw = torch.zeros(weight.shape, dtype=dw_dtype, device=h.device) if (
            write_grad and needs[1]) else None
        db = torch.zeros(vocab, **f32) if write_grad and bias is not None and needs[2] else None
        for start in range(0, n, chunk):
            hc = h[start:start + chunk]
            sl = slice(start, start + hc.shape[0])
            z = _logits(hc, weight, bias, layout).contiguous()
            loss_rows[sl], lse[sl], coef[sl], g = _chunk_fwd(
                z, y[sl], row_scale[sl], (ignore_index, smoothing, z_loss, softcap), write_grad)
            if write_grad:
                _accumulate(hc, weight, g, layout, dh, dw, db, start)
            del z, g
        ctx.layout, ctx.chunk, ctx.softcap, ctx.recompute = layout, chunk, softcap, recompute
        ctx.reduction, ctx.hidden_shape, ctx.mode = reduction, hidden.shape, mode
        ctx.block_chunk = block_chunk
        ctx.has_bias = bias is not None
        if recompute:
            ctx.save_for_backward(h, weight, bias, y, lse, coef)
        else:
            ctx.save_for_backward(
                dh, None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype))
        out = _weights.ce_reduce(loss_rows, y, w, denom, ignore_index, reduction)
        return out.reshape(labels.shape) if reduction == "none" else out, lse.reshape(
            labels.shape)

    @staticmethod
    def backward(ctx, g_loss, g_lse):
        no_double_backward("linear_cross_entropy")
        tail = (None,) * 12
        if not ctx.recompute:
            dh, dw, db = ctx.saved_tensors
            scale = g_loss.float()

            def scaled(t):  # in place: the saved gradient becomes the returned one
                return None if t is None else t.mul_(scale)

            dh = scaled(dh)
            return ((None if dh is None else dh.reshape(ctx.hidden_shape)), scaled(dw),
                    scaled(db), *tail)
        h, weight, bias, y, lse, coef = ctx.saved_tensors
        n = h.shape[0]
        needs = ctx.needs_input_grad
        cot = (g_loss.reshape(-1) if ctx.reduction == "none" else g_loss.expand(n)).float()
        coef = coef * cot[:, None]
        coef[:, 0] += g_lse.reshape(-1).float()
        return recompute_grads(
            h, weight, bias, ctx.layout, ctx.chunk, ctx.mode, needs,
            lambda z, sl, c0, c1: _chunk_bwd(z, (y[sl] - c0).contiguous(), lse[sl],
                                             coef[sl].contiguous(), ctx.softcap),
            ctx.hidden_shape, ctx.block_chunk) + tail


def recompute_grads(h, weight, bias, layout, chunk, mode, needs, block_grad, hidden_shape,
                    block_chunk):
    """(dH, dW, db) recomputed in the backward with the cotangents folded into `block_grad`
    (see vocab_walk): the vocabulary walk for "lean" (blocks of `block_chunk` * V logits, see
    head_sizes), else the token walk with dW summed in float32 ("fast") or W's dtype
    ("low_precision")."""
    if mode == "lean":
        dh, dw, db = vocab_walk(h, weight, bias, layout, block_chunk, needs, block_grad)
        return (None if dh is None else dh.to(h.dtype).reshape(hidden_shape), dw,
                None if db is None else db.to(bias.dtype))
    n, vocab = h.shape[0], weight.shape[1] if layout == "dv" else weight.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if needs[0] else None
    dw_dtype = torch.float32 if mode == "fast" else weight.dtype
    dw = torch.zeros(weight.shape, dtype=dw_dtype, device=h.device) if needs[1] else None
    db = torch.zeros(bias.shape, **f32) if bias is not None and needs[2] else None
    for start in range(0, n, chunk):
        hc = h[start:start + chunk]
        sl = slice(start, start + hc.shape[0])
        z = _logits(hc, weight, bias, layout).contiguous()
        g = block_grad(z, sl, 0, vocab)
        _accumulate(hc, weight, g, layout, dh, dw, db, start)
        del z, g
    return (None if dh is None else dh.reshape(hidden_shape),
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: torch.Tensor | None = None, weight_layout: str = "dv",
                         ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         logit_softcap: float | None = None, return_lse: bool = False,
                         check_labels: bool = False, weights: torch.Tensor | None = None,
                         where: torch.Tensor | None = None, num_items=None,
                         mode: str = "fast", chunk_size: int | None = None):
    """`jax_fusedloss.linear_cross_entropy` from PyTorch (see its docs): token chunks, torch
    matmuls, the same Triton cross-entropy kernels; gradients computed in the forward (scaled
    in the backward), recomputed in the backward for reduction="none", return_lse, float16 and
    mode="lean" (the vocabulary walk). `mode`, `chunk_size` (the lean backward's blocks: see
    head_sizes), `check_labels` and the per-token `weights` / `where` / `num_items` (folded into
    the fused gradient's row scale, no gradient) as in jax_fusedloss. First-order only
    (backward with create_graph=True raises)."""
    vocab = check_head(hidden, weight, bias, weight_layout)
    _checks.check_int_tensor(labels, "labels", hidden.shape[:-1], "hidden.shape[:-1]")
    _checks.check_choice(reduction, "reduction", _checks.REDUCTIONS)
    _checks.check_choice(mode, "mode", MODES)
    smoothing, z_loss, logit_softcap = _checks.check_ce_options(label_smoothing, z_loss,
                                                                logit_softcap)
    ignore_index = _checks.check_int(ignore_index, "ignore_index")
    num_items = _checks.check_num_items(num_items, reduction)
    _checks.check_labels(labels, vocab, ignore_index,
                         _checks.check_bool(check_labels, "check_labels"))
    y = _checks.labels_to_int32(labels, ignore_index, vocab)
    token_rows = _weights.ce_rows(y, labels.shape, ignore_index, reduction, weights, where,
                                  num_items, hidden)
    n = labels.numel()
    chunk, block_chunk = head_sizes(n, vocab, hidden.dtype, mode, chunk_size)
    if n == 0:  # 0.0 whatever the weight holds (inf/NaN), as cross_entropy; gradients zero
        zero = (hidden.sum() + weight.sum()).float() * 0.0
        zero = torch.where(torch.isfinite(zero), zero, 0.0).abs()
        loss = hidden.new_zeros(labels.shape, dtype=torch.float32) + zero if (
            reduction == "none") else zero
        return (loss, hidden.new_zeros(labels.shape, dtype=torch.float32)) if return_lse \
            else loss
    loss, lse = _LinearCrossEntropy.apply(hidden, weight, bias, labels, weight_layout, chunk,
                                          ignore_index, reduction, smoothing, z_loss,
                                          logit_softcap, bool(return_lse), mode, block_chunk,
                                          token_rows)
    return (loss, lse) if return_lse else loss
