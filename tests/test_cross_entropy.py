"""cross_entropy: JAX "triton" (the interpreter on CPU, compiled kernels on a GPU) and "xla",
and torch_ref, against the float64 plain-JAX formula (tests/reference/jax_ref.py) in values
and gradients, through the shared grid of tests/opbase.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_fusedloss
import torch_ref
from jax_fusedloss import _common, _triton_jax
from tests import opbase
from tests.helpers import (HAS_GPU, assert_close, assert_grad_close, check_transformations,
                           random_logits, to_numpy, to_torch)
from tests.opbase import IMPLS, JAX_IMPLS, spec
from tests.reference import jax_ref


def _named(out, opts):
    return dict(zip(("loss", "lse"), out)) if opts.get("return_lse") else {"loss": out}


class CrossEntropy(opbase.Op):
    name = "cross_entropy"
    outputs = ("loss", "lse")
    input_keys = ("frac_ignored",)

    def inputs(self, seed, shape, dtype, scale, opts, frac_ignored=0.3):
        return dict(x=random_logits(seed, shape, dtype, scale),
                    labels=opbase.make_labels(seed + 1, shape[:-1], shape[-1],
                                              opts.get("ignore_index", -100), frac_ignored))

    def jax(self, impl, x, inputs, opts):
        return _named(jax_fusedloss.cross_entropy(x, inputs["labels"], implementation=impl,
                                                  **opts), opts)

    def torch(self, x, inputs, opts):
        return _named(torch_ref.cross_entropy(x, inputs["labels"].long(), **opts), opts)

    def reference(self, x, inputs, opts):
        return _named(jax_ref.cross_entropy(x, inputs["labels"], **opts), opts)


CE = CrossEntropy()
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


@opbase.grid(dtype=opbase.DTYPES, shape=SHAPES, opt=["plain", "combined"])
def test_grid(impl, path, dtype, shape, opt):
    CE.check(impl, dtype, shape, **OPTIONS[opt])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_options_and_reductions(impl, opt, reduction):
    CE.check(impl, "float32", (6, 301), seed=3, reduction=reduction, **OPTIONS[opt])


@opbase.grid()  # every implementation and launch path (XLA's: one)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_return_lse_is_differentiable(impl, reduction, path):
    CE.check(impl, "bfloat16", (4, 700), seed=5, reduction=reduction, return_lse=True,
             label_smoothing=0.1, z_loss=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_unit_scale_and_large_logits(impl, scale):
    CE.check(impl, "float32", (4, 1000), seed=7, scale=scale, z_loss=1e-4)


@opbase.grid()  # every implementation and launch path (XLA's: one)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_not_nan(impl, reduction, path):
    outs, grad = CE.check(impl, "bfloat16", (3, 517), seed=9, reduction=reduction,
                          frac_ignored=1.0, z_loss=1e-2, label_smoothing=0.1)
    assert np.all(outs["loss"] == 0.0)
    assert np.all(grad == 0.0)


@pytest.mark.parametrize("impl", JAX_IMPLS)
def test_scaled_cotangent(impl):
    """A loss multiplied by a weight takes the in-place rescaling path of the backward."""
    inputs = CE.inputs(11, (5, 20011), "float32", 2.0, {})  # several tiles per row
    f = lambda x: 2.5 * jax_fusedloss.cross_entropy(x, inputs["labels"], implementation=impl)
    _, rgrad = CE.expected(inputs, {}, {})
    assert_grad_close(jax.grad(f)(inputs["x"]), 2.5 * to_numpy(rgrad), "float32")


def test_matches_optax_and_torch_functional():
    """JAX implementations against optax, torch_ref against torch.nn.functional."""
    import torch

    inputs = CE.inputs(13, (8, 333), "float32", 2.0, {}, frac_ignored=0.0)
    logits, labels = inputs["x"], inputs["labels"]
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    tf = torch.nn.functional.cross_entropy(to_torch(logits), to_torch(labels).long())
    for impl in JAX_IMPLS:
        got = jax_fusedloss.cross_entropy(logits, labels, implementation=impl)
        assert_close(got, ref, rtol=2e-6, what=f"{impl} vs optax")
    got = torch_ref.cross_entropy(to_torch(logits), to_torch(labels).long())
    assert_close(got, tf, rtol=2e-6, what="torch_ref vs F.cross_entropy")


@opbase.grid()  # every implementation and launch path (XLA's: one)
def test_out_of_range_labels_are_nan_and_isolated(impl, path):
    """Labels outside [0, V) give NaN for that token only and never read out of bounds."""
    inputs = CE.inputs(15, (6, 300), "float32", 2.0, {}, frac_ignored=0.0)
    inputs["labels"] = inputs["labels"].at[1].set(300).at[4].set(-5)
    w = opbase.weights(16, (6,), ("loss",))
    outs, grad = CE.run(impl, inputs, dict(reduction="none"), w)
    loss, grad = to_numpy(outs["loss"]), to_numpy(grad)
    assert np.isnan(loss[[1, 4]]).all() and np.isnan(grad[[1, 4]]).all()
    good = np.array([0, 2, 3, 5])
    routs, rgrad = CE.expected({k: v[good] for k, v in inputs.items()}, dict(reduction="none"),
                               {"loss": w["loss"][good]})
    assert_close(loss[good], routs["loss"], rtol=2e-5, what="other rows' loss")
    assert_grad_close(grad[good], rgrad, "float32", what="other rows' grad")
    mean, _ = CE.run(impl, inputs, {}, grad=False)
    assert np.isnan(to_numpy(mean["loss"]))


@pytest.mark.parametrize("impl", JAX_IMPLS)
def test_transformations(impl):
    """jit, grad, vmap, checkpoint and lax.scan give the same values as a direct call."""
    logits = random_logits(17, (3, 4, 260), "bfloat16")
    labels = opbase.make_labels(18, (3, 4), 260)
    ce = lambda x, y: jax_fusedloss.cross_entropy(x, y, z_loss=1e-3, implementation=impl)
    check_transformations(ce, logits, labels)
    per_tok = jax.vmap(lambda x, y: jax_fusedloss.cross_entropy(
        x, y, reduction="none", implementation=impl))(logits, labels)
    assert per_tok.shape == (3, 4) and per_tok.dtype == jnp.float32


X, Y = spec((4, 10)), spec((4,), jnp.int32)
BAD_INPUTS = [
    ((spec(()), spec((), jnp.int32)), {}, ValueError, "logits.shape"),
    ((X, spec((5,), jnp.int32)), {}, ValueError, "labels.shape"),
    ((X, spec((4, 1), jnp.int32)), {}, ValueError, "labels.shape"),
    ((X, spec((4,))), {}, TypeError, "labels.dtype"),
    ((spec((4, 10), jnp.int32), Y), {}, TypeError, "logits.dtype"),
    ((X, Y), dict(reduction="avg"), ValueError, "reduction"),
    ((X, Y), dict(implementation="cuda"), ValueError, "implementation"),
    ((X, Y), dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    ((X, Y), dict(logit_softcap=0.0), ValueError, "logit_softcap"),
    ((X, Y), dict(z_loss=-1.0), ValueError, "z_loss"),
]


@pytest.mark.parametrize("args,kwargs,exc,match", BAD_INPUTS)
def test_bad_input_fails_at_trace_time(args, kwargs, exc, match):
    opbase.check_rejected(jax_fusedloss.cross_entropy, args, kwargs, exc, match)


def test_triton_without_interpreter_says_so(monkeypatch):
    """Off a GPU (simulated on one: the probe says no), "triton" needs the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_triton_jax, "on_cuda_gpu", lambda: False)
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
        jax_fusedloss.cross_entropy(jnp.zeros((2, 8)), jnp.zeros((2,), jnp.int32),
                                    implementation="triton")


