"""Launch heuristics shared by the kernel families: pure functions of shapes and dtype.

No device probing: the caller passes the multiprocessor count it knows (132 on H100/H200).
The measurements behind the constants are in benchmarks/NOTES.md; the one-off tools named
below (benchmarks/keep_ab.py, ce_instructions.py, registers.py, launch_attrs.py) were retired
from the tree and are in git history (benchmarks/NOTES.md says where).
"""
from typing import NamedTuple

import triton

DEFAULT_NUM_SMS = 132  # H100 SXM / H200; used on the CPU interpreter, where there is no device.
# A row path wants about this many programs per SM to keep the memory system busy; below
# that we split each row's vocabulary over several programs (two-level reduction).
PROGRAMS_PER_SM = 2
# Once rows are split, few rows are latency-bound rather than bandwidth-bound: aim for more,
# shorter programs (about one or two tiles each at N = 8..64, V = 128K) so that many loads
# are in flight at once. CUPTI on H100 (bf16, V=128256): logsumexp 3.1 / 3.6 / 8.4 us of
# kernel time at N = 1 / 8 / 64 (benchmarks/results/kernel_time.csv).
SPLIT_PROGRAMS_PER_SM = 8
# A pass that also writes the gradient re-reads each row: 16384-element tiles (32 KiB bf16,
# 64 KiB fp32) with 32 warps keep the most bytes in flight per SM. Measured on H100 at N=8192, V=128256 (2026-11-22): bf16 fused
# fwd+grad 2.07 ms with 16384-element tiles and 32 warps vs 2.14 ms with 8192 and 16 warps; fp32
# 3.56 vs 3.88 ms. Forward-only passes were fastest with 4096-element tiles and 8 warps (bf16
# 0.710 ms = copy floor; fp32 1.370 ms vs 1.351 best).
FWD_TILE_ELEMS = 4096
GRAD_TILE_ELEMS = 16384
# The fused forward + gradient's per-thread statistics walk (_ce_core.slice_stats) prefetches the
# next whole tile of 16-bit logits from this vocabulary up: H100, bf16, N=8192, that kernel
# alone (benchmarks/results/ce_library_h100.txt), ms without / with the prefetch:
#   V        32000        50257        128256       151936       256000
#          0.364/0.466  0.610/0.764  1.792/1.561  2.192/1.960  3.935/3.612
# (copy of the logits 0.351 / 0.549 / 1.393 / 1.653 / 2.778 ms). Rows of one to three whole
# tiles lose with it; between 50257 and 128256 nothing was measured.
PREFETCH_MIN_VOCAB = 65536
# The fused cross-entropy forward + gradient keeps a row's first KEEP whole tiles in registers
# from its statistics walk to its gradient pass (kernels/_ce_core.slice_stats): those tiles are
# the gradient pass's last (it walks backwards), the ones whose re-read missed L2 most, and with
# them out of L2 the rest of the row fits better (132 rows in flight). A 16384-element tile is
# 8 registers a thread for 16-bit logits, 16 for float32; the softcap's arithmetic then spills
# (Triton 3.6 on H100, bf16: 16 bytes at KEEP=1, 154 at 2; results/registers_h100_triton36.txt),
# so softcapped rows keep nothing. With tiles kept the prefetch gains nothing
# and is off. H100, N=8192, the kernel alone (benchmarks/results/ce_keep_h100.txt), ms at
# KEEP = 0 (with the prefetch where it is on) / 1 / 2, and KEEP's best x the logits' copy:
#   bf16  V=32000 0.364/0.482/0.568   50257 0.610/0.785/0.836   100000 1.255/1.247/1.297
#         V=128256 1.558/1.516/1.526 (1.09x)   151936 1.958/1.874/1.811 (1.10x)
#   fp32  V=32000 0.772/0.777/0.970   50257 1.276/1.178/1.415 (1.08x)   100000 2.673/2.502/2.770
# (bf16 at 256000 and float32 from 448 KiB rows run the split kernel below.) Rows of 16-bit
# logits keep one tile from KEEP_VOCAB[2][0] columns and two from KEEP_VOCAB[2][1]; float32
# rows keep one from KEEP_VOCAB[4][0] (two spill).
KEEP_VOCAB = {2: (120_000, 140_000), 4: (40_000, 1 << 62)}


