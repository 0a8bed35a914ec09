"""Naive formulas in plain PyTorch: the oracle of the PyTorch-side tests (tests of torch_ref,
the GPU suite's torch half, the property tests), kept apart from the torch_ref frontend.

The same definitions as tests/reference/jax_ref.py (see there and the public docstrings), at
the dtype given by `dtype` (float64 as the oracle); reference gradients come from
torch.autograd of these formulas.
"""
from __future__ import annotations

import torch


def softcap(z: torch.Tensor, c: float | None) -> torch.Tensor:
    return z if c is None else c * torch.tanh(z / c)


def _take(z, idx):
    return torch.gather(z, -1, idx.long().unsqueeze(-1)).squeeze(-1)


def _reduce(per_token, count, reduction, num_items=None):
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (num_items if num_items is not None else count.sum().clamp(min=1))


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor, *,
                            ignore_index: int = -100, reduction: str = "mean",
                            label_smoothing: float = 0.0, z_loss: float = 0.0,
                            logit_softcap: float | None = None, return_lse: bool = False,
                            dtype: torch.dtype = torch.float32):
    """cross_entropy by the naive formula at `dtype`; out-of-range labels give NaN."""
    z = softcap(logits.to(dtype), logit_softcap)
    vocab = z.shape[-1]
    lse = torch.logsumexp(z, dim=-1)
    ignored = labels == ignore_index
    bad = ~ignored & ((labels < 0) | (labels >= vocab))
    zy = _take(z, labels.clamp(0, vocab - 1))
    loss = lse - zy
    if label_smoothing:  # (not 0 * inf = NaN on a row with -inf logits)
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - z.mean(dim=-1))
    if z_loss:
        loss = loss + z_loss * lse**2
    loss = torch.where(ignored, torch.zeros_like(loss), loss)
    loss = torch.where(bad, torch.full_like(loss, float("nan")), loss)
    loss = _reduce(loss, ~ignored, reduction)
    return (loss, lse) if return_lse else loss


def kd_tokens_reference(student_logits, teacher_ids, teacher_logprobs, mask=None, *,
                        temperature: float = 1.0, normalize: str = "full",
                        dtype: torch.dtype = torch.float32):
    """Per-token KL(teacher || student) over the top-K (at `dtype`) and whether each token has a
    counting entry. Entries are summed as given: a repeated id counts once per entry (and
    autograd's gather scatter-adds its gradient)."""
    s = student_logits.to(dtype) / temperature
    vocab = s.shape[-1]
    ids = teacher_ids.long()
    valid = (ids >= 0) & (ids < vocab)
    if mask is not None:
        valid = valid & (mask != 0)
    sk = torch.gather(s, -1, torch.where(valid, ids, torch.zeros_like(ids)))
    if normalize == "full":
        norm = torch.logsumexp(s, dim=-1, keepdim=True)
    else:
        z = torch.where(valid, sk, torch.full_like(sk, float("-inf")))
        # Tokens without a counting entry take a finite stand-in (their terms are all zero).
        norm = torch.logsumexp(torch.where(valid.any(-1, keepdim=True), z, torch.zeros_like(z)),
                               dim=-1, keepdim=True)
    lp = teacher_logprobs.to(dtype)
    p = torch.where(valid, lp.exp(), torch.zeros_like(lp))
    term = torch.where(p > 0, p * (lp - (sk - norm)), torch.zeros_like(p))
    return term.sum(-1), valid.any(-1)


def kd_loss_reference(student_logits, teacher_ids, teacher_logprobs, mask=None, *,
                      temperature: float = 1.0, normalize: str = "full",
                      reduction: str = "mean", num_items=None,
                      dtype: torch.dtype = torch.float32):
    """kd_loss by the naive formula at `dtype`."""
    per_tok, has_entry = kd_tokens_reference(student_logits, teacher_ids, teacher_logprobs, mask,
                                             temperature=temperature, normalize=normalize,
                                             dtype=dtype)
    return _reduce(per_tok, has_entry, reduction, num_items)


def distill_loss_reference(student_logits, labels, teacher_ids, teacher_logprobs, mask=None, *,
                           alpha: float, temperature: float = 1.0, ignore_index: int = -100,
                           normalize: str = "full", reduction: str = "mean", num_items=None,
                           temperature_squared: bool = False, label_smoothing: float = 0.0,
                           z_loss: float = 0.0, logit_softcap: float | None = None,
                           dtype: torch.dtype = torch.float32):
    """distill_loss by the naive formulas at `dtype`: the softcap transforms the logits both
    terms see; smoothing and z-loss belong to the cross-entropy term."""
    z = softcap(student_logits.to(dtype), logit_softcap)
    active = labels != ignore_index
    kd_mask = active[..., None] if mask is None else (mask != 0) & active[..., None]
    kd, has_entry = kd_tokens_reference(z, teacher_ids, teacher_logprobs, kd_mask,
                                        temperature=temperature, normalize=normalize,
                                        dtype=dtype)
    ce = cross_entropy_reference(z, labels, ignore_index=ignore_index, reduction="none",
                                 label_smoothing=label_smoothing, z_loss=z_loss, dtype=dtype)
    kd_w = (1.0 - alpha) * (temperature**2 if temperature_squared else 1.0)
    if reduction != "mean":
        return _reduce(alpha * ce + kd_w * kd, None, reduction)
    return (alpha * _reduce(ce, active, "mean", num_items)
            + kd_w * _reduce(kd, has_entry, "mean", num_items))


def reductions_reference(logits: torch.Tensor, labels: torch.Tensor | None = None, *,
                         temperature: float = 1.0, dtype: torch.dtype = torch.float64):
    """(lse, entropy, logp or None) by the naive formulas at `dtype`. -inf logits add nothing
    to the entropy (and keep autograd finite); out-of-range labels give NaN log-probs."""
    z = logits.to(dtype) / temperature
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    finite_z = torch.where(torch.isneginf(z), torch.zeros_like(z), z)
    ent = lse - (p * finite_z).sum(dim=-1)
    if labels is None:
        return lse, ent, None
    vocab = z.shape[-1]
    bad = (labels < 0) | (labels >= vocab)
    zy = _take(z, labels.clamp(0, vocab - 1))
    logp = torch.where(bad, torch.full_like(lse, float("nan")), zy - lse)
    return lse, ent, logp
