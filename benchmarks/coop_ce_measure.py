"""Measurements of the co-operative cross-entropy prototype (benchmarks/coop_ce.py): the
--bench sweep (CSV), Nsight Compute's DRAM bytes per row, and the sm_90 PTX/ptxas report
(--ptx, no GPU needed). Run through `python -m benchmarks.coop_ce`.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import triton

from benchmarks.coop_ce import (REREAD_TILES, Reread, coop_ce_fwd_grad, coop_ce_kernel,
                                coop_constexprs, coop_reread_fwd_grad, fitting_ctas, fits,
                                make_inputs, max_err, sweep_configs, values_per_thread)

# ----------------------------------------------------------------------------- bench
BENCH_CASES = (("bfloat16", 128256), ("float32", 128256), ("bfloat16", 256000),
               ("bfloat16", 32000), ("float32", 256000), ("float32", 32000))  # first first
FIELDS = ("device", "date", "commit", "dtype", "vocab", "n", "impl", "p", "num_warps", "slice",
          "block", "ctas_per_sm", "evict", "prefetch", "values_per_thread", "n_regs",
          "n_spills", "occupancy", "grid", "ms", "x_copy", "x_fused", "max_err_vs_fused",
          "timeouts", "dram_read_per_row", "dram_write_per_row", "note")
SHOWN = ("dtype", "vocab", "impl", "p", "num_warps", "slice", "block", "ctas_per_sm", "evict",
         "prefetch", "n_regs", "occupancy", "grid", "ms", "x_copy", "x_fused",
         "max_err_vs_fused", "timeouts", "note")


def bench(out: str, n: int = 8192, cases=BENCH_CASES, variants=("reread",), configs=None,
          top: int = 3, ps=(2, 4, 8, 12, 16), warps=(8, 16, 32), budget_s: float = 150.0,
          ncu: str = "auto", device: str = "cuda") -> None:
    """Times coop_ce against torch_ref's fused forward + gradient and a clone (the copy
    floor: one read and one write); prints a table and writes `out` (CSV, row by row).

    variants "reread": the first case runs `configs` (default sweep_configs()), then the best
    one with eviction hints and prefetch toggled and at 1 and 2 CTAs per SM; the other cases
    run the `top` fastest of those. "reg": the register variant's P x warps sweep, every case.
    Starts no configuration after budget_s seconds. ncu ("auto": if on PATH, "on", "off"):
    then Nsight Compute's DRAM bytes per row of the best REREAD launch and of torch_ref's
    fused kernels on the first case."""
    import datetime

    import torch

    deadline = time.time() + budget_s
    base = dict(device=torch.cuda.get_device_name(), n=n, commit=_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"))
    print(" ".join(f"{f:>{max(9, len(f))}s}" for f in SHOWN), flush=True)
    timed = []  # (ms, config) of the first case
    with open(out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, FIELDS, extrasaction="ignore")
        writer.writeheader()

        def emit(**row):
            row = dict(base, **row)
            writer.writerow(row)
            fh.flush()
            print(" ".join(f"{_fmt(row.get(f, '')):>{max(9, len(f))}s}" for f in SHOWN),
                  flush=True)

        for i, (dt, vocab) in enumerate(cases):
            case = _Case(emit, n, dt, vocab, device)
            if "reg" in variants:
                case.register_sweep(ps, warps, deadline)
            if "reread" in variants and i == 0:
                timed = case.reread(configs or sweep_configs(), deadline)
                if timed:
                    timed += case.reread(ablations(min(timed)[1], [c for _, c in timed]),
                                         deadline)
            elif "reread" in variants:
                case.reread([c for _, c in sorted(timed)[:top]], deadline)
            del case
            torch.cuda.empty_cache()
        if timed and (ncu == "on" or (ncu == "auto" and shutil.which("ncu"))):
            for row in ncu_rows(n, *cases[0], min(timed)[1]):
                emit(**row)


def ablations(best: Reread, done) -> list:
    """The best launch with eviction hints, prefetch and both toggled, and at 1 and 2 CTAs
    per SM (1: the register variant's regime, nothing to hide the exchange)."""
    return [c for c in (best._replace(evict=not best.evict),
                        best._replace(prefetch=not best.prefetch),
                        best._replace(evict=not best.evict, prefetch=not best.prefetch),
                        best._replace(ctas=1), best._replace(ctas=2)) if c not in done]


class _Case:
    """One (dtype, V) of the sweep: inputs, the copy floor and the fused reference, timed."""

    def __init__(self, emit, n: int, dt: str, vocab: int, device: str = "cuda"):
        import torch
        from triton.testing import do_bench

        from torch_ref.cross_entropy import _fwd

        self.emit, self.dt, self.vocab = emit, dt, vocab
        self.x, y = make_inputs(n, vocab, getattr(torch, dt), device, seed=vocab)
        self.y = y.to(torch.int32)  # the labels every implementation gets, converted once
        self.good = (self.y == -100) | ((self.y >= 0) & (self.y < vocab))
        ones = torch.ones(n, device=device)
        self.copy_ms = do_bench(lambda: self.x.clone(), return_mode="median")
        fused = lambda: _fwd(self.x, self.y, ones, -100, 0.0, 0.0, None, True)
        self.fused_ms = do_bench(fused, return_mode="median")
        self.ref = fused()[3]
        emit(dtype=dt, vocab=vocab, impl="copy", ms=self.copy_ms, x_copy=1.0)
        emit(dtype=dt, vocab=vocab, impl="torch_ref_fused", ms=self.fused_ms,
             x_copy=self.fused_ms / self.copy_ms, x_fused=1.0)

    def _time(self, row: dict, fn, seen: set | None = None) -> float | None:
        """Runs fn once (info, error vs the fused gradient), then times it unless it spilled,
        timed out, asks for more CTAs per SM than fit or is a launch in `seen` (the knobs with
        CTAs per SM resolved); emits the row; returns ms or None."""
        from triton.testing import do_bench

        info = {}
        grad = fn(info=info)[2]
        row.update(info, dtype=self.dt, vocab=self.vocab,
                   max_err_vs_fused=max_err(grad, self.ref, self.good))
        del grad
        row["ctas_per_sm"] = row.get("ctas_per_sm") or info.get("occupancy")
        key = tuple(row.get(k) for k in ("impl", "p", "num_warps", "block", "ctas_per_sm",
                                         "evict", "prefetch"))
        why = ("spills" if info.get("n_spills") else "timeouts" if info["timeouts"] else
               "ctas > occupancy" if (row["ctas_per_sm"] or 0) > info.get("occupancy", 0)
               else "a launch timed above" if seen is not None and key in seen else None)
        if seen is not None:
            seen.add(key)
        if why:
            self.emit(**row, note=f"skipped: {why}")
            return None
        ms = do_bench(lambda: fn(), return_mode="median")
        self.emit(**row, ms=ms, x_copy=ms / self.copy_ms, x_fused=ms / self.fused_ms)
        return ms

    def register_sweep(self, ps, warps, deadline) -> None:
        for p in ps:
            for w in warps:
                if fits(self.vocab, p, w) and time.time() < deadline:
                    self._time(dict(impl="coop", p=p, num_warps=w,
                                    values_per_thread=values_per_thread(self.vocab, p, w)),
                               lambda p=p, w=w, **kw: coop_ce_fwd_grad(self.x, self.y, p, w,
                                                                       **kw))

    def reread(self, configs, deadline) -> list:
        """Times each REREAD launch; returns [(ms, config)] of those timed."""
        timed, seen = [], set()
        for cfg in configs:
            if time.time() > deadline:
                break
            row = dict(impl="coop_reread", p=cfg.p(self.vocab), num_warps=cfg.warps,
                       slice=cfg.slice, block=cfg.block, ctas_per_sm=cfg.ctas,
                       evict=int(cfg.evict), prefetch=int(cfg.prefetch),
                       values_per_thread=max(1, cfg.block // (32 * cfg.warps)))
            ms = self._time(row, lambda cfg=cfg, **kw: coop_reread_fwd_grad(self.x, self.y,
                                                                             cfg, **kw), seen)
            if ms is not None:
                timed.append((ms, cfg))
        return timed


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


# ----------------------------------------------------------------------------- Nsight Compute
NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sector_hit_rate.pct")
NCU_KERNELS = "regex:coop_ce_kernel|ce_fwd_kernel|ce_partial_kernel|ce_merge_kernel|ce_bwd_kernel"


def ncu_run(spec: str) -> None:
    """The child that ncu profiles: one torch_ref fused forward + gradient and one coop
    REREAD launch on the inputs the bench uses. spec: JSON {dtype, vocab, n, cfg}."""
    import torch

    from torch_ref.cross_entropy import _fwd

    s = json.loads(spec)
    x, y = make_inputs(s["n"], s["vocab"], getattr(torch, s["dtype"]), "cuda", seed=s["vocab"])
    y = y.to(torch.int32)
    _fwd(x, y, torch.ones(s["n"], device="cuda"), -100, 0.0, 0.0, None, True)
    coop_reread_fwd_grad(x, y, Reread(*s["cfg"]))
    torch.cuda.synchronize()


def ncu_rows(n: int, dt: str, vocab: int, cfg: Reread, timeout: int = 300) -> list[dict]:
    """CSV rows with Nsight Compute's DRAM bytes read and written per row (one call, caches
    flushed before each kernel, as ncu does by default) of the REREAD launch `cfg` and of
    torch_ref's fused kernels; the note gives bytes read over one read of the logits and the
    L2 hit rate. One row with the reason in its note if ncu fails."""
    spec = json.dumps(dict(dtype=dt, vocab=vocab, n=n, cfg=list(cfg)))
    cmd = [shutil.which("ncu") or "ncu", "--csv", "--print-units", "base", "--metrics",
           ",".join(NCU_METRICS), "-k", NCU_KERNELS, sys.executable, "-m", "benchmarks.coop_ce",
           "--ncu-run", spec]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        per_kernel = parse_ncu_csv(proc.stdout)
        if not per_kernel:
            raise RuntimeError(f"rc={proc.returncode}: {(proc.stdout + proc.stderr)[-400:]}")
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return [dict(dtype=dt, vocab=vocab, impl="ncu", note=f"ncu failed: {e}"[:600])]
    itemsize = 2 if dt == "bfloat16" else 4
    rows = []
    for impl, mine in (("ncu_coop_reread", lambda k: k.startswith("coop_ce")),
                       ("ncu_torch_ref_fused", lambda k: not k.startswith("coop_ce"))):
        kernels = {k: v for k, v in per_kernel.items() if mine(k)}
        read = sum(v.get(NCU_METRICS[0], 0.0) for v in kernels.values())
        write = sum(v.get(NCU_METRICS[1], 0.0) for v in kernels.values())
        hits = " ".join(f"{k}:{v.get(NCU_METRICS[2], float('nan')):.1f}%"
                        for k, v in kernels.items())
        row = dict(dtype=dt, vocab=vocab, impl=impl, dram_read_per_row=read / n,
                   dram_write_per_row=write / n,
                   note=f"read/one read={read / (n * vocab * itemsize):.3f} L2 hit {hits}")
        if impl == "ncu_coop_reread":
            row.update(p=cfg.p(vocab), num_warps=cfg.warps, slice=cfg.slice, block=cfg.block,
                       ctas_per_sm=cfg.ctas or None, evict=int(cfg.evict),
                       prefetch=int(cfg.prefetch))
        rows.append(row)
    return rows


def parse_ncu_csv(text: str) -> dict:
    """{kernel name: {metric: value}} from `ncu --csv` output (metrics summed over launches
    of the same kernel, except percentages, which keep the last)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return {}
    out: dict = {}
    for rec in csv.DictReader(lines[start:]):
        name = rec.get("Kernel Name", "").split("(")[0].strip()
        metric = rec.get("Metric Name")
        try:
            value = float(rec.get("Metric Value", "").replace(",", ""))
        except ValueError:
            continue
        stats = out.setdefault(name, {})
        pct = metric.endswith(".pct")
        stats[metric] = value if pct else stats.get(metric, 0.0) + value
    return out


# ----------------------------------------------------------------------------- sm_90 PTX
def sm90_compile(dtype: str = "bf16", p: int = 8, num_warps: int = 32, vocab: int = 128256,
                 **options):
    """Compiles coop_ce_kernel for sm_90 with the real compiler (no GPU needed; run in a
    process without TRITON_INTERPRET); `options`: coop_constexprs' keywords (block for
    REREAD). Returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = coop_constexprs(vocab, p, **options)
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


# Register variant (dtype, P, warps, V): P in {2, 4, 8} at 32 warps (each fits there).
PTX_CONFIGS = tuple((dt, p, 32, v) for dt in ("bf16", "fp32")
                    for p, v in ((2, 32000), (4, 32000), (8, 128256)))
# REREAD (dtype, V, config): the bench sweep's tiles x warps (the slice sets only P), then
# prefetch on and eviction hints off for two of them.
PTX_REREAD_CONFIGS = tuple((dt, 128256, cfg) for dt in ("bf16", "fp32") for cfg in (
    *(Reread(16384, b, w) for b, w in REREAD_TILES),
    Reread(16384, 2048, 4, prefetch=True), Reread(16384, 4096, 8, prefetch=True),
    Reread(16384, 2048, 4, evict=False)))


def sm90_report(dtype: str, p: int, num_warps: int, vocab: int, **options) -> dict:
    """ptx_summary and ptxas_usage of one configuration compiled for sm_90 (no loops list),
    with the CTAs per SM that its registers and shared memory allow (H100)."""
    compiled = sm90_compile(dtype, p, num_warps, vocab, **options)
    ptx = compiled.asm["ptx"]
    summary = {k: v for k, v in ptx_summary(ptx).items() if k != "loops"}
    usage = ptxas_usage(ptx)
    occ = fitting_ctas(usage["registers"] or 255, compiled.metadata.shared, num_warps)
    return dict(dtype=dtype, p=p, num_warps=num_warps, vocab=vocab, **options, **summary,
                **usage, shared=compiled.metadata.shared, occupancy=occ)


def sm90_reports() -> list[dict]:
    """sm90_report of every PTX_CONFIGS and PTX_REREAD_CONFIGS entry."""
    return [sm90_report(*cfg) for cfg in PTX_CONFIGS] + [
        dict(sm90_report(dt, cfg.p(v), cfg.warps, v, block=cfg.block, evict=cfg.evict,
                         prefetch=cfg.prefetch), slice=cfg.slice)
        for dt, v, cfg in PTX_REREAD_CONFIGS]


def _op(line: str) -> str:
    """The instruction of a PTX line without predicate and operands ("" for none)."""
    line = re.sub(r"^@!?%p\d+\s+", "", line.strip())
    return "" if not line or line.startswith(("$", "//", ".", "{", "}")) else line.split()[0]


def ptx_summary(ptx: str) -> dict:
    """What the synchronisation compiled to: the atomics, fences and acquire/release memory
    operations; the loops (backward branches) with their atomics, acquire loads and barriers;
    the global loads issued between the arrival (the acq_rel atomic) and the spin loop (the
    prefetch of the next row); the global loads and stores (vector width, cache hints)."""
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
                global_stores=sorted({o for o in ops if o.startswith("st.global")}),
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


