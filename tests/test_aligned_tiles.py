"""_online's aligned tile walk (issue 11 item 4): rows whose start is not a multiple of 16 bytes
(V=50257 and any odd V) are walked as an edge tile plus a vector span of 16-byte groups.

- The walk covers every column of a slice exactly once, whatever the row's offset modulo the
  vector width, the slice bounds and the tile size; the span starts on an aligned address.
- The kernels read rows at any offset: the launch plans run on logits whose row stride is not
  V (the frontends always pass contiguous rows; the kernels take the stride), at odd V, on
  both launch paths, bf16 and float32, against float64 formulas.
The compiled kernels' 16-byte vector loads and stores at V=50257 are checked by
tests/sm90_compile.py (tests/test_compile_sm90.py).
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from jax_fusedloss.kernels import cross_entropy as ce
from jax_fusedloss.kernels import reductions as red
from jax_fusedloss.kernels._online import edge_tile, vector_span
from tests.helpers import DEVICE, GRAD_TOL, TORCH_DTYPES, assert_close


@triton.jit
def _cover_kernel(cases_ptr, count_ptr, base_ptr, W, VEC: tl.constexpr, ALIGN: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """Case i = (row_off, start, stop): count[i, col] += 1 for each column the walk visits
    (edge tile, then the span's tiles); base[i, 0] = the absolute offset of the span's first
    column modulo VEC, base[i, 1] = the span's length."""
    i = tl.program_id(0)
    row_off = tl.load(cases_ptr + i * 3)
    start = tl.load(cases_ptr + i * 3 + 1).to(tl.int32)
    stop = tl.load(cases_ptr + i * 3 + 2).to(tl.int32)
    out = count_ptr + i * W
    k0, k1, lo = vector_span(row_off, start, stop, ALIGN, VEC)
    if ALIGN < VEC:
        cols, mask = edge_tile(start, stop, lo, k1, VEC)
        tl.atomic_add(out + cols, tl.where(mask, 1, 0), mask=mask)
    for k in range(k0, k1, BLOCK_V):
        t = k + tl.arange(0, BLOCK_V)
        tl.atomic_add(out + lo + t, tl.where(t < k1, 1, 0), mask=t < k1)
    tl.store(base_ptr + i * 2, ((row_off + lo + k0) % VEC).to(tl.int32))
    tl.store(base_ptr + i * 2 + 1, (k1 - k0).to(tl.int32))


@pytest.mark.parametrize("vec,align,block", [(8, 1, 16), (8, 2, 8), (4, 1, 16), (4, 4, 8),
                                             (8, 8, 16)])
def test_walk_covers_each_column_once(vec, align, block):
    """Every row offset residue (and one past 2**32), slices from empty to several tiles,
    starting on and off a group: each column of [start, stop) visited once, nothing else; the
    span starts aligned and (unaligned walks) has a length that is a multiple of the width."""
    width = 64
    offsets = list(range(0, vec, align)) + [2 ** 32 + 2 * vec + align]
    cases = [(off, start, start + length) for off in offsets
             for start in (0, 1, vec - 1, vec + 3) if start % align == 0
             for length in (0, 1, vec - 1, vec, vec + 1, 2 * vec - 1, block + vec - 1,
                            3 * block + 1, width - start)]
    table = torch.tensor(cases, dtype=torch.int64, device=DEVICE)
    count = torch.zeros((len(cases), width), dtype=torch.int32, device=DEVICE)
    base = torch.zeros((len(cases), 2), dtype=torch.int32, device=DEVICE)
    _cover_kernel[(len(cases),)](table, count, base, width, VEC=vec, ALIGN=align,
                                 BLOCK_V=block)
    cols = torch.arange(width)
    count, base = count.cpu(), base.cpu()
    for i, (off, start, stop) in enumerate(cases):
        want = ((cols >= start) & (cols < stop)).int()
        assert torch.equal(count[i], want), (
            f"VEC={vec} ALIGN={align} row_off={off} [{start}, {stop}): visits "
            f"{count[i].tolist()}")
        if base[i, 1] > 0:  # an empty span (a slice holding no whole group) has no base
            assert base[i, 0] == 0, f"row_off={off} [{start}, {stop}): span {base[i]}"
        if align < vec:
            assert base[i, 1] % vec == 0, f"row_off={off} [{start}, {stop}): span {base[i]}"


# ------------------------------------------------------------------ plans on strided rows
def _run(plan, stride: int, **tensors):
    """Executes a plan (as torch_ref._launch.run_plan) with every launch's stride_row set to
    `stride`; x may be a row-strided view."""
    env = dict(tensors)
    x = tensors["x"]
    dtypes = {"float32": torch.float32, "int32": torch.int32, "logits": x.dtype}
    for step in plan.launches:
        names = step.kernel.arg_names  # (inputs..., scalars..., outputs..., CONSTEXPRS)
        scalars = list(step.scalars)
        if "stride_row" in names:
            scalars[names.index("stride_row") - len(step.inputs)] = stride
        inputs = [env[i] if isinstance(i, str) else
                  torch.zeros(i.shape, dtype=dtypes[i.dtype], device=x.device)
                  for i in step.inputs]
        aliased = {o: i for i, o in step.aliases}  # written in place: the input's storage
        outs = [inputs[aliased[k]] if k in aliased else
                torch.empty(b.shape, dtype=dtypes[b.dtype], device=x.device)
                for k, b in enumerate(step.outputs)]
        extra = {"num_warps": step.num_warps} if x.is_cuda else {}
        step.kernel[step.grid](*inputs, *scalars, *outs, **extra, **step.constexprs)
        env.update((b.name, o) for b, o in zip(step.outputs, outs))
    return tuple(env[name] for name in plan.results)


def _strided_logits(seed, n, vocab, stride, dtype):
    """[n, vocab] logits (N(0, 2)) as a view with row stride `stride`; padding columns NaN."""
    g = torch.Generator().manual_seed(seed)
    full = torch.full((n, stride), float("nan"), dtype=torch.float64)
    full[:, :vocab] = torch.randn((n, vocab), generator=g, dtype=torch.float64) * 2.0
    x = full.to(TORCH_DTYPES[dtype]).to(DEVICE)[:, :vocab]
    assert x.stride(0) == stride
    return x, x.to(torch.float64)


# (V, SMs): rows one program each (1 SM), or split over vocabulary slices (64 SMs; only
# vocabularies over one 4096-element tile split). 8 rows: with an odd stride, every row offset
# residue modulo the vector width.
CASES = [(7, 1), (97, 1), (1003, 1), (4099, 1), (4099, 64)]
DTYPES = ("bfloat16", "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,sms", CASES)
def test_logsumexp_strided_rows(vocab, sms, dtype):
    """Forward log-sum-exp, entropy and label log-prob of rows with stride V + 2 (row offsets
    in every residue; no congruence with V needed: nothing is written per column)."""
    n, stride = 8, vocab + 2
    x, x64 = _strided_logits(0, n, vocab, stride, dtype)
    y = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1),
                      dtype=torch.int32).to(DEVICE)
    plan = red.red_fwd_plan(n, vocab, inv_temp=1.0, entropy=True, has_label=True, num_sms=sms)
    lse, ent, logp, _ = _run(plan, stride, x=x, y=y)
    ref_lse = torch.logsumexp(x64, dim=-1)
    logp_all = x64.log_softmax(-1)
    what = f"V={vocab} sms={sms} {dtype}"
    assert_close(lse, ref_lse, rtol=2e-5, atol=2e-5, what=f"lse {what}")
    assert_close(ent, -(logp_all.exp() * logp_all).sum(-1), rtol=2e-5, atol=2e-5,
                 what=f"entropy {what}")
    assert_close(logp, logp_all.gather(1, y.long()[:, None])[:, 0], rtol=2e-5, atol=2e-5,
                 what=f"logp {what}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,sms", CASES)
