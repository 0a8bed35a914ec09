"""Top-K distillation kernels (kd_loss, distill_loss): forward, split statistics, backward.

One row holds the student logits x[V], the teacher's K entries (id_k, lp_k) and, for
distill_loss, a label y. With z = c * tanh(x / c) (logit_softcap c; z = x without one), s = z / T
(the softcap first, then the temperature), p_k = exp(lp_k), an entry valid when 0 <= id_k < V
(the launchers map masked entries to id -1) and P = sum of valid p_k:
    L  = logsumexp(s) (FULL)  or  logsumexp of s[id_k] over valid k ("topk", FULL=False)
    kd = sum over valid k with p_k > 0 of p_k * (lp_k - (s[id_k] - L))
    ce = cross_entropy's row loss of z (label y, smoothing, z-loss; DISTILL only)
    loss = ce_a * ce + kd_a * kd, where (ce_a, kd_a) are the row's weights (row_scale)
Every entry is its own term, so an id repeated in a row counts once per entry. The gradient
for a unit cotangent w.r.t. x_j is dz_j/dx_j times
    a * softmax(z)_j - b * [j == y] - c + kd_a / T * (P * softmax(s)_j - sum_{id_k = j} p_k)
with (a, b, c) the cross-entropy coefficients for the weight ce_a (none for kd_loss) and
"topk" replacing softmax(s)_j by sum_{id_k = j} exp(s_j - L) (zero away from the ids). The
cross-entropy statistics, row finish and (a, b, c) are kernels/_ce_core.py's, as in
kernels/cross_entropy.py. A row walks its vocabulary once for the statistics; the gradient pass
writes the dense part tile by tile (backwards, for L2 reuse; one FMA and one exp2 per column
and term, no per-column label test), then the K id columns and the label column are stored
over it with their complete values computed from scratch in float32 (duplicate ids get
identical values): after a barrier in the split gradient kernel, by kd_ids_kernel (a launch of
its own) after the fused forward + gradient.

Kernels take (inputs..., scalars..., outputs..., CONSTEXPRS) so JAX (jax-triton) and PyTorch
launch them identically. Imports triton only.
"""
import triton
import triton.language as tl

from jax_fusedloss.kernels._ce_core import (ce_coefs, ce_row_finish, int_power, label_state,
                                            load_raw, load_z, merge_scaled, scaled_lse,
                                            slice_stats, to_z)
from jax_fusedloss.kernels._online import (LOG2E, edge_tile, hint_multiple, load_field,
                                           load_partials, lse_parts, merge_stats, poison_inf,
                                           safe_max, span_ptr, store_partials, vector_span)
from jax_fusedloss._validate import inverse_temperature
from jax_fusedloss.kernels import launch
from jax_fusedloss.kernels.launch import KD_IDS_WARPS, merge_block, row_config
from jax_fusedloss.kernels.plan import LOGITS, Buf, Launch, Plan, Zeros, placeholder

DUP_CHUNK = 16  # teacher entries compared per step when summing duplicates: [BLOCK_K, 16] tiles
# Per-row statistics, float32 [N, STATS_FIELDS] = (lse(z), L, P, ce_a, kd_a, r, lg_x, r_L,
# lg_L): the row weights ce_a, kd_a at 3:5 (a backward folds its cotangent into them); the
# softmaxes as softmax(z) = exp((z - r) - lg_x) and softmax(s) = exp((z - r_L) / T - lg_L)
# at the ids (r_L = r unless "topk"), accurate whatever |lse|.
STATS_FIELDS = tl.constexpr(9)  # a constexpr global: the kernels read it
# distill_loss temperatures whose cross-entropy softmax can be taken as the T-th power of the
# KD term's exp((z - m) / T) (CE_STATS = T; where launch.kd_power says so): one exp per logit
# and pass instead of two
POWER_TEMPERATURES = (2.0, 3.0, 4.0)


@triton.jit
def distill_ce(x_row, label, V, lse_x, lse_lo, sumz, smoothing, z_loss, active, bad, ce_a,
               softcap, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
               HAS_ZLOSS: tl.constexpr):
    """distill_loss's cross-entropy term of a row from its walk's statistics: ce_row_finish's
    (loss, a, b, c), z[y] read from the row at x_row (a label outside [0, V) reads nothing)."""
    in_range = (label >= 0) & (label < V)
    zy, _ = load_z(x_row, tl.where(in_range, label, 0), in_range, softcap, HAS_SOFTCAP, "", True)
    return ce_row_finish(lse_x, lse_lo, tl.where(in_range, zy, 0.0), sumz, V, smoothing, z_loss,
                         ~active, bad, ce_a, HAS_SMOOTHING, HAS_ZLOSS)


@triton.jit
def _row_state(labels_ptr, row, V, ignore_index, DISTILL: tl.constexpr):
    """(label, active, bad): active is False for a distill row whose label is ignored."""
    if DISTILL:
        label, ignored, bad = label_state(labels_ptr, row, V, ignore_index)
        active = ~ignored
    else:
        label = tl.full([], -1, tl.int32)
        active = tl.full([], 1, tl.int1)
        bad = tl.full([], 0, tl.int1)
    return label, active, bad


@triton.jit
def _entries(ids_ptr, lp_ptr, row, V, K, active, kk):
    """Teacher entries kk of a row: (ids, valid, lp, p), lp and p zero where not valid. Both
    loads are issued together (lp is masked by kk < K only, not by the ids' validity, which
    would make it wait for the ids)."""
    ids = tl.load(ids_ptr + row * K + kk, mask=kk < K, other=-1)
    lp = tl.load(lp_ptr + row * K + kk, mask=kk < K, other=0.0).to(tl.float32)
    # An inactive row has an empty id range. (`vector & scalar_bool` would be shorter, but
    # Triton 3.9's interpreter then rejects the result as a load mask.)
    valid = (ids >= 0) & (ids < tl.where(active, V, 0))
    lp = tl.where(valid, lp, 0.0)
    return ids, valid, lp, tl.where(valid, tl.exp(lp), 0.0)


@triton.jit
def _gather(x_row, ids, valid, softcap, HAS_SOFTCAP: tl.constexpr):
    """(z[ids], dz/dx there) in float32 (z = 0 at invalid lanes, which are not read)."""
    z, dz = load_z(x_row, tl.where(valid, ids, 0), valid, softcap, HAS_SOFTCAP, "", True)
    return tl.where(valid, z, 0.0), dz


