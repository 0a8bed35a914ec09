"""The oracles themselves: the plain-JAX formulas (tests/reference/jax_ref.py) and the
plain-PyTorch ones (tests/reference/torch_oracle.py) agree at float64 in values and gradients,
match optax / jax.nn where those define the same quantity, and distill_loss's references reduce
to cross_entropy's where the KD weight is 0."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from tests.helpers import assert_close
from tests.reference import jax_ref, torch_oracle

V = 97
RNG = np.random.default_rng(0)
X = RNG.normal(size=(2, 3, V)) * 3.0
LABELS = np.where(RNG.random((2, 3)) < 0.3, -1, RNG.integers(0, V, size=(2, 3)))
LABELS[0, 0] = V + 2  # out of range: NaN
IDS = RNG.integers(-2, V + 2, size=(2, 3, 5))
LP = np.log(RNG.dirichlet(np.ones(6), size=(2, 3))[..., :5])
MASK = RNG.random((2, 3, 5)) < 0.8
COT = RNG.normal(size=(2, 3))

CE_OPTIONS = [dict(), dict(label_smoothing=0.2, z_loss=1e-2, logit_softcap=5.0),
              dict(reduction="sum", label_smoothing=1.0), dict(reduction="none", z_loss=0.1)]
KD_OPTIONS = [dict(), dict(temperature=2.0, normalize="topk", reduction="none"),
              dict(temperature=0.7, reduction="sum"), dict(num_items=11.0)]
DISTILL_OPTIONS = [dict(alpha=0.3), dict(alpha=0.6, temperature=2.0, temperature_squared=True,
                                         normalize="topk", reduction="none"),
                   dict(alpha=0.5, label_smoothing=0.1, z_loss=1e-3, logit_softcap=4.0,
                        temperature=1.5, num_items=7.0)]


def both(jax_fn, torch_fn, args, **opts):
    """(value, grad) of sum(cot * out) from each oracle at float64, on finite tokens."""
    def cot_of(out):
        return COT if np.ndim(out) else 1.0

    with jax_ref.x64():
        jv, jg = jax_ref.value_and_vjp(lambda x: jax_fn(x, *[jnp.asarray(a) for a in args],
                                                        **opts), jnp.asarray(X), cot_of)
    t = torch.from_numpy(X.copy()).requires_grad_(True)
    tv = torch_fn(t, *[torch.from_numpy(np.asarray(a)) for a in args], dtype=torch.float64,
                  **opts)
    (tv * torch.as_tensor(cot_of(tv))).sum().backward()
    return (np.asarray(jv), np.asarray(jg)), (tv.detach().numpy(), t.grad.numpy())


def assert_agree(j, t, what):
    finite = np.isfinite(j[0])
    assert (finite == np.isfinite(t[0])).all(), f"{what}: NaN patterns differ"
    assert_close(j[0][finite], t[0][finite], rtol=1e-12, atol=1e-12, what=f"{what} value")
    rows = np.isfinite(j[1]).all(-1) & np.isfinite(t[1]).all(-1)
    assert_close(j[1][rows], t[1][rows], rtol=1e-10, atol=1e-12, what=f"{what} grad")


@pytest.mark.parametrize("opts", CE_OPTIONS, ids=str)
def test_cross_entropy_oracles_agree(opts):
    j, t = both(jax_ref.cross_entropy, torch_oracle.cross_entropy_reference, (LABELS,),
                ignore_index=-1, **opts)
    assert_agree(j, t, "cross_entropy")


@pytest.mark.parametrize("opts", KD_OPTIONS, ids=str)
def test_kd_oracles_agree(opts):
    j, t = both(jax_ref.kd_loss, torch_oracle.kd_loss_reference, (IDS, LP, MASK), **opts)
    assert_agree(j, t, "kd_loss")


@pytest.mark.parametrize("opts", DISTILL_OPTIONS, ids=str)
def test_distill_oracles_agree(opts):
    j, t = both(jax_ref.distill_loss, torch_oracle.distill_loss_reference,
                (LABELS, IDS, LP, MASK), ignore_index=-1, **opts)
    assert_agree(j, t, "distill_loss")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_reductions_oracles_agree(temperature):
    y = np.abs(LABELS) % V
    for i, name in enumerate(("lse", "entropy", "logp")):
        j, t = both(lambda x, y: jax_ref.reductions(x, y, temperature=temperature)[i],
                    lambda x, y, dtype: torch_oracle.reductions_reference(
                        x, y, temperature=temperature, dtype=dtype)[i], (y,))
        assert_agree(j, t, name)


@pytest.mark.parametrize("oracle", ["jax", "torch"])
@pytest.mark.parametrize("opts", [dict(label_smoothing=0.3), dict(z_loss=1e-2),
                                  dict(logit_softcap=3.0, reduction="none"),
                                  dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=6.0,
                                       reduction="sum")], ids=str)
def test_distill_without_kd_weight_is_cross_entropy(oracle, opts):
    """alpha = 1: distill_loss's reference with cross_entropy's options is cross_entropy's."""
    i = ["jax", "torch"].index(oracle)
    d = both(jax_ref.distill_loss, torch_oracle.distill_loss_reference, (LABELS, IDS, LP, MASK),
             alpha=1.0, ignore_index=-1, temperature=2.0, **opts)[i]
    c = both(jax_ref.cross_entropy, torch_oracle.cross_entropy_reference, (LABELS,),
             ignore_index=-1, **opts)[i]
    assert_agree(d, c, "alpha=1 vs cross_entropy")


