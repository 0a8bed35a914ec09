"""linear_cross_entropy: JAX "triton" (interpreter on CPU) and "xla", and torch_ref, against
jax.grad / torch.autograd of the naive formula (logits = h @ W + b materialised) in float64."""
from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_fusedloss
from jax_fusedloss import _lm_head
import torch_ref
from jax_fusedloss.kernels.linear_ce import CHUNK_BUDGET_BYTES
from jax_fusedloss.linear_cross_entropy import default_chunk_size
from tests.helpers import assert_close, to_numpy, to_torch

# the modules (each package exports a function of the same name)
lce_jax = importlib.import_module("jax_fusedloss.linear_cross_entropy")
lce_torch = importlib.import_module("torch_ref.linear_cross_entropy")


@pytest.fixture(autouse=True)
def _full_precision_fp32_matmuls():
    """float32 matmuls at full precision: on a GPU, XLA's default for float32 dots is TF32 (a
    10-bit mantissa, ~1e-3 relative), far outside these tests' float32 tolerances; the bf16
    tests are unaffected."""
    with jax.default_matmul_precision("highest"):
        yield


# ----------------------------------------------------------------------------- naive formulas
def _options(o):
    return (o.get("ignore_index", -100), o.get("reduction", "mean"), o.get("label_smoothing", 0.0),
            o.get("z_loss", 0.0), o.get("logit_softcap"))


