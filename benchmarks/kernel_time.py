"""GPU kernel time per call of jax_fusedloss's forward ops at few rows, read from CUPTI.

`benchmarks.run` times JAX callables with the host clock, which at N <= 64 measures JAX's
dispatch more than the GPU. `--grad` times value_and_grad of the op's mean instead (which
kernels a training step runs, and how long each takes). This tool records the device
activity of the same jitted calls with the PyTorch profiler (CUPTI sees every kernel in the
process, JAX's included) and writes the sum of kernel durations per call, per kernel, to a
CSV:

    source .whl/gpu-env.sh && python3 -m benchmarks.kernel_time --out $OUT/kernel_time.csv
"""
from __future__ import annotations

import argparse
import csv
import datetime

import jax
import jax.numpy as jnp
import torch
from torch.profiler import ProfilerActivity, profile

import jax_fusedloss

OPS = {
    "logsumexp": lambda x, y, **kw: jax_fusedloss.logsumexp(x, **kw),
    "entropy": lambda x, y, **kw: jax_fusedloss.entropy(x, **kw),
    "token_logprobs": lambda x, y, **kw: jax_fusedloss.token_logprobs(x, y, **kw),
    "cross_entropy": lambda x, y, **kw: jax_fusedloss.cross_entropy(x, y, **kw),
}


def kernel_us_per_call(fn, x, y, calls: int = 100) -> dict[str, float]:
    f = jax.jit(fn)
    for _ in range(20):  # compile and warm up
        jax.block_until_ready(f(x, y))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            jax.block_until_ready(f(x, y))
    per_kernel: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            per_kernel[event.name] = per_kernel.get(event.name, 0.0) + event.self_device_time_total
    return {name: us / calls for name, us in per_kernel.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ns", default="1,8,64")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--impl", default=None, help="implementation= (default: None, auto)")
    parser.add_argument("--grad", action="store_true",
                        help="time value_and_grad of the op's mean instead of the op")
    args = parser.parse_args(argv)
    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    with open(args.out, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["op", "n", "v", "dtype", "kernel_us", "kernels", "device", "date"])
        for op in args.ops.split(","):
            kw = {"implementation": args.impl} if args.impl else {}
            fn = (lambda f: lambda x, y: f(x, y, **kw))(OPS[op])
            if args.grad:
                fn = (lambda f: lambda x, y: jax.value_and_grad(
                    lambda x: f(x, y).astype(jnp.float32).mean())(x))(fn)
                op += "_fwd_bwd"
            for n in map(int, args.ns.split(",")):
                x = jax.random.normal(jax.random.key(n), (n, args.vocab), jnp.bfloat16)
                y = jax.random.randint(jax.random.key(n + 1), (n,), 0, args.vocab)
                per_kernel = kernel_us_per_call(fn, x, y)
                total = sum(per_kernel.values())
                detail = ";".join(f"{k[:40]}={v:.2f}" for k, v in sorted(per_kernel.items()))
                writer.writerow([op, n, args.vocab, "bf16", f"{total:.2f}", detail, device, date])
                print(f"{op:15s} n={n:<3d} {total:6.2f} us of GPU kernels per call  ({detail})",
                      flush=True)


if __name__ == "__main__":
    main()
