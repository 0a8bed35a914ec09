"""Compiles the kernel launches of the libraries' launch plans (tests/sm90_plans.py: every
kernel, every constexpr value and pair of them) for sm_90 with the real Triton compiler, and
checks that rows whose width V is not a multiple of 16 bytes still load and store 16-byte
vectors (_online's aligned tile walk).

Run as a script in its own process (TRITON_INTERPRET unset), for one family of
sm90_plans.FAMILIES (`python tests/sm90_compile.py kd`) or all of them (no argument); exits
non-zero if any compile fails or a vector check fails. The interpreter accepts kernels the
compiler rejects; this catches them without a GPU. Array arguments are declared 16-byte
aligned and scalars without divisibility, as jax-triton compiles them.
"""
import os
import re
import sys
import time
from collections import defaultdict

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.sm90_plans import FAMILIES, launches, specs, twin_key  # noqa: E402

# 128-bit global accesses: ld.global[.nc][.L1::...][.L2::...].v4.b32 (Triton packs 8 halves or
# 4 floats into 4 32-bit registers), st.global[...].v4.b32.
VECTOR_LOAD = re.compile(r"\bld\.global[\w.:]*\.v4\.[bfu]32\b")
VECTOR_STORE = re.compile(r"\bst\.global[\w.:]*\.v4\.[bfu]32\b")
# Kernels that walk logits rows (every launch of these has ALIGN) and those that also write
# a [N, V] row.
ROW_WALKERS = ("red_fwd_kernel", "red_bwd_kernel", "ce_fwd_kernel", "ce_partial_kernel",
               "ce_bwd_kernel", "scale_rows_kernel", "kd_fwd_kernel", "kd_partial_kernel",
               "kd_bwd_kernel", "ce_split_fused_kernel", "tail_fwd_kernel", "tail_bwd_kernel")
ROW_WRITERS = ("red_bwd_kernel", "ce_fwd_kernel", "ce_bwd_kernel", "scale_rows_kernel",
               "kd_fwd_kernel", "kd_bwd_kernel", "ce_split_fused_kernel", "tail_fwd_kernel",
               "tail_bwd_kernel")


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int,
                 maxnreg: int | None = None):
    """triton.compile for sm_90 with jax-triton's assumptions: pointers 16-byte aligned;
    `maxnreg` as the plan's register cap (plan.Launch.maxnreg)."""
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, t in signature.items() if t.startswith("*")}
    sig = dict(signature, **{c: "constexpr" for c in constexprs})
    options = dict(num_warps=num_warps, enable_fp_fusion=True)  # as jax-triton and torch_ref
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def vector_ops(ptx: str) -> tuple[int, int]:
    """(128-bit global loads, 128-bit global stores) in a kernel's PTX."""
    return len(VECTOR_LOAD.findall(ptx)), len(VECTOR_STORE.findall(ptx))


def vector_problems(results, walkers=ROW_WALKERS) -> list[str]:
    """Checks compiles of unaligned rows (ALIGN below the 16-byte vector width of their
    dtype) against their aligned twins (ALIGN=16, otherwise the same compile): the same
    number of 128-bit loads and stores, and, for each row-walking kernel, some unaligned compile
    with 128-bit loads (and stores where it writes rows). `results`: (kernel name, signature,
    constexprs, warps, (loads, stores)) of each compile; `walkers`: the row-walking kernels
    expected among them."""
    aligned = {}
    unaligned = []
    for name, sig, cx, warps, vec in results:
        if "ALIGN" not in cx:
            continue
        itemsize = {"*bf16": 2, "*fp16": 2, "*fp32": 4}[next(iter(sig.values()))]
        key = twin_key(name, sig, cx, warps)
        if cx["ALIGN"] == 16:
            aligned[key] = vec
        elif cx["ALIGN"] < 16 // itemsize:
            unaligned.append((key, cx, vec))
    problems = []
    seen = defaultdict(lambda: [0, 0])
    for key, cx, vec in unaligned:
        twin = aligned.get(key)
        if twin is None:
            problems.append(f"no aligned twin for {key[0]} {cx}")
        elif vec != twin:
            problems.append(f"{key[0]} {key[1][0][1]} {cx}: (loads, stores) of 128 bits "
                            f"{vec} unaligned vs {twin} aligned")
        seen[key[0]][0] += vec[0] > 0
        seen[key[0]][1] += vec[1] > 0
    for name in walkers:
        loads, stores = seen[name]
        if not loads or (name in ROW_WRITERS and not stores):
            problems.append(f"{name}: no unaligned compile with 128-bit loads"
                            + (" and stores" if name in ROW_WRITERS else ""))
    return problems


