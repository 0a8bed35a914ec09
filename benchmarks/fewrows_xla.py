"""Few-row log-sum-exp written in XLA several ways, timed as a JAX user gets it (issue 11 item
2): us per call inside one jitted program of `--calls` calls (benchmarks.fewrows' method).

    source .whl/gpu-env.sh && python3 -m benchmarks.fewrows_xla > $OUT/fewrows_xla.txt

Formulations of lse over bf16 [N, V] rows with float32 math: `formula` (jax.nn.logsumexp of
the upcast, the baseline), `onepass` (the twin's one variadic reduction,
_xla/chunks.one_pass_stats), `two_msB` / `two_opB` (rows reshaped to [N, B, V/B]: max + sum
exp, or the one-pass reduction, over V/B, then B partials merged) and `triton` (our kernels
through jax-triton). Two rounds in opposite orders; the summary is their mean, as a ratio to
`formula`. Result on H100 (2026-11-24): benchmarks/results/fewrows_xla_h100.txt, measured
with the wall clock of the program (mostly its host dispatch at these sizes) before
benchmarks.fewrows switched to the device span; not re-run since.
"""
from __future__ import annotations

import argparse
import statistics


def variants(vocab: int) -> dict:
    import jax
    import jax.numpy as jnp

    import jax_fusedloss as jfl
    from jax_fusedloss._xla.chunks import lse_from_stats, one_pass_stats, safe_max

    f32 = jnp.float32

    def formula(x):
        return jax.nn.logsumexp(x.astype(f32), axis=-1)

    def onepass(x):
        return lse_from_stats(*one_pass_stats(x.astype(f32)))

    def merge(m_b, s_b):
        m = m_b.max(-1)
        return lse_from_stats(m, (s_b * jnp.exp(m_b - safe_max(m)[:, None])).sum(-1))

    def two_ms(b):
        def f(x):
            z = x.astype(f32).reshape(x.shape[0], b, vocab // b)
            m_b = z.max(-1)
            return merge(m_b, jnp.exp(z - safe_max(m_b)[..., None]).sum(-1))
        return f

    def two_op(b):
        def f(x):
            n = x.shape[0]
            m_b, s_b = one_pass_stats(x.astype(f32).reshape(n * b, vocab // b))
            return merge(m_b.reshape(n, b), s_b.reshape(n, b))
        return f

    out = {"formula": formula, "onepass": onepass,
           "triton": lambda x: jfl.logsumexp(x, implementation="triton")}
    for b in (64, 128, 256):
        if vocab % b == 0:
            out[f"two_ms{b}"] = two_ms(b)
            out[f"two_op{b}"] = two_op(b)
    return out


def main(argv=None) -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.fewrows import time_program

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--ns", default="1,8,64")
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    ns = [int(n) for n in args.ns.split(",")]
    fns = variants(args.vocab)
    print(f"# {jax.devices()[0].device_kind}, bf16 V={args.vocab}, {args.calls} calls/program")
    res: dict = {}
    for rnd in range(2):
        for n in ns:
            xs = [jax.random.normal(jax.random.key(n * 1000 + i), (n, args.vocab), jnp.bfloat16)
                  for i in range(args.calls)]
            ref = fns["formula"](xs[0])
            for name in (list(fns) if rnd == 0 else list(reversed(fns))):
                fn = fns[name]
                err = float(jnp.abs(fn(xs[0]) - ref).max())
                _, spans = time_program(fn, [(x,) for x in xs], args.reps)
                t = sorted(s / args.calls * 1e6 for s in spans)  # device time per call
                res.setdefault((n, name), []).append(statistics.median(t))
                print(f"round {rnd} n={n:<3d} {name:10s} {statistics.median(t):7.2f} us/call  "
                      f"err {err:.1e}", flush=True)
    print("SUMMARY (mean of the rounds' medians, ratio to formula)")
    for n in ns:
        base = statistics.mean(res[(n, "formula")])
        for name in fns:
            v = statistics.mean(res[(n, name)])
            print(f"n={n:<3d} {name:10s} {v:7.2f} us  x{v / base:.2f}")


if __name__ == "__main__":
    main()
