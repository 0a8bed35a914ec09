"""The Triton kernels of the tail forms (kernels/kd_tail.py) through the interpreter: kd_loss /
distill_loss with tail=True, "kl" and "jsd", against the float64 formulas of
tests/reference/kd_tail_ref.py and the XLA rows (values and gradients), with tiles small
enough that a row walks several of them (the id bitmap across tiles, in the gradient's rows
or a buffer of its own; the unaligned edge tile), several ids in one tile, duplicate /
masked / out-of-range ids, all-masked rows, a teacher top-K summing to 1, a student whose
tail mass is ~1e-8 (no cancellation), T != 1, float32 / bfloat16 / float16 (float16
recomputes its gradient: the backward kernel) on the row and split launch paths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss
from tests.helpers import force_path
from tests.test_kd_tail import CASES, DISTILL, check, make_inputs

pytestmark = pytest.mark.usefixtures("interpreter")

KD_CASES = ("kl", "jsd", "jsd-beta", "kl-t2-none", "jsd-t07")
DISTILL_CASES = ("kl-t2-sq", "jsd-all-options", "jsd-weights")


@pytest.mark.parametrize("name", KD_CASES)
def test_kd_matches_float64(name):
    check("kd", CASES[name], impl="triton")


@pytest.mark.parametrize("name", DISTILL_CASES)
def test_distill_matches_float64(name):
    check("distill", dict(DISTILL[name], alpha=0.3), impl="triton")


def _small_tiles(monkeypatch):
    """16-column tiles: a 37-column row is an edge tile and 3-4 span tiles."""
    from jax_fusedloss.kernels import kd_tail, launch

    for mod in (kd_tail, launch):
        monkeypatch.setattr(mod, "GRAD_TILE_ELEMS", 16)
        monkeypatch.setattr(mod, "FWD_TILE_ELEMS", 16)


def _tile_inputs(vocab, dtype, k=6):
    """make_inputs' rows (duplicate, out-of-range, negative and masked ids, an all-masked row)
    with row 0's ids packed into one tile (3, 4, 5, 5, 7) and rows 3-4's student mass on
    their ids."""
    x, y, ids, lp, mask, w = make_inputs(7, vocab=vocab, k=k)
    ids = ids.at[0].set(jnp.asarray([3, 4, 5, 5, 7, vocab - 1], ids.dtype))
    on_ids = jax.nn.one_hot(jnp.where(ids >= 0, ids, vocab), vocab).sum(1)[..., :vocab]
    x = x + 6.0 * on_ids * jnp.asarray([0, 0, 0, 1, 1, 0], x.dtype)[:, None]
    return x.astype(dtype), y, ids, lp, mask, w


TOL = {"float32": (2e-5, 2e-6), "bfloat16": (1e-2, 1e-5), "float16": (2e-3, 1e-6)}


@pytest.mark.parametrize("fn, divergence, dtype, vocab, path, reduction", [
    ("kd", "jsd", "bfloat16", 37, "rows", "none"),
    ("distill", "kl", "bfloat16", 48, "rows", "none"),
    ("kd", "kl", "float16", 37, "split", "none"),
    ("distill", "jsd", "float16", 40, "rows", "none"),
    ("kd", "kl", "bfloat16", 37, "rows", "sum"),
    ("distill", "jsd", "bfloat16", 45, "split", "sum"),
])
def test_tile_walk(monkeypatch, fn, divergence, dtype, vocab, path, reduction):
    """Rows of several 16-column tiles. Reduction "none" (per-row cotangents): the statistics-
    only forward, its id bitmaps in a buffer of their own, and float16 recomputes (the
    backward kernel); "sum" in bfloat16: the fused forward + gradient, the bitmaps in the
    gradient's rows (odd V: each row's bitmap starts at its own 4-byte boundary)."""
    _small_tiles(monkeypatch)
    force_path(path, monkeypatch)
    inputs = _tile_inputs(vocab, jnp.dtype(dtype))
    opts = dict(tail=True, divergence=divergence, temperature=1.5, reduction=reduction)
    if fn == "distill":
        opts.update(alpha=0.4, label_smoothing=0.1)
    rtol, atol = TOL[dtype]
    check(fn, opts, inputs=inputs, impl="triton", rtol=max(rtol, 2e-5), atol=atol)
    # the XLA rows on the same inputs: loss per row and gradient
    x, y, ids, lp, mask, _ = inputs
    run = {"kd": lambda x, impl: jax_fusedloss.kd_loss(x, ids, lp, mask, implementation=impl,
                                                       **opts),
           "distill": lambda x, impl: jax_fusedloss.distill_loss(
               x, y, ids, lp, mask, implementation=impl, **opts)}[fn]
    got, want = (jax.vjp(lambda x: run(x, impl), x) for impl in ("triton", "xla"))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
    cot = jnp.linspace(0.5, 2.0, x.shape[0]) if reduction == "none" else jnp.float32(1.0)
    g, r = (np.asarray(v[1](cot)[0], np.float32) for v in (got, want))
    np.testing.assert_allclose(g, r, rtol=rtol, atol=atol + rtol * np.abs(r).max())


@pytest.mark.parametrize("fn, divergence, walk", [
    ("kd", "kl", "prefetch"), ("distill", "jsd", "prefetch"), ("kd", "jsd", "keep1"),
    ("kd", "kl", "keep2"),
])
def test_walk_prefetch_and_kept_tiles(monkeypatch, fn, divergence, walk):
    """The fused walk's PREFETCH and KEEP forms (long rows on a GPU) on 16-column tiles: a
    40-column row of 2 whole tiles and a partial one, ids in the kept tiles."""
    from jax_fusedloss.kernels import kd_tail, launch

    _small_tiles(monkeypatch)
    force_path("rows", monkeypatch)
    monkeypatch.setattr(launch, "PREFETCH_MIN_VOCAB", 0)
    keep = {"prefetch": 0, "keep1": 1, "keep2": 2}[walk]
    monkeypatch.setattr(kd_tail, "TAIL_KEEP_VOCAB", {2: (0, 0)[:keep] + (1 << 62,) * (2 - keep)})
    inputs = _tile_inputs(40, jnp.bfloat16)
    opts = dict(tail=True, divergence=divergence, temperature=1.0 if walk != "prefetch" else 1.5)
    if fn == "distill":
        opts.update(alpha=0.4)
    check(fn, opts, inputs=inputs, impl="triton", rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("divergence", ["kl", "jsd"])
def test_tiny_tail_mass_without_cancellation(monkeypatch, divergence):
    """A student with ~1e-8 of its mass outside the teacher's ids: Q_t is summed over the
    tail columns, so the loss and the tail columns' gradient keep float32 accuracy (1 - sum_d
    Q_d would have none)."""
    _small_tiles(monkeypatch)
    x, y, ids, lp, _, _ = make_inputs(11, vocab=37, k=5)
    x = x * 0.1 + 25.0 * jax.nn.one_hot(ids, 37).sum(1)
    lp = lp - 0.2  # teacher tail mass > 0
    check("kd", dict(tail=True, divergence=divergence), inputs=(x, y, ids, lp, None, None),
          impl="triton", rtol=1e-4, atol=1e-9)



@pytest.mark.parametrize("fn, divergence, k", [("kd", "kl", 5), ("kd", "jsd", 5),
                                                ("distill", "jsd", 5), ("kd", "kl", 37)])
def test_repeated_id_check_per_program(monkeypatch, fn, divergence, k):
    """tail_dups_kernel's two paths in one launch: programs of 2 rows, of which the first
    holds make_inputs' repeated id (the sums and order of the entries) and the others none
    (the check alone, every valid entry its own id; masked and out-of-range entries too);
    K=37: the check's loads of 16 entries, the last one partial, and 3 more repeats."""
    from jax_fusedloss.kernels import kd_tail

    monkeypatch.setattr(kd_tail, "DUPS_ROWS", 2)
    x, y, ids, lp, mask, w = make_inputs(vocab=50, k=k)
    if k > 16:
        ids = ids.at[2, 30].set(ids[2, 3]).at[2, 36].set(ids[2, 3]).at[5, 17].set(ids[5, 33])
    opts = dict(tail=True, divergence=divergence, temperature=1.5)
    if fn == "distill":
        opts.update(alpha=0.4)
    check(fn, opts, inputs=(x, y, ids, lp, mask, w), impl="triton")

