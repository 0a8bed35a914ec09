"""Distillation from hidden states (linear_kd_loss, linear_distill_loss) forward + backward
(dH, dW) against the three bare matmuls and naive XLA; kd_loss's tail / jsd forms on logits
against the copy floor.

    source .whl/gpu-env.sh && python3 -m benchmarks.linear_kd --out $OUT/linear_kd
    python3 -m benchmarks.linear_kd --out $OUT/linear_kd --only matmuls,logits-  # a subset
    python -m benchmarks.linear_kd --out /tmp/lkd --smoke --n 64 --d 32 --v 1000 --k 8  # CPU

Default shape N=8192, D=4096, V=128256, K=64, bf16, weight `[V, D]`. Rows:
- matmuls-floor: the step's three bare matmuls (h W^T, G W, G^T h with G given);
- naive-{kd,distill}[-tail|-jsd]: logits materialised, full float32 log-softmax, a gather
  (the tail: a second log-sum-exp with the ids at -inf), XLA's autodiff;
- {kd,distill}-<impl>-<mode>[-tail|-jsd]: ours, implementation "triton" (the KD kernels,
  kernels/kd.py and kernels/kd_tail.py) or "xla" (the XLA rows), in each memory mode;
- logits-kd-{triton,tail,jsd}: kd_loss on `[N, V]` bf16 logits, fwd+bwd, implementation
  "triton" on a GPU (the tail forms: kernels/kd_tail.py), against the copy floor (read the
  logits once, write their gradient once, at the measured copy bandwidth, as
  benchmarks/run.py); logits-kd-xla-{tail,jsd}: the same through the XLA rows;
  logits-naive-kd[-tail|-jsd]: the naive XLA formula on the logits (full float32
  log-softmax, a gather, XLA's autodiff), against the same floor.
  `--only logits-` runs these rows alone; a later `--only` run into the same CSV takes
  its ratios from the matmuls-floor row an earlier one wrote (same commit, device, shape,
  day).
Time: median (20th-80th percentile) ms of the host wall of the jitted step in a loop
(benchmarks/timing.py). Memory: `temp_gib`, XLA's temporaries beyond inputs and outputs (the
buffer assignment's memory_analysis). Rows go to `<out>/linear_kd.csv` with device, versions
and commit.
"""
from __future__ import annotations

import argparse
import csv
import datetime
from pathlib import Path

from benchmarks import record, timing

GIB = float(1 << 30)
FIELDS = ["date", "device", "commit", "versions", "n", "d", "v", "k", "case", "median_ms",
          "p20_ms", "p80_ms", "x_floor", "temp_gib", "loss"]
FORMS = {"": {}, "-tail": dict(tail=True), "-jsd": dict(tail=True, divergence="jsd")}


def _inputs(n, d, v, k):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((n, d), np.float32) * 0.5, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v, d), np.float32) * 0.02, jnp.bfloat16)
    y = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    t = jnp.asarray(rng.standard_normal((n, v), np.float32) * 3, jnp.bfloat16)
    lp, ids = jax.jit(lambda t: jax.lax.top_k(jax.nn.log_softmax(t.astype(jnp.float32)), k))(t)
    return h, w, y, ids, lp, t


def _naive(fn, form, y, ids, lp):
    import jax
    import jax.numpy as jnp

    from tests.reference.kd_tail_ref import gathered_tokens

    def loss(h, w):
        z = (h @ w.T).astype(jnp.float32)
        kd = jnp.mean(gathered_tokens(z, ids, lp, **FORMS[form]))
        if fn == "kd":
            return kd
        ce = jnp.mean(jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, y[:, None], -1)[:, 0])
        return 0.5 * ce + 0.5 * kd
    return loss


def cases(smoke: bool) -> list[str]:
    names = ["matmuls-floor"]
    for fn in ("kd", "distill"):
        for form in FORMS:
            names.append(f"naive-{fn}{form}")
            modes = ("fast", "low_precision", "lean") if form != "-jsd" else ("fast", "lean")
            names += [f"{fn}-{'xla' if smoke else 'triton'}-{m}{form}" for m in modes]
    names += ["logits-kd-" + f for f in ("triton", "tail", "jsd", "xla-tail", "xla-jsd")]
    names += ["logits-naive-kd" + f for f in FORMS]
    return names


