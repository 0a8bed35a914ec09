"""The kernels to compile for sm_90, generated from the launch plans the libraries execute.

Each family's plan function runs over a grid of shapes (the row path at N=8192, the split
path at N=8, an aligned and an unaligned vocabulary), dtypes and option sets; every distinct
launch is a candidate compile: (kernel, signature, constexprs, warps). Each unaligned compile
has an aligned twin (same tiles at V=128256 or 32000 and V=50257), against which sm90_compile checks
its 16-byte vector loads and stores. A signature maps the
kernel's parameters to types: pointers from the dtypes of the arrays a launch reads or writes,
Python ints to i32 and floats to fp32, as both executors pass them.

The grids give ~630 distinct launches, most of them the same code paths again (float16 beside
bfloat16, the same tiles at another vocabulary or option set); `specs` compiles a covering
subset of each kernel's launches (`covering`): every value of every constexpr, in every tile
layout the plans use it with and beside every value of every other constexpr, float16 with
each of them too, and each unaligned compile's aligned twin (~270 compiles).
"""
from __future__ import annotations

import itertools

from jax_fusedloss.kernels import cross_entropy as ce
from jax_fusedloss.kernels import kd
from jax_fusedloss.kernels import kd_tail
from jax_fusedloss.kernels import reductions as red
from jax_fusedloss.kernels.plan import LOGITS

SMS = 132  # H100 / H200
DTYPES = ("bf16", "fp16", "fp32")
SHAPES = ((8192, 128256), (8, 128256), (8192, 50257), (8, 50257))
# Every dtype at the aligned vocabulary (ALIGN=16), bf16 and fp32 (8 and 4 elements per
# 16-byte vector) at the unaligned one (ALIGN=1).
CASES = tuple((dt, shape) for dt in DTYPES for shape in SHAPES[:2]) + tuple(
    (dt, shape) for dt in ("bf16", "fp32") for shape in SHAPES[2:])
# KD: every dtype aligned, bf16 unaligned.
KD_CASES = tuple((dt, shape) for dt in DTYPES for shape in SHAPES[:2]) + tuple(
    ("bf16", shape) for shape in SHAPES[2:])
TYPES = {"float32": "fp32", "int32": "i32"}
# The fused forward + gradient prefetches from V = launch.PREFETCH_MIN_VOCAB: its unaligned
# compiles (V=50257, no prefetch) get their aligned twins from a short aligned row.
SHORT_ROWS = (8192, 32000)
# The one-launch split forward + gradient runs for long rows only (launch.split_fused_config):
# float32 at V=128256 (one of CASES) and an unaligned twin, bf16 at V=256000 and its twin.
SPLIT_ROWS = (("fp32", (8192, 128255)), ("bf16", (8192, 256000)), ("bf16", (8192, 255999)))
# The fused forward + gradient keeps tiles in registers on long rows (launch.keep_tiles): two
# for bf16 at V=151936 (and its unaligned twin), one for float32 at V=50257 (one of CASES),
# whose aligned twin is V=50256.
KEEP_ROWS = (("bf16", (8192, 151936)), ("bf16", (8192, 151935)), ("fp32", (8192, 50256)))
KD_KEEP_ROWS = ((8192, 151935), (8192, 151936))
# The vocabulary-parallel rows (kd_partials_plan, kd_bwd_plan) on one device's slice: V=128256
# over 2 devices in every dtype, bf16 at an unaligned slice, and a slice of V=151936 over 2
# (75968 columns, distill_loss's power form from launch.KD_POWER_MIN_VOCAB).
KD_VP_CASES = tuple((dt, shape) for dt in DTYPES for shape in ((8192, 64128), (8, 64128))) + (
    ("bf16", (8192, 50257)), ("bf16", (8, 50257)), ("bf16", (8192, 75968)))


def _itemsize(dt: str) -> int:
    return 4 if dt == "fp32" else 2


