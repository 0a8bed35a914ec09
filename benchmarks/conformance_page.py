"""docs/conformance.rst from a conformance run's CSV (see benchmarks.conformance --render):
the run's device, date, versions and commit, the cases with their metrics and tolerances, and
one row per case and dtype with one column per implementation."""
from __future__ import annotations

from benchmarks import conformance_cases as cc
from benchmarks.conformance_metrics import METRICS

MARK = {"pass": "pass", "FAIL": "**FAIL**", "n/a": "n/a", "error": "**error**"}
INTRO = """\
Numerical conformance
=====================

Every fused-loss library found its precision bugs late, in users' training runs. This page is
the numerical conformance suite of issue 31: one named case per bug class, each with an
independent float64 oracle (the naive formula on the same input values, its gradient by
autodiff), a metric and a tolerance per dtype, run on jax_fusedloss (Triton from JAX, Triton
from ``torch_ref``, the XLA twin) and on every other implementation that installs. A cell says
``pass`` with the measured error of the case's first metric, or ``FAIL`` with that of the first
check it fails (every failed check is listed under *Notes*); ``n/a`` where an implementation
lacks the op or an option the case needs. Generated from ``{source}`` by::

    python -m benchmarks.conformance --out DIR --publish     # run, then regenerate this page
    python -m benchmarks.conformance --render {source_path}  # regenerate from the CSV

"""


def _text(text: str) -> str:
    """Plain text with RST's inline markup characters escaped."""
    for ch in "\\|*`_":
        text = text.replace(ch, "\\" + ch)
    return text


def _table(header, rows, widths=None) -> str:
    lines = [".. list-table::", f"   :header-rows: {1 if header else 0}"]
    if widths:
        lines.append(f"   :widths: {' '.join(str(w) for w in widths)}")
    lines.append("")
    for row in ([header] if header else []) + rows:
        lines.append(f"   * - {row[0] or ' '}")
        lines.extend(f"     - {cell or ' '}" for cell in row[1:])
    return "\n".join(lines) + "\n"


def _checks(case) -> str:
    return "; ".join(f"``{c.metric}`` <= " + ", ".join(f"{c.tol[d]:.3g} ({d})"
                                                        for d in case.dtypes)
                     for c in case.checks)


def _cell(row) -> str:
    status = row["status"]
    if status in ("pass", "FAIL") and row["error"]:
        return f"{MARK[status]} {float(row['error']):.1e}"
    return MARK.get(status, status)


def _literal(text: str) -> str:
    """`text` as an inline literal (RST markup in error messages stays inert)."""
    text = " ".join(text.replace("`", "'").split())
    return f"``{text}``" if text else ""


def page_text(rows: list[dict], source: str) -> str:
    first = rows[0]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    keys = list(dict.fromkeys((r["case"], r["dtype"]) for r in rows))
    cells = {(r["case"], r["dtype"], r["impl"]): r for r in rows}
    out = [INTRO.format(source=source, source_path=f"benchmarks/results/{source}")]
    run = [["device", first["device"]], ["date", first["date"]],
           ["versions", first["versions"]], ["commit", first["commit"]]]
    out += ["The run\n-------\n\n", _table(None, run, [1, 6]), "\n"]
    if first["device"].startswith("CPU"):
        out += [".. note::\n   This is a CPU run: Triton's interpreter, no GPU-only case or "
                "anchor (Liger, Cut Cross-Entropy, torch.compile). The GPU run replaces it.\n\n"]
    out += ["Cases\n-----\n\n"]
    case_rows = [[f"``{c.name}``", c.op, ", ".join(c.dtypes), _text(c.bug), _checks(c)]
                 for c in cc.CASES]
    out += [_table(["case", "op", "dtypes", "bug class", "checks (metric <= tolerance)"],
                   case_rows, [3, 1, 1, 6, 4]), "\n"]
    out += ["Metrics\n-------\n\n"]
    out += [f"- ``{name}``: {_text(' '.join(fn.__doc__.split()))}\n"
            for name, fn in METRICS.items()]
    out += ["\nResults\n-------\n\n"]
    grid = [[f"``{case}`` {dtype}"] + [_cell(cells[(case, dtype, i)])
                                         if (case, dtype, i) in cells else "" for i in impls]
            for case, dtype in keys]
    out += [_table(["case"] + [f"``{i}``" for i in impls], grid), "\n"]
    failed = [f"- ``{r['case']}`` {r['dtype']}, ``{r['impl']}`` {MARK[r['status']]}: "
              f"{_literal(r['detail'])}\n" for r in rows if r["status"] in ("FAIL", "error")]
    missing = sorted({(r["impl"], r["detail"]) for r in rows if r["status"] == "n/a"})
    if failed or missing:
        out += ["Notes\n-----\n\n"] + failed
        out += [f"- ``{impl}`` n/a: {_literal(detail)}\n" for impl, detail in missing]
    return "".join(out)
