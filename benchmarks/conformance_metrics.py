"""The float64 oracle of the conformance cases and their metrics.

The oracle runs the naive formulas of tests/reference/torch_oracle.py in float64 on the exact
input values (on the CPU; only the rows a case looks at) and takes the gradient of
`loss_scale * sum(value)` from torch.autograd. A metric maps (got, expected, inputs) to an error
(0 is perfect; inf for a NaN or a shape where a number was expected) and a short detail.
"""
from __future__ import annotations

import numpy as np

from benchmarks.conformance_cases import IGNORE, Inputs


def _t64(a: np.ndarray):
    import torch

    return torch.from_numpy(np.asarray(a).astype(np.float64))


def oracle(op: str, inp: Inputs, opts: dict) -> tuple[np.ndarray, np.ndarray]:
    """(value, gradient) in float64. With `inp.rows` set (and reduction "none"), only those
    rows: the value per row and their gradient rows."""
    import torch

    from tests.reference import torch_oracle

    x, y = inp.x, inp.labels
    if inp.rows is not None:
        x, y = x[inp.rows], y[inp.rows]
    xt = _t64(x).requires_grad_(True)
    yt = torch.from_numpy(np.asarray(y, np.int64))
    if op == "ce":
        value = torch_oracle.cross_entropy_reference(
            xt, yt, ignore_index=IGNORE, reduction=opts["reduction"],
            label_smoothing=opts["label_smoothing"], z_loss=opts["z_loss"], dtype=torch.float64)
    elif op == "logprobs":
        value = torch_oracle.reductions_reference(xt, yt, temperature=opts["temperature"],
                                                  dtype=torch.float64)[2]
    else:
        value = torch_oracle.kd_loss_reference(
            xt, torch.from_numpy(inp.ids.astype(np.int64)), _t64(inp.lp),
            temperature=opts["temperature"], normalize="full", reduction=opts["reduction"],
            dtype=torch.float64)
    (grad,) = torch.autograd.grad(value.sum() * opts["loss_scale"], xt)
    return value.detach().numpy(), grad.numpy()


# ----------------------------------------------------------------------------- metrics
def _finite_or_inf(err: float) -> float:
    return float(err) if np.isfinite(err) else float("inf")


def _nan_mismatch(got, exp) -> int:
    return int(np.sum(np.isnan(got) != np.isnan(exp)))


def value_rel(got, exp, inp, opts):
    """max |value - oracle| / max |oracle| (finite oracle entries; NaN where finite: inf)."""
    gv, ev = np.atleast_1d(got[0]), np.atleast_1d(exp[0])
    if gv.shape != ev.shape:
        return float("inf"), f"shape {gv.shape} != {ev.shape}"
    fin = np.isfinite(ev)
    if not np.isfinite(gv[fin]).all():
        return float("inf"), "non-finite value"
    scale = max(float(np.max(np.abs(ev[fin]), initial=0.0)), 1e-300)
    return _finite_or_inf(np.max(np.abs(gv[fin] - ev[fin]), initial=0.0) / scale), ""


def value_abs(got, exp, inp, opts):
    """max |value - oracle| (log-probs: an absolute error is a relative error of p)."""
    gv, ev = np.atleast_1d(got[0]), np.atleast_1d(exp[0])
    return _finite_or_inf(np.max(np.abs(gv - ev))), ""


def value_scaled(got, exp, inp, opts):
    """max |value - oracle| / max |z| of the row's z = x / T: float32's resolution at that
    scale is the floor of any float32 computation of z."""
    gv, ev = np.atleast_1d(got[0]), np.atleast_1d(exp[0])
    x = np.asarray(inp.x, np.float64) if inp.rows is None else np.asarray(inp.x[inp.rows],
                                                                         np.float64)
    scale = np.abs(x).max(axis=1) / opts["temperature"]
    return _finite_or_inf(np.max(np.abs(gv - ev) / np.maximum(scale, 1.0))), ""


