"""Split-vocabulary log-sum-exp, entropy and token log-probs: forward, merge, backward.

Per row, with z = x * inv_temp, lse = logsumexp(z), p = softmax(z) and label y:
    lse,    H = lse - sum_j p_j z_j = log(s) - u / s,    logp = z_y - lse,
where, relative to the row max m, s = sum_j exp(z_j - m) and u = sum_j (z_j - m) exp(z_j - m).
Keeping u relative to the running max (instead of sum z exp(z - m)) avoids the cancellation
of lse - E[z] when the logits are large. A slice of the row gives partials (m, s, u, z_y or 0);
partials merge with identity (-inf, 0, 0, 0). The forward also writes lse_lo, the low part of
the log-sum-exp (_online.lse_parts: lse + lse_lo is exact to a few ulp of a small number), and
log p = (z - lse) - lse_lo in logp and the backward, so neither loses |lse| * 2**-24.

Gradient for per-row cotangents (g_lse, g_H, g_logp):
    dx_j = inv_temp * (p_j * (g_lse - g_logp - g_H * H) - g_H * p_j log p_j + g_logp [j == y]).

Conventions: a row whose logits are all -inf has lse = -inf, H = NaN, logp = NaN and a zero
gradient. A row with a NaN logit has lse, H and logp NaN and an all-NaN gradient row; one
with a +inf logit and no NaN has lse = +inf (as jax.nn.logsumexp), H and logp NaN and an
all-NaN gradient row. A label outside [0, V) is never used as an address: its logp is NaN and its
gradient row is NaN only where that row's g_logp is nonzero.

Kernels take (inputs..., scalars..., outputs..., CONSTEXPRS). Imports triton only.
"""
import triton
import triton.language as tl

from jax_fusedloss.kernels._online import (edge_tile, hint_multiple, load_field, load_partials,
                                           load_tile, lse_parts, safe_max, span_ptr,
                                           store_partials, tile_update, vector_span)
from jax_fusedloss.kernels.launch import RowConfig, merge_block, row_config
from jax_fusedloss.kernels.plan import LOGITS, Buf, Launch, Plan, Zeros, placeholder


@triton.jit
def _rescale(m, s, u, m_to):
    """Re-expresses (s, u), taken relative to max m, relative to m_to (a finite max, or 0)."""
    alpha = tl.exp(m - m_to)
    du = tl.where(m == float("-inf"), 0.0, m - m_to) * s
    return s * alpha, (u + du) * alpha


