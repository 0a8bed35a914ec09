"""Launches through our own typed-FFI handler for kernels that take a self-resetting counter.

Why: a one-launch split reduction merges each row's slice partials in the program that
arrives last on a per-row int32 counter. Through jaxlib's Triton call that counter is an XLA
buffer that must be zero-filled before every launch, a command-buffer node of its own (~1.5 us
on H100, more than the whole launch at one row; benchmarks/results/zeros_ab_h100.txt). The
handler in `_ffi/counter_call.cc` keeps one counter per call site and device in memory of its
own, zeroed once; the kernel leaves it at zero again (its last program stores 0), so no fill
is needed. Everything else is jaxlib's launch: the same PTX (made a cubin by Triton's ptxas,
`machine_code`), grid, parameters and trailing scratch pointers, taken from the call
jax-triton lowers (`decode_kernel_call`).

The handler is built on first use on a CUDA GPU with the host's C++ compiler against jaxlib's
FFI headers (`jax.ffi.include_dir()`), cached under $JFL_CACHE_DIR (default
~/.cache/jax_fusedloss). Where that cannot be done (no compiler, no CUDA driver library) a
warning says why once and launches keep the zero-filled counter; JFL_COUNTER_CALL=0 chooses
that path on purpose (the A/B switch of benchmarks/fewrows.py).

Imports jax only; nothing here runs at import.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np

TARGET = "jfl_counter_call"
SOURCE = Path(__file__).parent / "_ffi" / "counter_call.cc"
REVISION = 3  # JflCounterCallRevision() of the source

_site_ids = itertools.count(1)
_site_lock = threading.Lock()


def enabled() -> bool:
    """Whether launches with a counter may use the handler (JFL_COUNTER_CALL, default on)."""
    mode = os.environ.get("JFL_COUNTER_CALL", "1")
    if mode not in ("0", "1"):
        raise ValueError(f"JFL_COUNTER_CALL must be '0' or '1', got {mode!r}")
    return mode == "1"


def next_site() -> int:
    """A fresh call-site id: deterministic in the order of lowering, so identical programs
    lowered in the same order give identical HLO (persistent compilation caches still hit)."""
    with _site_lock:
        return next(_site_ids)


# ----------------------------------------------------------------------------- build + register
def cache_dir() -> Path:
    return Path(os.environ.get("JFL_CACHE_DIR", Path.home() / ".cache" / "jax_fusedloss"))


def compiler() -> str | None:
    """The C++ compiler: $CXX, else the first of c++, g++, clang++ on PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def build(include_dir: str | None = None, out_dir: Path | None = None) -> Path:
    """Compiles the handler (once per source, headers and compiler) and returns the library's
    path. Raises RuntimeError with the compiler's message when it cannot."""
    import jax

    include_dir = include_dir or jax.ffi.include_dir()
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
    api = Path(include_dir) / "xla" / "ffi" / "api"
    headers = b"".join((api / h).read_bytes() for h in ("c_api.h", "api.h", "ffi.h"))
    digest = hashlib.sha256(SOURCE.read_bytes() + headers + cxx.encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"counter_call-{digest}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_lib = Path(tmp) / lib.name
        cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-isystem", include_dir,
               str(SOURCE), "-o", str(tmp_lib), "-ldl"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{run.stderr[-2000:]}")
        os.replace(tmp_lib, lib)  # atomic: concurrent builders race harmlessly
    return lib


@functools.lru_cache(maxsize=1)
def _registered() -> str | None:
    """Builds, loads and registers the handler; None on success, else the reason it is off."""
    import ctypes

    import jax

    try:
        lib = ctypes.CDLL(str(build()))
        if lib.JflCounterCallRevision() != REVISION:
            return "the built library is of another revision"
        stages = {"initialize": jax.ffi.pycapsule(lib.JflCounterCallInitialize),
                  "execute": jax.ffi.pycapsule(lib.JflCounterCallExecute)}
        jax.ffi.register_ffi_target(TARGET, stages, platform="CUDA")
    except Exception as e:  # noqa: BLE001 - any failure means: launch the other way
        return f"{type(e).__name__}: {e}"
    return None


def available() -> bool:
    """Whether this process launches counter kernels through the handler (on a CUDA GPU)."""
    if not enabled():
        return False
    why = _registered()
    if why is not None:
        _warn_once(why)
    return why is None


@functools.lru_cache(maxsize=1)
def _warn_once(why: str) -> None:
    warnings.warn("jax_fusedloss: few-row reductions keep a zero-filled arrival counter (one "
                  f"more graph node per call) because the counter launcher is off: {why}",
                  RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------- jaxlib's proto
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """A protobuf message's (field number, wire type, value) in order; values are ints
    (varint, fixed32, fixed64 as raw unsigned) or bytes (length-delimited)."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i:i + size], i + size
        elif wire == 5:
            value, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((field, wire, value))
    return out


# Parameter oneof field -> handler kind (counter_call.cc): bool, i32, u32, i64, u64, f32, f64
_SCALAR_KINDS = {2: 8, 3: 3, 4: 6, 5: 4, 6: 7, 7: 5, 8: 9}
ARRAY = -1  # a buffer parameter, resolved by the caller


def decode_kernel_call(opaque: bytes) -> dict[str, Any]:
    """The launch in jax-triton's zlib-compressed `TritonAnyKernelCall` (jaxlib's
    gpu/triton.proto): kernel name, PTX, warps, shared memory, grid and the parameters in
    order as (kind, value) with kind ARRAY for buffers. Raises ValueError for what the handler
    does not launch: autotuned calls, clusters, outputs jaxlib would zero, Triton scratch."""
    top = _fields(zlib.decompress(opaque))
    calls = [v for f, w, v in top if f == 1 and w == 2]
    if len(calls) != 1:
        raise ValueError("not a single (non-autotuned) kernel call")
    call = {"grid": [1, 1, 1], "params": []}
    kernel = None
    for f, w, v in _fields(calls[0]):
        if f == 1:
            kernel = v
        elif f in (2, 3, 4):
            call["grid"][f - 2] = v
        elif f == 5:
            (pf, pw, pv), = _fields(v)
            if pf == 1:
                arr = dict((af, av) for af, _, av in _fields(pv))
                if arr.get(1, 0):
                    raise ValueError("the call zeroes an output (bytes_to_zero)")
                call["params"].append((ARRAY, 0))
            elif pf in _SCALAR_KINDS:
                kind = _SCALAR_KINDS[pf]
                if kind == 3:  # int32 varints of negative values are 64-bit sign-extended
                    pv = struct.unpack("<i", struct.pack("<I", pv & 0xFFFFFFFF))[0]
                elif kind == 4:
                    pv = struct.unpack("<q", struct.pack("<Q", pv))[0]
                elif kind in (7, 9):
                    pv = struct.unpack("<q", struct.pack("<Q", pv))[0]  # bits, as int64
                call["params"].append((kind, pv))
            else:
                raise ValueError(f"unsupported kernel parameter (field {pf})")
    if kernel is None:
        raise ValueError("the call has no kernel")
    k = {f: v for f, _, v in _fields(kernel)}
    if k.get(10, 1) != 1:
        raise ValueError("cluster launches (num_ctas > 1) are not supported")
    if any(f > 10 for f in k):
        raise ValueError("the kernel needs Triton scratch memory or other launch state")
    call.update(name=k[1].decode(), num_warps=k.get(2, 4), shared=k.get(3, 0),
                ptx=k[4].decode(), capability=k.get(6, 0))
    return call


_IMAGES: dict[tuple[str, int], bytes] = {}


def machine_code(ptx: str, capability: int, make_backend) -> bytes:
    """The cubin of `ptx` for `capability` from Triton's ptxas (what Triton builds for
    PyTorch; jaxlib compiles PTX with its own compiler too, never the driver), cached per
    process; the PTX itself where that fails, for the driver to compile. `make_backend()`
    gives Triton's CUDA backend, made only on a cache miss."""
    key = (ptx, capability)
    if key not in _IMAGES:
        try:
            backend = make_backend()
            _IMAGES[key] = bytes(backend.make_cubin(ptx, {}, backend.parse_options({}),
                                                    capability))
        except Exception as e:  # noqa: BLE001 - the driver can still compile the PTX
            warnings.warn(f"jax_fusedloss: Triton's ptxas failed ({type(e).__name__}: {e}); "
                          "the counter launcher hands the driver PTX instead", RuntimeWarning,
                          stacklevel=2)
            _IMAGES[key] = ptx.encode()
    return _IMAGES[key]


def handler_attributes(call: dict[str, Any], n_operands: int, counter: tuple[int, int],
                       counter_words: int) -> dict[str, Any]:
    """The handler's attributes for a decoded call (with its machine code as call["image"])
    whose buffers are jaxlib's (operands, then results), with operand counter[0] and its
    aliased result counter[1] replaced by the handler's counter: both leave the custom call,
    later operands and results shift down."""
    c_in, c_out = counter
    kinds, values, b = [], [], 0
    for kind, value in call["params"]:
        if kind == ARRAY:
            if b in (c_in, n_operands + c_out):
                kind, value = 2, 0
            elif b < n_operands:
                kind, value = 0, b - (b > c_in)
            else:
                r = b - n_operands
                kind, value = 1, r - (r > c_out)
            b += 1
        kinds.append(kind)
        values.append(value)
    gx, gy, gz = call["grid"]
    return dict(site=np.int64(next_site()), name=call["name"], image=call["image"],
                num_warps=np.int64(call["num_warps"]), shared=np.int64(call["shared"]),
                grid_x=np.int64(gx), grid_y=np.int64(gy), grid_z=np.int64(gz),
                counter_words=np.int64(counter_words),
                kinds=np.asarray(kinds, np.int64), values=np.asarray(values, np.int64))
