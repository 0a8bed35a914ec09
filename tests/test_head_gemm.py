"""The statistics-only forward of the hidden-state ops through the fused GEMM
(jax_fusedloss/kernels/head_gemm.py: the logits' softmax partials in the GEMM's epilogue, no
logits written): against the matmul + row-kernel walk it replaces (`_lm_head.GEMM_EPILOGUE`
off, the same Triton implementation), the XLA twin and float64; where it applies and where it
does not; chunked, vmapped, under a gradient, on 4 CPU devices with the vocabulary sharded.
CPU: Triton's interpreter; GPU: the compiled kernel at the real size."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss
from jax_fusedloss import _lm_head, _triton_jax
from tests.helpers import assert_close, interpret_on_4_cpu_devices


@pytest.fixture
def gemm_calls(monkeypatch):
    """Counts the traces that took the fused GEMM."""
    calls = []
    real = _lm_head._gemm_walk

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(_lm_head, "_gemm_walk", spy)
    return calls


def inputs(seed, n, d, vocab, dtype, layout, bias, bad=True):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (n, d)).astype(dtype)
    w = (jax.random.normal(k[1], (d, vocab) if layout == "dv" else (vocab, d)) * 0.4
         ).astype(dtype)
    b = (jax.random.normal(k[2], (vocab,)) * 2).astype(dtype) if bias else None
    y = jax.random.randint(k[3], (n,), 0, vocab)
    if bad and n >= 3:
        y = y.at[1].set(-2).at[2].set(vocab + 3)
    return h, w, b, y


def logprobs(h, w, b, y, layout, temperature, entropy, impl="triton", gemm=True):
    _lm_head.GEMM_EPILOGUE = gemm
    try:
        out = jax.jit(lambda h, w, b: jax_fusedloss.linear_token_logprobs(
            h, w, y, bias=b, weight_layout=layout, temperature=temperature,
            return_entropy=entropy, implementation=impl))(h, w, b)
    finally:
        _lm_head.GEMM_EPILOGUE = True
    return out if entropy else (out,)


def float64_ref(h, w, b, y, layout, temperature):
    """(logp, entropy) in float64 from the logits `h W + b` rounded once to the inputs' dtype
    (as the fused GEMM, and XLA's GEMM with its bias epilogue on a GPU, round them)."""
    dt = h.dtype
    hf, wf = np.asarray(h, np.float64), np.asarray(w, np.float64)
    z = hf @ (wf if layout == "dv" else wf.T)
    if b is not None:
        z = z + np.asarray(b, np.float64)
    z = np.asarray(jnp.asarray(z, jnp.float32).astype(dt), np.float64) / temperature
    lse = np.log(np.sum(np.exp(z - z.max(1, keepdims=True)), 1)) + z.max(1)
    lp = z - lse[:, None]
    yy = np.asarray(y)
    ok = (yy >= 0) & (yy < z.shape[1])
    logp = np.where(ok, lp[np.arange(len(yy)), np.clip(yy, 0, z.shape[1] - 1)], np.nan)
    return logp, -np.sum(np.exp(lp) * lp, 1)


CASES = [  # (n, d, vocab, dtype, layout, bias, temperature, entropy)
    (37, 48, 200, "bfloat16", "dv", True, 1.0, True),
    (37, 40, 203, "bfloat16", "vd", False, 0.7, True),  # V odd: fine for a [V, D] weight
    (5, 16, 64, "float16", "vd", True, 1.3, False),
    (21, 24, 96, "float16", "dv", False, 1.0, True),
    (1, 8, 40, "bfloat16", "dv", True, 2.0, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_matmul_walk_and_float64(interpreter, gemm_calls, case):
    n, d, vocab, dtype, layout, bias, temp, ent = case
    h, w, b, y = inputs(n + vocab, n, d, vocab, dtype, layout, bias)
    got = logprobs(h, w, b, y, layout, temp, ent)
    assert gemm_calls, "the fused GEMM was not taken"
    walk = logprobs(h, w, b, y, layout, temp, ent, gemm=False)
    twin = logprobs(h, w, b, y, layout, temp, ent, impl="xla")
    ref = float64_ref(h, w, b, y, layout, temp)
    # With a bias XLA on a CPU rounds the logits twice (h W, then + b): the two walks' logits
    # then differ from ours by up to one rounding, as much as z's ulp (4 bits of bfloat16).
    tol = dict(rtol=1e-5, atol=2e-5) if not bias else dict(rtol=0.0, atol=8 * float(
        jnp.finfo(jnp.dtype(dtype)).eps) * (1 + float(np.abs(ref[0][np.isfinite(ref[0])]).max())))
    for i, name in enumerate(("logp", "entropy")[:len(got)]):
        assert_close(got[i], walk[i], equal_nan=True, what=f"{name} vs the matmul walk", **tol)
        assert_close(got[i], twin[i], equal_nan=True, what=f"{name} vs the XLA twin", **tol)
        assert_close(got[i], ref[i], rtol=1e-5, atol=5e-5, equal_nan=True,
                     what=f"{name} vs float64")
    if n >= 3:  # out-of-range labels: NaN log-probs, their entropies untouched
        assert np.isnan(np.asarray(got[0])[1:3]).all()
        assert not np.isnan(np.asarray(got[0])[[0] + list(range(3, n))]).any()
        if ent:
            assert np.isfinite(np.asarray(got[1])).all()


@pytest.mark.parametrize("d, vocab, layout, dtype", [
    (20, 64, "dv", "bfloat16"),  # D * 2 bytes not a multiple of 16
    (16, 61, "dv", "bfloat16"),  # a [D, V] row of 122 bytes
    (16, 64, "dv", "float32"),  # float32: XLA's matmul precision, not the GEMM's
])
def test_shapes_tma_cannot_address_take_the_matmul_walk(interpreter, gemm_calls, d, vocab,
                                                         layout, dtype):
    h, w, b, y = inputs(3, 9, d, vocab, dtype, layout, True)
    got = logprobs(h, w, b, y, layout, 1.0, True)
    assert not gemm_calls
    twin = logprobs(h, w, b, y, layout, 1.0, True, impl="xla")
    for a, t in zip(got, twin):
        assert_close(a, t, rtol=1e-5, atol=2e-5, equal_nan=True, what="fallback")


def test_token_chunks(interpreter, gemm_calls, monkeypatch):
    """A partials budget of 2 row tiles: N=45 in chunks of 32 rows (a ragged one first)."""
    from jax_fusedloss.kernels import head_gemm

    cfg = head_gemm.config(False)
    monkeypatch.setattr(head_gemm, "PART_BUDGET_BYTES",
                        2 * cfg["BM"] * head_gemm.part_tiles(72, cfg) * head_gemm.FIELDS * 4)
    assert head_gemm.chunk_rows(45, 72, cfg) == 2 * cfg["BM"]
    h, w, b, y = inputs(4, 45, 16, 72, "bfloat16", "vd", True)
    got = logprobs(h, w, b, y, "vd", 1.0, True)
    assert gemm_calls
    ref = float64_ref(h, w, b, y, "vd", 1.0)
    for a, r in zip(got, ref):
        assert_close(a, r, rtol=1e-5, atol=5e-5, equal_nan=True, what="chunked")


def test_vmap_and_gradient(interpreter, gemm_calls):
    """vmap over token sets equals the per-element calls; under value_and_grad with
    per-token cotangents (the forward keeps statistics) the gradients match the matmul walk."""
    h, w, b, y = inputs(5, 24, 16, 48, "bfloat16", "dv", False, bad=False)
    hb, yb = h.reshape(3, 8, 16), y.reshape(3, 8)

    def f(h, y):
        return jax_fusedloss.linear_token_logprobs(h, w, y, return_entropy=True,
                                                   implementation="triton")

    got = jax.jit(jax.vmap(f))(hb, yb)
    assert gemm_calls
    for i in range(3):
        one = jax.jit(f)(hb[i], yb[i])
        for a, o in zip(got, one):
            assert_close(a[i], o, rtol=1e-6, atol=1e-6, what=f"vmap [{i}]")
    c = jax.random.normal(jax.random.key(9), (2, 24))

    def loss(h, w):
        logp, ent = jax_fusedloss.linear_token_logprobs(h, w, y, return_entropy=True,
                                                        implementation="triton", mode="fast")
        return jnp.sum(logp * c[0]) + jnp.sum(ent * c[1])

    grads = {}
    for gemm in (True, False):
        _lm_head.GEMM_EPILOGUE = gemm
        try:
            grads[gemm] = jax.jit(jax.value_and_grad(loss, (0, 1)))(h, w)
        finally:
            _lm_head.GEMM_EPILOGUE = True
    assert_close(grads[True][0], grads[False][0], rtol=1e-5, atol=1e-5, what="value")
    for a, t, name in zip(grads[True][1], grads[False][1], ("dh", "dw")):
        assert_close(a, t, rtol=1e-2, atol=1e-2, what=name)


def test_vocabulary_sharded_shard_map(interpreter):
    """shard_map over 4 CPU devices, the weight's vocabulary split (vocab_axis) and the
    tokens too: each device's fused GEMM over its slice, merged across the axis, and lean's
    gradient (each device's dW block written in place), against one device (a child
    process: the device count is fixed at jax's import)."""
    code = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import jax_fusedloss
from jax_fusedloss import _lm_head, _triton_jax
from tests.test_head_gemm import inputs
calls = []
real = _lm_head._gemm_walk
_lm_head._gemm_walk = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
mesh = jax.make_mesh((2, 2), ("t", "v"))
h, w, b, y = inputs(7, 12, 16, 96, "bfloat16", "vd", True)
put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
hs, ws, bs, ys = put(h, P("t")), put(w, P("v")), put(b, P("v")), put(y, P("t"))
def local(h, w, b, y):
    return jax_fusedloss.linear_token_logprobs(h, w, y, bias=b, weight_layout="vd",
        return_entropy=True, implementation="triton", vocab_axis="v")
f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("t"), P("v"), P("v"), P("t")),
                          out_specs=(P("t"), P("t"))))
