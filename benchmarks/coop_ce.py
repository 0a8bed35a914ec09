"""Prototype (issue 11 item 1): cross-entropy forward + gradient reading each logits row once.

Each row is split over P co-operating programs. A program loads its slice of the row into
registers once, publishes the slice statistics (max, sum exp, sum z, z[label] or 0) to a
float32 scratch `part[N, P, 4]`, arrives on the row's counter (atomic add, acq_rel: the
release publishes the statistics), issues the load of its next row's slice, spins until the
counter reaches P (atomic add of 0, acquire), merges the P partials and writes the gradient
g = a * exp(z - lse) - b * [j == y] - c of its slice from the registers. Rows are taken
persistently: group g handles rows g, g + n_groups, ...

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
rows; a label outside [0, V) that is not ignore_index gives a NaN loss and gradient row).
Label smoothing and z-loss are supported; logit softcap is not (prototype).

    python -m benchmarks.coop_ce --check                  # GPU: correctness (~1 min)
    python -m benchmarks.coop_ce --bench --out coop.csv   # GPU: sweep of P x warps
    python -m benchmarks.coop_ce --ptx                    # CPU ok: sm_90 PTX/ptxas summary
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl

from jax_fusedloss.kernels._online import hint_multiple, merge_stats, safe_max, stats_to_lse
try:  # the cross-entropy row finish shared by the kernel families (kernels/_ce_core.py) ...
    from jax_fusedloss.kernels._ce_core import ce_row_finish, label_state
except ImportError:  # ... or where it lived before (kernels/cross_entropy.py at 9a81633)
    from jax_fusedloss.kernels.cross_entropy import _ce_row_finish as ce_row_finish
    from jax_fusedloss.kernels.cross_entropy import _label_state as label_state
from jax_fusedloss.kernels.launch import merge_block, vocab_align

MAX_SPIN = 1 << 20  # polls per program before the watchdog gives up (~0.3-1 s of spinning)


@triton.jit
def _load_partial(base, valid, FIELD: tl.constexpr, IS_MAX: tl.constexpr):
    """Field FIELD of a row's P partials, read from L2 (.cg: never a stale L1 line)."""
    return tl.load(base + FIELD, mask=valid, other=float("-inf") if IS_MAX else 0.0,
                   cache_modifier=".cg")


