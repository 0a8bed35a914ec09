"""Fused cross-entropy kernels: forward (optionally writing the gradient), split merge, backward.

Per row, with z = softcap * tanh(x / softcap) (or z = x), lse = logsumexp(z), eps = smoothing:
    loss = (1 - eps) * (lse - z[y]) + eps * (lse - mean(z)) + z_loss * lse**2
    dloss/dz_j = a * softmax(z)_j - b * [j == y] - c,
    a = scale * (1 + 2 * z_loss * lse), b = scale * (1 - eps), c = scale * eps / V,
where `scale` is the per-row gradient scale (0 for ignored rows). A label outside [0, V) that
is not ignore_index gives NaN loss and a NaN gradient row; it is never used as an address.
The statistics walk, the row finish and (a, b, c) are kernels/_ce_core.py's, shared with the
distillation kernels (kernels/kd.py).

Kernels take (inputs..., scalars..., outputs..., CONSTEXPRS) so JAX (jax-triton) and PyTorch
launch them identically. Imports triton only.
"""
import triton
import triton.language as tl

from jax_fusedloss.kernels import launch
from jax_fusedloss.kernels.launch import (merge_block, row_config, scale_rows_constexprs,
                                          split_fused_config)
from jax_fusedloss.kernels.plan import LOGITS, Buf, Launch, Plan, Zeros, placeholder
from jax_fusedloss.kernels._ce_core import (ce_row_finish, label_state, load_raw, load_z,
                                            slice_stats, to_z)
from jax_fusedloss.kernels._online import (LOG2E, edge_tile, hint_multiple, load_field,
                                           load_partials, lse_parts, merge_stats, store_partials,
                                           span_ptr, vector_span)

# Per-row gradient coefficients, float32 [N, COEF_FIELDS] = (a, b, c, lse_lo * w, w): w = 1 as
# written, and a backward that scales every field by a row's cotangent keeps lse_lo = field 3
# / field 4 (0 where w = 0), the low part of the log-sum-exp (see _online.lse_parts).
COEF_FIELDS = tl.constexpr(5)  # a constexpr global: the kernels read it


@triton.jit
def _ce_grad_tile(x_ptr, g_ptr, offs, mask, lse_safe, lo2, a, c, softcap,
                  HAS_SOFTCAP: tl.constexpr, EVICTION: tl.constexpr, MASKED: tl.constexpr):
    """Writes (a * softmax - c) * dz/dx for one tile: x at x_ptr + offs, gradient at
    g_ptr + offs (the label's term is _ce_grad_slice's fix-up)."""
    _ce_grad_store(load_raw(x_ptr, offs, mask, EVICTION, MASKED), g_ptr, offs, mask, lse_safe,
                   lo2, a, c, softcap, HAS_SOFTCAP, EVICTION, MASKED)


@triton.jit
def _ce_grad_store(x, g_ptr, offs, mask, lse_safe, lo2, a, c, softcap, HAS_SOFTCAP: tl.constexpr,
                   EVICTION: tl.constexpr, MASKED: tl.constexpr):
    """_ce_grad_tile of a tile x of raw logits already in registers."""
    z, dz = to_z(x, mask, softcap, HAS_SOFTCAP, MASKED)
    g = a * tl.math.exp2((z - lse_safe) * LOG2E - lo2) - c
    if HAS_SOFTCAP:
        g = g * dz
    if MASKED:
        tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=mask,
                 eviction_policy=EVICTION)
    else:
        tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), eviction_policy=EVICTION)


