"""GPU only: how our kernels reach the GPU from XLA. By default a launch lowers to jaxlib's
typed-FFI Triton call (`_triton_jax.FFI_TARGET`); JFL_TRITON_CALL=legacy gives jax-triton's
legacy custom call. Both must give bit-identical results (same kernel, same proto), including
the calls whose output aliases an input (the split passes' arrival counters), and a
jax-triton call that is not ours must keep jax-triton's own lowering. A plan's register cap
(plan.Launch.maxnreg) must reach the GPU through either call and through torch_ref."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_fusedloss  # noqa: E402
from jax_fusedloss import _triton_jax  # noqa: E402

pytestmark = pytest.mark.gpu


def _targets(compiled_text: str) -> set[str]:
    found = set()
    for target in (_triton_jax.FFI_TARGET, _triton_jax.LEGACY_TARGET):
        if f'custom_call_target="{target}"' in compiled_text:
            found.add(target)
    return found


def _run(monkeypatch, mode: str, fn, *args):
    """jit(fn) traced afresh under JFL_TRITON_CALL=mode: (outputs, custom-call targets)."""
    monkeypatch.setenv("JFL_TRITON_CALL", mode)
    jitted = jax.jit(lambda *a: fn(*a))  # a new function: no trace cached from the other mode
    text = jitted.lower(*args).compile().as_text()
    return jax.tree.map(np.asarray, jitted(*args)), _targets(text)


def _ce_value_and_grad(x, y):
    return jax.value_and_grad(
        lambda x: jax_fusedloss.cross_entropy(x, y, implementation="triton"))(x)


def _reductions(x, y):
    return (jax_fusedloss.logsumexp(x, implementation="triton"),
            jax_fusedloss.token_logprobs(x, y, return_entropy=True, implementation="triton"))


@pytest.mark.parametrize("fn,n,vocab,dtype", [
    (_ce_value_and_grad, 512, 32000, jnp.bfloat16),   # one program per row, fused grad
    (_ce_value_and_grad, 264, 114689, jnp.float32),   # split fwd + grad (aliased counter)
    (_ce_value_and_grad, 264, 229384, jnp.bfloat16),  # the same keeping a tile, reg cap
    (_ce_value_and_grad, 4, 50257, jnp.bfloat16),     # few rows: partials + merge
    (_reductions, 8, 128256, jnp.bfloat16),           # split reductions, one launch (counter)
    (_reductions, 300, 50257, jnp.float16),
], ids=lambda p: getattr(p, "__name__", str(p)))
def test_ffi_and_legacy_calls_agree_bitwise(monkeypatch, fn, n, vocab, dtype):
    """jaxlib's typed-FFI Triton call gives the legacy call's bits."""
    if _triton_jax.call_target() != _triton_jax.FFI_TARGET:
        pytest.skip("this jaxlib has no typed-FFI Triton call")
    keys = jax.random.split(jax.random.key(n + vocab), 2)
    x = (jax.random.normal(keys[0], (n, vocab), jnp.float32) * 3).astype(dtype)
    y = jax.random.randint(keys[1], (n,), 0, vocab)
    out_ffi, targets_ffi = _run(monkeypatch, "ffi", fn, x, y)
    out_legacy, targets_legacy = _run(monkeypatch, "legacy", fn, x, y)
    # a gradient's in-place scaling (plan.Launch.partial_alias) takes the legacy call in
    # either mode
    assert _triton_jax.FFI_TARGET in targets_ffi
    assert targets_legacy == {_triton_jax.LEGACY_TARGET}
    for a, b in zip(jax.tree.leaves(out_ffi), jax.tree.leaves(out_legacy)):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.atleast_1d(a), np.atleast_1d(b)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        assert np.isfinite(a.astype(np.float32)).all()


def test_other_jax_triton_calls_keep_their_lowering():
    """Our lowering rule replaces jax-triton's for every call in the process; calls that do not
    ask for the FFI target must come out exactly as jax-triton makes them."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs) + 1.0)

    jax_fusedloss.logsumexp(jnp.ones((2, 64)), implementation="triton")  # registers our rule
    jax_triton = _triton_jax._jax_triton()  # importing it directly would blank TRITON_CACHE_DIR
    x = jnp.arange(128, dtype=jnp.float32)
    f = jax.jit(lambda x: jax_triton.triton_call(
        x, kernel=add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
        BLOCK=128))
    assert _targets(f.lower(x).compile().as_text()) == {_triton_jax.LEGACY_TARGET}
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x) + 1)


def test_launching_keeps_triton_cache_dir(tmp_path):
    """jax-triton blanks TRITON_CACHE_DIR when first imported; every path of ours that imports
    it (the first launch, the FFI lowering's registration) must leave the variable as it was,
    or torch's Triton kernels in the same process fail to find their cache. In a fresh
    process: here jax-triton is imported already."""
    import subprocess
    import sys

    code = ("import os, jax, jax.numpy as jnp, jax_fusedloss as j; "
            "jax.jit(lambda a: j.logsumexp(a, implementation='triton'))(jnp.ones((3, 100))); "
            "print('CACHE=' + repr(os.environ.get('TRITON_CACHE_DIR')))")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert f"CACHE={str(tmp_path)!r}" in out, out


