"""Top-K distillation with a tail bucket (kd_loss / distill_loss with tail=True): the
(K+1)-bucket forward KL and generalised Jensen-Shannon divergence, forward with the fused
unit-cotangent gradient, and the backward from saved statistics.

Per row, with s = z / T (z the softcapped logits), q = softmax(s) over the whole vocabulary,
D the distinct valid teacher ids, P_d the teacher's probability of id d (the sum of p_k over
the entries listing d), P_t = max(0, 1 - sum_k p_k) (0 when D is the whole vocabulary),
Q_d = q_d and Q_t = sum_{j not in D} q_j:

    kl  = sum_b P_b (log P_b - log Q_b)
    jsd = sum_b beta P_b (log P_b - log M_b) + (1 - beta) Q_b (log Q_b - log M_b),
          M_b = beta P_b + (1 - beta) Q_b

over the K+1 buckets b; the row loss is kd_a * div (+ ce_a * ce for distill_loss, ce the
cross-entropy row of kernels/_ce_core.py). The spec is jax_fusedloss/_xla/kd_tail.py (the XLA
rows), whose statistics layout (TAIL_FIELDS) these kernels share, so either backward takes
either forward's statistics.

Q_t without cancellation: the row walk (_tail_stats, _ce_core.slice_stats' per-thread walk
with its prefetch and kept tiles) sums exp((z_j - m_t) / T) over the tail columns only (S_t,
the ids' columns taken as -inf; m_t their max), and the row's sum is rebuilt from it and the
distinct ids' gathered logits, S = S_t + sum_d exp((z_d - r) / T) relative to the row's max
r: sums of positive terms, nothing subtracted. The mask is a bitmap of the row's columns
(one bit a column of the aligned span) that the row's program builds before its walk
(_mark_ids: zero it, one atomic or an id, a barrier each) and reads back one byte a thread
row of each tile, prefetched with the tile (_tile_bits): no per-column search, no sorted
ids. The bitmap lives in the row's own gradient buffer, which the dense gradient pass
overwrites after a barrier (the fused forward), else in an int32 [N, ceil(V / 32)] buffer
(the statistics-only forward, a gradient written over the logits, rows too short to hold
it).
The edge tile of an unaligned row (at most 2 * VEC - 2 columns) compares against every id.
Which entries list the same id (D, P_d) comes from a launch of its own before the walk
(tail_dups_kernel): that comparison in the row program cost the walk its registers.

With G_b = dF/dQ_b and C = sum_b G_b Q_b the gradient w.r.t. s_j is q_j (G_b(j) - C): on a tail
column alpha1 q_j + alpha2 q_j / Q_t (kl: alpha1 = P_D + P_t, alpha2 = -P_t; jsd: alpha1 =
(1 - beta) log(Q_t / M_t) - C, alpha2 = 0), one exponential a column (the two terms share
exp((z_j - r) / T), their coefficients folded into one exponent offset); at an id its own
value (kl: (P_D + P_t) q_d - P_d; jsd: q_d ((1 - beta) log(Q_d / M_d) - C)), times kd_a / T,
stored over the dense value: by tail_ids_kernel (a launch of its own, as kd_ids_kernel) after
the fused forward + gradient, after a barrier in the backward kernel.

Kernels take (inputs..., scalars..., outputs..., CONSTEXPRS). Imports triton only.
"""
import math

import triton
import triton.language as tl

from jax_fusedloss._validate import inverse_temperature
from jax_fusedloss.kernels import launch
from jax_fusedloss.kernels._ce_core import (ce_coefs, load_raw, load_z,
                                            merge_scaled, to_z)
from jax_fusedloss.kernels._online import (LOG2E, edge_tile, hint_multiple, lse_parts,
                                           merge_stats, poison_inf, safe_max, span_ptr,
                                           vector_span)
from jax_fusedloss.kernels.kd import (DUP_CHUNK, _entries, _gather, _row_state, distill_ce,
                                      save_label_logit)
from jax_fusedloss.kernels.kd import _write_dense as _kd_write_dense
from jax_fusedloss.kernels.launch import (FWD_TILE_ELEMS, GRAD_TILE_ELEMS, KD_IDS_WARPS,
                                          _tile, row_config, vocab_align)
from jax_fusedloss.kernels.plan import LOGITS, Buf, Launch, Plan, Zeros, placeholder

# float32 [N, TAIL_FIELDS] = (lse(z), lgS, lgS_t, ce_a, kd_a, r, lg_x, alpha1, alpha2, C), as
# _xla/kd_tail.py's TAIL_FIELDS: q_j = exp((z_j - r) / T - lgS), q_j / Q_t =
# exp((z_j - r) / T - lgS_t), softmax(z)_j = exp((z_j - r) - lg_x); the row weights at 3:5.
TAIL_FIELDS = tl.constexpr(10)
FLT_MAX = tl.constexpr(3.4028234663852886e38)
# tail_dups_kernel's rows a program (fewer where [rows, BLOCK_K] would pass DUPS_TILE
# entries), warps, and entries a load of its repeat check
DUPS_ROWS = 32
DUPS_TILE = 2048
DUPS_WARPS = 4
DUPS_STEP = 16
BITMAP_ZERO_BLOCK = 1024  # int32 words of the id bitmap _mark_ids zeroes at once
# Whole tiles tail_fwd_kernel's walk keeps in registers for its gradient pass (as
# launch.KD_KEEP_VOCAB; rows of one exponential a logit only), per itemsize: the vocabulary
# from which one, then two, are kept (the prefetch is off then). Measured on H100, bf16,
# N=8192, V=128256, K=64, fwd+bwd of kd_loss tail / jsd / distill_loss tail, ms, since the walk
# sums the tail alone (A/B/A in separate processes): none 2.084 / 2.123 / 2.246, one 2.090 /
# 2.125 / 2.240, two 1.928 / 1.951 / 2.076 (H200, before that change: one tile 1.885 against
# 1.809 without). Below V=120000 nothing was measured: none.
TAIL_KEEP_VOCAB = {2: (120_000, 120_000)}


@triton.jit
def _log(a):
    """log(a), -inf at a <= 0."""
    return tl.where(a > 0.0, tl.log(tl.where(a > 0.0, a, 1.0)), float("-inf"))


@triton.jit
def _logaddexp(u, v):
    mx = tl.maximum(u, v)
    ms = tl.where(mx == float("-inf"), 0.0, mx)
    return tl.where(mx == float("-inf"), float("-inf"),
                    ms + tl.log(tl.exp(u - ms) + tl.exp(v - ms)))


