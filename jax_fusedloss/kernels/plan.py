"""Launch plans: the kernel launches of one pass, as data that JAX and PyTorch both execute.

A kernel family's plan function (`ce_fwd_plan`, `red_bwd_plan`, ...) is a pure function of
shapes, options and the multiprocessor count; it returns a `Plan`: launches over named arrays.
Each launch reads arrays by name (the plan's inputs, or outputs of earlier launches), passes
its scalars, writes the output buffers it declares and binds them by name. Executors:
`jax_fusedloss._triton_jax.run_plan` (jax-triton on a GPU, the interpreter elsewhere) and
`torch_ref._launch.run_plan`. The sm_90 compile check (tests/sm90_compile.py) walks the same
plans. Kernels take `(inputs..., scalars..., outputs..., CONSTEXPRS)`, so a launch is
`kernel[grid](*inputs, *scalars, *outputs, **constexprs)` in both frameworks.

Imports triton only (through the kernel modules), never jax or torch.
"""
from __future__ import annotations

from typing import Any, NamedTuple

# Buffer dtypes: "float32", "int32", or "logits" (whatever dtype the plan's "x" input has).
LOGITS = "logits"


class Buf(NamedTuple):
    """An array a launch writes: `name` binds it for later launches and the plan's results."""
    name: str
    shape: tuple[int, ...]
    dtype: str


class Zeros(NamedTuple):
    """A zero-filled input for an optional operand the kernel does not read (its flag is off):
    kernels always take every pointer."""
    shape: tuple[int, ...]
    dtype: str


class Launch(NamedTuple):
    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    inputs: tuple  # names (str) or Zeros
    scalars: tuple  # Python ints and floats (floats travel as float32)
    outputs: tuple[Buf, ...]
    num_warps: int
    constexprs: dict
    aliases: tuple[tuple[int, int], ...] = ()  # (input index, output index): written in place
    # A cap on registers a thread (Triton's `maxnreg`, PTX .maxnreg) or None. jaxlib turns the
    # PTX jax-triton hands it into machine code with its own compiler, which may allocate more
    # registers than Triton's ptxas does for PyTorch (fewer programs per SM); the cap makes
    # both the same where that matters (launch.SPLIT_FUSED_KEPT). A function of the kernel,
    # its constexprs and warps: jax-triton's compile cache does not key on it.
    maxnreg: int | None = None
    # The kernel writes only part of an aliased output and leaves the rest as the input held
    # it (in place), so its aliased operand and output must be one buffer. XLA's dynamic-slice
    # fusion breaks that for typed-FFI custom calls: inside a loop it gave such an output a
    # slice of the loop's accumulator and left the input in another buffer (H100, jax 0.11.2:
    # linear KD's "lean" dW came back 0); jax-triton's legacy custom call is not fused there.
    # The JAX executor sends these launches through the legacy call (_triton_jax.launch).
    partial_alias: bool = False


class Plan(NamedTuple):
    launches: tuple[Launch, ...]
    results: tuple[str, ...]  # names of the arrays the pass returns, in order


def placeholder(name: str, dtype: str = "float32") -> Buf:
    """A 1-element output for a pointer the kernel does not write (its flag is off)."""
    return Buf(name, (1,), dtype)
