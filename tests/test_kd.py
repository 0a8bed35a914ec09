"""kd_loss and distill_loss: JAX "triton" (interpreter on CPU) and "xla", torch_ref, and the
plain-PyTorch formula at float64 agree on values and gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_fusedloss
import torch_ref
from tests.helpers import (VALUE_RTOL, assert_close, assert_grad_close, check_transformations,
                           force_path, random_logits, to_numpy, to_torch)

IMPLS = ["triton", "xla", "torch_ref"]
# The split path is a Triton launch choice: "xla" runs once.
IMPL_PATHS = [("triton", "rows"), ("triton", "split"), ("torch_ref", "rows"),
              ("torch_ref", "split"), ("xla", "rows")]
DTYPES = ["float32", "bfloat16", "float16"]
# (shape, K, normalize, temperature): V below one tile (37), prime V (5003: two forward
# tiles), V over several tiles of the gradient pass too, with a ragged tail (40009), leading
# dims [B, T, V], K from 1 to 128.
BIG_V = 40009
CASES = {
    "v37-k8-full": ((5, 37), 8, "full", 1.0),
    "v5003-k1-full-t2": ((3, 5003), 1, "full", 2.0),
    "v40009-k128-topk": ((2, BIG_V), 128, "topk", 0.7),
    "v40009-k64-full-t3": ((1, 2, BIG_V), 64, "full", 3.0),
}
DISTILL_CASES = {
    "v37-k8-full-t1": ((5, 37), 8, "full", 1.0),  # T = 1: the KD term shares the CE softmax
    "v5003-k16-topk-t2": ((3, 5003), 16, "topk", 2.0),
    "v40009-k64-full-t2": ((1, 2, BIG_V), 64, "full", 2.0),
}


def make_labels(seed, shape, vocab, frac_ignored=0.3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, vocab, size=shape)
    y[rng.random(shape) < frac_ignored] = -100
    return jnp.asarray(y, jnp.int32)


def make_teacher(seed, lead, vocab, k, mask_frac=0.2, dtype=jnp.float32):
    """A teacher's top-k (ids int32, log-probs) of random logits, and a random bool mask."""
    key = jax.random.key(seed)
    logits = jax.random.normal(key, lead + (vocab,)) * 3.0
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(logits), k)
    rng = np.random.default_rng(seed)
    mask = jnp.asarray(rng.random(lead + (k,)) >= mask_frac)
    return ids.astype(jnp.int32), lp.astype(dtype), mask


def _jax_fn(fn):
    return jax_fusedloss.kd_loss if fn == "kd" else jax_fusedloss.distill_loss


def _args(fn, labels, ids, lp, mask):
    return (ids, lp, mask) if fn == "kd" else (labels, ids, lp, mask)


def _torch_args(fn, labels, ids, lp, mask):
    return [None if a is None else torch.from_dlpack(a) for a in _args(fn, labels, ids, lp, mask)]


def run(impl, fn, logits, labels, ids, lp, mask, weights=None, grad=True, **opts):
    """(loss, gradient of sum(weights * loss) w.r.t. the student logits); with grad=False the
    loss alone, outside differentiation (the kernels then skip the gradient write)."""
    if impl == "torch_ref":
        x = to_torch(logits).requires_grad_(grad)
        f = torch_ref.kd_loss if fn == "kd" else torch_ref.distill_loss
        loss = f(x, *_torch_args(fn, labels, ids, lp, mask), **opts)
        if grad:
            (loss * (1.0 if weights is None else to_torch(weights))).sum().backward()
        return loss.detach(), x.grad

    def f(x):
        return _jax_fn(fn)(x, *_args(fn, labels, ids, lp, mask), implementation=impl, **opts)

    if not grad:
        return jax.jit(f)(logits), None
    w = 1.0 if weights is None else weights
    (_, loss), g = jax.jit(jax.value_and_grad(lambda x: (jnp.sum(f(x) * w), f(x)),
                                              has_aux=True))(logits)
    return loss, g


