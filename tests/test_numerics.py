"""Numerics contracts of issue 12 on every implementation (JAX "triton" through the interpreter,
"xla", torch_ref; both launch paths) against float64 NumPy references:

- the NaN/+inf policy: a row with a NaN logit gives NaN loss/lse/entropy/log-prob and an
  all-NaN gradient row; a row with +inf and no NaN gives lse +inf (as jax.nn.logsumexp), NaN
  loss and an all-NaN gradient row; an all -inf row keeps its documented result; NaN teacher
  log-probs give a NaN KD loss; merge_partials with a +inf partial gives +inf;
- an accurate softcap for every c > 0 (values and gradients);
- the static-option helpers of _common (check_static_float, check_static_int,
  labels_to_int32).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_fusedloss
import torch_ref
from jax_fusedloss import _common, _triton_jax
from tests.helpers import assert_close, force_path, to_numpy

IMPL_PATHS = [("triton", "rows"), ("triton", "split"), ("torch_ref", "rows"),
              ("torch_ref", "split"), ("xla", "rows")]
# Two forward tiles (4096) and, on the split path, two vocabulary splits with a ragged tail:
# a NaN or +inf in either half must reach the row's result through the merge.
V = 4200
NAN, INF = float("nan"), float("inf")


@pytest.fixture(params=IMPL_PATHS, ids=lambda p: f"{p[0]}-{p[1]}")
def impl(request, monkeypatch):
    name, path = request.param
    force_path(path, monkeypatch)
    return name


# ----------------------------------------------------------------------------- float64 oracles
def np_lse(z):
    m = z.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))[..., 0]


def np_softmax(z):
    return np.exp(z - np_lse(z)[..., None])


def onehot(labels, vocab):
    return (np.arange(vocab)[None, :] == np.asarray(labels)[:, None]).astype(np.float64)


def check_rows(got, expected, what, rtol=2e-5, atol=0.0):
    """got vs expected row by row: NaN, +-inf exactly where expected, the rest close."""
    got, expected = to_numpy(got).astype(np.float64), np.asarray(expected, np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    for pattern, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        mismatch = np.argwhere(test(got) != test(expected))
        assert not len(mismatch), (f"{what}: {len(mismatch)} entries differ in being {pattern}; "
                                   f"first at {tuple(mismatch[0])}: got {got[tuple(mismatch[0])]}"
                                   f", expected {expected[tuple(mismatch[0])]}")
    finite = np.isfinite(expected)
    assert_close(got[finite], expected[finite], rtol=rtol, atol=atol, what=what)


def grad_atol(expected):
    e = np.asarray(expected)
    return 2e-5 * max(float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0)), 1e-30)


# ----------------------------------------------------------------------------- cross-entropy
def policy_logits(seed):
    """Row 0 ordinary; 1 NaN in the second half; 2 +inf in the first half; 3 +inf and NaN;
    4 +inf in the second half; 5 NaN and an ignored label."""
    x = np.random.default_rng(seed).normal(size=(6, V)).astype(np.float32) * 2
    x[1, 4100] = NAN
    x[2, 7] = INF
    x[3, 7], x[3, 4100] = INF, NAN
    x[4, 4150] = INF
    x[5, 50] = NAN
    return x


def run_ce(impl, x, y, w, *, return_lse, **opts):
    """(per-row loss, lse, gradient of sum(w * loss)); w = None: "sum" (the fused gradient
    path, unit cotangent) and its scalar loss."""
    reduction = "none" if w is not None else "sum"
    kw = dict(reduction=reduction, return_lse=return_lse, **opts)
    if impl == "torch_ref":
        xt = torch.from_numpy(x.copy()).requires_grad_(True)
        out = torch_ref.cross_entropy(xt, torch.from_numpy(y), **kw)
        loss, lse = out if return_lse else (out, None)
        (loss * (1.0 if w is None else torch.from_numpy(w))).sum().backward()
        return loss.detach(), lse, xt.grad

    def f(x):
        out = jax_fusedloss.cross_entropy(x, jnp.asarray(y), implementation=impl, **kw)
        return out if return_lse else (out, None)

    loss, lse = f(jnp.asarray(x))
    grad = jax.grad(lambda x: jnp.sum(f(x)[0] * (1.0 if w is None else w)))(jnp.asarray(x))
    return loss, lse, grad


@pytest.mark.parametrize("return_lse", [True, False], ids=["lse-unfused", "fused"])
def test_ce_nan_inf_policy(impl, return_lse, interpreter):
    x = policy_logits(1)
    y = np.random.default_rng(2).integers(0, V, size=6).astype(np.int32)
    y[5] = -100
    w = np.linspace(0.5, 1.5, 6).astype(np.float32) if return_lse else None
    loss, lse, grad = run_ce(impl, x, y, w, return_lse=return_lse)
    x64 = x[0:1].astype(np.float64)
    ref_loss = np_lse(x64) - x64[0, y[0]]
    ref_grad = np.full(x.shape, NAN)  # every row but 0 holds a NaN or +inf logit
    ref_grad[0] = (np_softmax(x64) - onehot(y[:1], V))[0] * (1.0 if w is None else w[0])
    check_rows(grad, ref_grad, "grad", atol=grad_atol(ref_grad))
    if return_lse:
        check_rows(loss, [ref_loss[0], NAN, NAN, NAN, NAN, 0.0], "loss")
        check_rows(lse, [np_lse(x64)[0], NAN, INF, NAN, INF, NAN], "lse")
    else:
        assert np.isnan(to_numpy(loss)), f"sum of losses {to_numpy(loss)} must be NaN"


def test_ce_nan_inf_with_options(impl, interpreter):
    """Smoothing and z-loss do not turn +inf into -inf or a finite loss either; a softcap maps
    +inf to the finite cap (c * tanh(inf) = c), as the naive formula does."""
    x = policy_logits(3)[:3]
    y = np.array([1, 2, 3], np.int32)
    loss, lse, _ = run_ce(impl, x, y, np.ones(3, np.float32), return_lse=True,
                          label_smoothing=0.1, z_loss=1e-3)
    assert np.isnan(to_numpy(loss)[1:]).all() and np.isfinite(to_numpy(loss)[0])
    loss, lse, grad = run_ce(impl, x[[0, 2]], y[:2], np.ones(2, np.float32), return_lse=True,
                             logit_softcap=5.0)
    z = 5.0 * np.tanh(x[[0, 2]].astype(np.float64) / 5.0)
    check_rows(loss, np_lse(z) - z[[0, 1], y[:2]], "softcapped loss")
    ref = (np_softmax(z) - onehot(y[:2], V)) / np.cosh(x[[0, 2]].astype(np.float64) / 5.0) ** 2
    check_rows(grad, ref, "softcapped grad", atol=grad_atol(ref))


# ----------------------------------------------------------------------------- reductions
def run_reductions(impl, x, labels, temperature, cot):
    """(lse, entropy, logp, gradient of sum(cot[:, 0] lse + cot[:, 1] H + cot[:, 2] logp))."""
    if impl == "torch_ref":
        xt = torch.from_numpy(x.copy()).requires_grad_(True)
        lse = torch_ref.logsumexp(xt, temperature=temperature)
        logp, ent = torch_ref.token_logprobs(xt, torch.from_numpy(labels),
                                             temperature=temperature, return_entropy=True)
        c = torch.from_numpy(cot)
        (c[:, 0] * lse + c[:, 1] * ent + c[:, 2] * logp).sum().backward()
        return lse.detach(), ent.detach(), logp.detach(), xt.grad

    def f(x):
        kw = dict(temperature=temperature, implementation=impl)
        lse = jax_fusedloss.logsumexp(x, **kw)
        logp, ent = jax_fusedloss.token_logprobs(x, jnp.asarray(labels), return_entropy=True,
                                                 **kw)
        return lse, ent, logp

    outs = f(jnp.asarray(x))
    grad = jax.grad(lambda x: sum(jnp.sum(o * cot[:, i]) for i, o in enumerate(f(x))))(
        jnp.asarray(x))
    return (*outs, grad)


def test_reductions_nan_inf_policy(impl, interpreter):
    """Row 0 ordinary; 1 NaN; 2 +inf; 3 all -inf (documented: lse -inf, entropy and logp NaN,
    zero gradient); 4 +inf and NaN; 5 +inf in the second half."""
    t = 1.5
    x = policy_logits(4)[[0, 1, 2, 3, 3, 4]]
    x[3] = -INF
    labels = np.random.default_rng(6).integers(0, V, size=6).astype(np.int32)
    cot = np.random.default_rng(7).uniform(0.5, 1.5, size=(6, 3)).astype(np.float32)
    lse, ent, logp, grad = run_reductions(impl, x, labels, t, cot)
    z = x[0:1].astype(np.float64) / t
    p = np_softmax(z)
    h = -(p * np.log(p)).sum(-1)
    lp = z[0, labels[0]] - np_lse(z)
    check_rows(lse, [np_lse(z)[0], NAN, INF, -INF, NAN, INF], "lse")
    check_rows(ent, [h[0], NAN, NAN, NAN, NAN, NAN], "entropy")
    check_rows(logp, [lp[0], NAN, NAN, NAN, NAN, NAN], "logp")
    ref = np.full(x.shape, NAN)
    ref[3] = 0.0
    ref[0] = (cot[0, 0] * p - cot[0, 1] * p * (np.log(p) + h[:, None])
              + cot[0, 2] * (onehot(labels[:1], V) - p))[0] / t
    check_rows(grad, ref, "grad", atol=grad_atol(ref))


def test_temperature_overflow_is_inf_not_minus_inf(impl, interpreter):
    """x / T overflowing float32 is +inf: lse +inf (as jax.nn.logsumexp), entropy NaN."""
    x = np.random.default_rng(8).normal(size=(2, 300)).astype(np.float32)
    x[:, 5] = 10.0
    lse, ent, _, _ = run_reductions(impl, x, np.zeros(2, np.int32), 1e-38,
                                    np.ones((2, 3), np.float32))
    check_rows(lse, [INF, INF], "lse")
    check_rows(ent, [NAN, NAN], "entropy")


def test_merge_partials_inf_and_nan():
    m = jnp.array([[1.0, INF, -INF], [1.0, 2.0, 3.0], [1.0, NAN, 0.0], [-INF, -INF, -INF]])
    s = jnp.array([[2.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    u = jnp.array([[-0.5, NAN, 0.0], [-0.1, -0.2, -0.3], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mm, ss, uu = jax_fusedloss.merge_partials(m, s, u)
    lse = mm + jnp.log(ss)
    ref = np.log(np.exp(np.array([1.0, 2.0, 3.0])).sum())
    check_rows(lse, [INF, ref, NAN, -INF], "merged lse")
    assert np.isnan(to_numpy(uu)[0]) and np.isnan(to_numpy(uu)[2])
    # The package's shard-local lse of a row holding +inf merges to jax.nn.logsumexp's +inf.
    z = np.random.default_rng(9).normal(size=(3, 900)).astype(np.float32)
    z[0, 700] = INF
    parts = jnp.stack([jax_fusedloss.logsumexp(c, implementation="xla")
                       for c in jnp.split(jnp.asarray(z), 3, axis=-1)], -1)
    mm, ss = jax_fusedloss.merge_partials(parts, jnp.ones_like(parts))
    check_rows(mm + jnp.log(ss), jax.nn.logsumexp(jnp.asarray(z), axis=-1), "shard merge")


# ----------------------------------------------------------------------------- distillation
K = 8


def kd_inputs(seed):
    """Student rows: 0 ordinary; 1 NaN at a non-id column; 2 +inf at a non-id column; 3 a NaN
    teacher log-prob; 4 +inf at an id column. Teacher: distinct ids, no mask."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(5, V)).astype(np.float32) * 2
    ids = np.stack([rng.choice(V, K, replace=False) for _ in range(5)]).astype(np.int32)
    t = rng.normal(size=(5, K)) * 2
    lp = (t - np_lse(np.concatenate([t, np.zeros((5, 1))], -1))[:, None]).astype(np.float32)
    free = [c for c in (4100, 4101, 4102) if c not in ids[1] and c not in ids[2]][0]
    x[1, free], x[2, free] = NAN, INF
    lp[3, 2] = NAN
    x[4, ids[4, 0]] = INF
    return x, ids, lp


