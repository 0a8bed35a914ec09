"""The LM head (fused linear cross-entropy), forward + backward (dH, dW), against its floor and
the anchors.

    source .whl/gpu-env.sh && python3 -m benchmarks.linear_ce --out out/linear_ce  # all shapes
    python3 -m benchmarks.linear_ce --out out/lce --quick    # the target shape only
    python -m benchmarks.linear_ce --out out/lce --smoke --n 64 --d 32 --v 1000   # CPU smoke

Shapes (`--shapes`, bf16 by default, weight `[V, D]` (`--layout vd`, as the PyTorch anchors
take it) unless `--layout dv`): llama3-8b (N=8192, D=4096, V=128256: the target), gemma2-2b
(N=8192, D=2304, V=256000: Gemma-2-2B's head, and the Cut Cross-Entropy paper's shape) and
llama3-8b-n32k (N=32768); or one `--n/--d/--v` shape. Rows at each shape:
- jax_fusedloss.linear_cross_entropy, implementation "triton", in each `mode` ("fast",
  "low_precision", "lean") at the default chunk, "low_precision" also at each `--chunk-sizes`;
  the XLA twin in "fast";
- optax naive: logits materialised, optax.softmax_cross_entropy_with_integer_labels in float32;
- matmuls: the three bare matmuls of the step (h W, G W^T, h^T G with G given), the floor;
- PyTorch: torch naive (F.linear + F.cross_entropy in float32), Liger's
  LigerFusedLinearCrossEntropyLoss and Apple's cut_cross_entropy.linear_cross_entropy when
  importable, torch_ref in "fast" and "lean". Cut Cross-Entropy twice: on the same random
  inputs as everyone, and on "peaked" ones (`_peaked_inputs`), since its backward skips blocks
  whose softmax is below its filter.
A naive baseline whose estimated memory exceeds `--mem-limit-gib` is skipped with a note.

Time: median / 20th / 80th percentile ms of the host wall of the jitted step called in a loop
(benchmarks/timing.py; 3 samples at the N=32768 shape). Memory, JAX: `temp_gib`, XLA's
temporaries (what the step needs beyond its inputs and returned gradients, from the buffer
assignment), and `device_extra_gib`, the device's peak-bytes counter during one call minus
what was in use before it and minus the outputs, read in a process of its own with XLA's
GEMM autotuning off (its scratch buffers at compile time would set the process's peak;
`--case --peak-only`), while the timing runs in another (`--case`); `peak_gib` = outputs +
temporaries.
PyTorch: `peak_gib` is max_memory_allocated beyond what was allocated before the call,
gradients included. Rows go to `<out>/linear_ce.csv` with device, versions and commit; each
shape ends with a one-line summary against the bare matmuls.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import math
import os
import traceback
from pathlib import Path

from benchmarks import record, timing

GIB = float(1 << 30)
FIELDS = ["date", "device", "commit", "versions", "n", "d", "v", "dtype", "layout",
          "framework", "impl", "median_ms", "p20_ms", "p80_ms", "ratio_to_matmuls", "peak_gib",
          "temp_gib", "device_extra_gib", "loss", "note"]
SHAPES = {"llama3-8b": (8192, 4096, 128256), "gemma2-2b": (8192, 2304, 256000),
          "llama3-8b-n32k": (32768, 4096, 128256)}
TARGET = "llama3-8b"
CHUNKS, QUICK_CHUNKS = "", ""  # chunk sweeps are opt-in (--chunk-sizes)
# Shapes with more logits than this (N=32768 at V=128256: 4.2e9) are timed with 3 samples
# (timing's smoke plan): a call there takes ~0.15 s, steady enough, and keeps the whole run
# near 5 minutes on an H100.
FEW_SAMPLES_ELEMS = 3e9
# Bytes per logit (N * V) of the naive baselines, measured on H100 at N=8192, V=128256 (bf16:
# torch naive 11.7 GiB, optax naive 5.0 GiB, matmuls with their given [N, V] gradient 3.0 + 2);
# one over --mem-limit-gib is skipped with a note. At N=32768, V=128256: torch naive ~47 GiB
# (fits an 80 GB GPU when it runs before JAX has allocated), optax ~20 GiB.
NAIVE_BYTES_PER_LOGIT = {"torch-naive": 12.0, "optax-naive": 5.1, "matmuls-floor": 5.0}


def _fits(name, n, v, limit_gib, note) -> bool:
    need = NAIVE_BYTES_PER_LOGIT.get(name, 0.0) * n * v / GIB
    if need > limit_gib:
        note(f"{name} at N={n} V={v}: skipped, needs ~{need:.0f} GiB > --mem-limit-gib "
             f"{limit_gib:g}")
        return False
    return True


MODES = ("fast", "low_precision", "lean")


def _jax_inputs(shape, dtype, layout):
    """Inputs made on the host and copied over: generating them on the device would leave its
    peak-bytes counter at the generator's float32 temporaries (2 GiB for a [V, D] weight)."""
    import jax
    import ml_dtypes
    import numpy as np

    n, d, v = shape
    np_dtype = {"bfloat16": ml_dtypes.bfloat16}.get(dtype, dtype)
    rng = np.random.default_rng(0)

    def normal(shape, scale=1.0):
        return jax.device_put((rng.standard_normal(shape, np.float32) * scale).astype(np_dtype))

    h = normal((n, d))
    w = normal((d, v) if layout == "dv" else (v, d), 0.02)
    y = jax.device_put(rng.integers(0, v, (n,), dtype=np.int32))
    return h, w, y, normal