def test_distill_softcap_caps_the_kd_term():
    """alpha = 0: the KD term sees the capped logits (labels in range: an out-of-range one
    gives NaN whatever alpha)."""
    with jax_ref.x64():
        x, y = jnp.asarray(X), jnp.asarray(np.where(LABELS > V, 3, LABELS))
        d = jax_ref.distill_loss(x, y, IDS, LP, MASK, alpha=0.0, ignore_index=-1,
                                 temperature=2.0, logit_softcap=4.0, reduction="none")
        kd = jax_ref.kd_loss(4.0 * jnp.tanh(x / 4.0), IDS, LP, MASK & (y != -1)[..., None],
                             temperature=2.0, reduction="none")
        assert_close(d, kd, rtol=1e-12, what="alpha=0 softcap")


def test_against_optax_and_jax_nn():
    with jax_ref.x64():
        x, y = jnp.asarray(X), jnp.asarray(np.abs(LABELS) % V)
        assert_close(jax_ref.cross_entropy(x, y, reduction="none"),
                     optax.softmax_cross_entropy_with_integer_labels(x, y), rtol=1e-12,
                     what="vs optax")
        lse, ent, logp = jax_ref.reductions(x, y, temperature=0.5)
        z = x / 0.5
        assert_close(lse, jax.nn.logsumexp(z, -1), rtol=1e-12, what="lse")
        assert_close(ent, jnp.sum(jax.scipy.special.entr(jax.nn.softmax(z)), -1), rtol=1e-10,
                     what="entropy")
        assert_close(logp, jnp.take_along_axis(jax.nn.log_softmax(z), y[..., None], -1)[..., 0],
                     rtol=1e-12, what="logp")


@pytest.mark.parametrize("weight_layout", ["dv", "vd"])
def test_linear_cross_entropy_is_cross_entropy_of_the_matmul(weight_layout):
    with jax_ref.x64():
        h = jnp.asarray(RNG.normal(size=(2, 3, 16)))
        w = jnp.asarray(RNG.normal(size=(16, V)))
        b = jnp.asarray(RNG.normal(size=(V,)))
        y = jnp.asarray(LABELS)
        opts = dict(ignore_index=-1, reduction="none", z_loss=1e-3, label_smoothing=0.1)
        got = jax_ref.linear_cross_entropy(h, w if weight_layout == "dv" else w.T, y, b,
                                           weight_layout=weight_layout, **opts)
        want = jax_ref.cross_entropy(jnp.einsum("btd,dv->btv", h, w) + b, y, **opts)
        assert_close(got, want, rtol=1e-12, equal_nan=True, what=weight_layout)