def _specs(plan, dt: str, inputs: dict[str, str]):
    """(kernel, signature, constexprs, warps, register cap) of each launch of a plan; `inputs`
    gives the plan inputs' types ("x" is the logits, of dtype dt)."""
    env = dict(inputs, x=f"*{dt}")
    for step in plan.launches:
        types = [env[i] if isinstance(i, str) else env["x"] if i.dtype == LOGITS
                 else f"*{TYPES[i.dtype]}" for i in step.inputs]
        types += ["fp32" if isinstance(s, float) else "i32" for s in step.scalars]
        outs = [f"*{dt}" if b.dtype == LOGITS else f"*{TYPES[b.dtype]}" for b in step.outputs]
        env.update((b.name, t) for b, t in zip(step.outputs, outs))
        names = [p.name for p in step.kernel.params if not p.is_constexpr]
        assert len(names) == len(types + outs), (step.kernel.__name__, names, types, outs)
        yield (step.kernel, dict(zip(names, types + outs)), dict(step.constexprs), step.num_warps,
               step.maxnreg)


def _ce():
    f32, i32 = "*fp32", "*i32"
    options = (dict(ignore_index=-100, smoothing=0.0, z_loss=0.0, softcap=None),
               dict(ignore_index=-100, smoothing=0.1, z_loss=1e-4, softcap=30.0))
    for (dt, (n, v)), opts in itertools.product(CASES, options):
        for write_grad in (True, False):
            yield from _specs(ce.ce_fwd_plan(n, v, num_sms=SMS, write_grad=write_grad,
                                             itemsize=_itemsize(dt), **opts),
                              dt, dict(y=i32, row_scale=f32))
        yield from _specs(ce.ce_bwd_plan(n, v, softcap=opts["softcap"], num_sms=SMS), dt,
                          dict(y=i32, lse=f32, coef=f32))
        yield from _specs(ce.ce_partials_plan(n, v, softcap=opts["softcap"],
                                              smoothing=opts["smoothing"], num_sms=SMS),
                          dt, dict(y=i32))
        if (n, v) == SHAPES[2]:
            yield from _specs(ce.ce_fwd_plan(*SHORT_ROWS, num_sms=SMS, write_grad=True,
                                             itemsize=_itemsize(dt), **opts),
                              dt, dict(y=i32, row_scale=f32))
    for (dt, (n, v)), opts in itertools.product(SPLIT_ROWS + KEEP_ROWS, options):
        yield from _specs(ce.ce_fwd_plan(n, v, num_sms=SMS, write_grad=True,
                                         itemsize=_itemsize(dt), **opts),
                          dt, dict(y=i32, row_scale=f32))
    for dt, (n, v) in CASES:
        yield from _specs(ce.scale_rows_plan(n, v, _itemsize(dt)), dt,
                          dict(grad=f"*{dt}", cot="*fp32"))


def _reductions():
    for (dt, (n, v)), entropy, has_label in itertools.product(CASES, (False, True),
                                                               (False, True)):
        kw = dict(inv_temp=1.0 / 0.7, entropy=entropy, has_label=has_label, num_sms=SMS)
        types = dict(y="*i32", lse="*fp32", lse_lo="*fp32", ent="*fp32", cot="*fp32")
        for plan in (red.red_fwd_plan, red.red_partials_plan, red.red_bwd_plan):
            yield from _specs(plan(n, v, **kw), dt, types)