def _jax_case_names(shape, sweep, limit, note) -> list[str]:
    """Ours in each mode (default chunk, and each --chunk-sizes entry: "C" for
    low_precision, "mode:C" for another mode), the XLA twin in "fast", optax naive and the
    matmul floor."""
    n, _, v = shape
    names = [f"ours-triton-{m}" for m in MODES]
    for entry in sweep:
        mode, chunk = entry.split(":") if ":" in entry else ("low_precision", entry)
        if int(chunk) <= n:
            names.append(f"ours-triton-{mode}-c{int(chunk)}")
    names.append("ours-xla-fast")
    if _fits("optax-naive", n, v, limit, note):
        names.append("optax-naive")
    if _fits("matmuls-floor", n, v, limit, note):
        names.append("matmuls-floor")
    return names


def _jax_case(name, shape, dtype, layout):
    """(jitted fn, args, note) of one named case."""
    import jax
    import jax.numpy as jnp
    import optax

    import jax_fusedloss as jfl

    h, w, y, normal = _jax_inputs(shape, dtype, layout)
    n, _, v = shape
    logits_of = (lambda h, w: h @ w) if layout == "dv" else (lambda h, w: h @ w.T)
    if name == "matmuls-floor":
        g = normal((n, v), 1e-3)
        if layout == "dv":
            return jax.jit(lambda h, w, g: (h @ w, g @ w.T, h.T @ g)), (h, w, g), ""
        return jax.jit(lambda h, w, g: (h @ w.T, g @ w, g.T @ h)), (h, w, g), ""
    if name == "optax-naive":
        def loss(h, w):
            return optax.softmax_cross_entropy_with_integer_labels(
                logits_of(h, w).astype(jnp.float32), y).mean()
        return jax.jit(jax.value_and_grad(loss, (0, 1))), (h, w), "float32 logits"
    _, impl, mode = name.split("-", 2)
    chunk = None
    if "-c" in mode:
        mode, chunk = mode.split("-c")
        chunk = int(chunk)

    def ours(h, w):
        return jfl.linear_cross_entropy(h, w, y, weight_layout=layout, implementation=impl,
                                        mode=mode, chunk_size=chunk)
    return jax.jit(jax.value_and_grad(ours, (0, 1))), (h, w), (
        "default chunk_size" if chunk is None else "")


def _device_extra_bytes(compiled, args) -> int | None:
    """The device's peak-bytes counter during one call, less what was in use before it and
    less the outputs: memory beyond inputs and returned outputs, as the allocator saw it."""
    import jax

    dev = jax.devices()[0]
    before = dev.memory_stats() or {}
    out = compiled(*args)
    jax.block_until_ready(out)
    after = dev.memory_stats() or {}
    if "peak_bytes_in_use" not in after or "bytes_in_use" not in before:
        return None
    if after["peak_bytes_in_use"] <= before.get("peak_bytes_in_use", 0):
        return None  # an earlier peak (compilation) hides this call's
    out_bytes = sum(a.nbytes for a in jax.tree.leaves(out))
    return after["peak_bytes_in_use"] - before["bytes_in_use"] - out_bytes