@triton.jit
def _tile_update_ent(m, s, u, z):
    """One online step for (max, sum exp(z - max), sum (z - max) exp(z - max)) over a 1-D
    tile z (scalar partials)."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    ms = safe_max(m_new)
    s, u = _rescale(m, s, u, ms)
    d = z - ms
    e = tl.exp(d)
    s += tl.sum(e, axis=0)
    u += tl.sum(tl.where(e > 0.0, d, 0.0) * e, axis=0)
    return m_new, s, u


@triton.jit
def _red_tile(m, s, u, ptr, offs, mask, inv_temp, HAS_ENTROPY: tl.constexpr):
    """Folds the 1-D tile at ptr + offs (masked lanes -inf) into the partials (m, s, u)."""
    z, _ = load_tile(ptr, offs, mask, inv_temp, 1.0, False)
    if HAS_ENTROPY:
        m, s, u = _tile_update_ent(m, s, u, z)
    else:
        m, s = tile_update(m, s, z)
    return m, s, u


@triton.jit
def _red_thread_tile(m, s, u, ptr, offs, mask, inv_temp, HAS_ENTROPY: tl.constexpr):
    """Folds a [T, VEC] tile (each row one thread's 16-byte vector; masked lanes -inf) into
    per-thread partials (m, s, u) of shape [T]: no block reduction, no barrier."""
    z, _ = load_tile(ptr, offs, mask, inv_temp, 1.0, False)
    m_new = tl.maximum(m, tl.max(z, axis=1))
    ms = safe_max(m_new)
    d = z - ms[:, None]
    e = tl.exp(d)
    if HAS_ENTROPY:
        s, u = _rescale(m, s, u, ms)
        u += tl.sum(tl.where(e > 0.0, d, 0.0) * e, axis=1)
    else:
        s = s * tl.exp(m - ms)
    return m_new, s + tl.sum(e, axis=1), u


@triton.jit
def _merge_partials(m_i, s_i, u_i):
    """Merges a vector of partials (m, s, u) (identity (-inf, 0, 0)) into one."""
    m = tl.max(m_i, axis=0)
    s_i, u_i = _rescale(m_i, s_i, u_i, safe_max(m))
    return m, tl.sum(s_i, axis=0), tl.sum(u_i, axis=0)


@triton.jit
def _red_slice_stats(x_ptr, row_off, label, start, stop, inv_temp, BLOCK_V: tl.constexpr,
                     ALIGN: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_LABEL: tl.constexpr):
    """Partials (m, s, u, z[label] if label in [start, stop) else 0) of one slice of the row at
    x_ptr + row_off (_online's aligned tile walk): the edge tile with scalar partials, the span
    as [BLOCK_V / VEC, VEC] tiles with per-thread partials (as _ce_core.slice_stats does)
    merged once at the end."""
    VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
    T: tl.constexpr = BLOCK_V // VEC
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    u = tl.zeros([], tl.float32)
    row_ptr = x_ptr + row_off
    k0, k1, lo = vector_span(row_off, start, stop, ALIGN, VEC)
    if ALIGN < VEC:
        cols, mask = edge_tile(start, stop, lo, k1, VEC)
        m, s, u = _red_tile(m, s, u, row_ptr, cols, mask, inv_temp, HAS_ENTROPY)
    first = tl.arange(0, T) == 0  # the edge tile's partials in thread row 0
    m = tl.where(first, m, float("-inf"))
    s = tl.where(first, s, 0.0)
    u = tl.where(first, u, 0.0)
    base = span_ptr(x_ptr, row_off, lo, ALIGN, VEC)
    rr = tl.arange(0, T)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    for k in range(k0, k1, BLOCK_V):
        t = k + rr
        m, s, u = _red_thread_tile(m, s, u, base, t, t < k1, inv_temp, HAS_ENTROPY)
    m, s, u = _merge_partials(m, s, u)
    zy = tl.zeros([], tl.float32)
    if HAS_LABEL:
        in_slice = (label >= start) & (label < stop)
        zl, _ = load_tile(row_ptr, tl.where(in_slice, label, start), in_slice, inv_temp, 1.0,
                          False)
        zy = tl.where(in_slice, zl, 0.0)
    return m, s, u, zy


@triton.jit
def _red_finish(row, m, s, u, zy, label, V, lse_ptr, ent_ptr, logp_ptr, lo_ptr,
                HAS_ENTROPY: tl.constexpr, HAS_LABEL: tl.constexpr):
    """Writes a row's lse, the low part lse_lo of its log-sum-exp (_online.lse_parts, for the
    backward) and, if asked, entropy and label log-prob from its merged partials."""
    lse, lse_lo = lse_parts(m, s)
    tl.store(lse_ptr + row, lse)
    tl.store(lo_ptr + row, lse_lo)
    finite = (lse > float("-inf")) & (lse < float("inf"))  # False for NaN too
    if HAS_ENTROPY:
        s_safe = tl.where(finite, s, 1.0)
        ent = tl.where(finite, tl.log(s_safe) - u / s_safe, float("nan"))
        tl.store(ent_ptr + row, ent)
    if HAS_LABEL:
        bad = (label < 0) | (label >= V)
        tl.store(logp_ptr + row, tl.where(bad | ~finite, float("nan"), (zy - lse) - lse_lo))


@triton.jit
def _red_merge_row(row, part_ptr, labels_ptr, V, lse_ptr, ent_ptr, logp_ptr, lo_ptr,
                   NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                   HAS_LABEL: tl.constexpr):
    """Merges a row's NUM_SPLITS partials and finishes the row (the partials were written by
    other programs of the same launch: .cg loads, never a stale L1 line)."""
    base, valid = load_partials(part_ptr, row, NUM_SPLITS, BLOCK_S)  # (m, s, u, z[y])
    m, s, u = _merge_partials(load_field(base, valid, 0, True, ".cg"),
                              load_field(base, valid, 1, False, ".cg"),
                              load_field(base, valid, 2, False, ".cg"))
    label = -1
    zy = tl.zeros([], tl.float32)
    if HAS_LABEL:
        label = tl.load(labels_ptr + row).to(tl.int32)
        zy = tl.sum(load_field(base, valid, 3, False, ".cg"), axis=0)
    _red_finish(row, m, s, u, zy, label, V, lse_ptr, ent_ptr, logp_ptr, lo_ptr, HAS_ENTROPY,
                HAS_LABEL)


@triton.jit
def red_fwd_kernel(
    # pointers (sync_in: int32 zeros [N], read only through its alias sync)
    logits_ptr, labels_ptr, sync_in_ptr,
    # sizes, strides, options
    V, stride_row, inv_temp,
    # outputs: partials float32 [N, NUM_SPLITS, 4] = (m, s, u, z[y] or 0) unless FINISH;
    # per-row lse, entropy, log-prob, lse_lo if FINISH or MERGE (unused ones may be 1-element
    # dummies); sync: the arrival counts of MERGE (aliases sync_in)
    part_ptr, lse_ptr, ent_ptr, logp_ptr, lo_ptr, sync_ptr,
    # constexprs
    SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    HAS_LABEL: tl.constexpr, FINISH: tl.constexpr, ALIGN: tl.constexpr,
    MERGE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Grid (N, NUM_SPLITS): the partials of one vocabulary slice; with MERGE the last program
    of a row to finish (an acq_rel arrival count per row: the others' partials are visible to
    it) also merges the row's partials and writes its outputs, so few rows take one launch,
    not partials + merge; with FINISH (row path, grid (N,)) the whole row in one program and
    its outputs directly."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    if FINISH:
        start = 0
        stop = V
    else:
        start = tl.program_id(1) * SPLIT_V
        stop = tl.minimum(start + SPLIT_V, V)
    label = -1
    if HAS_LABEL:
        label = tl.load(labels_ptr + row).to(tl.int32)
    m, s, u, zy = _red_slice_stats(logits_ptr, row * stride_row, label, start, stop, inv_temp,
                                   BLOCK_V, ALIGN, HAS_ENTROPY, HAS_LABEL)
    if FINISH:
        _red_finish(row, m, s, u, zy, label, V, lse_ptr, ent_ptr, logp_ptr, lo_ptr, HAS_ENTROPY,
                    HAS_LABEL)
    else:
        store_partials(part_ptr, row, tl.program_id(1), tl.num_programs(1), m, s, u, zy)
        if MERGE:
            if tl.atomic_add(sync_ptr + row, 1, sem="acq_rel") == NUM_SPLITS - 1:
                _red_merge_row(row, part_ptr, labels_ptr, V, lse_ptr, ent_ptr, logp_ptr, lo_ptr,
                               NUM_SPLITS, BLOCK_S, HAS_ENTROPY, HAS_LABEL)


@triton.jit
def _red_grad_tile(x_ptr, g_ptr, offs, mask, cols, lse_safe, lse_lo, a, b, c, label, poison,
                   inv_temp, HAS_ENTROPY: tl.constexpr, HAS_LABEL: tl.constexpr):
    """Writes the gradient of one tile: x at x_ptr + offs, gradient at g_ptr + offs, row
    columns cols."""
    z, _ = load_tile(x_ptr, offs, mask, inv_temp, 1.0, False)
    logp = (z - lse_safe) - lse_lo
    p = tl.exp(logp)
    g = a * p
    if HAS_ENTROPY:
        g -= c * tl.where(p > 0.0, logp, 0.0) * p
    if HAS_LABEL:
        g = tl.where(cols == label, g + b, g)
        g = tl.where(poison, float("nan"), g)
    tl.store(g_ptr + offs, (g * inv_temp).to(g_ptr.dtype.element_ty), mask=mask)


@triton.jit
def red_bwd_kernel(
    # pointers: cot is float32 [N, 3] = (g_lse, g_entropy, g_logp); lse_lo the forward's (or
    # zeros); ent unused without HAS_ENTROPY, labels unused without HAS_LABEL
    logits_ptr, labels_ptr, lse_ptr, lo_ptr, ent_ptr, cot_ptr,
    # sizes, strides, options
    V, stride_row, inv_temp,
    # outputs
    grad_ptr,
    # constexprs
    SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    HAS_LABEL: tl.constexpr, ALIGN: tl.constexpr,
):
    """Grid (N, NUM_SPLITS): the gradient of one slice for the combined cotangents; log p is
    (z - lse) - lse_lo, accurate whatever |lse|."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * SPLIT_V
    stop = tl.minimum(start + SPLIT_V, V)
    lse = tl.load(lse_ptr + row)
    live = lse != float("-inf")  # an all -inf row gets a zero gradient
    lse_safe = tl.where(live, lse, 0.0)
    lse_lo = tl.load(lo_ptr + row)
    a = tl.load(cot_ptr + row * 3)
    c = tl.zeros([], tl.float32)
    if HAS_ENTROPY:
        c = tl.where(live, tl.load(cot_ptr + row * 3 + 1), 0.0)
        a -= c * tl.where(live, tl.load(ent_ptr + row), 0.0)
    label = -1
    b = tl.zeros([], tl.float32)
    poison = False
    if HAS_LABEL:
        label = tl.load(labels_ptr + row).to(tl.int32)
        b = tl.where(live, tl.load(cot_ptr + row * 3 + 2), 0.0)
        a -= b
        poison = ((label < 0) | (label >= V)) & (b != 0.0)
    a = tl.where(live, a, 0.0)
    a = tl.where(lse == float("inf"), float("nan"), a)  # NaN lse: NaN p does it
    VEC: tl.constexpr = 128 // logits_ptr.dtype.element_ty.primitive_bitwidth
    row_off = row * stride_row
    k0, k1, lo = vector_span(row_off, start, stop, ALIGN, VEC)
    if ALIGN < VEC:
        cols, mask = edge_tile(start, stop, lo, k1, VEC)
        _red_grad_tile(logits_ptr + row_off, grad_ptr + row * V, cols, mask, cols, lse_safe,
                       lse_lo, a, b, c, label, poison, inv_temp, HAS_ENTROPY, HAS_LABEL)
    xs = span_ptr(logits_ptr, row_off, lo, ALIGN, VEC)
    gs = span_ptr(grad_ptr, row * V, lo, ALIGN, VEC)
    for k in range(k0, k1, BLOCK_V):
        t = k + tl.arange(0, BLOCK_V)
        _red_grad_tile(xs, gs, t, t < k1, lo + t, lse_safe, lse_lo, a, b, c, label, poison,
                       inv_temp, HAS_ENTROPY, HAS_LABEL)