def keep_tiles(vocab: int, itemsize: int, softcap, table=None) -> int:
    """The KEEP constexpr of a fused row walk: the thresholds of `table` (itemsize -> vocab
    levels; KEEP_VOCAB, the cross-entropy kernel's, by default) that `vocab` reaches; none
    with a softcap or an itemsize the table does not list."""
    table = KEEP_VOCAB if table is None else table
    if softcap is not None or itemsize not in table:
        return 0
    return sum(vocab >= v for v in table[itemsize])


# The same for kd_loss / distill_loss's fused row walk (kernels/kd.kd_fwd_kernel), where the
# row takes one exponential per element (kd_loss "full", distill_loss at T = 1 and in the power
# form of KD_POWER_MIN_VOCAB below; distill_loss at other T != 1 takes two and lost) and no
# softcap. H100, bf16, N=8192, K=64, the walk and
# kd_ids_kernel from torch (benchmarks/keep_ab.py, results/kd_keep_h100.txt), ms at KEEP =
# 0 / 1 / 2 (the prefetch on at KEEP = 0):
#   kd_loss       V=32000 0.413/0.645/0.667   50257 0.926/0.883/0.957
#                 V=128256 1.652/1.651/1.621   151936 2.056/1.971/1.904
#   distill T=1   V=128256 1.653/1.762/1.617   151936 2.059/2.154/1.911
#   distill T=2   V=128256 1.884/1.934/1.908
# (one kept tile loses for distill_loss; float32 not measured: nothing kept).
KD_KEEP_VOCAB = {2: (120_000, 120_000)}


def kd_keep_tiles(vocab: int, itemsize: int, softcap, exps: int) -> int:
    """The KEEP constexpr of kd_fwd_kernel's fused row walk for rows taking `exps`
    exponentials per element (see KD_KEEP_VOCAB)."""
    return keep_tiles(vocab, itemsize, softcap, KD_KEEP_VOCAB) if exps == 1 else 0


# distill_loss at an integer temperature T (kernels/kd.POWER_TEMPERATURES) takes the
# cross-entropy's exp(z - m) as the T-th power of the KD term's exp((z - m) / T) (one exp per
# logit and pass instead of two: CE_STATS = T) on rows of at least KD_POWER_MIN_VOCAB[itemsize]
# logits. H100, N=8192, K=64, the walk + ids kernel from torch (benchmarks/keep_ab.py --power,
# results/kd_power_h100.txt), ms two exps at KEEP 0 / power at KEEP 0 / 1 / 2, first form:
#   bf16 T=2  V=32000 0.531 / 0.662 / 0.665 / 0.695    50257 0.861 / 0.935 / 0.983 / 1.000
#             V=65536 1.060 / 0.976 / 0.978 / 0.975    100000 1.579 / 1.447 / 1.411 / 1.432
#             V=128256 1.877 / 1.767 / 1.728 / 1.680   151936 2.374 / 2.161 / 2.049 / 1.955
#   bf16 T=4  V=128256 1.873 / 1.826 / 1.771 / 1.739
#   fp32 T=2  V=50257 1.477 / 1.454 / 1.406 / 1.573    128256 4.071 / 3.662 / 3.502 / 3.589
# The final form also takes the online rescale as a power and factors the gradient, q (w_s +
# w_x q**(T-1)): power at KEEP 1 / 2, bf16 T=2 V=128256 1.729 / 1.682 -> 1.808 / 1.642, 151936
# 2.055 / 1.962 -> 2.232 / 1.928; fp32 128256 3.500 / 3.596 -> 3.488 / 3.587.
# Short 16-bit rows lose: 51-54 registers a thread against 32 (benchmarks/registers.py on the
# H100), so one 1024-thread program per SM instead of two; the long rows' walk has one anyway.
# With the power form a row takes one exp per logit, so kd_keep_tiles keeps its tiles (float32
# keeps none: KD_KEEP_VOCAB has no float32 entry, one tile would win 3-4% here, unmeasured for
# kd_loss).
KD_POWER_MIN_VOCAB = {2: 65536, 4: 50_000}