@triton.jit
def _ce_grad_slice(x_ptr, row_off, g_ptr, g_off, label, lse, lse_lo, a, b, c, start, stop,
                   softcap, kept0, kept1, BLOCK_V: tl.constexpr, ALIGN: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, EVICTION: tl.constexpr, KEEP: tl.constexpr):
    """Writes (a * softmax - b * onehot(label) - c) * dz/dx over [start, stop) of the row at
    x_ptr + row_off into g_ptr + g_off, the softmax as exp((z - lse) - lse_lo) (as many
    operations per column as exp(z - lse)); _online's aligned tile walk.

    The tiles write (a * softmax - c) * dz/dx; the label's column is then rewritten once, after
    a barrier (so that it lands after the tile store of the same address), instead of a
    compare and select per column. Walks the slice backwards: the tiles the statistics pass
    read last are the likeliest to still sit in L2 when the fused kernel comes back for them
    (the edge tile, at most 2 * VEC - 2 columns, and the partial last tile go first; whole
    tiles store unmasked). The first KEEP whole tiles come from registers (slice_stats' kept0,
    kept1, which callers with KEEP = 0 fill with any placeholder) and are written last.
    """
    VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    lo2 = lse_lo * LOG2E
    # The label's logit is read before any tile is written: the gradient may overwrite the
    # logits in place (linear_cross_entropy's chunks); the barrier orders this read before
    # every thread's stores.
    in_slice = (label >= start) & (label < stop)
    col = tl.where(in_slice, label, start)
    zy, dzy = load_z(x_ptr + row_off, col, in_slice, softcap, HAS_SOFTCAP, "", True)
    tl.debug_barrier()
    k0, k1, lo = vector_span(row_off, start, stop, ALIGN, VEC)
    if ALIGN < VEC:
        cols, mask = edge_tile(start, stop, lo, k1, VEC)
        _ce_grad_tile(x_ptr + row_off, g_ptr + g_off, cols, mask, lse_safe, lo2, a, c, softcap,
                      HAS_SOFTCAP, EVICTION, True)
    xs = span_ptr(x_ptr, row_off, lo, ALIGN, VEC)
    gs = span_ptr(g_ptr, g_off, lo, ALIGN, VEC)
    n_full = (k1 - k0) // BLOCK_V
    for k in range(k0 + n_full * BLOCK_V, k1, BLOCK_V):  # the partial last tile, if any
        t = k + tl.arange(0, BLOCK_V)
        _ce_grad_tile(xs, gs, t, t < k1, lse_safe, lo2, a, c, softcap, HAS_SOFTCAP, EVICTION,
                      True)
    for i in range(0, n_full - KEEP):
        t = k0 + (n_full - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
        _ce_grad_tile(xs, gs, t, t < k1, lse_safe, lo2, a, c, softcap, HAS_SOFTCAP, EVICTION,
                      False)
    # slice_stats' KEEP leading tiles, from registers ([BLOCK_V / VEC, VEC] tiles)
    rr = tl.arange(0, BLOCK_V // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    if KEEP >= 2:
        _ce_grad_store(kept1, gs, k0 + BLOCK_V + rr, rr < (n_full - 1) * BLOCK_V, lse_safe, lo2,
                       a, c, softcap, HAS_SOFTCAP, EVICTION, True)
    if KEEP >= 1:
        _ce_grad_store(kept0, gs, k0 + rr, rr < n_full * BLOCK_V, lse_safe, lo2, a, c, softcap,
                       HAS_SOFTCAP, EVICTION, True)
    tl.debug_barrier()  # the tile stores of this program before the label's store
    gy = a * tl.math.exp2((zy - lse_safe) * LOG2E - lo2) - b - c
    if HAS_SOFTCAP:
        gy = gy * dzy
    tl.store(g_ptr + g_off + col, gy.to(g_ptr.dtype.element_ty), mask=in_slice)


@triton.jit
def _ce_finish_and_store(row, m, s, zy, sumz, labels_ptr, row_scale_ptr, V, ignore_index,
                         smoothing, z_loss, loss_ptr, lse_ptr, coef_ptr,
                         HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr):
    """Finishes a row from its merged statistics (max, sum), stores loss, lse and coef
    (COEF_FIELDS), returns (lse, lse_lo, a, b, c) (shared by the row path and the merge)."""
    label, ignored, bad = label_state(labels_ptr, row, V, ignore_index)
    scale = tl.where(ignored, 0.0, tl.load(row_scale_ptr + row))
    lse, lse_lo = lse_parts(m, s)
    loss, a, b, c = ce_row_finish(lse, lse_lo, zy, sumz, V, smoothing, z_loss, ignored, bad,
                                  scale, HAS_SMOOTHING, HAS_ZLOSS)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)
    out = coef_ptr + row * COEF_FIELDS
    tl.store(out, a)
    tl.store(out + 1, b)
    tl.store(out + 2, c)
    tl.store(out + 3, lse_lo)
    tl.store(out + 4, 1.0)
    return lse, lse_lo, a, b, c


@triton.jit
def ce_fwd_kernel(
    # pointers
    logits_ptr, labels_ptr, row_scale_ptr,
    # sizes, strides, options
    V, stride_row, ignore_index, smoothing, z_loss, softcap,
    # outputs
    loss_ptr, lse_ptr, coef_ptr, grad_ptr,
    # constexprs
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, ALIGN: tl.constexpr,
    PREFETCH: tl.constexpr, KEEP: tl.constexpr,
):
    """Row path, one program per row: loss, lse, gradient coefficients and, if WRITE_GRAD,
    the gradient for a unit cotangent (scaled by row_scale) in the same program. The
    statistics walk is slice_stats' per-thread one (PREFETCH: see there).

    With WRITE_GRAD the statistics pass asks L1/L2 to keep its lines (evict_last) and the
    gradient pass streams (evict_first), so the re-read of the row hits cache more often; the
    row's first KEEP whole tiles stay in registers between the passes (launch.KEEP_VOCAB: H100,
    bf16, N=8192, this kernel at V=151936 1.958 -> 1.811 ms, V=128256 1.558 -> 1.516).
    """
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    label, ignored, bad = label_state(labels_ptr, row, V, ignore_index)
    m, s, _, sumz, zy, kept0, kept1 = slice_stats(
        logits_ptr, row * stride_row, label, 0, V, softcap, 1.0, BLOCK_V, ALIGN, HAS_SOFTCAP,
        HAS_SMOOTHING, True, False, "evict_last" if WRITE_GRAD else "", PREFETCH,
        KEEP if WRITE_GRAD else 0)
    lse, lse_lo, a, b, c = _ce_finish_and_store(row, m, s, zy, sumz, labels_ptr, row_scale_ptr,
                                                V, ignore_index, smoothing, z_loss, loss_ptr,
                                                lse_ptr, coef_ptr, HAS_SMOOTHING, HAS_ZLOSS)
    if WRITE_GRAD:
        _ce_grad_slice(logits_ptr, row * stride_row, grad_ptr, row * V, label, lse, lse_lo, a, b,
                       c, 0, V, softcap, kept0, kept1, BLOCK_V, ALIGN, HAS_SOFTCAP, "evict_first",
                       KEEP)


@triton.jit
def row_exchange(sync_ptr, row, split, max_polls, NUM_SPLITS: tl.constexpr):
    """The statistics exchange of a row split over NUM_SPLITS programs of one launch, after this
    program stored its slice's partials: returns (complete, abandoned).

    `sync_ptr[row]` (int32, zero before the launch) counts arrivals in bits 0-7 and holds an
    abandon bit per split from bit 8. This program arrives with an acq_rel atomic add (the
    release publishes its partials). The last to arrive sees every partial (its acquire) and
    the abandon bits set so far (`abandoned`, a mask of splits; 0 for the others). Any other
    program polls (acquire) until the count is complete; after `max_polls` polls it abandons with a
    compare-and-swap that succeeds only while the count is incomplete, so either the last
    program sees its bit and writes the gradient of that slice too, or the CAS fails because
    the count completed. `complete` is False for an abandoned program (it writes nothing more).
    No program ever waits unboundedly: correct without co-residency, and in Triton's
    interpreter, which runs programs one after another (every program but a row's last
    abandons there)."""
    word = tl.atomic_add(sync_ptr + row, 1, sem="acq_rel") + 1
    last = (word & 255) == NUM_SPLITS
    abandoned = tl.where(last, word >> 8, 0)
    state = tl.where(last, 1, 0)  # 0 waiting, 1 complete, 2 abandoned
    polls = 0
    while state == 0:
        if polls < max_polls:
            word = tl.atomic_add(sync_ptr + row, 0, sem="acquire")
            polls += 1
        else:
            prev = tl.atomic_cas(sync_ptr + row, word, word | (1 << (8 + split)), sem="acq_rel")
            state = tl.where(prev == word, 2, 0)
            word = prev
        state = tl.where((state == 0) & ((word & 255) == NUM_SPLITS), 1, state)
    return state == 1, abandoned


@triton.jit
def ce_split_fused_kernel(
    # pointers
    logits_ptr, labels_ptr, row_scale_ptr, sync_in_ptr,
    # sizes, strides, options
    V, stride_row, ignore_index, smoothing, z_loss, softcap, max_polls,
    # outputs (sync aliases sync_in: zeros)
    loss_ptr, lse_ptr, coef_ptr, grad_ptr, part_ptr, sync_ptr,
    # constexprs
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT_V: tl.constexpr,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr, ALIGN: tl.constexpr, PREFETCH: tl.constexpr, KEEP: tl.constexpr,
):
    """Forward + unit-cotangent gradient in one launch with each row split over NUM_SPLITS
    programs, grid (N * NUM_SPLITS,), a row's programs adjacent (they start together): each
    walks its slice for the statistics (evict_last), stores them in part [N, NUM_SPLITS, 4]
    (as ce_partial_kernel), exchanges them (row_exchange), merges and writes its slice's
    gradient (evict_first, last tile first). The row re-read comes from L2 more often than in
    ce_fwd_kernel's whole-row walk: between a column's two reads the GPU reads about NUM_SPLITS
    times fewer bytes (H100, float32 V=128256: 3.58 -> 3.11 ms; launch.split_fused_config has
    the table). Outputs as ce_fwd_kernel with WRITE_GRAD; part and sync are scratch."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    pid = tl.program_id(0)
    row = (pid // NUM_SPLITS).to(tl.int64)
    split = pid % NUM_SPLITS
    start = split * SPLIT_V
    stop = tl.minimum(start + SPLIT_V, V)
    label, ignored, bad = label_state(labels_ptr, row, V, ignore_index)
    m, s, _, sumz, zy, kept0, kept1 = slice_stats(
        logits_ptr, row * stride_row, label, start, stop, softcap, 1.0, BLOCK_V, ALIGN,
        HAS_SOFTCAP, HAS_SMOOTHING, True, False, "evict_last", PREFETCH, KEEP)
    store_partials(part_ptr, row, split, NUM_SPLITS, m, s, sumz, zy)
    complete, abandoned = row_exchange(sync_ptr, row, split, max_polls, NUM_SPLITS)
    if complete:
        base, valid = load_partials(part_ptr, row, NUM_SPLITS, BLOCK_S)
        m, s = merge_stats(load_field(base, valid, 0, True, ".cg"),
                           load_field(base, valid, 1, False, ".cg"))
        sumz = tl.sum(load_field(base, valid, 2, False, ".cg"), axis=0)
        zy = tl.sum(load_field(base, valid, 3, False, ".cg"), axis=0)
        lse, lse_lo, a, b, c = _ce_finish_and_store(row, m, s, zy, sumz, labels_ptr,
                                                    row_scale_ptr, V, ignore_index, smoothing,
                                                    z_loss, loss_ptr, lse_ptr, coef_ptr,
                                                    HAS_SMOOTHING, HAS_ZLOSS)
        _ce_grad_slice(logits_ptr, row * stride_row, grad_ptr, row * V, label, lse, lse_lo, a,
                       b, c, start, stop, softcap, kept0, kept1, BLOCK_V, ALIGN, HAS_SOFTCAP,
                       "evict_first", KEEP)
        for j in range(NUM_SPLITS):  # abandoned slices, if this program is its row's last
            if ((abandoned >> j) & 1) == 1:
                _ce_grad_slice(logits_ptr, row * stride_row, grad_ptr, row * V, label, lse,
                               lse_lo, a, b, c, j * SPLIT_V, tl.minimum((j + 1) * SPLIT_V, V),
                               softcap, m, m, BLOCK_V, ALIGN, HAS_SOFTCAP, "evict_first", 0)


@triton.jit
def ce_partial_kernel(
    # pointers
    logits_ptr, labels_ptr,
    # sizes, strides, options
    V, stride_row, softcap,
    # outputs: float32 [N, NUM_SPLITS, 4] = (max, sum, sum z, z[y] or 0)
    part_ptr,
    # constexprs
    SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, ALIGN: tl.constexpr,
):
    """Split path, grid (N, NUM_SPLITS): partial statistics of one vocabulary slice."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    start = split * SPLIT_V
    stop = tl.minimum(start + SPLIT_V, V)
    label = tl.load(labels_ptr + row).to(tl.int32)
    m, s, _, sumz, zy, _, _ = slice_stats(logits_ptr, row * stride_row, label, start, stop,
                                          softcap, 1.0, BLOCK_V, ALIGN, HAS_SOFTCAP,
                                          HAS_SMOOTHING, True, False, "", False, 0)
    store_partials(part_ptr, row, split, num_splits, m, s, sumz, zy)


@triton.jit
def ce_merge_kernel(
    # pointers
    part_ptr, labels_ptr, row_scale_ptr,
    # sizes, options
    V, ignore_index, smoothing, z_loss,
    # outputs
    loss_ptr, lse_ptr, coef_ptr,
    # constexprs
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_ZLOSS: tl.constexpr,
):
    """Split path, grid (N,): merges a row's partials into loss, lse and coefficients."""
    row = tl.program_id(0).to(tl.int64)
    base, valid = load_partials(part_ptr, row, NUM_SPLITS, BLOCK_S)  # (max, sum, sum z, z[y])
    m, s = merge_stats(load_field(base, valid, 0, True, ""), load_field(base, valid, 1, False, ""))
    sumz = tl.sum(load_field(base, valid, 2, False, ""), axis=0)
    zy = tl.sum(load_field(base, valid, 3, False, ""), axis=0)
    _ce_finish_and_store(row, m, s, zy, sumz, labels_ptr, row_scale_ptr, V, ignore_index,
                         smoothing, z_loss, loss_ptr, lse_ptr, coef_ptr, HAS_SMOOTHING,
                         HAS_ZLOSS)


@triton.jit
def ce_bwd_kernel(
    # pointers
    logits_ptr, labels_ptr, lse_ptr, coef_ptr,
    # sizes, strides, options
    V, stride_row, softcap,
    # outputs
    grad_ptr,
    # constexprs
    SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid (N, NUM_SPLITS): gradient of one slice from lse and per-row coefficients (a, b, c,
    lse_lo * w, w) (a is NaN for a bad label, as the forward wrote it)."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * SPLIT_V
    stop = tl.minimum(start + SPLIT_V, V)
    label = tl.load(labels_ptr + row).to(tl.int32)
    coef = coef_ptr + row * COEF_FIELDS
    a = tl.load(coef)
    b = tl.load(coef + 1)
    c = tl.load(coef + 2)
    w = tl.load(coef + 4)
    lse_lo = tl.where(w != 0.0, tl.load(coef + 3) / tl.where(w != 0.0, w, 1.0), 0.0)
    _ce_grad_slice(logits_ptr, row * stride_row, grad_ptr, row * V, label,
                   tl.load(lse_ptr + row), lse_lo, a, b, c, start, stop, softcap, a, a, BLOCK_V,
                   ALIGN, HAS_SOFTCAP, "", 0)


@triton.jit
def _scale_tile(in_ptr, out_ptr, offs, mask, cot):
    """out[offs] = in[offs] * cot under mask."""
    g = tl.load(in_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g * cot).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def scale_rows_kernel(
    # pointers
    grad_in_ptr, cot_ptr,
    # sizes
    V,
    # outputs (aliases grad_in on the GPU: rows whose cotangent is exactly 1 are not touched)
    grad_out_ptr,
    # constexprs
    BLOCK_V: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid (N,): grad_out[row] = grad_in[row] * cot[row]; rows with cot == 1 are skipped.
    _online's aligned tile walk."""
    VEC: tl.constexpr = 128 // grad_in_ptr.dtype.element_ty.primitive_bitwidth
    V = hint_multiple(V, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    cot = tl.load(cot_ptr + row)
    if cot != 1.0:
        row_off = row * V
        k0, k1, lo = vector_span(row_off, 0, V, ALIGN, VEC)
        if ALIGN < VEC:
            cols, mask = edge_tile(0, V, lo, k1, VEC)
            _scale_tile(grad_in_ptr + row_off, grad_out_ptr + row_off, cols, mask, cot)
        g_in = span_ptr(grad_in_ptr, row_off, lo, ALIGN, VEC)
        g_out = span_ptr(grad_out_ptr, row_off, lo, ALIGN, VEC)
        for k in range(k0, k1, BLOCK_V):
            t = k + tl.arange(0, BLOCK_V)
            _scale_tile(g_in, g_out, t, t < k1, cot)


# ----------------------------------------------------------------------------- launch plans
def _flags(softcap, smoothing) -> dict:
    return dict(HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=smoothing > 0)


def ce_bwd_launch(n: int, vocab: int, softcap, num_sms: int) -> Launch:
    """x, y, lse, coef -> grad: the gradient from per-row lse and coefficients (a, b, c)."""
    cfg = row_config(n, vocab, num_sms, write_grad=True)
    return Launch(ce_bwd_kernel, (n, cfg.num_splits), ("x", "y", "lse", "coef"),
                  (vocab, vocab, float(softcap or 1.0)), (Buf("grad", (n, vocab), LOGITS),),
                  cfg.num_warps, dict(SPLIT_V=cfg.split_v, BLOCK_V=cfg.block_v, ALIGN=cfg.align,
                                      HAS_SOFTCAP=softcap is not None))


def ce_partials_launch(n: int, vocab: int, softcap, smoothing: float, num_sms: int,
                       splits_from_grad: bool = False) -> Launch:
    """x, y -> part [N, S, 4] = (max, sum exp, sum z, z[y] or 0) per vocabulary slice; y may
    lie outside [0, V) (a label in another device's slice)."""
    cfg = row_config(n, vocab, num_sms, write_grad=splits_from_grad)
    return Launch(ce_partial_kernel, (n, cfg.num_splits), ("x", "y"),
                  (vocab, vocab, float(softcap or 1.0)),
                  (Buf("part", (n, cfg.num_splits, 4), "float32"),), cfg.num_warps,
                  dict(SPLIT_V=cfg.split_v, BLOCK_V=cfg.block_v, ALIGN=cfg.align,
                       **_flags(softcap, smoothing)))


def ce_fwd_plan(n: int, vocab: int, *, ignore_index: int, smoothing: float, z_loss: float,
                softcap, num_sms: int, write_grad: bool, itemsize: int,
                in_place: bool = False) -> Plan:
    """x, y, row_scale -> loss, lse, coef [N, COEF_FIELDS] (and grad, the unit-cotangent
    gradient scaled by row_scale, with write_grad). Many rows: one program per row, the
    gradient written in the same program; with write_grad and rows of long `itemsize`-byte
    logits (launch.split_fused_config), each row's slices in programs of one launch that
    exchange their statistics. Few rows: partials per vocabulary slice, a merge, then the
    gradient pass.

    With write_grad and in_place the gradient overwrites x (aliased): for logits that are dead
    afterwards (linear_cross_entropy's chunks), never a caller's. Safe because every program
    reads a tile before it writes that tile and no tile is read after another program wrote
    it: the row kernel reads its whole row for the statistics, then re-reads tile by tile,
    writing each tile after reading it; the one-launch split kernel writes a slice only after
    every program of its row has read its own (the exchange), and a row's last program writes
    an abandoned slice that nobody else writes; on the few-rows path the partials launch
    (reads only) runs before the gradient launch, which reads and writes its own slice tile
    by tile."""
    cfg = row_config(n, vocab, num_sms, write_grad, launch.keep_tiles(vocab, itemsize, softcap))
    alias = ((0, 3),) if write_grad and in_place else ()
    rows = (Buf("loss", (n,), "float32"), Buf("lse", (n,), "float32"),
            Buf("coef", (n, COEF_FIELDS.value), "float32"))
    results = ("loss", "lse", "coef") + (("grad",) if write_grad else ())
    flags = dict(ALIGN=cfg.align, HAS_ZLOSS=z_loss > 0, **_flags(softcap, smoothing))
    scalars = (vocab, vocab, ignore_index, smoothing, z_loss, float(softcap or 1.0))
    split = split_fused_config(n, vocab, itemsize, num_sms, softcap) if write_grad else None
    if split is not None:
        s = split.num_splits
        return Plan((Launch(
            ce_split_fused_kernel, (n * s,), ("x", "y", "row_scale", Zeros((n,), "int32")),
            scalars + (launch.SPLIT_FUSED_POLLS,),
            rows + (Buf("grad", (n, vocab), LOGITS), Buf("part", (n, s, 4), "float32"),
                    Buf("sync", (n,), "int32")), split.num_warps,
            dict(NUM_SPLITS=s, BLOCK_S=merge_block(s), SPLIT_V=split.split_v,
                 BLOCK_V=split.block_v, **flags, PREFETCH=split.prefetch, KEEP=split.keep),
            aliases=((3, 5),) + alias, maxnreg=split.maxnreg),), results)
    if cfg.num_splits == 1:
        grad = Buf("grad", (n, vocab), LOGITS) if write_grad else placeholder("grad", LOGITS)
        return Plan((Launch(
            ce_fwd_kernel, (n,), ("x", "y", "row_scale"), scalars, rows + (grad,), cfg.num_warps,
            dict(BLOCK_V=cfg.block_v, WRITE_GRAD=write_grad, PREFETCH=cfg.prefetch,
                 KEEP=cfg.keep, **flags),
            aliases=alias),), results)
    part = ce_partials_launch(n, vocab, softcap, smoothing, num_sms, write_grad)
    merge = Launch(ce_merge_kernel, (n,), ("part", "y", "row_scale"),
                   (vocab, ignore_index, smoothing, z_loss), rows, 1,
                   dict(NUM_SPLITS=cfg.num_splits, BLOCK_S=merge_block(cfg.num_splits),
                        HAS_SMOOTHING=smoothing > 0, HAS_ZLOSS=z_loss > 0))
    grad = (ce_bwd_plan(n, vocab, softcap=softcap, num_sms=num_sms,
                        in_place=in_place).launches if write_grad else ())
    return Plan((part, merge) + grad, results)


def ce_bwd_plan(n: int, vocab: int, *, softcap, num_sms: int, in_place: bool = False) -> Plan:
    """x, y, lse, coef -> grad; with in_place the gradient overwrites x (see ce_fwd_plan)."""
    launch = ce_bwd_launch(n, vocab, softcap, num_sms)
    return Plan((launch._replace(aliases=((0, 0),) if in_place else ()),), ("grad",))


def ce_partials_plan(n: int, vocab: int, *, softcap, smoothing: float, num_sms: int) -> Plan:
    return Plan((ce_partials_launch(n, vocab, softcap, smoothing, num_sms),), ("part",))


def scale_rows_plan(n: int, vocab: int, itemsize: int) -> Plan:
    """grad, cot -> grad * cot[:, None], in place (rows with cot == 1 are not touched)."""
    return Plan((Launch(scale_rows_kernel, (n,), ("grad", "cot"), (vocab,),
                        (Buf("scaled", (n, vocab), LOGITS),), 8,
                        scale_rows_constexprs(vocab, itemsize), aliases=((0, 0),),
                        partial_alias=True),), ("scaled",))
