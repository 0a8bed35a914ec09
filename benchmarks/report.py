"""Results: merge run CSVs, and draw the plots and tables from the merged CSV only.

    python -m benchmarks.report [RUN_CSV ...] [--results-dir benchmarks/results]
                                [--readme [README.md]] [--device SUBSTRING]

Appends each RUN_CSV's new rows to RESULTS_DIR/results.csv, then, from that file, takes the
latest row of every case on one device (the most recent device unless --device picks one),
and writes RESULTS_DIR/table.md and RESULTS_DIR/*.png; with --readme it also rewrites the
block between `<!-- bench:start -->` and `<!-- bench:end -->` in the README with the
headline table (`headline`). No number in those outputs is typed by hand.

The published results (benchmarks/results and the README block) take GPU rows only: rows
whose device column is "cpu" (the `--cpu-smoke` run) are refused there before anything is
written; give them another `--results-dir` (e.g. out/bench_cpu_smoke/results) to draw them.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks import shapes

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BEGIN, END = "<!-- bench:start -->", "<!-- bench:end -->"
OURS = ("jax_fusedloss", "torch_ref")
CASE_KEY = ("op", "impl", "mode", "n", "v", "k", "dtype")
PROBLEM_KEY = ("op", "mode", "n", "v", "k", "dtype")


class NotGpuRowsError(ValueError):
    """Rows that are not from a GPU run were headed for the published results."""


def is_gpu_row(row: dict) -> bool:
    """True for a row measured on a GPU (the runner writes device "cpu" otherwise)."""
    return str(row["device"]).strip().lower() not in ("", "cpu")


def check_gpu_rows(rows: list[dict], where: str) -> None:
    """Raises NotGpuRowsError naming `where` when any row is not from a GPU run."""
    bad = sorted({str(r["device"]) or "(empty)" for r in rows if not is_gpu_row(r)})
    if bad:
        raise NotGpuRowsError(
            f"{where} take GPU runs only; {sum(not is_gpu_row(r) for r in rows)} rows have device "
            f"{', '.join(bad)}. Nothing was written. Draw them elsewhere with "
            "--results-dir out/<name> and without --readme.")


# ----------------------------------------------------------------------------- rows
def read_rows(path: Path) -> list[dict]:
    """Rows of a benchmark CSV, numbers parsed; raises ValueError on other columns."""
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != shapes.COLUMNS:
            raise ValueError(f"{path}: columns {reader.fieldnames} must be {list(shapes.COLUMNS)}")
        rows = list(reader)
    for r in rows:
        for c in ("n", "v", "k"):
            r[c] = int(r[c])
        for c in ("median_ms", "p20_ms", "p80_ms", "floor_ms"):
            r[c] = float(r[c])
        r["peak_bytes"] = int(r["peak_bytes"]) if r["peak_bytes"] not in ("", None) else None
    return rows


def _raw(path: Path) -> list[list[str]]:
    with Path(path).open(newline="") as f:
        return list(csv.reader(f))


def append_results(run_csvs, results_csv: Path) -> int:
    """Appends rows of `run_csvs` not yet in `results_csv` (created if needed); returns count."""
    results_csv = Path(results_csv)
    results_csv.parent.mkdir(parents=True, exist_ok=True)
    have = set(map(tuple, _raw(results_csv)[1:])) if results_csv.exists() else set()
    new = []
    for path in run_csvs:
        read_rows(path)  # validates the columns
        new += [row for row in _raw(path)[1:] if tuple(row) not in have]
        have.update(map(tuple, new))
    write_header = not results_csv.exists() or results_csv.stat().st_size == 0
    with results_csv.open("a", newline="") as f:
        w = csv.writer(f)
        if write_header:
            w.writerow(shapes.COLUMNS)
        w.writerows(new)
    return len(new)


def latest(rows: list[dict], device: str | None = None) -> list[dict]:
    """The latest row of every case on one device (by default the device of the newest row)."""
    if not rows:
        return []
    if device is None:
        device = max(rows, key=lambda r: r["date"])["device"]
    best = {}
    for r in rows:
        if device.lower() in r["device"].lower():
            key = tuple(r[c] for c in CASE_KEY)
            if key not in best or r["date"] >= best[key]["date"]:
                best[key] = r
    return list(best.values())


def _problems(rows: list[dict]) -> dict[tuple, list[dict]]:
    out = defaultdict(list)
    for r in rows:
        out[tuple(r[c] for c in PROBLEM_KEY)].append(r)
    for group in out.values():
        group.sort(key=lambda r: r["median_ms"])
    return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def _order(key: tuple) -> tuple:
    op, mode, n, v, k, dtype = key
    tier = 0 if shapes.is_target(op, mode, n, v, dtype) else 1
    return (tier, shapes.OPS.index(op) if op in shapes.OPS else 99, dtype, mode, n, v)


def is_ours(impl: str) -> bool:
    return impl.startswith(OURS)


def best_baseline(group: list[dict]) -> dict | None:
    baselines = [r for r in group if not is_ours(r["impl"])]
    return min(baselines, key=lambda r: r["median_ms"]) if baselines else None


def bandwidth(r: dict) -> float:
    """The run's copy bandwidth (bytes/s), recovered from a row's floor."""
    moved = shapes.floor_bytes(r["op"], r["mode"], r["n"], r["v"], r["dtype"])
    return moved / (r["floor_ms"] * 1e-3)


def beyond_logits(r: dict) -> float | None:
    """Peak bytes beyond the logits (and their gradient for fwd_bwd)."""
    if r["peak_bytes"] is None:
        return None
    return r["peak_bytes"] - shapes.floor_bytes(r["op"], r["mode"], r["n"], r["v"], r["dtype"])


def _title(key: tuple) -> str:
    op, mode, n, v, k, dtype = key
    return f"{op} {mode} {dtype} N={n} V={shapes.vocab_name(v)}" + (f" K={k}" if k else "")


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


# ----------------------------------------------------------------------------- text
def summary_text(rows: list[dict], max_problems: int = 40) -> str:
    """The stdout summary, most important last (a console often keeps only the tail).

    Every problem in one line (our rows against the best baseline; left to table.md when
    there are more than `max_problems`), then the target shapes in full.
    """
    if not rows:
        return "[report] no rows"
    problems = _problems(rows)
    lines = ["", "== Every problem: our rows against the best baseline "
                 "(speedup: baseline median / ours) =="]
    lines.append(f"  {'problem':<52} {'ours':<18} {'ms':>10} {'x floor':>8} {'baseline':>12} "
                 f"{'ms':>10} {'speedup':>8}")
    for key, group in problems.items():
        base = best_baseline(group)
        for r in (r for r in group if is_ours(r["impl"])):
            lines.append(f"  {_title(key):<52} {r['impl']:<18} {r['median_ms']:>10.4g} "
                         f"{r['median_ms'] / r['floor_ms']:>8.2f}"
                         + (f" {base['impl']:>12} {base['median_ms']:>10.4g} "
                            f"{base['median_ms'] / r['median_ms']:>8.2f}" if base else ""))
    if len(problems) > max_problems:
        lines = ["", f"[report] {len(problems)} problems: one line each in table.md"]
    lines += ["", "== Target shapes (x floor: median / (bytes that must move / copy bandwidth); "
                  "beyond: peak minus logits and gradient) =="]
    for key, group in problems.items():
        if not shapes.is_target(key[0], key[1], key[2], key[3], key[5]):
            continue
        base = best_baseline(group)
        lines.append(f"{_title(key)}: floor {group[0]['floor_ms']:.4g} ms at "
                     f"{bandwidth(group[0]) / 1e9:.0f} GB/s"
                     + (f"; best baseline {base['impl']}" if base else ""))
        lines.append(f"  {'impl':<20}{'median ms':>11}{'p20-p80 ms':>20}{'x floor':>9}"
                     f"{'speedup':>9}{'peak GiB':>10}{'beyond MiB':>12}")
        for r in group:
            speed = f"{base['median_ms'] / r['median_ms']:.2f}" if base else "-"
            lines.append(f"  {r['impl']:<20}{r['median_ms']:>11.4g}"
                         f"{r['p20_ms']:>10.4g}-{r['p80_ms']:<9.4g}"
                         f"{r['median_ms'] / r['floor_ms']:>9.2f}{speed:>9}"
                         f"{_gib(r['peak_bytes']):>10}{_mib(beyond_logits(r)):>12}")
    return "\n".join(lines)


def _footer(rows: list[dict], source: str) -> list[str]:
    runs = {}
    for r in rows:
        runs.setdefault((r["date"], r["commit"], r["versions"]), bandwidth(r))
    return ["", f"_{rows[0]['device']}; runs: "
                + "; ".join(f"{d}, commit {c}, {ver}, copy bandwidth {bw / 1e9:.0f} GB/s"
                            for (d, c, ver), bw in sorted(runs.items()))
                + f". Drawn by `benchmarks/report.py` from `{source}`._", ""]


def headline(rows: list[dict], plots: list[str] = (),
             source: str = "benchmarks/results/results.csv") -> str:
    """The README's block: one line per op and mode at the target shape (ours, its ratio to
    the floor, the fastest baseline, the speedup, peak memory of both), the plot of time /
    floor across vocabularies, and the device, dates and versions of the runs."""
    if not rows:
        return "_No benchmark rows yet._\n"
    out = [f"| N={shapes.TARGET_N}, V={shapes.TARGET_V} | jax_fusedloss ms | x floor "
           "| fastest baseline, ms | speedup | peak GiB, ours / baseline |",
           "|---|---|---|---|---|---|"]
    for key, group in _problems(rows).items():
        mine = [r for r in group if r["impl"] == OURS[0]]
        if (key[2], key[3]) != (shapes.TARGET_N, shapes.TARGET_V) or not mine:
            continue
        r, base = mine[0], best_baseline(group)
        what = f"{key[0]} {key[1]} {key[5]}" + (f" K={key[4]}" if key[4] else "")
        tail = (f"{base['impl']} {base['median_ms']:.3g} | "
                f"{base['median_ms'] / r['median_ms']:.2f}x | "
                f"{_gib(r['peak_bytes'])} / {_gib(base['peak_bytes'])}" if base
                else f"- | - | {_gib(r['peak_bytes'])} / -")
        out.append(f"| {what} | {r['median_ms']:.3g} | {r['median_ms'] / r['floor_ms']:.2f} "
                   f"| {tail} |")
    ratio = [p for p in plots if Path(p).stem.startswith("ratio_to_floor")]
    out += [""] + [f"![{Path(p).stem}]({p})" for p in ratio]
    return "\n".join(out + _footer(rows, source))


def markdown(rows: list[dict], plots: list[str] = (),
             source: str = "benchmarks/results/results.csv") -> str:
    """table.md: the target shape's table, logsumexp's latency, one line per problem, links
    to `plots`; a footer names the device, runs and source."""
    if not rows:
        return "_No benchmark rows yet._\n"
    problems = _problems(rows)
    out = []
    head = ["| problem | impl | median ms (p20-p80) | x floor | speedup vs best baseline "
            "| peak GiB |", "|---|---|---|---|---|---|"]
    for key, group in problems.items():
        if (key[2], key[3]) != (shapes.TARGET_N, shapes.TARGET_V):
            continue
        out, head = out + head, []
        base = best_baseline(group)
        out.append(f"| **{_title(key)}** | floor | {group[0]['floor_ms']:.3g} | 1.00 | | |")
        for r in group:
            speed = f"{base['median_ms'] / r['median_ms']:.2f}" if base else ""
            name = f"**{r['impl']}**" if is_ours(r["impl"]) else r["impl"]
            out.append(f"| | {name} | {r['median_ms']:.3g} ({r['p20_ms']:.3g}-{r['p80_ms']:.3g}) "
                       f"| {r['median_ms'] / r['floor_ms']:.2f} | {speed} "
                       f"| {_gib(r['peak_bytes'])} |")
    lse = [r for key, g in problems.items() for r in g
           if key[0] == "logsumexp" and key[1] == "fwd" and key[3] == shapes.TARGET_V]
    if lse:
        out += ["", f"logsumexp forward at V={shapes.TARGET_V}:", "",
                "| N | impl | median us (p20-p80) | share of copy bandwidth |", "|---|---|---|---|"]
        for r in sorted(lse, key=lambda r: (r["n"], r["median_ms"])):
            out.append(f"| {r['n']} | {r['impl']} | {r['median_ms'] * 1e3:.3g} "
                       f"({r['p20_ms'] * 1e3:.3g}-{r['p80_ms'] * 1e3:.3g}) "
                       f"| {100 * r['floor_ms'] / r['median_ms']:.0f}% |")
    out += ["", "Every problem (our rows, and the fastest baseline):", "",
            "| problem | impl | median ms | x floor | best baseline | its ms | speedup |",
            "|---|---|---|---|---|---|---|"]
    for key, group in problems.items():
        base = best_baseline(group)
        for r in (r for r in group if is_ours(r["impl"])):
            tail = (f"{base['impl']} | {base['median_ms']:.3g} | "
                    f"{base['median_ms'] / r['median_ms']:.2f}" if base else "- | - | -")
            out.append(f"| {_title(key)} | {r['impl']} | {r['median_ms']:.3g} "
                       f"| {r['median_ms'] / r['floor_ms']:.2f} | {tail} |")
    out += [""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(out + _footer(rows, source))


def rewrite_readme(readme: Path, block: str) -> bool:
    """Replaces the text between the bench markers; False (file untouched) without markers."""
    text = Path(readme).read_text()
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        return False
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    Path(readme).write_text(f"{head}{BEGIN}\n{block.strip()}\n{END}{tail}")
    return True


# ----------------------------------------------------------------------------- plots
def draw_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """Per (op, dtype, V) with at least 3 token counts: time vs N with the floor (top row)
    and time / floor vs N (bottom row), one column per mode; and time / floor vs V at N=8192.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    impls = sorted({r["impl"] for r in rows})
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(impls)}
    written = []
    series = defaultdict(list)
    for r in rows:
        series[(r["op"], r["dtype"], r["v"])].append(r)
    for (op, dtype, v), group in sorted(series.items()):
        ns = sorted({r["n"] for r in group})
        if len(ns) < 3:
            continue
        modes = [m for m in shapes.MODES if any(r["mode"] == m for r in group)]
        fig, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes), 8), squeeze=False,
                                 sharex=True)
        for col, mode in enumerate(modes):
            top, bottom = axes[0, col], axes[1, col]
            rs = [r for r in group if r["mode"] == mode]
            floor = {r["n"]: r["floor_ms"] for r in rs}
            top.plot(sorted(floor), [floor[n] for n in sorted(floor)], "k--", label="floor")
            bottom.axhline(1.0, color="k", linestyle="--", linewidth=1, label="floor")
            for name in sorted({r["impl"] for r in rs}):
                pts = sorted((r["n"], r["median_ms"], r["floor_ms"]) for r in rs
                             if r["impl"] == name)
                style = dict(color=colors[name], label=name,
                             linewidth=2.5 if is_ours(name) else 1.2)
                top.plot([p[0] for p in pts], [p[1] for p in pts], "o-", **style)
                bottom.plot([p[0] for p in pts], [p[1] / p[2] for p in pts], "o-", **style)
            top.set(xscale="log", yscale="log", ylabel="median ms",
                    title=f"{op} {mode} {dtype} V={shapes.vocab_name(v)}")
            bottom.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="median / floor")
            for ax in (top, bottom):
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=8)
        fig.suptitle(group[0]["device"], fontsize=9)
        fig.tight_layout()
        written.append(out_dir / f"{op}_{dtype}_v{v}.png")
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    sweep = [r for r in rows if r["n"] == shapes.TARGET_N]
    vocabs = defaultdict(set)
    for r in sweep:
        vocabs[(r["op"], r["dtype"])].add(r["v"])
    panels = sorted((key for key, vs in vocabs.items() if len(vs) > 1),
                    key=lambda p: (shapes.OPS.index(p[0]) if p[0] in shapes.OPS else 99, p[1]))
    if panels:
        fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), squeeze=False)
        for ax, (op, dtype) in zip(axes[:, 0], panels):
            for name in sorted({r["impl"] for r in sweep if r["op"] == op}):
                for mode, style in (("fwd_bwd", "o-"), ("fwd", "s:")):
                    key = (op, dtype, name, mode)
                    pts = sorted((r["v"], r["median_ms"] / r["floor_ms"]) for r in sweep
                                 if (r["op"], r["dtype"], r["impl"], r["mode"]) == key)
                    if pts:
                        ax.plot(*zip(*pts), style, color=colors[name], label=f"{name} {mode}")
            ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
            ax.set(xscale="log", yscale="log", xlabel="vocabulary V", ylabel="median / floor",
                   title=f"{op} {dtype}, N={shapes.TARGET_N}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        written.append(out_dir / f"ratio_to_floor_n{shapes.TARGET_N}.png")
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    return written


def write_table(rows: list[dict], out_dir: Path, plots: list[Path] = (),
                source: str = "benchmarks/results/results.csv") -> Path:
    """Writes `out_dir`/table.md (every problem) and returns its path."""
    path = Path(out_dir) / "table.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(rows, plots=[Path(p).name for p in plots], source=source))
    return path


def draw(rows: list[dict], out_dir: Path, source: str = "benchmarks/results/results.csv"
         ) -> list[Path]:
    """The PNGs and table.md in `out_dir`; without matplotlib only table.md (with a note)."""
    try:
        plots = draw_plots(rows, out_dir)
    except ImportError as e:
        print(f"[report] no plots: {e}")
        plots = []
    return plots + [write_table(rows, out_dir, plots, source)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="*", type=Path,
                    help="run CSVs (DIR/bench.csv) to append to RESULTS_DIR/results.csv first")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                    help="where results.csv, table.md and the plots live (default: the "
                         "published GPU results, which refuse CPU rows)")
    ap.add_argument("--readme", nargs="?", type=Path, const=RESULTS_DIR.parent.parent / "README.md",
                    default=None, help="rewrite the bench block of this README (GPU rows only)")
    ap.add_argument("--device", default=None, help="plot this device (default: the newest run's)")
    args = ap.parse_args(argv)
    results = args.results_dir / "results.csv"
    published = args.results_dir.resolve() == RESULTS_DIR.resolve()
    try:
        for path in args.runs if published or args.readme else ():
            check_gpu_rows(read_rows(path), f"{path}: benchmarks/results and the README")
        if args.runs:
            print(f"[report] {append_results(args.runs, results)} new rows appended to {results}")
        rows = latest(read_rows(results), args.device)
        if args.readme:
            check_gpu_rows(rows, f"{results}: the README's benchmark block")
    except NotGpuRowsError as e:
        print(f"[report] refused: {e}", file=sys.stderr)
        return 2
    root = RESULTS_DIR.parent.parent
    source = (results.resolve().relative_to(root) if results.resolve().is_relative_to(root)
              else results)
    written = draw(rows, args.results_dir, source=str(source))
    print("[report] wrote " + ", ".join(str(p) for p in written))
    if args.readme:
        here = args.readme.resolve().parent
        rel = [os.path.relpath(p, here) for p in written if p.suffix == ".png"]
        if rewrite_readme(args.readme, headline(rows, plots=rel, source=str(source))):
            print(f"[report] rewrote the {BEGIN} block of {args.readme}")
        else:
            print(f"[report] {args.readme} has no {BEGIN} ... {END} block; left untouched")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
