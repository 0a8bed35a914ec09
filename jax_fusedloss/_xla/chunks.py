"""Walking `[N, V]` in vocabulary chunks with plain JAX, without `[N, V]` float32 temporaries."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

CHUNK = 4096  # columns per step: [N, 4096] float32 temporaries at most


def chunk_layout(vocab: int) -> tuple[int, int]:
    """(chunk width, number of chunks). The last chunk is shifted left to stay in bounds."""
    width = min(vocab, CHUNK)
    return width, -(-vocab // width)


def chunk_start(i, vocab: int, width: int):
    """Start column of chunk i and the first column it owns (earlier ones belong to chunk i-1)."""
    owned = i * width
    return jnp.minimum(owned, vocab - width), owned


def transform(x: jax.Array, inv_temp: float, softcap: float | None):
    """(z, dz/dx) in float32 for a chunk of raw logits."""
    x = x.astype(jnp.float32) * inv_temp
    if softcap is None:
        return x, jnp.full_like(x, inv_temp)
    t = jnp.tanh(x / softcap)
    return softcap * t, (1.0 - t * t) * inv_temp


def online_stats(x: jax.Array, inv_temp: float = 1.0, softcap: float | None = None):
    """Per row of `[N, V]`: (max, sum exp(z - max), sum z, sum z * exp(z - max)), float32.

    Masked or -inf entries add nothing; the merge identity is (-inf, 0, 0, 0).
    """
    n, vocab = x.shape
    width, count = chunk_layout(vocab)

    def body(i, carry):
        m, s, sz, szp = carry
        start, owned = chunk_start(i, vocab, width)
        mask = (start + jnp.arange(width)) >= owned
        z, _ = transform(jax.lax.dynamic_slice_in_dim(x, start, width, axis=1), inv_temp, softcap)
        z = jnp.where(mask, z, -jnp.inf)
        m_new = jnp.maximum(m, z.max(axis=1))
        ms = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        alpha = jnp.exp(m - ms)
        e = jnp.exp(z - ms[:, None])
        zf = jnp.where(mask, z, 0.0)
        return (m_new, s * alpha + e.sum(axis=1), sz + zf.sum(axis=1),
                szp * alpha + jnp.where(e > 0, z * e, 0.0).sum(axis=1))

    zeros = jnp.zeros((n,), jnp.float32)
    return jax.lax.fori_loop(0, count, body, (jnp.full((n,), -jnp.inf, jnp.float32), zeros,
                                              zeros, zeros))


def lse_from_stats(m, s):
    return jnp.where(s > 0, jnp.where(jnp.isneginf(m), 0.0, m) + jnp.log(s), -jnp.inf)


def write_chunks(x: jax.Array, out_dtype, chunk_grad: Callable) -> jax.Array:
    """Builds an `[N, V]` array chunk by chunk: chunk_grad(cols, z, dz) -> float32 [N, width]."""
    n, vocab = x.shape
    width, count = chunk_layout(vocab)

    def body(i, out):
        start, _ = chunk_start(i, vocab, width)
        cols = start + jnp.arange(width)
        g = chunk_grad(cols, jax.lax.dynamic_slice_in_dim(x, start, width, axis=1))
        return jax.lax.dynamic_update_slice_in_dim(out, g.astype(out_dtype), start, axis=1)

    return jax.lax.fori_loop(0, count, body, jnp.zeros((n, vocab), out_dtype))