@triton.jit
def save_label_logit(x_row, xk_row, label, active, V, K):
    """Stores the row's raw logit at its label in xk_row[K] (0 for an inactive row or a label
    outside [0, V)): the id launch reads it there once the gradient overwrote the logits."""
    has_y = active & (label >= 0) & (label < V)
    xy = tl.load(x_row + tl.where(has_y, label, 0), mask=has_y, other=0.0)
    tl.store(xk_row + K, xy.to(tl.float32))


@triton.jit
def _log_sum(s, lse):
    """log(s) of a softmax sum, 0 for an empty one (s == 0), NaN where its lse is NaN (the
    NaN/+inf policy: a NaN row gradient)."""
    return tl.where(lse != lse, float("nan"), tl.log(tl.where(s == 0.0, 1.0, s)))


@triton.jit
def _dense_offsets(lg_x, lg_L, P, a, kd_a, inv_temp, FULL: tl.constexpr,
                   CE_STATS: tl.constexpr, KD_STATS: tl.constexpr):
    """Exponent offsets and signs of the dense gradient, relative to the row's max r of z:
    coef_x * softmax(z)_j + coef_s * softmax(s)_j = sgn_x * exp2((z_j - r) * LOG2E - off_x) +
    sgn_s * exp2((z_j - r) * inv_temp * LOG2E - off_s), with lg_x = log sum exp(z - r) and
    lg_L = log sum exp((z - r) / T): each coefficient's magnitude (0 gives offset +inf and a
    zero term) is folded into its exponent, so a column costs one subtraction, then one FMA
    and one exp2 per term, and z - r is exact where z is near the max (a float32 lse would
    lose |lse| * 2**-24 in every exponent). With FULL and no KD_STATS the temperature is 1 and
    both softmaxes are one. A NaN `a` (a bad label, a NaN lse) or lg makes an offset NaN: a
    NaN row, no per-column check. With an integer CE_STATS = T >= 2 (_ce_core._fold) the
    signs come back as signed weights sgn * exp2(-off) (_dense_value's power form)."""
    coef_x = a
    coef_s = kd_a * inv_temp * P
    if FULL:
        if not KD_STATS:
            coef_x = a + coef_s
    off_x = lg_x * LOG2E - tl.log2(tl.abs(coef_x))
    off_s = lg_L * LOG2E - tl.log2(tl.abs(coef_s))
    sgn_x = tl.where(coef_x < 0.0, -1.0, 1.0)
    sgn_s = tl.where(coef_s < 0.0, -1.0, 1.0)
    if CE_STATS >= 2:
        sgn_x = sgn_x * tl.math.exp2(-off_x)
        sgn_s = sgn_s * tl.math.exp2(-off_s)
    return off_x, sgn_x, off_s, sgn_s


@triton.jit
def _dense_value(d, dz, off_x, sgn_x, off_s, sgn_s, c, inv_temp, CE_STATS: tl.constexpr,
                 KD_STATS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_SMOOTHING: tl.constexpr):
    """The dense gradient at columns with d = z - r (dz = dz/dx): (coef_x softmax(z) +
    coef_s softmax(s) - c) * dz. With an integer CE_STATS = T >= 2 one exp per column:
    q = exp(d / T), coef_x softmax(z) = sgn_x q**T and coef_s softmax(s) = sgn_s q, the signs
    being _dense_offsets' signed weights (an underflow of q**T below float32's normal range
    where the exp form would have kept a subnormal: a difference under 2**-126 times the
    weight)."""
    g = tl.zeros_like(d)
    if CE_STATS >= 2:
        q = tl.math.exp2(d * (inv_temp * LOG2E))
        g += q * (sgn_s + sgn_x * int_power(q, CE_STATS - 1))
    else:
        if CE_STATS:
            g += sgn_x * tl.math.exp2(d * LOG2E - off_x)
        if KD_STATS:
            g += sgn_s * tl.math.exp2(d * (inv_temp * LOG2E) - off_s)
    if HAS_SMOOTHING:
        g -= c
    if HAS_SOFTCAP:
        g = g * dz
    return g


@triton.jit
def _dense_tile(x_ptr, g_ptr, offs, mask, r, off_x, sgn_x, off_s, sgn_s, c, inv_temp, softcap,
                EVICTION: tl.constexpr, CE_STATS: tl.constexpr, KD_STATS: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, MASKED: tl.constexpr):
    """Writes the dense gradient of one tile (x at x_ptr + offs, gradient at g_ptr + offs):
    zeros without a load when there is none ("topk" kd_loss). MASKED=False: a tile wholly
    inside the row, loaded and stored without a mask."""
    x = tl.zeros(offs.shape, x_ptr.dtype.element_ty)
    if CE_STATS or KD_STATS:
        x = load_raw(x_ptr, offs, mask, EVICTION, MASKED)
    _dense_store(x, g_ptr, offs, mask, r, off_x, sgn_x, off_s, sgn_s, c, inv_temp, softcap,
                 EVICTION, CE_STATS, KD_STATS, HAS_SOFTCAP, HAS_SMOOTHING, MASKED)


@triton.jit
def _dense_store(x, g_ptr, offs, mask, r, off_x, sgn_x, off_s, sgn_s, c, inv_temp, softcap,
                 EVICTION: tl.constexpr, CE_STATS: tl.constexpr, KD_STATS: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, MASKED: tl.constexpr):
    """_dense_tile of a tile x of raw logits already in registers (not read without CE_STATS
    or KD_STATS)."""
    if CE_STATS or KD_STATS:
        z, dz = to_z(x, mask, softcap, HAS_SOFTCAP, MASKED)
        g = _dense_value(z - r, dz, off_x, sgn_x, off_s, sgn_s, c, inv_temp, CE_STATS,
                         KD_STATS, HAS_SOFTCAP, HAS_SMOOTHING)
    else:
        g = tl.zeros(offs.shape, tl.float32)
    if MASKED:
        tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=mask,
                 eviction_policy=EVICTION)
    else:
        tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), eviction_policy=EVICTION)


