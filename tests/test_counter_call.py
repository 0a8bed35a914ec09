"""The counter launcher (jax_fusedloss/_counter_call.py, _ffi/counter_call.cc): few-row split
reductions launched through our typed-FFI handler, which keeps each call site's arrival
counter in memory of its own instead of a buffer XLA zero-fills before every launch.

CPU: the handler builds against the installed jaxlib's FFI headers; jaxlib's kernel-call
proto decodes into the handler's parameter list (counter operand and result dropped, indices
shifted); calls the handler cannot launch are refused; Triton's ptxas makes the cubin; the
fallback warns. GPU: every call of a jitted program of many few-row calls (chained, in a scan,
vmapped, several call sites, 300 sites, T != 1) equals the zero-filled path bit for bit and
the float32 formulas, and the compiled program really launches through the handler without a
zero fill; rows sharded over several GPUs (needs 2)."""
from __future__ import annotations

import ctypes
import os
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedloss
from jax_fusedloss import _counter_call
from tests.helpers import assert_close, random_logits, to_numpy


# ----------------------------------------------------------------------------- build (CPU)
def test_handler_builds_against_jaxlib_headers(tmp_path):
    if _counter_call.compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    lib_path = _counter_call.build(out_dir=tmp_path)
    assert lib_path.exists() and lib_path.parent == tmp_path
    lib = ctypes.CDLL(str(lib_path))
    assert lib.JflCounterCallRevision() == _counter_call.REVISION
    for stage in ("JflCounterCallInitialize", "JflCounterCallExecute"):
        assert jax.ffi.pycapsule(getattr(lib, stage)) is not None
    assert _counter_call.build(out_dir=tmp_path) == lib_path  # cached, not rebuilt


def test_build_failure_names_the_compiler_error(tmp_path, monkeypatch):
    if _counter_call.compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(_counter_call, "SOURCE", bad)
    with pytest.raises(RuntimeError, match="bad.cc failed"):
        _counter_call.build(out_dir=tmp_path / "out")


def test_switch_is_validated(monkeypatch):
    monkeypatch.setenv("JFL_COUNTER_CALL", "yes")
    with pytest.raises(ValueError, match="JFL_COUNTER_CALL"):
        _counter_call.enabled()
    monkeypatch.setenv("JFL_COUNTER_CALL", "0")
    assert not _counter_call.available()


# ----------------------------------------------------------------------------- proto (CPU)
# A protobuf writer for jaxlib's gpu/triton.proto messages, independent of the reader.
def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        out += bytes([b | (0x80 if v else 0)])
        if not v:
            return out


def _field(number: int, value) -> bytes:
    if isinstance(value, bytes):
        return _varint(number << 3 | 2) + _varint(len(value)) + value
    if isinstance(value, tuple):  # ("fixed32", bits)
        return _varint(number << 3 | 5) + struct.pack("<I", value[1])
    return _varint(number << 3) + _varint(value)


def _call_proto(params, *, num_ctas=None, extra_kernel=b"", autotuned=False):
    kernel = (_field(1, b"red_fwd_kernel") + _field(2, 8) + _field(3, 1024)
              + _field(4, b".version 8.4\n// ptx") + _field(5, b"ttir") + _field(6, 90)
              + (_field(10, num_ctas) if num_ctas is not None else b"") + extra_kernel)
    call = _field(1, kernel) + _field(2, 3) + _field(3, 32) + _field(4, 1)
    for p in params:
        call += _field(5, p)
    any_call = _field(2 if autotuned else 1, call) + _field(3, b"meta") + _field(4, b"name")
    return zlib.compress(any_call)


ARRAY = _field(1, _field(2, 16))  # Array{bytes_to_zero=0, ptr_divisibility=16}