def np_kd(x, ids, lp, t, normalize):
    """float64 per-row KL and its gradient w.r.t. x (finite inputs)."""
    s = x.astype(np.float64) / t
    rows = np.arange(len(x))[:, None]
    sk = s[rows, ids]
    p = np.exp(lp.astype(np.float64))
    big_p = p.sum(-1, keepdims=True)
    g = np.zeros_like(s)
    if normalize == "full":
        L = np_lse(s)[:, None]
        g += big_p * np_softmax(s)
    else:
        L = np_lse(sk)[:, None]
        np.add.at(g, (np.broadcast_to(rows, ids.shape), ids), big_p * np.exp(sk - L))
    np.add.at(g, (np.broadcast_to(rows, ids.shape), ids), -p)
    return (p * (lp - sk + L)).sum(-1), g / t


def run_kd(impl, x, ids, lp, labels=None, **opts):
    """(per-row loss, gradient of the summed loss)."""
    distill = labels is not None
    if impl == "torch_ref":
        xt = torch.from_numpy(x.copy()).requires_grad_(True)
        args = ([torch.from_numpy(labels)] if distill else []) + [torch.from_numpy(ids),
                                                                  torch.from_numpy(lp)]
        f = torch_ref.distill_loss if distill else torch_ref.kd_loss
        loss = f(xt, *args, reduction="none", **opts)
        loss.sum().backward()
        return loss.detach(), xt.grad
    args = ([jnp.asarray(labels)] if distill else []) + [jnp.asarray(ids), jnp.asarray(lp)]
    f = jax_fusedloss.distill_loss if distill else jax_fusedloss.kd_loss

    def g(x):
        return f(x, *args, reduction="none", implementation=impl, **opts)

    xj = jnp.asarray(x)
    return g(xj), jax.grad(lambda x: jnp.sum(g(x)))(xj)