@triton.jit
def _jsd_parts(lP, lQ, beta, log_b, log_1mb):
    """(beta P (log P - log M), (1 - beta) Q (log Q - log M), log M), zero-mass terms 0."""
    lM = _logaddexp(log_b + lP, log_1mb + lQ)
    tp = tl.where(lP == float("-inf"), 0.0, beta * tl.exp(lP) * (lP - lM))
    tq = tl.where(lQ == float("-inf"), 0.0, (1.0 - beta) * tl.exp(lQ) * (lQ - lM))
    return tp, tq, lM


@triton.jit
def _duplicates(ids_ptr, lp_ptr, row, V, K, active, ids, BLOCK_K: tl.constexpr,
                K_CHUNK: tl.constexpr):
    """Per entry: (sum of p over the valid entries listing its id, their count, how many of
    them come before it)."""
    kk = tl.arange(0, BLOCK_K)
    sum_p = tl.zeros([BLOCK_K], tl.float32)
    count = tl.zeros([BLOCK_K], tl.float32)
    before = tl.zeros([BLOCK_K], tl.float32)
    for j in range(0, K, K_CHUNK):
        jj = j + tl.arange(0, K_CHUNK)
        idj, vj, _lpj, pj = _entries(ids_ptr, lp_ptr, row, V, K, active, jj)
        same = (ids[:, None] == idj[None, :]) & vj[None, :]
        sum_p += tl.sum(tl.where(same, pj[None, :], 0.0), axis=1)
        count += tl.sum(tl.where(same, 1.0, 0.0), axis=1)
        before += tl.sum(tl.where(same & (jj[None, :] < kk[:, None]), 1.0, 0.0), axis=1)
    return sum_p, count, before


@triton.jit
def tail_dups_kernel(
    # pointers: ids / logprobs [N, K] (-1: no entry)
    ids_ptr, logprobs_ptr,
    # sizes
    N, V, K,
    # outputs: dup [N, K]
    dup_ptr,
    # constexprs
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, STEP: tl.constexpr,
):
    """Grid (cdiv(N, ROWS),): where each teacher entry stands among its row's entries that
    list its id, for tail_fwd_kernel and tail_ids_kernel (_row_dups): -1 where the entry is
    not valid or an earlier entry lists its id, -2 where it is its id's only entry, else (the
    first of several) the sum of their p (as _duplicates). A launch of its own: the O(K^2)
    comparison in the row walk's program, even skipped, cost the walk registers (H100,
    V=128256 bf16: 0.15 ms of 1.87). ROWS rows a program, each entry against entry j at step
    j. (This kernel alone, H100, N=8192, K=64, distinct ids: 27 us with the sums and counts
    computed for every row, 16 us with the check first, 12 us with STEP entries a load.)"""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kk = tl.arange(0, BLOCK_K)
    # _entries of [ROWS, BLOCK_K] (rows past N read as row N - 1, none of their entries valid)
    ids, valid, _lp, p = _entries(ids_ptr, logprobs_ptr,
                                  tl.minimum(rows, N - 1).to(tl.int64)[:, None], V, K,
                                  (rows < N)[:, None], kk[None, :])
    ids = tl.where(valid, ids, -1)
    # first whether any row of the program lists an id twice (a compare a pair), then only
    # then the sums, counts and order of the repeated entries
    again = tl.zeros([ROWS, BLOCK_K], tl.int32)
    jc = tl.arange(0, STEP)
    for j0 in range(0, K, STEP):  # STEP entries a load, then one a step from registers
        blk = tl.load(ids_ptr + rows.to(tl.int64)[:, None] * K + j0 + jc[None, :],
                      mask=(rows < N)[:, None] & (j0 + jc < K)[None, :], other=-1)
        for jj in tl.static_range(STEP):
            idj = tl.sum(tl.where(jc[None, :] == jj, blk, 0), axis=1)
            again |= ((ids == idj[:, None]) & (kk[None, :] != j0 + jj)).to(tl.int32)
    dup = tl.where(valid, -2.0, -1.0)
    if tl.max(tl.max(tl.where(valid, again, 0), axis=1), axis=0) != 0:
        sum_p = tl.zeros([ROWS, BLOCK_K], tl.float32)
        count = tl.zeros([ROWS, BLOCK_K], tl.float32)
        before = tl.zeros([ROWS, BLOCK_K], tl.float32)
        for j in range(0, K):
            at = kk[None, :] == j  # entry j of every row, from registers
            idj = tl.sum(tl.where(at, ids, 0), axis=1)
            pj = tl.sum(tl.where(at, p, 0.0), axis=1)
            same = (ids == idj[:, None]) & valid
            sum_p += tl.where(same, pj[:, None], 0.0)
            count += tl.where(same, 1.0, 0.0)
            before += tl.where(same & (kk[None, :] > j), 1.0, 0.0)
        dup = tl.where(valid & (before == 0.0), tl.where(count > 1.0, sum_p, -2.0), -1.0)
    tl.store(dup_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], dup,
             mask=(rows < N)[:, None] & (kk < K)[None, :])


@triton.jit
def _row_dups(dup_ptr, row, K, valid, p, kk):
    """(first, repeated, sum_p) of a row's entries from tail_dups_kernel's dup: the entries
    that stand for their id (`first`), those among them whose id other entries list too, and
    P_d at them (the entry's p where its id is listed once)."""
    dup = tl.load(dup_ptr + row * K + kk, mask=kk < K, other=-1.0)
    first = valid & (dup != -1.0)
    repeated = first & (dup >= 0.0)
    return first, repeated, tl.where(repeated, dup, p)


@triton.jit
def _mark_ids(bitmap, ids, valid, base, span, V, ZERO_BLOCK: tl.constexpr):
    """Builds the row's id bitmap at `bitmap` (int32 words, 4-byte aligned): bit p set for the
    valid ids at span position p = id - base in [0, span), every other bit of the
    ceil(V / 32) words 0. Zero stores, a barrier, one atomic or an id (duplicates and ids
    sharing a word compose), a barrier: every thread of the program then reads the whole
    bitmap (CTA-scope ordering of bar.sync)."""
    words = tl.cdiv(V, 32)
    for w0 in range(0, words, ZERO_BLOCK):
        w = w0 + tl.arange(0, ZERO_BLOCK)
        tl.store(bitmap + w, tl.zeros([ZERO_BLOCK], tl.int32), mask=w < words)
    tl.debug_barrier()
    p = ids - base
    inside = valid & (p >= 0) & (p < span)
    p = tl.where(inside, p, 0)
    tl.atomic_or(bitmap + (p >> 5), 1 << (p & 31), mask=inside, sem="relaxed", scope="cta")
    tl.debug_barrier()


