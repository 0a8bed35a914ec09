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

Q_t without cancellation: the row walk sums exp((z_j - r) / T) over the tail columns only
(S_t, r the running max of z), skipping the columns of the teacher's ids; S = S_t + the ids'
terms (a sum of positive terms). The skip costs no per-column search: the launcher passes the
row's valid ids sorted ascending (`sid`, int32 [N, K + 1], 2**31 - 1 past the valid ones and
in the last column), and the walk, which visits its 16-byte aligned tiles in column order,
carries the next id not yet passed; a tile that holds it clears that column from its tail
mask (one compare a column per id in the tile, a scalar compare per tile otherwise). The edge
tile of an unaligned row (at most 2 * VEC - 2 columns) compares against every id.

With G_b = dF/dQ_b and C = sum_b G_b Q_b the gradient w.r.t. s_j is q_j (G_b(j) - C): on a tail
column alpha1 q_j + alpha2 q_j / Q_t (kl: alpha1 = P_D + P_t, alpha2 = -P_t; jsd: alpha1 =
(1 - beta) log(Q_t / M_t) - C, alpha2 = 0), one exponential a column (the two terms share
exp((z_j - r) / T), their coefficients folded into one exponent offset); at an id its own
value (kl: (P_D + P_t) q_d - P_d; jsd: q_d ((1 - beta) log(Q_d / M_d) - C)), times kd_a / T,
stored over the dense value after a barrier, as kernels/kd.py does.

Kernels take (inputs..., scalars..., outputs..., CONSTEXPRS). Imports triton only.
"""
import math

import triton
import triton.language as tl

from jax_fusedloss._validate import inverse_temperature
from jax_fusedloss.kernels._ce_core import ce_coefs, ce_row_finish, load_z
from jax_fusedloss.kernels._online import (LOG2E, edge_tile, hint_multiple, lse_parts,
                                           poison_inf, safe_max, span_ptr, vector_span)
from jax_fusedloss.kernels.kd import DUP_CHUNK, _entries, _gather, _row_state
from jax_fusedloss.kernels.launch import (FWD_TILE_ELEMS, GRAD_TILE_ELEMS, _tile, row_config,
                                          vocab_align)
from jax_fusedloss.kernels.plan import LOGITS, Buf, Launch, Plan, placeholder

# float32 [N, TAIL_FIELDS] = (lse(z), lgS, lgS_t, ce_a, kd_a, r, lg_x, alpha1, alpha2, C), as
# _xla/kd_tail.py's TAIL_FIELDS: q_j = exp((z_j - r) / T - lgS), q_j / Q_t =
# exp((z_j - r) / T - lgS_t), softmax(z)_j = exp((z_j - r) - lg_x); the row weights at 3:5.
TAIL_FIELDS = tl.constexpr(10)
NO_ID = tl.constexpr(2**31 - 1)  # the sorted ids' padding: past every column
FLT_MAX = tl.constexpr(3.4028234663852886e38)


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
def _fold(m, acc_t, acc_x, acc_z, z, keep, mask, c_kd, DISTILL: tl.constexpr,
          SHARE_EXP: tl.constexpr, HAS_SMOOTHING: tl.constexpr):
    """One online step over a tile z (float32, -inf at masked lanes) with a block max: the
    tail sum acc_t of exp((z - m) / T) over the `keep` lanes, (DISTILL) acc_x of exp(z - m)
    over every lane (the same exponential at T = 1: SHARE_EXP) and (HAS_SMOOTHING) sum z."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    ms = safe_max(m_new)
    d = z - ms
    alpha = tl.minimum(tl.math.exp2((m - ms) * c_kd), FLT_MAX)
    e = tl.math.exp2(d * c_kd)
    acc_t = acc_t * alpha + tl.where(keep, e, 0.0)
    if DISTILL:
        if SHARE_EXP:
            acc_x = acc_x * alpha + e
        else:
            acc_x = acc_x * tl.minimum(tl.exp(m - ms), FLT_MAX) + tl.exp(d)
    if HAS_SMOOTHING:
        acc_z += tl.where(mask, z, 0.0)
    return m_new, acc_t, acc_x, acc_z