def test_decode_kernel_call_reads_jaxlib_proto():
    f32 = struct.unpack("<I", struct.pack("<f", 0.7))[0]
    params = [ARRAY, ARRAY, ARRAY, _field(3, -5), _field(5, 2**40), _field(7, ("fixed32", f32)),
              _field(4, 7), ARRAY, ARRAY, ARRAY]
    call = _counter_call.decode_kernel_call(_call_proto(params))
    assert call["name"] == "red_fwd_kernel" and call["num_warps"] == 8
    assert call["shared"] == 1024 and call["grid"] == [3, 32, 1]
    assert call["ptx"].startswith(".version 8.4") and call["capability"] == 90
    A = _counter_call.ARRAY
    assert call["params"] == [(A, 0), (A, 0), (A, 0), (3, -5), (4, 2**40), (5, f32), (6, 7),
                              (A, 0), (A, 0), (A, 0)]


def test_handler_attributes_drop_the_counter_and_shift_indices():
    A = _counter_call.ARRAY
    # buffers: operands x, y, sync_in (3), then results part, lse, sync (sync aliases sync_in)
    call = dict(name="k", image=b"cubin", num_warps=4, shared=0, grid=[2, 16, 1],
                params=[(A, 0), (A, 0), (A, 0), (3, 11), (5, 99), (A, 0), (A, 0), (A, 0)])
    attrs = _counter_call.handler_attributes(call, 3, (2, 2), counter_words=2)
    assert attrs["kinds"].tolist() == [0, 0, 2, 3, 5, 1, 1, 2]
    assert attrs["values"].tolist() == [0, 1, 0, 11, 99, 0, 1, 0]
    assert (attrs["grid_x"], attrs["grid_y"], attrs["grid_z"]) == (2, 16, 1)
    assert attrs["counter_words"] == 2
    # the counter in the middle: later operands and results move down by one
    attrs = _counter_call.handler_attributes(call, 3, (0, 0), counter_words=2)
    assert attrs["kinds"].tolist() == [2, 0, 0, 3, 5, 2, 1, 1]
    assert attrs["values"].tolist() == [0, 0, 1, 11, 99, 0, 0, 1]
    again = _counter_call.handler_attributes(call, 3, (0, 0), counter_words=2)
    assert again["site"] != attrs["site"]  # every lowering is its own call site


@pytest.mark.parametrize("case,match", [
    (dict(autotuned=True), "single"),
    (dict(num_ctas=2), "cluster"),
    (dict(extra_kernel=_field(11, 64)), "scratch"),
    (dict(params=[_field(1, _field(1, 64) + _field(2, 16))]), "zeroes"),
])
def test_decode_refuses_what_the_handler_cannot_launch(case, match):
    params = case.pop("params", [ARRAY])
    with pytest.raises(ValueError, match=match):
        _counter_call.decode_kernel_call(_call_proto(params, **case))


# ----------------------------------------------------------------------------- GPU
V = 128256


def _ref_lse(x):
    return jax.nn.logsumexp(x.astype(jnp.float64) if jax.config.jax_enable_x64
                            else x.astype(jnp.float32), axis=-1)


