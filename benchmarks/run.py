"""The benchmark suite in one command.

    python -m benchmarks.run [--out DIR] [--quick] [--ops cross_entropy,logsumexp,...]
                             [--impls ...] [--ns 1,8192] [--vocabs llama3,gemma]
                             [--cross] [--budget-s S] [--cpu-smoke]

It needs a CUDA GPU; without one it says so and stops. `--cpu-smoke` runs tiny shapes on the
CPU instead, to test the plumbing: its rows (device "cpu") go to out/bench_cpu_smoke by default
and are never merged into the published results (`benchmarks.report` refuses them).

The parent process builds the grid (`benchmarks.shapes`), then runs two workers one after
the other, each in its own process so that neither framework's allocator holds memory the
other needs: the PyTorch worker (copy bandwidth, torch_ref, plain PyTorch, Liger-Kernel),
then the JAX worker (jax_fusedloss, optax, plain JAX). Each appends one row per case to
DIR/bench.csv as soon as it is measured, so a run cut short keeps what it measured. The
parent then prints the summary, and draws plots and tables into DIR when matplotlib is there.
Cases are taken most important first and a worker stops starting cases at its deadline.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from benchmarks import report, shapes, timing
from benchmarks.record import CsvSink, commit, versions

CSV_NAME = "bench.csv"
TORCH_SHARE = 0.4  # the PyTorch worker's share of the time budget (it has nothing to compile)
BANDWIDTH_BYTES = 2 << 30
JAX_CACHE_DIR = os.environ.get("BENCH_JAX_CACHE", "/tmp/jax_fusedloss_bench_cache")
DEFAULT_OUT, DEFAULT_SMOKE_OUT = Path("out/bench"), Path("out/bench_cpu_smoke")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help=f"folder for bench.csv, meta.json and plots (default {DEFAULT_OUT}, "
                         f"or {DEFAULT_SMOKE_OUT} with --cpu-smoke)")
    ap.add_argument("--ops", default=",".join(shapes.OPS),
                    help="comma-separated ops to time (default: all, i.e. "
                         f"{', '.join(shapes.OPS)})")
    ap.add_argument("--impls", default="", help="only these implementations (default: all)")
    ap.add_argument("--ns", default="", help="only these token counts")
    ap.add_argument("--vocabs", default="", help="only these vocabularies (names or sizes)")
    ap.add_argument("--modes", default=",".join(shapes.MODES),
                    help="comma-separated: fwd (the loss alone), fwd_bwd (loss and gradient "
                         "of the logits); default both")
    ap.add_argument("--quick", action="store_true", help="the reduced grid (< 4 minutes)")
    ap.add_argument("--cross", action="store_true",
                    help="every vocabulary x token count for every op (slow)")
    ap.add_argument("--frameworks", default="torch,jax",
                    help="which workers run: torch (copy bandwidth, torch_ref, PyTorch, "
                         "Liger-Kernel) and/or jax (jax_fusedloss, optax, plain JAX); "
                         "default torch,jax")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting cases after this many seconds (default 230 quick, "
                         "480 full, 120 smoke)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes and CPU-safe implementations on the CPU: tests the "
                         "plumbing; the rows are not results and are never published")
    ap.add_argument("--list", action="store_true", help="print the problems and exit")
    ap.add_argument("--worker", choices=("torch", "jax"), help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = DEFAULT_SMOKE_OUT if args.cpu_smoke else DEFAULT_OUT
    return args


def gpu_present() -> bool:
    """A cheap look for a CUDA GPU before any framework is imported (the NVIDIA device nodes,
    unless CUDA_VISIBLE_DEVICES hides every device)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


NO_GPU = ("[run] no CUDA GPU found: this suite times GPU-sized shapes (up to 32768 x 256000 "
          "logits) and would run for many minutes on a CPU. To check the plumbing here, run\n"
          "    python -m benchmarks.run --cpu-smoke\n"
          "(tiny shapes, rows written under out/ and never published).")


