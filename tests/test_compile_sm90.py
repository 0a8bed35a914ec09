"""Every kernel compiles for sm_90 with the real Triton compiler (no GPU needed), and rows whose
start is not 16-byte aligned (V=50257, bf16 and fp32) load and store 16-byte vectors as
aligned rows do (tests/sm90_compile.py's vector check). One child process a kernel family
(tests/sm90_plans.py's FAMILIES), so pytest-xdist spreads them over its workers."""
import os
import subprocess
import sys

import pytest

from tests.helpers import compiler_env
from tests.sm90_plans import FAMILIES, launches, specs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernels_compile_for_sm90(tmp_path, family):
    env = compiler_env(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_compile.py")
    proc = subprocess.run([sys.executable, script, family], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_compiles_cover_every_kernel_and_row_walker():
    """The families' compiles together: every kernel of the plans and every row walker of the
    vector check (each family's run checks only the walkers it compiles)."""
    from tests.sm90_compile import ROW_WALKERS

    planned = {kernel.__name__ for kernel, *_ in launches()}
    compiled = {kernel.__name__ for kernel, *_ in specs()}
    assert planned == compiled
    assert set(ROW_WALKERS) <= compiled, set(ROW_WALKERS) - compiled
