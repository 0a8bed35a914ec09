"""The conformance cases of issue 31 (benchmarks/conformance_cases.py) on our implementations:
every case x dtype x {Triton from JAX, Triton from torch_ref, the XLA twin} must pass, against
the same float64 oracle, metrics and tolerances as `python -m benchmarks.conformance`.

On the CPU Triton runs in its interpreter and the GPU-only case (N * V > 2**31) is skipped;
`-m gpu` runs every case, that one included, through the compiled kernels."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from benchmarks import conformance_cases as cc
from benchmarks import conformance_impls as ci
from benchmarks.conformance import case_rows
from benchmarks.conformance_metrics import oracle
from tests.helpers import HAS_GPU

PARAMS = [(c.name, d, i) for c in cc.CASES for d in c.dtypes for i in ci.OURS]


@functools.cache
def _inputs(case_name: str, dtype: str):
    case = cc.BY_NAME[case_name]
    inp = case.build(np.random.default_rng(case.seed), dtype, HAS_GPU)
    return inp, oracle(case.op, inp, case.opts())


def _check(case_name: str, dtype: str, impl_name: str) -> None:
    from benchmarks.conformance import evaluate

    case, impl = cc.BY_NAME[case_name], ci.BY_NAME[impl_name]
    reason = ci.unsupported(impl, case.op, case.required())
    if reason:  # only torch_ref's missing vocabulary parallelism is expected here
        assert (impl_name, reason) == ("ours_torch_ref", "no option vocab_parallel"), reason
        pytest.skip(reason)
    inp, expected = _inputs(case_name, dtype)
    cell = evaluate(case, dtype, impl, HAS_GPU, inp, expected)
    if cell["status"] == "n/a" and cell["detail"].startswith("needs 2+ GPUs"):
        pytest.skip(cell["detail"])
    assert cell["status"] == "pass", f"{case_name} [{dtype}] on {impl_name}: {cell}"


CPU_PARAMS = [p for p in PARAMS if not cc.BY_NAME[p[0]].gpu_only]


@pytest.mark.parametrize("case_name,dtype,impl_name", CPU_PARAMS)
def test_conformance_cpu(case_name, dtype, impl_name, interpreter):
    _check(case_name, dtype, impl_name)


@pytest.mark.gpu
@pytest.mark.parametrize("case_name,dtype,impl_name", PARAMS)
def test_conformance_gpu(case_name, dtype, impl_name):
    _check(case_name, dtype, impl_name)


def test_every_case_row_is_recorded(monkeypatch):
    """A failing implementation is one "error" cell, never the end of the run; options an
    implementation lacks are "n/a"."""
    def boom(op, inp, opts):
        raise RuntimeError("kaput")

    broken = ci.Impl("broken", False, {"ce": frozenset({"loss_scale"})}, boom)
    case = cc.BY_NAME["all_ignored"]
    cells = dict(case_rows(case, "fp32", [broken, ci.BY_NAME["optax"]], gpu=False))
    assert cells["broken"]["status"] == "n/a" and "ignore_index" in cells["broken"]["detail"]
    case = cc.BY_NAME["loss_in_input_dtype"]
    cells = dict(case_rows(case, "bf16", [broken], gpu=False))
    assert cells["broken"]["status"] == "error" and "kaput" in cells["broken"]["detail"]