def _kd():
    ce_opts = dict(smoothing=0.1, z_loss=1e-4, softcap=30.0)  # distill_loss's CE options
    options = (("full", False, 2.0, {}), ("topk", False, 1.0, {}), ("full", True, 1.0, {}),
               ("full", True, 2.0, {}), ("topk", True, 2.0, {}), ("full", True, 1.0, ce_opts),
               ("full", True, 2.0, ce_opts), ("topk", True, 2.0, ce_opts))
    types = dict(ids="*i32", lp="*fp32", y="*i32", row_scale="*fp32")
    for (dt, (n, v)), (normalize, distill, t, extra), write_grad in itertools.product(
            KD_CASES, options, (True, False)):
        yield from _specs(kd.kd_fwd_plan(n, v, 64, temperature=t, normalize=normalize,
                                         distill=distill, ignore_index=-100, num_sms=SMS,
                                         write_grad=write_grad, itemsize=_itemsize(dt), **extra),
                          dt, types)
        if (n, v) == SHAPES[2] and write_grad:
            yield from _specs(kd.kd_fwd_plan(*SHORT_ROWS, 64, temperature=t, normalize=normalize,
                                             distill=distill, ignore_index=-100, num_sms=SMS,
                                             write_grad=True, itemsize=_itemsize(dt), **extra),
                              dt, types)
    # the fused walk keeping two tiles (16-bit, V=128256 above) at an unaligned V and its twin
    for (n, v), (normalize, distill, t, extra) in itertools.product(KD_KEEP_ROWS, options):
        yield from _specs(kd.kd_fwd_plan(n, v, 64, temperature=t, normalize=normalize,
                                         distill=distill, ignore_index=-100, num_sms=SMS,
                                         write_grad=True, itemsize=2, **extra), "bf16", types)
    for k in (1, 128):
        yield from _specs(kd.kd_fwd_plan(8192, 128256, k, temperature=2.0, normalize="full",
                                         distill=True, ignore_index=-100, num_sms=SMS,
                                         write_grad=True, itemsize=2), "bf16", types)
    # the LM head's chunks: the gradient written over the logits (in_place)
    for normalize, distill, t, extra in options:
        yield from _specs(kd.kd_fwd_plan(4096, 128256, 64, temperature=t, normalize=normalize,
                                         distill=distill, ignore_index=-100, num_sms=SMS,
                                         write_grad=True, itemsize=2, in_place=True, **extra),
                          "bf16", types)
    bwd_types = dict(ids="*i32", lp="*fp32", y="*i32", stats="*fp32", offset="*i32")
    for (dt, (n, v)), (normalize, distill, t, extra) in itertools.product(KD_VP_CASES, options):
        slice_opts = dict(temperature=t, normalize=normalize, distill=distill, num_sms=SMS,
                          smoothing=extra.get("smoothing", 0.0), softcap=extra.get("softcap"),
                          itemsize=_itemsize(dt))
        if distill or normalize == "full":  # "topk" kd_loss takes no statistics pass
            # as the vocabulary-parallel rows call it: gathering the label and 64 ids
            yield from _specs(kd.kd_partials_plan(n, v, gather_k=64, **slice_opts), dt,
                              dict(ids="*i32", y="*i32", offset="*i32"))
        yield from _specs(kd.kd_bwd_plan(n, v, 64, vocab_total=2 * v, ignore_index=-100,
                                         z_loss=extra.get("z_loss", 0.0), **slice_opts),
                          dt, bwd_types)


def _kd_tail():
    """The tail forms (kernels/kd_tail.py): the fused forward + gradient, the forward alone and
    the backward; every dtype aligned, bf16 unaligned (each with its aligned twin)."""
    ce_opts = dict(smoothing=0.1, z_loss=1e-4, softcap=30.0)
    options = (("kl", False, 1.0, {}), ("jsd", False, 2.0, {}), ("kl", True, 2.0, {}),
               ("jsd", True, 1.0, ce_opts))
    types = dict(ids="*i32", lp="*fp32", y="*i32", row_scale="*fp32", stats="*fp32",
                 offset="*i32")
    for (dt, (n, v)), (div, distill, t, extra) in itertools.product(KD_CASES, options):
        kw = dict(temperature=t, divergence=div, beta=0.3, distill=distill, ignore_index=-100,
                  **extra)
        for write_grad, in_place in ((True, False), (False, False), (True, True)):
            if in_place and dt != "bf16":
                continue  # the LM head's chunks, bf16
            yield from _specs(kd_tail.tail_fwd_plan(n, v, 64, write_grad=write_grad,
                                                    num_sms=SMS, itemsize=_itemsize(dt),
                                                    in_place=in_place, **kw),
                              dt, types)
        yield from _specs(kd_tail.tail_bwd_plan(n, v, 64, num_sms=SMS, **kw), dt, types)