got = f(hs, ws, bs, ys)
one = jax.jit(lambda h, w, b: jax_fusedloss.linear_token_logprobs(h, w, y, bias=b,
    weight_layout="vd", return_entropy=True, implementation="triton"))(h, w, b)
assert calls, "no fused GEMM"
for a, o in zip(got, one):
    np.testing.assert_allclose(np.asarray(a), np.asarray(o), rtol=1e-5, atol=2e-5)
# lean's gradient: each device's vocabulary block over its tokens, dW written in place
dws = []
real_dw = _lm_head._gemm_dw
_lm_head._gemm_dw = lambda *a, **k: (dws.append(1), real_dw(*a, **k))[1]
c = jax.random.normal(jax.random.key(8), (2, 12))
def obj(h, w, b, y, c, **kw):
    lp, ent = jax_fusedloss.linear_token_logprobs(h, w, y, bias=b, weight_layout="vd",
        return_entropy=True, implementation="triton", mode="lean", **kw)
    return jnp.sum(jnp.where(jnp.isnan(lp), 0.0, lp) * c[0]) + jnp.sum(ent * c[1])
def local_grad(h, w, b, y, c):  # (w's and b's gradients come back summed over "t")
    return jax.grad(lambda h, w, b: obj(h, w, b, y, c, vocab_axis="v"), (0, 1, 2))(h, w, b)
