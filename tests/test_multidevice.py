"""Every op on a 4-device CPU mesh (and on the GPUs present, when marked gpu): tokens,
vocabulary and both sharded, under jit (Auto and Explicit axes) and inside shard_map, against
the single-device result, with no logits-sized collective in the compiled HLO and the
gradient keeping the logits' sharding. The checks live in tests/multidevice_check.py and run
in a subprocess, because the device count is fixed when jax starts (and a broken collective
aborts the whole process)."""
import os
import subprocess
import sys

import pytest
from tests.multidevice_linear_check import layouts_per_case  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(impl: str, env_extra: dict, timeout: int, only: str = "") -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **env_extra)
    proc = subprocess.run([sys.executable, "-m", "tests.multidevice_check", impl]
                          + ([only] if only else []), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    assert proc.returncode == 0 and lines and all(ln.startswith("OK") for ln in lines), out
    return out


CPU4 = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}


def test_four_cpu_devices_xla(interpreter):
    out = _run("xla", CPU4, timeout=900)
    assert out.count("OK ") == 8 * 11, out  # 8 ops x (8 jit layouts + 3 shard_map layouts)


def test_four_cpu_devices_odd_cases(interpreter):
    """V=97 (no mesh axis divides it: the vocabulary axis is gathered, values stay exact) and a
    token shard whose labels are all ignored, for the ops with labels."""
    out = _run("xla", dict(CPU4, JFL_CHECK_ODD="1"), timeout=900,
               only="cross_entropy,token_logprobs,distill_loss")
    assert out.count("OK ") == 3 * 4, out  # Auto axes, jit only (shard_map needs even slices)


def test_four_cpu_devices_triton_interpreter(interpreter):
    """One op per kernel family (the interpreter costs about 1 ms per program and loop step);
    under jit over several CPU devices the XLA twin runs (see _sharding.py), inside shard_map
    the interpreted kernels run on each device."""
    out = _run("triton", dict(CPU4, JFL_CHECK_INTERPRET="1"), timeout=900,
               only="cross_entropy,token_logprobs,distill_loss")
    assert out.count("OK ") == 3 * 11, out


@pytest.mark.gpu
def test_gpus_compiled_kernels_large_vocab():
    """Compiled kernels at V=128256 bf16 on every GPU present (a 1 x n mesh)."""
    _run("triton", {"JFL_CHECK_BIG": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, 900)


def test_readme_multi_gpu_example(tmp_path, interpreter):
    """The README's Multi-GPU snippets run as written on 4 CPU devices."""
    import re

    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Multi-GPU"):text.index("## Performance")]
    code = "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))
    script = tmp_path / "readme_multi_gpu.py"
    script.write_text(code + "\nimport numpy as np\nassert np.isfinite(float(loss))\n")
    env = dict(os.environ, **CPU4, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_four_cpu_devices_linear_cross_entropy(interpreter):
    """linear_cross_entropy on 4 CPU devices (tests/multidevice_linear_check.py): tokens,
    vocabulary ("dv" and "vd" weights) and both sharded, FSDP (the weight sharded over the
    token axis on V or on D), Auto and Explicit axes, shard_map;
    the gradient-in-forward path, the recomputing backward and the lean vocabulary walk."""
    env = dict(os.environ, **CPU4, JFL_CHECK_QUICK="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.multidevice_linear_check", "xla",
                           "dv_bias_fused,vd_bias_recompute,vd_bias_lean"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    assert proc.returncode == 0 and all(ln.startswith("OK") for ln in lines), out
    assert len(lines) == 3 * layouts_per_case(), out  # cases x layouts of the harness




def test_linear_head_on_explicit_axes_without_set_mesh(interpreter):
    """jit of explicitly sharded arrays with no `jax.set_mesh` around it (the mesh known only
    from the arrays' types): linear_cross_entropy and its gradients with tokens and the
    vocabulary sharded equal one device's. (The partitioned body used to trace with the
    Explicit types and fail on a dynamic_update_slice of mixed shardings.)"""
    code = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jax_fusedloss as jfl
mesh = jax.make_mesh((2, 2), ("t", "v"), axis_types=(AxisType.Explicit,) * 2)
k = jax.random.split(jax.random.key(0), 3)
h = jax.random.normal(k[0], (32, 16))
w = jax.random.normal(k[1], (96, 16)) * 0.3
y = jax.random.randint(k[2], (32,), 0, 96)
f = jax.jit(jax.value_and_grad(lambda h, w, y: jfl.linear_cross_entropy(
    h, w, y, weight_layout="vd", mode="lean", chunk_size=8), (0, 1)))
one = f(h, w, y)
put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
got = f(put(h, P("t")), put(w, P("v")), put(y, P("t")))
for a, o in zip(jax.tree.leaves(got), jax.tree.leaves(one)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(o), rtol=1e-5, atol=1e-6)
print("OK")
"""
    env = dict(os.environ, **CPU4, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
