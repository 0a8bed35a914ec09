"""The LM head's launch heuristics: tokens per chunk, vocabulary columns per block. The head
has no kernel of its own (the frameworks' matmuls plus the logits ops' kernels), so this file
holds only the walk sizes, framework-free so that jax_fusedloss and torch_ref share them.
Imports only the standard library.

Per chunk of C tokens: logits `[C, V]` (the cross-entropy kernel overwrites them with their
gradient in place), `dH_chunk = g W^T` and `dW += h_chunk^T g`. Two costs pull C apart:
- memory: the chunk's logits, `C * V * itemsize` bytes, live beside dH and dW;
- time: each chunk's dW update reads and writes all of dW (a GEMM with beta = 1): `2 * D * V * s`
  bytes (s: dW's itemsize) for `2 * D * C * V` flops, C / s flops per byte. An H100 does about
  700 TFLOP/s (bf16) against 3 TB/s, about 240 flops per byte, so below C ~ 240 * s the update
  is memory-bound and every extra chunk adds ~`2 * D * V * s / 3e12` s (0.7 ms for a bf16
  dW at D=4096, V=128256).
"""

import math

# The default chunk's logits stay within this many bytes (`chunk_size=` overrides it per call):
# 128 MiB is 512 rows at V=128256 in bf16 ...
CHUNK_BUDGET_BYTES = 128 << 20
# ... but for 16-bit logits a chunk keeps at least this many rows in "fast" and "lean" (fewer,
# longer chunks are faster: "fast" updates its float32 dW per chunk, and lean's chunk GEMM runs
# at M = C), and in "low_precision" fills LOW_PRECISION_CHUNK_BYTES (each chunk's beta=1 GEMM
# reads and writes all of dW, so fewer chunks are faster; the chunk's logits are its memory).
# Measured on H100, bf16, N=8192, D=4096, V=128256 ([V, D] weight), fwd+bwd, x the three bare
# matmuls / XLA temporaries beyond inputs and gradients (benchmarks/results/lm_head_h100.csv,
# NOTES.md):
#   "low_precision": C=512 1.23x 0.17 GiB | 768 1.08x 0.24 GiB | 1024 1.10-1.14x 0.31 GiB;
#                    since dH's chunk is written in bf16 (2026-11-27, one process): 512 1.22x
#                    0.17 | 640 1.14x 0.19 | 704 1.19x 0.21 | 768 1.14x 0.23 | 832 1.24x 0.24 |
#                    896 1.17x 0.26 (cuBLAS's kernels favour multiples of 128 rows)
#   "fast":          C=2048 1.13x 2.04 GiB | 4096 1.08-1.12x 2.08 GiB (the float32 dW dominates)
#   "lean":          C=768 1.49x 0.30 GiB | 1024 1.50x 0.22 GiB (its backward's blocks hold C * V
#                    logits with the weight's and dW's blocks: `vocab_block`); 1024 1.52x 0.12
#                    GiB since each dW block is written into dW in place (2026-11-27); 1024
#                    1.45x 0.13 GiB with blocks sized for whole GEMM waves (`wave_cols`)
# float32 logits run float32 matmuls (far fewer flops per second): no floor.
MIN_ROWS_16BIT = {"fast": 4096, "lean": 1024}
LOW_PRECISION_CHUNK_BYTES = 192 << 20
# "low_precision"'s chunks are a multiple of this many rows (a GEMM tile of M).
ROW_ALIGN = 128


