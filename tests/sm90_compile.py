"""Compiles every kernel launch of the libraries' launch plans (tests/sm90_plans.py) for sm_90
with the real Triton compiler.

Run as a script in its own process (TRITON_INTERPRET unset); exits non-zero if any compile
fails. The interpreter accepts kernels the compiler rejects; this catches them without a GPU.
"""
import os
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(here))
    from tests.sm90_plans import specs

    failures = 0
    count = 0
    for kernel, signature, constexprs, num_warps in specs():
        name = kernel.__name__
        sig = dict(signature, **{c: "constexpr" for c in constexprs})
        t0 = time.time()
        try:
            compiled = triton.compile(ASTSource(kernel, sig, constexprs),
                                      target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=num_warps))
            print(f"ok   {name} {constexprs} shared={compiled.metadata.shared}B "
                  f"{time.time() - t0:.1f}s", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failing kernel, then fail
            failures += 1
            print(f"FAIL {name} {signature} {constexprs}: {type(e).__name__}: {e}", flush=True)
        count += 1
    print(f"{count} compiles, {failures} failures")
    return 1 if failures or not count else 0


if __name__ == "__main__":
    sys.exit(main())
