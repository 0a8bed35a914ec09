"""The XLA twins' vocabulary-chunk walk (what runs on GPU and TPU) on CPU: equal to the CPU
whole-row walk, which the op test files check against references, for every op, with ragged
last chunks, chunks wider than the row, and the few-row shortcut (one chunk of a whole row)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss as jfl
from jax_fusedloss._xla import chunks



def _ops(v):
    k = 8
    y = jax.random.randint(jax.random.key(1), (12,), 0, v).at[3].set(-100)
    teacher = jax.nn.log_softmax(jax.random.normal(jax.random.key(2), (12, v)))
    lp, ids = jax.lax.top_k(teacher, k)
    return {
        "cross_entropy": lambda x: jfl.cross_entropy(x, y, label_smoothing=0.1, z_loss=1e-3,
                                                     implementation="xla"),
        "cross_entropy_softcap": lambda x: jfl.cross_entropy(x, y, logit_softcap=3.0,
                                                             reduction="sum",
                                                             implementation="xla"),
        "logsumexp": lambda x: jfl.logsumexp(x, temperature=0.7, implementation="xla").sum(),
        "entropy": lambda x: jfl.entropy(x, implementation="xla").sum(),
        "token_logprobs": lambda x: jfl.token_logprobs(
            x, jnp.where(y < 0, 0, y), implementation="xla").sum(),
        "kd_full": lambda x: jfl.kd_loss(x, ids, lp, temperature=2.0, implementation="xla"),
        "kd_topk": lambda x: jfl.kd_loss(x, ids, lp, normalize="topk", implementation="xla"),
        "distill": lambda x: jfl.distill_loss(x, y, ids, lp, alpha=0.3, implementation="xla"),
    }


# V=300: 5 chunks of 64, the last one shifted; V=50: one chunk narrower than 64; full_rows: the
# few-row shortcut (the whole row is one chunk).
@pytest.mark.parametrize("v, dtype, full_rows", [(300, "float32", False),
                                                 (300, "bfloat16", False),
                                                 (50, "float32", False),
                                                 (300, "float32", True)])
def test_chunk_walk_equals_whole_rows(v, dtype, full_rows, monkeypatch):
    x = (jax.random.normal(jax.random.key(0), (12, v)) * 3).astype(dtype)
    want = {name: jax.value_and_grad(f)(x) for name, f in _ops(v).items()}
    monkeypatch.setattr(chunks, "CHUNKED_ON_CPU", True)
    monkeypatch.setattr(chunks, "CHUNK", 64)
    monkeypatch.setattr(chunks, "FULL_ROW_BYTES", (1 << 30) if full_rows else 0)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=2e-2, atol=1e-3)
    for name, f in _ops(v).items():
        loss, grad = jax.value_and_grad(f)(x)
        np.testing.assert_allclose(float(loss), float(want[name][0]), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        np.testing.assert_allclose(np.asarray(grad, np.float32),
                                   np.asarray(want[name][1], np.float32), **tol, err_msg=name)


def test_one_pass_special_rows(monkeypatch):
    """The few-row one-pass reductions (`chunks.one_pass_stats`, a variadic reduce with an
    online-softmax combiner, in the reductions' and cross-entropy's twins) against the CPU
    whole-row walk on rows that exercise its merge: all -inf, -inf mixed in, +inf, NaN, huge
    offsets, one finite entry, a label at -inf."""
    v = 37
    rng = np.random.default_rng(3)
    x = rng.normal(size=(9, v)).astype(np.float32) * 4
    x[0] = -np.inf
    x[1, ::3] = -np.inf
    x[2, 5] = np.inf
    x[3, 7] = np.nan
    x[4] += 1e5
    x[5] -= 1e5
    x[6] = -np.inf
    x[6, 11] = 2.0
    x[7, 4] = -np.inf
    y = jnp.asarray([0, 1, 2, 3, 4, 5, 11, 4, 8])

    def outs(x):
        return (jfl.logsumexp(x, implementation="xla"), jfl.entropy(x, implementation="xla"),
                jfl.token_logprobs(x, y, implementation="xla"),
                jfl.cross_entropy(x, y, reduction="none", label_smoothing=0.1, z_loss=1e-3,
                                  implementation="xla"))

    x = jnp.asarray(x)
    want = outs(x)
    monkeypatch.setattr(chunks, "CHUNKED_ON_CPU", True)
    monkeypatch.setattr(chunks, "FULL_ROW_BYTES", 1 << 30)
    got = outs(x)
    for name, g, w in zip(("logsumexp", "entropy", "token_logprobs", "cross_entropy"), got,
                          want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6,
                                   equal_nan=True, err_msg=name)
