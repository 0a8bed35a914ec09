"""Per-token `weights=`, `where=` and `num_items=` of torch_ref's losses: the rules of
jax_fusedloss/_weights.py (cross-entropy) and jax_fusedloss/_kd_inputs.py (distillation) in
torch, with the same messages. A token's weight joins the per-row scale of the fused gradient
(no extra pass); the weights are data and get no gradient.

- `where` (bool `[...]`, optax's convention): False counts as ignored.
- `weights` (float `[...]`, broadcast against the tokens): each counted token's loss times its
  weight (any sign; a weight of 0 does not hide an out-of-range label's NaN).
- "mean" divides by `num_items` when given, else by the sum of the counted tokens' weights
  (without weights: their number), taken as 1 where it is 0.
"""
from __future__ import annotations

import torch

from torch_ref import _checks


def _broadcast(a: torch.Tensor, name: str, shape, what: str) -> torch.Tensor:
    try:
        out = torch.broadcast_shapes(tuple(a.shape), tuple(shape))
    except RuntimeError:
        out = None
    if out is None or tuple(out) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(a.shape)} must broadcast to {what}"
                         f"{tuple(shape)}")
    return a.expand(tuple(shape)).reshape(-1)


def token_weights(weights, where, shape, ref: torch.Tensor, what: str = "labels.shape="):
    """Checked and flattened (float32 `[N]` weights or None, bool `[N]` where or None), on
    `ref`'s device, detached (no gradient); a `where=False` token weighs 0."""
    out = []
    for name, a in (("weights", weights), ("where", where)):
        if a is None:
            out.append(None)
            continue
        kind = "a float" if name == "weights" else "a bool"
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"{name} must be {kind} torch.Tensor, got {type(a).__name__}")
        if name == "weights" and not a.dtype.is_floating_point:
            raise TypeError(f"weights.dtype={a.dtype} must be a float type")
        if name == "where" and a.dtype != torch.bool:
            raise TypeError(f"where.dtype={a.dtype} must be bool")
        _checks.check_same_device(name, a, ref, "the inputs")
        flat = _broadcast(a.detach(), name, shape, what)
        out.append(flat.float() if name == "weights" else flat)
    w, keep = out
    if keep is not None:
        w = torch.where(keep, torch.ones((), device=keep.device) if w is None else w,
                        torch.zeros((), device=keep.device))
    return w, keep


def denominator(counted: torch.Tensor, w, num_items) -> torch.Tensor:
    """"mean"'s float32 denominator: num_items, else the weight sum of the counted rows (1
    where it is 0), else their count (at least 1)."""
    if num_items is not None:
        return torch.as_tensor(num_items, device=counted.device).float().reshape(())
    if w is None:
        return counted.sum().clamp(min=1).float()
    total = torch.where(counted, w, torch.zeros((), device=w.device)).sum()
    return torch.where(total == 0, torch.ones((), device=w.device), total)


def ce_rows(y: torch.Tensor, shape, ignore_index: int, reduction: str, weights, where,
            num_items, ref: torch.Tensor):
    """(labels with `where=False` ignored, weights `[N]` or None, denominator, row_scale `[N]`)
    of cross_entropy / linear_cross_entropy (`y`: the flat int32 labels)."""
    w, keep = token_weights(weights, where, shape, ref)
    if keep is not None:
        y = torch.where(keep, y, torch.full_like(y, ignore_index))
    if reduction == "mean":
        denom = denominator(y != ignore_index, w, num_items)
    else:
        denom = torch.ones((), device=y.device)
    base = torch.ones(y.shape, device=y.device) if w is None else w
    return y.contiguous(), w, denom, (base / denom).contiguous()


def ce_reduce(loss_rows: torch.Tensor, y: torch.Tensor, w, denom, ignore_index: int,
              reduction: str) -> torch.Tensor:
    """Weighted per-token losses (0 at ignored tokens): summed, over the denominator, or as
    they are."""
    loss = loss_rows if w is None else torch.where(y == ignore_index, 0.0, loss_rows * w)
    if reduction == "none":
        return loss
    return loss.sum() / denom


def kd_column(coef: float, counted: torch.Tensor, w, reduction: str, num_items):
    """One column of distillation's row_scale `[N, 2]`: coef times the token weight, over
    "mean"'s denominator (jax_fusedloss._kd_inputs.row_scales)."""
    base = torch.ones(counted.shape, device=counted.device) if w is None else w
    col = coef * base
    if reduction == "mean":
        col = col / denominator(counted, w, num_items)
    return col
