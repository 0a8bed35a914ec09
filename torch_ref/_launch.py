"""Launching the framework-free kernels from PyTorch: `kernel[grid](*inputs, *scalars, *outputs)`.

On CUDA tensors the kernels compile; on CPU tensors they need Triton's interpreter
(TRITON_INTERPRET=1 before triton is imported).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from jax_fusedloss.kernels.launch import DEFAULT_NUM_SMS


def num_sms(t: torch.Tensor) -> int:
    if t.is_cuda:
        return torch.cuda.get_device_properties(t.device).multi_processor_count
    return DEFAULT_NUM_SMS


def run_plan(plan, **tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Executes a launch plan (jax_fusedloss/kernels/plan.py) over named tensors, which must be
    contiguous (plans pass the row length as the row stride); returns the plan's results.
    Buffers of dtype "logits" take the dtype of the first tensor."""
    env = dict(tensors)
    x = next(iter(tensors.values()))
    if not x.is_contiguous():
        raise ValueError("run_plan needs contiguous logits rows")
    dtypes = {"float32": torch.float32, "int32": torch.int32, "logits": x.dtype}
    for step in plan.launches:
        inputs = [env[i] if isinstance(i, str) else
                  torch.zeros(i.shape, dtype=dtypes[i.dtype], device=x.device)
                  for i in step.inputs]
        aliased = {o: i for i, o in step.aliases}  # written in place: the input's storage
        outs = [inputs[aliased[k]] if k in aliased else
                torch.empty(b.shape, dtype=dtypes[b.dtype], device=x.device)
                for k, b in enumerate(step.outputs)]
        launch(step.kernel, step.grid, inputs, step.scalars, outs, step.num_warps,
               step.constexprs, step.maxnreg)
        env.update((b.name, o) for b, o in zip(step.outputs, outs))
    return tuple(env[name] for name in plan.results)


def launch(kernel, grid: tuple[int, ...], inputs: Sequence[Any], scalars: Sequence[Any],
           outputs: Sequence[torch.Tensor], num_warps: int = 4, constexprs: dict | None = None,
           maxnreg: int | None = None):
    if not inputs[0].is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("torch_ref on CPU tensors runs the kernels through Triton's "
                           "interpreter: set TRITON_INTERPRET=1 before triton is imported")
    # FP fusion (FMA contraction) stated, as jax-triton states it for the JAX path: Triton 3.9
    # warns that its default turns it off in 3.10, and both frameworks must compile the same.
    extra = {"num_warps": num_warps, "enable_fp_fusion": True} if inputs[0].is_cuda else {}
    if maxnreg is not None and inputs[0].is_cuda:
        extra["maxnreg"] = maxnreg
    kernel[grid](*inputs, *scalars, *outputs, **extra, **(constexprs or {}))
    return outputs
