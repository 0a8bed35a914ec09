"""The one place that launches Triton kernels from JAX.

On a CUDA GPU: `jax_triton.triton_call` (the real custom call). Anywhere else: the very same
kernel through Triton's interpreter inside `jax.pure_callback`, which needs TRITON_INTERPRET=1
in the environment before triton is first imported. Kernels are always launched as
`kernel(*inputs, *scalars, *outputs, **constexprs)`.

Import hygiene: nothing here imports triton, torch or jax_triton at module import; jax_triton
0.3.1 blanks TRITON_CACHE_DIR when imported, so we restore it right after. All three are
optional dependencies: the base package runs the XLA twin with jax alone. When one is missing,
`check_triton_available` raises `MissingDependencyError`, which names the extra to install.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_INTERPRET_LOCK = threading.Lock()  # the interpreter is not thread-safe

_GPU_EXTRA = 'pip install "jax-fusedloss[gpu]"'
_TORCH_EXTRA = 'pip install "jax-fusedloss[torch]"'


class MissingDependencyError(NotImplementedError, ImportError):
    """An optional dependency of implementation="triton" is not installed.

    An ImportError for the user who forced implementation="triton", and a NotImplementedError
    for the dispatcher, which then falls through to the XLA twin when implementation=None.
    """


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _require(modules: Sequence[str], why: str, extra: str) -> None:
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise MissingDependencyError(
            f'implementation="triton" {why} needs '
            f'{" and ".join(m.replace("_", "-") for m in missing)}: {extra}')


def on_cuda_gpu() -> bool:
    """True when JAX's default backend is a CUDA GPU (where the compiled path runs)."""
    try:
        version = jax.devices()[0].client.platform_version.lower()
        return jax.default_backend() == "gpu" and "cuda" in version
    except Exception:  # noqa: BLE001 - any failure to query means no CUDA GPU
        return jax.default_backend() == "gpu"


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms() -> int:
    """Multiprocessor count of the default device (the launch heuristics' input)."""
    from jax_fusedloss.kernels.launch import DEFAULT_NUM_SMS

    if on_cuda_gpu():
        return int(getattr(jax.devices()[0], "core_count", DEFAULT_NUM_SMS))
    return DEFAULT_NUM_SMS


def has_tma() -> bool:
    """Whether the default device is a CUDA GPU with TMA (compute capability 9.0 or newer: H100,
    H200, B200), which kernels/head_gemm.py's descriptors need."""
    if not on_cuda_gpu():
        return False
    try:
        return float(getattr(jax.devices()[0], "compute_capability", "0")) >= 9.0
    except (TypeError, ValueError):
        return False


def check_triton_available() -> None:
    """Raises NotImplementedError when the "triton" implementation cannot run in this process.

    A missing optional dependency raises `MissingDependencyError` (both a NotImplementedError
    and an ImportError) with the pip command that installs it.
    """
    if on_cuda_gpu():
        _require(("triton", "jax_triton"), "on a CUDA GPU", _GPU_EXTRA)
        return
    _require(("triton", "torch"), "without a CUDA GPU (Triton's interpreter)",
             f'{_TORCH_EXTRA} (or "jax-fusedloss[gpu]" on a CUDA GPU)')
    if not interpreter_enabled():
        raise NotImplementedError(
            'implementation="triton" needs a CUDA GPU, or Triton\'s interpreter on other '
            "machines: set TRITON_INTERPRET=1 in the environment before triton is imported "
            "(and install torch, which the interpreter uses for host buffers).")
    if not _triton_interprets():
        raise NotImplementedError(
            'implementation="triton" without a CUDA GPU runs Triton\'s interpreter, but '
            "TRITON_INTERPRET=1 was set after triton was imported in this process (triton "
            "decides at import): set it in the environment before anything imports triton "
            "(e.g. `TRITON_INTERPRET=1 python ...`, or first thing in conftest.py).")


