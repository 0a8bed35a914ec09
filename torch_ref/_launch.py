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


def launch(kernel, grid: tuple[int, ...], inputs: Sequence[Any], scalars: Sequence[Any],
           outputs: Sequence[torch.Tensor], num_warps: int = 4, constexprs: dict | None = None):
    if not inputs[0].is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("torch_ref on CPU tensors runs the kernels through Triton's "
                           "interpreter: set TRITON_INTERPRET=1 before triton is imported")
    extra = {"num_warps": num_warps} if inputs[0].is_cuda else {}
    kernel[grid](*inputs, *scalars, *outputs, **extra, **(constexprs or {}))
    return outputs
