"""RL from hidden states: `linear_token_logprobs` (forward; forward + backward with per-token
cotangents) against its matmul floor and naive baselines, and weighted vs unweighted
`cross_entropy` on logits.

    source .whl/gpu-env.sh && python3 -m benchmarks.linear_rl --out $OUT/linear_rl
    python -m benchmarks.linear_rl --out /tmp/rl --smoke --n 64 --d 32 --v 1000   # CPU smoke

Shape: N=8192 tokens, D=4096, V=151936 (Qwen's vocabulary), bf16, weight `[D, V]`
(`--layout vd` for a tied `[V, D]` table); or `--n/--d/--v`. Rows (framework, impl, pass):
- "fwd": the log-probs alone (`logp`) and with the entropy (`logp+ent`): ours (implementation
  None: Triton on a GPU, through the fused statistics GEMM; `-matmul-walk`: with that GEMM off,
  the logits chunk by chunk and the row kernel), the XLA naive form (logits materialised,
  float32 log_softmax, gather, entropy), torch naive (the same in PyTorch), against one bare
  matmul `h W` (the floor);
- "fwd+bwd": the gradient (dH, dW) of `sum(a * logp + b * entropy)` with random per-token a,
  b (what a PPO/GRPO loss sends back): ours in each mode and its XLA twin, XLA naive, torch
  naive and torch_ref, against the three bare matmuls (`h W`, `G W^T`, `h^T G` with G given);
  "fwd+bwd-logp": the same for `sum(a * logp)` (no entropy: "lean" computes dH in its
  forward), ours "fast" and "lean" and XLA naive, against the same floor;
- "ce": value_and_grad of `cross_entropy` on `[N, V]` logits without and with `weights=`
  (per-token weights folded into the fused gradient: the two should match);
- "logits": `token_logprobs` on the same logits, forward only (rollout scoring), alone and
  with the entropy, and the XLA naive form of the latter: the shape of TRL's published
  log-prob + entropy figures (issue 29: 8192 tokens, V=151936, H100; 12.8 ms unfused, 0.89 ms
  fused).
Time: median / 20th / 80th percentile ms of the host wall of the jitted call in a loop
(benchmarks/timing.py). Memory: JAX `temp_gib` (XLA's temporaries, memory_analysis); PyTorch
`peak_gib` (max_memory_allocated beyond what was allocated before the call). Rows go to
`<out>/linear_rl.csv` with device, versions and commit.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU

from benchmarks import record, timing  # noqa: E402

GIB = float(1 << 30)
FIELDS = ["date", "device", "commit", "versions", "n", "d", "v", "dtype", "layout", "pass",
          "framework", "impl", "median_ms", "p20_ms", "p80_ms", "ratio_to_floor", "temp_gib",
          "peak_gib", "note"]
MODES = ("fast", "low_precision", "lean")
# Rows compiled with the statistics-only forward's fused GEMM off (_lm_head.GEMM_EPILOGUE).
MATMUL_WALK = "-matmul-walk"


def _jax_inputs(n, d, v, dtype, layout):
    """Inputs made on the host and copied over (a device generator's float32 temporaries
    would fill the memory counters)."""
    import jax
    import ml_dtypes
    import numpy as np

    np_dtype = {"bfloat16": ml_dtypes.bfloat16}.get(dtype, dtype)
    rng = np.random.default_rng(0)

    def normal(shape, scale=1.0, dt=np_dtype):
        return jax.device_put((rng.standard_normal(shape, np.float32) * scale).astype(dt))

    h = normal((n, d))
    w = normal((d, v) if layout == "dv" else (v, d), 0.02)
    y = jax.device_put(rng.integers(0, v, (n,), dtype=np.int32))
    a, b = normal((n,), 1.0, np.float32), normal((n,), 0.1, np.float32)
    return h, w, y, a, b, normal


def _jax_cases(n, d, v, dtype, layout):
    """{(pass, impl): (jitted fn, args)}."""
    import jax
    import jax.numpy as jnp

    import jax_fusedloss as jfl

    h, w, y, a, b, normal = _jax_inputs(n, d, v, dtype, layout)
    mm = (lambda h, w: h @ w) if layout == "dv" else (lambda h, w: h @ w.T)

    def naive(h, w, ent):
        z = mm(h, w).astype(jnp.float32)
        lp = jax.nn.log_softmax(z)
        logp = jnp.take_along_axis(lp, y[:, None], -1)[:, 0]
        return (logp, -jnp.sum(jnp.exp(lp) * lp, -1)) if ent else logp

    def ours(h, w, ent, mode="fast", impl=None):
        return jfl.linear_token_logprobs(h, w, y, weight_layout=layout, return_entropy=ent,
                                         mode=mode, implementation=impl)

    def objective(fn):
        def obj(h, w):
            logp, e = fn(h, w)
            return jnp.sum(a * logp) + jnp.sum(b * e)
        return jax.jit(jax.value_and_grad(obj, (0, 1)))

    cases = {("fwd", "matmul-floor"): (jax.jit(mm), (h, w))}
    for ent in (False, True):
        tag = "logp+ent" if ent else "logp"
        cases["fwd", f"ours-{tag}"] = (jax.jit(lambda h, w, ent=ent: ours(h, w, ent)), (h, w))
        # the same without the fused GEMM: the logits chunk by chunk, then the row kernel
        cases["fwd", f"ours-{tag}{MATMUL_WALK}"] = (jax.jit(
            lambda h, w, ent=ent: ours(h, w, ent)), (h, w))
        cases["fwd", f"xla-naive-{tag}"] = (jax.jit(lambda h, w, ent=ent: naive(h, w, ent)),
                                            (h, w))
    g = normal((n, v), 1e-3)
    floor = ((lambda h, w, g: (h @ w, g @ w.T, h.T @ g)) if layout == "dv" else
             (lambda h, w, g: (h @ w.T, g @ w, g.T @ h)))
    cases["fwd+bwd", "matmuls-floor"] = (jax.jit(floor), (h, w, g))
    for mode in MODES:
        cases["fwd+bwd", f"ours-{mode}"] = (objective(
            lambda h, w, mode=mode: ours(h, w, True, mode)), (h, w))
    cases["fwd+bwd", "ours-xla-fast"] = (objective(lambda h, w: ours(h, w, True, "fast", "xla")),
                                         (h, w))
    cases["fwd+bwd", "xla-naive"] = (objective(lambda h, w: naive(h, w, True)), (h, w))
    # log-probs alone (a GRPO loss without an entropy bonus): "lean" keeps dH in the forward
    for mode in ("fast", "lean"):
        cases["fwd+bwd-logp", f"ours-{mode}"] = (objective(
            lambda h, w, mode=mode: (ours(h, w, False, mode), 0.0)), (h, w))
    cases["fwd+bwd-logp", "xla-naive"] = (objective(lambda h, w: (naive(h, w, False), 0.0)),
                                          (h, w))
    x = normal((n, v), 2.0)
    wt = normal((n,), 1.0, "float32")
    cases["ce", "ours-unweighted"] = (jax.jit(jax.value_and_grad(
        lambda x: jfl.cross_entropy(x, y))), (x,))
    cases["ce", "ours-weighted"] = (jax.jit(jax.value_and_grad(
        lambda x, wt: jfl.cross_entropy(x, y, weights=wt))), (x, wt))

    def naive_logits(x):
        lp = jax.nn.log_softmax(x.astype(jnp.float32))
        return jnp.take_along_axis(lp, y[:, None], -1)[:, 0], -jnp.sum(jnp.exp(lp) * lp, -1)

    cases["logits", "ours-logp"] = (jax.jit(lambda x: jfl.token_logprobs(x, y)), (x,))
    cases["logits", "ours-logp+ent"] = (jax.jit(
        lambda x: jfl.token_logprobs(x, y, return_entropy=True)), (x,))
    cases["logits", "xla-naive-logp+ent"] = (jax.jit(naive_logits), (x,))
    return cases


def _run_jax(n, d, v, dtype, layout, smoke, rows, note, passes):
    from jax_fusedloss import _lm_head

    for (pss, name), (fn, args) in _jax_cases(n, d, v, dtype, layout).items():
        if passes and pss not in passes:
            continue
        try:
            _lm_head.GEMM_EPILOGUE = not name.endswith(MATMUL_WALK)
            try:
                compiled = fn.lower(*args).compile()
            finally:
                _lm_head.GEMM_EPILOGUE = True
            temp = timing.jax_temp_bytes(compiled)
            stats = timing.time_jax(lambda: compiled(*args), 1,
                                    sum(a.nbytes for a in args), smoke)
            rows.append(dict(**{"pass": pss}, framework="jax", impl=name, **stats._asdict(),
                             temp_gib=None if temp is None else temp / GIB))
            print(rows[-1], flush=True)
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            traceback.print_exc()
            note(f"jax {pss} {name}: {type(e).__name__}: {str(e)[-400:]}")


def _run_torch(n, d, v, dtype, smoke, rows, note, passes=()):
    import torch

    import torch_ref

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    dt = getattr(torch, dtype)
    h = torch.randn(n, d, device=dev, generator=gen).to(dt).requires_grad_(True)
    w = (torch.randn(v, d, device=dev, generator=gen) * 0.02).to(dt).requires_grad_(True)
    y = torch.randint(0, v, (n,), device=dev, generator=gen)
    a = torch.randn(n, device=dev, generator=gen)
    b = torch.randn(n, device=dev, generator=gen) * 0.1

    def naive(h, w):
        lp = torch.log_softmax(torch.nn.functional.linear(h, w).float(), -1)
        return lp.gather(-1, y[:, None])[:, 0], -(lp.exp() * lp).sum(-1)

    def fused(mode):
        return lambda h, w: torch_ref.linear_token_logprobs(h, w, y, weight_layout="vd",
                                                            return_entropy=True, mode=mode)

    cases = {("fwd", "torch-naive-logp+ent"): (naive, False),
             ("fwd+bwd", "torch-naive"): (naive, True)}
    if cuda:  # the interpreter on a CPU would take hours at a real shape
        cases.update({("fwd+bwd", f"torch_ref-{m}"): (fused(m), True) for m in ("fast", "lean")})
    input_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()
    for (pss, name), (fn, grad) in cases.items():
        if passes and pss not in passes:
            continue
        try:
            def call(fn=fn, grad=grad):
                if not grad:
                    with torch.no_grad():
                        return fn(h, w)
                logp, ent = fn(h, w)
                return torch.autograd.grad((a * logp).sum() + (b * ent).sum(), (h, w))

            stats = timing.time_torch(call, 1, input_bytes, cuda, smoke)
            peak = timing.torch_peak_bytes(call, 0, cuda)
            rows.append(dict(**{"pass": pss}, framework="torch", impl=name, **stats._asdict(),
                             peak_gib=None if peak is None else peak / GIB))
            print(rows[-1], flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            note(f"torch {pss} {name}: {type(e).__name__}: {str(e)[-400:]}")


def _ratios(rows) -> None:
    floors = {r["pass"]: r["median_ms"] for r in rows if r["impl"] in (
        "matmul-floor", "matmuls-floor")}
    for r in rows:
        floor = floors.get(r["pass"].removesuffix("-logp"))
        r["ratio_to_floor"] = None if floor is None or r["pass"] in ("ce", "logits") else (
            r["median_ms"] / floor)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for linear_rl.csv")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--layout", default="dv", choices=["dv", "vd"])
    p.add_argument("--smoke", action="store_true", help="3 samples per case (CPU check)")
    p.add_argument("--no-torch", action="store_true", help="JAX rows only")
    p.add_argument("--passes", default="",
                   help="comma-separated passes to run (fwd, fwd+bwd, fwd+bwd-logp, ce, "
                        "logits; torch rows: fwd, fwd+bwd); default all")
    args = p.parse_args(argv)
    rows, notes = [], []
    note = (lambda msg: (notes.append(msg), print("NOTE", msg, flush=True)))
    passes = set(filter(None, args.passes.split(",")))
    _run_jax(args.n, args.d, args.v, args.dtype, args.layout, args.smoke, rows, note, passes)
    if not args.no_torch:
        _run_torch(args.n, args.d, args.v, args.dtype, args.smoke, rows, note, passes)
    _ratios(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "linear_rl.csv"
    import jax

    common = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind,
                  commit=record.commit(), versions=record.versions(), n=args.n, d=args.d,
                  v=args.v, dtype=args.dtype, layout=args.layout)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        if new:
            writer.writeheader()
        for r in rows:
            writer.writerow(dict(common, **r))
        for msg in notes:
            writer.writerow(dict(common, framework="note", impl="", note=msg))
    for r in rows:
        ratio = r.get("ratio_to_floor")
        mem = r.get("temp_gib", r.get("peak_gib"))
        print(f"{r['pass']:8s} {r['framework']:5s} {r['impl']:22s} {r['median_ms']:9.3f} ms"
              + ("" if ratio is None else f"  x{ratio:5.2f} floor")
              + ("" if mem is None else f"  mem {mem:6.2f} GiB"))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
