"""Every kernel compiles for sm_90 with the real Triton compiler (no GPU needed), and rows whose
start is not 16-byte aligned (V=50257, bf16 and fp32) load and store 16-byte vectors as
aligned rows do (tests/sm90_compile.py's vector check)."""
import os
import subprocess
import sys

from tests.helpers import compiler_env


def test_all_kernels_compile_for_sm90(tmp_path):
    env = compiler_env(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_compile.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
