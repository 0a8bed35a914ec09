"""cross_entropy: JAX "triton" (interpreter on CPU) and "xla", torch_ref, the plain-PyTorch
formula and a float64 reference agree on values and gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jax_fusedloss
import torch_ref
from jax_fusedloss import _triton_jax
from tests.helpers import (VALUE_RTOL, assert_close, assert_grad_close, check_transformations,
                           force_path, random_logits, to_numpy, to_torch)

IMPLS = ["triton", "xla", "torch_ref"]
DTYPES = ["float32", "bfloat16", "float16"]
# V below one block (37), prime V (5003: 2 forward tiles), over several tiles with a ragged
# tail in both the forward (4096) and the gradient (16384) passes (20011), leading dims.
SHAPES = [(5, 37), (3, 5003), (2, 2, 20011)]
OPTIONS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(z_loss=1e-2),
    "softcap": dict(logit_softcap=4.0),
    "combined": dict(label_smoothing=0.2, z_loss=1e-3, logit_softcap=7.0, ignore_index=-1),
}


def make_labels(seed, shape, vocab, ignore_index=-100, frac_ignored=0.3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, vocab, size=shape)
    y[rng.random(shape) < frac_ignored] = ignore_index
    return jnp.asarray(y, jnp.int32)


def run(impl, logits, labels, weights=None, lse_weights=None, **opts):
    """(loss, lse or None, grad) for sum(weights * loss) (+ sum(lse_weights * lse))."""
    want_lse = lse_weights is not None
    if impl == "torch_ref":
        x = to_torch(logits).requires_grad_(True)
        out = torch_ref.cross_entropy(x, torch.from_dlpack(labels).long(), return_lse=want_lse,
                                      **opts)
        loss, lse = out if want_lse else (out, None)
        obj = (loss * (to_torch(weights) if weights is not None else 1.0)).sum()
        if want_lse:
            obj = obj + (lse * to_torch(lse_weights)).sum()
        obj.backward()
        return loss.detach(), None if lse is None else lse.detach(), x.grad

    def f(x):
        out = jax_fusedloss.cross_entropy(x, labels, return_lse=want_lse, implementation=impl,
                                          **opts)
        loss, lse = out if want_lse else (out, None)
        obj = jnp.sum(loss * (weights if weights is not None else 1.0))
        if want_lse:
            obj = obj + jnp.sum(lse * lse_weights)
        return obj, (loss, lse)

    (_, (loss, lse)), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(logits)
    return loss, lse, grad


def reference(logits, labels, weights=None, lse_weights=None, dtype=torch.float64, **opts):
    x = to_torch(logits).to(dtype).requires_grad_(True)
    loss, lse = torch_ref.cross_entropy_reference(x, torch.from_dlpack(labels).long(),
                                                  return_lse=True, dtype=dtype, **opts)
    obj = (loss * (to_torch(weights).to(dtype) if weights is not None else 1.0)).sum()
    if lse_weights is not None:
        obj = obj + (lse * to_torch(lse_weights).to(dtype)).sum()
    obj.backward()
    return loss.detach(), lse.detach(), x.grad


def check(impl, dtype, shape, seed=0, scale=2.0, reduction="mean", with_lse=False,
          frac_ignored=0.3, **opts):
    logits = random_logits(seed, shape, dtype, scale)
    labels = make_labels(seed + 1, shape[:-1], shape[-1], opts.get("ignore_index", -100),
                         frac_ignored)
    w = jax.random.uniform(jax.random.key(seed + 2), shape[:-1]) if reduction == "none" else None
    lw = jax.random.normal(jax.random.key(seed + 3), shape[:-1]) if with_lse else None
    loss, lse, grad = run(impl, logits, labels, w, lw, reduction=reduction, **opts)
    rloss, rlse, rgrad = reference(logits, labels, w, lw, reduction=reduction, **opts)
    assert_close(loss, rloss, rtol=VALUE_RTOL[dtype], atol=1e-5, what=f"{impl} loss")
    if with_lse:
        assert_close(lse, rlse, rtol=VALUE_RTOL[dtype], atol=1e-5, what=f"{impl} lse")
    assert to_numpy(grad).shape == logits.shape
    assert str(grad.dtype).split(".")[-1] == dtype, f"grad dtype {grad.dtype} != {dtype}"
    assert_grad_close(grad, rgrad, dtype, what=f"{impl} grad")
    return loss, grad


# The split path is a Triton launch choice: "xla" runs once.
IMPL_PATHS = [("triton", "rows"), ("triton", "split"), ("torch_ref", "rows"),
              ("torch_ref", "split"), ("xla", "rows")]


@pytest.mark.parametrize("impl,path_name", IMPL_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("opt", ["plain", "combined"])
def test_grid(impl, path_name, dtype, shape, opt, monkeypatch, interpreter):
    force_path(path_name, monkeypatch)
    check(impl, dtype, shape, **OPTIONS[opt])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_options_and_reductions(impl, opt, reduction, interpreter):
    check(impl, "float32", (6, 301), seed=3, reduction=reduction, **OPTIONS[opt])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_return_lse_is_differentiable(impl, reduction, path, interpreter):
    check(impl, "bfloat16", (4, 700), seed=5, reduction=reduction, with_lse=True,
          label_smoothing=0.1, z_loss=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_unit_scale_and_large_logits(impl, scale, interpreter):
    check(impl, "float32", (4, 1000), seed=7, scale=scale, z_loss=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_not_nan(impl, reduction, path, interpreter):
    loss, grad = check(impl, "bfloat16", (3, 517), seed=9, reduction=reduction,
                       frac_ignored=1.0, z_loss=1e-2, label_smoothing=0.1)
    assert np.all(to_numpy(loss) == 0.0)
    assert np.all(to_numpy(grad) == 0.0)


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_scaled_cotangent(impl, interpreter):
    """A loss multiplied by a weight takes the in-place rescaling path of the backward."""
    logits = random_logits(11, (5, 20011), "float32")  # several tiles per row
    labels = make_labels(12, (5,), 20011)
    f = lambda x: 2.5 * jax_fusedloss.cross_entropy(x, labels, implementation=impl)
    _, _, rgrad = reference(logits, labels)
    assert_grad_close(jax.grad(f)(logits), 2.5 * to_numpy(rgrad), "float32")


def test_matches_optax_and_torch_functional(interpreter):
    logits = random_logits(13, (8, 333), "float32")
    labels = make_labels(14, (8,), 333, frac_ignored=0.0)
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    tf = torch.nn.functional.cross_entropy(to_torch(logits), torch.from_dlpack(labels).long())
    for impl in ["triton", "xla"]:
        got = jax_fusedloss.cross_entropy(logits, labels, implementation=impl)
        assert_close(got, ref, rtol=2e-6, what=f"{impl} vs optax")
        assert_close(got, tf, rtol=2e-6, what=f"{impl} vs F.cross_entropy")


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_labels_are_nan_and_isolated(impl, path, interpreter):
    """Labels outside [0, V) give NaN for that token only and never read out of bounds."""
    logits = random_logits(15, (6, 300), "float32")
    labels = make_labels(16, (6,), 300, frac_ignored=0.0)
    labels = labels.at[1].set(300).at[4].set(-5)
    loss, _, grad = run(impl, logits, labels, reduction="none")
    good = np.array([0, 2, 3, 5])
    loss, grad = to_numpy(loss), to_numpy(grad)
    assert np.isnan(loss[[1, 4]]).all() and np.isnan(grad[[1, 4]]).all()
    rloss, _, rgrad = reference(logits[good], labels[good], reduction="none")
    assert_close(loss[good], rloss, rtol=2e-5, what="other rows' loss")
    assert_close(grad[good], rgrad, rtol=2e-5, atol=1e-7, what="other rows' grad")
    mean, _, _ = run(impl, logits, labels)
    assert np.isnan(to_numpy(mean))


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_transformations(impl, interpreter):
    """jit, grad, vmap, checkpoint and lax.scan give the same values as a direct call."""
    logits = random_logits(17, (3, 4, 260), "bfloat16")
    labels = make_labels(18, (3, 4), 260)
    ce = lambda x, y: jax_fusedloss.cross_entropy(x, y, z_loss=1e-3, implementation=impl)
    check_transformations(ce, logits, labels)
    per_tok = jax.vmap(lambda x, y: jax_fusedloss.cross_entropy(
        x, y, reduction="none", implementation=impl))(logits, labels)
    assert per_tok.shape == (3, 4) and per_tok.dtype == jnp.float32


BAD_INPUTS = [
    (lambda: (jnp.zeros(()), jnp.zeros((), jnp.int32)), {}, ValueError, "logits.shape"),
    (lambda: (jnp.zeros((4, 10)), jnp.zeros((5,), jnp.int32)), {}, ValueError, "labels.shape"),
    (lambda: (jnp.zeros((4, 10)), jnp.zeros((4, 1), jnp.int32)), {}, ValueError, "labels.shape"),
    (lambda: (jnp.zeros((4, 10)), jnp.zeros((4,), jnp.float32)), {}, TypeError, "labels.dtype"),
    (lambda: (jnp.zeros((4, 10), jnp.int32), jnp.zeros((4,), jnp.int32)), {}, TypeError,
     "logits.dtype"),
    (lambda: (jnp.zeros((4, 10)), jnp.zeros((4,), jnp.int32)), dict(reduction="avg"), ValueError,
     "reduction"),
    (lambda: (jnp.zeros((4, 10)), jnp.zeros((4,), jnp.int32)), dict(implementation="cuda"),
     ValueError, "implementation"),
    (lambda: (jnp.zeros((4, 10)), jnp.zeros((4,), jnp.int32)), dict(label_smoothing=1.5),
     ValueError, "label_smoothing"),
    (lambda: (jnp.zeros((4, 10)), jnp.zeros((4,), jnp.int32)), dict(logit_softcap=0.0),
     ValueError, "logit_softcap"),
    (lambda: (jnp.zeros((4, 10)), jnp.zeros((4,), jnp.int32)), dict(z_loss=-1.0), ValueError,
     "z_loss"),
]


@pytest.mark.parametrize("make,kwargs,exc,match", BAD_INPUTS)
def test_bad_input_fails_at_trace_time(make, kwargs, exc, match):
    x, y = make()
    with pytest.raises(exc, match=match.replace(".", r"\.")):
        jax.eval_shape(lambda x, y: jax_fusedloss.cross_entropy(x, y, **kwargs), x, y)


def test_triton_without_interpreter_says_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if _triton_jax.on_cuda_gpu():
        pytest.skip("a GPU runs the compiled path")
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
        jax_fusedloss.cross_entropy(jnp.zeros((2, 8)), jnp.zeros((2,), jnp.int32),
                                    implementation="triton")


def test_auto_picks_xla_on_cpu_and_empty_batch():
    if _triton_jax.on_cuda_gpu():
        pytest.skip("CPU behaviour")
    from jax_fusedloss import _common

    assert _common.default_implementation() == "xla"
    assert float(jax_fusedloss.cross_entropy(jnp.zeros((0, 8)), jnp.zeros((0,), jnp.int32))) == 0