def reduction_config(n_rows: int, vocab: int, num_sms: int,
                     write_grad: bool = False) -> RowConfig:
    """Launch configuration: the shared row/split heuristic (row path when num_splits == 1);
    `write_grad` for the backward, which writes a gradient as it reads the logits."""
    return row_config(n_rows, vocab, num_sms, write_grad)


# ----------------------------------------------------------------------------- launch plans
def _label_input(has_label: bool):
    return "y" if has_label else Zeros((1,), "int32")


def _split_launch(n, vocab, inv_temp, entropy, has_label, cfg, outs=None) -> Launch:
    """The split forward: partials only, or with `outs` (the row outputs) merged by each row's
    last program in the same launch."""
    merge = outs is not None
    outs = outs or tuple(placeholder(f"unused{i}") for i in range(4))
    sync = Zeros((n,) if merge else (1,), "int32")
    return Launch(red_fwd_kernel, (n, cfg.num_splits), ("x", _label_input(has_label), sync),
                  (vocab, vocab, inv_temp),
                  (Buf("part", (n, cfg.num_splits, 4), "float32"), *outs,
                   Buf("sync", sync.shape, "int32")), cfg.num_warps,
                  dict(SPLIT_V=cfg.split_v, BLOCK_V=cfg.block_v, FINISH=False, ALIGN=cfg.align,
                       HAS_ENTROPY=entropy, HAS_LABEL=has_label, MERGE=merge,
                       NUM_SPLITS=cfg.num_splits, BLOCK_S=merge_block(cfg.num_splits)),
                  aliases=((2, 5),))