@triton.jit
def _load_slice(logits_ptr, row, N, stride_row, cols, mask):
    """A member's slice of `row` in the logits' dtype (zeros for a row >= N). The row test is
    a column bound (a power of two, so vector loads survive): the interpreter rejects a mask
    combined with a scalar bool."""
    in_rows = cols < tl.where(row < N, 1 << 30, 0)
    return tl.load(logits_ptr + row * stride_row + cols, mask=mask & in_rows, other=0.0)


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
):
    """Grid (n_groups * P,): see the module docstring. slice_v: columns per member, a
    multiple of 16 and at most BLOCK."""
    V = hint_multiple(V, ALIGN)
    stride_row = hint_multiple(stride_row, ALIGN)
    slice_v = hint_multiple(slice_v, 16)
    n_groups = tl.num_programs(0) // P
    ticket = tl.atomic_add(sync_ptr + N, 1, sem="relaxed")  # start order, not program id
    group = ticket // P
    member = ticket % P
    start = member * slice_v
    local = tl.arange(0, BLOCK)
    cols = start + local
    mask = (local < slice_v) & (cols < V)  # min() would hide the alignment from the compiler
    n_rows = tl.where(group < N, (N - 1 - group) // n_groups + 1, 0)
    idx = tl.arange(0, BLOCK_P)
    x = _load_slice(logits_ptr, group.to(tl.int64), N, stride_row, cols, mask)
    budget = max_spin
    for i in range(0, n_rows):
        row = (group + i * n_groups).to(tl.int64)
        z = tl.where(mask, x.to(tl.float32), float("-inf"))
        label, ignored, bad = label_state(labels_ptr, row, V, ignore_index)
        m = tl.max(z, axis=0)
        s = tl.sum(tl.exp(z - safe_max(m)), axis=0)
        out = part_ptr + (row * P + member) * 4
        tl.store(out, m)
        tl.store(out + 1, s)
        if HAS_SMOOTHING:
            tl.store(out + 2, tl.sum(tl.where(mask, z, 0.0), axis=0))
        tl.store(out + 3, tl.sum(tl.where(mask & (cols == label), z, 0.0), axis=0))
        arrived = tl.atomic_add(sync_ptr + row, 1, sem="acq_rel") + 1  # release: publish
        nxt = row + n_groups  # prefetch the next row's slice before waiting on this one
        x = _load_slice(logits_ptr, nxt, N, stride_row, cols, mask)
        while (arrived < P) & (budget > 0):
            arrived = tl.atomic_add(sync_ptr + row, 0, sem="acquire")
            budget -= 1
        if arrived < P:  # watchdog: count the timeout, poison the row below
            tl.atomic_add(sync_ptr + N + 1, 1, sem="relaxed")
        base = part_ptr + (row * P + idx) * 4
        valid = idx < P
        mm, ss = merge_stats(_load_partial(base, valid, 0, True),
                             _load_partial(base, valid, 1, False))
        sumz = 0.0
        if HAS_SMOOTHING:
            sumz = tl.sum(_load_partial(base, valid, 2, False), axis=0)
        zy = tl.sum(_load_partial(base, valid, 3, False), axis=0)
        lse = tl.where(arrived >= P, stats_to_lse(mm, ss), float("nan"))
        scale = tl.where(ignored, 0.0, 1.0)
        loss, a, b, c = ce_row_finish(lse, 0.0, zy, sumz, V, smoothing, z_loss, ignored, bad,
                                      scale, HAS_SMOOTHING, HAS_ZLOSS)
        if member == 0:
            tl.store(loss_ptr + row, loss)
            tl.store(lse_ptr + row, lse)
        lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
        g = a * tl.exp(z - lse_safe) - tl.where(cols == label, b, 0.0) - c
        tl.store(grad_ptr + row * V + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launch
def slice_cols(vocab: int, p: int) -> int:
    """Columns per member: V over P slices, rounded up to a multiple of 16 (aligned starts)."""
    return triton.cdiv(triton.cdiv(vocab, p), 16) * 16


def coop_constexprs(vocab: int, p: int, smoothing: float = 0.0, z_loss: float = 0.0) -> dict:
    """BLOCK: a member's slice rounded up to a power of two (its register tile)."""
    return dict(P=p, BLOCK=triton.next_power_of_2(slice_cols(vocab, p)), BLOCK_P=merge_block(p),
                HAS_SMOOTHING=smoothing > 0, HAS_ZLOSS=z_loss > 0, ALIGN=vocab_align(vocab))


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


def _occupancy(compiled, num_warps: int, props) -> int:
    """CTAs of this kernel that fit on one SM: registers (allocated per warp in units of 256),
    threads and shared memory (plus 1 KiB reserved per CTA)."""
    regs = triton.cdiv(max(compiled.n_regs, 1) * 32, 256) * 256 * num_warps
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // regs
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (compiled.metadata.shared + 1024)
    return max(1, min(by_regs, by_threads, by_smem, 32))


_COMPILED: dict = {}  # (dtype, warps, constexprs, device) -> (kernel, CTAs per SM, SMs)


def coop_ce_fwd_grad(logits, labels, p: int, num_warps: int = 16, *, ignore_index: int = -100,
                     smoothing: float = 0.0, z_loss: float = 0.0, groups: int | None = None,
                     max_spin: int = MAX_SPIN, info: dict | None = None):
    """(loss [N], lse [N], grad [N, V]) of cross-entropy with reduction "none" and a unit
    cotangent, as torch_ref's fused forward writes them (ce_fwd_plan with write_grad).

    logits: [N, V] float32 or bfloat16, labels: [N] integer. `groups` sets the number of row
    groups (grid = groups * P); default: as many as fit on the GPU at once (from the compiled
    kernel's registers), at most N; on the CPU interpreter min(N, 2). `info`, if given,
    receives n_regs, n_spills, occupancy, grid and the timeout count (a device sync)."""
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
    const = coop_constexprs(vocab, p, smoothing, z_loss)
    extra = {}
    if x.is_cuda:
        extra = dict(num_warps=num_warps)
        key = (x.dtype, num_warps, tuple(const.items()), dev.index)
        if key not in _COMPILED:
            compiled = coop_ce_kernel.warmup(*args, grid=(1,), **extra, **const)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(dev)
            _COMPILED[key] = (compiled, _occupancy(compiled, num_warps, props),
                              props.multi_processor_count)
        compiled, occ, sms = _COMPILED[key]
        groups = groups or max(1, min(n, sms * occ // p))
        if info is not None:
            info.update(n_regs=compiled.n_regs, n_spills=compiled.n_spills, occupancy=occ)
    groups = groups or min(n, 2)
    coop_ce_kernel[(groups * p,)](*args, **extra, **const)
    if info is not None:
        info.update(grid=groups * p, timeouts=int(sync[n + 1]))
    return loss, lse, grad


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


def check(device: str = "cuda", vocabs=CHECK_VOCABS, ns=CHECK_NS, ps=CHECK_PS,
          big=(8192, 128256, 8)) -> int:
    """Runs the correctness grid (on the GPU); prints one line per case; returns the failures.
    `big` = (N, V, P) of the cases with options and with one group per row."""
    import torch

    failures = 0

    def report(what, errors):
        nonlocal failures
        failures += bool(errors)
        print(("FAIL " if errors else "ok   ") + what, flush=True)
        for e in errors:
            print("     " + e.replace("\n", " | ")[:600], flush=True)

    for dtype in (torch.bfloat16, torch.float32):
        for vocab in vocabs:
            for n in ns:
                x, y = make_inputs(n, vocab, dtype, device, seed=vocab + n)
                refs = references(x, y)
                for p in ps:
                    w = check_warps(vocab, p)
                    if w is None:
                        continue
                    info = {}
                    got = coop_ce_fwd_grad(x, y, p, w, info=info)
                    errors = compare(got, refs, y, vocab)
                    errors += [f"{info['timeouts']} timeouts"] if info["timeouts"] else []
                    report(f"{str(dtype)[6:]:8s} V={vocab:<6d} N={n:<4d} P={p:<2d} warps={w:<2d} "
                           f"{info}", errors)
                del x, refs
    n, vocab, p = big
    x, y = make_inputs(n, vocab, torch.bfloat16, device, seed=1)
    for what, opts, kw in (("smoothing 0.1, z_loss 1e-4", dict(smoothing=0.1, z_loss=1e-4), {}),
                           ("one group per row (far over capacity: start-order tickets)", {},
                            dict(groups=n))):
        info = {}
        got = coop_ce_fwd_grad(x, y, p, default_warps(vocab, p), info=info, **opts, **kw)
        errors = compare(got, references(x, y, **opts), y, vocab)
        report(f"bf16 V={vocab} N={n} P={p} {what} {info}",
               errors + ([f"{info['timeouts']} timeouts"] if info["timeouts"] else []))
    info = {}
    x, y = make_inputs(256, 1000, torch.float32, device)
    loss, lse, grad = coop_ce_fwd_grad(x, y, 4, 8, max_spin=0, info=info)
    report(f"watchdog (max_spin=0: waiting members give up) {info}",
           [] if info["timeouts"] and grad.isnan().any() else ["no timeout or no NaN"])
    print(f"check: {failures} failures", flush=True)
    return failures


# ----------------------------------------------------------------------------- bench
BENCH_CASES = (("bfloat16", 128256), ("float32", 128256), ("bfloat16", 256000),
               ("bfloat16", 32000), ("float32", 256000), ("float32", 32000))  # first first
FIELDS = ("device", "date", "commit", "dtype", "vocab", "n", "impl", "p", "num_warps",
          "values_per_thread", "n_regs", "n_spills", "occupancy", "grid", "ms", "x_copy",
          "x_fused", "max_err_vs_fused", "timeouts", "note")


def bench(out: str, n: int = 8192, cases=BENCH_CASES, ps=(2, 4, 8, 12, 16), warps=(8, 16, 32),
          budget_s: float = 90.0) -> None:
    """Times the sweep against torch_ref's fused forward + gradient and a clone (the copy
    floor: one read and one write); prints a table and writes `out` (CSV, row by row).
    Starts no configuration after budget_s seconds."""
    import datetime
    import time

    import torch

    deadline = time.time() + budget_s
    base = dict(device=torch.cuda.get_device_name(), n=n, commit=_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"))
    shown = FIELDS[3:]
    print(" ".join(f"{f:>{max(9, len(f))}s}" for f in shown), flush=True)
    with open(out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, FIELDS)
        writer.writeheader()

        def emit(**row):
            row = dict(base, **row)
            writer.writerow(row)
            fh.flush()
            print(" ".join(f"{_fmt(row.get(f, '')):>{max(9, len(f))}s}" for f in shown),
                  flush=True)

        for dt, vocab in cases:
            _bench_case(emit, n, dt, vocab, ps, warps, deadline)
            torch.cuda.empty_cache()


def _bench_case(emit, n, dt, vocab, ps, warps, deadline, device="cuda") -> None:
    import time

    import torch
    from triton.testing import do_bench

    from torch_ref.cross_entropy import _fwd

    x, y = make_inputs(n, vocab, getattr(torch, dt), device, seed=vocab)
    y = y.to(torch.int32)  # the labels every implementation gets, converted once
    good = (y == -100) | ((y >= 0) & (y < vocab))
    ones = torch.ones(n, device=device)
    copy_ms = do_bench(lambda: x.clone(), return_mode="median")
    fused = lambda: _fwd(x, y, ones, -100, 0.0, 0.0, None, True)
    fused_ms = do_bench(fused, return_mode="median")
    ref = fused()[3]
    emit(dtype=dt, vocab=vocab, impl="copy", ms=copy_ms, x_copy=1.0)
    emit(dtype=dt, vocab=vocab, impl="torch_ref_fused", ms=fused_ms, x_copy=fused_ms / copy_ms,
         x_fused=1.0)
    for p in ps:
        for w in warps:
            if not fits(vocab, p, w) or time.time() > deadline:
                continue
            row = dict(dtype=dt, vocab=vocab, impl="coop", p=p, num_warps=w,
                       values_per_thread=values_per_thread(vocab, p, w))
            info = {}
            grad = coop_ce_fwd_grad(x, y, p, w, info=info)[2]
            row.update(info, max_err_vs_fused=max_err(grad, ref, good))
            del grad
            if info.get("n_spills"):
                emit(**row, note="skipped: spills")
                continue
            ms = do_bench(lambda: coop_ce_fwd_grad(x, y, p, w), return_mode="median")
            emit(**row, ms=ms, x_copy=ms / copy_ms, x_fused=ms / fused_ms)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


# ----------------------------------------------------------------------------- sm_90 PTX
def sm90_compile(dtype: str = "bf16", p: int = 8, num_warps: int = 32, vocab: int = 128256):
    """Compiles coop_ce_kernel for sm_90 with the real compiler (no GPU needed; run in a
    process without TRITON_INTERPRET); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = coop_constexprs(vocab, p)
    names = [a for a in coop_ce_kernel.arg_names if a not in const]
    types = [f"*{dtype}", "*i32"] + ["i32"] * 5 + ["fp32"] * 2 + ["i32", "*i32"] + \
        ["*fp32"] * 3 + [f"*{dtype}"]
    sig = dict(zip(names, types), **{c: "constexpr" for c in const})
    # Pointers 16-byte aligned, as Triton's launcher specialises them (torch allocations are):
    # without it every load compiles to 2- or 4-byte scalar accesses.
    aligned = {(coop_ce_kernel.arg_names.index(a),): [["tt.divisibility", 16]]
               for a, t in zip(names, types) if t.startswith("*")}
    return triton.compile(ASTSource(coop_ce_kernel, sig, const, aligned),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


# (dtype, P, warps, V): P in {2, 4, 8} at 32 warps (each fits there), both dtypes.
PTX_CONFIGS = tuple((dt, p, 32, v) for dt in ("bf16", "fp32")
                    for p, v in ((2, 32000), (4, 32000), (8, 128256)))


def sm90_report(dtype: str, p: int, num_warps: int, vocab: int) -> dict:
    """ptx_summary and ptxas_usage of one configuration compiled for sm_90 (no loops list)."""
    ptx = sm90_compile(dtype, p, num_warps, vocab).asm["ptx"]
    summary = {k: v for k, v in ptx_summary(ptx).items() if k != "loops"}
    return dict(dtype=dtype, p=p, num_warps=num_warps, vocab=vocab, **summary,
                **ptxas_usage(ptx))


def _op(line: str) -> str:
    """The instruction of a PTX line without predicate and operands ("" for none)."""
    line = re.sub(r"^@!?%p\d+\s+", "", line.strip())
    return "" if not line or line.startswith(("$", "//", ".", "{", "}")) else line.split()[0]


def ptx_summary(ptx: str) -> dict:
    """What the synchronisation compiled to: the atomics, fences and acquire/release memory
    operations; the loops (backward branches) with their atomics, acquire loads and barriers;
    the global loads issued between the arrival (the acq_rel atomic) and the spin loop (the
    prefetch of the next row); the vector width of the global loads."""
    lines = ptx.splitlines()
    ops = [_op(ln) for ln in lines]
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\$L\w+):", ln))}
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L\w+);", ln)
        if m and labels.get(m.group(1), i) < i:
            body = [o for o in ops[labels[m.group(1)]:i + 1] if o]
            loops.append(dict(
                lines=(labels[m.group(1)], i), instructions=len(body),
                sync=sorted({o for o in body if o.startswith(("atom", "red")) or "acquire" in o}),
                bar_sync=sum(o.startswith(("bar.sync", "barrier")) for o in body),
                global_loads=sorted({o for o in body if o.startswith("ld.global")})))
    spin = [lp for lp in loops if any("acquire" in o for o in lp["sync"]) and
            lp["instructions"] < 40]
    arrive = next((i for i, o in enumerate(ops) if o.startswith("atom") and "acq_rel" in o), None)
    prefetch = ([o for o in ops[arrive:spin[0]["lines"][0]] if o.startswith("ld.global")]
                if arrive is not None and spin else [])
    return dict(sync_ops=sorted({o for o in ops if o.startswith(("atom", "red", "fence", "membar"))
                                 or "acquire" in o or "release" in o}),
                global_loads=sorted({o for o in ops if o.startswith("ld.global")}),
                loops=loops, spin_loops=spin, loads_between_arrival_and_spin=prefetch)


def ptxas_usage(ptx: str) -> dict:
    """Registers and spill bytes that ptxas -v reports for sm_90a (Triton's own ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        proc = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o",
                               os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill (stores|loads)", out)
    return dict(registers=int(regs.group(1)) if regs else None,
                spill_bytes=sum(int(b) for b, _ in spills), ptxas=out.strip()[-400:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="correctness on the GPU")
    parser.add_argument("--bench", action="store_true", help="time the sweep on the GPU")
    parser.add_argument("--ptx", action="store_true",
                        help="sm_90 PTX and ptxas summary as JSON (no GPU needed)")
    parser.add_argument("--out", default="coop_ce.csv", help="the --bench CSV")
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="--bench starts no configuration after this many seconds")
    args = parser.parse_args(argv)
    failures = 0
    if args.ptx:
        print(json.dumps([sm90_report(*cfg) for cfg in PTX_CONFIGS], indent=1))
    if args.check:
        failures = check()
    if args.bench:
        bench(args.out, budget_s=args.budget_s)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