def kd_power(vocab: int, itemsize: int) -> bool:
    """Whether distill_loss's fused row walk may take the power form (see KD_POWER_MIN_VOCAB;
    itemsize 0: unknown, no)."""
    return itemsize in KD_POWER_MIN_VOCAB and vocab >= KD_POWER_MIN_VOCAB[itemsize]


# kd_fwd_kernel's row walk gathers the logits at the teacher ids for kd_ids_kernel (issued
# before its gradient pass, while the row is in L2) where the rows are 16-byte aligned; on
# unaligned rows the ids kernel gathers them itself. H100, bf16, N=8192, K=64, kd_loss, the
# walk + ids kernel, ms walk gathers / ids kernel gathers (benchmarks/keep_ab.py --gather,
# results/kd_gather_h100.txt): V=50257 0.927 / 0.670 (unaligned), 50256 0.637 / 0.650, 32000
# 0.413 / 0.425, 65536 0.902 / 0.902, 128256 1.619 / 1.643. (distill_loss at V=50257: 0.934 /
# 0.921, slow either way: not understood.)
def kd_walk_gathers(vocab: int, itemsize: int) -> bool:
    """Whether kd_fwd_kernel's row walk gathers the logits at the teacher ids (rows of
    `vocab` `itemsize`-byte logits start 16-byte aligned; itemsize 0: unknown, no)."""
    return itemsize > 0 and vocab_align(vocab) * itemsize >= 16


# The fused forward + gradient over many rows splits each row over programs of one launch that
# exchange their statistics (kernels/cross_entropy.ce_split_fused_kernel) for rows of at least
# SPLIT_FUSED_MIN_ROW_BYTES: between a column's statistics read and its gradient re-read the
# GPU then reads fewer bytes, so the re-read hits L2 more often. Slices of about
# SPLIT_FUSED_SLICE_BYTES in 8192-element tiles (16 warps). H100, N=8192, the kernels alone
# (benchmarks/ce_instructions.py --split; results/ce_split_h100.txt, ce_split2_h100.txt),
# ms whole-row walk -> split, and x the logits' copy:
#   float32 V=128256 3.576 -> 3.107 (1.29x -> 1.12x)   float32 V=151936 4.41 -> 3.71 (1.34x -> 1.13x)
#   float32 V=256000 7.89 -> 6.43 (1.43x -> 1.16x)     bf16 V=256000 3.60 -> 3.41 (1.30x -> 1.23x)
# Shorter rows lose with every split tried (bf16 V=128256 and 151936, 256-297 KiB rows: 1.56 ->
# 1.61-1.83 and 1.96 -> 1.97-2.20 ms; float32 V=50257 1.27 -> 1.35 ms); 128 KiB slices lost
# against 64-96 KiB ones everywhere (float32 V=128256 4.07 ms).
SPLIT_FUSED_MIN_ROW_BYTES = 448 * 1024
SPLIT_FUSED_SLICE_BYTES = 96 * 1024
SPLIT_FUSED_TILE_ELEMS = 8192
SPLIT_FUSED_MAX_SPLITS = 16  # row_exchange's abandon bits
# Whole tiles of its slice a program of the split kernel keeps in registers (as KEEP_VOCAB), per
# itemsize. H100, N=8192, the kernel alone, KEEP = 0 (with the prefetch) / 1 / 2, ms
# (benchmarks/ce_instructions.py --split-keep, results/ce_split_keep_h100.txt): bf16 V=256000
# 3.538 / 3.337 / 4.658; float32 V=128256 3.095 / 4.468 / 4.753, V=256000 6.368 / 8.920 / 9.247
# (57 to 125 registers a thread against 40-64 without: fewer programs per SM).
SPLIT_FUSED_KEEP = {2: 1}
# With a tile kept, smaller tiles and slices, per itemsize: (tile elements, slice bytes,
# register cap). bf16 V=256000, tile x programs a row (--split-sweep,
# results/ce_split_sweep_h100.txt): from torch 4096 x 16 took 3.116 ms against 3.339 for
# 8192 x 6. From JAX it took 3.915 ms: jaxlib compiles jax-triton's PTX itself, to 60
# registers a thread where Triton's ptxas (PyTorch) makes 48 from the same PTX, so 4 programs
# of 256 threads per SM instead of 5 (CUPTI launch records, benchmarks/launch_attrs.py,
# results/launch_attrs_h100.txt). Capped at 48 (PTX .maxnreg) both take 3.14 ms (3.10-3.14).
# Unaligned rows (V=255999) get 48 from jaxlib uncapped and are slower capped (3.31 -> 3.64
# ms, both frameworks; 3.79 with 8192 x 6): the cap is for 16-byte aligned rows only.
SPLIT_FUSED_KEPT = {2: (4096, 32 * 1024, 48)}
# kd_bwd_kernel of distill_loss (the cross-entropy term on) at 16 or 32 warps and 16-byte
# aligned rows: jaxlib's compiler gives it more than 32 registers a thread, so fewer programs an
# SM than kd_loss's (32 registers). Capped at 32 (2 x H200, vocabulary-sharded, N=16384,
# V=128256 bf16, K=64, value_and_grad, time_jax, benchmarks/NOTES.md): distill_loss 2.18 ->
# 1.81 ms (kd_loss 1.75 either way); caps of 40 / 48 were slower (2.20 / 2.20). At 16 warps
# (H100, the kernel alone, see BWD_SLICE_MIN_TILE): [32768, 32064] 1.80 -> 1.54 ms, [8192,
# 8064] 0.195 -> 0.144; at 8 warps the cap changes nothing (1.648 / 1.647).
KD_BWD_DISTILL_MAXNREG = 32
# Polls of a program waiting for its row's other programs before it hands its slice to the
# row's last program (kernels/cross_entropy.row_exchange).
SPLIT_FUSED_POLLS = 4096
# Warps per row of kernels/kd.kd_ids_kernel (the work at the teacher's ids after the fused row
# walk of kd_loss / distill_loss): 1 / 2 / 4 took 68 / 68 / 62 us at K=64 and 7.0 / 7.9 / 12.8
# at K=1 (H100, bf16, N=8192, V=128256).
KD_IDS_WARPS = 2

