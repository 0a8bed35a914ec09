"""Float64 distillation rows in plain torch for what torch_ref's KD kernels do not run: the
(K+1)-bucket forms (`tail=True`, divergence "kl" | "jsd"; the formulas of
jax_fusedloss/_xla/kd_tail.py) and, for every form, the logits gradient of one block of
vocabulary columns from per-row statistics (the backward of mode="lean", the rule of
jax_fusedloss/_xla/kd.py's and kd_tail.py's `rows_bwd` with an offset).

Per row, with z the (softcapped) logits, s = z / T, q = softmax(s), P_d the teacher's merged
probability of a distinct valid id d, P_t = max(0, 1 - sum_k p_k) (0 when the ids cover the
vocabulary) and Q_t = sum_{j not in ids} q_j (summed over the tail columns, not 1 - sum q_d):

    kl  = sum_b P_b (log P_b - log Q_b)
    jsd = sum_b beta P_b log(P_b / M_b) + (1 - beta) Q_b log(Q_b / M_b),  M_b = beta P_b +
          (1 - beta) Q_b

over the K+1 buckets. With G_b = dF/dQ_b and C = sum_b G_b Q_b, dF/ds_j = q_j (G_b(j) - C): on a
tail column `alpha1 q_j + alpha2 q_j / Q_t` (kl: alpha1 = P_D + P_t, alpha2 = -P_t; jsd:
alpha1 = (1 - beta) log(Q_t / M_t) - C, alpha2 = 0); at an id, kl: alpha1 q_d - P_d, jsd:
q_d ((1 - beta) log(Q_d / M_d) - C). distill_loss adds the cross-entropy of z (a p_j - b [j = y]
- c, as cross_entropy).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

# Tail statistics, float64 [N, TAIL_FIELDS]: (lse(z), lse(s), log Q_t, ce_a, kd_a, alpha1,
# alpha2, C); the row weights at 3:5 as in kernels/kd.py's STATS_FIELDS (whose (lse(z), L, P,
# ce_a, kd_a, ...) block_grad reads for the other forms), so a backward folds its cotangent in
# the same columns for both.
TAIL_FIELDS = 8


class Form(NamedTuple):
    """A distillation call's options (jax_fusedloss._kd_rows.KDOptions, less the dispatch)."""
    temperature: float
    normalize: str
    distill: bool
    ignore_index: int
    smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    tail: bool = False
    divergence: str = "kl"
    beta: float = 0.5


def _softcap(x: torch.Tensor, c):
    """(z, dz/dx) in float64; dz None without a softcap."""
    x = x.double()
    if c is None:
        return x, None
    t = torch.tanh(x / c)
    return c * t, 1.0 - t * t


def _log(a):
    return torch.where(a > 0, torch.log(torch.where(a > 0, a, 1.0)), -math.inf)


