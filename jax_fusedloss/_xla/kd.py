"""Chunked pure-JAX top-K distillation: the per-row statistics and gradient of kernels/kd.py.

The vocabulary is walked once in chunks for both online softmaxes (of z for the
cross-entropy of distill_loss, of z / T for the KD term; z the softcapped logits) and, with
label smoothing, the sum of z; the gradient is written chunk by chunk, then the K teacher
columns are overwritten with their complete values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fusedloss._validate import inverse_temperature
from jax_fusedloss._xla import cross_entropy as _ce
from jax_fusedloss._xla.chunks import (carry_like, chunk_layout, chunk_start, lse_parts,
                                       rounded, row_blocks, stats_init, transform, whole_rows,
                                       write_chunks)
from jax_fusedloss._xla.chunks import poison_inf, safe_max


def kd_stats_needed(opts) -> bool:
    """Whether the KD term needs its own softmax of z / T (see kernels.kd.kd_constexprs)."""
    return opts.normalize == "full" and not (opts.distill and opts.temperature == 1.0)


def _smoothing(opts) -> bool:
    return opts.distill and opts.smoothing > 0


def vocab_stats(x: jax.Array, opts):
    """One walk over the vocabulary of `[N, V]` logits, as kernels/_ce_core.slice_stats: the
    max m of z (the softcapped logits), s = sum exp(z - m) (distill), s_kd = sum exp((z - m) /
    T) (when the KD term has its own softmax) and sum z (label smoothing), the sums relative to
    safe_max(m); float32 [N] each, None where the options do not need it."""
    distill, kd, smooth = opts.distill, kd_stats_needed(opts), _smoothing(opts)
    inv_temp = inverse_temperature(opts.temperature)
    n, vocab = x.shape

    def step(carry, z, zsum):
        m, s, s_kd, sz = carry
        m_new = jnp.maximum(m, z.max(axis=1))
        ms = safe_max(m_new)
        d = z - ms[:, None]
        if distill:
            s = s * jnp.exp(m - ms) + jnp.exp(d).sum(axis=1)
        if kd:
            s_kd = s_kd * jnp.exp((m - ms) * inv_temp) + jnp.exp(rounded(d * inv_temp)).sum(
                axis=1)
        if smooth:
            sz = sz + zsum.sum(axis=1)
        return m_new, s, s_kd, sz

    if whole_rows():
        def rows(xb):
            z, _ = transform(xb, 1.0, opts.softcap)
            return step(stats_init(xb.shape[0], 4), z, z)

        out = row_blocks(x, rows, 4, whole=opts.softcap is None and not (distill and kd))
    else:
        width, count = chunk_layout(vocab, n)

        def body(i, carry):
            start, owned = chunk_start(i, vocab, width)
            z, _ = transform(jax.lax.dynamic_slice_in_dim(x, start, width, axis=1), 1.0,
                             opts.softcap)
            keep = (start + jnp.arange(width)) >= owned
            return step(carry, jnp.where(keep, z, -jnp.inf), jnp.where(keep, z, 0.0))

        out = jax.lax.fori_loop(0, count, body, carry_like(x, stats_init(n, 4)))
    m, s, s_kd, sz = out
    return m, s if distill else None, s_kd if kd else None, sz if smooth else None


def _scaled_lse(m, s, scale):
    """logsumexp(z * scale) from the max m of z and s = sum exp((z - safe_max(m)) * scale):
    +inf where m * scale overflows (kernels/_ce_core.scaled_lse)."""
    return jnp.where(s == 0, -jnp.inf, safe_max(m) * scale + jnp.log(jnp.where(s == 0, 1.0, s)))


def _log_sum(s, lse):
    """log(s), 0 for an empty sum, NaN where lse is NaN (kernels/kd.py's _log_sum)."""
    return jnp.where(jnp.isnan(lse), jnp.nan, jnp.log(jnp.where(s == 0, 1.0, s)))


def _entries(x, ids, lp, y, opts, vocab=None, xk=None):
    """(valid, p, z[ids], dz/dx there, active, bad) for [N, K] teacher entries (z float32);
    `vocab` is the global vocabulary and `xk` the gathered logits when x is one slice of it."""
    vocab = x.shape[1] if vocab is None else vocab
    valid = (ids >= 0) & (ids < vocab)
    if opts.distill:
        ignored, bad = _ce.label_state(y, vocab, opts.ignore_index)
        active = ~ignored
        valid = valid & active[:, None]
    else:
        active = jnp.ones(ids.shape[:1], bool)
        bad = jnp.zeros(ids.shape[:1], bool)
    p = jnp.where(valid, jnp.exp(lp), 0.0)
    if xk is None:
        xk = jnp.take_along_axis(x, jnp.where(valid, ids, 0), axis=1).astype(jnp.float32)
    zk, dzk = transform(xk, 1.0, opts.softcap)
    return valid, p, zk, dzk, active, bad


def slice_gather(x, cols, offset):
    """x[row, cols - offset] in float32 where that column lies in this slice, else 0 ([N, K])."""
    local = cols - offset
    inside = (local >= 0) & (local < x.shape[1])
    got = jnp.take_along_axis(x, jnp.where(inside, local, 0), axis=1).astype(jnp.float32)
    return jnp.where(inside, got, 0.0)


def needs_vocab_pass(opts) -> bool:
    """Whether rows_fwd walks the vocabulary ("topk" kd_loss only gathers K values)."""
    return opts.distill or kd_stats_needed(opts)


def rows_fwd(x, ids, lp, y, row_scale, opts, *, vocab=None, vstats=None, xk=None, xy=None):
    """Per-row loss [N] and stats [N, 9] = (lse(z), L, P, ce_a, kd_a, r, lg_x, r_L, lg_L); see
    kernels/kd.py (STATS_FIELDS).

    For one vocabulary slice of `vocab` columns, pass `vstats`, the vocab_stats merged over
    every slice, the teacher ids' logits `xk` and the labels' logits `xy` (raw: the softcap is
    applied here)."""
    inv_temp = inverse_temperature(opts.temperature)
    n = x.shape[0]
    neg, zero = jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32)
    if vstats is None:
        vstats = vocab_stats(x, opts) if needs_vocab_pass(opts) else (neg, None, None, None)
    m, s, s_kd, sumz = vstats
    r = safe_max(m)
    s = zero if s is None else s
    lse_x, lse_lo = lse_parts(m, s)
    valid, p, zk, _, active, _ = _entries(x, ids, lp, y, opts, vocab, xk)
    if opts.normalize != "full":
        zv = jnp.where(valid, zk, -jnp.inf)
        mk = zv.max(axis=1)
        r_L = safe_max(mk)
        s_L = jnp.exp(rounded((zv - r_L[:, None]) * inv_temp)).sum(axis=1)
        L = _scaled_lse(mk, s_L, inv_temp)
    elif kd_stats_needed(opts):
        r_L, s_L, L = r, s_kd, _scaled_lse(m, s_kd, inv_temp)
    else:
        r_L, s_L, L = r, s, lse_x
    # NaN/+inf policy (see kernels/kd.py): +inf statistics become NaN; p == 0 adds nothing,
    # a NaN teacher log-prob gives a NaN term.
    lse_x, L = poison_inf(lse_x), poison_inf(L)
    lg_x, lg_L = _log_sum(s, lse_x), _log_sum(s_L, L)
    log_q = rounded((zk - r_L[:, None]) * inv_temp) - lg_L[:, None]  # s[id] - L
    kd = jnp.where(p == 0, 0.0, p * (lp - log_q)).sum(axis=1)
    P = p.sum(axis=1)
    ce_a = jnp.where(active, row_scale[:, 0], 0.0)
    kd_a = jnp.where(active, row_scale[:, 1], 0.0)
    loss = kd_a * kd
    if opts.distill:
        if xy is None:
            safe = jnp.clip(y, 0, x.shape[1] - 1)
            xy = jnp.take_along_axis(x, safe[:, None], axis=1)[:, 0].astype(jnp.float32)
        zy, _ = transform(xy, 1.0, opts.softcap)
        ce, _ = _ce.finish(lse_x, lse_lo, zy, sumz, y, ce_a, opts,
                           x.shape[1] if vocab is None else vocab)
        loss = loss + ce_a * ce  # NaN for a bad label even where ce_a is 0
    return loss, jnp.stack([lse_x, L, P, ce_a, kd_a, r, lg_x, r_L, lg_L], axis=1)


