"""Prototype (issue 11 item 1): cross-entropy forward + gradient reading each logits row once.

Each row is split over P co-operating programs. Register variant: a program loads its slice of
the row into registers once, publishes the slice statistics (max, sum exp, sum z, z[label] or
0) to a float32 scratch `part[N, P, 4]`, arrives on the row's counter (atomic add, acq_rel: the
release publishes the statistics), issues the load of its next row's slice, spins until the
counter reaches P (atomic add of 0, acquire), merges the P partials and writes the gradient
g = a * exp(z - lse) - b * [j == y] - c of its slice from the registers. Rows are taken
persistently: group g handles rows g, g + n_groups, ...

REREAD variant (`block` / Reread): the slice is not kept across the wait. Pass 1 walks it in
tiles of BLOCK columns (evict_last) for the statistics, the program publishes and arrives,
spins with a few scalars live, then pass 2 reads the slice again (evict_first, last tile
first) and writes the gradient. The in-flight working set is grid x slice bytes (528
programs x 16-32 KiB: 8-17 MB), well inside an H100's 50 MB L2, so the second read should
come from L2, not HBM; with low registers several CTAs share an SM, so some stream while
others wait for their row's exchange. Optionally the next row's first tile is loaded before
the spin (prefetch).

Deadlock freedom: groups are formed from the order in which programs *start* (each takes a
ticket from a zeroed counter: group = ticket // P, member = ticket % P), not from program ids.
All members of a group other than the newest one have started and stay resident, so a group
waits only for programs that have yet to start, and those start as earlier groups finish:
the kernel cannot deadlock as long as P programs fit on the GPU at once, whatever the grid
size (the default grid is the co-resident capacity anyway). A watchdog bounds the spinning:
each program has a budget of `max_spin` polls over its lifetime; a row whose partials did not
all arrive in time gets NaN lse, loss and gradient and adds 1 to a timeout count, so a failure
of co-residency shows as a failed check, never as a hang.

Numerics follow ce_fwd_kernel (reduction "none", unit cotangent, row scale 1, 0 for ignored
rows; a label outside [0, V) that is not ignore_index gives a NaN loss and gradient row; the
log-sum-exp carried as lse + lse_lo). Label smoothing and z-loss are supported; logit softcap
is not (prototype). Measurements live in benchmarks/coop_ce_measure.py.

    python -m benchmarks.coop_ce --check                  # GPU: correctness (~3 min)
    python -m benchmarks.coop_ce --bench --out coop.csv   # GPU: REREAD sweep (~3 min)
    python -m benchmarks.coop_ce --ptx                    # CPU ok: sm_90 PTX/ptxas summary
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import NamedTuple

import triton
import triton.language as tl

from jax_fusedloss.kernels._online import LOG2E, hint_multiple, lse_parts, merge_stats, tile_update
from jax_fusedloss.kernels._ce_core import ce_row_finish, label_state
from jax_fusedloss.kernels.launch import merge_block, vocab_align

MAX_SPIN = 1 << 20  # polls per program before the watchdog gives up (~0.3-1 s of spinning)


@triton.jit
def _load_partial(base, valid, FIELD: tl.constexpr, IS_MAX: tl.constexpr):
    """Field FIELD of a row's P partials, read from L2 (.cg: never a stale L1 line)."""
    return tl.load(base + FIELD, mask=valid, other=float("-inf") if IS_MAX else 0.0,
                   cache_modifier=".cg")


@triton.jit
def _load_slice(logits_ptr, row, N, stride_row, cols, mask, EVICTION: tl.constexpr):
    """Columns `cols` of `row` in the logits' dtype (zeros for a row >= N). The row test is
    a column bound (a power of two, so vector loads survive): the interpreter rejects a mask
    combined with a scalar bool."""
    in_rows = cols < tl.where(row < N, 1 << 30, 0)
    return tl.load(logits_ptr + row * stride_row + cols, mask=mask & in_rows, other=0.0,
                   eviction_policy=EVICTION)