@pytest.mark.parametrize("normalize,t", [("full", 2.0), ("topk", 0.7)])
def test_kd_nan_inf_policy(impl, normalize, t, interpreter):
    """"full" sees every column: rows 1-4 NaN, all-NaN gradient rows. "topk" sees only the
    teacher's ids (as its formula): rows 1 and 2 are ordinary; rows 3 and 4 are NaN with NaN
    gradients at the ids and zeros elsewhere, as autodiff of the naive formula gives."""
    x, ids, lp = kd_inputs(10)
    loss, grad = run_kd(impl, x, ids, lp, temperature=t, normalize=normalize)
    finite_rows = [0] if normalize == "full" else [0, 1, 2]
    ref_loss, ref_grad = np_kd(x[finite_rows], ids[finite_rows], lp[finite_rows], t, normalize)
    want_loss = np.full(5, NAN)
    want_loss[finite_rows] = ref_loss
    want_grad = np.full(x.shape, NAN)
    if normalize == "topk":
        want_grad[3:] = 0.0
        for r in (3, 4):
            want_grad[r, ids[r]] = NAN
    want_grad[finite_rows] = ref_grad
    check_rows(loss, want_loss, "loss")
    check_rows(grad, want_grad, "grad", atol=grad_atol(want_grad))


@pytest.mark.parametrize("t", [1.0, 2.0])
def test_distill_nan_inf_policy(impl, t, interpreter):
    """distill_loss (alpha = 0.3): rows 1-4 NaN with all-NaN gradients; an ignored row with a
    NaN logit adds 0 but its gradient row is NaN (as torch and autodiff of the naive formula)."""
    x, ids, lp = kd_inputs(11)
    labels = np.random.default_rng(12).integers(0, V, size=5).astype(np.int32)
    x = np.concatenate([x, x[1:2]])
    ids, lp = np.concatenate([ids, ids[1:2]]), np.concatenate([lp, lp[1:2]])
    labels = np.concatenate([labels, [-100]]).astype(np.int32)
    loss, grad = run_kd(impl, x, ids, lp, labels, alpha=0.3, temperature=t)
    kd, g_kd = np_kd(x[:1], ids[:1], lp[:1], t, "full")
    x64 = x[:1].astype(np.float64)
    ce = np_lse(x64) - x64[0, labels[0]]
    g_ce = np_softmax(x64) - onehot(labels[:1], V)
    check_rows(loss, [0.3 * ce[0] + 0.7 * kd[0], NAN, NAN, NAN, NAN, 0.0], "loss")
    want = np.full(x.shape, NAN)
    want[0] = 0.3 * g_ce[0] + 0.7 * g_kd[0]
    check_rows(grad, want, "grad", atol=grad_atol(want))