def test_cross_entropy_strided_rows(vocab, sms, dtype):
    """Cross-entropy loss and its gradient (written by the forward on the row path, by the
    backward kernel on the split path) for rows with stride V + 16: the gradient [N, V] is
    written at row * V, congruent to the logits' row offsets modulo 16 bytes, as the span's
    stores require."""
    n, stride = 8, vocab + 16
    x, x64 = _strided_logits(2, n, vocab, stride, dtype)
    y = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(3),
                      dtype=torch.int32).to(DEVICE)
    scale = torch.linspace(0.5, 1.5, n, dtype=torch.float32, device=DEVICE)
    plan = ce.ce_fwd_plan(n, vocab, ignore_index=-100, smoothing=0.0, z_loss=0.0, softcap=None,
                          num_sms=sms, write_grad=True, itemsize=x.element_size())
    loss, _, _, grad = _run(plan, stride, x=x, y=y, row_scale=scale)
    onehot = torch.nn.functional.one_hot(y.long(), vocab).to(x64)
    what = f"V={vocab} sms={sms} {dtype}"
    assert_close(loss, torch.logsumexp(x64, -1) - (x64 * onehot).sum(-1), rtol=2e-5,
                 atol=2e-5, what=f"loss {what}")
    ref = (x64.softmax(-1) - onehot) * scale.to(x64)[:, None]
    tol = GRAD_TOL[dtype] * float(ref.abs().max())
    assert grad.dtype == x.dtype and grad.is_contiguous()
    assert_close(grad, ref, rtol=GRAD_TOL[dtype], atol=tol, what=f"grad {what}")