def reference(fn, logits, labels, ids, lp, mask, weights=None, **opts):
    """float64 plain-PyTorch loss and its torch.autograd gradient."""
    x = to_torch(logits).to(torch.float64).requires_grad_(True)
    if opts.get("num_items") is not None:
        opts["num_items"] = float(opts["num_items"])
    targs = _torch_args(fn, labels, ids, lp, mask)
    if fn == "kd":
        loss = torch_ref.kd_loss_reference(x, *targs, dtype=torch.float64, **opts)
    else:
        targs[0] = targs[0].long()
        loss = torch_ref.distill_loss_reference(x, *targs, dtype=torch.float64, **opts)
    w = to_torch(weights).to(torch.float64) if weights is not None else 1.0
    (loss * w).sum().backward()
    return loss.detach(), x.grad


def check(impl, fn, dtype, shape, k, seed=0, scale=2.0, reduction="mean", mask_frac=0.2,
          teacher=None, labels=None, forward=False, **opts):
    """Loss and gradient (and with `forward` the loss outside differentiation) against the
    float64 reference; returns (loss, grad) as numpy."""
    logits = random_logits(seed, shape, dtype, scale)
    lead, vocab = shape[:-1], shape[-1]
    ids, lp, mask = teacher if teacher is not None else make_teacher(seed + 1, lead, vocab, k,
                                                                     mask_frac)
    if labels is None and fn == "distill":
        labels = make_labels(seed + 2, lead, vocab, frac_ignored=0.3)
    w = jax.random.uniform(jax.random.key(seed + 3), lead) if reduction == "none" else None
    loss, grad = run(impl, fn, logits, labels, ids, lp, mask, w, reduction=reduction, **opts)
    rloss, rgrad = reference(fn, logits, labels, ids, lp, mask, w, reduction=reduction, **opts)
    assert_close(loss, rloss, rtol=VALUE_RTOL[dtype], atol=1e-5, what=f"{impl} {fn} loss")
    if forward:
        plain, _ = run(impl, fn, logits, labels, ids, lp, mask, grad=False, reduction=reduction,
                       **opts)
        assert_close(plain, rloss, rtol=VALUE_RTOL[dtype], atol=1e-5,
                     what=f"{impl} {fn} loss, forward only")
    assert to_numpy(grad).shape == logits.shape
    assert str(grad.dtype).split(".")[-1] == dtype, f"grad dtype {grad.dtype} != {dtype}"
    assert_grad_close(grad, rgrad, dtype, what=f"{impl} {fn} grad")
    return to_numpy(loss), to_numpy(grad)


def test_grid_covers_both_paths_and_several_tiles():
    """The launch heuristic gives the big case several tiles in both passes, and the forced
    paths below are what they claim (guards the grid against a retuned heuristic)."""
    from jax_fusedloss.kernels.launch import row_config

    for write_grad in (False, True):
        rows = row_config(2, BIG_V, 1, write_grad)
        split = row_config(2, BIG_V, 64, write_grad)
        assert rows.num_splits == 1 and rows.block_v < BIG_V, rows
        assert split.num_splits > 1, split


