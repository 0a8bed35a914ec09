"""linear_token_logprobs: JAX "triton" (interpreter on CPU) and "xla", and torch_ref, against
jax.vjp / torch.autograd of the naive formula (logits = h @ W + b materialised) in float64,
with per-token cotangents on both outputs (what a PPO/GRPO loss sends back)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_fusedloss
import torch_ref
from jax_fusedloss import _lm_head
from tests.helpers import assert_close, check_transformations, to_numpy, to_torch
from tests.reference import jax_ref
from tests.multidevice_linear_check import layouts_per_case  # noqa: E402


@pytest.fixture(autouse=True)
def _full_precision_fp32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


D = 24  # not a multiple of 16


def make_inputs(seed, lead, vocab, layout="dv", with_bias=True, bad=True):
    k = jax.random.split(jax.random.key(seed), 6)
    h = jax.random.normal(k[0], lead + (D,), jnp.float32)
    w = jax.random.normal(k[1], (D, vocab) if layout == "dv" else (vocab, D)) * 0.5
    b = jax.random.normal(k[2], (vocab,)) if with_bias else None
    y = jax.random.randint(k[3], lead, 0, vocab)
    if bad and y.size >= 3:  # out of range both ways: NaN log-prob, masked by the objective
        flat = y.reshape(-1).at[1].set(-3).at[2].set(vocab + 5)
        y = flat.reshape(lead)
    c_logp = jax.random.normal(k[4], lead)
    c_ent = jax.random.normal(k[5], lead)
    return h, w, b, y, c_logp, c_ent


def naive(h, w, b, y, *, layout="dv", temperature=1.0):
    """(logp, entropy) of the naive formula at the inputs' dtype (NaN at bad labels)."""
    z = h @ (w if layout == "dv" else w.T)
    if b is not None:
        z = z + b
    lse, ent, logp = jax_ref.reductions(z, y, temperature=temperature)
    del lse
    return logp, ent


def objective(fn, y, c_logp, c_ent, vocab):
    valid = (y >= 0) & (y < vocab)

    def obj(h, w, b):
        logp, ent = fn(h, w, b)
        return jnp.sum(jnp.where(valid, logp, 0.0) * c_logp) + jnp.sum(ent * c_ent), (logp, ent)
    return obj


def run_ours(impl, h, w, b, y, c_logp, c_ent, vocab, **o):
    fn = (lambda h, w, b: jax_fusedloss.linear_token_logprobs(
        h, w, y, bias=b, return_entropy=True, implementation=impl, **o))
    argnums = (0, 1, 2) if b is not None else (0, 1)
    (_, outs), grads = jax.jit(jax.value_and_grad(objective(fn, y, c_logp, c_ent, vocab),
                                                  argnums, has_aux=True))(h, w, b)
    return outs, grads


def run_ref(h, w, b, y, c_logp, c_ent, vocab, layout="dv", temperature=1.0):
    with jax_ref.x64():
        f64 = (lambda a: None if a is None else jnp.asarray(np.asarray(a), jnp.float64))
        fn = (lambda h, w, b: naive(h, w, b, y, layout=layout, temperature=temperature))
        argnums = (0, 1, 2) if b is not None else (0, 1)
        (_, outs), grads = jax.value_and_grad(objective(fn, y, c_logp, c_ent, vocab),
                                              argnums, has_aux=True)(f64(h), f64(w), f64(b))
        return [np.asarray(o) for o in outs], [np.asarray(g) for g in grads]


def compare(got, want, what, rtol=2e-5):
    for a, e, name in zip(got[0], want[0], ("logp", "entropy")):
        assert_close(a, e, rtol=rtol, atol=rtol, equal_nan=True, what=f"{what} {name}")
    for a, e, name in zip(got[1], want[1], ("dh", "dw", "db")):
        scale = float(np.max(np.abs(e))) if e.size else 1.0
        assert_close(a, e, rtol=rtol, atol=rtol * scale, what=f"{what} {name}")


# name: (lead, vocab, layout, bias, temperature, mode, chunk_size)
CASES = {
    "odd_dv_bias_T07": ((3, 5), 97, "dv", True, 0.7, "fast", 4),
    "vd_nobias_T2_lowp": ((11,), 97, "vd", False, 2.0, "low_precision", 3),
    "one_token": ((1,), 97, "dv", True, 1.0, "fast", None),
    "lean_blocks_dv": ((21,), 300, "dv", True, 0.7, "lean", 2),  # blocks 128, 128, 44
    "lean_blocks_vd": ((21,), 300, "vd", False, 1.3, "lean", 2),
}