def chunk_rows(n: int, vocab: int, itemsize: int, mode: str) -> int:
    """Default tokens per chunk, at most n (n itself when all n tokens fit): the largest power
    of two C with `C * vocab * itemsize <= CHUNK_BUDGET_BYTES`, for 16-bit logits raised to
    `MIN_ROWS_16BIT[mode]` ("fast", "lean") or, in "low_precision", to the largest multiple of
    ROW_ALIGN rows within LOW_PRECISION_CHUNK_BYTES (768 at V=128256 in bf16). Powers of two
    divide the usual token counts (no ragged tail); every choice keeps the matmuls' M
    dimension tile-aligned. `itemsize`: the logits' (the hidden/weight dtype's)."""
    row_bytes = vocab * itemsize
    rows = max(1, CHUNK_BUDGET_BYTES // row_bytes)
    aligned = False
    if itemsize == 2 and mode == "low_precision":
        fill = LOW_PRECISION_CHUNK_BYTES // row_bytes // ROW_ALIGN * ROW_ALIGN
        aligned = fill > rows
        rows = max(rows, fill)
    elif itemsize == 2:
        rows = max(rows, MIN_ROWS_16BIT[mode])
    if n <= rows:
        return max(n, 1)
    if aligned:
        return rows
    chunk = 1
    while chunk * 2 <= rows:
        chunk *= 2
    return chunk


# The lean backward's vocabulary blocks (see vocab_block): at least this many columns per
# block when all tokens fit (below it the block's dW GEMM is thin and dH's float32 read-modify-
# write, N * D * 8 bytes per block, repeats too often) ...
MIN_BLOCK_COLS = 4096
# ... and the columns are a multiple of this (a GEMM tile).
BLOCK_COL_ALIGN = 128


def budget_rows(vocab: int, itemsize: int) -> int:
    """Rows of `vocab` logits within CHUNK_BUDGET_BYTES (the lean backward's default block
    holds `budget_rows * vocab` logits: 512 * V at V=128256 in bf16)."""
    return max(1, CHUNK_BUDGET_BYTES // (vocab * itemsize))


def vocab_block(n: int, vocab: int, chunk: int, waves: tuple[int, int, int, int] | None = None
                ) -> tuple[int, int]:
    """(columns per block, tokens per row chunk) of the lean backward's vocabulary walk, whose
    logits block holds at most `chunk * vocab` elements, as the token walk's chunk does.

    Two costs, for the same logits budget B = chunk * vocab: dH's float32 accumulator is read
    and written once per block (N * D * 8 bytes, V / cols times) and, when the tokens do not
    fit one block, each block's float32 dW accumulator once per row chunk (D * cols * 8 bytes,
    N / rows times). All tokens at once (rows = N) when that leaves at least MIN_BLOCK_COLS
    columns (N=8192, V=128256, chunk 512: 7936 columns, 17 blocks); else square blocks
    (rows ~ cols ~ sqrt(B)), which minimise the sum of the two.

    `waves` = (multiprocessors, D, tile rows, tile columns) of the persistent GEMMs that run
    each block over all tokens (kernels/head_gemm: the block's gradient `[N, cols]`, its dW
    `[cols, D]`): the columns are then `wave_cols`' choice near the budget's."""
    budget = max(chunk, 1) * vocab
    cols = budget // max(n, 1)
    if cols >= vocab:
        return vocab, max(n, 1)
    if cols >= MIN_BLOCK_COLS:
        if waves is not None:
            return wave_cols(n, vocab, cols, *waves), max(n, 1)
        return cols - cols % BLOCK_COL_ALIGN, max(n, 1)
    side = math.isqrt(budget)
    cols = min(vocab, max(BLOCK_COL_ALIGN, side - side % BLOCK_COL_ALIGN))
    return cols, max(1, min(n, budget // cols))


# wave_cols looks this far past the budget's columns (the block's logits, its memory, grow
# with it) ...
WAVE_STRETCH = 1.125


def wave_cols(n: int, vocab: int, cols: int, sms: int, d: int, bm: int, bn: int) -> int:
    """Columns per block (a multiple of the tile's `bn`, at least MIN_BLOCK_COLS, at most
    `cols * WAVE_STRETCH`) for which the walk's persistent GEMMs (one program per
    multiprocessor, static tile order) take the least time: a block's gradient is
    `cdiv(n, bm) * cdiv(cols, bn)` tiles of K = d, its dW `cdiv(cols, bm) * cdiv(d, bn)`
    tiles of K = n, and each launch takes as long as its most loaded program (whole waves of
    `sms` tiles). Ties: fewer blocks, then more columns. H100 (132 SMs), N=8192, D=4096,
    V=128256: 8448 columns (both GEMMs 16 and 8 full waves a block) where the budget's 8064
    ran 15.5 and 7.6 waves, i.e. 16 and 8 with the last one about half idle."""
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    def cost(c: int) -> tuple[int, int, int]:
        total = 0
        for size, count in ((c, vocab // c), (vocab % c, 1)):
            if size and count:
                grad = cdiv(cdiv(n, bm) * cdiv(size, bn), sms) * d
                dw = cdiv(cdiv(size, bm) * cdiv(d, bn), sms) * n
                total += count * (grad + dw)
        return total, cdiv(vocab, c), -c

    top = max(bn, int(cols * WAVE_STRETCH) // bn * bn)
    bottom = max(bn, cdiv(MIN_BLOCK_COLS, bn) * bn)
    return min(range(bottom, top + 1, bn), key=cost, default=top)