def red_fwd_plan(n: int, vocab: int, *, inv_temp: float, entropy: bool, has_label: bool,
                 num_sms: int) -> Plan:
    """x[, y] -> lse, ent, logp, lse_lo (ent and logp are 1-element placeholders unless asked
    for; lse_lo is the low part of the log-sum-exp, _online.lse_parts, for red_bwd_plan).
    Many rows: one program per row; few rows: partials per vocabulary slice, merged by each
    row's last program in the same launch (instead of a second, merge launch; the two forms
    measured within run-to-run spread of each other on H100 through the legacy custom call,
    benchmarks/results/fewrows_h100_2026-11-24_onelaunch.csv)."""
    cfg = reduction_config(n, vocab, num_sms)
    flags = dict(HAS_ENTROPY=entropy, HAS_LABEL=has_label)
    outs = (Buf("lse", (n,), "float32"),
            Buf("ent", (n,), "float32") if entropy else placeholder("ent"),
            Buf("logp", (n,), "float32") if has_label else placeholder("logp"),
            Buf("lse_lo", (n,), "float32"))
    results = ("lse", "ent", "logp", "lse_lo")
    if cfg.num_splits == 1:
        return Plan((Launch(red_fwd_kernel, (n,), ("x", _label_input(has_label),
                                                   Zeros((1,), "int32")),
                            (vocab, vocab, inv_temp),
                            (placeholder("part"),) + outs + (placeholder("sync", "int32"),),
                            cfg.num_warps,
                            dict(SPLIT_V=cfg.block_v, BLOCK_V=cfg.block_v, FINISH=True,
                                 ALIGN=cfg.align, MERGE=False, NUM_SPLITS=1, BLOCK_S=2,
                                 **flags)),), results)
    return Plan((_split_launch(n, vocab, inv_temp, entropy, has_label, cfg, outs),), results)