# implementation=None on a CUDA GPU: up to this many rows (per op family) the XLA twin runs
# instead of our kernels, per custom-call target of our launches (_triton_jax.call_target).
# Decided by what a user sees: the host wall clock of a jitted program, not device time.
#
# Reductions ("ffi"): 8. H100, bf16, V=128256, 2026-11-25, host wall per call in a jitted
# program of 64 calls, 200 back-to-back dispatches (benchmarks/NOTES.md, "Few rows"): at N=1
# our kernel took 11.07 us (logsumexp) and 13.98 us (token_logprobs) against 3.3-5.0 and
# 2.5-2.6 us for the XLA formula; at N=8 even a per-site counter launcher (since removed, 6 us
# faster than the path we ship at N=1) only tied XLA (4.48 vs 4.92, 4.50 vs 4.07 us), so the
# path we ship loses there too. At N=64 Triton wins with that launcher (10.1 vs 15.8 us of
# wall) and without it by device time (10.1 vs 16.4 us); N=9-64 without the launcher has no
# host-wall measurement yet. In a realistic decode step (8 rows after an [8, 4096] x
# [4096, 128256] matmul) the choice is invisible (351.8 vs 357.0 us).
#
# Losses ("ffi"): 0. Device time per call (GPU span of a program of 64 calls / 64, CUPTI, us,
# Triton / XLA twin / XLA formula, benchmarks/results/fewrows_h100_2026-11-24_ffi.csv):
#   N                   1              8              64
#   cross_entropy       5.3/4.3/5.4    9.2/8.3/11.0   14.7/17.9/17.0
#   cross_entropy grad  6.8/8.4/9.2    11.1/13.8/15.5 27.1/34.9/60.6
# the gradient is faster on Triton at every N and a call does not know at dispatch whether it
# will be differentiated; no host-wall measurement says otherwise yet.
#
# Through jax-triton's legacy custom call ("legacy": older jaxlibs, or JFL_TRITON_CALL=legacy)
# every launch ends XLA's command buffer and is launched from the host on its own; these
# thresholds came from the wall clock of such programs (fewrows_h100_2026-11-24.csv: the
# twin's program was faster up to these row counts).
AUTO_XLA_MAX_ROWS = {"ffi": {"loss": 0, "reductions": 8},
                     "legacy": {"loss": 64, "reductions": 8}}


