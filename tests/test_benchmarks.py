"""CPU smoke tests of the benchmark plumbing: the grid, the one-command run, the CSV, the report.

The numbers timed here are meaningless (tiny shapes on a CPU); what is checked is that the
suite runs end to end without a GPU or jax_triton, writes exactly the agreed columns, and that
the plots and tables are drawn from a CSV alone.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report, shapes
from benchmarks.record import CsvSink

ROOT = Path(__file__).resolve().parent.parent
HEADER = ("op,impl,mode,n,v,k,dtype,median_ms,p20_ms,p80_ms,peak_bytes,floor_ms,device,versions,"
          "commit,date")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_columns_are_the_agreed_ones():
    assert ",".join(shapes.COLUMNS) == HEADER


def test_quick_grid_puts_the_target_shapes_first():
    grid = shapes.build_grid(shapes.OPS, quick=True)
    assert len(set(grid)) == len(grid)
    tiers = [p.tier for p in grid]
    assert tiers == sorted(tiers)
    first = {(p.op, p.mode, p.dtype, p.n, p.v, p.k) for p in grid if p.tier == 0}
    n, v = shapes.TARGET_N, shapes.TARGET_V
    for op in shapes.OPS:
        assert (op, "fwd_bwd", "bf16", n, v, shapes.teacher_k(op)) in first
    assert ("cross_entropy", "fwd_bwd", "fp32", n, v, 0) in first
    assert {("logsumexp", "fwd", "bf16", small, v, 0) for small in shapes.LSE_SMALL_N} <= first
    assert {p.v for p in grid if p.op == "cross_entropy"} == set(shapes.VOCABS.values())


def test_full_grid_covers_the_named_shapes():
    grid = shapes.build_grid(shapes.OPS)
    ce = {(p.n, p.v) for p in grid if (p.op, p.dtype) == ("cross_entropy", "bf16")}
    assert ce == {(n, v) for n in shapes.TOKENS for v in shapes.VOCABS.values()}
    for op in shapes.OPS:
        got = {(p.n, p.v) for p in grid if p.op == op}
        if op in shapes.TARGET_ONLY_OPS:
            assert got == {(shapes.TARGET_N, shapes.TARGET_V)}, op
            continue
        assert {(n, shapes.TARGET_V) for n in shapes.TOKENS} <= got, op
        assert {(shapes.TARGET_N, v) for v in shapes.VOCABS.values()} <= got, op
    assert all(p.mode in shapes.MODES for p in grid)
    assert shapes.parse_vocabs("llama3,50257") == [128256, 50257]
    with pytest.raises(ValueError, match="vocabulary"):
        shapes.parse_vocabs("llama9")


def test_one_command_cpu_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), BENCH_COMMIT="testcommit")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--cpu-smoke", "--out", str(tmp_path),
         "--ops", "cross_entropy"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tmp_path / "bench.csv"
    assert path.read_text().splitlines()[0] == HEADER
    rows = report.read_rows(path)
    impls = {r["impl"] for r in rows}
    assert impls == {"jax_fusedloss_xla", "optax", "optax_fp32", "torch"}, impls
    assert {r["mode"] for r in rows} == set(shapes.MODES)
    for r in rows:
        assert 0 < r["p20_ms"] <= r["median_ms"] <= r["p80_ms"], r
        assert r["floor_ms"] > 0 and r["device"] == "cpu" and r["commit"] == "testcommit", r
        assert "jax=" in r["versions"] and r["date"].endswith("Z"), r
        if r["impl"] != "torch":  # XLA's buffer assignment holds at least the logits
            assert r["peak_bytes"] >= r["n"] * r["v"] * 2, r
    assert "== Target shapes" in proc.stdout
    assert (tmp_path / "table.md").read_text().count("cross_entropy") >= 2
    assert "--readme" not in proc.stdout + proc.stderr  # never suggests publishing CPU rows
    assert "not results" in proc.stdout and "GPU runs only" in proc.stdout


def _row(op, impl, mode, n, v, median_ms, *, date="2026-11-01T00:00:00Z", dtype="bf16",
         peak_extra=1024, bandwidth=3.0e12):
    moved = shapes.floor_bytes(op, mode, n, v, dtype)
    return dict(op=op, impl=impl, mode=mode, n=n, v=v, k=shapes.teacher_k(op),
                dtype=dtype, median_ms=median_ms, p20_ms=median_ms * 0.98,
                p80_ms=median_ms * 1.03, peak_bytes=moved + peak_extra * n,
                floor_ms=moved / bandwidth * 1e3, device="NVIDIA Test GPU",
                versions="jax=0 torch=0", commit="abc1234", date=date)


def _synthetic_csv(path: Path, date: str = "2026-11-01T00:00:00Z", scale: float = 1.0) -> Path:
    sink = CsvSink(path)
    v = shapes.TARGET_V
    for n in (1, 64, 1024, 8192):
        floor = shapes.floor_bytes("cross_entropy", "fwd_bwd", n, v, "bf16") / 3.0e9
        for impl, factor in (("jax_fusedloss", 1.1), ("torch_ref", 1.15), ("liger", 1.9),
                             ("optax", 2.3)):
            sink.write(_row("cross_entropy", impl, "fwd_bwd", n, v, floor * factor * scale,
                            date=date))
            sink.write(_row("cross_entropy", impl, "fwd", n, v, floor * factor / 2, date=date))
    for vocab in set(shapes.VOCABS.values()) - {v}:
        floor = shapes.floor_bytes("cross_entropy", "fwd_bwd", 8192, vocab, "bf16") / 3.0e9
        sink.write(_row("cross_entropy", "jax_fusedloss", "fwd_bwd", 8192, vocab, floor * 1.2,
                        date=date))
    floor = shapes.floor_bytes("kd_loss", "fwd_bwd", 8192, v, "bf16") / 3.0e9
    sink.write(_row("kd_loss", "jax_fusedloss", "fwd_bwd", 8192, v, floor * 1.5, date=date))
    sink.write(_row("distill_loss", "jax_fusedloss", "fwd_bwd", 8192, v, floor * 1.19, date=date))
    for n, us in ((1, 9.0), (8, 20.0)):
        sink.write(_row("logsumexp", "jax_fusedloss", "fwd", n, v, us * 1e-3, date=date))
        sink.write(_row("logsumexp", "torch", "fwd", n, v, 58e-3, date=date))
        sink.write(_row("logsumexp", "jnp_fp32", "fwd", n, v, 16e-3, date=date))
    # N=1 was also timed inside a program: those rows decide the few-row target there
    sink.write(_row("logsumexp", "jax_fusedloss", shapes.PROGRAM_MODE, 1, v, 3.0e-3, date=date))
    sink.write(_row("logsumexp", "jnp_fp32", shapes.PROGRAM_MODE, 1, v, 5.0e-3, date=date))
    return path


def test_report_merges_runs_and_draws_plots_tables_and_readme(tmp_path):
    pytest.importorskip("matplotlib")
    run1 = _synthetic_csv(tmp_path / "run1.csv")
    run2 = _synthetic_csv(tmp_path / "run2.csv", date="2026-11-02T00:00:00Z", scale=0.5)
    results_dir = tmp_path / "results"
    results = results_dir / "results.csv"
    assert report.append_results([run1], results) > 0
    assert report.append_results([run1], results) == 0  # rows already there are not repeated
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nBefore.\n\n{report.BEGIN}\nold table\n{report.END}\n\nAfter.\n")
    assert report.main([str(run2), "--results-dir", str(results_dir), "--readme", str(readme)]) == 0
    with results.open(newline="") as f:
        assert ",".join(next(csv.reader(f))) == HEADER
    rows = report.latest(report.read_rows(results))
    assert {r["date"] for r in rows} == {"2026-11-02T00:00:00Z"}  # the newest row of each case
    pngs = sorted(results_dir.glob("*.png"))
    assert {p.name for p in pngs} == {f"cross_entropy_bf16_v{shapes.TARGET_V}.png",
                                      f"ratio_to_floor_n{shapes.TARGET_N}.png"}
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000, p
    table = (results_dir / "table.md").read_text()
    assert f"cross_entropy fwd_bwd bf16 N={shapes.TARGET_N}" in table
    assert "| **jax_fusedloss** |" in table and "logsumexp forward" in table
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# Title\n\nBefore.")
    assert text.rstrip().endswith("After.")
    block = text.split(report.BEGIN)[1].split(report.END)[0]
    assert "jax_fusedloss" in block and "results/ratio_to_floor_n8192.png" in block
    assert "2026-11-02T00:00:00Z" in block and "2026-11-01" not in block


def test_readme_without_markers_is_left_alone(tmp_path):
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    assert not report.rewrite_readme(plain, "table")
    assert plain.read_text() == "no markers\n"


def test_headline_is_one_line_per_op_and_mode_at_the_target_shape(tmp_path):
    rows = report.read_rows(_synthetic_csv(tmp_path / "run.csv"))
    block = report.headline(rows, plots=["results/ratio_to_floor_n8192.png"])
    at_target = {(r["op"], r["mode"], r["dtype"]) for r in rows if r["impl"] == "jax_fusedloss"
                 and (r["n"], r["v"]) == (shapes.TARGET_N, shapes.TARGET_V)}
    lines = [ln for ln in block.splitlines() if ln.startswith("| ") and " ms " not in ln]
    assert len(lines) == len(at_target), block
    assert "![ratio_to_floor_n8192](results/ratio_to_floor_n8192.png)" in block
    assert "commit" in block and rows[0]["device"] in block
    assert "issue" not in report.summary_text(rows) + report.markdown(rows) + block


def test_readme_block_is_drawn_from_the_published_csv():
    """The README's numbers are what benchmarks/report.py draws from results.csv (rerun
    `python -m benchmarks.report --readme` after a new run)."""
    results = report.RESULTS_DIR / "results.csv"
    rows = report.latest(report.read_rows(results))
    text = (ROOT / "README.md").read_text()
    block = text.split(report.BEGIN)[1].split(report.END)[0].strip()
    plots = [f"benchmarks/results/{p.name}" for p in sorted(report.RESULTS_DIR.glob("*.png"))]
    want = report.headline(rows, plots=plots,
                           source="benchmarks/results/results.csv").strip()
    assert block == want, "README bench block differs from benchmarks/results/results.csv"


def test_missing_baseline_is_skipped_with_a_note(monkeypatch):
    from benchmarks import jax_impls

    monkeypatch.setitem(sys.modules, "optax", None)  # import optax now fails
    impls, notes = jax_impls.implementations("cross_entropy", "bf16", None, on_gpu=False)
    assert set(impls) == {"jax_fusedloss_xla"}
    assert any("import failed" in n for n in notes), notes


def _cpu_csv(path: Path) -> Path:
    sink = CsvSink(path)
    sink.write(dict(_row("cross_entropy", "jax_fusedloss_xla", "fwd", 64, 1000, 0.5), device="cpu"))
    return path


def test_report_refuses_cpu_rows_for_the_published_results_and_readme(tmp_path, monkeypatch,
                                                                      capsys):
    published = tmp_path / "published"
    gpu_run = _synthetic_csv(tmp_path / "gpu.csv")
    monkeypatch.setattr(report, "RESULTS_DIR", published)
    assert report.main([str(gpu_run)]) == 0
    before = {p.name: p.read_bytes() for p in published.iterdir()}
    cpu_run = _cpu_csv(tmp_path / "cpu.csv")
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.BEGIN}\nGPU block\n{report.END}\n")

    assert report.main([str(cpu_run)]) == 2  # the published results.csv takes GPU rows only
    assert "GPU runs only" in capsys.readouterr().err
    elsewhere = tmp_path / "elsewhere"
    assert report.main([str(cpu_run), "--results-dir", str(elsewhere), "--readme",
                        str(readme)]) == 2
    assert not (elsewhere / "results.csv").exists()
    assert {p.name: p.read_bytes() for p in published.iterdir()} == before
    assert readme.read_text() == f"{report.BEGIN}\nGPU block\n{report.END}\n"

    assert report.main([str(cpu_run), "--results-dir", str(elsewhere)]) == 0  # drawn elsewhere
    assert (elsewhere / "table.md").exists()


def test_run_without_a_gpu_points_to_cpu_smoke(tmp_path, monkeypatch, capsys):
    from benchmarks import run

    monkeypatch.setattr(run, "gpu_present", lambda: False)
    assert run.main(["--out", str(tmp_path / "bench")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--cpu-smoke" in err
    assert not (tmp_path / "bench").exists()
    inside = report.RESULTS_DIR / "smoke"
    assert run.main(["--cpu-smoke", "--out", str(inside)]) == 2
    assert "published results" in capsys.readouterr().err and not inside.exists()
    assert run.parse_args(["--cpu-smoke"]).out == run.DEFAULT_SMOKE_OUT


def test_run_help_describes_every_option(capsys):
    from benchmarks import run

    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, words in (("--ops", "comma-separated ops"), ("--modes", "fwd_bwd (loss"),
                          ("--frameworks", "which workers run"), ("--cpu-smoke", "plumbing")):
        assert option in text and words in text, (option, text)


def test_gpu_activities_split_into_executions():
    from benchmarks import timing

    acts = [(0.0, 2.0, "a"), (1.0, 5.0, "b"), (10.0, 11.0, "a"), (12.0, 13.0, "b")]
    groups = timing.executions(acts, 2)
    assert groups == [acts[:2], acts[2:]]
    assert [timing.span_us(g) for g in groups] == [5.0, 3.0]
    with pytest.raises(RuntimeError, match="3 GPU activities in 2 executions"):
        timing.executions(acts[:3], 2)
    with pytest.raises(RuntimeError, match="0 GPU activities"):
        timing.executions([], 1)


def test_time_jax_subtracts_what_each_run_pays_once(monkeypatch):
    """A JAX sample is the steady-state time per call: a fixed cost of every run (here a 6 ms
    wake-up in block_until_ready, against 1 ms calls) cancels, where G calls' time over G would
    keep 6 / G ms of it."""
    import time

    import jax
    import jax.numpy as jnp

    from benchmarks import timing

    out = jnp.ones(4)

    def call():
        time.sleep(1e-3)
        return out

    def slow_wake(x):
        time.sleep(6e-3)
        return x

    def sleep_ms() -> float:
        """What a 1 ms sleep really takes here now (a loaded CPU oversleeps): the call's true
        time."""
        samples = []
        for _ in range(30):
            t0 = time.perf_counter()
            time.sleep(1e-3)
            samples.append((time.perf_counter() - t0) * 1e3)
        return sorted(samples)[len(samples) // 2]

    monkeypatch.setattr(jax, "block_until_ready", slow_wake)
    # G = 20 calls' time over G would keep 6 / 20 = 0.3 ms of the wake-up: half of it fails.
    # Under the other xdist worker's load a sleep's length drifts between the two
    # measurements (CI once saw 1.58 ms against 1.08), so up to three tries, each measuring
    # the sleep right before timing; a method that kept the 0.3 ms fails all three.
    for _ in range(3):
        base = sleep_ms()
        stats = timing.time_jax(call, 1, out.nbytes)
        if 0.9 * base < stats.median_ms < base + 0.15:
            break
    assert 0.9 * base < stats.median_ms < base + 0.15, (stats, base)


def test_time_jax_samples_stay_positive_in_noise(monkeypatch):
    """A run's fixed cost (a 2 ms first call after each sync) with calls that take next to
    nothing: the call time is lost in the timer's noise, and every sample must still be > 0
    (sample-by-sample differences of a 1-call and a (G+1)-call run go below 0 about half the
    time here)."""
    import time

    import jax
    import jax.numpy as jnp

    from benchmarks import timing

    out = jnp.ones(4)
    state = {"synced": True}

    def call():
        if state["synced"]:
            time.sleep(2e-3)
            state["synced"] = False
        return out

    def sync(x):
        state["synced"] = True
        return x

    monkeypatch.setattr(jax, "block_until_ready", sync)
    for smoke in (True, False):
        stats = timing.time_jax(call, 1, out.nbytes, smoke)
        assert 0 < stats.p20_ms <= stats.median_ms <= stats.p80_ms, stats


def test_readme_lm_head_table_is_drawn_from_the_published_csv():
    """The README's LM-head table is what `benchmarks.linear_ce --readme` draws from
    benchmarks/results/lm_head_h100.csv (GPU rows only; edit the CSV, not the README)."""
    import pathlib

    from benchmarks import linear_ce

    root = pathlib.Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text()
    a = text.index(linear_ce.README_START)
    b = text.index(linear_ce.README_END) + len(linear_ce.README_END)
    block = linear_ce.readme_block(root / "benchmarks" / "results" / "lm_head_h100.csv")
    assert text[a:b] == block, "README LM-head table differs from the CSV: run " \
        "python -m benchmarks.linear_ce --readme README.md"
    assert "H100" in block and '`mode="lean"`' in block


def test_linear_ce_benchmark_cpu_smoke(tmp_path):
    """benchmarks.linear_ce runs end to end on the CPU at a tiny shape (every mode of ours
    through the interpreter, the XLA twin, optax and the matmul floor) and writes its CSV."""
    import csv

    from benchmarks import linear_ce

    linear_ce.main(["--out", str(tmp_path), "--smoke", "--n", "16", "--d", "8", "--v", "300",
                    "--frameworks", "jax", "--isolate", "no"])
    rows = list(csv.DictReader(open(tmp_path / "linear_ce.csv")))
    impls = {r["impl"] for r in rows if r["framework"] == "jax"}
    assert {"ours-triton-fast", "ours-triton-low_precision", "ours-triton-lean",
            "ours-xla-fast", "optax-naive", "matmuls-floor"} <= impls, impls
    losses = {float(r["loss"]) for r in rows if r["impl"].startswith(("ours", "optax"))}
    assert max(losses) - min(losses) < 1e-3, losses