def _duplicate_sums(ids, valid, p):
    """Per entry: the sum of p and the count over the valid entries sharing its id ([N, K])."""
    def body(j, carry):
        sum_p, count = carry
        same = (ids == jax.lax.dynamic_slice_in_dim(ids, j, 1, axis=1)) & \
            jax.lax.dynamic_slice_in_dim(valid, j, 1, axis=1)
        return (sum_p + jnp.where(same, jax.lax.dynamic_slice_in_dim(p, j, 1, axis=1), 0.0),
                count + same)

    zeros = jnp.zeros(ids.shape, jnp.float32)
    return jax.lax.fori_loop(0, ids.shape[1], body, carry_like(ids, (zeros, zeros)))


def rows_bwd(x, ids, lp, y, stats, opts, *, offset=0, vocab=None, xk=None):
    """Gradient w.r.t. x for per-row weights stats[:, 3:5] (cotangent already folded in), the
    softmaxes from the references stats[:, 5:9].

    For one vocabulary slice starting at column `offset` of `vocab`, pass the teacher ids'
    logits `xk` (gathered over all slices); ids and labels stay global."""
    n = x.shape[0]
    inv_temp = inverse_temperature(opts.temperature)
    full = opts.normalize == "full"
    lse_x, L, P, ce_a, kd_a, r, lg_x, r_L, lg_L = (stats[:, i] for i in range(9))
    r, lg_x, r_L, lg_L = (v[:, None] for v in (r, lg_x, r_L, lg_L))
    valid, p, zk, dzk, _, bad = _entries(x, ids, lp, y, opts, vocab, xk)
    if opts.distill:  # a is NaN for a bad label or a NaN lse: a NaN row
        a, b, c = (v[:, None] for v in _ce.coefs(lse_x, bad, ce_a, opts,
                                                  x.shape[1] if vocab is None else vocab))
    coef_s = (kd_a * inv_temp * P)[:, None]
    y_local = (y - offset)[:, None]

    def chunk_grad(cols, xc):
        z, dz = transform(xc, 1.0, opts.softcap)
        d = z - r  # softmaxes relative to the row max: no |lse| in the exponent's error
        g = jnp.zeros(z.shape, jnp.float32)
        if opts.distill:
            g = a * jnp.exp(d - lg_x) - jnp.where(cols[None, :] == y_local, b, 0.0) - c
        if full:  # r_L = r
            g = g + coef_s * jnp.exp(rounded(d * inv_temp) - lg_L)
        return g * dz if opts.softcap is not None else g

    if opts.distill or full:
        grad = write_chunks(x, x.dtype, chunk_grad)
    else:
        grad = jnp.zeros(x.shape, x.dtype)
    sum_p, count = _duplicate_sums(ids, valid, p)
    q = jnp.exp(rounded((zk - r_L) * inv_temp) - lg_L)
    mult = P[:, None] if full else P[:, None] * count
    g = (kd_a * inv_temp)[:, None] * (mult * q - sum_p)
    if opts.distill:
        g = g + a * jnp.exp((zk - r) - lg_x) - jnp.where(ids == y[:, None], b, 0.0) - c
    if opts.softcap is not None:
        g = g * dzk
    local = ids - offset
    cols = jnp.where(valid & (local >= 0) & (local < x.shape[1]), local, x.shape[1])
    return grad.at[jnp.arange(n)[:, None], cols].set(g.astype(x.dtype), mode="drop")
