"""CPU section of the suite: the default (XLA twin) ops against optax / jax.nn on the host CPU.

    python -m benchmarks.cpu --out DIR [--ops cross_entropy,logsumexp] [--repeats 7]

Per case: forward (`fwd`) and value_and_grad of the mean loss w.r.t. the logits (`fwd_bwd`),
the median (and 20th/80th percentiles) of `--repeats` timed calls after two warm-up calls, the
implementations' calls interleaved,
each call one jitted program run to `block_until_ready` (host wall clock); and XLA's temporary
bytes of the compiled program (`memory_analysis().temp_size_in_bytes`). Baselines take the
float32 upcast of bf16 logits, as users of optax do. The CPU is often shared: the table says
the load average before and after the run, and the CSV keeps it with every row.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import time
from pathlib import Path

import numpy as np

CASES = ((4096, 32000, "fp32"), (4096, 32000, "bf16"), (8192, 32000, "bf16"))
COLUMNS = ("op", "impl", "mode", "n", "v", "dtype", "median_ms", "p20_ms", "p80_ms",
           "temp_bytes", "machine", "load", "versions", "commit", "date")


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} x{os.cpu_count()} cores"


def _impls(op: str):
    """{impl: loss(x, y) -> scalar} for one op; `y` is ignored by label-free ops."""
    import jax
    import jax.numpy as jnp
    import optax

    import jax_fusedloss as jfl

    f32 = jnp.float32
    if op == "cross_entropy":
        return {
            "jax_fusedloss": lambda x, y: jfl.cross_entropy(x, y),
            "optax": lambda x, y: optax.softmax_cross_entropy_with_integer_labels(
                x.astype(f32), y).mean(),
        }
    if op == "logsumexp":
        return {
            "jax_fusedloss": lambda x, y: jfl.logsumexp(x).mean(),
            "jax.nn": lambda x, y: jax.nn.logsumexp(x.astype(f32), axis=-1).mean(),
        }
    raise SystemExit(f"unknown op {op!r}")


def _time(fns: dict, args, repeats: int) -> dict:
    """{name: (median, p20, p80) ms} of `repeats` calls of each fn, interleaved (one call of
    each per round): on a 2-core machine a call's time drifts by 20-30% over a minute (page
    faults of the fresh [N, V] output), which back-to-back runs of one fn after the other
    turned into a bias between them."""
    import jax

    for fn in fns.values():
        for _ in range(2):
            jax.block_until_ready(fn(*args))
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: tuple(float(np.percentile(s, q)) for q in (50, 20, 80))
            for name, s in samples.items()}


def run(ops, cases, repeats: int, out: Path | None) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from benchmarks import record

    machine, versions, commit = _machine(), record.versions(), record.commit()
    date = datetime.date.today().isoformat()
    rows = []
    for n, v, dt in cases:
        dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dt]
        kx, ky = jax.random.split(jax.random.key(0))
        x = (3.0 * jax.random.normal(kx, (n, v), jnp.float32)).astype(dtype)
        y = jax.random.randint(ky, (n,), 0, v)
        for op in ops:
            for mode in ("fwd", "fwd_bwd"):
                jfs = {impl: jax.jit(loss if mode == "fwd" else jax.value_and_grad(loss))
                       for impl, loss in _impls(op).items()}
                times = _time(jfs, (x, y), repeats)
                for impl, jf in jfs.items():
                    temp = jf.lower(x, y).compile().memory_analysis().temp_size_in_bytes
                    med, p20, p80 = times[impl]
                    row = dict(op=op, impl=impl, mode=mode, n=n, v=v, dtype=dt,
                               median_ms=f"{med:.1f}", p20_ms=f"{p20:.1f}", p80_ms=f"{p80:.1f}",
                               temp_bytes=temp, machine=machine,
                               load=f"{os.getloadavg()[0]:.2f}", versions=versions,
                               commit=commit, date=date)
                    rows.append(row)
                    print(f"{op:14s} {impl:14s} {mode:8s} {n:6d} {v:7d} {dt:5s} "
                          f"{med:9.1f} [{p20:.1f}, {p80:.1f}] ms  temp {temp / 2**20:9.1f} MiB"
                          f"  load {row['load']}", flush=True)
                    if out is not None:
                        _append(out / "cpu.csv", row)
    return rows


def _append(path: Path, row: dict) -> None:
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(COLUMNS)
        w.writerow([row[c] for c in COLUMNS])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="directory for cpu.csv")
    p.add_argument("--ops", default="cross_entropy", help="comma-separated: cross_entropy,"
                   "logsumexp")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cases", default=None,
                   help="N:V:dtype,... (default 4096:32000:fp32,4096:32000:bf16,8192:32000:bf16)")
    a = p.parse_args(argv)
    cases = CASES if a.cases is None else tuple(
        (int(n), int(v), d) for n, v, d in (c.split(":") for c in a.cases.split(",")))
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
    print(f"# {_machine()}, load {os.getloadavg()}, {datetime.datetime.now():%Y-%m-%d %H:%M}")
    print(f"{'op':14s} {'impl':14s} {'mode':8s} {'N':>6s} {'V':>7s} {'dtype':5s} "
          f"{'median':>9s} [p20, p80]     temp")
    run(a.ops.split(","), cases, a.repeats, a.out)
    print(f"# load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