def lce_reference_jax(h, w, y, b=None, *, weight_layout="dv", **o):
    """(loss, lse) of the naive formula in plain JAX at the inputs' dtype."""
    ignore, reduction, eps, zl, cap = _options(o)
    z = h @ (w if weight_layout == "dv" else w.T)
    if b is not None:
        z = z + b
    if cap is not None:
        z = cap * jnp.tanh(z / cap)
    lse = jax.nn.logsumexp(z, axis=-1)
    zy = jnp.take_along_axis(z, jnp.clip(y, 0, z.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    loss = (1 - eps) * (lse - zy) + eps * (lse - z.mean(-1)) + zl * lse**2
    ignored = y == ignore
    loss = jnp.where(ignored, 0.0, loss)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / jnp.maximum((~ignored).sum(), 1)
    return loss, lse


def lce_reference_torch(h, w, y, b=None, *, weight_layout="dv", **o):
    """(loss, lse) of the naive formula in plain PyTorch at the inputs' dtype."""
    ignore, reduction, eps, zl, cap = _options(o)
    z = h @ (w if weight_layout == "dv" else w.t())
    if b is not None:
        z = z + b
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    lse = torch.logsumexp(z, -1)
    zy = torch.gather(z, -1, y.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    loss = (1 - eps) * (lse - zy) + eps * (lse - z.mean(-1)) + zl * lse**2
    ignored = y == ignore
    loss = torch.where(ignored, torch.zeros_like(loss), loss)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / (~ignored).sum().clamp(min=1)
    return loss, lse


# ----------------------------------------------------------------------------- inputs
D, V = 24, 97  # V: prime, below and not a multiple of any block; D not a multiple of 8


def make_inputs(seed, lead, layout, with_bias, dtype="float32", frac_ignored=0.3, ignore=-100,
                vocab=V):
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], lead + (D,), jnp.float32)
    w = jax.random.normal(k[1], (D, vocab) if layout == "dv" else (vocab, D), jnp.float32) * 0.4
    b = jax.random.normal(k[2], (vocab,), jnp.float32) if with_bias else None
    rng = np.random.default_rng(seed)
    y = rng.integers(0, vocab, size=lead)
    y[rng.random(lead) < frac_ignored] = ignore
    cast = (lambda a: a.astype(dtype))
    return cast(h), cast(w), None if b is None else cast(b), jnp.asarray(y, jnp.int32)


def objective_weights(seed, lead, reduction, with_lse):
    """Cotangents: per-token for "none", a non-unit scalar otherwise (tests the rescale)."""
    rng = np.random.default_rng(seed + 7)
    wl = jnp.asarray(rng.normal(size=lead), jnp.float32) if reduction == "none" else 1.7
    wlse = jnp.asarray(rng.normal(size=lead), jnp.float32) if with_lse else None
    return wl, wlse


def run_jax(impl, h, w, b, y, wl, wlse, **o):
    def f(h, w, b):
        out = jax_fusedloss.linear_cross_entropy(h, w, y, bias=b, implementation=impl,
                                                 return_lse=wlse is not None, **o)
        loss, lse = out if wlse is not None else (out, None)
        obj = jnp.sum(loss * wl) + (jnp.sum(lse * wlse) if wlse is not None else 0.0)
        return obj, (loss, lse)

    argnums = (0, 1, 2) if b is not None else (0, 1)
    (_, (loss, lse)), grads = jax.jit(jax.value_and_grad(f, argnums, has_aux=True))(h, w, b)
    return loss, lse, grads


def ref_jax(h, w, b, y, wl, wlse, **o):
    o = {k: v for k, v in o.items() if k not in ("chunk_size", "mode")}
    with jax.enable_x64(True):
        f64 = (lambda a: None if a is None else jnp.asarray(np.asarray(to_numpy(a), np.float64)))

        def f(h, w, b):
            loss, lse = lce_reference_jax(h, w, y, b, **o)
            obj = jnp.sum(loss * wl) + (jnp.sum(lse * wlse) if wlse is not None else 0.0)
            return obj, (loss, lse)

        argnums = (0, 1, 2) if b is not None else (0, 1)
        (_, (loss, lse)), grads = jax.value_and_grad(f, argnums, has_aux=True)(
            f64(h), f64(w), f64(b))
        return np.asarray(loss), np.asarray(lse), [np.asarray(g) for g in grads]


def run_torch(h, w, b, y, wl, wlse, fn, dtype=None, **o):
    if fn is lce_reference_torch:
        o = {k: v for k, v in o.items() if k not in ("chunk_size", "mode")}
    ts = [None if a is None else to_torch(a) for a in (h, w, b)]
    if dtype is not None:
        ts = [None if t is None else t.to(dtype) for t in ts]
    for t in ts:
        if t is not None:
            t.requires_grad_(True)
    yt = to_torch(y, torch.long)
    out = fn(ts[0], ts[1], yt, ts[2], **o) if fn is lce_reference_torch else fn(
        ts[0], ts[1], yt, bias=ts[2], return_lse=wlse is not None, **o)
    loss, lse = out if isinstance(out, tuple) else (out, None)
    cast = (lambda a: to_torch(a).to(loss.dtype)) if dtype is not None else to_torch
    obj = (loss * (cast(wl) if not isinstance(wl, float) else wl)).sum()
    if wlse is not None:
        obj = obj + (lse * cast(wlse)).sum()
    obj.backward()
    return (loss.detach(), None if lse is None else lse.detach(),
            [t.grad for t in ts if t is not None])


# ----------------------------------------------------------------------------- grid
# (layout, bias, leading shape, chunk_size, options): every option, both layouts, ragged chunks
CASES = {
    "dv-plain-ragged": ("dv", False, (21,), 8, {}),
    "vd-bias-mean": ("vd", True, (3, 7), 8, {}),
    "dv-bias-smoothing-sum": ("dv", True, (21,), 5, dict(label_smoothing=0.1, reduction="sum")),
    "vd-zloss-onechunk": ("vd", False, (21,), None, dict(z_loss=1e-2)),
    "dv-bias-softcap-none": ("dv", True, (21,), 8, dict(logit_softcap=3.0, reduction="none")),
    "vd-bias-combined-lse": ("vd", True, (3, 7), 16,
                             dict(label_smoothing=0.2, z_loss=1e-3, logit_softcap=5.0,
                                  ignore_index=-1, return_lse=True)),
    "dv-none-lse": ("dv", False, (21,), 7, dict(reduction="none", return_lse=True)),
    "vd-low-precision": ("vd", True, (21,), 4, dict(mode="low_precision")),
    "dv-lean-bias-smoothing": ("dv", True, (21,), 3, dict(mode="lean", label_smoothing=0.1)),
    "dv-lean-none": ("dv", False, (21,), 8, dict(mode="lean", reduction="none")),
    "vd-lean-combined-none-lse": ("vd", True, (3, 7), 2,
                                  dict(mode="lean", z_loss=1e-3, logit_softcap=5.0,
                                       reduction="none", return_lse=True)),
}


def _case(name, seed=0, frac_ignored=0.3, dtype="float32"):
    layout, with_bias, lead, chunk, o = CASES[name]
    o = dict(o, weight_layout=layout, chunk_size=chunk)
    with_lse = o.pop("return_lse", False)
    h, w, b, y = make_inputs(seed, lead, layout, with_bias, dtype, frac_ignored,
                             o.get("ignore_index", -100))
    wl, wlse = objective_weights(seed, lead, o.get("reduction", "mean"), with_lse)
    return (h, w, b, y, wl, wlse), o


def _compare(got, want, rtol, atol_grad, what):
    loss, lse, grads = got
    rloss, rlse, rgrads = want
    assert_close(loss, rloss, rtol=rtol, atol=rtol, what=f"{what} loss")
    if rlse is not None and lse is not None:
        assert_close(lse, rlse, rtol=rtol, atol=rtol, what=f"{what} lse")
    for g, rg, name in zip(grads, rgrads, ("d hidden", "d weight", "d bias")):
        scale = max(float(np.max(np.abs(to_numpy(rg)))), 1e-30)
        assert_close(g, rg, rtol=atol_grad, atol=atol_grad * scale, what=f"{what} {name}")


@pytest.mark.parametrize("impl", ["triton", "xla"])
@pytest.mark.parametrize("name", list(CASES))
def test_jax_matches_float64_reference(impl, name):
    args, o = _case(name)
    got = run_jax(impl, *args, **o)
    _compare(got, ref_jax(*args, **o), 2e-5, 2e-5, f"{impl} {name}")
    assert all(g.dtype == a.dtype for g, a in zip(got[2], args[:3]))


@pytest.mark.parametrize("name", list(CASES))
def test_torch_ref_matches_torch_autograd(name):
    args, o = _case(name, seed=3)
    got = run_torch(*args, fn=torch_ref.linear_cross_entropy, **o)
    want = run_torch(*args, fn=lce_reference_torch, dtype=torch.float64, **o)
    _compare(got, want, 2e-5, 2e-5, f"torch_ref {name}")


@pytest.mark.parametrize("impl", ["triton", "xla", "torch_ref"])
@pytest.mark.parametrize("layout, reduction", [("dv", "mean"), ("vd", "none")])
def test_lean_vocabulary_blocks(impl, layout, reduction):
    """mode="lean" walks blocks of vocabulary columns in the backward: V=300 with chunk_size=2
    and 21 tokens gives blocks of 128, 128 and a ragged 44 columns, each over row chunks of 4
    tokens (kernels.linear_ce.vocab_block), so every dW column block, the block seams and the
    float32 block accumulator are checked against float64 autodiff."""
    from jax_fusedloss.kernels.linear_ce import vocab_block

    assert vocab_block(21, 300, 2) == (128, 4)
    h, w, b, y = make_inputs(4, (21,), layout, True, vocab=300)
    wl, _ = objective_weights(4, (21,), reduction, False)
    o = dict(weight_layout=layout, reduction=reduction, chunk_size=2, mode="lean",
             label_smoothing=0.1, z_loss=1e-3, logit_softcap=4.0)
    args = (h, w, b, y, wl, None)
    if impl == "torch_ref":
        got = run_torch(*args, fn=torch_ref.linear_cross_entropy, **o)
    else:
        got = run_jax(impl, *args, **o)
    want = ref_jax(*args, **o)
    _compare(got, want, 2e-5, 2e-5, f"{impl} lean")
    dw, rdw = to_numpy(got[2][1]).astype(np.float64), want[2][1]
    cols = dw.reshape(-1, 300) if layout == "dv" else dw.T
    rcols = rdw.reshape(-1, 300) if layout == "dv" else rdw.T
    for c0 in (0, 128, 256):  # each block of dW on its own
        blk = slice(c0, c0 + 128)
        assert_close(cols[:, blk], rcols[:, blk], rtol=2e-5,
                     atol=2e-5 * np.abs(rcols).max(), what=f"{impl} dW block at {c0}")


@pytest.mark.parametrize("mode", ["fast", "low_precision", "lean"])
@pytest.mark.parametrize("impl", ["triton", "xla", "torch_ref"])
def test_float16_loss_scale_flushes_nothing(impl, mode):
    """float16 under a loss scale: the gradients are computed with the cotangent folded in,
    so an entry below float16's subnormals for a unit cotangent survives the scale. N=1, D=1,
    V=2, logits (0, -20): dL/dW[0, 1] = p_1 = 2.06e-9 (flushed to 0 in float16), times 65536 =
    1.35e-4. Before the fix every mode returned dW = 0 there."""
    h = jnp.ones((1, 1), jnp.float16)
    w = jnp.asarray([[0.0, -20.0]], jnp.float16)
    y = jnp.zeros((1,), jnp.int32)
    scale = 65536.0
    p1 = np.exp(-20.0) / (1.0 + np.exp(-20.0))
    if impl == "torch_ref":
        ht, wt = (to_torch(a).requires_grad_(True) for a in (h, w))
        (torch_ref.linear_cross_entropy(ht, wt, torch.zeros(1, dtype=torch.long), mode=mode)
         * scale).backward()
        dw = to_numpy(wt.grad)
    else:
        dw = jax.jit(jax.grad(lambda w: scale * jax_fusedloss.linear_cross_entropy(
            h, w, y, mode=mode, implementation=impl)))(w)
        assert dw.dtype == jnp.float16
    got = float(np.asarray(dw, np.float64)[0, 1])
    assert abs(got - scale * p1) <= 2e-3 * scale * p1, f"{impl} {mode}: dW[0,1]={got}, " \
        f"expected {scale * p1:.4g}"


@pytest.mark.parametrize("impl", ["triton", "xla", "torch_ref"])
def test_empty_batch_with_nonfinite_weight(impl):
    """N=0: the loss is +0.0 whatever the weight holds (an inf or NaN entry used to make it
    NaN, and a finite weight -0.0), and the gradients are zeros."""
    h = jnp.zeros((0, D), jnp.float32)
    w = jnp.ones((D, V), jnp.float32).at[3, 5].set(jnp.inf).at[4, 6].set(jnp.nan)
    y = jnp.zeros((0,), jnp.int32)
    if impl == "torch_ref":
        ht, wt = (to_torch(a).requires_grad_(True) for a in (h, w))
        loss = torch_ref.linear_cross_entropy(ht, wt, torch.zeros(0, dtype=torch.long))
        loss.backward()
        loss, dw = float(loss), to_numpy(wt.grad)
    else:
        loss, dw = jax.value_and_grad(lambda w: jax_fusedloss.linear_cross_entropy(
            h, w, y, implementation=impl), 0)(w)
        loss, dw = float(loss), np.asarray(dw)
    assert loss == 0.0 and np.copysign(1.0, loss) == 1.0, loss
    assert not np.any(dw), "an empty batch has zero gradients"


@pytest.mark.parametrize("mode", ["fast", "lean"])
def test_second_order_raises_the_library_message(mode):
    """jax.hessian / grad of grad: the library's NotImplementedError, not JAX's message about
    custom_partitioning."""
    h, w, _, y = make_inputs(0, (5,), "dv", False)

    def f(h):
        return jax_fusedloss.linear_cross_entropy(h, w, y, mode=mode, implementation="xla")

    with pytest.raises(NotImplementedError, match="second-order"):
        jax.hessian(f)(h)
    with pytest.raises(NotImplementedError, match="second-order"):
        jax.grad(lambda h: jnp.sum(jax.grad(f)(h)))(h)


@pytest.mark.parametrize("impl", ["triton", "xla", "torch_ref"])
def test_all_ignored(impl):
    args, o = _case("vd-bias-mean", frac_ignored=1.0)
    if impl == "torch_ref":
        loss, _, grads = run_torch(*args, fn=torch_ref.linear_cross_entropy, **o)
    else:
        loss, _, grads = run_jax(impl, *args, **o)
    assert float(loss) == 0.0
    for g in grads:
        assert not np.any(to_numpy(g)), "all-ignored batch must have zero gradients"


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_bfloat16_logits(impl):
    args, o = _case("dv-bias-smoothing-sum", dtype="bfloat16")
    got = run_jax(impl, *args, **o)
    ref = ref_jax(*args, **o)  # float64 from the same bf16 inputs: logits rounded only in ours
    _compare(got, ref, 2e-2, 3e-2, f"{impl} bf16")
    assert [g.dtype for g in got[2]] == [jnp.bfloat16] * 3


def test_no_grad_forward_and_chunk_independence():
    args, o = _case("vd-bias-combined-lse")
    h, w, b, y, _, _ = args
    outs = [jax.jit(lambda h, w, b, c=c: jax_fusedloss.linear_cross_entropy(
        h, w, y, bias=b, **dict(o, chunk_size=c)))(h, w, b) for c in (1, 3, 21, 100)]
    for c, out in zip((3, 21, 100), outs[1:]):
        assert_close(out, outs[0], rtol=1e-5, what=f"chunk_size={c}")


def test_vmap_and_scan():
    """vmap (a batch of token sets, one shared weight; the partitioned call maps over the
    batch) and lax.scan, under grad, equal the per-element results."""
    hb, w, b, yb = make_inputs(1, (3, 10), "vd", True)

    def f(h, w, b, y):
        return jax_fusedloss.linear_cross_entropy(h, w, y, bias=b, weight_layout="vd",
                                                  chunk_size=4, implementation="xla")

    g = jax.grad(f, (0, 1, 2))
    got = jax.jit(jax.vmap(g, (0, None, None, 0)))(hb, w, b, yb)
    _, scanned = jax.jit(lambda hb, yb: jax.lax.scan(
        lambda c, hy: (c, g(hy[0], w, b, hy[1])), 0.0, (hb, yb)))(hb, yb)
    g_one = jax.jit(g)
    for i in range(3):
        want = g_one(hb[i], w, b, yb[i])
        for a, s, r, name in zip(got, scanned, want, ("dh", "dw", "db")):
            assert_close(a[i], r, rtol=1e-5, atol=1e-6, what=f"vmap {name}[{i}]")
            assert_close(s[i], r, rtol=1e-5, atol=1e-6, what=f"scan {name}[{i}]")


def test_default_chunk_size():
    """128 MiB of chunk logits (the gradient overwrites them), but for 16-bit logits at least
    4096 rows in "fast" and 1024 in "lean" (powers of two), and in "low_precision" the largest
    multiple of 128 rows within 192 MiB of logits; at most N. The lean backward's vocabulary
    blocks hold 128 MiB of logits (chunk_size * V if given)."""
    from jax_fusedloss.kernels.linear_ce import LOW_PRECISION_CHUNK_BYTES, vocab_block

    assert default_chunk_size(8192, 128256, 4096, jnp.bfloat16, "low_precision") == 768
    assert default_chunk_size(8192, 128256, 4096, jnp.bfloat16, "fast") == 4096
    assert default_chunk_size(8192, 128256, 4096, jnp.bfloat16, "lean") == 1024
    assert default_chunk_size(8192, 151936, 4096, jnp.bfloat16, "low_precision") == 640
    assert default_chunk_size(8192, 256000, 2304, jnp.bfloat16, "low_precision") == 384
    assert default_chunk_size(8192, 32000, 2304, jnp.bfloat16, "low_precision") == 3072
    assert default_chunk_size(8192, 32000, 2304, jnp.bfloat16, "lean") == 2048  # budget
    assert default_chunk_size(500, 128256, 4096, jnp.bfloat16, "low_precision") == 500
    for v in (32000, 128256, 151936, 256000):
        c = default_chunk_size(8192, v, 4096, jnp.bfloat16, "low_precision")
        assert c % 128 == 0 and c * v * 2 <= LOW_PRECISION_CHUNK_BYTES < (c + 128) * v * 2
    assert lce_torch.default_chunk_size(8192, 128256, torch.bfloat16, "low_precision") == 768
    assert default_chunk_size(8192, 128256, 4096, jnp.float32, "fast") == 256  # no floor
    assert default_chunk_size(100, 128256, 4096, jnp.bfloat16) == 100
    assert default_chunk_size(5, 10**9, 64, jnp.float32) == 1
    assert lce_torch.default_chunk_size(8192, 128256, torch.bfloat16) == 4096  # "fast"
    assert lce_torch.default_chunk_size(8192, 128256, torch.bfloat16, "lean") == 1024
    assert 512 * 128256 * 2 <= CHUNK_BUDGET_BYTES < 1024 * 128256 * 2
    # lean blocks: all 8192 tokens at once, 7936 columns (17 blocks); N=32768: square-ish
    # blocks, 8064 columns by row chunks of 8143 tokens; a vocabulary that fits: one block
    assert vocab_block(8192, 128256, 512) == (7936, 8192)
    assert vocab_block(32768, 128256, 512) == (8064, 8143)
    assert vocab_block(21, 97, 8) == (97, 8)  # the whole vocabulary, 8 tokens at a time
    for n, v, c in ((8192, 128256, 512), (32768, 128256, 512), (21, 300, 2), (1, 5, 1)):
        cols, rows = vocab_block(n, v, c)
        assert 1 <= cols <= v and 1 <= rows <= n and (cols * rows <= c * v or cols == v)


def _wave_time(n, vocab, cols, sms, d, bm, bn):
    """Lean's block GEMMs' time in tile-K steps, launch by launch (one program per SM, static
    tile order: a launch lasts as long as its most loaded program)."""
    time = 0
    for start in range(0, vocab, cols):
        size = min(cols, vocab - start)
        for tiles, k in ((math.ceil(n / bm) * math.ceil(size / bn), d),
                         (math.ceil(size / bm) * math.ceil(d / bn), n)):
            time += math.ceil(tiles / sms) * k
    return time


def _wave_use(n, vocab, cols, sms, d, bm, bn):
    """The share of the SMs' time that does useful tile work."""
    useful = (n * vocab * d + vocab * d * n) / (bm * bn)
    return useful / (sms * _wave_time(n, vocab, cols, sms, d, bm, bn))


def test_lean_blocks_fill_whole_waves():
    """On a GPU with TMA (`waves` given) lean's blocks are sized for whole waves of the
    persistent block GEMMs: a multiple of the tile's columns, within WAVE_STRETCH of the
    budget, taking no longer than the budget's columns would (checked with a plain
    simulation of the launches). H100 (132 SMs), N=8192, D=4096: 8448 columns at V=128256
    and V=151936, where the budget's 8064 left ~5% idle (on an H100 these blocks alone took
    lean CE from 1.49x to 1.44x the three matmuls and lean RL from 1.50x to 1.45x,
    benchmarks/NOTES.md)."""
    from jax_fusedloss.kernels.linear_ce import (MIN_BLOCK_COLS, WAVE_STRETCH, budget_rows,
                                                 vocab_block)

    waves = (132, 4096, 128, 256)
    assert vocab_block(8192, 128256, budget_rows(128256, 2), waves) == (8448, 8192)
    assert vocab_block(8192, 151936, budget_rows(151936, 2), waves) == (8448, 8192)
    assert _wave_use(8192, 128256, 8064, *waves) < 0.96
    assert _wave_use(8192, 128256, 8448, *waves) > 0.997
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 40000))
        vocab = int(rng.integers(1000, 300000))
        d = int(rng.choice([512, 2304, 4096, 8192]))
        w = (int(rng.choice([78, 114, 132])), d, 128, 256)
        chunk = budget_rows(vocab, 2)
        plain, rows = vocab_block(n, vocab, chunk)
        cols, wrows = vocab_block(n, vocab, chunk, w)
        assert wrows == rows
        if plain == vocab or rows < n:  # one block, or row chunks: as without waves
            assert cols == plain
            continue
        budget = chunk * vocab // n
        assert cols % 256 == 0 and MIN_BLOCK_COLS <= cols <= budget * WAVE_STRETCH
        assert _wave_time(n, vocab, cols, *w) <= _wave_time(n, vocab, plain, *w), \
            (n, vocab, w, cols, plain)