def grad_rows(got, exp, inp, opts):
    """max over rows (finite in the oracle) of max |g - g_ref| / max |g_ref| of that row: the
    gradient's error relative to the row's largest entry."""
    g, e = got[1], exp[1]
    if g.shape != e.shape:
        return float("inf"), f"shape {g.shape} != {e.shape}"
    worst, where = 0.0, -1
    for i in range(e.shape[0]):
        if not np.isfinite(e[i]).all():
            continue
        scale = np.max(np.abs(e[i]))
        if scale == 0:
            err = np.max(np.abs(g[i]))
        else:
            err = np.max(np.abs(g[i] - e[i])) / scale
        err = _finite_or_inf(err)
        if err > worst:
            worst, where = err, i
    return worst, (f"worst row {where}" if where >= 0 else "")


def _elementwise(g, e, idx):
    """max relative error of g at idx against e (inf for a NaN)."""
    ge, ee = g[idx], e[idx]
    return _finite_or_inf(np.max(np.abs(ge - ee) / np.abs(ee), initial=0.0))


def grad_true_class(got, exp, inp, opts):
    """max relative error of the gradient at each row's label: (p_y - 1)/N for a mean."""
    y = inp.labels if inp.rows is None else inp.labels[inp.rows]
    rows = np.flatnonzero(y != IGNORE)
    return _elementwise(got[1], exp[1], (rows, y[rows])), ""


def grad_peak(got, exp, inp, opts):
    """max relative error of the gradient at the teacher's first id (its top token)."""
    rows = np.arange(inp.ids.shape[0])
    return _elementwise(got[1], exp[1], (rows, inp.ids[:, 0])), ""


def grad_rel_normal(got, exp, inp, opts):
    """max relative error over gradient entries whose oracle is a float16 normal (>= 2**-14):
    an entry flushed to zero counts 100%."""
    g, e = got[1], exp[1]
    idx = np.nonzero(np.abs(e) >= 2.0**-14)
    flushed = int(np.sum(g[idx] == 0))
    return _elementwise(g, e, idx), f"{flushed} of {idx[0].size} entries zero"


def nan_policy(got, exp, inp, opts):
    """Rows that break the policy: a row with a NaN or +inf logit has a NaN loss and NaN in its
    gradient row; every other row (-inf logits included) a finite loss and gradient row."""
    x = inp.x if inp.rows is None else inp.x[inp.rows]
    x = np.asarray(x, np.float64)
    poisoned = np.isnan(x).any(axis=1) | np.isposinf(x).any(axis=1)
    gv, g = np.atleast_1d(got[0]), got[1]
    ok = np.where(poisoned, np.isnan(gv) & np.isnan(g).any(axis=1),
                  np.isfinite(gv) & np.isfinite(g).all(axis=1))
    rows = np.flatnonzero(~ok)
    return float(rows.size), (f"rows {rows.tolist()}" if rows.size else "")


def zero(got, exp, inp, opts):
    """max(|loss|, max |gradient|): both must be exactly 0 (NaN: inf)."""
    vals = np.concatenate([np.atleast_1d(got[0]).ravel(), np.asarray(got[1]).ravel()])
    return _finite_or_inf(np.max(np.abs(vals))), ""


def nonnegative(got, exp, inp, opts):
    """The most negative per-token loss (0 when none is negative; NaN: inf)."""
    gv = np.atleast_1d(got[0])
    if np.isnan(gv).any():
        return float("inf"), "NaN loss"
    return float(max(0.0, -float(np.min(gv)))), ""


METRICS = dict(value_rel=value_rel, value_abs=value_abs, value_scaled=value_scaled,
               grad_rows=grad_rows, grad_true_class=grad_true_class, grad_peak=grad_peak,
               grad_rel_normal=grad_rel_normal, nan_policy=nan_policy, zero=zero,
               nonnegative=nonnegative)