@triton.jit
def _tile_bits(bits8, p0, span, T: tl.constexpr, VEC: tl.constexpr, MASKED: tl.constexpr):
    """The bitmap bytes of the span tile at span positions p0 + [0, T * VEC): [T] int8, one
    a thread row (its VEC <= 8 columns start at a multiple of VEC); with MASKED only
    positions inside the span are read (0 elsewhere). Read past L1 (.cg): the atomics of
    _mark_ids are performed in L2."""
    p = p0 + tl.arange(0, T) * VEC
    if MASKED:
        b = tl.load(bits8 + (p >> 3), mask=p < span, other=0, cache_modifier=".cg")
    else:
        b = tl.load(bits8 + (p >> 3), cache_modifier=".cg")
    return b


@triton.jit
def _fold(m, s_t, s_x, sumz, z, member, mask, c_kd, DISTILL: tl.constexpr,
          SHARE_EXP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, MASKED: tl.constexpr,
          AXIS: tl.constexpr):
    """One online step over the tail columns of a tile z (float32, -inf at masked lanes; the
    `member` columns, teacher ids, taken as -inf), reduced along AXIS as _ce_core._fold (1:
    per-thread statistics of a [T, VEC] tile): m the max and s_t = sum exp((z - m) / T) of
    the tail columns, (DISTILL, not SHARE_EXP) s_x = sum exp(z - m) of the same columns and
    (HAS_SMOOTHING) sum z over every column."""
    zt = tl.where(member, float("-inf"), z)
    m_new = tl.maximum(m, tl.max(zt, axis=AXIS))
    ms = safe_max(m_new)
    if AXIS == 1:
        d = zt - ms[:, None]
    else:
        d = zt - ms
    s_t = s_t * tl.minimum(tl.math.exp2((m - ms) * c_kd), FLT_MAX) + tl.sum(
        tl.math.exp2(d * c_kd), axis=AXIS)
    if DISTILL:
        if not SHARE_EXP:
            s_x = s_x * tl.minimum(tl.exp(m - ms), FLT_MAX) + tl.sum(tl.exp(d), axis=AXIS)
    if HAS_SMOOTHING:
        sumz += tl.sum(tl.where(mask, z, 0.0) if MASKED else z, axis=AXIS)
    return m_new, s_t, s_x, sumz


@triton.jit
def _tile_fold(m, s_t, s_x, sumz, x, b, p0, mask, softcap, c_kd, HAS_SOFTCAP: tl.constexpr,
               DISTILL: tl.constexpr, SHARE_EXP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
               MASKED: tl.constexpr):
    """_fold of a [T, VEC] tile x of raw logits at span positions p0 + [0, T * VEC), its
    teacher ids the set bits of its bitmap bytes b (_tile_bits)."""
    VEC: tl.constexpr = x.shape[1]
    p = p0 + tl.arange(0, x.shape[0]) * VEC
    shift = (p & 7)[:, None] + tl.arange(0, VEC)[None, :]
    member = ((b.to(tl.int32)[:, None] >> shift) & 1) != 0
    z, _ = to_z(x, mask, softcap, HAS_SOFTCAP, MASKED)
    return _fold(m, s_t, s_x, sumz, z, member, mask, c_kd, DISTILL, SHARE_EXP, HAS_SMOOTHING,
                 MASKED, 1)


@triton.jit
def _tail_stats(x_ptr, row_off, V, bitmap, idv, softcap, inv_temp, BLOCK_V: tl.constexpr,
                ALIGN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DISTILL: tl.constexpr,
                SHARE_EXP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, EVICTION: tl.constexpr,
                PREFETCH: tl.constexpr, KEEP: tl.constexpr):
    """One walk over a row's tail columns, as _ce_core.slice_stats' (the aligned tile walk,
    per-thread statistics merged once at the end, PREFETCH and KEEP as there, the bitmap
    bytes prefetched with the tiles): (m_t, S_t, s_xt, sum z, kept0, kept1) with m_t the max
    of z over the columns that are not teacher ids (`idv`: the ids, -1 where not valid;
    marked in the int32 `bitmap` by the caller before the walk, _mark_ids, except the edge
    tile's, compared directly), S_t = sum exp((z - m_t) / T) over them and s_xt =
    sum exp(z - m_t) (DISTILL without SHARE_EXP, else 0), both relative to safe_max(m_t);
    sum z over every column (HAS_SMOOTHING). The ids' own terms are tail_fwd_kernel's, from
    their gathered logits."""
    VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
    c_kd = inv_temp * LOG2E
    m = tl.full([], float("-inf"), tl.float32)
    s_t = tl.zeros([], tl.float32)
    s_x = tl.zeros([], tl.float32)
    sumz = tl.zeros([], tl.float32)
    k0, k1, lo = vector_span(row_off, 0, V, ALIGN, VEC)
    span = k1 - k0
    bits8 = bitmap.to(tl.pointer_type(tl.int8))
    if ALIGN < VEC:
        cols, in_edge = edge_tile(0, V, lo, k1, VEC)
        ze, _ = load_z(x_ptr + row_off, cols, in_edge, softcap, HAS_SOFTCAP, EVICTION, True)
        hit = tl.max(tl.where(cols[:, None] == idv[None, :], 1, 0), axis=1) != 0
        m, s_t, s_x, sumz = _fold(m, s_t, s_x, sumz, ze, hit, in_edge, c_kd, DISTILL,
                                  SHARE_EXP, HAS_SMOOTHING, True, 0)
    base = span_ptr(x_ptr, row_off, lo, ALIGN, VEC)
    T: tl.constexpr = BLOCK_V // VEC  # per-thread statistics, the edge tile's in thread row 0
    rr = tl.arange(0, T)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    first = tl.arange(0, T) == 0
    m = tl.where(first, m, float("-inf"))
    s_t = tl.where(first, s_t, 0.0)
    s_x = tl.where(first, s_x, 0.0)
    sumz = tl.where(first, sumz, 0.0)
    n_full = span // BLOCK_V
    kept0 = tl.zeros([T, VEC], x_ptr.dtype.element_ty)
    kept1 = tl.zeros([T, VEC], x_ptr.dtype.element_ty)
    if KEEP >= 1:
        kept0 = load_raw(base, k0 + rr, rr < n_full * BLOCK_V, "evict_first", True)
        b = _tile_bits(bits8, 0, n_full * BLOCK_V, T, VEC, True)
        m, s_t, s_x, sumz = _tile_fold(m, s_t, s_x, sumz, kept0, b, 0, rr < n_full * BLOCK_V,
                                       softcap, c_kd, HAS_SOFTCAP, DISTILL, SHARE_EXP,
                                       HAS_SMOOTHING, True)
    if KEEP >= 2:
        kept1 = load_raw(base, k0 + BLOCK_V + rr, rr < (n_full - 1) * BLOCK_V, "evict_first",
                         True)
        b = _tile_bits(bits8, BLOCK_V, n_full * BLOCK_V, T, VEC, True)
        m, s_t, s_x, sumz = _tile_fold(m, s_t, s_x, sumz, kept1, b, BLOCK_V,
                                       rr < (n_full - 1) * BLOCK_V, softcap, c_kd, HAS_SOFTCAP,
                                       DISTILL, SHARE_EXP, HAS_SMOOTHING, True)
    if PREFETCH and x_ptr.dtype.element_ty.primitive_bitwidth <= 16:
        x_next = load_raw(base, k0 + KEEP * BLOCK_V + rr, rr < (n_full - KEEP) * BLOCK_V,
                          EVICTION, True)
        b_next = _tile_bits(bits8, KEEP * BLOCK_V, n_full * BLOCK_V, T, VEC, True)
        for i in range(KEEP, n_full):
            x = x_next
            b = b_next
            x_next = load_raw(base, k0 + (i + 1) * BLOCK_V + rr,
                              rr < (n_full - 1 - i) * BLOCK_V, EVICTION, True)
            b_next = _tile_bits(bits8, (i + 1) * BLOCK_V, n_full * BLOCK_V, T, VEC, True)
            m, s_t, s_x, sumz = _tile_fold(m, s_t, s_x, sumz, x, b, i * BLOCK_V, rr >= 0,
                                           softcap, c_kd, HAS_SOFTCAP, DISTILL, SHARE_EXP,
                                           HAS_SMOOTHING, False)
    else:
        for i in range(KEEP, n_full):
            x = load_raw(base, k0 + i * BLOCK_V + rr, rr >= 0, EVICTION, False)
            b = _tile_bits(bits8, i * BLOCK_V, span, T, VEC, False)
            m, s_t, s_x, sumz = _tile_fold(m, s_t, s_x, sumz, x, b, i * BLOCK_V, rr >= 0,
                                           softcap, c_kd, HAS_SOFTCAP, DISTILL, SHARE_EXP,
                                           HAS_SMOOTHING, False)
    for k in range(k0 + n_full * BLOCK_V, k1, BLOCK_V):  # the partial last tile, if any
        t = k + rr
        x = load_raw(base, t, t < k1, EVICTION, True)
        b = _tile_bits(bits8, k - k0, span, T, VEC, True)
        m, s_t, s_x, sumz = _tile_fold(m, s_t, s_x, sumz, x, b, k - k0, t < k1, softcap, c_kd,
                                       HAS_SOFTCAP, DISTILL, SHARE_EXP, HAS_SMOOTHING, True)
    m_i = m
    m = tl.max(m_i, axis=0)
    s_t = merge_scaled(m_i, s_t, m, inv_temp)
    if DISTILL and not SHARE_EXP:
        _, s_x = merge_stats(m_i, s_x)
    else:
        s_x = tl.sum(s_x, axis=0)  # 0, as a scalar
    return m, s_t, s_x, tl.sum(sumz, axis=0), kept0, kept1


