"""kd_loss and distill_loss: JAX "triton" (the interpreter on CPU, compiled kernels on a GPU)
and "xla", and torch_ref, against the float64 plain-JAX formulas (tests/reference/jax_ref.py)
in values and gradients, through the shared grid of tests/opbase.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss
import torch_ref
from tests import opbase
from tests.helpers import (DEVICE, assert_close, assert_grad_close, check_transformations,
                           force_path, random_logits, to_numpy, to_torch)
from tests.opbase import IMPLS, JAX_IMPLS, spec
from tests.reference import jax_ref


def make_teacher(seed, lead, vocab, k, mask_frac=0.2, dtype=jnp.float32):
    """A teacher's top-k (ids int32, log-probs) of random logits, and a random bool mask."""
    logits = jax.random.normal(jax.random.key(seed), lead + (vocab,)) * 3.0
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(logits), k)
    mask = jnp.asarray(np.random.default_rng(seed).random(lead + (k,)) >= mask_frac)
    return ids.astype(jnp.int32), lp.astype(dtype), mask


class Distillation(opbase.Op):
    """kd_loss (fn="kd") or distill_loss (fn="distill")."""

    input_keys = ("k", "mask_frac", "teacher", "labels")

    def __init__(self, fn):
        self.fn, self.name = fn, {"kd": "kd_loss", "distill": "distill_loss"}[fn]

    def inputs(self, seed, shape, dtype, scale, opts, k=8, mask_frac=0.2, teacher=None,
               labels=None):
        lead, vocab = shape[:-1], shape[-1]
        ids, lp, mask = teacher or make_teacher(seed + 1, lead, vocab, k, mask_frac)
        if labels is None and self.fn == "distill":
            labels = opbase.make_labels(seed + 2, lead, vocab, opts.get("ignore_index", -100))
        inputs = dict(x=random_logits(seed, shape, dtype, scale), ids=ids, lp=lp, mask=mask)
        return inputs if self.fn == "kd" else dict(inputs, labels=labels)

    def _args(self, inputs):
        teacher = (inputs["ids"], inputs["lp"], inputs["mask"])
        return teacher if self.fn == "kd" else (inputs["labels"],) + teacher

    def jax(self, impl, x, inputs, opts):
        return {"loss": getattr(jax_fusedloss, self.name)(x, *self._args(inputs),
                                                          implementation=impl, **opts)}

    def torch(self, x, inputs, opts):
        return {"loss": getattr(torch_ref, self.name)(x, *self._args(inputs), **opts)}

    def reference(self, x, inputs, opts):
        return {"loss": getattr(jax_ref, self.name)(x, *self._args(inputs), **opts)}


OPS = {"kd": Distillation("kd"), "distill": Distillation("distill")}
KD, DISTILL = OPS["kd"], OPS["distill"]
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


def test_grid_covers_both_paths_and_several_tiles():
    """The launch heuristic gives the big case several tiles in both passes, and the forced
    paths below are what they claim (guards the grid against a retuned heuristic)."""
    from jax_fusedloss.kernels.launch import row_config

    for write_grad in (False, True):
        rows = row_config(2, BIG_V, 1, write_grad)
        split = row_config(2, BIG_V, 64, write_grad)
        assert rows.num_splits == 1 and rows.block_v < BIG_V, rows
        assert split.num_splits > 1, split


@opbase.grid(dtype=opbase.DTYPES, case=list(CASES))
def test_kd_grid(impl, path, dtype, case):
    shape, k, normalize, t = CASES[case]
    KD.check(impl, dtype, shape, k=k, normalize=normalize, temperature=t, forward=True)


