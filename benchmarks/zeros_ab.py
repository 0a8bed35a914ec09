"""Where a few-row logsumexp's time goes inside a jitted program: its one launch with the
arrival counter zero-filled as the library does it (A: XLA copies a zero constant into the
counter the launch aliases), zero-filled by an XLA fusion that XLA cannot fold (C), and not
zero-filled at all (D: the counter is an uninitialised output, so the results are wrong; this
times the launch alone). Device time per call (CUPTI span / 64) of a program of 64 calls, bf16
V=128256, and the optimized HLO's ops of each form at N=1.

    source .whl/gpu-env.sh && python3 -m benchmarks.zeros_ab
"""
from __future__ import annotations

import re
import statistics

import jax
import jax.numpy as jnp

V = 128256
FORMS = ("A", "C", "D")


def _run_plan(form: str):
    """_triton_jax.run_plan with the aliased counter zero-filled as `form` says."""
    from jax_fusedloss import _triton_jax

    def run_plan(plan, results=None, **arrays):
        env = dict(arrays)
        x = next(iter(arrays.values()))
        dtypes = {"float32": jnp.float32, "int32": jnp.int32, "logits": x.dtype}
        for step in plan.launches:
            aliased = {i for i, _ in step.aliases}
            inputs = []
            for k, i in enumerate(step.inputs):
                if isinstance(i, str):
                    inputs.append(env[i])
                elif k in aliased and form == "C":  # zeros from the data: not foldable
                    bit = (x[0, 0] != x[0, 0]).astype(dtypes[i.dtype])
                    inputs.append(jnp.broadcast_to(bit, i.shape))
                else:
                    inputs.append(jnp.zeros(i.shape, dtypes[i.dtype]))
            outs = _triton_jax.launch(
                step.kernel, grid=step.grid, inputs=inputs, scalars=step.scalars,
                out_shapes=[jax.ShapeDtypeStruct(b.shape, dtypes[b.dtype])
                            for b in step.outputs],
                num_warps=step.num_warps, constexprs=step.constexprs,
                input_output_aliases={} if form == "D" else dict(step.aliases),
                maxnreg=step.maxnreg)
            env.update((b.name, o) for b, o in zip(step.outputs, outs))
        return tuple(env[name] for name in (plan.results if results is None else results))
    return run_plan


def main() -> None:
    import jax_fusedloss as jfl
    from benchmarks import record
    from benchmarks.fewrows import time_program
    from jax_fusedloss import _triton_jax

    print(f"# {jax.devices()[0].device_kind}, commit {record.commit()}, {record.versions()}")
    library = _triton_jax.run_plan
    try:
        for n in (1, 8):
            xs = [jax.random.normal(jax.random.key(n * 1000 + i), (n, V), jnp.bfloat16)
                  for i in range(64)]
            ys = [jnp.zeros((n,), jnp.int32)] * 64
            ref = jax.nn.logsumexp(xs[0].astype(jnp.float32), -1)
            res = []
            for form in FORMS * 2:
                _triton_jax.run_plan = _run_plan(form)

                def fn(x, y, form=form):
                    return jfl.logsumexp(x, implementation="triton")
                err = float(jnp.max(jnp.abs(jax.jit(fn)(xs[0], ys[0]) - ref)))
                if n == 1 and len(res) < len(FORMS):
                    txt = jax.jit(fn).lower(xs[0], ys[0]).compile().as_text()
                    ops = set(re.findall(r"= \S+ (\w[\w-]*)\(", txt)) - {
                        "parameter", "get-tuple-element", "tuple", "bitcast"}
                    print(form, "ops:", sorted(ops), flush=True)
                _, spans = time_program(fn, list(zip(xs, ys)), 20)
                res.append(f"{form}: {statistics.median(spans) / 64 * 1e6:.2f} ({err:.0e})")
            print(n, " | ".join(res), flush=True)
    finally:
        _triton_jax.run_plan = library


if __name__ == "__main__":
    main()
