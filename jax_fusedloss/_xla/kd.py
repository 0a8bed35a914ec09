"""Chunked pure-JAX top-K distillation: the per-row statistics and gradient of kernels/kd.py.

The vocabulary is walked once in chunks for both online softmaxes (of x for the
cross-entropy of distill_loss, of x / T for the KD term); the gradient is written chunk by
chunk, then the K teacher columns are overwritten with their complete values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fusedloss._xla.chunks import (carry_like, chunk_layout, chunk_start, lse_from_stats,
                                       rounded, row_blocks, stats_init, whole_rows,
                                       write_chunks)
from jax_fusedloss._xla.chunks import poison_inf, safe_max
from jax_fusedloss._xla.cross_entropy import label_state


def kd_stats_needed(opts) -> bool:
    """Whether the KD term needs its own softmax of x / T (see kernels.kd.kd_constexprs)."""
    return opts.normalize == "full" and not (opts.distill and opts.temperature == 1.0)


def _update(m, s, z):
    m_new = jnp.maximum(m, z.max(axis=1))
    ms = safe_max(m_new)
    return m_new, s * jnp.exp(m - ms) + jnp.exp(z - ms[:, None]).sum(axis=1)


def vocab_lse(x: jax.Array, scales: tuple[float, ...]) -> tuple[jax.Array, ...]:
    """logsumexp over the vocabulary of x * scale for each scale, in one walk; float32 [N]."""
    n, vocab = x.shape
    init = tuple(stats_init(n, 2) for _ in scales)
    if whole_rows():
        def rows(xb):
            z = xb.astype(jnp.float32)
            return tuple(v for scale in scales
                         for v in _update(*stats_init(xb.shape[0], 2),
                                          rounded(z * scale) if scale != 1.0 else z))

        flat = row_blocks(x, rows, 2 * len(scales), whole=all(c == 1.0 for c in scales))
        return tuple(lse_from_stats(flat[2 * i], flat[2 * i + 1]) for i in range(len(scales)))
    width, count = chunk_layout(vocab)

    def body(i, carry):
        start, owned = chunk_start(i, vocab, width)
        z = jax.lax.dynamic_slice_in_dim(x, start, width, axis=1).astype(jnp.float32)
        z = jnp.where((start + jnp.arange(width)) >= owned, z, -jnp.inf)
        return tuple(_update(m, s, z * scale) for (m, s), scale in zip(carry, scales))

    return tuple(lse_from_stats(m, s)
                 for m, s in jax.lax.fori_loop(0, count, body, carry_like(x, init)))


def _entries(x, ids, lp, y, opts, vocab=None, xk=None):
    """(valid, p, x[ids] float32, active, bad) for [N, K] teacher entries; `vocab` is the
    global vocabulary and `xk` the gathered logits when x is one slice of it."""
    vocab = x.shape[1] if vocab is None else vocab
    valid = (ids >= 0) & (ids < vocab)
    if opts.distill:
        ignored, bad = label_state(y, vocab, opts.ignore_index)
        active = ~ignored
        valid = valid & active[:, None]
    else:
        active = jnp.ones(ids.shape[:1], bool)
        bad = jnp.zeros(ids.shape[:1], bool)
    p = jnp.where(valid, jnp.exp(lp), 0.0)
    if xk is None:
        xk = jnp.take_along_axis(x, jnp.where(valid, ids, 0), axis=1).astype(jnp.float32)
    return valid, p, xk, active, bad


def slice_gather(x, cols, offset):
    """x[row, cols - offset] in float32 where that column lies in this slice, else 0 ([N, K])."""
    local = cols - offset
    inside = (local >= 0) & (local < x.shape[1])
    got = jnp.take_along_axis(x, jnp.where(inside, local, 0), axis=1).astype(jnp.float32)
    return jnp.where(inside, got, 0.0)


def lse_scales(opts) -> tuple[float, ...]:
    """The scales s of the logsumexp(x * s) over the vocabulary that rows_fwd needs."""
    return (1.0,) * opts.distill + (1.0 / opts.temperature,) * kd_stats_needed(opts)


def rows_fwd(x, ids, lp, y, row_scale, opts, *, vocab=None, lses=None, xk=None, xy=None):
    """Per-row loss [N] and stats [N, 5] = (lse(x), L, P, ce_a, kd_a); see kernels/kd.py.

    For one vocabulary slice of `vocab` columns, pass the merged `lses` (one per lse_scales),
    the teacher ids' logits `xk` and the labels' logits `xy`."""
    inv_temp = 1.0 / opts.temperature
    kd_stats = kd_stats_needed(opts)
    scales = lse_scales(opts)
    if lses is None:
        lses = vocab_lse(x, scales) if scales else ()
    neg = jnp.full(x.shape[:1], -jnp.inf, jnp.float32)
    lse_x = lses[0] if opts.distill else neg
    valid, p, xk, active, bad = _entries(x, ids, lp, y, opts, vocab, xk)
    sk = xk * inv_temp
    if opts.normalize == "full":
        L = lses[-1] if kd_stats else lse_x
    else:
        zk = jnp.where(valid, sk, -jnp.inf)
        mk = zk.max(axis=1)
        L = lse_from_stats(mk, jnp.exp(zk - safe_max(mk)[:, None]).sum(axis=1))
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
        loss = loss + jnp.where(active, ce_a * (lse_x - xy), 0.0)
        loss = jnp.where(bad, jnp.nan, loss)
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
    lse_safe = jnp.where(jnp.isneginf(lse_x), 0.0, lse_x)
    L_safe = jnp.where(jnp.isneginf(L), 0.0, L)
    valid, p, xk, _, bad = _entries(x, ids, lp, y, opts, vocab, xk)
    coef_s = kd_a * inv_temp * P
    y_local = y - offset

    def chunk_grad(cols, xc):
        z = xc.astype(jnp.float32)
        g = jnp.zeros(z.shape, jnp.float32)
        if opts.distill:
            g = ce_a[:, None] * (jnp.exp(z - lse_safe[:, None])
                                 - (cols[None, :] == y_local[:, None]))
        if full:
            g = g + coef_s[:, None] * jnp.exp(rounded(z * inv_temp) - L_safe[:, None])
        return jnp.where(bad[:, None], jnp.nan, g)

    if opts.distill or full:
        grad = write_chunks(x, x.dtype, chunk_grad)
    else:
        grad = jnp.zeros(x.shape, x.dtype)
    sum_p, count = _duplicate_sums(ids, valid, p)
    q = jnp.exp(xk * inv_temp - L_safe[:, None])
    mult = P[:, None] if full else P[:, None] * count
    g = (kd_a * inv_temp)[:, None] * (mult * q - sum_p)
    if opts.distill:
        g = g + ce_a[:, None] * (jnp.exp(xk - lse_safe[:, None]) - (ids == y[:, None]))
        g = jnp.where(bad[:, None], jnp.nan, g)
    local = ids - offset
    cols = jnp.where(valid & (local >= 0) & (local < x.shape[1]), local, x.shape[1])
    return grad.at[jnp.arange(n)[:, None], cols].set(g.astype(x.dtype), mode="drop")
