"""logsumexp, entropy, token_logprobs and merge_partials: JAX "triton" (the interpreter on CPU,
compiled kernels on a GPU) and "xla", and torch_ref, against the float64 plain-JAX formulas
(tests/reference/jax_ref.py) in values and gradients, through the shared grid of
tests/opbase.py."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss
import torch_ref
from jax_fusedloss import _common, _triton_jax
from jax_fusedloss.kernels import launch as launch_cfg
from jax_fusedloss.kernels import reductions as red_kernels
from tests import opbase
from tests.helpers import (HAS_GPU, assert_close, assert_grad_close, check_transformations,
                           random_logits, to_numpy)
from tests.opbase import IMPLS, JAX_IMPLS, spec
from tests.reference import jax_ref

# V = 1, V below one block (37), prime V over 2 fp32 tiles (5003), V over several tiles with a
# ragged tail for every dtype (9001) with leading dims [B, T, V].
SHAPES = [(4, 1), (5, 37), (3, 5003), (2, 2, 9001)]


def _call(module, op, x, labels, **kw):
    """Outputs by name of `op` from jax_fusedloss, torch_ref or jax_ref (same signatures);
    "both" is token_logprobs(return_entropy=True)."""
    if op == "lse":
        return {"lse": module.logsumexp(x, **kw)}
    if op == "entropy":
        return {"ent": module.entropy(x, **kw)}
    if op == "logprobs":
        return {"logp": module.token_logprobs(x, labels, **kw)}
    logp, ent = module.token_logprobs(x, labels, return_entropy=True, **kw)
    return {"logp": logp, "ent": ent}


class Reduction(opbase.Op):
    value_atol = 2e-5
    OUTPUTS = {"lse": ("lse",), "entropy": ("ent",), "logprobs": ("logp",), "both": ("logp", "ent")}

    def __init__(self, op):
        self.name, self.outputs = op, self.OUTPUTS[op]

    def inputs(self, seed, shape, dtype, scale, opts):
        return dict(x=random_logits(seed, shape, dtype, scale),
                    labels=opbase.make_labels(seed + 1, shape[:-1], shape[-1], frac_ignored=0.0))

    def jax(self, impl, x, inputs, opts):
        return _call(jax_fusedloss, self.name, x, inputs["labels"], implementation=impl, **opts)

    def torch(self, x, inputs, opts):
        return _call(torch_ref, self.name, x, inputs["labels"].long(), **opts)

    def reference(self, x, inputs, opts):
        return _call(jax_ref, self.name, x, inputs["labels"], **opts)


OPS = {op: Reduction(op) for op in ("lse", "entropy", "logprobs", "both")}


@opbase.grid(dtype=opbase.DTYPES, shape=SHAPES, op_t=[("lse", 1.0), ("both", 0.7)])
def test_grid(impl, path, dtype, shape, op_t):
    op, temperature = op_t
    OPS[op].check(impl, dtype, shape, temperature=temperature)


@opbase.grid()  # every implementation and launch path (XLA's: one)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ops_and_temperatures(impl, op, temperature, path):
    OPS[op].check(impl, "bfloat16", (3, 1500), seed=3, temperature=temperature)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [0.5, 40.0])
def test_unit_scale_and_large_logits(impl, scale):
    OPS["both"].check(impl, "float32", (4, 1000), seed=5, scale=scale)


def small_tiles(n_rows, vocab, num_sms, write_grad=False):
    """The launch heuristic with 32-element tiles and 8 splits of 5 tiles (V=1201: the last
    split is 81 wide), so that interpreter-sized rows take the split path in earnest."""
    cfg = launch_cfg.row_config(n_rows, vocab, num_sms, write_grad)
    split_v = 5 * 32
    return cfg._replace(block_v=32, num_splits=-(-vocab // split_v), split_v=split_v)


@pytest.mark.parametrize("impl", ["triton", "torch_ref"])
def test_many_splits(impl, monkeypatch):
    monkeypatch.setattr(red_kernels, "row_config", small_tiles)
    assert red_kernels.reduction_config(2, 1201, 64).num_splits == 8
    OPS["both"].check(impl, "float32", (2, 1201), seed=7, temperature=0.7)


@pytest.mark.parametrize("impl", ["triton", "torch_ref"])
def test_one_launch_merge(impl, monkeypatch):
    """The one-launch split forward: every program of a row arrives at the row's counter
    (zeros aliased to the `sync` output, so it ends at the split count) and the row's last
    program merges the partials right."""
    monkeypatch.setattr(red_kernels, "row_config", small_tiles)
    x = random_logits(11, (3, 1201), "float32")
    y = jnp.asarray([4, 1200, 17], jnp.int32)
    plan = red_kernels.red_fwd_plan(3, 1201, inv_temp=1.0, entropy=True, has_label=True,
                                    num_sms=64)
    (step,) = plan.launches
    assert dict(step.aliases)[2] == [b.name for b in step.outputs].index("sync")
    names = ("lse", "ent", "logp", "sync")
    if impl == "triton":
        lse, ent, logp, sync = _triton_jax.run_plan(plan, names, x=x, y=y)
    else:
        import torch

        from torch_ref import _launch

        device = "cuda" if HAS_GPU else "cpu"
        out = _launch.run_plan(plan._replace(results=names),
                               x=torch.from_numpy(np.array(to_numpy(x))).to(device),
                               y=torch.from_numpy(np.array(to_numpy(y))).to(device))
        lse, ent, logp, sync = (o.cpu().numpy() for o in out)
    splits = step.constexprs["NUM_SPLITS"]
    assert splits > 1
    np.testing.assert_array_equal(to_numpy(sync), np.full(3, splits, np.int32))
    ref = jax_ref.token_logprobs(x, y, return_entropy=True)
    assert_close(to_numpy(lse), to_numpy(jax_ref.logsumexp(x)), rtol=1e-6, what="lse")
    assert_close(to_numpy(logp), to_numpy(ref[0]), rtol=1e-5, atol=1e-6, what="logp")
    assert_close(to_numpy(ent), to_numpy(ref[1]), rtol=1e-5, atol=1e-6, what="entropy")


def masked_logits(dtype):
    """Row 0 all -inf, row 1 -inf but one entry, row 2 -inf at the label, row 3 ordinary."""
    logits = random_logits(9, (4, 700), "float32").at[0].set(-jnp.inf)
    logits = logits.at[1].set(-jnp.inf).at[1, 650].set(3.0)
    logits = logits.at[2, ::3].set(-jnp.inf).astype(dtype)
    return logits, jnp.asarray([5, 650, 9, 11], jnp.int32)


@opbase.grid()  # every implementation and launch path (XLA's: one)
def test_neg_inf_rows_and_entries(impl, path):
    """All -inf row: lse -inf, entropy and logp NaN, zero gradient; -inf entries add nothing."""
    logits, labels = masked_logits(jnp.bfloat16)
    inputs = dict(x=logits, labels=labels)
    weights = opbase.weights(10, (4,), ("ent", "logp"))
    outs, grad = OPS["both"].run(impl, inputs, {}, weights)
    (lse,) = OPS["lse"].run(impl, inputs, {}, {"lse": weights["ent"]})[0].values()
    assert to_numpy(lse)[0] == -np.inf
    assert np.isnan(to_numpy(outs["ent"])[0]) and np.isnan(to_numpy(outs["logp"])[0])
    assert np.all(to_numpy(grad)[0] == 0)
    rows = np.array([1, 2, 3])
    routs, rgrad = OPS["both"].expected({k: v[rows] for k, v in inputs.items()}, {},
                                        {k: v[rows] for k, v in weights.items()})
    assert to_numpy(outs["logp"])[2] == -np.inf and to_numpy(outs["ent"])[1] == 0
    assert_close(to_numpy(outs["ent"])[1:], routs["ent"], rtol=2e-5, atol=1e-6, what="entropy")
    assert_close(to_numpy(outs["logp"])[1:], routs["logp"], rtol=2e-5, what="logp")
    assert_grad_close(to_numpy(grad)[1:], rgrad, "bfloat16")


@opbase.grid()  # every implementation and launch path (XLA's: one)
def test_out_of_range_labels(impl, path):
    """NaN log-prob, never an out-of-bounds read; a NaN gradient row only if its cotangent
    is nonzero, so masking with jnp.where gives clean gradients; the entropy is unaffected."""
    both = OPS["both"]
    inputs = both.inputs(11, (5, 600), "float32", 2.0, {})
    labels = inputs["labels"]
    inputs["labels"] = labels.at[1].set(600).at[3].set(-100)
    weights = opbase.weights(13, (5,), ("ent", "logp"))
    outs, grad = both.run(impl, inputs, {}, weights)
    logp, grad = to_numpy(outs["logp"]), to_numpy(grad)
    assert np.isnan(logp[[1, 3]]).all() and np.isnan(grad[[1, 3]]).all()
    good = np.array([0, 2, 4])
    routs, rgrad = both.expected({k: v[good] for k, v in inputs.items()}, {},
                                 {k: v[good] for k, v in weights.items()})
    assert_close(logp[good], routs["logp"], rtol=2e-5, what="other rows' logp")
    assert_grad_close(grad[good], rgrad, "float32", what="other rows' grad")
    masked = dict(weights, logp=weights["logp"].at[1].set(0.0).at[3].set(0.0))
    outs, grad = both.run(impl, inputs, {}, masked)
    routs, rgrad = both.expected(dict(inputs, labels=labels.at[1].set(0).at[3].set(0)), {},
                                 masked)
    assert_close(outs["ent"], routs["ent"], rtol=2e-5, what="entropy with bad labels")
    assert_grad_close(grad, rgrad, "float32", what="grad with masked bad labels")


@pytest.mark.parametrize("impl", JAX_IMPLS)
def test_matches_jax(impl):
    logits = random_logits(14, (6, 333), "float32")
    labels = opbase.make_labels(15, (6,), 333, frac_ignored=0.0)
    z = logits / 0.8
    kw = dict(temperature=0.8, implementation=impl)
    assert_close(jax_fusedloss.logsumexp(logits, **kw), jax.nn.logsumexp(z, axis=-1), rtol=2e-6,
                 what="vs jax.nn.logsumexp")
    h = jnp.sum(jax.scipy.special.entr(jax.nn.softmax(z)), axis=-1)
    assert_close(jax_fusedloss.entropy(logits, **kw), h, rtol=2e-5, what="vs entr")
    lp = jnp.take_along_axis(jax.nn.log_softmax(z), labels[:, None], axis=-1)[:, 0]
    assert_close(jax_fusedloss.token_logprobs(logits, labels, **kw), lp, rtol=2e-6, atol=1e-6,
                 what="vs log_softmax")


@pytest.mark.parametrize("impl", JAX_IMPLS)
def test_transformations(impl):
    """jit, grad, vmap, checkpoint and lax.scan agree with direct calls."""
    logits = random_logits(16, (3, 4, 260), "bfloat16")
    labels = opbase.make_labels(17, (3, 4), 260, frac_ignored=0.0)

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


def test_merge_partials_old_keyword_is_deprecated():
    """The first argument was `max` up to 0.1.0: still accepted, with a DeprecationWarning."""
    m, s = random_logits(21, (2, 3), "float32"), jnp.ones((2, 3))
    with pytest.warns(DeprecationWarning, match="maximum"):
        old = jax_fusedloss.merge_partials(max=m, sumexp=s)
    new = jax_fusedloss.merge_partials(maximum=m, sumexp=s)
    for a, b in zip(old, new):
        assert_close(a, b, what="max= vs maximum=")


X = spec((4, 10))
BAD_INPUTS = [
    (jax_fusedloss.logsumexp, (spec(()),), {}, ValueError, "logits.shape"),
    (jax_fusedloss.entropy, (spec((4, 0)),), {}, ValueError, "logits.shape"),
    (jax_fusedloss.logsumexp, (spec((4, 10), jnp.int32),), {}, TypeError, "logits.dtype"),
    (jax_fusedloss.logsumexp, (X,), dict(temperature=0.0), ValueError, "temperature"),
    (jax_fusedloss.entropy, (X,), dict(temperature=-1.0), ValueError, "temperature"),
    (jax_fusedloss.entropy, (X,), dict(temperature=float("nan")), ValueError, "temperature"),
    (jax_fusedloss.logsumexp, (X,), dict(implementation="cuda"), ValueError, "implementation"),
    (jax_fusedloss.token_logprobs, (X, spec((5,), jnp.int32)), {}, ValueError, "labels.shape"),
    (jax_fusedloss.token_logprobs, (X, spec((4, 1), jnp.int32)), {}, ValueError,
     "labels.shape"),
    (jax_fusedloss.token_logprobs, (X, spec((4,))), {}, TypeError, "labels.dtype"),
    (jax_fusedloss.token_logprobs, (X, None), {}, TypeError, "labels"),
    (jax_fusedloss.token_logprobs, (X, spec((4,), jnp.int32)), dict(return_entropy=1),
     TypeError, "return_entropy"),
    (jax_fusedloss.merge_partials, (spec((4, 3)), spec((4, 2))), {}, ValueError, "shape"),
]


@pytest.mark.parametrize("fn,args,kwargs,exc,match", BAD_INPUTS)
def test_bad_input_fails_at_trace_time(fn, args, kwargs, exc, match):
    opbase.check_rejected(fn, args, kwargs, exc, match)


def test_traced_temperature_is_rejected():
    with pytest.raises(TypeError, match="temperature must be a static"):
        jax.jit(lambda x, t: jax_fusedloss.logsumexp(x, temperature=t))(jnp.zeros((2, 8)), 0.5)


def test_torch_ref_bad_inputs():
    import torch

    with pytest.raises(ValueError, match="temperature"):
        torch_ref.entropy(torch.zeros(2, 8), temperature=0.0)
    with pytest.raises(ValueError, match=r"labels\.shape"):
        torch_ref.token_logprobs(torch.zeros(2, 8), torch.zeros(3, dtype=torch.long))


def test_empty_batch_and_auto_implementation():
    assert jax_fusedloss.logsumexp(jnp.zeros((0, 8))).shape == (0,)
    logp, ent = jax_fusedloss.token_logprobs(jnp.zeros((2, 0, 8)), jnp.zeros((2, 0), jnp.int32),
                                             return_entropy=True)
    assert logp.shape == ent.shape == (2, 0)
    x = random_logits(20, (3, 50), "float32")
    # None: Triton on a CUDA GPU except for few rows (measured faster on XLA), XLA elsewhere
    few = launch_cfg.auto_prefers_xla(*x.shape, "reductions", _triton_jax.call_kind())
    auto = "triton" if _common.default_implementation() == "triton" and not few else "xla"
    assert auto == ("triton" if HAS_GPU and not few else "xla")
    assert_close(jax_fusedloss.entropy(x), jax_fusedloss.entropy(x, implementation=auto),
                 what=f"None == {auto!r}")