@triton.jit
def _dense_offsets(lgS, lgS_t, lg_x, a1, a2, kd_a, a, inv_temp):
    """(off_s, sgn_s, off_x, sgn_x): the dense gradient at a column with d = z - r is
    sgn_s exp2(d / T * LOG2E - off_s) + sgn_x exp2(d * LOG2E - off_x) (the second for the
    cross-entropy), i.e. kd_a / T (a1 q + a2 q / Q_t) + a softmax(z): the tail coefficient is
    kd_a / T (a1 Q_t + a2) / S_t relative to exp((z - r) / T), taken relative to S where
    a2 == 0 (so Q_t = 0 costs nothing there). A zero coefficient gives offset +inf."""
    k = kd_a * inv_temp
    u = tl.where(a2 == 0.0, k * a1, k * (a1 * tl.exp(lgS_t - lgS) + a2))
    ref = tl.where(a2 == 0.0, lgS, lgS_t)
    off_s = ref * LOG2E - tl.log2(tl.abs(u))
    off_s = tl.where(u == 0.0, float("inf"), off_s)
    off_x = lg_x * LOG2E - tl.log2(tl.abs(a))
    return off_s, tl.where(u < 0.0, -1.0, 1.0), off_x, tl.where(a < 0.0, -1.0, 1.0)


@triton.jit
def _dense_value(z, dz, r, off_s, sgn_s, off_x, sgn_x, c, inv_temp, DISTILL: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr):
    d = z - r
    g = sgn_s * tl.math.exp2(d * (inv_temp * LOG2E) - off_s)
    if DISTILL:
        g += sgn_x * tl.math.exp2(d * LOG2E - off_x)
        if HAS_SMOOTHING:
            g -= c
    if HAS_SOFTCAP:
        g = g * dz
    return g


@triton.jit
def _dense_tile(x_ptr, g_ptr, offs, mask, r, off_s, sgn_s, off_x, sgn_x, c, inv_temp, softcap,
                EVICTION: tl.constexpr, DISTILL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_SMOOTHING: tl.constexpr):
    z, dz = load_z(x_ptr, offs, mask, softcap, HAS_SOFTCAP, EVICTION, True)
    g = _dense_value(z, dz, r, off_s, sgn_s, off_x, sgn_x, c, inv_temp, DISTILL, HAS_SOFTCAP,
                     HAS_SMOOTHING)
    tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=mask, eviction_policy=EVICTION)


