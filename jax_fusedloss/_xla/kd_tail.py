"""Pure-JAX rows of the (K+1)-bucket distillation divergences (kd_loss / distill_loss with
`tail=True`): "kl" and the generalised Jensen-Shannon "jsd" over the teacher's distinct ids and
one tail bucket.

Per row, with s = z / T (z the softcapped logits), q = softmax(s) over the whole vocabulary,
D the distinct valid teacher ids, P_d the teacher's probability of id d (the sum of p_k over the
entries listing d), P_t = max(0, 1 - sum_k p_k) (0 when D is the whole vocabulary), Q_d = q_d
and Q_t = sum_{j not in D} q_j:

    kl  = sum_b P_b (log P_b - log Q_b)
    jsd = sum_b beta P_b (log P_b - log M_b) + (1 - beta) Q_b (log Q_b - log M_b),
          M_b = beta P_b + (1 - beta) Q_b

over the K+1 buckets b (terms with zero mass add nothing). Q_t is summed over the tail columns
themselves (the id columns of each row zeroed before the sum), never taken as 1 - sum_d q_d.
With G_b = dF/dQ_b and C = sum_b G_b Q_b the gradient w.r.t. s_j is q_j (G_b(j) - C): on a
tail column `alpha1 q_j + alpha2 q_j / Q_t` (kl: alpha1 = P_D + P_t, alpha2 = -P_t; jsd:
alpha1 = (1 - beta) log(Q_t / M_t) - C, alpha2 = 0), at an id its own value
(kl: (P_D + P_t) q_d - P_d; jsd: q_d ((1 - beta) log(Q_d / M_d) - C)).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fusedloss._xla import cross_entropy as _ce
from jax_fusedloss._xla.chunks import (ROW_BLOCK_BYTES, carry_like, lse_parts, rounded,
                                       safe_max, transform, whole_rows, write_chunks)
from jax_fusedloss._xla.kd import _duplicate_sums, _entries, vocab_stats

# Per-row statistics, float32 [N, TAIL_FIELDS]: (lse(z), lgS, lgS_t, ce_a, kd_a, r, lg_x,
# alpha1, alpha2, C): the row weights at 3:5 as in kernels/kd.py's STATS_FIELDS (a backward
# folds its cotangent into them); q_j = exp((z_j - r) / T - lgS), q_j / Q_t = exp((z_j - r) / T
# - lgS_t).
TAIL_FIELDS = 10
# Off the CPU, tail_sums takes blocks of rows whose float32 copy is at most this size (few,
# long steps: a loop step of a few rows is launch-bound on a GPU); on the CPU, ROW_BLOCK_BYTES.
TAIL_BLOCK_BYTES = 512 << 20


def _log(a):
    """log(a), -inf at 0 (no warning path through log(0) in the gradient: none is taken)."""
    return jnp.where(a > 0, jnp.log(jnp.where(a > 0, a, 1.0)), -jnp.inf)


def tail_sums(x, cols, ref, opts):
    """(sum over all columns j, sum over the columns not in `cols`) of exp((z_j - ref) / T),
    float32 [N] each, for x `[N, W]` and `cols` `[N, K]` (slice-local column indices; W for an
    entry that names none), in blocks of rows. One reduction order for both sums, so a row
    without ids gets Q_t = 1 exactly."""
    n, w = x.shape
    inv_t = 1.0 / opts.temperature
    r = min(n, max(1, (ROW_BLOCK_BYTES if whole_rows() else TAIL_BLOCK_BYTES) // (4 * w)))

    def block(start):
        xb = jax.lax.dynamic_slice_in_dim(x, start, r)
        z, _ = transform(xb, 1.0, opts.softcap)
        refb = jax.lax.dynamic_slice_in_dim(ref, start, r)
        e = jnp.exp(rounded((z - refb[:, None]) * inv_t))
        cb = jax.lax.dynamic_slice_in_dim(cols, start, r)
        et = e.at[jnp.arange(r)[:, None], cb].set(0.0, mode="drop")
        return e.sum(axis=1), et.sum(axis=1)

    if r == n:
        return block(0)

    def body(i, out):
        start = jnp.minimum(i * r, n - r)
        return tuple(jax.lax.dynamic_update_slice_in_dim(o, v, start, axis=0)
                     for o, v in zip(out, block(start)))

    init = (jnp.zeros((n,), jnp.float32),) * 2
    return jax.lax.fori_loop(0, -(-n // r), body, carry_like(x, init))


def local_cols(ids, valid, offset, width):
    """Slice-local columns of the valid ids, `width` (out of range) elsewhere."""
    local = ids - offset
    return jnp.where(valid & (local >= 0) & (local < width), local, width)


def _first_entries(ids, valid):
    """[N, K] bool: a valid entry whose id no earlier valid entry of its row lists."""
    k = ids.shape[1]
    pos = jnp.arange(k)

    def body(j, seen):
        idj = jax.lax.dynamic_slice_in_dim(ids, j, 1, axis=1)
        vj = jax.lax.dynamic_slice_in_dim(valid, j, 1, axis=1)
        return seen | ((ids == idj) & vj & (pos[None, :] > j))

    seen = jax.lax.fori_loop(0, k, body, carry_like(ids, jnp.zeros(ids.shape, bool)))
    return valid & ~seen


def _log_teacher(lp, sum_p, count):
    """log P_d per entry: the entry's own log-prob when its id is listed once, else log of
    the merged probability."""
    return jnp.where(count > 1, _log(sum_p), lp)


def _jsd_parts(lP, lQ, beta):
    """(beta P (log P - log M), (1 - beta) Q (log Q - log M), log M), zero-mass terms 0."""
    lM = jnp.logaddexp(jnp.log(beta) + lP, jnp.log1p(-beta) + lQ)
    tp = jnp.where(jnp.isneginf(lP), 0.0, beta * jnp.exp(lP) * (lP - lM))
    tq = jnp.where(jnp.isneginf(lQ), 0.0, (1.0 - beta) * jnp.exp(lQ) * (lQ - lM))
    return tp, tq, lM


def rows_fwd(x, ids, lp, y, row_scale, opts, *, vocab=None, offset=0, vstats=None, xk=None,
             xy=None, psum=None):
    """Per-row loss [N] and stats [N, TAIL_FIELDS]. For one vocabulary slice starting at
    column `offset` of `vocab`, pass `vstats` merged over the slices, the ids' and labels'
    logits `xk`, `xy` and `psum` (the sum over the slices of a per-row float32 array)."""
    inv_t = 1.0 / opts.temperature
    n, width = x.shape
    if vstats is None:
        vstats = vocab_stats(x, opts)
    m, s, _, sumz = vstats
    r = safe_max(m)
    zero = jnp.zeros((n,), jnp.float32)
    s_ce = zero if s is None else s
    lse_x, lse_lo = lse_parts(m, s_ce)
    lg_x = _log(s_ce)
    valid, p, zk, _, active, _ = _entries(x, ids, lp, y, opts, vocab, xk)
    sums = tail_sums(x, local_cols(ids, valid, offset, width), r, opts)
    lgS, lgS_t = (_log(v if psum is None else psum(v)) for v in sums)
    sum_p, count = _duplicate_sums(ids, valid, p)
    first = _first_entries(ids, valid)
    lQ = rounded((zk - r[:, None]) * inv_t) - lgS[:, None]
    lP = _log_teacher(lp, sum_p, count)
    P = p.sum(axis=1)
    # no tail bucket when the ids cover the vocabulary (a residual there is the teacher's
    # rounding: its student mass is exactly 0)
    covers = jnp.sum(first, axis=1) >= (width if vocab is None else vocab)
    P_t = jnp.where(covers, 0.0, jnp.maximum(0.0, 1.0 - P))
    lPt, lQt = _log(P_t), lgS_t - lgS
    if opts.divergence == "kl":
        ids_term = jnp.where(first & (sum_p > 0), sum_p * (lP - lQ), 0.0).sum(axis=1)
        div = ids_term + jnp.where(P_t > 0, P_t * (lPt - lQt), 0.0)
        alpha1, alpha2, C = P + P_t, -P_t, zero
    else:
        tp, tq, lM = _jsd_parts(lP, lQ, opts.beta)
        tpt, tqt, lMt = _jsd_parts(lPt, lQt, opts.beta)
        div = jnp.where(first, tp + tq, 0.0).sum(axis=1) + tpt + tqt
        C = (jnp.where(first, tq, 0.0).sum(axis=1) + tqt)  # sum_b G_b Q_b
        alpha1 = jnp.where(jnp.isneginf(lQt), 0.0, (1.0 - opts.beta) * (lQt - lMt)) - C
        alpha2 = zero
    ce_a = jnp.where(active, row_scale[:, 0], 0.0)
    kd_a = jnp.where(active, row_scale[:, 1], 0.0)
    loss = kd_a * div
    if opts.distill:
        if xy is None:
            safe = jnp.clip(y, 0, width - 1)
            xy = jnp.take_along_axis(x, safe[:, None], axis=1)[:, 0].astype(jnp.float32)
        zy, _ = transform(xy, 1.0, opts.softcap)
        ce, _ = _ce.finish(lse_x, lse_lo, zy, sumz, y, ce_a, opts,
                           width if vocab is None else vocab)
        loss = loss + ce_a * ce
    stats = jnp.stack([lse_x, lgS, lgS_t, ce_a, kd_a, r, lg_x, alpha1, alpha2, C], axis=1)
    return loss, stats


def rows_bwd(x, ids, lp, y, stats, opts, *, offset=0, vocab=None, xk=None):
    """Gradient w.r.t. x of the rows (weights stats[:, 3:5], cotangent folded in). For one
    vocabulary slice starting at `offset` of `vocab`, pass the ids' logits `xk` (0 or anything
    where an id lies outside the slice: those columns are not written)."""
    n, width = x.shape
    inv_t = 1.0 / opts.temperature
    lse_x, lgS, lgS_t, ce_a, kd_a, r, lg_x, alpha1, alpha2, C = (stats[:, i]
                                                                 for i in range(TAIL_FIELDS))
    valid, p, zk, dzk, _, bad = _entries(x, ids, lp, y, opts, vocab, xk)
    full_vocab = width if vocab is None else vocab
    if opts.distill:
        a, b, c = (v[:, None] for v in _ce.coefs(lse_x, bad, ce_a, opts, full_vocab))
    k = (kd_a * inv_t)[:, None]
    rr, lgS_, lgS_t_, lg_x_ = (v[:, None] for v in (r, lgS, lgS_t, lg_x))
    a1, a2 = alpha1[:, None], alpha2[:, None]
    y_local = (y - offset)[:, None]

    def chunk_grad(cols, xc):
        z, dz = transform(xc, 1.0, opts.softcap)
        d = rounded((z - rr) * inv_t)
        g = k * (a1 * jnp.exp(d - lgS_) + jnp.where(a2 == 0, 0.0, a2 * jnp.exp(d - lgS_t_)))
        if opts.distill:
            g = g + a * jnp.exp((z - rr) - lg_x_) - jnp.where(cols[None, :] == y_local, b, 0.0) - c
        return g * dz if opts.softcap is not None else g

    grad = write_chunks(x, x.dtype, chunk_grad)
    sum_p, count = _duplicate_sums(ids, valid, p)
    lq = rounded((zk - rr) * inv_t) - lgS_
    q = jnp.exp(lq)
    if opts.divergence == "kl":
        v = a1 * q - sum_p
    else:
        lP = _log_teacher(lp, sum_p, count)
        lM = jnp.logaddexp(jnp.log(opts.beta) + lP, jnp.log1p(-opts.beta) + lq)
        v = jnp.where(q > 0, q * ((1.0 - opts.beta) * (lq - lM) - C[:, None]), 0.0)
    g = k * v
    if opts.distill:
        g = g + a * jnp.exp((zk - rr) - lg_x_) - jnp.where(ids == y[:, None], b, 0.0) - c
    if opts.softcap is not None:
        g = g * dzk
    cols = local_cols(ids, valid, offset, width)
    return grad.at[jnp.arange(n)[:, None], cols].set(g.astype(x.dtype), mode="drop")
