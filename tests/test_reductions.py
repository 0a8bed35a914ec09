"""logsumexp, entropy, token_logprobs and merge_partials: JAX "triton" (interpreter on CPU) and
"xla", torch_ref and a float64 plain-PyTorch reference agree on values and gradients."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_fusedloss
import torch_ref
from jax_fusedloss import _triton_jax
from jax_fusedloss.kernels import launch as launch_cfg
from jax_fusedloss.kernels import reductions as red_kernels
from tests.helpers import (VALUE_RTOL, assert_close, assert_grad_close, check_transformations,
                           force_path, random_logits, to_numpy, to_torch)

IMPLS = ["triton", "xla", "torch_ref"]
DTYPES = ["float32", "bfloat16", "float16"]
# V = 1, V below one block (37), prime V over 2 fp32 tiles (5003), V over several tiles with a
# ragged tail for every dtype (9001) with leading dims [B, T, V].
SHAPES = [(4, 1), (5, 37), (3, 5003), (2, 2, 9001)]
# Which outputs an op returns; "both" is token_logprobs(return_entropy=True).
OPS = {"lse": ("lse",), "entropy": ("ent",), "logprobs": ("logp",), "both": ("logp", "ent")}
# The split path is a Triton launch choice: "xla" runs once.
IMPL_PATHS = [("triton", "rows"), ("triton", "split"), ("torch_ref", "rows"),
              ("torch_ref", "split"), ("xla", "rows")]


def make_labels(seed, shape, vocab):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=shape), jnp.int32)


def call_jax(op, x, labels, impl, temperature):
    kw = dict(temperature=temperature, implementation=impl)
    if op == "lse":
        return {"lse": jax_fusedloss.logsumexp(x, **kw)}
    if op == "entropy":
        return {"ent": jax_fusedloss.entropy(x, **kw)}
    if op == "logprobs":
        return {"logp": jax_fusedloss.token_logprobs(x, labels, **kw)}
    logp, ent = jax_fusedloss.token_logprobs(x, labels, return_entropy=True, **kw)
    return {"logp": logp, "ent": ent}


def call_torch(op, x, labels, temperature):
    kw = dict(temperature=temperature)
    if op == "lse":
        return {"lse": torch_ref.logsumexp(x, **kw)}
    if op == "entropy":
        return {"ent": torch_ref.entropy(x, **kw)}
    if op == "logprobs":
        return {"logp": torch_ref.token_logprobs(x, labels, **kw)}
    logp, ent = torch_ref.token_logprobs(x, labels, return_entropy=True, **kw)
    return {"logp": logp, "ent": ent}


def run(impl, op, logits, labels, weights, temperature=1.0):
    """(outputs by name, gradient of sum_k sum(weights[k] * outputs[k]))."""
    if impl == "torch_ref":
        x = to_torch(logits).requires_grad_(True)
        outs = call_torch(op, x, torch.from_dlpack(labels).long(), temperature)
        sum(((o * to_torch(weights[k])).sum() for k, o in outs.items())).backward()
        return {k: o.detach() for k, o in outs.items()}, x.grad

    def f(x):
        outs = call_jax(op, x, labels, impl, temperature)
        return sum(jnp.sum(o * weights[k]) for k, o in outs.items()), outs

    (_, outs), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(logits)
    return outs, grad


def reference(op, logits, labels, weights, temperature=1.0, rows=None):
    """The float64 plain-PyTorch formula and its torch.autograd gradient (optionally on rows)."""
    x = to_torch(logits).double()
    y = torch.from_dlpack(labels).long()
    w = {k: to_torch(v).double() for k, v in weights.items()}
    if rows is not None:
        x, y, w = x[rows], y[rows], {k: v[rows] for k, v in w.items()}
    x.requires_grad_(True)
    lse, ent, logp = torch_ref.reductions_reference(x, y, temperature=temperature)
    outs = {k: v for k, v in (("lse", lse), ("ent", ent), ("logp", logp)) if k in OPS[op]}
    sum(((o * w[k]).sum() for k, o in outs.items())).backward()
    return {k: o.detach() for k, o in outs.items()}, x.grad


def make_weights(seed, lead, names):
    keys = jax.random.split(jax.random.key(seed), 3)
    return {k: jax.random.normal(keys[i], lead) for i, k in enumerate(("lse", "ent", "logp"))
            if k in names}


def check(impl, op, dtype, shape, temperature=1.0, seed=0, scale=2.0):
    logits = random_logits(seed, shape, dtype, scale)
    labels = make_labels(seed + 1, shape[:-1], shape[-1])
    weights = make_weights(seed + 2, shape[:-1], OPS[op])
    outs, grad = run(impl, op, logits, labels, weights, temperature)
    routs, rgrad = reference(op, logits, labels, weights, temperature)
    for k in OPS[op]:
        assert to_numpy(outs[k]).dtype == np.float32, f"{impl} {k} dtype"
        assert_close(outs[k], routs[k], rtol=VALUE_RTOL[dtype], atol=2e-5, what=f"{impl} {k}")
    assert to_numpy(grad).shape == logits.shape
    assert str(grad.dtype).split(".")[-1] == dtype, f"grad dtype {grad.dtype} != {dtype}"
    assert_grad_close(grad, rgrad, dtype, what=f"{impl} {op} grad")
    return outs, grad


@pytest.mark.parametrize("impl,path_name", IMPL_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op,temperature", [("lse", 1.0), ("both", 0.7)])
def test_grid(impl, path_name, dtype, shape, op, temperature, monkeypatch, interpreter):
    force_path(path_name, monkeypatch)
    check(impl, op, dtype, shape, temperature)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ops_and_temperatures(impl, op, temperature, path, interpreter):
    check(impl, op, "bfloat16", (3, 1500), temperature, seed=3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [0.5, 40.0])
def test_unit_scale_and_large_logits(impl, scale, interpreter):
    check(impl, "both", "float32", (4, 1000), seed=5, scale=scale)


def small_tiles(n_rows, vocab, num_sms, write_grad=False):
    """The launch heuristic with 32-element tiles and 8 splits of 5 tiles (V=1201: the last
    split is 81 wide), so that interpreter-sized rows take the split path in earnest."""
    cfg = launch_cfg.row_config(n_rows, vocab, num_sms, write_grad)
    split_v = 5 * 32
    return cfg._replace(block_v=32, num_splits=-(-vocab // split_v), split_v=split_v)


@pytest.mark.parametrize("impl", ["triton", "torch_ref"])
def test_many_splits(impl, monkeypatch, interpreter):
    monkeypatch.setattr(red_kernels, "row_config", small_tiles)
    assert red_kernels.reduction_config(2, 1201, 64).num_splits == 8
    check(impl, "both", "float32", (2, 1201), 0.7, seed=7)


def masked_logits(dtype):
    """Row 0 all -inf, row 1 -inf but one entry, row 2 -inf at the label, row 3 ordinary."""
    logits = random_logits(9, (4, 700), "float32").at[0].set(-jnp.inf)
    logits = logits.at[1].set(-jnp.inf).at[1, 650].set(3.0)
    logits = logits.at[2, ::3].set(-jnp.inf).astype(dtype)
    return logits, jnp.asarray([5, 650, 9, 11], jnp.int32)


@pytest.mark.parametrize("impl", IMPLS)
def test_neg_inf_rows_and_entries(impl, path, interpreter):
    """All -inf row: lse -inf, entropy and logp NaN, zero gradient; -inf entries add nothing."""
    logits, labels = masked_logits(jnp.bfloat16)
    weights = make_weights(10, (4,), ("ent", "logp"))
    outs, grad = run(impl, "both", logits, labels, weights)
    (lse,) = run(impl, "lse", logits, labels, {"lse": weights["ent"]})[0].values()
    assert to_numpy(lse)[0] == -np.inf
    assert np.isnan(to_numpy(outs["ent"])[0]) and np.isnan(to_numpy(outs["logp"])[0])
    assert np.all(to_numpy(grad)[0] == 0)
    routs, rgrad = reference("both", logits, labels, weights, rows=[1, 2, 3])
    assert to_numpy(outs["logp"])[2] == -np.inf and to_numpy(outs["ent"])[1] == 0
    assert_close(to_numpy(outs["ent"])[1:], routs["ent"], rtol=2e-5, atol=1e-6, what="entropy")
    assert_close(to_numpy(outs["logp"])[1:], routs["logp"], rtol=2e-5, what="logp")
    assert_grad_close(to_numpy(grad)[1:], rgrad, "bfloat16")


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_labels(impl, path, interpreter):
    """NaN log-prob, never an out-of-bounds read; a NaN gradient row only if its cotangent
    is nonzero, so masking with jnp.where gives clean gradients; the entropy is unaffected."""
    logits = random_logits(11, (5, 600), "float32")
    labels = make_labels(12, (5,), 600).at[1].set(600).at[3].set(-100)
    weights = make_weights(13, (5,), ("ent", "logp"))
    outs, grad = run(impl, "both", logits, labels, weights)
    logp, grad = to_numpy(outs["logp"]), to_numpy(grad)
    assert np.isnan(logp[[1, 3]]).all() and np.isnan(grad[[1, 3]]).all()
    good = [0, 2, 4]
    routs, rgrad = reference("both", logits, labels, weights, rows=good)
    assert_close(logp[good], routs["logp"], rtol=2e-5, what="other rows' logp")
    assert_grad_close(grad[good], rgrad, "float32", what="other rows' grad")
    masked = dict(weights, logp=weights["logp"].at[1].set(0.0).at[3].set(0.0))
    outs, grad = run(impl, "both", logits, labels, masked)
    routs, rgrad = reference("both", logits, labels.at[1].set(0).at[3].set(0), masked)
    assert_close(outs["ent"], routs["ent"], rtol=2e-5, what="entropy with bad labels")
    assert_grad_close(grad, rgrad, "float32", what="grad with masked bad labels")


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_matches_jax(impl, interpreter):
    logits = random_logits(14, (6, 333), "float32")
    labels = make_labels(15, (6,), 333)
    z = logits / 0.8
    kw = dict(temperature=0.8, implementation=impl)
    assert_close(jax_fusedloss.logsumexp(logits, **kw), jax.nn.logsumexp(z, axis=-1), rtol=2e-6,
                 what="vs jax.nn.logsumexp")
    h = jnp.sum(jax.scipy.special.entr(jax.nn.softmax(z)), axis=-1)
    assert_close(jax_fusedloss.entropy(logits, **kw), h, rtol=2e-5, what="vs entr")
    lp = jnp.take_along_axis(jax.nn.log_softmax(z), labels[:, None], axis=-1)[:, 0]
    assert_close(jax_fusedloss.token_logprobs(logits, labels, **kw), lp, rtol=2e-6, atol=1e-6,
                 what="vs log_softmax")


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_transformations(impl, interpreter):
    """jit, grad, vmap, checkpoint and lax.scan agree with direct calls."""
    logits = random_logits(16, (3, 4, 260), "bfloat16")
    labels = make_labels(17, (3, 4), 260)

    def f(x, y):
        logp, ent = jax_fusedloss.token_logprobs(x, y, temperature=0.9, return_entropy=True,
                                                 implementation=impl)
        return jnp.sum(logp * jnp.arange(4.0)) + jnp.sum(ent)

    check_transformations(f, logits, labels)
    lse = jax.vmap(functools.partial(jax_fusedloss.logsumexp, implementation=impl))(logits)
    assert lse.shape == (3, 4) and lse.dtype == jnp.float32


def slice_partials(z, n_slices):
    """(max, sum exp(z - max), sum (z - max) exp(z - max)) of each slice, stacked on axis 1."""
    stats = []
    for c in jnp.split(z, n_slices, axis=-1):
        m = c.max(-1)
        d = c - jnp.where(jnp.isneginf(m), 0.0, m)[..., None]
        e = jnp.exp(d)
        stats.append((m, e.sum(-1), (jnp.where(jnp.isneginf(d), 0.0, d) * e).sum(-1)))
    return tuple(jnp.stack(col, axis=1) for col in zip(*stats))


def test_merge_partials_matches_logsumexp_of_concatenation():
    z = random_logits(18, (3, 2, 1000), "float32").at[1, :, 250:500].set(-jnp.inf)
    z = z.at[2].set(-jnp.inf)  # every slice of these rows is empty

    @jax.jit
    def merged(z):
        m, s, u = slice_partials(z, 4)  # [3, 4, 2]
        m2, s2 = jax_fusedloss.merge_partials(jnp.moveaxis(m, 1, -1), jnp.moveaxis(s, 1, -1))
        return jax_fusedloss.merge_partials(m, s, u, axis=1), m2 + jnp.log(s2)

    (mm, ss, uu), lse_last_axis = merged(z)
    lse = jax.nn.logsumexp(z, axis=-1)
    assert_close(mm + jnp.log(ss), lse, rtol=1e-6, what="merged lse")
    assert_close(lse_last_axis, lse, rtol=1e-6, what="merged lse, last axis")
    h = jnp.sum(jax.scipy.special.entr(jax.nn.softmax(z[:2])), axis=-1)
    assert_close((jnp.log(ss) - uu / ss)[:2], h, rtol=1e-5, atol=1e-6, what="merged entropy")
    assert np.all(to_numpy(mm[2]) == -np.inf) and np.all(to_numpy(ss[2]) == 0)
    assert np.all(to_numpy(uu[2]) == 0)


def test_merge_partials_of_shard_results_and_grad():
    """Shard-local (lse, 1, -entropy) merge to the full row's values and gradient."""
    z = random_logits(19, (5, 900), "float32").at[:, 300:600].set(-jnp.inf)

    def sharded(z):
        parts = jnp.split(z, 3, axis=-1)
        lse = jnp.stack([jax_fusedloss.logsumexp(p, implementation="xla") for p in parts], -1)
        ent = jnp.stack([jax_fusedloss.entropy(p, implementation="xla") for p in parts], -1)
        # the all -inf middle shard: lse -inf, entropy NaN; the merge treats it as the identity
        m, s, u = jax_fusedloss.merge_partials(lse, jnp.ones_like(lse), -ent)
        return m + jnp.log(s), jnp.log(s) - u / s

    lse, h = jax.jit(sharded)(z)
    assert_close(lse, jax.nn.logsumexp(z, axis=-1), rtol=1e-6, what="sharded lse")
    assert_close(h, jnp.sum(jax.scipy.special.entr(jax.nn.softmax(z)), -1), rtol=1e-5,
                 what="sharded entropy")
    g_lse, g_ent = jax.jit(lambda z: [jax.grad(lambda z: jnp.sum(sharded(z)[i]))(z)
                                      for i in range(2)])(z)
    assert np.isfinite(to_numpy(g_lse)).all() and np.isfinite(to_numpy(g_ent)).all()
    assert_close(g_lse, jax.nn.softmax(z), rtol=1e-5, atol=1e-7, what="sharded lse grad")
    h_ref = lambda z: jnp.sum(jax.nn.logsumexp(z, -1) - jnp.sum(
        jax.nn.softmax(z) * jnp.where(jnp.isneginf(z), 0.0, z), -1))  # finite grads at -inf
    assert_close(g_ent, jax.grad(h_ref)(z), rtol=1e-4, atol=1e-6, what="sharded entropy grad")