# ----------------------------------------------------------------------------- in place
def test_in_place_plans_alias_the_logits():
    """in_place makes the launch that writes the gradient alias input 0 ("x"): the row kernel
    (output 3, "grad") and the split path's gradient launch (output 0); nothing otherwise."""
    from jax_fusedloss.kernels import cross_entropy as k

    opts = dict(ignore_index=-100, smoothing=0.0, z_loss=0.0, softcap=None)
    for sms, alias in ((1, ((0, 3),)), (64, ((0, 0),))):  # rows, split
        plan = k.ce_fwd_plan(8, 40000, num_sms=sms, write_grad=True, in_place=True, itemsize=2,
                             **opts)
        assert [step.aliases for step in plan.launches] == [()] * (len(plan.launches) - 1) + [
            alias], f"num_sms={sms}"
        gradient = plan.launches[-1]
        assert gradient.inputs[0] == "x" and gradient.outputs[alias[0][1]].name == "grad"
        for off in (dict(write_grad=True), dict(write_grad=False, in_place=True)):
            plan = k.ce_fwd_plan(8, 40000, num_sms=sms, itemsize=2, **opts, **off)
            assert all(step.aliases == () for step in plan.launches), (sms, off)
    assert k.ce_bwd_plan(8, 40000, softcap=None, num_sms=64,
                         in_place=True).launches[0].aliases == ((0, 0),)
    assert k.ce_bwd_plan(8, 40000, softcap=None, num_sms=64).launches[0].aliases == ()


