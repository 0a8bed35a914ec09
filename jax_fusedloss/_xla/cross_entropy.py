"""Chunked pure-JAX cross-entropy: the per-row statistics and gradient of the Triton kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fusedloss._xla.chunks import lse_parts, online_stats, transform, write_chunks
from jax_fusedloss._xla.chunks import poison_inf, safe_max


def label_state(labels: jax.Array, vocab: int, ignore_index: int):
    ignored = labels == ignore_index
    bad = ~ignored & ((labels < 0) | (labels >= vocab))
    return ignored, bad


def slice_stats(x, y, opts):
    """(max, sum exp(z - max), sum z, z[y] or 0 when y is outside [0, V)) per row of `[N, V]`."""
    m, s, sumz = online_stats(x, 1.0, opts.softcap)
    return m, s, sumz, label_logit(x, y, opts)


def label_logit(x, y, opts):
    """z[y] per row, 0 where y is outside [0, V)."""
    vocab = x.shape[-1]
    inside = (y >= 0) & (y < vocab)
    safe = jnp.clip(y, 0, vocab - 1)
    zy, _ = transform(jnp.take_along_axis(x, safe[:, None], axis=1)[:, 0], 1.0, opts.softcap)
    return jnp.where(inside, zy, 0.0)


def coefs(lse, bad, scale, opts, vocab: int):
    """Gradient coefficients (a, b, c) [N] for row weights `scale` (0 at ignored rows) from an
    lse whose +inf is already poisoned: `a` is NaN for a bad label or a NaN lse, which makes the
    whole gradient row NaN (see kernels/_ce_core.py)."""
    eps, zl = opts.smoothing, opts.z_loss
    a = scale * (1.0 + 2.0 * zl * lse) if zl > 0 else scale
    a = jnp.where(bad | jnp.isnan(lse), jnp.nan, a)
    return a, scale * (1.0 - eps), scale * eps / vocab


def finish(lse, lse_lo, zy, sumz, y, row_scale, opts, vocab: int):
    """Per-row (loss, coef[N, 5]) from a row's log-sum-exp lse + lse_lo (lse_parts), z[y] and
    sum z over all `vocab` columns; coef = (a, b, c, lse_lo * w, w) with w = 1, as
    kernels/cross_entropy.py's COEF_FIELDS."""
    ignored, bad = label_state(y, vocab, opts.ignore_index)
    lse = poison_inf(lse)  # NaN/+inf policy: NaN loss and gradient row, see kernels
    eps, zl = opts.smoothing, opts.z_loss
    loss = (1.0 - eps) * ((lse - zy) + lse_lo)
    if eps > 0:
        loss = loss + eps * ((lse - sumz / vocab) + lse_lo)
    if zl > 0:
        loss = loss + zl * lse * lse
    loss = jnp.where(bad, jnp.nan, jnp.where(ignored, 0.0, jnp.where(jnp.isnan(lse), jnp.nan,
                                                                     loss)))
    a, b, c = coefs(lse, bad, jnp.where(ignored, 0.0, row_scale), opts, vocab)
    return loss, jnp.stack([a, b, c, lse_lo, jnp.ones_like(a)], axis=1)


def rows_fwd(x, y, row_scale, opts):
    """Per-row (loss, lse, coef[N, 5]) for `[N, V]` logits; see kernels/cross_entropy.py."""
    m, s, sumz, zy = slice_stats(x, y, opts)
    lse, lse_lo = lse_parts(m, s)
    loss, coef = finish(lse, lse_lo, zy, sumz, y, row_scale, opts, x.shape[-1])
    return loss, lse, coef


def rows_bwd(x, y, lse, coef, opts):
    """Gradient `(a * softmax - b * onehot - c) * dz/dx`, written chunk by chunk; the softmax
    is exp((z - lse) - lse_lo), lse_lo = coef[:, 3] / coef[:, 4] (0 where coef[:, 4] is 0:
    a backward may scale every field by the row's cotangent)."""
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)[:, None]
    a, b, c, lo_w, w = (coef[:, i:i + 1] for i in range(5))
    lse_lo = jnp.where(w != 0, lo_w / jnp.where(w != 0, w, 1.0), 0.0)

    def chunk_grad(cols, xc):
        z, dz = transform(xc, 1.0, opts.softcap)
        onehot_b = jnp.where(cols[None, :] == y[:, None], b, 0.0)
        return (a * jnp.exp((z - lse_safe) - lse_lo) - onehot_b - c) * dz

    return write_chunks(x, x.dtype, chunk_grad)


def rows_fwd_grad_whole(x, y, row_scale, opts):
    """rows_fwd and the unit-cotangent gradient in one walk of whole float32 rows (CPU): the
    exponentials e = exp(z - max) are computed once, summed, and turned into the softmax term
    a * e / sum(e) in place (optax's value_and_grad computes them once too; rows_fwd then
    rows_bwd computes them twice). 2-core EPYC, [4096, 32000], value_and_grad with optax's
    calls interleaved: 336 vs 337 ms (benchmarks/results/cpu_2core.csv); 393 vs 317 ms the
    other way. No [N, V] buffer besides the gradient."""
    vocab = x.shape[-1]
    z, dz = transform(x, 1.0, opts.softcap)
    m = z.max(axis=1)
    e = jnp.exp(z - safe_max(m)[:, None])
    s = e.sum(axis=1)
    sumz = z.sum(axis=1) if opts.smoothing > 0 else jnp.zeros_like(s)
    lse, lse_lo = lse_parts(m, s)
    loss, coef = finish(lse, lse_lo, label_logit(x, y, opts), sumz, y, row_scale, opts, vocab)
    a, b, c = (coef[:, i:i + 1] for i in range(3))
    p = e * (a / jnp.where(s == 0, 1.0, s)[:, None])  # s == 0: an all -inf row, e is 0
    onehot_b = jnp.where(jnp.arange(vocab)[None, :] == y[:, None], b, 0.0)
    g = p - onehot_b - c if opts.smoothing > 0 else p - onehot_b
    return loss, lse, coef, (g * dz if opts.softcap is not None else g).astype(x.dtype)
