"""The cross-entropy core shared by the cross_entropy and kd kernel families.

Per row, with z the (softcapped) logits, lse = logsumexp(z), y the label, eps the label
smoothing and `scale` the row's weight (0 for an ignored row):
    loss = (1 - eps) * (lse - z[y]) + eps * (lse - mean(z)) + z_loss * lse**2
    dloss/dz_j = a * softmax(z)_j - b * [j == y] - c,
    a = scale * (1 + 2 * z_loss * lse), b = scale * (1 - eps), c = scale * eps / V.
`slice_stats` walks a slice of a row once for the statistics both families need (the max,
the softmax sum of z and, for distillation, of z / T, the sum of z and z[y]); `ce_row_finish`
turns the merged statistics into the loss and (a, b, c). A label outside [0, V) that is not
ignore_index gives NaN loss and a NaN gradient row; it is never used as an address.

Imports triton only.
"""
import triton
import triton.language as tl

from jax_fusedloss.kernels._online import (LOG2E, edge_tile, merge_stats, poison_inf, safe_max,
                                           span_ptr, tanh_and_grad, vector_span)


@triton.jit
def label_state(labels_ptr, row, V, ignore_index):
    """(label, ignored, bad): bad for a label outside [0, V) that is not ignore_index."""
    label = tl.load(labels_ptr + row).to(tl.int32)
    ignored = label == ignore_index
    bad = (~ignored) & ((label < 0) | (label >= V))
    return label, ignored, bad


@triton.jit
def load_raw(ptr, offs, mask, EVICTION: tl.constexpr, MASKED: tl.constexpr):
    """The tile at ptr + offs as stored (masked lanes 0); MASKED=False loads without a mask (a
    tile wholly inside the row: the compiler drops the selects)."""
    if MASKED:
        x = tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy=EVICTION)
    else:
        x = tl.load(ptr + offs, eviction_policy=EVICTION)
    return x


