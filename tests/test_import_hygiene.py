"""`import jax_fusedloss` works without a GPU and leaves Triton usable in the same process."""
import subprocess
import sys
import textwrap

from tests.helpers import compiler_env

SCRIPT = textwrap.dedent("""
    import os
    os.environ["TRITON_CACHE_DIR"] = os.environ["CHECK_CACHE_DIR"]
    import jax, jax.numpy as jnp
    import jax_fusedloss
    from jax_fusedloss import _triton_jax
    loss = jax_fusedloss.cross_entropy(jnp.zeros((2, 8)), jnp.zeros((2,), jnp.int32))
    assert abs(float(loss) - float(jnp.log(8.0))) < 1e-6, loss
    try:  # jax-triton 0.3.1 blanks TRITON_CACHE_DIR on import, then fails without a GPU
        _triton_jax._jax_triton()
    except ImportError:
        pass
    assert os.environ["TRITON_CACHE_DIR"] == os.environ["CHECK_CACHE_DIR"], "cache dir lost"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from jax_fusedloss.kernels.cross_entropy import scale_rows_kernel
    sig = dict(grad_in_ptr="*bf16", cot_ptr="*fp32", V="i32", grad_out_ptr="*bf16",
               BLOCK_V="constexpr", ALIGN="constexpr")
    triton.compile(ASTSource(scale_rows_kernel, sig, dict(BLOCK_V=1024, ALIGN=16)),
                   target=GPUTarget("cuda", 90, 32))
    print("ok")
""")


def test_import_keeps_triton_usable(tmp_path):
    env = compiler_env(CHECK_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


TORCH_WITHOUT_JAX = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.modules["jax"] = None  # any `import jax` now raises ImportError
    import torch
    import torch_ref
    x = torch.randn(4, 37, requires_grad=True)
    y = torch.tensor([0, 5, -100, 36])
    loss = torch_ref.cross_entropy(x, y)
    loss.backward()
    ref = torch.nn.functional.cross_entropy(x.detach(), y, ignore_index=-100)
    assert abs(float(loss) - float(ref)) < 1e-5, (float(loss), float(ref))
    assert not any(m == "jax" or m.startswith("jax.") for m in sys.modules
                   if sys.modules[m] is not None), "jax was imported"
    print("ok")
""")


def test_torch_frontend_without_jax():
    """torch_ref and the kernels need neither JAX nor jax_fusedloss's JAX modules."""
    env = compiler_env()
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", TORCH_WITHOUT_JAX], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


def test_cuda_without_jax_triton_falls_back_to_xla(monkeypatch):
    """implementation=None on a CUDA machine without jax-triton runs the XLA twin; a forced
    "triton" names the extra to install (simulated: the probe says CUDA, jax_triton absent)."""
    import jax.numpy as jnp
    import pytest

    import jax_fusedloss
    from jax_fusedloss import _common, _triton_jax

    real = _triton_jax._installed
    monkeypatch.setattr(_triton_jax, "on_cuda_gpu", lambda: True)
    monkeypatch.setattr(_triton_jax, "_installed", lambda m: m != "jax_triton" and real(m))
    assert _common.default_implementation() == "triton"
    x, y = jnp.zeros((2, 8)), jnp.zeros((2,), jnp.int32)
    loss = jax_fusedloss.cross_entropy(x, y)  # falls through to "xla"
    assert abs(float(loss) - float(jnp.log(8.0))) < 1e-6
    with pytest.raises(ImportError, match=r"jax-fusedloss\[gpu\]"):
        jax_fusedloss.cross_entropy(x, y, implementation="triton")


def test_validation_needs_no_framework():
    """jax_fusedloss._validate, the checks both frontends share, imports neither JAX nor
    torch."""
    script = textwrap.dedent("""
        import sys
        sys.modules["jax"] = sys.modules["torch"] = None  # importing either now raises
        from jax_fusedloss import _validate
        assert _validate.check_float(0.5, "x", lo=0.0, hi=1.0) == 0.5
        try:
            _validate.check_int(2**31, "ignore_index")
            raise SystemExit("2**31 was accepted")
        except ValueError as e:
            assert "ignore_index=2147483648" in str(e), e
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=compiler_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
