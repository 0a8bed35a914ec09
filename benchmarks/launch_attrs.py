"""How the same kernel is launched from JAX and from PyTorch: CUPTI's launch record of each kernel
(registers a thread, grid, block, shared memory, the profiler's occupancy estimate, duration).

    source .whl/gpu-env.sh && python -m benchmarks.launch_attrs > $OUT/launch_attrs.txt
    source .whl/gpu-env.sh && python -m benchmarks.launch_attrs --survey > $OUT/survey.txt

jax-triton hands jaxlib the PTX of a kernel and jaxlib turns it into machine code itself, while
PyTorch launches Triton's own cubin (its bundled ptxas): the two may allocate registers
differently, and for the one-launch split cross-entropy (kernels/cross_entropy
.ce_split_fused_kernel), whose programs of a row wait for each other, registers decide how many
programs run at once. Cases: cross_entropy value_and_grad / torch_ref forward + backward, bf16,
N=8192, V=256000 and 255999 (unaligned rows), CONFIGS below.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile

ARGS = ("registers per thread", "grid", "block", "shared memory", "est. achieved occupancy %",
        "blocks per SM", "warps per SM")
# launch.split_fused_config's choices for bf16 rows keeping a tile: the production one
# (launch.SPLIT_FUSED_KEPT: 4096-element tiles, 32 KiB slices, 48 registers), the same uncapped,
# and the earlier 8192 x 6 (8192-element tiles, 96 KiB slices)
CONFIGS = {"production": {}, "4096 x 16 uncapped": dict(SPLIT_FUSED_KEPT={2: (4096, 32 * 1024,
                                                                               None)}),
           "8192 x 6": dict(SPLIT_FUSED_KEPT={})}
VOCABS = (256000, 255999)


def kernel_records(run) -> list[dict]:
    """CUPTI kernel records (name, duration us, ARGS) of the GPU work of `run()`, through
    torch's profiler's Chrome trace (it sees JAX's kernels too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [dict(name=e["name"], dur=e.get("dur", 0.0),
                 **{k: e.get("args", {}).get(k) for k in ARGS})
            for e in events if e.get("cat") == "kernel"]


def _show(tag: str, records: list[dict]) -> None:
    seen = {}
    for r in records:
        seen.setdefault(r["name"], []).append(r)
    for name, rs in seen.items():
        if "split" not in name and "ce_fwd" not in name:
            continue
        r = rs[-1]
        durs = sorted(x["dur"] for x in rs)
        print(f"{tag}: {name[:40]:40s} median {durs[len(durs) // 2]:8.1f} us "
              + " ".join(f"{k}={r[k]}" for k in ARGS), flush=True)


def main():
    import torch

    print(f"# {torch.cuda.get_device_name()}; median of 5 calls after one", flush=True)
    for v in VOCABS:
        _vocab(v)


def _vocab(v: int) -> None:
    from unittest import mock

    import jax
    import jax.numpy as jnp
    import torch

    import jax_fusedloss
    import torch_ref
    from jax_fusedloss import _triton_jax
    from jax_fusedloss.kernels import launch

    n = 8192
    x = jax.random.normal(jax.random.key(0), (n, v), jnp.bfloat16) * 2
    y = jax.random.randint(jax.random.key(1), (n,), 0, v, jnp.int32)
    xt = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 2
    yt = torch.randint(0, v, (n,), device="cuda")
    for label, knobs in CONFIGS.items():
        with mock.patch.multiple(launch, **knobs) if knobs else contextlib.nullcontext():
            # jax-triton's compile cache keys on the kernel, constexprs and warps, not on the
            # register cap: compile each config afresh
            _triton_jax._jax_triton().triton_lib._COMPILED_KERNEL_CACHE.clear()
            f = jax.jit(jax.value_and_grad(lambda a: jax_fusedloss.cross_entropy(a, y)))

            def run_jax():
                for _ in range(5):
                    out = f(x)
                jax.block_until_ready(out)

            def run_torch():
                for _ in range(5):
                    a = xt.detach().requires_grad_(True)
                    torch_ref.cross_entropy(a, yt).backward()
                torch.cuda.synchronize()

            run_jax()
            run_torch()
            _show(f"V={v} {label} jax", kernel_records(run_jax))
            _show(f"V={v} {label} torch", kernel_records(run_torch))


SURVEY = (("cross_entropy", "bf16", 32000), ("cross_entropy", "bf16", 50257),
          ("cross_entropy", "bf16", 128256), ("cross_entropy", "bf16", 151936),
          ("cross_entropy", "fp32", 128256), ("kd_loss", "bf16", 50257),
          ("kd_loss", "bf16", 128256), ("distill_loss", "bf16", 128256),
          ("logsumexp", "bf16", 128256))


def survey():
    """--survey: registers a thread of every kernel of the suite's fwd_bwd at N=8192 for the
    SURVEY cases, launched from JAX (value_and_grad) and from torch_ref (backward)."""
    import torch

    print(f"# {torch.cuda.get_device_name()}; fwd_bwd, N=8192", flush=True)
    for op, dtype, v in SURVEY:
        for tag, regs in _survey_case(op, dtype, v).items():
            print(f"{op} {dtype} V={v} {tag}: " + ", ".join(
                f"{k} {n} regs x {b} threads {d} us" for k, (n, b, d) in regs.items()),
                flush=True)
        torch.cuda.empty_cache()


def _survey_case(op: str, dtype: str, v: int) -> dict:
    import jax
    import torch

    from benchmarks import jax_impls, shapes, torch_impls

    p = shapes.Problem(op, "fwd_bwd", 8192, v, shapes.teacher_k(op), dtype, 0)
    jimpls, _ = jax_impls.implementations(op, dtype, {"jax_fusedloss"}, True)
    f = jax.jit(jax_impls.objective(jimpls["jax_fusedloss"], "fwd_bwd"))
    jin = jax_impls.make_inputs(p, 0)
    timpls, _ = torch_impls.implementations(op, {"torch_ref"}, True)
    tin = torch_impls.make_inputs(p, 0, "cuda")
    tfn = torch_impls.objective(timpls["torch_ref"], "fwd_bwd")
    x = tin[0].detach().requires_grad_(True)

    def run_jax():
        jax.block_until_ready(f(*jin))

    def run_torch():
        tfn(x, *tin[1:])
        torch.cuda.synchronize()

    out = {}
    for tag, run in (("jax", run_jax), ("torch", run_torch)):
        run()
        out[tag] = {r["name"]: (r["registers per thread"], r["block"][0], round(r["dur"]))
                    for r in kernel_records(run) if r["name"].endswith("_kernel")}
    return out


if __name__ == "__main__":
    import sys

    survey() if "--survey" in sys.argv else main()
