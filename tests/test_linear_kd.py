"""linear_kd_loss / linear_distill_loss against the float64 formulas on the logits
`hidden @ W + b` (tests/reference/kd_tail_ref.py), gradients w.r.t. hidden, weight and bias:
every memory mode, both weight layouts, a vocabulary walk of several blocks, the XLA rows and
the Triton kernels (the interpreter), the tail forms and per-token weights; bfloat16; jit;
validation; and (gpu-marked) the real size against naive XLA."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss
from tests.reference import jax_ref
from tests.reference import kd_tail_ref as ref

MODES = ("fast", "low_precision", "lean")


def make_inputs(seed=0, n=7, d=16, vocab=300, k=4, layout="dv", dtype=jnp.float32):
    """hidden, weight, bias, labels (one ignored), teacher top-k (a duplicate id, an
    out-of-range id, a masked row), weights of mixed sign with a zero."""
    keys = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(keys[0], (n, d))
    w = jax.random.normal(keys[1], (d, vocab) if layout == "dv" else (vocab, d)) * 0.5
    b = jax.random.normal(keys[2], (vocab,)) * 0.1
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(jax.random.normal(keys[3], (n, vocab)) * 3), k)
    ids = ids.at[0, 1].set(ids[0, 0]).at[1, 2].set(vocab + 3)
    mask = jnp.ones((n, k), bool).at[2].set(False)
    y = jax.random.randint(keys[4], (n,), 0, vocab).at[3].set(-100)
    wt = jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32).at[1].set(0.0)
    return [a.astype(dtype) for a in (h, w, b)] + [y, ids, lp, mask, wt]


def _objective(out):
    return jnp.sum(out * jnp.arange(1, out.size + 1, dtype=out.dtype).reshape(out.shape))


def run(fn, impl, inputs, layout="dv", with_bias=True, **opts):
    h, w, b, y, ids, lp, mask, wt = inputs
    if opts.pop("weighted", False):
        opts["weights"] = wt

    def f(h, w, b):
        if fn == "kd":
            out = jax_fusedloss.linear_kd_loss(h, w, ids, lp, mask, bias=b, weight_layout=layout,
                                               implementation=impl, **opts)
        else:
            out = jax_fusedloss.linear_distill_loss(h, w, y, ids, lp, mask, bias=b,
                                                    weight_layout=layout, implementation=impl,
                                                    **opts)
        return _objective(out)

    return jax.jit(jax.value_and_grad(f, (0, 1, 2)))(h, w, b if with_bias else None)


def reference(fn, inputs, layout="dv", **opts):
    h, w, b, y, ids, lp, mask, wt = inputs
    for key in ("mode", "chunk_size"):
        opts.pop(key, None)
    with jax_ref.x64():
        c = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        if opts.pop("weighted", False):
            opts["weights"] = c(wt)

        def f(h, w, b):
            z = ref.linear_logits(h, w, b, layout)
            out = (ref.kd_loss(z, ids, c(lp), mask, **opts) if fn == "kd"
                   else ref.distill_loss(z, y, ids, c(lp), mask, **opts))
            return _objective(out)

        return jax.value_and_grad(f, (0, 1, 2))(c(h), c(w), c(b))


def compare(got, want, rtol, what):
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=rtol, atol=rtol,
                               err_msg=f"{what}: loss")
    for name, g, r in zip(("dH", "dW", "db"), got[1], want[1]):
        g, r = np.asarray(g, np.float64), np.asarray(r)
        err = np.abs(g - r)
        tol = rtol * (1.0 + np.abs(r).max())
        assert err.max() <= tol, (f"{what}: {name} {int((err > tol).sum())} entries off, first "
                                  f"at {np.unravel_index(err.argmax(), err.shape)}, max error "
                                  f"{err.max():.3g}")


CASES = {
    "kd-kl": ("kd", dict(tail=True)),
    "kd-jsd-weights": ("kd", dict(tail=True, divergence="jsd", beta=0.3, weighted=True)),
    "kd-notail-t2-none": ("kd", dict(temperature=2.0, reduction="none")),
    "kd-topk-sum": ("kd", dict(normalize="topk", reduction="sum")),
    "distill-kl-t2-sq": ("distill", dict(alpha=0.3, tail=True, temperature=2.0,
                                         temperature_squared=True)),
    "distill-jsd-options": ("distill", dict(alpha=0.6, tail=True, divergence="jsd",
                                            label_smoothing=0.1, z_loss=1e-3, logit_softcap=5.0,
                                            weighted=True, reduction="none")),
    "distill-notail-weights": ("distill", dict(alpha=0.5, weighted=True, num_items=9)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_xla_matches_float64(name, mode):
    fn, opts = CASES[name]
    layout = "vd" if mode == "lean" else "dv"
    inputs = make_inputs(layout=layout)
    got = run(fn, "xla", inputs, layout, mode=mode, chunk_size=3, **opts)
    compare(got, reference(fn, inputs, layout, **opts), 2e-5, f"{name} {mode}")


@pytest.mark.parametrize("fn, mode, vocab", [("kd", "fast", 45), ("distill", "lean", 45),
                                             ("distill", "low_precision", 45),
                                             ("distill", "fast", 48), ("kd", "fast", 48),
                                             ("distill", "lean", 300)])
def test_triton_interpreter_matches_float64(interpreter, fn, mode, vocab):
    """V=45: rows off 16-byte boundaries; V=48 (aligned): the fused KD forward gathers the
    logits at the ids (and the label's) in its walk and writes each chunk's gradient over the
    chunk's logits (kd_fwd_plan's in_place). "lean" at V=300: the vocabulary walk's blocks of
    128, 128 and 44 columns over row chunks of 4 tokens, each block's gradient by
    kd_bwd_kernel with the block's offset (teacher ids and labels in other blocks)."""
    opts = dict(temperature=2.0, weighted=True) | (dict(alpha=0.4) if fn == "distill" else {})
    inputs = make_inputs(n=5, vocab=vocab)
    got = run(fn, "triton", inputs, mode=mode, chunk_size=2, **opts)
    compare(got, reference(fn, inputs, **opts), 2e-5, f"triton {fn} {mode}")