def auto_prefers_xla(n_rows: int, vocab: int, family: str = "loss", call: str = "ffi") -> bool:
    """Whether implementation=None should run the XLA twin rather than Triton on a GPU, for an
    op of `family` ("loss": cross_entropy, kd_loss, distill_loss; "reductions": logsumexp,
    entropy, token_logprobs) whose kernels launch through custom call `call` ("ffi" or
    "legacy")."""
    return n_rows <= AUTO_XLA_MAX_ROWS[call][family]


class RowConfig(NamedTuple):
    block_v: int  # elements per tile, a power of two
    num_warps: int
    num_splits: int  # programs per row; 1 = fused single-program row path
    split_v: int  # vocabulary slice per program, a multiple of block_v
    align: int  # largest power of two <= 16 dividing vocab: the ALIGN constexpr of hint_multiple
    prefetch: bool = False  # the PREFETCH constexpr of a fused row pass that writes the gradient
    keep: int = 0  # the KEEP constexpr of a fused row pass that writes the gradient
    maxnreg: int | None = None  # a register cap for the launch (plan.Launch.maxnreg)


def row_config(n_rows: int, vocab: int, num_sms: int = DEFAULT_NUM_SMS,
               write_grad: bool = False, keep: int = 0,
               grad_tile: int | None = None) -> RowConfig:
    """Tile, warps and split count for a row-wise online-softmax pass over `[n_rows, vocab]`
    (the measured optimum is in elements for both bf16 and fp32, so the dtype is no input).

    `write_grad`: the pass also writes a `[n_rows, vocab]` gradient (bigger tiles pay off).
    `keep`: tiles the fused row walk keeps in registers (keep_tiles; the cross-entropy kernel
    only), which turns the prefetch off; ignored on the split path.
    `grad_tile`: the tile of a pass that writes the gradient, many rows (GRAD_TILE_ELEMS if
    None; bwd_slice_tile for the gradient of a vocabulary slice).
    """
    if n_rows >= PROGRAMS_PER_SM * num_sms:
        block_v, num_warps = _tile(vocab, (grad_tile or GRAD_TILE_ELEMS) if write_grad
                                   else FWD_TILE_ELEMS)
        keep = keep if write_grad else 0
        return RowConfig(block_v, num_warps, 1, triton.cdiv(vocab, block_v) * block_v,
                         vocab_align(vocab), write_grad and vocab >= PREFETCH_MIN_VOCAB and not keep,
                         keep)
    # Few rows: split each row over programs; short latency-bound programs want small tiles.
    block_v, num_warps = _tile(vocab, FWD_TILE_ELEMS)
    n_tiles = triton.cdiv(vocab, block_v)
    splits = min(n_tiles, triton.cdiv(SPLIT_PROGRAMS_PER_SM * num_sms, max(n_rows, 1)))
    split_v = triton.cdiv(n_tiles, splits) * block_v
    return RowConfig(block_v, num_warps, triton.cdiv(vocab, split_v), split_v,
                     vocab_align(vocab))