def test_auto_implementation_and_empty_batch():
    """None picks "triton" on a CUDA GPU and "xla" elsewhere; an empty batch gives 0."""
    assert _common.default_implementation() == ("triton" if HAS_GPU else "xla")
    assert float(jax_fusedloss.cross_entropy(jnp.zeros((0, 8)), jnp.zeros((0,), jnp.int32))) == 0


def test_numpy_float64_logits_follow_jax_rule():
    """NumPy float64 logits become float32 as JAX makes them with x64 off (optax accepts them
    too), for every op that takes logits; a float64 JAX array (x64 on) is refused with a hint."""
    rng = np.random.default_rng(0)
    x64 = rng.normal(size=(3, 50))
    y = np.array([1, 7, 49])
    want = jax_fusedloss.cross_entropy(jnp.asarray(x64, jnp.float32), y)
    got = jax_fusedloss.cross_entropy(x64, y)
    assert got.dtype == jnp.float32 and float(got) == float(want)
    grad = jax.grad(jax_fusedloss.cross_entropy)(x64, y)
    assert grad.dtype == jnp.float32 and grad.shape == x64.shape
    assert jax_fusedloss.logsumexp(x64).dtype == jnp.float32
    ids = np.argsort(-x64, axis=-1)[:, :4]
    lp = np.log(np.full((3, 4), 0.25))
    assert jnp.isfinite(jax_fusedloss.kd_loss(x64, ids, lp))
    assert jnp.isfinite(jax_fusedloss.distill_loss(x64, y, ids, lp, alpha=0.5))
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match=r"float64 .*astype\(float32\)"):
            jax_fusedloss.cross_entropy(jnp.asarray(x64), y)
