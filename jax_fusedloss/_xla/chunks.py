"""Walking `[N, V]` in vocabulary chunks with plain JAX, without `[N, V]` float32 temporaries."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jax_fusedloss._sharding import match_varying

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
    u = x / softcap
    t = jnp.tanh(u)
    # 1 - tanh(u)**2 = 4e / (1 + e)**2 with e = exp(-2|u|): no cancellation where |t| ~ 1.
    e = jnp.exp(-2.0 * jnp.abs(u))
    return softcap * t, 4.0 * e / ((1.0 + e) * (1.0 + e)) * inv_temp


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
        ms = safe_max(m_new)
        alpha = jnp.exp(m - ms)
        e = jnp.exp(z - ms[:, None])
        zf = jnp.where(mask, z, 0.0)
        return (m_new, s * alpha + e.sum(axis=1), sz + zf.sum(axis=1),
                szp * alpha + jnp.where(e > 0, z * e, 0.0).sum(axis=1))

    zeros = jnp.zeros((n,), jnp.float32)
    init = carry_like(x, (jnp.full((n,), -jnp.inf, jnp.float32), zeros, zeros, zeros))
    return jax.lax.fori_loop(0, count, body, init)


def safe_max(m):
    """The reference of a running sum: m where finite, 0 where m is +-inf, NaN stays NaN (see
    kernels/_online.py: an all -inf row sums to 0, a row with +inf sums to +inf, never NaN)."""
    return jnp.where(jnp.isinf(m), 0.0, m)


def lse_from_stats(m, s):
    """-inf where s == 0 (no entry above -inf), else safe_max(m) + log(s): +inf for a row with
    a +inf entry, NaN for a row with a NaN entry."""
    return jnp.where(s == 0, -jnp.inf, safe_max(m) + jnp.log(jnp.where(s == 0, 1.0, s)))


def poison_inf(lse):
    """+inf -> NaN: a loss or gradient built on a +inf lse is NaN (the NaN/+inf policy)."""
    return jnp.where(jnp.isposinf(lse), jnp.nan, lse)


def write_chunks(x: jax.Array, out_dtype, chunk_grad: Callable) -> jax.Array:
    """Builds an `[N, V]` array chunk by chunk: chunk_grad(cols, z, dz) -> float32 [N, width]."""
    n, vocab = x.shape
    width, count = chunk_layout(vocab)

    def body(i, out):
        start, _ = chunk_start(i, vocab, width)
        cols = start + jnp.arange(width)
        g = chunk_grad(cols, jax.lax.dynamic_slice_in_dim(x, start, width, axis=1))
        return jax.lax.dynamic_update_slice_in_dim(out, g.astype(out_dtype), start, axis=1)

    return jax.lax.fori_loop(0, count, body, carry_like(x, jnp.zeros((n, vocab), out_dtype)))


def carry_like(x: jax.Array, carry):
    """A loop carry (pytree) given the varying manual axes of x, so that the twins' loops type
    check inside shard_map."""
    return jax.tree.map(lambda c: match_varying(c, x), carry)
