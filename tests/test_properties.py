"""Property tests (hypothesis) for every op: random shapes (N <= 12, V in 1..300, odd ones
included), dtypes, options, ignore and mask patterns (all-ignored included) and magnitudes
(scale 0.1..30, offsets up to 1e3). For each drawn case JAX "xla", JAX "triton" (Triton's
interpreter on the CPU, the compiled kernels on a GPU) and torch_ref must agree with the naive
formula at float64 (tests/reference/torch_oracle.py, differentiated by torch.autograd) in value and
gradient, and with each other; and these invariants hold:

- gradient row sums: a softmax-gradient row sums to its row's cotangent times what the formula
  says (0 for cross-entropy without softcap and z-loss, 2 z lse for its z-loss, 0 for KD,
  entropy and log-probs, 1/T for logsumexp; ignored rows are 0);
- "mean" equals "sum" divided by the count (cross_entropy, kd_loss);
- results under `jax.jit` equal eager ones.

How many examples run is a hypothesis profile (registered in tests/conftest.py), chosen by the
environment variable JFL_HYPOTHESIS_PROFILE: "ci" (the default: a few derandomized examples
per test, under a minute in all on two CPU cores) or "gpu" (150 per test, for the GPU machine):

    JFL_HYPOTHESIS_PROFILE=gpu python -m pytest -q tests/test_properties.py
"""
from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_fusedloss
import torch_ref
import torch_ref._launch
from jax_fusedloss import _triton_jax
from tests.helpers import DEVICE, DTYPES, GRAD_TOL, TORCH_DTYPES, assert_close, to_numpy
from tests.reference import torch_oracle

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
given = hypothesis.given

IMPLS = ("xla", "triton", "torch_ref")
OFFSETS = (0.0, -7.5, 100.0, 1e3, -1e3)
FP16_TINY = 6e-8  # fp16's smallest subnormal: smaller gradient entries flush to 0


@contextlib.contextmanager
def launch_path(path: str):
    """The fused row path ("rows": 1 SM) or the split path ("split": 64 SMs), as
    tests.helpers.force_path, without pytest's function-scoped monkeypatch."""
    sms = 1 if path == "rows" else 64
    with mock.patch.object(_triton_jax, "num_sms", lambda: sms), \
            mock.patch.object(torch_ref._launch, "num_sms", lambda t: sms):
        yield


# ----------------------------------------------------------------------------- strategies
@st.composite
def logits_case(draw, max_n=12, max_v=300):
    """(x as float32 numpy holding values exact in `dtype`, dtype name, launch path)."""
    n, v = draw(st.integers(1, max_n)), draw(st.integers(1, max_v))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    scale = draw(st.floats(0.1, 30.0))
    offset = draw(st.sampled_from(OFFSETS))
    seed = draw(st.integers(0, 2**20))
    x = np.random.default_rng(seed).normal(size=(n, v)) * scale + offset
    x = to_numpy(jnp.asarray(x, jnp.float32).astype(DTYPES[dtype])).astype(np.float32)
    return x, dtype, draw(st.sampled_from(["rows", "split"]))


@st.composite
def labels_case(draw, n, v):
    """(labels int32 [n], ignore_index): none, some or all ignored."""
    ignore_index = draw(st.sampled_from([-100, -1, 0]))
    pattern = draw(st.sampled_from(["none", "some", "all"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**20)))
    y = rng.integers(0, v, size=n)
    if pattern == "all":
        y[:] = ignore_index
    elif pattern == "some":
        y[rng.random(n) < 0.4] = ignore_index
    elif ignore_index == 0:
        y[y == 0] = v - 1 if v > 1 else y[y == 0]
    return y.astype(np.int32), ignore_index


@st.composite
def cotangent(draw, reduction, n):
    """The cotangent of the loss: a scalar for "mean"/"sum", a row vector for "none"; exactly
    1 half the time (the fused unit-cotangent path)."""
    if reduction != "none":
        return np.float32(draw(st.sampled_from([1.0, 1.0, 0.37, -2.0, 1024.0])))
    if draw(st.booleans()):
        return np.ones(n, np.float32)
    return np.random.default_rng(draw(st.integers(0, 2**20))).normal(size=n).astype(np.float32)