def test_special_rows():
    """The full teacher distribution as its top-K (tail mass 0) and a matching student: both
    divergences are 0; all-masked rows are 0 and not counted."""
    t = jax.random.normal(jax.random.key(3), (4, 23)) * 2.0
    lp_t, ids_t = jax.lax.top_k(jax.nn.log_softmax(t), 23)
    for k in (23, 6):
        for div in ("kl", "jsd"):
            loss = jax_fusedloss.kd_loss(t, ids_t[:, :k], lp_t[:, :k], tail=True, divergence=div,
                                         reduction="none", implementation="triton")
            assert np.abs(np.asarray(loss)).max() < 1e-6, (k, div, loss)
    x, _, ids, lp, _, _ = make_inputs()
    mask = jnp.zeros(ids.shape, bool).at[0].set(True)
    rows = jax_fusedloss.kd_loss(x, ids, lp, mask, tail=True, reduction="none",
                                 implementation="triton")
    assert np.all(np.asarray(rows)[1:] == 0.0), rows
    mean, g = jax.value_and_grad(lambda x: jax_fusedloss.kd_loss(
        x, ids, lp, mask, tail=True, divergence="jsd", implementation="triton"))(x)
    assert not np.any(np.asarray(g)[1:]), g
    check("kd", dict(tail=True), inputs=(t * 0.5, None, ids_t, lp_t, None, None),
          impl="triton")


@pytest.mark.parametrize("divergence", ["kl", "jsd"])
def test_special_logits_as_the_xla_rows(divergence):
    """NaN in a tail column and at a teacher id, +inf at an id and in the tail, -inf columns
    (the walk sums only the tail; the row's sum is rebuilt from the ids' gathered logits): the
    loss per row and the gradient rows are NaN, +inf or finite where the XLA rows' are, and
    equal where finite."""
    x, y, ids, lp, mask, _ = make_inputs(8, n=8, vocab=37, k=5)
    x = x.at[0, 30].set(jnp.nan).at[1, ids[1, 0]].set(jnp.nan)
    x = x.at[2, ids[2, 1]].set(jnp.inf).at[3, 31].set(jnp.inf)
    x = x.at[4, :20].set(-jnp.inf).at[5].set(-jnp.inf).at[5, ids[5, 0]].set(1.0)
    opts = dict(tail=True, divergence=divergence, reduction="none")
    (got, vg), (want, vw) = (jax.vjp(lambda x: jax_fusedloss.kd_loss(
        x, ids, lp, mask, implementation=impl, **opts), x) for impl in ("triton", "xla"))
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{got} vs {want}")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, equal_nan=True)
    g, r = (np.asarray(v(jnp.ones(8))[0]) for v in (vg, vw))
    np.testing.assert_array_equal(np.isnan(g).any(1), np.isnan(r).any(1))
    fin = ~np.isnan(r).any(1)
    np.testing.assert_allclose(g[fin], r[fin], rtol=1e-4, atol=1e-6)
