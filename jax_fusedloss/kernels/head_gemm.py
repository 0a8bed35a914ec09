"""The LM head's logits GEMM with the softmax statistics in its epilogue: `[N, V]` logits are
never written. For the hidden-state forms' statistics-only forward (rollout scoring:
`linear_token_logprobs` without a gradient), where a cuBLAS GEMM writes the logits and a row
pass reads them back (2.5 GB each way at N=8192, V=151936 in bf16).

`head_stats_kernel` is a persistent GEMM (one program per SM walks output tiles) that loads
its operands through TMA descriptors built on the device (`tl.make_tensor_descriptor`, which
needs Triton's global scratch: `scratch_bytes`; jax_fusedloss/_triton_jax.py passes it). Each
`[BM, BN]` tile of logits `z = round(h W + b) / T` (rounded once to the inputs' dtype before
the temperature, as cuBLAS's bias epilogue rounds the matmul walk's chunk logits on an H100;
XLA on a CPU, and XLA's own Triton GEMM on a GPU at a few rows, round h W before adding b)
leaves four float32 per row in
`part [N, T, 4]` (T = cdiv(V, BN) tiles): the tile's max m, `s = sum exp(z - m)`,
`u = sum (z - m) exp(z - m)` (with ENTROPY, else 0) and `z[label]` where the tile holds the
label (else 0). Merging the T partials (`_xla.reductions.merge_stats`, a sum for the label's
logit) gives what the row kernels' statistics give. Labels outside the tile's columns (another
vocabulary slice's, or -1) are never used as addresses.

TMA needs 16-byte aligned rows: `tma_ok` says which shapes qualify (D a multiple of 8 16-bit
elements, and V too for a `[D, V]` weight); others take the matmul + row-kernel path.
Imports triton and the standard library only.
"""
import triton
import triton.language as tl

from jax_fusedloss.kernels._online import LOG2E, safe_max

# Output tile, K step, tile grouping along M (L2 reuse of the weight), warps and stages:
# H100, N=8192, D=4096, bf16: 128x256x64, 8 warps, 3 stages ran the [8192, 7936] block at
# 0.96-0.99x the time of XLA's cuBLAS GEMM with this epilogue (benchmarks/NOTES.md).
GPU_CONFIG = dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3)
# The interpreter (CPU tests): small tiles, few programs.
CPU_CONFIG = dict(BM=16, BN=32, BK=32, GROUP_M=2, num_warps=4, num_stages=2)
CPU_PROGRAMS = 3
FIELDS = 4  # m, s, u, z[label]
# Global scratch a program: three 128-byte TMA descriptors (Triton's metadata says 256-384).
SCRATCH_BYTES = 512
# Tokens a launch at most, so that `part` stays within this many bytes.
PART_BUDGET_BYTES = 128 << 20


def tma_ok(d: int, vocab: int, layout: str, itemsize: int) -> bool:
    """Whether TMA can address `hidden [N, d]` and the weight (rows of 16-byte multiples)."""
    rows = (d,) if layout == "vd" else (d, vocab)
    return itemsize == 2 and all(r * itemsize % 16 == 0 for r in rows)


def config(gpu: bool) -> dict:
    return dict(GPU_CONFIG if gpu else CPU_CONFIG)


def part_tiles(vocab: int, cfg: dict) -> int:
    return triton.cdiv(vocab, cfg["BN"])


def chunk_rows(n: int, vocab: int, cfg: dict) -> int:
    """Tokens a launch: all n when `part` fits PART_BUDGET_BYTES, else a multiple of BM."""
    per_row = part_tiles(vocab, cfg) * FIELDS * 4
    rows = max(cfg["BM"], PART_BUDGET_BYTES // per_row // cfg["BM"] * cfg["BM"])
    return min(n, rows)


def tiles(n: int, cols: int, cfg: dict) -> int:
    """Output tiles of an [n, cols] GEMM."""
    return triton.cdiv(n, cfg["BM"]) * triton.cdiv(cols, cfg["BN"])


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile index -> (row tile, column tile), GROUP_M row tiles at a time down each column."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % size_m), (tile % per_group) // size_m


@triton.jit
def _descriptors(h_ptr, w_ptr, M, V, K, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, DV: tl.constexpr):
    """TMA descriptors of hidden [M, K] and the weight ([K, V] with DV, else [V, K])."""
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, K], strides=[K, 1],
                                       block_shape=[BM, BK])
    if DV:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[K, V], strides=[V, 1],
                                           block_shape=[BK, BN])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[V, K], strides=[K, 1],
                                           block_shape=[BN, BK])
    return h_desc, w_desc