def _head_gemm():
    """The LM head's fused statistics GEMM (kernels/head_gemm.py) with the GPU's tiles: both
    weight layouts with the bias and the entropy, without them, and fp16 once."""
    from jax_fusedloss.kernels import head_gemm

    cfg = head_gemm.config(True)
    names = [p.name for p in head_gemm.head_stats_kernel.params if not p.is_constexpr]
    for dt, dv, extra in (("bf16", True, True), ("bf16", False, True), ("bf16", True, False),
                          ("fp16", False, True)):
        types = [f"*{dt}", f"*{dt}", f"*{dt}", "*i32", "i32", "i32", "i32", "fp32", "*fp32"]
        yield (head_gemm.head_stats_kernel, dict(zip(names, types)),
               dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"],
                    PROGRAMS=SMS, DV=dv, HAS_BIAS=extra, ENTROPY=extra, F32_DOT=False,
                    FLATTEN=True, WARP_SPECIALIZE=True), cfg["num_warps"], None)


def _head_grad():
    """The lean backward's fused gradient GEMM (kernels/head_gemm.py): each layout with and
    without the log term (token log-probs' with entropy, cross-entropy's) and with TMA and
    plain stores, fp16 once."""
    from jax_fusedloss.kernels import head_gemm

    cfg = head_gemm.config(True)
    names = [p.name for p in head_gemm.head_grad_kernel.params if not p.is_constexpr]
    for dt, dv, log_term, tma in (("bf16", True, True, True), ("bf16", False, True, False),
                                  ("bf16", True, False, False), ("bf16", False, False, True),
                                  ("fp16", True, True, True)):
        types = [f"*{dt}", f"*{dt}", f"*{dt}", "*i32", "*fp32", "*i32", "i32", "i32", "i32",
                 "i32", "fp32", f"*{dt}"]
        yield (head_gemm.head_grad_kernel, dict(zip(names, types)),
               dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"],
                    PROGRAMS=SMS, DV=dv, HAS_BIAS=not log_term, LOG_TERM=log_term,
                    TMA_STORE=tma, F32_DOT=False, FLATTEN=True, WARP_SPECIALIZE=True),
               cfg["num_warps"], None)


def _head_dw():
    """The lean backward's dW blocks written in place (kernels/head_gemm.py): both layouts,
    fp16 once."""
    from jax_fusedloss.kernels import head_gemm

    cfg = head_gemm.config(True)
    names = [p.name for p in head_gemm.head_dw_kernel.params if not p.is_constexpr]
    for dt, dv in (("bf16", True), ("bf16", False), ("fp16", False)):
        types = [f"*{dt}", f"*{dt}", "*i32", f"*{dt}", "i32", "i32", "i32", "i32", f"*{dt}"]
        yield (head_gemm.head_dw_kernel, dict(zip(names, types)),
               dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"],
                    PROGRAMS=SMS, DV=dv, F32_DOT=False, FLATTEN=True, WARP_SPECIALIZE=True),
               cfg["num_warps"], None)


# Constexprs that only size a loop bound or a merge (the vocabulary slice a program walks, how
# many partials a row merges): each value compiled once, not in every combination.
SIZES = ("SPLIT_V", "NUM_SPLITS", "BLOCK_S")
# What sets a compile's tiles and layouts; with the element width, warps and register cap one
# factor of `covering`, so each branch compiles in each of them.
TILES = ("ALIGN", "BLOCK_V", "BLOCK_K", "BLOCK_C", "KEEP")
# The compile families (tests/test_compile_sm90.py runs one child process each). The LM head's
# GEMMs are hand-picked already (a dozen) and all compiled.
FAMILIES = {"ce": (_ce,), "reductions": (_reductions,), "kd": (_kd,), "kd_tail": (_kd_tail,),
            "head_gemm": (_head_gemm, _head_grad, _head_dw)}