@pytest.mark.parametrize("impl", ["triton", "torch_ref"])
@pytest.mark.parametrize("fn,temperature", [("kd", 2.0), ("distill", 1.0)])
def test_fused_walk_with_prefetch_over_many_tiles(impl, fn, temperature, monkeypatch):
    """The fused forward + gradient's per-thread statistics walk with the next tile
    prefetched (bf16; on the GPU only from V = PREFETCH_MIN_VOCAB, here forced) over ten
    512-element tiles, a partial one and an edge tile (V = 5003): both softmax sums (kd at
    T = 2) and the shared one (distill at T = 1). A shape no other test traces, so no cached
    trace without the prefetch stands in for it."""
    from jax_fusedloss.kernels import launch

    force_path("rows", monkeypatch)
    monkeypatch.setattr(launch, "GRAD_TILE_ELEMS", 512)
    monkeypatch.setattr(launch, "PREFETCH_MIN_VOCAB", 0)
    cfg = launch.row_config(3, 5003, 1, write_grad=True)
    assert cfg.prefetch and cfg.block_v == 512 and cfg.num_splits == 1
    extra = dict(alpha=0.3) if fn == "distill" else {}
    OPS[fn].check(impl, "bfloat16", (3, 5003), k=16, normalize="full", temperature=temperature,
                  **extra)


@pytest.mark.parametrize("impl", ["triton", "torch_ref"])
@pytest.mark.parametrize("fn,temperature,keep,vocab", [("kd", 2.0, 2, 5000),
                                                       ("distill", 1.0, 1, 5003)])
def test_fused_walk_keeping_tiles(impl, fn, temperature, keep, vocab, monkeypatch):
    """The fused forward + gradient with the row's first `keep` whole tiles held in registers
    from the statistics walk to the gradient pass (launch.KD_KEEP_VOCAB, here forced; the
    prefetch then off), over ten 512-element tiles, a partial one and, at V=5003, an edge
    tile. At V=5000 (16-byte aligned rows) the walk also gathers the logits at the ids for
    kd_ids_kernel (launch.kd_walk_gathers); at 5003 the ids kernel gathers them."""
    from jax_fusedloss.kernels import kd, launch

    force_path("rows", monkeypatch)
    monkeypatch.setattr(launch, "GRAD_TILE_ELEMS", 512)
    monkeypatch.setattr(launch, "PREFETCH_MIN_VOCAB", 0)
    monkeypatch.setattr(launch, "KD_KEEP_VOCAB", {2: (0,) * keep + (10 ** 9,) * (2 - keep)})
    assert launch.kd_keep_tiles(vocab, 2, None, 1) == keep
    plan = kd.kd_fwd_plan(3, vocab, 16, temperature=temperature, normalize="full",
                          distill=fn == "distill", ignore_index=-100, num_sms=1,
                          write_grad=True, itemsize=2)
    walk, ids = plan.launches[0].constexprs, plan.launches[1].constexprs
    assert walk["KEEP"] == keep and not walk["PREFETCH"] and walk["BLOCK_V"] == 512
    assert walk["WALK_GATHER"] == ids["WALK_GATHER"] == (vocab == 5000)
    extra = dict(alpha=0.3) if fn == "distill" else {}
    OPS[fn].check(impl, "bfloat16", (3, vocab), k=16, normalize="full", temperature=temperature,
                  **extra)