def _spy_aliases(monkeypatch):
    """Records the input_output_aliases of every Triton launch from JAX."""
    from jax_fusedloss import _triton_jax

    seen, launch = [], _triton_jax.launch

    def spy(kernel, **kw):
        if kw.get("input_output_aliases"):
            seen.append((getattr(kernel, "__name__", None) or kernel.fn.__name__,
                         dict(kw["input_output_aliases"])))
        return launch(kernel, **kw)

    monkeypatch.setattr(_triton_jax, "launch", spy)
    return seen


# (path, layout, reduction, chunk) on 1 SM: chunks of 2 rows take the row path (V=17000: two
# gradient tiles per row; the 1-row tail splits), chunks of 1 row the split path (5 slices);
# "none" recomputes the logits in the backward (ce_bwd_plan in place).
IN_PLACE_CASES = [("rows", "dv", "mean", 2), ("rows", "vd", "none", 2),
                  ("split", "vd", "mean", 1), ("split", "dv", "none", 1)]


@pytest.mark.parametrize("path, layout, reduction, chunk", IN_PLACE_CASES)
def test_in_place_equals_out_of_place(monkeypatch, path, layout, reduction, chunk):
    """The gradient written over each chunk's logits (the default) gives the same loss, dH,
    dW and db as a separate gradient buffer, bit for bit, and both match float64 autodiff:
    JAX "triton" (the interpreter writes in place like the GPU) and torch_ref, row and split
    paths, both layouts, gradients in the forward ("mean") and recomputed ("none")."""
    from jax_fusedloss import _triton_jax
    import torch_ref._launch

    monkeypatch.setattr(_triton_jax, "num_sms", lambda: 1)
    monkeypatch.setattr(torch_ref._launch, "num_sms", lambda t: 1)
    vocab, n = 17000, 5
    k = jax.random.split(jax.random.key(5), 3)
    h = jax.random.normal(k[0], (n, D), jnp.float32)
    w = jax.random.normal(k[1], (D, vocab) if layout == "dv" else (vocab, D), jnp.float32) * 0.4
    b = jax.random.normal(k[2], (vocab,), jnp.float32)
    y = jnp.asarray(np.random.default_rng(5).integers(0, vocab, n), jnp.int32).at[2].set(-100)
    wl, _ = objective_weights(5, (n,), reduction, False)
    o = dict(weight_layout=layout, reduction=reduction, chunk_size=chunk, z_loss=1e-3)
    args = (h, w, b, y, wl, None)
    seen = _spy_aliases(monkeypatch)
    results = {}
    for flag in (True, False):
        monkeypatch.setattr(lce_jax, "_IN_PLACE", flag)
        monkeypatch.setattr(lce_torch, "_IN_PLACE", flag)
        seen.clear()
        results["jax", flag] = run_jax("triton", *args, **o)
        assert bool(seen) == flag, f"in_place={flag}: launch aliases {seen}"
        results["torch", flag] = run_torch(*args, fn=torch_ref.linear_cross_entropy, **o)
    want = ref_jax(*args, **o)
    for fw in ("jax", "torch"):
        got, base = results[fw, True], results[fw, False]
        assert_close(got[0], base[0], what=f"{fw} loss in place vs not")
        for g, g0, name in zip(got[2], base[2], ("dh", "dw", "db")):
            assert_close(g, g0, what=f"{fw} {name} in place vs not")
        _compare(got, want, 2e-5, 2e-5, f"{fw} in place {path}")