@st.composite
def teacher_case(draw, n, v):
    """(ids int32 [n, K] with repeats and out-of-range ids, log-probs [n, K] (some -inf),
    mask or None)."""
    k = draw(st.integers(1, min(v, 8)))
    rng = np.random.default_rng(draw(st.integers(0, 2**20)))
    ids = rng.integers(-2, v + 2, size=(n, k)).astype(np.int32)
    p = rng.dirichlet(np.ones(k + 1), size=n)[:, :k]
    p[rng.random((n, k)) < 0.1] = 0.0
    with np.errstate(divide="ignore"):
        lp = np.log(p).astype(np.float32)
    mask = None if draw(st.booleans()) else rng.random((n, k)) < 0.7
    return ids, lp, mask


# ----------------------------------------------------------------------------- the harness
def jax_run(fn, x, dtype, cot, extra=None):
    """jit(value_and_grad) of sum(cot * fn(x)) -> (value, grad, extras...) as numpy."""
    def obj(x):
        out = fn(x)
        return jnp.sum(out * cot), out

    def run(x):
        (_, out), g = jax.value_and_grad(obj, has_aux=True)(x)
        return (out, g) + (tuple(extra(x)) if extra else ())

    return jax.jit(run)(jnp.asarray(x).astype(DTYPES[dtype]))


def value_grad_torch(fn, x, dtype, cot, ref=False):
    t = torch.from_numpy(x.copy())
    t = (t.double() if ref else t.to(DEVICE, TORCH_DTYPES[dtype])).requires_grad_(True)
    out = fn(t)
    c = torch.as_tensor(cot, dtype=out.dtype, device=out.device)
    (g,) = torch.autograd.grad((out * c).sum(), t)
    return out.detach().cpu().double().numpy(), g.detach().cpu().double().numpy()


def tolerances(dtype, zmax, coef, n):
    """(value atol, grad atol without the reference's scale). fp32 rounding of an lse of size
    zmax shifts every softmax entry by about 1e-7 * zmax relative; `coef` bounds a row's
    cotangent times the formula's factor in front of the softmax."""
    value_atol = 2e-6 * (1.0 + zmax) * n
    grad_atol = 1e-6 * (1.0 + zmax) * coef
    return value_atol, grad_atol


def check_all(what, results, ref_value, ref_grad, dtype, zmax, coef):
    """Every implementation (and xla vs triton) against the float64 reference."""
    n = ref_grad.shape[0]
    value_atol, grad_atol = tolerances(dtype, zmax, coef, n)
    scale = float(np.max(np.abs(ref_grad), initial=0.0))
    gtol = GRAD_TOL[dtype] * scale + grad_atol
    if dtype == "float16":
        gtol += FP16_TINY
    for impl, (value, grad) in results.items():
        assert_close(value, ref_value, rtol=2e-5, atol=value_atol, what=f"{what} {impl} value")
        assert_close(grad, ref_grad, rtol=GRAD_TOL[dtype], atol=gtol, what=f"{what} {impl} grad")
    assert_close(results["xla"][0], results["triton"][0], rtol=4e-5, atol=2 * value_atol,
                 what=f"{what} xla vs triton value")
    assert_close(results["xla"][1], results["triton"][1], rtol=2 * GRAD_TOL[dtype],
                 atol=2 * gtol, what=f"{what} xla vs triton grad")


def check_row_sums(what, results, expected, dtype, zmax, coef):
    """Each gradient row sums to `expected` [n] (up to the rounding of its entries)."""
    for impl, (_, grad) in results.items():
        g = np.asarray(to_numpy(grad), np.float64)
        tol = (GRAD_TOL[dtype] + 1e-6 * (1.0 + zmax)) * (np.abs(g).sum(-1) + coef)
        if dtype == "float16":
            tol = tol + g.shape[1] * FP16_TINY
        err = np.abs(g.sum(-1) - expected)
        assert (err <= tol).all(), (f"{what} {impl}: gradient row sums {g.sum(-1)} != "
                                    f"{expected} (max error {err.max():.3g})")


def row_cot(cot, reduction, n, count):
    """Each row's cotangent times its "mean" scale."""
    c = np.broadcast_to(np.asarray(cot, np.float64), (n,))
    return c / count if reduction == "mean" else c