def red_partials_plan(n: int, vocab: int, *, inv_temp: float, entropy: bool, has_label: bool,
                      num_sms: int) -> Plan:
    """x[, y] -> part [N, S, 4] = (m, s, u, z[y] or 0) per vocabulary slice; y may lie outside
    [0, V) (a label in another device's slice)."""
    cfg = reduction_config(n, vocab, num_sms)
    return Plan((_split_launch(n, vocab, inv_temp, entropy, has_label, cfg),), ("part",))


def red_bwd_plan(n: int, vocab: int, *, inv_temp: float, entropy: bool, has_label: bool,
                 num_sms: int) -> Plan:
    """x, lse, lse_lo, ent, cot [N, 3][, y] -> grad (ent is read only with entropy; lse_lo
    zeros where unknown, at the cost of |lse| * 2**-24 in every softmax entry)."""
    cfg = reduction_config(n, vocab, num_sms, write_grad=True)
    return Plan((Launch(red_bwd_kernel, (n, cfg.num_splits),
                        ("x", _label_input(has_label), "lse", "lse_lo", "ent", "cot"),
                        (vocab, vocab, inv_temp), (Buf("grad", (n, vocab), LOGITS),),
                        cfg.num_warps,
                        dict(SPLIT_V=cfg.split_v, BLOCK_V=cfg.block_v, ALIGN=cfg.align,
                             HAS_ENTROPY=entropy, HAS_LABEL=has_label)),), ("grad",))