@pytest.mark.parametrize("impl,path_name", IMPL_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_kd_grid(impl, path_name, dtype, case, monkeypatch, interpreter):
    force_path(path_name, monkeypatch)
    shape, k, normalize, t = CASES[case]
    check(impl, "kd", dtype, shape, k, normalize=normalize, temperature=t, forward=True)


@pytest.mark.parametrize("impl,path_name", IMPL_PATHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # float16: the kd grid
@pytest.mark.parametrize("case", list(DISTILL_CASES))
def test_distill_grid(impl, path_name, dtype, case, monkeypatch, interpreter):
    force_path(path_name, monkeypatch)
    shape, k, normalize, t = DISTILL_CASES[case]
    check(impl, "distill", dtype, shape, k, normalize=normalize, temperature=t, alpha=0.3,
          forward=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", ["kd", "distill"])
@pytest.mark.parametrize("reduction,normalize", [("mean", "full"), ("sum", "topk"),
                                                 ("none", "full"), ("none", "topk")])
def test_reductions(impl, fn, reduction, normalize, interpreter):
    extra = dict(alpha=0.6, temperature_squared=True) if fn == "distill" else {}
    check(impl, fn, "float32", (6, 301), 16, seed=3, reduction=reduction, normalize=normalize,
          temperature=1.5, mask_frac=0.4, **extra)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", ["kd", "distill"])
@pytest.mark.parametrize("num_items", [7, "array"])
def test_num_items(impl, fn, num_items, interpreter):
    """num_items replaces the "mean" denominator (gradient accumulation over micro-batches)."""
    if num_items == "array":
        num_items = jnp.asarray(11.0) if impl != "torch_ref" else torch.tensor(11.0)
    extra = dict(alpha=0.4) if fn == "distill" else {}
    loss, _ = check(impl, fn, "float32", (5, 211), 8, seed=5, num_items=num_items, **extra)
    denom = float(num_items)
    total, _ = check(impl, fn, "float32", (5, 211), 8, seed=5, reduction="sum", **extra)
    assert_close(loss, total / denom, rtol=1e-6, what="mean == sum / num_items")


@pytest.mark.parametrize("impl,path_name", IMPL_PATHS)
@pytest.mark.parametrize("normalize", ["full", "topk"])
@pytest.mark.parametrize("fn", ["kd", "distill"])
def test_repeated_ids_count_per_entry(impl, path_name, normalize, fn, monkeypatch, interpreter):
    """An id listed several times in a row counts once per entry; its gradient column sums
    the entries' contributions (autograd of the gather formula); entries sharing an id with
    the label also carry the cross-entropy term."""
    force_path(path_name, monkeypatch)
    vocab, k = 700, 8
    ids, lp, mask = make_teacher(21, (4,), vocab, k, mask_frac=0.0)
    ids = ids.at[0, 3].set(ids[0, 1]).at[0, 5].set(ids[0, 1])  # an id three times
    ids = ids.at[1, 7].set(ids[1, 0]).at[2].set(ids[2, 0])  # twice; a whole row of one id
    mask = mask.at[1, 0].set(False)  # a masked duplicate does not count
    labels = make_labels(22, (4,), vocab, frac_ignored=0.0).at[0].set(ids[0, 1])
    extra = dict(alpha=0.5) if fn == "distill" else {}
    _, grad = check(impl, fn, "float32", (4, vocab), k, seed=23, teacher=(ids, lp, mask),
                    labels=labels, normalize=normalize, temperature=1.3, **extra)
    assert np.isfinite(grad).all()


@pytest.mark.parametrize("impl,path_name", IMPL_PATHS)
@pytest.mark.parametrize("fn", ["kd", "distill"])
def test_tokens_without_entries(impl, path_name, fn, monkeypatch, interpreter):
    """Tokens whose entries are all masked add 0 and get a zero gradient; with no counting
    token at all, "mean" is 0, not NaN."""
    force_path(path_name, monkeypatch)
    vocab, k = 517, 4
    ids, lp, mask = make_teacher(31, (3, 2), vocab, k)
    mask = mask.at[0, 1].set(False).at[2].set(False)
    extra = dict(alpha=0.0) if fn == "distill" else {}
    labels = make_labels(32, (3, 2), vocab, frac_ignored=0.0) if fn == "distill" else None
    loss, grad = check(impl, fn, "bfloat16", (3, 2, vocab), k, seed=33, teacher=(ids, lp, mask),
                       labels=labels, reduction="none", normalize="full", **extra)
    assert np.all(grad[0, 1] == 0) and np.all(grad[2] == 0)
    assert np.all(loss[0, 1] == 0) and np.all(loss[2] == 0)
    none = jnp.zeros_like(mask)
    loss, grad = check(impl, fn, "bfloat16", (3, 2, vocab), k, seed=33, teacher=(ids, lp, none),
                       labels=labels, reduction="mean", normalize="topk", **extra)
    assert np.all(loss == 0) and np.all(grad == 0)


@pytest.mark.parametrize("impl,path_name", IMPL_PATHS)
@pytest.mark.parametrize("normalize", ["full", "topk"])
def test_out_of_range_ids_count_as_masked(impl, path_name, normalize, monkeypatch,
                                          interpreter):
    """Ids outside [0, V) add nothing and are never used as an address."""
    force_path(path_name, monkeypatch)
    vocab, k = 300, 6
    ids, lp, mask = make_teacher(41, (4,), vocab, k, mask_frac=0.0)
    bad = ids.at[0, 2].set(vocab).at[1, 0].set(-1).at[1, 4].set(-7).at[3, 5].set(2**30)
    logits = random_logits(42, (4, vocab), "float32")
    got = run(impl, "kd", logits, None, bad, lp, mask, normalize=normalize, reduction="sum")
    masked = mask & (bad == ids)
    want = reference("kd", logits, None, ids, lp, masked, normalize=normalize, reduction="sum")
    assert_close(got[0], want[0], rtol=2e-5, what="loss")
    assert_grad_close(got[1], want[1], "float32")


def test_kernel_never_reads_out_of_bounds(path, interpreter):
    """The kernels' own guard: raw out-of-range ids (not remapped by a wrapper) in a buffer
    whose neighbouring rows are NaN give finite results equal to masking those entries."""
    from torch_ref.kd import _rows

    vocab, n = 300, 3
    big = torch.full((n + 2, vocab), float("nan"))
    big[1:-1] = torch.randn(n, vocab) * 2
    x = big[1:-1]
    ids, lp, mask = make_teacher(43, (n,), vocab, 4, mask_frac=0.0)
    raw = torch.from_dlpack(ids).clone()
    raw[0, 1], raw[2, 3], raw[1, 0] = -3, vocab + 2, -1
    row_scale = torch.tensor([[0.0, 1.0]] * n)
    y = torch.zeros(n, dtype=torch.int32)
    lpt = torch.from_dlpack(lp).clone()
    for normalize in ("full", "topk"):
        loss, grad = _rows(x, raw, lpt, y, row_scale, 1.0, normalize, False, -100, True)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        rloss, rgrad = reference("kd", jnp.asarray(x.numpy()), None, ids, lp,
                                 jnp.asarray((raw == torch.from_dlpack(ids)).numpy()),
                                 normalize=normalize, reduction="none")
        assert_close(loss, rloss, rtol=2e-5, atol=1e-6, what=f"{normalize} loss")
        assert_grad_close(grad, rgrad, "float32")


@pytest.mark.parametrize("impl", IMPLS)
def test_full_teacher_is_exact_kl(impl, interpreter):
    """K = V with "full" is the exact KL(teacher || softmax(x / T))."""
    vocab = 37
    logits = random_logits(51, (4, vocab), "float32")
    t_logp = jax.nn.log_softmax(jax.random.normal(jax.random.key(52), (4, vocab)))
    ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), (4, vocab))
    loss, _ = run(impl, "kd", logits, None, ids, t_logp, None, temperature=2.0,
                  reduction="none")
    kl = jnp.sum(jnp.exp(t_logp) * (t_logp - jax.nn.log_softmax(logits / 2.0)), axis=-1)
    assert_close(loss, kl, rtol=1e-5, atol=1e-6, what="exact KL")


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_distill_alpha_extremes_match_the_parts(impl, interpreter):
    """alpha = 1 is cross_entropy; alpha = 0 is kd_loss over the tokens with a label."""
    vocab = 401
    logits = random_logits(61, (5, vocab), "bfloat16")
    labels = make_labels(62, (5,), vocab)
    ids, lp, mask = make_teacher(63, (5,), vocab, 8)
    ce = jax.jit(jax.value_and_grad(lambda x: jax_fusedloss.cross_entropy(
        x, labels, implementation=impl)))
    d1 = jax.jit(jax.value_and_grad(lambda x: jax_fusedloss.distill_loss(
        x, labels, ids, lp, mask, alpha=1.0, implementation=impl)))
    kd = jax.jit(jax.value_and_grad(lambda x: jax_fusedloss.kd_loss(
        x, ids, lp, mask & (labels != -100)[:, None], temperature=2.0, implementation=impl)))
    d0 = jax.jit(jax.value_and_grad(lambda x: jax_fusedloss.distill_loss(
        x, labels, ids, lp, mask, alpha=0.0, temperature=2.0, implementation=impl)))
    for (a, ga), (b, gb), what in ((ce(logits), d1(logits), "alpha=1"),
                                   (kd(logits), d0(logits), "alpha=0")):
        assert_close(a, b, rtol=1e-6, what=what)
        assert_close(ga, gb, rtol=1e-2, atol=1e-6, what=f"{what} grad")


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_labels_are_nan_and_isolated(impl, interpreter):
    vocab = 260
    logits = random_logits(71, (4, vocab), "float32")
    labels = make_labels(72, (4,), vocab, frac_ignored=0.0).at[2].set(vocab)
    ids, lp, mask = make_teacher(73, (4,), vocab, 8)
    loss, grad = run(impl, "distill", logits, labels, ids, lp, mask, alpha=0.5,
                     reduction="none")
    loss, grad = to_numpy(loss), to_numpy(grad)
    assert np.isnan(loss[2]) and np.isnan(grad[2]).all()
    good = np.array([0, 1, 3])
    assert np.isfinite(loss[good]).all() and np.isfinite(grad[good]).all()


@pytest.mark.parametrize("impl", ["triton", "xla"])
def test_mask_and_logprob_dtypes_and_zero_teacher_cotangents(impl, interpreter):
    """A 0/1 float mask equals the bool mask; bf16 log-probs are used in float32; teacher
    inputs get zero gradients; a scaled loss takes the row-rescaling backward."""
    vocab = 333
    logits = random_logits(81, (6, vocab), "float32")
    ids, lp, mask = make_teacher(82, (6,), vocab, 8, dtype=jnp.bfloat16)
    f = lambda x, lp, m: 2.5 * jax_fusedloss.kd_loss(x, ids, lp, m, implementation=impl)
    val, (gx, glp) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(logits, lp, mask)
    val_f, gx_f = jax.jit(jax.value_and_grad(f))(logits, lp, mask.astype(jnp.float32))
    assert_close(val, val_f, rtol=0, what="float mask")
    assert_close(gx, gx_f, rtol=0, what="float mask grad")
    assert glp.dtype == jnp.bfloat16 and not np.any(to_numpy(glp))
    rloss, rgrad = reference("kd", logits, None, ids, lp, mask)
    assert_close(val, 2.5 * to_numpy(rloss), rtol=2e-5, what="scaled loss")
    assert_grad_close(gx, 2.5 * to_numpy(rgrad), "float32", what="scaled grad")


@pytest.mark.parametrize("impl", ["triton", "xla"])
@pytest.mark.parametrize("fn", ["kd", "distill"])
def test_transformations(impl, fn, interpreter):
    """jit, grad, vmap, checkpoint and lax.scan give the same values as direct calls."""
    vocab = 260
    logits = random_logits(91, (2, 3, vocab), "bfloat16")
    labels = make_labels(92, (2, 3), vocab)
    ids, lp, mask = make_teacher(93, (2, 3), vocab, 8)

    def loss(x, y, i, p, m):
        if fn == "kd":
            return jax_fusedloss.kd_loss(x, i, p, m, temperature=2.0, implementation=impl)
        return jax_fusedloss.distill_loss(x, y, i, p, m, alpha=0.5, temperature=2.0,
                                          implementation=impl)

    check_transformations(loss, logits, labels, ids, lp, mask)


def _bad(shape=(4, 10), ids_shape=(4, 3), ids_dtype=jnp.int32, lp_shape=None,
         lp_dtype=jnp.float32, mask_shape=None):
    def make():
        mask = None if mask_shape is None else jnp.ones(mask_shape, bool)
        return (jnp.zeros(shape), jnp.zeros(ids_shape, ids_dtype),
                jnp.zeros(lp_shape or ids_shape, lp_dtype), mask)
    return make


BAD_INPUTS = [
    (_bad(ids_shape=(4, 11)), {}, ValueError, "teacher_ids.shape[-1]=11"),
    (_bad(ids_shape=(5, 3)), {}, ValueError, "teacher_ids.shape"),
    (_bad(ids_shape=(4,)), {}, ValueError, "teacher_ids.shape"),
    (_bad(ids_shape=(4, 0)), {}, ValueError, "teacher_ids.shape[-1]=0"),
    (_bad(ids_dtype=jnp.float32), {}, TypeError, "teacher_ids.dtype"),
    (_bad(lp_shape=(4, 2)), {}, ValueError, "teacher_logprobs.shape"),
    (_bad(lp_dtype=jnp.int32), {}, TypeError, "teacher_logprobs.dtype"),
    (_bad(mask_shape=(4,)), {}, ValueError, "mask.shape"),
    (_bad(), dict(temperature=0.0), ValueError, "temperature"),
    (_bad(), dict(temperature=-1.0), ValueError, "temperature"),
    (_bad(), dict(normalize="renorm"), ValueError, "normalize"),
    (_bad(), dict(reduction="avg"), ValueError, "reduction"),
    (_bad(), dict(implementation="cuda"), ValueError, "implementation"),
    (_bad(), dict(reduction="sum", num_items=4), ValueError, "num_items"),
    (_bad(), dict(num_items=0), ValueError, "num_items"),
    (_bad(), dict(num_items=jnp.ones(2)), ValueError, "num_items.shape"),
]


@pytest.mark.parametrize("make,kwargs,exc,match", BAD_INPUTS)
def test_bad_input_fails_at_trace_time(make, kwargs, exc, match):
    x, ids, lp, mask = make()
    with pytest.raises(exc, match=match.replace(".", r"\.").replace("[", r"\[")):
        jax.eval_shape(lambda x, i, p: jax_fusedloss.kd_loss(x, i, p, mask, **kwargs), x, ids,
                       lp)


@pytest.mark.parametrize("kwargs,labels,exc,match", [
    (dict(alpha=1.5), jnp.zeros((4,), jnp.int32), ValueError, "alpha"),
    (dict(alpha=0.5), jnp.zeros((3,), jnp.int32), ValueError, "labels.shape"),
    (dict(alpha=0.5), jnp.zeros((4,), jnp.float32), TypeError, "labels.dtype"),
    (dict(alpha=0.5, temperature=0.0), jnp.zeros((4,), jnp.int32), ValueError, "temperature"),
])
def test_distill_bad_input_fails_at_trace_time(kwargs, labels, exc, match):
    x, ids, lp, _ = _bad()()
    with pytest.raises(exc, match=match.replace(".", r"\.")):
        jax.eval_shape(lambda x: jax_fusedloss.distill_loss(x, labels, ids, lp, **kwargs), x)


def test_empty_batch():
    x = jnp.zeros((0, 8))
    ids, lp = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2))
    assert float(jax_fusedloss.kd_loss(x, ids, lp)) == 0.0
    assert jax_fusedloss.distill_loss(x, jnp.zeros((0,), jnp.int32), ids, lp, alpha=0.5,
                                      reduction="none").shape == (0,)
