"""linear_kd_loss / linear_distill_loss on a 4-device CPU mesh (tests/multidevice_kd_check.py,
in a subprocess: the device count is fixed when jax starts): tokens, vocabulary and both
sharded, Auto and Explicit axes, shard_map with vocab_axis; the tail forms' vocabulary-parallel
rows, the gradient-in-forward, recomputing and lean backwards."""
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