def test_kd_temperature_overflow_is_nan(impl, interpreter):
    """A temperature so small that x / T overflows gives NaN, never -inf."""
    x, ids, lp = kd_inputs(13)
    loss, _ = run_kd(impl, x[:1], ids[:1], lp[:1], temperature=1e-38)
    check_rows(loss, [NAN], "loss")


# ----------------------------------------------------------------------------- softcap
@pytest.mark.parametrize("cap", [0.5, 30.0, 1e4, 1e6, 1e8])
def test_softcap_accurate_for_every_cap(impl, cap, interpreter):
    """c * tanh(x / c) against float64 for caps from below the logits' scale (saturated tanh)
    to far above it (tanh(u) ~ u, where 1 - 2 / (exp(2u) + 1) cancels: c = 1e8 gave 11.92 for
    1.47). Logits up to ~50 so that every cap sees both regimes."""
    rng = np.random.default_rng(14)
    x = (rng.normal(size=(4, 300)) * np.array([[1.0], [3.0], [10.0], [25.0]])).astype(np.float32)
    y = rng.integers(0, 300, size=4).astype(np.int32)
    w = np.array([1.0, 0.5, 2.0, 1.0], np.float32)
    loss, lse, grad = run_ce(impl, x, y, w, return_lse=True, logit_softcap=cap)
    x64 = x.astype(np.float64)
    z = cap * np.tanh(x64 / cap)
    rows = np.arange(4)
    check_rows(loss, np_lse(z) - z[rows, y], "loss")
    check_rows(lse, np_lse(z), "lse")
    ref = w[:, None] * (np_softmax(z) - onehot(y, 300)) / np.cosh(x64 / cap) ** 2
    check_rows(grad, ref, "grad", atol=grad_atol(ref))