def _run_jax_case(name, shape, dtype, layout, few, peak_only=False) -> dict:
    """Times one case and reads its memory: XLA's buffer assignment (temporaries: what the
    program needs beyond its arguments and outputs) and, with `peak_only`, the device's
    peak-bytes counter (`_device_extra_bytes`) instead of a timing: that run is a process of
    its own with XLA's GEMM autotuning off (`--case --peak-only`), since the autotuner's
    scratch buffers at compile time would otherwise set the process's peak."""
    fn, args, note = _jax_case(name, shape, dtype, layout)
    compiled = fn.lower(*args).compile()
    ma = compiled.memory_analysis()
    row = dict(framework="jax", impl=name, peak_gib=(ma.output_size_in_bytes
                                                    + ma.temp_size_in_bytes) / GIB,
               temp_gib=ma.temp_size_in_bytes / GIB, note=note)
    if peak_only:
        extra = _device_extra_bytes(compiled, args)
        return dict(row, device_extra_gib=None if extra is None else extra / GIB)
    stats = timing.time_jax(lambda: compiled(*args), 1, sum(a.nbytes for a in args), few)
    loss = float("nan") if name == "matmuls-floor" else float(compiled(*args)[0])
    return dict(row, **stats._asdict(), loss=loss, device_extra_gib=None)


def _case_process(name, shape, dtype, layout, few, peak_only) -> dict:
    import json
    import subprocess
    import sys

    n, d, v = shape
    cmd = [sys.executable, "-m", "benchmarks.linear_ce", "--case", name, "--n", str(n), "--d",
           str(d), "--v", str(v), "--dtype", dtype, "--layout", layout, "--out", "-"]
    cmd += (["--smoke"] if few else []) + (["--peak-only"] if peak_only else [])
    env = dict(os.environ)
    if peak_only:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("CASE ")]
    if proc.returncode or not line:
        raise RuntimeError(proc.stderr[-1500:])
    return json.loads(line[-1][5:])


def _jax_cases(shape, dtype, layout, sweep, few, limit, rows, note, isolate, peak=True):
    """Every JAX case of one shape; with `isolate` (on a GPU) each timed in a process of its
    own and, with `peak`, its device peak read in another (`_run_jax_case`)."""
    n, d, v = shape
    for name in _jax_case_names(shape, sweep, limit, note):
        try:
            if not isolate:
                rows.append(_run_jax_case(name, shape, dtype, layout, few))
            else:
                row = _case_process(name, shape, dtype, layout, few, False)
                if peak:
                    row["device_extra_gib"] = _case_process(name, shape, dtype, layout, few,
                                                            True)["device_extra_gib"]
                rows.append(row)
            print(rows[-1], flush=True)
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            traceback.print_exc()
            note(f"jax {name} at N={n} D={d} V={v}: {type(e).__name__}: {str(e)[-600:]}")


def _peaked_inputs(n, d, v, dt, dev, gen):
    """(h, W [V, D], y) whose softmax is peaked like a trained LM's: a Zipf prior over the
    vocabulary (logit -1.5 log(1 + rank), through h[:, 0] = 1) plus token noise of std 1, labels
    drawn from the prior. A numpy simulation at V=128256 (1024 tokens) gives a loss of ~3.6
    nats and ~98% of Cut Cross-Entropy's 128 x 128 backward blocks under its filter (bf16 eps /
    32 = 2.4e-4) once it sorts the vocabulary by mean logit. The random inputs of the other
    rows (h ~ N(0, 1), W ~ N(0, 0.02^2): logits of std 1.28 over 128K classes) have a flat
    softmax: max probability ~3e-3, ~7 entries per 128 x 128 block above the filter, so CCE
    skips no block there. Data-dependent skipping drops gradient entries below the filter."""
    import torch

    prior = -1.5 * torch.log1p(torch.randperm(v, device=dev, generator=gen).float())
    h = torch.randn(n, d, device=dev, generator=gen)
    h[:, 0] = 1.0
    w = torch.randn(v, d, device=dev, generator=gen) / math.sqrt(max(d - 1, 1))
    w[:, 0] = prior
    y = torch.multinomial(torch.softmax(prior, 0), n, replacement=True, generator=gen)
    return h.to(dt).requires_grad_(True), w.to(dt).requires_grad_(True), y