def _kernel_registers(run) -> list[tuple[str, int]]:
    """(kernel name, registers a thread) of every kernel launched by `run()`: CUPTI's launch
    records through torch's profiler's Chrome trace (it sees JAX's kernels too)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [(e["name"], e.get("args", {}).get("registers per thread"))
            for e in events if e.get("cat") == "kernel"]


@pytest.mark.parametrize("mode", ["ffi", "legacy"])
def test_register_cap_reaches_the_gpu(monkeypatch, mode):
    """The split forward + gradient keeping a tile of 16-bit rows is capped at
    launch.SPLIT_FUSED_KEPT's registers a thread (jaxlib's own compile of the PTX took 60
    uncapped, Triton's ptxas 48): CUPTI's launch records of the JAX call (FFI and legacy) and
    of torch_ref's show at most the cap."""
    import torch

    import torch_ref
    from jax_fusedloss.kernels import launch
    from tests.helpers import to_torch

    if mode == "ffi" and _triton_jax.call_target() != _triton_jax.FFI_TARGET:
        pytest.skip("this jaxlib has no typed-FFI Triton call")
    n, vocab = launch.PROGRAMS_PER_SM * _triton_jax.num_sms(), 229384  # aligned rows
    cfg = launch.split_fused_config(n, vocab, 2, _triton_jax.num_sms())
    assert cfg is not None and cfg.keep == 1 and cfg.maxnreg is not None
    x = jax.random.normal(jax.random.key(3), (n, vocab), jnp.bfloat16)
    y = jax.random.randint(jax.random.key(4), (n,), 0, vocab)
    monkeypatch.setenv("JFL_TRITON_CALL", mode)
    f = jax.jit(lambda x: _ce_value_and_grad(x, y))
    jax.block_until_ready(f(x))
    xt = to_torch(x).requires_grad_(True)
    yt = to_torch(y, torch.long)

    def run():
        jax.block_until_ready(f(x))
        torch_ref.cross_entropy(xt, yt).backward()
        torch.cuda.synchronize()

    regs = [regs for name, regs in _kernel_registers(run)
            if name.startswith("ce_split_fused_kernel")]
    assert len(regs) == 2, regs
    assert all(r <= cfg.maxnreg for r in regs), (regs, cfg.maxnreg)


def test_in_place_launches_inside_a_loop():
    """XLA's dynamic-slice fusion hands a typed-FFI call slices of a loop's buffers: an output
    written into the loop's stacked result gets that slice, apart from the input it aliases.
    The launches that write only part of an aliased output (plan.Launch.partial_alias: the
    gradient's in-place scaling, which skips rows whose cotangent is 1; the KD id columns over
    the dense gradient) must still be right there: per-chunk gradients of cross_entropy and
    kd_loss inside lax.map equal the whole batch's. (jax 0.11.2 did not fuse this program's
    slices, so it passed with those launches on the FFI call too; the hidden-state walks,
    which it did fuse, are guarded by tests/test_linear_kd.py's real-size test.)"""
    chunks, n, vocab, k = 4, 256, 32000, 8
    keys = jax.random.split(jax.random.key(7), 3)
    x = (jax.random.normal(keys[0], (chunks, n, vocab)) * 2).astype(jnp.bfloat16)
    y = jax.random.randint(keys[1], (chunks, n), 0, vocab)
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(jax.random.normal(keys[2], (chunks, n, vocab))),
                            k)

    def grads(x, y, ids, lp):  # cotangent 1 for every row: the scaling skips them all
        return jax.grad(lambda x: jax_fusedloss.cross_entropy(
            x, y, reduction="sum", implementation="triton") + jax_fusedloss.kd_loss(
            x, ids, lp, reduction="sum", implementation="triton"))(x)

    looped = jax.jit(lambda *a: jax.lax.map(lambda c: grads(*c), a))(x, y, ids, lp)
    whole = jax.jit(lambda x, y, ids, lp: grads(
        x.reshape(-1, vocab), y.reshape(-1), ids.reshape(-1, k), lp.reshape(-1, k)))(
        x, y, ids, lp)
    looped = np.asarray(looped, np.float32).reshape(-1, vocab)
    whole = np.asarray(whole, np.float32)  # the plans for 256 and 1024 rows may differ
    np.testing.assert_allclose(looped, whole, rtol=1e-2, atol=1e-2 * np.abs(whole).max())


@pytest.mark.parametrize("chunk_size", [3, 5, 64])
def test_walks_with_odd_chunks(chunk_size):
    """The hidden-state walks with chunk sizes that put a chunk's rows at offsets that are not
    16-byte multiples (jax-triton declares every array pointer 16-byte aligned; a fused slice
    is an interior pointer): the Triton row functions agree with the XLA ones."""
    n, d, vocab = 67, 64, 1000
    keys = jax.random.split(jax.random.key(9), 3)
    h = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (d, vocab)) * 0.3).astype(jnp.bfloat16)
    y = jax.random.randint(keys[2], (n,), 0, vocab)
    cot = jnp.linspace(-1.0, 1.0, n)

    def run(impl, mode):
        def f(h, w):
            ce = jax_fusedloss.linear_cross_entropy(h, w, y, mode=mode, chunk_size=chunk_size,
                                                    implementation=impl)
            logp, ent = jax_fusedloss.linear_token_logprobs(
                h, w, y, return_entropy=True, mode=mode, chunk_size=chunk_size,
                implementation=impl)
            return ce + jnp.sum(logp * cot) + jnp.sum(ent * cot[::-1])
        return jax.jit(jax.value_and_grad(f, (0, 1)))(h, w)

    for mode in ("fast", "lean"):
        got, want = run("triton", mode), run("xla", mode)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * float(np.abs(b).max()),
                                       err_msg=f"{mode} chunk {chunk_size}")