@triton.jit
def _logits_tile(h_desc, w_desc, r0, c0, K, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, DV: tl.constexpr, F32_DOT: tl.constexpr):
    """float32 h[r0:r0+BM] @ W[:, c0:c0+BN] over all K (zeros where TMA reads past an edge)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        a = h_desc.load([r0, k * BK])
        if DV:
            b = w_desc.load([k * BK, c0])
        else:
            b = w_desc.load([c0, k * BK]).T
        if F32_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _round(x, dt: tl.constexpr, BY_HAND: tl.constexpr):
    """float32 x rounded to dt (to nearest even), as float32. BY_HAND: bfloat16 by integer
    arithmetic (Triton's interpreter converts float32 to bfloat16 by truncation); NaN and
    infinities pass unchanged."""
    if BY_HAND and dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        up = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, up.to(tl.float32, bitcast=True), x)
    return x.to(dt).to(tl.float32)


@triton.jit
def head_stats_kernel(
    # hidden [M, K], weight [K, N] (DV) or [N, K], bias [N] (HAS_BIAS), labels [M] int32
    h_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, inv_temp,
    part_ptr,  # out: [M, cdiv(N, BN), FIELDS] float32
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, DV: tl.constexpr, HAS_BIAS: tl.constexpr, ENTROPY: tl.constexpr,
    F32_DOT: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """Grid (PROGRAMS,): program p takes output tiles p, p + PROGRAMS, ... (module doc).
    F32_DOT (the interpreter, whose tl.dot multiplies 16-bit floats as their bit patterns):
    the operands upcast first, bfloat16 rounded by hand. FLATTEN and WARP_SPECIALIZE (GPU):
    the tile loop flattened into the K loop (the next tile's loads issued during this tile's
    epilogue) and warp-specialised; Triton 3.6 compiles the latter without adding warps here
    (jax-triton 0.3.1 launches the num_warps asked for: tests/sm90_compile.py checks it).
    H100, N=8192, D=4096, V=151936: 14.75 ms flattened, 14.57 also warp-specialised, 14.88
    neither (torch.mm 14.00)."""
    dt = h_ptr.dtype.element_ty
    h_desc, w_desc = _descriptors(h_ptr, w_ptr, M, N, K, BM, BN, BK, DV)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        r0 = pid_m * BM
        c0 = pid_n * BN
        acc = _logits_tile(h_desc, w_desc, r0, c0, K, BM, BN, BK, DV, F32_DOT)
        rows = r0 + tl.arange(0, BM)
        cols = c0 + tl.arange(0, BN)
        if HAS_BIAS:  # (bias in dt) added before the one rounding, as cuBLAS's bias epilogue
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        z = _round(acc, dt, F32_DOT)  # the logits in their dtype, as XLA's matmul writes them
        z = tl.where((cols < N)[None, :], z * inv_temp, float("-inf"))
        m = tl.max(z, axis=1)
        d = z - safe_max(m)[:, None]
        e = tl.math.exp2(d * LOG2E)
        s = tl.sum(e, axis=1)
        u = tl.zeros_like(s)
        if ENTROPY:
            u = tl.sum(tl.where(e > 0.0, e * d, 0.0), axis=1)
        y = tl.load(y_ptr + rows, mask=rows < M, other=-1)
        own = (cols[None, :] == y[:, None]) & (cols < N)[None, :]  # y: maybe another slice's
        zy = tl.sum(tl.where(own, z, 0.0), axis=1)
        out = part_ptr + (rows.to(tl.int64) * tiles_n + pid_n) * 4
        live = rows < M
        tl.store(out, m, mask=live)
        tl.store(out + 1, s, mask=live)
        tl.store(out + 2, u, mask=live)
        tl.store(out + 3, zy, mask=live)


# ----------------------------------------------------------------------------- the gradient
# Per-row coefficients of head_grad_kernel, float32 [N, GRAD_FIELDS] = (lse, lse_lo, A, B, L,
# C): with t = (z - lse) - lse_lo (z tempered), p = exp(t), the gradient of the logit is
#     g = p * (A + B * t) + L * [column == label] + C,
# which holds cross-entropy's (A = a, B = 0, L = -b, C = -c: kernels/cross_entropy.py) and
# the token log-probs' with the entropy (kernels/reductions.py, times 1/T).
GRAD_FIELDS = 6


def grad_tma_store(cols: int, itemsize: int) -> bool:
    """Whether a block of `cols` gradient columns can be stored through TMA (16-byte rows)."""
    return cols * itemsize % 16 == 0


@triton.jit
def head_grad_kernel(
    # hidden [M, K]; weight [K, V] (DV) or [V, K]; bias [V] (HAS_BIAS); labels [M] int32
    # relative to the block (any value: only compared); coef [M, GRAD_FIELDS]; col0 [1] int32,
    # the block's first column
    h_ptr, w_ptr, b_ptr, y_ptr, coef_ptr, col0_ptr,
    M, NB, K, V, inv_temp,
    g_ptr,  # out: [M, NB] in h's dtype, the gradient of the block's logits
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, DV: tl.constexpr, HAS_BIAS: tl.constexpr, LOG_TERM: tl.constexpr,
    TMA_STORE: tl.constexpr, F32_DOT: tl.constexpr, FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Grid (PROGRAMS,): the gradient of the logits of weight columns [col0, col0 + NB) (a
    block of the lean backward's vocabulary walk), the weight read in place, the logits
    recomputed in registers (rounded as head_stats_kernel's) and never written.
    LOG_TERM: B is not all 0. TMA_STORE: g's rows are 16-byte multiples (else plain stores)."""
    dt = h_ptr.dtype.element_ty
    col0 = tl.load(col0_ptr)
    h_desc, w_desc = _descriptors(h_ptr, w_ptr, M, V, K, BM, BN, BK, DV)
    if TMA_STORE:
        g_desc = tl.make_tensor_descriptor(g_ptr, shape=[M, NB], strides=[NB, 1],
                                           block_shape=[BM, BN])
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(NB, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        r0 = pid_m * BM
        c0 = pid_n * BN
        acc = _logits_tile(h_desc, w_desc, r0, col0 + c0, K, BM, BN, BK, DV, F32_DOT)
        rows = r0 + tl.arange(0, BM)
        cols = c0 + tl.arange(0, BN)
        live = rows < M
        inside = cols < NB
        if HAS_BIAS:
            acc += tl.load(b_ptr + col0 + cols, mask=inside, other=0.0).to(tl.float32)[None, :]
        z = _round(acc, dt, F32_DOT) * inv_temp
        coef = coef_ptr + rows.to(tl.int64) * 6
        lse = tl.load(coef, mask=live, other=0.0)
        lse_lo = tl.load(coef + 1, mask=live, other=0.0)
        A = tl.load(coef + 2, mask=live, other=0.0)
        L = tl.load(coef + 4, mask=live, other=0.0)
        C = tl.load(coef + 5, mask=live, other=0.0)
        t = (z - lse[:, None]) - lse_lo[:, None]
        p = tl.math.exp2(t * LOG2E)
        if LOG_TERM:
            B = tl.load(coef + 3, mask=live, other=0.0)
            g = p * (A[:, None] + B[:, None] * t)
        else:
            g = p * A[:, None]
        y = tl.load(y_ptr + rows, mask=live, other=-1)
        g = g + tl.where(cols[None, :] == y[:, None], L[:, None], 0.0) + C[:, None]
        if TMA_STORE:
            g_desc.store([r0, c0], g.to(dt))
        else:
            out = g_ptr + rows.to(tl.int64)[:, None] * NB + cols[None, :]
            tl.store(out, g.to(dt), mask=live[:, None] & inside[None, :])


# ----------------------------------------------------------------------------- dW in place
def dw_ok(cols: int, itemsize: int) -> bool:
    """Whether head_dw_kernel can take a block of `cols` gradient columns: TMA addresses the
    block's gradient `[M, cols]` (16-byte rows); the weight's shapes are `tma_ok`'s."""
    return itemsize == 2 and cols * itemsize % 16 == 0


@triton.jit
def head_dw_kernel(
    # g [M, NB] (the block's logit gradient), hidden [M, K], col0 [1] int32 (the block's
    # first weight column), dw_in (the weight's gradient, aliased to dw_ptr)
    g_ptr, h_ptr, col0_ptr, dw_in_ptr,
    M, NB, K, V,
    dw_ptr,  # out: dW [V, K] (else [K, V] with DV); only the block's columns are written
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr, DV: tl.constexpr, F32_DOT: tl.constexpr, FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Grid (PROGRAMS,): a vocabulary block of the weight's gradient, `g^T h` `[NB, K]` summed
    over all M tokens in float32 and rounded once, stored through TMA straight into dW's rows
    col0.. (or, with DV, transposed into its columns col0..): no block buffer to copy in. The
    store's descriptor ends at the block's last column, so tiles past it write nothing. Both
    layouts run the same main loop (g^T from shared memory, h as is): H100, a [8192 tokens,
    8192 columns] block at D=4096 took 0.73 ms this way against XLA's dot 0.75, and 0.79 with
    h^T g for DV (benchmarks/NOTES.md, twenty-first session). (dw_in_ptr is dw_ptr's buffer,
    unused: jax-triton passes an aliased input too.)"""
    dt = g_ptr.dtype.element_ty
    col0 = tl.load(col0_ptr)
    g_desc = tl.make_tensor_descriptor(g_ptr, shape=[M, NB], strides=[NB, 1],
                                       block_shape=[BK, BM])
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, K], strides=[K, 1],
                                       block_shape=[BK, BN])
    if DV:
        out_desc = tl.make_tensor_descriptor(dw_ptr, shape=[K, col0 + NB], strides=[V, 1],
                                             block_shape=[BN, BM])
    else:
        out_desc = tl.make_tensor_descriptor(dw_ptr, shape=[col0 + NB, K], strides=[K, 1],
                                             block_shape=[BM, BN])
    tiles_m = tl.cdiv(NB, BM)
    tiles_n = tl.cdiv(K, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        r0 = pid_m * BM
        c0 = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(M, BK)):
            a = g_desc.load([k * BK, r0]).T
            b = h_desc.load([k * BK, c0])
            if F32_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        out = _round(acc, dt, F32_DOT).to(dt)
        if DV:
            out_desc.store([c0, col0 + r0], out.T)
        else:
            out_desc.store([col0 + r0, c0], out)
