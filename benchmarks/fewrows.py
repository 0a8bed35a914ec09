"""Few-row calls as a JAX user gets them: many calls inside one jitted program.

At N <= 64 rows a call's GPU kernels take a few microseconds (CUPTI, `benchmarks.kernel_time`),
but what a JAX user pays is the program's time per call, launch gaps included. This tool jits
one program that applies an op to `--calls` different `[N, V]` inputs (no common
subexpressions; separate buffers, so no slicing copies) and reports the device time per call:
the GPU span of one execution of the program (CUPTI: first activity to the end of the last,
launch gaps included) / calls. Also the wall time per call, which at few rows is mostly the
host's dispatch of a program with 2 x calls arguments (equal for every implementation, and
not what a call costs inside a training step). For our implementations and XLA's own formula,
under several environments (each in its own process: XLA reads XLA_FLAGS once):

    source .whl/gpu-env.sh && python3 -m benchmarks.fewrows --out $OUT/fewrows

Variants: "default" (XLA's defaults: consecutive kernels run as CUDA graphs, XLA's command
buffers, which a legacy custom call ends), "nocmdbuf" (command buffers
off: every kernel launched on its own) and "legacy-call" (our kernels through jax-triton's
legacy custom call instead of jaxlib's typed-FFI one; XLA's flag that recorded legacy custom
calls into command buffers, --legacy_command_buffer_custom_call_targets, is gone from jaxlib
0.11.2). The row "triton-rowpath" forces one program per
row (no vocabulary split: one short launch for cross_entropy too, whose split forward is
partials + merge; the reductions' split forward merges in its own launch since 266cf71).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {  # environment of each worker process (XLA reads XLA_FLAGS once)
    "default": {},
    "nocmdbuf": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    # jax-triton's own lowering: the legacy custom call "triton_kernel_call" (we lower to the
    # typed-FFI "triton_kernel_call_ffi" by default, _triton_jax.call_target).
    "legacy-call": {"JFL_TRITON_CALL": "legacy"},
}
FIELDS = ["date", "device", "commit", "versions", "variant", "op", "n", "v", "dtype", "impl",
          "us_per_call", "p20_us", "p80_us", "wall_us_per_call", "calls"]


def _ops():
    import jax
    import jax.numpy as jnp

    import jax_fusedloss as jfl

    def xla_lse(x, y):
        return jax.nn.logsumexp(x.astype(jnp.float32), axis=-1)

    def xla_logp(x, y):
        z = jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0]

    def xla_ce(x, y):
        return jnp.mean(-xla_logp(x, y))

    def grad_of(loss):
        return lambda x, y: jax.grad(loss)(x, y)

    return {
        "logsumexp": (lambda impl: lambda x, y: jfl.logsumexp(x, implementation=impl), xla_lse),
        "token_logprobs": (lambda impl: lambda x, y: jfl.token_logprobs(x, y,
                                                                       implementation=impl),
                           xla_logp),
        "cross_entropy": (lambda impl: lambda x, y: jfl.cross_entropy(x, y, implementation=impl),
                          xla_ce),
        "cross_entropy_grad": (lambda impl: grad_of(
            lambda x, y: jfl.cross_entropy(x, y, implementation=impl)), grad_of(xla_ce)),
    }


def time_program(fn, inputs, reps: int) -> tuple[list[float], list[float]]:
    """Jits `[fn(*args) for args in inputs]` (one call per tuple of arrays in `inputs`):
    (wall seconds per execution of the program, device span seconds per execution).

    The wall clock includes the host's dispatch of a program with 2 x calls arguments, which
    at few rows is longer than the GPU work (about 1 ms against 0.3 ms for 64 logsumexp calls
    at N=1, H100): it is not what a call costs inside a bigger program. The device span is,
    from CUPTI (torch's profiler sees JAX's kernels too): first GPU activity (kernel, copy or
    memset) of an execution to the end of its last, launch gaps between the calls included."""
    import jax

    from benchmarks import timing

    # Separate arguments, not slices of one stacked array: a custom call's operand sliced out of
    # a bigger buffer is copied first (XLA fuses a slice only into its own kernels).
    f = jax.jit(lambda inputs: [fn(*args) for args in inputs])
    jax.block_until_ready(f(inputs))
    for _ in range(3):
        jax.block_until_ready(f(inputs))
    wall = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(inputs))
        wall.append(time.perf_counter() - t0)

    def run():
        for _ in range(reps):
            jax.block_until_ready(f(inputs))

    groups = timing.executions(timing.gpu_activities(run), reps)
    return wall, [timing.span_us(g) * 1e-6 for g in groups]


def worker(variant: str, ns, vocab: int, calls: int, reps: int, ops, impls) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jax_fusedloss.kernels import launch

    rows = []
    for op, (ours, xla_formula) in _ops().items():
        if op not in ops:
            continue
        for n in ns:
            xs = [jax.random.normal(jax.random.key(n * 1000 + i), (n, vocab), jnp.bfloat16)
                  for i in range(calls)]
            ys = [jax.random.randint(jax.random.key(n * 1000 + i + 500), (n,), 0, vocab)
                  for i in range(calls)]
            cases = [("triton", ours("triton")), ("xla-twin", ours("xla")),
                     ("xla-formula", xla_formula), ("triton-rowpath", ours("triton"))]
            for impl, fn in cases:
                if impl not in impls:
                    continue
                saved = launch.PROGRAMS_PER_SM
                if impl == "triton-rowpath":
                    launch.PROGRAMS_PER_SM = 0  # every N takes the one-program-per-row path
                try:
                    wall, spans = time_program(fn, list(zip(xs, ys)), reps)
                finally:
                    launch.PROGRAMS_PER_SM = saved
                dev = sorted(t / calls * 1e6 for t in spans)
                host = sorted(t / calls * 1e6 for t in wall)
                q = statistics.quantiles(dev, n=5)
                rows.append(dict(variant=variant, op=op, n=n, v=vocab, dtype="bf16", impl=impl,
                                 us_per_call=round(statistics.median(dev), 2),
                                 p20_us=round(q[0], 2), p80_us=round(q[-1], 2),
                                 wall_us_per_call=round(statistics.median(host), 2),
                                 calls=calls))
                print(f"[{variant:11s}] {op:18s} n={n:<3d} {impl:15s} "
                      f"device {statistics.median(dev):7.2f} us/call   "
                      f"wall {statistics.median(host):7.2f} us/call", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for fewrows.csv")
    p.add_argument("--ns", default="1,8,64")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--ops", default="logsumexp,token_logprobs,cross_entropy")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--impls", default="triton,xla-twin,xla-formula,triton-rowpath")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    ns = [int(n) for n in args.ns.split(",")]
    ops = args.ops.split(",")
    if args.worker:
        rows = worker(args.worker, ns, args.vocab, args.calls, args.reps, ops,
                      args.impls.split(","))
        print("ROWS " + json.dumps(rows), flush=True)
        return
    from benchmarks import record

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for variant in args.variants.split(","):
        env = dict(os.environ)
        for key, value in VARIANTS[variant].items():
            env[key] = (env.get(key, "") + " " + value).strip() if key == "XLA_FLAGS" else value
        cmd = [sys.executable, "-m", "benchmarks.fewrows", "--out", args.out, "--ns", args.ns,
               "--vocab", str(args.vocab), "--calls", str(args.calls), "--reps",
               str(args.reps), "--ops", args.ops, "--impls", args.impls, "--worker", variant]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.stdout.write("".join(line + "\n" for line in res.stdout.splitlines()
                                 if not line.startswith("ROWS ")))
        if res.returncode:
            sys.stdout.write(res.stderr[-4000:])
            continue
        for line in res.stdout.splitlines():
            if line.startswith("ROWS "):
                rows += json.loads(line[5:])
    import jax

    meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind,
                commit=record.commit(), versions=record.versions())
    with open(out / "fewrows.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({**meta, **r})
    print(f"wrote {out / 'fewrows.csv'} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