@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
@pytest.mark.parametrize("vocab", [64, 203, 517])
@pytest.mark.parametrize("smoothing,softcap,prefetch,keep", [
    (0.0, None, True, 0), (0.1, 5.0, True, 0), (0.0, None, False, 0), (0.0, None, False, 1),
    (0.1, None, False, 2)])
def test_fused_walk_over_many_tiles(vocab, dtype, smoothing, softcap, prefetch, keep,
                                    monkeypatch):
    """The fused forward + gradient's per-thread statistics walk (_ce_core.slice_stats,
    with and without the next tile prefetched, which applies to 16-bit logits, or with the
    first `keep` whole tiles held in registers for the gradient pass) over many tiles:
    64-element tiles instead of 16384, so a row holds one to eight whole tiles plus a partial
    one and, at odd V, an edge tile (at V=64 the second kept tile is empty). Rows whose max
    sits in the last tile (every thread's sum rescaled late), whose label is in the partial
    tile, with -inf entries, and an ignored row; row stride V + 16; against float64
    formulas."""
    from jax_fusedloss.kernels import launch

    monkeypatch.setattr(launch, "GRAD_TILE_ELEMS", 64)
    monkeypatch.setattr(launch, "PREFETCH_MIN_VOCAB", 0 if prefetch else 10 ** 9)
    levels = (0,) * keep + (10 ** 9,) * (2 - keep)
    monkeypatch.setattr(launch, "KEEP_VOCAB", {2: levels, 4: levels})
    plan = _check_fused_walk(vocab, dtype, smoothing, softcap,
                             f"prefetch={prefetch} keep={keep}")
    assert plan.launches[0].kernel is ce.ce_fwd_kernel
    assert plan.launches[0].constexprs["BLOCK_V"] == 64
    assert plan.launches[0].constexprs["PREFETCH"] == prefetch
    assert plan.launches[0].constexprs["KEEP"] == keep


@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("vocab,splits", [(203, 2), (1031, 6)])
@pytest.mark.parametrize("smoothing,softcap", [(0.0, None), (0.1, 5.0)])
def test_split_fused_rows(vocab, splits, dtype, smoothing, softcap, monkeypatch):
    """The one-launch split forward + gradient (ce_split_fused_kernel): each row's slices in
    programs that exchange their statistics through row_exchange. The interpreter runs
    programs one after another, so every program but a row's last abandons its slice and the
    last writes the whole row's gradient (the GPU tests time out no program); the walk cases
    of test_fused_walk_over_many_tiles, 64-element tiles, slices of three tiles (192 columns);
    16-bit rows keeping a tile take launch.SPLIT_FUSED_KEPT's config and register cap (here
    the same tiles, but no cap: the rows are unaligned)."""
    from jax_fusedloss.kernels import launch

    monkeypatch.setattr(launch, "SPLIT_FUSED_TILE_ELEMS", 64)
    monkeypatch.setattr(launch, "SPLIT_FUSED_MIN_ROW_BYTES", 0)
    monkeypatch.setattr(launch, "SPLIT_FUSED_SLICE_BYTES", 192 * (2 if dtype == "bfloat16" else 4))
    monkeypatch.setattr(launch, "SPLIT_FUSED_KEPT", {2: (64, 192 * 2, 48)})
    monkeypatch.setattr(launch, "SPLIT_FUSED_POLLS", 2)
    monkeypatch.setattr(launch, "PREFETCH_MIN_VOCAB", 0)
    plan = _check_fused_walk(vocab, dtype, smoothing, softcap, f"splits={splits}")
    assert plan.launches[0].kernel is ce.ce_split_fused_kernel
    assert plan.launches[0].constexprs["NUM_SPLITS"] == splits
    # 16-bit logits without a softcap keep a tile of the slice (launch.SPLIT_FUSED_KEEP)
    keep = int(dtype == "bfloat16" and softcap is None)
    assert plan.launches[0].constexprs["KEEP"] == keep
    assert plan.launches[0].constexprs["PREFETCH"] == (not keep)
    assert plan.launches[0].maxnreg is None  # odd vocabularies: no cap (SPLIT_FUSED_KEPT)


