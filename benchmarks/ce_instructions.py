"""GPU prototype: fewer instructions per logit in the fused cross-entropy forward + gradient.

    source .whl/gpu-env.sh && python3 -m benchmarks.ce_instructions > $OUT/ce_instructions.txt

The fused kernel is latency- and instruction-bound, not bandwidth-bound (Nsight Compute,
benchmarks/NOTES.md). This stripped kernel (no options: unit row weight, no smoothing,
z-loss or softcap) toggles three changes against the library's kernel measured in the same
run: per-lane sums (`lane`), unmasked whole tiles (`unmasked`) and the label's column written
once after a barrier instead of a compare per logit (`fixup`). The library adopted them
(kernels/_ce_core.slice_stats, kernels/cross_entropy._ce_grad_slice). H100 result:
benchmarks/results/ce_instructions_h100.txt.
"""

import functools
import itertools

import torch
import triton
import triton.language as tl

from jax_fusedloss.kernels._online import LOG2E, hint_multiple, lse_parts, safe_max
from jax_fusedloss.kernels.launch import vocab_align


@triton.jit
def _stats_tile(z, m, s, s_vec, LANE_SUM: tl.constexpr):
    m_new = tl.maximum(m, tl.max(z, axis=0))
    ms = safe_max(m_new)
    alpha = tl.math.exp2((m - ms) * LOG2E)
    e = tl.math.exp2((z - ms) * LOG2E)
    if LANE_SUM:
        s_vec = s_vec * alpha + e
    else:
        s = s * alpha + tl.sum(e, axis=0)
    return m_new, s, s_vec


