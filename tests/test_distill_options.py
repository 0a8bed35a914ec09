"""distill_loss's cross-entropy options (label_smoothing, z_loss, logit_softcap): the Triton
kernels (the interpreter on CPU, compiled on a GPU) on both launch paths, the XLA twin and
torch_ref against a float64 formula written out here, values and gradients.

The formula is the docstring's: with z = c * tanh(x / c) (or x),
    loss = alpha * CE(z, y; smoothing, z-loss) + (1 - alpha) * KL_T(z)
where KL_T compares the teacher with softmax(z / T) (the softcap first, then the
temperature) and an ignored token adds nothing to either term (its teacher entries count as
masked).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_fusedloss
import torch_ref
from tests.helpers import (VALUE_RTOL, assert_close, assert_grad_close, force_path,
                           random_logits, to_numpy, to_torch)
from tests.reference import jax_ref

IGNORE = -100
ALL = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=4.0)
# name -> (options, reduction, normalize, temperature). Each option alone and all combined;
# between them every reduction and both normalizations, T = 1 (the KD term shares the
# cross-entropy's softmax), T != 1 (its own softmax of z / T) and integer T = 2, 3 with "full"
# (the cross-entropy's softmax as the T-th power of the KD term's: kd.POWER_TEMPERATURES).
CASES = {
    "smoothing": (dict(label_smoothing=0.2), "mean", "full", 2.0),
    "z_loss": (dict(z_loss=1e-2), "sum", "topk", 1.5),
    "softcap": (dict(logit_softcap=2.5), "none", "full", 1.0),
    "all-t1": (ALL, "mean", "full", 1.0),
    "all-topk": (ALL, "none", "topk", 2.0),
    "all-t07": (ALL, "sum", "full", 0.7),
    "all-t3": (ALL, "mean", "full", 3.0),
}
# The path picks the shape: "rows" V=37 (odd, below one tile) on the fused row path, "split"
# V=5003 (odd, two tiles) on the split path (partials, merge, gradient pass).
SHAPES = {"rows": ((6, 37), 8), "split": ((3, 5003), 16)}
IMPL_PATHS = [("triton", "rows"), ("triton", "split"), ("torch_ref", "rows"),
              ("torch_ref", "split"), ("xla", "rows")]
# (case, dtype, impl, path): every case in float32 on every implementation and path;
# bfloat16 on two cases and float16 (whose gradient for per-token weights other than 1 is
# recomputed from the logits) on one, through JAX's Triton and XLA paths (and torch_ref's
# own float16 recompute).
GRID = [(c, "float32", i, p) for c in CASES for i, p in IMPL_PATHS] + [
    (c, dt, i, p) for c, dt in (("all-t1", "bfloat16"), ("all-topk", "bfloat16"),
                                ("softcap", "float16"))
    for i, p in IMPL_PATHS if i != "torch_ref" or dt == "float16"]


def make_inputs(seed: int, shape, k: int, dtype: str):
    """Logits, labels (the first a teacher id, the second and about a third of the others
    ignored), teacher top-k ids and
    log-probs with a random mask (one id repeated), per-token weights in [-1, 1]."""
    n, vocab = shape
    x = random_logits(seed, shape, dtype, scale=3.0)
    rng = np.random.default_rng(seed)
    t_lp, t_ids = jax.lax.top_k(jax.nn.log_softmax(
        jax.random.normal(jax.random.key(seed + 1), shape) * 3.0), k)
    ids = np.asarray(t_ids, np.int32).copy()
    ids[1, 2] = ids[1, 0]  # a repeated id counts once per entry
    y = rng.integers(0, vocab, n).astype(np.int32)
    y[rng.random(n) < 0.35] = IGNORE
    y[0], y[1] = ids[0, 1], IGNORE
    mask = rng.random((n, k)) >= 0.2
    w = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    return x, jnp.asarray(y), jnp.asarray(ids), jnp.asarray(t_lp, jnp.float32), \
        jnp.asarray(mask), jnp.asarray(w)


def reference(x, y, ids, lp, mask, w, *, alpha, temperature, normalize, reduction,
              label_smoothing=0.0, z_loss=0.0, logit_softcap=None):
    """float64 loss and its gradient (jax.vjp; cotangent w for "none") by the plain formula."""
    with jax.enable_x64(True):
        x64 = jnp.asarray(np.asarray(to_numpy(x), np.float64))
        y, ids, lp, mask = (jnp.asarray(np.asarray(a)) for a in (y, ids, lp, mask))
        lp = lp.astype(jnp.float64)

        def loss_fn(x):
            z = x if logit_softcap is None else logit_softcap * jnp.tanh(x / logit_softcap)
            vocab = z.shape[-1]
            active = y != IGNORE
            lse = jax.nn.logsumexp(z, axis=-1)
            zy = jnp.take_along_axis(z, jnp.clip(y, 0, vocab - 1)[:, None], axis=1)[:, 0]
            ce = ((1 - label_smoothing) * (lse - zy)
                  + label_smoothing * (lse - z.mean(axis=-1)) + z_loss * lse**2)
            ce = jnp.where(active, ce, 0.0)
            s = z / temperature
            valid = (ids >= 0) & (ids < vocab) & mask & active[:, None]
            sk = jnp.take_along_axis(s, jnp.where(valid, ids, 0), axis=1)
            has = valid.any(axis=-1)
            if normalize == "full":
                L = jax.nn.logsumexp(s, axis=-1)
            else:  # tokens without an entry: a finite stand-in (all their terms are 0)
                L = jax.nn.logsumexp(jnp.where(has[:, None], jnp.where(valid, sk, -jnp.inf),
                                               0.0), axis=-1)
            p = jnp.where(valid, jnp.exp(lp), 0.0)
            kd = jnp.where(p > 0, p * (lp - (sk - L[:, None])), 0.0).sum(axis=-1)
            if reduction == "none":
                return alpha * ce + (1 - alpha) * kd
            if reduction == "sum":
                return jnp.sum(alpha * ce + (1 - alpha) * kd)
            return (alpha * ce.sum() / jnp.maximum(active.sum(), 1)
                    + (1 - alpha) * kd.sum() / jnp.maximum(has.sum(), 1))

        value, vjp = jax.vjp(loss_fn, x64)
        (grad,) = vjp(jnp.asarray(np.asarray(w), jnp.float64) if reduction == "none"
                      else jnp.ones((), jnp.float64))
        return np.asarray(value), np.asarray(grad)


def run(impl, x, y, ids, lp, mask, w, grad=True, **opts):
    """(loss, gradient of sum(w * loss) for "none" or of the loss) w.r.t. the logits; with
    grad=False the loss alone, outside differentiation (no gradient written)."""
    if impl == "torch_ref":
        xt = to_torch(x).requires_grad_(grad)
        targs = [torch.from_dlpack(a) for a in (y, ids, lp, mask)]
        with torch.set_grad_enabled(grad):
            loss = torch_ref.distill_loss(xt, *targs, **opts)
        if grad:
            (loss * (to_torch(w) if opts["reduction"] == "none" else 1.0)).sum().backward()
        return loss.detach(), xt.grad

    def f(x):
        return jax_fusedloss.distill_loss(x, y, ids, lp, mask, implementation=impl, **opts)

    if not grad:
        return jax.jit(f)(x), None
    weight = w if opts["reduction"] == "none" else 1.0
    (_, loss), g = jax.jit(jax.value_and_grad(lambda x: (jnp.sum(f(x) * weight), f(x)),
                                              has_aux=True))(x)
    return loss, g


def test_power_form_where_the_temperature_is_an_integer():
    """distill_loss at T in kd.POWER_TEMPERATURES with "full" takes the cross-entropy's
    softmax as the T-th power of the KD term's (CE_STATS = T) where launch.kd_power allows it
    (long 16-bit rows); other temperatures, "topk", kd_loss and short rows keep their own
    exponentials."""
    from jax_fusedloss.kernels import kd, launch

    def ce_stats(vocab, t, normalize="full", distill=True, itemsize=2):
        plan = kd.kd_fwd_plan(8192, vocab, 64, temperature=t, normalize=normalize,
                              distill=distill, ignore_index=-100, num_sms=132, write_grad=True,
                              itemsize=itemsize)
        return plan.launches[0].constexprs["CE_STATS"], plan.launches[0].constexprs["KEEP"]

    assert launch.kd_power(128256, 2) and not launch.kd_power(50257, 2)
    assert not launch.kd_power(128256, 0)
    assert ce_stats(128256, 2.0) == (2, 2)  # one exp per logit: tiles kept as at T = 1
    assert ce_stats(128256, 4.0)[0] == 4 and ce_stats(128256, 3.0)[0] == 3
    assert ce_stats(128256, 1.5) == (1, 0) and ce_stats(128256, 1.0) == (1, 2)
    assert ce_stats(128256, 2.0, normalize="topk")[0] == 1
    assert ce_stats(128256, 2.0, distill=False)[0] == 0
    assert ce_stats(50257, 2.0)[0] == 1


@pytest.mark.parametrize("case,dtype,impl,path_name", GRID)
def test_options_against_float64(impl, path_name, case, dtype, monkeypatch):
    """Every case against the float64 reference; distill_loss's power form (CE_STATS = T at
    an integer T, "full": "smoothing" and "all-t3") forced on at these short rows."""
    from jax_fusedloss.kernels import launch

    force_path(path_name, monkeypatch)
    monkeypatch.setattr(launch, "KD_POWER_MIN_VOCAB", {2: 0, 4: 0})
    options, reduction, normalize, t = CASES[case]
    shape, k = SHAPES[path_name]
    x, y, ids, lp, mask, w = make_inputs(sorted(CASES).index(case), shape, k, dtype)
    opts = dict(alpha=0.4, temperature=t, normalize=normalize, reduction=reduction, **options)
    loss, grad = run(impl, x, y, ids, lp, mask, w, **opts)
    rloss, rgrad = reference(x, y, ids, lp, mask, w, **opts)
    what = f"{impl} {path_name} {case} {dtype}"
    assert_close(loss, rloss, rtol=VALUE_RTOL[dtype], atol=1e-5, what=f"{what} loss")
    assert str(grad.dtype).split(".")[-1] == dtype, f"grad dtype {grad.dtype} != {dtype}"
    assert_grad_close(grad, rgrad, dtype, what=f"{what} grad")
    if reduction == "none":  # ignored tokens: no loss, no gradient (teacher entries masked)
        ignored = np.asarray(y) == IGNORE
        assert ignored.any() and np.all(to_numpy(loss)[ignored] == 0), what
        assert np.all(to_numpy(grad)[ignored] == 0), what
    if impl != "xla" and case.startswith("all"):  # the forward without the gradient write
        plain, _ = run(impl, x, y, ids, lp, mask, w, grad=False, **opts)
        assert_close(plain, rloss, rtol=VALUE_RTOL[dtype], atol=1e-5, what=f"{what} forward")


@pytest.mark.parametrize("impl", ["triton", "xla", "torch_ref"])
def test_bad_label_is_nan_and_isolated_with_options(impl):
    """A label outside [0, V) gives that token NaN loss and a NaN gradient row, with every
    option on; the other tokens are unaffected."""
    x, y, ids, lp, mask, w = make_inputs(11, (4, 37), 8, "float32")
    y = y.at[2].set(37)
    loss, grad = run(impl, x, y, ids, lp, mask, w, alpha=0.5, reduction="none", **ALL)
    loss, grad = to_numpy(loss), to_numpy(grad)
    assert np.isnan(loss[2]) and np.isnan(grad[2]).all()
    good = np.array([0, 1, 3])
    assert np.isfinite(loss[good]).all() and np.isfinite(grad[good]).all()


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_alpha_one_is_cross_entropy_with_the_same_options(impl):
    """alpha = 1 is cross_entropy with the same smoothing, z-loss and softcap."""
    x, y, ids, lp, mask, _ = make_inputs(12, (5, 37), 8, "float32")
    ce = jax.jit(jax.value_and_grad(lambda x: jax_fusedloss.cross_entropy(
        x, y, implementation=impl, **ALL)))(x)
    d1 = jax.jit(jax.value_and_grad(lambda x: jax_fusedloss.distill_loss(
        x, y, ids, lp, mask, alpha=1.0, temperature=2.0, implementation=impl, **ALL)))(x)
    assert_close(d1[0], ce[0], rtol=1e-6, what="alpha=1 loss")
    assert_close(d1[1], ce[1], rtol=1e-5, atol=1e-8, what="alpha=1 grad")


BAD_OPTIONS = [
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(label_smoothing=float("nan")), ValueError, "label_smoothing"),
    (dict(z_loss=-1e-4), ValueError, "z_loss"),
    (dict(z_loss=float("inf")), ValueError, "z_loss"),
    (dict(logit_softcap=0.0), ValueError, "logit_softcap"),
    (dict(logit_softcap=-2.0), ValueError, "logit_softcap"),
    (dict(logit_softcap=float("inf")), ValueError, "logit_softcap"),
    (dict(logit_softcap="30"), TypeError, "logit_softcap"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_OPTIONS)
def test_bad_options_fail_like_cross_entropy(kwargs, exc, match):
    """The same checks and messages as cross_entropy, in JAX (at trace time) and torch_ref."""
    x, y = jnp.zeros((4, 10)), jnp.zeros((4,), jnp.int32)
    ids, lp = jnp.zeros((4, 3), jnp.int32), jnp.zeros((4, 3))
    with pytest.raises(exc, match=match):
        jax.eval_shape(lambda x: jax_fusedloss.distill_loss(x, y, ids, lp, alpha=0.5, **kwargs),
                       x)
    with pytest.raises(exc, match=match):
        jax.eval_shape(lambda x: jax_fusedloss.cross_entropy(x, y, **kwargs), x)
    with pytest.raises(exc, match=match):
        torch_ref.distill_loss(torch.zeros(4, 10), torch.zeros(4, dtype=torch.int32),
                               torch.zeros(4, 3, dtype=torch.int32), torch.zeros(4, 3),
                               alpha=0.5, **kwargs)


def test_traced_option_names_the_argument():
    x, y = jnp.zeros((4, 10)), jnp.zeros((4,), jnp.int32)
    ids, lp = jnp.zeros((4, 3), jnp.int32), jnp.zeros((4, 3))
    with pytest.raises(TypeError, match="z_loss must be a static Python number"):
        jax.jit(lambda x, c: jax_fusedloss.distill_loss(x, y, ids, lp, alpha=0.5, z_loss=c))(
            x, 1e-3)


# ----------------------------------------------------------------------------- huge temperatures
HUGE_TEMPERATURES = [1e30, 9e37, 2e38, 3.4e38, 1e300]


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("normalize", ["full", "topk"])
def test_huge_temperature_is_finite_and_matches_float64(impl, normalize, interpreter):
    """A temperature whose float32 reciprocal underflows (above about 8.5e37) gave NaN loss and
    gradient ("full"); the student softmax is uniform there and the loss finite."""
    x = jax.random.normal(jax.random.key(0), (3, 11)) * 2
    y = jnp.array([1, 2, 3])
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (3, 11))), 3)
    for t in HUGE_TEMPERATURES:
        ops = {
            "kd_loss": (lambda x: jax_fusedloss.kd_loss(
                x, ids, lp, temperature=t, normalize=normalize, implementation=impl),
                lambda x: jax_ref.kd_loss(x, ids, lp, temperature=t, normalize=normalize)),
            "distill_loss": (lambda x: jax_fusedloss.distill_loss(
                x, y, ids, lp, alpha=0.3, temperature=t, normalize=normalize,
                implementation=impl),
                lambda x: jax_ref.distill_loss(x, y, ids, lp, alpha=0.3, temperature=t,
                                               normalize=normalize)),
        }
        for name, (fn, ref) in ops.items():
            value, grad = jax.value_and_grad(fn)(x)
            with jax_ref.x64():
                want, want_grad = jax.value_and_grad(ref)(jnp.asarray(np.asarray(x), jnp.float64))
            what = f"{name} normalize={normalize} T={t:g} ({impl})"
            assert_close(value, want, rtol=1e-5, atol=1e-6, what=what + " loss")
            assert_close(grad, want_grad, rtol=1e-5, atol=1e-6, what=what + " gradient")


def test_temperature_squared_overflowing_float32_is_an_error():
    x = jnp.zeros((2, 5))
    y, ids, lp = jnp.array([0, 1]), jnp.array([[0, 1], [2, 3]]), jnp.full((2, 2), -0.7)
    loss = jax_fusedloss.distill_loss(x, y, ids, lp, alpha=0.5, temperature=1e19,
                                      temperature_squared=True, implementation="xla")
    assert np.isfinite(float(loss)), f"T=1e19: T**2 = 1e38 fits float32, got loss {loss}"
    with pytest.raises(ValueError, match=r"temperature=1e\+20 with temperature_squared=True: "
                                         r"T\*\*2 overflows float32"):
        jax_fusedloss.distill_loss(x, y, ids, lp, alpha=0.5, temperature=1e20,
                                   temperature_squared=True, implementation="xla")
