"""No output element left unwritten: every op through the interpreter with each kernel's fresh
output buffers filled with NaN (integers with a large negative sentinel) before the launch
(`_triton_jax.POISON`), on both launch paths, against the XLA implementation.

A GPU's fresh buffers hold whatever an earlier program left there, so a kernel that skips an
element (a ragged chunk, a split whose last slice is empty, a row of the merge path) can
return a right-looking value in one process and a wrong one after other work; the
interpreter's torch.empty usually hands back zeros. Poisoned, such an element turns NaN here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss as jfl
from jax_fusedloss import _triton_jax
from tests.helpers import assert_close, force_path, to_numpy

pytestmark = pytest.mark.usefixtures("interpreter")


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(_triton_jax, "POISON", float("nan"))


def _check(fn, args, what, rtol=2e-2, atol=2e-2):
    """fn(*args, impl) through Triton (poisoned) and XLA: every output finite and close."""
    got = jax.tree.leaves(fn(*args, "triton"))
    want = jax.tree.leaves(fn(*args, "xla"))
    for i, (g, w) in enumerate(zip(got, want)):
        g = to_numpy(g)
        assert np.isfinite(g).all(), f"{what}[{i}]: {np.sum(~np.isfinite(g))} unwritten"
        assert_close(g, w, rtol=rtol, atol=atol * max(1.0, float(np.abs(to_numpy(w)).max())),
                     what=f"{what}[{i}]")


def _head_inputs(layout, n=24, d=16, v=203):
    k = jax.random.split(jax.random.key(3), 5)
    h = jax.random.normal(k[0], (n, d)).astype(jnp.bfloat16)
    shape = (d, v) if layout == "dv" else (v, d)
    w = (jax.random.normal(k[1], shape) * 0.2).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (n,), 0, v)
    return h, w, y, jax.random.normal(k[3], (n,)), jax.random.normal(k[4], (n,)) * 0.1


@pytest.mark.parametrize("layout,mode", [("dv", "lean"), ("vd", "fast")])
def test_linear_token_logprobs(poisoned, layout, mode):
    """Per-token cotangents: the statistics-only forward (ragged tail chunk) and the
    recompute (the lean vocabulary walk's ragged last block)."""
    h, w, y, a, b = _head_inputs(layout)

    def fn(h, w, impl):
        def f(h, w):
            lp, ent = jfl.linear_token_logprobs(h, w, y, weight_layout=layout, temperature=0.9,
                                                return_entropy=True, mode=mode, chunk_size=16,
                                                implementation=impl)
            return jnp.sum(lp * a) + jnp.sum(ent * b), (lp, ent)
        return jax.value_and_grad(f, (0, 1), has_aux=True)(h, w)

    _check(fn, (h, w), f"linear_token_logprobs {layout} {mode}")


@pytest.mark.parametrize("mode", ["low_precision", "lean"])
def test_linear_cross_entropy(poisoned, mode):
    """A unit cotangent: the gradient written in the forward ("lean": dH) and the vocabulary
    walk for dW."""
    h, w, y, _, _ = _head_inputs("vd")

    def fn(h, w, impl):
        return jax.value_and_grad(lambda h, w: jfl.linear_cross_entropy(
            h, w, y, weight_layout="vd", mode=mode, chunk_size=16, implementation=impl),
            (0, 1))(h, w)

    _check(fn, (h, w), f"linear_cross_entropy {mode}")


@pytest.mark.parametrize("path,n", [("split", 3), ("rows", 5)])
def test_logits_ops(poisoned, monkeypatch, path, n):
    """The logits ops' row, split and merge launches: cross_entropy (loss, lse, gradient),
    token_logprobs with entropy, logsumexp, and kd_loss with and without the tail."""
    force_path(path, monkeypatch)
    v, kk = 301, 8
    k = jax.random.split(jax.random.key(5), 4)
    x = (jax.random.normal(k[0], (n, v)) * 2).astype(jnp.bfloat16)
    y = jax.random.randint(k[1], (n,), 0, v)
    ids = jax.random.randint(k[2], (n, kk), 0, v)
    lp = jax.nn.log_softmax(jax.random.normal(k[3], (n, kk)))

    def fn(x, impl):
        ce = jax.value_and_grad(lambda x: jfl.cross_entropy(
            x, y, label_smoothing=0.1, implementation=impl))(x)
        ce_none = jfl.cross_entropy(x, y, reduction="none", return_lse=True,
                                    implementation=impl)
        tok = jax.vjp(lambda x: jfl.token_logprobs(x, y, return_entropy=True,
                                                   implementation=impl), x)
        tok_grad = tok[1]((jnp.ones(n), jnp.full((n,), 0.5)))
        lse = jfl.logsumexp(x, implementation=impl)
        kd = [jax.value_and_grad(lambda x: jfl.kd_loss(x, ids, lp, tail=tail,
                                                       implementation=impl))(x)
              for tail in (False, True)]
        return ce, ce_none, tok[0], tok_grad, lse, kd

    _check(fn, (x,), f"logits ops n={n}")
