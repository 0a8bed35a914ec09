"""Walking `[N, V]` with plain JAX without `[N, V]` float32 temporaries.

Two walks give the same per-row statistics (the same step functions, see `online_stats`):
- by vocabulary chunks of `CHUNK` columns (TPU, GPU): an online softmax over the chunks;
- on CPU by whole rows (`whole_rows`): XLA:CPU reduces whole rows fast (YNNPACK fusions), so a
  row is one chunk. A float32 `x` is reduced at once (no temporaries); a 16-bit `x` is walked in
  blocks of rows through a uint16 view (see `row_blocks`). The gradient is one elementwise
  fusion over `[N, V]` that writes the output dtype directly.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jax_fusedloss._sharding import match_varying

CHUNK = 4096  # columns per step: [N, 4096] float32 temporaries at most
# ... unless a whole row's float32 temporaries for all N rows fit in this: then one chunk is
# the whole row. A walk over 32 chunks of a few rows is launch-bound (H100, bf16, V=128256, in
# one jitted program: logsumexp N=1 328 us per call chunked vs 12 us for one chunk, which is
# jax.nn.logsumexp; benchmarks/results/fewrows_h100.csv).
FULL_ROW_BYTES = 64 << 20
# ... and up to this many rows, that one chunk is reduced by `one_pass_stats` (one variadic
# reduction) rather than max + sum exp. H100, bf16, V=128256, logsumexp in one jitted program
# of 64 calls, us per call, one-pass / jax.nn.logsumexp: N=1 14.7 / 16.2, N=8 17.7 / 18.3,
# N=64 36.3 / 31.3 (its exps per element cost more than a launch there);
# benchmarks/results/fewrows_xla_h100.txt.
ONE_PASS_MAX_ROWS = 16
# CPU, 16-bit logits: rows per block so a block's float32 copy is about this size (a [65,
# 32000] block; measured as fast as 16 or 256 rows on a 2-core EPYC, benchmarks/cpu.py).
ROW_BLOCK_BYTES = 8 << 20


# Tests set this to walk vocabulary chunks on CPU too (the GPU and TPU walk).
CHUNKED_ON_CPU = False


def whole_rows() -> bool:
    """Whether the twins take a whole row as one chunk (CPU): decided at trace time."""
    return jax.default_backend() == "cpu" and not CHUNKED_ON_CPU


def chunk_layout(vocab: int, n: int | None = None) -> tuple[int, int]:
    """(chunk width, number of chunks) for `[n, vocab]`: whole rows when their float32 copy fits
    FULL_ROW_BYTES, else CHUNK columns. The last chunk is shifted left to stay in bounds."""
    width = vocab if n is not None and n * vocab * 4 <= FULL_ROW_BYTES else min(vocab, CHUNK)
    return width, -(-vocab // width)


def one_pass(vocab: int, n: int) -> bool:
    """Whether `[n, vocab]` is reduced by `one_pass_stats` (whole rows in one chunk, at most
    ONE_PASS_MAX_ROWS of them) rather than walked chunk by chunk."""
    return chunk_layout(vocab, n)[1] == 1 and n <= ONE_PASS_MAX_ROWS


def chunk_start(i, vocab: int, width: int):
    """Start column of chunk i and the first column it owns (earlier ones belong to chunk i-1)."""
    owned = i * width
    return jnp.minimum(owned, vocab - width), owned


def transform(x: jax.Array, inv_temp: float, softcap: float | None):
    """(z, dz/dx) in float32 for a chunk of raw logits."""
    x = x.astype(jnp.float32) * inv_temp
    if softcap is None:
        return rounded(x) if inv_temp != 1.0 else x, jnp.full_like(x, inv_temp)
    u = x / softcap
    t = jnp.tanh(u)
    # 1 - tanh(u)**2 = 4e / (1 + e)**2 with e = exp(-2|u|): no cancellation where |t| ~ 1.
    e = jnp.exp(-2.0 * jnp.abs(u))
    return rounded(softcap * t), 4.0 * e / ((1.0 + e) * (1.0 + e)) * inv_temp


def rounded(z):
    """z (a product) rounded to float32 before it is used, on CPU: in one elementwise fusion
    XLA:CPU contracts `x * c - m` into an FMA, so `z - lse` at a row's largest entry would
    differ between the statistics and the gradient (a V=1 row's gradient not exactly 0). The
    select (NaN stays NaN) keeps the product apart; elsewhere z is returned as is."""
    return jnp.where(z == z, z, jnp.nan) if whole_rows() else z


def online_step(carry, z, zsum):
    """One chunk of `online_stats`: carry (max, s, sum z) updated by chunk z (masked entries
    -inf) and zsum (z with masked entries 0)."""
    m, s, sz = carry
    m_new = jnp.maximum(m, z.max(axis=1))
    ms = safe_max(m_new)
    e = jnp.exp(z - ms[:, None])
    return m_new, s * jnp.exp(m - ms) + e.sum(axis=1), sz + zsum.sum(axis=1)


def one_pass_stats(z: jax.Array, centered: bool = False, add: tuple = ()):
    """Per row of a float32 `[N, W]` z: (max m, s = sum exp(z - m)[, u = sum (z - m) exp(z -
    m) if `centered`], the plain sums of the `[N, W]` arrays in `add`) in ONE variadic
    reduction whose combiner merges online-softmax partials: one XLA kernel where the
    two-reduction formula (max, then sum exp) takes two or more. For few rows on a GPU (a whole
    row is one chunk), where launches, not arithmetic, decide. Sums are relative to
    safe_max(m), as `online_step`'s: an all -inf row gives (-inf, 0, 0, ...), a row with +inf
    gives s = +inf, a row with NaN gives NaN."""
    f32 = jnp.float32
    d = z - safe_max(z)
    s0 = jnp.exp(d)  # 1 at finite z, 0 at -inf, +inf at +inf, NaN at NaN
    ops = (z, s0) + ((jnp.where(s0 > 0, d, 0.0) * s0,) if centered else ()) + tuple(add)
    k = 3 if centered else 2  # the partials merged by rescaling; the rest add

    def combine(a, b):
        m = jnp.maximum(a[0], b[0])
        ref = safe_max(m)
        s = u = 0.0
        for part in (a, b):
            shift = safe_max(part[0]) - ref
            # a partial's weight under the merged reference: 0 for an empty (-inf) one
            w = jnp.where(jnp.isneginf(part[0]), 0.0, jnp.exp(shift))
            s = s + part[1] * w
            if centered:  # sum (z - ref) e = w * (u_i + (m_i - ref) s_i)
                u = u + jnp.where(w > 0, (part[2] + shift * part[1]) * w, 0.0)
        return (m, s) + ((u,) if centered else ()) + tuple(
            x + y for x, y in zip(a[k:], b[k:]))

    init = (jnp.array(-jnp.inf, f32),) + (jnp.array(0.0, f32),) * (len(ops) - 1)
    return jax.lax.reduce(ops, init, combine, (1,))


def stats_init(n: int, count: int):
    """The merge identity (-inf, 0, ...) for `count` float32 per-row statistics."""
    zeros = jnp.zeros((n,), jnp.float32)
    return (jnp.full((n,), -jnp.inf, jnp.float32),) + (zeros,) * (count - 1)


def online_stats(x: jax.Array, inv_temp: float = 1.0, softcap: float | None = None):
    """Per row of `[N, V]`: (max, sum exp(z - max), sum z), float32.

    Masked or -inf entries add nothing to the sum of exponentials; the merge identity is
    (-inf, 0, 0).
    """
    n, vocab = x.shape
    if whole_rows():
        def rows(xb):
            z, _ = transform(xb, inv_temp, softcap)
            return online_step(stats_init(xb.shape[0], 3), z, z)

        return row_blocks(x, rows, 3, whole=softcap is None and inv_temp == 1.0)
    if one_pass(vocab, n):  # few rows: one kernel
        z, _ = transform(x, inv_temp, softcap)
        return one_pass_stats(z, add=(z,))
    width, count = chunk_layout(vocab, n)

    def body(i, carry):
        start, owned = chunk_start(i, vocab, width)
        mask = (start + jnp.arange(width)) >= owned
        z, _ = transform(jax.lax.dynamic_slice_in_dim(x, start, width, axis=1), inv_temp, softcap)
        return online_step(carry, jnp.where(mask, z, -jnp.inf), jnp.where(mask, z, 0.0))

    return jax.lax.fori_loop(0, count, body, carry_like(x, stats_init(n, 3)))


def row_blocks(x: jax.Array, rows: Callable, count: int, whole: bool = False):
    """rows(xb) -> `count` float32 [R] statistics of the rows xb of x, for all rows of x.

    With `whole` (rows reduces x itself, no transformed copy to share between reductions), a
    float32 x is passed at once: XLA:CPU fuses each reduction with its elementwise producers.
    Otherwise x is walked in blocks of about ROW_BLOCK_BYTES of float32, the last block shifted
    up to stay in bounds (its overlap is recomputed, equal), so that a transformed z (softcap,
    temperature) or a 16-bit x's float32 copy (YNNPACK's reductions take float32) is one
    block. XLA:CPU's float normalization turns a bf16 dynamic-slice into a slice of a float32
    copy of all of x hoisted out of the loop: a uint16 view of x is sliced instead.
    """
    n, vocab = x.shape
    if (whole and x.dtype == jnp.float32) or n == 0:
        return rows(x)
    r = min(n, max(1, ROW_BLOCK_BYTES // (4 * vocab)))
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x

    def body(i, out):
        start = jnp.minimum(i * r, n - r)
        xb = jax.lax.dynamic_slice_in_dim(bits, start, r, axis=0)
        xb = jax.lax.bitcast_convert_type(xb, x.dtype) if bits is not x else xb
        return tuple(jax.lax.dynamic_update_slice_in_dim(o, v, start, axis=0)
                     for o, v in zip(out, rows(xb)))

    init = tuple(jnp.zeros((n,), jnp.float32) for _ in range(count))
    return jax.lax.fori_loop(0, -(-n // r), body, carry_like(x, init))


def safe_max(m):
    """The reference of a running sum: m where finite, 0 where m is +-inf, NaN stays NaN (see
    kernels/_online.py: an all -inf row sums to 0, a row with +inf sums to +inf, never NaN)."""
    return jnp.where(jnp.isinf(m), 0.0, m)


def lse_from_stats(m, s):
    """-inf where s == 0 (no entry above -inf), else safe_max(m) + log(s): +inf for a row with
    a +inf entry, NaN for a row with a NaN entry."""
    return jnp.where(s == 0, -jnp.inf, safe_max(m) + jnp.log(jnp.where(s == 0, 1.0, s)))


def lse_parts(m, s):
    """(hi, lo): the log-sum-exp from (max, sum relative to safe_max(max)) as an unevaluated
    float32 sum, hi = lse_from_stats(m, s) and lo the part of safe_max(m) + log(s) that
    rounding hi lost (TwoSum; 0 where hi is not finite). exp((z - hi) - lo) is a softmax entry
    whose error does not grow with |lse| (see kernels/_online.lse_parts)."""
    ms = safe_max(m)
    ls = jnp.log(jnp.where(s == 0, 1.0, s))
    hi = jnp.where(s == 0, -jnp.inf, ms + ls)
    back = hi - ms
    lo = (ms - (hi - back)) + (ls - back)
    return hi, jnp.where(jnp.isfinite(hi), lo, 0.0)


def poison_inf(lse):
    """+inf -> NaN: a loss or gradient built on a +inf lse is NaN (the NaN/+inf policy)."""
    return jnp.where(jnp.isposinf(lse), jnp.nan, lse)


def write_chunks(x: jax.Array, out_dtype, chunk_grad: Callable) -> jax.Array:
    """Builds an `[N, V]` array chunk by chunk: chunk_grad(cols, x chunk) -> float32 [N, width].
    On CPU the whole row is one chunk: one elementwise fusion writes out_dtype."""
    n, vocab = x.shape
    if whole_rows():
        return chunk_grad(jnp.arange(vocab), x).astype(out_dtype)
    width, count = chunk_layout(vocab, n)

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