def _csv_list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def problems(args: argparse.Namespace) -> list[shapes.Problem]:
    ops = _csv_list(args.ops)
    if args.cpu_smoke:
        return shapes.smoke_grid(ops)
    return shapes.build_grid(ops, quick=args.quick, cross=args.cross,
                             ns=[int(n) for n in _csv_list(args.ns)] or None,
                             vocabs=shapes.parse_vocabs(args.vocabs) or None,
                             modes=_csv_list(args.modes))


# ----------------------------------------------------------------------------- workers
def _is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "out of memory" in text or "resource_exhausted" in text or "outofmemory" in text


def _fmt(x: float) -> str:
    return f"{x:.5g}"


class Worker:
    """Runs one framework's cases in priority order until the deadline.

    A subclass provides the framework: `setup`, `implementations`, `make_inputs`, `measure`
    (-> stats, peak bytes, text for the log line) and `cleanup`.
    """

    mutating: frozenset = frozenset()  # implementations that overwrite the logits in fwd_bwd

    def __init__(self, args: argparse.Namespace, meta: dict, meta_path: Path):
        self.args, self.meta, self.meta_path = args, meta, meta_path
        self.smoke = args.cpu_smoke
        self.names = set(_csv_list(args.impls)) or None
        self.sink = CsvSink(Path(args.out) / CSV_NAME)
        self.inputs_key, self.inputs = None, None
        self.noted = set()

    def note(self, text: str) -> None:
        if text not in self.noted:
            self.noted.add(text)
            print(f"[{self.args.worker}] note: {text}", flush=True)

    def row(self, p: shapes.Problem, impl: str, stats: timing.Stats, peak: int | None) -> dict:
        moved = shapes.floor_bytes(p.op, p.mode, p.n, p.v, p.dtype)
        floor_ms = moved / self.meta["bandwidth"] * 1e3
        return dict(op=p.op, impl=impl, mode=p.mode, n=p.n, v=p.v, k=p.k, dtype=p.dtype,
                    median_ms=_fmt(stats.median_ms), p20_ms=_fmt(stats.p20_ms),
                    p80_ms=_fmt(stats.p80_ms), peak_bytes="" if peak is None else peak,
                    floor_ms=_fmt(floor_ms), device=self.meta["device"],
                    versions=self.meta["versions"], commit=self.meta["commit"],
                    date=self.meta["date"])

    def run(self) -> None:
        todo = problems(self.args)
        self.setup()
        done = 0
        for i, p in enumerate(todo):
            if time.time() > self.args.deadline:
                print(f"[{self.args.worker}] budget reached: {len(todo) - i} problems not "
                      "started", flush=True)
                break
            done += self.run_problem(p)
        print(f"[{self.args.worker}] {done} cases measured", flush=True)

    def run_problem(self, p: shapes.Problem) -> int:
        """Times every implementation on `p`; returns how many cases were measured."""
        impls, notes = self.implementations(p)
        for text in notes:
            self.note(text)
        done = 0
        for name, fn in impls.items():
            label = f"{p.op} {p.mode} {p.dtype} N={p.n} V={p.v} {name}"
            try:
                inputs = self.get_inputs(p)
                stats, peak, extra = self.measure(p, name, fn, inputs)
            except Exception as e:  # noqa: BLE001 - one failing case never stops the run
                reason = "out of memory" if _is_oom(e) else f"{type(e).__name__}: {e}"
                print(f"[{self.args.worker}] {label}: skipped ({reason.splitlines()[0][:300]})",
                      flush=True)
                self.cleanup()
                continue
            finally:
                if name in self.mutating and p.mode == "fwd_bwd":
                    self.drop_inputs()  # the logits now hold their gradient
            row = self.row(p, name, stats, peak)
            self.sink.write(row)
            done += 1
            ratio = stats.median_ms / float(row["floor_ms"])
            print(f"[{self.args.worker}] {label}: {stats.median_ms:.4g} ms "
                  f"({stats.p20_ms:.4g}-{stats.p80_ms:.4g}) = {ratio:.2f}x floor{extra}",
                  flush=True)
        return done

    def get_inputs(self, p: shapes.Problem) -> list[tuple]:
        key = (shapes.input_kind(p.op), p.n, p.v, p.k, p.dtype)
        if key != self.inputs_key:
            same_logits = self.inputs_key is not None and self.inputs_key[1:] == key[1:]
            logits = [tup[0] for tup in self.inputs] if same_logits else None
            self.drop_inputs()
            r = timing.rotations(p.n * p.v * shapes.ITEMSIZE[p.dtype], 2 if self.smoke else
                                 timing.MAX_ROTATE)
            self.inputs = [self.make_inputs(p, seed, None if logits is None else logits[seed])
                           for seed in range(r)]
            self.inputs_key = key
        return self.inputs

    def drop_inputs(self) -> None:
        self.inputs_key, self.inputs = None, None
        self.cleanup()


