"""Per-token `weights=`, `where=` and `num_items=` of cross_entropy and linear_cross_entropy
against jax.vjp of an independent float64 formula: per-token naive losses times the weights,
"mean" over the weight sum of the counted tokens (1 where it is 0) or num_items."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss
from tests.helpers import assert_close
from tests.reference import jax_ref


@pytest.fixture(autouse=True)
def _full_precision_fp32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


N, D, V = 13, 20, 97


def weighted_reference(per_token, y, weights, where, reduction, num_items, ignore=-100):
    counted = y != ignore
    if where is not None:
        counted = counted & where
    w = jnp.ones(y.shape, per_token.dtype) if weights is None else jnp.broadcast_to(
        weights, y.shape).astype(per_token.dtype)
    loss = jnp.where(counted, per_token * w, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    if num_items is not None:
        return jnp.sum(loss) / num_items
    total = jnp.sum(jnp.where(counted, w, 0.0)) if weights is not None else jnp.maximum(
        jnp.sum(counted), 1)
    return jnp.sum(loss) / jnp.where(total == 0, 1.0, total)


def inputs(seed, kind):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (N, D))
    w = jax.random.normal(k[1], (D, V)) * 0.5
    y = jax.random.randint(k[2], (N,), 0, V).at[3].set(-100)
    rng = np.random.default_rng(seed)
    weights = {"mixed": rng.normal(size=N) * 2, "zeros": rng.normal(size=N) * (rng.random(N) < .5),
               "all_zero": np.zeros(N), "none": None}[kind]
    where = jnp.asarray(rng.random(N) < 0.7)
    return h, w, y, (None if weights is None else jnp.asarray(weights, jnp.float32)), where


def _check(ours, ref, args, cot, what):
    """Value and vjp of ours (float32) and ref (float64) with the cotangent `cot`."""
    out, vjp = jax.vjp(ours, *args)
    grads = vjp(jnp.broadcast_to(jnp.asarray(cot, out.dtype), out.shape))
    with jax_ref.x64():
        a64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in args]
        rout, rvjp = jax.vjp(ref, *a64)
        rgrads = rvjp(jnp.broadcast_to(jnp.asarray(cot, rout.dtype), rout.shape))
        rout, rgrads = np.asarray(rout), [np.asarray(g) for g in rgrads]
    assert_close(out, rout, rtol=2e-5, atol=2e-6, what=f"{what} loss")
    for g, rg in zip(grads, rgrads):
        assert_close(g, rg, rtol=2e-5, atol=2e-5 * max(np.abs(rg).max(), 1e-30),
                     what=f"{what} grad")


CASES = [("mixed", "mean", False), ("mixed", "none", True), ("zeros", "sum", True),
         ("zeros", "mean", False), ("all_zero", "mean", False), ("none", "mean", True)]


@pytest.mark.parametrize("impl", ["triton", "xla"])
@pytest.mark.parametrize("kind, reduction, use_where", CASES)
def test_cross_entropy_weights(impl, kind, reduction, use_where):
    h, w, y, weights, where = inputs(0, kind)
    where = where if use_where else None
    logits = h @ w
    cot = np.random.default_rng(1).normal(size=N) if reduction == "none" else 1.7

    def ours(x):
        return jax_fusedloss.cross_entropy(x, y, weights=weights, where=where,
                                           reduction=reduction, implementation=impl)

    def ref(x):
        per = jax_ref.cross_entropy(x, y, reduction="none")
        return weighted_reference(per, y, weights, where, reduction, None)

    _check(ours, ref, (logits,), cot, f"{impl} {kind} {reduction}")


@pytest.mark.parametrize("mode", ["fast", "lean", "low_precision"])
@pytest.mark.parametrize("kind, reduction, use_where", CASES[:4])
def test_linear_cross_entropy_weights(mode, kind, reduction, use_where):
    h, w, y, weights, where = inputs(2, kind)
    where = where if use_where else None
    cot = np.random.default_rng(3).normal(size=N) if reduction == "none" else 0.6

    def ours(h, w):
        return jax_fusedloss.linear_cross_entropy(h, w, y, weights=weights, where=where,
                                                  reduction=reduction, mode=mode, chunk_size=4,
                                                  implementation="triton")

    def ref(h, w):
        per = jax_ref.linear_cross_entropy(h, w, y, reduction="none")
        return weighted_reference(per, y, weights, where, reduction, None)

    _check(ours, ref, (h, w), cot, f"linear {mode} {kind} {reduction}")


@pytest.mark.parametrize("fn", ["cross_entropy", "linear_cross_entropy"])
def test_num_items_and_broadcast_weights(fn):
    """num_items replaces the denominator (an int or a traced scalar); weights `[1]` and
    `[B, 1]` broadcast against the labels."""
    h, w, y, _, where = inputs(4, "none")
    hb, yb = h.reshape(1, N, D), y.reshape(1, N)
    weights = jnp.full((1, 1), 0.5)

    def call(h, num_items):
        if fn == "cross_entropy":
            return jax_fusedloss.cross_entropy(h @ w, yb, weights=weights, num_items=num_items,
                                               implementation="xla")
        return jax_fusedloss.linear_cross_entropy(h, w, yb, weights=weights,
                                                  num_items=num_items, implementation="xla")

    per = jax_fusedloss.cross_entropy(h @ w, y, reduction="none", implementation="xla")
    want = 0.5 * float(jnp.sum(per)) / 40
    assert_close(call(hb, 40), want, rtol=1e-6, what="int num_items")
    assert_close(jax.jit(call)(hb, jnp.float32(40)), want, rtol=1e-6, what="traced num_items")


def test_weights_get_no_gradient_and_zero_weight_keeps_nan():
    h, w, y, weights, _ = inputs(5, "mixed")
    x = h @ w
    gw = jax.grad(lambda wt: jax_fusedloss.cross_entropy(x, y, weights=wt,
                                                         implementation="xla"))(weights)
    assert not np.any(np.asarray(gw)), "weights are data: zero gradient"
    bad = y.at[0].set(V + 1)
    zero_w = weights.at[0].set(0.0)
    assert np.isnan(float(jax_fusedloss.cross_entropy(x, bad, weights=zero_w))), \
        "a weight of 0 does not hide an out-of-range label"
    masked = jax_fusedloss.cross_entropy(x, bad, weights=zero_w, where=jnp.arange(N) != 0)
    assert np.isfinite(float(masked)), "where=False does"


@pytest.mark.parametrize("kw, err, match", [
    (dict(weights=jnp.ones((N,), jnp.int32)), TypeError, "weights.dtype"),
    (dict(weights=[1.0] * N), TypeError, "weights must be"),
    (dict(weights=jnp.ones((N + 1,))), ValueError, "weights.shape"),
    (dict(where=jnp.ones((N,), jnp.float32)), TypeError, "where.dtype"),
    (dict(where=jnp.ones((2, N), bool)), ValueError, "where.shape"),
    (dict(num_items=0), ValueError, "num_items"),
    (dict(num_items=4, reduction="sum"), ValueError, "num_items"),
    (dict(num_items=jnp.ones((2,))), ValueError, "num_items.shape"),
])
@pytest.mark.parametrize("fn", ["cross_entropy", "linear_cross_entropy"])
def test_validation_names_the_argument(fn, kw, err, match):
    h, w, y, _, _ = inputs(6, "none")
    with pytest.raises(err, match=match):
        if fn == "cross_entropy":
            jax_fusedloss.cross_entropy(h @ w, y, **kw)
        else:
            jax_fusedloss.linear_cross_entropy(h, w, y, **kw)
