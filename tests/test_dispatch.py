"""How implementation=None and the GPU launch path are chosen (no GPU needed): the custom-call
target of our jax-triton launches (_triton_jax.call_target) and the few-row table per target
(kernels.launch.AUTO_XLA_MAX_ROWS)."""
from __future__ import annotations

import jaxlib
import pytest

from jax_fusedloss import _triton_jax
from jax_fusedloss.kernels import launch


def _jaxlib_has_ffi_call() -> bool:
    version = tuple(int(p) for p in jaxlib.__version__.split(".")[:3] if p.isdigit())
    return version >= _triton_jax.FFI_MIN_JAXLIB


def test_call_target_follows_the_environment_and_jaxlib(monkeypatch):
    monkeypatch.setenv("JFL_TRITON_CALL", "legacy")
    assert _triton_jax.call_target() == _triton_jax.LEGACY_TARGET
    assert _triton_jax.call_kind() == "legacy"
    monkeypatch.delenv("JFL_TRITON_CALL")
    want = _triton_jax.FFI_TARGET if _jaxlib_has_ffi_call() else _triton_jax.LEGACY_TARGET
    assert _triton_jax.call_target() == want
    monkeypatch.setenv("JFL_TRITON_CALL", "graph")
    with pytest.raises(ValueError, match="JFL_TRITON_CALL must be 'ffi' or 'legacy'"):
        _triton_jax.call_target()


@pytest.mark.parametrize("family,ffi_rows,legacy_rows", [("loss", 0, 64), ("reductions", 8, 8)])
def test_few_row_table(family, ffi_rows, legacy_rows):
    """Few rows go to the XLA twin where its host wall clock was measured faster: the
    reductions up to 8 rows through either call, the losses only through the legacy call."""
    for n in (1, 8, 9, 64, 4096):
        assert launch.auto_prefers_xla(n, 128256, family, "ffi") == (n <= ffi_rows), n
    assert launch.auto_prefers_xla(1, 128256, family, "legacy")
    assert launch.auto_prefers_xla(legacy_rows, 128256, family, "legacy")
    assert not launch.auto_prefers_xla(legacy_rows + 1, 128256, family, "legacy")


@pytest.mark.parametrize("vocab,itemsize,softcap,keep", [
    (32000, 2, None, 0), (100000, 2, None, 0), (128256, 2, None, 1), (151936, 2, None, 2),
    (151936, 2, 30.0, 0), (32000, 4, None, 0), (50257, 4, None, 1), (100000, 4, None, 1),
    (50257, 4, 30.0, 0)])
def test_kept_tiles(vocab, itemsize, softcap, keep):
    """The fused cross-entropy row walk keeps tiles in registers where launch.KEEP_VOCAB's
    table says it was measured faster, never with a softcap (its arithmetic spills), and then
    drops the prefetch; only a pass that writes the gradient keeps anything."""
    assert launch.keep_tiles(vocab, itemsize, softcap) == keep
    cfg = launch.row_config(8192, vocab, 132, write_grad=True, keep=keep)
    assert cfg.num_splits == 1 and cfg.keep == keep
    assert cfg.prefetch == (vocab >= launch.PREFETCH_MIN_VOCAB and keep == 0)
    assert launch.row_config(8192, vocab, 132, write_grad=False, keep=keep).keep == 0


@pytest.mark.parametrize("vocab,softcap,exps,keep", [
    (128256, None, 1, 2), (151936, None, 1, 2), (50257, None, 1, 0), (128256, None, 2, 0),
    (128256, 30.0, 1, 0)])
def test_kd_kept_tiles(vocab, softcap, exps, keep):
    """kd_loss / distill_loss keep two tiles on long 16-bit rows with one exponential per
    element (launch.KD_KEEP_VOCAB), none with two (distill_loss at T != 1), a softcap, or
    float32 (not measured)."""
    assert launch.kd_keep_tiles(vocab, 2, softcap, exps) == keep
    assert launch.kd_keep_tiles(vocab, 4, softcap, exps) == 0


def test_kd_walk_gathers_on_aligned_rows():
    """kd_fwd_kernel's walk gathers the logits at the teacher ids only where rows start
    16-byte aligned (launch.kd_walk_gathers: measured slower at the unaligned V=50257)."""
    assert launch.kd_walk_gathers(50256, 2) and launch.kd_walk_gathers(128256, 2)
    assert launch.kd_walk_gathers(32000, 4)
    assert not launch.kd_walk_gathers(50257, 2) and not launch.kd_walk_gathers(50258, 4)
    assert not launch.kd_walk_gathers(128256, 0)


@pytest.mark.parametrize("vocab,tile,warps", [
    (128256, 16384, 32), (64128, 16384, 32), (32064, 8192, 16), (8064, 4096, 8),
    (1000, 1024, 4)])
def test_kd_bwd_slice_tiles(vocab, tile, warps):
    """kd_bwd_kernel on many rows takes a quarter of the row as its tile, within [4096,
    GRAD_TILE_ELEMS] and no larger than the row (launch.bwd_slice_tile: the measured optimum
    on a device's vocabulary slice and on the LM head's vocabulary blocks; whole llama3 rows
    keep the default), and distill_loss's programs of 16 or more warps on aligned rows are
    register-capped."""
    from jax_fusedloss.kernels import kd

    for distill in (False, True):
        plan = kd.kd_bwd_plan(8192, vocab, 64, vocab_total=4 * vocab, temperature=1.0,
                              normalize="full", distill=distill, ignore_index=-100,
                              num_sms=132, itemsize=2)
        (step,) = plan.launches
        assert (step.constexprs["BLOCK_V"], step.num_warps) == (tile, warps)
        capped = distill and warps >= 16 and vocab % 16 == 0
        assert step.maxnreg == (launch.KD_BWD_DISTILL_MAXNREG if capped else None)