@opbase.grid(dtype=["float32", "bfloat16"], case=list(DISTILL_CASES))  # float16: the kd grid
def test_distill_grid(impl, path, dtype, case):
    shape, k, normalize, t = DISTILL_CASES[case]
    DISTILL.check(impl, dtype, shape, k=k, normalize=normalize, temperature=t, alpha=0.3,
                  forward=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", ["kd", "distill"])
@pytest.mark.parametrize("reduction,normalize", [("mean", "full"), ("sum", "topk"),
                                                 ("none", "full"), ("none", "topk")])
def test_reductions(impl, fn, reduction, normalize):
    extra = dict(alpha=0.6, temperature_squared=True) if fn == "distill" else {}
    OPS[fn].check(impl, "float32", (6, 301), k=16, seed=3, reduction=reduction,
                  normalize=normalize, temperature=1.5, mask_frac=0.4, **extra)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", ["kd", "distill"])
@pytest.mark.parametrize("num_items", [7, "array"])
def test_num_items(impl, fn, num_items):
    """num_items replaces the "mean" denominator (gradient accumulation over micro-batches)."""
    num_items = jnp.asarray(11.0) if num_items == "array" else num_items
    extra = dict(alpha=0.4) if fn == "distill" else {}
    outs, _ = OPS[fn].check(impl, "float32", (5, 211), k=8, seed=5, num_items=num_items,
                            **extra)
    total, _ = OPS[fn].check(impl, "float32", (5, 211), k=8, seed=5, reduction="sum", **extra)
    assert_close(outs["loss"], total["loss"] / float(num_items), rtol=1e-6,
                 what="mean == sum / num_items")


@opbase.grid(normalize=["full", "topk"], fn=["kd", "distill"])
def test_repeated_ids_count_per_entry(impl, path, normalize, fn):
    """An id listed several times in a row counts once per entry; its gradient column sums
    the entries' contributions (autograd of the gather formula); entries sharing an id with
    the label also carry the cross-entropy term."""
    vocab, k = 700, 8
    ids, lp, mask = make_teacher(21, (4,), vocab, k, mask_frac=0.0)
    ids = ids.at[0, 3].set(ids[0, 1]).at[0, 5].set(ids[0, 1])  # an id three times
    ids = ids.at[1, 7].set(ids[1, 0]).at[2].set(ids[2, 0])  # twice; a whole row of one id
    mask = mask.at[1, 0].set(False)  # a masked duplicate does not count
    labels = opbase.make_labels(22, (4,), vocab, frac_ignored=0.0).at[0].set(ids[0, 1])
    extra = dict(alpha=0.5) if fn == "distill" else {}
    _, grad = OPS[fn].check(impl, "float32", (4, vocab), seed=23, teacher=(ids, lp, mask),
                            labels=labels, normalize=normalize, temperature=1.3, **extra)
    assert np.isfinite(grad).all()


@opbase.grid(fn=["kd", "distill"])
def test_tokens_without_entries(impl, path, fn):
    """Tokens whose entries are all masked add 0 and get a zero gradient; with no counting
    token at all, "mean" is 0, not NaN."""
    vocab, k = 517, 4
    ids, lp, mask = make_teacher(31, (3, 2), vocab, k)
    mask = mask.at[0, 1].set(False).at[2].set(False)
    extra = dict(alpha=0.0) if fn == "distill" else {}
    labels = opbase.make_labels(32, (3, 2), vocab, frac_ignored=0.0)
    outs, grad = OPS[fn].check(impl, "bfloat16", (3, 2, vocab), seed=33,
                               teacher=(ids, lp, mask), labels=labels, reduction="none",
                               normalize="full", **extra)
    assert np.all(grad[0, 1] == 0) and np.all(grad[2] == 0)
    assert np.all(outs["loss"][0, 1] == 0) and np.all(outs["loss"][2] == 0)
    none = jnp.zeros_like(mask)
    outs, grad = OPS[fn].check(impl, "bfloat16", (3, 2, vocab), seed=33,
                               teacher=(ids, lp, none), labels=labels, reduction="mean",
                               normalize="topk", **extra)
    assert np.all(outs["loss"] == 0) and np.all(grad == 0)


@opbase.grid(normalize=["full", "topk"])
def test_out_of_range_ids_count_as_masked(impl, path, normalize):
    """Ids outside [0, V) add nothing and are never used as an address."""
    vocab, k = 300, 6
    inputs = KD.inputs(42, (4, vocab), "float32", 2.0, {}, k=k, mask_frac=0.0)
    ids = inputs["ids"]
    bad = ids.at[0, 2].set(vocab).at[1, 0].set(-1).at[1, 4].set(-7).at[3, 5].set(2**30)
    opts = dict(normalize=normalize, reduction="sum")
    got, grad = KD.run(impl, dict(inputs, ids=bad), opts, {})
    want, rgrad = KD.expected(dict(inputs, mask=inputs["mask"] & (bad == ids)), opts, {})
    assert_close(got["loss"], want["loss"], rtol=2e-5, what="loss")
    assert_grad_close(grad, rgrad, "float32")


def test_kernel_never_reads_out_of_bounds(path):
    """The kernels' own guard: raw out-of-range ids (not remapped by a wrapper) in a buffer
    whose neighbouring rows are NaN give finite results equal to masking those entries."""
    import torch

    from torch_ref._kd_rows64 import Form
    from torch_ref.kd import _rows

    vocab, n = 300, 3
    big = torch.full((n + 2, vocab), float("nan"), device=DEVICE)
    big[1:-1] = torch.randn(n, vocab, generator=torch.Generator().manual_seed(43)).to(DEVICE) * 2
    x = big[1:-1]
    ids, lp, mask = make_teacher(43, (n,), vocab, 4, mask_frac=0.0)
    raw = to_torch(ids)
    raw[0, 1], raw[2, 3], raw[1, 0] = -3, vocab + 2, -1
    row_scale = torch.tensor([[0.0, 1.0]] * n, device=DEVICE)
    y = torch.zeros(n, dtype=torch.int32, device=DEVICE)
    inputs = dict(x=jnp.asarray(x.cpu().numpy()), ids=ids, lp=lp,
                  mask=jnp.asarray((raw == to_torch(ids)).cpu().numpy()))
    ones = {"loss": jnp.ones((n,))}  # the kernels' gradient is for a unit cotangent per row
    for normalize in ("full", "topk"):
        loss, grad, _ = _rows(x, raw, to_torch(lp), y, row_scale,
                              Form(1.0, normalize, False, -100), True)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        routs, rgrad = KD.expected(inputs, dict(normalize=normalize, reduction="none"), ones)
        assert_close(loss, routs["loss"], rtol=2e-5, atol=1e-6, what=f"{normalize} loss")
        assert_grad_close(grad, rgrad, "float32")


@pytest.mark.parametrize("impl", IMPLS)
def test_full_teacher_is_exact_kl(impl):
    """K = V with "full" is the exact KL(teacher || softmax(x / T))."""
    vocab = 37
    t_logp = jax.nn.log_softmax(jax.random.normal(jax.random.key(52), (4, vocab)))
    ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), (4, vocab))
    inputs = dict(x=random_logits(51, (4, vocab), "float32"), ids=ids, lp=t_logp, mask=None)
    outs, _ = KD.run(impl, inputs, dict(temperature=2.0, reduction="none"),
                     opbase.weights(53, (4,), ("loss",)))
    kl = jnp.sum(jnp.exp(t_logp) * (t_logp - jax.nn.log_softmax(inputs["x"] / 2.0)), axis=-1)
    assert_close(outs["loss"], kl, rtol=1e-5, atol=1e-6, what="exact KL")


