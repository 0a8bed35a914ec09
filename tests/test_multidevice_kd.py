"""linear_kd_loss / linear_distill_loss on a 4-device CPU mesh (tests/multidevice_kd_check.py,
in a subprocess: the device count is fixed when jax starts): tokens, vocabulary and both
sharded, Auto and Explicit axes, shard_map with vocab_axis; the tail forms' vocabulary-parallel
rows, the gradient-in-forward, recomputing and lean backwards; kd_loss / distill_loss's
vocabulary-parallel Triton rows inside shard_map (the interpreter on each device) against
float64 references."""
import os
import subprocess
import sys
from tests.multidevice_linear_check import layouts_per_case  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_four_cpu_devices_linear_kd(interpreter):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", JFL_CHECK_QUICK="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.multidevice_kd_check", "xla"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    assert proc.returncode == 0 and all(ln.startswith("OK") for ln in lines), out
    assert len(lines) == 4 * layouts_per_case(), out  # cases x layouts of the harness


def test_four_cpu_devices_vocab_parallel_triton_rows(interpreter):
    """kd_loss / distill_loss with the vocabulary split over 2 and 4 devices inside shard_map,
    implementation="triton": the slice statistics of kd_partial_kernel merged across devices,
    the slice gradients of kd_bwd_kernel (in the forward, rescaled, or recomputed for float16),
    against float64 references over reductions, temperatures, normalize, masks, repeated ids,
    ids and labels on both sides of the slice edges, ignore_index, the cross-entropy options
    and the power form (tests/multidevice_kd_check.py vp)."""
    from tests.multidevice_kd_check import vp_cases

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", JFL_CHECK_INTERPRET="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.multidevice_kd_check", "vp"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    assert proc.returncode == 0 and all(ln.startswith("OK") for ln in lines), out
    assert len(lines) == len(vp_cases()), out