H100_SHARED_BYTES = 232448  # the opt-in maximum a block may use (227 KiB)


def _check_head_gemm(compiled, num_warps: int) -> None:
    """A fused head GEMM as JAX launches it: within the global scratch a program gets
    (head_gemm.SCRATCH_BYTES) and an H100's shared memory, at the warps asked for
    (jax-triton launches those, not a warp-specialised total), its operands through TMA and
    its products on wgmma. (Compiled at Triton's default 3 stages, which the configs use.)"""
    from jax_fusedloss.kernels import head_gemm

    meta, ptx = compiled.metadata, compiled.asm["ptx"]
    if not 0 < meta.global_scratch_size <= head_gemm.SCRATCH_BYTES:
        raise AssertionError(f"global scratch {meta.global_scratch_size} B a program, "
                             f"{head_gemm.SCRATCH_BYTES} passed")
    if meta.shared > H100_SHARED_BYTES:
        raise AssertionError(f"{meta.shared} B of shared memory, over an H100's")
    if meta.num_warps != num_warps:
        raise AssertionError(f"{meta.num_warps} warps compiled, {num_warps} launched")
    if "cp.async.bulk.tensor" not in ptx or "wgmma.mma_async" not in ptx:
        raise AssertionError("no TMA loads or no wgmma in the PTX")


def main(family: str | None = None) -> int:
    todo = list(specs(family))
    names = {kernel.__name__ for kernel, *_ in todo}
    # all families: every row walker expected; one: those it compiles (test_compile_sm90
    # checks that the families together compile every row walker)
    walkers = ROW_WALKERS if family is None else [n for n in ROW_WALKERS if n in names]
    failures = 0
    results = []
    for kernel, signature, constexprs, num_warps, maxnreg in todo:
        name = kernel.__name__
        t0 = time.time()
        try:
            compiled = compile_sm90(kernel, signature, constexprs, num_warps, maxnreg)
            vec = vector_ops(compiled.asm["ptx"])
            if maxnreg is not None and f".maxnreg {maxnreg}" not in compiled.asm["ptx"]:
                raise AssertionError(f"the register cap {maxnreg} is not in the PTX")
            if name.startswith("head_"):
                _check_head_gemm(compiled, num_warps)
            results.append((name, signature, constexprs, num_warps, vec))
            print(f"ok   {name} {constexprs} shared={compiled.metadata.shared}B "
                  f"v4 ld/st={vec[0]}/{vec[1]} {time.time() - t0:.1f}s", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failing kernel, then fail
            failures += 1
            print(f"FAIL {name} {signature} {constexprs}: {type(e).__name__}: {e}", flush=True)
    problems = vector_problems(results, walkers)
    for p in problems:
        print(f"VECTOR {p}")
    print(f"{len(results) + failures} compiles, {failures} failures, "
          f"{len(problems)} vector problems")
    return 1 if failures or problems or not results else 0


def check_families() -> int:
    """Without compiling: the families' compiles together hold every kernel of the plans and
    every row walker of the vector check (each family's run checks only the walkers it
    compiles)."""
    planned_launches, chosen = list(launches()), list(specs())
    planned = {kernel.__name__ for kernel, *_ in planned_launches}
    compiled = {kernel.__name__ for kernel, *_ in chosen}
    missing = (planned - compiled) | (set(ROW_WALKERS) - compiled)
    print(f"{len(planned_launches)} launches, {len(chosen)} compiles of "
          f"{len(compiled)} kernels; missing: {sorted(missing) or 'none'}")
    return 1 if missing else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--check-families"]:
        sys.exit(check_families())
    if len(sys.argv) > 1 and sys.argv[1] not in FAMILIES:
        sys.exit(f"unknown family {sys.argv[1]!r}: one of {', '.join(FAMILIES)}")
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