@triton.jit
def _tail_walk(x_ptr, row_off, V, sid_row, nxt, idv, softcap, c_kd, BLOCK_V: tl.constexpr,
               ALIGN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DISTILL: tl.constexpr,
               SHARE_EXP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, EVICTION: tl.constexpr):
    """One walk over a row: (m, S_t, s_x, sum z) with m the max of z, S_t = sum over the
    columns not in the ids of exp((z - m) / T), s_x = sum exp(z - m) (DISTILL), both relative
    to safe_max(m). `sid_row`: the row's sorted valid ids (NO_ID after them), `nxt` the first;
    `idv` the ids ([BLOCK_K], -1 where not valid) for the edge tile."""
    VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
    m = tl.full([], float("-inf"), tl.float32)
    acc_t = tl.zeros([BLOCK_V], tl.float32)
    acc_x = tl.zeros([BLOCK_V], tl.float32)
    acc_z = tl.zeros([BLOCK_V], tl.float32)
    k0, k1, lo = vector_span(row_off, 0, V, ALIGN, VEC)
    if ALIGN < VEC:
        cols, in_edge = edge_tile(0, V, lo, k1, VEC)
        ze, _dze = load_z(x_ptr + row_off, cols, in_edge, softcap, HAS_SOFTCAP, EVICTION, True)
        hit = tl.max(tl.where(cols[:, None] == idv[None, :], 1, 0), axis=1)
        e_t = tl.zeros([2 * VEC], tl.float32)
        e_x = tl.zeros([2 * VEC], tl.float32)
        e_z = tl.zeros([2 * VEC], tl.float32)
        m, e_t, e_x, e_z = _fold(m, e_t, e_x, e_z, ze, in_edge & (hit == 0), in_edge, c_kd,
                                 DISTILL, SHARE_EXP, HAS_SMOOTHING)
        first = tl.arange(0, BLOCK_V) == 0
        acc_t = tl.where(first, tl.sum(e_t, axis=0), 0.0)
        acc_x = tl.where(first, tl.sum(e_x, axis=0), 0.0)
        acc_z = tl.where(first, tl.sum(e_z, axis=0), 0.0)
    base = span_ptr(x_ptr, row_off, lo, ALIGN, VEC)
    a = tl.zeros([], tl.int32)
    for k in range(k0, k1, BLOCK_V):
        t = k + tl.arange(0, BLOCK_V)
        mask = t < k1
        z, _dz = load_z(base, t, mask, softcap, HAS_SOFTCAP, EVICTION, True)
        keep = mask
        tile_end = lo + k + BLOCK_V
        while nxt < tile_end:  # the ids in this tile (earlier ones: the edge's, no-ops)
            keep = keep & ((lo + t) != nxt)
            a += 1
            nxt = tl.load(sid_row + a)
        m, acc_t, acc_x, acc_z = _fold(m, acc_t, acc_x, acc_z, z, keep, mask, c_kd, DISTILL,
                                       SHARE_EXP, HAS_SMOOTHING)
    return m, tl.sum(acc_t, axis=0), tl.sum(acc_x, axis=0), tl.sum(acc_z, axis=0)


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
def _write_ids(x_row, g_row, ids_ptr, lp_ptr, row, V, K, active, label, ids, valid, lp, zk, dzk,
               r, lgS, lg_x, a1, C, kd_a, off_s, sgn_s, off_x, sgn_x, a, b, c, inv_temp, beta,
               log_b, log_1mb, softcap, start, stop, BLOCK_K: tl.constexpr,
               K_CHUNK: tl.constexpr, DISTILL: tl.constexpr, JSD: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr):
    """Overwrites the columns of [start, stop) at the valid teacher ids (their complete values,
    identical for duplicates) and (distill) the label column when it is not an id (its dense
    value - b). The dense values must be visible first."""
    sum_p, count, _before = _duplicates(ids_ptr, lp_ptr, row, V, K, active, ids, BLOCK_K,
                                        K_CHUNK)
    lq = (zk - r) * inv_temp - lgS
    q = tl.exp(lq)
    if JSD:
        lP = tl.where(count > 1.0, _log(sum_p), lp)
        lM = _logaddexp(log_b + lP, log_1mb + lq)
        v = tl.where(q > 0.0, q * ((1.0 - beta) * (lq - lM) - C), 0.0)
    else:
        v = a1 * q - sum_p
    g = kd_a * inv_temp * v
    if DISTILL:
        g += a * tl.exp((zk - r) - lg_x) - tl.where(ids == label, b, 0.0) - c
    if HAS_SOFTCAP:
        g = g * dzk
    own = valid & (ids >= start) & (ids < stop)
    if DISTILL:
        is_id = tl.max(tl.where(valid & (ids == label), 1, 0), axis=0)
        y = tl.where(active & (is_id == 0), label, -1)
        own_y = (y >= start) & (y < stop)
        zy, dzy = load_z(x_row, tl.where(own_y, y, 0), own_y, softcap, HAS_SOFTCAP, "", True)
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
    # [N, 2] = (ce, kd), sid [N, K + 1] (the valid ids sorted, NO_ID after them)
    logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, row_scale_ptr, sid_ptr,
    # sizes, strides, options
    V, K, stride_row, inv_temp, ignore_index, smoothing, z_loss, softcap, beta, log_b, log_1mb,
    # outputs: loss [N], stats [N, TAIL_FIELDS], grad [N, V] (WRITE_GRAD)
    loss_ptr, stats_ptr, grad_ptr,
    # constexprs
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr,
    DISTILL: tl.constexpr, JSD: tl.constexpr, SHARE_EXP: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid (N,): a row's loss and statistics from one walk over its vocabulary; with
    WRITE_GRAD also the unit-cotangent gradient (a second walk, the row's lines kept in L2
    by the first's evict_last), its id and label columns stored after a barrier."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * stride_row
    label, active, bad = _row_state(labels_ptr, row, V, ignore_index, DISTILL)
    kk = tl.arange(0, BLOCK_K)
    ids, valid, lp, p = _entries(ids_ptr, logprobs_ptr, row, V, K, active, kk)
    sid_row = sid_ptr + row * (K + 1)
    nxt = tl.where(active, tl.load(sid_row), NO_ID)
    c_kd = inv_temp * LOG2E
    m, s_t, s_x, sumz = _tail_walk(logits_ptr, row * stride_row, V, sid_row, nxt,
                                   tl.where(valid, ids, -1), softcap, c_kd, BLOCK_V, ALIGN,
                                   HAS_SOFTCAP, DISTILL, SHARE_EXP, HAS_SMOOTHING,
                                   "evict_last" if WRITE_GRAD else "")
    r = safe_max(m)
    zk, dzk = _gather(x_row, ids, valid, softcap, HAS_SOFTCAP)
    sum_p, count, before = _duplicates(ids_ptr, logprobs_ptr, row, V, K, active, ids, BLOCK_K,
                                       K_CHUNK)
    first = valid & (before == 0.0)
    d_k = (zk - r) * inv_temp
    s_all = s_t + tl.sum(tl.where(first, tl.math.exp2(d_k * LOG2E), 0.0), axis=0)
    lgS = _log(s_all)
    lgS_t = _log(s_t)
    lQ = d_k - lgS
    lP = tl.where(count > 1.0, _log(sum_p), lp)
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
    ce_a = tl.where(active, tl.load(row_scale_ptr + row * 2), 0.0)
    kd_a = tl.where(active, tl.load(row_scale_ptr + row * 2 + 1), 0.0)
    loss = kd_a * div
    lse_x, lse_lo = lse_parts(m, s_x)
    lse_x = poison_inf(lse_x)
    lg_x = _log(s_x)
    a = 0.0
    b = 0.0
    c = 0.0
    if DISTILL:
        in_range = (label >= 0) & (label < V)
        zy, _ = load_z(x_row, tl.where(in_range, label, 0), in_range, softcap, HAS_SOFTCAP,
                       "", True)
        ce, a, b, c = ce_row_finish(lse_x, lse_lo, tl.where(in_range, zy, 0.0), sumz, V,
                                    smoothing, z_loss, ~active, bad, ce_a, HAS_SMOOTHING,
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
        off_s, sgn_s, off_x, sgn_x = _dense_offsets(lgS, lgS_t, lg_x, a1, a2, kd_a, a, inv_temp)
        _write_dense(logits_ptr, row * stride_row, grad_ptr, row * V, r, off_s, sgn_s, off_x,
                     sgn_x, c, inv_temp, softcap, 0, V, "evict_first", BLOCK_V, ALIGN, DISTILL,
                     HAS_SOFTCAP, HAS_SMOOTHING)
        tl.debug_barrier()  # the id columns overwrite dense values other threads wrote
        _write_ids(x_row, grad_ptr + row * V, ids_ptr, logprobs_ptr, row, V, K, active, label,
                   ids, valid, lp, zk, dzk, r, lgS, lg_x, a1, C, kd_a, off_s, sgn_s, off_x,
                   sgn_x, a, b, c, inv_temp, beta, log_b, log_1mb, softcap, 0, V, BLOCK_K,
                   K_CHUNK, DISTILL, JSD, HAS_SOFTCAP, HAS_SMOOTHING)


@triton.jit
def tail_bwd_kernel(
    # pointers: logits [N, V], ids / logprobs [N, K], labels [N], stats [N, TAIL_FIELDS] (the
    # row weights 3:5 scaled by the cotangent)
    logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, stats_ptr,
    # sizes, strides, options
    V, K, stride_row, inv_temp, ignore_index, smoothing, z_loss, softcap, beta, log_b, log_1mb,
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
    stop = tl.minimum(start + SPLIT_V, V)
    label, active, bad = _row_state(labels_ptr, row, V, ignore_index, DISTILL)
    st = stats_ptr + row * TAIL_FIELDS
    lse_x, lgS, lgS_t, ce_a, kd_a = (tl.load(st), tl.load(st + 1), tl.load(st + 2),
                                     tl.load(st + 3), tl.load(st + 4))
    r, lg_x, a1, a2, C = (tl.load(st + 5), tl.load(st + 6), tl.load(st + 7), tl.load(st + 8),
                          tl.load(st + 9))
    a = 0.0
    b = 0.0
    c = 0.0
    if DISTILL:
        a, b, c = ce_coefs(lse_x, V, smoothing, z_loss, bad, ce_a, HAS_ZLOSS)
    off_s, sgn_s, off_x, sgn_x = _dense_offsets(lgS, lgS_t, lg_x, a1, a2, kd_a, a, inv_temp)
    _write_dense(logits_ptr, row * stride_row, grad_ptr, row * V, r, off_s, sgn_s, off_x, sgn_x,
                 c, inv_temp, softcap, start, stop, "", BLOCK_V, ALIGN, DISTILL, HAS_SOFTCAP,
                 HAS_SMOOTHING)
    tl.debug_barrier()  # the id columns overwrite dense values other threads wrote
    x_row = logits_ptr + row * stride_row
    ids, valid, lp, _p = _entries(ids_ptr, logprobs_ptr, row, V, K, active,
                                  tl.arange(0, BLOCK_K))
    zk, dzk = _gather(x_row, ids, valid, softcap, HAS_SOFTCAP)
    _write_ids(x_row, grad_ptr + row * V, ids_ptr, logprobs_ptr, row, V, K, active, label, ids,
               valid, lp, zk, dzk, r, lgS, lg_x, a1, C, kd_a, off_s, sgn_s, off_x, sgn_x, a, b,
               c, inv_temp, beta, log_b, log_1mb, softcap, start, stop, BLOCK_K, K_CHUNK,
               DISTILL, JSD, HAS_SOFTCAP, HAS_SMOOTHING)


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
                  smoothing: float = 0.0, z_loss: float = 0.0,
                  softcap: float | None = None) -> Plan:
    """x, ids, lp, y, row_scale [N, 2], sid [N, K + 1] -> loss, stats [N, TAIL_FIELDS] (and
    grad, the unit-cotangent gradient, with write_grad): one program per row walks its
    vocabulary once for the statistics and, with write_grad, once more for the gradient
    (16384-element tiles, 32 warps, as the other fused row walks: launch.GRAD_TILE_ELEMS;
    4096 and 8 warps without the gradient)."""
    flags = tail_constexprs(distill, divergence, temperature, k, softcap, smoothing, z_loss)
    block_v, warps = _tile(vocab, GRAD_TILE_ELEMS if write_grad else FWD_TILE_ELEMS)
    grad = Buf("grad", (n, vocab), LOGITS) if write_grad else placeholder("grad", LOGITS)
    launch = Launch(
        tail_fwd_kernel, (n,), ("x", "ids", "lp", "y", "row_scale", "sid"),
        _scalars(vocab, k, temperature, ignore_index, smoothing, z_loss, softcap, beta),
        (Buf("loss", (n,), "float32"), Buf("stats", (n, TAIL_FIELDS.value), "float32"), grad),
        warps,
        dict(BLOCK_V=block_v, SHARE_EXP=temperature == 1.0, WRITE_GRAD=write_grad,
             ALIGN=vocab_align(vocab), **flags))
    return Plan((launch,), ("loss", "stats") + (("grad",) if write_grad else ()))


def tail_bwd_plan(n: int, vocab: int, k: int, *, temperature: float, divergence: str,
                  beta: float, distill: bool, ignore_index: int, num_sms: int,
                  smoothing: float = 0.0, z_loss: float = 0.0,
                  softcap: float | None = None) -> Plan:
    """x, ids, lp, y, stats -> grad: launch.row_config's programs per row (one for many rows,
    vocabulary slices for few)."""
    flags = tail_constexprs(distill, divergence, temperature, k, softcap, smoothing, z_loss)
    cfg = row_config(n, vocab, num_sms, write_grad=True)
    launch = Launch(
        tail_bwd_kernel, (n, cfg.num_splits), ("x", "ids", "lp", "y", "stats"),
        _scalars(vocab, k, temperature, ignore_index, smoothing, z_loss, softcap, beta),
        (Buf("grad", (n, vocab), LOGITS),), cfg.num_warps,
        dict(SPLIT_V=cfg.split_v, BLOCK_V=cfg.block_v, ALIGN=cfg.align, **flags))
    return Plan((launch,), ("grad",))
