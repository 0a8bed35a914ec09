"""The issue's performance targets, checked against benchmark rows (never typed-in numbers).

Each check reads the latest rows of the run and says what was measured, the target, and
whether it holds; a target whose rows are missing says so.
"""
from __future__ import annotations

from benchmarks import shapes

OURS = "jax_fusedloss"
# Issue 11's targets (H100, same run as the baselines):
CE_FLOOR_RATIO = 1.15  # cross_entropy fwd_bwd, N=8192, every named V in bf16 and V=128256 in
#                        fp32: median / floor
KD_FLOOR_RATIO = 1.2  # kd_loss "full" and distill_loss fwd_bwd, bf16, N=8192, V=128256
LSE_BANDWIDTH_SHARE = 0.85  # logsumexp fwd, N >= 1024: floor / median
LSE_FEW_ROWS_RATIO = 0.7  # logsumexp / token_logprobs, N in {1, 8, 64}, V=128256, inside one
#                           jitted program: ours / the XLA formula on float32 (jnp_fp32 rows)


def _find(rows, op, mode, n, v, dtype="bf16", impl=None):
    return [r for r in rows if (r["op"], r["mode"], r["n"], r["v"], r["dtype"]) ==
            (op, mode, n, v, dtype) and (impl is None or r["impl"] == impl)]


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def check(rows: list[dict]) -> list[str]:
    """One line per target: measured value, target, MET / MISSED / no data."""
    n, v = shapes.TARGET_N, shapes.TARGET_V
    lines = []
    for cv, cdt in [(v, "bf16"), (v, "fp32")] + [(vv, "bf16") for vv in shapes.VOCABS.values()
                                                  if vv != v]:
        mine = _find(rows, "cross_entropy", "fwd_bwd", n, cv, cdt, OURS)
        if mine:
            ratio = mine[0]["median_ms"] / mine[0]["floor_ms"]
            lines.append(f"cross_entropy fwd_bwd {cdt} N={n} V={cv}: {ratio:.2f}x floor "
                         f"(target <= {CE_FLOOR_RATIO}): {_verdict(ratio <= CE_FLOOR_RATIO)}")
    ce = _find(rows, "cross_entropy", "fwd_bwd", n, v)
    ours = [r for r in ce if r["impl"] == OURS]
    if ours:
        r = ours[0]
        others = [b for b in ce if not b["impl"].startswith(("jax_fusedloss", "torch_ref"))]
        slower = [b for b in others if b["median_ms"] <= r["median_ms"]]
        lines.append("cross_entropy fwd_bwd faster than every baseline ("
                     + ", ".join(f"{b['impl']} {b['median_ms']:.3g} ms" for b in others)
                     + f"; ours {r['median_ms']:.3g} ms): "
                     + (_verdict(not slower) if others else "no baseline rows"))
        sweep = sorted((s for s in rows if (s["op"], s["mode"], s["v"], s["dtype"], s["impl"]) ==
                        ("cross_entropy", "fwd_bwd", v, "bf16", OURS) and s["peak_bytes"]),
                       key=lambda s: s["n"])
        if sweep:
            per_token = [(s["n"], (s["peak_bytes"] - shapes.floor_bytes(
                s["op"], s["mode"], s["n"], s["v"], s["dtype"])) / s["n"]) for s in sweep]
            lines.append("cross_entropy fwd_bwd peak beyond logits + gradient, bytes per token "
                         "(O(N) means flat in N): "
                         + ", ".join(f"N={k}: {b:.0f}" for k, b in per_token))
    else:
        lines.append(f"cross_entropy fwd_bwd bf16 N={n} V={v}: no {OURS} row")
    for op, what in (("kd_loss", "kd_loss full"),
                     ("distill_loss", f"distill_loss T={shapes.DISTILL_TEMPERATURE:g} full")):
        kd = _find(rows, op, "fwd_bwd", n, v, impl=OURS)
        if kd:
            ratio = kd[0]["median_ms"] / kd[0]["floor_ms"]
            lines.append(f"{what} fwd_bwd bf16 N={n} V={v} K={kd[0]['k']}: {ratio:.2f}x "
                         f"floor (target <= {KD_FLOOR_RATIO}): "
                         f"{_verdict(ratio <= KD_FLOOR_RATIO)}")
        else:
            lines.append(f"{op} fwd_bwd bf16 N={n} V={v}: no {OURS} row")
    lse = sorted((r for r in rows if (r["op"], r["mode"], r["impl"], r["dtype"]) ==
                  ("logsumexp", "fwd", OURS, "bf16")), key=lambda r: (r["v"], r["n"]))
    for r in lse:
        if r["n"] >= 1024:
            share = r["floor_ms"] / r["median_ms"]
            lines.append(f"logsumexp fwd N={r['n']} V={r['v']}: {100 * share:.0f}% of copy "
                         f"bandwidth (target >= {100 * LSE_BANDWIDTH_SHARE:.0f}%): "
                         f"{_verdict(share >= LSE_BANDWIDTH_SHARE)}")
    if not lse:
        lines.append(f"logsumexp fwd: no {OURS} rows")
    for op in shapes.PROGRAM_OPS:
        for few in shapes.LSE_SMALL_N:
            lines += _few_rows(rows, op, few, v)
    return lines


def _few_rows(rows: list[dict], op: str, n: int, v: int) -> list[str]:
    """The few-row target, ours / jax.nn.logsumexp on float32 (the jnp_fp32 row), from the rows
    timed inside a jitted program (device time per call); the host-clock rows of a single call
    where a run has no such rows."""
    for mode, how in ((shapes.PROGRAM_MODE, f"per call in a program of {shapes.PROGRAM_CALLS}"),
                      ("fwd", "single call, host clock")):
        mine = _find(rows, op, mode, n, v, impl=OURS)
        if not mine:
            continue
        us = mine[0]["median_ms"] * 1e3
        base = _find(rows, op, mode, n, v, impl="jnp_fp32")
        if not base:
            return [f"{op} N={n} V={v}: {us:.1f} us {how} (no jnp_fp32 row to compare with)"]
        ratio = mine[0]["median_ms"] / base[0]["median_ms"]
        return [f"{op} N={n} V={v}: {us:.1f} us {how} = {ratio:.2f}x the XLA formula on "
                f"float32 (target <= {LSE_FEW_ROWS_RATIO}x): "
                f"{_verdict(ratio <= LSE_FEW_ROWS_RATIO)}"]
    return []