def _triton_interprets() -> bool:
    """Whether triton, if imported, was imported in interpreter mode: its own jitted helpers
    (tl.sum) are InterpretedFunctions then, JITFunctions otherwise."""
    import sys

    if "triton.language" not in sys.modules:
        return True  # imported later, after the variable: fine
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sys.modules["triton.language"].sum, InterpretedFunction)


@functools.lru_cache(maxsize=1)
def _jax_triton():
    saved = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    except ModuleNotFoundError as e:
        if e.name != "jax_triton":
            raise
        raise MissingDependencyError(
            f'implementation="triton" on a CUDA GPU needs jax-triton: {_GPU_EXTRA}') from e
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved
    return jax_triton


# How a kernel launch reaches the GPU from XLA. jax-triton 0.3.1 lowers every call to jaxlib's
# legacy custom call "triton_kernel_call" (status-returning API, the compressed kernel proto as
# the backend_config string), which XLA executes outside its command buffers (CUDA graphs): a
# host-side cuLaunchKernel per launch. Newer jaxlibs register the same launcher as a typed-FFI
# handler, "triton_kernel_call_ffi" (the proto as the attribute `opaque`, decoded in the
# handler's initialize stage; Pallas's Triton calls use it), and XLA records those calls into
# its command buffers with its own kernels: on H100 a one-row logsumexp inside a jitted program
# went from 12.4 to 4.1 us of device time per call (benchmarks/NOTES.md). We lower our calls
# to the FFI handler where jaxlib has it; JFL_TRITON_CALL=legacy keeps jax-triton's own
# lowering (the A/B switch of benchmarks/fewrows.py).
FFI_TARGET = "triton_kernel_call_ffi"
LEGACY_TARGET = "triton_kernel_call"
FFI_MIN_JAXLIB = (0, 10, 3)


def call_target() -> str:
    """The custom-call target our jax-triton launches lower to in this process."""
    mode = os.environ.get("JFL_TRITON_CALL", "ffi")
    if mode not in ("ffi", "legacy"):
        raise ValueError(f"JFL_TRITON_CALL must be 'ffi' or 'legacy', got {mode!r}")
    import jaxlib

    version = tuple(int(p) for p in jaxlib.__version__.split(".")[:3] if p.isdigit())
    return FFI_TARGET if mode == "ffi" and version >= FFI_MIN_JAXLIB else LEGACY_TARGET


def call_kind() -> str:
    """"ffi" or "legacy": call_target() by the key of kernels.launch.AUTO_XLA_MAX_ROWS."""
    return "ffi" if call_target() == FFI_TARGET else "legacy"


# A register cap travels from `launch` to the lowering rule as a suffix of the custom-call
# target name ("triton_kernel_call_ffi#maxnreg=48"): jax-triton passes the name through to its
# lowering, where the kernel is compiled, and has no parameter for the cap itself.
MAXNREG_TAG = "#maxnreg="


def _split_tags(name: str) -> tuple[str, dict[str, str]]:
    """"target#maxnreg=48" -> ("target", {"maxnreg": "48"})."""
    base, *tags = name.split("#")
    return base, dict(t.split("=", 1) for t in tags)


def _capped_backend(init, maxnreg: int):
    """jax-triton's backend_init_func `init` with Triton's `maxnreg` compile option set."""
    def backend(device, compute_capability):
        b = init(device, compute_capability)
        parse = b.parse_options
        b.parse_options = lambda opts: parse(dict(opts, maxnreg=maxnreg))
        return b
    return backend