def _teacher(ids, lp):
    """(valid, p, per entry: the sum of p and the count over the valid entries sharing its id,
    a valid entry no earlier valid entry of its row lists), [N, K] each."""
    valid = ids >= 0
    p = torch.where(valid, torch.exp(lp.double()), 0.0)
    same = (ids[:, :, None] == ids[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    sum_p = (same * p[:, None, :]).sum(2)
    earlier = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool,
                         device=ids.device).tril(-1)
    first = valid & ~(same & earlier).any(2)
    return valid, p, sum_p, same.sum(2), first


def _labels(y, vocab, f: Form):
    """(ignored, bad) [N] bool: a label that is ignore_index, one outside [0, V) otherwise."""
    if not f.distill:
        none = torch.zeros(y.shape, dtype=torch.bool, device=y.device)
        return none, none
    ignored = y == f.ignore_index
    return ignored, ~ignored & ((y < 0) | (y >= vocab))


def _jsd_parts(lP, lQ, beta):
    lM = torch.logaddexp(math.log(beta) + lP, math.log1p(-beta) + lQ)
    tp = torch.where(torch.isneginf(lP), 0.0, beta * torch.exp(lP) * (lP - lM))
    tq = torch.where(torch.isneginf(lQ), 0.0, (1.0 - beta) * torch.exp(lQ) * (lQ - lM))
    return tp, tq, lM


def tail_fwd(x, ids, lp, y, row_scale, f: Form):
    """Per-row loss (float32 [N]: kd_a * divergence + ce_a * cross-entropy) and the tail
    statistics (float64 [N, TAIL_FIELDS]) of `[N, V]` logits; ids are -1 where an entry does
    not count (torch_ref.kd._prepare)."""
    n, vocab = x.shape
    z, _ = _softcap(x, f.softcap)
    s = z / f.temperature
    lse_s = torch.logsumexp(s, 1)
    valid, p, sum_p, count, first = _teacher(ids, lp)
    sid = ids.long().clamp(min=0)
    lq = s.gather(1, sid) - lse_s[:, None]
    in_ids = torch.zeros(n, vocab, dtype=torch.bool, device=x.device)
    rows = torch.arange(n, device=x.device)[:, None].expand_as(sid)
    in_ids[rows[valid], sid[valid]] = True
    lqt = _log(torch.where(in_ids, 0.0, torch.exp(s - lse_s[:, None])).sum(1))
    big_p = p.sum(1)
    pt = torch.where(in_ids.sum(1) >= vocab, 0.0, (1.0 - big_p).clamp(min=0.0))
    lpt = _log(pt)
    lP = torch.where(count > 1, _log(sum_p), lp.double())
    zero = torch.zeros(n, dtype=torch.float64, device=x.device)
    if f.divergence == "kl":
        div = torch.where(first & (sum_p > 0), sum_p * (lP - lq), 0.0).sum(1) + torch.where(
            pt > 0, pt * (lpt - lqt), 0.0)
        alpha1, alpha2, c = big_p + pt, -pt, zero
    else:
        tp, tq, _ = _jsd_parts(lP, lq, f.beta)
        tpt, tqt, lmt = _jsd_parts(lpt, lqt, f.beta)
        div = torch.where(first, tp + tq, 0.0).sum(1) + tpt + tqt
        c = torch.where(first, tq, 0.0).sum(1) + tqt
        alpha1 = torch.where(torch.isneginf(lqt), 0.0, (1.0 - f.beta) * (lqt - lmt)) - c
        alpha2 = zero
    ignored, bad = _labels(y, vocab, f)
    rs = row_scale.double()
    ce_a = torch.where(ignored, 0.0, rs[:, 0])
    kd_a = torch.where(ignored, 0.0, rs[:, 1])
    lse_z = torch.logsumexp(z, 1)
    loss = kd_a * div
    if f.distill:
        zy = z.gather(1, y.long().clamp(0, vocab - 1)[:, None])[:, 0]
        eps = f.smoothing
        ce = ((1 - eps) * (lse_z - zy) + eps * (lse_z - z.mean(1)) + f.z_loss * lse_z ** 2)
        ce = torch.where(ignored, 0.0, torch.where(bad, math.nan, ce))
        loss = loss + ce_a * ce
    stats = torch.stack([lse_z, lse_s, lqt, ce_a, kd_a, alpha1, alpha2, c], 1)
    return loss.float(), stats


def block_grad(xb, c0: int, ids, lp, y, stats, f: Form, vocab: int) -> torch.Tensor:
    """The logits gradient (in xb's dtype) of the columns `[c0, c0 + W)` whose logits are xb
    `[R, W]`, for the row weights stats[:, 3:5] (cotangent folded in): `stats` are tail_fwd's
    (f.tail) or the KD kernels' (kernels/kd.py STATS_FIELDS: lse(z), L = the lse of the KD
    softmax, P = sum_k p_k, ce_a, kd_a, ...). ids and labels are global."""
    z, dz = _softcap(xb, f.softcap)
    rows, width = z.shape
    s = z / f.temperature
    st = stats.double()
    lse_z, ce_a, kd_a = st[:, 0], st[:, 3], st[:, 4]
    k = (kd_a / f.temperature)[:, None]
    valid, _, sum_p, count, _ = _teacher(ids, lp)
    local = ids.long() - c0
    inside = valid & (local >= 0) & (local < width)
    sk = s.gather(1, local.clamp(0, width - 1))
    if f.tail:
        lse_s, lqt, a1, a2, c = (st[:, i][:, None] for i in (1, 2, 5, 6, 7))
        lq = s - lse_s
        dense = a1 * torch.exp(lq) + torch.where(a2 != 0, a2 * torch.exp(lq - lqt), 0.0)
        lqk = sk - lse_s
        if f.divergence == "kl":
            v = a1 * torch.exp(lqk) - sum_p
        else:
            lP = torch.where(count > 1, _log(sum_p), lp.double())
            lM = torch.logaddexp(math.log(f.beta) + lP, math.log1p(-f.beta) + lqk)
            qk = torch.exp(lqk)
            v = torch.where(qk > 0, qk * ((1.0 - f.beta) * (lqk - lM) - c), 0.0)
    else:
        big_l, big_p = st[:, 1:2], st[:, 2:3]
        full = f.normalize == "full"
        dense = big_p * torch.exp(s - big_l) if full else torch.zeros_like(s)
        v = (big_p if full else big_p * count) * torch.exp(sk - big_l) - sum_p
    g = torch.cat([k * dense, torch.zeros(rows, 1, dtype=s.dtype, device=s.device)], 1)
    g.scatter_(1, torch.where(inside, local, width), torch.where(inside, k * v, 0.0))
    g = g[:, :width]
    if f.distill:
        _, bad = _labels(y, vocab, f)
        a = torch.where(bad, math.nan, ce_a * (1.0 + 2.0 * f.z_loss * lse_z))[:, None]
        b = (ce_a * (1.0 - f.smoothing))[:, None]
        cols = torch.arange(c0, c0 + width, device=z.device)[None, :]
        g = g + a * torch.exp(z - lse_z[:, None]) - torch.where(
            cols == y.long()[:, None], b, 0.0) - (ce_a * f.smoothing / vocab)[:, None]
    if dz is not None:
        g = g * dz
    return g.to(xb.dtype)
