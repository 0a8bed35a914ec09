"""Chunked pure-JAX log-sum-exp, entropy and token log-probs: the twin of kernels/reductions.py.

Partial statistics of a set of logits z, relative to their max m: s = sum exp(z - m) and
u = sum (z - m) exp(z - m); -inf entries add nothing and the identity is (-inf, 0, 0).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fusedloss._xla.chunks import (carry_like, chunk_layout, chunk_start, one_pass,
                                       one_pass_stats, row_blocks, stats_init, transform,
                                       whole_rows, write_chunks)
from jax_fusedloss._xla.chunks import lse_parts, safe_max


def merge_stats(m: jax.Array, s: jax.Array, u: jax.Array | None, axis: int):
    """Merges partials (m, s[, u]) along `axis`. A partial with m = -inf counts as the identity
    whatever its s and u (e.g. the NaN entropy of an all -inf shard); gradients stay finite.

    A row whose largest partial max is +inf merges to m = +inf with s (and u) the sums of the
    +inf partials' own s (and u), taken relative to 0 as kernels/_online.safe_max does, so
    m + log(s) is +inf as jax.nn.logsumexp gives; finite partials add nothing to it. A NaN
    in a row's partials (other than a -inf partial's s and u) makes its merged s NaN, also
    where a NaN-dropping max hid it behind a finite partial max."""
    big = jnp.max(m, axis=axis, keepdims=True)
    top = jnp.isposinf(big)
    ref = jnp.where(jnp.isinf(big), 0.0, big)
    dead = jnp.isneginf(m)
    hidden = top & jnp.isfinite(m)  # weight 0 under a +inf max, but a NaN s or u still counts
    shift = jnp.where(dead | hidden | jnp.isposinf(m), 0.0, m) - ref  # 0 for +inf partials
    w = jnp.where(dead | hidden, 0.0, jnp.exp(shift))
    s_out = jnp.sum(jnp.where(dead, 0.0, s) * w, axis=axis)
    m_out = jnp.squeeze(big, axis)
    if u is None:
        return m_out, s_out
    return m_out, s_out, jnp.sum(jnp.where(dead, 0.0, w * (u + shift * s)), axis=axis)


def finish(m, s, u, zy, labels, vocab: int):
    """(lse, entropy, logp, lse_lo) from merged partials; u, zy may be None (output None).

    lse follows lse_from_stats (-inf, +inf or NaN for an empty, +inf or NaN row); entropy and
    logp are NaN wherever lse is not finite; lse_lo is the low part of the log-sum-exp
    (lse_parts), for rows_bwd."""
    lse, lse_lo = lse_parts(m, s)
    finite = jnp.isfinite(lse)
    s_safe = jnp.where(finite, s, 1.0)
    ent = None if u is None else jnp.where(finite, jnp.log(s_safe) - u / s_safe, jnp.nan)
    logp = None
    if zy is not None:
        bad = (labels < 0) | (labels >= vocab)
        logp = jnp.where(bad | ~finite, jnp.nan, (zy - lse) - lse_lo)
    return lse, ent, logp, lse_lo


def slice_stats(x: jax.Array, y: jax.Array | None, opts):
    """Per-row partials (m, s, u, z[y] or 0 outside [0, V); None without labels) of `[N, V]`
    logits in one chunked pass."""
    n, vocab = x.shape
    inv_temp = 1.0 / opts.temperature

    def step(carry, z):
        mc = jnp.max(z, axis=1, keepdims=True)
        d = z - safe_max(mc)
        e = jnp.exp(d)
        # u (the entropy's sum) only where asked for: zeros cost nothing in the walk
        u = (jnp.where(e > 0, d, 0.0) * e).sum(axis=1) if opts.entropy else jnp.zeros_like(
            mc[:, 0])
        chunk = (mc[:, 0], e.sum(axis=1), u)
        return merge_stats(*(jnp.stack([a, b]) for a, b in zip(carry, chunk)), axis=0)

    if whole_rows():
        m, s, u = row_blocks(
            x, lambda xb: step(stats_init(xb.shape[0], 3), transform(xb, inv_temp, None)[0]), 3,
            whole=inv_temp == 1.0)
    elif one_pass(vocab, n):  # one kernel; the label's logit as a plain sum
        z, _ = transform(x, inv_temp, None)
        picked = () if y is None else (
            jnp.where(jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) == y[:, None], z, 0.0),)
        m, s, *rest = one_pass_stats(z, centered=opts.entropy, add=picked)
        u = rest.pop(0) if opts.entropy else jnp.zeros_like(s)  # u only feeds the entropy
        return m, s, u, rest[0] if rest else None
    else:
        width, count = chunk_layout(vocab, n)

        def body(i, carry):
            start, owned = chunk_start(i, vocab, width)
            z, _ = transform(jax.lax.dynamic_slice_in_dim(x, start, width, axis=1), inv_temp,
                             None)
            return step(carry, jnp.where(start + jnp.arange(width) >= owned, z, -jnp.inf))

        m, s, u = jax.lax.fori_loop(0, count, body, carry_like(x, stats_init(n, 3)))
    zy = None
    if y is not None:
        inside = (y >= 0) & (y < vocab)
        safe = jnp.clip(y, 0, vocab - 1)
        zy, _ = transform(jnp.take_along_axis(x, safe[:, None], axis=1)[:, 0], inv_temp, None)
        zy = jnp.where(inside, zy, 0.0)
    return m, s, u, zy


def rows_fwd(x: jax.Array, y: jax.Array | None, opts):
    """Per-row (lse, entropy or None, logp or None, lse_lo) of `[N, V]` logits, one chunked
    pass."""
    m, s, u, zy = slice_stats(x, y, opts)
    return finish(m, s, u if opts.entropy else None, zy, y, x.shape[-1])


def rows_bwd(x: jax.Array, y: jax.Array | None, lse, lse_lo, ent, cot, opts) -> jax.Array:
    """Gradient for per-row cotangents cot = [N, 3] (g_lse, g_entropy, g_logp), chunk by
    chunk; log p = (z - lse) - lse_lo (lse_lo zeros where unknown)."""
    vocab = x.shape[-1]
    inv_temp = 1.0 / opts.temperature
    live = ~jnp.isneginf(lse)
    lse_safe = jnp.where(live, lse, 0.0)[:, None]
    lse_lo = lse_lo[:, None]
    a = cot[:, 0]
    c = jnp.where(live, cot[:, 1], 0.0) if opts.entropy else None
    if c is not None:
        a = a - c * jnp.where(live, ent, 0.0)
    b = poison = None
    if y is not None:
        b = jnp.where(live, cot[:, 2], 0.0)
        a = a - b
        poison = ((y < 0) | (y >= vocab)) & (b != 0)
    a = jnp.where(live, a, 0.0)
    a = jnp.where(jnp.isposinf(lse), jnp.nan, a)[:, None]  # a NaN lse: the NaN p does it

    def chunk_grad(cols, xc):
        z, _ = transform(xc, inv_temp, None)
        logp = (z - lse_safe) - lse_lo
        p = jnp.exp(logp)
        g = a * p
        if c is not None:
            g = g - c[:, None] * jnp.where(p > 0, logp, 0.0) * p
        if b is not None:
            g = jnp.where(cols[None, :] == y[:, None], g + b[:, None], g)
            g = jnp.where(poison[:, None], jnp.nan, g)
        return g * inv_temp

    return write_chunks(x, x.dtype, chunk_grad)
