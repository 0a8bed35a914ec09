"""kd_loss / distill_loss with the tail bucket (tail=True), divergence="kl" | "jsd" and per-token
weights / where, against the float64 formulas of tests/reference/kd_tail_ref.py (values and
gradients): the XLA rows on CPU (whole rows and the chunked GPU walk), Triton (the interpreter)
for weights without the tail (the tail kernels: tests/test_kd_tail_triton.py), special inputs
(duplicate, masked and out-of-range ids, a teacher top-K summing to 1, all-masked rows, T != 1
with and without T^2), the divergence's zero at a matching student, its sign on random inputs
(hypothesis), and validation."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss
from jax_fusedloss._xla import chunks, kd_tail
from tests.reference import jax_ref
from tests.reference import kd_tail_ref as ref

N, V, K = 6, 37, 5


def make_inputs(seed=0, n=N, vocab=V, k=K, scale=2.0):
    """Logits, labels (one ignored), teacher top-k with a duplicate id, an out-of-range id, a
    masked entry and an all-masked row; weights of mixed sign with a zero."""
    x = jax.random.normal(jax.random.key(seed), (n, vocab)) * scale
    t = jax.nn.log_softmax(jax.random.normal(jax.random.key(seed + 1), (n, vocab)) * 3.0)
    lp, ids = jax.lax.top_k(t, k)
    ids = ids.at[0, 1].set(ids[0, 0]).at[1, 2].set(vocab + 3).at[3, 0].set(-7)
    mask = jnp.ones((n, k), bool).at[2].set(False).at[4, 1].set(False)
    y = jax.random.randint(jax.random.key(seed + 2), (n,), 0, vocab).at[5].set(-100)
    w = jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32).at[1].set(0.0)
    return x, y, ids, lp, mask, w


def _value_grad(fn, x):
    def obj(x):
        out = fn(x)
        return jnp.sum(out * jnp.arange(1, out.size + 1, dtype=out.dtype).reshape(out.shape))
    return jax.value_and_grad(obj)(x)


def _f64(a):
    return jnp.asarray(np.asarray(a, np.float64))


def check(fn_name, opts, inputs=None, impl="xla", rtol=2e-5, atol=2e-6):
    x, y, ids, lp, mask, w = inputs or make_inputs()
    opts = dict(opts)
    if opts.pop("weighted", False):
        opts["weights"] = w
    if fn_name == "kd":
        got = _value_grad(lambda x: jax_fusedloss.kd_loss(x, ids, lp, mask, implementation=impl,
                                                          **opts), x)
    else:
        got = _value_grad(lambda x: jax_fusedloss.distill_loss(
            x, y, ids, lp, mask, implementation=impl, **opts), x)
    with jax_ref.x64():
        o64 = {k: (_f64(v) if k == "weights" else v) for k, v in opts.items()}
        if fn_name == "kd":
            want = _value_grad(lambda x: ref.kd_loss(x, ids, _f64(lp), mask, **o64), _f64(x))
        else:
            want = _value_grad(lambda x: ref.distill_loss(x, y, ids, _f64(lp), mask, **o64),
                               _f64(x))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=rtol, atol=atol,
                               err_msg=f"{fn_name} {opts} loss")
    gerr = np.abs(np.asarray(got[1], np.float64) - np.asarray(want[1]))
    scale = np.abs(np.asarray(want[1])).max()
    assert gerr.max() <= atol + rtol * scale, (
        f"{fn_name} {opts}: {int((gerr > atol + rtol * scale).sum())} gradient entries off, "
        f"first at {np.unravel_index(gerr.argmax(), gerr.shape)}, max error {gerr.max():.3g}")


CASES = {
    "kl": dict(tail=True),
    "jsd": dict(tail=True, divergence="jsd"),
    "jsd-beta": dict(tail=True, divergence="jsd", beta=0.2, reduction="sum"),
    "kl-t2-none": dict(tail=True, temperature=2.0, reduction="none"),
    "jsd-t07": dict(tail=True, divergence="jsd", temperature=0.7),
    "kl-weights": dict(tail=True, weighted=True),
    "jsd-weights-none": dict(tail=True, divergence="jsd", weighted=True, reduction="none"),
    "kl-num-items": dict(tail=True, num_items=11, weighted=True),
    "notail-weights": dict(weighted=True),
    "notail-topk-weights-sum": dict(weighted=True, normalize="topk", reduction="sum"),
}
DISTILL = {
    "kl-t2-sq": dict(tail=True, temperature=2.0, temperature_squared=True),
    "kl-t2": dict(tail=True, temperature=2.0),
    "jsd-all-options": dict(tail=True, divergence="jsd", label_smoothing=0.1, z_loss=1e-3,
                            logit_softcap=4.0, temperature=1.5),
    "jsd-weights": dict(tail=True, divergence="jsd", weighted=True),
    "notail-weights-t1": dict(weighted=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kd_matches_float64(name):
    check("kd", CASES[name])


@pytest.mark.parametrize("name", list(DISTILL) + ["kl", "jsd-weights-none"])
def test_distill_matches_float64(name):
    opts = dict(DISTILL.get(name) or CASES[name])
    check("distill", dict(opts, alpha=0.3))


@pytest.mark.parametrize("name", ["kl-t2-none", "jsd-weights"])
def test_chunked_vocabulary_walk(monkeypatch, name):
    """The GPU/TPU walk of the XLA rows (vocabulary chunks, row blocks) on CPU."""
    monkeypatch.setattr(chunks, "CHUNKED_ON_CPU", True)
    monkeypatch.setattr(chunks, "CHUNK", 16)
    monkeypatch.setattr(kd_tail, "TAIL_BLOCK_BYTES", 4 * V * 4)  # blocks of 4 rows (and 2)
    opts = dict(CASES.get(name) or DISTILL[name])
    check("distill", dict(opts, alpha=0.4))


@pytest.mark.parametrize("fn_name", ["kd", "distill"])
def test_triton_weights_fold_into_the_fused_gradient(interpreter, fn_name):
    """Per-token weights without the tail on the Triton kernels (the interpreter): a per-row
    scale of the gradient the forward writes."""
    opts = dict(weighted=True, temperature=2.0)
    if fn_name == "distill":
        opts["alpha"] = 0.5
    check(fn_name, opts, impl="triton")


def test_where_and_all_zero_weights():
    x, y, ids, lp, mask, w = make_inputs()
    keep = jnp.asarray([True, False, True, True, False, True])
    for fn in ("kd", "distill"):
        check(fn, dict(tail=True, where=keep, **({"alpha": 0.5} if fn == "distill" else {})))
    zero = jnp.zeros((N,), jnp.float32)
    loss, g = jax.value_and_grad(lambda x: jax_fusedloss.kd_loss(
        x, ids, lp, mask, tail=True, weights=zero))(x)
    assert float(loss) == 0.0 and not np.any(np.asarray(g)), (float(loss), g)
    # where=False makes a token's NaN label harmless, as ignore_index does
    bad_y = y.at[1].set(V + 5)
    loss = jax_fusedloss.distill_loss(x, bad_y, ids, lp, mask, alpha=0.5, tail=True,
                                      where=keep)
    assert np.isfinite(float(loss)), float(loss)


def test_teacher_summing_to_one_and_matching_student():
    """The full teacher distribution as its 'top-K' (K = V: tail mass 0) and a student equal
    to the teacher: both divergences are 0; with a truncated top-K (tail > 0) too."""
    t = jax.random.normal(jax.random.key(3), (4, 23)) * 2.0
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(t), 23)
    for k in (23, 6):
        for div in ("kl", "jsd"):
            loss = jax_fusedloss.kd_loss(t, ids[:, :k], lp[:, :k], tail=True, divergence=div,
                                         reduction="none")
            assert np.abs(np.asarray(loss)).max() < 1e-6, (k, div, loss)
    check("kd", dict(tail=True), inputs=(t * 0.5, None, ids, lp, None, None))
    check("kd", dict(tail=True, divergence="jsd"), inputs=(t * 0.5, None, ids, lp, None, None))


def test_all_masked_rows_are_zero_and_not_counted():
    x, y, ids, lp, _, w = make_inputs()
    mask = jnp.zeros((N, K), bool).at[0].set(True)
    for div in ("kl", "jsd"):
        rows = jax_fusedloss.kd_loss(x, ids, lp, mask, tail=True, divergence=div,
                                     reduction="none")
        assert np.all(np.asarray(rows)[1:] == 0.0), rows
        mean = jax_fusedloss.kd_loss(x, ids, lp, mask, tail=True, divergence=div)
        np.testing.assert_allclose(float(mean), float(rows[0]), rtol=1e-6)


def test_tail_divergences_are_nonnegative():
    """The (K+1)-bucket divergences are >= 0 on random inputs (up to rounding), while the
    truncated KL goes negative on the same inputs."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.given(seed=st.integers(0, 2**16), k=st.integers(1, 12),
                      scale=st.floats(0.1, 8.0), temp=st.sampled_from([0.5, 1.0, 3.0]),
                      beta=st.floats(0.05, 0.95))
    def prop(seed, k, scale, temp, beta):
        x, _, ids, lp, mask, _ = make_inputs(seed, vocab=17, k=k, scale=scale)
        lp = lp + jnp.log(jnp.asarray(np.random.default_rng(seed).uniform(0.3, 1.2, (1, k)),
                                      jnp.float32))  # teacher mass anywhere in [0, 1.2]
        for div in ("kl", "jsd"):
            rows = np.asarray(jax_fusedloss.kd_loss(
                x, ids, lp, mask, tail=True, divergence=div, beta=beta, temperature=temp,
                reduction="none"))
            assert rows.min() >= -1e-6, (div, rows)

    prop()
    _, _, ids, lp, _, _ = make_inputs(1, vocab=17, k=3)
    peaked = 10.0 * jax.nn.one_hot(ids, 17).sum(1)  # the student's mass on the ids
    assert float(jnp.min(jax_fusedloss.kd_loss(peaked, ids, lp, reduction="none"))) < 0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(divergence="jsd"), ValueError, "requires tail=True"),
    (dict(tail=True, normalize="topk"), ValueError, "normalize"),
    (dict(tail=True, divergence="js"), ValueError, "divergence"),
    (dict(tail=True, divergence="jsd", beta=1.0), ValueError, "beta"),
    (dict(tail=1), TypeError, "tail"),
    (dict(weights=jnp.ones((N, 2))), ValueError, "weights.shape"),
    (dict(weights=jnp.ones((N,), jnp.int32)), TypeError, "weights.dtype"),
    (dict(where=jnp.ones((N,))), TypeError, "where.dtype"),
])
def test_validation_names_the_argument(kwargs, error, match):
    x, y, ids, lp, mask, _ = make_inputs()
    with pytest.raises(error, match=match):
        jax_fusedloss.kd_loss(x, ids, lp, mask, **kwargs)
    with pytest.raises(error, match=match):
        jax_fusedloss.distill_loss(x, y, ids, lp, mask, alpha=0.5, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("divergence", ["kl", "jsd"])
def test_gpu_real_size(divergence):
    """kd_loss(tail=True) at N=8192, V=128256, K=64 bf16 against the gather-based naive XLA
    formula (full float32 log-softmax) in loss and gradient."""
    n, vocab, k = 8192, 128256, 64
    keys = jax.random.split(jax.random.key(0), 2)
    x = (jax.random.normal(keys[0], (n, vocab)) * 2).astype(jnp.bfloat16)
    t = x.astype(jnp.float32) + jax.random.normal(keys[1], (n, vocab))
    # the teacher's top-k a row block at a time: XLA's top_k of all 8192 rows sorts them with
    # ~23 GiB of temporaries, which an 80 GB GPU does not have beside what the suite holds
    rows = 1024
    topk = jax.jit(lambda t: jax.lax.top_k(jax.nn.log_softmax(t), k))
    lp, ids = (jnp.concatenate(a) for a in zip(*(topk(t[i:i + rows])
                                                    for i in range(0, n, rows))))
    del t
    ours = jax.jit(jax.value_and_grad(lambda x: jax_fusedloss.kd_loss(
        x, ids, lp, tail=True, divergence=divergence)))(x)
    g = np.asarray(ours[1], np.float32)
    # the naive formula's float32 temporaries at all 8192 rows (~24 GiB) do not fit an 80 GB
    # GPU beside what the suite holds: a row block at a time (its rows are independent)
    naive = jax.jit(jax.value_and_grad(lambda x, ids, lp: jnp.sum(ref.gathered_tokens(
        x, ids, lp, tail=True, divergence=divergence)) / n))
    parts = [naive(x[i:i + rows], ids[i:i + rows], lp[i:i + rows]) for i in range(0, n, rows)]
    np.testing.assert_allclose(float(ours[0]), sum(float(p[0]) for p in parts), rtol=1e-3)
    r = np.concatenate([np.asarray(p[1], np.float32) for p in parts])
    rel = np.linalg.norm(g - r) / np.linalg.norm(r)
    assert rel < 1e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_odd_vocab_peaked_student(reduction):
    """Compiled kernels at V=50257 bf16 (rows start off 4-byte boundaries: the fused forward's
    id bitmaps sit at each row's own aligned offset in the gradient; "none" keeps them in a
    buffer of their own) with a student whose mass outside the teacher's ids is ~1e-6 (Q_t
    from the tail columns, not 1 - sum q): the Triton kernels against the XLA rows."""
    n, vocab, k = 1024, 50257, 64
    keys = jax.random.split(jax.random.key(1), 3)
    ids = jax.random.randint(keys[0], (n, k), 0, vocab)
    lp = jax.nn.log_softmax(jax.random.normal(keys[1], (n, k))) - 0.05  # teacher tail ~5%
    x = jax.random.normal(keys[2], (n, vocab)) + 25.0 * jax.nn.one_hot(ids, vocab).sum(1)
    x = x.astype(jnp.bfloat16)
    cot = jnp.linspace(0.5, 2.0, n) if reduction == "none" else jnp.float32(1.0)
    for divergence in ("kl", "jsd"):
        def run(x, impl):
            return jax_fusedloss.kd_loss(x, ids, lp, tail=True, divergence=divergence,
                                         reduction=reduction, implementation=impl)
        (got, vjp_got), (want, vjp_want) = (jax.vjp(lambda x: run(x, i), x)
                                            for i in ("triton", "xla"))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
        g, r = (np.asarray(v(cot)[0], np.float32) for v in (vjp_got, vjp_want))
        rel = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert rel < 1e-2, (divergence, rel)