@pytest.mark.parametrize("impl", JAX_IMPLS)
def test_distill_alpha_extremes_match_the_parts(impl):
    """alpha = 1 is cross_entropy; alpha = 0 is kd_loss over the tokens with a label."""
    vocab = 401
    logits = random_logits(61, (5, vocab), "bfloat16")
    labels = opbase.make_labels(62, (5,), vocab)
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
def test_bad_labels_are_nan_and_isolated(impl):
    vocab = 260
    inputs = DISTILL.inputs(71, (4, vocab), "float32", 2.0, {}, k=8)
    inputs["labels"] = opbase.make_labels(72, (4,), vocab, frac_ignored=0.0).at[2].set(vocab)
    outs, grad = DISTILL.run(impl, inputs, dict(alpha=0.5, reduction="none"),
                             opbase.weights(73, (4,), ("loss",)))
    loss, grad = to_numpy(outs["loss"]), to_numpy(grad)
    assert np.isnan(loss[2]) and np.isnan(grad[2]).all()
    good = np.array([0, 1, 3])
    assert np.isfinite(loss[good]).all() and np.isfinite(grad[good]).all()


@pytest.mark.parametrize("impl", JAX_IMPLS)
def test_mask_and_logprob_dtypes_and_zero_teacher_cotangents(impl):
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
    routs, rgrad = KD.expected(dict(x=logits, ids=ids, lp=lp, mask=mask), {}, {})
    assert_close(val, 2.5 * to_numpy(routs["loss"]), rtol=2e-5, what="scaled loss")
    assert_grad_close(gx, 2.5 * to_numpy(rgrad), "float32", what="scaled grad")