@pytest.mark.parametrize("fn, mode, opts", [
    ("kd", "fast", dict(tail=True, divergence="jsd", beta=0.3, weighted=True)),
    ("distill", "lean", dict(alpha=0.4, tail=True, temperature=2.0)),
    ("kd", "low_precision", dict(tail=True, reduction="none")),
    ("kd", "lean", dict(tail=True, divergence="jsd", reduction="none")),
    ("distill", "fast", dict(alpha=0.4, tail=True, label_smoothing=0.1)),
    ("distill", "lean", dict(alpha=0.4, tail=True, divergence="jsd", label_smoothing=0.1,
                             vocab=300)),
])
def test_triton_tail_interpreter_matches_float64(interpreter, fn, mode, opts):
    """The (K+1)-bucket forms on the Triton tail kernels (kernels/kd_tail.py) in the walks
    ("fast": each chunk's gradient written over its logits, the logits at the ids and label
    kept in xk for the id launch; "lean" at V=300: tail_bwd_kernel on the vocabulary walk's
    blocks of 128, 128 and 44 columns, ids and labels of other blocks left out)."""
    layout = "vd" if mode == "lean" else "dv"
    opts = dict(opts)
    inputs = make_inputs(n=5, vocab=opts.pop("vocab", 45), layout=layout)
    got = run(fn, "triton", inputs, layout, mode=mode, chunk_size=2, **opts)
    compare(got, reference(fn, inputs, layout, **opts), 2e-5, f"triton tail {fn} {mode}")


def test_without_bias_and_bfloat16():
    inputs = make_inputs(dtype=jnp.bfloat16)
    for mode in MODES:
        got = run("distill", "xla", inputs, with_bias=False, mode=mode, alpha=0.5, tail=True,
                  chunk_size=4)
        assert got[1][2] is None
        want = reference("distill", inputs, alpha=0.5, tail=True)
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=3e-2)
        for g, r in zip(got[1][:2], want[1][:2]):
            err = np.abs(np.asarray(g, np.float64) - np.asarray(r)).max()
            assert err <= 3e-2 * (1 + np.abs(np.asarray(r)).max()), (mode, err)