BAD_INPUTS = [
    (lambda: jax_fusedloss.logsumexp(jnp.zeros(())), ValueError, "logits.shape"),
    (lambda: jax_fusedloss.entropy(jnp.zeros((4, 0))), ValueError, "logits.shape"),
    (lambda: jax_fusedloss.logsumexp(jnp.zeros((4, 10), jnp.int32)), TypeError, "logits.dtype"),
    (lambda: jax_fusedloss.logsumexp(jnp.zeros((4, 10)), temperature=0.0), ValueError,
     "temperature"),
    (lambda: jax_fusedloss.entropy(jnp.zeros((4, 10)), temperature=-1.0), ValueError,
     "temperature"),
    (lambda: jax_fusedloss.entropy(jnp.zeros((4, 10)), temperature=float("nan")), ValueError,
     "temperature"),
    (lambda: jax_fusedloss.logsumexp(jnp.zeros((4, 10)), implementation="cuda"), ValueError,
     "implementation"),
    (lambda: jax_fusedloss.token_logprobs(jnp.zeros((4, 10)), jnp.zeros((5,), jnp.int32)),
     ValueError, "labels.shape"),
    (lambda: jax_fusedloss.token_logprobs(jnp.zeros((4, 10)), jnp.zeros((4, 1), jnp.int32)),
     ValueError, "labels.shape"),
    (lambda: jax_fusedloss.token_logprobs(jnp.zeros((4, 10)), jnp.zeros((4,))), TypeError,
     "labels.dtype"),
    (lambda: jax_fusedloss.token_logprobs(jnp.zeros((4, 10)), None), TypeError, "labels"),
    (lambda: jax_fusedloss.token_logprobs(jnp.zeros((4, 10)), jnp.zeros((4,), jnp.int32),
                                          return_entropy=1), TypeError, "return_entropy"),
    (lambda: jax_fusedloss.merge_partials(jnp.zeros((4, 3)), jnp.zeros((4, 2))), ValueError,
     "shape"),
]


