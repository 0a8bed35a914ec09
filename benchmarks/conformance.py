"""The numerical conformance suite (issue 31): every case of benchmarks.conformance_cases on
every implementation of benchmarks.conformance_impls, against float64, in one run.

    python -m benchmarks.conformance --out DIR [--cases a,b] [--impls a,b] [--publish]
    python -m benchmarks.conformance --render CSV      # docs/conformance.rst from a run's CSV

Writes DIR/conformance.csv (one row per case x dtype x implementation: pass / FAIL / n/a /
error, the measured error, the device, date, versions and commit) and DIR/conformance.rst.
`--publish` also copies the CSV to benchmarks/results/conformance_{cpu,gpu}.csv and regenerates
docs/conformance.rst from it. Without a CUDA GPU, Triton runs in its interpreter and only ours,
optax and plain JAX/PyTorch run (the GPU-only case is "n/a: GPU only"). A failing
implementation never stops the run: its cell reads "error: ...".
"""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import os
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("case", "dtype", "op", "impl", "status", "error", "tol", "metric", "detail",
           "seconds", "device", "date", "versions", "commit")


def _setup_env() -> bool:
    """Environment before jax or triton is imported; True on a CUDA GPU."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    # JAX hands freed buffers back at once: jax and torch take turns with N * V > 2**31.
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    from jax_fusedloss._triton_jax import on_cuda_gpu  # imports jax, not triton

    gpu = on_cuda_gpu()
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    return gpu


def _versions() -> str:
    from benchmarks import record

    extra = []
    for name in ("cut-cross-entropy", "flax"):
        try:
            extra.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return " ".join([record.versions()] + extra)


def _device(gpu: bool) -> str:
    if gpu:
        import jax

        return f"{jax.devices()[0].device_kind} x{jax.device_count()}"
    from benchmarks.cpu import _machine

    return f"CPU ({_machine()}), Triton interpreter"


def evaluate(case, dtype: str, impl, gpu: bool, inp, expected) -> dict:
    """One cell: {status, error, detail, seconds}."""
    from benchmarks import conformance_impls as ci
    from benchmarks.conformance_metrics import METRICS

    opts = case.opts()
    if case.gpu_only and not gpu:
        return dict(status="n/a", detail="GPU only")
    reason = ci.unsupported(impl, case.op, case.required())
    if reason:
        return dict(status="n/a", detail=reason)
    try:
        impl.probe()
    except ImportError as e:
        return dict(status="n/a", detail=f"not installed ({e})")
    start = time.perf_counter()
    try:
        value, grad = ci.run_cell(impl, case.op, inp, opts)
        per_row = inp.rows is not None and getattr(value, "ndim", 0) > 0
        got = (ci.as_f64(value, inp.rows if per_row else None), ci.as_f64(grad, inp.rows))
        del value, grad
        errors = [METRICS[c.metric](got, expected, inp, opts) for c in case.checks]
    except NotImplementedError as e:
        return dict(status="n/a", detail=str(e).removeprefix("n/a: "))
    except Exception as e:  # noqa: BLE001 - one implementation's failure is one cell
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        return dict(status="error", detail=msg[:200], seconds=time.perf_counter() - start)
    finally:
        ci.release_memory()
    bad = [(c, err, det) for c, (err, det) in zip(case.checks, errors)
           if not err <= c.tol[dtype]]
    detail = "; ".join(f"{c.metric}={err:.2g} > {c.tol[dtype]:.3g} {det}".strip()
                       for c, err, det in bad) or "; ".join(d for _, d in errors if d)
    shown, err = (bad[0][0], bad[0][1]) if bad else (case.checks[0], errors[0][0])
    return dict(status="FAIL" if bad else "pass", error=err, metric=shown.metric,
                tol=shown.tol[dtype], detail=detail, seconds=time.perf_counter() - start)


def case_rows(case, dtype: str, impls, gpu: bool):
    """Yields (impl name, cell) for one case and dtype, building its inputs and oracle once."""
    import numpy as np

    from benchmarks.conformance_metrics import oracle

    inp = expected = None
    if not (case.gpu_only and not gpu):
        try:
            inp = case.build(np.random.default_rng(case.seed), dtype, gpu)
            expected = oracle(case.op, inp, case.opts())
        except Exception as e:  # noqa: BLE001 - a case that cannot be built is one row
            for impl in impls:
                yield impl.name, dict(status="error", detail=f"inputs or oracle: {e}"[:200])
            return
    for impl in impls:
        yield impl.name, evaluate(case, dtype, impl, gpu, inp, expected)


def run(out: Path, case_names, impl_names, budget_s: float) -> Path:
    gpu = _setup_env()
    from benchmarks import conformance_cases as cc
    from benchmarks import conformance_impls as ci
    from benchmarks.record import commit

    impls = [ci.BY_NAME[n] for n in impl_names] if impl_names else [
        i for i in ci.IMPLS if gpu or not i.gpu_only]
    cases = [cc.BY_NAME[n] for n in case_names] if case_names else list(cc.CASES)
    meta = dict(device=_device(gpu), date=f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
                versions=_versions(), commit=commit())
    print(f"# {meta['device']} | {meta['versions']} | {meta['commit']}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "conformance.csv"
    spent = {i.name: 0.0 for i in impls}
    start = time.perf_counter()
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for case in cases:
            for dtype in case.dtypes:
                over = [i for i in impls if spent[i.name] > budget_s]
                for name, cell in case_rows(case, dtype, [i for i in impls if i not in over],
                                            gpu):
                    spent[name] += cell.get("seconds", 0.0)
                    _write(writer, case, dtype, name, cell, meta)
                for i in over:
                    _write(writer, case, dtype, i.name,
                           dict(status="n/a", detail="skipped: time budget"), meta)
                f.flush()
    print(f"# {time.perf_counter() - start:.0f} s; per implementation: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in spent.items()), flush=True)
    render(path, out / "conformance.rst")
    return path


def _write(writer, case, dtype, name, cell, meta) -> None:
    check = case.checks[0]
    err = cell.get("error")
    row = dict(case=case.name, dtype=dtype, op=case.op, impl=name, status=cell["status"],
               error="" if err is None else f"{err:.3g}",
               tol=f"{cell.get('tol', check.tol[dtype]):.3g}",
               metric=cell.get("metric", check.metric), detail=cell.get("detail", ""),
               seconds=f"{cell.get('seconds', 0.0):.2f}", **meta)
    writer.writerow(row)
    print(f"{case.name:28s} {dtype:5s} {name:18s} {row['status']:5s} {row['error']:>9s} "
          f"{row['detail'][:90]}", flush=True)


def render(csv_path: Path, page: Path) -> None:
    from benchmarks.conformance_page import page_text

    with Path(csv_path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    page.write_text(page_text(rows, csv_path.name))
    print(f"# wrote {page}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="directory for conformance.csv and .rst")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--impls", default="", help="comma-separated implementations")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="an implementation that has spent this long skips the rest")
    ap.add_argument("--publish", action="store_true",
                    help="copy the CSV to benchmarks/results/ and regenerate docs/conformance.rst")
    ap.add_argument("--render", type=Path, help="only regenerate docs/conformance.rst from CSV")
    a = ap.parse_args(argv)
    if a.render:
        render(a.render, ROOT / "docs" / "conformance.rst")
        return
    if a.out is None:
        ap.error("--out DIR (or --render CSV) is required")
    path = run(a.out, [c for c in a.cases.split(",") if c], [i for i in a.impls.split(",") if i],
               a.budget_s)
    if a.publish:
        with path.open(newline="") as f:
            device = next(csv.DictReader(f))["device"]
        tag = "cpu" if device.startswith("CPU") else "gpu"
        dest = ROOT / "benchmarks" / "results" / f"conformance_{tag}.csv"
        shutil.copyfile(path, dest)
        render(dest, ROOT / "docs" / "conformance.rst")


if __name__ == "__main__":
    main()