def split_fused_config(n_rows: int, vocab: int, itemsize: int,
                       num_sms: int = DEFAULT_NUM_SMS, softcap=None) -> RowConfig | None:
    """The config of the one-launch split forward + gradient (num_splits programs a row,
    split_v columns each), or None where the whole-row walk of row_config is faster (few rows,
    or rows shorter than SPLIT_FUSED_MIN_ROW_BYTES of `itemsize`-byte logits)."""
    if n_rows < PROGRAMS_PER_SM * num_sms or vocab * itemsize < SPLIT_FUSED_MIN_ROW_BYTES:
        return None
    keep = 0 if softcap is not None else SPLIT_FUSED_KEEP.get(itemsize, 0)
    align = vocab_align(vocab)
    tile, slice_bytes, maxnreg = SPLIT_FUSED_TILE_ELEMS, SPLIT_FUSED_SLICE_BYTES, None
    if keep and itemsize in SPLIT_FUSED_KEPT:
        tile, slice_bytes, maxnreg = SPLIT_FUSED_KEPT[itemsize]
        if align * itemsize < 16:  # unaligned rows: no cap (see SPLIT_FUSED_KEPT)
            maxnreg = None
    block_v, num_warps = _tile(vocab, tile)
    n_tiles = triton.cdiv(vocab, block_v)
    per_slice = max(1, slice_bytes // (block_v * itemsize),
                    triton.cdiv(n_tiles, SPLIT_FUSED_MAX_SPLITS))
    split_v = per_slice * block_v
    return RowConfig(block_v, num_warps, triton.cdiv(vocab, split_v), split_v, align,
                     vocab >= PREFETCH_MIN_VOCAB and not keep, keep, maxnreg)


def _tile(vocab: int, max_tile: int) -> tuple[int, int]:
    """(tile elements, warps): one warp per 512 elements (16 values per thread, 2-4 16-byte
    vector loads), 4 to 32 warps."""
    block_v = max(16, min(triton.next_power_of_2(max(vocab, 1)), max_tile))
    return block_v, min(32, max(4, block_v // 512))


# The tile of kd_bwd_kernel on many rows (one program a row: a device's vocabulary slice, a
# block of the LM head's vocabulary walk): a quarter of the row rounded up to a power of two,
# within [BWD_SLICE_MIN_TILE, GRAD_TILE_ELEMS]. H100, bf16, K=64, T=1, the kernel alone from
# JAX (time_jax), ms for kd_loss / distill_loss (the latter capped at KD_BWD_DISTILL_MAXNREG),
# tiles 16384 / 8192 / 4096 / 2048:
#   [32768, 32064] (a 4-way slice of V=128256): 1.69 / 1.53 / 1.65 / 1.69 and 1.76 / 1.54 /
#     1.65 / 1.68 (uncapped at 8192: 1.80);
#   [16384, 64128] (2-way): 1.48 / 1.55 / 1.59 / 1.60 and 1.49 / 1.55 / 1.59 / 1.59;
#   [8192, 8064] (a block of the LM head's walk; 16384 and 8192 are one tile there): 0.131 /
#     0.131 / 0.115 / 0.126 and 0.144 / 0.144 / 0.120 / 0.122 (uncapped at 8192: 0.195).
# Whole rows of V=128256 keep GRAD_TILE_ELEMS. Measured for bf16 at T=1 only (float32 and
# other temperatures follow the same rule unmeasured, as row_config's tiles are in elements).
BWD_SLICE_MIN_TILE = 4096


def bwd_slice_tile(vocab: int) -> int:
    """kd_bwd_kernel's tile for rows of `vocab` columns (see BWD_SLICE_MIN_TILE)."""
    quarter = triton.next_power_of_2(max(vocab, 1)) // 4
    return min(GRAD_TILE_ELEMS, max(BWD_SLICE_MIN_TILE, quarter))


def vocab_align(*sizes: int) -> int:
    """Largest power of two <= 16 that divides every size (row length or stride)."""
    align = 16
    while align > 1 and any(size % align for size in sizes):
        align //= 2
    return align


def merge_block(num_splits: int) -> int:
    """BLOCK_S of a merge kernel: the split count rounded up to a power of two (at least 2)."""
    return max(2, triton.next_power_of_2(num_splits))


def scale_rows_constexprs(vocab: int, itemsize: int) -> dict:
    """Constexprs of scale_rows_kernel: 16 KiB tiles (a pure streaming pass), vector hint."""
    return dict(BLOCK_V=min(triton.next_power_of_2(vocab), 16384 // itemsize),
                ALIGN=vocab_align(vocab))