COVERED = ("ce", "reductions", "kd", "kd_tail")


def twin_key(name, signature, constexprs, num_warps):
    """A compile's key up to its vocabulary: ALIGN, what the plans choose by alignment
    (WALK_GATHER: launch.kd_walk_gathers) or by row length without touching the loads and
    stores (CE_STATS, distill_loss's power form: launch.kd_power) and the split sizes set
    aside."""
    rest = tuple(sorted((k, v) for k, v in constexprs.items()
                        if k not in ("ALIGN", "WALK_GATHER", "CE_STATS") + SIZES))
    return name, tuple(signature.items()), rest, num_warps


def launches(family: str | None = None):
    """Every distinct compile of the plans' grids (of one family, or all), in a stable order."""
    seen = set()
    gens = FAMILIES.values() if family is None else (FAMILIES[family],)
    for kernel, sig, constexprs, warps, maxnreg in itertools.chain.from_iterable(
            g() for gs in gens for g in gs):
        key = (kernel.__name__, tuple(sig.items()), tuple(sorted(constexprs.items())), warps,
               maxnreg)
        if key not in seen:
            seen.add(key)
            yield kernel, sig, constexprs, warps, maxnreg


def _requirements(spec) -> set:
    """What one compile covers: each pair of its factors (the tile layout: element width,
    warps, register cap and TILES; whether it is float16; each other constexpr but SIZES) and
    each of its SIZES values."""
    kernel, sig, constexprs, warps, maxnreg = spec
    dtype = next(iter(sig.values()))
    factors = {"<layout>": (dtype != "*fp32", warps, maxnreg,
                            *(constexprs.get(t) for t in TILES)),
               "<fp16>": dtype == "*fp16"}
    factors.update((k, v) for k, v in constexprs.items() if k not in TILES + SIZES)
    items = sorted(factors.items(), key=lambda kv: kv[0])
    return ({("pair", a, b) for a, b in itertools.combinations(items, 2)}
            | {("one", a) for a in items}
            | {("size", k, v) for k, v in constexprs.items() if k in SIZES})


def covering(candidates: list) -> list:
    """A subset of the candidates (one kernel's or many) that covers every requirement of
    every candidate (`_requirements`, per kernel), each unaligned compile with its aligned
    twin; greedy (most new requirements per compile first), deterministic, in the candidates'
    order."""
    aligned = {}
    for i, (kernel, sig, cx, warps, _) in enumerate(candidates):
        if cx.get("ALIGN") == 16:
            aligned.setdefault(twin_key(kernel.__name__, sig, cx, warps), i)

    def group(i):  # a compile and what must come with it
        kernel, sig, cx, warps, _ = candidates[i]
        if "ALIGN" in cx and cx["ALIGN"] < 16:
            twin = aligned.get(twin_key(kernel.__name__, sig, cx, warps))
            return (i,) if twin is None else (i, twin)
        return (i,)

    reqs = [{(c[0].__name__, r) for r in _requirements(c)} for c in candidates]
    todo = set().union(*reqs) if reqs else set()
    chosen: set[int] = set()
    while todo:
        best, best_gain = None, 0.0
        for i in range(len(candidates)):
            if i in chosen:
                continue
            new = [j for j in group(i) if j not in chosen]
            gain = len(set().union(*(reqs[j] for j in new)) & todo) / len(new)
            if gain > best_gain:
                best, best_gain = new, gain
        chosen.update(best)
        for j in best:
            todo -= reqs[j]
    return [candidates[i] for i in sorted(chosen)]


def specs(family: str | None = None):
    """The compiles to run (of one family, or all): `covering` of each covered family's
    launches, every launch of the others."""
    for name in FAMILIES if family is None else (family,):
        candidates = list(launches(name))
        yield from covering(candidates) if name in COVERED else candidates