def _chain(calls):
    """A jitted program of `calls` chained few-row calls: call i reads x + i * 1e-3 * lse_{i-1}
    (so no two calls are the same and XLA may not merge them); returns every call's outputs."""
    def program(x, y):
        outs, prev = [], jnp.zeros((x.shape[0],), jnp.float32)
        for i in range(calls):
            xi = (x.astype(jnp.float32) + 1e-3 * prev[:, None]).astype(x.dtype)
            logp, ent = jax_fusedloss.token_logprobs(xi, y, return_entropy=True)
            lse = jax_fusedloss.logsumexp(xi)
            outs.append((lse, logp, ent))
            prev = lse
        return outs
    return program


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_program_of_many_calls_matches_zero_filled_path(rows, monkeypatch):
    x = random_logits(rows, (rows, V), "bfloat16")
    y = jnp.asarray(np.random.default_rng(rows).integers(0, V, rows), jnp.int32)
    program = _chain(16)
    monkeypatch.setenv("JFL_COUNTER_CALL", "1")
    text = _compiled(lambda a, b: program(a, b), x, y)
    assert f'custom_call_target="{_counter_call.TARGET}"' in text
    ours = jax.tree.map(np.asarray, jax.jit(lambda a, b: program(a, b))(x, y))
    again = jax.tree.map(np.asarray, jax.jit(lambda a, b: program(a, b))(x, y))
    monkeypatch.setenv("JFL_COUNTER_CALL", "0")
    text0 = _compiled(lambda a, b: program(a, b), x, y)
    assert _counter_call.TARGET not in text0
    filled = jax.tree.map(np.asarray, jax.jit(lambda a, b: program(a, b))(x, y))
    for a, b, c in zip(jax.tree.leaves(ours), jax.tree.leaves(again), jax.tree.leaves(filled)):
        np.testing.assert_array_equal(a, b)  # a second execution: counters were back at 0
        np.testing.assert_array_equal(a, c)
    lse0 = to_numpy(ours[0][0])
    assert_close(lse0, to_numpy(_ref_lse(x)), rtol=1e-5, what="first lse")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_temperature_and_entropy_through_the_launcher(dtype, monkeypatch):
    """A float scalar other than 1 (jax-triton folds 1.0 into the kernel, so inv_temp only
    reaches the handler's parameter list at T != 1), entropy and an odd vocabulary: the
    launcher's results equal the zero-filled path's bits and the float32 formulas."""
    vocab = 50257
    x = random_logits(5, (3, vocab), dtype)
    y = jnp.asarray([0, vocab - 1, 12345], jnp.int32)

    def program(a, b):
        return (jax_fusedloss.logsumexp(a, temperature=0.7),
                jax_fusedloss.entropy(a, temperature=0.7),
                jax_fusedloss.token_logprobs(a, b, temperature=0.7))

    outs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("JFL_COUNTER_CALL", mode)
        fn = jax.jit(lambda a, b: program(a, b))
        used = f'custom_call_target="{_counter_call.TARGET}"' in fn.lower(x, y).compile().as_text()
        assert used == (mode == "1")
        outs[mode] = [np.asarray(o) for o in fn(x, y)]
    for a, b in zip(outs["1"], outs["0"]):
        np.testing.assert_array_equal(a, b)
    z = x.astype(jnp.float32) / 0.7
    logp = jax.nn.log_softmax(z)
    ref = (jax.nn.logsumexp(z, axis=-1), -(jnp.exp(logp) * logp).sum(-1),
           jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0])
    for got, want, what in zip(outs["1"], ref, ("lse", "entropy", "logp")):
        assert_close(got, to_numpy(want), rtol=1e-4, atol=1e-4, what=what)


@pytest.mark.gpu
def test_more_sites_than_one_counter_slab():
    """300 call sites in one program (more counters than one 64 KiB slab of the handler holds):
    every call right, in two executions."""
    x = random_logits(77, (300, 2, 8192), "float32")

    def program(x):
        return jnp.stack([jax_fusedloss.logsumexp(x[i]) for i in range(x.shape[0])])

    fn = jax.jit(program)
    text = fn.lower(x).compile().as_text()
    assert text.count(f'custom_call_target="{_counter_call.TARGET}"') == 300
    ref = to_numpy(jax.nn.logsumexp(x, axis=-1))
    for _ in range(2):
        assert_close(to_numpy(fn(x)), ref, rtol=1e-6, what="lse of 300 sites")


@pytest.mark.gpu
def test_scan_vmap_and_repeated_sites():
    """A call site inside a scan runs once per iteration on one counter; vmapped calls fold
    into rows; a program calls two different sites on the same input."""
    x = random_logits(3, (5, 4, V), "bfloat16")

    def body(carry, xi):
        return carry + jax_fusedloss.logsumexp(xi).sum(), jax_fusedloss.logsumexp(xi)

    def program(x):
        total, per_step = jax.lax.scan(body, jnp.float32(0), x)
        vm = jax.vmap(jax_fusedloss.logsumexp)(x)
        twice = jax_fusedloss.logsumexp(x[0]) - jax_fusedloss.logsumexp(x[0] * 1)
        return total, per_step, vm, twice

    total, per_step, vm, twice = jax.block_until_ready(jax.jit(program)(x))
    ref = to_numpy(_ref_lse(x))
    assert_close(to_numpy(per_step), ref, rtol=1e-5, what="scan lse")
    assert_close(to_numpy(vm), ref, rtol=1e-5, what="vmapped lse")
    assert_close(float(total), float(ref.sum()), rtol=1e-5, what="scan carry")
    np.testing.assert_array_equal(to_numpy(twice), 0)
    for _ in range(3):  # executions of the same program keep agreeing
        np.testing.assert_array_equal(to_numpy(jax.jit(program)(x)[1]), to_numpy(per_step))