@functools.lru_cache(maxsize=1)
def _register_ffi_lowering() -> None:
    """Re-registers jax-triton's CUDA lowering so that a call whose custom_call_target_name is
    FFI_TARGET becomes a typed-FFI custom call (api_version 4, the same compressed proto as the
    attribute `opaque`), and a name carrying MAXNREG_TAG is compiled with that register cap
    (and lowered by its target with the tag removed); every other call (other users of
    jax-triton in the process) lowers exactly as jax-triton lowers it."""
    from jax.interpreters import mlir
    from jax._src.lib.mlir import ir

    triton_lib = _jax_triton().triton_lib  # through _jax_triton: it keeps TRITON_CACHE_DIR

    def rule(ctx, *args, **params):
        name, tags = _split_tags(params["custom_call_target_name"])
        init = triton_lib.get_cuda_backend
        if "maxnreg" in tags:
            init = _capped_backend(init, int(tags["maxnreg"]))
        params = dict(params, custom_call_target_name=name)
        legacy = functools.partial(triton_lib.triton_kernel_call_lowering, init)
        if "scratch" in tags:
            return _scratch_call(ctx, args, params, legacy, name)
        if name != FFI_TARGET:
            return legacy(ctx, *args, **params)
        # jax-triton compiles the kernel and emits its (legacy-API) call; we keep its proto,
        # emit the FFI call in its place and erase the legacy op (nothing uses its results).
        outs = legacy(ctx, *args, **params)
        op = outs[0].owner
        op = getattr(op, "operation", op)
        try:
            opaque = ir.StringAttr(op.attributes["backend_config"]).value_bytes
        except (KeyError, ValueError, TypeError):
            opaque = b""
        if not opaque:
            return outs  # a jax-triton that lowers to a typed-FFI call itself: keep its op
        ffi = jax.ffi.ffi_lowering(FFI_TARGET, api_version=4,
                                   operand_output_aliases=dict(params["input_output_aliases"]))
        new = ffi(ctx, *args, opaque=opaque)
        op.erase()
        return new

    mlir.register_lowering(triton_lib.triton_kernel_call_p, rule, platform="cuda")


# Triton kernels that build TMA descriptors on the device (tl.make_tensor_descriptor) write them
# to a global scratch buffer, a hidden pointer parameter Triton appends after the explicit ones
# (then one for profiling). jax-triton 0.3.1 passes no such buffer: jaxlib's launcher appends
# null pointers in both places. A launch with `scratch` > 0 gets one more output (its last,
# uint8 [programs * scratch]) and one more array parameter in the call's proto, after the
# kernel's own: that buffer lands in the global-scratch slot. The tag "#scratch=1" tells the
# lowering rule; jax-triton compiles the kernel without the extra output.
SCRATCH_TAG = "#scratch=1"
# An array parameter (TritonKernelCall.parameters = 5, Parameter.array = 1, Array.ptr_divisibility
# = 2 set to 16) inside TritonAnyKernelCall.kernel_call (field 1): protobuf merges a repeated
# embedded message into the first, so appending these bytes appends one parameter.
_ARRAY_PARAM = b"\x0a\x06\x2a\x04\x0a\x02\x10\x10"


def _scratch_call(ctx, args, params, legacy, name):
    """The call of a kernel with a global-scratch buffer (see SCRATCH_TAG)."""
    import zlib

    from jax._src.lib.mlir import ir

    outs = legacy(ctx.replace(avals_out=ctx.avals_out[:-1]), *args, **params)
    op = outs[0].owner
    op = getattr(op, "operation", op)
    proto = zlib.decompress(ir.StringAttr(op.attributes["backend_config"]).value_bytes)
    config = zlib.compress(proto + _ARRAY_PARAM)
    op.erase()
    aliases = dict(params["input_output_aliases"])
    if name == FFI_TARGET:
        return jax.ffi.ffi_lowering(FFI_TARGET, api_version=4,
                                    operand_output_aliases=aliases)(ctx, *args, opaque=config)
    return jax.ffi.ffi_lowering(LEGACY_TARGET, api_version=2, backend_config=config,
                                operand_output_aliases=aliases)(ctx, *args)


def _to_torch(a: np.ndarray):
    import torch

    a = np.array(a, copy=True)  # writable and contiguous
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _to_numpy(t) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