@pytest.mark.parametrize("impl", ["triton", "xla"])
@pytest.mark.parametrize("name", list(CASES))
def test_jax_matches_float64(impl, name):
    lead, vocab, layout, bias, temp, mode, chunk = CASES[name]
    h, w, b, y, cl, ce = make_inputs(1, lead, vocab, layout, bias)
    got = run_ours(impl, h, w, b, y, cl, ce, vocab, weight_layout=layout, temperature=temp,
                   mode=mode, chunk_size=chunk)
    want = run_ref(h, w, b, y, cl, ce, vocab, layout, temp)
    compare(got, want, f"{impl} {name}")
    bad = ~((y >= 0) & (y < vocab))
    assert np.isnan(to_numpy(got[0][0])[np.asarray(bad)]).all(), "bad labels: NaN log-prob"
    assert np.isfinite(to_numpy(got[0][1])).all(), "entropy unaffected by bad labels"


@pytest.mark.parametrize("impl", ["triton", "xla"])
@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_lean_logprobs_alone(impl, layout):
    """"lean", log-probs alone at temperature 1: dH comes from the forward (cross-entropy's
    fused row function, each row scaled by minus its cotangent in the backward) and dW from
    the vocabulary walk (blocks 128, 128, 44 over row chunks). Against float64 with mixed-sign
    per-token cotangents; bad labels: NaN log-prob, and a NaN gradient row (so all of dW)
    exactly where the log-prob's cotangent is nonzero."""
    vocab = 300
    h, w, b, y, cl, _ = make_inputs(6, (21,), vocab, layout, layout == "dv")
    valid = (y >= 0) & (y < vocab)

    def ours(h, w, b):
        return jax_fusedloss.linear_token_logprobs(h, w, y, bias=b, weight_layout=layout,
                                                   mode="lean", chunk_size=2,
                                                   implementation=impl)

    def obj(fn, masked=True):
        def f(h, w, b):
            logp = fn(h, w, b)
            return jnp.sum((jnp.where(valid, logp, 0.0) if masked else logp) * cl), logp
        return f

    argnums = (0, 1, 2) if b is not None else (0, 1)
    (_, logp), grads = jax.jit(jax.value_and_grad(obj(ours), argnums, has_aux=True))(h, w, b)
    with jax_ref.x64():
        f64 = (lambda a: None if a is None else jnp.asarray(np.asarray(a), jnp.float64))
        ref = (lambda h, w, b: naive(h, w, b, y, layout=layout)[0])
        (_, rlogp), rgrads = jax.value_and_grad(obj(ref), argnums, has_aux=True)(
            f64(h), f64(w), f64(b))
        rgrads = [np.asarray(g) for g in rgrads]
    compare(([logp], grads), ([np.asarray(rlogp)], rgrads), f"{impl} {layout} logp alone")
    # an unmasked bad label: its row of dH is NaN, the others finite; dW is NaN throughout
    dh, dw = jax.jit(jax.grad(lambda h, w: obj(ours, masked=False)(h, w, b)[0], (0, 1)))(h, w)
    dh, dw = to_numpy(dh), to_numpy(dw)
    bad = ~np.asarray(valid)
    assert np.isnan(dh[bad]).all() and np.isfinite(dh[~bad]).all()
    assert np.isnan(dw).all()


@pytest.mark.parametrize("name", ["odd_dv_bias_T07", "lean_blocks_vd"])
def test_torch_ref_matches_float64(name):
    lead, vocab, layout, bias, temp, mode, chunk = CASES[name]
    h, w, b, y, cl, ce = make_inputs(2, lead, vocab, layout, bias)
    valid = to_torch((y >= 0) & (y < vocab))

    def run(fn, dtype, **o):
        ts = [None if a is None else to_torch(a).to(dtype).requires_grad_(True)
              for a in (h, w, b)]
        logp, ent = fn(ts[0], ts[1], to_torch(y, torch.long), ts[2], **o)
        obj = (torch.where(valid, logp, 0.0) * to_torch(cl).to(dtype)).sum() + (
            ent * to_torch(ce).to(dtype)).sum()
        obj.backward()
        return [logp.detach(), ent.detach()], [t.grad for t in ts if t is not None]

    got = run(lambda h, w, y, b, **o: torch_ref.linear_token_logprobs(
        h, w, y, bias=b, return_entropy=True, **o), torch.float32, weight_layout=layout,
        temperature=temp, mode=mode, chunk_size=chunk)

    def ref(h, w, y, b):
        z = h @ (w if layout == "dv" else w.t())
        z = (z if b is None else z + b) / temp
        lp = torch.log_softmax(z, -1)
        logp = torch.gather(lp, -1, y.clamp(0, vocab - 1)[..., None])[..., 0]
        logp = torch.where((y >= 0) & (y < vocab), logp, torch.nan)
        return logp, -(lp.exp() * lp).sum(-1)

    want = run(ref, torch.float64)
    compare(got, [[to_numpy(a) for a in want[0]], [to_numpy(g) for g in want[1]]],
            f"torch_ref {name}")