def test_softcap_gradient_relative_accuracy(impl, interpreter):
    """dz/dx = 1 - tanh(u)**2 without cancellation where |tanh u| ~ 1: every gradient entry
    to 1e-4 relative (1 - t*t with t rounded near 1 was off by 7% at u = 8)."""
    x = np.linspace(-9.0, 9.0, 64, dtype=np.float32)[None, :].repeat(2, 0)
    y = np.array([3, 60], np.int32)
    _, _, grad = run_ce(impl, x, y, np.ones(2, np.float32), return_lse=True, logit_softcap=1.0)
    x64 = x.astype(np.float64)
    z = np.tanh(x64)
    ref = (np_softmax(z) - onehot(y, 64)) / np.cosh(x64) ** 2
    assert_close(grad, ref, rtol=1e-4, atol=1e-30, what="softcap grad, relative")


# ----------------------------------------------------------------------------- _common helpers
def test_check_static_float():
    f = _common.check_static_float
    assert f(0.25, "label_smoothing", lo=0.0, hi=1.0) == 0.25
    assert f(1, "label_smoothing", lo=0.0, hi=1.0) == 1.0
    assert f(np.float32(3.0), "logit_softcap", lo=0.0, lo_open=True) == 3.0
    for value, kw in [(NAN, {}), (INF, dict(lo=0.0, lo_open=True)),
                      (0.0, dict(lo=0.0, lo_open=True)), (-1e-9, dict(lo=0.0)),
                      (1.5, dict(lo=0.0, hi=1.0)), (1.0, dict(hi=1.0, hi_open=True))]:
        with pytest.raises(ValueError, match="^x="):
            f(value, "x", **kw)
    with pytest.raises(ValueError, match=r"logit_softcap=inf must lie in \(0, inf\)"):
        f(INF, "logit_softcap", lo=0.0, lo_open=True, hi=INF)
    for bad in ("0.1", None, True, [0.1]):
        with pytest.raises(TypeError, match="z_loss"):
            f(bad, "z_loss", lo=0.0)
    with pytest.raises(TypeError, match="z_loss must be a static Python number, got a traced"):
        jax.jit(lambda v: f(v, "z_loss", lo=0.0))(0.1)


def test_check_static_int():
    f = _common.check_static_int
    assert f(-100, "ignore_index") == -100 and f(np.int64(2**31 - 1), "ignore_index") == 2**31 - 1
    for bad in (2**31, -(2**31) - 1, 2**40):
        with pytest.raises(ValueError, match=r"ignore_index=\d+|ignore_index=-\d+"):
            f(bad, "ignore_index")
    for bad in (1.5, -100.0, "3", None, False):
        with pytest.raises(TypeError, match="ignore_index"):
            f(bad, "ignore_index")
    with pytest.raises(TypeError, match="ignore_index must be a static Python int"):
        jax.jit(lambda v: f(v, "ignore_index"))(3)


