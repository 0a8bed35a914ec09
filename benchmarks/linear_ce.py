"""Fused linear cross-entropy, forward + backward (dX, dW), against its floor and the anchors.

    python -m benchmarks.linear_ce --out out/linear_ce             # on the GPU (~2-3 min)
    python -m benchmarks.linear_ce --out out/lce --smoke --n 64 --d 32 --v 1000   # CPU smoke

Rows (bf16 by default, N=8192, D=4096, V=128256):
- jax_fusedloss.linear_cross_entropy: implementation "triton" with float32 and "input"
  accumulation of dW, and "xla";
- optax naive: logits = h @ W materialised, optax.softmax_cross_entropy_with_integer_labels;
- matmuls: the three bare matmuls of the step (h @ W, G @ W^T, h^T @ G with G given), the floor;
- PyTorch: torch naive (F.linear + F.cross_entropy), Liger's LigerFusedLinearCrossEntropyLoss
  and Apple's cut_cross_entropy.linear_cross_entropy when importable, torch_ref's autograd
  Function.

Median / 20th / 80th percentile ms (benchmarks/timing.py), and memory: `peak_gib` is the memory
beyond the inputs during forward + backward, gradients included (JAX: XLA's output + temp
bytes; PyTorch: max_memory_allocated beyond what was allocated before the call), `temp_gib`
XLA's temporaries. Rows go to `<out>/linear_ce.csv` with device, versions and commit.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import traceback
from pathlib import Path

from benchmarks import record, timing

GIB = float(1 << 30)
FIELDS = ["date", "device", "commit", "versions", "n", "d", "v", "dtype", "framework", "impl",
          "median_ms", "p20_ms", "p80_ms", "ratio_to_matmuls", "peak_gib", "temp_gib", "loss",
          "note"]


def _jax_cases(n, d, v, dtype, smoke, rows, note):
    import jax
    import jax.numpy as jnp
    import optax

    import jax_fusedloss as jfl

    dt = jnp.dtype(dtype)
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (n, d), jnp.float32).astype(dt)
    w = (jax.random.normal(k[1], (d, v), jnp.float32) * 0.02).astype(dt)
    y = jax.random.randint(k[2], (n,), 0, v)

    def ours(impl, accumulation):
        return lambda h, w: jfl.linear_cross_entropy(h, w, y, implementation=impl,
                                                     accumulation=accumulation)

    def optax_naive(h, w):
        return optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()

    cases = [("ours-triton-f32acc", ours("triton", "float32")),
             ("ours-triton-inputacc", ours("triton", "input")),
             ("ours-xla-f32acc", ours("xla", "float32")),
             ("optax-naive", optax_naive)]
    for name, loss_fn in cases:
        try:
            fn = jax.jit(jax.value_and_grad(loss_fn, (0, 1)))
            compiled = fn.lower(h, w).compile()
            ma = compiled.memory_analysis()
            stats = timing.time_jax(lambda: compiled(h, w), 1, h.nbytes + w.nbytes, smoke)
            loss = float(compiled(h, w)[0])
            peak = ma.output_size_in_bytes + ma.temp_size_in_bytes
            rows.append(dict(framework="jax", impl=name, **stats._asdict(), peak_gib=peak / GIB,
                             temp_gib=ma.temp_size_in_bytes / GIB, loss=loss))
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            traceback.print_exc()
            note(f"jax {name}: {type(e).__name__}: {e}")
        print(rows[-1] if rows else None, flush=True)

    g = (jax.random.normal(k[3], (n, v), jnp.float32) * 1e-3).astype(dt)

    def matmuls(h, w, g):
        return h @ w, g @ w.T, h.T @ g

    compiled = jax.jit(matmuls).lower(h, w, g).compile()
    ma = compiled.memory_analysis()
    stats = timing.time_jax(lambda: compiled(h, w, g), 1, h.nbytes + w.nbytes, smoke)
    rows.append(dict(framework="jax", impl="matmuls-floor", **stats._asdict(),
                     peak_gib=(ma.output_size_in_bytes + ma.temp_size_in_bytes) / GIB,
                     temp_gib=ma.temp_size_in_bytes / GIB, loss=float("nan")))
    print(rows[-1], flush=True)


def _torch_cases(n, d, v, dtype, smoke, rows, note):
    import torch
    import torch.nn.functional as F

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dt = getattr(torch, dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(n, d, device=dev, generator=gen).to(dt).requires_grad_(True)
    w_vd = (torch.randn(v, d, device=dev, generator=gen) * 0.02).to(dt).requires_grad_(True)
    y = torch.randint(0, v, (n,), device=dev, generator=gen)

    cases = {"torch-naive": lambda h, w: F.cross_entropy(F.linear(h, w).float(), y)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        cases["liger-flce"] = lambda h, w: liger(w, h, y)
    except Exception as e:  # noqa: BLE001 - a missing or broken anchor is skipped
        note(f"liger: {type(e).__name__}: {e}; skipped")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        cases["cut-cross-entropy"] = lambda h, w: cce(h, w, y)
    except Exception as e:  # noqa: BLE001
        note(f"cut_cross_entropy: {type(e).__name__}: {e}; skipped")
    try:
        import torch_ref

        cases["torch_ref-f32acc"] = lambda h, w: torch_ref.linear_cross_entropy(
            h, w, y, weight_layout="vd")
    except Exception as e:  # noqa: BLE001
        note(f"torch_ref: {type(e).__name__}: {e}; skipped")

    input_bytes = h.numel() * h.element_size() + w_vd.numel() * w_vd.element_size()
    for name, loss_fn in cases.items():
        try:
            def call(loss_fn=loss_fn):
                loss = loss_fn(h, w_vd)
                return loss.detach(), torch.autograd.grad(loss, (h, w_vd))

            stats = timing.time_torch(call, 1, input_bytes, cuda, smoke)
            peak = timing.torch_peak_bytes(call, 0, cuda)
            loss = float(call()[0])
            rows.append(dict(framework="torch", impl=name, **stats._asdict(),
                             peak_gib=None if peak is None else peak / GIB, temp_gib=None,
                             loss=loss))
            print(rows[-1], flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            note(f"torch {name}: {type(e).__name__}: {e}")
        if cuda:
            torch.cuda.empty_cache()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for linear_ce.csv")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--v", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--frameworks", default="jax,torch", help="comma list of jax, torch")
    p.add_argument("--smoke", action="store_true", help="few samples (CPU check of the script)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, notes = [], []

    def note(msg):
        print("note:", msg, flush=True)
        notes.append(msg)

    frameworks = args.frameworks.split(",")
    if "jax" in frameworks:
        _jax_cases(args.n, args.d, args.v, args.dtype, args.smoke, rows, note)
    if "torch" in frameworks:
        try:
            _torch_cases(args.n, args.d, args.v, args.dtype, args.smoke, rows, note)
        except Exception as e:  # noqa: BLE001 - e.g. torch missing: keep the JAX rows
            traceback.print_exc()
            note(f"torch: {type(e).__name__}: {e}")
    floor = next((r["median_ms"] for r in rows if r["impl"] == "matmuls-floor"), None)
    device = _device()
    common = dict(date=datetime.date.today().isoformat(), device=device,
                  commit=record.commit(), versions=record.versions(), n=args.n, d=args.d,
                  v=args.v, dtype=args.dtype)
    path = out / "linear_ce.csv"
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        if new:
            writer.writeheader()
        for r in rows:
            ratio = r["median_ms"] / floor if floor else None
            writer.writerow(dict(common, **r, ratio_to_matmuls=ratio, note=""))
        for msg in notes:
            writer.writerow(dict(common, framework="note", impl="", note=msg))
    print(f"\n{device}  N={args.n} D={args.d} V={args.v} {args.dtype}  fwd+bwd (dX, dW)")
    for r in rows:
        ratio = f"{r['median_ms'] / floor:5.2f}x" if floor else "  -  "
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{r['framework']:6s} {r['impl']:22s} {r['median_ms']:9.2f} ms {ratio}  "
              f"peak {peak} GiB  loss {r['loss']:.5f}")
    print(f"wrote {path}")


def _device() -> str:
    try:
        import jax

        return jax.devices()[0].device_kind.replace(",", " ")
    except Exception:  # noqa: BLE001
        return os.uname().nodename


if __name__ == "__main__":
    main()