@pytest.mark.parametrize("impl", ["triton", "xla", "torch_ref"])
def test_empty_batch(impl):
    h, w = jnp.zeros((0, D)), jnp.ones((D, 50))
    y = jnp.zeros((0,), jnp.int32)
    if impl == "torch_ref":
        ht, wt = (to_torch(a).requires_grad_(True) for a in (h, w))
        logp, ent = torch_ref.linear_token_logprobs(ht, wt, torch.zeros(0, dtype=torch.long),
                                                    return_entropy=True)
        (logp.sum() + ent.sum()).backward()
        assert logp.shape == (0,) and not wt.grad.any()
        return
    dh, dw = jax.grad(lambda h, w: jnp.sum(jax_fusedloss.linear_token_logprobs(
        h, w, y, implementation=impl)), (0, 1))(h, w)
    assert dh.shape == (0, D) and not np.any(np.asarray(dw))


def test_entropy_free_call_does_not_compute_it(monkeypatch):
    """Without return_entropy the row functions run with entropy=False (no entropy sums in
    the forward, none in the backward) and only three per-row statistics are kept."""
    seen = []
    real = _lm_head.apply

    def spy(op, *args):
        seen.append((op.opts.entropy, len(op.stat_shapes())))
        return real(op, *args)

    monkeypatch.setattr(_lm_head, "apply", spy)
    h, w, b, y, *_ = make_inputs(3, (4,), 50, bad=False)
    jax_fusedloss.linear_token_logprobs(h, w, y, implementation="xla")
    jax_fusedloss.linear_token_logprobs(h, w, y, implementation="xla", return_entropy=True)
    assert seen == [(False, 3), (True, 4)]


def test_transformations():
    """jit, vmap, vmap(grad), checkpoint and scan equal the per-element results."""
    h, w, b, y, cl, ce = make_inputs(4, (3, 6), 61, bad=False)

    def f(h, y, cl, ce):
        logp, ent = jax_fusedloss.linear_token_logprobs(h, w, y, bias=b, temperature=0.9,
                                                        return_entropy=True, chunk_size=4,
                                                        implementation="xla")
        return jnp.sum(logp * cl) + jnp.sum(ent * ce)

    check_transformations(f, h, y, cl, ce)


def test_matches_token_logprobs_on_logits():
    """The same numbers as the logits op on materialised logits (any mode)."""
    h, w, b, y, *_ = make_inputs(5, (9,), 97, bad=False)
    z = h @ w + b
    want = jax_fusedloss.token_logprobs(z, y, temperature=0.8, return_entropy=True,
                                        implementation="xla")
    for mode in ("fast", "lean"):
        got = jax_fusedloss.linear_token_logprobs(h, w, y, bias=b, temperature=0.8, mode=mode,
                                                  return_entropy=True, implementation="xla")
        for a, e in zip(got, want):
            assert_close(a, e, rtol=1e-5, atol=1e-5, what=mode)


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=0.0), "temperature"),
    (dict(mode="slow"), "mode"),
    (dict(weight_layout="x"), "weight_layout"),
    (dict(return_entropy="yes"), "return_entropy"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(labels=jnp.zeros((4,), jnp.float32)), "labels"),
    (dict(labels=jnp.zeros((5,), jnp.int32)), "labels"),
    (dict(weight=jnp.zeros((D, 9), jnp.bfloat16)), "weight"),
    (dict(bias=jnp.zeros((8,))), "bias"),
])
def test_validation_names_the_argument(bad, match):
    args = dict(hidden=jnp.zeros((4, D)), weight=jnp.zeros((D, 9)),
                labels=jnp.zeros((4,), jnp.int32))
    for k in ("hidden", "weight", "labels"):
        if k in bad:
            args[k] = bad.pop(k)
    with pytest.raises((TypeError, ValueError), match=match):
        jax_fusedloss.linear_token_logprobs(args["hidden"], args["weight"], args["labels"],
                                            **bad)