def test_labels_to_int32_checks_at_own_width():
    f = _common.labels_to_int32
    got = f(jnp.array([0, 9, 10, 2**32 - 1, 2**32 - 100], jnp.uint32), -100, 10)
    assert got.dtype == jnp.int32 and got.tolist() == [0, 9, -1, -1, -1]
    assert f(jnp.array([3, -100, 12], jnp.int32), -100, 10).tolist() == [3, -100, 12]
    assert f(jnp.array([3, 200], jnp.uint8), None, 1000).tolist() == [3, 200]
    with jax.enable_x64(True):
        y = jnp.array([2**32 + 1, -(2**32) - 100, -100, 3, -1, 2**31], jnp.int64)
        assert f(y, -100, 10).tolist() == [-1, -1, -100, 3, -1, -1]
        assert f(y, -1, 10).tolist() == [-2, -2, -2, 3, -1, -2]
        assert f(y, None, 10).tolist() == [-1, -1, -1, 3, -1, -1]
        big = jnp.array([2**63 - 1, 5], jnp.uint64)
        assert f(big, -100, 10).tolist() == [-1, 5]
    with pytest.raises(ValueError, match="ignore_index"):
        f(jnp.array([1], jnp.uint32), 2**31, 10)


def test_wide_labels_through_the_kernels(interpreter):
    """labels_to_int32's sentinel is reported by the kernels as out of range (NaN loss), not
    scored as a wrapped class: int64 2**32 + 1 would be class 1 after astype(int32)."""
    x = jnp.asarray(np.random.default_rng(15).normal(size=(3, 40)), jnp.float32)
    with jax.enable_x64(True):
        y = _common.labels_to_int32(jnp.array([2**32 + 1, 1, -100], jnp.int64), -100, 40)
    for impl in ("triton", "xla"):
        loss = to_numpy(jax_fusedloss.cross_entropy(x, y, reduction="none", implementation=impl))
        assert np.isnan(loss[0]) and np.isfinite(loss[1]) and loss[2] == 0, (impl, loss)


# ----------------------------------------------------------------------------- public API
# The public functions validate through _common's check_static_float / check_static_int and
# narrow labels with labels_to_int32.

def test_public_softcap_inf_rejected():
    with pytest.raises(ValueError, match="logit_softcap"):
        jax_fusedloss.cross_entropy(jnp.zeros((2, 5)), jnp.zeros(2, jnp.int32),
                                    logit_softcap=INF, implementation="xla")


def test_public_traced_option_names_argument():
    x, y = jnp.zeros((2, 5)), jnp.zeros(2, jnp.int32)
    with pytest.raises(TypeError, match="label_smoothing must be a static"):
        jax.jit(lambda e: jax_fusedloss.cross_entropy(x, y, label_smoothing=e,
                                                      implementation="xla"))(0.1)


def test_public_nan_z_loss_rejected():
    with pytest.raises(ValueError, match="z_loss"):
        jax_fusedloss.cross_entropy(jnp.zeros((2, 5)), jnp.zeros(2, jnp.int32), z_loss=NAN,
                                    implementation="xla")


def test_public_int64_labels_checked_at_own_width():
    x = jnp.asarray(np.random.default_rng(16).normal(size=(2, 40)), jnp.float32)
    with jax.enable_x64(True):
        loss = jax_fusedloss.cross_entropy(x, jnp.array([2**32 + 1, 1], jnp.int64),
                                           reduction="none", implementation="xla")
    assert np.isnan(to_numpy(loss)[0])



# ----------------------------------------------------------------------------- loss scaling
# fp16 training multiplies the loss by a scale (here 1024) so that small gradient entries
# survive fp16: the gradient must be as accurate as float64 * scale rounded to fp16 once. A
# unit-cotangent gradient written in fp16 and rescaled afterwards flushes entries below fp16's
# smallest subnormal before the scale could save them (4.3% of them for "ce" before the fix).
# (N, V, logit std) per op: distill on a smaller shape with wider logits (interpreter time).
LOSS_SCALE = 1024.0
SCALE_SHAPES = {"ce": (64, 2048, 2.0), "distill": (16, 512, 4.0)}