def test_public_cross_entropy_never_aliases_the_callers_logits(monkeypatch):
    """Only linear_cross_entropy's chunks are overwritten: cross_entropy (whose logits belong
    to the caller, and XLA would copy them to alias them) launches without aliases, also in
    the recompute backward of return_lse."""
    seen = _spy_aliases(monkeypatch)
    x = jax.random.normal(jax.random.key(0), (6, V), jnp.float32)
    y = jnp.arange(6, dtype=jnp.int32)
    for lse in (False, True):
        def f(x, lse=lse):
            out = jax_fusedloss.cross_entropy(x, y, return_lse=lse, implementation="triton")
            return jnp.sum(out[0] + 0.5 * out[1]) if lse else out

        jax.jit(jax.grad(f))(x)
    assert all(name == "scale_rows_kernel" for name, _ in seen), seen  # grad rescaled in place


@pytest.mark.parametrize("bad, match", [
    (dict(weight_layout="dd"), "weight_layout"),
    (dict(weight=np.zeros((V, D), np.float32)), r"weight.shape"),
    (dict(weight=jnp.zeros((D, V), jnp.bfloat16)), r"weight.dtype"),
    (dict(bias=jnp.zeros((V + 1,), jnp.float32)), r"bias.shape"),
    (dict(labels=jnp.zeros((20,), jnp.int32)), r"labels.shape"),
    (dict(labels=jnp.zeros((21,), jnp.float32)), r"labels.dtype"),
    (dict(hidden=jnp.zeros((21, D), jnp.int32)), r"hidden.dtype"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.5), "chunk_size"),
    (dict(reduction="avg"), "reduction"),
    (dict(label_smoothing=1.5), "label_smoothing"),
    (dict(mode="bf16"), "mode"),
    (dict(return_lse="no"), "return_lse"),
])
def test_validation_names_the_argument(bad, match):
    h, w, b, y = make_inputs(0, (21,), "dv", True)
    kw = dict(hidden=h, weight=w, labels=y, bias=b)
    kw.update(bad)
    args = [kw.pop(k) for k in ("hidden", "weight", "labels")]
    with pytest.raises((TypeError, ValueError), match=match):
        jax_fusedloss.linear_cross_entropy(*args, **kw)