def _torch_dtype(dtype):
    import torch

    return {np.dtype(jnp.bfloat16): torch.bfloat16, np.dtype(np.float16): torch.float16,
            np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32,
            np.dtype(np.int64): torch.int64}[np.dtype(dtype)]


# In the interpreter, fresh output buffers are filled with this value (floats; integers get
# INT_POISON) instead of whatever memory held: a kernel that leaves an output element unwritten
# then shows as NaN in the results (tests/test_poisoned_outputs.py). None: torch.empty, as the
# GPU, whose fresh buffers hold stale data.
POISON: float | None = None
INT_POISON = -(1 << 30)


def _fresh(s):
    import torch

    t = torch.empty(s.shape, dtype=_torch_dtype(s.dtype))
    if POISON is not None:
        t.fill_(POISON if t.is_floating_point() else INT_POISON)
    return t


def _interpret(kernel, grid, inputs, scalars, out_shapes, constexprs, aliases):
    """The kernel through Triton's interpreter in a `buffer_callback`, which reads each
    device's buffers in place: `pure_callback` first puts its arguments on CPU device 0, and
    inside shard_map on 4 CPU devices the other devices' callbacks waited for those transfers
    while device 0 waited for them at the next psum (a deadlock from 128 KiB inputs on).
    Like jax-triton's call on the GPU, it has no batching rule: a launch under vmap fails
    here too (callers fold the batch into rows, `rowwise`, or map over it, `_sharding.
    _map_batched`), so the CPU suite catches a vmap that would fail on the GPU."""
    from jax.experimental.buffer_callback import buffer_callback

    def host(_ctx, outs, *arrays):
        with _INTERPRET_LOCK:
            ins = [_to_torch(np.asarray(a)) for a in arrays]
            results = [_fresh(s) for s in out_shapes]
            for i, o in aliases.items():  # written in place, as on the GPU: `ins` are copies
                results[o] = ins[i]
            kernel[grid](*ins, *scalars, *results, **constexprs)
            for out, result in zip(outs, results):
                np.asarray(out)[...] = _to_numpy(result)

    return tuple(buffer_callback(host, tuple(out_shapes), vmap_method=None)(*inputs))


def launch(kernel, *, grid: tuple[int, ...], inputs: Sequence[jax.Array],
           scalars: Sequence[Any] = (), out_shapes: Sequence[jax.ShapeDtypeStruct],
           num_warps: int = 4, num_stages: int = 3, constexprs: dict[str, Any] | None = None,
           input_output_aliases: dict[int, int] | None = None,
           maxnreg: int | None = None, partial_alias: bool = False,
           scratch: int = 0) -> tuple[jax.Array, ...]:
    """Launches `kernel(*inputs, *scalars, *outputs, **constexprs)` over `grid`.

    Float scalars travel as float32 and ints as int32/int64 by value. `input_output_aliases`
    maps an input index to an output index: on the GPU the output reuses the input's buffer
    (XLA copies it first if the input is still live); in the interpreter the kernel writes in
    place over the host copy of the input, so read-after-write hazards show there too.
    `maxnreg` caps the registers a thread on the GPU (plan.Launch.maxnreg; the interpreter
    has none). `partial_alias` (plan.Launch.partial_alias): the kernel writes only part of an
    aliased output, so on the GPU it takes the legacy custom call, which XLA's dynamic-slice
    fusion leaves whole. `scratch`: bytes of global scratch a program (Triton's
    metadata.global_scratch_size or more: device-side TMA descriptors), see SCRATCH_TAG.
    """
    check_triton_available()
    constexprs = dict(constexprs or {})
    aliases = dict(input_output_aliases or {})
    scalars = [np.float32(s) if isinstance(s, float) else s for s in scalars]
    if on_cuda_gpu():
        target = LEGACY_TARGET if partial_alias and aliases else call_target()
        _register_ffi_lowering()
        if maxnreg is not None:
            target = f"{target}{MAXNREG_TAG}{int(maxnreg)}"
        shapes = list(out_shapes)
        if scratch:
            target += SCRATCH_TAG
            shapes.append(jax.ShapeDtypeStruct((int(np.prod(grid)) * int(scratch),), jnp.uint8))
        outs = _jax_triton().triton_call(
            *inputs, *scalars, kernel=kernel, out_shape=shapes, grid=grid,
            num_warps=num_warps, num_stages=num_stages, input_output_aliases=aliases,
            custom_call_target_name=target, **constexprs)
        return tuple(outs)[:len(out_shapes)]
    return _interpret(kernel, grid, inputs, [float(s) if isinstance(s, np.floating) else s
                                             for s in scalars],
                      out_shapes, constexprs, aliases)


