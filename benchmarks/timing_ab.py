"""The JAX sample estimators side by side, in one process: G back-to-back calls' host time over
G (the suite's estimator until 2026-11-24) against the steady-state estimator of
`timing.time_jax` (G + 1 calls less the fixed cost, over G + 1), alternated, for a few
host-bound and GPU-bound cases of the suite, ours and a baseline each.

    source .whl/gpu-env.sh && python3 -m benchmarks.timing_ab
"""
from __future__ import annotations

import argparse
import time

from benchmarks import shapes, timing

CASES = (("cross_entropy", "fwd", 8, 128256, ("jax_fusedloss", "optax")),
         ("logsumexp", "fwd", 64, 128256, ("jax_fusedloss", "jnp_fp32")),
         ("cross_entropy", "fwd_bwd", 1, 128256, ("jax_fusedloss", "optax")),
         ("cross_entropy", "fwd_bwd", 8192, 128256, ("jax_fusedloss", "optax")),
         ("kd_loss", "fwd_bwd", 8192, 128256, ("jax_fusedloss", "jnp_fp32")))


def all_calls(call, out_bytes: int) -> float:
    """The former estimator: median over samples of (host time of G calls) / G, in ms."""
    import jax

    jax.block_until_ready(call())
    start = time.perf_counter()
    jax.block_until_ready(call())
    g, m = timing.plan(time.perf_counter() - start, out_bytes)
    samples = []
    for _ in range(m):
        start = time.perf_counter()
        for _ in range(g):
            out = call()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / g)
        del out
    return timing.summarize(samples).median_ms


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import jax

    from benchmarks import jax_impls, record

    print(f"# {jax.devices()[0].device_kind}, commit {record.commit()}, {record.versions()}")
    for op, mode, n, vocab, names in CASES:
        p = shapes.Problem(op, mode, n, vocab, shapes.teacher_k(op), "bf16", 0)
        inputs = jax_impls.make_inputs(p, 0)
        impls, _ = jax_impls.implementations(op, "bf16", set(names), True)
        for name in names:
            f = jax.jit(jax_impls.objective(impls[name], mode)).lower(*inputs).compile()
            out_bytes = sum(o.size * o.dtype.itemsize for o in jax.tree.leaves(
                jax.eval_shape(jax_impls.objective(impls[name], mode), *inputs)))
            old, new = [], []
            for _ in range(args.rounds):
                old.append(all_calls(lambda: f(*inputs), out_bytes))
                new.append(timing.time_jax(lambda: f(*inputs), 1, out_bytes).median_ms)
            print(f"{op} {mode} N={n} V={vocab} {name:14s} G calls / G: "
                  f"{' '.join(f'{t:.4f}' for t in old)} ms   steady state: "
                  f"{' '.join(f'{t:.4f}' for t in new)} ms", flush=True)


if __name__ == "__main__":
    main()