@triton.jit
def to_z(x, mask, softcap, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """(z, dz/dx) in float32 of a tile x of raw logits with no temperature (z = x, or the
    softcap's c tanh(x / c)); masked lanes get z = -inf."""
    z = x.to(tl.float32)
    dz = z
    if HAS_SOFTCAP:
        t, dz = tanh_and_grad(z / softcap)
        z = softcap * t
    if MASKED:
        z = tl.where(mask, z, float("-inf"))
    return z, dz


@triton.jit
def load_z(ptr, offs, mask, softcap, HAS_SOFTCAP: tl.constexpr, EVICTION: tl.constexpr,
           MASKED: tl.constexpr):
    """to_z of load_raw: unlike _online.load_tile, no multiply by an inverse temperature (an
    instruction per logit)."""
    return to_z(load_raw(ptr, offs, mask, EVICTION, MASKED), mask, softcap, HAS_SOFTCAP, MASKED)


@triton.jit
def int_power(e, P: tl.constexpr):
    """e**P for a constexpr integer P >= 1, by P - 1 multiplies."""
    r = e
    for _ in tl.static_range(P - 1):
        r = r * e
    return r


@triton.jit
def _fold(m, s, s_kd, sumz, z, mask, c_kd, HAS_SMOOTHING: tl.constexpr, CE_STATS: tl.constexpr,
          KD_STATS: tl.constexpr, MASKED: tl.constexpr, AXIS: tl.constexpr):
    """One online-softmax step of slice_stats' (m, s, s_kd, sum z) over a tile z (float32,
    -inf at masked lanes), reduced along AXIS: 0 for a 1-D tile into scalars, 1 for a
    [T, VEC] tile whose rows are each one thread's 16-byte vector into per-thread statistics
    of shape [T] (reductions that stay in a thread's registers: no block reduction and no
    barrier per tile). CE_STATS: 0 no s, 1 s from its own exp per element, an integer
    p >= 2 (with KD_STATS and c_kd = log2(e) / p, i.e. a temperature T = p) s from the KD
    term's exp((z - m) / p) to the p-th power, one exp per element instead of two."""
    m_new = tl.maximum(m, tl.max(z, axis=AXIS))
    ms = safe_max(m_new)
    if AXIS == 1:
        d = z - ms[:, None]
    else:
        d = z - ms
    if KD_STATS:
        alpha_kd = tl.minimum(tl.math.exp2((m - ms) * c_kd), 3.4028234663852886e38)
        e_kd = tl.math.exp2(d * c_kd)
        s_kd = s_kd * alpha_kd + tl.sum(e_kd, axis=AXIS)
    if CE_STATS:
        # at most FLT_MAX: a sum that is 0 stays 0 when the max jumps to +inf
        if CE_STATS >= 2:  # exp(d) = exp(d / T)**T: no second exp, for the rescale neither
            alpha = tl.minimum(int_power(alpha_kd, CE_STATS), 3.4028234663852886e38)
            e = int_power(e_kd, CE_STATS)
        else:
            alpha = tl.minimum(tl.exp(m - ms), 3.4028234663852886e38)
            e = tl.exp(d)
        s = s * alpha + tl.sum(e, axis=AXIS)
    if HAS_SMOOTHING:
        sumz += tl.sum(tl.where(mask, z, 0.0) if MASKED else z, axis=AXIS)
    return m_new, s, s_kd, sumz


@triton.jit
def _thread_fold(m, s, s_kd, sumz, x, mask, softcap, c_kd, HAS_SOFTCAP: tl.constexpr,
                 HAS_SMOOTHING: tl.constexpr, CE_STATS: tl.constexpr, KD_STATS: tl.constexpr,
                 MASKED: tl.constexpr):
    """_fold of a [T, VEC] tile x of raw logits into per-thread statistics."""
    z, _ = to_z(x, mask, softcap, HAS_SOFTCAP, MASKED)
    return _fold(m, s, s_kd, sumz, z, mask, c_kd, HAS_SMOOTHING, CE_STATS, KD_STATS, MASKED, 1)


@triton.jit
def slice_stats(x_ptr, row_off, label, start, stop, softcap, kd_scale, BLOCK_V: tl.constexpr,
                ALIGN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                CE_STATS: tl.constexpr, KD_STATS: tl.constexpr, EVICTION: tl.constexpr,
                PREFETCH: tl.constexpr, KEEP: tl.constexpr):
    """Statistics of z over [start, stop) of the row at x_ptr + row_off in one online walk
    (_online's aligned tile walk): (m, s, s_kd, sum z, z[label], kept0, kept1).

    m is the max of z (the reference of both sums: z / T has its max at the same column),
    s = sum exp(z - m) (CE_STATS; an integer p >= 2 takes it from the KD term's exponentials,
    see _fold), s_kd = sum exp((z - m) * kd_scale) (KD_STATS), sum z
    (HAS_SMOOTHING, else 0) and z[label] if label lies in [start, stop) (else 0). The sums
    are relative to safe_max(m): logsumexp(z) = stats_to_lse(m, s) and
    logsumexp(z * kd_scale) = scaled_lse(m, s_kd, kd_scale). Each sum costs one exp per
    element; z - m is shared.

    The edge tile (odd V) is folded with scalar statistics, the span as [BLOCK_V / VEC, VEC]
    tiles with per-thread statistics merged once at the end (_thread_fold: no block reduction
    or barrier per tile), whole tiles unmasked; with PREFETCH and 16-bit logits the next whole
    tile's load is issued before this tile's arithmetic (twice the bytes in flight; the launch
    heuristic turns it on for the fused forward + gradient over long rows,
    launch.PREFETCH_MIN_VOCAB). H100, bf16, N=8192, the fused forward + gradient alone:
    V=128256 1.79 ms with per-lane sums and a block max per tile, 1.79 per-thread, 1.56
    per-thread with the prefetch; V=32000 0.50 -> 0.35 ms per-thread
    (benchmarks/results/ce_thread_h100.txt, ce_library_h100.txt).

    KEEP (0 to 2): the first KEEP whole tiles of the span are loaded with evict_first and
    returned as raw [BLOCK_V / VEC, VEC] tiles (kept0, kept1; lanes past the whole tiles 0) for
    a gradient pass that takes them from registers instead of re-reading them
    (cross_entropy._ce_grad_slice; launch.KEEP_VOCAB has the measurements). Tiles not kept are
    zeros that the compiler drops.
    """
    VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
    c_kd = kd_scale * LOG2E
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    s_kd = tl.zeros([], tl.float32)
    sumz = tl.zeros([], tl.float32)
    row_ptr = x_ptr + row_off
    k0, k1, lo = vector_span(row_off, start, stop, ALIGN, VEC)
    if ALIGN < VEC:
        cols, mask = edge_tile(start, stop, lo, k1, VEC)
        z, _ = load_z(row_ptr, cols, mask, softcap, HAS_SOFTCAP, EVICTION, True)
        m, s, s_kd, sumz = _fold(m, s, s_kd, sumz, z, mask, c_kd, HAS_SMOOTHING, CE_STATS,
                                 KD_STATS, True, 0)
    base = span_ptr(x_ptr, row_off, lo, ALIGN, VEC)
    T: tl.constexpr = BLOCK_V // VEC  # per-thread statistics, the edge tile's in thread row 0
    rr = tl.arange(0, T)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    first = tl.arange(0, T) == 0
    m = tl.where(first, m, float("-inf"))
    s = tl.where(first, s, 0.0)
    s_kd = tl.where(first, s_kd, 0.0)
    sumz = tl.where(first, sumz, 0.0)
    n_full = (k1 - k0) // BLOCK_V
    # KEEP leading whole tiles stay in registers for the caller (kept0, kept1; masked past
    # n_full): loaded with evict_first, as nothing re-reads them
    kept0 = tl.zeros([T, VEC], x_ptr.dtype.element_ty)
    kept1 = tl.zeros([T, VEC], x_ptr.dtype.element_ty)
    if KEEP >= 1:
        kept0 = load_raw(base, k0 + rr, rr < n_full * BLOCK_V, "evict_first", True)
        m, s, s_kd, sumz = _thread_fold(m, s, s_kd, sumz, kept0, rr < n_full * BLOCK_V, softcap,
                                        c_kd, HAS_SOFTCAP, HAS_SMOOTHING, CE_STATS, KD_STATS,
                                        True)
    if KEEP >= 2:
        kept1 = load_raw(base, k0 + BLOCK_V + rr, rr < (n_full - 1) * BLOCK_V, "evict_first",
                         True)
        m, s, s_kd, sumz = _thread_fold(m, s, s_kd, sumz, kept1, rr < (n_full - 1) * BLOCK_V,
                                        softcap, c_kd, HAS_SOFTCAP, HAS_SMOOTHING, CE_STATS,
                                        KD_STATS, True)
    # 16-bit logits only: with float32 tiles (twice the bytes per tile) the prefetch was
    # slower on H100 (3.99 vs 3.58 ms at V=128256) or no faster
    if PREFETCH and x_ptr.dtype.element_ty.primitive_bitwidth <= 16:
        x_next = load_raw(base, k0 + KEEP * BLOCK_V + rr, rr < (n_full - KEEP) * BLOCK_V,
                          EVICTION, True)
        for i in range(KEEP, n_full):
            x = x_next
            x_next = load_raw(base, k0 + (i + 1) * BLOCK_V + rr,
                              rr < (n_full - 1 - i) * BLOCK_V, EVICTION, True)
            m, s, s_kd, sumz = _thread_fold(m, s, s_kd, sumz, x, rr >= 0, softcap, c_kd,
                                            HAS_SOFTCAP, HAS_SMOOTHING, CE_STATS, KD_STATS,
                                            False)
    else:
        for i in range(KEEP, n_full):
            x = load_raw(base, k0 + i * BLOCK_V + rr, rr >= 0, EVICTION, False)
            m, s, s_kd, sumz = _thread_fold(m, s, s_kd, sumz, x, rr >= 0, softcap, c_kd,
                                            HAS_SOFTCAP, HAS_SMOOTHING, CE_STATS, KD_STATS,
                                            False)
    for k in range(k0 + n_full * BLOCK_V, k1, BLOCK_V):  # the partial last tile, if any
        t = k + rr
        x = load_raw(base, t, t < k1, EVICTION, True)
        m, s, s_kd, sumz = _thread_fold(m, s, s_kd, sumz, x, t < k1, softcap, c_kd,
                                        HAS_SOFTCAP, HAS_SMOOTHING, CE_STATS, KD_STATS, True)
    m_t = m
    m, s = merge_stats(m_t, s)
    if KD_STATS:
        s_kd = merge_scaled(m_t, s_kd, m, kd_scale)
    else:
        s_kd = tl.sum(s_kd, axis=0)  # 0, as a scalar
    sumz = tl.sum(sumz, axis=0)
    in_slice = (label >= start) & (label < stop)
    zy, _ = load_z(row_ptr, tl.where(in_slice, label, start), in_slice, softcap, HAS_SOFTCAP, "",
                   True)
    return m, s, s_kd, sumz, tl.where(in_slice, zy, 0.0), kept0, kept1


@triton.jit
def scaled_lse(m, s, scale):
    """logsumexp(z * scale) from the max m of z and s = sum exp((z - safe_max(m)) * scale):
    -inf for a row with no entry above -inf, +inf where m * scale overflows (so that the
    NaN/+inf policy makes the row NaN, as for z * scale overflowing elementwise) or m is +inf,
    NaN for a NaN row."""
    return tl.where(s == 0.0, float("-inf"), safe_max(m) * scale + tl.log(s))


@triton.jit
def merge_scaled(m_i, s_i, m, scale):
    """Merges partial sums s_i of exp((z - m_i) * scale) (padding lanes m_i = -inf, s_i = 0)
    into the sum relative to the merged max m: sum_i s_i * exp((m_i - safe_max(m)) * scale)."""
    return tl.sum(s_i * tl.math.exp2((m_i - safe_max(m)) * (scale * LOG2E)), axis=0)


@triton.jit
def ce_coefs(lse, V, smoothing, z_loss, bad, scale, HAS_ZLOSS: tl.constexpr):
    """Gradient coefficients (a, b, c) of a row (see the module docstring) from its lse (with
    +inf already poisoned to NaN): a is NaN for a bad label or a NaN lse, which turns the whole
    gradient row NaN without a per-element check (also for an ignored row, as autodiff of the
    naive formula gives)."""
    a = scale
    if HAS_ZLOSS:
        a = scale * (1.0 + 2.0 * z_loss * lse)
    a = tl.where(bad | (lse != lse), float("nan"), a)
    return a, scale * (1.0 - smoothing), scale * smoothing / V


@triton.jit
def ce_row_finish(lse, lse_lo, zy, sumz, V, smoothing, z_loss, ignored, bad, scale,
                  HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr):
    """Per-row loss (unweighted: 0 for an ignored row, NaN for a bad label or a NaN or +inf
    lse) and the gradient coefficients (a, b, c) for the row weight `scale`. The log-sum-exp
    is lse + lse_lo (_online.lse_parts; lse_lo = 0 where unknown): lse - z[y] is taken before
    lse_lo is added, so the loss does not lose |lse| * 2**-24 to lse's rounding."""
    lse = poison_inf(lse)
    loss = (1.0 - smoothing) * ((lse - zy) + lse_lo)
    if HAS_SMOOTHING:
        loss += smoothing * ((lse - sumz / V) + lse_lo)
    if HAS_ZLOSS:
        loss += z_loss * lse * lse
    loss = tl.where(lse != lse, float("nan"), loss)
    loss = tl.where(ignored, 0.0, loss)
    loss = tl.where(bad, float("nan"), loss)
    a, b, c = ce_coefs(lse, V, smoothing, z_loss, bad, scale, HAS_ZLOSS)
    return loss, a, b, c