def run_plan(plan, results: Sequence[str] | None = None,
             **arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Executes a launch plan (jax_fusedloss/kernels/plan.py) over named arrays; returns the
    plan's results (or the named `results`). Buffers of dtype "logits" take the dtype of the
    first array."""
    env = dict(arrays)
    dtypes = {"float32": jnp.float32, "int32": jnp.int32,
              "logits": next(iter(arrays.values())).dtype}
    for step in plan.launches:
        inputs = [env[i] if isinstance(i, str) else jnp.zeros(i.shape, dtypes[i.dtype])
                  for i in step.inputs]
        outs = launch(step.kernel, grid=step.grid, inputs=inputs, scalars=step.scalars,
                      out_shapes=[jax.ShapeDtypeStruct(b.shape, dtypes[b.dtype])
                                  for b in step.outputs],
                      num_warps=step.num_warps, constexprs=step.constexprs,
                      input_output_aliases=dict(step.aliases), maxnreg=step.maxnreg,
                      partial_alias=step.partial_alias)
        env.update((b.name, o) for b, o in zip(step.outputs, outs))
    return tuple(env[name] for name in (plan.results if results is None else results))


def run_rows(make_plan: Callable[[int, int], Any], names: Sequence[str], *arrays: jax.Array,
             results: Sequence[str] | None = None) -> tuple[jax.Array, ...]:
    """run_plan(make_plan(n, vocab)) over arrays (bound to `names`) that all lead with the row
    axis, the first being `[n, vocab]`; vmappable (see rowwise), so the `results` asked for
    must lead with the row axis too (no placeholders)."""
    def body(*arrays):
        n, vocab = arrays[0].shape
        return run_plan(make_plan(n, vocab), results, **dict(zip(names, arrays)))

    return rowwise(body)(*arrays)


def rowwise(fn: Callable[..., tuple[jax.Array, ...]]) -> Callable[..., tuple[jax.Array, ...]]:
    """Makes `fn(*arrays)`, whose arrays and outputs all lead with one row axis, vmappable.

    jax-triton has no batching rule, so a vmapped call folds the batch axis into rows. A
    size-0 batch (or no rows) gives empty outputs without launching anything.
    """
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        one = [jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype)
               for a, b in zip(args, in_batched)]
        rows = one[0].shape[0]
        if axis_size * rows == 0:  # nothing to launch (a size-0 batch, or no rows)
            outs = jax.eval_shape(fn, *one)
            return (tuple(jnp.zeros((axis_size,) + o.shape, o.dtype) for o in outs),
                    tuple(True for _ in outs))
        flat = []
        for a, batched in zip(args, in_batched):
            if not batched:
                a = jnp.broadcast_to(a, (axis_size,) + a.shape)
            flat.append(a.reshape((axis_size * a.shape[1],) + a.shape[2:]))
        outs = wrapped(*flat)
        outs = tuple(o.reshape((axis_size, rows) + o.shape[1:]) for o in outs)
        return outs, tuple(True for _ in outs)

    return wrapped