cs = put(c, P(None, "t"))
got = jax.jit(jax.shard_map(local_grad, mesh=mesh, in_specs=(P("t"), P("v"), P("v"), P("t"),
    P(None, "t")), out_specs=(P("t"), P("v"), P("v"))))(hs, ws, bs, ys, cs)
one = jax.jit(jax.grad(lambda h, w, b: obj(h, w, b, y, c), (0, 1, 2)))(h, w, b)
assert dws, "no dW written in place"
for a, o in zip(got, one):
    a, o = np.asarray(a, np.float32), np.asarray(o, np.float32)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(a, o, rtol=2e-2, atol=2e-2 * np.abs(o).max())
print("OK")
"""
    interpret_on_4_cpu_devices(code, timeout=600)


def test_vmap_inside_shard_map(interpreter):
    """vmap inside shard_map (4 CPU devices, the weight's vocabulary split): no custom
    partitioning maps the batch there, so each head GEMM launch must (jax-triton, like the
    interpreter here, has no batching rule). Cross-entropy, token log-probs with the entropy
    and top-K distillation in "lean", the log-probs in "fast" too (its statistics forward),
    value and gradient against per-element calls on one device. Before the launches mapped
    their batch, all four failed (a child process: the device count is fixed at jax's
    import)."""
    code = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_fusedloss as jfl
from jax_fusedloss import _lm_head
calls = []
real = _lm_head._gemm_launch
_lm_head._gemm_launch = lambda k, *a, **kw: (calls.append(k.__name__), real(k, *a, **kw))[1]
mesh = jax.make_mesh((4,), ("v",))
B, N, D, V = 2, 12, 32, 256
k = jax.random.split(jax.random.key(0), 5)
h = jax.random.normal(k[0], (B, N, D), jnp.float32).astype(jnp.bfloat16)
w = (jax.random.normal(k[1], (D, V), jnp.float32) * 0.2).astype(jnp.bfloat16)
y = jax.random.randint(k[2], (B, N), 0, V)
ids = jax.random.randint(k[3], (B, N, 4), 0, V)
tlp = jax.nn.log_softmax(jax.random.normal(k[4], (B, N, 4)))
put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
args = (put(h, P()), put(w, P(None, "v")), put(y, P()), put(ids, P()), put(tlp, P()))
def ops(mode, axis):
    kw = dict(mode=mode, vocab_axis=axis, implementation="triton")
    return {
        "ce": lambda h, w, y, i, t: jfl.linear_cross_entropy(h, w, y, **kw),
        "rl": lambda h, w, y, i, t: jnp.sum(jnp.stack(jfl.linear_token_logprobs(
            h, w, y, return_entropy=True, **kw)) * jnp.array([[1.0], [-0.5]])),
        "kd": lambda h, w, y, i, t: jfl.linear_kd_loss(h, w, i, t, **kw),
    }
for mode, name in [("lean", "ce"), ("lean", "rl"), ("lean", "kd"), ("fast", "rl")]:
    f, one = ops(mode, "v")[name], ops(mode, None)[name]
    calls.clear()
    step = jax.vmap(jax.value_and_grad(f, (0, 1)), in_axes=(0, None, 0, 0, 0))
    got = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(None, "v"), P(), P(), P()),
                                out_specs=(P(), (P(), P(None, None, "v")))))(*args)
    assert calls, (mode, name, "no head GEMM")
    for i in range(B):
        ref = jax.jit(jax.value_and_grad(one, (0, 1)))(h[i], w, y[i], ids[i], tlp[i])
        for a, r in zip(jax.tree.leaves(jax.tree.map(lambda x: x[i], got)),
                        jax.tree.leaves(ref)):
            a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
            assert np.isfinite(r).all()
            np.testing.assert_allclose(a, r, rtol=2e-2, atol=2e-2 * np.abs(r).max(),
                                       err_msg=f"{mode} {name} [{i}]")
print("OK")
"""
    interpret_on_4_cpu_devices(code, timeout=900)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_gpu_real_size(gemm_calls, layout):
    """N=8192, D=4096, V=151936 bf16, forward only (rollout scoring) through the compiled
    kernel: against the matmul walk on all rows (its logits, bias included, rounded once by
    cuBLAS's bias epilogue, as ours) and float64 on a slice."""
    n, d, vocab = 8192, 4096, 151936
    h, w, b, y = inputs(0, n, d, vocab, "bfloat16", layout, layout == "vd")
    w = (w.astype(jnp.float32) * 0.05).astype(jnp.bfloat16)
    got = logprobs(h, w, b, y, layout, 0.9, True)
    assert gemm_calls
    walk = logprobs(h, w, b, y, layout, 0.9, True, gemm=False)
    for a, t, name in zip(got, walk, ("logp", "entropy")):
        assert_close(a, t, rtol=1e-4, atol=1e-4, equal_nan=True, what=f"{name} vs the walk")
    # float64 logits rounded once can round a near-tie the other way than float32
    # accumulation did: a label logit one bfloat16 ulp apart (1/16 at |z| ~ 16)
    rows = 64
    ref = float64_ref(h[:rows], w, b, y[:rows], layout, 0.9)
    for a, r, name in zip(got, ref, ("logp", "entropy")):
        assert_close(a[:rows], r, rtol=1e-3, atol=8e-2, equal_nan=True,
                     what=f"{name} vs float64")


@pytest.mark.gpu
def test_gpu_cross_entropy_statistics_forward(gemm_calls):
    """linear_cross_entropy's evaluation loss (no gradient) and per-token losses through the
    compiled statistics GEMM at N=8192, D=4096, V=128256 ([V, D], bf16, z-loss, ignored
    tokens): against the matmul walk."""
    n, d, vocab = 8192, 4096, 128256
    h, w, _, y = inputs(2, n, d, vocab, "bfloat16", "vd", False, bad=False)
    w = (w.astype(jnp.float32) * 0.05).astype(jnp.bfloat16)
    y = y.at[::5].set(-100)
    outs = {}
    for gemm in (True, False):
        _lm_head.GEMM_EPILOGUE = gemm
        try:
            outs[gemm] = [jax.jit(lambda h, w, r=r: jax_fusedloss.linear_cross_entropy(
                h, w, y, weight_layout="vd", z_loss=1e-4, reduction=r))(h, w)
                for r in ("mean", "none")]
        finally:
            _lm_head.GEMM_EPILOGUE = True
    assert len(gemm_calls) == 2
    for a, t, name in zip(outs[True], outs[False], ("mean", "none")):
        assert_close(a, t, rtol=1e-4, atol=1e-4, what=f"{name} vs the walk")


def _grads64(h, w, b, y, layout, g_of_z):
    """(dh, dw[, db]) in float64 of an objective whose gradient w.r.t. the logits (rounded
    once to the inputs' dtype, then divided by nothing: g_of_z takes them as they are) is
    g_of_z(z)."""
    dt = h.dtype
    hf, wf = np.asarray(h, np.float64), np.asarray(w, np.float64)
    z = hf @ (wf if layout == "dv" else wf.T)
    if b is not None:
        z = z + np.asarray(b, np.float64)
    z = np.asarray(jnp.asarray(z, jnp.float32).astype(dt), np.float64)
    g = g_of_z(z)
    dh = g @ (wf.T if layout == "dv" else wf)
    dw = hf.T @ g if layout == "dv" else g.T @ hf
    return (dh, dw) + (() if b is None else (g.sum(0),))


def _softmax64(z):
    lse = np.log(np.sum(np.exp(z - z.max(1, keepdims=True)), 1)) + z.max(1)
    return np.exp(z - lse[:, None]), lse


@pytest.mark.parametrize("layout, bias", [("vd", True), ("dv", False)])
def test_lean_gradient_blocks(interpreter, monkeypatch, layout, bias):
    """The lean backward's vocabulary blocks through head_grad_kernel (blocks of 128 columns,
    row chunks of 7 tokens, the weight read in place at each block's column): token log-probs
    with the entropy at T=0.8 (dH and dW in the backward) and cross-entropy with smoothing and
    z-loss under per-token cotangents (dH in the forward, dW in the backward), against float64
    and against the matmul + row-kernel walk."""
    calls = []
    real = _lm_head._gemm_grad
    monkeypatch.setattr(_lm_head, "_gemm_grad",
                        lambda *a, **k: (calls.append(a[5]), real(*a, **k))[1])
    vocab = 203 if layout == "vd" else 200
    h, w, b, y = inputs(1, 37, 16, vocab, "bfloat16", layout, bias)
    c = jax.random.normal(jax.random.key(3), (3, 37))
    valid = np.asarray((y >= 0) & (y < vocab))
    yc = jnp.clip(y, 0, vocab - 1)
    temp, eps, zl = 0.8, 0.1, 1e-3
    args = (h, w, b) if bias else (h, w)

    def rl(h, w, b=None):
        lp, ent = jax_fusedloss.linear_token_logprobs(
            h, w, y, bias=b, weight_layout=layout, temperature=temp, return_entropy=True,
            mode="lean", chunk_size=5, implementation="triton")
        return jnp.sum(jnp.where(jnp.isnan(lp), 0.0, lp) * c[0]) + jnp.sum(ent * c[1])

    def ce(h, w, b=None):
        loss = jax_fusedloss.linear_cross_entropy(
            h, w, yc, bias=b, weight_layout=layout, label_smoothing=eps, z_loss=zl,
            reduction="none", mode="lean", chunk_size=5, implementation="triton")
        return jnp.sum(loss * c[2])

    def g_rl(z):
        p, lse = _softmax64(z / temp)
        lp = np.log(p)
        ent = -np.sum(p * lp, 1)
        g_logp = np.where(valid, np.asarray(c[0], np.float64), 0.0)
        g_h = np.asarray(c[1], np.float64)
        g = p * (-g_logp - g_h * ent)[:, None] - g_h[:, None] * p * lp
        g[np.arange(37), np.asarray(yc)] += g_logp
        return g / temp

    def g_ce(z):
        p, lse = _softmax64(z)
        ct = np.asarray(c[2], np.float64)
        g = ct[:, None] * ((1 + 2 * zl * lse)[:, None] * p - eps / z.shape[1])
        g[np.arange(37), np.asarray(yc)] -= ct * (1 - eps)
        return g

    for name, f, g_of_z in (("log-probs", rl, g_rl), ("cross-entropy", ce, g_ce)):
        calls.clear()
        got = jax.jit(jax.grad(f, tuple(range(len(args)))))(*args)
        assert len(calls) == 4, calls  # a ragged block of 75 columns, then one loop body
        _lm_head.GEMM_EPILOGUE = False
        try:
            walk = jax.jit(jax.grad(f, tuple(range(len(args)))))(*args)
        finally:
            _lm_head.GEMM_EPILOGUE = True
        ref = _grads64(h, w, b, y, layout, g_of_z)
        for a, m, r, what in zip(got, walk, ref, ("dh", "dw", "db")):
            scale = float(np.abs(r).max())
            # (seen: 0.4-0.8% of the largest entry, dh rounded to bfloat16)
            assert_close(a, r, atol=1.5e-2 * scale, what=f"{name} {what} vs float64")
            # (the CPU walk rounds h W before adding the bias: a second rounding of z)
            assert_close(a, m, atol=(4e-2 if bias else 1.5e-2) * scale,
                         what=f"{name} {what} vs the walk")


class _Coefs:
    """The two hooks _gemm_grad reads of a HeadOp, with coefficients given outright."""

    def __init__(self, layout, coef, labels, inv_temp, log_term):
        self.head = _lm_head.HeadOptions(layout, "lean", 1, 1, 1, 1)
        self.out = (coef, labels, inv_temp, log_term)

    def gemm_grad(self, rows):
        return self.out


@pytest.mark.parametrize("layout, start, size", [("vd", 40, 72), ("dv", 8, 61), ("dv", 0, 96)])
def test_gradient_kernel_elementwise(interpreter, layout, start, size):
    """head_grad_kernel's block against the float64 formula entry by entry: random per-row
    (A, B, L, C) with lse, lse_lo of the true rows, labels inside and outside the block, a
    first column that is not a tile multiple, blocks whose rows are (TMA store) and are not
    (plain stores) 16-byte multiples."""
    from jax_fusedloss._lm_head import _gemm_grad

    n, d, vocab, temp = 19, 24, 160, 0.7
    h, w, b, y = inputs(5, n, d, vocab, "bfloat16", layout, True, bad=False)
    hf, wf = np.asarray(h, np.float64), np.asarray(w, np.float64)
    z = hf @ (wf if layout == "dv" else wf.T) + np.asarray(b, np.float64)
    z = np.asarray(jnp.asarray(z, jnp.float32).astype(jnp.bfloat16), np.float64) / temp
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    k = np.random.default_rng(0).standard_normal((4, n))
    lse_lo = 1e-7 * k[0]
    local = np.asarray(y) - start  # some rows' labels lie outside the block
    coef = np.stack([lse - lse_lo, lse_lo, k[0], k[1], k[2], 0.01 * k[3]], axis=1)
    op = _Coefs(layout, jnp.asarray(coef, jnp.float32), jnp.asarray(local, jnp.int32),
                1.0 / temp, True)
    g = jax.jit(lambda h, w, b: _gemm_grad(op, h, w, b, jnp.int32(start), size))(h, w, b)
    t = z[:, start:start + size] - lse[:, None]
    p = np.exp(t)
    want = p * (k[0][:, None] + k[1][:, None] * t) + 0.01 * k[3][:, None]
    cols = np.arange(size)
    want += np.where(cols[None, :] == local[:, None], k[2][:, None], 0.0)
    assert ((local >= 0) & (local < size)).any() and ((local < 0) | (local >= size)).any()
    # bfloat16 output (the interpreter truncates: 2**-7 relative)
    assert_close(g, want, rtol=1e-2, atol=1e-6, what="block gradient")


def _ce64(h, w, b, y, layout, z_loss, ignore=-100):
    """Per-token cross-entropy (+ z_loss * lse^2) in float64 of the logits rounded once;
    0 at ignored tokens, NaN at labels outside [0, V)."""
    zr = float64_ref(h, w, b, y, layout, 1.0)  # (its rounding; logp at the labels)
    hf, wf = np.asarray(h, np.float64), np.asarray(w, np.float64)
    z = hf @ (wf if layout == "dv" else wf.T)
    if b is not None:
        z = z + np.asarray(b, np.float64)
    z = np.asarray(jnp.asarray(z, jnp.float32).astype(h.dtype), np.float64)
    lse = np.log(np.sum(np.exp(z - z.max(1, keepdims=True)), 1)) + z.max(1)
    yy = np.asarray(y)
    loss = -zr[0] + z_loss * lse ** 2
    return np.where(yy == ignore, 0.0, loss)


@pytest.mark.parametrize("layout, dtype, bias", [("vd", "bfloat16", True),
                                                 ("dv", "float16", False)])
def test_cross_entropy_statistics_forward(interpreter, gemm_calls, layout, dtype, bias):
    """linear_cross_entropy's statistics-only forward through the fused GEMM (an evaluation
    loss without a gradient; per-token losses under a gradient in "fast"): ignored tokens,
    labels out of range, z-loss, per-token weights; against float64 and the matmul walk,
    loss and gradients. Label smoothing and a softcap keep the matmul walk."""
    n, d, vocab, zl = 29, 24, 152, 1e-3
    h, w, b, y = inputs(11, n, d, vocab, dtype, layout, bias)
    y = y.at[4].set(-100).at[9].set(-100)
    wt = jax.random.uniform(jax.random.key(4), (n,))
    c = jax.random.normal(jax.random.key(5), (n,))
    yc = jnp.where((y == -100) | ((y >= 0) & (y < vocab)), y, 0)  # no label out of range
    kw = dict(bias=b, weight_layout=layout, z_loss=zl, implementation="triton")

    def per_token(h, w, labels=y):
        return jax_fusedloss.linear_cross_entropy(h, w, labels, reduction="none", **kw)

    def objective(h, w):  # (a label out of range would make all of dW NaN: see the docstring)
        return jnp.sum(per_token(h, w, yc) * c)

    def run(gemm):
        _lm_head.GEMM_EPILOGUE = gemm
        try:
            mean = jax.jit(lambda h, w: jax_fusedloss.linear_cross_entropy(
                h, w, yc, weights=wt, **kw))(h, w)
            return (mean, jax.jit(per_token)(h, w),
                    jax.jit(jax.value_and_grad(objective, (0, 1)))(h, w))
        finally:
            _lm_head.GEMM_EPILOGUE = True

    gemm_calls.clear()
    got = run(True)
    assert len(gemm_calls) == 3, gemm_calls  # the mean, the losses, the gradient's forward
    walk = run(False)
    ref = _ce64(h, w, b, y, layout, zl)
    ref_c = _ce64(h, w, b, yc, layout, zl)
    wts = np.where(np.asarray(yc) == -100, 0.0, np.asarray(wt, np.float64))
    assert_close(got[1], ref, rtol=1e-5, atol=5e-5, equal_nan=True, what="losses vs float64")
    assert np.isnan(np.asarray(got[1])[1:3]).all() and np.asarray(got[1])[4] == 0.0
    assert_close(got[0], np.sum(ref_c * wts) / np.sum(wts), rtol=1e-5, atol=5e-5,
                 what="weighted mean vs float64")
    tol = dict(rtol=1e-5, atol=2e-5) if not bias else dict(rtol=0.0, atol=0.1)
    assert_close(got[1], walk[1], equal_nan=True, what="losses vs the matmul walk", **tol)
    assert_close(got[2][0], np.sum(ref_c * np.asarray(c, np.float64)), rtol=1e-4, atol=1e-4,
                 what="objective vs float64")
    for a, m, name in zip(got[2][1], walk[2][1], ("dh", "dw")):
        scale = float(np.abs(np.asarray(m, np.float32)).max())
        assert_close(a, m, atol=(4e-2 if bias else 1.5e-2) * scale, what=f"{name} vs the walk")
    for opt in (dict(label_smoothing=0.1), dict(logit_softcap=20.0)):
        gemm_calls.clear()
        jax.jit(lambda h, w: jax_fusedloss.linear_cross_entropy(h, w, y, **kw, **opt))(h, w)
        assert not gemm_calls, opt


@pytest.mark.parametrize("layout, bias", [("vd", True), ("dv", False)])
def test_lean_dw_blocks_written_in_place(interpreter, monkeypatch, layout, bias):
    """The lean backward's dW blocks over all tokens written into dW by head_dw_kernel
    (blocks of 24 columns, the ragged first one of 11 ([V, D], V=203: its rows are not
    16-byte multiples, so XLA's dot and a copy) or 8 columns): cross-entropy (dH in the
    forward) and token log-probs with the entropy (dH in the backward too), every entry of
    dW against float64 and against the copy. With every block in place ([D, V]) the first
    (the ragged one) creates dW and writes only its columns: fresh outputs are NaN-poisoned,
    so a column no block wrote fails."""
    from jax_fusedloss.kernels import linear_ce

    monkeypatch.setattr(linear_ce, "MIN_BLOCK_COLS", 16)
    monkeypatch.setattr(linear_ce, "BLOCK_COL_ALIGN", 8)
    monkeypatch.setattr(_triton_jax, "POISON", float("nan"))
    calls = []
    real = _lm_head._gemm_dw
    monkeypatch.setattr(_lm_head, "_gemm_dw", lambda *a, **k: (
        calls.append((a[1].shape[1], a[2] is None)), real(*a, **k))[1])
    n, vocab = 37, 203 if layout == "vd" else 200
    h, w, b, y = inputs(2, n, 16, vocab, "bfloat16", layout, bias, bad=False)
    c = jax.random.normal(jax.random.key(6), (2, n))
    args = (h, w, b) if bias else (h, w)
    argnums = tuple(range(len(args)))

    def ce(h, w, b=None):
        return jax_fusedloss.linear_cross_entropy(
            h, w, y, bias=b, weight_layout=layout, z_loss=1e-3, mode="lean", chunk_size=5,
            implementation="triton")

    def rl(h, w, b=None):
        lp, ent = jax_fusedloss.linear_token_logprobs(
            h, w, y, bias=b, weight_layout=layout, return_entropy=True, mode="lean",
            chunk_size=5, implementation="triton")
        return jnp.sum(lp * c[0]) + jnp.sum(ent * c[1])

    def g_ce(z):
        p, lse = _softmax64(z)
        g = (1 + 2e-3 * lse)[:, None] * p
        g[np.arange(n), np.asarray(y)] -= 1.0
        return g / n

    def g_rl(z):
        p, _ = _softmax64(z)
        lp = np.log(p)
        ent = -np.sum(p * lp, 1)
        g_logp, g_h = np.asarray(c[0], np.float64), np.asarray(c[1], np.float64)
        g = p * (-g_logp - g_h * ent)[:, None] - g_h[:, None] * p * lp
        g[np.arange(n), np.asarray(y)] += g_logp
        return g

    ragged = 11 if layout == "vd" else 8
    for name, f, g_of_z in (("cross-entropy", ce, g_ce), ("log-probs", rl, g_rl)):
        calls.clear()
        got = jax.jit(jax.grad(f, argnums))(*args)
        # the ragged block (creating dW where every block is in place), then one loop body
        # ([V, D]'s 11 columns: XLA's dot, so every block updates a zeroed dW)
        assert calls == ([(24, False)] if layout == "vd" else [(ragged, True), (24, False)]), \
            calls
        _lm_head.DW_IN_PLACE = False
        try:
            copy = jax.jit(jax.grad(f, argnums))(*args)
        finally:
            _lm_head.DW_IN_PLACE = True
        ref = _grads64(h, w, b, y, layout, g_of_z)
        for a, m, r, what in zip(got, copy, ref, ("dh", "dw", "db")):
            scale = float(np.abs(r).max())
            # (CE's dH comes from the forward's walk, whose CPU logits round h W before
            # adding the bias: a second rounding of z)
            assert_close(a, r, atol=(3e-2 if bias else 1.5e-2) * scale,
                         what=f"{name} {what} vs float64")
            # the same products, rounded once either way (the interpreter's float32 dot
            # against XLA's on the CPU: summation order only)
            assert_close(a, m, rtol=1e-2, atol=1e-3 * scale, what=f"{name} {what} vs the copy")


@pytest.mark.gpu
@pytest.mark.parametrize("case, layout", [("ce", "vd"), ("rl", "dv")])
def test_gpus_lean_in_place_dw_layouts(monkeypatch, case, layout):
    """Lean's gradient at its default blocks (dW written in place) on every GPU present, a
    1 x n mesh: shard_map with the vocabulary split, jit with the tokens sharded, jit with
    the weight's vocabulary sharded, against one device (bf16, N=2048, D=512, V=32768).
    2 x H200, 2026-11-27: all six within 5.3e-3 of the largest entry."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    calls = []
    real = _lm_head._gemm_dw
    monkeypatch.setattr(_lm_head, "_gemm_dw", lambda *a, **k: (calls.append(1),
                                                                 real(*a, **k))[1])
    mesh = jax.make_mesh((len(jax.devices()),), ("v",))
    n, d, vocab = 2048, 512, 32768
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (n, d)).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (vocab, d) if layout == "vd" else (d, vocab)) * 0.05
         ).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (n,), 0, vocab)
    c = jax.random.normal(k[3], (2, n))
    wspec = P("v") if layout == "vd" else P(None, "v")

    def loss(h, w, **kw):
        if case == "ce":
            return jax_fusedloss.linear_cross_entropy(h, w, y, weight_layout=layout,
                                                      mode="lean", **kw)
        lp, ent = jax_fusedloss.linear_token_logprobs(h, w, y, weight_layout=layout,
                                                      return_entropy=True, mode="lean", **kw)
        return jnp.sum(lp * c[0]) + jnp.sum(ent * c[1])

    grad = jax.value_and_grad(loss, (0, 1))
    one = jax.jit(grad)(h, w)

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    sm = jax.jit(jax.shard_map(lambda h, w: jax.value_and_grad(
        lambda h, w: loss(h, w, vocab_axis="v"), (0, 1))(h, w), mesh=mesh,
        in_specs=(P(), wspec), out_specs=(P(), (P(), wspec))))
    outs = {"shard_map": sm(put(h, P()), put(w, wspec)),
            "jit tokens": jax.jit(grad)(put(h, P("v")), put(w, P())),
            "jit vocab": jax.jit(grad)(put(h, P()), put(w, wspec))}
    assert calls
    for name, got in outs.items():
        for a, r, what in zip(jax.tree.leaves(got), jax.tree.leaves(one), ("loss", "dh", "dw")):
            r = np.asarray(r, np.float32)
            assert_close(a, r, rtol=0.0, atol=2e-2 * float(np.abs(r).max()),
                         what=f"{name} {what}")