def test_empty_batch():
    h = jnp.zeros((0, D), jnp.float32)
    w = jnp.ones((D, V), jnp.float32)
    y = jnp.zeros((0,), jnp.int32)
    loss, (dh, dw) = jax.value_and_grad(
        lambda h, w: jax_fusedloss.linear_cross_entropy(h, w, y), (0, 1))(h, w)
    assert float(loss) == 0.0 and dh.shape == (0, D) and not np.any(np.asarray(dw))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("mode", ["fast", "low_precision", "lean", "lean-none"])
def test_gpu_real_size_and_memory(mode, layout):
    """Every mode at a real size (compiled kernels, N=4096, D=4096, V=128256, bf16): loss,
    dH and every column of dW against float32 logits autodiff, and XLA's temporaries within
    the mode's budget: one chunk's logits (overwritten by their gradient) plus, for "fast",
    the float32 dW accumulator; for "lean" the block's logits plus dH's float32 accumulator;
    never a weight-sized bf16 copy beyond the returned gradient. "lean-none": per-token
    losses under mixed-sign per-token cotangents (dH from the forward, rows scaled)."""
    per_token = mode == "lean-none"
    mode = "lean" if per_token else mode
    n, d, vocab = 4096, 4096, 128256
    k = jax.random.split(jax.random.key(0), 4)
    h = (jax.random.normal(k[0], (n, d), jnp.float32)).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (d, vocab), jnp.float32) * 0.02).astype(jnp.bfloat16)
    if layout == "vd":
        w = w.T.copy()
    y = jax.random.randint(k[2], (n,), 0, vocab).at[::7].set(-100)
    cot = jax.random.normal(k[3], (n,)) if per_token else None

    def ours(h, w):
        if per_token:
            return jnp.sum(cot * jax_fusedloss.linear_cross_entropy(
                h, w, y, mode=mode, weight_layout=layout, reduction="none"))
        return jax_fusedloss.linear_cross_entropy(h, w, y, mode=mode, weight_layout=layout)

    def naive(h, w):
        if per_token:
            return jnp.sum(cot * lce_reference_jax(h, w, y, weight_layout=layout,
                                                   reduction="none")[0])
        return lce_reference_jax(h, w, y, weight_layout=layout)[0]

    fused = jax.jit(jax.value_and_grad(ours, (0, 1)))
    loss, (dh, dw) = fused(h, w)
    rloss, (rdh, rdw) = jax.jit(jax.value_and_grad(
        lambda h, w: naive(h.astype(jnp.float32), w.astype(jnp.float32)), (0, 1)))(h, w)
    assert_close(loss, rloss, rtol=2e-3, what="loss")
    for g, rg, name in ((dh, rdh, "dh"), (dw, rdw, "dw")):
        scale = float(jnp.max(jnp.abs(rg)))
        assert_close(g, rg, atol=3e-2 * scale, rtol=3e-2, what=name)
    # every column of dW (the classic place for a silent error), by vocabulary block
    cols = (dw.astype(jnp.float32) - rdw) if layout == "dv" else (dw.astype(jnp.float32) - rdw).T
    col_err = jnp.max(jnp.abs(cols), axis=0)
    assert float(jnp.max(col_err)) <= 3e-2 * float(jnp.max(jnp.abs(rdw))) + 1e-6
    temp = fused.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    chunk = default_chunk_size(n, vocab, d, jnp.bfloat16, mode)
    budget = chunk * vocab * 2 + (128 << 20)
    if mode == "fast":
        budget += d * vocab * 4
    if mode == "lean":  # the backward: a block of logits, the weight's block and dW's (XLA
        # copies a dynamic slice out for the GEMM, and the GEMM's dW block in), dH's float32 sum
        cols = _lm_head.head_options(n, vocab, jnp.bfloat16, layout, mode, None, d).block
        budget = max(budget, (n * cols * 2 + 2 * d * cols * 2 + n * d * 4) + (128 << 20))
    assert temp <= budget, f"{mode}: temp {temp / 2**30:.3f} GiB > {budget / 2**30:.3f} GiB"
    if mode != "fast":
        assert temp < d * vocab * 2, f"{mode}: temporaries {temp / 2**30:.3f} GiB hold a dW"