def _torch_cases(shape, dtype, few, limit, rows, note):
    import torch
    import torch.nn.functional as F

    n, d, v = shape
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dt = getattr(torch, dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(n, d, device=dev, generator=gen).to(dt).requires_grad_(True)
    w_vd = (torch.randn(v, d, device=dev, generator=gen) * 0.02).to(dt).requires_grad_(True)
    y = torch.randint(0, v, (n,), device=dev, generator=gen)
    inputs = (h, w_vd, y)

    cases = {}  # name: (loss_fn(h, w, y), inputs)
    if _fits("torch-naive", n, v, limit, note):
        cases["torch-naive"] = (lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y),
                                inputs)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        cases["liger-flce"] = (lambda h, w, y: liger(w, h, y), inputs)
    except Exception as e:  # noqa: BLE001 - a missing or broken anchor is skipped
        note(f"liger: {type(e).__name__}: {e}; skipped")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        # its defaults: impl="cce", filter_eps="high" (bf16 eps / 32), reduction="mean"
        cases["cut-cross-entropy"] = (lambda h, w, y: cce(h, w, y), inputs)
        cases["cut-cross-entropy-peaked"] = (lambda h, w, y: cce(h, w, y),
                                             _peaked_inputs(n, d, v, dt, dev, gen))
    except Exception as e:  # noqa: BLE001
        note(f"cut_cross_entropy: {type(e).__name__}: {e}; skipped")
    try:
        import torch_ref

        for mode in ("fast", "lean"):
            cases[f"torch_ref-{mode}"] = (lambda h, w, y, mode=mode: torch_ref.linear_cross_entropy(
                h, w, y, weight_layout="vd", mode=mode), inputs)
    except Exception as e:  # noqa: BLE001
        note(f"torch_ref: {type(e).__name__}: {e}; skipped")

    input_bytes = h.numel() * h.element_size() + w_vd.numel() * w_vd.element_size()
    for name, (loss_fn, (hc, wc, yc)) in cases.items():
        try:
            def call(loss_fn=loss_fn, hc=hc, wc=wc, yc=yc):
                loss = loss_fn(hc, wc, yc)
                return loss.detach(), torch.autograd.grad(loss, (hc, wc))

            stats = timing.time_torch(call, 1, input_bytes, cuda, few)
            peak = timing.torch_peak_bytes(call, 0, cuda)
            loss = float(call()[0])
            rows.append(dict(framework="torch", impl=name, **stats._asdict(),
                             peak_gib=None if peak is None else peak / GIB, temp_gib=None,
                             loss=loss, note="peaked inputs" if "peaked" in name else ""))
            print(rows[-1], flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            note(f"torch {name} at N={n} D={d} V={v}: {type(e).__name__}: {e}")
        if cuda:
            torch.cuda.empty_cache()
    del cases, inputs, h, w_vd, y
    if cuda:
        torch.cuda.empty_cache()


def _extra_gib(r):
    """Memory beyond the inputs and the returned gradients: JAX's XLA temporaries (the device
    counter is in the CSV beside it), PyTorch's peak less its gradients."""
    return r.get("temp_gib") if r["framework"] == "jax" else r.get("peak_gib")


def _summary(label, shape, rows) -> str:
    """One line: every row as x bare matmuls and GiB beyond inputs (JAX: XLA temporaries)."""
    n, d, v = shape
    floor = next((r["median_ms"] for r in rows if r["impl"] == "matmuls-floor"), None)

    def cell(r):
        ratio = f"{r['median_ms'] / floor:.2f}x" if floor else f"{r['median_ms']:.1f}ms"
        extra = _extra_gib(r)
        return f"{r['impl']} {ratio} {'-' if extra is None else f'{extra:.2f}'}"

    head = f"{label} N={n} D={d} V={v}: matmuls " + (f"{floor:.1f} ms" if floor else "-")
    return head + " | x matmuls, GiB: " + ", ".join(cell(r) for r in rows
                                                    if r["impl"] != "matmuls-floor")


def _shapes(args) -> dict:
    if args.n or args.d or args.v:
        base = SHAPES[TARGET]
        return {"custom": (args.n or base[0], args.d or base[1], args.v or base[2])}
    names = [TARGET] if args.quick else args.shapes.split(",")
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown --shapes {unknown}; known: {', '.join(SHAPES)}")
    return {s: SHAPES[s] for s in names}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for linear_ce.csv (required unless --readme)")
    p.add_argument("--readme", type=Path, help="rewrite this README's LM-head table from "
                   "--from-csv instead of running")
    p.add_argument("--from-csv", type=Path, default=Path(__file__).parent / "results"
                   / "lm_head_h100.csv", help="the published CSV the README table comes from")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    p.add_argument("--n", type=int, help="one custom shape instead of --shapes (with --d, --v)")
    p.add_argument("--d", type=int)
    p.add_argument("--v", type=int)
    p.add_argument("--chunk-sizes", default=None,
                   help="extra chunk sizes: C (low_precision) or mode:C, comma-separated "
                   f"(default {CHUNKS}; --quick none)")
    p.add_argument("--quick", action="store_true", help=f"only {TARGET}, no chunk sweep")
    p.add_argument("--layout", default="vd", choices=["vd", "dv"],
                   help="weight [V, D] (vd, as the PyTorch anchors) or [D, V] (dv)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # one JAX case in this process
    p.add_argument("--peak-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--isolate", choices=["auto", "yes", "no"], default="auto",
                   help="each JAX case in its own process (auto: on a GPU)")
    p.add_argument("--peak-shapes", default=TARGET,
                   help="shapes whose JAX cases also get a device-peak process (comma list)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--frameworks", default="jax,torch", help="comma list of jax, torch")
    p.add_argument("--mem-limit-gib", type=float, default=64.0,
                   help="skip a naive baseline estimated to need more (80 GB GPU: 64)")
    p.add_argument("--smoke", action="store_true", help="few samples (CPU check of the script)")
    args = p.parse_args(argv)
    if args.readme:
        return write_readme(args.readme, args.from_csv)
    if not args.out:
        p.error("--out is required")
    sweep = [c for c in (args.chunk_sizes or (QUICK_CHUNKS if args.quick else CHUNKS))
             .split(",") if c]
    shapes = _shapes(args)
    if args.case:
        import json

        (shape,) = shapes.values()
        row = _run_jax_case(args.case, shape, args.dtype, args.layout, args.smoke,
                            args.peak_only)
        print("CASE " + json.dumps(row), flush=True)
        return
    isolate = args.isolate == "yes" or (args.isolate == "auto" and _device_is_gpu())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {label: [] for label in shapes}
    notes = []

    def note(msg):
        print("note:", msg, flush=True)
        notes.append(msg)

    frameworks = args.frameworks.split(",")
    for fw in ("torch", "jax"):  # torch first: JAX keeps the memory it allocated
        if fw not in frameworks:
            continue
        for label, shape in shapes.items():
            few = args.smoke or shape[0] * shape[2] > FEW_SAMPLES_ELEMS
            print(f"== {fw} {label} N={shape[0]} D={shape[1]} V={shape[2]}", flush=True)
            try:
                if fw == "jax":
                    _jax_cases(shape, args.dtype, args.layout, sweep, few,
                               args.mem_limit_gib, results[label], note, isolate,
                               label in args.peak_shapes.split(","))
                else:
                    _torch_cases(shape, args.dtype, few, args.mem_limit_gib, results[label],
                                 note)
            except Exception as e:  # noqa: BLE001 - e.g. torch missing: keep the other rows
                traceback.print_exc()
                note(f"{fw} {label}: {type(e).__name__}: {e}")
    path = _write_csv(out, shapes, results, notes, args.dtype, args.layout)
    device = _device()
    for label, shape in shapes.items():
        rows = results[label]
        floor = next((r["median_ms"] for r in rows if r["impl"] == "matmuls-floor"), None)
        print(f"\n{device}  {label} N={shape[0]} D={shape[1]} V={shape[2]} {args.dtype}  "
              "fwd+bwd (dH, dW)")
        for r in rows:
            ratio = f"{r['median_ms'] / floor:5.2f}x" if floor else "  -  "
            peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
            dev = r.get("device_extra_gib")
            peak += "" if dev is None else f" (temp {r['temp_gib']:.3f}, device {dev:.3f})"
            print(f"{r['framework']:6s} {r['impl']:32s} {r['median_ms']:9.2f} ms {ratio}  "
                  f"peak {peak} GiB  loss {r['loss']:.5f}  {r['note']}")
    print("\nsummary (* = default chunk_size; peak = GiB beyond the inputs)")
    for label, shape in shapes.items():
        print(_summary(label, shape, results[label]))
    print(f"wrote {path}")


def _write_csv(out: Path, shapes, results, notes, dtype, layout) -> Path:
    device = _device()
    versions = record.versions()
    try:
        versions += f" cut-cross-entropy={importlib.metadata.version('cut-cross-entropy')}"
    except importlib.metadata.PackageNotFoundError:
        pass
    common = dict(date=datetime.date.today().isoformat(), device=device,
                  commit=record.commit(), versions=versions, dtype=dtype, layout=layout)
    path = out / "linear_ce.csv"
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        if new:
            writer.writeheader()
        for label, (n, d, v) in shapes.items():
            rows = results[label]
            floor = next((r["median_ms"] for r in rows if r["impl"] == "matmuls-floor"), None)
            for r in rows:
                ratio = r["median_ms"] / floor if floor else None
                writer.writerow(dict(common, n=n, d=d, v=v, **r, ratio_to_matmuls=ratio))
        for msg in notes:
            writer.writerow(dict(common, framework="note", impl="", note=msg))
    return path


README_START, README_END = "<!-- lm-head:start -->", "<!-- lm-head:end -->"
# README rows: (impl in the CSV, what the reader sees)
README_ROWS = (("ours-triton-fast", '`mode="fast"` (default)'),
               ("ours-triton-low_precision", '`mode="low_precision"`'),
               ("ours-triton-lean", '`mode="lean"`'),
               ("optax-naive", "XLA: logits, then optax in float32"),
               ("liger-flce", "Liger fused linear CE (PyTorch)"),
               ("cut-cross-entropy", "Cut Cross-Entropy (PyTorch)"),
               ("torch-naive", "PyTorch: logits, then F.cross_entropy in float32"))


def readme_block(csv_path: Path) -> str:
    """The README's LM-head table from the newest run at the target shape in `csv_path`:
    milliseconds, x the three bare matmuls of the same run, and memory beyond the inputs and
    the returned gradients (JAX: XLA's temporaries; PyTorch: peak minus the gradients)."""
    with open(csv_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["framework"] in ("jax", "torch")]
    n, d, v = SHAPES[TARGET]
    rows = [r for r in rows if (int(r["n"]), int(r["d"]), int(r["v"])) == (n, d, v)]
    date = max(r["date"] for r in rows)
    rows = {r["impl"]: r for r in rows if r["date"] == date}
    floor = float(rows["matmuls-floor"]["median_ms"])
    grads = (n * d + v * d) * 2 / GIB  # bf16 dH and dW, returned (PyTorch's peak holds them)
    lines = [README_START,
             f"LM head, `linear_cross_entropy` forward + backward (dH, dW), N={n}, D={d}, V={v}, "
             f"bf16, weight `[V, D]`; {rows['matmuls-floor']['device']}, {date} "
             f"(`benchmarks/linear_ce.py`; memory: beyond the inputs and the returned "
             f"gradients):", "",
             "| implementation | ms | x the three bare matmuls | memory GiB |",
             "|---|---|---|---|",
             f"| three bare matmuls (the floor) | {floor:.1f} | 1.00 | - |"]
    for impl, label in README_ROWS:
        r = rows.get(impl)
        if r is None:
            continue
        ms = float(r["median_ms"])
        mem = float(r["temp_gib"]) if r["framework"] == "jax" else float(r["peak_gib"]) - grads
        lines.append(f"| {label} | {ms:.1f} | {ms / floor:.2f} | {max(mem, 0.0):.2f} |")
    peaked = rows.get("cut-cross-entropy-peaked")
    if peaked is not None:
        lines += ["", "Cut Cross-Entropy skips gradient blocks below its filter: on a trained "
                  "LM's peaked softmax it took "
                  f"{float(peaked['median_ms']):.1f} ms in the same run."]
    return "\n".join(lines + [README_END])


def write_readme(readme: Path, csv_path: Path) -> None:
    text = readme.read_text()
    a, b = text.index(README_START), text.index(README_END) + len(README_END)
    readme.write_text(text[:a] + readme_block(csv_path) + text[b:])


def _device_is_gpu() -> bool:
    try:
        import jax

        return jax.devices()[0].platform == "gpu"
    except Exception:  # noqa: BLE001
        return False


def _device() -> str:
    try:
        import jax

        return jax.devices()[0].device_kind.replace(",", " ")
    except Exception:  # noqa: BLE001
        return os.uname().nodename


if __name__ == "__main__":
    main()
