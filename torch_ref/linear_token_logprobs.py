"""Token log-probs (and entropy) of the LM head from PyTorch: the walks of
torch_ref.linear_cross_entropy with the reductions kernels of token_logprobs. The forward keeps
per-row statistics; the backward recomputes the logits with the per-token cotangents folded
in (token chunks, or vocabulary blocks for mode="lean")."""
from __future__ import annotations

import torch

from torch_ref import _checks
from torch_ref._checks import no_double_backward
from torch_ref.linear_cross_entropy import MODES, _logits, check_head, head_sizes, recompute_grads
from torch_ref.reductions import _bwd, _fwd


def _block_rows(y, cot, c0, c1):
    """Labels and cotangents of the columns `[c0, c1)`: a block that does not own a row's
    label drops the label term (its softmax part joins g_lse), as jax_fusedloss does."""
    local = y - c0
    owned = (local >= 0) & (local < c1 - c0)
    cot = cot.clone()
    cot[:, 0] = torch.where(owned, cot[:, 0], cot[:, 0] - cot[:, 2])
    cot[:, 2] = torch.where(owned, cot[:, 2], 0.0)
    return torch.where(owned, local, 0).contiguous(), cot


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, layout, sizes, inv_temp, want_entropy, mode):
        chunk, ctx.block_chunk = sizes
        vocab = weight.shape[1] if layout == "dv" else weight.shape[0]
        h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        y = _checks.labels_to_int32(labels, None, vocab).reshape(-1)
        y = torch.where((y < 0) | (y >= vocab), -1, y).contiguous()
        n = h.shape[0]
        f32 = dict(dtype=torch.float32, device=h.device)
        lse, lse_lo, logp = (torch.empty(n, **f32) for _ in range(3))
        ent = torch.empty(n, **f32) if want_entropy else None
        for start in range(0, n, chunk):
            sl = slice(start, min(start + chunk, n))
            z = _logits(h[sl], weight, bias, layout).contiguous()
            lse[sl], e, logp[sl], lse_lo[sl] = _fwd(z, y[sl], inv_temp, want_entropy)
            if want_entropy:
                ent[sl] = e
            del z
        ctx.layout, ctx.chunk, ctx.inv_temp, ctx.mode = layout, chunk, inv_temp, mode
        ctx.want_entropy, ctx.hidden_shape = want_entropy, hidden.shape
        ctx.save_for_backward(h, weight, bias, y, lse, lse_lo, ent)
        ctx.set_materialize_grads(False)
        lead = labels.shape
        return logp.reshape(lead), None if ent is None else ent.reshape(lead)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        no_double_backward("linear_token_logprobs")
        h, weight, bias, y, lse, lse_lo, ent = ctx.saved_tensors
        n = h.shape[0]
        cot = torch.zeros(n, 3, dtype=torch.float32, device=h.device)
        if g_logp is not None:
            cot[:, 2] = g_logp.reshape(-1).float()
        if g_ent is not None and ctx.want_entropy:
            cot[:, 1] = g_ent.reshape(-1).float()
        # an out-of-range label poisons its row where its log-prob's cotangent is nonzero
        cot[:, 0] = torch.where((y < 0) & (cot[:, 2] != 0), torch.nan, 0.0)

        def block_grad(z, sl, c0, c1):
            yb, cb = _block_rows(y[sl], cot[sl], c0, c1)
            return _bwd(z, yb, lse[sl], lse_lo[sl], None if ent is None else ent[sl],
                        cb.contiguous(), ctx.inv_temp, ctx.want_entropy)

        return recompute_grads(h, weight, bias, ctx.layout, ctx.chunk, ctx.mode,
                               ctx.needs_input_grad, block_grad, ctx.hidden_shape,
                               ctx.block_chunk) + (None,) * 6


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          bias: torch.Tensor | None = None, weight_layout: str = "dv",
                          temperature: float = 1.0, return_entropy: bool = False,
                          mode: str = "fast", chunk_size: int | None = None):
    """`jax_fusedloss.linear_token_logprobs` from PyTorch (see its docs): token chunks, torch
    matmuls, the same Triton reductions kernels; the backward recomputes the logits with the
    per-token cotangents folded in ("lean": vocabulary blocks sized as jax_fusedloss's, see
    linear_cross_entropy.head_sizes). First-order only."""
    vocab = check_head(hidden, weight, bias, weight_layout)
    _checks.check_int_tensor(labels, "labels", hidden.shape[:-1], "hidden.shape[:-1]")
    _checks.check_choice(mode, "mode", MODES)
    temperature = _checks.check_float(temperature, "temperature", lo=0.0, lo_open=True)
    _checks.check_bool(return_entropy, "return_entropy")
    n = labels.numel()
    sizes = head_sizes(n, vocab, hidden.dtype, mode, chunk_size)
    if n == 0:  # zeros, with zero gradients
        zero = (hidden.sum() + weight.sum()).float() * 0.0
        zero = torch.where(torch.isfinite(zero), zero, 0.0).abs()
        empty = hidden.new_zeros(labels.shape, dtype=torch.float32) + zero
        return (empty, empty.clone()) if return_entropy else empty
    logp, ent = _LinearLogprobs.apply(hidden, weight, bias, labels, weight_layout, sizes,
                                      1.0 / temperature, bool(return_entropy), mode)
    return (logp, ent) if return_entropy else logp