class TorchWorker(Worker):
    def setup(self) -> None:
        import torch

        from benchmarks import torch_impls

        self.torch, self.impls_mod = torch, torch_impls
        self.mutating = torch_impls.MUTATES_INPUT
        self.cuda = torch.cuda.is_available() and not self.smoke
        if self.smoke:
            torch.set_num_threads(1)  # tiny CPU ops: threads only add contention
        self.device = "cuda" if self.cuda else "cpu"
        self.meta["device"] = torch.cuda.get_device_name() if self.cuda else "cpu"
        nbytes = (32 << 20) if self.smoke else BANDWIDTH_BYTES
        self.meta["bandwidth"] = timing.copy_bandwidth_torch(nbytes, self.cuda, self.smoke)
        self.meta_path.write_text(json.dumps(self.meta, indent=1))
        print(f"[torch] device {self.meta['device']}; copy bandwidth "
              f"{self.meta['bandwidth'] / 1e9:.0f} GB/s (read + write of {nbytes >> 20} MiB)",
              flush=True)

    def implementations(self, p: shapes.Problem) -> tuple[dict[str, Callable], list[str]]:
        return self.impls_mod.implementations(p.op, self.names, self.cuda)

    def make_inputs(self, p: shapes.Problem, seed: int, logits) -> tuple:
        return self.impls_mod.make_inputs(p, seed, self.device, logits)

    def cleanup(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def measure(self, p: shapes.Problem, name: str, fn: Callable,
                inputs: list[tuple]) -> tuple[timing.Stats, int | None, str]:
        g = self.impls_mod.objective(fn, p.mode)
        for tup in inputs:
            tup[0].requires_grad_(p.mode == "fwd_bwd")

        def call():
            for tup in inputs:
                g(*tup)

        out_bytes = p.n * p.v * shapes.ITEMSIZE[p.dtype] * len(inputs) * (p.mode == "fwd_bwd")
        stats = timing.time_torch(call, len(inputs), out_bytes, self.cuda, self.smoke)
        in_bytes = sum(t.numel() * t.element_size() for t in inputs[0])
        peak = timing.torch_peak_bytes(lambda: g(*inputs[0]), in_bytes, self.cuda)
        return stats, peak, _peak_text(p, peak, None)


class JaxWorker(Worker):
    def setup(self) -> None:
        import jax

        from benchmarks import jax_impls

        self.jax, self.impls_mod = jax, jax_impls
        if JAX_CACHE_DIR and not self.smoke:  # a later run on this machine reuses executables
            jax.config.update("jax_compilation_cache_dir", JAX_CACHE_DIR)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        self.on_gpu = jax.default_backend() == "gpu"
        if "device" not in self.meta:
            self.meta["device"] = jax.devices()[0].device_kind if self.on_gpu else "cpu"
        if "bandwidth" not in self.meta:
            nbytes = (32 << 20) if self.smoke else BANDWIDTH_BYTES
            self.meta["bandwidth"] = timing.copy_bandwidth_jax(nbytes, self.smoke)
            self.meta_path.write_text(json.dumps(self.meta, indent=1))
            print(f"[jax] copy bandwidth {self.meta['bandwidth'] / 1e9:.0f} GB/s (measured "
                  "with JAX: no PyTorch worker ran)", flush=True)

    def implementations(self, p: shapes.Problem) -> tuple[dict[str, Callable], list[str]]:
        return self.impls_mod.implementations(p.op, p.dtype, self.names, self.on_gpu)

    def run_problem(self, p: shapes.Problem) -> int:
        done = super().run_problem(p)
        if self.on_gpu and not self.smoke and shapes.in_program(p):
            done += self.run_in_program(p)
        return done

    def run_in_program(self, p: shapes.Problem) -> int:
        """Rows of mode PROGRAM_MODE: the device time per call of a jitted program of
        PROGRAM_CALLS calls on distinct inputs (CUPTI span / calls, benchmarks.fewrows), for
        ours and the jnp_fp32 baseline. A few-row call's host-clock row above is mostly JAX's
        dispatch of its program, not what the op costs inside a training step."""
        from benchmarks import fewrows

        impls, _ = self.implementations(p)
        inputs = [self.make_inputs(p, 1000 + i, None) for i in range(shapes.PROGRAM_CALLS)]
        done = 0
        for name in ("jax_fusedloss", "jnp_fp32"):
            if name not in impls:
                continue
            fn = impls[name]
            try:
                _, spans = fewrows.time_program(lambda *a, fn=fn: fn(*a), inputs, reps=10)
            except Exception as e:  # noqa: BLE001 - one failing case never stops the run
                print(f"[jax] {p.op} {shapes.PROGRAM_MODE} N={p.n} {name}: skipped "
                      f"({type(e).__name__}: {str(e)[:200]})", flush=True)
                continue
            stats = timing.summarize([s / shapes.PROGRAM_CALLS for s in spans])
            self.sink.write(self.row(p._replace(mode=shapes.PROGRAM_MODE), name, stats, None))
            done += 1
            print(f"[jax] {p.op} {shapes.PROGRAM_MODE} {p.dtype} N={p.n} V={p.v} {name}: "
                  f"{stats.median_ms * 1e3:.2f} us per call in a program of "
                  f"{shapes.PROGRAM_CALLS}", flush=True)
        return done

    def make_inputs(self, p: shapes.Problem, seed: int, logits) -> tuple:
        return self.impls_mod.make_inputs(p, seed, logits)

    def cleanup(self) -> None:
        gc.collect()

    def measure(self, p: shapes.Problem, name: str, fn: Callable,
                inputs: list[tuple]) -> tuple[timing.Stats, int | None, str]:
        g = self.impls_mod.objective(fn, p.mode)
        arity, r = len(inputs[0]), len(inputs)

        def rotated(*flat):
            return [g(*flat[i * arity:(i + 1) * arity]) for i in range(r)]

        flat = [a for tup in inputs for a in tup]
        start = time.perf_counter()
        compiled = self.jax.jit(rotated).lower(*flat).compile()
        compile_s = time.perf_counter() - start
        out_bytes = p.n * p.v * shapes.ITEMSIZE[p.dtype] * r * (p.mode == "fwd_bwd")
        stats = timing.time_jax(lambda: compiled(*flat), r, out_bytes, self.smoke)
        peak = timing.jax_peak_bytes(compiled, r)
        temp = timing.jax_temp_bytes(compiled) if r == 1 else None
        return stats, peak, _peak_text(p, peak, temp) + f"; compile {compile_s:.1f} s"


def _peak_text(p: shapes.Problem, peak: int | None, temp: int | None) -> str:
    if peak is None:
        return ""
    logits = p.n * p.v * shapes.ITEMSIZE[p.dtype]
    extra = peak - logits * (2 if p.mode == "fwd_bwd" else 1)
    text = f"; peak {peak / 2**30:.3g} GiB, beyond logits+grad {extra / 2**20:.3g} MiB"
    return text + ("" if temp is None else f" (XLA temp {temp / 2**20:.3g} MiB)")


# ----------------------------------------------------------------------------- parent
def _worker_main(args: argparse.Namespace) -> None:
    meta_path = Path(args.out) / "meta.json"
    meta = json.loads(meta_path.read_text())
    (TorchWorker if args.worker == "torch" else JaxWorker)(args, meta, meta_path).run()


def _spawn(framework: str, argv: list[str], deadline: float, smoke: bool) -> int:
    env = dict(os.environ)
    if framework == "jax":
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # JAX is alone in its process
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "benchmarks.run", *argv, "--worker", framework,
           "--deadline", repr(deadline)]
    grace = 60.0  # a case takes seconds; this only catches a hung worker
    try:
        limit = max(deadline - time.time(), 0) + grace
        return subprocess.run(cmd, env=env, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        print(f"[run] the {framework} worker ran past its deadline and was stopped", flush=True)
        return -1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        _worker_main(args)
        return 0
    if args.list:
        for p in problems(args):
            print(f"tier {p.tier}: {p.op} {p.mode} {p.dtype} N={p.n} V={p.v}"
                  + (f" K={p.k}" if p.k else ""))
        return 0
    if not args.cpu_smoke and not gpu_present():
        print(NO_GPU, file=sys.stderr)
        return 2
    if args.cpu_smoke and Path(args.out).resolve().is_relative_to(report.RESULTS_DIR):
        print(f"[run] --out {args.out} is inside the published results {report.RESULTS_DIR}; "
              "a CPU smoke run writes elsewhere (default out/bench_cpu_smoke)", file=sys.stderr)
        return 2
    start = time.time()
    budget = args.budget_s or (120.0 if args.cpu_smoke else 230.0 if args.quick else 480.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = problems(args)
    meta = dict(versions=versions(), commit=commit(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    CsvSink(out / CSV_NAME)
    print(f"[run] {len(todo)} problems, budget {budget:.0f} s; {meta['versions']}; "
          f"commit {meta['commit']}", flush=True)
    frameworks = _csv_list(args.frameworks)
    for framework in ("torch", "jax"):
        if framework not in frameworks:
            continue
        share = TORCH_SHARE if framework == "torch" and "jax" in frameworks else 1.0
        rc = _spawn(framework, argv, start + budget * share, args.cpu_smoke)
        if rc:
            print(f"[run] the {framework} worker exited with status {rc}", flush=True)
    try:
        rows = [r for r in report.read_rows(out / CSV_NAME) if r["date"] == meta["date"]]
        print(report.summary_text(rows))
        written = report.draw(rows, out, source=str(out / CSV_NAME))
        print(f"[run] wrote {', '.join(str(p) for p in written)}")
    except Exception as e:  # noqa: BLE001 - the CSV is what matters; never lose it to a plot
        rows = []
        print(f"[run] summary failed ({type(e).__name__}: {e}); the CSV is intact")
    print(f"[run] {len(rows)} rows in {out / CSV_NAME} after {time.time() - start:.0f} s.")
    if args.cpu_smoke:
        print(f"[run] CPU smoke run: tiny shapes that test the plumbing, not results. They stay in "
              f"{out} (plots and table.md there); the published results and the README take GPU "
              "runs only.")
    else:
        print(f"[run] To publish: python -m benchmarks.report {out / CSV_NAME} --readme "
              "(appends to benchmarks/results/results.csv and redraws the README block)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