def test_four_cpu_devices(interpreter):
    """Tokens, vocabulary and both sharded (jit, Auto and Explicit axes; shard_map with
    vocab_axis), in every mode (tests/multidevice_rl_check.py), against one device."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JFL_CHECK_QUICK="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "tests.multidevice_rl_check", "xla"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and all(ln.startswith("OK") for ln in lines), out
    assert len(lines) == 4 * layouts_per_case(), out  # cases x layouts of the harness


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fast", "lean", "lean-logp"])
def test_gpu_real_size_against_float64(mode):
    """N=8192, D=4096, V=151936 bf16 (compiled kernels): log-probs, entropy and dH of a slice
    of 256 tokens against float64 torch autograd of the naive formula on the same bf16 values,
    dW of those 256 tokens alone against float64, and dW of all tokens against float32 logits
    autodiff (XLA). "lean-logp": log-probs alone at temperature 1 (dH from the forward)."""
    alone = mode == "lean-logp"
    mode = "lean" if alone else mode
    n, d, vocab, rows, temp = 8192, 4096, 151936, 256, 1.0 if alone else 0.9
    k = jax.random.split(jax.random.key(0), 5)
    h = jax.random.normal(k[0], (n, d)).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (d, vocab)) * 0.02).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (n,), 0, vocab)
    cl, ce = jax.random.normal(k[3], (n,)), jax.random.normal(k[4], (n,)) * 0.1
    if alone:
        ce = jnp.zeros_like(ce)

    def obj(fn):
        def f(h, w):
            logp, ent = fn(h, w)
            return jnp.sum(logp * cl[:h.shape[0]]) + jnp.sum(ent * ce[:h.shape[0]]), (logp, ent)
        return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))

    def ours(h, w):
        out = jax_fusedloss.linear_token_logprobs(h, w, y[:h.shape[0]], temperature=temp,
                                                  return_entropy=not alone, mode=mode)
        return (out, jnp.zeros_like(out)) if alone else out

    step = obj(ours)
    (_, (logp, ent)), (dh, dw) = step(h, w)
    (_, _), (_, dw_slice) = step(h[:rows], w)
    if mode == "lean":  # XLA's temporaries: a vocabulary block's gradient, dH's float32 sum
        # and one piece of the weight's block (XLA copies it out for cuBLAS), 16 MiB slack
        cols = _lm_head.head_options(n, vocab, jnp.bfloat16, "dv", mode, None, d).block
        budget = n * cols * 2 + n * d * 4 + d * cols * 2 // _lm_head.DH_PIECES + (16 << 20)
        temp_bytes = step.lower(h, w).compile().memory_analysis().temp_size_in_bytes
        assert temp_bytes <= budget, f"temporaries {temp_bytes / 2**30:.3f} GiB > budget " \
            f"{budget / 2**30:.3f} GiB"

    def ref64():
        ht = to_torch(h[:rows]).double().requires_grad_(True)
        wt = to_torch(w).double().requires_grad_(True)
        lp = torch.log_softmax((ht @ wt) / temp, -1)
        yt = to_torch(y[:rows], torch.long)
        lpy, e = lp.gather(-1, yt[:, None])[:, 0], -(lp.exp() * lp).sum(-1)
        ((lpy * to_torch(cl[:rows]).double()).sum() + (e * to_torch(ce[:rows]).double()).sum()
         ).backward()
        return [to_numpy(t) for t in (lpy.detach(), e.detach(), ht.grad, wt.grad)]

    rlogp, rent, rdh, rdw = ref64()
    assert_close(logp[:rows], rlogp, atol=2e-2, rtol=1e-2, what="logp")
    if not alone:
        assert_close(ent[:rows], rent, atol=2e-2, rtol=1e-2, what="entropy")
    for got, want, name in ((dh[:rows], rdh, "dh"), (dw_slice, rdw, "dw of the slice")):
        scale = float(np.abs(want).max())
        assert_close(got, want, atol=3e-2 * scale, rtol=3e-2, what=name)

    def naive(h, w):
        z = (h.astype(jnp.float32) @ w.astype(jnp.float32)) / temp
        lp = jax.nn.log_softmax(z)
        return jnp.take_along_axis(lp, y[:, None], -1)[:, 0], -jnp.sum(jnp.exp(lp) * lp, -1)

    (_, _), (_, rdw_all) = obj(naive)(h, w)
    scale = float(jnp.max(jnp.abs(rdw_all)))
    assert_close(dw, rdw_all, atol=3e-2 * scale, rtol=3e-2, what="dw (all tokens)")