@triton.jit
def ce_fast_kernel(
    x_ptr,
    y_ptr,
    V,
    loss_ptr,
    lse_ptr,
    grad_ptr,
    scale,
    BLOCK: tl.constexpr,
    LANE_SUM: tl.constexpr,
    UNMASKED: tl.constexpr,
    FIXUP: tl.constexpr,
    ALIGN: tl.constexpr,
):
    V = hint_multiple(V, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * V
    g_ptr = grad_ptr + row * V
    label = tl.load(y_ptr + row).to(tl.int32)
    ar = tl.arange(0, BLOCK)
    n_full = V // BLOCK if UNMASKED else 0
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    s_vec = tl.zeros([BLOCK], tl.float32)
    for t in range(0, n_full):
        z = tl.load(row_ptr + t * BLOCK + ar, eviction_policy="evict_last").to(tl.float32)
        m, s, s_vec = _stats_tile(z, m, s, s_vec, LANE_SUM)
    for off in range(n_full * BLOCK, V, BLOCK):
        cols = off + ar
        z = tl.load(
            row_ptr + cols, mask=cols < V, other=float("-inf"), eviction_policy="evict_last"
        ).to(tl.float32)
        m, s, s_vec = _stats_tile(z, m, s, s_vec, LANE_SUM)
    if LANE_SUM:
        s = tl.sum(s_vec, axis=0)
    lse, lse_lo = lse_parts(m, s)
    zy = tl.load(row_ptr + label).to(tl.float32)
    tl.store(loss_ptr + row, (lse - zy) + lse_lo)
    tl.store(lse_ptr + row, lse)
    a = scale
    b = scale
    c = scale * 0.0
    lo2 = lse_lo * LOG2E
    # pass 2, backwards: the masked tail first, then full tiles from the end
    for off in range(n_full * BLOCK, V, BLOCK):
        cols = off + ar
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(
            tl.float32
        )
        g = a * tl.math.exp2((z - lse) * LOG2E - lo2) - c
        if not FIXUP:
            g = g - tl.where(cols == label, b, 0.0)
        tl.store(
            g_ptr + cols, g.to(g_ptr.dtype.element_ty), mask=mask, eviction_policy="evict_first"
        )
    for i in range(0, n_full):
        off = (n_full - 1 - i) * BLOCK
        z = tl.load(row_ptr + off + ar, eviction_policy="evict_first").to(tl.float32)
        g = a * tl.math.exp2((z - lse) * LOG2E - lo2) - c
        if not FIXUP:
            g = g - tl.where(off + ar == label, b, 0.0)
        tl.store(g_ptr + off + ar, g.to(g_ptr.dtype.element_ty), eviction_policy="evict_first")
    if FIXUP:
        tl.debug_barrier()
        gy = a * tl.math.exp2((zy - lse) * LOG2E - lo2) - c - b
        tl.store(g_ptr + label, gy.to(g_ptr.dtype.element_ty))


@triton.jit
def _thread_update(m, s, z):
    """Per-thread online softmax: z is a [T, R] tile whose rows each sit in one thread's
    registers (R = one 16-byte vector), (m, s) are [T]: no cross-thread reduction, no barrier."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    ms2 = safe_max(m_new) * LOG2E
    alpha = tl.minimum(tl.math.exp2(m * LOG2E - ms2), 3.4028234663852886e38)
    s = s * alpha + tl.sum(tl.math.exp2(z * LOG2E - ms2[:, None]), axis=1)
    return m_new, s


@triton.jit
def ce_thread_kernel(x_ptr, y_ptr, V, loss_ptr, lse_ptr, grad_ptr, scale,
                     BLOCK: tl.constexpr, R: tl.constexpr, GBLOCK: tl.constexpr,
                     UNROLL: tl.constexpr, GUNROLL: tl.constexpr, PREFETCH: tl.constexpr,
                     ALIGN: tl.constexpr):
    """The statistics pass on [BLOCK // R, R] tiles with per-thread (max, sum) merged once at
    the end (no block-wide reduction, so no barrier, per tile); the gradient pass as
    ce_fast_kernel's best (unmasked whole tiles backwards, label fix-up)."""
    V = hint_multiple(V, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * V
    g_ptr = grad_ptr + row * V
    label = tl.load(y_ptr + row).to(tl.int32)
    T: tl.constexpr = BLOCK // R
    rr = tl.arange(0, T)[:, None] * R + tl.arange(0, R)[None, :]
    m = tl.full([T], float("-inf"), tl.float32)
    s = tl.zeros([T], tl.float32)
    n_full = V // BLOCK
    if PREFETCH:  # the next tile's load issued before this tile's arithmetic
        z_next = tl.load(row_ptr + rr, mask=rr < n_full * BLOCK, other=0.0,
                         eviction_policy="evict_last")
        for t in tl.range(0, n_full, loop_unroll_factor=UNROLL):
            z = z_next.to(tl.float32)
            nxt = tl.minimum(t + 1, n_full - 1) * BLOCK
            z_next = tl.load(row_ptr + nxt + rr, eviction_policy="evict_last")
            m, s = _thread_update(m, s, z)
    else:
        for t in tl.range(0, n_full, loop_unroll_factor=UNROLL):
            z = tl.load(row_ptr + t * BLOCK + rr, eviction_policy="evict_last").to(tl.float32)
            m, s = _thread_update(m, s, z)
    for off in range(n_full * BLOCK, V, BLOCK):
        cols = off + rr
        z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf"),
                    eviction_policy="evict_last").to(tl.float32)
        m, s = _thread_update(m, s, z)
    mt = tl.max(m, axis=0)
    st = tl.sum(s * tl.math.exp2((m - safe_max(mt)) * LOG2E), axis=0)
    lse, lse_lo = lse_parts(mt, st)
    zy = tl.load(row_ptr + label).to(tl.float32)
    tl.store(loss_ptr + row, (lse - zy) + lse_lo)
    tl.store(lse_ptr + row, lse)
    a = scale
    c = scale * 0.0
    lo2 = lse_lo * LOG2E
    lse2 = lse * LOG2E + lo2
    ar = tl.arange(0, GBLOCK)
    g_full = V // GBLOCK
    for off in range(g_full * GBLOCK, V, GBLOCK):
        cols = off + ar
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(
            tl.float32)
        g = a * tl.math.exp2(z * LOG2E - lse2) - c
        tl.store(g_ptr + cols, g.to(g_ptr.dtype.element_ty), mask=mask,
                 eviction_policy="evict_first")
    for i in tl.range(0, g_full, loop_unroll_factor=GUNROLL):
        off = (g_full - 1 - i) * GBLOCK
        z = tl.load(row_ptr + off + ar, eviction_policy="evict_first").to(tl.float32)
        g = a * tl.math.exp2(z * LOG2E - lse2) - c
        tl.store(g_ptr + off + ar, g.to(g_ptr.dtype.element_ty), eviction_policy="evict_first")
    tl.debug_barrier()
    gy = a * tl.math.exp2(zy * LOG2E - lse2) - c - scale
    tl.store(g_ptr + label, gy.to(g_ptr.dtype.element_ty))


def _outputs(x):
    """(loss, lse, grad) buffers of a prototype launch on logits x."""
    loss = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    return loss, torch.empty_like(loss), torch.empty_like(x)


def run_thread(x, y, block, gblock, warps, unroll=1, gunroll=1, prefetch=0):
    v = x.shape[1]
    loss, lse, g = _outputs(x)
    ce_thread_kernel[(x.shape[0],)](x, y, v, loss, lse, g, 1.0, BLOCK=block,
                                    R=16 // x.element_size(), GBLOCK=gblock, UNROLL=unroll,
                                    GUNROLL=gunroll, PREFETCH=prefetch, ALIGN=vocab_align(v),
                                    num_warps=warps)
    return loss, g


def run(x, y, block, warps, lane, unmasked, fixup):
    n, v = x.shape
    loss, lse, g = _outputs(x)
    align = vocab_align(v)
    ce_fast_kernel[(n,)](
        x,
        y,
        v,
        loss,
        lse,
        g,
        1.0,
        BLOCK=block,
        LANE_SUM=lane,
        UNMASKED=unmasked,
        FIXUP=fixup,
        ALIGN=align,
        num_warps=warps,
    )
    return loss, g


def _setup(dt, v, n=8192):
    """Inputs, float32 references, and the copy and library times of one (dtype, V) case."""
    from triton.testing import do_bench

    from torch_ref.cross_entropy import _fwd

    torch.manual_seed(0)
    x = torch.randn(n, v, device="cuda", dtype=dt) * 2
    y = torch.randint(0, v, (n,), device="cuda", dtype=torch.int32)
    ref_loss = torch.nn.functional.cross_entropy(x.float(), y.long(), reduction="none")
    ref_g = torch.softmax(x.float(), -1)
    ref_g[torch.arange(n), y.long()] -= 1
    ones = torch.ones(n, device="cuda")
    copy = do_bench(lambda: x.clone(), rep=200)
    prod = do_bench(lambda: _fwd(x, y, ones, -100, 0.0, 0.0, None, True), rep=300)
    print(f"{dt} V={v}: copy {copy:.3f} ms | production {prod:.3f} ms "
          f"({prod / copy:.3f}x copy)", flush=True)
    return x, y, ref_loss, ref_g, copy, prod


def _measure(head, fn, ref_loss, ref_g, copy, prod):
    """Times fn() -> (loss, grad) after checking it against the references."""
    from triton.testing import do_bench

    try:
        loss, g = fn()
        el = (loss - ref_loss).abs().max().item()
        eg = (g.float() - ref_g).abs().max().item()
        t = do_bench(fn, rep=300)
        print(f"{head} {t:.3f} ms ({t / copy:.3f}x copy, {t / prod:.3f}x prod) "
              f"err loss {el:.1e} grad {eg:.1e}", flush=True)
    except Exception as e:  # a configuration that does not compile or fit
        print(f"{head} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


def _case(dt, v, n=8192):
    """One (dtype, V) case: the library's kernel, then the prototype's configurations."""
    x, y, ref_loss, ref_g, copy, prod = _setup(dt, v, n)
    full = v == 128256 and dt == torch.bfloat16
    cfgs = ([(16384, 32), (8192, 16), (16384, 16), (4096, 8), (8192, 8)] if full
            else [(16384, 32), (8192, 16)])
    flags = (list(itertools.product([0, 1], repeat=3)) if full
             else [(0, 0, 0), (0, 1, 1), (1, 1, 1)])
    for (block, warps), (lane, unm, fix) in itertools.product(cfgs, flags):
        head = f"  B={block:5d} w={warps:2d} lane={lane} unmasked={unm} fixup={fix}:"
        _measure(head, lambda: run(x, y, block, warps, lane, unm, fix), ref_loss, ref_g, copy,
                 prod)


def _thread_case(dt, v, full, n=8192):
    """Per-thread statistics (ce_thread_kernel) against the library and ce_fast_kernel's best."""
    x, y, ref_loss, ref_g, copy, prod = _setup(dt, v, n)
    _measure("  ce_fast B=16384 w=32 lane=1 unmasked=1 fixup=1:",
             lambda: run(x, y, 16384, 32, 1, 1, 1), ref_loss, ref_g, copy, prod)
    cfgs = ([(b, 16384, 32, u, gu, pf) for b in (8192, 16384) for u, gu, pf in (
        (1, 1, 0), (2, 1, 0), (4, 1, 0), (1, 2, 0), (2, 2, 0), (1, 1, 1), (2, 2, 1))]
        + [(b, 16384, 16, u, gu, pf) for b in (8192, 16384) for u, gu, pf in (
            (1, 1, 0), (2, 2, 0), (1, 1, 1))]) if full else [
        (16384, 16384, 32, 1, 1, 0), (16384, 16384, 32, 2, 2, 0), (16384, 16384, 32, 1, 1, 1),
        (8192, 16384, 32, 2, 2, 1)]
    for block, gblock, warps, u, gu, pf in cfgs:
        head = f"  thread B={block:5d} G={gblock:5d} w={warps:2d} unroll={u},{gu} prefetch={pf}:"
        _measure(head, lambda: run_thread(x, y, block, gblock, warps, u, gu, pf), ref_loss,
                 ref_g, copy, prod)



def run_library(x, y, block, warps, prefetch, write_grad=True, keep=0):
    """The library's ce_fwd_kernel launched directly with a chosen tile, warps, PREFETCH and
    KEEP."""
    from jax_fusedloss.kernels.cross_entropy import COEF_FIELDS, ce_fwd_kernel

    n, v = x.shape
    loss = torch.empty(n, device=x.device, dtype=torch.float32)
    lse = torch.empty_like(loss)
    coef = torch.empty((n, COEF_FIELDS.value), device=x.device, dtype=torch.float32)
    g = torch.empty_like(x) if write_grad else torch.empty((1,), device=x.device, dtype=x.dtype)
    scale = torch.ones(n, device=x.device, dtype=torch.float32)
    ce_fwd_kernel[(n,)](x, y, scale, v, v, -100, 0.0, 0.0, 1.0, loss, lse, coef, g,
                        BLOCK_V=block, HAS_SOFTCAP=False, HAS_SMOOTHING=False, HAS_ZLOSS=False,
                        WRITE_GRAD=write_grad, ALIGN=vocab_align(v), PREFETCH=prefetch,
                        KEEP=keep, num_warps=warps)
    return loss, g


def main_library():
    """--library: the library's fused kernel over tiles, warps and PREFETCH at every named
    vocabulary (the launch heuristic's table), forward + gradient and forward alone."""
    for dt in (torch.bfloat16, torch.float32):
        for v in (32000, 50257, 128256, 151936, 256000):
            x, y, ref_loss, ref_g, copy, prod = _setup(dt, v)
            for block, warps, pf in ((16384, 32, 0), (16384, 32, 1), (8192, 32, 1),
                                     (8192, 16, 1), (8192, 16, 0), (32768, 32, 0)):
                if dt == torch.float32 and pf:
                    continue  # the kernel prefetches 16-bit logits only
                _measure(f"  library B={block:5d} w={warps:2d} prefetch={pf}:",
                         lambda: run_library(x, y, block, warps, pf), ref_loss, ref_g, copy,
                         prod)
            for block, warps, pf in ((4096, 8, 0), (4096, 8, 1), (8192, 16, 1)):
                if dt == torch.float32 and pf:
                    continue
                from triton.testing import do_bench
                t = do_bench(lambda: run_library(x, y, block, warps, pf, False), rep=200)
                print(f"  forward alone B={block:5d} w={warps:2d} prefetch={pf}: {t:.3f} ms "
                      f"({2 * t / copy:.3f}x read)", flush=True)
            torch.cuda.empty_cache()


def main_keep():
    """--keep: the library's fused kernel keeping KEEP leading tiles of each row in registers
    (no re-read) against KEEP=0, twice in alternation, at the vocabularies where the row walk
    runs (bf16 with and without PREFETCH; float32 rows up to the split threshold)."""
    cases = ((torch.bfloat16, 151936), (torch.bfloat16, 128256), (torch.bfloat16, 256000),
             (torch.bfloat16, 100000), (torch.bfloat16, 50257), (torch.bfloat16, 32000),
             (torch.float32, 50257), (torch.float32, 32000), (torch.float32, 100000))
    for dt, v in cases:
        x, y, ref_loss, ref_g, copy, prod = _setup(dt, v)
        pfs = (1, 0) if dt == torch.bfloat16 and v >= 65536 else (0,)
        for rep in range(2):
            for pf in pfs:
                for keep in (0, 1, 2):
                    _measure(f"  keep={keep} prefetch={pf} rep={rep}:",
                             functools.partial(run_library, x, y, 16384, 32, pf, keep=keep),
                             ref_loss, ref_g, copy, prod)
        del x, y, ref_loss, ref_g
        torch.cuda.empty_cache()


def run_split(x, y, splits, block, prefetch, polls=None):
    """The library's ce_fwd_plan with each row split over about `splits` programs of one
    launch (ce_split_fused_kernel; 1 = ce_fwd_kernel) of `block`-element tiles, through
    torch_ref's plan executor: (fn, the number of programs a row got)."""
    from jax_fusedloss.kernels import cross_entropy as ce
    from jax_fusedloss.kernels import launch
    from torch_ref import _launch

    n, v = x.shape
    knobs = dict(SPLIT_FUSED_MIN_ROW_BYTES=0 if splits > 1 else 1 << 60,
                 SPLIT_FUSED_SLICE_BYTES=triton.cdiv(triton.cdiv(v, block), splits) * block
                 * x.element_size(), SPLIT_FUSED_TILE_ELEMS=block, GRAD_TILE_ELEMS=block,
                 PREFETCH_MIN_VOCAB=0 if prefetch else 1 << 60,
                 SPLIT_FUSED_POLLS=launch.SPLIT_FUSED_POLLS if polls is None else polls)
    saved = {k: getattr(launch, k) for k in knobs}
    for k, val in knobs.items():
        setattr(launch, k, val)
    try:
        plan = ce.ce_fwd_plan(n, v, ignore_index=-100, smoothing=0.0, z_loss=0.0, softcap=None,
                              num_sms=132, write_grad=True, itemsize=x.element_size())
    finally:
        for k, val in saved.items():
            setattr(launch, k, val)
    got = plan.launches[0].constexprs.get("NUM_SPLITS", 1)
    scale = torch.ones(n, device=x.device, dtype=torch.float32)

    def fn():
        loss, _, _, g = _launch.run_plan(plan, x=x, y=y, row_scale=scale)
        return loss, g
    return fn, got


def main_split():
    """--split: the one-launch split forward + gradient (ce_split_fused_kernel) over programs
    per row and tiles, against ce_fwd_kernel (splits=1) in the same run. (An earlier sweep
    with polls=0, every program but a row's last handing its slice to the last, and with
    16384-element tiles: benchmarks/results/ce_split_h100.txt.)"""
    cases = ((torch.float32, 128256, (1, 4, 6, 8)), (torch.float32, 151936, (1, 4, 6, 8)),
             (torch.float32, 256000, (1, 6, 8, 12)), (torch.float32, 50257, (1, 2, 3)),
             (torch.bfloat16, 256000, (1, 4, 6, 8)), (torch.float32, 32000, (1, 2)))
    for dt, v, split_list in cases:
        x, y, ref_loss, ref_g, copy, prod = _setup(dt, v)
        pf = int(dt != torch.float32)
        for rep in range(2):
            for splits in split_list:
                for block in ((16384, 8192) if splits == 1 else (8192,)):
                    fn, got = run_split(x, y, splits, block, pf)
                    _measure(f"  split S={splits}({got}) B={block:5d} prefetch={pf} rep={rep}:",
                             fn, ref_loss, ref_g, copy, prod)
        del x, y, ref_loss, ref_g
        torch.cuda.empty_cache()


def main_split_keep():
    """--split-keep: the one-launch split kernel with KEEP leading tiles of each program's slice
    in registers (launch.SPLIT_FUSED_KEEP) against none, at the rows it runs on."""
    from jax_fusedloss.kernels import launch

    for dt, v, splits in ((torch.bfloat16, 256000, 6), (torch.float32, 128256, 6),
                          (torch.float32, 256000, 11)):
        x, y, ref_loss, ref_g, copy, prod = _setup(dt, v)
        for rep in range(2):
            for keep in (0, 1, 2):
                saved, launch.SPLIT_FUSED_KEEP = launch.SPLIT_FUSED_KEEP, {x.element_size(): keep}
                fn, got = run_split(x, y, splits, 8192, int(dt != torch.float32) and not keep)
                launch.SPLIT_FUSED_KEEP = saved
                _measure(f"  split keep={keep} S={got} rep={rep}:", fn, ref_loss, ref_g, copy,
                         prod)
        del x, y, ref_loss, ref_g
        torch.cuda.empty_cache()


def main_split_sweep():
    """--split-sweep: bf16 V=256000, the split kernel's programs per row and tile with and
    without a kept tile."""
    from jax_fusedloss.kernels import launch

    x, y, ref_loss, ref_g, copy, prod = _setup(torch.bfloat16, 256000)
    for block, splits in ((8192, 6), (8192, 4), (8192, 8), (8192, 11), (4096, 6), (4096, 11),
                          (4096, 16)):
        for keep in (1, 0):
            saved, launch.SPLIT_FUSED_KEEP = launch.SPLIT_FUSED_KEEP, {2: keep}
            fn, got = run_split(x, y, splits, block, int(not keep))
            launch.SPLIT_FUSED_KEEP = saved
            _measure(f"  split B={block} S={got} keep={keep}:", fn, ref_loss, ref_g, copy, prod)


def main():
    import sys

    if "--split-sweep" in sys.argv:
        return main_split_sweep()
    if "--split-keep" in sys.argv:
        return main_split_keep()

    if "--split" in sys.argv:
        return main_split()
    if "--keep" in sys.argv:
        return main_keep()
    if "--library" in sys.argv:
        return main_library()
    if "--thread" in sys.argv:
        for dt, v in ((torch.bfloat16, 128256), (torch.float32, 128256),
                      (torch.bfloat16, 32000), (torch.bfloat16, 256000),
                      (torch.bfloat16, 151936)):
            _thread_case(dt, v, full=(dt == torch.bfloat16 and v == 128256))
            torch.cuda.empty_cache()
        return
    for dt, v in ((torch.bfloat16, 128256), (torch.float32, 128256), (torch.bfloat16, 32000),
                  (torch.bfloat16, 256000), (torch.bfloat16, 50257)):
        _case(dt, v)
        torch.cuda.empty_cache()



if __name__ == "__main__":
    main()