@triton.jit
def _tile_stats(x, cols, mask, label, m, s, sumz, zy, HAS_SMOOTHING: tl.constexpr):
    """Folds a tile x (logits dtype, masked lanes ignored) into a slice's statistics: max m,
    sum s of exp(z - safe_max(m)), sum of z (HAS_SMOOTHING) and z[label] (0 if not here)."""
    z = tl.where(mask, x.to(tl.float32), float("-inf"))
    m, s = tile_update(m, s, z)
    if HAS_SMOOTHING:
        sumz += tl.sum(tl.where(mask, z, 0.0), axis=0)
    zy += tl.sum(tl.where(mask & (cols == label), z, 0.0), axis=0)
    return m, s, sumz, zy


@triton.jit
def _arrive(part_ptr, sync_ptr, row, member, m, s, sumz, zy, P: tl.constexpr,
            HAS_SMOOTHING: tl.constexpr):
    """Publishes a member's partial (max, sum, sum z, z[y]) of `row` and arrives on the row's
    counter (acq_rel: the release publishes the partial); returns the members arrived."""
    out = part_ptr + (row * P + member) * 4
    tl.store(out, m)
    tl.store(out + 1, s)
    if HAS_SMOOTHING:
        tl.store(out + 2, sumz)
    tl.store(out + 3, zy)
    return tl.atomic_add(sync_ptr + row, 1, sem="acq_rel") + 1


@triton.jit
def _wait(sync_ptr, row, N, arrived, budget, P: tl.constexpr):
    """Polls the row's counter (acquire) until all P members arrived or the program's polling
    budget runs out; a timeout adds 1 to the count at sync[N + 1]. Returns (arrived, budget)."""
    while (arrived < P) & (budget > 0):
        arrived = tl.atomic_add(sync_ptr + row, 0, sem="acquire")
        budget -= 1
    if arrived < P:
        tl.atomic_add(sync_ptr + N + 1, 1, sem="relaxed")
    return arrived, budget


@triton.jit
def _finish_row(part_ptr, row, member, arrived, label, ignored, bad, V, smoothing, z_loss,
                loss_ptr, lse_ptr, P: tl.constexpr, BLOCK_P: tl.constexpr,
                HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr):
    """Merges the row's P partials (a row whose members did not all arrive gets a NaN lse),
    member 0 stores loss and lse; returns (lse or 0 where -inf, lse_lo * log2(e), a, b, c)."""
    idx = tl.arange(0, BLOCK_P)
    base = part_ptr + (row * P + idx) * 4
    valid = idx < P
    mm, ss = merge_stats(_load_partial(base, valid, 0, True),
                         _load_partial(base, valid, 1, False))
    sumz = 0.0
    if HAS_SMOOTHING:
        sumz = tl.sum(_load_partial(base, valid, 2, False), axis=0)
    zy = tl.sum(_load_partial(base, valid, 3, False), axis=0)
    lse, lse_lo = lse_parts(mm, ss)
    lse = tl.where(arrived >= P, lse, float("nan"))
    scale = tl.where(ignored, 0.0, 1.0)
    loss, a, b, c = ce_row_finish(lse, lse_lo, zy, sumz, V, smoothing, z_loss, ignored, bad,
                                  scale, HAS_SMOOTHING, HAS_ZLOSS)
    if member == 0:
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
    return tl.where(lse == float("-inf"), 0.0, lse), lse_lo * LOG2E, a, b, c


@triton.jit
def _store_grad(grad_ptr, row, V, z, cols, mask, label, lse, lo2, a, b, c,
                EVICTION: tl.constexpr):
    """Stores a * exp((z - lse) - lse_lo) - b * [j == label] - c over `cols` (as
    ce_fwd_kernel's gradient)."""
    g = a * tl.math.exp2((z - lse) * LOG2E - lo2) - tl.where(cols == label, b, 0.0) - c
    tl.store(grad_ptr + row * V + cols, g.to(grad_ptr.dtype.element_ty), mask=mask,
             eviction_policy=EVICTION)