@pytest.mark.gpu
def test_gpu_in_place_gradient_saves_one_chunk_of_logits(monkeypatch):
    """XLA's buffer assignment with the chunk's gradient aliasing its logits (the default)
    needs less temporary memory, most of one [C, V] buffer, than with a separate gradient
    buffer (compiled only)."""
    n, d, vocab, chunk = 4096, 4096, 128256, 512
    h = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d, vocab), jnp.bfloat16)
    y = jnp.zeros((n,), jnp.int32)
    temps = {}
    for flag in (True, False):
        monkeypatch.setattr(lce_jax, "_IN_PLACE", flag)
        fused = jax.jit(jax.value_and_grad(lambda h, w: jax_fusedloss.linear_cross_entropy(
            h, w, y, chunk_size=chunk, mode="low_precision"), (0, 1)))
        temps[flag] = fused.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    saved = temps[False] - temps[True]
    # H100 (jax 0.11.2): 77 of the chunk's 125 MiB saved; XLA's buffer assignment already
    # shares part of the separate gradient buffer with other temporaries.
    assert saved >= 0.5 * chunk * vocab * 2, (
        f"in place saves {saved / 2**20:.0f} MiB of temporaries ({temps[True] / 2**20:.0f} vs "
        f"{temps[False] / 2**20:.0f} MiB); one chunk's logits are {chunk * vocab * 2 / 2**20:.0f}")
    assert temps[True] <= chunk * vocab * 2 + (64 << 20), temps


def test_statistics_only_forward_takes_short_chunks():
    """A forward that keeps statistics only (rollout scoring, the recompute modes' forward)
    updates no dW per chunk, so its default chunk is "low_precision"'s (192 MiB of 16-bit
    logits) whatever the mode: 640 rows at V=151936, not "fast"'s 4096; a given chunk_size
    sizes every walk."""

    for mode in ("fast", "low_precision", "lean"):
        o = _lm_head.head_options(8192, 151936, jnp.bfloat16, "dv", mode, None)
        assert o.stats_chunk == 640 and o.chunk == {"fast": 4096, "low_precision": 640,
                                                    "lean": 1024}[mode], o
        assert _lm_head.head_options(8192, 151936, jnp.bfloat16, "dv", mode, 300).stats_chunk \
            == 300
    assert _lm_head.head_options(100, 151936, jnp.bfloat16, "dv", "fast", None).stats_chunk \
        == 100