# ----------------------------------------------------------------------------- cross-entropy
@given(case=logits_case(), data=st.data())
def test_cross_entropy_properties(case, data):
    x, dtype, path = case
    n, v = x.shape
    y, ignore_index = data.draw(labels_case(n, v), "labels")
    reduction = data.draw(st.sampled_from(["mean", "sum", "none"]), "reduction")
    opts = dict(ignore_index=ignore_index, reduction=reduction,
                label_smoothing=data.draw(st.sampled_from([0.0, 0.1, 1.0]), "smoothing"),
                z_loss=data.draw(st.sampled_from([0.0, 1e-4, 1e-2]), "z_loss"),
                logit_softcap=data.draw(st.sampled_from([None, 1.0, 30.0]), "softcap"))
    cot = data.draw(cotangent(reduction, n), "cotangent")
    yj, yt = jnp.asarray(y), torch.from_numpy(y).to(DEVICE)
    count = max(int((y != ignore_index).sum()), 1)

    results = {}
    with launch_path(path):
        for impl in ("xla", "triton"):
            def f(x, reduction=reduction, impl=impl):
                return jax_fusedloss.cross_entropy(x, yj, implementation=impl,
                                                   **{**opts, "reduction": reduction})
            out, g, mean, total = jax_run(f, x, dtype, cot,
                                          extra=lambda x, f=f: (f(x, "mean"), f(x, "sum")))
            results[impl] = (out, g)
            assert_close(mean * count, total, rtol=2e-6, atol=1e-6 * (1 + abs(float(total))),
                         what=f"{impl}: mean * count == sum")
            if impl == "triton":
                eager = f(jnp.asarray(x).astype(DTYPES[dtype]))
                assert_close(eager, out, rtol=1e-6, atol=1e-6, what="triton: eager == jit")
        results["torch_ref"] = value_grad_torch(
            lambda t: torch_ref.cross_entropy(t, yt, **opts), x, dtype, cot)
    ref_value, ref_grad = value_grad_torch(
        lambda t: torch_oracle.cross_entropy_reference(t, torch.from_numpy(y), dtype=torch.float64,
                                                    **opts), x, dtype, cot, ref=True)
    zmax = float(np.abs(x).max()) if opts["logit_softcap"] is None else opts["logit_softcap"]
    lse = np.log(np.exp(x.astype(np.float64) - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    rc = row_cot(cot, reduction, n, count)
    coef = float(np.max(np.abs(rc) * (1 + 2 * opts["z_loss"] * np.abs(lse))))
    check_all("cross_entropy", results, ref_value, ref_grad, dtype, zmax, coef)
    if opts["logit_softcap"] is None:
        expected = np.where(y != ignore_index, rc * 2 * opts["z_loss"] * lse, 0.0)
        check_row_sums("cross_entropy", results, expected, dtype, zmax, coef)


# ----------------------------------------------------------------------------- distillation
@given(case=logits_case(), data=st.data())
def test_kd_and_distill_properties(case, data):
    x, dtype, path = case
    n, v = x.shape
    ids, lp, mask = data.draw(teacher_case(n, v), "teacher")
    distill = data.draw(st.booleans(), "distill")
    reduction = data.draw(st.sampled_from(["mean", "sum", "none"]), "reduction")
    t = data.draw(st.sampled_from([0.5, 1.0, 2.5]), "temperature")
    opts = dict(temperature=t, normalize=data.draw(st.sampled_from(["full", "topk"]), "norm"),
                reduction=reduction)
    if distill:
        y, ignore_index = data.draw(labels_case(n, v), "labels")
        opts.update(alpha=data.draw(st.sampled_from([0.0, 0.3, 1.0]), "alpha"),
                    ignore_index=ignore_index,
                    temperature_squared=data.draw(st.booleans(), "t2"))
    cot = data.draw(cotangent(reduction, n), "cotangent")
    jargs = [jnp.asarray(ids), jnp.asarray(lp), None if mask is None else jnp.asarray(mask)]
    targs = [torch.from_numpy(ids), torch.from_numpy(lp),
             None if mask is None else torch.from_numpy(mask)]
    if distill:
        jargs.insert(0, jnp.asarray(y))
        targs.insert(0, torch.from_numpy(y))
    jfn = jax_fusedloss.distill_loss if distill else jax_fusedloss.kd_loss
    tfn = torch_ref.distill_loss if distill else torch_ref.kd_loss
    rfn = torch_oracle.distill_loss_reference if distill else torch_oracle.kd_loss_reference
    valid = (ids >= 0) & (ids < v) & (True if mask is None else mask)
    count = max(int(valid.any(-1).sum()), 1)

    results = {}
    with launch_path(path):
        for impl in ("xla", "triton"):
            def f(x, reduction=reduction, impl=impl):
                return jfn(x, *jargs, implementation=impl, **{**opts, "reduction": reduction})
            extra = None if distill else (lambda x, f=f: (f(x, "mean"), f(x, "sum")))
            out, g, *means = jax_run(f, x, dtype, cot, extra=extra)
            results[impl] = (out, g)
            if means:
                assert_close(means[0] * count, means[1], rtol=2e-6,
                             atol=1e-6 * (1 + abs(float(means[1]))),
                             what=f"{impl}: mean * count == sum")
            if impl == "triton":
                eager = f(jnp.asarray(x).astype(DTYPES[dtype]))
                assert_close(eager, out, rtol=1e-6, atol=1e-6, what="triton: eager == jit")
        results["torch_ref"] = value_grad_torch(
            lambda s: tfn(s, *[a if a is None else a.to(DEVICE) for a in targs], **opts), x,
            dtype, cot)
    ref_value, ref_grad = value_grad_torch(
        lambda s: rfn(s, *targs, dtype=torch.float64, **opts), x, dtype, cot, ref=True)
    zmax = float(np.abs(x).max()) / t
    c2 = t**2 if distill and opts["temperature_squared"] else 1.0
    coef = float(np.max(np.abs(row_cot(cot, reduction, n, 1)))) * max(1.0, c2 / t)
    check_all("distill_loss" if distill else "kd_loss", results, ref_value, ref_grad, dtype,
              zmax, coef)
    check_row_sums("kd", results, np.zeros(n), dtype, zmax, coef)


# ----------------------------------------------------------------------------- reductions
@given(case=logits_case(), data=st.data())
def test_reductions_properties(case, data):
    """logsumexp, entropy and token_logprobs at once: the objective is
    sum(c0 * lse + c1 * H + c2 * logp) with per-row cotangents c."""
    x, dtype, path = case
    n, v = x.shape
    t = data.draw(st.sampled_from([0.5, 1.0, 2.5]), "temperature")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**20), "seed"))
    y = rng.integers(0, v, size=n).astype(np.int32)
    cot = rng.normal(size=(3, n)).astype(np.float32)
    if data.draw(st.booleans(), "unit cotangents"):
        cot[:] = 1.0
    yj, yt = jnp.asarray(y), torch.from_numpy(y)

    def stacked_jax(impl):
        def f(x):
            kw = dict(temperature=t, implementation=impl)
            return jnp.stack([jax_fusedloss.logsumexp(x, **kw), jax_fusedloss.entropy(x, **kw),
                              jax_fusedloss.token_logprobs(x, yj, **kw)])
        return f

    def stacked_torch(s):
        logp, ent = torch_ref.token_logprobs(s, yt.to(s.device), temperature=t,
                                             return_entropy=True)
        return torch.stack([torch_ref.logsumexp(s, temperature=t), ent, logp])

    results = {}
    with launch_path(path):
        for impl in ("xla", "triton"):
            out, g = jax_run(stacked_jax(impl), x, dtype, cot)
            results[impl] = (out, g)
            if impl == "triton":
                eager = stacked_jax(impl)(jnp.asarray(x).astype(DTYPES[dtype]))
                assert_close(eager, out, rtol=1e-6, atol=1e-6, what="triton: eager == jit")
        results["torch_ref"] = value_grad_torch(stacked_torch, x, dtype, cot)

    def reference(s):
        return torch.stack(torch_oracle.reductions_reference(s, yt, temperature=t))

    ref_value, ref_grad = value_grad_torch(reference, x, dtype, cot, ref=True)
    zmax = float(np.abs(x).max()) / t
    zrange = float((x.max(-1) - x.min(-1)).max()) / t
    coef = float(np.abs(cot).max()) * (3 + 2 * zrange) / t
    check_all("reductions", results, ref_value, ref_grad, dtype, zmax, coef)
    check_row_sums("reductions", results, cot[0].astype(np.float64) / t, dtype, zmax, coef)

