"""torch_ref's options that follow the JAX API (issues 29 and 30): per-token `weights` / `where`
/ `num_items` of cross_entropy and linear_cross_entropy (weights of mixed sign, zeros and
all-zero), `tail` / `divergence="jsd"` / `weights` / `where` of kd_loss and distill_loss,
mode="lean" and the tail forms of the linear KD losses, and the lean walk's block sizes (one
rule for every linear frontend, as jax_fusedloss._lm_head.head_options). Each against a float64
formula (jax.vjp inside jax_ref.x64) and the JAX function."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss
from tests import test_kd_tail, test_linear_kd, test_weights
from tests.helpers import assert_close
from tests.reference import jax_ref
from tests.reference import kd_tail_ref as kd_ref

torch = pytest.importorskip("torch")
torch_ref = pytest.importorskip("torch_ref")


@pytest.fixture(autouse=True)
def _full_precision_fp32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _t(a):
    return None if a is None else torch.from_numpy(np.array(a))


def _torch_vjp(fn, args, cot):
    ts = [_t(a).requires_grad_(True) for a in args]
    out = fn(*ts)
    c = torch.as_tensor(np.broadcast_to(np.asarray(cot, np.float32), out.shape).copy())
    return out.detach().numpy(), [g.numpy() for g in torch.autograd.grad(out, ts, c)]


def _jax_vjp(fn, args, cot, x64=False):
    if x64:
        with jax_ref.x64():
            return _jax_vjp(fn, [jnp.asarray(np.asarray(a), jnp.float64) for a in args], cot)
    out, vjp = jax.vjp(fn, *args)
    grads = vjp(jnp.broadcast_to(jnp.asarray(cot, out.dtype), out.shape))
    return np.asarray(out), [np.asarray(g) for g in grads]


def _compare(got, want, what, rtol=2e-5):
    assert_close(got[0], want[0], rtol=rtol, atol=2e-6, what=f"{what} loss")
    for g, r in zip(got[1], want[1]):
        assert_close(g, r, rtol=rtol, atol=rtol * max(np.abs(r).max(), 1e-30),
                     what=f"{what} grad")


# ----------------------------------------------------------------------------- weights (CE)
CE_CASES = [("mixed", "mean", False, None), ("mixed", "none", True, None),
            ("zeros", "sum", True, None), ("all_zero", "mean", False, None),
            ("none", "mean", True, 40)]
CE_FNS = [("cross_entropy", None, CE_CASES),
          ("linear_cross_entropy", "fast", CE_CASES[:3:2] + CE_CASES[4:]),
          ("linear_cross_entropy", "lean", CE_CASES[1:4:2])]


@pytest.mark.parametrize("fn, mode, kind, reduction, use_where, num_items", [
    (fn, mode) + case for fn, mode, cases in CE_FNS for case in cases])
def test_ce_weights_match_float64_and_jax(interpreter, fn, mode, kind, reduction, use_where,
                                         num_items):
    h, w, y, weights, where = test_weights.inputs(7, kind)
    where = where if use_where else None
    n = y.shape[0]
    cot = np.random.default_rng(1).normal(size=n) if reduction == "none" else 1.7
    opts = dict(reduction=reduction, num_items=num_items)
    if fn == "cross_entropy":
        args = (h @ w,)

        def ours(x):
            return torch_ref.cross_entropy(x, _t(y).long(), weights=_t(weights),
                                           where=_t(where), **opts)

        def theirs(x):
            return jax_fusedloss.cross_entropy(x, y, weights=weights, where=where,
                                               implementation="xla", **opts)

        def ref(x):
            per = jax_ref.cross_entropy(x, y, reduction="none")
            return test_weights.weighted_reference(per, y, weights, where, reduction, num_items)
    else:
        args = (h, w)

        def ours(h, w):
            return torch_ref.linear_cross_entropy(h, w, _t(y).long(), weights=_t(weights),
                                                  where=_t(where), mode=mode, chunk_size=4,
                                                  **opts)

        def theirs(h, w):
            return jax_fusedloss.linear_cross_entropy(h, w, y, weights=weights, where=where,
                                                      mode=mode, implementation="xla", **opts)

        def ref(h, w):
            per = jax_ref.linear_cross_entropy(h, w, y, reduction="none")
            return test_weights.weighted_reference(per, y, weights, where, reduction, num_items)

    got = _torch_vjp(ours, args, cot)
    what = f"torch_ref {fn} {mode} {kind} {reduction}"
    _compare(got, _jax_vjp(ref, args, cot, x64=True), f"{what} vs float64")
    _compare(got, _jax_vjp(theirs, args, cot), f"{what} vs JAX", rtol=1e-5)


def test_weights_get_no_gradient_zero_weight_keeps_nan_and_check_labels(interpreter):
    h, w, y, weights, _ = test_weights.inputs(5, "mixed")
    x = _t(h @ w).requires_grad_(True)
    wt = _t(weights).requires_grad_(True)
    yt = _t(y).long()
    torch_ref.cross_entropy(x, yt, weights=wt).backward()
    assert wt.grad is None and x.grad is not None, "weights are data: no gradient"
    bad = yt.clone()
    bad[0] = w.shape[1] + 1
    zero_w = _t(weights).clone()
    zero_w[0] = 0.0
    assert torch.isnan(torch_ref.cross_entropy(x, bad, weights=zero_w)), \
        "a weight of 0 does not hide an out-of-range label"
    keep = torch.arange(yt.numel()) != 0
    assert torch.isfinite(torch_ref.cross_entropy(x, bad, weights=zero_w, where=keep))
    for call in (lambda: torch_ref.cross_entropy(x, bad, check_labels=True),
                 lambda: torch_ref.linear_cross_entropy(_t(h), _t(w), bad, check_labels=True)):
        with pytest.raises(ValueError, match=r"labels\[0\]=.* outside \[0, 97\)"):
            call()


@pytest.mark.parametrize("kw, err, match", [
    (dict(weights=torch.ones(13, dtype=torch.int32)), TypeError, "weights.dtype"),
    (dict(weights=[1.0] * 13), TypeError, "weights must be"),
    (dict(weights=torch.ones(14)), ValueError, "weights.shape"),
    (dict(where=torch.ones(13)), TypeError, "where.dtype"),
    (dict(where=torch.ones(2, 13, dtype=torch.bool)), ValueError, "where.shape"),
    (dict(num_items=0), ValueError, "num_items"),
    (dict(num_items=4, reduction="sum"), ValueError, "num_items"),
    (dict(check_labels=1), TypeError, "check_labels"),
])
@pytest.mark.parametrize("fn", ["cross_entropy", "linear_cross_entropy"])
def test_weights_validation_names_the_argument(interpreter, fn, kw, err, match):
    h, w, y, _, _ = test_weights.inputs(6, "none")
    with pytest.raises(err, match=match):
        if fn == "cross_entropy":
            torch_ref.cross_entropy(_t(h @ w), _t(y).long(), **kw)
        else:
            torch_ref.linear_cross_entropy(_t(h), _t(w), _t(y).long(), **kw)


def test_every_jax_option_but_dispatch_is_in_torch_ref():
    """torch_ref's frontends take every keyword of their JAX twins except `implementation` and
    `vocab_axis` (JAX dispatch and shard_map; passing them is Python's TypeError naming them);
    and token_logprobs' check_labels works."""
    import inspect

    for name in torch_ref.__all__:
        ours = set(inspect.signature(getattr(torch_ref, name)).parameters)
        theirs = set(inspect.signature(getattr(jax_fusedloss, name)).parameters)
        assert theirs - ours == {"implementation", "vocab_axis"}, (name, theirs - ours)
        assert ours <= theirs, (name, ours - theirs)
    with pytest.raises(ValueError, match=r"labels\[1\]=9 lies outside \[0, 5\):"):
        torch_ref.token_logprobs(torch.zeros(2, 5), torch.tensor([0, 9]), check_labels=True)


# ----------------------------------------------------------------------------- walk sizes
@pytest.mark.parametrize("n, vocab, dtype, mode, chunk_size", [
    (8192, 128256, "bfloat16", "lean", None), (8192, 151936, "float32", "fast", None),
    (300, 50257, "float16", "low_precision", None), (7, 300, "float32", "lean", 2),
    (5000, 32000, "bfloat16", "lean", 4096)])
def test_head_sizes_follow_jax(n, vocab, dtype, mode, chunk_size):
    """Every torch_ref linear frontend sizes its walks by head_sizes, the rule of
    jax_fusedloss._lm_head.head_options (the lean blocks keep the 128 MiB budget)."""
    from jax_fusedloss import _lm_head
    from jax_fusedloss.kernels.linear_ce import vocab_block
    from torch_ref.linear_cross_entropy import head_sizes

    chunk, block_chunk = head_sizes(n, vocab, getattr(torch, dtype), mode, chunk_size)
    want = _lm_head.head_options(n, vocab, jnp.dtype(dtype), "dv", mode, chunk_size)
    assert (chunk, *vocab_block(n, vocab, block_chunk)) == (want.chunk, want.block,
                                                             want.block_rows)


def test_lean_logprobs_blocks_keep_the_budget(interpreter, monkeypatch):
    """linear_token_logprobs' lean backward asks vocab_block for the budget's rows, not the
    token chunk's (the gap of issue 29's first torch_ref version)."""
    import sys

    from jax_fusedloss.kernels.linear_ce import budget_rows

    lce = sys.modules["torch_ref.linear_cross_entropy"]

    seen = []
    real = lce.vocab_block
    monkeypatch.setattr(lce, "vocab_block", lambda n, v, c: seen.append(c) or real(n, v, c))
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(8, 50, requires_grad=True)
    torch_ref.linear_token_logprobs(h, w, torch.randint(0, 50, (6,)), mode="lean").sum().backward()
    assert seen == [budget_rows(50, 4)]


# ----------------------------------------------------------------------------- KD on logits
KD_CASES = {
    "kd-tail-kl-weights": ("kd", dict(tail=True, weighted=True)),
    "kd-jsd-where-none": ("kd", dict(tail=True, divergence="jsd", beta=0.3, reduction="none",
                                     use_where=True)),
    "distill-jsd-options": ("distill", dict(alpha=0.4, tail=True, divergence="jsd",
                                            temperature=2.0, label_smoothing=0.1, z_loss=1e-3,
                                            logit_softcap=5.0, weighted=True)),
    "distill-notail-weights-where": ("distill", dict(alpha=0.5, weighted=True, use_where=True,
                                                     num_items=9)),
}


@pytest.mark.parametrize("name", KD_CASES)
def test_kd_options_match_float64_and_jax(interpreter, name):
    fn, opts = KD_CASES[name]
    opts = dict(opts)
    x, y, ids, lp, mask, wt = test_kd_tail.make_inputs(3)
    n = x.shape[0]
    weights = wt if opts.pop("weighted", False) else None
    where = (jnp.arange(n) % 3 != 1) if opts.pop("use_where", False) else None
    cot = np.linspace(-1.0, 2.0, n) if opts.get("reduction") == "none" else 1.3

    def ours(x):
        kw = dict(opts, weights=_t(weights), where=_t(where))
        if fn == "kd":
            return torch_ref.kd_loss(x, _t(ids), _t(lp), _t(mask), **kw)
        return torch_ref.distill_loss(x, _t(y).long(), _t(ids), _t(lp), _t(mask), **kw)

    def theirs(x):
        kw = dict(opts, weights=weights, where=where)
        if fn == "kd":
            return jax_fusedloss.kd_loss(x, ids, lp, mask, implementation="xla", **kw)
        return jax_fusedloss.distill_loss(x, y, ids, lp, mask, implementation="xla", **kw)

    def ref(x):
        kw = dict(opts, where=where,
                  weights=None if weights is None else jnp.asarray(np.asarray(weights), x.dtype))
        lp64 = jnp.asarray(np.asarray(lp), x.dtype)
        if fn == "kd":
            return kd_ref.kd_loss(x, ids, lp64, mask, **kw)
        return kd_ref.distill_loss(x, y, ids, lp64, mask, **kw)

    got = _torch_vjp(ours, (x,), cot)
    _compare(got, _jax_vjp(ref, (x,), cot, x64=True), f"torch_ref {name} vs float64")
    _compare(got, _jax_vjp(theirs, (x,), cot), f"torch_ref {name} vs JAX", rtol=1e-5)


# ----------------------------------------------------------------------------- linear KD
LINEAR_CASES = [("kd", "lean", dict(temperature=2.0, weighted=True)),
                ("kd", "lean", dict(tail=True, divergence="jsd", beta=0.3, reduction="none")),
                ("distill", "lean", dict(alpha=0.4, tail=True, logit_softcap=5.0,
                                         label_smoothing=0.1, weighted=True, num_items=9)),
                ("distill", "low_precision", dict(alpha=0.6, tail=True, divergence="jsd",
                                                  z_loss=1e-3, reduction="none"))]


@pytest.mark.parametrize("fn, mode, opts", LINEAR_CASES)
def test_linear_kd_modes_and_tail_match_float64_and_jax(interpreter, fn, mode, opts):
    """V=300 with chunk_size=2: the lean backward walks three blocks of 128 columns in row
    chunks of four tokens."""
    inputs = test_linear_kd.make_inputs(seed=4)
    h, w, b, y, ids, lp, mask, wt = inputs
    opts = dict(opts)
    weighted = opts.pop("weighted", False)

    def ours(h, w, b):
        kw = dict(opts, weights=_t(wt) if weighted else None, mode=mode, chunk_size=2)
        if fn == "kd":
            out = torch_ref.linear_kd_loss(h, w, _t(ids), _t(lp), _t(mask), bias=b, **kw)
        else:
            out = torch_ref.linear_distill_loss(h, w, _t(y).long(), _t(ids), _t(lp), _t(mask),
                                                bias=b, **kw)
        return (out * torch.arange(1, out.numel() + 1).reshape(out.shape)).sum()

    got = _torch_vjp(ours, (h, w, b), 1.0)
    got = (got[0], got[1])
    what = f"torch_ref linear {fn} {mode} {opts}"
    test_linear_kd.compare(got, test_linear_kd.reference(fn, inputs, weighted=weighted, **opts),
                           2e-5, f"{what} vs float64")
    theirs = test_linear_kd.run(fn, "xla", inputs, weighted=weighted, mode=mode, **opts)
    test_linear_kd.compare(got, theirs, 1e-5, f"{what} vs JAX")


@pytest.mark.parametrize("kw, err, match", [
    (dict(divergence="jsd"), ValueError, "requires tail=True"),
    (dict(tail=True, normalize="topk"), ValueError, "requires normalize"),
    (dict(tail=True, divergence="jsd", beta=1.0), ValueError, "beta"),
    (dict(divergence="js"), ValueError, "divergence"),
    (dict(weights=torch.ones(3)), ValueError, "weights.shape"),
    (dict(where=torch.ones(7)), TypeError, "where.dtype"),
    (dict(mode="slow"), ValueError, "mode"),
])
def test_kd_validation_names_the_argument(interpreter, kw, err, match):
    h, w, b, y, ids, lp, mask, wt = test_linear_kd.make_inputs(seed=5, n=7, vocab=40)
    logits_kw = {k: v for k, v in kw.items() if k != "mode"}
    with pytest.raises(err, match=match):
        torch_ref.linear_kd_loss(_t(h), _t(w), _t(ids), _t(lp), **kw)
    if logits_kw:
        with pytest.raises(err, match=match):
            torch_ref.distill_loss(_t(h @ w), _t(y).long(), _t(ids), _t(lp), alpha=0.5,
                                   **logits_kw)