def _case(name, h, w, y, ids, lp, t):
    """(jitted fn, args, floor bytes or None) of one named case."""
    import jax

    import jax_fusedloss as jfl

    if name == "matmuls-floor":
        g = (t * 1e-3).astype(h.dtype)
        return jax.jit(lambda h, w, g: (h @ w.T, g @ w, g.T @ h)), (h, w, g), None
    if name.startswith("logits-naive-kd"):
        from tests.reference.kd_tail_ref import gathered_tokens

        opts = FORMS[name[len("logits-naive-kd"):]]
        fn = jax.value_and_grad(lambda x, ids, lp: jax.numpy.mean(gathered_tokens(x, ids, lp,
                                                                                  **opts)))
        return jax.jit(fn), ((t * 0.5).astype(t.dtype), ids, lp), 2 * t.nbytes
    if name.startswith("logits-kd-"):
        form = name.rsplit("-", 1)[1]
        opts = {"triton": {}, "tail": dict(tail=True),
                "jsd": dict(tail=True, divergence="jsd")}[form]
        impl = "triton" if jax.default_backend() == "gpu" else None
        if name.startswith("logits-kd-xla-"):
            impl = "xla"
        fn = jax.value_and_grad(lambda x, ids, lp: jfl.kd_loss(x, ids, lp, implementation=impl,
                                                                **opts))
        # a student unlike t; the teacher's arrays are arguments (as constants XLA would fold
        # their preparation into the program)
        return jax.jit(fn), ((t * 0.5).astype(t.dtype), ids, lp), 2 * t.nbytes
    form = "-" + name.split("-")[-1] if name.endswith(("-tail", "-jsd")) else ""
    base = name[:len(name) - len(form)]
    if base.startswith("naive-"):
        loss = _naive(base.split("-")[1], form, y, ids, lp)
        return jax.jit(jax.value_and_grad(loss, (0, 1))), (h, w), None
    fn, impl, mode = base.split("-", 2)

    def loss(h, w):
        if fn == "kd":
            return jfl.linear_kd_loss(h, w, ids, lp, weight_layout="vd", mode=mode,
                                      implementation=impl, **FORMS[form])
        return jfl.linear_distill_loss(h, w, y, ids, lp, alpha=0.5, weight_layout="vd",
                                       mode=mode, implementation=impl, **FORMS[form])
    return jax.jit(jax.value_and_grad(loss, (0, 1))), (h, w), None


def _earlier_floor(path: Path, meta: dict) -> float | None:
    """The matmuls-floor of an earlier invocation into the same CSV by the same commit on the
    same device, shape and day (a run split by --only), or None."""
    if not path.exists():
        return None
    keys = ("date", "device", "commit", "n", "d", "v", "k")
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["case"] == "matmuls-floor"
                and all(r[k] == str(meta[k]) for k in keys)]
    return float(rows[-1]["median_ms"]) if rows else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--only", default="",
                    help="comma-separated case-name prefixes (e.g. matmuls,naive-kd,kd-)")
    ap.add_argument("--smoke", action="store_true", help="one sample per case (CPU check)")
    args = ap.parse_args(argv)
    import jax

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    inputs = _inputs(args.n, args.d, args.v, args.k)
    bandwidth = timing.copy_bandwidth_jax(inputs[-1].nbytes, args.smoke)
    device = jax.devices()[0].device_kind
    print(f"{device}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; N={args.n} D={args.d} "
          f"V={args.v} K={args.k} bf16", flush=True)
    meta = dict(date=datetime.date.today().isoformat(), device=device, commit=record.commit(),
                versions=record.versions(), n=args.n, d=args.d, v=args.v, k=args.k)
    path = out / "linear_kd.csv"
    new = not path.exists()
    floor_ms = _earlier_floor(path, meta)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        if new:
            writer.writeheader()
        for name in cases(args.smoke):
            if args.only and not name.startswith(tuple(args.only.split(","))):
                continue
            try:
                fn, fargs, floor_bytes = _case(name, *inputs)
                compiled = fn.lower(*fargs).compile()
                temp = timing.jax_temp_bytes(compiled)
                stats = timing.time_jax(lambda: compiled(*fargs), 1,
                                        sum(a.nbytes for a in fargs), args.smoke)
                res = compiled(*fargs)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if name == "matmuls-floor":
                floor_ms = stats.median_ms
            ref = (floor_bytes / bandwidth * 1e3) if floor_bytes else floor_ms
            x = stats.median_ms / ref if ref else float("nan")
            loss = float("nan") if name == "matmuls-floor" else float(res[0])
            writer.writerow(dict(meta, case=name, median_ms=f"{stats.median_ms:.4g}",
                                 p20_ms=f"{stats.p20_ms:.4g}", p80_ms=f"{stats.p80_ms:.4g}",
                                 x_floor=f"{x:.3g}", temp_gib=f"{(temp or 0) / GIB:.3g}",
                                 loss=f"{loss:.6g}"))
            f.flush()
            what = "copy floor" if floor_bytes else "matmuls"
            print(f"{name:32s} {stats.median_ms:9.3f} ms ({stats.p20_ms:.3f}-{stats.p80_ms:.3f})"
                  f" = {x:5.2f}x {what}; temps {(temp or 0) / GIB:6.2f} GiB; loss {loss:.5g}",
                  flush=True)
    print(f"rows in {path}")


if __name__ == "__main__":
    main()