def test_leading_axes_and_empty_batch():
    h, w, b, y, ids, lp, mask, wt = make_inputs(n=6, vocab=50)
    rows = jax_fusedloss.linear_kd_loss(h.reshape(2, 3, -1), w, ids.reshape(2, 3, -1),
                                        lp.reshape(2, 3, -1), tail=True, reduction="none")
    flat = jax_fusedloss.linear_kd_loss(h, w, ids, lp, tail=True, reduction="none")
    np.testing.assert_allclose(np.asarray(rows).reshape(-1), np.asarray(flat), rtol=1e-6)
    empty = jax_fusedloss.linear_distill_loss(h[:0], w, y[:0], ids[:0], lp[:0], alpha=0.5)
    assert float(empty) == 0.0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(weight_layout="xy"), ValueError, "weight_layout"),
    (dict(mode="slow"), ValueError, "mode"),
    (dict(divergence="jsd"), ValueError, "requires tail=True"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(weights=jnp.ones((3,))), ValueError, "weights.shape"),
])
def test_validation_names_the_argument(kwargs, error, match):
    h, w, b, y, ids, lp, mask, _ = make_inputs(n=4, vocab=40)
    with pytest.raises(error, match=match):
        jax_fusedloss.linear_kd_loss(h, w, ids, lp, mask, **kwargs)
    with pytest.raises(error, match=match):
        jax_fusedloss.linear_distill_loss(h, w, y, ids, lp, mask, alpha=0.5, **kwargs)
    with pytest.raises(ValueError, match="teacher"):
        jax_fusedloss.linear_kd_loss(h, w, ids[:, :2], lp, mask)
    with pytest.raises(TypeError, match="labels"):
        jax_fusedloss.linear_distill_loss(h, w, y.astype(jnp.float32), ids, lp, alpha=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("fn, opts", [("kd", dict()), ("kd", dict(tail=True)),
                                      ("distill", dict(alpha=0.5, temperature=2.0)),
                                      ("distill", dict(alpha=0.5, tail=True, divergence="jsd"))])
def test_gpu_real_size(fn, opts):
    """N=8192, D=4096, V=128256, K=64 bf16 ("vd" weight): every mode against naive XLA
    (full float32 log-softmax) in loss and gradients."""
    n, d, vocab, k = 8192, 4096, 128256, 64
    keys = jax.random.split(jax.random.key(0), 4)
    h = (jax.random.normal(keys[0], (n, d)) * 0.5).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (vocab, d)) * 0.02).astype(jnp.bfloat16)
    y = jax.random.randint(keys[2], (n,), 0, vocab)
    t = jax.random.normal(keys[3], (n, vocab), jnp.bfloat16) * 3
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(t.astype(jnp.float32)), k)

    def ours(h, w, mode):
        if fn == "kd":
            return jax_fusedloss.linear_kd_loss(h, w, ids, lp, weight_layout="vd", mode=mode,
                                                **opts)
        return jax_fusedloss.linear_distill_loss(h, w, y, ids, lp, weight_layout="vd",
                                                 mode=mode, **opts)

    def naive(h, w):
        z = (h @ w.T).astype(jnp.float32)
        kd_opts = {k: v for k, v in opts.items() if k != "alpha"}
        kd = jnp.mean(ref.gathered_tokens(z, ids, lp, **kd_opts))
        if fn == "kd":
            return kd
        ce = jnp.mean(jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, y[:, None], -1)[:, 0])
        return opts["alpha"] * ce + (1 - opts["alpha"]) * kd

    want = jax.jit(jax.value_and_grad(naive, (0, 1)))(h, w)
    for mode in MODES:
        got = jax.jit(jax.value_and_grad(ours, (0, 1)), static_argnums=2)(h, w, mode)
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=2e-2)
        for name, g, r in zip(("dH", "dW"), got[1], want[1]):
            g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
            rel = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
            assert rel < 2e-2, (mode, name, rel)


@pytest.mark.parametrize("fn, mode, reduction", [("kd", "fast", "mean"),
                                                 ("distill", "low_precision", "none")])
def test_torch_ref_matches_float64(interpreter, fn, mode, reduction):
    """torch_ref's linear forms (the KD kernels on torch matmuls' chunks) against float64."""
    torch = pytest.importorskip("torch")
    import torch_ref

    inputs = make_inputs(n=5, vocab=45)
    h, w, b, y, ids, lp, mask, wt = (torch.from_numpy(np.array(a)) for a in inputs)
    h, w, b = (t.clone().requires_grad_(True) for t in (h, w, b))
    opts = dict(temperature=2.0, weights=wt, reduction=reduction, mode=mode, chunk_size=2)
    if fn == "kd":
        out = torch_ref.linear_kd_loss(h, w, ids, lp, mask, bias=b, **opts)
    else:
        out = torch_ref.linear_distill_loss(h, w, y.long(), ids, lp, mask, bias=b, alpha=0.4,
                                            **opts)
    obj = (out * torch.arange(1, out.numel() + 1).reshape(out.shape)).sum()
    obj.backward()
    got = (obj.detach().numpy(), (h.grad.numpy(), w.grad.numpy(), b.grad.numpy()))
    ref_opts = dict(temperature=2.0, weighted=True, reduction=reduction)
    if fn == "distill":
        ref_opts["alpha"] = 0.4
    compare(got, reference(fn, inputs, **ref_opts), 2e-5, f"torch_ref {fn} {mode}")


def test_benchmark_cpu_smoke(tmp_path):
    """benchmarks/linear_kd.py runs end to end at a tiny shape and writes its CSV."""
    from benchmarks import linear_kd

    cases = "matmuls-floor,naive-kd-tail,kd-xla-lean-tail,logits-kd-jsd"
    linear_kd.main(["--out", str(tmp_path), "--smoke", "--n", "16", "--d", "8", "--v", "64",
                    "--k", "4", "--only", cases])
    rows = (tmp_path / "linear_kd.csv").read_text().splitlines()
    assert len(rows) == 1 + len(cases.split(",")), rows
    naive, ours = (float(r.split(",")[-1]) for r in rows[2:4])
    assert abs(naive - ours) < 1e-3 * max(1.0, abs(naive)), rows