@triton.jit(do_not_specialize=["N", "max_spin"])  # one compile for every batch size
def coop_ce_kernel(
    # pointers
    logits_ptr, labels_ptr,
    # sizes, strides, options
    N, V, stride_row, slice_v, ignore_index, smoothing, z_loss, max_spin,
    # scratch: sync int32 [N + 2] zeroed (row counters, ticket, timeouts); part fp32 [N, P, 4]
    sync_ptr, part_ptr,
    # outputs
    loss_ptr, lse_ptr, grad_ptr,
    # constexprs
    P: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr, ALIGN: tl.constexpr,
    REREAD: tl.constexpr, EVICT: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Grid (n_groups * P,): see the module docstring. slice_v: columns per member, a
    multiple of 16; at most BLOCK (the register variant: the slice is one tile) or, with
    REREAD, any multiple of 16 walked in tiles of BLOCK, twice. PREFETCH: the next row's slice
    (first tile with REREAD) is loaded between arrival and spin (always on without REREAD).
    EVICT (REREAD only): the statistics pass loads evict_last, the gradient pass loads and
    stores evict_first."""
    FIRST: tl.constexpr = "evict_last" if EVICT else ""
    SECOND: tl.constexpr = "evict_first" if EVICT else ""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    slice_v = hint_multiple(slice_v, 16)
    n_groups = tl.num_programs(0) // P
    ticket = tl.atomic_add(sync_ptr + N, 1, sem="relaxed")  # start order, not program id
    group = ticket // P
    member = ticket % P
    local = tl.arange(0, BLOCK)
    cols = member * slice_v + local  # the slice, or with REREAD its first tile
    mask = (local < slice_v) & (cols < V)  # min() would hide the alignment from the compiler
    n_rows = tl.where(group < N, (N - 1 - group) // n_groups + 1, 0)
    n_tiles = tl.cdiv(slice_v, BLOCK)
    if PREFETCH:
        x = _load_slice(logits_ptr, group.to(tl.int64), N, stride_row, cols, mask, FIRST)
    budget = max_spin
    for i in range(0, n_rows):
        row = (group + i * n_groups).to(tl.int64)
        label, ignored, bad = label_state(labels_ptr, row, V, ignore_index)
        if not PREFETCH:
            x = _load_slice(logits_ptr, row, N, stride_row, cols, mask, FIRST)
        z = tl.where(mask, x.to(tl.float32), float("-inf"))  # kept without REREAD
        zero = tl.zeros([], tl.float32)
        m, s, sumz, zy = _tile_stats(x, cols, mask, label, zero + float("-inf"), zero, zero,
                                     zero, HAS_SMOOTHING)
        if REREAD:  # the slice's other tiles
            for t in range(1, n_tiles):
                t_cols = cols + t * BLOCK
                t_mask = (local + t * BLOCK < slice_v) & (t_cols < V)
                x_t = tl.load(logits_ptr + row * stride_row + t_cols, mask=t_mask, other=0.0,
                              eviction_policy=FIRST)
                m, s, sumz, zy = _tile_stats(x_t, t_cols, t_mask, label, m, s, sumz, zy,
                                             HAS_SMOOTHING)
        arrived = _arrive(part_ptr, sync_ptr, row, member, m, s, sumz, zy, P, HAS_SMOOTHING)
        if PREFETCH:  # the next row's slice (first tile), loading while this one waits
            x = _load_slice(logits_ptr, row + n_groups, N, stride_row, cols, mask, FIRST)
        arrived, budget = _wait(sync_ptr, row, N, arrived, budget, P)
        lse, lo2, a, b, c = _finish_row(part_ptr, row, member, arrived, label, ignored, bad, V,
                                        smoothing, z_loss, loss_ptr, lse_ptr, P, BLOCK_P,
                                        HAS_SMOOTHING, HAS_ZLOSS)
        if REREAD:  # the second read, last tile first (the likeliest still in L1/L2)
            for k in range(0, n_tiles):
                off = (n_tiles - 1 - k) * BLOCK
                t_cols = cols + off
                t_mask = (local + off < slice_v) & (t_cols < V)
                x_t = tl.load(logits_ptr + row * stride_row + t_cols, mask=t_mask, other=0.0,
                              eviction_policy=SECOND)
                _store_grad(grad_ptr, row, V, x_t.to(tl.float32), t_cols, t_mask, label, lse,
                            lo2, a, b, c, SECOND)
        else:
            _store_grad(grad_ptr, row, V, z, cols, mask, label, lse, lo2, a, b, c, "")


# ----------------------------------------------------------------------------- launch
def slice_cols(vocab: int, p: int) -> int:
    """Columns per member: V over P slices, rounded up to a multiple of 16 (aligned starts)."""
    return triton.cdiv(triton.cdiv(vocab, p), 16) * 16


def coop_constexprs(vocab: int, p: int, smoothing: float = 0.0, z_loss: float = 0.0,
                    block: int | None = None, evict: bool = True,
                    prefetch: bool = False) -> dict:
    """Without `block` (the register variant): BLOCK is a member's slice rounded up to a power
    of two (its register tile), the next row's slice always prefetched. With `block` (REREAD):
    tiles of `block` columns; `evict` and `prefetch` as coop_ce_kernel's EVICT and PREFETCH."""
    reread = block is not None
    return dict(P=p, BLOCK=block if reread else triton.next_power_of_2(slice_cols(vocab, p)),
                BLOCK_P=merge_block(p), HAS_SMOOTHING=smoothing > 0, HAS_ZLOSS=z_loss > 0,
                ALIGN=vocab_align(vocab), REREAD=reread, EVICT=reread and evict,
                PREFETCH=prefetch or not reread)


class Reread(NamedTuple):
    """A REREAD launch: `slice` columns per member at most (P = ceil(V / slice) members per
    row, slice_cols(V, P) each), tiles of `block` columns, `warps` warps, `ctas` programs per
    SM in the grid (0: as many as fit, the compiled occupancy), eviction hints, prefetch."""
    slice: int
    block: int
    warps: int
    ctas: int = 0
    evict: bool = True
    prefetch: bool = False

    def p(self, vocab: int) -> int:
        return triton.cdiv(vocab, self.slice)

    def __str__(self) -> str:
        return (f"S={self.slice} B={self.block} w={self.warps} ctas={self.ctas or 'max'} "
                f"evict={int(self.evict)} prefetch={int(self.prefetch)}")


# The REREAD sweep (--bench, --check), likeliest first: slices (8-32 K columns: P = 4 to 16 at
# V = 128256; a grid of 528 programs holds 8-34 MB of bf16 slices in flight, inside H100's
# 50 MB L2), tiles x warps with 8-32 values per thread (16-byte bf16 vectors need 8), CTAs per
# SM (0: as many as fit; sm_90 fits 3-12 of these, see --ptx).
REREAD_SLICES = (16384, 8192, 32768)
REREAD_TILES = ((2048, 4), (1024, 4), (2048, 8), (4096, 8), (4096, 4))
REREAD_CTAS = (0, 4, 8)


def values_per_thread(vocab: int, p: int, num_warps: int) -> int:
    return max(1, coop_constexprs(vocab, p)["BLOCK"] // (32 * num_warps))


def default_warps(vocab: int, p: int) -> int:
    """About 16 values per thread, 4 to 32 warps."""
    return min(32, max(4, coop_constexprs(vocab, p)["BLOCK"] // 512))


def fits(vocab: int, p: int, num_warps: int) -> bool:
    """A loose pre-filter for a member's slice staying in registers: at most a third of the
    per-thread register limit of a CTA of num_warps warps (65536 per SM, 255 per thread) per
    value (ptxas for sm_90 used 54-255 registers for 8-64 values per thread). What decides is
    the compiled kernel's spill count (n_spills on the GPU, ptxas_usage without one)."""
    return values_per_thread(vocab, p, num_warps) * 3 <= min(255, 65536 // (32 * num_warps))


def fitting_ctas(n_regs: int, shared: int, num_warps: int, props=None) -> int:
    """CTAs of a kernel that fit on one SM: registers (allocated per warp in units of 256),
    threads, shared memory (plus 1 KiB reserved per CTA) and 32 CTAs; the SM's limits from
    `props` (torch device properties), else an H100's."""
    regs = triton.cdiv(max(n_regs, 1) * 32, 256) * 256 * num_warps
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // regs
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (shared + 1024)
    return max(1, min(by_regs, by_threads, by_smem, 32))


_COMPILED: dict = {}  # (dtype, warps, constexprs, device) -> (kernel, CTAs per SM, SMs)


def coop_ce_fwd_grad(logits, labels, p: int, num_warps: int = 16, *, block: int | None = None,
                     evict: bool = True, prefetch: bool = False,
                     ctas_per_sm: int | None = None, ignore_index: int = -100,
                     smoothing: float = 0.0, z_loss: float = 0.0, groups: int | None = None,
                     max_spin: int = MAX_SPIN, info: dict | None = None):
    """(loss [N], lse [N], grad [N, V]) of cross-entropy with reduction "none" and a unit
    cotangent, as torch_ref's fused forward writes them (ce_fwd_plan with write_grad).

    logits: [N, V] float32 or bfloat16, labels: [N] integer. `block` selects the REREAD
    variant (tiles of `block` columns; see coop_constexprs). `groups` sets the number of row
    groups (grid = groups * P); default: ctas_per_sm (default: as many as fit, from the
    compiled kernel's registers) times the SMs, in whole groups, at most N; on the CPU
    interpreter min(N, 2). `info`, if given, receives n_regs, n_spills, occupancy, grid,
    slice_v and the timeout count (a device sync)."""
    import torch

    from torch_ref._checks import labels_to_int32

    n, vocab = logits.shape
    x = logits.contiguous()
    y = labels_to_int32(labels, ignore_index, vocab)
    dev = x.device
    sync = torch.zeros(n + 2, dtype=torch.int32, device=dev)
    part = torch.empty((n, p, 4), dtype=torch.float32, device=dev)
    loss = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    grad = torch.empty_like(x)
    if n == 0:
        return loss, lse, grad
    args = (x, y, n, vocab, vocab, slice_cols(vocab, p), ignore_index, float(smoothing),
            float(z_loss), int(max_spin), sync, part, loss, lse, grad)
    const = coop_constexprs(vocab, p, smoothing, z_loss, block, evict, prefetch)
    extra = {}
    if x.is_cuda:
        extra = dict(num_warps=num_warps)
        key = (x.dtype, num_warps, tuple(const.items()), dev.index)
        if key not in _COMPILED:
            compiled = coop_ce_kernel.warmup(*args, grid=(1,), **extra, **const)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(dev)
            _COMPILED[key] = (compiled, fitting_ctas(compiled.n_regs, compiled.metadata.shared,
                                                      num_warps, props),
                              props.multi_processor_count)
        compiled, occ, sms = _COMPILED[key]
        groups = groups or max(1, min(n, sms * (ctas_per_sm or occ) // p))
        if info is not None:
            info.update(n_regs=compiled.n_regs, n_spills=compiled.n_spills, occupancy=occ)
    groups = groups or min(n, 2)
    coop_ce_kernel[(groups * p,)](*args, **extra, **const)
    if info is not None:
        info.update(grid=groups * p, slice_v=args[5], timeouts=int(sync[n + 1]))
    return loss, lse, grad


def coop_reread_fwd_grad(logits, labels, cfg: Reread, **kwargs):
    """coop_ce_fwd_grad's REREAD variant launched as `cfg` says (kwargs: its options)."""
    return coop_ce_fwd_grad(logits, labels, cfg.p(logits.shape[-1]), cfg.warps, block=cfg.block,
                            evict=cfg.evict, prefetch=cfg.prefetch,
                            ctas_per_sm=cfg.ctas or None, **kwargs)


# ----------------------------------------------------------------------------- check
TOL = {"float32": dict(loss=(1e-4, 1e-5), grad=(1e-6, 1e-4)),  # (atol, rtol)
       "bfloat16": dict(loss=(1e-4, 1e-5), grad=(1e-6, 1e-2))}  # grad: 1 bf16 ulp is <= 2^-7


def make_inputs(n: int, vocab: int, dtype, device, seed: int = 0, ignore_index: int = -100):
    """Logits N(0, 2^2) and labels in [0, V) with ignored and out-of-range labels mixed in:
    rows 1 mod 7 ignored, 3 mod 7 labelled V, 5 mod 7 labelled -7 (and row 0 of N=1 normal)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    x = (2.0 * torch.randn(n, vocab, generator=gen, device=device)).to(dtype)
    y = torch.randint(0, vocab, (n,), generator=gen, device=device)
    r = torch.arange(n, device=device) % 7
    y = torch.where(r == 1, ignore_index, y)
    y = torch.where(r == 3, vocab, y)
    return x, torch.where(r == 5, -7, y)


def references(x, y, ignore_index=-100, smoothing=0.0, z_loss=0.0):
    """{"fused": (loss, lse, grad) from torch_ref (the existing kernels, unit cotangent),
    "fp32": the same from the plain float32 formula and autograd}."""
    import torch

    import torch_ref
    from tests.reference.torch_oracle import cross_entropy_reference

    out = {}
    for name, fn, inp in (("fused", torch_ref.cross_entropy, x),
                          ("fp32", cross_entropy_reference, x.float())):
        kw = dict(ignore_index=ignore_index, reduction="none", label_smoothing=smoothing,
                  z_loss=z_loss)
        leaf = inp.detach().clone().requires_grad_()
        loss = fn(leaf, y, **kw)
        loss.backward(torch.ones_like(loss))
        with torch.no_grad():
            _, lse = fn(inp, y, return_lse=True, **kw)
        out[name] = (loss.detach(), lse, leaf.grad)
    return out


def compare(got, refs, y, vocab: int, ignore_index: int = -100, chunk: int = 1024) -> list[str]:
    """Mismatches of (loss, lse, grad) against each reference (per-dtype tolerances, the
    gradient compared `chunk` rows at a time to bound the temporaries; rows with an
    out-of-range label must have an all-NaN gradient), as messages."""
    import torch

    loss, lse, grad = got
    tol = TOL[str(grad.dtype).removeprefix("torch.")]
    bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
    errors = []

    def close(what, a, b, key) -> bool:
        try:
            torch.testing.assert_close(a.float(), b.float(), atol=tol[key][0],
                                       rtol=tol[key][1], equal_nan=True)
            return True
        except AssertionError as e:
            errors.append(f"{what}: {e}")
            return False

    for name, (r_loss, r_lse, r_grad) in refs.items():
        close(f"loss vs {name}", loss, r_loss, "loss")
        close(f"lse vs {name}", lse, r_lse, "loss")
        for r0 in range(0, grad.shape[0], chunk):
            ok = ~bad[r0:r0 + chunk]
            if not close(f"grad rows {r0}+ vs {name}", grad[r0:r0 + chunk][ok],
                         r_grad[r0:r0 + chunk][ok], "grad"):
                break
    if bad.any() and not torch.isnan(grad[bad]).all():
        errors.append(f"grad of {int(bad.sum())} out-of-range rows not all NaN")
    return errors


def max_err(grad, ref, good, chunk: int = 1024) -> float:
    """max |grad - ref| over the rows where `good`, `chunk` rows at a time (NaN if any)."""
    errs = [(grad[r0:r0 + chunk][good[r0:r0 + chunk]].float()
             - ref[r0:r0 + chunk][good[r0:r0 + chunk]].float()).abs().max()
            for r0 in range(0, grad.shape[0], chunk)]
    return float(errs[0].new_tensor(errs).max())  # torch's max propagates NaN


CHECK_VOCABS = (128256, 50257, 1000, 97)
CHECK_NS = (1, 7, 8192)
CHECK_PS = (1, 2, 4, 8, 12, 16)  # 12: not a power of two; 11 groups fill 132 SMs


def check_warps(vocab: int, p: int) -> int | None:
    """The most warps, at most default_warps, whose slice passes `fits` (None if none)."""
    return next((w for w in (32, 16, 8, 4) if w <= default_warps(vocab, p) and
                 fits(vocab, p, w)), None)


def check_reread_configs(vocab: int) -> tuple:
    """REREAD launches checked at every (dtype, V, N): three of the sweep's (P = 1 where V is
    small), one of 2 CTAs per SM, and slices of about V / 4 (P = 4 at every V) in tiles of half
    a slice or 1024 columns (several tiles, a ragged last one)."""
    small = triton.cdiv(triton.cdiv(vocab, 4), 16) * 16
    return (Reread(16384, 2048, 4), Reread(8192, 1024, 4, prefetch=True),
            Reread(32768, 4096, 8, evict=False, prefetch=True), Reread(16384, 2048, 4, ctas=2),
            Reread(small, max(16, min(1024, triton.next_power_of_2(small) // 2)), 4,
                   prefetch=True))


def sweep_configs(slices=REREAD_SLICES, tiles=REREAD_TILES, ctas=REREAD_CTAS, evicts=(True,),
                  prefetches=(False,)) -> list:
    """The --bench sweep's REREAD launches, most promising first."""
    return [Reread(s, b, w, c, e, f) for (b, w) in tiles for s in slices for c in ctas
            for e in evicts for f in prefetches]


def check(device: str = "cuda", vocabs=CHECK_VOCABS, ns=CHECK_NS, ps=CHECK_PS,
          big=(8192, 128256, 8), variants=("reg", "reread"), sweep=None) -> int:
    """Runs the correctness grid (on the GPU); prints one line per case; returns the failures.
    `big` = (N, V, P) of the cases with options and with one group per row (P: the register
    variant's); `sweep`: the REREAD launches checked at `big` (default: sweep_configs() with
    2 CTA counts, eviction hints and prefetch toggled)."""
    import torch

    failures = 0

    def run(what, x, y, refs, fn, **kw):
        nonlocal failures
        info = {}
        errors = compare(fn(x, y, info=info, **kw), refs, y, x.shape[1])
        errors += [f"{info['timeouts']} timeouts"] if info["timeouts"] else []
        failures += bool(errors)
        print(("FAIL " if errors else "ok   ") + f"{what} {info}", flush=True)
        for e in errors:
            print("     " + e.replace("\n", " | ")[:600], flush=True)

    reg, reread = "reg" in variants, "reread" in variants
    for dtype in (torch.bfloat16, torch.float32):
        for vocab in vocabs:
            for n in ns:
                x, y = make_inputs(n, vocab, dtype, device, seed=vocab + n)
                refs = references(x, y)
                head = f"{str(dtype)[6:]:8s} V={vocab:<6d} N={n:<4d}"
                for p in ps if reg else ():
                    w = check_warps(vocab, p)
                    if w is not None:
                        run(f"{head} P={p:<2d} warps={w:<2d}", x, y, refs,
                            lambda *a, **k: coop_ce_fwd_grad(*a, p, w, **k))
                for cfg in check_reread_configs(vocab) if reread else ():
                    run(f"{head} REREAD {cfg}", x, y, refs, _reread(cfg))
                del x, refs
    n, vocab, p = big
    x, y = make_inputs(n, vocab, torch.bfloat16, device, seed=1)
    refs = references(x, y)
    head = f"bf16 V={vocab} N={n}"
    base = Reread(16384, 2048, 4)
    if sweep is None:
        sweep = sweep_configs(ctas=(0,)) + [base._replace(ctas=4), base._replace(evict=False),
                                            base._replace(prefetch=True),
                                            base._replace(evict=False, prefetch=True)]
    for cfg in sweep if reread else ():
        run(f"{head} REREAD {cfg}", x, y, refs, _reread(cfg))
    launches = ([(f"P={p}", lambda *a, **k: coop_ce_fwd_grad(*a, p, default_warps(vocab, p),
                                                              **k))] if reg else [])
    launches += ([(f"REREAD {cfg}", _reread(cfg)) for cfg in (base, sweep[-1])]
                 if reread else [])
    for what, fn in launches:
        run(f"{head} {what} one group per row (far over capacity: start-order tickets)",
            x, y, refs, fn, groups=n)
    opts = dict(smoothing=0.1, z_loss=1e-4)
    refs = references(x, y, **opts)
    for what, fn in launches:
        run(f"{head} {what} smoothing 0.1, z_loss 1e-4", x, y, refs, fn, **opts)
    x, y = make_inputs(256, 1000, torch.float32, device)
    for what, fn in ([("P=4", lambda *a, **k: coop_ce_fwd_grad(*a, 4, 8, **k))] if reg else []) + \
            ([("REREAD", _reread(Reread(256, 128, 4)))] if reread else []):
        info = {}
        grad = fn(x, y, max_spin=0, info=info)[2]
        ok = info["timeouts"] and grad.isnan().any()
        failures += not ok
        print(("ok   " if ok else "FAIL ") + f"watchdog {what} (max_spin=0: waiting members "
              f"give up: timeouts and NaN expected) {info}", flush=True)
    print(f"check: {failures} failures", flush=True)
    return failures


def _reread(cfg: Reread):
    return lambda x, y, **kw: coop_reread_fwd_grad(x, y, cfg, **kw)


def _ints(text: str) -> tuple:
    return tuple(int(v) for v in text.split(",") if v)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="correctness on the GPU")
    parser.add_argument("--bench", action="store_true", help="time the sweep on the GPU")
    parser.add_argument("--ptx", action="store_true",
                        help="sm_90 PTX and ptxas summary as JSON (no GPU needed)")
    parser.add_argument("--variants", default=None,
                        help="reg,reread (default: both for --check, reread for --bench)")
    parser.add_argument("--out", default="coop_ce.csv", help="the --bench CSV")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="--bench starts no configuration after this many seconds")
    parser.add_argument("--n", type=int, default=8192, help="--bench rows")
    parser.add_argument("--cases", default=None,
                        help="--bench dtype:V,... (default: bf16 V=128256 first, then fp32 and "
                             "V=32000/256000)")
    parser.add_argument("--slices", type=_ints, default=REREAD_SLICES,
                        help="REREAD columns per member S (P = ceil(V / S)), comma-separated")
    parser.add_argument("--tiles", default=",".join(f"{b}x{w}" for b, w in REREAD_TILES),
                        help="REREAD BLOCKxWARPS pairs, comma-separated")
    parser.add_argument("--ctas", type=_ints, default=REREAD_CTAS,
                        help="REREAD CTAs per SM in the grid (0: as many as fit)")
    parser.add_argument("--evict", type=_ints, default=(1,), help="eviction hints: 1, 0 or 1,0")
    parser.add_argument("--prefetch", type=_ints, default=(0,), help="prefetch: 0, 1 or 0,1")
    parser.add_argument("--top", type=int, default=3,
                        help="--bench: the fastest REREAD launches of the first case that the "
                             "other cases run")
    parser.add_argument("--ncu", choices=("auto", "on", "off"), default="auto",
                        help="--bench: Nsight Compute DRAM bytes per row (auto: if on PATH)")
    parser.add_argument("--ncu-run", default=None, help=argparse.SUPPRESS)  # ncu's child
    args = parser.parse_args(argv)
    from benchmarks import coop_ce_measure as measure

    if args.ncu_run:
        measure.ncu_run(args.ncu_run)
        return 0
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t]
    configs = sweep_configs(args.slices, tiles, args.ctas, tuple(map(bool, args.evict)),
                            tuple(map(bool, args.prefetch)))
    failures = 0
    if args.ptx:
        print(json.dumps(measure.sm90_reports(), indent=1))
    if args.check:
        failures = check(variants=(args.variants or "reg,reread").split(","))
    if args.bench:
        cases = measure.BENCH_CASES
        if args.cases:
            cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
        measure.bench(args.out, args.n, cases, (args.variants or "reread").split(","), configs,
                      args.top, budget_s=args.budget_s, ncu=args.ncu)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