def scaled_grad(impl, op, x, ids, lp, y):
    """Gradient of LOSS_SCALE * loss("mean") w.r.t. fp16 logits, as float64 numpy."""
    if impl == "torch_ref":
        xt = torch.from_numpy(x).to(torch.float16).requires_grad_(True)
        if op == "ce":
            loss = torch_ref.cross_entropy(xt, torch.from_numpy(y))
        else:
            loss = torch_ref.distill_loss(xt, torch.from_numpy(y), torch.from_numpy(ids),
                                          torch.from_numpy(lp), alpha=0.5)
        (loss * LOSS_SCALE).backward()
        return xt.grad.double().numpy()

    def f(x):
        if op == "ce":
            return jax_fusedloss.cross_entropy(x, jnp.asarray(y), implementation=impl)
        return jax_fusedloss.distill_loss(x, jnp.asarray(y), jnp.asarray(ids), jnp.asarray(lp),
                                          alpha=0.5, implementation=impl)

    g = jax.jit(jax.grad(lambda x: f(x) * LOSS_SCALE))(jnp.asarray(x, jnp.float16))
    return np.asarray(g, np.float64)


@pytest.mark.parametrize("op", ["ce", "distill"])
def test_fp16_loss_scaling_not_flushed(impl, op, interpreter):
    """Every implementation, on the rows path: the launch paths differ only in how the
    forward writes the same unit gradient, which the recompute does not use."""
    if _triton_jax.num_sms() > 1:
        pytest.skip("the rows path only (interpreter time)")
    n, vocab, std = SCALE_SHAPES[op]
    rng = np.random.default_rng(17)
    x = (rng.normal(size=(n, vocab)) * std).astype(np.float16).astype(np.float32)
    y = rng.integers(0, vocab, n).astype(np.int32)
    ids = np.stack([rng.choice(vocab, 4, replace=False) for _ in range(n)]).astype(np.int32)
    lp = np.log(rng.dirichlet(np.ones(5), n)[:, :4]).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = (np_softmax(x64) - onehot(y, vocab)) / n
    if op == "distill":
        _, kd_grad = np_kd(x, ids, lp, 1.0, "full")
        ref = 0.5 * ref + 0.5 * kd_grad / n
    ref *= LOSS_SCALE
    got = scaled_grad(impl, op, x, ids, lp, y)
    representable = np.abs(ref) >= 6e-8  # fp16's smallest subnormal
    flushed = float(np.mean(got[representable] == 0))
    rel = np.abs(got - ref)[representable] / np.abs(ref[representable])
    once = np.abs(ref.astype(np.float16).astype(np.float64) - ref)[representable]
    rel_once = once / np.abs(ref[representable])
    assert flushed == 0.0, f"{flushed:.2%} of gradient entries flushed to zero"
    assert rel.mean() <= 1.5 * rel_once.mean() + 1e-5, (
        f"mean relative error {rel.mean():.3g} vs {rel_once.mean():.3g} for float64 * scale "
        f"rounded to fp16 once; max {rel.max():.3g}")


# ----------------------------------------------------------------------------- vmap over size 0
VMAP_OPS = {
    "cross_entropy": lambda x, y, impl: jax_fusedloss.cross_entropy(x, y, implementation=impl),
    "cross_entropy-none-lse": lambda x, y, impl: jnp.sum(jnp.stack(jax_fusedloss.cross_entropy(
        x, y, reduction="none", return_lse=True, implementation=impl))),
    "logsumexp": lambda x, y, impl: jax_fusedloss.logsumexp(x, implementation=impl),
    "entropy": lambda x, y, impl: jax_fusedloss.entropy(x, implementation=impl),
    "token_logprobs": lambda x, y, impl: jax_fusedloss.token_logprobs(x, y, implementation=impl),
    "kd_loss": lambda x, y, impl: jax_fusedloss.kd_loss(
        x, jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2)), implementation=impl),
    "distill_loss": lambda x, y, impl: jax_fusedloss.distill_loss(
        x, y, jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2)), alpha=0.5, implementation=impl),
}


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_vmap_over_size_zero_axis(impl, interpreter):
    """jax.vmap over an empty batch gives empty results and gradients, launching nothing (the
    batching rule divided by the batch size: ZeroDivisionError)."""
    x, y = jnp.ones((0, 3, 7)), jnp.zeros((0, 3), jnp.int32)
    for name, op in VMAP_OPS.items():
        f = functools.partial(op, impl=impl)
        value = jax.vmap(f)(x, y)
        assert value.shape[0] == 0, f"{name}: {value.shape}"
        grad = jax.jit(jax.vmap(jax.grad(lambda x, y: jnp.sum(f(x, y)))))(x, y)
        assert grad.shape == x.shape, f"{name}: grad {grad.shape}"
        unbatched_y = jax.vmap(f, in_axes=(0, None))(x, jnp.zeros(3, jnp.int32))
        assert unbatched_y.shape == value.shape, f"{name}: {unbatched_y.shape}"


