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

# The default chunk's logits stay within this many bytes (the knob between memory and speed;
# `chunk_size=` overrides it per call): 128 MiB is 512 rows at V=128256 in bf16, whose logits
# (0.12 GiB) plus the bf16 dH + dW (1.05 GiB) keep N=8192, D=4096 within 1.2 GiB beyond inputs.
CHUNK_BUDGET_BYTES = 128 << 20
# ... but a chunk of 16-bit logits keeps at least this many rows per byte of dW's itemsize:
# 512 rows for a bf16 dW ("input" accumulation), 1024 for a float32 one (the dW update stays
# compute-bound, see above). float32 logits run float32 matmuls (far fewer flops per second:
# no floor).
MIN_ROWS_PER_DW_BYTE = 256


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