@pytest.mark.parametrize("fn,exc,match", BAD_INPUTS)
def test_bad_input_fails_at_trace_time(fn, exc, match):
    with pytest.raises(exc, match=match.replace(".", r"\.")):
        jax.eval_shape(fn)


def test_traced_temperature_is_rejected():
    with pytest.raises(TypeError, match="temperature must be a static"):
        jax.jit(lambda x, t: jax_fusedloss.logsumexp(x, temperature=t))(jnp.zeros((2, 8)), 0.5)


def test_torch_ref_bad_inputs():
    with pytest.raises(ValueError, match="temperature"):
        torch_ref.entropy(torch.zeros(2, 8), temperature=0.0)
    with pytest.raises(ValueError, match=r"labels\.shape"):
        torch_ref.token_logprobs(torch.zeros(2, 8), torch.zeros(3, dtype=torch.long))


def test_empty_batch_and_auto_implementation():
    if _triton_jax.on_cuda_gpu():
        pytest.skip("CPU behaviour")
    assert jax_fusedloss.logsumexp(jnp.zeros((0, 8))).shape == (0,)
    logp, ent = jax_fusedloss.token_logprobs(jnp.zeros((2, 0, 8)), jnp.zeros((2, 0), jnp.int32),
                                             return_entropy=True)
    assert logp.shape == ent.shape == (2, 0)
    x = random_logits(20, (3, 50), "float32")
    assert_close(jax_fusedloss.entropy(x), jax_fusedloss.entropy(x, implementation="xla"),
                 what="auto == xla on CPU")