@triton.jit
def _write_dense(x_ptr, x_off, g_ptr, g_off, r, lg_x, lg_L, P, a, c, kd_a, inv_temp, softcap,
                 start, stop, kept0, kept1, EVICTION: tl.constexpr, BLOCK_V: tl.constexpr,
                 ALIGN: tl.constexpr, FULL: tl.constexpr, CE_STATS: tl.constexpr,
                 KD_STATS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_SMOOTHING: tl.constexpr, KEEP: tl.constexpr):
    """Writes the dense part of the unit-cotangent gradient of columns [start, stop) of one row,
    a * softmax(z) + coef_s * softmax(s) - c (times dz/dx with a softcap), from the row's
    softmax references (stats fields 5-8: softmax(z) = exp((z - r) - lg_x), softmax(s) =
    exp((z - r) / T - lg_L)), tile by tile (_online's aligned tile walk: the edge tile first,
    then the vector span), walking backwards (the tiles the statistics pass read last are the
    likeliest to be in L2: the partial last tile, then whole tiles without masks); zeros
    without a load when there is none ("topk" kd_loss). The first KEEP whole tiles come from
    registers (slice_stats' kept0, kept1; any placeholder with KEEP = 0), written last. The id
    and label columns are _write_ids'."""
    off_x, sgn_x, off_s, sgn_s = _dense_offsets(lg_x, lg_L, P, a, kd_a, inv_temp, FULL,
                                                CE_STATS, KD_STATS)
    VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
    k0, k1, lo = vector_span(x_off, start, stop, ALIGN, VEC)
    if ALIGN < VEC:
        cols, mask = edge_tile(start, stop, lo, k1, VEC)
        _dense_tile(x_ptr + x_off, g_ptr + g_off, cols, mask, r, off_x, sgn_x, off_s, sgn_s, c,
                    inv_temp, softcap, EVICTION, CE_STATS, KD_STATS, HAS_SOFTCAP, HAS_SMOOTHING,
                    True)
    xs = span_ptr(x_ptr, x_off, lo, ALIGN, VEC)
    gs = span_ptr(g_ptr, g_off, lo, ALIGN, VEC)
    n_full = (k1 - k0) // BLOCK_V
    for k in range(k0 + n_full * BLOCK_V, k1, BLOCK_V):  # the partial last tile, if any
        t = k + tl.arange(0, BLOCK_V)
        _dense_tile(xs, gs, t, t < k1, r, off_x, sgn_x, off_s, sgn_s, c, inv_temp, softcap,
                    EVICTION, CE_STATS, KD_STATS, HAS_SOFTCAP, HAS_SMOOTHING, True)
    for i in range(0, n_full - KEEP):
        t = k0 + (n_full - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
        _dense_tile(xs, gs, t, t < k1, r, off_x, sgn_x, off_s, sgn_s, c, inv_temp, softcap,
                    EVICTION, CE_STATS, KD_STATS, HAS_SOFTCAP, HAS_SMOOTHING, False)
    rr = tl.arange(0, BLOCK_V // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    if KEEP >= 2:
        _dense_store(kept1, gs, k0 + BLOCK_V + rr, rr < (n_full - 1) * BLOCK_V, r, off_x, sgn_x,
                     off_s, sgn_s, c, inv_temp, softcap, EVICTION, CE_STATS, KD_STATS,
                     HAS_SOFTCAP, HAS_SMOOTHING, True)
    if KEEP >= 1:
        _dense_store(kept0, gs, k0 + rr, rr < n_full * BLOCK_V, r, off_x, sgn_x, off_s, sgn_s,
                     c, inv_temp, softcap, EVICTION, CE_STATS, KD_STATS, HAS_SOFTCAP,
                     HAS_SMOOTHING, True)


@triton.jit
def _write_ids(x_row, grad_row_ptr, ids_ptr, lp_ptr, row, V, K, active, label, ids, valid, p,
               zk, dzk, r, lg_x, r_L, lg_L, P, a, b, c, kd_a, inv_temp, softcap, start, stop,
               xy_ptr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, FULL: tl.constexpr,
               DISTILL: tl.constexpr, CE_STATS: tl.constexpr, KD_STATS: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
               LABEL_FROM_XK: tl.constexpr):
    """Overwrites the columns of one row's gradient that _write_dense got wrong, those in
    [start, stop), with their complete values computed from scratch in float32:
    1. each valid teacher id (`ids`, `valid`, `p` from _entries, `zk`, `dzk` from _gather):
       entries sharing an id sum their p (and, for "topk", count their q) through a
       [BLOCK_K, K_CHUNK] comparison per step, so all of them store the same value;
    2. the label column (distill) when it is not a teacher id: dense value - b, its raw
       logit read at x_row[label] or, with LABEL_FROM_XK, at xy_ptr (kd_fwd_kernel saved it
       there: the gradient may have overwritten the logits).
    Every column is multiplied by dz/dx with a softcap. The dense values must be visible
    first (a barrier in the same program, or an earlier launch)."""
    sum_p = tl.zeros([BLOCK_K], tl.float32)
    count = tl.zeros([BLOCK_K], tl.float32)
    for j in range(0, K, K_CHUNK):
        idj, vj, _lpj, pj = _entries(ids_ptr, lp_ptr, row, V, K, active,
                                     j + tl.arange(0, K_CHUNK))
        same = (ids[:, None] == idj[None, :]) & vj[None, :]
        sum_p += tl.sum(tl.where(same, pj[None, :], 0.0), axis=1)
        count += tl.sum(tl.where(same, 1.0, 0.0), axis=1)
    q = tl.exp((zk - r_L) * inv_temp - lg_L)
    if FULL:
        g = kd_a * inv_temp * (P * q - sum_p)
    else:
        g = kd_a * inv_temp * (P * count * q - sum_p)
    if DISTILL:
        g += a * tl.exp((zk - r) - lg_x) - tl.where(ids == label, b, 0.0) - c
    if HAS_SOFTCAP:
        g = g * dzk
    own = valid & (ids >= start) & (ids < stop)
    if DISTILL:
        # The label column's load before any store (a load after a store to another pointer
        # could not be moved ahead of it: one more round trip). -1 (no store) when the row is
        # inactive or the label is a teacher id (stored with the ids).
        is_id = tl.max(tl.where(valid & (ids == label), 1, 0), axis=0)
        y = tl.where(active & (is_id == 0), label, -1)
        own_y = (y >= start) & (y < stop)
        if LABEL_FROM_XK:
            zy, dzy = load_z(xy_ptr, 0, own_y, softcap, HAS_SOFTCAP, "", True)
        else:
            zy, dzy = load_z(x_row, tl.where(own_y, y, 0), own_y, softcap, HAS_SOFTCAP, "",
                             True)
    tl.store(grad_row_ptr + tl.where(own, ids, 0), g.to(grad_row_ptr.dtype.element_ty), mask=own)
    if DISTILL:
        off_x, sgn_x, off_s, sgn_s = _dense_offsets(lg_x, lg_L, P, a, kd_a, inv_temp, FULL,
                                                    CE_STATS, KD_STATS)
        gy = _dense_value(zy - r, 1.0, off_x, sgn_x, off_s, sgn_s, c, inv_temp, CE_STATS,
                          KD_STATS, False, HAS_SMOOTHING) - b
        if HAS_SOFTCAP:
            gy = gy * dzy
        tl.store(grad_row_ptr + tl.where(own_y, y, 0), gy.to(grad_row_ptr.dtype.element_ty),
                 mask=own_y)


@triton.jit
def _topk_softmax(zk, valid, inv_temp):
    """("topk") (L, r_L, s_L): the log-sum-exp of s = z / T over the valid ids (not poisoned),
    their max of z and sum exp((z - r_L) / T)."""
    zv = tl.where(valid, zk, float("-inf"))
    mk = tl.max(zv, axis=0)
    r_L = safe_max(mk)
    s_L = tl.sum(tl.math.exp2((zv - r_L) * (inv_temp * LOG2E)), axis=0)
    return scaled_lse(mk, s_L, inv_temp), r_L, s_L


@triton.jit
def _kd_sum(zk, lp, p, r_L, lg_L, inv_temp):
    """The row's KD term: sum over entries with p > 0 of p * (lp - (s[id] - L))."""
    log_q = (zk - r_L) * inv_temp - lg_L  # s[id] - L
    return tl.sum(tl.where(p == 0.0, 0.0, p * (lp - log_q)), axis=0)


@triton.jit
def kd_fwd_kernel(
    # pointers: logits [N, V], ids / logprobs [N, K], labels [N], row_scale [N, 2] = (ce, kd),
    # part [N, NUM_SPLITS, 4] (read only with FROM_PARTS)
    logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, row_scale_ptr, part_ptr,
    # sizes, strides, options
    V, K, stride_row, inv_temp, ignore_index, smoothing, z_loss, softcap,
    # outputs: loss [N], stats [N, STATS_FIELDS], grad [N, V] (with IN_PLACE the logits'
    # buffer) and xk [N, K + 1] (WALK_GATHER: the raw logits at the ids, then the label's)
    loss_ptr, stats_ptr, grad_ptr, xk_ptr,
    # constexprs
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, FULL: tl.constexpr, DISTILL: tl.constexpr,
    CE_STATS: tl.constexpr, KD_STATS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr, FROM_PARTS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    ALIGN: tl.constexpr, PREFETCH: tl.constexpr, KEEP: tl.constexpr, WALK_GATHER: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    """Grid (N,): a row's loss and statistics, from its own walk over the vocabulary (row
    path, _ce_core.slice_stats' per-thread walk, PREFETCH and KEEP as there; with WRITE_GRAD
    also the unit-cotangent gradient) or from split partials.

    With WRITE_GRAD the statistics pass asks the caches to keep its lines (evict_last) so the
    gradient pass re-reads the row from L2 more often, and everything that gathers at the
    teacher's ids is left to kd_ids_kernel, launched next: the KD term of the loss (`loss`
    holds the cross-entropy part), ("topk") stats fields 1, 7, 8, and the gradient's id and
    label columns (`grad` holds the dense part). P (field 2) is stored here: the dense part
    needs it. With WALK_GATHER (the row is walked and 16-byte aligned: launch.kd_walk_gathers)
    the logits at the ids are stored too (xk, float32; 0 at invalid entries): their gather is
    issued before the gradient pass, while the row is in L2, and nothing waits for it until
    the pass is done (H100, bf16, V=128256, K=64, value_and_grad: kd_loss 1.668 -> 1.647 ms,
    distill_loss T=2 1.913 -> 1.897, T=1 unchanged; "topk" kd_loss, which does not walk the
    row, lost 0.768 -> 0.864, and kd_loss at the unaligned V=50257 0.670 -> 0.927: there the
    ids kernel gathers them itself). distill_loss saves the label's raw logit there too
    (column K). IN_PLACE (with WALK_GATHER): the gradient overwrites the logits (aliased), so
    those gathers are stored, and every thread's reads of the row's scattered logits done,
    before a barrier that precedes the gradient pass.
    """
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * stride_row
    label, active, bad = _row_state(labels_ptr, row, V, ignore_index, DISTILL)
    # The teacher's entries first: contiguous loads whose latency the walk hides.
    ids, valid, lp, p = _entries(ids_ptr, logprobs_ptr, row, V, K, active, tl.arange(0, BLOCK_K))
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    s_kd = tl.zeros([], tl.float32)
    sumz = tl.zeros([], tl.float32)
    kept0 = m
    kept1 = m
    if FROM_PARTS:
        # partials: (max z, sum exp(z - max), sum exp((z - max) / T), sum z)
        base, ok = load_partials(part_ptr, row, NUM_SPLITS, BLOCK_S)
        m_i = load_field(base, ok, 0, True, "")
        m, s = merge_stats(m_i, load_field(base, ok, 1, False, ""))
        s_kd = merge_scaled(m_i, load_field(base, ok, 2, False, ""), m, inv_temp)
        sumz = tl.sum(load_field(base, ok, 3, False, ""), axis=0)
    elif DISTILL or KD_STATS:
        m, s, s_kd, sumz, _, kept0, kept1 = slice_stats(
            logits_ptr, row * stride_row, -1, 0, V, softcap, inv_temp, BLOCK_V, ALIGN,
            HAS_SOFTCAP, HAS_SMOOTHING, CE_STATS, KD_STATS, "evict_last" if WRITE_GRAD else "",
            PREFETCH, KEEP if WRITE_GRAD else 0)
    # Softmaxes relative to the max r of z (z - r is exact near the max), not to a float32
    # lse: softmax(z) = exp((z - r) - lg_x); softmax(s) = exp((z - r_L) / T - lg_L).
    lse_x, lse_lo = lse_parts(m, s)
    r = safe_max(m)
    L = scaled_lse(m, s_kd, inv_temp)
    r_L = r
    s_L = s_kd
    if FULL:
        if not KD_STATS:
            L = lse_x
            s_L = s
    zk = tl.zeros([BLOCK_K], tl.float32)
    if not WRITE_GRAD:
        zk, _ = _gather(x_row, ids, valid, softcap, HAS_SOFTCAP)
        if not FULL:
            L, r_L, s_L = _topk_softmax(zk, valid, inv_temp)
    # NaN/+inf policy: a NaN or +inf logit in the row gives NaN statistics (poison_inf), so
    # the loss and (through the offsets of _write_dense) the gradient row are NaN; an entry
    # with p == 0 adds nothing, but a NaN teacher log-prob gives a NaN term.
    lse_x = poison_inf(lse_x)
    L = poison_inf(L)
    lg_x = _log_sum(s, lse_x)
    lg_L = _log_sum(s_L, L)
    P = tl.sum(p, axis=0)
    ce_a = tl.where(active, tl.load(row_scale_ptr + row * 2), 0.0)
    kd_a = tl.where(active, tl.load(row_scale_ptr + row * 2 + 1), 0.0)
    loss = tl.zeros([], tl.float32)
    if not WRITE_GRAD:
        loss = kd_a * _kd_sum(zk, lp, p, r_L, lg_L, inv_temp)
    a = 0.0
    b = 0.0
    c = 0.0
    if DISTILL:
        ce, a, b, c = distill_ce(x_row, label, V, lse_x, lse_lo, sumz, smoothing, z_loss,
                                 active, bad, ce_a, softcap, HAS_SOFTCAP, HAS_SMOOTHING,
                                 HAS_ZLOSS)
        loss += ce_a * ce  # NaN for a bad label even where ce_a is 0
    tl.store(loss_ptr + row, loss)
    out = stats_ptr + row * STATS_FIELDS
    tl.store(out, lse_x)
    tl.store(out + 1, L)
    tl.store(out + 2, P)
    tl.store(out + 3, ce_a)
    tl.store(out + 4, kd_a)
    tl.store(out + 5, r)
    tl.store(out + 6, lg_x)
    tl.store(out + 7, r_L)
    tl.store(out + 8, lg_L)
    if WRITE_GRAD:
        xk_row = xk_ptr + row * (K + 1)
        kk = tl.arange(0, BLOCK_K)
        if WALK_GATHER:
            xk = load_raw(x_row, tl.where(valid, ids, 0), valid, "", True)
            if DISTILL:
                save_label_logit(x_row, xk_row, label, active, V, K)
            if IN_PLACE:
                tl.store(xk_row + kk, xk.to(tl.float32), mask=kk < K)
                tl.debug_barrier()  # the row's gathered logits read before it is overwritten
        _write_dense(logits_ptr, row * stride_row, grad_ptr, row * V, r, lg_x, lg_L, P, a, c,
                     kd_a, inv_temp, softcap, 0, V, kept0, kept1, "evict_first", BLOCK_V, ALIGN,
                     FULL, CE_STATS, KD_STATS, HAS_SOFTCAP, HAS_SMOOTHING,
                     KEEP if DISTILL or KD_STATS else 0)
        if WALK_GATHER and not IN_PLACE:
            tl.store(xk_row + kk, xk.to(tl.float32), mask=kk < K)


@triton.jit
def kd_ids_kernel(
    # pointers: logits [N, V], ids / logprobs [N, K], labels [N], then kd_fwd_kernel's
    # outputs xk [N, K] (the logits at the ids; read with WALK_GATHER), loss [N],
    # stats [N, STATS_FIELDS], grad [N, V], the last three aliased to the output of the same
    # name
    logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, xk_ptr, loss_in_ptr, stats_in_ptr,
    grad_in_ptr,
    # sizes, strides, options
    V, K, stride_row, inv_temp, ignore_index, smoothing, z_loss, softcap,
    # outputs (in place)
    loss_ptr, stats_ptr, grad_ptr,
    # constexprs
    BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, FULL: tl.constexpr, DISTILL: tl.constexpr,
    CE_STATS: tl.constexpr, KD_STATS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr, ALIGN: tl.constexpr,
    WALK_GATHER: tl.constexpr,
):
    """Grid (N,), after kd_fwd_kernel with WRITE_GRAD, in place: a row's work at its teacher
    ids. ("topk") the softmax over the ids into stats fields 1, 7, 8; the KD term added to
    the loss; the gradient's id and label columns written over the dense part (_write_ids).

    A launch of its own rather than the tail of the row walk: that walk runs one 1024-thread
    program per SM, so its dependent round trips per row (the logits gathered at the ids, the
    duplicate scan, the stores) stalled the whole SM; here many small programs per SM overlap
    them. H100, bf16, N=8192, V=128256, K=64, device span of value_and_grad, id work in the
    walk -> here (this kernel's share): kd_loss "full" 1.858 -> 1.667 ms (68 us), "topk" 0.866
    -> 0.768 (79 us), distill_loss T=1 1.912 -> 1.660 (66 us), T=2 2.118 -> 1.913; at K=1
    1.620 -> 1.584 ("topk" 0.667 -> 0.676). It ran near the random-access rate of the HBM
    (Nsight Compute: 54 MB read, 16 MB written in 61 us: its gathers and the 2-byte stores
    into gradient lines long evicted from L2); since the walk gathers the logits at the ids
    for it (xk) it takes 51 us in kd_loss "full" (1.648 ms in all). 1, 2 or 4 warps: within
    10%."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * stride_row
    label, active, bad = _row_state(labels_ptr, row, V, ignore_index, DISTILL)
    kk = tl.arange(0, BLOCK_K)
    ids, valid, lp, p = _entries(ids_ptr, logprobs_ptr, row, V, K, active, kk)
    if WALK_GATHER:  # kd_fwd_kernel gathered them
        zk, dzk = load_z(xk_ptr + row * (K + 1), kk, kk < K, softcap, HAS_SOFTCAP, "", True)
        zk = tl.where(valid, zk, 0.0)  # as _gather
    else:
        zk, dzk = _gather(x_row, ids, valid, softcap, HAS_SOFTCAP)
    st = stats_in_ptr + row * STATS_FIELDS
    if FULL:
        r_L = tl.load(st + 7)
        lg_L = tl.load(st + 8)
    else:
        L, r_L, s_L = _topk_softmax(zk, valid, inv_temp)
        L = poison_inf(L)
        lg_L = _log_sum(s_L, L)
        out = stats_ptr + row * STATS_FIELDS
        tl.store(out + 1, L)
        tl.store(out + 7, r_L)
        tl.store(out + 8, lg_L)
    kd_a = tl.load(st + 4)
    tl.store(loss_ptr + row,
             tl.load(loss_in_ptr + row) + kd_a * _kd_sum(zk, lp, p, r_L, lg_L, inv_temp))
    a = 0.0
    b = 0.0
    c = 0.0
    if DISTILL:
        a, b, c = ce_coefs(tl.load(st), V, smoothing, z_loss, bad, tl.load(st + 3), HAS_ZLOSS)
    _write_ids(x_row, grad_ptr + row * V, ids_ptr, logprobs_ptr, row, V, K, active, label, ids,
               valid, p, zk, dzk, tl.load(st + 5), tl.load(st + 6), r_L, lg_L, tl.load(st + 2),
               a, b, c, kd_a, inv_temp, softcap, 0, V, xk_ptr + row * (K + 1) + K, BLOCK_K,
               K_CHUNK, FULL, DISTILL, CE_STATS, KD_STATS, HAS_SOFTCAP, HAS_SMOOTHING,
               WALK_GATHER)


@triton.jit
def kd_partial_kernel(
    # pointers: logits [N, V]; GATHER: teacher ids [N, K] and labels [N] (global columns),
    # offset [N] int32 (the global column of the row's first logit)
    logits_ptr, ids_ptr, labels_ptr, offset_ptr,
    # sizes, strides, options
    V, stride_row, inv_temp, softcap, K,
    # outputs: float32 [N, NUM_SPLITS, 4] = (max z, sum exp(z - max), sum exp((z - max) / T),
    # sum z); GATHER: float32 [N, K + 1], the raw logits at the label, then at the ids (0 for
    # a column outside these logits)
    part_ptr, xg_ptr,
    # constexprs
    SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, CE_STATS: tl.constexpr,
    KD_STATS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    ALIGN: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Split path, grid (N, NUM_SPLITS): partial online-softmax statistics of one slice; with
    BLOCK_C > 0 the row's split 0 also gathers the logits at its label and teacher ids when
    they fall in these columns (a vocabulary slice: global column - offset in [0, V)), the
    loads issued before the walk so their latency hides behind it. Nothing outside [0, V) is
    read."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * SPLIT_V
    if BLOCK_C > 0:
        cc = tl.arange(0, BLOCK_C)
        mine = cc < tl.where(split == 0, K + 1, 0)  # the row's split 0 gathers
        off = tl.load(offset_ptr + row)
        col = tl.load(ids_ptr + row * K + cc - 1, mask=mine & (cc >= 1), other=-1) - off
        col = tl.where(cc == 0, tl.load(labels_ptr + row) - off, col)
        hit = mine & (col >= 0) & (col < V)
        xg = tl.load(logits_ptr + row * stride_row + tl.where(hit, col, 0), mask=hit,
                     other=0.0).to(tl.float32)
    m, s, s_kd, sumz, _, _, _ = slice_stats(logits_ptr, row * stride_row, -1, start,
                                            tl.minimum(start + SPLIT_V, V), softcap, inv_temp,
                                            BLOCK_V, ALIGN, HAS_SOFTCAP, HAS_SMOOTHING, CE_STATS,
                                            KD_STATS, "", False, 0)
    store_partials(part_ptr, row, split, tl.num_programs(1), m, s, s_kd, sumz)
    if BLOCK_C > 0:
        tl.store(xg_ptr + row * (K + 1) + cc, xg, mask=mine)


@triton.jit
def kd_bwd_kernel(
    # pointers: logits [N, V], ids / logprobs [N, K] (ids local: columns of these logits),
    # labels [N] (global: columns of the whole vocabulary), stats [N, STATS_FIELDS],
    # offset [N] int32 (the global column of the row's first logit)
    logits_ptr, ids_ptr, logprobs_ptr, labels_ptr, stats_ptr, offset_ptr,
    # sizes, strides, options; vocab_total: the whole vocabulary (V, unless these logits
    # are a vocabulary slice)
    V, K, stride_row, inv_temp, ignore_index, smoothing, z_loss, softcap, vocab_total,
    # outputs
    grad_ptr,
    # constexprs
    SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr, FULL: tl.constexpr, DISTILL: tl.constexpr, CE_STATS: tl.constexpr,
    KD_STATS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid (N, NUM_SPLITS): the gradient of one slice from the row's statistics (the
    cross-entropy coefficients recomputed from lse and ce_a); only the program whose slice
    holds an id stores that id's column.

    The logits may be one vocabulary slice of `vocab_total` columns starting at global column
    `offset` (the vocabulary-parallel backward: statistics merged across devices, each device
    writing its slice): a label is checked against the whole vocabulary and written where it
    falls in the slice; the caller maps the teacher ids to the slice's columns (-1 outside)."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * SPLIT_V
    stop = tl.minimum(start + SPLIT_V, V)
    label, active, bad = _row_state(labels_ptr, row, vocab_total, ignore_index, DISTILL)
    label = tl.where(bad, -1, label - tl.load(offset_ptr + row))  # a column of the slice, if any
    st = stats_ptr + row * STATS_FIELDS
    a = 0.0
    b = 0.0
    c = 0.0
    if DISTILL:
        a, b, c = ce_coefs(tl.load(st), vocab_total, smoothing, z_loss, bad, tl.load(st + 3),
                           HAS_ZLOSS)
    r, lg_x, r_L, lg_L, P, kd_a = (tl.load(st + 5), tl.load(st + 6), tl.load(st + 7),
                                   tl.load(st + 8), tl.load(st + 2), tl.load(st + 4))
    _write_dense(logits_ptr, row * stride_row, grad_ptr, row * V, r, lg_x, lg_L, P, a, c, kd_a,
                 inv_temp, softcap, start, stop, a, a, "", BLOCK_V, ALIGN, FULL, CE_STATS,
                 KD_STATS, HAS_SOFTCAP, HAS_SMOOTHING, 0)
    tl.debug_barrier()  # the id columns overwrite dense values other threads wrote
    x_row = logits_ptr + row * stride_row
    ids, valid, _lp, p = _entries(ids_ptr, logprobs_ptr, row, V, K, active, tl.arange(0, BLOCK_K))
    zk, dzk = _gather(x_row, ids, valid, softcap, HAS_SOFTCAP)
    _write_ids(x_row, grad_ptr + row * V, ids_ptr, logprobs_ptr, row, V, K, active, label, ids,
               valid, p, zk, dzk, r, lg_x, r_L, lg_L, P, a, b, c, kd_a, inv_temp, softcap,
               start, stop, x_row, BLOCK_K, K_CHUNK, FULL, DISTILL, CE_STATS, KD_STATS,
               HAS_SOFTCAP, HAS_SMOOTHING, False)


def kd_constexprs(normalize: str, distill: bool, temperature: float, k: int,
                  softcap: float | None = None, smoothing: float = 0.0,
                  z_loss: float = 0.0, power: bool = False) -> dict:
    """The compile-time switches of kd_fwd_kernel and kd_bwd_kernel, a pure function of the
    options.

    KD_STATS: the KD term needs its own online softmax of s = z / T over the vocabulary; a
    distill_loss at T = 1 shares the cross-entropy's instead (one exp per element, not two).
    CE_STATS: 0 without the cross-entropy term (kd_loss), else 1, or with `power`
    (launch.kd_power) T for a distill_loss whose temperature is in POWER_TEMPERATURES with
    KD_STATS (exp(z - m) = exp((z - m) / T)**T: the cross-entropy's softmax costs multiplies,
    not a second exp; _ce_core._fold).
    BLOCK_K: the teacher entries of a row held in registers at once (a power of two >= 16).
    HAS_SMOOTHING, HAS_ZLOSS: options of the cross-entropy term (distill_loss only).
    """
    full = normalize == "full"
    kd_stats = full and not (distill and temperature == 1.0)
    ce_stats = int(bool(distill))
    if power and distill and kd_stats and temperature in POWER_TEMPERATURES:
        ce_stats = int(temperature)
    return dict(BLOCK_K=max(16, triton.next_power_of_2(k)), K_CHUNK=DUP_CHUNK, FULL=full,
                DISTILL=bool(distill), CE_STATS=ce_stats, KD_STATS=kd_stats,
                HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=bool(distill) and smoothing > 0,
                HAS_ZLOSS=bool(distill) and z_loss > 0)


def needs_vocab_pass(flags: dict) -> bool:
    """Whether the forward walks the vocabulary at all ("topk" kd_loss only gathers K values)."""
    return flags["DISTILL"] or flags["KD_STATS"]


# ----------------------------------------------------------------------------- launch plans
def kd_fwd_plan(n: int, vocab: int, k: int, *, temperature: float, normalize: str,
                distill: bool, ignore_index: int, num_sms: int, write_grad: bool,
                smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                itemsize: int = 0, in_place: bool = False) -> Plan:
    """x, ids, lp, y, row_scale [N, 2] -> loss, stats [N, STATS_FIELDS] (and grad, the unit-
    cotangent gradient, with write_grad; with in_place, for logits that are dead after the
    call (the LM head's chunks), written over x where the walk gathers the logits at the
    ids, launch.kd_walk_gathers, and a fresh buffer elsewhere). Many rows: one program per
    row walks the vocabulary once and writes the gradient, then kd_ids_kernel does the work
    at the teacher's ids; few rows: partials per vocabulary slice (when the options need a
    vocabulary walk), one program per row merges them, then a split gradient pass. smoothing
    and z_loss apply to distill's cross-entropy term, softcap to the logits both terms see.
    itemsize: bytes per logit, which sets the tiles the row walk keeps in registers
    (launch.kd_keep_tiles; 0 keeps none)."""
    flags = kd_constexprs(normalize, distill, temperature, k, softcap, smoothing, z_loss,
                          launch.kd_power(vocab, itemsize))
    exps = flags["KD_STATS"] + (flags["CE_STATS"] == 1)  # exponentials per logit and pass
    cfg = row_config(n, vocab, num_sms, write_grad,
                     launch.kd_keep_tiles(vocab, itemsize, softcap, exps))
    inv_temp = inverse_temperature(temperature)
    cap = float(softcap or 1.0)
    scalars = (vocab, k, vocab, inv_temp, ignore_index, float(smoothing), float(z_loss), cap)
    fused = cfg.num_splits == 1
    launches = []
    part, splits = "row_scale", 1  # part is not read unless it holds split partials
    if not fused and needs_vocab_pass(flags):
        part, splits = "part", cfg.num_splits
        launches.append(_partials_launch(n, vocab, flags, cfg, inv_temp, cap))
    write_here = write_grad and fused
    grad = Buf("grad", (n, vocab), LOGITS) if write_here else placeholder("grad", LOGITS)
    walk_gather = (write_here and needs_vocab_pass(flags)
                   and launch.kd_walk_gathers(vocab, itemsize))
    in_place = in_place and walk_gather
    xk = Buf("xk", (n, k + 1), "float32") if walk_gather else placeholder("xk")
    launches.append(Launch(
        kd_fwd_kernel, (n,), ("x", "ids", "lp", "y", "row_scale", part), scalars,
        (Buf("loss", (n,), "float32"), Buf("stats", (n, STATS_FIELDS.value), "float32"), grad,
         xk),
        cfg.num_warps if fused else 4,
        dict(BLOCK_V=cfg.block_v, NUM_SPLITS=splits, BLOCK_S=merge_block(splits),
             FROM_PARTS=splits > 1, WRITE_GRAD=write_here, ALIGN=cfg.align,
             PREFETCH=cfg.prefetch and write_here, KEEP=cfg.keep if write_here else 0,
             WALK_GATHER=walk_gather, IN_PLACE=in_place, **flags),
        aliases=((0, 2),) if in_place else ()))
    if write_here:
        # in place the logits are gone: kd_ids_kernel reads the ids' and label's from xk
        logits = Zeros((1,), LOGITS) if in_place else "x"
        launches.append(Launch(
            kd_ids_kernel, (n,), (logits, "ids", "lp", "y", "xk", "loss", "stats", "grad"),
            scalars,
            (Buf("loss", (n,), "float32"), Buf("stats", (n, STATS_FIELDS.value), "float32"),
             Buf("grad", (n, vocab), LOGITS)), KD_IDS_WARPS,
            dict(ALIGN=cfg.align, WALK_GATHER=walk_gather, **flags),
            aliases=((5, 0), (6, 1), (7, 2)), partial_alias=True))
    if write_grad and not fused:
        launches.append(kd_bwd_launch(n, vocab, k, scalars, flags, cfg))
    return Plan(tuple(launches), ("loss", "stats") + (("grad",) if write_grad else ()))


def _partials_launch(n, vocab, flags, cfg, inv_temp, cap, k: int | None = None) -> Launch:
    """x[, ids, y, offset] -> part [N, S, 4] = (max z, sum exp(z - max), sum exp((z - max) /
    T), sum z) of each row's S vocabulary splits[, xg [N, k + 1], the raw logits at the label
    and the k ids (kd_partials_plan)]."""
    gather = k is not None
    ins = (("ids", "y", "offset") if gather else
           (Zeros((1,), "int32"), Zeros((1,), "int32"), Zeros((1,), "int32")))
    xg = Buf("xg", (n, k + 1), "float32") if gather else placeholder("xg")
    return Launch(kd_partial_kernel, (n, cfg.num_splits), ("x",) + ins,
                  (vocab, vocab, inv_temp, cap, k or 0),
                  (Buf("part", (n, cfg.num_splits, 4), "float32"), xg), cfg.num_warps,
                  dict(SPLIT_V=cfg.split_v, BLOCK_V=cfg.block_v, ALIGN=cfg.align,
                       CE_STATS=flags["CE_STATS"], KD_STATS=flags["KD_STATS"],
                       HAS_SOFTCAP=flags["HAS_SOFTCAP"], HAS_SMOOTHING=flags["HAS_SMOOTHING"],
                       BLOCK_C=triton.next_power_of_2(k + 1) if gather else 0))


def kd_bwd_launch(n, vocab, k, scalars, flags, cfg, offset="", vocab_total=None) -> Launch:
    """x, ids, lp, y, stats[, offset] -> grad (the row weights folded into stats): `offset`
    names the [N] int32 input holding the first global column of a vocabulary slice of
    `vocab_total` columns (none: the whole row, offset 0). distill_loss's 1024-thread
    programs of 16 or 32 warps on aligned rows are capped at launch.KD_BWD_DISTILL_MAXNREG
    registers (as many programs an SM as kd_loss's)."""
    capped = flags["DISTILL"] and cfg.num_warps >= 16 and cfg.align == 16
    return Launch(kd_bwd_kernel, (n, cfg.num_splits),
                  ("x", "ids", "lp", "y", "stats", offset or Zeros((n,), "int32")),
                  scalars + (vocab if vocab_total is None else vocab_total,),
                  (Buf("grad", (n, vocab), LOGITS),), cfg.num_warps,
                  dict(SPLIT_V=cfg.split_v, BLOCK_V=cfg.block_v, ALIGN=cfg.align, **flags),
                  maxnreg=launch.KD_BWD_DISTILL_MAXNREG if capped else None)


# ----------------------------------------------------------------------------- vocabulary-parallel
# A device holding a vocabulary slice of every row (kd_loss / distill_loss with the logits
# sharded on V): kd_partials_plan's statistics of its slice, merged across the devices with
# O(N) all-reduces (and the logits at the teacher ids and labels with one O(N * K) all-reduce)
# by the caller, which finishes the rows; then kd_bwd_plan writes the slice's unit-cotangent
# gradient from the merged statistics. Two reads of the slice and one write: the floor of a
# loss whose statistics span devices.
def _slice_flags(vocab, k, temperature, normalize, distill, smoothing, z_loss, softcap,
                 itemsize) -> dict:
    return kd_constexprs(normalize, distill, temperature, k, softcap, smoothing, z_loss,
                         launch.kd_power(vocab, itemsize))


def kd_partials_plan(n: int, vocab: int, *, temperature: float, normalize: str, distill: bool,
                     num_sms: int, smoothing: float = 0.0, softcap: float | None = None,
                     itemsize: int = 0, gather_k: int | None = None) -> Plan:
    """x -> part [N, S, 4] = (max z, sum exp(z - max), sum exp((z - max) / T), sum z) of each
    row's S vocabulary splits (relative to each split's max; sum exp(z - max) for distill,
    the T-sum where the KD term has its own softmax, sum z with label smoothing, 0 where not
    needed: kd_constexprs). None of it is needed for "topk" kd_loss (needs_vocab_pass).
    With `gather_k`: x, ids [N, gather_k], y [N], offset [N] int32 -> part and xg float32
    [N, gather_k + 1], the raw logits at the label and the ids where those global columns
    fall in x = columns [offset, offset + vocab) (0 elsewhere): a vocabulary slice's logits
    at the labels and teacher ids, read by the same launch."""
    flags = _slice_flags(vocab, 1, temperature, normalize, distill, smoothing, 0.0, softcap,
                         itemsize)
    return Plan((_partials_launch(n, vocab, flags, row_config(n, vocab, num_sms),
                                  inverse_temperature(temperature), float(softcap or 1.0),
                                  gather_k),),
                ("part",) + (("xg",) if gather_k is not None else ()))


def kd_bwd_plan(n: int, vocab: int, k: int, *, vocab_total: int, temperature: float,
                normalize: str, distill: bool, ignore_index: int, num_sms: int,
                smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                itemsize: int = 0) -> Plan:
    """x, ids, lp, y, stats, offset -> grad: the gradient of a vocabulary slice `x` [N, V] of
    `vocab_total` columns from the rows' merged statistics [N, STATS_FIELDS] (the cotangent
    folded into the row weights), `offset` [N] int32 the slice's first global column, `y` the
    global labels and `ids` the teacher ids as columns of the slice (-1 elsewhere)."""
    flags = _slice_flags(vocab, k, temperature, normalize, distill, smoothing, z_loss, softcap,
                         itemsize)
    scalars = (vocab, k, vocab, inverse_temperature(temperature), ignore_index,
               float(smoothing), float(z_loss), float(softcap or 1.0))
    cfg = row_config(n, vocab, num_sms, write_grad=True, grad_tile=launch.bwd_slice_tile(vocab))
    return Plan((kd_bwd_launch(n, vocab, k, scalars, flags, cfg, "offset", vocab_total),),
                ("grad",))
