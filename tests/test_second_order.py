"""Second-order derivatives with default settings on a machine without a GPU (no
TRITON_INTERPRET): every op must raise the library's own NotImplementedError about
second-order derivatives, not the "triton" implementation's "needs a CUDA GPU" that the
dispatcher met while falling through after the XLA twin refused. Runs in a subprocess because
the interpreter mode of a process is fixed when triton is first imported."""
import subprocess
import sys

import pytest

from tests.helpers import compiler_env

SCRIPT = """
import sys
import jax, jax.numpy as jnp
import jax_fusedloss as jfl
x = jax.random.normal(jax.random.key(0), (2, 7))
y = jnp.array([1, 6])
ids, lp = jnp.array([[0, 3], [2, 5]]), jnp.log(jnp.full((2, 2), 0.5))
h = jax.random.normal(jax.random.key(1), (2, 3))
w = jax.random.normal(jax.random.key(2), (3, 7))
ops = {
    "cross_entropy": lambda x: jfl.cross_entropy(x, y),
    "kd_loss": lambda x: jfl.kd_loss(x, ids, lp),
    "distill_loss": lambda x: jfl.distill_loss(x, y, ids, lp, alpha=0.5),
    "logsumexp": lambda x: jfl.logsumexp(x).sum(),
    "entropy": lambda x: jfl.entropy(x).sum(),
    "token_logprobs": lambda x: jfl.token_logprobs(x, y).sum(),
    "linear_cross_entropy": lambda h: jfl.linear_cross_entropy(h, w, y),
}
for name in sys.argv[1:]:  # each op a fresh trace; the failure leaves no state behind
    arg = h if name == "linear_cross_entropy" else x
    try:
        jax.hessian(ops[name])(arg)
        print("CASE", name, "NO ERROR")
    except Exception as e:
        kind = "NotImplementedError" if isinstance(e, NotImplementedError) else type(e).__name__
        print("CASE", name, "RAISED", kind, str(e).splitlines()[0] if str(e) else "")
"""

OPS = ["cross_entropy", "kd_loss", "distill_loss", "logsumexp", "entropy", "token_logprobs"]


@pytest.fixture(scope="module")
def hessian_errors() -> dict:
    """{op: its CASE line} for every op, from one child process (one jax start, not one an
    op): the interpreter mode is what needs the child process, not each op."""
    ops = OPS + ["linear_cross_entropy"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *ops], capture_output=True, text=True,
                          env=compiler_env(JAX_PLATFORMS="cpu"), timeout=300)
    out = proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 0, out
    lines = [ln.split(" ", 2) for ln in proc.stdout.splitlines() if ln.startswith("CASE ")]
    return {op: rest for _, op, rest in lines}


def _check(op: str, errors: dict) -> None:
    out = errors.get(op, "no result")
    assert "RAISED NotImplementedError jax_fusedloss: second-order derivatives" in out, (
        f"{op}: jax.hessian without TRITON_INTERPRET should raise the library's second-order "
        f"error, got:\n{out}")


@pytest.mark.parametrize("op", OPS)
def test_hessian_without_interpreter_names_second_order(op, hessian_errors):
    _check(op, hessian_errors)


def test_linear_cross_entropy_hessian_without_interpreter_names_second_order(hessian_errors):
    _check("linear_cross_entropy", hessian_errors)
