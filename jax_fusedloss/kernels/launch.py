"""Launch heuristics shared by the kernel families: pure functions of shapes and dtype.

No device probing: the caller passes the multiprocessor count it knows (132 on H100/H200).
"""
from typing import NamedTuple

import triton

DEFAULT_NUM_SMS = 132  # H100 SXM / H200; used on the CPU interpreter, where there is no device.
# 16 KiB per tile load (8192 bf16 or 4096 fp32): enough bytes in flight per program to cover
# HBM latency with ~2 programs per SM, small enough that per-program registers do not spill.
MAX_TILE_BYTES = 16384
# A row path wants about this many programs per SM to keep the memory system busy; below
# that we split each row's vocabulary over several programs (two-level reduction).
PROGRAMS_PER_SM = 2


class RowConfig(NamedTuple):
    block_v: int  # elements per tile, a power of two
    num_warps: int
    num_splits: int  # programs per row; 1 = fused single-program row path
    split_v: int  # vocabulary slice per program, a multiple of block_v


def row_config(n_rows: int, vocab: int, itemsize: int, num_sms: int = DEFAULT_NUM_SMS,
               max_tile_bytes: int = MAX_TILE_BYTES) -> RowConfig:
    """Tile, warps and split count for a row-wise online-softmax pass over `[n_rows, vocab]`."""
    block_v = min(triton.next_power_of_2(max(vocab, 1)), max_tile_bytes // itemsize)
    block_v = max(block_v, 16)
    # One warp per 512 elements of a tile (16 bf16 or fp32 values per thread, 2-4 16-byte
    # vector loads), between 4 and 16 warps.
    num_warps = min(16, max(4, block_v // 512))
    n_tiles = triton.cdiv(vocab, block_v)
    target_programs = PROGRAMS_PER_SM * num_sms
    if n_rows >= target_programs or n_tiles == 1:
        return RowConfig(block_v, num_warps, 1, n_tiles * block_v)
    splits = min(n_tiles, triton.cdiv(target_programs, max(n_rows, 1)))
    split_v = triton.cdiv(n_tiles, splits) * block_v
    return RowConfig(block_v, num_warps, triton.cdiv(vocab, split_v), split_v)