@pytest.mark.parametrize("impl", JAX_IMPLS)
@pytest.mark.parametrize("fn", ["kd", "distill"])
def test_transformations(impl, fn):
    """jit, grad, vmap, checkpoint and lax.scan give the same values as direct calls."""
    vocab = 260
    logits = random_logits(91, (2, 3, vocab), "bfloat16")
    labels = opbase.make_labels(92, (2, 3), vocab)
    ids, lp, mask = make_teacher(93, (2, 3), vocab, 8)

    def loss(x, y, i, p, m):
        if fn == "kd":
            return jax_fusedloss.kd_loss(x, i, p, m, temperature=2.0, implementation=impl)
        return jax_fusedloss.distill_loss(x, y, i, p, m, alpha=0.5, temperature=2.0,
                                          implementation=impl)

    check_transformations(loss, logits, labels, ids, lp, mask)


def _teacher(ids=(4, 3), ids_dtype=jnp.int32, lp=None, lp_dtype=jnp.float32, mask=None):
    """(logits [4, 10], ids, log-probs, mask) as abstract arguments."""
    return (spec((4, 10)), spec(ids, ids_dtype), spec(lp or ids, lp_dtype),
            None if mask is None else spec(mask, bool))


def _distill(labels, *args, **kwargs):
    return jax_fusedloss.distill_loss(args[0], labels, *args[1:], **kwargs)


KD_BAD = [
    (_teacher(ids=(4, 11)), {}, ValueError, "teacher_ids.shape[-1]=11"),
    (_teacher(ids=(5, 3)), {}, ValueError, "teacher_ids.shape"),
    (_teacher(ids=(4,)), {}, ValueError, "teacher_ids.shape"),
    (_teacher(ids=(4, 0)), {}, ValueError, "teacher_ids.shape[-1]=0"),
    (_teacher(ids_dtype=jnp.float32), {}, TypeError, "teacher_ids.dtype"),
    (_teacher(lp=(4, 2)), {}, ValueError, "teacher_logprobs.shape"),
    (_teacher(lp_dtype=jnp.int32), {}, TypeError, "teacher_logprobs.dtype"),
    (_teacher(mask=(4,)), {}, ValueError, "mask.shape"),
    (_teacher(), dict(temperature=0.0), ValueError, "temperature"),
    (_teacher(), dict(temperature=-1.0), ValueError, "temperature"),
    (_teacher(), dict(normalize="renorm"), ValueError, "normalize"),
    (_teacher(), dict(reduction="avg"), ValueError, "reduction"),
    (_teacher(), dict(implementation="cuda"), ValueError, "implementation"),
    (_teacher(), dict(reduction="sum", num_items=4), ValueError, "num_items"),
    (_teacher(), dict(num_items=0), ValueError, "num_items"),
    (_teacher(), dict(num_items=jnp.ones(2)), ValueError, "num_items.shape"),
]
DISTILL_BAD = [
    ((spec((4,), jnp.int32), *_teacher()), dict(alpha=1.5), ValueError, "alpha"),
    ((spec((3,), jnp.int32), *_teacher()), dict(alpha=0.5), ValueError, "labels.shape"),
    ((spec((4,)), *_teacher()), dict(alpha=0.5), TypeError, "labels.dtype"),
    ((spec((4,), jnp.int32), *_teacher()), dict(alpha=0.5, temperature=0.0), ValueError,
     "temperature"),
]


@pytest.mark.parametrize("fn,args,kwargs,exc,match",
                         [(jax_fusedloss.kd_loss, *b) for b in KD_BAD]
                         + [(_distill, *b) for b in DISTILL_BAD])
def test_bad_input_fails_at_trace_time(fn, args, kwargs, exc, match):
    opbase.check_rejected(fn, args, kwargs, exc, match)


def test_empty_batch():
    x = jnp.zeros((0, 8))
    ids, lp = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2))
    assert float(jax_fusedloss.kd_loss(x, ids, lp)) == 0.0
    assert jax_fusedloss.distill_loss(x, jnp.zeros((0,), jnp.int32), ids, lp, alpha=0.5,
                                      reduction="none").shape == (0,)
