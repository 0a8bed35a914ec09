"""Host clock against device time for the benchmark's target shapes (JAX, value_and_grad).

Its host column is 12 back-to-back calls' host time over 12, which includes what a run pays
once (dispatch of the first call, the wake-up after the last; `benchmarks.run` subtracts it
since 2026-11-24, see `benchmarks.timing`) and the gaps between consecutive programs. Inside a
training step the loss pays neither. This tool times the same programs both ways and lists
their GPU activities (CUPTI, through torch's profiler): device span per call = first GPU
activity of an execution to the end of its last, the op's own XLA kernels and the gaps
between them included.

    source .whl/gpu-env.sh && python3 -m benchmarks.device_span > $OUT/device_span.txt
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import shapes

CASES = ("cross_entropy:bf16:128256", "cross_entropy:fp32:128256", "cross_entropy:bf16:32000",
         "cross_entropy:bf16:50257", "cross_entropy:bf16:151936", "cross_entropy:bf16:256000",
         "kd_loss:bf16:128256", "distill_loss:bf16:128256")


def measure(op: str, dtype: str, vocab: int, n: int, calls: int = 12, samples: int = 10):
    """(host ms per call, device span ms per call, median gap between executions in us,
    {GPU activity: median us})."""
    import jax

    from benchmarks import jax_impls, timing

    p = shapes.Problem(op, "fwd_bwd", n, vocab, shapes.teacher_k(op), dtype, 0)
    inputs = jax_impls.make_inputs(p, 0)
    impls, _ = jax_impls.implementations(op, dtype, {"jax_fusedloss"}, True)
    f = jax.jit(jax_impls.objective(impls["jax_fusedloss"], "fwd_bwd"))
    for _ in range(5):
        jax.block_until_ready(f(*inputs))
    host = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            out = f(*inputs)
        jax.block_until_ready(out)
        host.append((time.perf_counter() - start) / calls)
        del out
    rounds = 3

    def run():
        for _ in range(rounds):
            for _ in range(calls):
                out = f(*inputs)
            jax.block_until_ready(out)
            del out

    groups = timing.executions(timing.gpu_activities(run), rounds * calls)
    spans = [timing.span_us(g) for g in groups]
    # between consecutive programs of one round (each round ends with a sync)
    gaps = [groups[i][0][0] - groups[i - 1][-1][1]
            for i in range(len(groups)) if i % calls]
    acts = {}
    for g in groups:
        for start, end, name in g:
            acts.setdefault(name[:40], []).append(end - start)
    return (statistics.median(host) * 1e3, statistics.median(spans) * 1e-3,
            statistics.median(gaps), {k: statistics.median(v) for k, v in acts.items()})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="op:dtype:vocab,...")
    ap.add_argument("--n", type=int, default=shapes.TARGET_N)
    ap.add_argument("--bandwidth-gbs", type=float, default=3020.0,
                    help="copy bandwidth for the floor (GB/s; benchmarks.run measures it)")
    args = ap.parse_args(argv)
    import jax

    from benchmarks import record

    print(f"# {jax.devices()[0].device_kind}, commit {record.commit()}, {record.versions()}; "
          f"N={args.n}, value_and_grad of the mean, floor at {args.bandwidth_gbs:.0f} GB/s")
    for case in args.cases.split(","):
        op, dtype, vocab = case.split(":")
        host, span, gap, acts = measure(op, dtype, int(vocab), args.n)
        floor = shapes.floor_bytes(op, "fwd_bwd", args.n, int(vocab), dtype) / (
            args.bandwidth_gbs * 1e9) * 1e3
        print(f"{op} {dtype} V={vocab}: host {host:.3f} ms ({host / floor:.3f}x floor), "
              f"device span {span:.3f} ms ({span / floor:.3f}x), gap between programs "
              f"{gap:.1f} us", flush=True)
        for name, us in sorted(acts.items(), key=lambda t: -t[1]):
            print(f"    {name:40s} {us:9.1f} us")


if __name__ == "__main__":
    main()
