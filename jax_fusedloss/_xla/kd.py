"""Chunked pure-JAX top-K distillation: the per-row statistics and gradient of kernels/kd.py.

The vocabulary is walked once in chunks for both online softmaxes (of z for the
cross-entropy of distill_loss, of z / T for the KD term; z the softcapped logits) and, with
label smoothing, the sum of z; the gradient is written chunk by chunk, then the K teacher
columns are overwritten with their complete values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fusedloss._xla import cross_entropy as _ce
from jax_fusedloss._xla.chunks import (carry_like, chunk_layout, chunk_start, lse_from_stats,
                                       rounded, row_blocks, stats_init, transform, whole_rows,
                                       write_chunks)
from jax_fusedloss._xla.chunks import poison_inf, safe_max


def kd_stats_needed(opts) -> bool:
    """Whether the KD term needs its own softmax of z / T (see kernels.kd.kd_constexprs)."""
    return opts.normalize == "full" and not (opts.distill and opts.temperature == 1.0)


def _smoothing(opts) -> bool:
    return opts.distill and opts.smoothing > 0


def _update(m, s, z):
    m_new = jnp.maximum(m, z.max(axis=1))
    ms = safe_max(m_new)
    return m_new, s * jnp.exp(m - ms) + jnp.exp(z - ms[:, None]).sum(axis=1)


def vocab_stats(x: jax.Array, opts) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
    """In one walk over the vocabulary of `[N, V]` logits: the logsumexp of z * scale for each
    scale of lse_scales(opts) (z the softcapped logits) and, with label smoothing, sum z (else
    None); float32 [N] each."""
    scales = lse_scales(opts)
    smooth = _smoothing(opts)
    n, vocab = x.shape

    def step(carry, z, zsum):
        out = tuple(v for i, scale in enumerate(scales)
                    for v in _update(carry[2 * i], carry[2 * i + 1],
                                     rounded(z * scale) if scale != 1.0 else z))
        return out + ((carry[-1] + zsum.sum(axis=1),) if smooth else ())

    def init(rows):
        return sum((stats_init(rows, 2) for _ in scales), ()) + (
            (jnp.zeros((rows,), jnp.float32),) if smooth else ())

    if whole_rows():
        def rows(xb):
            z, _ = transform(xb, 1.0, opts.softcap)
            return step(init(xb.shape[0]), z, z)

        flat = row_blocks(x, rows, 2 * len(scales) + smooth,
                          whole=opts.softcap is None and all(c == 1.0 for c in scales))
    else:
        width, count = chunk_layout(vocab, n)

        def body(i, carry):
            start, owned = chunk_start(i, vocab, width)
            z, _ = transform(jax.lax.dynamic_slice_in_dim(x, start, width, axis=1), 1.0,
                             opts.softcap)
            keep = (start + jnp.arange(width)) >= owned
            return step(carry, jnp.where(keep, z, -jnp.inf), jnp.where(keep, z, 0.0))

        flat = jax.lax.fori_loop(0, count, body, carry_like(x, init(n)))
    lses = tuple(lse_from_stats(flat[2 * i], flat[2 * i + 1]) for i in range(len(scales)))
    return lses, flat[-1] if smooth else None


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


def lse_scales(opts) -> tuple[float, ...]:
    """The scales s of the logsumexp(z * s) over the vocabulary that rows_fwd needs."""
    return (1.0,) * opts.distill + (1.0 / opts.temperature,) * kd_stats_needed(opts)


def rows_fwd(x, ids, lp, y, row_scale, opts, *, vocab=None, lses=None, sumz=None, xk=None,
             xy=None):
    """Per-row loss [N] and stats [N, 5] = (lse(z), L, P, ce_a, kd_a); see kernels/kd.py.

    For one vocabulary slice of `vocab` columns, pass the merged `lses` (one per lse_scales),
    the merged sum of z `sumz` (label smoothing), the teacher ids' logits `xk` and the labels'
    logits `xy` (raw: the softcap is applied here)."""
    inv_temp = 1.0 / opts.temperature
    kd_stats = kd_stats_needed(opts)
    if lses is None:
        lses, sumz = vocab_stats(x, opts) if lse_scales(opts) else ((), None)
    neg = jnp.full(x.shape[:1], -jnp.inf, jnp.float32)
    lse_x = lses[0] if opts.distill else neg
    valid, p, zk, _, active, _ = _entries(x, ids, lp, y, opts, vocab, xk)
    sk = zk * inv_temp
    if opts.normalize == "full":
        L = lses[-1] if kd_stats else lse_x
    else:
        sv = jnp.where(valid, sk, -jnp.inf)
        mk = sv.max(axis=1)
        L = lse_from_stats(mk, jnp.exp(sv - safe_max(mk)[:, None]).sum(axis=1))
    # NaN/+inf policy (see kernels/kd.py): +inf statistics become NaN; p == 0 adds nothing,
    # a NaN teacher log-prob gives a NaN term.
    lse_x, L = poison_inf(lse_x), poison_inf(L)
    kd = jnp.where(p == 0, 0.0, p * (lp - (sk - L[:, None]))).sum(axis=1)
    P = p.sum(axis=1)
    ce_a = jnp.where(active, row_scale[:, 0], 0.0)
    kd_a = jnp.where(active, row_scale[:, 1], 0.0)
    loss = kd_a * kd
    if opts.distill:
        if xy is None:
            safe = jnp.clip(y, 0, x.shape[1] - 1)
            xy = jnp.take_along_axis(x, safe[:, None], axis=1)[:, 0].astype(jnp.float32)
        zy, _ = transform(xy, 1.0, opts.softcap)
        ce, _ = _ce.finish(lse_x, zy, sumz, y, ce_a, opts,
                           x.shape[1] if vocab is None else vocab)
        loss = loss + ce_a * ce  # NaN for a bad label even where ce_a is 0
    return loss, jnp.stack([lse_x, L, P, ce_a, kd_a], axis=1)


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
    """Gradient w.r.t. x for per-row weights stats[:, 3:5] (cotangent already folded in).

    For one vocabulary slice starting at column `offset` of `vocab`, pass the teacher ids'
    logits `xk` (gathered over all slices); ids and labels stay global."""
    n = x.shape[0]
    inv_temp = 1.0 / opts.temperature
    full = opts.normalize == "full"
    lse_x, L, P, ce_a, kd_a = (stats[:, i] for i in range(5))
    lse_safe = jnp.where(jnp.isneginf(lse_x), 0.0, lse_x)[:, None]
    L_safe = jnp.where(jnp.isneginf(L), 0.0, L)[:, None]
    valid, p, zk, dzk, _, bad = _entries(x, ids, lp, y, opts, vocab, xk)
    if opts.distill:  # a is NaN for a bad label or a NaN lse: a NaN row
        a, b, c = (v[:, None] for v in _ce.coefs(lse_x, bad, ce_a, opts,
                                                  x.shape[1] if vocab is None else vocab))
    coef_s = (kd_a * inv_temp * P)[:, None]
    y_local = (y - offset)[:, None]

    def chunk_grad(cols, xc):
        z, dz = transform(xc, 1.0, opts.softcap)
        g = jnp.zeros(z.shape, jnp.float32)
        if opts.distill:
            g = a * jnp.exp(z - lse_safe) - jnp.where(cols[None, :] == y_local, b, 0.0) - c
        if full:
            g = g + coef_s * jnp.exp(rounded(z * inv_temp) - L_safe)
        return g * dz if opts.softcap is not None else g

    if opts.distill or full:
        grad = write_chunks(x, x.dtype, chunk_grad)
    else:
        grad = jnp.zeros(x.shape, x.dtype)
    sum_p, count = _duplicate_sums(ids, valid, p)
    q = jnp.exp(zk * inv_temp - L_safe)
    mult = P[:, None] if full else P[:, None] * count
    g = (kd_a * inv_temp)[:, None] * (mult * q - sum_p)
    if opts.distill:
        g = g + a * jnp.exp(zk - lse_safe) - jnp.where(ids == y[:, None], b, 0.0) - c
    if opts.softcap is not None:
        g = g * dzk
    local = ids - offset
    cols = jnp.where(valid & (local >= 0) & (local < x.shape[1]), local, x.shape[1])
    return grad.at[jnp.arange(n)[:, None], cols].set(g.astype(x.dtype), mode="drop")