@triton.jit
def _write_dense(x_ptr, x_off, g_ptr, g_off, r, off_s, sgn_s, off_x, sgn_x, c, inv_temp,
                 softcap, start, stop, EVICTION: tl.constexpr, BLOCK_V: tl.constexpr,
                 ALIGN: tl.constexpr, DISTILL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_SMOOTHING: tl.constexpr):
    """The dense gradient of columns [start, stop) of a row (the edge tile, then the span
    backwards: the tiles the statistics walk read last first, for L2)."""
    VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
    k0, k1, lo = vector_span(x_off, start, stop, ALIGN, VEC)
    if ALIGN < VEC:
        cols, mask = edge_tile(start, stop, lo, k1, VEC)
        _dense_tile(x_ptr + x_off, g_ptr + g_off, cols, mask, r, off_s, sgn_s, off_x, sgn_x, c,
                    inv_temp, softcap, EVICTION, DISTILL, HAS_SOFTCAP, HAS_SMOOTHING)
    xs = span_ptr(x_ptr, x_off, lo, ALIGN, VEC)
    gs = span_ptr(g_ptr, g_off, lo, ALIGN, VEC)
    n_tiles = tl.cdiv(k1 - k0, BLOCK_V)
    for i in range(0, n_tiles):
        t = k0 + (n_tiles - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
        _dense_tile(xs, gs, t, t < k1, r, off_s, sgn_s, off_x, sgn_x, c, inv_temp, softcap,
                    EVICTION, DISTILL, HAS_SOFTCAP, HAS_SMOOTHING)


@triton.jit
def _write_ids(x_row, g_row, active, label, ids, valid, first, repeated, sum_p, lp, zk, dzk,
               r, lgS, lg_x, a1, C, kd_a, off_s, sgn_s, off_x, sgn_x, a, b, c, inv_temp, beta,
               log_b, log_1mb, softcap, start, stop, xy_ptr, DISTILL: tl.constexpr,
               JSD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
               LABEL_FROM_XK: tl.constexpr):
    """Overwrites the columns of [start, stop) at the valid teacher ids (each from the entry
    that stands for its id, `first`; `repeated`, `sum_p` as _row_dups gives them) and
    (distill) the label column when it is not an id (its dense value - b; its raw logit at
    x_row[label], or at xy_ptr with LABEL_FROM_XK). The dense values must be visible
    first."""
    lq = (zk - r) * inv_temp - lgS
    q = tl.exp(lq)
    if JSD:
        lP = tl.where(repeated, _log(sum_p), lp)
        lM = _logaddexp(log_b + lP, log_1mb + lq)
        v = tl.where(q > 0.0, q * ((1.0 - beta) * (lq - lM) - C), 0.0)
    else:
        v = a1 * q - sum_p
    g = kd_a * inv_temp * v
    if DISTILL:
        g += a * tl.exp((zk - r) - lg_x) - tl.where(ids == label, b, 0.0) - c
    if HAS_SOFTCAP:
        g = g * dzk
    own = first & (ids >= start) & (ids < stop)
    if DISTILL:
        is_id = tl.max(tl.where(valid & (ids == label), 1, 0), axis=0)
        y = tl.where(active & (is_id == 0), label, -1)
        own_y = (y >= start) & (y < stop)
        if LABEL_FROM_XK:
            zy, dzy = load_z(xy_ptr, 0, own_y, softcap, HAS_SOFTCAP, "", True)
        else:
            zy, dzy = load_z(x_row, tl.where(own_y, y, 0), own_y, softcap, HAS_SOFTCAP, "",
                             True)
        gy = _dense_value(zy, dzy, r, off_s, sgn_s, off_x, sgn_x, c, inv_temp, DISTILL, False,
                          HAS_SMOOTHING) - b
        if HAS_SOFTCAP:
            gy = gy * dzy
    tl.store(g_row + tl.where(own, ids, 0), g.to(g_row.dtype.element_ty), mask=own)
    if DISTILL:
        tl.store(g_row + tl.where(own_y, y, 0), gy.to(g_row.dtype.element_ty), mask=own_y)


@triton.jit
def tail_fwd_kernel(
    # pointers: logits [N, V], ids / logprobs [N, K] (-1: no entry), labels [N], row_scale
    # [N, 2] = (ce, kd), tail_dups_kernel's dup [N, K]
    logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, row_scale_ptr, dup_ptr,
    # sizes, strides, options
    V, K, stride_row, inv_temp, ignore_index, smoothing, z_loss, softcap, beta, log_b, log_1mb,
    # outputs: loss [N], stats [N, TAIL_FIELDS], grad [N, V] (WRITE_GRAD; with IN_PLACE the
    # logits' buffer), the id bitmaps int32 [N, ceil(V / 32)] (not BITMAP_IN_GRAD), xk
    # [N, K + 1] (IN_PLACE: the raw logits at the ids, then the label's)
    loss_ptr, stats_ptr, grad_ptr, bitmap_ptr, xk_ptr,
    # constexprs
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr,
    DISTILL: tl.constexpr, JSD: tl.constexpr, SHARE_EXP: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr, ALIGN: tl.constexpr, PREFETCH: tl.constexpr, KEEP: tl.constexpr,
    BITMAP_IN_GRAD: tl.constexpr, ZERO_BLOCK: tl.constexpr, IN_PLACE: tl.constexpr,
):
    """Grid (N,): a row's loss and statistics from one walk over its vocabulary (_tail_stats,
    per-thread as kd_fwd_kernel's, PREFETCH and KEEP as there); with WRITE_GRAD also the dense
    part of the unit-cotangent gradient (kernels/kd.py's _write_dense, the row's lines kept
    in L2 by the walk's evict_last, its first KEEP tiles in registers). The logits at the ids
    are gathered before the walk (their latency hidden by it); the id and label columns of
    the gradient are tail_ids_kernel's (a launch of its own, as kd_ids_kernel). The walk's id
    bitmap (_mark_ids) is at the first 4-byte boundary of the row's gradient with
    BITMAP_IN_GRAD (the dense pass, after a barrier, overwrites it), else in bitmap_ptr.
    IN_PLACE: the gradient overwrites the logits (aliased), so the raw logits at the ids and
    the label go to xk for tail_ids_kernel, and a barrier separates every read of the row's
    scattered logits from the gradient pass."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * stride_row
    label, active, bad = _row_state(labels_ptr, row, V, ignore_index, DISTILL)
    kk = tl.arange(0, BLOCK_K)
    ids, valid, lp, p = _entries(ids_ptr, logprobs_ptr, row, V, K, active, kk)
    if BITMAP_IN_GRAD:
        ITEM: tl.constexpr = grad_ptr.dtype.element_ty.primitive_bitwidth // 8
        g8 = (grad_ptr + row * V).to(tl.pointer_type(tl.int8))
        bitmap = (g8 + (4 - (row * V * ITEM) % 4) % 4).to(tl.pointer_type(tl.int32))
    else:
        bitmap = bitmap_ptr + row * tl.cdiv(V, 32)
    # the bitmap before any load it does not need: its barriers wait for the loads in flight
    # (H100, N=8192, V=128256: the first tiles' loads issued before it cost ~0.1 ms a step,
    # the loads below 0.015-0.022 ms; issued after it the walk hides them)
    VEC: tl.constexpr = 128 // logits_ptr.dtype.element_ty.primitive_bitwidth
    k0, k1, lo = vector_span(row * stride_row, 0, V, ALIGN, VEC)
    idv = tl.where(valid, ids, -1)
    _mark_ids(bitmap, idv, idv >= 0, lo + k0, k1 - k0, V, ZERO_BLOCK)
    first, repeated, sum_p = _row_dups(dup_ptr, row, K, valid, p, kk)
    ce_a = tl.where(active, tl.load(row_scale_ptr + row * 2), 0.0)
    kd_a = tl.where(active, tl.load(row_scale_ptr + row * 2 + 1), 0.0)
    xk = load_raw(x_row, tl.where(valid, ids, 0), valid, "", True)  # raw: kept for IN_PLACE
    zk, _ = to_z(xk, valid, softcap, HAS_SOFTCAP, True)
    zk = tl.where(valid, zk, 0.0)  # as _gather
    m_t, s_t, s_xt, sumz, kept0, kept1 = _tail_stats(
        logits_ptr, row * stride_row, V, bitmap, idv, softcap, inv_temp,
        BLOCK_V, ALIGN, HAS_SOFTCAP, DISTILL, SHARE_EXP, HAS_SMOOTHING,
        "evict_last" if WRITE_GRAD else "", PREFETCH, KEEP)
    if BITMAP_IN_GRAD:
        tl.debug_barrier()  # every thread's bitmap reads before the dense pass overwrites it
    # the whole row from its tail and its distinct ids, relative to r: S = S_t + S_D, sums of
    # positive terms (no cancellation); m the row's max (NaN and +inf as the walk's would be)
    m = tl.maximum(m_t, tl.max(tl.where(first, zk, float("-inf")), axis=0))
    r = safe_max(m)
    tail_scale = tl.math.exp2((safe_max(m_t) - r) * (inv_temp * LOG2E))
    s_t = tl.where(m_t == float("-inf"), 0.0, s_t * tail_scale)
    s_all = s_t + tl.sum(tl.where(first, tl.math.exp2((zk - r) * (inv_temp * LOG2E)), 0.0),
                         axis=0)
    s_x = tl.zeros([], tl.float32)  # (kd_loss: no cross-entropy statistics)
    if DISTILL:
        s_x = s_all
        if not SHARE_EXP:
            s_x = tl.where(m_t == float("-inf"), 0.0, s_xt * tl.exp(safe_max(m_t) - r)) + tl.sum(
                tl.where(first, tl.exp(zk - r), 0.0), axis=0)
    lgS = _log(s_all)
    lgS_t = _log(s_t)
    lQ = (zk - r) * inv_temp - lgS
    lP = tl.where(repeated, _log(sum_p), lp)
    P = tl.sum(p, axis=0)
    covers = tl.sum(tl.where(first, 1, 0), axis=0) >= V
    P_t = tl.where(covers, 0.0, tl.maximum(0.0, 1.0 - P))
    lPt = _log(P_t)
    lQt = lgS_t - lgS
    if JSD:
        tp, tq, _lM = _jsd_parts(lP, lQ, beta, log_b, log_1mb)
        tpt, tqt, lMt = _jsd_parts(lPt, lQt, beta, log_b, log_1mb)
        div = tl.sum(tl.where(first, tp + tq, 0.0), axis=0) + tpt + tqt
        C = tl.sum(tl.where(first, tq, 0.0), axis=0) + tqt
        a1 = tl.where(lQt == float("-inf"), 0.0, (1.0 - beta) * (lQt - lMt)) - C
        a2 = tl.zeros([], tl.float32)
    else:
        ids_term = tl.sum(tl.where(first & (sum_p > 0.0), sum_p * (lP - lQ), 0.0), axis=0)
        div = ids_term + tl.where(P_t > 0.0, P_t * (lPt - lQt), 0.0)
        a1 = P + P_t
        a2 = -P_t
        C = tl.zeros([], tl.float32)
    loss = kd_a * div
    lse_x, lse_lo = lse_parts(m, s_x)
    lse_x = poison_inf(lse_x)
    lg_x = _log(s_x)
    a = 0.0
    c = 0.0
    if DISTILL:
        ce, a, _b, c = distill_ce(x_row, label, V, lse_x, lse_lo, sumz, smoothing, z_loss,
                                  active, bad, ce_a, softcap, HAS_SOFTCAP, HAS_SMOOTHING,
                                  HAS_ZLOSS)
        loss += ce_a * ce
    tl.store(loss_ptr + row, loss)
    out = stats_ptr + row * TAIL_FIELDS
    tl.store(out, lse_x)
    tl.store(out + 1, lgS)
    tl.store(out + 2, lgS_t)
    tl.store(out + 3, ce_a)
    tl.store(out + 4, kd_a)
    tl.store(out + 5, r)
    tl.store(out + 6, lg_x)
    tl.store(out + 7, a1)
    tl.store(out + 8, a2)
    tl.store(out + 9, C)
    if WRITE_GRAD:
        # the tail columns' kd_a / T (a1 q + a2 q / Q_t) as kd's coef_s softmax(s), coef_s =
        # u / T relative to exp(ref) (_dense_offsets' choice of reference)
        u = tl.where(a2 == 0.0, kd_a * a1, kd_a * (a1 * tl.exp(lgS_t - lgS) + a2))
        ref = tl.where(a2 == 0.0, lgS, lgS_t)
        if IN_PLACE:
            xk_row = xk_ptr + row * (K + 1)
            tl.store(xk_row + kk, xk.to(tl.float32), mask=kk < K)
            if DISTILL:
                save_label_logit(x_row, xk_row, label, active, V, K)
            tl.debug_barrier()  # the row's scattered logits read before it is overwritten
        _kd_write_dense(logits_ptr, row * stride_row, grad_ptr, row * V, r, lg_x,
                        tl.where(u == 0.0, 0.0, ref), 1.0, a, c, u, inv_temp, softcap, 0, V,
                        kept0, kept1, "evict_first", BLOCK_V, ALIGN, True, DISTILL, True,
                        HAS_SOFTCAP, HAS_SMOOTHING, KEEP)


@triton.jit
def _row_coefs(labels_ptr, stats_ptr, row, v_total, col0, ignore_index, smoothing, z_loss,
               inv_temp, DISTILL: tl.constexpr, HAS_ZLOSS: tl.constexpr):
    """What the gradient of a row needs from its statistics: (label, active, lgS, lg_x, a1, C,
    kd_a, r, off_s, sgn_s, off_x, sgn_x, a, b, c). The row has `v_total` columns, of which the
    logits at hand start at column `col0` (0, or a block of the LM head's vocabulary walk):
    the label is checked against v_total and returned relative to col0."""
    label, active, bad = _row_state(labels_ptr, row, v_total, ignore_index, DISTILL)
    label = label - col0
    st = stats_ptr + row * TAIL_FIELDS
    lse_x, lgS, lgS_t, ce_a, kd_a = (tl.load(st), tl.load(st + 1), tl.load(st + 2),
                                     tl.load(st + 3), tl.load(st + 4))
    r, lg_x, a1, a2, C = (tl.load(st + 5), tl.load(st + 6), tl.load(st + 7), tl.load(st + 8),
                          tl.load(st + 9))
    a = 0.0
    b = 0.0
    c = 0.0
    if DISTILL:
        a, b, c = ce_coefs(lse_x, v_total, smoothing, z_loss, bad, ce_a, HAS_ZLOSS)
    off_s, sgn_s, off_x, sgn_x = _dense_offsets(lgS, lgS_t, lg_x, a1, a2, kd_a, a, inv_temp)
    return (label, active, lgS, lg_x, a1, C, kd_a, r, off_s, sgn_s, off_x, sgn_x, a, b, c)


@triton.jit
def tail_ids_kernel(
    # pointers: logits [N, V], ids / logprobs [N, K], labels [N], tail_fwd_kernel's stats
    # [N, TAIL_FIELDS], grad [N, V] (aliased to the output), (FROM_XK) xk [N, K + 1],
    # tail_dups_kernel's dup [N, K]
    logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, stats_ptr, grad_in_ptr, xk_ptr, dup_ptr,
    # sizes, strides, options
    V, K, stride_row, inv_temp, ignore_index, smoothing, z_loss, softcap, beta, log_b, log_1mb,
    # outputs (in place)
    grad_ptr,
    # constexprs
    BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, DISTILL: tl.constexpr, JSD: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr,
    ALIGN: tl.constexpr, FROM_XK: tl.constexpr,
):
    """Grid (N,), after tail_fwd_kernel with WRITE_GRAD, in place: the gradient's id and label
    columns over its dense part (many small programs per SM overlap the gathers and the
    scattered stores that stalled the row walk's one program per SM: kd_ids_kernel). FROM_XK
    (the gradient overwrote the logits): the logits at the ids and label from xk."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    _ids_tail(logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, stats_ptr, grad_ptr, row, V, K,
              stride_row, V, 0, inv_temp, ignore_index, smoothing, z_loss, softcap, beta, log_b,
              log_1mb, 0, V, xk_ptr + row * (K + 1), dup_ptr, BLOCK_K, K_CHUNK, DISTILL, JSD,
              HAS_SOFTCAP, HAS_SMOOTHING, HAS_ZLOSS, False, 0, 0, FROM_XK, True)


@triton.jit
def _ids_tail(logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, stats_ptr, grad_ptr, row, V, K,
              stride_row, v_total, col0, inv_temp, ignore_index, smoothing, z_loss, softcap,
              beta, log_b, log_1mb, start, stop, xk_row, dup_ptr, BLOCK_K: tl.constexpr,
              K_CHUNK: tl.constexpr, DISTILL: tl.constexpr, JSD: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr,
              DENSE: tl.constexpr, BLOCK_V: tl.constexpr, ALIGN: tl.constexpr,
              FROM_XK: tl.constexpr, FROM_DUP: tl.constexpr):
    """The gradient of columns [start, stop) of a row from its statistics: (DENSE) the dense
    part, then, after a barrier, the id and label columns (without DENSE: only those); with
    FROM_XK the raw logits at the ids and label come from xk_row (K + 1 floats), with
    FROM_DUP the entries' duplicates from tail_dups_kernel's dup (else compared here). The
    logits are columns [col0, col0 + V) of rows of v_total (the ids given relative to col0,
    -1 outside)."""
    (label, active, lgS, lg_x, a1, C, kd_a, r, off_s, sgn_s, off_x, sgn_x, a, b,
     c) = _row_coefs(labels_ptr, stats_ptr, row, v_total, col0, ignore_index, smoothing,
                     z_loss, inv_temp, DISTILL, HAS_ZLOSS)
    if DENSE:
        _write_dense(logits_ptr, row * stride_row, grad_ptr, row * V, r, off_s, sgn_s, off_x,
                     sgn_x, c, inv_temp, softcap, start, stop, "", BLOCK_V, ALIGN, DISTILL,
                     HAS_SOFTCAP, HAS_SMOOTHING)
        tl.debug_barrier()  # the id columns overwrite dense values other threads wrote
    x_row = logits_ptr + row * stride_row
    kk = tl.arange(0, BLOCK_K)
    ids, valid, lp, p = _entries(ids_ptr, logprobs_ptr, row, V, K, active, kk)
    if FROM_DUP:
        first, repeated, sum_p = _row_dups(dup_ptr, row, K, valid, p, kk)
    else:
        sum_p, count, before = _duplicates(ids_ptr, logprobs_ptr, row, V, K, active, ids,
                                           BLOCK_K, K_CHUNK)
        first = valid & (before == 0.0)
        repeated = first & (count > 1.0)
    if FROM_XK:
        zk, dzk = load_z(xk_row, kk, kk < K, softcap, HAS_SOFTCAP, "", True)
        zk = tl.where(valid, zk, 0.0)  # as _gather
    else:
        zk, dzk = _gather(x_row, ids, valid, softcap, HAS_SOFTCAP)
    _write_ids(x_row, grad_ptr + row * V, active, label, ids, valid, first, repeated, sum_p, lp,
               zk, dzk, r, lgS, lg_x, a1, C, kd_a, off_s, sgn_s, off_x, sgn_x, a, b, c,
               inv_temp, beta, log_b, log_1mb, softcap, start, stop, xk_row + K, DISTILL, JSD,
               HAS_SOFTCAP, HAS_SMOOTHING, FROM_XK)


@triton.jit
def tail_bwd_kernel(
    # pointers: logits [N, V], ids / logprobs [N, K], labels [N], stats [N, TAIL_FIELDS] (the
    # row weights 3:5 scaled by the cotangent), offset [N] (the logits' first column of the
    # row's v_total; the ids relative to it, -1 outside; the labels global)
    logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, stats_ptr, offset_ptr,
    # sizes, strides, options
    V, K, stride_row, v_total, inv_temp, ignore_index, smoothing, z_loss, softcap, beta, log_b,
    log_1mb,
    # outputs
    grad_ptr,
    # constexprs
    SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr, DISTILL: tl.constexpr, JSD: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Grid (N, NUM_SPLITS): the gradient of one vocabulary slice from the row's statistics;
    only the program whose slice holds an id (or the label) stores that column."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * SPLIT_V
    col0 = tl.load(offset_ptr + row)
    _ids_tail(logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, stats_ptr, grad_ptr, row, V, K,
              stride_row, v_total, col0, inv_temp, ignore_index, smoothing, z_loss, softcap,
              beta, log_b, log_1mb, start, tl.minimum(start + SPLIT_V, V), logprobs_ptr,
              logprobs_ptr, BLOCK_K, K_CHUNK, DISTILL, JSD, HAS_SOFTCAP, HAS_SMOOTHING,
              HAS_ZLOSS, True, BLOCK_V, ALIGN, False, False)


# ----------------------------------------------------------------------------- launch plans
def tail_constexprs(distill: bool, divergence: str, temperature: float, k: int,
                    softcap: float | None = None, smoothing: float = 0.0,
                    z_loss: float = 0.0) -> dict:
    """The compile-time switches shared by tail_fwd_kernel and tail_bwd_kernel. SHARE_EXP:
    distill_loss at T = 1 takes the cross-entropy's exp(z - m) from the tail sum's."""
    return dict(BLOCK_K=max(16, triton.next_power_of_2(k)), K_CHUNK=DUP_CHUNK,
                DISTILL=bool(distill), JSD=divergence == "jsd",
                HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=bool(distill) and smoothing > 0,
                HAS_ZLOSS=bool(distill) and z_loss > 0)


def _scalars(vocab, k, temperature, ignore_index, smoothing, z_loss, softcap, beta):
    return (vocab, k, vocab, inverse_temperature(temperature), ignore_index, float(smoothing),
            float(z_loss), float(softcap or 1.0), float(beta), math.log(beta),
            math.log1p(-beta))


def tail_fwd_plan(n: int, vocab: int, k: int, *, temperature: float, divergence: str,
                  beta: float, distill: bool, ignore_index: int, write_grad: bool,
                  smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                  num_sms: int = launch.DEFAULT_NUM_SMS, itemsize: int = 0,
                  in_place: bool = False) -> Plan:
    """x, ids, lp, y, row_scale [N, 2] -> loss, stats [N, TAIL_FIELDS] (and grad, the
    unit-cotangent gradient, with write_grad; with in_place written over x, for logits that
    are dead after the call: the LM head's chunks): tail_dups_kernel finds the rows'
    repeated teacher ids, then one program per row walks its vocabulary once for the
    statistics and, with write_grad, once more for the dense gradient, with kd_fwd_kernel's
    row configuration (launch.row_config: tiles, warps, prefetch, and
    TAIL_KEEP_VOCAB's kept tiles for `itemsize`-byte logits where the walk takes one
    exponential a logit; few rows take the same walk, one program a row); then
    tail_ids_kernel writes the id and label columns. The walk's id bitmaps live in the
    gradient's rows where they fit (write_grad, `itemsize` known, not in_place), else in an
    int32 [N, ceil(V / 32)] buffer of their own (N * V / 8 bytes)."""
    flags = tail_constexprs(distill, divergence, temperature, k, softcap, smoothing, z_loss)
    share = temperature == 1.0
    exps = 1 if share or not distill else 2
    keep = launch.keep_tiles(vocab, itemsize, softcap, TAIL_KEEP_VOCAB) if exps == 1 else 0
    cfg = row_config(n, vocab, num_sms, write_grad, keep)
    block_v, warps, prefetch, keep = cfg.block_v, cfg.num_warps, cfg.prefetch, cfg.keep
    if cfg.num_splits > 1:  # few rows: still one program a row (no split statistics here)
        block_v, warps = _tile(vocab, GRAD_TILE_ELEMS if write_grad else FWD_TILE_ELEMS)
        prefetch, keep = False, 0
    grad = Buf("grad", (n, vocab), LOGITS) if write_grad else placeholder("grad", LOGITS)
    scalars = _scalars(vocab, k, temperature, ignore_index, smoothing, z_loss, softcap, beta)
    align = vocab_align(vocab)
    words = triton.cdiv(vocab, 32)
    in_place = in_place and write_grad
    in_grad = (write_grad and not in_place and itemsize > 0
               and vocab * itemsize >= 4 * words + 3)
    bitmap = placeholder("bitmap", "int32") if in_grad else Buf("bitmap", (n, words), "int32")
    xk = Buf("xk", (n, k + 1), "float32") if in_place else placeholder("xk")
    rows = max(1, min(DUPS_ROWS, DUPS_TILE // flags["BLOCK_K"]))
    dups = Launch(tail_dups_kernel, (triton.cdiv(n, rows),), ("ids", "lp"), (n, vocab, k),
                  (Buf("dup", (n, k), "float32"),), DUPS_WARPS,
                  dict(ROWS=rows, BLOCK_K=flags["BLOCK_K"], STEP=DUPS_STEP))
    launches = [dups, Launch(
        tail_fwd_kernel, (n,), ("x", "ids", "lp", "y", "row_scale", "dup"), scalars,
        (Buf("loss", (n,), "float32"), Buf("stats", (n, TAIL_FIELDS.value), "float32"), grad,
         bitmap, xk),
        warps,
        dict(BLOCK_V=block_v, SHARE_EXP=share, WRITE_GRAD=write_grad, ALIGN=align,
             PREFETCH=prefetch and write_grad, KEEP=keep if write_grad else 0,
             BITMAP_IN_GRAD=in_grad, IN_PLACE=in_place,
             ZERO_BLOCK=min(BITMAP_ZERO_BLOCK, triton.next_power_of_2(words)), **flags),
        aliases=((0, 2),) if in_place else ())]
    if write_grad:
        # in place the logits are gone: the ids' and label's come from xk
        logits = Zeros((1,), LOGITS) if in_place else "x"
        launches.append(Launch(
            tail_ids_kernel, (n,), (logits, "ids", "lp", "y", "stats", "grad", "xk", "dup"),
            scalars,
            (Buf("grad", (n, vocab), LOGITS),), KD_IDS_WARPS,
            dict(ALIGN=align, FROM_XK=in_place, **flags), aliases=((5, 0),),
            partial_alias=True))
    return Plan(tuple(launches), ("loss", "stats") + (("grad",) if write_grad else ()))


def tail_bwd_plan(n: int, vocab: int, k: int, *, temperature: float, divergence: str,
                  beta: float, distill: bool, ignore_index: int, num_sms: int,
                  smoothing: float = 0.0, z_loss: float = 0.0,
                  softcap: float | None = None, offset: str = "",
                  vocab_total: int | None = None) -> Plan:
    """x, ids, lp, y, stats[, offset] -> grad: launch.row_config's programs per row (one for
    many rows, vocabulary slices for few). With `offset` (the name of an [N] int32 input, as
    kd_bwd_launch's) `x` holds columns [offset, offset + vocab) of rows of `vocab_total`
    columns, as a block of the LM head's vocabulary walk does: the teacher ids relative to
    offset (-1 outside), the labels global. Without, whole rows."""
    flags = tail_constexprs(distill, divergence, temperature, k, softcap, smoothing, z_loss)
    cfg = row_config(n, vocab, num_sms, write_grad=True)
    scalars = _scalars(vocab, k, temperature, ignore_index, smoothing, z_loss, softcap, beta)
    launch = Launch(
        tail_bwd_kernel, (n, cfg.num_splits),
        ("x", "ids", "lp", "y", "stats", offset or Zeros((n,), "int32")),
        scalars[:3] + (vocab if vocab_total is None else vocab_total,) + scalars[3:],
        (Buf("grad", (n, vocab), LOGITS),), cfg.num_warps,
        dict(SPLIT_V=cfg.split_v, BLOCK_V=cfg.block_v, ALIGN=cfg.align, **flags))
    return Plan((launch,), ("grad",))
