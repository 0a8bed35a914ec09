"""Every kernel compiles for sm_90 with the real Triton compiler (no GPU needed), and rows whose
start is not 16-byte aligned (V=50257, bf16 and fp32) load and store 16-byte vectors as
aligned rows do (tests/sm90_compile.py's vector check). One child process a kernel family
(tests/sm90_plans.py's FAMILIES), so pytest-xdist spreads them over its workers."""
import os
import subprocess
import sys

import pytest

from tests.helpers import compiler_env
from tests.sm90_plans import FAMILIES

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_compile.py")


def _run(arg: str, env: dict) -> None:
    proc = subprocess.run([sys.executable, SCRIPT, arg], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernels_compile_for_sm90(tmp_path, family):
    _run(family, compiler_env(TRITON_CACHE_DIR=str(tmp_path / "triton-cache")))


def test_families_compile_every_kernel_and_row_walker():
    """The families' compiles together: every kernel of the plans, every row walker of the
    vector check (in a child process: the kernels' parameters need the compiler's mode)."""
    _run("--check-families", compiler_env())