# ----------------------------------------------------------------------------- K > 65536
def test_more_than_65536_teacher_entries():
    """The KD kernels' tile caps K at 65536 (more does not compile for sm_90; the interpreter
    would hide it): forced "triton" says so, None runs the XLA twin, torch_ref raises."""
    k = 65537
    x, ids, lp = jnp.zeros((1, k)), jnp.zeros((1, k), jnp.int32), jnp.zeros((1, k))
    y = jnp.zeros((1,), jnp.int32)
    with pytest.raises(NotImplementedError, match="at most 65536 teacher entries"):
        jax_fusedloss.kd_loss(x, ids, lp, implementation="triton")
    with pytest.raises(NotImplementedError, match="at most 65536 teacher entries"):
        jax_fusedloss.distill_loss(x, y, ids, lp, alpha=0.5, implementation="triton")
    out = jax.eval_shape(lambda x: jax_fusedloss.kd_loss(x, ids, lp), x)
    assert out.shape == ()
    xt, idt, lpt = torch.zeros(1, k), torch.zeros(1, k, dtype=torch.int32), torch.zeros(1, k)
    with pytest.raises(ValueError, match=r"teacher_ids.shape\[-1\]=65537 \(K\) must be at most"):
        torch_ref.kd_loss(xt, idt, lpt)
    with pytest.raises(ValueError, match="must be at most 65536"):
        torch_ref.distill_loss(xt, torch.zeros(1, dtype=torch.int64), idt, lpt, alpha=0.5)


# ----------------------------------------------------------------------------- clear errors
@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_second_order_is_a_library_error(impl, interpreter):
    x, y = jnp.ones((2, 5)), jnp.zeros(2, jnp.int32)
    ids, lp = jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 2))
    for f in (lambda x: jax_fusedloss.cross_entropy(x, y, implementation=impl),
              lambda x: jax_fusedloss.kd_loss(x, ids, lp, implementation=impl)):
        assert jax.grad(f)(x).shape == x.shape
        with pytest.raises(NotImplementedError, match="second-order derivatives"):
            jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x)
        with pytest.raises(NotImplementedError, match="second-order derivatives"):
            jax.hessian(f)(x)


LATE_INTERPRET = """
import os, triton
os.environ["TRITON_INTERPRET"] = "1"
import jax.numpy as jnp, jax_fusedloss
x, y = jnp.ones((2, 5)), jnp.zeros(2, jnp.int32)
try:
    jax_fusedloss.cross_entropy(x, y, implementation="triton")
except NotImplementedError as e:
    print("RAISED", e)
print("FALLBACK", float(jax_fusedloss.cross_entropy(x, y)))
"""


def test_interpreter_set_after_triton_import_is_a_clear_error():
    import subprocess
    import sys

    from tests.helpers import compiler_env

    out = subprocess.run([sys.executable, "-c", LATE_INTERPRET], capture_output=True, text=True,
                         env=compiler_env(JAX_PLATFORMS="cpu"), timeout=300)
    assert "RAISED" in out.stdout and "set after triton was imported" in out.stdout, (
        out.stdout + out.stderr[-2000:])
    assert "FALLBACK 1.609" in out.stdout, out.stdout


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_reductions_second_order_is_a_library_error(impl, interpreter):
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 30)), jnp.float32)
    with pytest.raises(NotImplementedError, match="second-order"):
        jax.grad(lambda x: jax.grad(
            lambda x: jax_fusedloss.logsumexp(x, implementation=impl).sum())(x).sum())(x)
