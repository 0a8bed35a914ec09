"""Timing, peak memory and copy bandwidth for JAX and PyTorch callables.

Both frameworks are timed the same way: one *call* applies the op to R different input
buffers back to back (R > 1 only for inputs smaller than `ROTATE_BYTES`: a mid-sized input is
then not re-read from L2, and per-call overheads are amortised); one *sample* is G calls
issued back to back, divided by G * R; the figures are the median and the 20th/80th
percentiles of M samples, after warm-up (compilation excluded).

PyTorch samples are timed with CUDA events on the current stream: from the GPU's start of the
first call to its end of the last, launch gaps between calls included. JAX's stream is
invisible to them, so JAX samples use the host clock, which also counts what a sample pays
once: the dispatch of its first call until the GPU starts, and the host's wake-up after the
last (~0.3 ms on H100; see SAMPLE_S). A training loop, which dispatches each step while the
GPU runs the previous one, never pays that, so a JAX sample is the steady-state time per call
(`time_jax`): the host time of G + 1 calls less that fixed cost, over G + 1, the fixed cost
estimated from runs of 1 call against runs of G + 1 (each run ended by `block_until_ready`).
Like the CUDA events it keeps every gap between consecutive programs, and a call whose
dispatch outlasts its GPU work is timed by its dispatch.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, NamedTuple

import numpy as np

ROTATE_BYTES = 64 << 20  # rotate inputs until a call touches this much (H100 L2 is 50 MiB)
# ... but at most this many copies: each is one more op to compile, and 8 ops of a few us
# already outlast the host's dispatch of one call.
MAX_ROTATE = 8
# A sample lasts at least this long. A JAX run's fixed cost (the host's first dispatch until the
# GPU starts, and the wake-up after the last call) is ~0.3 ms, not one launch latency: H100,
# jitted value_and_grad of cross_entropy, bf16 [8192, 128256], host time per call of G calls,
# G = 1 / 3 / 6 / 10: 1.88 / 1.70 / 1.63 / 1.61 ms (optax 3.23 / 2.97 / 2.93 / 2.91 ms).
# Until 2026-11-24 (eighth session) JAX samples were G calls' host time over G, so that cost
# stayed in at ~1.5-3% of a few-ms call; since then time_jax subtracts it (module docstring).
SAMPLE_S = 20e-3
CASE_S = 0.15  # time spent sampling one case (after warm-up)
MIN_SAMPLES, MAX_SAMPLES = 10, 40
# JAX allocates a call's outputs when it is enqueued, so the G calls of a sample can hold G
# gradients at once: bound their bytes (a 2 GiB gradient still gets G = 5).
MAX_INFLIGHT_BYTES = 32 << 30


class Stats(NamedTuple):
    median_ms: float
    p20_ms: float
    p80_ms: float


def summarize(samples_s) -> Stats:
    """Median and 20th/80th percentiles (ms) of per-op times in seconds."""
    ms = np.asarray(samples_s, np.float64) * 1e3
    return Stats(*(float(np.percentile(ms, q)) for q in (50, 20, 80)))


def rotations(input_bytes: int, cap: int = MAX_ROTATE) -> int:
    """R: how many different input buffers one call walks through."""
    return int(min(cap, max(1, math.ceil(ROTATE_BYTES / max(input_bytes, 1)))))


def plan(call_s: float, out_bytes: int, smoke: bool = False) -> tuple[int, int]:
    """(G, M): calls per sample and samples, from one warm call's duration in seconds."""
    g = max(1, math.ceil(SAMPLE_S / max(call_s, 1e-7)))
    g = int(min(g, 256, max(1, MAX_INFLIGHT_BYTES // max(out_bytes, 1))))
    m = int(CASE_S / max(g * call_s, 1e-9))
    m = min(max(m, MIN_SAMPLES), MAX_SAMPLES)
    return (1, 3) if smoke else (g, m)


# ----------------------------------------------------------------------------- JAX
def time_jax(call: Callable[[], Any], ops: int, out_bytes: int,
             smoke: bool = False) -> Stats:
    """Times `call()` (a compiled JAX function bound to its inputs) doing `ops` ops at steady
    state: what every run pays once cancels (module docstring).

    Each sample times a run of 1 call and a run of G + 1 calls, both ended by
    `block_until_ready`: one = F + c, total = F + (G + 1) c for a fixed cost F and a call's
    time c. F is estimated once, as the median over samples of ((G + 1) one - total) / G,
    held within [0, half the shortest total], and each sample is (total - F) / (G + 1):
    positive even where F is lost in the noise (a loaded CPU, tiny ops), c where it is not.
    (The run of 2c17c29 took (total - one) / G sample by sample, which a loaded CPU once
    drove below 0 at a tiny shape.)"""
    import jax

    def run(calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
        jax.block_until_ready(out)
        return time.perf_counter() - start

    jax.block_until_ready(call())  # warm-up: first execution, allocator growth
    one = run(1)
    per_call = (run(3) - one) / 2  # G from the steady-state time, not the fixed cost
    g, m = plan(per_call if per_call > 0 else one, out_bytes, smoke)
    g = max(g, 2)
    ones, totals = [], []
    for _ in range(m):
        ones.append(run(1))
        totals.append(run(g + 1))
    fixed = float(np.median([((g + 1) * o - t) / g for o, t in zip(ones, totals)]))
    fixed = min(max(fixed, 0.0), 0.5 * min(totals))
    return summarize([(t - fixed) / ((g + 1) * ops) for t in totals])


def jax_peak_bytes(compiled, per_call: int) -> int | None:
    """Arguments + outputs + temporaries of one op, from XLA's buffer assignment.

    With R ops per executable, arguments and outputs are divided by R and the temporaries are
    kept whole (XLA may or may not reuse them between the R ops): an upper bound.
    """
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return None
    if ma is None:
        return None
    io = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    return int(io // per_call + ma.temp_size_in_bytes)


def jax_temp_bytes(compiled) -> int | None:
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001
        return None


def copy_bandwidth_jax(nbytes: int, smoke: bool = False) -> float:
    """Bytes read + written per second by a large device-to-device pass (`x * 2` in bf16).

    The fallback when no PyTorch worker measured `copy_bandwidth_torch` in the same run.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    double = jax.jit(lambda a: a * 2).lower(x).compile()  # exact; one read + one write
    stats = time_jax(lambda: double(x), 1, x.nbytes, smoke)
    return 2 * x.nbytes / (stats.median_ms * 1e-3)


# ----------------------------------------------------------------------------- PyTorch
def time_torch(call: Callable[[], Any], per_call: int, out_bytes: int, cuda: bool,
               smoke: bool = False) -> Stats:
    """Times `call()` doing `per_call` ops with CUDA events (host clock on the CPU)."""
    import torch

    def sync():
        if cuda:
            torch.cuda.synchronize()

    call()  # warm-up: Triton compiles, allocator growth
    sync()
    start = time.perf_counter()
    call()
    sync()
    g, m = plan(time.perf_counter() - start, out_bytes, smoke)
    if not cuda:
        samples = []
        for _ in range(m):
            start = time.perf_counter()
            for _ in range(g):
                call()
            samples.append((time.perf_counter() - start) / (g * per_call))
        return summarize(samples)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(m)]
    for begin, end in events:
        begin.record()
        for _ in range(g):
            call()
        end.record()
    sync()
    return summarize([begin.elapsed_time(end) * 1e-3 / (g * per_call) for begin, end in events])


def torch_peak_bytes(call_once: Callable[[], Any], input_bytes: int, cuda: bool) -> int | None:
    """Input bytes + the most memory allocated during one op beyond what was allocated before.

    Comparable to JAX's arguments + outputs + temporaries; the op's outputs are kept alive
    until the peak is read. None on the CPU.
    """
    if not cuda:
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = call_once()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return int(input_bytes + peak)


def copy_bandwidth_torch(nbytes: int, cuda: bool, smoke: bool = False) -> float:
    """Bytes read + written per second by `dst.copy_(src)` of `nbytes` (median of samples)."""
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda" if cuda else "cpu")
    dst = torch.empty_like(src)
    stats = time_torch(lambda: dst.copy_(src), 1, 0, cuda, smoke)
    moved = 2 * src.numel() * src.element_size()
    src = dst = None  # free before empty_cache (the lambda is done with them)
    if cuda:
        torch.cuda.empty_cache()
    return moved / (stats.median_ms * 1e-3)


def gpu_activities(run: Callable[[], Any]) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU activity (kernel, copy, memset) while `run()`
    executes, sorted by start: CUPTI through torch's profiler, which sees JAX's kernels too."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    return sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA"), key=lambda t: t[0])


def executions(activities: list, count: int) -> list[list]:
    """Splits the activities of `count` executions of one program (each runs the same number
    of GPU activities, one after another) into one group per execution."""
    per_exec, rest = divmod(len(activities), count)
    if per_exec == 0 or rest:
        raise RuntimeError(f"{len(activities)} GPU activities in {count} executions: not one "
                           "program's worth each")
    return [activities[i * per_exec:(i + 1) * per_exec] for i in range(count)]


def span_us(group: list) -> float:
    """First start to last end of a group of (start us, end us, ...) activities."""
    return max(a[1] for a in group) - group[0][0]