def test_build_cache_dir_is_honoured(tmp_path, monkeypatch):
    if _counter_call.compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    monkeypatch.setenv("JFL_CACHE_DIR", str(tmp_path))
    assert _counter_call.build().parent == tmp_path
    assert os.listdir(tmp_path)


@pytest.mark.gpu
def test_tokens_sharded_over_local_gpus():
    """Each GPU runs its own few rows through the launcher with a counter of its own (one per
    call site and CUDA context): rows sharded over every local GPU, Auto axes, equal to the
    float32 reference. Needs two or more GPUs."""
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 or more GPUs")
    mesh = jax.sharding.Mesh(np.array(devices), ("rows",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    x = random_logits(21, (4 * len(devices), V), "bfloat16")
    y = jnp.asarray(np.random.default_rng(21).integers(0, V, x.shape[0]), jnp.int32)
    xs, ys = jax.device_put(x, rows), jax.device_put(y, rows)

    def program(a, b):
        return jax_fusedloss.logsumexp(a), jax_fusedloss.token_logprobs(a, b)

    fn = jax.jit(program, out_shardings=(rows, rows))
    assert f'custom_call_target="{_counter_call.TARGET}"' in fn.lower(xs, ys).compile().as_text()
    for _ in range(3):  # every execution finds each GPU's counter back at zero
        lse, logp = fn(xs, ys)
        assert_close(to_numpy(lse), to_numpy(_ref_lse(x)), rtol=1e-5, what="sharded lse")
        ref_logp = jnp.take_along_axis(jax.nn.log_softmax(x.astype(jnp.float32)),
                                       y[:, None], axis=-1)[:, 0]
        assert_close(to_numpy(logp), to_numpy(ref_logp), rtol=1e-4, atol=1e-4,
                     what="sharded logp")


def test_unavailable_launcher_warns_once_and_falls_back(monkeypatch):
    """Where the handler cannot be built (no compiler, no driver library) a call keeps the
    zero-filled counter: available() is False and says why once, as a RuntimeWarning."""
    monkeypatch.setenv("JFL_COUNTER_CALL", "1")
    monkeypatch.setattr(_counter_call, "_registered", lambda: "no C++ compiler found")
    _counter_call._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="counter launcher is off: no C\\+\\+ compiler"):
        assert not _counter_call.available()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _counter_call.available()  # said once
    _counter_call._warn_once.cache_clear()


# A kernel with one pointer parameter that does nothing, in PTX for sm_90a.
_TINY_PTX = """.version 8.0
.target sm_90a
.address_size 64
.visible .entry jfl_tiny(.param .u64 jfl_tiny_param_0) { ret; }
"""


def _cuda_backend():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget("cuda", 90, 32))


def test_machine_code_is_tritons_cubin_and_falls_back_to_ptx():
    """The handler gets a cubin from Triton's ptxas (not PTX for the driver to compile, which a
    driver older than Triton's PTX would refuse); PTX ptxas rejects goes through as PTX, with
    a warning."""
    image = _counter_call.machine_code(_TINY_PTX, 90, _cuda_backend)
    assert image[:4] == b"\x7fELF"
    broken = _TINY_PTX.replace("ret;", "not_an_instruction;")
    with pytest.warns(RuntimeWarning, match="ptxas failed"):
        assert _counter_call.machine_code(broken, 90, _cuda_backend) == broken.encode()
