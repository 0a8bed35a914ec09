"""Triton building blocks shared by every kernel family: the logit transform and online softmax.

Imports triton only. Every helper works on one tile of a row held in registers as float32.
"""
import triton
import triton.language as tl


@triton.jit
def load_tile(row_ptr, cols, mask, inv_temp, softcap, HAS_SOFTCAP: tl.constexpr):
    """Loads a tile and returns (z, dz/dx) in float32; masked lanes get z = -inf.

    z = softcap * tanh(x * inv_temp / softcap) when HAS_SOFTCAP, else x * inv_temp.
    """
    return load_tile_hint(row_ptr, cols, mask, inv_temp, softcap, HAS_SOFTCAP, "")


@triton.jit
def load_tile_hint(row_ptr, cols, mask, inv_temp, softcap, HAS_SOFTCAP: tl.constexpr,
                   EVICTION: tl.constexpr):
    """load_tile with an L2 eviction hint ("", "evict_last" or "evict_first")."""
    x = tl.load(row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICTION)
    x = x.to(tl.float32) * inv_temp
    if HAS_SOFTCAP:
        # tanh(u) = 1 - 2 / (exp(2u) + 1): saturates cleanly to +-1 for large |u|.
        t = 1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0)
        z = softcap * t
        dz = (1.0 - t * t) * inv_temp
    else:
        z = x
        dz = tl.zeros_like(x) + inv_temp
    z = tl.where(mask, z, float("-inf"))
    return z, dz


@triton.jit
def safe_max(m):
    """The max to subtract: 0 where a row has seen only -inf, so exp(-inf - 0) = 0, never NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def merge_stats(m_a, s_a, m_b, s_b):
    """Merges two (max, sum of exp(z - max)) pairs; the identity is (-inf, 0)."""
    m = tl.maximum(m_a, m_b)
    ms = safe_max(m)
    s = s_a * tl.exp(m_a - ms) + s_b * tl.exp(m_b - ms)
    return m, s


@triton.jit
def tile_update(m, s, z):
    """One online-softmax step: folds a tile z (float32, -inf at masked lanes) into (m, s)."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    ms = safe_max(m_new)
    s = s * tl.exp(m - ms) + tl.sum(tl.exp(z - ms), axis=0)
    return m_new, s


@triton.jit
def stats_to_lse(m, s):
    """log-sum-exp from (max, sum); -inf for a row with no finite entry."""
    return tl.where(s > 0.0, safe_max(m) + tl.log(s), float("-inf"))


@triton.jit
def hint_multiple(x, ALIGN: tl.constexpr):
    """Returns x (a size or stride the caller guarantees is a multiple of ALIGN) in a form the
    compiler knows is a multiple of ALIGN, so row starts and tile masks allow 16-byte vector
    loads. jax-triton passes scalars without the divisibility specialisation that Triton's own
    launcher infers; (x // ALIGN) * ALIGN carries it (tl.multiple_of on a scalar does not)."""
    return (x // ALIGN) * ALIGN