def test_split_fused_config_covers_rows():
    """launch.split_fused_config: only many rows of long logits rows; whole tiles per slice,
    at most SPLIT_FUSED_MAX_SPLITS slices a row, covering it with no empty slice."""
    from jax_fusedloss.kernels import launch

    assert launch.split_fused_config(263, 256000, 4, 132) is None  # few rows: split path
    for itemsize in (2, 4):
        for v in (50257, 114687, 114688, 128256, 131071, 256000, 256001, 10 ** 6, 2 ** 21):
            cfg = launch.split_fused_config(8192, v, itemsize, 132)
            if v * itemsize < launch.SPLIT_FUSED_MIN_ROW_BYTES:
                assert cfg is None, (v, itemsize)
                continue
            assert cfg.split_v % cfg.block_v == 0, (v, itemsize, cfg)
            assert 2 <= cfg.num_splits <= launch.SPLIT_FUSED_MAX_SPLITS, (v, itemsize, cfg)
            assert (cfg.num_splits - 1) * cfg.split_v < v <= cfg.num_splits * cfg.split_v
            # a register cap only where a tile is kept and the rows are 16-byte aligned
            capped = itemsize in launch.SPLIT_FUSED_KEPT and cfg.keep and v % 8 == 0
            assert cfg.maxnreg == (launch.SPLIT_FUSED_KEPT[2][2] if capped else None), (v, cfg)


def _check_fused_walk(vocab, dtype, smoothing, softcap, what):
    """Runs ce_fwd_plan's fused forward + gradient over six rows with a row stride of V + 16
    (see test_fused_walk_over_many_tiles) and checks it against float64; returns the plan."""
    n, stride = 6, vocab + 16
    x, _ = _strided_logits(4, n, vocab, stride, dtype)
    x[1, -2] = 30.0  # the max in the last (partial) tile
    x[2, 0] = 25.0  # the max in the first column (the edge tile at odd V)
    if smoothing == 0.0 and softcap is None:
        x[3, 5:vocab:3] = float("-inf")
    x64 = x.to(torch.float64)
    y = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(5),
                      dtype=torch.int32)
    y[4] = vocab - 1  # the label in the partial tile
    y[5] = -100  # ignored
    y = y.to(DEVICE)
    scale = torch.linspace(0.5, 1.5, n, dtype=torch.float32, device=DEVICE)
    plan = ce.ce_fwd_plan(n, vocab, ignore_index=-100, smoothing=smoothing, z_loss=0.0,
                          softcap=softcap, num_sms=1, write_grad=True,
                          itemsize=x.element_size())
    loss, lse, _, grad = _run(plan, stride, x=x, y=y, row_scale=scale)
    z, dz = x64, torch.ones_like(x64)
    if softcap is not None:
        z = softcap * torch.tanh(x64 / softcap)
        dz = 1 - torch.tanh(x64 / softcap) ** 2
    kept = y != -100
    onehot = torch.nn.functional.one_hot(torch.where(kept, y, 0).long(), vocab).to(x64)
    ref_lse = torch.logsumexp(z, -1)
    zy = (torch.where(onehot > 0, z, 0.0)).sum(-1)
    ref_loss = (1 - smoothing) * (ref_lse - zy)
    if smoothing:
        ref_loss = ref_loss + smoothing * (ref_lse - z.mean(-1))
    ref_loss = torch.where(kept.cpu() if not kept.is_cuda else kept, ref_loss, 0.0)
    w = (scale.to(x64) * kept.to(x64))[:, None]
    ref = w * (z.softmax(-1) - (1 - smoothing) * onehot - smoothing / vocab) * dz
    what = f"V={vocab} {dtype} smoothing={smoothing} softcap={softcap} {what}"
    assert_close(lse, ref_lse, rtol=2e-5, atol=2e-5, what=f"lse {what}")
    assert_close(loss, ref_loss, rtol=2e-5, atol=2e-5, what=f"loss {what}")
    tol = GRAD_TOL[dtype] * float(ref.abs().max())
    assert_close(grad, ref, rtol=GRAD_TOL[dtype], atol=tol, what=f"grad {what}")
    return plan
