"""GPU only: numerics through the compiled kernels that the interpreter cannot vouch for, and
the auto-dispatch: a huge KD temperature, gradients at large logit offsets, and
implementation=None choosing XLA for few rows (kernels.launch.AUTO_XLA_MAX_ROWS)."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_fusedloss as jfl  # noqa: E402
from jax_fusedloss import _triton_jax  # noqa: E402

pytestmark = pytest.mark.gpu
V = 128256


def _f64_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("temperature", [1e4, 1e30, 3e38])
@pytest.mark.parametrize("normalize", ["full", "topk"])
def test_kd_huge_temperature_matches_xla(temperature, normalize):
    """1/T underflows toward 0: the student distribution is uniform (log V for "full"), never
    -inf or NaN, and the compiled kernels agree with the XLA twin."""
    x = jax.random.normal(jax.random.key(0), (64, V), jnp.float32) * 3
    teacher = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (64, V)))
    lp, ids = jax.lax.top_k(teacher, 16)
    out = {}
    for impl in ("triton", "xla"):
        f = jax.jit(jax.value_and_grad(lambda a: jfl.kd_loss(
            a, ids, lp, temperature=temperature, normalize=normalize, implementation=impl)))
        out[impl] = f(x)
    loss_t, grad_t = out["triton"]
    loss_x, grad_x = out["xla"]
    assert np.isfinite(float(loss_t)), float(loss_t)
    np.testing.assert_allclose(float(loss_t), float(loss_x), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad_t), np.asarray(grad_x), rtol=1e-4,
                               atol=1e-12 + 1e-6 * float(np.abs(np.asarray(grad_x)).max()))


@pytest.mark.parametrize("offset", [1e5, -1e5])
@pytest.mark.parametrize("n", [8, 512])  # split path, row path
def test_gradients_at_large_offsets(offset, n):
    """fp32 logits N(0, 1) + offset: the softmax gradient relative to float64 (issue 12 item
    10: an fp32 lse of 1e5 carries 0.008 of rounding into exp(z - lse))."""
    x = jax.random.normal(jax.random.key(2), (n, V), jnp.float32) + offset
    y = jax.random.randint(jax.random.key(3), (n,), 0, V)
    want = _f64_softmax(np.asarray(x))
    onehot = np.zeros_like(want)
    onehot[np.arange(n), np.asarray(y)] = 1.0
    grads = {
        "cross_entropy": (jax.grad(lambda a: jfl.cross_entropy(
            a, y, reduction="sum", implementation="triton"))(x), want - onehot),
        "logsumexp": (jax.grad(lambda a: jfl.logsumexp(
            a, implementation="triton").sum())(x), want),
    }
    for name, (got, ref) in grads.items():
        err = np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max()
        assert err < 2e-6, (name, err)


def test_auto_dispatch_few_rows_is_xla_and_equal(monkeypatch):
    """Through the legacy custom call, implementation=None at N <= AUTO_XLA_MAX_ROWS["legacy"]
    ["loss"] runs the XLA twin (no Triton custom call in the compiled program) and gives the
    Triton path's values and gradients; the reductions switch to Triton above their own
    (smaller) row count. Through the FFI call the losses run Triton from one row and the
    reductions above AUTO_XLA_MAX_ROWS["ffi"]["reductions"]; implementation="triton" runs
    Triton at one row either way."""
    from jax_fusedloss.kernels import launch

    if _triton_jax.call_target() == _triton_jax.FFI_TARGET:
        x1 = jnp.zeros((1, V), jnp.bfloat16)
        red = launch.AUTO_XLA_MAX_ROWS["ffi"]["reductions"]
        for fn, x, triton in (
                (lambda a: jfl.cross_entropy(a, jnp.zeros((1,), jnp.int32)), x1, True),
                (jfl.logsumexp, x1, False),
                (lambda a: jfl.logsumexp(a, implementation="triton"), x1, True),
                (jfl.logsumexp, jnp.zeros((red, V), jnp.bfloat16), False),
                (jfl.logsumexp, jnp.zeros((red + 1, V), jnp.bfloat16), True)):
            text = jax.jit(fn).lower(x).compile().as_text()
            assert (_triton_jax.FFI_TARGET in text) == triton, (x.shape, triton)
    monkeypatch.setenv("JFL_TRITON_CALL", "legacy")
    n = launch.AUTO_XLA_MAX_ROWS["legacy"]["loss"]
    x = jax.random.normal(jax.random.key(4), (n, V), jnp.bfloat16)
    y = jax.random.randint(jax.random.key(5), (n,), 0, V)
    auto = jax.jit(jax.value_and_grad(lambda a: jfl.cross_entropy(a, y)))
    hlo = auto.lower(x).compile().as_text()
    assert "triton_kernel_call" not in hlo
    big = jax.jit(lambda a: jfl.cross_entropy(a, jnp.zeros((4 * n,), jnp.int32)))
    assert "triton_kernel_call" in big.lower(jnp.zeros((4 * n, V), jnp.bfloat16)).compile(
    ).as_text()
    few = launch.AUTO_XLA_MAX_ROWS["legacy"]["reductions"]
    for rows, triton in ((few, False), (few + 1, True)):
        lse = jax.jit(lambda a: jfl.logsumexp(a)).lower(
            jnp.zeros((rows, V), jnp.bfloat16)).compile()
        assert ("triton_kernel_call" in lse.as_text()) == triton, rows
    loss, grad = auto(x)
    loss_t, grad_t = jax.value_and_grad(lambda a: jfl.cross_entropy(
        a, y, implementation="triton"))(x)
    np.testing.assert_allclose(float(loss), float(loss_t), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(grad_t, np.float32),
                               atol=1e-7 + 1e-2 * float(np.abs(np.asarray(grad_t,
                                                                          np.float32)).max()))


@pytest.mark.parametrize("offset", [0.0, 1e5])
@pytest.mark.parametrize("n", [1, 8, 64])
def test_xla_few_rows_one_pass_matches_float64(offset, n):
    """The XLA twin at few rows on a GPU (what implementation=None runs there): one variadic
    reduction per op (_xla/chunks.one_pass_stats). lse, entropy, token log-probs and the
    cross-entropy loss against float64, at V=128256 and at a large offset."""
    x = jax.random.normal(jax.random.key(6), (n, V), jnp.float32) * 3 + offset
    y = jax.random.randint(jax.random.key(7), (n,), 0, V)
    x64 = np.asarray(x, np.float64)
    mx = x64.max(axis=-1, keepdims=True)
    lse = (mx + np.log(np.exp(x64 - mx).sum(axis=-1, keepdims=True)))[:, 0]
    p = _f64_softmax(x64)
    ent = -(p * (x64 - lse[:, None])).sum(axis=-1)
    logp = x64[np.arange(n), np.asarray(y)] - lse
    got = jax.jit(lambda a: (jfl.logsumexp(a, implementation="xla"),
                             jfl.entropy(a, implementation="xla"),
                             jfl.token_logprobs(a, y, implementation="xla"),
                             jfl.cross_entropy(a, y, reduction="none", implementation="xla")))(x)
    for name, g, want, tol in (("logsumexp", got[0], lse, 5e-7 * np.abs(lse).max()),
                               ("entropy", got[1], ent, 2e-5),
                               ("token_logprobs", got[2], logp, 2e-5),
                               ("cross_entropy", got[3], -logp, 2e-5)):
        np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=0, atol=tol,
                                   err_msg=name)
