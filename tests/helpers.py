"""Shared test utilities: seeded inputs, per-dtype tolerances, informative comparisons."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_fusedloss._triton_jax import on_cuda_gpu

# The one environment probe (the library's, as in conftest.py): a CUDA GPU runs the compiled
# kernels, anything else Triton's interpreter; torch tensors of the torch_ref tests live on DEVICE.
HAS_GPU = on_cuda_gpu()
DEVICE = "cuda" if HAS_GPU else "cpu"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Values (losses, lse) are accumulated in float32 from the exact input values, so they are
# tight for every dtype; gradients are rounded to the logits' dtype once.
VALUE_RTOL = {"float32": 2e-5, "bfloat16": 2e-5, "float16": 2e-5}
GRAD_TOL = {"float32": 2e-5, "bfloat16": 1e-2, "float16": 2e-3}  # x max|grad| of the reference


def random_logits(seed: int, shape, dtype: str, scale: float = 2.0) -> jax.Array:
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale
    return x.astype(DTYPES[dtype])


def from_torch(t: torch.Tensor) -> jax.Array:
    """A JAX array viewing a torch tensor (dlpack), exported with the tensor's CUDA device as
    torch's current device: torch refuses to export a tensor of any other device ("Can't
    export tensors on a different CUDA device index", seen on a host with two GPUs in
    test_gpu_kd, whose tensors live on cuda:0)."""
    t = t.contiguous()
    if not t.is_cuda:
        return jnp.from_dlpack(t)
    with torch.cuda.device(t.device):
        return jnp.from_dlpack(t)


def to_torch(x: jax.Array, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A torch copy of `x` (as `dtype`). The copy runs on torch's stream, so it is finished
    before the dlpack view goes: once neither framework holds `x`'s memory, JAX's allocator
    hands it out again, and a copy still queued then reads whatever JAX writes there (on an
    H100 a reference built from `h[:256]` read another computation's data, and labels taken
    that way indexed out of bounds; the platform allocator, which synchronises on free, hid
    it)."""
    x = jnp.asarray(x)
    view = torch.from_dlpack(x)
    t = view.clone() if dtype is None else view.to(dtype, copy=True)
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
    del view
    return t


def to_numpy(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()
    return np.asarray(jnp.asarray(t).astype(jnp.float32) if jnp.asarray(t).dtype in
                      (jnp.bfloat16, jnp.float16) else t)


def assert_close(actual, expected, *, rtol: float = 0.0, atol: float = 0.0, what: str = "",
                 equal_nan: bool = False) -> None:
    """np.allclose with a message that says how many elements mismatch, where and by how much."""
    a = to_numpy(actual).astype(np.float64)
    e = to_numpy(expected).astype(np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    ok = np.isclose(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan)
    if not ok.all():
        bad = np.argwhere(~ok)
        first = tuple(bad[0])
        err = np.nanmax(np.abs(a - e))
        raise AssertionError(
            f"{what}: {len(bad)}/{a.size} elements differ (rtol={rtol}, atol={atol}); first at "
            f"{first}: {a[first]!r} vs {e[first]!r}; max abs error {err:.3g}")


def assert_grad_close(actual, expected, dtype: str, what: str = "grad") -> None:
    """Within GRAD_TOL of the reference, scaled by its largest entry; 1e-12 absolute at least:
    a float64 reference's own rounding where the exact gradient is 0 (a V=1 row's softmax
    gradient comes out about 3e-16 from a compiled float64 reference, 0 from the kernels)."""
    e = to_numpy(expected)
    scale = float(np.max(np.abs(e))) if e.size else 1.0
    assert_close(actual, e, atol=max(GRAD_TOL[dtype] * scale, 1e-12), rtol=GRAD_TOL[dtype],
                 what=what)


def check_transformations(f, *args) -> None:
    """f(*args[b]) for each b of the leading axis against vmap, jit(vmap(grad)), checkpoint and
    a lax.scan carrying value_and_grad; gradients are w.r.t. the first argument."""
    n = args[0].shape[0]
    direct = jnp.stack([jax.jit(f)(*(a[b] for a in args)) for b in range(n)])
    grads = jnp.stack([jax.jit(jax.grad(f))(*(a[b] for a in args)) for b in range(n)])
    assert_close(jax.vmap(f)(*args), direct, rtol=1e-6, what="vmap")
    assert_close(jax.jit(jax.vmap(jax.grad(f)))(*args), grads, rtol=1e-2, atol=1e-6,
                 what="vmap(grad)")
    assert_close(jax.jit(jax.grad(jax.checkpoint(f)))(*(a[0] for a in args)), grads[0],
                 rtol=1e-2, atol=1e-6, what="checkpoint")

    def step(carry, xs):
        val, g = jax.value_and_grad(f)(*xs)
        return carry + val, g

    total, scan_grads = jax.jit(lambda *a: jax.lax.scan(step, 0.0, a))(*args)
    assert_close(total, direct.sum(), rtol=1e-6, what="scan value")
    assert_close(scan_grads, grads, rtol=1e-2, atol=1e-6, what="scan grads")


def compiler_env(**extra: str) -> dict:
    """Environment for a child process that runs the real Triton compiler: no interpreter,
    fp fusion's default stated too (Triton 3.9 warns otherwise; our launches also pass
    enable_fp_fusion=True), the repository importable."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def interpret_on_4_cpu_devices(code: str, timeout: int) -> str:
    """Runs `python -c code` in a child process that sees 4 CPU devices (the count is fixed
    when jax starts) with Triton's interpreter, the repository importable; asserts that it
    exits 0 and prints OK, and returns its stdout."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               TRITON_INTERPRET="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def force_path(name: str, monkeypatch) -> str:
    """Forces the launch heuristic onto the fused row path ("rows": 1 SM, so every batch has
    enough rows) or the two-level split path ("split": 64 SMs, so small batches split)."""
    from jax_fusedloss import _triton_jax
    import torch_ref._launch

    sms = 1 if name == "rows" else 64
    monkeypatch.setattr(_triton_jax, "num_sms", lambda: sms)
    monkeypatch.setattr(torch_ref._launch, "num_sms", lambda t: sms)
    return name
