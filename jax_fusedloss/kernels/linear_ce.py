"""Fused linear cross-entropy's launch heuristic: tokens per chunk. The op has no kernel of its
own (the frameworks' matmuls plus the cross-entropy kernels), so this file holds only the chunk
size, framework-free so that jax_fusedloss and torch_ref share it. Imports nothing.

Per chunk of C tokens: logits `[C, V]` (the cross-entropy kernel overwrites them with their
gradient in place), `dH_chunk = g W^T` and `dW += h_chunk^T g`. Two costs pull C apart:
- memory: the chunk's logits, `C * V * itemsize` bytes, live beside dH and dW;
- time: each chunk's dW update reads and writes all of dW (a GEMM with beta = 1): `2 * D * V * s`
  bytes (s: dW's itemsize) for `2 * D * C * V` flops, C / s flops per byte. An H100 does about
  700 TFLOP/s (bf16) against 3 TB/s, about 240 flops per byte, so below C ~ 240 * s the update
  is memory-bound and every extra chunk adds ~`2 * D * V * s / 3e12` s (0.7 ms for a bf16
  dW at D=4096, V=128256).
"""

# The default chunk's logits stay within this many bytes (`chunk_size=` overrides it per call):
# 128 MiB is 512 rows at V=128256 in bf16 ...
CHUNK_BUDGET_BYTES = 128 << 20
# ... but a chunk of 16-bit logits keeps at least this many rows per byte of dW's itemsize, so
# the dW update stays compute-bound: 1024 rows for a bf16 dW ("input" accumulation), 2048 for a
# float32 one. Measured on H100, bf16, N=8192, D=4096, V=128256, fwd+bwd, x the three bare
# matmuls / peak GiB beyond the inputs (benchmarks/results/linear_ce_h100.csv):
#   "input":   C=256 1.89x 1.15 | 512 1.32x 1.21 | 1024 1.16x 1.35 | 2048 1.10x 1.61
#   "float32": C=256 2.80x 3.05 | 512 1.72x 3.05 | 1024 1.29x 3.06 | 2048 1.16x 3.08
# (the bound above, ~240 flops per byte, was optimistic: at C=512 the bf16 update is still
# memory-bound in practice). float32 logits run float32 matmuls (far fewer flops per second:
# no floor).
MIN_ROWS_PER_DW_BYTE = 512


def chunk_rows(n: int, vocab: int, itemsize: int, dw_itemsize: int) -> int:
    """Default tokens per chunk: the largest power of two C with `C * vocab * itemsize <=
    CHUNK_BUDGET_BYTES`, raised to `MIN_ROWS_PER_DW_BYTE * dw_itemsize` for 16-bit logits, at
    most n (n itself when all n tokens fit). Powers of two divide the usual token counts (no
    ragged tail) and keep the matmuls' M dimension tile-aligned.

    `itemsize`: the logits' (hidden/weight dtype); `dw_itemsize`: dW's accumulator's (2 for
    accumulation="input" of a bf16 weight, 4 for "float32").
    """
    rows = max(1, CHUNK_BUDGET_BYTES // (vocab * itemsize))
    if itemsize == 2:
        rows = max(rows, MIN_ROWS_PER_DW_BYTE * dw_itemsize)
    if n <= rows:
        return max(n, 1)
    chunk = 1
    while chunk * 2 <= rows:
        chunk *= 2
    return chunk
